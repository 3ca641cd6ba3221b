"""Where a sample's confidence, a number in [0, 1], comes from at evaluation (sample_confidences):
  probe          the run's own probe.pt, on the training feature at the last of the run's budgets
                 (where it saw data; not at the end of thinking)
  probe-posthoc  the post-hoc probe (evaluation/posthoc.py) on the final normed state of the last
                 thinking token
  verbal         the last <confidence> tag (RLCR's format; baselines.verbal_confidence)
  verbal-forced  RLCR's released reading: the mean tag of k re-answers forced after the thinking
                 cut at the budget (forced_verbal)
  logits         exp(mean log-prob of the response) at the run's training temperature, where C2GSPG
                 trained it (logit_confidence)
"""
import math

import torch

import decode
import probe as probe_lib
from baselines import verbal_confidence  # RLCR's parser, read here for --confidence verbal
from grade import answer_tag, blank_answer
from grpo import pack, token_logprobs
from label import cuts_of, mc_labels
from data import RLCR_FORMAT
from rollout import generate
from update import cut_ends, forward_pass
from harness import plan, staticcache

SOURCES = ("probe", "probe-posthoc", "verbal", "verbal-forced", "logits")
# The released forced answer's text, after the cut thinking and `</think>` (exit checkpoints, post-hoc labels).
EVAL_SUFFIX = "\n\nIf I were to give the final answer now, the final answer would be \\boxed{"
# RLCR's released forced re-answer (2_budget_eval_rlcr), after the thinking cut at the budget.
RLCR_REANSWER = ("...</think>\n\nI am out of time, let me just output the final answer and confidence analysis "
                 "in exactly this format:\n" + RLCR_FORMAT + "\n\n<answer>")


def sample_confidences(source, model, tokenizer, prompts, responses, texts, golds, prb=None,
                       close_id=None, every=None, exit_k=1, suffix=EVAL_SUFFIX, close="think", seed=0,
                       batch_size=8, rows=64, fractions=(0.25, 0.5, 0.75), forced_k=16, budget=8000,
                       reanswer=RLCR_REANSWER, logit_temperature=0.8):
    """(conf [N] floats, extras [N] dicts): one confidence per response, probes read at read_point
    (`fractions`: the run's config's). verbal: extras {"verbal_missing": bool};
    verbal-forced: {"verbal_missing": how many of the forced_k re-answers had no tag}. Probe sources
    with `every`: {"checkpoints": [[t, c_t, y_t], ...]} for t = every, 2 * every, ... below the end of
    thinking: the probe's confidence after t thinking tokens and whether one forced answer there
    (what an early exit would output; T 0.6, top-p 0.95) is right, for uses.early_exit.
    """
    if source == "verbal":
        pairs = [verbal_confidence(t) for t in texts]
        return [c for c, _ in pairs], [{"verbal_missing": m} for _, m in pairs]
    if source == "verbal-forced":
        conf, missing = forced_verbal(model, tokenizer, prompts, responses, close_id, budget, forced_k,
                                      seed=seed, batch_size=rows, close_text=reanswer)
        return conf, [{"verbal_missing": m} for m in missing]
    if source == "logits":
        conf = logit_confidence(model, prompts, responses, tokenizer.pad_token_id, batch_size, logit_temperature)
        if not all(math.isfinite(c) for c in conf):  # never a NaN row in samples.jsonl
            raise FloatingPointError(f"{sum(not math.isfinite(c) for c in conf)} of {len(conf)} logit "
                                     "confidences are NaN or inf: the model's weights hold NaN or inf")
        return conf, [{} for _ in texts]
    if source not in ("probe", "probe-posthoc") or prb is None:
        raise ValueError(f"confidence source {source!r} needs a probe; sources: {', '.join(SOURCES)}")
    staticcache.release(model)  # the generation's static shape: neither the features nor the labels reuse it
    ends = [think_end(r, close_id) for r in responses]
    bls = [([b for b in absolute_cuts(te, every) if b < te] if every else []) +
           [read_point(source, r, close_id, fractions)] for r, te in zip(responses, ends)]
    feats = features(model, prompts, responses, bls, tokenizer.pad_token_id, source == "probe-posthoc",
                     batch_size)
    confs = probe_confidences(prb, feats)
    extras = [{} for _ in texts]
    if every:
        # On a GPU, fewer cuts where a chunk of them would not fit: a speed choice only, since each
        # forced answer draws from its own stream (label.py), whatever chunk it lands in.
        chunk = max(1, rows // exit_k)
        if _device(model).type == "cuda":
            width = max((len(p) + max(bl) for p, bl in zip(prompts, bls)), default=0) + plan.FORCED_SUFFIX
            chunk = plan.label_chunk(chunk, exit_k, width, model.config, plan.free_bytes(_device(model)))
        ys = mc_labels(model, tokenizer, prompts, responses, [bl[:-1] for bl in bls], golds, k=exit_k,
                       temperature=0.6, top_p=0.95, max_new_tokens=64, close=close, suffix=suffix,
                       seed=seed, batch_size=chunk)
        staticcache.release(model)  # nor does the next batch's generation reuse the labels' shape
        extras = [{"checkpoints": [[b, round(c, 6), y] for b, c, y in zip(bl, cs, yl)]}
                  for bl, cs, yl in zip(bls, confs, ys)]
    return [cs[-1] for cs in confs], extras


def absolute_cuts(length, every):
    """Cuts every `every` tokens, up to and including `length` if it falls on one:
    absolute_cuts(1200, 500) == [500, 1000]."""
    return list(range(every, length + 1, every))


def read_point(source, response, close_id, fractions=(0.25, 0.5, 0.75)):
    """Where a probe is read, in response tokens: the post-hoc probe at the end of thinking, the run's
    own at its last training cut (label.cuts_of with the run's fractions: 6 of 8 tokens)."""
    if source == "probe":
        return max(cuts_of(len(response), fractions), default=0)
    return think_end(response, close_id)


def forced_verbal(model, tokenizer, prompts, responses, close_id, budget, k, seed=None, batch_size=8,
                  close_text=RLCR_REANSWER, max_new_tokens=1000):
    """(conf [N], missing [N]): per response, the mean reanswer_confidence of k re-answers forced after
    `prompt + thinking[:budget] + close_text` (released: RLCR_REANSWER, tokenized on its own; None:
    the `</think>` id alone, for the toy), and how many of the k had no readable tag."""
    if close_id is None:
        raise ValueError("--confidence verbal-forced needs a `</think>` token in the tokenizer")
    close = [close_id] if close_text is None else tokenizer.encode(close_text, add_special_tokens=False)
    forced = [list(p) + list(r[:min(think_end(r, close_id), budget)]) + close for p, r in zip(prompts, responses)]
    texts = sample_by_length(model, tokenizer, forced, k, max_new_tokens=max_new_tokens, temperature=0.6,
                             top_p=0.95, seed=seed, batch_size=max(1, batch_size // k))
    read = [[reanswer_confidence(t) for t in ts] for ts in texts]
    return [sum(c for c, _ in r) / len(r) for r in read], [sum(m for _, m in r) for r in read]


def reanswer_confidence(text):
    """(confidence, missing) of one forced RLCR re-answer as released (2_budget_eval --rlcr): its
    verbal confidence, but (0.5, True) where it has no complete <answer> tag, or a blank one, and
    holds a `\\boxed{` (the released boxed fallback). The re-answer continues an opened `<answer>`:
    its `</answer>` closes that one. reanswer_confidence("\\boxed{5} <confidence>0.9</confidence>") ==
    (0.5, True); reanswer_confidence("5</answer> <confidence>0.9</confidence>") == (0.9, False)."""
    tagged = text if "<answer>" in text or "</answer>" not in text else "<answer>" + text
    if "\\boxed{" in text and blank_answer(answer_tag(tagged)):
        return 0.5, True
    return verbal_confidence(text)


def sample_by_length(model, tokenizer, prompts, k, run=None, **kw):
    """The k sampled texts of each prompt (lists, in the order given); on the static path (CUDA)
    sampled shortest prompt first, so that a chunk holds prompts of about one width (one static
    shape) rather than a rollout's budgets in turn. run: the generate called (rollout.generate's).
    """
    order = list(range(len(prompts)))
    if decode.default_decode(model) == "static":
        order.sort(key=lambda i: len(prompts[i]))
    out = (run or generate)(model, tokenizer, [list(prompts[i]) for i in order], n=k, **kw)
    texts = [None] * len(prompts)
    for j, i in enumerate(order):
        texts[i] = out.texts[j * k:(j + 1) * k]
    return texts


def think_end(response, close_id):
    """Thinking length: index of the first `</think>` id in the response ids, else len(response)."""
    response = list(response)
    return response.index(close_id) if close_id in response else len(response)


def _device(model):
    return next(model.parameters()).device


def logit_confidence(model, prompts, responses, pad_id, batch_size=8, temperature=0.8):
    """exp(mean_t log p_T(response token t)) with logits / temperature, one float per response (EOS
    included): C2GSPG's confidence, trained at the sampling temperature; temperature=1: the raw model's.
    """
    out = []
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            b = pack(prompts[s:s + batch_size], responses[s:s + batch_size], pad_id)
            dev = _device(model)
            logp = token_logprobs(model, b["input_ids"].to(dev), b["attention_mask"].to(dev), temperature).float().cpu()
            m = b["loss_mask"]
            mean = (logp * m).sum(1) / m.sum(1).clamp(min=1)
            out += torch.exp(mean).tolist()
    return out


def features(model, prompts, responses, cut_lists, pad_id, final_norm, batch_size=8):
    """Probe features at each cut of each response, N tensors [B_i, d] float32 on CPU: the training
    feature, or with final_norm the post-hoc one (the final normed state at prompt_len + b - 1)."""
    out = []
    for s in range(0, len(prompts), batch_size):
        ps, rs, bs = prompts[s:s + batch_size], responses[s:s + batch_size], cut_lists[s:s + batch_size]
        b = pack(ps, rs, pad_id)
        batch = {k: v.to(_device(model)) for k, v in b.items()}
        ends = cut_ends(b["prompt_lens"].tolist(), bs)
        _, feats, _ = forward_pass(model, batch, ends, final_norm=final_norm, logprobs=False)
        out += [feats[i, :len(bl)].float().cpu() for i, bl in enumerate(bs)]
    return out


def probe_confidences(prb, feats):
    """Probe probabilities for a list of [B_i, d] feature tensors -> list of lists of floats."""
    sizes = [len(f) for f in feats]
    probs = probe_lib.predict(prb, torch.cat(feats)).cpu() if sum(sizes) else torch.zeros(0)
    return [p.tolist() for p in probs.split(sizes)]
