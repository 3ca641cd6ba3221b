"""GRPO pieces as small pure functions: packing, group advantages, chunked token log-probs, and the
clipped policy loss (no KL penalty, as released).

Packed layout: input_ids[i] = prompt_i + response_i + [pad] * ... (right padding). Token t (t >= 1) is
predicted from position t - 1, so log-prob tensors are [N, L-1] over targets input_ids[:, 1:], and the
loss mask is 1 exactly on targets that are response tokens (EOS included, padding excluded)."""
import math
from contextlib import nullcontext
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from harness.parallel import WORLD, LogprobModel, all_gather, all_sum, padded


def pack(prompts, responses, pad_id, logprobs=None):
    """Right-pad N prompt (non-empty) + response pairs (id lists) into one batch: input_ids and
    attention_mask [N, L] long, loss_mask [N, L-1] (1 on response targets: an EOS equal to pad_id is
    trained), prompt_lens [N], with logprobs sampler_logp [N, L-1]. Example: prompt [5, 6], response
    [7, 2], L = 5 -> input_ids [5, 6, 7, 2, pad], loss_mask [0, 1, 1, 0]."""
    n = len(prompts)
    L = max(2, max(len(p) + len(r) for p, r in zip(prompts, responses)))
    batch = {"input_ids": torch.full((n, L), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros(n, L, dtype=torch.long), "loss_mask": torch.zeros(n, L - 1),
             "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.long)}
    if logprobs is not None:
        batch["sampler_logp"] = torch.zeros(n, L - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        batch["input_ids"][i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        batch["attention_mask"][i, :len(p) + len(r)] = 1
        batch["loss_mask"][i, len(p) - 1:len(p) + len(r) - 1] = 1
        if logprobs is not None:  # one per response token
            batch["sampler_logp"][i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(logprobs[i])
    return batch


def group_advantages(rewards, group_size, eps=1e-6):
    """Per-group z-score: rewards [N] (N = groups * group_size, groups contiguous) -> advantages [N].
    A = (r - mean_group r) / (std_group r + eps), the unbiased std (torch's); a group of one: A = 0.
    Example: (1, -1, 1, -1), group_size 4 -> std = sqrt(4/3), A = +-0.866."""
    g = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def _chunk_logprobs(h, lm_head, t, temperature):
    logits = lm_head(h).float() / temperature
    return logits.log_softmax(-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def logprobs_from_hidden(hidden, lm_head, targets, temperature=1.0, chunk_size=1024):
    """Log-probs [N, L-1] float32 of targets [N, L-1] (= input_ids[:, 1:]) from hidden [N, L, d]:
      logp[n, t] = log_softmax(lm_head(hidden[n, t]) / temperature)[targets[n, t]]
    on chunks of chunk_size positions, each checkpointed under grad (else autograd keeps every
    chunk's [chunk, V] softmax: the full logits again)."""
    n, L, d = hidden.shape
    h, t = hidden[:, :-1].reshape(-1, d), targets.reshape(-1).to(hidden.device)
    out = [checkpoint(_chunk_logprobs, h[s:s + chunk_size], lm_head, t[s:s + chunk_size], temperature,
                      use_reentrant=False) for s in range(0, len(h), chunk_size)]
    return torch.cat(out).view(n, L - 1)


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, chunk_size=1024):
    """Log-probs [N, L-1] of input_ids[:, 1:] under a transformers *ForCausalLM: its decoder, unmasked on
    right padding (no pad is attended; SDPA takes flash), then its lm_head by chunks (logprobs_from_hidden)."""
    right = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())  # pack's rows: tokens, then pads
    hidden = model.model(input_ids=input_ids, attention_mask=None if right else attention_mask, use_cache=False)
    return logprobs_from_hidden(hidden.last_hidden_state, model.lm_head, input_ids[:, 1:], temperature, chunk_size)


# --agg: a micro-batch's token-mean weighs by its tokens (one token-mean over the batch) or, as the
# released verl actor, by its rows (grpo.update)
AGGS = ("token-mean", "token-mean-per-micro-batch")


def aggregate(values, mask):
    """The token-mean of per-token values [N, T] under the loss mask [N, T]: sum(v * m) / sum(m)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


def policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2):
    """Clipped-ratio policy loss. logp, old_logp, mask: [N, T]; adv: [N] (broadcast) or [N, T].
      ratio = exp(logp - old_logp)
      l_t   = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss = aggregate(l_t, mask). Returns (loss, stats): clip_frac = share of masked tokens where
    the clipped term is taken, ratio_mean = masked mean ratio."""
    a = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).to(logp)  # logp's dtype and device
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    loss = aggregate(-torch.minimum(unclipped, clipped), mask)
    stats = {"clip_frac": float(aggregate((clipped < unclipped).to(logp.dtype), mask)),
             "ratio_mean": float(aggregate(ratio.detach(), mask))}
    return loss, stats


def micro_batches(lengths, max_tokens):
    """Row indices in micro-batches of <= max_tokens padded tokens: rows longest first, each joining the
    last one if it fits there within max_tokens / 32 of its longest row (why: docs/reference.md)."""
    batches, cur = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        longest = lengths[cur[0]] if cur else 0
        if cur and ((len(cur) + 1) * longest > max_tokens or longest - lengths[i] > max_tokens / 32):
            batches, cur = batches + [cur], []
        cur.append(i)
    return [sorted(b) for b in batches + [cur] if b]  # rollout order within: one micro-batch as before


def micro_batch(batch, rows, device, length=None):
    """`pack`'s batch at `rows`, cut to L = `length` tokens (default: their longest) -> (sub, L)."""
    sub = {k: v[rows].to(device) for k, v in batch.items()}
    L = length or int(sub["attention_mask"].sum(1).max())
    cut = {"input_ids": L, "attention_mask": L, "loss_mask": L - 1, "sampler_logp": L - 1}
    return {k: v[:, :cut[k]] if k in cut else v for k, v in sub.items()}, L


def micro_step(fwd, batch, mb, old_logp, adv, cfg, device):
    """Log-probs by fwd(ids, mask, temperature, chunk_size) and the clipped loss of the rows `mb` of
    `pack`'s batch (None: FSDP2's padding, row 0's first 2 tokens) -> (sub-batch, logp, loss,
    stats); d = logp - sampler_logp: sampler_gap = mean |d|, sampler_kl_k3 = mean e^d - 1 - d."""
    mb, length = (mb, None) if mb is not None else ([0], 2)
    sub, L = micro_batch(batch, mb, device, length)
    logp = fwd(sub["input_ids"], sub["attention_mask"], cfg["temperature"], cfg["chunk_size"])
    old = logp.detach() if old_logp is None else old_logp[mb, :L - 1].to(device)
    loss, st = policy_loss(logp, old, adv[mb], sub["loss_mask"], cfg["clip_low"], cfg["clip_high"])
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss ({loss.item()}) in a micro-batch of rows {mb}")
    if "sampler_logp" in sub:  # the sampler's gap to the policy it samples for, in float64
        d = (logp.detach().double() - sub["sampler_logp"]) * sub["loss_mask"]
        n, k3 = sub["loss_mask"].sum().clamp(min=1), d.expm1() - d  # k3: e^d - 1 - d
        st.update(sampler_gap=float(d.abs().sum() / n), sampler_kl_k3=float(k3.sum() / n),
                  sampler_ratio_max=float(d.sum(-1).exp().max()))  # a row's largest e^(sum d)
    return sub, logp, loss, st


def update(policy, opt, batch, old_logp, adv, mbs, cfg, device, extra=None):
    """One optimizer step over this rank's micro-batches `mbs`, each weighted by its share of every
    rank's tokens (token-mean) or rows: one process, FSDP2's ranks and --offload alike. old_logp
    [N, T] or None (on-policy); extra: a mode's loss term (baselines.extra_loss). -> mean stats."""
    policy.train()
    fsdp = isinstance(policy, LogprobModel)  # FSDP2's policy (parallel.wrap): ranks, or --offload
    weights = batch["loss_mask"].sum(1) if cfg["agg"] == "token-mean" else torch.ones(len(adv))
    mine = [sum(weights[mb].sum().item() for mb in mbs), sum(map(len, mbs))]  # weight, sequences
    total, n_seq = (max(v, 1.0) for v in (all_sum(mine, device) if fsdp else mine))  # every rank's
    (name, coef, term), ratio_max = extra or (None, None, None), 0.0
    sums = dict.fromkeys(("loss", "clip_frac", "kl", "ratio_mean"), 0.0)  # kl: 0, no KL penalty
    fwd = policy if fsdp else partial(token_logprobs, policy)  # LogprobModel's forward: the same
    amp = nullcontext() if fsdp or device.type != "cuda" else torch.autocast("cuda", torch.bfloat16)
    for mb in padded(policy, mbs, cfg) if fsdp else mbs:  # FSDP2: None pads
        real = mb is not None
        w = weights[mb].sum().item() if real else 0.0  # a whole number: exact means below
        with amp:
            sub, logp, loss, stats = micro_step(fwd, batch, mb, old_logp, adv, cfg, device)
        ratio_max = max(ratio_max, stats.pop("sampler_ratio_max", 0.0) * real)  # a max; padding: 0
        weighted = loss * (w / total)
        if term is not None:  # term [n]: a mean over every sequence; [n, T]: weighted like the loss
            part = term(logp, sub["loss_mask"], mb if real else [0])
            part, share = (aggregate(part, sub["loss_mask"]), w / total) if part.dim() == 2 \
                else (part.sum(), real / n_seq)
            weighted = weighted + coef * part * share
            sums[name] = sums.get(name, 0.0) + part.item() * share * total  # logged as its mean
        (weighted * WORLD).backward()  # FSDP2 averages gradients over ranks: each share times WORLD
        for key, value in (("loss", loss.item()), *stats.items()):
            sums[key] = sums.get(key, 0.0) + value * w  # weighted like the loss
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg["grad_clip"])
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm ({grad_norm})")
    opt.step()
    opt.zero_grad(set_to_none=True)
    means = all_sum(list(sums.values()), device) if fsdp else sums.values()  # one all-reduce
    out = dict(zip(sums, (v / total for v in means)), grad_norm=grad_norm)
    if "sampler_logp" in batch:  # every stat a mean weighted like the loss, but this largest one
        out["sampler_ratio_max"] = max(all_gather(ratio_max)) if fsdp else ratio_max
    return out
