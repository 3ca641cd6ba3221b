"""Where a sample's confidence in [0, 1] comes from at evaluation (sample_confidences):
  probe          the run's own probe.pt at the last of the run's budgets, where it saw data
  probe-posthoc  the post-hoc probe (posthoc_probe) at the end of thinking, fitted with the released
                 protocol on questions no evaluated benchmark holds, cached in --out
  verbal         the last <confidence> tag (RLCR's format; baselines.verbal_confidence)
  verbal-forced  RLCR's released reading: the mean tag of k forced re-answers (forced_verbal)
  logits         exp(mean log-prob of the response) at the run's temperature (logit_confidence)
The protocol and where it differs from the release: docs/reference.md, "Evaluation"."""
import copy
import json
import math
import os
import pickle
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import ReduceLROnPlateau
from tqdm import tqdm

import data
import probe as probe_lib
import rollout
import toy
from baselines import verbal_confidence
from grade import answer_tag, answers_match, blank_answer, boxed_answer, boxed_in_thinking, code_job
from grade import is_correct
from grpo import pack, token_logprobs
import label as label_lib
from label import FORCED, closed_cut, cut_ends, cuts_of, forward_pass, mc_labels
from rollout import generate
from evaluation.benchmarks import (EVAL_SUFFIX, REAL, RLCR_REANSWER, TOY, digest, generate_dealt,
                                   model_id, settings, share, spread)
from harness import checkpoint, files, plan, sandbox, staticcache
from harness.files import UserError
from harness.parallel import MASTER

SOURCES = ("probe", "probe-posthoc", "verbal", "verbal-forced", "logits")
TOY_SOURCES = [f"{name}:test" for name in data.TOY_BENCHMARKS]   # all toy: a post-hoc fit on train
EVAL_LEAD = "..."  # released: the cut thinking ends in "..." before `</think>` + EVAL_SUFFIX
CODE_TOKENS = 2048   # the longest forced program (benchmarks.CODE_SUFFIX)
GRID = [(lr, p, wd) for lr in (1e-3, 5e-4, 1e-4) for p in (0.5, 0.8) for wd in (1e-3, 1e-2)]


def sample_confidences(source, model, tokenizer, prompts, responses, texts, golds, prb=None,
                       close_id=None, every=None, suffix=EVAL_SUFFIX, close="think", seed=0,
                       batch_size=8, rows=64, fractions=(0.25, 0.5, 0.75), forced_k=16, budget=8000,
                       reanswer=RLCR_REANSWER, logit_temperature=0.8):
    """(conf [N] floats, extras [N] dicts): one confidence per response (the run's own probe at
    label.cuts_of's last cut with the run's `fractions`). verbal: extras {"verbal_missing": bool};
    verbal-forced: {"verbal_missing": how many of the forced_k had no tag}. Probe sources with
    `every`: {"checkpoints": [[t, c_t, y_t], ...]} for t = every, 2 * every, ... below the end of
    thinking: the confidence there and whether one forced answer (T 0.6, top-p 0.95) is right."""
    if source == "verbal":
        pairs = [verbal_confidence(t) for t in texts]
        return [c for c, _ in pairs], [{"verbal_missing": m} for _, m in pairs]
    if source == "verbal-forced":
        conf, missing = forced_verbal(model, tokenizer, prompts, responses, close_id, budget,
                                      forced_k, seed=seed, batch_size=rows, close_text=reanswer)
        return conf, [{"verbal_missing": m} for m in missing]
    if source == "logits":
        conf = logit_confidence(model, prompts, responses, tokenizer.pad_token_id, batch_size,
                                logit_temperature)
        if bad := sum(not math.isfinite(c) for c in conf):  # never a NaN row in samples.jsonl
            raise FloatingPointError(f"{bad} of {len(conf)} logit confidences are NaN or inf: the "
                                     "model's weights hold NaN or inf")
        return conf, [{} for _ in texts]
    staticcache.release(model)  # neither the features nor the labels reuse the generation's shape
    ends = [think_end(r, close_id) for r in responses]
    bls = [(list(range(every, te, every)) if every else [])
           + [max(cuts_of(len(r), fractions), default=0) if source == "probe" else te]
           for r, te in zip(responses, ends)]
    posthoc = source == "probe-posthoc"
    if every:
        # One prefill a response: its features at every cut and a forced answer at each (the last's
        # unread). On a GPU, fewer cuts a chunk where they would not fit: each draws its own stream.
        chunk = rows
        if model.device.type == "cuda":
            width = max((len(p) + max(bl) for p, bl in zip(prompts, bls)), default=0) + plan.FORCED_SUFFIX
            chunk = plan.label_chunk(chunk, 1, width, model.config, plan.free_bytes(model.device))
        ys, feats = mc_labels(model, tokenizer, prompts, responses, bls, golds, k=1,
                              sampling=dict(FORCED, temperature=0.6, top_p=0.95, max_new_tokens=64),
                              close=close, suffix=suffix, seed=seed, batch_size=chunk,
                              features=True, final_norm=posthoc)
        staticcache.release(model)  # nor does the next batch's generation reuse the labels' shape
    else:
        feats = features(model, prompts, responses, bls, tokenizer.pad_token_id, posthoc,
                         batch_size)
    sizes = [len(f) for f in feats]
    probs = probe_lib.predict(prb, torch.cat(feats)).cpu() if sum(sizes) else torch.zeros(0)
    confs = [p.tolist() for p in probs.split(sizes)]
    extras = [{"checkpoints": [[b, round(c, 6), y] for b, c, y in zip(bl[:-1], cs, yl)]}
              for bl, cs, yl in zip(bls, confs, ys)] if every else [{} for _ in texts]
    return [cs[-1] for cs in confs], extras


def forced_verbal(model, tokenizer, prompts, responses, close_id, budget, k, seed=None,
                  batch_size=8, close_text=RLCR_REANSWER, max_new_tokens=1000):
    """(conf [N], missing [N]): per response, the mean reanswer_confidence of k re-answers forced
    after `prompt + thinking[:budget] + close_text` (released: RLCR_REANSWER, tokenized on its own;
    None: the `</think>` id alone, for the toy), and how many of the k had no readable tag."""
    if close_id is None:
        raise ValueError("--confidence verbal-forced needs a `</think>` token in the tokenizer")
    close = [close_id] if close_text is None else tokenizer.encode(close_text, add_special_tokens=False)
    forced = [list(p) + list(r[:min(think_end(r, close_id), budget)]) + close
              for p, r in zip(prompts, responses)]
    order = list(range(len(forced)))
    if rollout.default_decode(model) == "static":   # shortest first: a chunk holds one static shape
        order.sort(key=lambda i: len(forced[i]))
    out = generate(model, tokenizer, [forced[i] for i in order], n=k, max_new_tokens=max_new_tokens,
                   temperature=0.6, top_p=0.95, seed=seed, batch_size=max(1, batch_size // k))
    read = [None] * len(forced)
    for j, i in enumerate(order):
        read[i] = [reanswer_confidence(t) for t in out.texts[j * k:(j + 1) * k]]
    return [sum(c for c, _ in r) / len(r) for r in read], [sum(m for _, m in r) for r in read]


def reanswer_confidence(text):
    """(confidence, missing) of one forced RLCR re-answer as released (2_budget_eval --rlcr): its
    verbal confidence, but (0.5, True) where it has no complete <answer> tag, or a blank one, and
    holds a `\\boxed{` (the released boxed fallback). The re-answer continues an opened
    `<answer>`: its `</answer>` closes that one.
    reanswer_confidence("\\boxed{5} <confidence>0.9</confidence>") == (0.5, True);
    reanswer_confidence("5</answer> <confidence>0.9</confidence>") == (0.9, False)."""
    tagged = text if "<answer>" in text or "</answer>" not in text else "<answer>" + text
    if "\\boxed{" in text and blank_answer(answer_tag(tagged)):
        return 0.5, True
    return verbal_confidence(text)


def think_end(response, close_id):
    """Thinking length: index of the first `</think>` id in the response ids, else len(response)."""
    response = list(response)
    return response.index(close_id) if close_id in response else len(response)


def logit_confidence(model, prompts, responses, pad_id, batch_size=8, temperature=0.8):
    """exp(mean_t log p_T(response token t)), EOS included, with logits / temperature, one float
    per response: C2GSPG's confidence, trained at the sampling temperature."""
    out, dev = [], model.device
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            b = pack(prompts[s:s + batch_size], responses[s:s + batch_size], pad_id)
            logp = token_logprobs(model, b["input_ids"].to(dev), b["attention_mask"].to(dev),
                                  temperature).float().cpu()
            m = b["loss_mask"]
            out += torch.exp((logp * m).sum(1) / m.sum(1).clamp(min=1)).tolist()
    return out


def features(model, prompts, responses, cut_lists, pad_id, final_norm, batch_size=8):
    """Probe features at each cut of each response, N tensors [B_i, d] float32 on CPU: the training
    feature, or with final_norm the post-hoc one (the final normed state at prompt_len + b - 1)."""
    out = []
    for s in range(0, len(prompts), batch_size):
        bs = cut_lists[s:s + batch_size]
        b = pack(prompts[s:s + batch_size], responses[s:s + batch_size], pad_id)
        batch = {k: v.to(model.device) for k, v in b.items()}
        ends = cut_ends(b["prompt_lens"].tolist(), bs)
        _, feats, _ = forward_pass(model, batch, ends, final_norm=final_norm, logprobs=False)
        out += [feats[i, :len(bl)].float().cpu() for i, bl in enumerate(bs)]
    return out


def get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded=(), prompt=(None, None)):
    """(probe or None, post-hoc report or None) for a confidence source; a post-hoc probe is cached
    in OUT per model (its label and a hash of model_id)."""
    if source == "probe":
        pt = os.path.join(path, "probe.pt")
        if not os.path.isfile(pt):
            raise UserError(f"{label} has no probe.pt: use --confidence probe-posthoc, logits or verbal")
        with checkpoint.reading(pt):
            return probe_lib.load(pt)[0], None
    if source != "probe-posthoc":
        return None, None
    # fit data: the toy's train split, or the RL set (released: lead_80), less any evaluated problem
    toy_only = all(where in TOY_SOURCES for *_, where in loaded)
    src = args.probe_data or ("toy" if toy_only else "deepscaler")
    is_toy = src in ("toy", "toy-pooled")
    w = TOY if is_toy else REAL
    s = settings("toy" if is_toy else src, args)
    if is_toy:   # toy: RL's train split, as released; toy-pooled: each benchmark's in turn, so ECE
        # measures what the state says about correctness, not the fit set's accuracy against one's
        names = [src] if src == "toy" else data.TOY_BENCHMARKS
        splits = [data.load_rows(name, split="train") for name in names]
        pool, instruction = [row for turn in zip(*splits) for row in turn], toy.INSTRUCTION
    else:
        pool, instruction = data.load_rows(src, lcb_release=args.lcb_release), data.instruction_for(src)
    instruction = instruction if prompt[0] is None else prompt[0]
    seen = {r["problem"] for _, rows, _, _ in loaded for r in rows}
    # toy-pooled: the released size (80) from each benchmark, as many as `toy` alone fits on
    size = w["probe_questions"] * (len(data.TOY_BENCHMARKS) if src == "toy-pooled" else 1)
    rows = [r for r in pool if r["problem"] not in seen][:args.probe_questions or size]
    if not rows:
        raise UserError(f"--probe-data {src}: all its {len(pool)} questions are in the evaluated "
                        "benchmarks, so no fit questions are left: pass other --probe-data")
    # the toy's forced answers stop at the newline ending the answer, before the boxes it writes
    protocol = dict(n=args.probe_samples or w["probe_samples"], max_new_tokens=s["max_new_tokens"],
                    temperature=args.temperature, top_p=args.top_p, every=s["every"],
                    count=args.posthoc_budgets or w["posthoc_budgets"], k=s["forced_k"],
                    suffix=s["suffix"], close=args.forced_close, stop=["\n"] if is_toy else [],
                    copy_natural=True, lead="" if is_toy else EVAL_LEAD, gate=s["gate"], epochs=100,
                    patience=30, batch=64, val_frac=0.2, seed=42,
                    **({"grader": s["grader"]} if "grader" in s else {}),   # code, or --grader's
                    **({"tokens": "text"} if args.posthoc_tokens == "text" else {}))
    print(f"post-hoc probe for {label}: {len(rows)} {src} questions ...", file=sys.stderr)
    cache = os.path.join(out_dir, f"posthoc_probe_{label.replace('/', '_')}_{digest(model_id(path), 8)}")
    prb, report = posthoc_probe(cache, model, tok, rows, instruction, close_id, protocol,
                                batch_size=s["score_batch"], rows=s["rows"], system=prompt[1])
    return prb, report and dict(report, data=src)   # (None, None) on a worker other than rank 0


def posthoc_probe(cache, model, tokenizer, questions, instruction, close_id, protocol,
                  batch_size=8, rows=64, system=None):
    """(probe, report): read from `cache`.pt if fitted there with the same protocol (get_probe's
    dict), else fitted and saved, the report copied to `cache`.json for people. Every worker samples
    and grades a share; rank 0 alone reads the cache and fits, the others return (None, None)."""
    p = cache_protocol(protocol, questions, instruction, system)
    cached = read_cache(cache + ".pt") if MASTER and os.path.exists(cache + ".pt") else None
    if share(cached is not None and cached[1].get("protocol") == p):
        return cached if MASTER else (None, None)
    say(f"fitting it (then cached in {cache}.pt): {len(questions)} questions x {p['n']} rollouts, "
        f"forced answers at their budgets, a fit over {len(GRID)} settings")
    prompts = [data.row_prompt(tokenizer, r, instruction, system) for r in questions]
    out = generate_dealt(model, tokenizer, prompts, n=p["n"], max_new_tokens=p["max_new_tokens"],
                         temperature=p["temperature"], top_p=p["top_p"], seed=p["seed"],
                         batch_size=max(1, rows // p["n"]), progress="post-hoc rollouts")
    staticcache.release(model)  # the labels below have shapes of their own
    rep = [q for q in prompts for _ in range(p["n"])]
    golds = [r["answer"] for r in questions for _ in range(p["n"])]
    groups = [q for q in range(len(questions)) for _ in range(p["n"])]
    x, y, g, stats = posthoc_examples(model, tokenizer, rep, out.ids, out.texts, golds, groups,
                                      close_id, dict(p, seed=p["seed"] + 1), batch_size, rows)
    if not MASTER:
        return None, None
    prb, report = fit_posthoc(x, y, g, p, device=model.device)
    right = sum(is_correct(t, a, p.get("grader", "math")) for t, a in zip(out.texts, golds))
    report.update(stats, protocol=p, questions=len(questions), samples=len(rep), prefixes=len(y),
                  label_mean=float(y.mean()), accuracy=right / len(golds))
    with files.replacing(cache + ".pt", "wb") as f:   # the one file read back: probe and report
        probe_lib.save(f, prb, report=json.dumps(report))
    files.write_json(cache + ".json", report, indent=1)   # a copy to read; never read back
    return prb, report


def say(phase):
    """One line on stderr per phase of the post-hoc fit, which takes minutes between its bars."""
    if MASTER:
        print(f"post-hoc probe: {phase}", file=sys.stderr, flush=True)


def posthoc_examples(model, tokenizer, prompts, responses, texts, golds, groups, close_id, p,
                     batch_size=8, rows=64):
    """(feats [M, d], labels [M], groups [M] problem indices, stats), M = p["count"] * N: per
    rollout and budget b (posthoc_budgets), the final normed state at prompt + thinking[:b] and
    posthoc_labels' label. p: get_probe's protocol; its "tokens" "text" (released): the thinking
    re-tokenized from its text, the forced prompts without the prompt's BOS (features keep it)."""
    ends = [think_end(r, close_id) for r in responses]
    forced = prompts
    if p.get("tokens") == "text":
        responses = [tokenizer.encode(tokenizer.decode(r[:e]), add_special_tokens=False)
                     for r, e in zip(responses, ends)]
        ends = [len(r) for r in responses]
        bos = tokenizer.bos_token_id
        forced = [q[1:] if bos is not None and q[:1] == [bos] else q for q in map(list, prompts)]
    positions = [posthoc_budgets(e, p["every"], p["count"]) for e in ends]
    labels, copied = posthoc_labels(model, tokenizer, forced, responses, texts, golds, positions,
                                    ends, p, rows)
    say(f"reading the hidden state at {sum(map(len, positions))} prefixes")

    def scored(starts):   # the features of the batches at these starts
        return [features(model, *(a[s:s + batch_size] for a in (prompts, responses, positions)),
                         tokenizer.pad_token_id, True, batch_size) for s in starts]
    x = torch.cat([f for b in spread(scored, list(range(0, len(prompts), batch_size))) for f in b])
    y = torch.tensor([v for ls in labels for v in ls], dtype=torch.float32)
    g = torch.tensor([grp for grp, ps in zip(groups, positions) for _ in ps], dtype=torch.long)
    past = sum(b >= e for ps, e in zip(positions, ends) for b in ps)
    return x, y, g, dict(examples=len(y), past_end=past, natural_copied=copied)


def posthoc_budgets(thinking, every=500, count=16):
    """The released budgets every, 2 * every, ..., count * every as the prefix length read at each,
    one past the end of thinking reading its end: posthoc_budgets(20, 8, 4) == [8, 16, 20, 20]."""
    return [min(every * (i + 1), thinking) for i in range(count)]


def posthoc_labels(model, tokenizer, prompts, responses, texts, golds, positions, ends, p, rows=64):
    """(Y_b at each rollout's budget positions: N lists of floats, how many were copied). At the end
    of a thinking that holds a box (p["gate"] "none": a box anywhere) the natural grade is copied
    (p["copy_natural"]); elsewhere Y_b is the share of p["k"] answers forced from `prompt +
    response[:b] + lead + CLOSE + suffix` (T 0.6, top-p 0.95) that are right, equal forced prompts
    sampled once, through label.forced_answers (each its own stream: the rollouts dealt to the
    workers). p["grader"] "code": the answers are programs, run against the gold's tests."""
    k, suffix, gate, grader = p["k"], p["suffix"], p["gate"], p.get("grader", "math")
    lead_ids = tokenizer.encode(p["lead"], add_special_tokens=False) if p["lead"] else []
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
    tail = [*lead_ids, label_lib.close_id(tokenizer, p["close"]), *suffix_ids]
    labels, todo, copied = [], {}, 0   # todo: forced prompt -> (j, (rollout, cut), gold)
    programs = (spread(sandbox.grade_many, [code_job(t, g) for t, g in zip(texts, golds)])
                if grader == "code" else None)
    for i, (ps, t) in enumerate(zip(positions, texts)):
        if programs is not None:
            natural = float(programs[i])
        else:
            boxed = boxed_in_thinking(t) if gate == "thinking" else boxed_answer(t) is not None
            natural = float(is_correct(t, golds[i])) if boxed else None
        row = []
        for b in ps:
            if p["copy_natural"] and b >= ends[i] and natural is not None:
                row.append(natural)
                copied += 1
            else:
                b = b if lead_ids else closed_cut(responses[i], b, tail[0])   # mc_labels' cut
                key = (*prompts[i], *responses[i][:b], *tail)
                row.append(todo.setdefault(key, (len(todo), (i, b), golds[i]))[0])
        labels.append(row)
    asks, asked = {}, [ib for _, ib, _ in todo.values()]   # asks: rollout -> its forced prompts' j
    for j, (i, _) in enumerate(asked):
        asks.setdefault(i, []).append(j)

    def answers(part):   # per rollout of `part`: the k answers to each forced prompt it asks
        bs = [[asked[j][1] for j in asks[i]] for i in part]
        got = label_lib.forced_answers(
            model, tokenizer, [prompts[i] for i in part], [responses[i] for i in part], bs,
            [(m, b) for m, cuts in enumerate(bs) for b in cuts], tail, k,
            dict(temperature=0.6, top_p=0.95, stop=tuple(p["stop"]),
                 max_new_tokens=CODE_TOKENS if grader == "code" else 64),
            p["seed"], max(1, rows // k), progress=MASTER and "post-hoc forced answers")[0]
        each = iter([got[at:at + k] for at in range(0, len(got), k)])
        return [[next(each) for _ in cuts] for cuts in bs]
    y = []
    if todo:
        got = dict(zip([j for i in asks for j in asks[i]], sum(spread(answers, list(asks)), [])))
        forced = [(got[j], gold) for j, _, gold in todo.values()]
        say(f"grading {len(todo) * k} forced answers")
        if grader == "code":
            passed = iter(spread(sandbox.grade_many, [code_job(t, g) for ts, g in forced for t in ts]))
            y = [sum(next(passed) for _ in ts) / k for ts, _ in forced]
        else:
            y = spread(lambda part: [sum(answers_match(boxed_answer(suffix + t), g) for t in ts) / k
                                     for ts, g in part], forced)
    return [[v if isinstance(v, float) else y[v] for v in row] for row in labels], copied


def fit_posthoc(x, y, groups, p, grid=GRID, device="cpu", plateau=(0.5, 5), together=True):
    """(the grid's best probe, report) of the released fit (docs/reference.md, "Evaluation") on
    x [M, d], soft labels y [M] and problems groups [M]: split_groups, then fit_setting for each
    grid point, the lowest validation loss wins. p: get_probe's protocol (its seed, val_frac,
    epochs, patience, batch). together: fit_together (the same fits, all at once: faster)."""
    if bad := int((~torch.isfinite(x)).any(1).sum()):
        raise FloatingPointError(f"post-hoc probe: {bad} of {len(x)} features are NaN or inf: the "
                                 "model's weights hold NaN or inf")
    tr, va = split_groups(groups, p["val_frac"], p["seed"])
    if len(tr) == 0 or len(va) == 0:
        raise ValueError("post-hoc probe needs at least two problems with labelled prefixes; "
                         "raise --probe-questions")
    data = [t.to(device).float() for t in (x[tr], y[tr], x[va], y[va])]
    fits = (fit_together(*data, p, grid, plateau) if together else
            [fit_setting(*data, p, one, plateau) for one in tqdm(grid, desc="post-hoc fit over the grid")])
    run, state = min(fits, key=lambda fit: fit[0]["val_loss"])   # the first of equal losses
    if state is None:
        raise FloatingPointError("post-hoc probe: no fit in the grid reached a finite validation loss")
    prb = probe_lib.Probe(x.shape[1], dropout=run["dropout"])
    prb.load_state_dict(state)
    yv, base = y[va], float(y[tr].mean())
    return prb, dict(run, n_train=len(tr), n_val=len(va), val_problems=len(set(groups[va].tolist())),
                     train_problems=len(set(groups[tr].tolist())),
                     val_bce=bce(probe_lib.predict(prb, x[va]), yv), base_rate=base,
                     base_bce=bce(torch.full_like(yv, base), yv), grid=[r for r, _ in fits])


def fit_setting(xt, yt, xv, yv, p, setting, plateau):
    """(run, state at the best epoch) of one grid setting (lr, dropout, weight decay), as released:
    a fresh Probe, AdamW, an epoch of batches then the validation loss against round(y), the lr
    halved on a plateau, stopped after `patience` epochs without a strictly lower loss."""
    lr, drop, wd = setting
    torch.manual_seed(p["seed"])
    prb = probe_lib.Probe(xt.shape[1], dropout=drop).to(xt.device)
    opt = probe_lib.make_optimizer(prb, lr=lr, weight_decay=wd)
    sched = ReduceLROnPlateau(opt, factor=plateau[0], patience=plateau[1])
    run_best, state, bad, best_epoch = math.inf, None, 0, 0
    for epoch in range(p["epochs"]):
        probe_lib.fit(prb, opt, xt, yt, passes=1, batch_size=p["batch"], seed=p["seed"] + epoch)
        prb.eval()
        with torch.no_grad():
            loss = val_loss(prb(xv), yv.round(), p["batch"])
        sched.step(loss)
        if loss < run_best:
            run_best, state, bad, best_epoch = loss, copy.deepcopy(prb.state_dict()), 0, epoch + 1
        elif (bad := bad + 1) >= p["patience"]:
            break
    return dict(lr=lr, dropout=drop, weight_decay=wd, epochs=epoch + 1, best_epoch=best_epoch,
                val_loss=run_best), state


def fit_together(xt, yt, xv, yv, p, grid, plateau):
    """[fit_setting(..., setting) for setting in grid], bit for bit on a CPU, in one loop (a probe
    step is too small to fill a CPU or a GPU): the same batches and dropout draws, each setting's
    probe one slice of stacked weights, AdamW written out with each setting's lr and weight decay.
    On CUDA the dropout masks come from another kernel than nn.Dropout's (the same distribution)."""
    G, seed, batch, dev = len(grid), p["seed"], p["batch"], xt.device
    torch.manual_seed(seed)
    first = probe_lib.Probe(xt.shape[1])
    init = first.state_dict()   # the weights each setting's fresh Probe starts from
    params = [t.detach().repeat(G, 1).to(dev).requires_grad_() for t in init.values()]
    flat = [t.view(G, -1) for t in params]   # [G, h*d], [G, h], [G, h], [G, 1]: setting g in row g
    avg, sq = [torch.zeros_like(t) for t in flat], [torch.zeros_like(t) for t in flat]
    # each dropout rate draws from the stream nn.Dropout draws from in fit_setting
    draws = {drop: torch.Generator(dev).set_state(torch.get_rng_state()) if dev.type == "cpu" else
             torch.Generator(dev).manual_seed(seed) for _, drop, _ in grid}
    lrs = [torch.optim.SGD([torch.zeros(1)], lr=lr) for lr, _, _ in grid]   # each setting's lr
    scheds = [ReduceLROnPlateau(o, factor=plateau[0], patience=plateau[1]) for o in lrs]

    def logits(xb, noise=1):   # [B, d] -> [G, B]; each setting's tensors contiguous, as alone
        w1, b1, w2, b2 = (t.view(G, -1, t.shape[-1]) for t in params)
        hid = torch.relu(torch.baddbmm(b1, xb.expand(G, -1, -1), w1.transpose(1, 2))) * noise
        return torch.stack([F.linear(a, w, b[0]).squeeze(-1) for a, w, b in zip(hid, w2, b2)])

    best, bad, epochs, t = [(math.inf, None, 0)] * G, [0] * G, [0] * G, 0
    for epoch in tqdm(range(p["epochs"]), desc=f"post-hoc fit, {G} settings at once"):
        order = torch.randperm(len(xt), generator=torch.Generator().manual_seed(seed + epoch)).to(dev)
        lr = [o.param_groups[0]["lr"] for o in lrs]
        decay = torch.tensor([[1 - a * wd] for a, (_, _, wd) in zip(lr, grid)], device=dev)
        for s in range(0, len(xt), batch):
            i = order[s:s + batch]
            noise = {d: torch.empty(len(i), first.hidden, device=dev).bernoulli_(1 - d, generator=g)
                     .div_(1 - d) for d, g in draws.items()}
            out = logits(xt[i], torch.stack([noise[d] for _, d, _ in grid]))
            # BCE-with-logits' gradient as torch computes it, (sigmoid - y) / B; the sigmoid row by
            # row, as a vectorized sigmoid rounds unlike its scalar tail
            sig = torch.stack([o.sigmoid() for o in out.detach()])
            grads = torch.autograd.grad(out, params, (sig - yt[i]) / len(i))
            t += 1
            step = torch.tensor([[-(a / (1 - 0.9 ** t))] for a in lr], device=dev)
            with torch.no_grad():   # torch's AdamW (betas 0.9, 0.999, eps 1e-8), op for op
                for q, g, m, v in zip(flat, grads, avg, sq):
                    g = g.view(G, -1)
                    q.mul_(decay)
                    m.lerp_(g, 1 - 0.9)
                    v.mul_(0.999).addcmul_(g, g, value=1 - 0.999)
                    q.add_(step.mul(m).div_((v.sqrt() / (1 - 0.999 ** t) ** 0.5).add_(1e-8)))
        with torch.no_grad():
            out = logits(xv)
        for g in (g for g in range(G) if bad[g] < p["patience"]):
            loss = val_loss(out[g], yv.round(), batch)
            scheds[g].step(loss)
            epochs[g] = epoch + 1
            if loss < best[g][0]:
                state = {k: v.detach()[g].view_as(init[k]).clone() for k, v in zip(init, flat)}
                best[g], bad[g] = (loss, state, epoch + 1), 0
            else:
                bad[g] += 1
        if min(bad) >= p["patience"]:
            break
    return [(dict(lr=lr, dropout=drop, weight_decay=wd, epochs=e, best_epoch=at, val_loss=v), st)
            for (lr, drop, wd), e, (v, st, at) in zip(grid, epochs, best)]


def split_groups(groups, val_frac=0.2, seed=42):
    """(train [M_t] ascending, val [M_v]) example indices, whole problems on one side, as released
    (build_group_split_indices); val in the shuffled problems' order (val_loss's batches)."""
    ids = groups.tolist()
    order = list(dict.fromkeys(ids))
    np.random.RandomState(seed).shuffle(order)
    target = max(1, int(len(ids) * val_frac))
    val = []
    for q in order:
        if len(val) >= target:
            break
        val += [i for i, g in enumerate(ids) if g == q]
    held = set(val)
    train = [i for i in range(len(ids)) if i not in held]
    return torch.tensor(train, dtype=torch.long), torch.tensor(val, dtype=torch.long)


def val_loss(logits, y, batch_size=64):
    """BCE of logits [M] against y [M] as released: the mean of per-batch means (batches of
    batch_size in order: a short last batch weighs as a full one)."""
    parts = [slice(s, s + batch_size) for s in range(0, len(y), batch_size)]
    means = [F.binary_cross_entropy_with_logits(logits[c], y[c].float()).item() for c in parts]
    return sum(means) / len(means)


def bce(p, y):
    """Mean binary cross-entropy -(y log p + (1 - y) log(1 - p)), p clamped to [1e-6, 1 - 1e-6]."""
    p = torch.as_tensor(p, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    y = torch.as_tensor(y, dtype=torch.float64)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def cache_protocol(protocol, questions, instruction, system=None):
    """What a cached post-hoc probe must have been fitted with to be reused: the protocol, and the
    fit data (the same count of other questions, or another prompt, is another probe)."""
    fit = [[r["problem"], r["answer"]] for r in questions] + [instruction, system]
    return dict(protocol, questions=len(questions), stop=list(protocol["stop"]), data=digest(fit))


def read_cache(path):
    """(probe, report) of a post-hoc cache file, or None with one line naming it where it is
    damaged: the probe is fitted again. Read with weights_only and checked by probe.load."""
    try:
        prb = probe_lib.load(path)[0]
        report = json.loads(torch.load(path, map_location="cpu", weights_only=True).get("report") or "null")
        if isinstance(report, dict):
            return prb, report
        why = "it holds no report (an older version's file)"
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: never here
        why = "it holds objects other than tensors; not loaded"
    except Exception as e:   # whatever is wrong with the file, the probe is fitted again
        why = files.first_line(e)
    print(f"warning: post-hoc probe cache {path} is damaged ({why}): fitting the probe again", file=sys.stderr)
    return None

