"""Reproduce the paper's comparison on the toy world: each method trained from the same base policy
(the committed toy_base) for several seeds, each evaluated with its matching confidence, one table.

    python reproduce.py                                  # Base, GRPO, RLCR, C2GSPG, RLCM x seeds 0,1,2
    python reproduce.py --ablations                      # + Final-Margin, Process-Brier, Final-Brier
    python reproduce.py --methods grpo,rlcm --seeds 0    # a part of it

How long (2 CPU cores, --jobs 2): the main table (12 trainings of 45 steps, 15 evaluations of 2000
samples) took 1216 s (20 min) on a fresh clone; the ablations add 9 trainings and evaluations; a rerun
with nothing left to do takes seconds.

Per method M and seed S: `train.py --reward M --seed S --out OUT/runs/M-seedS` (not for the base),
then `evaluate.py --model RUN --benchmarks toy --confidence C --seed S --no-early-exit --out
OUT/eval/M-seedS` with C the method's confidence (the post-hoc probe; RLCR: verbal; C2GSPG: the
sequence likelihood). The base is evaluated once per seed too, so its spread shows the measurement
noise. --jobs of these run at once as subprocesses (one thread each), logs in OUT/logs/.
Resumable: a training or evaluation made with the arguments this command passes is not redone, an
interrupted one continues (train.py --resume, evaluate.py's samples.jsonl): run the same command
again. A run made with other settings (a smoke test's, into the same --out) is refused in one line;
an evaluation made with other arguments is done again. Killed (SIGTERM, or SIGKILL), it takes its
children with it. Finally OUT/table.md (mean +- std over seeds), OUT/results.json (every seed's
numbers) and OUT/reliability_M.png (all seeds pooled).
"""
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

from harness import checkpoint
import metrics
from harness import runlog
from harness.checkpoint import UserError
from harness import config
import evaluate
from harness import launch
from evaluation.report import clean, plot_reliability

MAIN = ("base", "grpo", "rlcr", "c2gspg", "rlcm")
ABLATIONS = ("final-margin", "process-brier", "final-brier")
NAMES = dict(zip(MAIN + ABLATIONS, ("Base", "GRPO", "RLCR", "C2GSPG", "RLCM", "Final-Margin", "Process-Brier",
                                    "Final-Brier")))
# evaluate.py --confidence of each method: the paper's (docs/design.md, "Baselines")
CONFIDENCE = dict(dict.fromkeys(MAIN + ABLATIONS, "probe-posthoc"), rlcr="verbal", c2gspg="logits")
KEYS = (("Acc", "acc"), ("PCE", "pce"), ("ECE", "ece"), ("Brier", "brier"), ("AUROC", "auroc"))
ROOT = os.path.dirname(os.path.abspath(__file__))
# What reproduce.py itself passes each run: --train-args / --eval-args that would change one is refused,
# since the table labels every row with its method, seed and confidence.
TRAIN_FIXED = ("reward", "seed", "out", "resume", "model", "plot")
EVAL_FIXED = ("model", "benchmarks", "confidence", "seed", "out")
PRINT, STOP = threading.Lock(), threading.Event()
CHILDREN, CHILDREN_LOCK = set(), threading.Lock()   # the running train.py / evaluate.py processes
quiet = lambda msg: None  # noqa: E731


def parse_args(argv):
    """(args, methods, seeds, jobs): every value checked before anything runs (UserError)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", help="comma list of " + ", ".join(MAIN + ABLATIONS) + " (default: the main table)")
    p.add_argument("--ablations", action="store_true", help="add " + ", ".join(ABLATIONS) + " (a second table)")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default 0,1,2)")
    p.add_argument("--jobs", default="2", help="trainings/evaluations run at once (default 2)")
    p.add_argument("--out", default=os.path.join("runs", "reproduce"))
    p.add_argument("--train-args", default="", help='passed to every train.py, e.g. "--steps 2 --eval-n 8"')
    p.add_argument("--eval-args", default="", help='passed to every evaluate.py, e.g. "--limit 4"')
    args = p.parse_args(argv)
    known = MAIN + ABLATIONS
    methods = MAIN + (ABLATIONS if args.ablations else ())
    if args.methods is not None:
        given = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in given if m not in known] or ([] if given else [args.methods])
        if bad:
            raise UserError(f"--methods {args.methods}: unknown method {bad[0]!r}; known: {', '.join(known)}")
        methods = tuple(m for m in known if m in given)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) < len(seeds) or not all(0 <= s < 2**32 for s in seeds):
        raise UserError(f"--seeds {args.seeds}: give distinct integers in [0, 2**32), e.g. 0,1,2")
    try:
        jobs = int(args.jobs)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be an integer >= 1")
    try:
        args.train_args, args.eval_args = shlex.split(args.train_args), shlex.split(args.eval_args)
    except ValueError as e:
        raise UserError(f"--train-args / --eval-args: cannot split ({e}): check the quotes") from None
    for m in methods:
        for s in seeds:
            run, ev, _ = paths(args.out, m, s)
            if run is not None:
                refuse_overrides("--train-args", train_flags, train_cmd(m, s, run), args.train_args, TRAIN_FIXED)
            refuse_overrides("--eval-args", evaluate.parse_args, eval_cmd(m, s, run, ev), args.eval_args, EVAL_FIXED)
    config.check_out(args.out)
    return args, methods, seeds, jobs


def parsed(parse, words, what):
    """parse(words), with argparse's usage-and-exit on a bad word turned into one UserError line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(words)
    except SystemExit:
        why = (err.getvalue().strip().splitlines() or ["cannot parse them"])[-1].partition("error: ")
        raise UserError(f"{what}: {why[2] or why[0]}") from None


def refuse_overrides(flag, parse, base, extra, fixed):
    """UserError naming the first of `fixed` that `extra`, appended to the command `base`, would change
    (the last occurrence of a flag wins)."""
    what = f"{flag} {shlex.join(extra)}"
    before, after = vars(parsed(parse, base, what)), vars(parsed(parse, base + extra, what))
    for key in fixed:
        if after[key] != before[key]:
            raise UserError(f"{what}: --{key.replace('_', '-')} is reproduce.py's to set for each method and "
                            f"seed (here {before[key]}); drop it (--methods, --seeds and --out choose what runs)")


def train_flags(words):
    return config.build_parser().parse_args(words)


def train_cmd(method, seed, run):
    """train.py's arguments for a new run, before --train-args."""
    return ["--reward", method, "--seed", str(seed), "--out", run]


def eval_cmd(method, seed, run, ev):
    """evaluate.py's arguments, before --eval-args."""
    return ["--model", run or "toy", "--benchmarks", "toy", "--confidence", CONFIDENCE[method], "--seed", str(seed),
            "--no-early-exit", "--out", ev]


def paths(out, method, seed):
    """(run dir or None for the base, eval dir, log prefix) of one job."""
    name = f"{method}-seed{seed}"
    return (None if method == "base" else os.path.join(out, "runs", name), os.path.join(out, "eval", name),
            os.path.join(out, "logs", name))


def training(run, ev, cmd, extra):
    """train.py's arguments that bring `run` to what `train.py CMD EXTRA` makes there, None when it is
    there already: CMD EXTRA for a folder without a checkpoint, a resume for a run with fewer steps.
    The settings a run was made with are its config.json; a run made with other ones (a smoke test's
    --steps 1, another --lr) is refused, not continued (that would mix two settings in one run) nor
    trained again (that would delete a run someone may want): the line says what differs and what to do."""
    ckpt = os.path.isfile(os.path.join(run, "config.json")) and checkpoint.latest_checkpoint(run, quiet, resume=True)
    if not ckpt:
        return cmd + extra
    saved, wanted = config.read_config(run), config.resolve_args(cmd + extra)
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


def model_label(run):
    """The name evaluate.py files this model under (evaluate.model_label): toy, or RUN_NAME/step_NNNNNN
    for the run's latest checkpoint; None before its first checkpoint."""
    if run is None:
        return "toy"
    ckpt = checkpoint.latest_checkpoint(run, quiet)
    return ckpt and evaluate.model_label(run, ckpt)


def eval_entry(eval_dir, label):
    """This model's entry of EVAL/results.json if its toy results hold every metric as a number (AUROC
    may be None: one class), else None: an evaluation still to do, so a rerun replaces a damaged entry."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    try:
        with open(os.path.join(eval_dir, "results.json"), encoding="utf-8") as f:
            entry = json.load(f).get(label)
        toy = entry["benchmarks"]["toy"]
        complete = all(number(toy.get(k)) for k in ("acc", "pce", "ece", "brier", "n")) and \
            (toy.get("auroc") is None or number(toy["auroc"]))
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return entry if complete else None


def made_with(entry, cmd):
    """Whether evaluate.py made `entry` with the arguments `cmd` (its recorded command, parsed)."""
    try:
        then = shlex.split(entry["provenance"]["command"])[1:]   # "evaluate.py ARGS"
        then = vars(parsed(evaluate.parse_args, then, "results.json"))
    except (KeyError, TypeError, ValueError, UserError):
        return False
    now = vars(evaluate.parse_args(cmd))
    return {**then, "argv": None} == {**now, "argv": None}


def held_out(run):
    """(accuracy at the first held-out check, at the last) from RUN/metrics.jsonl, else (None, None)."""
    rows = checkpoint.read_jsonl(os.path.join(run, "metrics.jsonl"), say=quiet) if run else []
    rows = sorted((r["step"], r["eval_accuracy"]) for r in rows if r.get("eval") and "eval_accuracy" in r)
    return (rows[0][1], rows[-1][1]) if rows else (None, None)


class Jobs:
    """One (method, seed) per call, run in a pool thread: train, then evaluate; one line per finished step."""

    def __init__(self, args, total, todo):
        self.args, self.total, self.todo, self.done, self.failed = args, total, todo, 0, []
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def say(self, line):
        with PRINT:
            self.done += 1
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def fail(self, what, detail):
        with PRINT:
            self.failed.append(what)
            print(f"FAILED {what}{detail}", flush=True)
        return False

    def child(self, cmd, log, what):
        """Run cmd with its output appended to log; True when it exits 0, else say why and False."""
        with checkpoint.appending(log) as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            with CHILDREN_LOCK:   # so that stop_children() sees every child started before STOP
                if STOP.is_set():
                    return False
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self.env, preexec_fn=launch._die_with_parent)
                CHILDREN.add(proc)
            rc = proc.wait()
            with CHILDREN_LOCK:
                CHILDREN.discard(proc)
        if rc == 0 or STOP.is_set():   # after a Ctrl-C the children's exits are no news
            return rc == 0
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = "".join(f"\n  | {line}" for line in f.read().splitlines()[-8:])
        return self.fail(what, f" (exit {rc}): {shlex.join(cmd)}\n  log: {log}{tail}")

    def __call__(self, method, seed):
        try:
            return self.job(method, seed)
        except (UserError, OSError, ValueError, KeyError) as e:   # a damaged config.json or results.json
            return self.fail(f"{method} seed {seed}", f": {type(e).__name__}: {e}")

    def job(self, method, seed):
        run, ev, log = paths(self.args.out, method, seed)
        name, py = f"{method} seed {seed}", sys.executable
        if run is not None:
            how, t = self.todo[method, seed], time.time()
            if how is not None and not self.child([py, os.path.join(ROOT, "train.py"), *how], log + ".train.log",
                                                  f"{name}: training"):
                return False
            start, end = held_out(run)
            self.say(f"{name}: " + (f"trained in {time.time() - t:.0f} s" if how is not None else "trained already") +
                     (f" (held-out {start:.2f} -> {end:.2f})" if start is not None else ""))
        label, t, fresh = model_label(run), time.time(), False
        cmd = eval_cmd(method, seed, run, ev) + self.args.eval_args
        entry = eval_entry(ev, label)
        if entry is None or not made_with(entry, cmd):
            if not self.child([py, os.path.join(ROOT, "evaluate.py"), *cmd], log + ".eval.log", f"{name}: evaluation"):
                return False
            entry, fresh = eval_entry(ev, label), True
            if entry is None:
                return self.fail(f"{name}: evaluation", f": {ev}/results.json holds no complete toy results of {label}")
        b = entry["benchmarks"]["toy"]
        self.say(f"{name}: " + (f"evaluated in {time.time() - t:.0f} s" if fresh else "evaluated already") +
                 f" (acc {b['acc']:.3f}, ECE {b['ece']:.3f}, n {b['n']})")
        return True


def mean_std(values):
    """(mean, sample std with ddof=1) of the finite values; std None for one value, both None for none."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def aggregate(out, methods, seeds):
    """{method: {confidence, seeds: {seed: numbers and paths}, mean: {key: x}, std: {key: x}}} from each
    OUT/eval/M-seedS/results.json (toy benchmark) and, for trained methods, OUT/runs/M-seedS/metrics.jsonl."""
    agg = {}
    for m in methods:
        per = {}
        for s in seeds:
            run, ev, _ = paths(out, m, s)
            label = model_label(run)
            entry = eval_entry(ev, label)
            if entry is None:
                raise UserError(f"{ev}/results.json holds no complete toy results for {label}: run the command again")
            b, st = entry["benchmarks"]["toy"], entry.get("settings", {}).get("toy", {})
            start, end = held_out(run)
            per[s] = dict({k: b[k] for _, k in KEYS}, n=b["n"], heldout_start=start, heldout_end=end,
                          model=label, run=run, eval=ev, confidence=entry["confidence"],
                          questions=st.get("questions"), samples=st.get("n"))
        keys = [k for _, k in KEYS] + ["heldout_start", "heldout_end"]
        stats = {k: mean_std([per[s][k] for s in seeds]) for k in keys}
        agg[m] = dict(confidence=CONFIDENCE[m], seeds=per, mean={k: v[0] for k, v in stats.items()},
                      std={k: v[1] for k, v in stats.items()})
    return agg


def cell(res, key):
    mean, std = res["mean"][key], res["std"][key]
    if mean is None:
        return "-"
    return f"{mean:.3f}" + (f" +- {std:.3f}" if std is not None else "")


def table(agg, methods):
    lines = ["| method | confidence | " + " | ".join(c for c, _ in KEYS) + " | held-out acc (train start -> end) |",
             "|---|---|" + "---:|" * len(KEYS) + "---|"]
    for m in methods:
        r = agg[m]
        span = "-" if r["mean"]["heldout_start"] is None else \
            f"{cell(r, 'heldout_start')} -> {cell(r, 'heldout_end')}"
        lines.append(f"| {NAMES[m]} | {r['confidence']} | " + " | ".join(cell(r, k) for _, k in KEYS) + f" | {span} |")
    return "\n".join(lines)


def accuracy_se(agg):
    """Standard error sqrt(p(1-p)/n) of one accuracy at the base's (else the first method's) accuracy."""
    m = "base" if "base" in agg else next(iter(agg))
    p, n = agg[m]["mean"]["acc"], next(iter(agg[m]["seeds"].values()))["n"]
    return dict(method=m, p=p, n=n, se=math.sqrt(p * (1 - p) / n))


def plot_pooled(out, m, res):
    """OUT/reliability_M.png: the reliability diagram of every seed's evaluation samples pooled."""
    conf, correct = [], []
    for s in res["seeds"].values():
        for r in checkpoint.read_jsonl(os.path.join(s["eval"], "samples.jsonl"), say=quiet):
            if (r["model"] == s["model"] and r["benchmark"] == "toy" and r["question"] < (s["questions"] or math.inf)
                    and r["sample"] < (s["samples"] or math.inf)):
                conf.append(r["confidence"]), correct.append(r["correct"])
    path = os.path.join(out, f"reliability_{m}.png")
    c = metrics.calibration(conf, correct)
    title = f"{NAMES[m]} | toy | {res['confidence']} | {len(res['seeds'])} seeds\nacc {c['acc']:.3f}  ECE {c['ece']:.3f}  n {c['n']}"
    plot_reliability(metrics.reliability(conf, correct), title, path)
    return path


def write_outputs(out, methods, seeds, argv):
    """table.md, results.json and the reliability diagrams; returns the markdown."""
    agg = aggregate(out, methods, seeds)
    prov = runlog.provenance(["reproduce.py", *argv], device="cpu")
    commit = prov["git_commit"][:7] + ("+dirty" if prov["git_commit"].endswith("+dirty") else "")
    se = accuracy_se(agg)
    md = [f"Toy-world reproduction, {prov['date'].replace('T', ' ').replace('+00:00', ' UTC')}; "
          f"command `python {prov['command']}`; commit {commit}; seeds {', '.join(map(str, seeds))} "
          "(mean +- sample std over seeds)", ""]
    main, abl = [m for m in methods if m in MAIN], [m for m in methods if m in ABLATIONS]
    for part in (main, abl):
        if part:
            md += [table(agg, part), ""]
    md.append(f"Standard error of one accuracy on the evaluation's n = {se['n']} samples: sqrt(p(1-p)/n) = "
              f"{se['se']:.3f} at p = {se['p']:.3f} ({NAMES[se['method']]}'s accuracy).")
    for m in methods:
        agg[m]["reliability_png"] = plot_pooled(out, m, agg[m])
    checkpoint.write_json(os.path.join(out, "results.json"), clean(dict(
        methods=agg, seeds=seeds, accuracy_se=se, command=prov["command"], date=prov["date"],
        git_commit=prov["git_commit"], provenance=prov)))
    text = "\n".join(md) + "\n"
    with checkpoint.replacing(os.path.join(out, "table.md")) as f:
        f.write(text)
    return text


def stop_children(signum, frame):
    """SIGTERM: terminate the children, then end as Ctrl-C does. (A SIGKILL gives no handler a chance:
    each child also gets the parent-death signal, harness/launch.py's, so none is left to hold its folder.)"""
    with CHILDREN_LOCK:
        STOP.set()
        for proc in CHILDREN:
            proc.terminate()
    raise KeyboardInterrupt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, methods, seeds, jobs = parse_args(argv)
        pairs = [(m, s) for s in seeds for m in methods]
        todo = {(m, s): training(run, ev, train_cmd(m, s, run), args.train_args)
                for m, s in pairs for run, ev, _ in [paths(args.out, m, s)] if run is not None}
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    t0 = time.time()
    STOP.clear()
    run_jobs = Jobs(args, sum(1 if m == "base" else 2 for m, _ in pairs), todo)
    pool = ThreadPoolExecutor(jobs)
    futures = [pool.submit(run_jobs, m, s) for m, s in pairs]
    default = signal.signal(signal.SIGTERM, stop_children)
    try:
        ok = [f.result() for f in futures]
    except KeyboardInterrupt:   # Ctrl-C (the children got it too) or SIGTERM (stop_children): start nothing new
        STOP.set()
        pool.shutdown(cancel_futures=True)
        print("\ninterrupted: finished steps are kept; run the same command again to continue", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, default)
    pool.shutdown()
    print(f"total {time.time() - t0:.0f} s")
    if not all(ok):
        print(f"{len(run_jobs.failed)} step(s) failed ({'; '.join(run_jobs.failed)}): no table written; "
              "fix the cause and run the same command again (finished steps are kept)", file=sys.stderr)
        raise SystemExit(1)
    try:
        print("\n" + write_outputs(args.out, methods, seeds, argv))
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
