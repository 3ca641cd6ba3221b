"""What an evaluation reports: per-benchmark metrics with bootstrap intervals (summarize),
reliability diagrams, the printed table and OUT/results.json (means); and a use of a calibrated
confidence: an early exit from a trace at the first checkpoint whose confidence reaches a threshold,
calibrated by conformal risk control over questions (split_early_exit). docs/reference.md."""
import json
import math
import os
import random

import numpy as np

import data
import metrics
from harness.files import UserError, replacing, write_json

EPSILONS = (0.1, 0.2, 0.3)   # conformal early-exit risk levels
COLUMNS = (("Acc", "acc"), ("ECE", "ece"), ("PCE", "pce"), ("Brier", "brier"), ("AUROC", "auroc"))
# What an Overall's benchmarks share when one command evaluates them all (n and max_new_tokens as
# its defaults per benchmark): one kept from an earlier evaluation with others: "mixed_settings".
MIXED = ("n", "max_new_tokens", "temperature", "top_p", "seed", "gate", "every", "forced_k")
# Per-benchmark settings printed with the table (results.json holds them all under "settings").
SETTINGS = {"confidence": "confidence", "grader": "grader", "samples": "n", "temp": "temperature",
            "top-p": "top_p", "max tokens": "max_new_tokens"}


def summarize(rows, n_bins=10, seed=0):
    """Metrics (metrics.calibration), pass@k, reliability rows and early exit of one benchmark."""
    conf, correct = [r["confidence"] for r in rows], [r["correct"] for r in rows]
    res = metrics.calibration(conf, correct, n_bins)
    by_q = {}
    for r in rows:
        by_q.setdefault(r["question"], []).append(r["correct"])
    res["questions"] = len(by_q)
    # the mean over questions of the unbiased pass@k, k = 1, 2, 4, ... and n, the fewest samples
    per_q = list(by_q.values())
    res["pass_at_k"] = {k: float(np.mean([metrics.pass_at_k(len(c), sum(c), k) for c in per_q]))
                        for k in vote_sizes(min(len(c) for c in per_q))}
    res["reliability"] = metrics.reliability(conf, correct, n_bins)
    # 95 % intervals over questions (metrics.bootstrap, 1000 resamples): printed as `0.543 +- 0.012`
    res["ci95"] = metrics.bootstrap(conf, correct, [r["question"] for r in rows], seed=seed)
    if any("verbal_missing" in r for r in rows):
        res["verbal_missing"] = sum(bool(r.get("verbal_missing")) for r in rows)
    res.update(early_exit_of(rows, seed=seed))
    return res


def plot_reliability(rel, title, path):
    """Bars of accuracy per confidence bin (count above each bar) against the diagonal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    full = [r for r in rel if r["count"]]
    ax.bar([r["lo"] for r in full], [r["accuracy"] for r in full], [r["hi"] - r["lo"] for r in full],
           align="edge", edgecolor="black", color="tab:blue", alpha=0.8, label="accuracy")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    for r in full:
        ax.text((r["lo"] + r["hi"]) / 2, min(r["accuracy"], 0.93) + 0.02, str(r["count"]),
                ha="center", fontsize=7)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy", title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    with replacing(path, "wb") as f:   # all or nothing: a full disk leaves the old one, not 0 bytes
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)


def overall(benches):
    """Unweighted mean over benchmarks of each metric, skipping nan (None in results.json)."""
    vals = {key: [b[key] for b in benches.values() if b[key] is not None and not math.isnan(b[key])]
            for _, key in COLUMNS}
    return {key: float(np.mean(v)) if v else math.nan for key, v in vals.items()}


def means(benches):
    """{"overall", "math", "ood"}: the paper's Overall, the mean over every benchmark (its 8: math,
    LCB, GPQA, LogiQA), and the means of the math and of the OOD benchmarks where there are any."""
    parts = {"math": {b: v for b, v in benches.items() if b not in data.OOD},
             "ood": {b: v for b, v in benches.items() if b in data.OOD}}
    return dict(overall=overall(benches), **{k: overall(v) for k, v in parts.items() if v})


def table(results):
    """Markdown per model: the math, then the OOD benchmarks; with both, their means; then the
    paper's Overall, the mean over all of them (docs/reference.md)."""
    head = ["| benchmark | n | Acc | pass@k | " + " | ".join(c for c, _ in COLUMNS[1:]) + " | "
            + " | ".join(SETTINGS) + " |",
            "|---|---:|---:|---|" + "---:|" * (len(COLUMNS) - 1) + "---|" * len(SETTINGS)]
    lines = []
    for label, res in results.items():
        benches = res["benchmarks"]
        ood = [b for b in benches if b in data.OOD]
        maths = [b for b in benches if b not in ood]
        release = res.get("settings", {}).get("lcb", {}).get("release")
        lines += ["", f"### {label}  (confidence: {res['confidence']})"
                  + (f"  (lcb: LiveCodeBench {release})" if release else ""), "", *head]
        lines += [_row(name, benches[name], res) for name in maths + ood]
        means = [("Math mean", res["math"]), ("OOD mean", res["ood"])] if maths and ood else []
        means.append(("Overall", res["overall"]))
        lines += [_row(name, dict(m, n=""), res) for name, m in means]
        for bench, diff in res.get("mixed_settings", {}).items():
            was = ", ".join(f"{k} {a} (here {b})" for k, (a, b) in diff.items())
            lines += ["", f"* mixed settings: results.json's Overall for {label} also averages "
                      f"{bench}, evaluated earlier with {was}"]
    return "\n".join(lines)


def _row(name, b, res):
    st = res.get("settings", {}).get(name, {})
    cells = [_cell(b, "acc"), " ".join(f"{k}: {v:.3f}" for k, v in b.get("pass_at_k", {}).items())]
    return (f"| {name} | {b['n']} | " + " | ".join(cells + [_cell(b, k) for _, k in COLUMNS[1:]])
            + " | " + " | ".join(str(st.get(k, "")) for k in SETTINGS.values()) + " |")


def _cell(b, key):
    ci = b.get("ci95", {}).get(key)
    return f"{b[key]:.3f}" + (f" +- {ci['pm']:.3f}" if ci else "")


def clean(x):
    """JSON-safe copy: inf -> "inf", nan -> None."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def read_results(out_dir):
    """OUT/results.json: {label: entry}, {} where there is none; a damaged one is a UserError."""
    path = os.path.join(out_dir, "results.json")
    fix = "remove it (samples.jsonl keeps every sample)"
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}): {fix}") from None
    if not isinstance(old, dict) or not all(isinstance(v, dict) for v in old.values()):
        raise UserError(f"{path} is not an object of results per model: {fix}")
    return old


def write_results(out_dir, label, res, now=None):
    """Merge this model's results into OUT/results.json (docs/reference.md); now(bench): the
    settings this evaluation gives a benchmark. Returns (the benchmarks kept, mixed_settings)."""
    old = read_results(out_dir)
    new, before = clean(res), old.get(label, {})
    same = all(before.get(k) == new.get(k) for k in ("model_id", "confidence", "posthoc_probe"))
    kept = [b for b in before.get("benchmarks", {}) if b not in new["benchmarks"]] if same else []
    for key in ("benchmarks", "settings") if kept else ():
        new[key] = {**{b: before[key][b] for b in kept if b in before.get(key, {})}, **new[key]}
    earlier = lambda b: before.get("settings", {}).get(b, {})  # noqa: E731
    mixed = {b: {k: [earlier(b).get(k), now(b)[k]] for k in MIXED if earlier(b).get(k) != now(b)[k]}
             for b in kept} if now else {}
    mixed = {b: diff for b, diff in mixed.items() if diff}
    new.pop("math", None), new.pop("ood", None)
    old[label] = dict(new, **clean(means(new["benchmarks"])), **({"mixed_settings": mixed} if mixed else {}))
    write_json(os.path.join(out_dir, "results.json"), old, indent=1)
    return kept, mixed


def report_uses(results):
    """A few lines per model: the post-hoc probe fit, then early exit per benchmark."""
    lines = []
    for label, res in results.items():
        if "posthoc_probe" in res:
            p = res["posthoc_probe"]
            lines.append(f"{label}: post-hoc probe val BCE {p['val_bce']:.4f} vs base rate {p['base_bce']:.4f} "
                         f"(lr {p['lr']}, dropout {p['dropout']}, wd {p['weight_decay']}, {p['prefixes']} prefixes)")
        for bench, b in res["benchmarks"].items():
            lines += [f"{label} {bench} early exit eps {e['epsilon']}, mean of {e['splits']} random half splits: "
                      f"test risk {e['test_risk']:.3f} (sd {e['test_risk_sd']:.3f}), exits {e['exit_rate']:.0%}, "
                      f"tokens saved {e['tokens_saved']:.1%}; split 0: threshold {e['threshold']}, cal bound "
                      f"{e['cal_bound']:.3f}, test risk {e['test_risk_split0']:.3f}" for e in b.get("early_exit", [])]
    return "\n".join(lines)


def vote_sizes(n):
    """Vote sizes 1, 2, 4, ... below n, then n: vote_sizes(6) == [1, 2, 4, 6]."""
    ks = [1 << i for i in range(max(n, 1).bit_length()) if (1 << i) < n]
    return ks + [n] if n >= 1 else []


def exit_outcome(trace, lam):
    """(loss, tokens) of a trace {"checkpoints": [(t_j, c_j, y_j), ...], "length"} at threshold lam:
    (1 - y_j, t_j) at the first c_j >= lam, else (0, length)."""
    for t, c, y in trace["checkpoints"]:
        if c >= lam:
            return 1.0 - float(y), float(t)
    return 0.0, float(trace["length"])


def worst_exit(trace):
    """m of a trace: the highest confidence of a wrong checkpoint at which some threshold exits (its
    confidence above every earlier one), -inf if none. (c, y) = (0.3, 1), (0.5, 0), (0.4, 0): 0.5.
    Kept in the trace as "worst": split_early_exit asks for it about 600 times a trace."""
    if "worst" not in trace:
        top, trace["worst"] = -math.inf, -math.inf
        for _, c, y in trace["checkpoints"]:
            if c > top:
                top = c
                if not y:
                    trace["worst"] = c
    return trace["worst"]


def crc_bound(units, lam):
    """(sum_i L_i(lam) + 1) / (n + 1) over n units (lists of traces), L_i their mean bound_loss."""
    total = sum(sum(lam <= worst_exit(tr) for tr in unit) / len(unit) for unit in units)
    return (float(total) + 1.0) / (len(units) + 1)


def crc_threshold(units, epsilon):
    """Smallest lam among the checkpoint confidences with crc_bound(units, lam) <= epsilon: inf when
    only never exiting is, None when not even that (1 / (n + 1) > epsilon)."""
    n = len(units)
    if 1.0 / (n + 1) > epsilon:
        return None
    # worst exits with the weight of one trace in its unit's mean, highest first
    worst = sorted(((worst_exit(tr), 1.0 / len(u)) for u in units for tr in u), reverse=True)
    cands = sorted({c for u in units for tr in u for _, c, _ in tr["checkpoints"]}, reverse=True)
    best, total, k = math.inf, 0.0, 0
    for lam in cands:
        while k < len(worst) and worst[k][0] >= lam:
            total += worst[k][1]
            k += 1
        if (total + 1.0) / (n + 1) > epsilon:
            break
        best = lam
    return best


def early_exit(cal, test, epsilons=EPSILONS):
    """Per epsilon, a dict: the CRC threshold on the `cal` units (lists of traces, one per question;
    None: infeasible, inf: never exit), cal_bound, and on the test traces test_risk (mean loss),
    exit_rate and tokens_saved = 1 - sum(tokens used) / sum(full lengths)."""
    traces = [tr for unit in test for tr in unit]
    full = sum(float(tr["length"]) for tr in traces) or 1.0
    rows = []
    for eps in epsilons:
        lam = crc_threshold(cal, eps)
        use = math.inf if lam is None else lam
        outs = [exit_outcome(tr, use) for tr in traces]
        exits = [tr for tr in traces if any(c >= use for _, c, _ in tr["checkpoints"])]
        rows.append(dict(epsilon=eps, threshold=lam, cal_bound=crc_bound(cal, use) if cal else math.nan,
                         test_risk=float(np.mean([o[0] for o in outs])) if outs else math.nan,
                         exit_rate=len(exits) / len(traces) if traces else math.nan,
                         tokens_saved=1.0 - sum(o[1] for o in outs) / full))
    return rows


def split_early_exit(units, epsilons=EPSILONS, splits=100, seed=0):
    """early_exit over `splits` seeded random halvings of the units (questions), the first half
    calibrating: per epsilon, split 0's threshold, cal_bound and test_risk_split0, and the means
    over all splits of test_risk (and its sd), exit_rate and tokens_saved."""
    runs, half = [], len(units) // 2
    for s in range(splits):
        order = list(units)
        random.Random(seed + s).shuffle(order)
        runs.append(early_exit(order[:half], order[half:], epsilons))
    averaged = ("test_risk", "exit_rate", "tokens_saved")
    return [dict(first, test_risk_split0=first["test_risk"], splits=splits,
                 **{k: float(np.mean([r[i][k] for r in runs])) for k in averaged},
                 test_risk_sd=float(np.std([r[i]["test_risk"] for r in runs])))
            for i, first in enumerate(runs[0])]


def early_exit_of(rows, seed=0, epsilons=EPSILONS, splits=100):
    """split_early_exit of samples.jsonl rows (question, length, checkpoints) by question, when
    every row has probe "checkpoints": {"early_exit": rows} else {}."""
    if not rows or not all("checkpoints" in r for r in rows):
        return {}
    by_q = {}
    for r in rows:
        by_q.setdefault(r["question"], []).append({k: r[k] for k in ("checkpoints", "length")})
    return {"early_exit": split_early_exit([by_q[q] for q in sorted(by_q)], epsilons, splits, seed)}
