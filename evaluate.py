"""Evaluate models: accuracy, calibration (ECE, PCE, Brier, AUROC), reliability diagrams, and two uses
of the confidence (weighted voting, conformal early exit).

    python evaluate.py --model runs/toy --benchmarks toy                      # CPU, about a minute
    python evaluate.py --model toy --model runs/toy --benchmarks toy --confidence probe-posthoc
    python evaluate.py --model deepseek-r1-distill-qwen-7b --model runs/rlcm \\
        --benchmarks math500,aime24,aime25,amc23                              # GPU

For each model and benchmark: n samples per question (temperature 0.6, top-p 1.0, up to 8000 tokens;
32 samples on AIME 2024/2025 and AMC 2023, 4 elsewhere; the toy world: 4 samples of at most 128
tokens), graded by the last \\boxed{} (math grader; a run trained with --reward rlcr: its last <answer>
tag, `--answer`), each with a confidence (confidence.py; default: the
post-hoc probe, fitted once per model with the released protocol and cached in --out; `probe` is the
run's own probe.pt, read at its last training budget). Written to --out (default RUN/eval
for a run or checkpoint, else eval_out/<model>): samples.jsonl (appended per batch: an interrupted
evaluation resumes where it stopped), results.json, reliability_<model>_<benchmark>.png. Metrics are
computed per benchmark over all samples; "Overall" is the unweighted mean over benchmarks. results.json
and the printed table carry, per benchmark, the confidence source, grader and sampling settings.
"""
import argparse
import json
import os
import sys
from contextlib import ExitStack

import torch
from tqdm import tqdm

import confidence
import data
import grade
import label as label_lib
import modes
import probe as probe_lib
import rollout
import runlog
import toy
import checkpoint
from checkpoint import ALIASES, UserError, resolve_model
from config import check_out, check_values
from report import overall, plot_reliability, report_uses, summarize, table, write_results

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
# Allowed flag values (config.check_values): checked before any model, data or folder is touched.
LIMITS = {key: (lambda v: v >= 1, ">= 1") for key in (
    "limit", "n_samples", "max_new_tokens", "batch_size", "threads", "every", "forced_k", "probe_questions")}
LIMITS.update(temperature=(lambda v: v >= 0, ">= 0 (0: greedy)"), top_p=(lambda v: 0 < v <= 1, "in (0, 1]"),
              seed=(lambda v: 0 <= v < 2**32, "in [0, 2**32)"))
SAMPLE_FIELDS = ("model", "benchmark", "question", "sample", "correct", "confidence")
LOCKS = ExitStack()  # the lock of every output folder written, held until main() ends


def _run_dir(path):
    """RUN for RUN/checkpoints/step_*, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def model_label(name, path):
    """Short stable name used in samples.jsonl and tables: 'toy', alias, 'run/step_000010', dir name."""
    if name == "toy" or name in ALIASES or not os.path.isdir(path):
        return name
    run = _run_dir(path)
    base = os.path.basename(os.path.abspath(path))
    return f"{os.path.basename(run)}/{base}" if run else base


def default_out(name, path):
    run = _run_dir(path) if os.path.isdir(path) else None
    return os.path.join(run, "eval") if run else os.path.join("eval_out", model_label(name, path).replace("/", "_"))


def load_model(name):
    """(model in eval mode on the GPU if there is one, tokenizer); trust_remote_code stays off."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = checkpoint.load_model(name, torch.bfloat16 if device == "cuda" else torch.float32)
    return model.to(device).eval(), tok


def load_benchmark(spec, limit=None):
    """(name, rows [{problem, answer}], instruction) for `toy` (its test split), a short name (data.BENCHMARKS,
    from the hub), a local .json/.jsonl/.parquet file, NAME=FILE (a local copy of a known benchmark, e.g.
    aime24=aime24.jsonl: named, and sampled, like it), or an HF dataset id (owner/name)."""
    name, _, path = spec.partition("=")
    known = "toy, " + ", ".join(data.BENCHMARKS)
    if name == "toy" and not path:
        return "toy", data.load_rows("toy", split="test", limit=limit), toy.INSTRUCTION
    if path:
        if name not in data.BENCHMARKS:
            raise UserError(f"unknown benchmark {name!r} in {spec!r}; known: {known}")
        return name, data.load_rows(path, limit=limit), data.INSTRUCTION
    if name.lower().endswith((".json", ".jsonl", ".parquet")):
        return os.path.splitext(os.path.basename(name))[0], data.load_rows(name, limit=limit), data.INSTRUCTION
    if name in data.BENCHMARKS or "/" in name:
        return name, data.load_rows(name, limit=limit), data.INSTRUCTION
    raise UserError(f"unknown benchmark {name!r}; known: {known}; or a local .json/.jsonl/.parquet file, "
                    "NAME=FILE, or an HF dataset id (owner/name)")


def read_samples(path):
    """Rows of samples.jsonl; a last line cut by a kill is dropped from the file with a message, any
    other line that is not a sample is one error naming the file and the line."""
    return checkpoint.read_jsonl(path, valid=lambda r: all(k in r for k in SAMPLE_FIELDS))


def hold(out_dir):
    """One writer per output folder: its lock is taken before anything is written there."""
    check_out(out_dir)
    key = os.path.realpath(out_dir)
    if key not in HELD:
        LOCKS.enter_context(checkpoint.locked(out_dir, "evaluation"))
        HELD.add(key)


HELD = set()


def check_prompts(tok, model, loaded, args, run_instruction=None):
    """Refuse a benchmark with a prompt longer than the model's context; warn on overflow."""
    for bench, rows, instruction in loaded:
        instruction = instruction if run_instruction is None else run_instruction
        data.check_context(tok, rows, instruction, getattr(model.config, "max_position_embeddings", None),
                           settings(bench, args)["max_new_tokens"], bench,
                           say=lambda m: print(m, file=sys.stderr))


def generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, path, system=None,
                       form="box"):
    """Sample, grade and score every missing (question, sample) of one benchmark, appending per batch.

    s: the benchmark's settings (n, max_new_tokens, ...); conf_kw: arguments of
    confidence.sample_confidences; form: where the answer is read (grade.extract: "box" or "tag").
    Rows already in `path` for (label, bench) are kept, not regenerated.
    """
    have = [r for r in read_samples(path) if r["model"] == label and r["benchmark"] == bench]
    stale = {r.get("source") for r in have} - {conf_kw["source"]}
    if stale:
        raise UserError(f"{path} holds {bench} samples of {label} with confidence {stale.pop()!r}, not "
                        f"{conf_kw['source']!r}: pass that --confidence or another --out")
    done = {(r["question"], r["sample"]) for r in have}
    todo = [(q, [j for j in range(s["n"]) if (q, j) not in done]) for q in range(len(rows))]
    todo = [t for t in todo if t[1]]
    bar = tqdm(total=len(rows) * s["n"], initial=len(rows) * s["n"] - sum(len(m) for _, m in todo),
               desc=f"{label} {bench}", file=sys.stderr)
    i = 0
    while i < len(todo):
        # A batch: up to batch_size questions missing the same number of samples (one generate call).
        m = len(todo[i][1])
        chunk = [todo[i]]
        while len(chunk) < s["batch"] and i + len(chunk) < len(todo) and len(todo[i + len(chunk)][1]) == m:
            chunk.append(todo[i + len(chunk)])
        i += len(chunk)
        prompts = [data.chat_prompt(tok, rows[q]["problem"], instruction, system) for q, _ in chunk]
        seed = args.seed * 1_000_003 + chunk[0][0] * 1009 + m
        out = rollout.generate(model, tok, prompts, n=m, max_new_tokens=s["max_new_tokens"],
                       temperature=args.temperature, top_p=args.top_p, seed=seed, batch_size=len(prompts),
                       decode=args.decode)
        golds = [rows[q]["answer"] for q, _ in chunk for _ in range(m)]
        conf, extras = confidence.sample_confidences(
            model=model, tokenizer=tok, prompts=[p for p in prompts for _ in range(m)], responses=out.ids,
            texts=out.texts, golds=golds, seed=seed + 1, batch_size=s["score_batch"], rows=s["rows"], **conf_kw)
        with checkpoint.appending(path) as f:
            for r, (q, missing) in enumerate((c for c in chunk for _ in range(m))):
                j, answer = missing[r % m], grade.extract(out.texts[r], GRADER, form)
                f.write(json.dumps(dict(
                    model=label, benchmark=bench, question=q, sample=j, answer=answer,
                    correct=int(grade.answers_match(answer, golds[r], GRADER)), confidence=float(conf[r]),
                    length=out.lengths[r], finish=out.finish[r], source=conf_kw["source"], **extras[r])) + "\n")
            f.flush()
        bar.update(len(chunk) * m)
    bar.close()


def run_config(path):
    """The config.json of the run a checkpoint belongs to, else {} (a base model)."""
    run = _run_dir(path) if os.path.isdir(path) else None
    if run and os.path.isfile(os.path.join(run, "config.json")):
        with open(os.path.join(run, "config.json")) as f:
            return json.load(f)
    return {}


def run_prompt(path, args):
    """(instruction, system prompt, answer form) for a model: the flags, else what its run trained
    with (the run's config.json, for a run's checkpoint; an RLCR run answers in <answer> tags), else
    (None, None, "box"): the benchmark's own instruction."""
    cfg = run_config(path)
    pick = lambda flag, key: flag if flag is not None else cfg.get(key)  # noqa: E731
    form = args.answer or modes.answer_form(cfg.get("reward"))
    return pick(args.instruction, "instruction"), pick(args.system_prompt, "system_prompt"), form


def settings(bench, args):
    """Per-benchmark sampling and confidence settings: world defaults, overridden by flags."""
    toy_world = bench == "toy"
    w = TOY if toy_world else REAL
    s = dict(n=w["n"] if toy_world else BIG_N.get(bench, w["n"]), max_new_tokens=w["max_new_tokens"],
             every=w["every"], forced_k=w["forced_k"], suffix=label_lib.SUFFIX if toy_world else confidence.EVAL_SUFFIX,
             score_batch=w["score_batch"], rows=w["rows"])
    for key in ("n", "max_new_tokens", "every", "forced_k"):
        if getattr(args, key if key != "n" else "n_samples") is not None:
            s[key] = getattr(args, key if key != "n" else "n_samples")
    s["batch"] = args.batch_size or max(1, w["rows"] // s["n"])
    return s


def get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded=(), prompt=(None, None)):
    """(probe or None, post-hoc report or None) for a confidence source; post-hoc probes are cached in OUT."""
    if source == "probe":
        if not os.path.isfile(os.path.join(path, "probe.pt")):
            raise UserError(f"{label} has no probe.pt: use --confidence probe-posthoc, logits or verbal")
        with checkpoint.reading(os.path.join(path, "probe.pt")):
            return probe_lib.load(os.path.join(path, "probe.pt"))[0], None
    if source != "probe-posthoc":
        return None, None
    # Fit data: the toy world's train split, or the RL training set for real models (released: lead_80,
    # the first 80 of the training set); problems of any benchmark being evaluated are skipped.
    toy_only = all(b.partition("=")[0] == "toy" for b in args.benchmarks.split(","))
    src = args.probe_data or ("toy" if toy_only else "deepscaler")
    w = TOY if src == "toy" else REAL
    s = settings("toy" if src == "toy" else src, args)
    if src == "toy":
        pool, instruction = data.load_rows("toy", split="train"), toy.INSTRUCTION
    else:
        pool, instruction = data.load_rows(src), data.INSTRUCTION
    instruction = instruction if prompt[0] is None else prompt[0]
    seen = {r["problem"] for _, rows, _ in loaded for r in rows}
    rows = [r for r in pool if r["problem"] not in seen][:args.probe_questions or w["probe_questions"]]
    protocol = dict(n=args.probe_samples or w["probe_samples"], max_new_tokens=s["max_new_tokens"],
                    temperature=args.temperature, top_p=args.top_p, every=s["every"],
                    count=args.posthoc_budgets or w["posthoc_budgets"], k=s["forced_k"], suffix=s["suffix"],
                    close=args.forced_close, stop=[], copy_natural=True, epochs=100, patience=30, batch=64,
                    val_frac=0.2, seed=42)
    print(f"post-hoc probe for {label}: {len(rows)} {src} questions ...", file=sys.stderr)
    prb, report = confidence.posthoc_probe(
        os.path.join(out_dir, "posthoc_probe_" + label.replace("/", "_")), model, tok, rows,
        instruction, close_id, protocol, batch_size=s["score_batch"], rows=s["rows"], system=prompt[1])
    return prb, dict(report, data=src)


def run_fractions(path):
    """The truncation fractions a run trained its probe at (its config.json), else the default."""
    run = _run_dir(path) or path
    cfg = os.path.join(run, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return tuple(json.load(f).get("budgets", (0.25, 0.5, 0.75)))
    return (0.25, 0.5, 0.75)


def default_confidence(name):
    """The paper's probe rows use the post-hoc probe (Base, GRPO and RLCM alike): the default for
    every model, the toy world included."""
    return "probe-posthoc"


def evaluate_model(name, loaded, args):
    """Generate (resuming), score and summarize one model on every benchmark; returns its results."""
    path = resolve_model(name)
    label = model_label(name, path)
    out_dir = args.out or default_out(name, path)
    if os.path.isdir(out_dir):   # a second writer stops before loading anything
        hold(out_dir)
    model, tok = load_model(name)
    prompt = run_prompt(path, args)
    check_prompts(tok, model, loaded, args, prompt[0])
    hold(out_dir)   # a new folder is made only now that the model loads and the prompts fit
    source = args.confidence or default_confidence(name)
    think = tok.convert_tokens_to_ids("</think>")
    close_id = None if think is None or think == tok.unk_token_id else think
    prb, report = get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded, prompt)
    samples = os.path.join(out_dir, "samples.jsonl")
    res = {"path": path, "confidence": source, "out": out_dir, "benchmarks": {}, "settings": {},
           "provenance": runlog.provenance(args.argv, next(model.parameters()).device)}
    for bench, rows, instruction in loaded:
        s = settings(bench, args)
        instruction = instruction if prompt[0] is None else prompt[0]
        probe_source = source in ("probe", "probe-posthoc") and not args.no_early_exit
        conf_kw = dict(source=source, prb=prb, close_id=close_id, every=s["every"] if probe_source else None,
                       suffix=s["suffix"], close=args.forced_close, fractions=run_fractions(path),
                       forced_k=s["forced_k"], budget=s["max_new_tokens"])
        generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, samples, prompt[1],
                           prompt[2])
        mine = [r for r in read_samples(samples) if r["model"] == label and r["benchmark"] == bench
                and r["question"] < len(rows) and r["sample"] < s["n"]]
        res["benchmarks"][bench] = summarize(mine, seed=args.seed)
        res["settings"][bench] = dict(s, confidence=source, grader=GRADER, answer=prompt[2], temperature=args.temperature,
                                      top_p=args.top_p, seed=args.seed, questions=len(rows),
                                      instruction=instruction, system_prompt=prompt[1],
                                      bootstrap=dict(resamples=1000, unit="question", seed=args.seed))
        b = res["benchmarks"][bench]
        title = f"{label} | {bench} | {source}\nacc {b['acc']:.3f}  ECE {b['ece']:.3f}  n {b['n']}"
        plot_reliability(b["reliability"], title,
                         os.path.join(out_dir, f"reliability_{label.replace('/', '_')}_{bench}.png"))
    res["overall"] = overall(res["benchmarks"])
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
    g.add_argument("--benchmarks", default="toy", help="comma list: toy, math500, aime24, ..., FILE or NAME=FILE")
    g.add_argument("--limit", type=int, help="questions per benchmark")
    g.add_argument("--out", help="output dir (default RUN/eval or eval_out/<model>)")
    g = p.add_argument_group("sampling")
    g.add_argument("--n-samples", type=int, help="samples per question (default 32 on aime/amc, else 4)")
    g.add_argument("--max-new-tokens", type=int, help="default 8000 (toy: 128)")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, help="questions per generation call (default 64 sequences; toy 256)")
    g.add_argument("--decode", choices=("static", "dynamic"), help="KV cache for decoding (default: static on CUDA)")
    g.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 for the toy world on CPU)")
    g = p.add_argument_group("confidence")
    g.add_argument("--confidence", choices=confidence.SOURCES,
                   help="default probe-posthoc (the paper's probe rows); probe: the run's own probe.pt, read "
                        "at its last training budget; verbal: the <confidence> tag; verbal-forced: the mean tag of "
                        "--forced-k re-answers after the thinking (RLCR's released reading); logits: C2GSPG's")
    g.add_argument("--every", type=int, help="thinking tokens between probe budgets / exit checkpoints (500; toy 8)")
    g.add_argument("--posthoc-budgets", type=int, help="post-hoc budgets per rollout: every, 2 * every, ... (16)")
    g.add_argument("--forced-k", type=int, help="forced answers per budget for post-hoc labels (16; toy 4)")
    g.add_argument("--forced-close", choices=("think", "eos"), default="think")
    g.add_argument("--probe-data", help="questions for the post-hoc probe (default: toy train split / deepscaler)")
    g.add_argument("--probe-questions", type=int, help="how many (default 80, as released)")
    g.add_argument("--probe-samples", type=int, help="rollouts per post-hoc question (default 8, as released)")
    g.add_argument("--no-early-exit", action="store_true", help="skip the forced answers at exit checkpoints")
    g = p.add_argument_group("prompt (default: what the run trained with, else the benchmark's)")
    g.add_argument("--instruction", help="text appended to every problem")
    g.add_argument("--system-prompt", help="system turn before the problem")
    g.add_argument("--answer", choices=("box", "tag"),
                   help="where the answer is read: the last \\boxed{} (default) or the last <answer> tag "
                        "(default for a run trained with --reward rlcr)")
    args = p.parse_args(argv)
    args.argv = ["evaluate.py", *(sys.argv[1:] if argv is None else argv)]  # for results.json provenance
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        check_values(vars(args), LIMITS)
        if args.out:
            check_out(args.out)
    except UserError as e:
        raise SystemExit(f"evaluate.py: error: {e}") from None
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    threads = torch.get_num_threads()
    # The toy model's matmuls are too small to gain from threads, and on a busy CPU threads that
    # wait for each other make generation 10x slower: one thread unless --threads says otherwise.
    if args.threads or (not torch.cuda.is_available() and all(n == "toy" for n in names)):
        torch.set_num_threads(args.threads or 1)
    try:
        for name in args.model:   # a missing model is a model error, not a benchmark's
            checkpoint.check_available(name)
        loaded = [load_benchmark(b, args.limit) for b in names]   # every name checked before any model loads
        results = dict(evaluate_model(name, loaded, args) for name in args.model)
    except checkpoint.Busy as e:   # another evaluation writes there: exit 2, its files untouched
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, OSError) as e:   # UserError, data.DataError and user-facing ValueErrors
        raise SystemExit(f"evaluate.py: error: {e}") from None
    except KeyboardInterrupt:   # samples are appended per batch: the same command continues from here
        results = None          # the line is printed below, once the progress bar has closed
    finally:
        torch.set_num_threads(threads)
        LOCKS.close()
        HELD.clear()
    if results is None:
        print("\ninterrupted: the samples so far are kept; run the same command again to continue",
              file=sys.stderr)
        raise SystemExit(130)
    print(table(results))
    print()
    print(report_uses(results))
    return results


if __name__ == "__main__":
    main()
