"""The paper's comparison on the toy world, as reproduce.py runs it: the methods and the confidence
each is evaluated with, where their results lie, and the tables over seeds (write_outputs).
"""
import contextlib
import io
import json
import math
import os
import shlex

import data
import evaluate
import metrics
from evaluation.report import clean, overall, plot_reliability
from evaluation.samples import model_id, model_label
from harness import checkpoint, files, runlog
from harness.files import UserError
from study.stats import cell, mean_std, paired

MAIN = ("base", "grpo", "rlcr", "c2gspg", "rlcm")
ABLATIONS = ("final-margin", "process-brier", "final-brier")
NAMES = dict(zip(MAIN + ABLATIONS, ("Base", "GRPO", "RLCR", "C2GSPG", "RLCM", "Final-Margin", "Process-Brier",
                                    "Final-Brier")))
# evaluate.py --confidence of each method: the paper's (docs/design.md, "Baselines")
CONFIDENCE = dict(dict.fromkeys(MAIN + ABLATIONS, "probe-posthoc"), rlcr="verbal", c2gspg="logits")
KEYS = (("Acc", "acc"), ("PCE", "pce"), ("ECE", "ece"), ("Brier", "brier"), ("AUROC", "auroc"))
BENCHMARKS = data.TOY_BENCHMARKS   # every method on each; "Overall" is their unweighted mean, as in the paper
PAIR = ("grpo", "rlcm")            # the headline pair: more seeds, and their paired difference
# From each run's metrics.jsonl (training_stats): why the calibration term does or does not act.
WHY = (("margin signal", "signal_frac"), ("probe AUROC (held-out, in training)", "probe_auroc"),
       ("calibration share of abs(advantage)", "calib_share"))
quiet = lambda msg: None  # noqa: E731


def paths(out, method, seed):
    """(run dir or None for the base, eval dir, log prefix) of one job."""
    name = f"{method}-seed{seed}"
    return (None if method == "base" else os.path.join(out, "runs", name), os.path.join(out, "eval", name),
            os.path.join(out, "logs", name))


def model_of(run):
    """(label, identity) that evaluate.py files the toy base (run None) or the run's latest checkpoint
    under (evaluation/samples.py: model_label, model_id); (None, None) before its first checkpoint."""
    if run is None:
        return "toy", model_id(checkpoint.resolve_model("toy"))
    ckpt = checkpoint.latest_checkpoint(run, quiet)
    return (model_label(run, ckpt), model_id(ckpt)) if ckpt else (None, None)


def eval_entry(eval_dir, label, ident):
    """This model's entry of EVAL/results.json if it is of this very model (`ident`: not of one trained
    before in the same folder) with every metric of every toy benchmark a number (AUROC may be None:
    one class), else None: an evaluation still to do, so a rerun replaces a damaged entry."""
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


def training_stats(run):
    """From RUN/metrics.jsonl: held-out accuracy at the first and last check, and the run's means of
    signal_frac, eval_probe_auroc and calib_adv_share (calib_share). None where the run has none."""
    rows = files.read_jsonl(os.path.join(run, "metrics.jsonl"), say=quiet) if run else []
    held = sorted((r["step"], r["eval_accuracy"]) for r in rows if r.get("eval") and "eval_accuracy" in r)
    start, end = (held[0][1], held[-1][1]) if held else (None, None)
    mean = lambda key, pick: mean_std([r.get(key) for r in rows if pick(r)])[0]  # noqa: E731
    return dict(heldout_start=start, heldout_end=end, signal_frac=mean("signal_frac", lambda r: not r.get("eval")),
                probe_auroc=mean("eval_probe_auroc", lambda r: r.get("eval")),
                calib_share=mean("calib_adv_share", lambda r: not r.get("eval")))


def over_seeds(out, methods, seeds):
    """{method: {confidence, seeds: {seed: {benchmarks: {name: numbers}, Overall, training stats, paths}},
    mean and std: {benchmark or "Overall": {key: x}, "train": {key: x}}} from each OUT/eval/M-seedS/
    results.json (every toy benchmark) and, for trained methods, OUT/runs/M-seedS/metrics.jsonl."""
    agg = {}
    for m in methods:
        per = {}
        for s in seeds[m]:
            run, ev, _ = paths(out, m, s)
            label, ident = model_of(run)
            entry = eval_entry(ev, label, ident)
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


def _cell_of(res, part, key):
    return cell(res["mean"][part][key], res["std"][part][key])


def tables(agg, methods):
    """The paper's layout, a row per method: Acc / PCE / ECE of each benchmark and Overall; then Brier
    and AUROC beside it, with the held-out accuracy over training."""
    parts = BENCHMARKS + ("Overall",)
    main, side = KEYS[:3], KEYS[3:]   # Acc, PCE, ECE; Brier, AUROC
    head = lambda keys: " | ".join(f"{p} {c}" for p in parts for c, _ in keys)  # noqa: E731
    cells = lambda r, keys: " | ".join(_cell_of(r, p, k) for p in parts for _, k in keys)  # noqa: E731
    lines = [f"| method | confidence | {head(main)} |", "|---|---|" + "---:|" * (len(parts) * len(main))]
    lines += [f"| {NAMES[m]} | {agg[m]['confidence']} | {cells(agg[m], main)} |" for m in methods]
    lines += ["", f"| method | {head(side)} | held-out acc (train start -> end) |",
              "|---|" + "---:|" * (len(parts) * len(side)) + "---|"]
    for m in methods:
        r = agg[m]
        span = "-" if r["mean"]["train"]["heldout_start"] is None else \
            f"{_cell_of(r, 'train', 'heldout_start')} -> {_cell_of(r, 'train', 'heldout_end')}"
        lines.append(f"| {NAMES[m]} | {cells(r, side)} | {span} |")
    return "\n".join(lines)


def headline_differences(agg):
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
            lines.append(f"| {NAMES[m]} | " + " | ".join(_cell_of(agg[m], "train", k) for _, k in WHY) + " |")
    return "\n".join(lines)


def accuracy_se(agg):
    """Standard error sqrt(p(1-p)/n) of one accuracy at the base's (else the first method's) accuracy."""
    m = "base" if "base" in agg else next(iter(agg))
    seed = next(iter(agg[m]["seeds"].values()))
    out = {}
    for b in BENCHMARKS:
        p, n = agg[m]["mean"][b]["acc"], seed["benchmarks"][b]["n"]
        out[b] = dict(p=p, n=n, se=math.sqrt(p * (1 - p) / n))
    return dict(method=m, benchmarks=out)


def plot_pooled(out, m, res):
    """OUT/reliability_M.png: the reliability diagram of every seed's samples, every benchmark pooled."""
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
    """OUT/table.md, OUT/results.json (every seed's numbers) and OUT/reliability_M.png (all seeds and
    benchmarks pooled); returns the markdown."""
    agg = over_seeds(out, methods, seeds)
    prov, when = stamp(argv)
    se, diffs = accuracy_se(agg), headline_differences(agg)
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
            md += [tables(agg, part), ""]
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
