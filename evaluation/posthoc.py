"""The post-hoc probe (--confidence probe-posthoc, the paper's probe rows): fitted on a model after
training with the released evaluation protocol, then read by evaluation/confidence.py at the end of
thinking. posthoc_probe samples, labels and fits it, and caches it per model in evaluate.py's --out.
The protocol, its flags and where it differs from the release: docs/reference.md, "Evaluation".
"""
import copy
import functools
import hashlib
import json
import math
import os
import pickle
import random
import sys
import zipfile

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import probe as probe_lib
from data import row_prompt
from grade import answers_match, boxed_answer, boxed_in_thinking, code_job, is_correct
from label import forced_prompt
from evaluation import shard
from evaluation.confidence import EVAL_SUFFIX, features, sample_by_length, think_end
from harness import files, sandbox, staticcache
from harness.parallel import MASTER

EVAL_LEAD = "..."  # released: the cut thinking ends in "..." before `</think>` + EVAL_SUFFIX
# Code benchmarks (released 2_budget_eval, LiveCodeBench): the forced answer is a whole program, up to
# CODE_TOKENS tokens after "..." + `</think>` + CODE_SUFFIX, graded by running it (grade's "code").
CODE_SUFFIX = "\n\nHere is my final Python solution:\n"
CODE_TOKENS = 2048
GRID = [(lr, p, wd) for lr in (1e-3, 5e-4, 1e-4) for p in (0.5, 0.8) for wd in (1e-3, 1e-2)]


def posthoc_probe(cache, model, tokenizer, questions, instruction, close_id, protocol, batch_size=8, rows=64,
                  system=None):
    """(probe, report) of a model: read from `cache`.pt (probe and report in one file) if fitted
    there with the same protocol, else fitted (posthoc_examples, fit_posthoc) and saved, the report
    copied to `cache`.json for people. protocol: the dict evaluation/probes.py builds from the flags.
    Every rank of evaluate.py's workers calls this and gets a share of the sampling and grading
    (evaluation/shard.py); rank 0 alone reads the cache and fits, the others return (None, None).
    """
    p = cache_protocol(protocol, questions, instruction, system)
    cached = read_cache(cache + ".pt") if MASTER and os.path.exists(cache + ".pt") else None
    if shard.share(cached is not None and cached[1].get("protocol") == p):
        return cached if MASTER else (None, None)
    say(f"fitting it (then cached in {cache}.pt): {len(questions)} questions x {p['n']} rollouts, forced "
        f"answers at their budgets, a fit over {len(GRID)} settings")
    prompts = [row_prompt(tokenizer, r, instruction, system) for r in questions]
    out = shard.generate_dealt(model, tokenizer, prompts, n=p["n"], max_new_tokens=p["max_new_tokens"],
                               temperature=p["temperature"], top_p=p["top_p"], seed=p["seed"],
                               batch_size=max(1, rows // p["n"]), progress="post-hoc rollouts")
    staticcache.release(model)  # the labels below have shapes of their own
    rep = [q for q in prompts for _ in range(p["n"])]
    golds = [r["answer"] for r in questions for _ in range(p["n"])]
    groups = [q for q in range(len(questions)) for _ in range(p["n"])]
    x, y, g, stats = posthoc_examples(model, tokenizer, rep, out.ids, out.texts, golds, groups, close_id,
                                      p["every"], p["count"], p["k"], p["suffix"], p["close"], tuple(p["stop"]),
                                      p["copy_natural"], p["seed"] + 1, batch_size, rows, p["lead"], p["gate"],
                                      p.get("grader", "math"), p.get("tokens", "sampled"),
                                      functools.partial(shard.generate_dealt, progress="post-hoc forced answers"))
    if not MASTER:
        return None, None
    prb, report = fit_posthoc(x, y, g, seed=p["seed"], max_epochs=p["epochs"], patience=p["patience"],
                              batch_size=p["batch"], val_frac=p["val_frac"], device=next(model.parameters()).device,
                              rule=p.get("fit", "released"))
    report.update(stats, protocol=p, questions=len(questions), samples=len(rep), prefixes=len(y),
                  label_mean=float(y.mean()),
                  accuracy=sum(is_correct(t, a, p.get("grader", "math")) for t, a in zip(out.texts, golds)) / len(golds))
    report["log"] = protocol_line(p, report)
    print(report["log"], file=sys.stderr)
    with files.replacing(cache + ".pt", "wb") as f:   # the one file read back: probe and report together
        probe_lib.save(f, prb, report=json.dumps(report))
    files.write_json(cache + ".json", report, indent=1)   # a copy to read; never read back
    return prb, report


def say(phase):
    """One line on stderr per phase of the post-hoc fit, which takes minutes between its bars."""
    if MASTER:
        print(f"post-hoc probe: {phase}", file=sys.stderr, flush=True)


def posthoc_examples(model, tokenizer, prompts, responses, texts, golds, groups, close_id, every=500,
                     count=16, k=16, suffix=EVAL_SUFFIX, close="think", stop=(), copy_natural=True,
                     seed=0, batch_size=8, rows=64, lead=EVAL_LEAD, gate="thinking", grader="math",
                     tokens="sampled", run=None):
    """(feats [M, d], labels [M], groups [M] problem indices, stats), M = count * N: one example
    per rollout and budget of posthoc_budgets, the feature the final normed state of the last token
    of prompt + thinking[:b], the label posthoc_labels'. batch_size: sequences per scoring forward;
    rows: per forced-answer generation call. tokens="text" (released): the thinking re-tokenized
    from its text, and the forced prompts without the prompt's BOS (the features keep it).
    """
    ends = [think_end(r, close_id) for r in responses]
    forced = prompts
    if tokens == "text":
        responses = [tokenizer.encode(tokenizer.decode(r[:e]), add_special_tokens=False)
                     for r, e in zip(responses, ends)]
        ends = [len(r) for r in responses]
        bos = tokenizer.bos_token_id
        forced = [p[1:] if bos is not None and p[:1] == [bos] else p for p in map(list, prompts)]
    positions = [posthoc_budgets(e, every, count) for e in ends]
    labels, copied = posthoc_labels(model, tokenizer, forced, responses, texts, golds, positions, ends, k,
                                    suffix, close, stop, copy_natural, CODE_TOKENS if grader == "code" else 64,
                                    seed=seed, rows=rows, lead=lead, gate=gate, grader=grader, run=run)
    say(f"reading the hidden state at {sum(map(len, positions))} prefixes")

    def scored(starts):
        return [features(model, prompts[s:s + batch_size], responses[s:s + batch_size],
                         positions[s:s + batch_size], tokenizer.pad_token_id, True, batch_size) for s in starts]
    x = torch.cat([f for batch in shard.spread(scored, list(range(0, len(prompts), batch_size))) for f in batch])
    y = torch.tensor([v for ls in labels for v in ls], dtype=torch.float32)
    g = torch.tensor([grp for grp, ps in zip(groups, positions) for _ in ps], dtype=torch.long)
    past = sum(b >= e for ps, e in zip(positions, ends) for b in ps)
    return x, y, g, dict(examples=len(y), past_end=past, natural_copied=copied)


def posthoc_budgets(thinking, every=500, count=16):
    """The released budgets every, 2 * every, ..., count * every as the prefix length read at each,
    one past the end of thinking reading its end: posthoc_budgets(20, 8, 4) == [8, 16, 20, 20]."""
    return [min(every * (i + 1), thinking) for i in range(count)]


def posthoc_labels(model, tokenizer, prompts, responses, texts, golds, positions, ends, k=16,
                   suffix=EVAL_SUFFIX, close="think", stop=(), copy_natural=True, max_new_tokens=64,
                   seed=0, rows=64, lead=EVAL_LEAD, gate="thinking", grader="math", run=None):
    """(Y_b for each rollout's budget positions: N lists of floats, how many were copied). At the end of thinking (ends[i]) of a thinking that holds a box (gate="thinking"; "none": a box
    anywhere), the natural answer's grade is copied (copy_natural). Elsewhere Y_b is the share of k
    answers forced from `prompt + response[:b] + lead + CLOSE + suffix` (T 0.6, top-p 0.95) that
    are right, read from the last box of `suffix + answer`; equal forced prompts are sampled once.
    grader="code": answers are programs, run against the gold's tests (sandbox.grade_many).
    run: the generate the forced answers are sampled with (sample_by_length's).
    """
    lead_ids = tokenizer.encode(lead, add_special_tokens=False) if lead else []
    labels, todo, copied = [], {}, 0
    programs = None if grader != "code" else shard.spread(sandbox.grade_many,
                                                          [code_job(t, g) for t, g in zip(texts, golds)])
    for i, ps in enumerate(positions):
        if programs is not None:
            natural = float(programs[i])
        else:
            boxed = boxed_in_thinking(texts[i]) if gate == "thinking" else boxed_answer(texts[i]) is not None
            natural = float(is_correct(texts[i], golds[i])) if boxed else None
        row = []
        for b in ps:
            if copy_natural and b >= ends[i] and natural is not None:
                row.append(natural)
                copied += 1
            else:
                cut = list(responses[i][:b]) + lead_ids
                key = tuple(forced_prompt(prompts[i], cut, len(cut), tokenizer, close, suffix))
                row.append(todo.setdefault(key, (len(todo), golds[i]))[0])
        labels.append(row)
    y = []
    if todo:
        texts = sample_by_length(model, tokenizer, list(todo), k, max_new_tokens=max_new_tokens, temperature=0.6,
                                 top_p=0.95, stop=stop, seed=seed, batch_size=max(1, rows // k), run=run)
        forced = [(ts, gold) for ts, (_, gold) in zip(texts, todo.values())]
        say(f"grading {len(todo) * k} forced answers")
        if grader == "code":
            passed = iter(shard.spread(sandbox.grade_many, [code_job(t, gold) for ts, gold in forced for t in ts]))
            y = [sum(next(passed) for _ in ts) / k for ts in texts]
        else:
            y = shard.spread(lambda part: [sum(answers_match(boxed_answer(suffix + t), gold) for t in ts) / k
                                           for ts, gold in part], forced)
    labels = [[v if isinstance(v, float) else y[v] for v in row] for row in labels]
    return labels, copied


def fit_posthoc(x, y, groups, seed=42, max_epochs=100, patience=30, batch_size=64, grid=GRID, device="cpu",
                val_frac=0.2, plateau=(0.5, 5), rule="released"):
    """The released fit (docs/reference.md, "Evaluation"): x [M, d], y [M] soft labels, groups [M],
    split by split_groups, a fresh Probe per grid point (torch seed `seed`), val_loss against
    round(y) ("project": lower by 1e-6 to count). Returns (the grid's best probe, report: its
    settings, the split, its validation BCE beside the constant predictors mean(y_train) and
    mean(round(y_train))).
    """
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"post-hoc probe: {int((~torch.isfinite(x)).any(1).sum())} of {len(x)} "
                                 "features are NaN or inf: the model's weights hold NaN or inf")
    tr, va = split_groups(groups, val_frac, seed, rule)
    if len(tr) == 0 or len(va) == 0:
        raise ValueError("post-hoc probe needs at least two problems with labelled prefixes; raise --probe-questions")
    xt, yt, xv, yv = (t.to(device) for t in (x[tr], y[tr], x[va], y[va]))
    best, runs = (math.inf, None, None), []
    for lr, drop, wd in tqdm(grid, desc="post-hoc fit over the grid"):
        torch.manual_seed(seed)
        prb = probe_lib.Probe(x.shape[1], dropout=drop).to(device)
        opt = probe_lib.make_optimizer(prb, lr=lr, weight_decay=wd)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=plateau[0], patience=plateau[1])
        run_best, state, bad, best_epoch = math.inf, None, 0, 0
        for epoch in range(max_epochs):
            probe_lib.fit(prb, opt, xt, yt, passes=1, batch_size=batch_size, seed=seed + epoch)
            loss = val_loss(prb, xv, yv.round(), batch_size, rule)
            sched.step(loss)
            if loss < run_best - (1e-6 if rule == "project" else 0):
                run_best, state, bad, best_epoch = loss, copy.deepcopy(prb.state_dict()), 0, epoch + 1
            else:
                bad += 1
                if bad >= patience:
                    break
        runs.append(dict(lr=lr, dropout=drop, weight_decay=wd, epochs=epoch + 1, best_epoch=best_epoch,
                         val_loss=run_best))
        if run_best < best[0]:
            best = (run_best, state, runs[-1])
    if best[1] is None:
        raise FloatingPointError("post-hoc probe: no fit in the grid reached a finite validation loss")
    prb = probe_lib.Probe(x.shape[1], dropout=best[2]["dropout"])
    prb.load_state_dict(best[1])
    yt, yv = yt.cpu(), yv.cpu()
    pv = probe_lib.predict(prb, xv.cpu())
    base, base_r = torch.full_like(yv, float(yt.mean())), torch.full_like(yv, float(yt.round().mean()))
    report = dict(best[2], n_train=len(tr), n_val=len(va),
                  val_problems=len(set(groups[va].tolist())), train_problems=len(set(groups[tr].tolist())),
                  val_bce=bce(pv, yv), val_bce_rounded=bce(pv, yv.round()), base_rate=float(yt.mean()),
                  base_bce=bce(base, yv), base_bce_rounded=bce(base_r, yv.round()), grid=runs)
    return prb, report


def split_groups(groups, val_frac=0.2, seed=42, rule="released"):
    """(train [M_t] ascending, val [M_v]) example indices, whole problems on one side. "released"
    (build_group_split_indices): problems by first appearance, shuffled by np.random.RandomState(seed),
    added to val while it holds < max(1, int(M * val_frac)) examples, val in that order (val_loss's
    batches). "project": random.Random(seed) over the sorted problems, until >= val_frac * M, val
    ascending."""
    ids = groups.tolist()
    order = list(dict.fromkeys(ids))
    if rule == "released":
        np.random.RandomState(seed).shuffle(order)
        target = max(1, int(len(ids) * val_frac))
    else:
        order = sorted(order)
        random.Random(seed).shuffle(order)
        target = val_frac * len(ids)
    members = {q: [] for q in order}
    for i, q in enumerate(ids):
        members[q].append(i)
    val = []
    for q in order:
        if len(val) >= target:
            break
        val += members[q]
    val = val if rule == "released" else sorted(val)
    held = set(val)
    train = [i for i in range(len(ids)) if i not in held]
    return torch.tensor(train, dtype=torch.long), torch.tensor(val, dtype=torch.long)


def val_loss(prb, x, y, batch_size=64, rule="released"):
    """BCE of the probe on x [M, d] against y [M]: "released", the mean of per-batch means (batches of
    batch_size in x's order: a short last batch weighs as a full one); "project", one mean (bce)."""
    if rule == "project":
        return bce(probe_lib.predict(prb, x), y)
    prb.eval()
    with torch.no_grad():
        logits = prb(x.float())
    means = [F.binary_cross_entropy_with_logits(logits[s:s + batch_size], y[s:s + batch_size].float()).item()
             for s in range(0, len(y), batch_size)]
    return sum(means) / len(means)


def bce(p, y):
    """Mean binary cross-entropy -(y log p + (1 - y) log(1 - p)), p clamped to [1e-6, 1 - 1e-6]."""
    p = torch.as_tensor(p, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    y = torch.as_tensor(y, dtype=torch.float64)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def cache_protocol(protocol, questions, instruction, system=None):
    """What a cached post-hoc probe must have been fitted with to be reused: the protocol, and the fit
    data (the same count of other questions, or another prompt, is another probe)."""
    fit_data = [[r["problem"], r["answer"]] for r in questions] + [instruction, system]
    return dict(protocol, questions=len(questions), stop=list(protocol["stop"]),
                data=hashlib.sha256(json.dumps(fit_data).encode()).hexdigest()[:16])


def read_cache(path):
    """(probe, report) of a post-hoc cache file, or None with one line naming it where it is damaged
    (cut short, not a probe, a pickle payload, NaN weights, no report): the probe is fitted again.
    Read with weights_only and checked by probe.load before anything of its sizes is built."""
    try:
        prb = probe_lib.load(path)[0]
        report = json.loads(torch.load(path, map_location="cpu", weights_only=True).get("report") or "null")
        if isinstance(report, dict):
            return prb, report
        why = "it holds no report (an older version's file)"
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: never here
        why = "it holds objects other than tensors; not loaded"
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, KeyError, zipfile.BadZipFile,
            FloatingPointError) as e:
        why = files.first_line(e)
    print(f"warning: post-hoc probe cache {path} is damaged ({why}): fitting the probe again", file=sys.stderr)
    return None


def protocol_line(p, report):
    """The post-hoc fit in one paragraph: what was sampled, labelled, split and chosen."""
    stop = ", ".join(map(repr, p["stop"])) or "none"
    val_share = report["n_val"] / max(report["n_train"] + report["n_val"], 1)
    return (f"post-hoc probe protocol: {p['questions']} problems x {p['n']} samples (T {p['temperature']}, "
            f"top-p {p['top_p']}, <= {p['max_new_tokens']} tokens); {p['count']} budgets every {p['every']} "
            f"thinking tokens per rollout, past the end of thinking: its feature and label "
            f"({report['past_end']} of {report['examples']} examples, natural answer copied for "
            f"{report['natural_copied']}); forced text {p['lead']!r} + {'</think>' if p['close'] == 'think' else 'EOS'!r} + {p['suffix']!r}, {p['k']} answers at "
            f"T 0.6, top-p 0.95, <= 64 tokens, stop {stop}, answer from the last box; split seed {p['seed']}: "
            f"train {report['n_train']} examples ({report['train_problems']} problems) / val {report['n_val']} "
            f"({report['val_problems']} problems, {val_share:.1%}); up to {p['epochs']} epochs, patience "
            f"{p['patience']}, ReduceLROnPlateau(0.5, 5), batch {p['batch']}; grid winner lr {report['lr']} "
            f"dropout {report['dropout']} wd {report['weight_decay']} after {report['epochs']} epochs (best "
            f"{report['best_epoch']}); val BCE {report['val_bce']:.4f} vs {report['base_bce']:.4f} for a constant, which "
            f"also ignores whether a prefix is past the end of thinking (there the label is the natural grade)")
