"""Evaluate models: accuracy, calibration (ECE, PCE, Brier, AUROC), reliability diagrams, and two uses
of the confidence (weighted voting, conformal early exit).

    python evaluate.py --model runs/toy --benchmarks toy                      # CPU, about a minute
    python evaluate.py --model toy --model runs/toy --benchmarks toy --confidence probe-posthoc
    python evaluate.py --model runs/toy --benchmarks toy --nproc 2            # two CPU workers: the same files
    python evaluate.py --model deepseek-r1-distill-qwen-7b --model runs/rlcm \\
        --benchmarks math500,aime24,aime25,amc23                              # one worker per GPU

For each model and benchmark: n samples per question (temperature 0.6, top-p 1.0, up to 8000 tokens;
32 samples on AIME 2024/2025 and AMC 2023, 4 elsewhere; the toy world: 4 samples of at most 128
tokens), graded by the last \\boxed{} (math grader; a run trained with --reward rlcr, or any model under
--mode rlcr, the released reading of RLCR and C2GSPG: its last <answer> tag, `--answer`; LiveCodeBench: the last fenced code block, run against its tests), each with a confidence (evaluation/confidence.py; default: the
post-hoc probe, fitted once per model with the released protocol and cached in --out; `probe` is the
run's own probe.pt, read at its last training budget). Written to --out (default RUN/eval
for a run or checkpoint, else eval_out/<model>): samples.jsonl (appended per generate call: an interrupted
evaluation resumes where it stopped; a row counts only for its model's resolved path and content, its benchmark's
file and question, and the settings it was made with: sample_key; a toy row also holds its problem and response
text, which the mechanism's readouts parse: evaluation/mechanism.py), results.json (a model per label;
another model with the same label is filed as label@HASH), reliability_<model>_<benchmark>.png. Metrics are
computed per benchmark over all samples, pass@k beside accuracy; "Overall" is the paper's, the unweighted
mean over every benchmark evaluated; with OOD benchmarks (lcb, gpqa, logiqa) in the list, they have a block
of their own, and the math and OOD means are printed beside it ("math", "ood" in results.json). results.json
and the printed table carry, per benchmark, the confidence source, grader and sampling settings.
"""
import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

import data
import grade
import label as label_lib
import modes
import probe as probe_lib
import rollout
import toy
from evaluation import confidence, posthoc, shard
from evaluation.report import overall, plot_reliability, report_uses, summarize, table, write_results
from evaluation.samples import (HELD, LOCKS, default_out, digest, filed_label, hold, model_id, model_label, ours,
                                own_rows, question_ids, read_samples, run_dir, sample_key)
from harness import checkpoint, config, files, launch, runlog, sandbox
from harness.checkpoint import ALIASES, resolve_model
from harness.files import UserError
from harness.config import check_out, check_values
from harness.parallel import MASTER, teardown

BIG_N = {"aime24": 32, "aime25": 32, "amc23": 32}   # samples per question; 4 elsewhere
# Per-world defaults. Toy: the forced text is the one the toy base learned (label.SUFFIX), and K is
# smaller than the released 16; `every` is in thinking tokens (toy traces think for ~10-40 tokens).
# batch: questions per generation call (64 sequences of 8000 tokens: ~30 GB of KV cache for the 7B);
# score_batch: sequences per scoring forward.
# Post-hoc probe (released): probe_questions x probe_samples rollouts, posthoc_budgets budgets every
# `every` thinking tokens (500 .. 8000; the toy: 8 .. 128, its whole generation budget).
REAL = dict(n=4, max_new_tokens=8000, every=500, forced_k=16, probe_questions=80, probe_samples=8,
            posthoc_budgets=16, rows=64, score_batch=8)
TOY = dict(n=4, max_new_tokens=128, every=8, forced_k=4, probe_questions=80, probe_samples=8,
           posthoc_budgets=16, rows=256, score_batch=256)
GRADER = "math"   # evaluation grades with grade.is_correct: normaliser + math-verify
TOY_SOURCES = [f"{name}:test" for name in data.TOY_BENCHMARKS]   # the post-hoc probe fits on toy train
TOY_FITS = ("toy", "toy-pooled")   # --probe-data for the toy world (toy_fit_rows)
# Allowed flag values (config.check_values): checked before any model, data or folder is touched.
LIMITS = {key: (lambda v: v >= 1, ">= 1") for key in (
    "limit", "n_samples", "max_new_tokens", "batch_size", "threads", "every", "forced_k", "probe_questions",
    "nproc")}
LIMITS.update(temperature=(lambda v: v >= 0, ">= 0 (0: greedy)"), top_p=(lambda v: 0 < v <= 1, "in (0, 1]"),
              seed=(lambda v: 0 <= v < 2**32, "in [0, 2**32)"), logit_temperature=(lambda v: v > 0, "> 0"))


def load_model(name):
    """(model in eval mode on the GPU if there is one, tokenizer); trust_remote_code stays off."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = checkpoint.load_model(name, torch.bfloat16 if device == "cuda" else torch.float32)
    return model.to(device).eval(), tok


def load_benchmark(spec, limit=None, lcb_release=data.LCB_RELEASE, toy_world="sum"):
    """(name, rows [{problem, answer}], instruction) for a toy benchmark (its test split in `toy_world`), a short name (data.BENCHMARKS,
    from the hub), a local .json/.jsonl/.parquet file, NAME=FILE (a local copy of a known benchmark, e.g.
    aime24=aime24.jsonl: named, and sampled, like it; lcb and logiqa rows built as the hub's), or an HF
    dataset id (owner/name). lcb_release: LiveCodeBench's window (data.lcb_window)."""
    name, _, path = spec.partition("=")
    known = ", ".join(data.TOY_BENCHMARKS + tuple(data.BENCHMARKS))
    if name in data.TOY_BENCHMARKS and not path:
        return name, data.load_rows(name, split="test", limit=limit, toy_world=toy_world), toy.INSTRUCTION
    if path:
        if name not in data.BENCHMARKS:
            raise UserError(f"unknown benchmark {name!r} in {spec!r}; known: {known}")
        rows = data.load_rows(path, limit=limit, like=name, lcb_release=lcb_release)
        return name, rows, data.instruction_for(name)
    if name.lower().endswith((".json", ".jsonl", ".parquet")):
        return os.path.splitext(os.path.basename(name))[0], data.load_rows(name, limit=limit), data.INSTRUCTION
    if name in data.BENCHMARKS or "/" in name:
        return name, data.load_rows(name, limit=limit, lcb_release=lcb_release), data.instruction_for(name)
    raise UserError(f"unknown benchmark {name!r}; known: {known}; or a local .json/.jsonl/.parquet file, "
                    "NAME=FILE, or an HF dataset id (owner/name)")


def benchmark_source(spec, lcb_release=data.LCB_RELEASE):
    """What a benchmark spec reads (data.load_rows' order): "toy:test" (a toy benchmark's test split),
    a hub name or id, or a file's resolved path; LiveCodeBench's with its release window ("lcb:v4_v5")."""
    name, _, path = spec.partition("=")
    where = path or spec
    if where in data.TOY_BENCHMARKS:
        return f"{where}:test"
    where = os.path.realpath(where) if where not in data.BENCHMARKS and os.path.isfile(where) else where
    return f"{where}:{lcb_release}" if name == "lcb" else where


def load_benchmarks(specs, limit=None, lcb_release=data.LCB_RELEASE, toy_world="sum"):
    """[(name, rows, instruction, source)] (load_benchmark, benchmark_source). A name stands for one
    source: a file whose stem is taken, by the built-in toy (its name brings the toy world's settings)
    or by an earlier benchmark of the list (b1/q.jsonl, b2/q.jsonl), is named by its path as given."""
    owner, out = {name: f"{name}:test" for name in data.TOY_BENCHMARKS}, []
    for spec in specs:
        name, rows, instruction = load_benchmark(spec, limit, lcb_release, toy_world)
        source = benchmark_source(spec, lcb_release)
        if owner.setdefault(name, source) != source:
            name = spec
        out.append((name, rows, instruction, source))
    return out


def check_prompts(tok, model, loaded, args, run_instruction=None, system=None):
    """Refuse a benchmark with a prompt longer than the model's context, or a chat template that
    cannot render it; warn on overflow."""
    for bench, rows, instruction, _ in loaded:
        instruction = instruction if run_instruction is None else run_instruction
        data.check_context(tok, rows, instruction, getattr(model.config, "max_position_embeddings", None),
                           settings(bench, args)["max_new_tokens"], bench,
                           say=lambda m: print(m, file=sys.stderr), system=system)


def natural_correct(text, answer, gold, form="box", gate="thinking", letters=True):
    """The grade of a natural response: its answer (grade.extract) matches the gold and, with
    gate="thinking" (released: natural_eval._evaluate_boxed), its thinking holds a box
    (grade.boxed_in_thinking), so a response that boxes only after `</think>` counts as wrong;
    gate="none" grades the answer alone. An RLCR answer (form="tag") needs its <answer> tag, as
    released, and no box. letters: grade.answers_match's (False for GPQA's boxed answers, as released)."""
    if form == "box" and gate == "thinking" and not grade.boxed_in_thinking(text):
        return False
    return grade.answers_match(answer, gold, GRADER, letters=letters)


def missing_samples(path, label, bench, rows, n, key):
    """[(question, [sample indices not yet in `path` for key])] of the questions missing any."""
    have, qids = read_samples(path), question_ids(rows)
    done = {(r["question"], r["sample"]) for r in own_rows(have, key, rows, n)}
    todo = [(q, [j for j in range(n) if (q, j) not in done]) for q in range(len(rows))]
    todo = [t for t in todo if t[1]]
    other = sum(r["model"] == label and r["benchmark"] == bench and not ours(r, key, qids) for r in have)
    if todo and other:
        print(f"{path}: {other} rows of {label} on {bench} were sampled with other settings, for other "
              "questions or by an older version: not reused", file=sys.stderr)
    return todo


def calls(todo, size):
    """The generate calls of a benchmark, in order: runs of up to `size` questions of `todo` missing the
    same number of samples. A call's samples depend on all of its questions (evaluation/shard.py), so
    workers share calls, never questions."""
    out = []
    for q, missing in todo:
        if out and len(out[-1]) < size and len(out[-1][0][1]) == len(missing):
            out[-1].append((q, missing))
        else:
            out.append([(q, missing)])
    return out


def grade_call(texts, golds, bench, s, form):
    """(answers, right) of one call's responses."""
    if s.get("grader") == "code":   # the programs run in a bounded pool of sandboxed children
        return [sandbox.extract_code(t) for t in texts], sandbox.grade_many(
            [grade.code_job(t, g) for t, g in zip(texts, golds)])
    answers = [grade.extract(t, GRADER, form) for t in texts]
    # GPQA's natural boxed answers are graded as released (no option letter read off them);
    # its RLCR answers and LogiQA's (the project's own protocol) by their letter
    letters = form == "tag" or bench != "gpqa"
    return answers, [natural_correct(t, a, g, form, s["gate"], letters) for t, a, g in zip(texts, answers, golds)]


def generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, path, system=None,
                       form="box", key=None):
    """Sample, grade and score every missing (question, sample) of one benchmark, appending per call.

    s: the benchmark's settings (n, max_new_tokens, ...); conf_kw: arguments of
    confidence.sample_confidences; form: where the answer is read (grade.extract: "box" or "tag");
    key: sample_key. Rows already in `path` for key (own_rows) are kept, not regenerated. With several
    workers each runs whole calls, and rank 0 writes every row as one process would (evaluation/shard.py).
    """
    qids = question_ids(rows)
    todo = shard.share(missing_samples(path, label, bench, rows, s["n"], key) if MASTER else None)
    bar = tqdm(total=len(rows) * s["n"], initial=len(rows) * s["n"] - sum(len(m) for _, m in todo),
               desc=f"{label} {bench}", file=sys.stderr, disable=not MASTER)

    def call_rows(chunk, m, out, conf, extras, golds):   # in the grading thread, while the next call generates
        answers, right = grade_call(out.texts, golds, bench, s, form)
        # a toy trace is a few lines: kept, so that the mechanism's readouts need no model
        trace = lambda q, r: dict(problem=rows[q]["problem"], text=out.texts[r]) if bench in data.TOY_BENCHMARKS else {}  # noqa: E731
        return [json.dumps(dict(
            model=label, benchmark=bench, question=q, sample=missing[r % m], answer=answers[r],
            correct=int(right[r]), confidence=float(conf[r]), length=out.lengths[r], finish=out.finish[r],
            source=conf_kw["source"], key=key, q=qids[q], **trace(q, r), **extras[r])) + "\n"
            for r, (q, missing) in enumerate(c for c in chunk for _ in range(m))]

    with shard.Rounds(path, bar) as written:
        for chunk in shard.deal(calls(todo, s["batch"])):   # this worker's call of each round
            if chunk is None:
                written.add(None)
                continue
            m = len(chunk[0][1])
            prompts = [data.chat_prompt(tok, rows[q]["problem"], instruction, system) for q, _ in chunk]
            seed = args.seed * 1_000_003 + chunk[0][0] * 1009 + m
            out = rollout.generate(model, tok, prompts, n=m, max_new_tokens=s["max_new_tokens"],
                                   temperature=args.temperature, top_p=args.top_p, seed=seed,
                                   batch_size=len(prompts), decode=args.decode)
            golds = [rows[q]["answer"] for q, _ in chunk for _ in range(m)]
            conf, extras = confidence.sample_confidences(
                model=model, tokenizer=tok, prompts=[p for p in prompts for _ in range(m)], responses=out.ids,
                texts=out.texts, golds=golds, seed=seed + 1, batch_size=s["score_batch"], rows=s["rows"],
                **conf_kw)
            written.add(call_rows, chunk, m, out, conf, extras, golds)
    bar.close()


def run_config(path):
    """The config.json of a run (RUN, or RUN/checkpoints/step_*), else {} (a base model)."""
    if not os.path.isdir(path):
        return {}
    run = run_dir(path) or (path if os.path.isdir(os.path.join(path, "checkpoints")) else None)
    if run and os.path.isfile(os.path.join(run, "config.json")):
        cfg = config.read_config(run, flag="--model")
        config.check_saved(cfg, os.path.join(run, "config.json"))
        return cfg
    return {}


def run_prompt(path, args):
    """(instruction, system prompt, answer form) for a model: the flags, else what its run trained
    with (the run's config.json, for a run's checkpoint; an RLCR run answers in <answer> tags), else
    (None, None, "box"): the benchmark's own instruction."""
    cfg = run_config(path)
    pick = lambda flag, key: flag if flag is not None else cfg.get(key)  # noqa: E731
    form = args.answer or ("tag" if args.mode == "rlcr" else modes.answer_form(cfg.get("reward")))
    if args.mode == "rlcr":   # each benchmark's RLCR prompt (rlcr_prompts), not the run's
        return args.instruction, pick(args.system_prompt, "system_prompt"), form
    return pick(args.instruction, "instruction"), pick(args.system_prompt, "system_prompt"), form


def rlcr_prompts(loaded):
    """--mode rlcr (the released evaluation's, for RLCR and C2GSPG): every benchmark asks in RLCR's
    format, data.RLCR_INSTRUCTION (the toy world's: toy.RLCR_INSTRUCTION). LiveCodeBench, whose
    answer is a program, has no RLCR form in the release: refused."""
    if any(data.kind(bench) == "code" for bench, *_ in loaded):
        raise UserError("--mode rlcr: lcb has no RLCR-format evaluation (its answer is a program, none in the "
                        "release either): evaluate it without --mode rlcr")
    return [(bench, rows, toy.RLCR_INSTRUCTION if bench in data.TOY_BENCHMARKS else data.RLCR_INSTRUCTION, src)
            for bench, rows, _, src in loaded]


def settings(bench, args):
    """Per-benchmark sampling and confidence settings: world defaults, overridden by flags."""
    toy_world = bench in data.TOY_BENCHMARKS
    w = TOY if toy_world else REAL
    code = data.kind(bench) == "code"
    s = dict(n=w["n"] if toy_world else BIG_N.get(bench, w["n"]), max_new_tokens=w["max_new_tokens"],
             every=w["every"], forced_k=w["forced_k"], suffix=label_lib.SUFFIX if toy_world else confidence.EVAL_SUFFIX,
             score_batch=w["score_batch"], rows=w["rows"])
    if code:   # the forced answer is a program (posthoc.CODE_SUFFIX), graded by running it
        s.update(suffix=posthoc.CODE_SUFFIX, grader="code")
    for key in ("n", "max_new_tokens", "every", "forced_k"):
        if getattr(args, key if key != "n" else "n_samples") is not None:
            s[key] = getattr(args, key if key != "n" else "n_samples")
    # verbal-forced (RLCR's released reading): its re-answer text (the toy: `</think>` alone) and
    # n_forced re-answers, 4 on the 32-sample benchmarks and 1 elsewhere in the released configs.
    s["reanswer"] = None if toy_world else confidence.RLCR_REANSWER
    s["reanswer_k"] = args.forced_k or (w["forced_k"] if toy_world else 4 if bench in BIG_N else 1)
    s["batch"] = args.batch_size or max(1, w["rows"] // s["n"])
    # The toy boxes after `</think>` by construction: the released gate would grade every answer wrong.
    # Code has no box to gate on: the program of the last fenced block after the thinking is run.
    s["gate"] = args.gate or ("none" if toy_world or code else "thinking")
    return s


def get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded=(), prompt=(None, None)):
    """(probe or None, post-hoc report or None) for a confidence source; post-hoc probes are cached in
    OUT, one file per model (its label and a hash of model_id)."""
    if source == "probe":
        if not os.path.isfile(os.path.join(path, "probe.pt")):
            raise UserError(f"{label} has no probe.pt: use --confidence probe-posthoc, logits or verbal")
        with checkpoint.reading(os.path.join(path, "probe.pt")):
            return probe_lib.load(os.path.join(path, "probe.pt"))[0], None
    if source != "probe-posthoc":
        return None, None
    # Fit data: the toy world's train split, or the RL training set for real models (released: lead_80,
    # the first 80 of the training set); problems of any benchmark being evaluated are skipped.
    toy_only = all(source in TOY_SOURCES for *_, source in loaded)
    src = args.probe_data or ("toy" if toy_only else "deepscaler")
    is_toy = src in TOY_FITS
    w = TOY if is_toy else REAL
    s = settings("toy" if is_toy else src, args)
    if is_toy:
        pool, instruction = toy_fit_rows(src, args.toy_world), toy.INSTRUCTION
    else:
        pool, instruction = data.load_rows(src, lcb_release=args.lcb_release), data.instruction_for(src)
    instruction = instruction if prompt[0] is None else prompt[0]
    seen = {r["problem"] for _, rows, _, _ in loaded for r in rows}
    rows = [r for r in pool if r["problem"] not in seen][:args.probe_questions or w["probe_questions"]]
    if not rows:
        raise UserError(f"--probe-data {src}: all its {len(pool)} questions are in the evaluated benchmarks, so "
                        "no fit questions are left: pass other --probe-data")
    protocol = dict(n=args.probe_samples or w["probe_samples"], max_new_tokens=s["max_new_tokens"],
                    temperature=args.temperature, top_p=args.top_p, every=s["every"],
                    count=args.posthoc_budgets or w["posthoc_budgets"], k=s["forced_k"], suffix=s["suffix"],
                    close=args.forced_close, stop=[], copy_natural=True, lead="" if is_toy else posthoc.EVAL_LEAD,
                    gate=s["gate"], epochs=100, patience=30, batch=64,
                    val_frac=0.2, seed=42, **({"grader": "code"} if s.get("grader") == "code" else {}))
    print(f"post-hoc probe for {label}: {len(rows)} {src} questions ...", file=sys.stderr)
    prb, report = posthoc.posthoc_probe(
        os.path.join(out_dir, f"posthoc_probe_{label}_{digest(model_id(path), 8)}".replace("/", "_")), model, tok,
        rows, instruction, close_id, protocol, batch_size=s["score_batch"], rows=s["rows"], system=prompt[1])
    return prb, dict(report, data=src)


def toy_fit_rows(src, world="sum"):
    """The post-hoc probe's toy fit questions: `toy`, RL's distribution alone (the released protocol
    fits on the training set), or `toy-pooled`, the train splits of every toy benchmark taken in
    turn, so the fit sees each benchmark's base rate and ECE measures what the state says about
    correctness rather than the gap between the fit set's accuracy and a benchmark's. world: whose
    rows (toy.WORLDS)."""
    if src == "toy":
        return data.load_rows("toy", split="train", toy_world=world)
    splits = [data.load_rows(name, split="train", toy_world=world) for name in data.TOY_BENCHMARKS]
    return [row for turn in zip(*splits) for row in turn]


def run_fractions(path):
    """The truncation fractions a run trained its probe at (its config.json), else the default."""
    return tuple(run_config(path).get("budgets") or (0.25, 0.5, 0.75))


def default_confidence(name):
    """The paper's probe rows use the post-hoc probe (Base, GRPO and RLCM alike): the default for
    every model, the toy world included."""
    return "probe-posthoc"


def evaluate_model(name, loaded, args):
    """Generate (resuming), score and summarize one model on every benchmark; returns its results."""
    path = resolve_model(name)
    label, ident = model_label(name, path), model_id(path)
    out_dir = args.out or default_out(name, path)
    if MASTER and os.path.isdir(out_dir):   # a second writer stops before loading anything
        hold(out_dir)
    model, tok = load_model(name)
    prompt = run_prompt(path, args)
    check_prompts(tok, model, loaded, args, prompt[0], prompt[1])
    if MASTER:   # rank 0 alone reads and writes the folder; the other ranks get what they need from it
        hold(out_dir)   # a new folder is made only now that the model loads and the prompts fit
        label = filed_label(label, ident, out_dir)   # reads results.json: a damaged one is refused now
    label = shard.share(label)
    source = args.confidence or default_confidence(name)
    think = tok.convert_tokens_to_ids("</think>")
    close_id = None if think is None or think == tok.unk_token_id else think
    prb, report = shard.share_probe(get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded, prompt)
                                    if MASTER else None, next(model.parameters()).device)   # fitted once
    samples = os.path.join(out_dir, "samples.jsonl")
    res = {"path": path, "model_id": ident, "confidence": source, "out": out_dir, "benchmarks": {}, "settings": {},
           "provenance": runlog.provenance(args.argv, next(model.parameters()).device)}
    for bench, rows, instruction, bench_source in loaded:
        s = settings(bench, args)
        instruction = instruction if prompt[0] is None else prompt[0]
        code = data.kind(bench) == "code"
        # No early exit on code: its forced answers at each checkpoint would be programs to run.
        probe_source = source in ("probe", "probe-posthoc") and not args.no_early_exit and not code
        conf_kw = dict(source=source, prb=prb, close_id=close_id, every=s["every"] if probe_source else None,
                       suffix=s["suffix"], close=args.forced_close, fractions=run_fractions(path),
                       forced_k=s["reanswer_k"], budget=s["max_new_tokens"], reanswer=s["reanswer"],
                       logit_temperature=args.logit_temperature or run_config(path).get("temperature", 0.8))
        key = sample_key(ident, bench_source, s, args, [instruction, prompt[1], prompt[2]], conf_kw)
        earlier = MASTER and len(own_rows(read_samples(samples), key, rows, s["n"]))   # by an earlier, cut command
        generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, samples, prompt[1],
                           prompt[2], key)
        if not MASTER:
            continue
        # Programs vote only when equal as text: the math grader would read code as math.
        res["benchmarks"][bench] = summarize(own_rows(read_samples(samples), key, rows, s["n"]), seed=args.seed,
                                             same=None if code else grade.answers_match)
        window = " to ".join(data.lcb_window(args.lcb_release))
        release = {"release": f"{args.lcb_release} (contests {window})"} if bench == "lcb" else {}
        world = {"toy_world": args.toy_world} if bench in data.TOY_BENCHMARKS else {}
        res["settings"][bench] = dict(s, confidence=source, grader=s.get("grader", GRADER), answer=prompt[2],
                                      temperature=args.temperature, **release, **world,
                                      top_p=args.top_p, seed=args.seed, questions=len(rows), samples_earlier=earlier,
                                      instruction=instruction, system_prompt=prompt[1], key=key,
                                      benchmark_source=bench_source, benchmark_rows=digest(question_ids(rows)),
                                      bootstrap=dict(resamples=1000, unit="question", seed=args.seed))
        b = res["benchmarks"][bench]
        title = f"{label} | {bench} | {source}\nacc {b['acc']:.3f}  ECE {b['ece']:.3f}  n {b['n']}"
        plot_reliability(b["reliability"], title,
                         os.path.join(out_dir, f"reliability_{label}_{bench}.png".replace("/", "_")))
    if not MASTER:   # rank 0 writes the results
        return label, None
    # The paper's Overall: the mean over every benchmark evaluated (its 8: math, LCB, GPQA, LogiQA);
    # beside it the means of the math and the OOD benchmarks.
    maths = {b: v for b, v in res["benchmarks"].items() if b not in data.OOD}
    ood = {b: v for b, v in res["benchmarks"].items() if b in data.OOD}
    res["overall"] = overall(res["benchmarks"])
    if maths:
        res["math"] = overall(maths)
    if ood:
        res["ood"] = overall(ood)
    if report is not None:
        res["posthoc_probe"] = report
    write_results(out_dir, label, res)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return label, res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("what to evaluate")
    g.add_argument("--model", action="append", required=True,
                   help="alias (toy, " + ", ".join(ALIASES) + "), HF id, model/checkpoint/run dir; repeatable")
    g.add_argument("--benchmarks", default="toy", help="comma list: toy, toy-long, toy-sub, math500, aime24, ..., "
                   "FILE or NAME=FILE")
    g.add_argument("--limit", type=int, help="questions per benchmark")
    g.add_argument("--toy-world", default="sum", choices=sorted(toy.WORLDS),
                   help="whose rows the toy benchmarks and the toy post-hoc fit read (toy.WORLDS; default sum)")
    g.add_argument("--lcb-release", default=data.LCB_RELEASE,
                   help="LiveCodeBench window: vN or vA_vB, by contest month (default v4_v5: 2024-08 to 2025-01, "
                        "the window of DeepSeek-R1's and lighteval's scores)")
    g.add_argument("--out", help="output dir (default RUN/eval or eval_out/<model>)")
    g.add_argument("--unconfined-code", action="store_true", help="where the code sandbox cannot make namespaces, "
                   "run lcb's programs without them (harness/sandbox.py), accepting that they can escape")
    g = p.add_argument_group("sampling")
    g.add_argument("--n-samples", type=int, help="samples per question (default 32 on aime/amc, else 4)")
    g.add_argument("--max-new-tokens", type=int, help="default 8000 (toy: 128)")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, help="questions per generation call (default 64 sequences; toy 256)")
    g.add_argument("--decode", choices=("static", "dynamic"), help="KV cache for decoding (default: static on CUDA)")
    g.add_argument("--threads", type=int, help="CPU threads (default: 1 on a machine without a GPU, else torch's)")
    g.add_argument("--nproc", type=int, help="workers (default: one per visible GPU, else 1), each running whole "
                   "generate calls: the same samples.jsonl as one process (evaluation/shard.py)")
    g.add_argument("--plan", action="store_true", help="print each benchmark's memory peak on one GPU and exit "
                   "(harness/evalplan.py; from the model's config alone)")
    g.add_argument("--gpu-mem", type=float, help="GiB of the GPU to plan for (default: this one's, else 80)")
    g = p.add_argument_group("confidence")
    g.add_argument("--confidence", choices=confidence.SOURCES,
                   help="default probe-posthoc (the paper's probe rows); probe: the run's own probe.pt, read "
                        "at its last training budget; verbal: the <confidence> tag; verbal-forced: the mean tag of "
                        "--forced-k re-answers after the thinking (RLCR's released reading); logits: C2GSPG's")
    g.add_argument("--logit-temperature", type=float,
                   help="temperature of --confidence logits (default: the run's training temperature, 0.8, "
                        "where C2GSPG trained its confidence; 1: the raw model's)")
    g.add_argument("--every", type=int, help="thinking tokens between probe budgets / exit checkpoints (500; toy 8)")
    g.add_argument("--posthoc-budgets", type=int, help="post-hoc budgets per rollout: every, 2 * every, ... (16)")
    g.add_argument("--forced-k", type=int, help="forced answers per budget for post-hoc labels (16; toy 4) and "
                                                "re-answers of verbal-forced (released: 4 on aime/amc, else 1; toy 4)")
    g.add_argument("--forced-close", choices=("think", "eos"), default="think")
    g.add_argument("--probe-data", help="questions for the post-hoc probe (default: toy train split / deepscaler; "
                   "toy-pooled: the train splits of every toy benchmark in turn, a fit matched to them all)")
    g.add_argument("--probe-questions", type=int, help="how many (default 80, as released)")
    g.add_argument("--probe-samples", type=int, help="rollouts per post-hoc question (default 8, as released)")
    g.add_argument("--no-early-exit", action="store_true", help="skip the forced answers at exit checkpoints")
    g = p.add_argument_group("prompt (default: what the run trained with, else the benchmark's)")
    g.add_argument("--instruction", help="text appended to every problem")
    g.add_argument("--system-prompt", help="system turn before the problem")
    g.add_argument("--gate", choices=("thinking", "none"),
                   help="thinking (default; toy: none): a boxed answer counts only if a box appears before "
                        "`</think>`, as the released evaluation counts it; none: the last box alone decides")
    g.add_argument("--answer", choices=("box", "tag"),
                   help="where the answer is read: the last \\boxed{} (default) or the last <answer> tag "
                        "(default for a run trained with --reward rlcr)")
    g.add_argument("--mode", choices=("boxed", "rlcr"), default="boxed",
                   help="rlcr: the released evaluation's --mode rlcr, with which it evaluates RLCR and C2GSPG: "
                        "every benchmark asks in RLCR's format (the RLCR prompt, whatever the run trained with), "
                        "the answer is the last <answer> tag and the confidence --confidence verbal-forced (the "
                        "mean <confidence> of forced re-answers) unless --confidence says otherwise")
    args = p.parse_args(argv)
    if args.mode == "rlcr" and args.confidence is None:
        args.confidence = "verbal-forced"
    args.argv = ["evaluate.py", *(sys.argv[1:] if argv is None else argv)]  # for results.json provenance
    return args


def check_flags(names, args):
    """Flags whose meaning argparse cannot check: refused like its own errors, one line and exit 2,
    before anything is read or written (an empty list would replace a model's results with none)."""
    run = args.out and next((f for f in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(args.out, f))),
                            None)
    try:
        if not names:
            raise UserError(f"--benchmarks {args.benchmarks!r} names no benchmark: pass e.g. toy or math500,aime24")
        if run:
            raise UserError(f"--out {args.out} is a training run's folder (it has {run}): evaluate into "
                            f"{os.path.join(args.out, 'eval')} (the default for --model {args.out}) or another folder")
    except UserError as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None):
    args = parse_args(argv)
    try:
        check_values(vars(args), LIMITS)
        data.lcb_window(args.lcb_release)
        if args.out:
            check_out(args.out)
    except (UserError, data.DataError) as e:
        raise SystemExit(f"evaluate.py: error: {e}") from None
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    check_flags(names, args)
    sandbox.allow_unconfined = args.unconfined_code
    threads = torch.get_num_threads()
    # What runs on a CPU here (the toy, a small local model) is too small to gain from threads, and
    # on a busy CPU threads that wait for each other make generation 10x slower: one thread on a
    # CPU unless --threads says otherwise.
    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    try:
        for name in args.model:   # a missing model is a model error, not a benchmark's
            checkpoint.check_available(name)
        if args.plan:   # before any benchmark or weights are read
            from harness import evalplan
            mem = args.gpu_mem or (torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0)
            for name in args.model:
                evalplan.check(name, [(b, settings(b, args)) for b in names], mem,
                               early_exit=not args.no_early_exit)
            return None
        loaded = load_benchmarks(names, args.limit, args.lcb_release, args.toy_world)   # every name checked before any model loads
        loaded = rlcr_prompts(loaded) if args.mode == "rlcr" else loaded
        if any(data.kind(name) == "code" for name, *_ in loaded):
            sandbox.check()   # can programs be confined here (or --unconfined-code)? Said before any model loads
        workers = launch.worker_count(vars(args))
        if workers > 1:   # one worker per GPU (or --nproc), each running this command: evaluation/shard.py
            for name in args.model:
                checkpoint.fetch(name)   # now: rank 0 would download inside the group while the others wait
            code = launch.launch(os.path.abspath(__file__), args.argv[1:], workers)
            if code:
                raise SystemExit(code)
            return None
        shard.setup()
        results = dict(evaluate_model(name, loaded, args) for name in args.model)
    except files.Busy as e:   # another evaluation writes there: exit 2, its files untouched
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, OSError, FloatingPointError) as e:   # UserError, data.DataError, NaN in a model or probe
        raise SystemExit(f"evaluate.py: error: {e}") from None
    except KeyboardInterrupt:   # samples are appended per batch: the same command continues from here
        results = None          # the line is printed below, once the progress bar has closed
    finally:
        torch.set_num_threads(threads)
        LOCKS.close()
        HELD.clear()
        teardown()
    if results is None:
        print("\ninterrupted: the samples so far are kept; run the same command again to continue",
              file=sys.stderr)
        raise SystemExit(130)
    if not MASTER:
        return None
    print(table(results))
    print()
    print(report_uses(results))
    return results


if __name__ == "__main__":
    main()
