"""Correctness and calibration rewards of RLCM (arXiv 2604.23333). Torch and the standard library only,
so this file can be copied into any project as is.

Shapes: N trajectories, B prefixes (truncation points) per trajectory.
  conf   [N, B]  probe confidence C_b = sigmoid(probe(h_b)) of prefix b, in [0, 1]
  labels [N, B]  Monte-Carlo label Y_b in [0, 1] (fraction of K forced answers that were right)
  mask   [N, B]  1 where prefix b exists, else 0;  correct [N]  1 if the final answer is right, else 0

RLCM:
  margin  = mean(C_b : Y_b == 1) - mean(C_b : Y_b == 0)   (solvable minus unsolvable prefixes),
            0 unless both sides exist; prefixes with 0 < Y_b < 1 count on neither side (released
            code; labels are not thresholded)
  R       = r_nat + lam * margin,  r_nat = 2 * correct - 1 (signed, +1/-1, released); lam 0.1

The ablations' calibration terms: corner_margin (released `conf_diff`, margin_corner=True),
final_margin (Final-Margin, released `conf_diff_v3` as its script sets it) and brier_reward
(Process-Brier with the RLCM budgets, Final-Brier with budget 1.0).
"""
import torch


def _float(x):
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.float()


def _mask(conf, mask):
    return torch.ones_like(conf) if mask is None else _float(mask).to(conf.device, conf.dtype)


def _sides(conf, labels, mask):
    """Per trajectory [N]: mean C over solvable prefixes (Y == 1), mean C over unsolvable ones
    (Y == 0), and whether each side has a prefix (a mean over no prefix is 0)."""
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    pos, neg = m * (labels == 1), m * (labels == 0)
    n_pos, n_neg = pos.sum(-1), neg.sum(-1)
    mean_pos = (conf * pos).sum(-1) / n_pos.clamp(min=1)
    mean_neg = (conf * neg).sum(-1) / n_neg.clamp(min=1)
    return mean_pos, mean_neg, n_pos > 0, n_neg > 0


def margin_reward(conf, labels, mask=None):
    """RLCM's confidence margin per trajectory, [N, B] -> [N]: mean C of the solvable prefixes minus
    mean C of the unsolvable ones, 0 when either side is empty: C (0.9, 0.5, 0.1), Y (1, 0.5, 0)
    -> 0.9 - 0.1 = 0.8."""
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    return torch.where(has_pos & has_neg, mean_pos - mean_neg, torch.zeros_like(mean_pos))


def corner_margin(conf, labels, mask=None):
    """The margin, with the released corner rule for one-sided traces, [N, B] -> [N]: mean C if only
    solvable prefixes, 1 - mean C if only unsolvable ones, 0 if neither.

    Released unit tests: C (.9, .7) all solvable -> 0.8; C (.3, .1) all unsolvable -> 0.8.
    """
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    out = torch.where(has_pos & has_neg, mean_pos - mean_neg, torch.zeros_like(mean_pos))
    out = torch.where(has_pos & ~has_neg, mean_pos, out)
    return torch.where(has_neg & ~has_pos, 1 - mean_neg, out)


def final_margin(conf, labels, mask=None):
    """Final-Margin's calibration term, [N, B] -> [N]: +mean C if only solvable prefixes, -mean C if
    only unsolvable ones, and 0 otherwise, exactly when both sides exist too (not a margin).

    At budget 1.0 (one prefix): C 0.7, Y 1 -> +0.7; C 0.2, Y 0 -> -0.2; Y 0.5 -> 0.
    """
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    out = torch.where(has_pos & ~has_neg, mean_pos, torch.zeros_like(mean_pos))
    return torch.where(has_neg & ~has_pos, -mean_neg, out)


def brier_reward(conf, labels, mask=None):
    """Negative Brier score over prefixes: -sum_b mask * (C_b - Y_b)^2 / max(sum_b mask, 1), [N, B] -> [N].

    With B = 1 (budget 1.0 only) this is the Final-Brier ablation; with the RLCM budgets, Process-Brier.
    """
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    return -((conf - labels) ** 2 * m).sum(-1) / m.sum(-1).clamp(min=1)


def total_reward(correct, calib, lam=0.1):
    """R = r_nat + lam * calib, r_nat = 2 * correct - 1 (+1/-1); [N] -> [N]. lam = 0 gives plain
    GRPO. correct (1, 0), calib (0.5, 0.5), lam 0.1 -> (1.05, -0.95)."""
    c = _float(correct)
    return 2 * c - 1 + lam * _float(calib).to(c.device, c.dtype)
