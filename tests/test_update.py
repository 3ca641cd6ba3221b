"""grpo.update beyond the loss: the sampler-vs-trainer gap it logs, and the padding micro-batches
that keep FSDP2's call counts equal across ranks."""
import math
import os
import subprocess
import sys

import pytest
import torch

import grpo
from grpo import pack, token_logprobs
from harness import parallel
from rollout import generate
from tests import tiny
from test_grpo import Capture

CFG = dict(agg="token-mean", reward="rlcm", max_new_tokens=12, temperature=0.8, chunk_size=16,
           clip_low=0.2, clip_high=0.2, grad_clip=1e9)
CPU = torch.device("cpu")


def run_update(lm, batch, mbs, adv=None):
    policy = lm
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    adv = torch.linspace(-1, 1, len(batch["input_ids"])) if adv is None else adv
    return grpo.update(policy, opt, batch, None, adv, mbs, CFG, CPU)


def test_the_sampler_is_the_policy_so_the_gap_is_zero():
    """generate -> pack -> update with the fp32 policy as its own sampler (the CPU toy): the sampler's
    log-probs sit on the loss-mask positions of the trainer's, so the gap is float noise. Moved by
    one position, the same numbers are far off (the classic off-by-one)."""
    tok = tiny.tokenizer()
    lm = tiny.model(vocab_size=len(tok), seed=3)  # the sampler's ids are then the trainer's vocabulary
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("1+2=", "what is 17*3?", "x")]
    kw = dict(n=2, max_new_tokens=CFG["max_new_tokens"], temperature=CFG["temperature"], top_p=0.9, seed=0)
    eos = generate(lm, tok, prompts, eos_ids=[], **kw).ids[0][3]
    out = generate(lm, tok, prompts, eos_ids=[eos], scores=True, **kw)
    assert min(out.lengths) < max(out.lengths)
    batch = pack([prompts[i] for i in out.prompt_index], out.ids, tok.pad_token_id, out.logprobs)
    mbs = [[0, 1], [2], [3, 4, 5]]
    shifted = dict(batch, sampler_logp=batch["sampler_logp"].roll(1, dims=1))
    stats = run_update(lm, batch, mbs)
    print(f"\nsampler gap on the fp32 toy: {stats['sampler_gap']:.2e}, k3 {stats['sampler_kl_k3']:.2e}, "
          f"ratio max - 1 {stats['sampler_ratio_max'] - 1:.2e}")
    assert stats["sampler_gap"] < 1e-5 and stats["sampler_kl_k3"] < 1e-8
    assert abs(stats["sampler_ratio_max"] - 1) < 1e-4
    assert run_update(tiny.model(vocab_size=len(tok), seed=3), shifted, mbs)["sampler_gap"] > 0.1


def test_a_known_shift_gives_its_gap_k3_and_ratio():
    """Sampler log-probs = the trainer's minus delta_i on every token of sequence i (one micro-batch
    each): gap = sum_i n_i |delta_i| / N, k3 = sum_i n_i (e^delta_i - 1 - delta_i) / N,
    ratio_max = max_i e^(n_i delta_i)."""
    g = torch.Generator().manual_seed(0)
    lm = tiny.model(vocab_size=64, seed=4)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (4, 2, 5)]
    deltas = [0.1, -0.3, 0.05]
    batch = pack(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(lm, batch["input_ids"], batch["attention_mask"], CFG["temperature"])
    sampler = [(logp[i][batch["loss_mask"][i] > 0] - d).tolist() for i, d in enumerate(deltas)]
    batch = pack(prompts, responses, 0, sampler)
    stats = run_update(lm, batch, [[0], [1], [2]])
    n = [len(r) for r in responses]
    gap = sum(k * abs(d) for k, d in zip(n, deltas)) / sum(n)
    k3 = sum(k * (math.exp(d) - 1 - d) for k, d in zip(n, deltas)) / sum(n)
    ratio = max(math.exp(k * d) for k, d in zip(n, deltas))
    assert stats["sampler_gap"] == pytest.approx(gap, abs=1e-6)
    assert stats["sampler_kl_k3"] == pytest.approx(k3, rel=1e-4)
    assert stats["sampler_ratio_max"] == pytest.approx(ratio, rel=1e-5)


def test_pack_puts_each_sampler_log_prob_on_its_target():
    b = pack([[5, 6], [7]], [[8, 9, 10], [11]], pad_id=0, logprobs=[[-1.0, -2.0, -3.0], [-4.0]])
    # targets input_ids[:, 1:] = (6, 8, 9, 10) and (11, pad, pad, pad)
    assert b["sampler_logp"].tolist() == [[0.0, -1.0, -2.0, -3.0], [-4.0, 0.0, 0.0, 0.0]]
    assert (b["loss_mask"] > 0).tolist() == (b["sampler_logp"] != 0).tolist()


def test_a_padding_micro_batch_forwards_two_tokens_and_adds_no_gradient(monkeypatch):
    """Another rank has two more micro-batches: this one runs two padding micro-batches, one row of
    2 tokens each, at weight 0; its parameters move exactly as without them."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 3, 4)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (9, 5, 7)]
    batch = pack(prompts, responses, pad_id=0)
    mbs = [[0], [1, 2]]
    moved = []
    for extra in (0, 2):
        monkeypatch.setattr(parallel, "all_gather", lambda n, extra=extra: [n, n + extra])
        lm = tiny.model(vocab_size=64, seed=5)
        shapes = []
        lm.model.register_forward_pre_hook(lambda mod, args, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                     with_kwargs=True)
        opt = torch.optim.SGD(lm.parameters(), lr=0.1)  # parallel.padded: FSDP2's padding
        policy = parallel.LogprobModel(lm, token_logprobs)  # FSDP2's policy, here unsharded
        grpo.update(policy, opt, batch, None, torch.linspace(-1, 1, 3), mbs, CFG, CPU)
        assert shapes == [(1, 15), (2, 11)] + [(1, 2)] * extra
        moved.append(torch.cat([p.detach().flatten() for p in lm.parameters()]))
    init = torch.cat([p.detach().flatten() for p in tiny.model(vocab_size=64, seed=5).parameters()])
    assert not torch.equal(moved[0], init)  # the update did move them
    assert torch.equal(moved[0], moved[1])


@pytest.mark.slow   # torchrun, two processes
def test_fsdp2_ranks_with_padding_micro_batches_equal_one_process(tmp_path):
    """Two gloo ranks with one and three micro-batches (rank 0 pads with two 2-token ones): the same
    weights and the same sampler gap, k3 and largest ratio as one process over the whole batch."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here]), "OMP_NUM_THREADS": "1"}
    script = os.path.join(here, "fsdp_padding.py")
    out = {}
    for world in (1, 2):
        path = str(tmp_path / f"w{world}.pt")
        cmd = [sys.executable, script, path] if world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, path]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        out[world] = torch.load(path, weights_only=True)
    one, two = out[1], out[2]
    assert two["shapes"] == [(1, 9), (1, 2), (1, 2)]
    init = tiny.model(vocab_size=64, hidden=32, layers=2, seed=0).state_dict()
    assert max((one["state"][k] - init[k]).abs().max().item() for k in init) > 1e-4  # the step moved them
    for k in one["state"]:
        assert torch.allclose(one["state"][k], two["state"][k], atol=1e-5), k
    n, deltas = [6, 2, 7, 3], [0.1, -0.2, 0.05, 0.3]
    gap = sum(k * abs(d) for k, d in zip(n, deltas)) / sum(n)
    assert two["stats"]["sampler_gap"] == pytest.approx(gap, abs=1e-6)
    for key in ("sampler_gap", "sampler_kl_k3", "sampler_ratio_max", "loss"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    # the largest ratio is rank 1's (e^0.9), so rank 0 must have gathered it
    ratio = max(math.exp(k * d) for k, d in zip(n, deltas))
    assert two["stats"]["sampler_ratio_max"] == pytest.approx(ratio, rel=1e-5)


def test_an_extra_loss_term_is_a_mean_over_sequences_however_the_batch_is_cut():
    """update knows no reward mode: a mode's extra term (name, coef, term) is added as coef times the
    mean over the batch's sequences of term(logp, loss_mask, rows), and that mean is logged as
    `name`. Here term = a sequence's summed response log-prob, with zero advantages so it is the
    whole loss: the gradient over micro-batches [0, 1], [2] equals that of 0.5 * mean_n term_n on the
    whole batch at once."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (5, 2, 4)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 7, 4)]
    batch = pack(prompts, responses, pad_id=0)
    seen = []

    def term(logp, mask, rows):
        seen.append(list(rows))
        return (logp * mask).sum(-1)

    policy = tiny.model(vocab_size=64, seed=4)
    cfg = {k: v for k, v in CFG.items() if k != "reward"}
    opt = Capture(policy.parameters())
    stats = grpo.update(policy, opt, batch, None, torch.zeros(3), [[0, 1], [2]], cfg, CPU,
                          extra=("logp_sum", 0.5, term))
    assert seen == [[0, 1], [2]]
    logp = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], CFG["temperature"], CFG["chunk_size"])
    by_hand = (logp * batch["loss_mask"]).sum(-1)
    assert stats["logp_sum"] == pytest.approx(by_hand.mean().item(), rel=1e-5) and stats["loss"] == 0.0
    (0.5 * by_hand.mean()).backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(opt.grads, policy.parameters()))
    assert any(a.abs().sum() > 0 for a in opt.grads)


def test_token_mean_per_micro_batch_is_the_released_weighting():
    """--agg token-mean-per-micro-batch (the released verl actor): each micro-batch's token-mean,
    weighted by its share of the rows. Responses of 6, 4, 1, 1 tokens with advantages 1, 1, -1, -1
    in micro-batches [0, 1], [2, 3], on-policy (per-token loss -A): micro-batch A's token-mean is -1,
    B's is +1, each at weight 2/4, so the loss is 0 (a token of B weighs (2/4)/2 = 0.25, one of A
    (2/4)/10 = 0.05: 5x less). The default token-mean is -(6 + 4 - 1 - 1) / 12 = -2/3. The
    gradient is that of 0.5 * tm_A + 0.5 * tm_B written out here."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (2, 3, 4, 2)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 4, 1, 1)]
    batch = pack(prompts, responses, pad_id=0)
    adv, mbs = torch.tensor([1.0, 1.0, -1.0, -1.0]), [[0, 1], [2, 3]]
    policy = tiny.model(vocab_size=64, seed=6)
    out = {}
    for agg in ("token-mean", "token-mean-per-micro-batch"):
        opt = Capture(policy.parameters())
        stats = grpo.update(policy, opt, batch, None, adv, mbs, dict(CFG, agg=agg), CPU)
        out[agg] = stats["loss"], opt.grads
    assert out["token-mean"][0] == pytest.approx(-2 / 3, rel=1e-6)
    assert out["token-mean-per-micro-batch"][0] == pytest.approx(0.0, abs=1e-7)
    logp = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], CFG["temperature"], CFG["chunk_size"])
    m = batch["loss_mask"]
    by_hand = sum(len(mb) / 4 * (-adv[mb, None] * logp[mb] * m[mb]).sum() / m[mb].sum() for mb in mbs)
    by_hand.backward()
    grads = out["token-mean-per-micro-batch"][1]
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(grads, policy.parameters()))
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, out["token-mean"][1]))
