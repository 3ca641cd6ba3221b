"""Correctness and calibration rewards of RLCM (arXiv 2604.23333). Torch and the standard library only,
so this file can be copied into any project as is. Two trajectories, the second's last cut padded:

    >>> C, Y = [[0.9, 0.5, 0.1], [0.8, 0.4, 0.0]], [[1, 0.5, 0], [1, 0, 0]]
    >>> margin = margin_reward(C, Y, mask=[[1, 1, 1], [1, 1, 0]])   # Y_b = 0.5: on neither side
    >>> margin, total_reward(correct=[1, 0], calib=margin, lam=0.1)
    (tensor([0.8000, 0.4000]), tensor([ 1.0800, -0.9600]))
    >>> margin_reward([[0.9, 0.0]], [[1, 0]])  # no mask: the padded 0 is an unsolvable cut
    tensor([0.9000])
    >>> margin_reward([[0.9, 0.1]], [[1 - 1e-7, 0]])  # float noise keeps a label's side
    tensor([0.8000])

Shapes: N trajectories, B cuts (truncation points) per trajectory.
  conf   [N, B]  probe confidence C_b = sigmoid(probe(h_b)) at cut b, in [0, 1]
  labels [N, B]  Monte-Carlo label Y_b in [0, 1] (fraction of K forced answers that were right)
  mask   [N, B]  1 where cut b is real, 0 on padding. None: every entry is a real cut, so pass the
                 mask whenever rows are padded (a padded 0 would count as an unsolvable cut)
  correct [N]    1 if the final answer is right, else 0

A cut is solvable when Y_b = 1 (all K forced answers right) and unsolvable when Y_b = 0 (none
right); with 0 < Y_b < 1 it counts on neither side (released code; labels are not thresholded).
A label within 1e-6 of 1 or 0 (float noise, 1 - 1e-7) counts as 1 or 0; K - 1 right of K stays
in between for any K below a million.

RLCM:
  margin  = mean(C_b : Y_b = 1) - mean(C_b : Y_b = 0),  0 unless both sides exist
  R       = r_nat + lam * margin,  r_nat = 2 * correct - 1 (signed, +1/-1, released); lam 0.1

The ablations' calibration terms: corner_margin (released `conf_diff`, margin_corner=True),
final_margin (Final-Margin, released `conf_diff_v3` as its script sets it) and brier_reward
(Process-Brier with the RLCM budgets, Final-Brier with budget 1.0)."""
import torch

EPS = 1e-6  # a label this close to 1 (or 0) is solvable (or unsolvable): float noise keeps its side


def _float(x):
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.float()


def _mask(conf, mask):
    return torch.ones_like(conf) if mask is None else _float(mask).to(conf.device, conf.dtype)


def _sides(conf, labels, mask):
    """Per trajectory [N]: mean C over the solvable cuts (Y_b = 1), mean C over the unsolvable ones
    (Y_b = 0), and whether each side has a cut (a mean over no cut is 0)."""
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    pos, neg = m * (labels >= 1 - EPS), m * (labels <= EPS)
    n_pos, n_neg = pos.sum(-1), neg.sum(-1)
    mean_pos = (conf * pos).sum(-1) / n_pos.clamp(min=1)
    mean_neg = (conf * neg).sum(-1) / n_neg.clamp(min=1)
    return mean_pos, mean_neg, n_pos > 0, n_neg > 0


def margin_reward(conf, labels, mask=None):
    """RLCM's margin, [N, B] -> [N]: mean C over solvable cuts - mean over unsolvable ones, or 0."""
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    return torch.where(has_pos & has_neg, mean_pos - mean_neg, torch.zeros_like(mean_pos))


def corner_margin(conf, labels, mask=None):
    """The margin, with the released corner rule for one-sided traces, [N, B] -> [N]: mean C if only
    solvable cuts, 1 - mean C if only unsolvable ones, 0 if neither. The released unit tests:

    >>> corner_margin([[0.9, 0.7], [0.3, 0.1]], [[1, 1], [0, 0]])
    tensor([0.8000, 0.8000])
    """
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    out = torch.where(has_pos & has_neg, mean_pos - mean_neg, torch.zeros_like(mean_pos))
    out = torch.where(has_pos & ~has_neg, mean_pos, out)
    return torch.where(has_neg & ~has_pos, 1 - mean_neg, out)


def final_margin(conf, labels, mask=None):
    """Final-Margin's calibration term, [N, B] -> [N]: +mean C if only solvable cuts, -mean C if
    only unsolvable ones, and 0 otherwise, exactly when both sides exist too (not a margin). At
    budget 1.0 (one cut):

    >>> final_margin([[0.7], [0.2], [0.9]], [[1], [0], [0.5]])
    tensor([ 0.7000, -0.2000,  0.0000])
    """
    mean_pos, mean_neg, has_pos, has_neg = _sides(conf, labels, mask)
    out = torch.where(has_pos & ~has_neg, mean_pos, torch.zeros_like(mean_pos))
    return torch.where(has_neg & ~has_pos, -mean_neg, out)


def brier_reward(conf, labels, mask=None):
    """The negative Brier score, [N, B] -> [N]: -sum_b mask (C_b - Y_b)^2 / max(sum_b mask, 1);
    soft labels are targets as they are. With B = 1 (budget 1.0 only) this is the Final-Brier
    ablation; with the RLCM budgets, Process-Brier.

    >>> brier_reward([[0.9, 0.5, 0.0]], [[1, 0.25, 0]], [[1, 1, 0]])
    tensor([-0.0363])
    """
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    return -((conf - labels) ** 2 * m).sum(-1) / m.sum(-1).clamp(min=1)


def total_reward(correct, calib, lam=0.1):
    """R = r_nat + lam * calib, r_nat = 2 * correct - 1 (+1/-1); [N] -> [N]. lam 0: plain GRPO."""
    c = _float(correct)
    return 2 * c - 1 + lam * _float(calib).to(c.device, c.dtype)
