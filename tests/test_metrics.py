import math

import numpy as np
import pytest

import metrics


def test_ece_pce_hand_computed():
    conf, correct = (0.9, 0.9, 0.1, 0.1), (1, 0, 0, 0)
    # bin 9: gap 0.9 - 0.5 = 0.4, bin 1: gap 0.1 - 0 = 0.1, each half the samples
    assert metrics.ece(conf, correct) == pytest.approx(0.25)
    assert metrics.pce(conf, correct) == pytest.approx(0.25)
    # under-confidence counts in ECE, not in PCE
    assert metrics.ece((0.2, 0.2), (1, 1)) == pytest.approx(0.8)
    assert metrics.pce((0.2, 0.2), (1, 1)) == 0.0


def test_ece_mixed_over_and_under_confidence():
    # bin 8 (0.8, 0.8): acc 0 -> over 0.8; bin 3 (0.3, 0.3): acc 1 -> under 0.7
    conf, correct = (0.8, 0.8, 0.3, 0.3), (0, 0, 1, 1)
    assert metrics.ece(conf, correct) == pytest.approx(0.5 * 0.8 + 0.5 * 0.7)
    assert metrics.pce(conf, correct) == pytest.approx(0.5 * 0.8)
    # with 1 bin everything pools: mean conf 0.55, acc 0.5
    assert metrics.ece(conf, correct, n_bins=1) == pytest.approx(0.05)


def test_ece_weighs_each_bin_by_its_share_of_the_samples():
    # bin 9 holds 3 of 4 samples (0.9 x 3, acc 2/3, gap 0.9 - 0.667 = 0.233), bin 1 holds 1 (0.1)
    conf = (0.9, 0.9, 0.9, 0.1)
    # bin 1 wrong: gap 0.1 -> 3/4 * 0.233 + 1/4 * 0.1 = 0.2 (equal weights would give 0.167)
    assert metrics.ece(conf, (1, 1, 0, 0)) == pytest.approx(0.2)
    # bin 1 right: gap -0.9 -> ECE 0.175 + 0.225 = 0.4, PCE 0.175 (equal weights: 0.567, 0.117)
    assert metrics.ece(conf, (1, 1, 0, 1)) == pytest.approx(0.4)
    assert metrics.pce(conf, (1, 1, 0, 1)) == pytest.approx(0.175)


def test_last_bin_holds_one():
    rows = metrics.reliability((1.0, 0.95), (1, 0))
    assert rows[9]["count"] == 2 and sum(r["count"] for r in rows) == 2
    assert metrics.ece((1.0,), (1,)) == 0.0


def test_reliability_rows():
    rows = metrics.reliability((0.9, 0.9, 0.1, 0.1), (1, 0, 0, 0))
    assert len(rows) == 10
    assert rows[1] == {"lo": 0.1, "hi": 0.2, "count": 2, "mean_conf": pytest.approx(0.1), "accuracy": 0.0}
    assert rows[9]["lo"] == 0.9 and rows[9]["hi"] == 1.0
    assert rows[9]["count"] == 2 and rows[9]["mean_conf"] == pytest.approx(0.9) and rows[9]["accuracy"] == 0.5
    empty = rows[5]
    assert empty["count"] == 0 and math.isnan(empty["mean_conf"]) and math.isnan(empty["accuracy"])


def test_brier():
    assert metrics.brier((0.9, 0.9, 0.1, 0.1), (1, 0, 0, 0)) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert metrics.brier((1.0, 0.0), (1, 0)) == 0.0


def test_auroc_ties_and_one_class():
    # pairs (pos, neg): (0.4, 0.1) win, (0.4, 0.4) tie 1/2, (0.8, 0.1) win, (0.8, 0.4) win -> 3.5 / 4
    assert metrics.auroc((0.1, 0.4, 0.4, 0.8), (0, 0, 1, 1)) == pytest.approx(0.875)
    assert metrics.auroc((0.1, 0.9), (1, 0)) == 0.0
    assert metrics.auroc((0.5, 0.5, 0.5), (1, 0, 1)) == pytest.approx(0.5)
    assert math.isnan(metrics.auroc((0.2, 0.7), (1, 1)))
    assert math.isnan(metrics.auroc((0.2, 0.7), (0, 0)))
    with pytest.raises(ValueError, match="^auroc needs correctness exactly 0 or 1$"):
        metrics.auroc((0.2, 0.7), (1, 0.5))   # a Monte-Carlo label is not a class


def test_auroc_matches_pairwise_count():
    rng = np.random.default_rng(0)
    conf = np.round(rng.random(60), 1)  # many ties
    correct = (rng.random(60) < 0.5).astype(float)
    pos, neg = conf[correct == 1], conf[correct == 0]
    pairwise = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (pos.size * neg.size)
    assert metrics.auroc(conf, correct) == pytest.approx(pairwise)


def test_invariants_random():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        conf = rng.random(n)
        correct = (rng.random(n) < rng.random()).astype(float)
        e, p = metrics.ece(conf, correct), metrics.pce(conf, correct)
        assert 0.0 <= p <= e + 1e-12 <= 1.0 + 1e-12
        # every bin over-confident (all wrong) -> PCE == ECE
        assert metrics.pce(conf, np.zeros(n)) == pytest.approx(metrics.ece(conf, np.zeros(n)))


def test_pce_equals_ece_when_every_bin_overconfident_mixed():
    conf = (0.95, 0.92, 0.55, 0.51, 0.15)
    correct = (1, 0, 0, 1, 0)  # bin 9 acc .5 < .935, bin 5 acc .5 < .53, bin 1 acc 0 < .15
    assert metrics.pce(conf, correct) == pytest.approx(metrics.ece(conf, correct))
    assert metrics.ece(conf, correct) > 0


def test_calibration_dict():
    out = metrics.calibration((0.9, 0.9, 0.1, 0.1), (1, 0, 0, 0))
    assert set(out) == {"acc", "ece", "pce", "brier", "auroc", "n"}
    assert out["acc"] == 0.25 and out["n"] == 4
    assert out["ece"] == pytest.approx(0.25) and out["brier"] == pytest.approx(0.21)
    # the right sample ties with one wrong one at 0.9 and beats two at 0.1: (1/2 + 2) / 3
    assert out["auroc"] == pytest.approx(2.5 / 3)


@pytest.mark.parametrize("conf, correct", [
    ((0.5, 0.5), (1,)), ((), ()), ((0.5, 1.2), (1, 0)), ((-0.1,), (1,)), ((0.5,), (2,)),
    ((float("nan"), 0.5), (1, 0)), ((0.5,), (float("nan"),)),
])
def test_validation(conf, correct):
    for fn in (metrics.ece, metrics.pce, metrics.brier, metrics.auroc, metrics.reliability, metrics.calibration):
        with pytest.raises(ValueError, match=r"pairs in \[0, 1\], not NaN"):
            fn(conf, correct)


def _questions(n_questions, n_samples, seed):
    """Every question right with probability 0.5 per sample; confidence 0.7 everywhere."""
    rng = np.random.default_rng(seed)
    correct = rng.random((n_questions, n_samples)) < 0.5
    groups = np.repeat(np.arange(n_questions), n_samples)
    return np.full(correct.size, 0.7), correct.reshape(-1).astype(float), groups


def test_bootstrap_resamples_whole_questions():
    # Two questions, one always right, one always wrong: a resample of 2 questions has accuracy 0, 1/2
    # or 1 with probabilities 1/4, 1/2, 1/4, so sd = sqrt(1/8) and pm = 1.96 * 0.354 = 0.693.
    conf, correct = [0.5] * 100, [1.0] * 50 + [0.0] * 50
    got = metrics.bootstrap(conf, correct, [0] * 50 + [1] * 50)
    assert got["acc"]["pm"] == pytest.approx(1.96 * math.sqrt(1 / 8), rel=0.08)
    assert (got["acc"]["lo"], got["acc"]["hi"]) == (0.0, 1.0)  # 0.5 -+ 0.69, clipped to [0, 1]
    # Treating the 100 samples as independent would claim far more certainty.
    assert metrics.bootstrap(conf, correct, range(100))["acc"]["pm"] < 0.25
    assert metrics.bootstrap(conf, correct, [0] * 50 + [1] * 50) == got  # seeded


def test_bootstrap_interval_holds_the_estimate_and_shrinks_with_more_samples():
    widths = []
    for n_samples in (2, 8, 32):
        conf, correct, groups = _questions(40, n_samples, seed=n_samples)
        got = metrics.bootstrap(conf, correct, groups)
        point = {"acc": correct.mean(), "ece": metrics.ece(conf, correct), "pce": metrics.pce(conf, correct)}
        for key, value in point.items():
            assert got[key]["lo"] <= value <= got[key]["hi"], (n_samples, key)
        widths.append(got["acc"]["pm"])
    assert widths[0] > widths[1] > widths[2] > 0
    # With more questions too: 40 -> 400 questions of 4 samples.
    small = metrics.bootstrap(*_questions(40, 4, seed=1))["ece"]["pm"]
    big = metrics.bootstrap(*_questions(400, 4, seed=1))["ece"]["pm"]
    assert big < small / 2


def test_pass_at_k_hand_worked():
    # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert metrics.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # 1 - C(5, 3) / C(6, 3) = 1 - 10/20
    assert metrics.pass_at_k(6, 1, 3) == pytest.approx(0.5)
    # k = 1 is the share right
    assert metrics.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert metrics.pass_at_k(10, 0, 5) == 0.0
    # n - c < k: every k-subset holds a right sample
    assert metrics.pass_at_k(3, 2, 2) == 1.0 and metrics.pass_at_k(4, 4, 1) == 1.0
    # k = n draws every sample: 1 with one right, 0 with none
    assert metrics.pass_at_k(4, 1, 4) == 1.0 and metrics.pass_at_k(4, 0, 4) == 0.0
    # n - c = k: one k-subset of wrong samples, 1 - 1 / C(4, 2)
    assert metrics.pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # C(n-3, k) / C(n, k) = (n-k)(n-k-1)(n-k-2) / (n(n-1)(n-2)); with n = 200, k = 100:
    assert metrics.pass_at_k(200, 3, 100) == pytest.approx(1 - 100 * 99 * 98 / (200 * 199 * 198))
    # C(1999, 1000) / C(2000, 1000) = 1000/2000, though C(2000, 1000) overflows a float
    assert metrics.pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        metrics.pass_at_k(n, c, k)


def test_heldout_probe_worked_numbers():
    """Prefixes Y (1, .5 | 0, 1), C (.8, .5 | .2, 1.0), K = 2. BCE: -(2 log .8 + log .5 + ~0) / 4 = 0.2849
    (C = 1.0 is clipped to 1 - 1e-7: without the clip (1 - Y) log(1 - C) is 0 * -inf = nan). ECE: bins
    8, 5, 2, 9 with gaps -.2, 0, .2, 0 -> 0.4 / 4 = 0.1. AUROC over the K forced answers: right
    Y * K = 2, 1, 0, 2 -> confidences of right answers (.8, .8, .5, 1, 1), of wrong (.5, .2, .2): 14.5 of
    15 pairs won (the .5 tie counts 1/2). The per-trajectory margin and brier are averaged."""
    trajectories = [dict(Y_b=[1.0, 0.5], C_b=[0.8, 0.5], margin=0.3, brier=-0.1),
                    dict(Y_b=[0.0, 1.0], C_b=[0.2, 1.0], margin=0.1, brier=-0.3)]
    got = metrics.heldout_probe(trajectories, 2)
    assert got == {"eval_probe_bce": pytest.approx((-2 * math.log(0.8) + math.log(2)) / 4),
                   "eval_probe_ece": pytest.approx(0.1), "eval_probe_auroc": pytest.approx(14.5 / 15),
                   "eval_margin": pytest.approx(0.2), "eval_brier": pytest.approx(-0.2),
                   "eval_probe_prefixes": 4}
    # no margin or brier in the trajectories, none in the row; no prefixes at all: only the count
    assert metrics.heldout_probe([dict(Y_b=[0.5], C_b=[0.5])], 2) == {
        "eval_probe_bce": pytest.approx(math.log(2)), "eval_probe_ece": 0.0, "eval_probe_auroc": 0.5,
        "eval_probe_prefixes": 1}
    assert metrics.heldout_probe([dict(Y_b=[], C_b=[])], 4) == {"eval_probe_prefixes": 0}
    # a sure and right probe, C = Y = 0 and 1: both clips keep the BCE finite, about 1e-7
    assert metrics.heldout_probe([dict(Y_b=[0.0, 1.0], C_b=[0.0, 1.0])], 2)["eval_probe_bce"] == pytest.approx(0, abs=1e-6)
