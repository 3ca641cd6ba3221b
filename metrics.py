"""Calibration metrics: ECE, PCE, Brier score, AUROC, the reliability table; pass@k; the share of
the advantage the calibration term sets. Inputs: 1-D `conf` and `correct` of one length N > 0, in
[0, 1] (AUROC: correct exactly 0/1). Bins are `[i/n, (i+1)/n)`, the last also holding 1.0."""
import math

import numpy as np


def _check(conf, correct):   # float64 arrays [N], or a ValueError
    conf, correct = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (conf, correct))
    inside = all(((x >= 0) & (x <= 1)).all() for x in (conf, correct))   # False on NaN
    if conf.shape != correct.shape or conf.size == 0 or not inside:
        raise ValueError(f"need N > 0 (confidence, correctness) pairs in [0, 1], not NaN: got "
                         f"{conf.size} confidences and {correct.size} correctness values")
    return conf, correct


def reliability(conf, correct, n_bins=10):
    """Per-bin rows {lo, hi, count, mean_conf, accuracy}, n_bins rows; empty bins: count 0, nan, nan."""
    conf, correct = _check(conf, correct)
    idx = np.minimum(np.floor(conf * n_bins).astype(np.int64), n_bins - 1)  # 1.0: the last bin
    rows = []
    for i in range(n_bins):
        sel = idx == i
        count = int(sel.sum())
        rows.append(dict(lo=i / n_bins, hi=(i + 1) / n_bins, count=count,
                         mean_conf=float(conf[sel].mean()) if count else math.nan,
                         accuracy=float(correct[sel].mean()) if count else math.nan))
    return rows


def _gaps(conf, correct, n_bins):   # (n_bin / N, mean_conf - accuracy) of the non-empty bins
    rows = [r for r in reliability(conf, correct, n_bins) if r["count"]]
    n = sum(r["count"] for r in rows)
    return (np.array([r["count"] / n for r in rows]),
            np.array([r["mean_conf"] - r["accuracy"] for r in rows]))


def ece(conf, correct, n_bins=10):
    """Expected calibration error: sum_bins n_bin / N * |mean_conf - accuracy|."""
    weights, gaps = _gaps(conf, correct, n_bins)
    return float((weights * np.abs(gaps)).sum())


def pce(conf, correct, n_bins=10):
    """Positive (over-confidence) calibration error: sum_bins n_bin / N * max(mean_conf - accuracy, 0)."""
    weights, gaps = _gaps(conf, correct, n_bins)
    return float((weights * np.maximum(gaps, 0.0)).sum())


def brier(conf, correct):
    """Brier score: mean (conf - correct)^2 (0 is perfect, lower is better)."""
    conf, correct = _check(conf, correct)
    return float(((conf - correct) ** 2).mean())


def auroc(conf, correct):
    """Area under the ROC curve of conf as a predictor of correct; nan when only one class is present.
    AUROC = (sum of the ranks of the right samples - n1 (n1 + 1) / 2) / (n1 * n0), ranks over all N
    confidences with ties averaged (equals the pairwise win rate, ties = 1/2)."""
    conf, correct = _check(conf, correct)
    if not np.isin(correct, (0.0, 1.0)).all():
        raise ValueError("auroc needs correctness exactly 0 or 1")
    n1 = int(correct.sum())
    n0 = correct.size - n1
    if n1 == 0 or n0 == 0:
        return math.nan
    _, where, counts = np.unique(conf, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[where]
    return float((ranks[correct == 1].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def calibration(conf, correct, n_bins=10):
    """All summary numbers at once: {"acc", "ece", "pce", "brier", "auroc", "n"}."""
    conf, correct = _check(conf, correct)
    return dict(acc=float(correct.mean()), ece=ece(conf, correct, n_bins),
                pce=pce(conf, correct, n_bins), brier=brier(conf, correct),
                auroc=auroc(conf, correct), n=int(conf.size))


def bootstrap(conf, correct, groups, n_resamples=1000, seed=0):
    """95 % intervals of Acc, ECE and PCE over groups [N] (each sample's question): {name: {"lo",
    "hi", "pm"}}: the estimate +- 1.96 x the sd over resamples of whole questions (`pm`), clipped to
    [0, 1]. Unlike a percentile interval of the upward-biased ECE, it always holds the estimate."""
    conf, correct = _check(conf, correct)
    stats = {"acc": lambda c, y: float(y.mean()), "ece": ece, "pce": pce}
    _, members = np.unique(np.asarray(groups).reshape(-1), return_inverse=True)
    by_group = [np.flatnonzero(members == g) for g in range(members.max() + 1)]
    rng = np.random.default_rng(seed)
    draws = {name: [] for name in stats}
    for _ in range(n_resamples):
        idx = np.concatenate([by_group[g] for g in rng.integers(0, len(by_group), len(by_group))])
        for name, fn in stats.items():
            draws[name].append(fn(conf[idx], correct[idx]))
    point = {name: fn(conf, correct) for name, fn in stats.items()}
    pm = {name: 1.96 * float(np.std(d)) for name, d in draws.items()}
    return {name: {"lo": max(p - pm[name], 0.0), "hi": min(p + pm[name], 1.0), "pm": pm[name]}
            for name, p in point.items()}


def pass_at_k(n, c, k):
    """Unbiased pass@k of a question, n samples, c right: 1 - C(n - c, k) / C(n, k), as the product
    1 - prod_{i = n-c+1}^{n} (1 - k / i) (Chen et al. 2021: the binomials overflow from n ~ 1000).
    Example: n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 0.7; with k = 1 it is c / n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def heldout_probe(trajectories, k):
    """The held-out check's eval_probe_* numbers (docs/reference.md) from its Y_b and C_b."""
    Y = np.array([y for t in trajectories for y in t["Y_b"]], dtype=np.float64)
    C = np.array([c for t in trajectories for c in t["C_b"]], dtype=np.float64)
    if Y.size == 0:
        return dict(eval_probe_prefixes=0)
    Cc = np.clip(C, 1e-7, 1 - 1e-7)
    right = np.rint(Y * k).astype(int)
    forced = np.concatenate([[1.0] * r + [0.0] * (k - r) for r in right])
    return dict(eval_probe_bce=float(-(Y * np.log(Cc) + (1 - Y) * np.log(1 - Cc)).mean()),
                eval_probe_ece=ece(C, Y), eval_probe_auroc=auroc(np.repeat(C, k), forced),
                **{f"eval_{key}": float(np.mean([t[key] for t in trajectories]))
                   for key in ("margin", "brier") if key in trajectories[0]},
                eval_probe_prefixes=int(Y.size))


def advantage_parts(correct, rewards, group_size, eps=1e-6):
    """(sum |A_nat|, sum |A_cal|) over a step: the group advantage A = (R - mean R) / (std R + eps)
    (grpo.group_advantages) split into the part from r_nat = 2 * correct - 1 and the part from the
    calibration term, so A_cal / (A_nat + A_cal) is the share of |advantage| the term sets.
    Example: correct (1, 0), R (1.05, -0.97): std 1.428, A_nat +-0.700, A_cal +-0.007."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    nat = 2 * np.asarray(correct, dtype=np.float64).reshape(-1, group_size) - 1
    scale = (r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.inf) + eps
    a_nat = (nat - nat.mean(axis=1, keepdims=True)) / scale
    a_cal = ((r - nat) - (r - nat).mean(axis=1, keepdims=True)) / scale
    return float(np.abs(a_nat).sum()), float(np.abs(a_cal).sum())
