"""Correctness and calibration rewards of RLCM (arXiv 2604.23333). Torch and the standard library only,
so this file can be copied into any project as is.

Shapes: N trajectories, B prefixes (truncation points) per trajectory.
  conf   [N, B]  probe confidence C_b = sigmoid(probe(h_b)) of prefix b, in [0, 1]
  labels [N, B]  Monte-Carlo label Y_b in [0, 1] (fraction of K forced answers that were right)
  mask   [N, B]  1 where prefix b exists (responses have different numbers of prefixes), else 0
  correct [N]    1 if the final answer is right, else 0 (bool or 0/1 float)

Formulas, exactly as computed:
  margin  = mean(C_b : Y_b == 1) - mean(C_b : Y_b == 0)        (solvable minus unsolvable prefixes)
  process Brier = -mean_b (C_b - Y_b)^2
  RLCR    = correct - (correct - conf)^2                         (verbal-confidence baseline)
  direct Brier = correct - lam * (correct - conf)^2
  total   R = r_nat + lam * calib,  r_nat = 2 * correct - 1 (signed, +1/-1) or correct (0/1)

Defaults: lam = 0.1, signed correctness +1/-1 (the released code), margin corner "zero".

Where the paper's text and the released code differ (the default follows the code unless noted):
- Forced-answer close token: the paper says `</think>`, the released code inserts EOS
  (label.py; default `</think>`, switch `--forced-close eos`).
- Prefixes with 0 < Y_b < 1 count on neither side of the margin (released code); labels are not
  thresholded.
- A trajectory with no solvable or no unsolvable prefix gets margin 0 (corner="zero", RLCM). The
  released code has two other corner rules, kept here under their own names:
  corner="margin-corner" (`conf_diff` with `margin_corner=True`): mean C if only solvable prefixes,
    1 - mean C if only unsolvable ones (released unit tests: C (.9, .7) -> 0.8, C (.3, .1) -> 0.8);
  corner="final-margin" (`conf_diff_v3` as the released Final-Margin script sets it: tau 0,
    alpha_both 0, alpha_only_correct = alpha_only_incorrect = 1; run with budget 1.0 only): +mean C
    if only solvable, -mean C if only unsolvable (C (.3, .1) -> -0.2), 0 when both sides exist.
"""
import torch


def _float(x):
    """x as a floating tensor (bool / int / list inputs become float32)."""
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.float()


def _mask(conf, mask):
    return torch.ones_like(conf) if mask is None else _float(mask).to(conf.device, conf.dtype)


CORNERS = ("zero", "margin-corner", "final-margin")


def margin_reward(conf, labels, mask=None, corner="zero"):
    """Confidence margin per trajectory: [N, B] -> [N].

    pos = mask * (Y == 1), neg = mask * (Y == 0)   (0 < Y < 1 is ignored)
    margin = sum(C * pos) / n_pos - sum(C * neg) / n_neg       when n_pos > 0 and n_neg > 0
    when only one side exists (neither side: always 0):
      corner="zero":          0
      corner="margin-corner": sum(C * pos) / n_pos if only pos,  1 - sum(C * neg) / n_neg if only neg
      corner="final-margin":  sum(C * pos) / n_pos if only pos,   -sum(C * neg) / n_neg if only neg,
                              and 0 (not the margin) when both sides exist
    Example: C (0.9, 0.5, 0.1), Y (1, 0.5, 0) -> 0.9 - 0.1 = 0.8.
    Final-Margin ablation (one prefix at budget 1.0): C 0.7, Y 1 -> +0.7; C 0.2, Y 0 -> -0.2;
    Y 0.5 -> 0.
    """
    if corner not in CORNERS:
        raise ValueError(f"corner must be one of {CORNERS}, got {corner!r}")
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    pos = m * (labels == 1)
    neg = m * (labels == 0)
    n_pos, n_neg = pos.sum(-1), neg.sum(-1)
    mean_pos = (conf * pos).sum(-1) / n_pos.clamp(min=1)
    mean_neg = (conf * neg).sum(-1) / n_neg.clamp(min=1)
    has_pos, has_neg = n_pos > 0, n_neg > 0
    both = has_pos & has_neg if corner != "final-margin" else torch.zeros_like(has_pos)
    out = torch.where(both, mean_pos - mean_neg, torch.zeros_like(mean_pos))
    if corner != "zero":
        out = torch.where(has_pos & ~has_neg, mean_pos, out)
        only_neg = 1 - mean_neg if corner == "margin-corner" else -mean_neg
        out = torch.where(has_neg & ~has_pos, only_neg, out)
    return out


def brier_reward(conf, labels, mask=None):
    """Negative Brier score over prefixes: -sum_b mask * (C_b - Y_b)^2 / max(sum_b mask, 1), [N, B] -> [N].

    With B = 1 (budget 1.0 only) this is the Final-Brier ablation; with the RLCM budgets, Process-Brier.
    """
    conf = _float(conf)
    labels = _float(labels).to(conf.device, conf.dtype)
    m = _mask(conf, mask)
    return -((conf - labels) ** 2 * m).sum(-1) / m.sum(-1).clamp(min=1)


def rlcr_reward(correct, conf):
    """RLCR baseline on verbal confidence: correct - (correct - conf)^2, [N] -> [N] (correct 0/1)."""
    c = _float(correct)
    return c - (c - _float(conf).to(c.device, c.dtype)) ** 2


def direct_brier_reward(correct, conf, lam=0.1):
    """Direct Brier reward: 1[correct] - lam * (1[correct] - conf)^2, [N] -> [N]."""
    c = _float(correct)
    return c - lam * (c - _float(conf).to(c.device, c.dtype)) ** 2


def total_reward(correct, calib, lam=0.1, signed=True):
    """R = r_nat + lam * calib, r_nat = 2 * correct - 1 if signed (+1/-1) else correct (0/1); [N] -> [N].

    lam = 0 gives plain GRPO. Example: correct (1, 0), calib (0.5, 0.5), lam 0.1:
    signed -> (1.05, -0.95), unsigned -> (1.05, 0.05).
    """
    c = _float(correct)
    r_nat = 2 * c - 1 if signed else c
    return r_nat + lam * _float(calib).to(c.device, c.dtype)
