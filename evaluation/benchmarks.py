"""The benchmarks an evaluation reads and how each is asked and sampled: loading (load_benchmarks), the
prompt (what the run trained with, the benchmark's own, or RLCR's under --mode rlcr), and the settings
of each benchmark (settings: the world's defaults below, overridden by evaluate.py's flags).
"""
import os
import sys

import config  # check_saved: the saved values as train.py's parser would take them
import data
import label as label_lib
import modes
import toy
from evaluation import confidence, posthoc
from evaluation.samples import run_dir
from harness.runfolder import read_config
from harness.files import UserError

BIG_N = {"aime24": 32, "aime25": 32, "amc23": 32}   # samples per question; 4 elsewhere
# Per-world defaults (docs/reference.md, "Evaluation"); every: thinking tokens between budgets;
# rows: sequences per generation call; score_batch: sequences per scoring forward.
REAL = dict(n=4, max_new_tokens=8000, every=500, forced_k=16, probe_questions=80, probe_samples=8,
            posthoc_budgets=16, rows=64, score_batch=8)
TOY = dict(n=4, max_new_tokens=128, every=8, forced_k=4, probe_questions=80, probe_samples=8,
           posthoc_budgets=16, rows=256, score_batch=256)


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


def load_benchmarks(specs, limit=None, lcb_release=data.LCB_RELEASE):
    """[(name, rows, instruction, source)]. A name stands for one source: a file whose stem is taken
    (by a toy benchmark, or an earlier one: b1/q.jsonl, b2/q.jsonl) is named by its path as given."""
    owner, out = {name: f"{name}:test" for name in data.TOY_BENCHMARKS}, []
    for spec in specs:
        name, rows, instruction = load_benchmark(spec, limit, lcb_release)
        source = benchmark_source(spec, lcb_release)
        if owner.setdefault(name, source) != source:
            name = spec
        out.append((name, rows, instruction, source))
    return out


def load_benchmark(spec, limit=None, lcb_release=data.LCB_RELEASE):
    """(name, rows [{problem, answer}], instruction) for a toy benchmark (its test split), a known
    name (data.BENCHMARKS), a local .json/.jsonl/.parquet file, NAME=FILE (a local copy of a known
    benchmark, named and sampled like it), or an HF dataset id (owner/name)."""
    name, _, path = as_named(spec).partition("=")
    known = ", ".join(data.TOY_BENCHMARKS + tuple(data.BENCHMARKS))
    if name in data.TOY_BENCHMARKS and not path:
        return name, data.load_rows(name, split="test", limit=limit), toy.INSTRUCTION
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


def as_named(spec):
    """NAME=FILE for a file whose stem is a known benchmark (DIR/gpqa.jsonl): named by its stem, it is
    read as that benchmark (gpqa's options and letter gold), never as plain rows filed under its name."""
    stem = os.path.splitext(os.path.basename(spec))[0]
    known = "=" not in spec and stem in data.BENCHMARKS and spec.lower().endswith((".json", ".jsonl", ".parquet"))
    return f"{stem}={spec}" if known else spec


def benchmark_source(spec, lcb_release=data.LCB_RELEASE):
    """What a benchmark spec reads (data.load_rows' order): "toy:test" (a toy benchmark's test split),
    a hub name or id, or a file's resolved path; LiveCodeBench's with its release window ("lcb:v4_v5")."""
    spec = as_named(spec)
    name, _, path = spec.partition("=")
    where = path or spec
    if where in data.TOY_BENCHMARKS:
        return f"{where}:test"
    where = os.path.realpath(where) if where not in data.BENCHMARKS and os.path.isfile(where) else where
    return f"{where}:{lcb_release}" if name == "lcb" else where


def check_prompts(tok, model, loaded, args, run_instruction=None, system=None):
    """Refuse a benchmark with a prompt longer than the model's context, or a chat template that
    cannot render it; warn on overflow."""
    for bench, rows, instruction, _ in loaded:
        instruction = instruction if run_instruction is None else run_instruction
        data.check_context(tok, rows, instruction, getattr(model.config, "max_position_embeddings", None),
                    settings(bench, args)["max_new_tokens"], bench,
                    say=lambda m: print(m, file=sys.stderr), system=system)


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
    format (data.RLCR_INSTRUCTION; the toy's: toy.RLCR_INSTRUCTION); LiveCodeBench is refused."""
    if any(data.kind(bench) == "code" for bench, *_ in loaded):
        raise UserError("--mode rlcr: lcb has no RLCR-format evaluation here (its answer is a program; the release "
                        "ships livecodebench_lite_rlcr.parquet but no config or grader for it): evaluate it "
                        "without --mode rlcr")
    for bench, rows, *_ in loaded:   # a released chat list is the whole prompt: RLCR's is not added to it
        if rows and "messages" in rows[0] and "<confidence>" not in rows[0]["problem"]:
            raise UserError(f"--mode rlcr: {bench}'s prompts are a verl file's, as released, and do not ask for "
                            "RLCR's format: pass the release's _rlcr parquet of it, or drop --mode rlcr")
    return [(bench, rows, toy.RLCR_INSTRUCTION if bench in data.TOY_BENCHMARKS else data.RLCR_INSTRUCTION, src)
            for bench, rows, _, src in loaded]


def run_config(path):
    """The config.json of a run (RUN, or RUN/checkpoints/step_*), else {} (a base model)."""
    if not os.path.isdir(path):
        return {}
    run = run_dir(path) or (path if os.path.isdir(os.path.join(path, "checkpoints")) else None)
    if run and os.path.isfile(os.path.join(run, "config.json")):
        cfg = read_config(run, flag="--model")
        config.check_saved(cfg, os.path.join(run, "config.json"))
        return cfg
    return {}
