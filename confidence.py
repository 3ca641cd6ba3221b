"""Where a sample's confidence comes from at evaluation, and the post-hoc probe.

Sources (one number in [0, 1] per sampled response):
  probe          the run's own probe (probe.pt in the checkpoint) on the training features: the last
                 decoder layer's output before the final norm, averaged over the 4 tokens before the
                 end of thinking (the position of `</think>` in the response, or its end).
  probe-posthoc  a probe fitted after training with the released evaluation protocol (`fit_posthoc`):
                 feature = final normed hidden state of the last token of prompt + thinking.
  verbal         the number in the last <confidence>...</confidence> tag (RLCR's format); values
                 above 1 read as percentages; a missing or unreadable tag reads as 0.5 (counted).
  logits         exp(mean log-prob of the response tokens) at temperature 1 (C2GSPG's confidence).

Post-hoc protocol (released evaluation code): budgets every 500 thinking tokens (`every`), forced
answers `prompt + thinking[:b] + </think> + EVAL_SUFFIX`, 16 per budget at temperature 0.6, top-p 0.95,
at most 64 tokens; labels Y_b = fraction right; MLP d -> d/4 -> 1; 80/20 split grouped by problem;
BCE on soft labels; early stopping on validation BCE against rounded labels; grid over lr x dropout x
weight decay (GRID). One addition: the end of thinking is also a budget, because that is where the
probe is read at test time.
"""
import copy
import json
import math
import os
import random
import re

import torch

import probe as probe_lib
from grpo import pack, token_logprobs
from data import chat_prompt
from grade import is_correct
from label import absolute_budgets, mc_labels
from rollout import generate
from score import budget_ends, score

SOURCES = ("probe", "probe-posthoc", "verbal", "logits")
EVAL_SUFFIX = "\n\nIf I were to give the final answer now, the final answer would be \\boxed{"
GRID = [(lr, p, wd) for lr in (1e-3, 5e-4, 1e-4) for p in (0.5, 0.8) for wd in (1e-3, 1e-2)]
_CONF_TAG = re.compile(r"<confidence>\s*(.*?)\s*</confidence>", re.S | re.I)
_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?")


def verbal_confidence(text):
    """(confidence, missing) from the last <confidence> tag: "0.8" -> 0.8, "85" or "85%" -> 0.85.

    Values are clipped to [0, 1]; no tag or no number in it -> (0.5, True).
    """
    tags = _CONF_TAG.findall(text)
    m = _NUMBER.search(tags[-1]) if tags else None
    if m is None:
        return 0.5, True
    v = float(m.group())
    if v > 1:
        v /= 100.0
    return min(max(v, 0.0), 1.0), False


def think_end(response, close_id):
    """Thinking length: index of the first `</think>` id in the response ids, else len(response)."""
    response = list(response)
    return response.index(close_id) if close_id in response else len(response)


def _device(model):
    return next(model.parameters()).device


def logit_confidence(model, prompts, responses, pad_id, batch_size=8):
    """exp(mean_t log p(response token t)) at temperature 1, one float per response (EOS included).

    prompts, responses: N lists of ids. Runs grpo.token_logprobs over grpo.pack micro-batches.
    """
    out = []
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            b = pack(prompts[s:s + batch_size], responses[s:s + batch_size], pad_id)
            dev = _device(model)
            logp = token_logprobs(model, b["input_ids"].to(dev), b["attention_mask"].to(dev)).float().cpu()
            m = b["loss_mask"]
            mean = (logp * m).sum(1) / m.sum(1).clamp(min=1)
            out += torch.exp(mean).tolist()
    return out


def features(model, prompts, responses, budget_lists, pad_id, final_norm, batch_size=8):
    """Probe features at each budget of each response: N tensors [B_i, d] float32 on CPU.

    final_norm=False: training features (mean of the 4 pre-norm states before prompt_len + b);
    final_norm=True: the post-hoc feature (final normed state of the token at prompt_len + b - 1).
    """
    out = []
    for s in range(0, len(prompts), batch_size):
        ps, rs, bs = prompts[s:s + batch_size], responses[s:s + batch_size], budget_lists[s:s + batch_size]
        b = pack(ps, rs, pad_id)
        batch = {k: v.to(_device(model)) for k, v in b.items()}
        ends = budget_ends(b["prompt_lens"].tolist(), bs)
        _, feats, _ = score(model, batch, ends, final_norm=final_norm, logprobs=False)
        out += [feats[i, :len(bl)].float().cpu() for i, bl in enumerate(bs)]
    return out


def probe_confidences(prb, feats):
    """Probe probabilities for a list of [B_i, d] feature tensors -> list of lists of floats."""
    flat = torch.cat(feats) if feats else torch.zeros(0, prb.dim)
    probs = probe_lib.predict(prb, flat).cpu().tolist() if len(flat) else []
    out, s = [], 0
    for f in feats:
        out.append(probs[s:s + len(f)])
        s += len(f)
    return out


def posthoc_budgets(thinking, every):
    """Budgets every `every` thinking tokens plus the end of thinking: (20, 8) -> [8, 16, 20]."""
    bs = absolute_budgets(thinking, every)
    return bs + [thinking] if thinking > 0 and thinking not in bs else bs


def posthoc_examples(model, tokenizer, prompts, responses, golds, groups, close_id, every, k=16,
                     suffix=EVAL_SUFFIX, close="think", seed=0, batch_size=8, rows=64):
    """(feats [M, d], labels [M], groups [M]) for fitting a post-hoc probe on sampled responses.

    Each response contributes one example per budget in posthoc_budgets(thinking length, every);
    labels are Monte-Carlo fractions of k forced answers (label.mc_labels, temperature 0.6, top-p 0.95,
    at most 64 tokens); groups[i] is the problem index of the response, for the grouped split.
    batch_size: sequences per scoring forward; rows: sequences per forced-answer generation call.
    """
    bls = [posthoc_budgets(think_end(r, close_id), every) for r in responses]
    labels = mc_labels(model, tokenizer, prompts, responses, bls, golds, k=k, temperature=0.6, top_p=0.95,
                       max_new_tokens=64, close=close, suffix=suffix, seed=seed, batch_size=max(1, rows // k))
    feats = features(model, prompts, responses, bls, tokenizer.pad_token_id, True, batch_size)
    x = torch.cat(feats)                       # responses without budgets contribute [0, d]
    y = torch.tensor([v for ls in labels for v in ls], dtype=torch.float32)
    g = torch.tensor([grp for grp, bl in zip(groups, bls) for _ in bl], dtype=torch.long)
    return x, y, g


def bce(p, y):
    """Mean binary cross-entropy -(y log p + (1 - y) log(1 - p)), p clamped to [1e-6, 1 - 1e-6]."""
    p = torch.as_tensor(p, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    y = torch.as_tensor(y, dtype=torch.float64)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def split_groups(groups, val_frac=0.2, seed=0):
    """Boolean masks (train [M], val [M]): a seeded val_frac of the distinct groups goes to validation."""
    uniq = sorted(set(groups.tolist()))
    random.Random(seed).shuffle(uniq)
    val = set(uniq[:max(1, math.ceil(val_frac * len(uniq)))])
    is_val = torch.tensor([g in val for g in groups.tolist()], dtype=torch.bool)
    return ~is_val, is_val


def fit_posthoc(x, y, groups, seed=0, max_epochs=50, patience=5, batch_size=64, grid=GRID, device="cpu"):
    """Fit the post-hoc probe: grid search with early stopping, grouped 80/20 split.

    x [M, d], y [M] soft labels, groups [M]. For each (lr, dropout, weight decay) in grid: a fresh
    Probe(d, d // 4, dropout) with AdamW, one shuffled pass per epoch on the training part (minibatch 64,
    our choice: the protocol does not state one), stop after `patience` epochs without a lower validation
    BCE against round(y); keep the best epoch. Returns
    (probe with the lowest validation loss over the grid, report dict with its config, validation BCE
    on soft and rounded labels, and the same for the constant predictors mean(y_train) and
    mean(round(y_train))).
    """
    tr, va = split_groups(groups, seed=seed)
    if tr.sum() == 0 or va.sum() == 0:
        raise ValueError("post-hoc probe needs at least two problems with labelled prefixes; raise --probe-questions")
    xt, yt, xv, yv = (t.to(device) for t in (x[tr], y[tr], x[va], y[va]))
    best = (math.inf, None, None)
    for lr, drop, wd in grid:
        torch.manual_seed(seed)
        prb = probe_lib.Probe(x.shape[1], dropout=drop).to(device)
        opt = probe_lib.make_optimizer(prb, lr=lr, weight_decay=wd)
        run_best, state, bad = math.inf, None, 0
        for epoch in range(max_epochs):
            probe_lib.fit(prb, opt, xt, yt, passes=1, batch_size=batch_size, seed=seed + epoch)
            loss = bce(probe_lib.predict(prb, xv), yv.round())
            if loss < run_best - 1e-6:
                run_best, state, bad = loss, copy.deepcopy(prb.state_dict()), 0
            else:
                bad += 1
                if bad >= patience:
                    break
        if run_best < best[0]:
            best = (run_best, state, dict(lr=lr, dropout=drop, weight_decay=wd))
    prb = probe_lib.Probe(x.shape[1], dropout=best[2]["dropout"])
    prb.load_state_dict(best[1])
    yt, yv = yt.cpu(), yv.cpu()
    pv = probe_lib.predict(prb, xv.cpu())
    # The constant predictors: the training base rate of the soft labels and of the rounded ones.
    base, base_r = torch.full_like(yv, float(yt.mean())), torch.full_like(yv, float(yt.round().mean()))
    report = dict(best[2], n_train=int(tr.sum()), n_val=int(va.sum()),
                  val_bce=bce(pv, yv), val_bce_rounded=bce(pv, yv.round()),
                  base_rate=float(yt.mean()), base_bce=bce(base, yv), base_bce_rounded=bce(base_r, yv.round()))
    return prb, report


def sample_confidences(source, model, tokenizer, prompts, responses, texts, golds, prb=None,
                       close_id=None, every=None, exit_k=1, suffix=EVAL_SUFFIX, close="think", seed=0,
                       batch_size=8, rows=64):
    """One confidence per response, plus per-sample extras for the results.

    Returns (conf [N] floats, extras [N] dicts). verbal: extras {"verbal_missing": bool}. Probe sources
    with `every`: extras {"checkpoints": [[t, c_t, y_t], ...]} for t = every, 2 * every, ... below the
    end of thinking: the probe's confidence after t thinking tokens and whether one forced answer there
    (what an early exit would output; temperature 0.6, top-p 0.95) is right, for uses.early_exit.
    """
    if source == "verbal":
        pairs = [verbal_confidence(t) for t in texts]
        return [c for c, _ in pairs], [{"verbal_missing": m} for _, m in pairs]
    if source == "logits":
        return logit_confidence(model, prompts, responses, tokenizer.pad_token_id, batch_size), [{} for _ in texts]
    if source not in ("probe", "probe-posthoc") or prb is None:
        raise ValueError(f"confidence source {source!r} needs a probe; sources: {', '.join(SOURCES)}")
    ends = [think_end(r, close_id) for r in responses]
    bls = [([b for b in absolute_budgets(te, every) if b < te] if every else []) + [te] for te in ends]
    feats = features(model, prompts, responses, bls, tokenizer.pad_token_id, source == "probe-posthoc",
                     batch_size)
    confs = probe_confidences(prb, feats)
    extras = [{} for _ in texts]
    if every:
        ys = mc_labels(model, tokenizer, prompts, responses, [bl[:-1] for bl in bls], golds, k=exit_k,
                       temperature=0.6, top_p=0.95, max_new_tokens=64, close=close, suffix=suffix,
                       seed=seed, batch_size=max(1, rows // exit_k))
        extras = [{"checkpoints": [[b, round(c, 6), y] for b, c, y in zip(bl, cs, yl)]}
                  for bl, cs, yl in zip(bls, confs, ys)]
    return [cs[-1] for cs in confs], extras


def posthoc_probe(cache, model, tokenizer, questions, instruction, close_id, n=4, max_new_tokens=8000,
                  temperature=0.6, top_p=1.0, every=500, k=16, suffix=EVAL_SUFFIX, close="think", seed=0,
                  batch_size=8, rows=64):
    """The post-hoc probe of a model: loaded from `cache`.pt / .json if there, else fitted and saved.

    Fitting samples n responses per question ({problem, answer}), labels their prefixes
    (posthoc_examples) and runs fit_posthoc. Returns (probe, report).
    """
    if os.path.exists(cache + ".pt") and os.path.exists(cache + ".json"):
        with open(cache + ".json") as f:
            return probe_lib.load(cache + ".pt")[0], json.load(f)
    prompts = [chat_prompt(tokenizer, r["problem"], instruction) for r in questions]
    out = generate(model, tokenizer, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, batch_size=max(1, rows // n))
    rep = [p for p in prompts for _ in range(n)]
    golds = [r["answer"] for r in questions for _ in range(n)]
    groups = [q for q in range(len(questions)) for _ in range(n)]
    x, y, g = posthoc_examples(model, tokenizer, rep, out.ids, golds, groups, close_id, every, k, suffix,
                               close, seed + 1, batch_size, rows)
    prb, report = fit_posthoc(x, y, g, seed=seed, device=_device(model))
    report.update(questions=len(questions), samples=len(rep), prefixes=len(y), label_mean=float(y.mean()),
                  accuracy=sum(is_correct(t, a) for t, a in zip(out.texts, golds)) / len(golds))
    probe_lib.save(cache + ".pt", prb)
    with open(cache + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return prb, report
