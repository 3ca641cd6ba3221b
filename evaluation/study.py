"""The pre-registered comparison on the toy world (the README's toy section; docs/toy-world.md,
"The study"): which runs it makes (their cost: evaluation/cost.py), their paired differences, and the verdict by
the rule written down before any of them ran, in OUT/table.md and OUT/results.json. reproduce.py runs it:

    python reproduce.py --study --base BASE --quiet-base QUIET_BASE   # python toy_warm.py [--world legible-quiet] --out DIR

Seven variants, each trained with train.py from its base on `toy`'s training split for seeds 0-7
(paired: the same seed gives the same data order and evaluation draws), each evaluated on every toy
benchmark (500 questions x 4 samples) twice: with the post-hoc probe fitted on every toy benchmark's
training split (`--probe-data toy-pooled`, the matched fit, which the verdict reads) and on `toy` alone
(the released protocol, shown beside it). Each RLCM variant is compared with GRPO on the same base,
seed by seed; the mechanism's readouts (evaluation/mechanism.py) come from the matched evaluations'
samples.
"""
import os

import data
import toy
from evaluation import comparison, records
from evaluation.report import clean
from harness import files
from harness.files import UserError
from metrics import mean_std, paired

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
# Fit questions of both fits as the study ran (before toy-pooled's default became 80 from each benchmark).
FIT_QUESTIONS = "80"
BENCHMARKS = data.TOY_BENCHMARKS
PARTS = BENCHMARKS + ("Overall",)
KEYS = (("Acc", "acc"), ("ECE", "ece"), ("PCE", "pce"), ("Brier", "brier"), ("AUROC", "auroc"))
READOUTS = (("`?` after a wrong line", "flag_wrong"), ("`?` after a right line", "flag_right"),
            ("AUROC without `?`", "auroc_unflagged"))
# The world's traces of 6 terms run to 49 tokens with their flags (2000 training rows), so 48 would
# cut some: 72, as docs/toy-world.md's premise (iii) runs; and RL at lr 2e-5, where its premise (iii)
# holds (at 1e-4 RL removes the slips the margin ranks within 20 steps). The toy's defaults now, written
# out so that the study's commands stay what they were when it ran. --train-args may change either.
WORLD_TRAIN = ["--max-new-tokens", "72", "--lr", "2e-5"]
# What the study sets for each run, on top of reproduce.py's own: --train-args / --eval-args that
# would change one are refused.
TRAIN_FIXED = ("lam", "probe_labels", "toy_world")
EVAL_FIXED = ("probe_data", "toy_world", "no_early_exit")
# The pre-registered thresholds (README): an effect, a calibration change, the accuracy band, premise (iii)
AUROC_GAIN, CALIB_DROP, ACC_BAND, SIGNAL, CALIB_SHARE = 0.03, -0.02, 0.02, 0.25, 0.15


def check_flags(args, methods):
    """reproduce.py's flags (args) for these variants: UserError unless --base and --quiet-base come with
    --study alone, each a model folder where a chosen variant starts from it, and --ablations without it."""
    given = [f for f, v in (("--base", args.base), ("--quiet-base", args.quiet_base)) if v is not None]
    if not args.study:
        if given or args.world != toy.WORLD:
            raise UserError(f"{(given or ['--world'])[0]} is for --study: add --study, or drop it")
        return
    if args.ablations:
        raise UserError("--ablations is for the paper's table: drop it, or --study")
    build = dict(base="python toy_warm.py --out DIR", quiet="python toy_warm.py --world legible-quiet --out DIR")
    for key, flag in (("base", "--base"), ("quiet", "--quiet-base")):
        path = getattr(args, flag[2:].replace("-", "_"))
        if any(VARIANTS[m]["base"] == key for m in methods) and path is None:
            raise UserError(f"--study needs {flag} DIR, the warm start its runs start from ({build[key]})")
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"{flag} {path}: no model there (config.json missing); build one: {build[key]}")


def jobs(out, variants, seeds, bases, world):
    """One job per variant and seed, as reproduce.py runs them: dict(name, variant, seed, run, log,
    train: train.py's arguments, evals: [dict(dir, folder, cmd: evaluate.py's arguments, log, what)]).
    bases: {"base": DIR, "quiet": DIR}; world: the toy world whose rows every run reads."""
    out_jobs = []
    for seed in seeds:
        for v in variants:
            name = f"{v}-seed{seed}"
            run, log = os.path.join(out, "runs", name), os.path.join(out, "logs", name)
            base = os.path.abspath(bases[VARIANTS[v]["base"]])   # the run's config holds it: any cwd resumes it
            train = [*VARIANTS[v]["train"], "--seed", str(seed), "--out", run, "--model", base, "--toy-world", world,
                     *WORLD_TRAIN]
            evals = [dict(dir=os.path.join(out, folder, name), folder=folder, log=f"{log}.{folder}.log", what=f" ({fit} fit)",
                          cmd=["--model", run, "--benchmarks", ",".join(BENCHMARKS), "--confidence", "probe-posthoc",
                               "--seed", str(seed), "--no-early-exit", "--out", os.path.join(out, folder, name),
                               "--probe-data", fit, "--probe-questions", FIT_QUESTIONS, "--toy-world", world])
                     for folder, fit in FITS]
            out_jobs.append(dict(name=f"{v} seed {seed}", variant=v, seed=seed, run=run, log=log, train=train,
                                 evals=evals))
    return out_jobs


def differences(per):
    """{variant: {"matched" | "released": {part: {key: paired}}, "readouts": {part: {key: paired}}}}:
    metrics.paired(reference, variant) over the seeds both have, for each variant whose reference is in
    `per`. per: {variant: {seed: {"eval" | "eval-released": {part: {key: x}}, "readouts": {part: {key: x}},
    "train": {...}}}}, part a benchmark or "Overall"."""
    out = {}
    for v, ref in REFERENCE.items():
        if v not in per or ref not in per:
            continue
        pick = lambda m, what, part, k: {s: n[what][part].get(k) for s, n in per[m].items() if part in n[what]}  # noqa: E731
        out[v] = {name: {part: {k: paired(pick(ref, what, part, k), pick(v, what, part, k)) for _, k in keys}
                         for part in PARTS}
                  for name, what, keys in (("matched", MATCHED, KEYS), ("released", RELEASED, KEYS),
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
    """The pre-registered rule, on the matched fit's Overall paired differences (RLCM lam 1 - GRPO unless
    said) -> dict(outcome "for" | "against" | "inconclusive", line, criteria [dict(side, text, shown, holds)]).

    For (all): AUROC >= +0.03 and ECE, PCE <= -0.02, each interval excluding 0; accuracy's mean within
    +-0.02; growing with lam (the AUROC difference's mean does not fall from lam 0.3 to 1 to 3, the ECE
    difference's does not rise); the mechanism moving the same way (`?` after a wrong line rises,
    interval above 0, and the AUROC on samples without `?` rises in the mean); no effect in the shuffled
    control (its AUROC, ECE and PCE intervals all hold 0).
    Against (any): the AUROC, ECE and PCE intervals all hold 0 while premise (iii) holds (RLCM lam 1's
    signal share >= 0.25 and calibration share of |advantage| >= 0.15, means over training and seeds);
    the AUROC and calibration gains with an accuracy mean below -0.02; the shuffled control as good (its
    AUROC interval above 0, its AUROC mean at least RLCM's and its ECE and PCE means at most RLCM's).
    Otherwise inconclusive. The two sides exclude each other; the quiet world is reported beside, the
    rule names none of it. A missing number fails its criterion."""
    auroc, ece, pce, acc = (_get(diffs, HEADLINE, k) for k in ("auroc", "ece", "pce", "acc"))
    sh = {k: _get(diffs, SHUFFLED, k) for k in ("auroc", "ece", "pce")}
    flag, quiet_auc = (_get(diffs, HEADLINE, k, "readouts") for k in ("flag_wrong", "auroc_unflagged"))
    dose = {k: [None if _get(diffs, v, k) is None else _get(diffs, v, k)["mean"] for v in DOSES] for k in ("auroc", "ece")}
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
        ("for", "Overall ECE and PCE <= -0.02, intervals excluding 0", f"ECE {_shown(ece)}, PCE {_shown(pce)}", calib),
        ("for", "Overall accuracy within +-0.02 (mean)", _shown(acc), acc is not None and abs(acc["mean"]) <= ACC_BAND),
        ("for", "growing with lam (lam 0.3 / 1 / 3: AUROC not falling, ECE not rising)",
         f"AUROC {doses('auroc')}; ECE {doses('ece')}", grows),
        ("for", "the mechanism moving the same way (`?` after a wrong line up, interval above 0; "
         "AUROC without `?` up)", f"`?` {_shown(flag)}; AUROC without `?` {_shown(quiet_auc)}",
         flag is not None and flag["lo"] > 0 and quiet_auc is not None and quiet_auc["mean"] > 0),
        ("for", "no effect in the shuffled control (its AUROC, ECE and PCE intervals hold 0)", three(sh),
         all(_holds_zero(d) for d in sh.values())),
        ("against", "intervals holding 0 while premise (iii) holds (signal share >= 0.25, calibration share "
         ">= 0.15)", f"{three(dict(auroc=auroc, ece=ece, pce=pce))}; signal share {number(train['signal_frac'])}, "
         f"calibration share {number(train['calib_share'])}",
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
        outcome, line = "inconclusive", "Inconclusive: no Against criterion holds, and For fails on: " + \
            "; ".join(failed) + "."
    return dict(outcome=outcome, line=line, criteria=criteria)


def _cell(values, fmt="{:.3f}"):
    mean, sd = mean_std(values)
    return "-" if mean is None else fmt.format(mean) + ("" if sd is None else f" +- {sd:.3f}")


def report(per, diffs, result):
    """table.md's body: each variant's Overall numbers (both fits), the paired differences per benchmark
    and Overall, the mechanism's readouts, the training's why, and the verdict beside its criteria."""
    variants = [v for v in VARIANTS if v in per]
    label = lambda v: VARIANTS[v]["label"]  # noqa: E731
    col = lambda v, what, part, k: [n[what].get(part, {}).get(k) for n in per[v].values()]  # noqa: E731
    md = ["Per variant, Overall (mean +- sd over seeds): matched fit (`--probe-data toy-pooled`), then the "
          "released one (`toy`)", "",
          "| variant | Acc | ECE | PCE | Brier | AUROC | released: ECE | PCE | Brier | AUROC |",
          "|---|" + "---:|" * 9]
    for v in variants:
        md.append(f"| {label(v)} | " + " | ".join(
            [_cell(col(v, MATCHED, "Overall", k)) for _, k in KEYS]
            + [_cell(col(v, RELEASED, "Overall", k)) for _, k in KEYS[1:]]) + " |")
    md += ["", "Paired differences, variant - reference (same seed): mean [95 % t interval] over seeds; matched "
           "fit, and the released fit's Overall last", "",
           "| variant - reference | part | " + " | ".join(c for c, _ in KEYS) + " | seeds |", "|---|---|" + "---:|" * 6]
    for v, d in diffs.items():
        name = f"{label(v)} - {label(REFERENCE[v])}"
        for what, part in [("matched", p) for p in PARTS] + [("released", "Overall")]:
            n = next((x["n"] for x in d[what][part].values() if x), 0)
            shown = part if what == "matched" else "Overall (released fit)"
            md.append(f"| {name} | {shown} | " + " | ".join(_shown(d[what][part][k]) for _, k in KEYS) + f" | {n} |")
    md += ["", "The mechanism (evaluation/mechanism.py, from the matched evaluations' samples; mean over benchmarks, "
           "then mean +- sd over seeds), and its paired differences", "",
           "| variant | " + " | ".join(c for c, _ in READOUTS) + " |", "|---|" + "---:|" * len(READOUTS)]
    md += [f"| {label(v)} | " + " | ".join(_cell(col(v, "readouts", "Overall", k)) for _, k in READOUTS) + " |"
           for v in variants]
    md += ["", "| variant - reference | " + " | ".join(c for c, _ in READOUTS) + " |", "|---|" + "---:|" * len(READOUTS)]
    md += [f"| {label(v)} - {label(REFERENCE[v])} | " + " | ".join(_shown(d["readouts"]["Overall"][k]) for _, k in READOUTS)
           + " |" for v, d in diffs.items()]
    md += ["", "Why (means over training, then mean +- sd over seeds; premise (iii): signal share >= 0.25, "
           "calibration share >= 0.15)", "",
           "| variant | signal share | calibration share of abs(advantage) | held-out acc start -> end |",
           "|---|---:|---:|---|"]
    for v in variants:
        t = lambda k: [n["train"].get(k) for n in per[v].values()]  # noqa: E731
        md.append(f"| {label(v)} | {_cell(t('signal_frac'))} | {_cell(t('calib_share'))} | "
                  f"{_cell(t('heldout_start'))} -> {_cell(t('heldout_end'))} |")
    md += ["", f"**Verdict ({result['outcome']}).** {result['line']}", "",
           "| side | criterion (RLCM lam 1 - GRPO, matched fit, Overall) | measured | holds |", "|---|---|---|---|"]
    md += [f"| {c['side']} | {c['text']} | {c['shown']} | {'yes' if c['holds'] else 'no'} |" for c in result["criteria"]]
    return "\n".join(md)


def write_study(args, work, argv):
    """The study's table.md and results.json (the numbers of every variant and seed, their paired
    differences, the mechanism's readouts and the verdict), from the jobs' records; returns the markdown."""
    per, commits = {}, {}
    for j in work:
        rec = records.read(args, j)
        if rec is None:
            raise UserError(f"{records.path(args, j)}: missing or made with other settings: run the command again")
        per.setdefault(j["variant"], {})[j["seed"]] = rec["numbers"]
        commits[rec["git_commit"]] = commits.get(rec["git_commit"], 0) + 1
    diffs = differences(per)
    result = verdict(per, diffs)
    prov, when = comparison.stamp(argv)
    seeds = sorted({j["seed"] for j in work})
    made = ", ".join(f"{c[:7]}{'+dirty' if c.endswith('+dirty') else ''} ({n})" for c, n in commits.items())
    text = (f"Pre-registered study on the {args.world} toy world (evaluation/study.py), {when}; "
            f"seeds {', '.join(map(str, seeds))} (paired); benchmarks {', '.join(BENCHMARKS)} (Overall: their "
            f"unweighted mean); jobs recorded at commit {made}\n\n{report(per, diffs, result)}\n")
    files.write_json(os.path.join(args.out, "results.json"), clean(dict(
        study=per, differences=diffs, verdict=result, benchmarks=list(BENCHMARKS), command=prov["command"],
        date=prov["date"], git_commit=prov["git_commit"], recorded_at=commits, provenance=prov)))
    with files.replacing(os.path.join(args.out, "table.md")) as f:
        f.write(text)
    return text
