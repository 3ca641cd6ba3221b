"""Reproduce the paper's comparison on the toy world: each method trained from the same base policy
(the committed toy_base) for several seeds, each evaluated with its matching confidence, one table.

    python reproduce.py                                  # Base, GRPO, RLCR, C2GSPG, RLCM; seeds below
    python reproduce.py --ablations                      # + Final-Margin, Process-Brier, Final-Brier
    python reproduce.py --methods grpo,rlcm --seeds 0    # a part of it
    python reproduce.py --study --base DIR --quiet-base DIR   # the pre-registered study (evaluation/study.py)

How long (2 CPU cores, --jobs 2): the main table is 16 trainings of 45 steps and 19 evaluations of
3 x 2000 samples, the ablations 9 more of each. Measured on a fresh clone (2026-12-01): both tables
2013 s, a training 55-82 s, an evaluation 28-114 s (the post-hoc probe's fit most of it; RLCR's and
C2GSPG's, which need none, the short ones); a rerun with nothing left to do takes seconds. --study
prints its own estimate before it starts (docs/toy-world.md, "Running the pre-registered study").

Seeds: GRPO and RLCM 0-4 (the headline pair: their paired difference RLCM - GRPO per seed, same seed,
base and data order, with a 95 % t interval over seeds), the others 0-2; --seeds sets one list for all.
Per method M and seed S: `train.py --reward M --seed S --out OUT/runs/M-seedS` (not for the base; RL
trains on the toy's training split only), then `evaluate.py --model RUN --benchmarks toy,toy-long,toy-sub
--confidence C --seed S --no-early-exit --out OUT/eval/M-seedS` (every toy benchmark; the post-hoc probe
is fitted on training problems) with C the method's confidence (the post-hoc probe; RLCR: verbal; C2GSPG: the
sequence likelihood). The base is evaluated once per seed too, so its spread shows the measurement
noise. --jobs of these run at once as subprocesses (one thread each), logs in OUT/logs/.
Resumable: a training or evaluation made with the arguments this command passes is not redone, an
interrupted one continues (train.py --resume, evaluate.py's samples.jsonl): run the same command
again. A run made with other settings (a smoke test's, into the same --out) is refused in one line;
an evaluation made with other arguments is done again. Killed (SIGTERM, or SIGKILL), it takes its
children with it. Finally OUT/table.md (mean +- std over seeds: Acc / PCE / ECE per benchmark and
Overall, the unweighted mean over benchmarks; Brier and AUROC; the paired differences; per method why:
the share of trajectories with a margin signal, the in-training probe's held-out AUROC, the share of
|advantage| the calibration term sets), OUT/results.json (every seed's numbers) and
OUT/reliability_M.png (all seeds and benchmarks pooled).
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

import data
import evaluate
import metrics
import toy
from metrics import mean_std, paired
from evaluation import benchmarks, mechanism, study
from evaluation.report import clean, plot_reliability
from harness import checkpoint, config, files, launch, runlog
from harness.files import UserError

MAIN = ("base", "grpo", "rlcr", "c2gspg", "rlcm")
ABLATIONS = ("final-margin", "process-brier", "final-brier")
NAMES = dict(zip(MAIN + ABLATIONS, ("Base", "GRPO", "RLCR", "C2GSPG", "RLCM", "Final-Margin", "Process-Brier",
                                    "Final-Brier")))
# evaluate.py --confidence of each method: the paper's (docs/design.md, "Baselines")
CONFIDENCE = dict(dict.fromkeys(MAIN + ABLATIONS, "probe-posthoc"), rlcr="verbal", c2gspg="logits")
KEYS = (("Acc", "acc"), ("PCE", "pce"), ("ECE", "ece"), ("Brier", "brier"), ("AUROC", "auroc"))
BENCHMARKS = data.TOY_BENCHMARKS   # every method on each; "Overall" is their unweighted mean, as in the paper
PAIR = ("grpo", "rlcm")            # the headline pair: more seeds, and their paired difference
SEEDS = dict(dict.fromkeys(MAIN + ABLATIONS, (0, 1, 2)), **dict.fromkeys(PAIR, (0, 1, 2, 3, 4)))
# From each run's metrics.jsonl (training_stats): why the calibration term does or does not act.
WHY = (("margin signal", "signal_frac"), ("probe AUROC (held-out, in training)", "probe_auroc"),
       ("calibration share of abs(advantage)", "calib_share"))
ROOT = os.path.dirname(os.path.abspath(__file__))
# What reproduce.py itself passes each run: --train-args / --eval-args that would change one is refused,
# since the table labels every row with its method, seed and confidence.
# RL trains on the toy's training split and checks on its test split: data and eval_data are fixed too.
TRAIN_FIXED = ("reward", "seed", "out", "resume", "model", "plot", "data", "eval_data")
EVAL_FIXED = ("model", "benchmarks", "confidence", "seed", "out")
PRINT, STOP = threading.Lock(), threading.Event()
CHILDREN, CHILDREN_LOCK = set(), threading.Lock()   # the running train.py / evaluate.py processes
quiet = lambda msg: None  # noqa: E731


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
    g = p.add_argument_group("the pre-registered study (evaluation/study.py; docs/toy-world.md)")
    g.add_argument("--study", action="store_true", help="run it instead of the paper's table")
    g.add_argument("--base", help="the legible world's warm start (python toy.py --world legible --out DIR)")
    g.add_argument("--quiet-base", help="the same world's without `?` (python toy.py --world legible-quiet --out DIR)")
    g.add_argument("--world", default="legible", choices=sorted(toy.WORLDS),
                   help="whose rows every run trains and is evaluated on (default legible)")
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
            refuse_overrides("--train-args", train_flags, j["train"], args.train_args, train_fixed)
        for e in j["evals"]:
            refuse_overrides("--eval-args", evaluate.parse_args, e["cmd"], args.eval_args, eval_fixed)
    for j in work:   # then as train.py resolves them: what a --config file sets counts too
        if j["train"]:
            refuse_overrides("--train-args", lambda words: train_config(words, train_fixed), j["train"],
                             args.train_args, train_fixed)
    config.check_out(args.out)
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


def parsed(parse, words, what):
    """parse(words), with argparse's usage-and-exit on a bad word turned into one UserError line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(words)
    except SystemExit:
        why = (err.getvalue().strip().splitlines() or ["cannot parse them"])[-1].partition("error: ")
        raise UserError(f"{what}: {why[2] or why[0]}") from None
    except UserError as e:   # train.py's own checks of the resolved values
        raise UserError(f"{what}: {e}") from None


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


def train_config(words, fixed=TRAIN_FIXED):
    """`fixed` as train.py resolves them from these arguments: a flag, else what a --config file
    sets (its model, its data), else the toy world's default. Other values are left to train.py, so
    that a bad one fails its training child, as it would without --config."""
    given = vars(train_flags(words))
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


def model_ident(run):
    """What evaluate.py records as the model's identity (evaluation/samples.model_id: its folder and
    content) for the toy base or the run's latest checkpoint; None before its first checkpoint."""
    ckpt = checkpoint.resolve_model("toy") if run is None else checkpoint.latest_checkpoint(run, quiet)
    return ckpt and evaluate.model_id(ckpt)


def eval_entry(eval_dir, label, ident):
    """This model's entry of EVAL/results.json if it is of this very model (`ident`, model_ident: not of
    one trained before in the same folder) and its results of every toy benchmark hold every metric as
    a number (AUROC may be None: one class), else None: an evaluation still to do, so a rerun replaces a
    damaged entry."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    try:
        with open(os.path.join(eval_dir, "results.json"), encoding="utf-8") as f:
            entry = json.load(f).get(label)
        if entry["model_id"] != ident:
            return None
        complete = all(all(number(b.get(k)) for k in ("acc", "pce", "ece", "brier", "n")) and
                       (b.get("auroc") is None or number(b["auroc"]))
                       for b in (entry["benchmarks"][name] for name in BENCHMARKS))
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
    rows = files.read_jsonl(os.path.join(run, "metrics.jsonl"), say=quiet) if run else []
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
        if run is not None:
            how, t = self.todo[name], time.time()
            if how is not None and not self.child([py, os.path.join(ROOT, "train.py"), *how], job["log"] + ".train.log",
                                                  f"{name}: training"):
                return False
            start, end = held_out(run)
            self.say(f"{name}: " + (f"trained in {time.time() - t:.0f} s" if how is not None else "trained already") +
                     (f" (held-out {start:.2f} -> {end:.2f})" if start is not None else ""))
        label, ident = model_label(run), model_ident(run)
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
        return True


def training_stats(run):
    """From RUN/metrics.jsonl: held-out accuracy at the first and last check, and the means over the
    run of the share of trajectories with a margin signal (signal_frac; 0 without a probe), of the
    in-training probe's held-out AUROC (eval_probe_auroc) and of the calibration term's share of the
    step's |advantage| (calib_adv_share; not for RLCR and C2GSPG). None where the run has none."""
    start, end = held_out(run)
    rows = files.read_jsonl(os.path.join(run, "metrics.jsonl"), say=quiet) if run else []
    mean = lambda key, pick: mean_std([r.get(key) for r in rows if pick(r)])[0]  # noqa: E731
    return dict(heldout_start=start, heldout_end=end, signal_frac=mean("signal_frac", lambda r: not r.get("eval")),
                probe_auroc=mean("eval_probe_auroc", lambda r: r.get("eval")),
                calib_share=mean("calib_adv_share", lambda r: not r.get("eval")))


def overall(benches):
    """{key: unweighted mean over the benchmarks where it is a number (None where none is)}."""
    return {k: mean_std([b[k] for b in benches.values()])[0] for _, k in KEYS}


def aggregate(out, methods, seeds):
    """{method: {confidence, seeds: {seed: {benchmarks: {name: numbers}, Overall, training stats, paths}},
    mean and std: {benchmark or "Overall": {key: x}, "train": {key: x}}} from each OUT/eval/M-seedS/
    results.json (every toy benchmark) and, for trained methods, OUT/runs/M-seedS/metrics.jsonl."""
    agg = {}
    for m in methods:
        per = {}
        for s in seeds[m]:
            run, ev, _ = paths(out, m, s)
            label = model_label(run)
            entry = eval_entry(ev, label, model_ident(run))
            if entry is None:
                raise UserError(f"{ev}/results.json holds no complete toy results for {label}: run the command again")
            benches = {b: dict({k: entry["benchmarks"][b][k] for _, k in KEYS}, n=entry["benchmarks"][b]["n"])
                       for b in BENCHMARKS}
            st = entry.get("settings", {}).get(BENCHMARKS[0], {})
            per[s] = dict(benchmarks=dict(benches, Overall=overall(benches)), train=training_stats(run), model=label,
                          run=run, eval=ev, confidence=entry["confidence"], questions=st.get("questions"),
                          samples=st.get("n"))
        parts = dict({b: [k for _, k in KEYS] for b in BENCHMARKS + ("Overall",)},
                     train=["heldout_start", "heldout_end"] + [k for _, k in WHY])
        stats = {part: {k: mean_std([(per[s]["train"] if part == "train" else per[s]["benchmarks"][part])[k]
                                     for s in per]) for k in keys} for part, keys in parts.items()}
        agg[m] = dict(confidence=CONFIDENCE[m], seeds=per,
                      mean={p: {k: v[0] for k, v in d.items()} for p, d in stats.items()},
                      std={p: {k: v[1] for k, v in d.items()} for p, d in stats.items()})
    return agg


def cell(res, part, key):
    mean, std = res["mean"][part][key], res["std"][part][key]
    if mean is None:
        return "-"
    return f"{mean:.3f}" + (f" +- {std:.3f}" if std is not None else "")


def table(agg, methods):
    """The paper's layout: a row per method; Acc / PCE / ECE of each benchmark and Overall."""
    parts, keys = BENCHMARKS + ("Overall",), [k for k in KEYS if k[1] in ("acc", "pce", "ece")]
    lines = ["| method | confidence | " + " | ".join(f"{p} {c}" for p in parts for c, _ in keys) + " |",
             "|---|---|" + "---:|" * (len(parts) * len(keys))]
    for m in methods:
        lines.append(f"| {NAMES[m]} | {agg[m]['confidence']} | " +
                     " | ".join(cell(agg[m], p, k) for p in parts for _, k in keys) + " |")
    return "\n".join(lines)


def side_table(agg, methods):
    """Brier and AUROC beside the main table, and the held-out accuracy over training."""
    parts, keys = BENCHMARKS + ("Overall",), [k for k in KEYS if k[1] in ("brier", "auroc")]
    lines = ["| method | " + " | ".join(f"{p} {c}" for p in parts for c, _ in keys) +
             " | held-out acc (train start -> end) |", "|---|" + "---:|" * (len(parts) * len(keys)) + "---|"]
    for m in methods:
        r = agg[m]
        span = "-" if r["mean"]["train"]["heldout_start"] is None else \
            f"{cell(r, 'train', 'heldout_start')} -> {cell(r, 'train', 'heldout_end')}"
        lines.append(f"| {NAMES[m]} | " + " | ".join(cell(r, p, k) for p in parts for _, k in keys) + f" | {span} |")
    return "\n".join(lines)


def differences(agg):
    """{benchmark or "Overall": {key: paired(GRPO, RLCM)}} for Acc, PCE and ECE, or None without both."""
    if not all(m in agg for m in PAIR):
        return None
    a, b = (agg[m]["seeds"] for m in PAIR)
    return {p: {k: paired({s: a[s]["benchmarks"][p][k] for s in a}, {s: b[s]["benchmarks"][p][k] for s in b})
                for k in ("acc", "pce", "ece")} for p in BENCHMARKS + ("Overall",)}


def difference_table(diffs):
    """RLCM - GRPO per benchmark and Overall: mean [95 % interval] (seeds), then each seed's difference."""
    lines = ["| RLCM - GRPO | Acc | PCE | ECE |", "|---|---:|---:|---:|"]
    for p, d in diffs.items():
        lines.append(f"| {p} | " + " | ".join(
            "-" if x is None else f"{x['mean']:+.3f} [{x['lo']:+.3f}, {x['hi']:+.3f}] (n {x['n']})"
            for x in d.values()) + " |")
    per = diffs["Overall"]["acc"] or diffs["Overall"]["pce"]
    if per:
        lines += ["", "Per seed (Overall): " + "; ".join(
            f"seed {s}: " + ", ".join(f"{k} {diffs['Overall'][k]['per_seed'][s]:+.3f}" for k in ("acc", "pce", "ece")
                                      if diffs["Overall"][k]) for s in per["per_seed"])]
    return "\n".join(lines)


def why_table(agg, methods):
    """Per trained method, the means over training (training_stats) that say why the margin acts or not."""
    lines = ["| method | " + " | ".join(c for c, _ in WHY) + " |", "|---|" + "---:|" * len(WHY)]
    for m in methods:
        if m != "base":
            lines.append(f"| {NAMES[m]} | " + " | ".join(cell(agg[m], "train", k) for _, k in WHY) + " |")
    return "\n".join(lines)


def accuracy_se(agg):
    """Standard error sqrt(p(1-p)/n) of one accuracy at the base's (else the first method's) accuracy on
    each benchmark."""
    m = "base" if "base" in agg else next(iter(agg))
    seed = next(iter(agg[m]["seeds"].values()))
    out = {}
    for b in BENCHMARKS:
        p, n = agg[m]["mean"][b]["acc"], seed["benchmarks"][b]["n"]
        out[b] = dict(p=p, n=n, se=math.sqrt(p * (1 - p) / n))
    return dict(method=m, benchmarks=out)


def plot_pooled(out, m, res):
    """OUT/reliability_M.png: the reliability diagram of every seed's evaluation samples pooled (every
    toy benchmark)."""
    conf, correct = [], []
    for s in res["seeds"].values():
        for r in files.read_jsonl(os.path.join(s["eval"], "samples.jsonl"), say=quiet):
            if (r["model"] == s["model"] and r["benchmark"] in BENCHMARKS and r["question"] < (s["questions"] or math.inf)
                    and r["sample"] < (s["samples"] or math.inf)):
                conf.append(r["confidence"]), correct.append(r["correct"])
    path = os.path.join(out, f"reliability_{m}.png")
    c = metrics.calibration(conf, correct)
    title = (f"{NAMES[m]} | toy benchmarks | {res['confidence']} | {len(res['seeds'])} seeds\n"
             f"acc {c['acc']:.3f}  ECE {c['ece']:.3f}  n {c['n']}")
    plot_reliability(metrics.reliability(conf, correct), title, path)
    return path


def stamp(argv):
    """(provenance, "DATE; command `...`; commit C") of this command, for the head of table.md."""
    prov = runlog.provenance(["reproduce.py", *argv], device="cpu")
    commit = prov["git_commit"][:7] + ("+dirty" if prov["git_commit"].endswith("+dirty") else "")
    return prov, (f"{prov['date'].replace('T', ' ').replace('+00:00', ' UTC')}; command `python {prov['command']}`; "
                  f"commit {commit}")


def write_outputs(out, methods, seeds, argv):
    """table.md, results.json and the reliability diagrams; returns the markdown."""
    agg = aggregate(out, methods, seeds)
    prov, when = stamp(argv)
    se, diffs = accuracy_se(agg), differences(agg)
    groups = {}
    for m in methods:
        groups.setdefault(", ".join(map(str, seeds[m])), []).append(NAMES[m])
    md = [f"Toy-world reproduction, {when}; seeds "
          + "; ".join(f"{', '.join(names)}: {s}" for s, names in groups.items())
          + " (mean +- sample std over seeds); benchmarks " + ", ".join(BENCHMARKS)
          + " (Overall: their unweighted mean)", ""]
    main, abl = [m for m in methods if m in MAIN], [m for m in methods if m in ABLATIONS]
    for part in (main, abl):
        if part:
            md += [table(agg, part), "", side_table(agg, part), ""]
    if diffs:
        md += ["Paired difference RLCM - GRPO (same seed, base and data order): mean [95 % t interval over "
               "seeds] (seeds)", "", difference_table(diffs), ""]
    md += ["Why (means over training, then over seeds)", "", why_table(agg, methods), ""]
    md.append(f"Standard error of one accuracy (sqrt(p(1-p)/n) at {NAMES[se['method']]}'s accuracy): " + ", ".join(
        f"{b} {x['se']:.3f} at p = {x['p']:.3f}, n = {x['n']} samples" for b, x in se["benchmarks"].items()) + ".")
    for m in methods:
        agg[m]["reliability_png"] = plot_pooled(out, m, agg[m])
    files.write_json(os.path.join(out, "results.json"), clean(dict(
        methods=agg, seeds=seeds, benchmarks=list(BENCHMARKS), differences=diffs, accuracy_se=se,
        command=prov["command"], date=prov["date"], git_commit=prov["git_commit"], provenance=prov)))
    text = "\n".join(md) + "\n"
    with files.replacing(os.path.join(out, "table.md")) as f:
        f.write(text)
    return text


def study_cost(args, work, todo, jobs):
    """One line: the trainings and evaluations of the study still to do and their estimated time
    (study.estimate), from the sizes they will run with."""
    trainings, evaluations = [], []
    for j in work:
        how = todo[j["name"]]
        if how is not None:
            cfg = config.resolve_args(how)
            ckpt = "--resume" in how and checkpoint.latest_checkpoint(j["run"], quiet, resume=True)
            left = cfg["steps"] - (checkpoint.step_of(ckpt) if ckpt else 0)
            trainings.append((left, cfg["prompts_per_step"] * cfg["group_size"], cfg["max_new_tokens"]))
        label = model_label(j["run"]) if how is None else None
        for e in j["evals"]:
            cmd = e["cmd"] + args.eval_args
            entry = label and eval_entry(e["dir"], label, model_ident(j["run"]))
            if not entry or not made_with(entry, cmd):
                ev = evaluate.parse_args(cmd)
                questions = min(ev.limit or toy.N_TEST, toy.N_TEST)
                fit = (ev.probe_questions or benchmarks.TOY["probe_questions"]) * (ev.probe_samples or benchmarks.TOY["probe_samples"])
                evaluations.append((len(BENCHMARKS) * questions * (ev.n_samples or benchmarks.TOY["n"]), fit))
    cpu, wall = study.estimate(trainings, evaluations, jobs)
    return (f"study: {len(trainings)} of {len(work)} trainings and {len(evaluations)} of "
            f"{sum(len(j['evals']) for j in work)} evaluations to do: about {study.duration(cpu)} of CPU, "
            f"{study.duration(wall)} at --jobs {jobs} on {os.cpu_count()} cores (estimated from the sum world's "
            "measured timings, scaled by steps, rollouts, tokens and samples: evaluation/study.py)")


def write_study(args, work, argv):
    """The study's table.md and results.json (evaluation/study.py: the numbers of every variant and
    seed, their paired differences, the mechanism's readouts and the verdict); returns the markdown."""
    per = {}
    for j in work:
        label, ident = model_label(j["run"]), model_ident(j["run"])
        got = dict(train=training_stats(j["run"]))
        for e in j["evals"]:
            entry = eval_entry(e["dir"], label, ident)
            if entry is None:
                raise UserError(f"{e['dir']}/results.json holds no complete toy results for {label}: run the command again")
            benches = {b: {k: entry["benchmarks"][b][k] for _, k in KEYS} for b in BENCHMARKS}
            got[e["folder"]] = dict(benches, Overall=overall(benches))
            if e["folder"] == study.MATCHED:
                got["readouts"] = mechanism.readouts(mechanism.of_evaluation(e["dir"], entry))
        per.setdefault(j["variant"], {})[j["seed"]] = got
    diffs = study.differences(per)
    result = study.verdict(per, diffs)
    prov, when = stamp(argv)
    seeds = sorted({j["seed"] for j in work})
    text = (f"Pre-registered study on the {args.world} toy world (evaluation/study.py), {when}; "
            f"seeds {', '.join(map(str, seeds))} (paired); benchmarks {', '.join(BENCHMARKS)} (Overall: their "
            f"unweighted mean)\n\n{study.report(per, diffs, result)}\n")
    files.write_json(os.path.join(args.out, "results.json"), clean(dict(
        study=per, differences=diffs, verdict=result, benchmarks=list(BENCHMARKS), command=prov["command"],
        date=prov["date"], git_commit=prov["git_commit"], provenance=prov)))
    with files.replacing(os.path.join(args.out, "table.md")) as f:
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
        work = job_list(args, methods, seeds)
        todo = {j["name"]: training(j["run"], j["evals"][0]["dir"], j["train"], args.train_args)
                for j in work if j["run"] is not None}
        if args.study:
            print(study_cost(args, work, todo, jobs), flush=True)
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
        print("\n" + (write_study(args, work, argv) if args.study else write_outputs(args.out, methods, seeds, argv)))
    except UserError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
