"""The forwards of one RL step: `score`, one no-grad pass over prompt + response for the old token
log-probs and the probe's features at the cut ends (a forward hook keeps only those positions), and
`update`, one optimizer step over micro-batches of at most --micro-tokens padded tokens, each
weighted by its share of the batch, which also measures the sampler's gap to the policy
(sampler_gap, sampler_kl_k3, sampler_ratio_max; docs/reference.md).
"""
import math
from contextlib import nullcontext

import torch

from grpo import aggregate, logprobs_from_hidden, policy_loss
from harness.parallel import WORLD, all_gather, all_sum, sharded
from probe import LAST_K, last_layer, prefix_features


def cut_ends(prompt_lens, cut_lists, width=None):
    """Absolute exclusive ends `len(prompt_i) + b` as a [N, B] long tensor (0 = no budget)."""
    width = width or max((len(bs) for bs in cut_lists), default=0)
    ends = torch.zeros(len(cut_lists), max(width, 1), dtype=torch.long)
    for i, bs in enumerate(cut_lists):
        ends[i, :len(bs)] = torch.tensor(bs, dtype=torch.long) + int(prompt_lens[i])
    return ends


@torch.no_grad()
def forward_pass(model, batch, ends=None, temperature=1.0, chunk_size=1024, last_k=LAST_K,
                 final_norm=False, logprobs=True):
    """Old log-probs and probe features from one forward.

    batch: `grpo.pack` output (input_ids / attention_mask [N, L]); ends: [N, B] absolute ends, or
    None for no features. Returns (old_logp [N, L-1] float32 or None, feats [N, B, d] float32 and
    valid [N, B] bool, or None and None). final_norm: the post-hoc probe's feature, the final normed
    state of the last token before each end, in place of probe.prefix_features' training one.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    captured = {}
    keep = nullcontext() if ends is None or final_norm else last_layer(
        model, lambda hidden: captured.setdefault("feats", prefix_features(hidden, ends.to(ids.device), last_k)))
    with keep:
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # no K/V kept
    feats, valid = captured.get("feats", (None, None))
    if final_norm and ends is not None:
        feats, valid = prefix_features(hidden, ends.to(ids.device), 1)
    old_logp = None
    if logprobs:
        old_logp = logprobs_from_hidden(hidden, model.lm_head, ids[:, 1:], temperature,
                                        chunk_size).float()
    return old_logp, feats, valid


def micro_batches(lengths, max_tokens):
    """Split indices into consecutive micro-batches of at most max_tokens padded tokens."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


def sampler_gap(logp, sampler_logp, mask):
    """([sum of |d|, sum of exp(d) - 1 - d, tokens], largest exp(sum_t d) of a row) over the masked
    tokens of one micro-batch, logp, sampler_logp, mask [n, T], d = logp - sampler_logp in float64."""
    d = (logp.detach().double() - sampler_logp.double()) * mask
    sums = [d.abs().sum().item(), (torch.expm1(d) - d).sum().item(), mask.sum().item()]
    return sums, d.sum(-1).exp().max().item()


def micro_batch(batch, rows, device, length=None):
    """The `pack` batch restricted to `rows` and cut to `length` tokens (default: their longest
    sequence); returns (sub, L), L the length cut to."""
    sub = {k: v[rows].to(device) for k, v in batch.items()}
    L = length or int(sub["attention_mask"].sum(1).max())
    cut = {"input_ids": L, "attention_mask": L, "loss_mask": L - 1, "sampler_logp": L - 1}
    return {k: v[:, :cut[k]] if k in cut else v for k, v in sub.items()}, L


def update(policy, opt, sched, batch, old_logp, adv, mbs, cfg, device, extra=None):
    """One optimizer step over the micro-batches `mbs` (lists of batch rows; rows in none of them are
    left out), each weighted by its share of the tokens (token-mean) or sequences of those rows.

    extra: None, or a mode's loss term (name, coef, term) (modes.extra_loss): term(logp, loss_mask,
    rows) gives a micro-batch's values from the differentiable log-probs, [n] per sequence (the loss
    adds coef * their mean over all sequences) or [n, T] per token (coef * their aggregate by --agg,
    weighted like the policy loss); the result has that mean or aggregate under `name`.
    old_logp [N, T] from the scoring pass, or None on-policy: the current log-probs, detached, so
    the ratio is exactly 1. sched: stepped after the optimizer (None: not stepped).
    Ranks with fewer micro-batches run padding ones (one row cut to 2 tokens, at weight 0): FSDP2
    needs as many forward/backward calls on every rank.
    """
    policy.train()
    mask = batch["loss_mask"]
    weights = mask.sum(1) if cfg["agg"] == "token-mean" else torch.ones(len(mask))
    total, n_seq = all_sum([sum(weights[mb].sum().item() for mb in mbs), sum(map(len, mbs))], device)
    # FSDP averages gradients over ranks, so each rank's share is scaled back up by WORLD
    n_mb = int(max(all_gather(len(mbs))))
    # kl stays 0 (no KL penalty, as released): a metrics.jsonl column kept for its readers
    sums = dict.fromkeys(("loss", "clip_frac", "kl", "ratio_mean"), 0.0)
    name, coef, term = extra or (None, None, None)
    extra_sum = 0.0
    # one plain GPU: autocast; under FSDP2 its mixed-precision policy casts instead
    plain_gpu = device.type == "cuda" and not sharded(policy)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if plain_gpu else nullcontext()
    gap = "sampler_logp" in batch
    gap_sums, ratio_max = [0.0, 0.0, 0.0], 0.0  # sum |d|, sum k3, tokens; see sampler_gap
    # --offload: FSDP2 would reduce-scatter each micro-batch's gradients and add them into the host
    # shards with a blocking copy; held unsharded on the GPU instead, they are reduced once
    hold = sharded(policy) and cfg.get("offload") and cfg.get("offload_grads", "gpu") == "gpu"
    for j in range(n_mb):
        real = j < len(mbs)
        if hold:
            policy.set_requires_gradient_sync(j == n_mb - 1)
        mb = mbs[j] if real else [0]
        w = weights[mb].sum().item() if real else 0.0  # a whole number: exact means below
        sub, L = micro_batch(batch, mb, device, length=None if real else 2)
        with amp:
            logp = policy(sub["input_ids"], sub["attention_mask"], cfg["temperature"], cfg["chunk_size"])
        logp = logp.float()
        old = logp.detach() if old_logp is None else old_logp[mb, :L - 1].to(device)
        loss, st = policy_loss(logp, old, adv[mb].to(device), sub["loss_mask"], cfg["clip_low"],
                               cfg["clip_high"], agg=cfg["agg"],
                               norm_const=cfg["max_new_tokens"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss ({loss.item()}) in micro-batch {j}")
        if gap and real:
            part, ratio = sampler_gap(logp, sub["sampler_logp"], sub["loss_mask"])
            gap_sums, ratio_max = [a + b for a, b in zip(gap_sums, part)], max(ratio_max, ratio)
        weighted = loss * (w * WORLD / max(total, 1.0))
        if term is not None:  # a padding micro-batch adds nothing
            part = term(logp, sub["loss_mask"], mb)
            if part.dim() == 2:  # per token: aggregated and weighted like the loss
                part = aggregate(part, sub["loss_mask"], cfg["agg"], cfg["max_new_tokens"])
                weighted = weighted + coef * part * (w * WORLD / max(total, 1.0))
                extra_sum += part.item() * w / max(total, 1.0)
            else:  # per sequence: a mean over sequences
                part = part.sum() * float(real)
                weighted = weighted + coef * part * WORLD / max(n_seq, 1.0)
                extra_sum += part.item() / max(n_seq, 1.0)
        weighted.backward()
        for key, value in (("loss", loss.item()), *st.items()):
            sums[key] += value * w  # weighted like the loss: a batch-wide mean
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg["grad_clip"])
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm ({grad_norm})")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    *means, extra, absd, k3, tokens = all_sum([*sums.values(), extra_sum, *gap_sums], device)  # one all-reduce
    out = dict(zip(sums, (v / max(total, 1.0) for v in means)), grad_norm=grad_norm)
    if term is not None:
        out[name] = extra
    if gap:
        out.update(sampler_gap=absd / max(tokens, 1.0), sampler_kl_k3=k3 / max(tokens, 1.0),
                   sampler_ratio_max=max(all_gather(ratio_max)))
    return out
