"""The pre-registered comparison on the toy world (docs/toy-world.md, "Running the pre-registered
study"): its runs and what they will cost, their records (OUT/records/VARIANT-seedS.json, which
stand for their jobs on any machine), their paired differences, and the verdict by the rule written
down before any of them ran, in OUT/table.md and OUT/results.json.

    python reproduce.py --study --base toy_base --quiet-base toy_base_quiet
"""
import json
import os

import config
import data
import evaluate
import toy
from evaluation import benchmarks
from evaluation.report import COLUMNS, clean, overall
from harness import checkpoint, files, runlog
from harness.files import UserError
from study import comparison, mechanism
from study.stats import cell, mean_std, paired

VARIANTS = {   # name: what the table calls it, train.py's arguments, whose base it starts from
    "grpo": dict(label="GRPO", train=["--reward", "grpo"], base="base"),
    "rlcm-0.3": dict(label="RLCM lam 0.3", train=["--reward", "rlcm", "--lam", "0.3"], base="base"),
    "rlcm-1": dict(label="RLCM lam 1", train=["--reward", "rlcm", "--lam", "1"], base="base"),
    "rlcm-3": dict(label="RLCM lam 3", train=["--reward", "rlcm", "--lam", "3"], base="base"),
    "rlcm-shuffled": dict(label="RLCM lam 1, shuffled-label probe", base="base",
                          train=["--reward", "rlcm", "--lam", "1", "--probe-labels", "shuffled"]),
    "grpo-quiet": dict(label="GRPO, no `?`", train=["--reward", "grpo"], base="quiet"),
    "rlcm-quiet": dict(label="RLCM lam 1, no `?`", train=["--reward", "rlcm", "--lam", "1"], base="quiet"),
}
REFERENCE = {"rlcm-0.3": "grpo", "rlcm-1": "grpo", "rlcm-3": "grpo", "rlcm-shuffled": "grpo",
             "rlcm-quiet": "grpo-quiet"}   # each difference is variant - reference, seed by seed
HEADLINE, DOSES, SHUFFLED = "rlcm-1", ("rlcm-0.3", "rlcm-1", "rlcm-3"), "rlcm-shuffled"
SEEDS = tuple(range(8))
MATCHED, RELEASED = "eval", "eval-released"   # the evaluations' folders under OUT
FITS = ((MATCHED, "toy-pooled"), (RELEASED, "toy"))   # and evaluate.py --probe-data of each
FIT_QUESTIONS = "80"   # both fits' questions as the study ran, whatever toy-pooled's default
BENCHMARKS = data.TOY_BENCHMARKS
PARTS = BENCHMARKS + ("Overall",)
READOUTS = (("`?` after a wrong line", "flag_wrong"), ("`?` after a right line", "flag_right"),
            ("AUROC without `?`", "auroc_unflagged"))
# 72 tokens (traces of 6 terms run to 49 with their flags) and lr 2e-5 (premise (iii) holds): the
# toy's defaults, written out so the study's commands stay as they ran; --train-args may change it.
WORLD_TRAIN = ["--max-new-tokens", "72", "--lr", "2e-5"]
# What the study sets for each run besides reproduce.py's own: --train-args / --eval-args may not.
TRAIN_FIXED = ("lam", "probe_labels", "toy_world")
EVAL_FIXED = ("probe_data", "toy_world", "no_early_exit")
# The pre-registered thresholds (README): effect, calibration change, accuracy band, premise (iii)
AUROC_GAIN, CALIB_DROP, ACC_BAND, SIGNAL, CALIB_SHARE = 0.03, -0.02, 0.02, 0.25, 0.15


def check_flags(args, methods):
    """UserError unless --base and --quiet-base come with --study alone, each a model folder where a
    chosen variant starts from it, and --ablations without it."""
    given = [f for f, v in (("--base", args.base), ("--quiet-base", args.quiet_base)) if v is not None]
    if not args.study:
        if given or args.world != toy.WORLD:
            raise UserError(f"{(given or ['--world'])[0]} is for --study: add --study, or drop it")
        return
    if args.ablations:
        raise UserError("--ablations is for the paper's table: drop it, or --study")
    build = dict(base="python toy.py --out DIR", quiet="python toy.py --world legible-quiet --out DIR")
    for key, flag in (("base", "--base"), ("quiet", "--quiet-base")):
        path = getattr(args, flag[2:].replace("-", "_"))
        if any(VARIANTS[m]["base"] == key for m in methods) and path is None:
            raise UserError(f"--study needs {flag} DIR, the warm start its runs start from "
                            f"({build[key]})")
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"{flag} {path}: no model there (config.json missing); build one: "
                            f"{build[key]}")


def jobs(out, variants, seeds, bases, world):
    """One job per variant and seed, as reproduce.py runs them: dict(name, variant, seed, run, log,
    train: train.py's arguments, evals: [dict(dir, folder, cmd: evaluate.py's arguments, log, what)]).
    bases: {"base": DIR, "quiet": DIR}; world: the toy world whose rows every run reads."""
    out_jobs = []
    for seed in seeds:
        for v in variants:
            name = f"{v}-seed{seed}"
            run, log = os.path.join(out, "runs", name), os.path.join(out, "logs", name)
            base = os.path.abspath(bases[VARIANTS[v]["base"]])   # in the run's config: any cwd resumes it
            train = [*VARIANTS[v]["train"], "--seed", str(seed), "--out", run, "--model", base,
                     "--toy-world", world, *WORLD_TRAIN]
            evals = [dict(dir=os.path.join(out, folder, name), folder=folder, log=f"{log}.{folder}.log",
                          what=f" ({fit} fit)",
                          cmd=["--model", run, "--benchmarks", ",".join(BENCHMARKS), "--confidence",
                               "probe-posthoc", "--seed", str(seed), "--no-early-exit", "--out",
                               os.path.join(out, folder, name), "--probe-data", fit, "--probe-questions",
                               FIT_QUESTIONS, "--toy-world", world])
                     for folder, fit in FITS]
            out_jobs.append(dict(name=f"{v} seed {seed}", variant=v, seed=seed, run=run, log=log,
                                 train=train, evals=evals))
    return out_jobs


def numbers(job):
    """What the table reads of one finished job: dict(train, eval, eval-released: {part: {key: x}},
    readouts: {part: {key: x}}), from its run and evaluation folders."""
    label, ident = comparison.model_of(job["run"])
    got = dict(train=comparison.training_stats(job["run"]))
    for e in job["evals"]:
        entry = comparison.eval_entry(e["dir"], label, ident)
        if entry is None:
            raise UserError(f"{e['dir']}/results.json holds no complete toy results for {label}: "
                            "run the command again")
        benches = {b: {k: entry["benchmarks"][b][k] for _, k in comparison.KEYS} for b in BENCHMARKS}
        got[e["folder"]] = dict(benches, Overall=overall(benches))
        if e["folder"] == MATCHED:
            got["readouts"] = mechanism.readouts(mechanism.of_evaluation(e["dir"], entry))
    return got


def _portable(words):
    """A command's words with the values of --out and --model (this machine's paths) left out."""
    return [w for i, w in enumerate(words) if i == 0 or words[i - 1] not in ("--out", "--model")]


def record_key(args, job):
    """What a record must have been made with to stand for this job on any machine: the variant and
    seed, the train.py and evaluate.py arguments without paths, and the warm start by content."""
    base = job["train"][job["train"].index("--model") + 1]
    return dict(variant=job["variant"], seed=job["seed"], base=files.identity(base),
                train=_portable(job["train"] + args.train_args),
                evals=[_portable(e["cmd"] + args.eval_args) for e in job["evals"]])


def record_path(args, job):
    return os.path.join(args.out, "records", f"{job['variant']}-seed{job['seed']}.json")


def read_record(args, job):
    """The job's record (dict: made_with, numbers, git_commit, date, model) when OUT/records holds one
    made with this job's settings, else None: the job is run (or found done in its folders) again."""
    where = record_path(args, job)
    try:
        with open(where, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: not a study record ({files.first_line(e)}): remove it to run the "
                        "job again") from None
    made = json.loads(json.dumps(record_key(args, job)))
    return rec if isinstance(rec, dict) and rec.get("made_with") == made else None


def write_record(args, job):
    """Record a finished job's numbers in OUT/records (a few KB, no path)."""
    prov = runlog.provenance(["reproduce.py"], device="cpu")
    os.makedirs(os.path.dirname(record_path(args, job)), exist_ok=True)
    files.write_json(record_path(args, job), clean(dict(
        made_with=record_key(args, job), numbers=numbers(job), git_commit=prov["git_commit"],
        date=prov["date"], model=comparison.model_of(job["run"])[1].partition("#")[2])))


# Seconds on 2 CPU cores at --jobs 2, from the study's own timings (docs/reference.md, "The study's
# layer"): a training's per rollout token, an evaluation's per sample and per post-hoc fit rollout.
ROLLOUT_TOKEN_S = 170 / (45 * 16 * 8 * 72)
SAMPLE_S = 280 * 0.28 / 6000
FIT_ROLLOUT_S = 280 * 0.72 / (80 * 8)


def cost_estimate(trainings, evaluations, jobs, cores=None):
    """(CPU seconds, wall seconds) of trainings [(steps, rollouts a step, max new tokens)] and
    evaluations [(samples, post-hoc fit rollouts)] run --jobs at a time on `cores` (default: this
    machine's)."""
    cpu = (sum(steps * rollouts * tokens * ROLLOUT_TOKEN_S for steps, rollouts, tokens in trainings)
           + sum(samples * SAMPLE_S + fit * FIT_ROLLOUT_S for samples, fit in evaluations))
    return cpu, cpu / max(1, min(jobs, cores or os.cpu_count() or 1))


def _duration(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def cost_summary(args, work, todo, jobs):
    """One line: the trainings and evaluations left and their estimated time, from their sizes."""
    trainings, evaluations = [], []
    for j in work:
        how = todo[j["name"]]
        if read_record(args, j) is not None:
            continue
        if how is not None:
            cfg = config.resolve_args(how)
            ckpt = "--resume" in how and checkpoint.latest_checkpoint(j["run"], comparison.quiet,
                                                                      resume=True)
            left = cfg["steps"] - (checkpoint.step_of(ckpt) if ckpt else 0)
            trainings.append((left, cfg["prompts_per_step"] * cfg["group_size"], cfg["max_new_tokens"]))
        label, ident = comparison.model_of(j["run"]) if how is None else (None, None)
        for e in j["evals"]:
            cmd = e["cmd"] + args.eval_args
            entry = label and comparison.eval_entry(e["dir"], label, ident)
            if not entry or not comparison.made_with(entry, cmd):
                ev, toy_eval = evaluate.parse_args(cmd), benchmarks.TOY   # and the toy's defaults
                questions = min(ev.limit or toy.N_TEST, toy.N_TEST)
                fit = ((ev.probe_questions or toy_eval["probe_questions"])
                       * (ev.probe_samples or toy_eval["probe_samples"]))
                samples = len(BENCHMARKS) * questions * (ev.n_samples or toy_eval["n"])
                evaluations.append((samples, fit))
    cpu, wall = cost_estimate(trainings, evaluations, jobs)
    return (f"study: {len(trainings)} of {len(work)} trainings and {len(evaluations)} of "
            f"{sum(len(j['evals']) for j in work)} evaluations to do: about {_duration(cpu)} of CPU, "
            f"{_duration(wall)} at --jobs {jobs} on {os.cpu_count()} cores (estimated from the study's "
            "measured timings, scaled by steps, rollouts, tokens and samples: study/study.py)")


def differences(per):
    """{variant: {"matched" | "released" | "readouts": {part: {key: paired}}}}: paired(reference,
    variant) over the seeds both have, for each variant whose reference is in `per`. per: {variant:
    {seed: {"eval" | "eval-released" | "readouts": {part: {key: x}}, "train": {...}}}}, part a
    benchmark or "Overall"."""
    out = {}
    for v, ref in REFERENCE.items():
        if v not in per or ref not in per:
            continue
        def pick(m, what, part, k):
            return {s: n[what][part].get(k) for s, n in per[m].items() if part in n[what]}
        out[v] = {name: {part: {k: paired(pick(ref, what, part, k), pick(v, what, part, k))
                                for _, k in keys} for part in PARTS}
                  for name, what, keys in (("matched", MATCHED, COLUMNS), ("released", RELEASED, COLUMNS),
                                           ("readouts", "readouts", READOUTS))}
    return out


def _get(diffs, v, key, what="matched"):
    """The paired Overall difference of `key` for variant v, or None."""
    return diffs.get(v, {}).get(what, {}).get("Overall", {}).get(key)


def _shown(d):
    return "n/a" if d is None else f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _holds_zero(d):
    return d is not None and d["lo"] <= 0 <= d["hi"]


def verdict(per, diffs):
    """The pre-registered rule (README) on the matched fit's Overall paired differences -> dict(
    outcome "for" | "against" | "inconclusive", line, criteria [dict(side, text, shown, holds)]); a
    missing number fails its criterion."""
    auroc, ece, pce, acc = (_get(diffs, HEADLINE, k) for k in ("auroc", "ece", "pce", "acc"))
    sh = {k: _get(diffs, SHUFFLED, k) for k in ("auroc", "ece", "pce")}
    flag, quiet_auc = (_get(diffs, HEADLINE, k, "readouts") for k in ("flag_wrong", "auroc_unflagged"))
    dose = {k: [(_get(diffs, v, k) or {}).get("mean") for v in DOSES] for k in ("auroc", "ece")}
    train = {k: mean_std([n["train"].get(k) for n in per.get(HEADLINE, {}).values()])[0]
             for k in ("signal_frac", "calib_share")}
    gain = auroc is not None and auroc["mean"] >= AUROC_GAIN and auroc["lo"] > 0
    calib = all(d is not None and d["mean"] <= CALIB_DROP and d["hi"] < 0 for d in (ece, pce))
    premise = all(v is not None for v in train.values()) and train["signal_frac"] >= SIGNAL \
        and train["calib_share"] >= CALIB_SHARE
    grows = all(None not in m for m in dose.values()) and dose["auroc"] == sorted(dose["auroc"]) \
        and dose["ece"] == sorted(dose["ece"], reverse=True)
    as_good = (None not in (auroc, ece, pce) and all(sh.values()) and sh["auroc"]["lo"] > 0
               and sh["auroc"]["mean"] >= auroc["mean"] and sh["ece"]["mean"] <= ece["mean"]
               and sh["pce"]["mean"] <= pce["mean"])
    number = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    doses = lambda k: " / ".join("n/a" if m is None else f"{m:+.3f}" for m in dose[k])  # noqa: E731
    three = lambda d: f"AUROC {_shown(d['auroc'])}, ECE {_shown(d['ece'])}, PCE {_shown(d['pce'])}"  # noqa: E731
    criteria = [
        ("for", "Overall AUROC >= +0.03, interval excluding 0", _shown(auroc), gain),
        ("for", "Overall ECE and PCE <= -0.02, intervals excluding 0",
         f"ECE {_shown(ece)}, PCE {_shown(pce)}", calib),
        ("for", "Overall accuracy within +-0.02 (mean)", _shown(acc),
         acc is not None and abs(acc["mean"]) <= ACC_BAND),
        ("for", "growing with lam (lam 0.3 / 1 / 3: AUROC not falling, ECE not rising)",
         f"AUROC {doses('auroc')}; ECE {doses('ece')}", grows),
        ("for", "the mechanism moving the same way (`?` after a wrong line up, interval above 0; "
         "AUROC without `?` up)", f"`?` {_shown(flag)}; AUROC without `?` {_shown(quiet_auc)}",
         flag is not None and flag["lo"] > 0 and quiet_auc is not None and quiet_auc["mean"] > 0),
        ("for", "no effect in the shuffled control (its AUROC, ECE and PCE intervals hold 0)", three(sh),
         all(_holds_zero(d) for d in sh.values())),
        ("against", "intervals holding 0 while premise (iii) holds (signal share >= 0.25, "
         "calibration share >= 0.15)", f"{three(dict(auroc=auroc, ece=ece, pce=pce))}; signal share "
         f"{number(train['signal_frac'])}, calibration share {number(train['calib_share'])}",
         all(_holds_zero(d) for d in (auroc, ece, pce)) and premise),
        ("against", "gains only with an accuracy loss (the first two For criteria, accuracy mean < -0.02)",
         _shown(acc), gain and calib and acc is not None and acc["mean"] < -ACC_BAND),
        ("against", "the shuffled control doing as well (its AUROC interval above 0, its means at least "
         "RLCM's)", three(sh), as_good),
    ]
    criteria = [dict(side=s, text=t, shown=n, holds=bool(h)) for s, t, n, h in criteria]
    failed = [c["text"] for c in criteria if c["side"] == "for" and not c["holds"]]
    against = [c["text"] for c in criteria if c["side"] == "against" and c["holds"]]
    if not failed:
        outcome, line = "for", "For the paper's direction: every For criterion holds."
    elif against:
        outcome, line = "against", "Against the paper's direction: " + "; ".join(against) + "."
    else:
        outcome = "inconclusive"
        line = "Inconclusive: no Against criterion holds, and For fails on: " + "; ".join(failed) + "."
    return dict(outcome=outcome, line=line, criteria=criteria)


def report(per, diffs, result):
    """table.md's body: each variant's Overall numbers (both fits), the paired differences per benchmark
    and Overall, the mechanism's readouts, the training's why, and the verdict beside its criteria."""
    variants = [v for v in VARIANTS if v in per]
    label = lambda v: VARIANTS[v]["label"]  # noqa: E731
    row = lambda *cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    # mean +- sd over seeds of variant v's Overall k (what: a fit, or "readouts"), and of a training number
    col = lambda v, what, k: cell(*mean_std([n[what].get("Overall", {}).get(k) for n in per[v].values()]))  # noqa: E731
    train = lambda v, k: cell(*mean_std([n["train"].get(k) for n in per[v].values()]))  # noqa: E731
    md = ["Per variant, Overall (mean +- sd over seeds): matched fit (`--probe-data toy-pooled`), then the "
          "released one (`toy`)", "",
          "| variant | Acc | ECE | PCE | Brier | AUROC | released: ECE | PCE | Brier | AUROC |",
          "|---|" + "---:|" * 9]
    md += [row(label(v), *[col(v, MATCHED, k) for _, k in COLUMNS], *[col(v, RELEASED, k) for _, k in COLUMNS[1:]])
           for v in variants]
    md += ["", "Paired differences, variant - reference (same seed): mean [95 % t interval] over seeds; matched "
           "fit, and the released fit's Overall last", "",
           row("variant - reference", "part", *[c for c, _ in COLUMNS], "seeds"), "|---|---|" + "---:|" * 6]
    for v, d in diffs.items():
        name = f"{label(v)} - {label(REFERENCE[v])}"
        for what, part in [("matched", p) for p in PARTS] + [("released", "Overall")]:
            n = next((x["n"] for x in d[what][part].values() if x), 0)
            shown = part if what == "matched" else "Overall (released fit)"
            md.append(row(name, shown, *[_shown(d[what][part][k]) for _, k in COLUMNS], str(n)))
    md += ["", "The mechanism (study/mechanism.py, from the matched evaluations' samples; mean over benchmarks, "
           "then mean +- sd over seeds), and its paired differences", "",
           row("variant", *[c for c, _ in READOUTS]), "|---|" + "---:|" * len(READOUTS)]
    md += [row(label(v), *[col(v, "readouts", k) for _, k in READOUTS]) for v in variants]
    md += ["", row("variant - reference", *[c for c, _ in READOUTS]), "|---|" + "---:|" * len(READOUTS)]
    md += [row(f"{label(v)} - {label(REFERENCE[v])}", *[_shown(d["readouts"]["Overall"][k]) for _, k in READOUTS])
           for v, d in diffs.items()]
    md += ["", "Why (means over training, then mean +- sd over seeds; premise (iii): signal share >= 0.25, "
           "calibration share >= 0.15)", "",
           "| variant | signal share | calibration share of abs(advantage) | held-out acc start -> end |",
           "|---|---:|---:|---|"]
    md += [row(label(v), train(v, "signal_frac"), train(v, "calib_share"),
               f"{train(v, 'heldout_start')} -> {train(v, 'heldout_end')}") for v in variants]
    md += ["", f"**Verdict ({result['outcome']}).** {result['line']}", "",
           "| side | criterion (RLCM lam 1 - GRPO, matched fit, Overall) | measured | holds |", "|---|---|---|---|"]
    md += [row(c["side"], c["text"], c["shown"], "yes" if c["holds"] else "no") for c in result["criteria"]]
    return "\n".join(md)


def write_study(args, work, argv):
    """The study's table.md and results.json (the numbers of every variant and seed, their paired
    differences, the mechanism's readouts and the verdict), from the jobs' records; returns the markdown."""
    per, commits = {}, {}
    for j in work:
        rec = read_record(args, j)
        if rec is None:
            raise UserError(f"{record_path(args, j)}: missing or made with other settings: run the command again")
        per.setdefault(j["variant"], {})[j["seed"]] = rec["numbers"]
        commits[rec["git_commit"]] = commits.get(rec["git_commit"], 0) + 1
    diffs = differences(per)
    result = verdict(per, diffs)
    prov, when = comparison.stamp(argv)
    seeds = sorted({j["seed"] for j in work})
    made = ", ".join(f"{c[:7]}{'+dirty' if c.endswith('+dirty') else ''} ({n})" for c, n in commits.items())
    text = (f"Pre-registered study on the {args.world} toy world (study/study.py), {when}; "
            f"seeds {', '.join(map(str, seeds))} (paired); benchmarks {', '.join(BENCHMARKS)} (Overall: their "
            f"unweighted mean); jobs recorded at commit {made}\n\n{report(per, diffs, result)}\n")
    files.write_json(os.path.join(args.out, "results.json"), clean(dict(
        study=per, differences=diffs, verdict=result, benchmarks=list(BENCHMARKS), command=prov["command"],
        date=prov["date"], git_commit=prov["git_commit"], recorded_at=commits, provenance=prov)))
    with files.replacing(os.path.join(args.out, "table.md")) as f:
        f.write(text)
    return text
