"""Reproduce the paper's comparison on the toy world: each method trained from the same base policy
(the committed toy_base) for several seeds, each evaluated with its matching confidence, one table.

    python reproduce.py                                 # Base, GRPO, RLCR, C2GSPG, RLCM; seeds below
    python reproduce.py --ablations                     # + Final-Margin, Process-Brier, Final-Brier
    python reproduce.py --methods grpo,rlcm --seeds 0   # a part of it
    python reproduce.py --study --base DIR --quiet-base DIR   # the pre-registered study (study/study.py)

Per method and seed, train.py then evaluate.py, --jobs at a time as one-thread subprocesses, logs in
OUT/logs/; what was made with these arguments is not redone, so the same command continues. Then
OUT/table.md, OUT/results.json and OUT/reliability_M.png. What each run is and what it printed:
docs/reference.md, "The paper's comparison, on the toy world".
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import config
import evaluate
import toy
from harness import checkpoint, files, launch
from harness.runfolder import check_out, read_config
from harness.files import UserError
from study import study
from study.comparison import (ABLATIONS, BENCHMARKS, CONFIDENCE, MAIN, PAIR, eval_entry, made_with,
                              model_of, parsed, paths, quiet, training_stats, write_outputs)

SEEDS = dict(dict.fromkeys(MAIN + ABLATIONS, (0, 1, 2)), **dict.fromkeys(PAIR, (0, 1, 2, 3, 4)))
ROOT = os.path.dirname(os.path.abspath(__file__))
# What reproduce.py itself passes each run, which --train-args / --eval-args may not change: the table
# labels every row with its method, seed and confidence, and RL trains and checks on the toy's splits.
TRAIN_FIXED = ("reward", "seed", "out", "resume", "model", "plot", "data", "eval_data")
EVAL_FIXED = ("model", "benchmarks", "confidence", "seed", "out")
PRINT, STOP = threading.Lock(), threading.Event()
CHILDREN, CHILDREN_LOCK = set(), threading.Lock()   # the running train.py / evaluate.py processes


def parse_args(argv):
    """(args, methods, seeds {method: [seed]}, jobs): every value checked before anything runs (UserError)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", help="comma list of " + ", ".join(MAIN + ABLATIONS) + " (default: the main table); "
                   "with --study of " + ", ".join(study.VARIANTS) + " (default: all)")
    p.add_argument("--ablations", action="store_true", help="add " + ", ".join(ABLATIONS) + " (a second table)")
    p.add_argument("--seeds", help="comma list of seeds for every method (default: grpo, rlcm 0-4, the others 0-2; "
                   "--study: 0-7)")
    p.add_argument("--jobs", default="2", help="trainings/evaluations run at once (default 2)")
    p.add_argument("--out", help="default runs/reproduce (--study: runs/study)")
    p.add_argument("--train-args", default="", help='passed to every train.py, e.g. "--steps 2 --eval-n 8"')
    p.add_argument("--eval-args", default="", help='passed to every evaluate.py, e.g. "--limit 4"')
    g = p.add_argument_group("the pre-registered study (study/study.py; docs/toy-world.md)")
    g.add_argument("--study", action="store_true", help="run it instead of the paper's table")
    g.add_argument("--base", help="the world's warm start (python toy.py --out DIR; as toy_base/)")
    g.add_argument("--quiet-base", help="the same world's without `?` (python toy.py --world legible-quiet --out DIR)")
    g.add_argument("--world", default=toy.WORLD, choices=sorted(toy.WORLDS),
                   help=f"the --toy-world every run names (default {toy.WORLD})")
    args = p.parse_args(argv)
    args.out = args.out or os.path.join("runs", "study" if args.study else "reproduce")
    known = tuple(study.VARIANTS) if args.study else MAIN + ABLATIONS
    methods = known if args.study else MAIN + (ABLATIONS if args.ablations else ())
    if args.methods is not None:
        given = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in given if m not in known] or ([] if given else [args.methods])
        if bad:
            raise UserError(f"--methods {args.methods}: unknown method {bad[0]!r}; known: {', '.join(known)}")
        methods = tuple(m for m in known if m in given)
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds is not None else [0]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) < len(seeds) or not all(0 <= s < 2**32 for s in seeds):
        raise UserError(f"--seeds {args.seeds}: give distinct integers in [0, 2**32), e.g. 0,1,2")
    default = lambda m: study.SEEDS if args.study else SEEDS[m]  # noqa: E731
    seeds = {m: list(default(m)) if args.seeds is None else seeds for m in methods}
    study.check_flags(args, methods)
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
    train_fixed = TRAIN_FIXED + (study.TRAIN_FIXED if args.study else ())
    eval_fixed = EVAL_FIXED + (study.EVAL_FIXED if args.study else ())
    work = job_list(args, methods, seeds)
    for j in work:
        if j["train"]:
            refuse_overrides("--train-args", config.build_parser().parse_args, j["train"], args.train_args,
                             train_fixed)
        for e in j["evals"]:
            refuse_overrides("--eval-args", evaluate.parse_args, e["cmd"], args.eval_args, eval_fixed)
    for j in work:   # then as train.py resolves them: what a --config file sets counts too
        if j["train"]:
            refuse_overrides("--train-args", lambda words: train_config(words, train_fixed), j["train"],
                             args.train_args, train_fixed)
    check_out(args.out)
    return args, methods, seeds, jobs


def job_list(args, methods, seeds):
    """What runs: per method (or study variant) and seed, dict(name, variant, seed, run (None for the
    base), log, train: train.py's arguments, evals: [dict(dir, folder, cmd: evaluate.py's arguments,
    log, what)]), seed by seed."""
    if args.study:
        return study.jobs(args.out, methods, seeds[methods[0]], dict(base=args.base, quiet=args.quiet_base),
                          args.world)
    out = []
    for s in sorted(set().union(*seeds.values())):
        for m in methods:
            if s in seeds[m]:
                run, ev, log = paths(args.out, m, s)
                out.append(dict(name=f"{m} seed {s}", variant=m, seed=s, run=run, log=log,
                                train=run and train_cmd(m, s, run),
                                evals=[dict(dir=ev, folder="eval", cmd=eval_cmd(m, s, run, ev), log=log + ".eval.log",
                                            what="")]))
    return out


def refuse_overrides(flag, parse, base, extra, fixed):
    """UserError naming the first of `fixed` that `extra`, appended to the command `base`, would change
    (the last occurrence of a flag wins)."""
    what = f"{flag} {shlex.join(extra)}"
    before, after = vars(parsed(parse, base, what)), vars(parsed(parse, base + extra, what))
    for key in fixed:
        if after[key] != before[key]:
            raise UserError(f"{what}: --{key.replace('_', '-')} is reproduce.py's to set for each method and "
                            f"seed (here {before[key]}); drop it (--methods, --seeds and --out choose what runs)")


def train_config(words, fixed=TRAIN_FIXED):
    """`fixed` as train.py resolves them from these arguments: a flag, else what a --config file
    sets, else the toy world's default. Other values are left to train.py to check."""
    given = vars(config.build_parser().parse_args(words))
    saved = config._read_config(given["config"]) if given["config"] else {}   # as train.py reads it
    world = {**config.COMMON, **config.TOY}
    return argparse.Namespace(**{k: given[k] if given[k] is not None else saved.get(k, world.get(k))
                                 for k in fixed})


def train_cmd(method, seed, run):
    """train.py's arguments for a new run, before --train-args."""
    return ["--reward", method, "--seed", str(seed), "--out", run]


def eval_cmd(method, seed, run, ev):
    """evaluate.py's arguments, before --eval-args."""
    return ["--model", run or "toy", "--benchmarks", ",".join(BENCHMARKS), "--confidence", CONFIDENCE[method], "--seed", str(seed),
            "--no-early-exit", "--out", ev]


def training(run, ev, cmd, extra):
    """train.py's arguments that bring `run` to what `train.py CMD EXTRA` makes there, None when it is
    there already: CMD EXTRA for a folder without a checkpoint, a resume for a run with fewer steps.
    A run made with other settings (its config.json) is refused, neither continued (mixing two
    settings) nor trained again (deleting a run someone may want)."""
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


class Jobs:
    """One (method, seed) per call, run in a pool thread: train, then evaluate; one line per finished step."""

    def __init__(self, args, total, todo):
        self.args, self.total, self.todo, self.done, self.failed = args, total, todo, 0, []
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def say(self, line, steps=1):
        with PRINT:
            self.done += steps
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def fail(self, what, detail):
        with PRINT:
            self.failed.append(what)
            print(f"FAILED {what}{detail}", flush=True)
        return False

    def child(self, cmd, log, what):
        """Run cmd with its output appended to log; True when it exits 0, else say why and False."""
        with files.appending(log) as f:
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

    def __call__(self, job):
        try:
            return self.job(job)
        except (UserError, OSError, ValueError, KeyError) as e:   # a damaged config.json or results.json
            return self.fail(job["name"], f": {type(e).__name__}: {e}")

    def job(self, job):
        run, name, py = job["run"], job["name"], sys.executable
        if self.args.study and study.read_record(self.args, job) is not None:
            self.say(f"{name}: recorded already ({study.record_path(self.args, job)})", 1 + len(job["evals"]))
            return True
        if run is not None:
            how, t = self.todo[name], time.time()
            if how is not None and not self.child([py, os.path.join(ROOT, "train.py"), *how], job["log"] + ".train.log",
                                                  f"{name}: training"):
                return False
            start, end = (training_stats(run)[k] for k in ("heldout_start", "heldout_end"))
            self.say(f"{name}: " + (f"trained in {time.time() - t:.0f} s" if how is not None else "trained already") +
                     (f" (held-out {start:.2f} -> {end:.2f})" if start is not None else ""))
        label, ident = model_of(run)
        for e in job["evals"]:
            ev, cmd, t, fresh = e["dir"], e["cmd"] + self.args.eval_args, time.time(), False
            entry = eval_entry(ev, label, ident)
            if entry is None or not made_with(entry, cmd):
                if not self.child([py, os.path.join(ROOT, "evaluate.py"), *cmd], e["log"], f"{name}: evaluation{e['what']}"):
                    return False
                entry, fresh = eval_entry(ev, label, ident), True
                if entry is None:
                    return self.fail(f"{name}: evaluation{e['what']}",
                                     f": {ev}/results.json holds no complete toy results of {label}")
            accs = ", ".join(f"{b} {entry['benchmarks'][b]['acc']:.3f}" for b in BENCHMARKS)
            self.say(f"{name}: " + (f"evaluated in {time.time() - t:.0f} s" if fresh else "evaluated already") +
                     f"{e['what']} (acc {accs}; n {entry['benchmarks'][BENCHMARKS[0]]['n']} each)")
        if self.args.study:
            study.write_record(self.args, job)
        return True


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
        work = job_list(args, methods, seeds)
        todo = {j["name"]: training(j["run"], j["evals"][0]["dir"], j["train"], args.train_args)
                for j in work if j["run"] is not None}
        if args.study:
            print(study.cost_summary(args, work, todo, jobs), flush=True)
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    t0 = time.time()
    STOP.clear()
    run_jobs = Jobs(args, sum((j["run"] is not None) + len(j["evals"]) for j in work), todo)
    pool = ThreadPoolExecutor(jobs)
    futures = [pool.submit(run_jobs, j) for j in work]
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
        print("\n" + (study.write_study(args, work, argv) if args.study else write_outputs(args.out, methods, seeds, argv)))
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
