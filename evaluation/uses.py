"""Two uses of a calibrated confidence: weighted voting over samples (vote, voting_curves), and
an early exit from a trace at the first checkpoint whose confidence reaches a threshold,
calibrated by conformal risk control over questions (split_early_exit; docs/reference.md).
"""
import math
import random

import numpy as np


def cluster_answers(answers, same=None):
    """Cluster ids of one question's answers, from 0 by first appearance, None staying None; same(a,
    b) (e.g. grade.answers_match) compares an answer with each cluster's first one.
    cluster_answers(["2", None, "2", "3"]) == [0, None, 0, 1]."""
    reps, ids = [], []
    for a in answers:
        if a is None:
            ids.append(None)
            continue
        for c, r in enumerate(reps):
            if a == r or (same is not None and same(a, r)):
                ids.append(c)
                break
        else:
            reps.append(a)
            ids.append(len(reps) - 1)
    return ids


def vote(keys, confs=None):
    """The key of largest total weight (count, or with confs the sum of confidences), ties to the
    first (None abstains; all abstaining: None). vote([1, 0, 0]) == 0; vote([1, 0, 0], [0.9, 0.3, 0.4])
    == 1; vote([1, 0]) == 1."""
    score, first = {}, {}
    for i, k in enumerate(keys):
        if k is None:
            continue
        score[k] = score.get(k, 0.0) + (1.0 if confs is None else float(confs[i]))
        first.setdefault(k, i)
    if not score:
        return None
    return min(score, key=lambda k: (-score[k], first[k]))


def vote_sizes(n):
    """Vote sizes 1, 2, 4, ... below n, then n: vote_sizes(6) == [1, 2, 4, 6]."""
    ks = [1 << i for i in range(max(n, 1).bit_length()) if (1 << i) < n]
    return ks + [n] if n >= 1 else []


def voting_curves(questions, draws=16, seed=0):
    """{"k", "majority", "weighted"}: accuracy of both votes for k in vote_sizes(min n), averaged
    over `draws` random size-k subsets per question (all samples at k = n). questions: dicts of
    equal-length lists "keys" (cluster ids, None = no answer), "correct" (0/1; a cluster's is its
    first sample's) and "conf"."""
    n = min((len(q["keys"]) for q in questions), default=0)
    rng = random.Random(seed)
    out = {"k": [], "majority": [], "weighted": []}
    for k in vote_sizes(n):
        hits = {"majority": 0.0, "weighted": 0.0}
        reps = 1 if k == n else draws
        for q in questions:
            right = {}
            for key, c in zip(q["keys"], q["correct"]):
                right.setdefault(key, bool(c))
            for _ in range(reps):
                pick = sorted(rng.sample(range(n), k)) if k < n else range(n)
                keys = [q["keys"][i] for i in pick]
                for name, confs in (("majority", None), ("weighted", [q["conf"][i] for i in pick])):
                    won = vote(keys, confs)
                    hits[name] += (won is not None and right[won]) / reps
        out["k"].append(k)
        for name in hits:
            out[name].append(hits[name] / len(questions))
    return out


def exit_outcome(trace, lam):
    """(loss, tokens) of a trace {"checkpoints": [(t_j, c_j, y_j), ...], "length"} at threshold lam:
    (1 - y_j, t_j) at the first c_j >= lam, else (0, length)."""
    for t, c, y in trace["checkpoints"]:
        if c >= lam:
            return 1.0 - float(y), float(t)
    return 0.0, float(trace["length"])


def worst_exit(trace):
    """m of a trace: the highest confidence of a wrong checkpoint at which some threshold exits (its
    confidence above every earlier one), -inf if none. (c, y) = (0.3, 1), (0.5, 0), (0.4, 0): 0.5."""
    top, m = -math.inf, -math.inf
    for _, c, y in trace["checkpoints"]:
        if c > top:
            top = c
            if not y:
                m = c
    return m


def crc_bound(units, lam):
    """(sum_i L_i(lam) + 1) / (n + 1) over n units (lists of traces, L_i = mean bound_loss of its traces)."""
    total = sum(np.mean([lam <= worst_exit(tr) for tr in unit]) for unit in units)
    return (float(total) + 1.0) / (len(units) + 1)


def crc_threshold(units, epsilon):
    """Smallest lam among the checkpoint confidences with crc_bound(units, lam) <= epsilon: inf when
    only never exiting is, None when not even that (1 / (n + 1) > epsilon)."""
    n = len(units)
    if 1.0 / (n + 1) > epsilon:
        return None
    # worst exits with the weight of one trace in its unit's mean, highest first
    worst = sorted(((worst_exit(tr), 1.0 / len(unit)) for unit in units for tr in unit), reverse=True)
    cands = sorted({c for unit in units for tr in unit for _, c, _ in tr["checkpoints"]}, reverse=True)
    best, total, k = math.inf, 0.0, 0
    for lam in cands:
        while k < len(worst) and worst[k][0] >= lam:
            total += worst[k][1]
            k += 1
        if (total + 1.0) / (n + 1) > epsilon:
            break
        best = lam
    return best


def early_exit(cal, test, epsilons=(0.1, 0.2, 0.3)):
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
        rows.append({
            "epsilon": eps, "threshold": lam,
            "cal_bound": crc_bound(cal, use) if cal else math.nan,
            "test_risk": float(np.mean([o[0] for o in outs])) if outs else math.nan,
            "exit_rate": len(exits) / len(traces) if traces else math.nan,
            "tokens_saved": 1.0 - sum(o[1] for o in outs) / full,
        })
    return rows


def split_early_exit(units, epsilons=(0.1, 0.2, 0.3), splits=100, seed=0):
    """early_exit over `splits` seeded random halvings of the units (questions), the first half
    calibrating: per epsilon, split 0's threshold, cal_bound and test_risk_split0, and over all
    splits the mean test_risk (test_risk_sd), exit_rate and tokens_saved.
    """
    runs = []
    for s in range(splits):
        order = list(units)
        random.Random(seed + s).shuffle(order)
        half = len(order) // 2
        runs.append(early_exit(order[:half], order[half:], epsilons))
    rows = []
    for i, first in enumerate(runs[0]):
        row = dict(first, test_risk_split0=first["test_risk"], splits=splits)
        for key in ("test_risk", "exit_rate", "tokens_saved"):
            row[key] = float(np.mean([r[i][key] for r in runs]))
        row["test_risk_sd"] = float(np.std([r[i]["test_risk"] for r in runs]))
        rows.append(row)
    return rows


def from_samples(rows, same=None, draws=16, seed=0, epsilons=(0.1, 0.2, 0.3), splits=100):
    """Voting curves and (when every row has probe "checkpoints") split_early_exit from samples.jsonl
    rows (question, sample, answer, correct, confidence, length[, checkpoints])."""
    by_q = {}
    for r in rows:
        by_q.setdefault(r["question"], []).append(r)
    questions = []
    for q in sorted(by_q):
        rs = sorted(by_q[q], key=lambda r: r["sample"])
        questions.append({"keys": cluster_answers([r["answer"] for r in rs], same),
                          "correct": [r["correct"] for r in rs], "conf": [r["confidence"] for r in rs]})
    out = {"voting": voting_curves(questions, draws, seed)}
    if rows and all("checkpoints" in r for r in rows):
        units = [[{"checkpoints": r["checkpoints"], "length": r["length"]} for r in by_q[q]] for q in sorted(by_q)]
        out["early_exit"] = split_early_exit(units, epsilons, splits, seed)
    return out
