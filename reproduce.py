"""Reproduce the paper's comparison on the toy world: each method trained from the committed
toy_base for several seeds, evaluated with its matching confidence, one table (OUT/table.md).

    python reproduce.py                                # Base, GRPO, RLCR, C2GSPG, RLCM; seeds below
    python reproduce.py --ablations                    # + Final-Margin, Process-Brier, Final-Brier
    python reproduce.py --methods grpo,rlcm --seeds 0  # a part of it

What was made with these arguments is not redone, so the same command continues. docs/reference.md,
"The paper's comparison, on the toy world", says what each run is and what it printed."""
import argparse
import contextlib
import io
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import config
import data
import evaluate
from evaluation.report import clean, overall, read_results
from evaluation.benchmarks import model_id, model_label
from harness import checkpoint, files, parallel, runlog
from harness.checkpoint import check_out, read_config
from harness.files import UserError

MAIN = ("base", "grpo", "rlcr", "c2gspg", "rlcm")
ABLATIONS = ("final-margin", "process-brier", "final-brier")
NAMES = dict(zip(MAIN + ABLATIONS, ("Base", "GRPO", "RLCR", "C2GSPG", "RLCM", "Final-Margin",
                                    "Process-Brier", "Final-Brier")))
# evaluate.py --confidence of each method: the paper's (docs/design.md, "Baselines")
CONFIDENCE = dict(dict.fromkeys(MAIN + ABLATIONS, "probe-posthoc"), rlcr="verbal", c2gspg="logits")
KEYS = (("Acc", "acc"), ("PCE", "pce"), ("ECE", "ece"), ("Brier", "brier"), ("AUROC", "auroc"))
BENCHMARKS = data.TOY_BENCHMARKS  # all methods on each; "Overall": unweighted mean, as in the paper
PAIR = ("grpo", "rlcm")            # the headline pair: more seeds, and their paired difference
quiet = lambda msg: None  # noqa: E731
SEEDS = dict(dict.fromkeys(MAIN + ABLATIONS, (0, 1, 2)), **dict.fromkeys(PAIR, (0, 1, 2, 3, 4)))
ROOT = os.path.dirname(os.path.abspath(__file__))
# What --train-args / --eval-args may not set: what a row is (a config file sets all of it)
ROW = {"--train-args": ("reward", "seed", "model", "out", "resume", "config", "toy_world"),
       "--eval-args": ("model", "seed", "out", "confidence")}


def parse_args(argv):
    """(args, methods, seeds {method: [seed]}, jobs), every value checked first (UserError)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", help=f"comma list of {', '.join(MAIN + ABLATIONS)} (default: the main table)")
    p.add_argument("--ablations", action="store_true", help="add " + ", ".join(ABLATIONS) + " (a second table)")
    p.add_argument("--seeds", help="comma list of seeds for every method (default: grpo, rlcm 0-4, others 0-2)")
    p.add_argument("--jobs", default="2", help="trainings/evaluations run at once (default 2)")
    p.add_argument("--out", default=os.path.join("runs", "reproduce"))
    p.add_argument("--train-args", default="", help='passed to every train.py, e.g. "--steps 2 --eval-n 8"')
    p.add_argument("--eval-args", default="", help='passed to every evaluate.py, e.g. "--limit 4"')
    args = p.parse_args(argv)
    known, methods = MAIN + ABLATIONS, MAIN + (ABLATIONS if args.ablations else ())
    if args.methods is not None:
        given = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in given if m not in known] or ([] if given else [args.methods])
        if bad:
            raise UserError(f"--methods {args.methods}: unknown method {bad[0]!r}; known: {', '.join(known)}")
        methods = tuple(m for m in known if m in given)
    words = args.seeds.split(",") if args.seeds is not None else ["0"]
    seeds = [int(s) for s in words if s.strip().isdecimal()]   # isdecimal: not "-1", nor "²"
    if len(seeds) < len(words) or len(set(seeds)) < len(seeds) or max(seeds) >= 2**32:
        raise UserError(f"--seeds {args.seeds}: give distinct integers in [0, 2**32), e.g. 0,1,2")
    seeds = {m: list(SEEDS[m]) if args.seeds is None else seeds for m in methods}
    if not args.jobs.strip().isdecimal() or int(args.jobs) < 1:
        raise UserError(f"--jobs {args.jobs}: must be an integer >= 1")
    try:
        args.train_args, args.eval_args = shlex.split(args.train_args), shlex.split(args.eval_args)
    except ValueError as e:
        raise UserError(f"--train-args / --eval-args: cannot split ({e}): check the quotes") from None
    for flag, parse, words in (("--train-args", config.build_parser().parse_args, args.train_args),
                               ("--eval-args", evaluate.parse_args, args.eval_args)):   # typos
        parsed(parse, ["--model", "toy", *words], f"{flag} {shlex.join(words)}")
    for flag, parser, words in (("--train-args", config.build_parser(), args.train_args),
                                ("--eval-args", evaluate.build_parser(), args.eval_args)):
        for a in parser._actions:   # what `words` set (abbreviations too), whatever the defaults
            a.default, a.required = argparse.SUPPRESS, False
        row = [k for k in ROW[flag] if k in vars(parser.parse_args(words))]
        if row:   # a row is its method and seed, on the toy, in its own folder
            raise UserError(f"{flag} {shlex.join(words)}: --{row[0]} would make a row another run "
                            "than its name says; reproduce.py sets it for each row: use --methods, "
                            "--seeds or --out")
    check_out(args.out)
    return args, methods, seeds, int(args.jobs)


def parsed(parse, words, what):
    """parse(words), with argparse's usage-and-exit on a bad word turned into one UserError line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(words)
    except SystemExit:
        why = (err.getvalue().strip().splitlines() or ["cannot parse them"])[-1].partition("error: ")
        raise UserError(f"{what}: {why[2] or why[0]}") from None


def train_cmd(method, seed, run):   # before --train-args
    return ["--reward", method, "--seed", str(seed), "--out", run]


def eval_cmd(method, seed, run, ev):   # before --eval-args
    return ["--model", run or "toy", "--benchmarks", ",".join(BENCHMARKS),
            "--confidence", CONFIDENCE[method], "--seed", str(seed), "--no-early-exit", "--out", ev]


def paths(out, method, seed):   # (run folder, None for the base; eval folder; log prefix)
    name = f"{method}-seed{seed}"
    return (None if method == "base" else os.path.join(out, "runs", name),
            os.path.join(out, "eval", name), os.path.join(out, "logs", name))


def model_of(run):
    """(label, model_id) of the base (run None) or the run's latest checkpoint, as evaluate.py's."""
    if run is None:
        return "toy", model_id(checkpoint.resolve_model("toy"))
    ckpt = checkpoint.latest_checkpoint(run, quiet)
    return (model_label(run, ckpt), model_id(ckpt)) if ckpt else (None, None)


def eval_entry(eval_dir, label, ident):
    """This model's (`ident`) entry in EVAL/results.json with every toy benchmark, else None."""
    entry = read_results(eval_dir).get(label, {})
    complete = entry.get("model_id") == ident and all(b in entry["benchmarks"] for b in BENCHMARKS)
    return entry if complete else None


def made_with(entry, cmd):
    """Whether evaluate.py made `entry` with the arguments `cmd`."""
    try:
        then = shlex.split(entry["provenance"]["command"])[1:]   # "evaluate.py ARGS"
        then = vars(parsed(evaluate.parse_args, then, "results.json"))
    except (KeyError, TypeError, ValueError, UserError):
        return False
    return {**then, "argv": None} == {**vars(evaluate.parse_args(cmd)), "argv": None}


def training(run, ev, method, seed, extra):
    """train.py's arguments that bring `run` to what train_cmd + `extra` makes (a resume if it has
    fewer steps), None if it is there. A run of other settings is refused, not mixed nor deleted."""
    cmd = train_cmd(method, seed, run)
    ckpt = os.path.isfile(os.path.join(run, "config.json")) and checkpoint.latest_checkpoint(run, quiet, resume=True)
    if not ckpt:
        return cmd + extra
    saved, wanted = read_config(run), config.resolve_args(cmd + extra)
    skip = set(config.NOT_SAVED) | {"out", "steps", "trust_remote_code"}
    redo = f"remove it and {ev} to train and evaluate it again, or pass another --out"
    differ = [f"--{k.replace('_', '-')} {saved[k]} (this command: {wanted[k]})" for k in saved
              if k in wanted and k not in skip and saved[k] != json.loads(json.dumps(wanted[k]))]
    if differ:
        raise UserError(f"{run} was trained with other settings: {', '.join(differ)}; {redo}")
    step, steps = checkpoint.step_of(ckpt), wanted["steps"]
    if step > steps:
        raise UserError(f"{run} is trained to step {step} (this command: --steps {steps}): {redo}")
    return None if step == steps else ["--resume", run, "--steps", str(steps), *extra]


def child(cmd, log):
    """Run cmd, its output appended to LOG: None when it exits 0, else why not, with the log's last
    lines. It dies with this process (harness/parallel.py's death signal): a kill leaves none."""
    with files.appending(log) as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, preexec_fn=parallel._die_with_parent).returncode
    if rc:
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = "".join(f"\n  | {line}" for line in f.read().splitlines()[-8:])
        return f" (exit {rc}): {shlex.join(cmd)}\n  log: {log}{tail}"


def job(args, todo, say, method, seed):
    """Train one method and seed (todo: train.py's arguments, None if done), then evaluate it unless
    its evaluation was made with these arguments. say(line, why) prints a line per step."""
    run, ev, log = paths(args.out, method, seed)
    name, py, t = f"{method} seed {seed}", sys.executable, time.time()
    try:
        if run is not None:
            how = todo[method, seed]
            why = how and child([py, os.path.join(ROOT, "train.py"), *how], log + ".train.log")
            if why:
                return say(f"{name}: training", why)
            say(f"{name}: " + (f"trained in {time.time() - t:.0f} s" if how else "trained already"))
        (label, ident), t = model_of(run), time.time()
        cmd = eval_cmd(method, seed, run, ev) + args.eval_args
        entry = eval_entry(ev, label, ident)
        fresh = entry is None or not made_with(entry, cmd)
        if fresh:
            why = child([py, os.path.join(ROOT, "evaluate.py"), *cmd], log + ".eval.log")
            entry = eval_entry(ev, label, ident)
            if why or entry is None:
                return say(f"{name}: evaluation",
                           why or f": {ev}/results.json holds no complete toy results of {label}")
        accs = ", ".join(f"{b} {entry['benchmarks'][b]['acc']:.3f}" for b in BENCHMARKS)
        took = f"evaluated in {time.time() - t:.0f} s" if fresh else "evaluated already"
        return say(f"{name}: {took} (acc {accs}; n {entry['benchmarks'][BENCHMARKS[0]]['n']} each)")
    except (UserError, OSError, ValueError, KeyError) as e:   # a damaged config.json, results.json
        return say(name, f": {type(e).__name__}: {e}")


def stop(*_):
    """Ctrl-C or SIGTERM: exit now; the children die with this process, finished steps stay."""
    print("\ninterrupted: finished steps are kept; run the same command again to continue",
          file=sys.stderr, flush=True)
    os._exit(130)


def over_seeds(out, methods, seeds):
    """{method: {confidence, seeds: {seed: {benchmarks, model, run, eval, confidence}}, mean and
    std: {benchmark or "Overall": {key: x}}}} from each seed's results.json."""
    agg = {}
    for m in methods:
        per = {}
        for s in seeds[m]:
            run, ev, _ = paths(out, m, s)
            label, ident = model_of(run)
            entry = eval_entry(ev, label, ident)   # complete: every job ended with one
            keep = ("acc", "pce", "ece", "brier", "auroc", "n")
            benches = {b: {k: entry["benchmarks"][b][k] for k in keep} for b in BENCHMARKS}
            per[s] = dict(benchmarks=dict(benches, Overall=overall(benches)), model=label, run=run,
                          eval=ev, confidence=entry["confidence"])
        stats = {p: {k: mean_std([per[s]["benchmarks"][p][k] for s in per]) for _, k in KEYS}
                 for p in BENCHMARKS + ("Overall",)}
        agg[m] = dict(confidence=CONFIDENCE[m], seeds=per,
                      mean={p: {k: v[0] for k, v in d.items()} for p, d in stats.items()},
                      std={p: {k: v[1] for k, v in d.items()} for p, d in stats.items()})
    return agg


def tables(agg, methods):
    """The paper's layout: Acc / PCE / ECE per benchmark; then Brier and AUROC."""
    parts = BENCHMARKS + ("Overall",)
    main, side = KEYS[:3], KEYS[3:]   # Acc, PCE, ECE; Brier, AUROC
    head = lambda keys: " | ".join(f"{p} {c}" for p in parts for c, _ in keys)  # noqa: E731
    cells = lambda r, keys: " | ".join(cell(r["mean"][p][k], r["std"][p][k])  # noqa: E731
                                       for p in parts for _, k in keys)
    lines = [f"| method | confidence | {head(main)} |", "|---|---|" + "---:|" * (len(parts) * len(main))]
    lines += [f"| {NAMES[m]} | {agg[m]['confidence']} | {cells(agg[m], main)} |" for m in methods]
    lines += ["", f"| method | {head(side)} |", "|---|" + "---:|" * (len(parts) * len(side))]
    lines += [f"| {NAMES[m]} | {cells(agg[m], side)} |" for m in methods]
    return "\n".join(lines)


def write_outputs(out, methods, seeds, argv):
    """OUT/table.md (returned) and OUT/results.json (every seed's numbers)."""
    agg, diffs = over_seeds(out, methods, seeds), None
    prov = runlog.provenance(["reproduce.py", *argv], device="cpu")
    commit = prov["git_commit"][:7] + ("+dirty" if prov["git_commit"].endswith("+dirty") else "")
    md = [f"Toy-world reproduction, {prov['date'].replace('T', ' ').replace('+00:00', ' UTC')}; "
          f"command `python {prov['command']}`; commit {commit}; seeds "
          + "; ".join(f"{NAMES[m]}: {', '.join(map(str, seeds[m]))}" for m in methods)
          + " (mean +- sample std over seeds); benchmarks " + ", ".join(BENCHMARKS)
          + " (Overall: their unweighted mean)", ""]
    for part in ([m for m in methods if m in MAIN], [m for m in methods if m in ABLATIONS]):
        if part:
            md += [tables(agg, part), ""]
    if all(m in agg for m in PAIR):   # the headline pair's paired difference
        a, b = (agg[m]["seeds"] for m in PAIR)
        diffs = {p: {k: paired(*({s: x[s]["benchmarks"][p][k] for s in x} for x in (a, b)))
                     for k in ("acc", "pce", "ece")} for p in BENCHMARKS + ("Overall",)}
        md += ["Paired difference RLCM - GRPO (same seed, base and data order): mean [95 % t interval over "
               "seeds] (seeds)", "", "| RLCM - GRPO | Acc | PCE | ECE |", "|---|---:|---:|---:|"]
        md += [f"| {p} | " + " | ".join("-" if x is None else f"{x['mean']:+.3f} [{x['lo']:+.3f}, "
                                        f"{x['hi']:+.3f}] (n {x['n']})" for x in d.values()) + " |"
               for p, d in diffs.items()] + [""]
    files.write_json(os.path.join(out, "results.json"), clean(dict(
        methods=agg, seeds=seeds, benchmarks=list(BENCHMARKS), differences=diffs,
        command=prov["command"], date=prov["date"], git_commit=prov["git_commit"], provenance=prov)))
    text = "\n".join(md) + "\n"
    with files.replacing(os.path.join(out, "table.md")) as f:
        f.write(text)
    return text


def mean_std(values):
    """(mean, sample std with ddof=1) of the finite values (None and nan skipped); std None for one
    value, both None for none. [0.5, 0.6, None] -> (0.55, 0.0707)."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def t_quantile(df, p=0.975):
    """Student's t quantile (p in (0.5, 1)): the density integrated by Simpson's rule, inverted by
    bisection (numpy has none, and scipy is not a requirement). df 4 -> 2.7764."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        x = np.linspace(0, mid := (lo + hi) / 2, 2001)
        f = const * (1 + x * x / df) ** (-(df + 1) / 2)
        cdf = 0.5 + mid / 6000 * (f[0] + 4 * f[1::2].sum() + 2 * f[2:-1:2].sum() + f[-1])
        lo, hi = (mid, hi) if cdf < p else (lo, mid)
    return (lo + hi) / 2


def paired(a, b):
    """The paired difference b - a ({seed: x}) over the seeds both have: per seed, its mean and a
    95 % t interval (mean +- t(0.975, n - 1) * sd / sqrt(n)); None under two seeds."""
    diffs = {s: b[s] - a[s] for s in a if s in b and a[s] is not None and b[s] is not None}
    if len(diffs) < 2:
        return None
    mean, sd = mean_std(list(diffs.values()))
    pm = t_quantile(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return dict(per_seed=diffs, mean=mean, lo=mean - pm, hi=mean + pm, pm=pm, n=len(diffs))


def cell(mean, sd):   # "0.512 +- 0.034"; "0.512" without an sd, "-" without a mean
    return "-" if mean is None else f"{mean:.3f}" + ("" if sd is None else f" +- {sd:.3f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, methods, seeds, jobs = parse_args(argv)
        work = [(m, s) for s in sorted(set().union(*seeds.values())) for m in methods
                if s in seeds[m]]   # seed by seed: stopped early, it has whole seeds
        todo = {(m, s): training(*paths(args.out, m, s)[:2], m, s, args.train_args)
                for m, s in work if m != "base"}
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    t0, done, failed, lock = time.time(), [], [], threading.Lock()

    def say(line, why=None):   # a line per step, "[3/8] ..." or "FAILED ...": whether it went well
        with lock:
            (failed if why else done).append(line)
            total = len(work) + len(todo)
            print(f"FAILED {line}{why}" if why else f"[{len(done)}/{total}] {line}", flush=True)
        return not why

    default = signal.signal(signal.SIGTERM, stop)
    with ThreadPoolExecutor(jobs) as pool:
        try:
            ok = list(pool.map(lambda ms: job(args, todo, say, *ms), work))
        except KeyboardInterrupt:   # Ctrl-C (the children got it too)
            stop()
        finally:
            signal.signal(signal.SIGTERM, default)
    print(f"total {time.time() - t0:.0f} s")
    if not all(ok):
        print(f"{len(failed)} step(s) failed ({'; '.join(failed)}): no table written; fix the "
              "cause and run the same command again (finished steps are kept)", file=sys.stderr)
        raise SystemExit(1)
    print("\n" + write_outputs(args.out, methods, seeds, argv))


if __name__ == "__main__":
    main()
