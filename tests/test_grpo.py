import math

import pytest
import torch
import torch.nn as nn
from transformers import Qwen2Config, Qwen2ForCausalLM

import config
import grpo

PAD = EOS = 1  # pad == EOS on purpose: the loss mask must still train the EOS target


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def batch():
    return grpo.pack([[5, 6, 7], [8, 9]], [[10, 11, 12, EOS], [13, EOS]], pad_id=PAD)


def test_pack_layout():
    b = batch()
    assert b["input_ids"].tolist() == [[5, 6, 7, 10, 11, 12, EOS], [8, 9, 13, EOS, PAD, PAD, PAD]]
    assert b["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    # targets = input_ids[:, 1:]; 1 exactly on response tokens incl. EOS
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert b["prompt_lens"].tolist() == [3, 2]
    assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.float32


def test_group_advantages():
    adv = grpo.group_advantages(torch.tensor([1.0, -1.0, 1.0, -1.0]), 4)
    assert adv.tolist() == pytest.approx([0.866025, -0.866025, 0.866025, -0.866025], abs=1e-5)
    adv = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0, 1.0]), 3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group 2: mean 5/3, unbiased std sqrt(4/3)
    assert adv[4].item() == pytest.approx((3 - 5 / 3) / (math.sqrt(4 / 3) + 1e-6), abs=1e-5)
    # one right answer in 8: mean -0.75, deviations (1.75, -0.25 x 7), unbiased variance 3.5 / 7 =
    # 0.5, std 0.707 < 1: A = (1.75, -0.25 x 7) * sqrt(2) = (2.475, -0.354 x 7)
    adv = grpo.group_advantages(torch.tensor([1.0] + [-1.0] * 7), 8)
    assert adv.tolist() == pytest.approx([1.75 * math.sqrt(2)] + [-0.25 * math.sqrt(2)] * 7, abs=1e-5)
    # 0/1 ints and float64 rewards give float32 advantages: (1, 0) -> +-0.5 / std 0.707
    assert grpo.group_advantages([1, 0], 2).tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)
    assert grpo.group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float32
    # a group of one sample: A = 0 (its std would be nan)
    assert grpo.group_advantages(torch.tensor([1.0, 0.0]), 1).tolist() == [0.0, 0.0]
    # eps = 1e-6 is added to the std: rewards (0, 2e-6), std 1.414e-6: A = +-1e-6 / 2.414e-6 = +-(sqrt 2 - 1)
    adv = grpo.group_advantages(torch.tensor([0.0, 2e-6]), 2)
    assert adv.tolist() == pytest.approx([1 - math.sqrt(2), math.sqrt(2) - 1], abs=1e-3)
    with pytest.raises(RuntimeError):  # torch's view: 5 rewards are no groups of 2
        grpo.group_advantages(torch.zeros(5), 2)


def _logits_param(n=4, t=3, v=5, seed=0):
    torch.manual_seed(seed)
    return nn.Parameter(torch.randn(n, t, v))


def _logp(logits, targets):
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sgd_step_moves_sampled_logprobs_with_the_advantage(sign):
    logits = _logits_param()
    targets = torch.randint(0, 5, (4, 3), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 3)
    old = _logp(logits, targets).detach()
    loss, _ = grpo.policy_loss(_logp(logits, targets), old, torch.full((4,), sign), mask)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    new = _logp(logits, targets)
    assert ((new - old) * sign > 0).all()


def test_equal_reward_group_gets_zero_gradient():
    adv = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0]), 2)
    assert adv[:4].tolist() == [0.0] * 4 and adv[4] < 0 < adv[5]
    logits = _logits_param(n=6)
    targets = torch.zeros(6, 3, dtype=torch.long)
    logp = _logp(logits, targets)
    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, torch.ones(6, 3))
    loss.backward()
    assert (logits.grad[:4] == 0).all() and (logits.grad[4:] != 0).any()


def test_clipped_side_has_zero_gradient():
    logp = torch.zeros(1, 4, requires_grad=True)
    # ratios exp(+0.5) = 1.65 and exp(-0.5) = 0.61, both outside [0.8, 1.2]
    old = torch.tensor([[-0.5, -0.5, 0.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = grpo.policy_loss(logp, old, adv, torch.ones(1, 4))
    loss.backward()
    # A > 0 with ratio above 1 + eps and A < 0 with ratio below 1 - eps are clipped: no gradient;
    # the other two sides are not clipped (min keeps the unclipped, more pessimistic term)
    g = logp.grad[0]
    assert g[0] == 0 and g[3] == 0 and g[1] != 0 and g[2] != 0
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((2 * math.exp(0.5) + 2 * math.exp(-0.5)) / 4)
    # asymmetric clip: with clip_high = 1.0 the ratio 1.65 is inside the range and trains
    logp.grad = None
    loss, _ = grpo.policy_loss(logp, old, adv, torch.ones(1, 4), clip_high=1.0)
    loss.backward()
    assert logp.grad[0, 0] != 0


def test_each_clip_bound_is_pinned_by_a_ratio_between_the_bounds():
    """Ratios (1.1, 1.3, 0.85, 0.7) with A (+1, +1, -1, -1) against the default range [0.8, 1.2]:
    1.1 and 0.85 lie inside and train; 1.3 (A > 0) and 0.7 (A < 0) lie outside and are clipped.
    Per-token loss -min(r A, clamp(r) A) = (-1.1, -1.2, 0.85, 0.8), mean -0.1625; gradient wrt
    logp (d ratio / d logp = ratio) -r A / 4 where unclipped: (-0.275, 0, 0.2125, 0)."""
    logp = torch.tensor([[1.1, 1.3, 0.85, 0.7]]).log().requires_grad_()
    old, adv, mask = torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)

    def step(**clip):
        logp.grad = None
        loss, stats = grpo.policy_loss(logp, old, adv, mask, **clip)
        loss.backward()
        return loss.item(), stats["clip_frac"], logp.grad[0].tolist()

    loss, frac, grad = step()
    assert loss == pytest.approx(-0.1625, abs=1e-6) and frac == 0.5
    assert grad == pytest.approx([-0.275, 0.0, 0.2125, 0.0], abs=1e-6)
    # clip_high 0.4 (range [0.8, 1.4]): 1.3 trains at -1.3, mean -0.1875
    loss, frac, grad = step(clip_high=0.4)
    assert loss == pytest.approx(-0.1875, abs=1e-6) and frac == 0.25
    assert grad == pytest.approx([-0.275, -0.325, 0.2125, 0.0], abs=1e-6)
    # clip_low 0.4 (range [0.6, 1.2]): 0.7 trains at 0.7, mean -0.1875
    loss, frac, grad = step(clip_low=0.4)
    assert loss == pytest.approx(-0.1875, abs=1e-6) and frac == 0.25
    assert grad == pytest.approx([-0.275, 0.0, 0.2125, 0.175], abs=1e-6)
    # clip_low 0.1, clip_high 0.4 (range [0.9, 1.4]): 1.3 trains, 0.85 and 0.7 both clip at 0.9:
    # (-1.1, -1.3, 0.9, 0.9), mean -0.15; a bound read from the other flag shows here
    loss, frac, grad = step(clip_low=0.1, clip_high=0.4)
    assert loss == pytest.approx(-0.15, abs=1e-6) and frac == 0.5
    assert grad == pytest.approx([-0.275, -0.325, 0.0, 0.0], abs=1e-6)


def test_aggregation_hand_computed():
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # ratio 1 -> per-token loss = -A, the token-mean over the masked tokens
    assert grpo.policy_loss(logp, logp, adv, mask)[0].item() == pytest.approx(-(1 + 1 + 2) / 3)
    stats = grpo.policy_loss(logp, logp, adv, mask)[1]
    assert stats == {"clip_frac": 0.0, "ratio_mean": 1.0}  # ratio 1 is never clipped
    # one masked token: the means divide by 1
    assert grpo.aggregate(torch.tensor([[3.0, 5.0]]), torch.tensor([[1.0, 0.0]])).item() == 3.0
    loss, stats = grpo.policy_loss(torch.tensor([[math.log(1.3)]]), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2) and stats == pytest.approx({"clip_frac": 1.0, "ratio_mean": 1.3})


def test_sampler_gap_worked_numbers():
    """micro_step's sampler gap: d = logp - sampler_logp on the masked tokens: (0.5, -0.3) and
    (0.2, 0.3); the masked 9 counts nowhere. mean |d| = 1.3 / 4; mean exp(d) - 1 - d = 0.2608 / 4
    (k3, each term >= 0); the largest sequence ratio exp(sum_t d) is exp(0.5) (row 2; row 1: exp(0.2))."""
    sampler = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    logp = sampler + torch.tensor([[0.5, -0.3, 9.0], [0.2, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    batch = dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
                 loss_mask=mask, sampler_logp=sampler)
    cfg = dict(temperature=1.0, chunk_size=8, clip_low=0.2, clip_high=0.2)
    *_, stats = grpo.micro_step(lambda *a: logp, batch, [0, 1], None, torch.ones(2), cfg, torch.device("cpu"))
    k3 = sum(math.exp(d) - 1 - d for d in (0.5, -0.3, 0.2, 0.3))
    assert k3 == pytest.approx(0.2608, abs=1e-4)
    assert stats["sampler_gap"] == pytest.approx(1.3 / 4) and stats["sampler_kl_k3"] == pytest.approx(k3 / 4)
    assert stats["sampler_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)


class Capture:
    """Stands in for the optimizer: keeps a copy of the gradients grpo.update accumulated."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def test_micro_batches_do_not_change_loss_or_gradient():
    """grpo.update over one micro-batch and over uneven micro-batches of the same rows (different
    padded widths) gives the same loss and the same summed gradient (one token-mean over the batch)."""
    torch.manual_seed(0)
    b = grpo.pack([[5, 6, 7], [8, 9], [3], [4, 4]],
                  [[10, 11, 12, 13, 14, EOS], [13, EOS], [20, 21, 22, EOS], [30, EOS]], pad_id=PAD)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    policy = tiny_qwen2()
    with torch.no_grad():   # old log-probs a little off the current ones, so ratios differ from 1
        old = grpo.token_logprobs(policy, b["input_ids"], b["attention_mask"]) + 0.1 * torch.randn(b["loss_mask"].shape)
    cfg = dict(agg="token-mean", temperature=1.0, chunk_size=5, clip_low=0.2, clip_high=0.2, grad_clip=1e9,
               max_new_tokens=8)
    out = {}
    for name, mbs in (("one", [[0, 1, 2, 3]]), ("split", [[0], [1, 2], [3]])):
        opt = Capture(policy.parameters())
        stats = grpo.update(policy, opt, b, old, adv, mbs, cfg, torch.device("cpu"))
        out[name] = stats["loss"], opt.grads
    assert out["split"][0] == pytest.approx(out["one"][0], rel=1e-5, abs=1e-7)
    assert abs(out["one"][0]) > 1e-3
    for g1, g2 in zip(out["one"][1], out["split"][1]):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-6)


def rollout_order(lengths, max_tokens):
    """micro_batches before it sorted rows by length: consecutive rows, each micro-batch padded to its
    longest row (the reference of the two tests below)."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


def padded(mbs, lengths):
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in mbs)


def test_micro_batches_by_length_give_rollout_orders_loss_and_gradient():
    """Rows of 3 to 18 tokens, 64 per micro-batch (so rows within 2 tokens of the longest join it):
    micro_batches groups them by length, each row once, none over the cap, fewer padded tokens than
    rollout order, and grpo.update over either gives the same loss and gradient, because each
    micro-batch weighs by its tokens (weighed by rows, the groupings' losses differ)."""
    torch.manual_seed(0)
    responses = [list(range(10, 10 + n)) + [EOS] for n in (14, 1, 9, 2, 13, 0, 8, 3)]
    b = grpo.pack([[5, 6, 7]] * 8, responses, pad_id=PAD)
    lengths = b["attention_mask"].sum(1).tolist()  # [18, 5, 13, 6, 17, 4, 12, 7]
    new, old = grpo.micro_batches(lengths, 64), rollout_order(lengths, 64)
    assert new == [[0, 4], [2, 6], [1, 3, 7], [5]]
    assert old == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert padded(new, lengths) == 87 < padded(old, lengths) == 129
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.5, 1.5, -1.0, 0.75])
    policy = tiny_qwen2()
    with torch.no_grad():   # old log-probs a little off the current ones, so ratios differ from 1
        old_logp = grpo.token_logprobs(policy, b["input_ids"], b["attention_mask"])
        old_logp += 0.1 * torch.randn(b["loss_mask"].shape)
    cfg = dict(agg="token-mean", temperature=1.0, chunk_size=16, clip_low=0.2, clip_high=0.2, grad_clip=1e9,
               max_new_tokens=16)
    out = []
    for mbs in (new, old):
        opt = Capture(policy.parameters())
        loss = grpo.update(policy, opt, b, old_logp, adv, mbs, cfg, torch.device("cpu"))["loss"]
        out.append((loss, opt.grads))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5) and abs(out[0][0]) > 1e-3
    for g1, g2 in zip(out[0][1], out[1][1]):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-7)


def test_micro_batches_pad_little_on_the_7b_recipe_lengths():
    """The default 7B recipe's update on one of 8 GPUs (config.REAL): 32 prompts x 6 / 8 = 24 rows of
    a 120-300-token prompt and a response of lognormal length, mean 4.3k tokens, sigma 0.6, cut at
    max_new_tokens (about 2 rows in 24: the GPU review's spread), 16384 tokens per micro-batch. Over
    2000 seeded draws, computed (padded) / real tokens: about 1.25 in rollout order, at most 1.05 by
    length, in no more micro-batches. `pytest -s` prints them."""
    rows, cap, cut = (config.REAL["prompts_per_step"] * config.REAL["group_size"] // 8,
                      config.REAL["micro_tokens"], config.REAL["max_new_tokens"])
    g, mu, sigma = torch.Generator().manual_seed(0), math.log(4300) - 0.6 ** 2 / 2, 0.6
    real, tokens, counts = 0, {"rollout order": 0, "by length": 0}, {"rollout order": 0, "by length": 0}
    for _ in range(2000):
        response = (mu + sigma * torch.randn(rows, generator=g)).exp().round().clamp(1, cut)
        lengths = (response + torch.randint(120, 301, (rows,), generator=g)).long().tolist()
        real += sum(lengths)
        for name, split in (("rollout order", rollout_order), ("by length", grpo.micro_batches)):
            mbs = split(lengths, cap)
            assert all(len(mb) == 1 or padded([mb], lengths) <= cap for mb in mbs)
            tokens[name] += padded(mbs, lengths)
            counts[name] += len(mbs)
    ratio = {name: tokens[name] / real for name in tokens}
    print(f"\n7B recipe, 24 rows a GPU: computed / real tokens {ratio['rollout order']:.3f} in rollout order "
          f"({counts['rollout order'] / 2000:.1f} micro-batches), {ratio['by length']:.3f} by length "
          f"({counts['by length'] / 2000:.1f})")
    assert ratio["rollout order"] > 1.2 and ratio["by length"] <= 1.05
    assert counts["by length"] <= counts["rollout order"]


def test_eos_target_trained_padding_not():
    model = tiny_qwen2()
    b = batch()
    hidden = model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    # feed the logits themselves as the "hidden states" through an identity head: their gradient is
    # the gradient wrt the logit rows of each target
    logits = model.lm_head(hidden).detach().requires_grad_()
    logp = grpo.logprobs_from_hidden(logits, nn.Identity(), b["input_ids"][:, 1:], chunk_size=4)
    loss, _ = grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0]), b["loss_mask"])
    loss.backward()
    g = logits.grad.abs().sum(-1)  # [N, L]; position t predicts target t + 1
    assert g[0, 5] > 0 and g[1, 2] > 0          # predicting the EOS targets
    assert (g[1, 3:] == 0).all()                 # predicting padding (same id as EOS) or past the end
    assert (g[0, :2] == 0).all() and g[1, 0] == 0  # predicting prompt tokens


def test_eos_trained_padding_not_through_the_model():
    model = tiny_qwen2()
    b = batch()
    hidden = model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    hidden.retain_grad()
    logp = grpo.logprobs_from_hidden(hidden, model.lm_head, b["input_ids"][:, 1:], chunk_size=5)
    loss, _ = grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), b["loss_mask"])
    loss.backward()
    g = hidden.grad.abs().sum(-1)
    assert g[1, 2] > 0 and (g[1, 3:] == 0).all()
    assert model.lm_head.weight.grad is not None and model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_matches_full_logits(temperature):
    model = tiny_qwen2()
    b = batch()
    sizes = []
    hook = model.lm_head.register_forward_pre_hook(lambda mod, args: sizes.append(args[0].shape[:-1].numel()))
    try:
        chunked = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], temperature, chunk_size=3)
        chunked.sum().backward()  # the checkpointed backward recomputes chunk by chunk too
    finally:
        hook.remove()
    assert sizes and max(sizes) <= 3 and sum(sizes) >= 2 * 6
    with torch.no_grad():
        whole = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], temperature, chunk_size=10_000)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        ref = (logits[:, :-1] / temperature).log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    assert chunked.shape == (2, 6)
    assert torch.allclose(chunked, whole, atol=1e-5)
    real = b["attention_mask"][:, :-1].bool()  # predicted from a real token (from a pad: no mask, unused)
    assert torch.allclose(chunked[real], ref[real], atol=1e-5)
    if temperature != 1.0:  # the temperature really changes the numbers
        assert not torch.allclose(ref, logits[:, :-1].log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1), atol=1e-3)


def test_right_padded_rows_go_without_a_mask_and_their_trained_log_probs_stay_the_masked_forwards():
    """pack right-pads, so causal attention never reaches a pad from a real token: the update's forward
    takes no mask (on a GPU SDPA's flash kernel, not the masked one), and the trained tokens' log-probs
    are the masked forward's, bit for bit. A left-padded batch keeps its mask."""
    model, b = tiny_qwen2(), batch()
    ids, mask = b["input_ids"], b["attention_mask"]
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"]), with_kwargs=True)
    with torch.no_grad():
        logp = grpo.token_logprobs(model, ids, mask)
        grpo.token_logprobs(model, ids.flip(1), mask.flip(1))  # left padding
        masked = grpo.logprobs_from_hidden(model.model(input_ids=ids, attention_mask=mask).last_hidden_state,
                                           model.lm_head, ids[:, 1:])
    hook.remove()
    assert seen[0] is None and torch.equal(seen[1], mask.flip(1))
    trained = b["loss_mask"].bool()
    assert torch.equal(logp[trained], masked[trained])
    assert not torch.allclose(logp, masked)  # after the pads they differ: no mask reached the model


def test_token_logprobs_never_calls_full_forward():
    model = tiny_qwen2()
    b = batch()

    def full_forward(*args, **kwargs):
        raise AssertionError("token_logprobs called model(...), which builds [N, L, V] logits")

    model.forward = full_forward
    with torch.no_grad():
        assert grpo.token_logprobs(model, b["input_ids"], b["attention_mask"]).shape == (2, 6)



def test_micro_step_pads_takes_the_old_log_probs_and_each_clip_bound_from_cfg():
    """micro_step of FSDP2's padding (None) is row 0's first 2 tokens; with old log-probs [N, T]
    (wider than the micro-batch) the ratio is exp(logp - old) on the micro-batch's columns; clip_low
    and clip_high are cfg's own: ratios 1.25 and 0.85 with A = 1 at clip_low 0.1, clip_high 0.3 are
    both inside, so nothing is clipped (the defaults 0.2 would clip the first). A non-finite loss
    names its rows."""
    batch = dict(input_ids=torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]]),
                 attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                 loss_mask=torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    seen = []

    def fwd(ids, mask, temperature, chunk_size):
        seen.append(ids.tolist())
        return torch.zeros(ids.shape[0], ids.shape[1] - 1)
    cfg = dict(temperature=1.0, chunk_size=8, clip_low=0.1, clip_high=0.3)
    sub, *_ = grpo.micro_step(fwd, batch, None, None, torch.ones(2), cfg, torch.device("cpu"))
    assert seen[-1] == [[5, 6]] and sub["loss_mask"].tolist() == [[0.0]]
    old = torch.tensor([[0.0, -math.log(1.25), -math.log(0.85)], [-math.log(1.25), 0.0, 0.0]])
    _, logp, loss, stats = grpo.micro_step(fwd, batch, [1], old, torch.ones(2), cfg, torch.device("cpu"))
    assert seen[-1] == [[5, 6]] and logp.shape == (1, 1)
    assert stats == pytest.approx({"clip_frac": 0.0, "ratio_mean": 1.25}) and loss.item() == pytest.approx(-1.25)
    _, _, loss, stats = grpo.micro_step(fwd, batch, [0], old, torch.ones(2), cfg, torch.device("cpu"))
    assert stats == pytest.approx({"clip_frac": 0.0, "ratio_mean": (1.25 + 0.85) / 2})
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) in a micro-batch of rows \[0\]"):
        grpo.micro_step(fwd, batch, [0], old, torch.tensor([float("nan"), 1.0]), cfg, torch.device("cpu"))


def test_the_sampler_gap_of_a_single_token():
    """One response token with d = 0.4: sampler_gap 0.4 and k3 e^0.4 - 1 - 0.4 = 0.0918 (a mean
    over one token, not two)."""
    batch = dict(input_ids=torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3, dtype=torch.long),
                 loss_mask=torch.tensor([[0.0, 1.0]]), sampler_logp=torch.tensor([[0.0, -1.0]]))
    cfg = dict(temperature=1.0, chunk_size=8, clip_low=0.2, clip_high=0.2)
    logp = torch.tensor([[0.0, -0.6]])
    *_, stats = grpo.micro_step(lambda *a: logp, batch, [0], None, torch.ones(1), cfg, torch.device("cpu"))
    assert stats["sampler_gap"] == pytest.approx(0.4) and stats["sampler_kl_k3"] == pytest.approx(math.exp(0.4) - 1.4)
