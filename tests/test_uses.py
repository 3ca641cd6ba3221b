import math
import random

import pytest

from evaluation import report


def test_vote_sizes():
    assert report.vote_sizes(1) == [1]
    assert report.vote_sizes(4) == [1, 2, 4]
    assert report.vote_sizes(6) == [1, 2, 4, 6]
    assert report.vote_sizes(32) == [1, 2, 4, 8, 16, 32]


# Calibration traces for early exit: one checkpoint each (10 tokens, confidence c, forced answer right y),
# full length 100. Exiting at a wrong checkpoint costs 1.
CONFS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
RIGHT = [0, 0, 0, 1, 0, 1, 1, 1, 1]
CAL = [[{"checkpoints": [(10, c, y)], "length": 100}] for c, y in zip(CONFS, RIGHT)]   # 9 one-trace units


def test_exit_outcome_first_crossing():
    tr = {"checkpoints": [(10, 0.2, 0), (20, 0.8, 1), (30, 0.9, 0)], "length": 50}
    assert report.exit_outcome(tr, 0.5) == (0.0, 20.0)
    assert report.exit_outcome(tr, 0.85) == (1.0, 30.0)
    assert report.exit_outcome(tr, 0.1) == (1.0, 10.0)
    assert report.exit_outcome(tr, math.inf) == (0.0, 50.0)


def test_crc_threshold_on_a_hand_computed_set():
    # n = 9: bound(lam) = (wrong exits + 1) / 10. Wrong exits: lam >= 0.6 -> 0, 0.4..0.5 -> 1, 0.3 -> 2, 0.2 -> 3.
    assert report.crc_bound(CAL, math.inf) == pytest.approx(0.1)
    assert report.crc_bound(CAL, 0.5) == pytest.approx(0.2)
    assert report.crc_bound(CAL, 0.2) == pytest.approx(0.4)
    assert report.crc_threshold(CAL, 0.3) == 0.3
    assert report.crc_threshold(CAL, 0.2) == 0.4
    assert report.crc_threshold(CAL, 0.1) == 0.6
    assert report.crc_threshold(CAL, 0.05) is None       # 1 / (n + 1) > epsilon: nothing is safe
    for eps in (0.1, 0.2, 0.3, 0.5):
        lam = report.crc_threshold(CAL, eps)
        assert report.crc_bound(CAL, lam) <= eps
        lower = [c for c in CONFS if c < lam]
        assert not lower or report.crc_bound(CAL, max(lower)) > eps     # the smallest such threshold


def test_calibration_uses_the_worst_exit_at_or_above_the_threshold():
    # Trace A exits right at its first checkpoint (0.3) and wrong at its second (0.5): its real loss is
    # 0 at lam = 0.3 but 1 at lam = 0.5, so the threshold is calibrated on bound_loss = 1[lam <= 0.5].
    a = {"checkpoints": [(5, 0.3, 1), (8, 0.5, 0)], "length": 9}
    assert report.exit_outcome(a, 0.3)[0] == 0.0 and report.exit_outcome(a, 0.5)[0] == 1.0
    assert report.worst_exit(a) == 0.5
    assert report.worst_exit({"checkpoints": [(1, 0.3, 1), (2, 0.5, 0), (3, 0.4, 0)], "length": 4}) == 0.5
    assert report.worst_exit({"checkpoints": [(1, 0.6, 1), (2, 0.5, 0)], "length": 4}) == -math.inf  # never an exit
    cal = [[a], [{"checkpoints": [(5, 0.1, 0)], "length": 9}], [{"checkpoints": [(5, 0.1, 0)], "length": 9}]]
    assert report.crc_bound(cal, 0.3) == pytest.approx(0.5)     # (1 + 0 + 0 + 1) / 4; the real loss gives 0.25
    assert report.crc_bound(cal, 0.5) == pytest.approx(0.5)
    assert report.crc_bound(cal, 0.1) == pytest.approx(1.0)      # (1 + 1 + 1 + 1) / 4
    assert report.crc_threshold(cal, 0.4) == math.inf
    assert report.crc_threshold(cal, 0.5) == 0.3


def _synthetic_traces(rng, questions=120, per=2, checkpoints=6):
    """Traces whose forced answer flips along the thinking (right, then wrong, then right ...), with a
    confidence that rises with the tokens and, less, with being right: the loss is not monotone."""
    units = []
    for _ in range(questions):
        hard, unit = rng.random(), []
        for _ in range(per):
            y, cps = int(rng.random() > hard), []
            for j in range(checkpoints):
                if rng.random() < 0.4:
                    y = int(rng.random() > hard)
                c = 0.5 * (j + 1) / checkpoints * (1 - hard) + 0.2 * y + rng.gauss(0, 0.15)
                cps.append((10 * (j + 1), round(c, 3), y))
            unit.append({"checkpoints": cps, "length": 10 * checkpoints + 10})
        units.append(unit)
    return units


def test_early_exit_meets_its_risk_target_over_random_splits():
    rng = random.Random(0)
    units = _synthetic_traces(rng)
    flips = sum(any(y1 and not y2 for (_, _, y1), (_, _, y2) in zip(tr["checkpoints"], tr["checkpoints"][1:]))
                for unit in units for tr in unit)
    assert flips > 50                                        # right, then wrong at a later checkpoint
    rows = report.split_early_exit(units, epsilons=(0.1, 0.2, 0.3), splits=200, seed=0)
    for r in rows:
        print(f"eps {r['epsilon']}: mean test risk {r['test_risk']:.3f} (sd {r['test_risk_sd']:.3f}), "
              f"exits {r['exit_rate']:.0%}")
        assert r["test_risk"] <= r["epsilon"]
        assert r["exit_rate"] > 0.05                         # it exits: the target is not met by never exiting
    # The split-0 row is early_exit on that split, and the mean is over all 200.
    order = list(units)
    random.Random(0).shuffle(order)
    first = report.early_exit(order[:60], order[60:])
    assert [r["test_risk_split0"] for r in rows] == [r["test_risk"] for r in first]
    assert [r["threshold"] for r in rows] == [r["threshold"] for r in first]


def test_early_exit_reports_tokens_saved_and_test_risk():
    test = [[{"checkpoints": [(10, 0.95, 1), (20, 0.99, 1)], "length": 100},
             {"checkpoints": [(10, 0.2, 0)], "length": 100}]]
    rows = report.early_exit(CAL, test, epsilons=(0.1, 0.05))
    r = rows[0]
    assert r["threshold"] == 0.6 and r["cal_bound"] == pytest.approx(0.1)
    assert r["test_risk"] == 0.0 and r["exit_rate"] == 0.5
    assert r["tokens_saved"] == pytest.approx(1 - (10 + 100) / 200)
    assert rows[1]["threshold"] is None and rows[1]["tokens_saved"] == 0.0


def test_early_exit_of_groups_by_question():
    rows = [dict(question=q, sample=s, answer=a, correct=c, confidence=p, length=40,
                 checkpoints=[[8, p, c]])
            for q in range(6)
            for s, (a, c, p) in enumerate([("5", 0, 0.3), ("5", 0, 0.3), ("7", 1, 0.9)])]
    out = report.early_exit_of(rows)
    assert [e["epsilon"] for e in out["early_exit"]] == [0.1, 0.2, 0.3]
    assert all(e["splits"] == 100 and e["test_risk_sd"] >= 0.0 for e in out["early_exit"])
    bare = [{k: v for k, v in r.items() if k != "checkpoints"} for r in rows]
    assert report.early_exit_of(bare) == {}


def test_crc_units_are_questions_with_the_mean_loss_of_their_traces():
    # Two questions of two traces each: at lam = 0.5 question 0 has one wrong exit of two (L = 0.5),
    # question 1 none, so the bound is (0.5 + 0 + 1) / 3 = 0.5, not (1 + 1) / 5 as over four traces.
    q0 = [{"checkpoints": [(4, 0.6, 0)], "length": 10}, {"checkpoints": [(4, 0.7, 1)], "length": 10}]
    q1 = [{"checkpoints": [(4, 0.2, 0)], "length": 10}, {"checkpoints": [(4, 0.9, 1)], "length": 10}]
    assert report.crc_bound([q0, q1], 0.5) == pytest.approx(0.5)
    assert report.crc_bound([q0, q1], 0.65) == pytest.approx(1 / 3)
    assert report.crc_threshold([q0, q1], 0.4) == 0.7      # candidates are seen confidences
