"""The update learns: on the committed toy policy, the loss's gradient is REINFORCE, and one AdamW
step with the toy's default settings moves probability from negative- to positive-advantage samples.

Both go through the code the run uses (rollout.generate, grade.is_correct, grpo.group_advantages,
grpo.token_logprobs, grpo.update: policy_loss, grad clip, AdamW).
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grade
import data
import grpo
import toy
from config import resolve_args
from grpo import group_advantages, pack, policy_loss, token_logprobs
from rollout import generate


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # as train.py runs the toy: its ops are too small to gain from threads on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cfg():
    return resolve_args([])  # the toy defaults of `python train.py`


@pytest.fixture(scope="module")
def rollouts(cfg):
    """8 training problems x 8 samples from the committed base policy (the RL rollout settings)."""
    path = toy.BASE_DIR
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = toy.dataset("train")[:8]
    prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    out = generate(model, tok, prompts, n=cfg["group_size"], max_new_tokens=cfg["max_new_tokens"],
                   temperature=cfg["temperature"], seed=3)
    correct = torch.tensor([grade.is_correct(t, rows[i]["answer"])
                            for t, i in zip(out.texts, out.prompt_index)], dtype=torch.float32)
    batch = pack([prompts[i] for i in out.prompt_index], out.ids, tok.pad_token_id)
    adv = group_advantages(2 * correct - 1, cfg["group_size"])
    return path, batch, adv


def sequence_logprobs(lm, batch, temperature):
    with torch.no_grad():
        logp = token_logprobs(lm, batch["input_ids"], batch["attention_mask"], temperature)
    return (logp * batch["loss_mask"]).sum(1)


def test_loss_gradient_is_the_per_sample_reinforce_gradient(cfg, rollouts):
    path, batch, adv = rollouts
    T, mask = cfg["temperature"], batch["loss_mask"]

    def grads(loss_fn):
        lm = AutoModelForCausalLM.from_pretrained(path)
        lm.zero_grad()
        loss_fn(lm).backward()
        return torch.cat([p.grad.flatten() for p in lm.parameters()])

    def ours(lm):  # chunked, checkpointed log-probs and the clipped ratio loss at ratio 1
        logp = token_logprobs(lm, batch["input_ids"], batch["attention_mask"], T, chunk_size=256)
        return policy_loss(logp, logp.detach(), adv, mask)[0]

    def reinforce(lm):  # from scratch: -sum_i A_i sum_t log p_t / total tokens
        logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = (logits[:, :-1] / T).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return -(adv[:, None] * logp * mask).sum() / mask.sum()

    g, ref = grads(ours), grads(reinforce)
    assert ref.norm() > 1e-3  # the batch has mixed groups, so there is a gradient to compare
    assert torch.nn.functional.cosine_similarity(g, ref, dim=0) > 0.99999
    assert (g - ref).norm() / ref.norm() < 1e-4


@pytest.mark.parametrize("steps", [1, 3])
def test_updates_move_probability_towards_positive_advantages(cfg, rollouts, steps):
    """Optimizer steps as train.py takes them with the toy defaults, on one batch: the first (at the
    warm-up lr, on a fresh AdamW), and the three of the warm-up, the last at the peak lr. (A fresh
    AdamW's first, sign-like step at the peak lr, which training never takes, moves every parameter
    by about lr and, on the committed base, lowers both sides.)"""
    path, batch, adv = rollouts
    assert (adv > 0).sum() >= 8 and (adv < 0).sum() >= 8
    lm = AutoModelForCausalLM.from_pretrained(path)
    lm.config.use_cache = False
    policy = lm
    before = sequence_logprobs(lm, batch, cfg["temperature"])
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg["lr"], weight_decay=0.0)  # as train.run
    warmup = max(cfg["warmup"], 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    mbs = grpo.micro_batches(batch["attention_mask"].sum(1).tolist(), cfg["micro_tokens"])
    old = torch.zeros(batch["loss_mask"].shape)
    with torch.no_grad():
        old[:] = token_logprobs(lm, batch["input_ids"], batch["attention_mask"], cfg["temperature"])
    for _ in range(steps):
        grpo.update(policy, opt, batch, old, adv, mbs, cfg, torch.device("cpu"))
        sched.step()  # after each update, as rl_step steps it
    delta = sequence_logprobs(lm, batch, cfg["temperature"]) - before
    up, down = delta[adv > 0].mean().item(), delta[adv < 0].mean().item()
    print(f"\nmean change of sequence log-prob after {steps} step(s), lr {opt.param_groups[0]['initial_lr']:.1e} / "
          f"warm-up {warmup}: positive advantage {up:+.4f}, negative {down:+.4f}")
    # a step moves a log-prob by about lr per unit of gradient: 0.005 at the earlier toy lr 1e-4, 0.001 at 2e-5
    assert up > 50 * cfg["lr"] and down < -50 * cfg["lr"]
