"""The --reward modes: RLCM, the paper's baselines and its ablations (docs/design.md, "Baselines"),
as train.py runs them. The formulas live in reward.py (RLCM's margin and the ablations' terms),
grpo.py (group advantages) and baselines.py (RLCR and C2GSPG whole); this file says which one each
mode uses and what it logs.

  mode           labels + probe      reward R                                   advantages
  rlcm           budgets .25/.5/.75  r_nat + lam * margin (--corner, zero)      group z-score
  grpo           no                  r_nat                                      group z-score
  final-margin   budget 1.0          r_nat + lam * final_margin (+-mean C)      group z-score
  process-brier  budgets .25/.5/.75  r_nat + lam * -mean_b (C_b - Y_b)^2        group z-score,
  final-brier    budget 1.0          the same; unanimous groups' R = 0          so theirs are 0
  rlcr           no                  correct - (correct - verbal conf)^2        group z-score
  c2gspg         no                  correct (0/1)                              (r - mean r) / max(1 - c, 1e-6);
                                                                                --c2gspg-bce: + 0.1 BCE(c_theta, r)
r_nat = 2 * correct - 1 (signed, released). The budgets, corner and unanimous-group filter a mode
implies are set by config.IMPLIED (flags given win); --corner picks the margin's rule (MARGINS).
The filter (--drop-unanimous, released filter_natural_corner_groups) sets the reward of every
trajectory in a group whose answers are all right or all wrong to 0: they stay in the update at
advantage 0, in the token-mean's denominator. When every group of the step is unanimous the
filter is off for that step, as released, so the step still trains on the Brier term.
rlcr reads correctness from the last <answer> tag and its confidence from the last <confidence> tag
(baselines.verbal_confidence, the released parser: "85" -> 0.85, "0.3" -> 0.3, missing or outside
[0, 100] -> 0.5 and counted); c2gspg's
c = exp(mean token log-prob) of the response at the sampling temperature under the rollout weights
(baselines.sequence_confidence).
"""
import torch

import grade
from baselines import c2gspg_advantages, c2gspg_loss, rlcr_reward, verbal_confidence
from grpo import group_advantages
from reward import brier_reward, corner_margin, final_margin, margin_reward, total_reward
from harness import rewardfn

REWARDS = ("rlcm", "grpo", "final-margin", "process-brier", "final-brier", "rlcr", "c2gspg")
PROBE_MODES = ("rlcm", "final-margin", "process-brier", "final-brier")  # forced-answer labels + probe
SHAPED = ("grpo",) + PROBE_MODES  # R = r_nat + lam * a calibration term (grpo: lam = 0)
BRIER_MODES = ("process-brier", "final-brier")
MARGINS = {"zero": margin_reward, "margin-corner": corner_margin, "final-margin": final_margin}  # --corner
COUNTED = ("verbal_missing", "skipped")  # components logged per step as a count; the others as a mean


def answer_form(mode):
    """Where a mode's responses give their answer (grade.extract): rlcr's last <answer> tag, else the box."""
    return "tag" if mode == "rlcr" else "box"


def calibration_key(mode):
    """The name a probe mode's calibration term is logged under: "brier" or "margin"."""
    return "brier" if mode in BRIER_MODES else "margin"


def correctness(texts, golds, grader, mode):
    """0/1 float [N]: the last box against the gold answer; rlcr: the last <answer> tag instead."""
    form = answer_form(mode)
    return torch.tensor([grade.is_correct(t, g, grader, form) for t, g in zip(texts, golds)],
                        dtype=torch.float32)


def judged(texts, golds, rows, reward_fn):
    """--reward-fn's correctness (harness/rewardfn.py): (values [N] float in [0, 1], 0 where
    skipped; scored [N] bool, False where the function returned None)."""
    values = [rewardfn.judge(reward_fn, t, g, r) for t, g, r in zip(texts, golds, rows)]
    return (torch.tensor([v or 0.0 for v in values], dtype=torch.float32),
            torch.tensor([v is not None for v in values], dtype=torch.bool))


def calibration(C, Y, valid, cfg):
    """The probe modes' calibration term [N]: the margin by --corner (rlcm, final-margin) or the
    negative Brier."""
    if cfg["reward"] in BRIER_MODES:
        return brier_reward(C, Y, valid)
    return MARGINS[cfg["corner"]](C, Y, valid)


def unanimous(correct, group_size, scored=None):
    """Bool [N]: True for every trajectory of a group whose answers are all right or all wrong
    (with `scored`, --reward-fn's: whose scored answers all have one value).

    Example: correct (1, 1, 0, 0, 0, 0), group_size 3 -> (False, False, False, True, True, True).
    """
    g = torch.as_tensor(correct, dtype=torch.float32).view(-1, group_size)
    if scored is None:
        same = (g == g[:, :1]).all(dim=1, keepdim=True)
    else:
        s = scored.view(-1, group_size)
        same = g.masked_fill(~s, -1.0).amax(1, keepdim=True) <= g.masked_fill(~s, 2.0).amin(1, keepdim=True)
    return same.expand_as(g).reshape(-1)


def reward_and_advantages(cfg, correct, calib, texts, seq_conf, all_unanimous=None, scored=None):
    """One step's rewards R [N], advantages [N] and the mode's components {name: [N] float} (logged
    per step as means, per sample as values).

    correct [N] 0/1; calib [N] the probe modes' calibration term (else unused); texts: the responses
    (rlcr reads its confidence there); seq_conf [N] c2gspg's sequence confidence (else None);
    all_unanimous: whether every group of the step, on every rank, is unanimous (the filter's
    fallback; None: judged on these groups); scored [N] bool: --reward-fn's judged samples (modes.judged;
    None: all). An unscored sample gets R = 0 and advantage 0 and is left out of its group's
    statistics, which the others' advantages are computed over (`skipped` is logged).
    """
    mode, G = cfg["reward"], cfg["group_size"]
    parts = {}
    if mode == "rlcr":
        conf, missing = map(list, zip(*[verbal_confidence(t) for t in texts])) if texts else ([], [])
        conf = torch.tensor(conf, dtype=torch.float32)
        R = rlcr_reward(correct, conf)
        parts = dict(verbal_conf=conf, verbal_missing=torch.tensor(missing, dtype=torch.float32),
                     rlcr_brier=(correct - conf) ** 2)
    elif mode == "c2gspg":
        R = correct.clone()
        parts = dict(seq_conf=seq_conf)
    else:
        lam = 0.0 if mode == "grpo" else cfg["lam"]
        R = total_reward(correct, calib, lam=lam)
        if mode in PROBE_MODES:
            parts = {calibration_key(mode): calib}
    if cfg["drop_unanimous"]:
        same = unanimous(correct, G, scored)
        if bool(same.all()) if all_unanimous is None else all_unanimous:
            same = torch.zeros_like(same)  # every group unanimous: no filter this step, as released
        R = R.masked_fill(same, 0.0)
        parts["dropped"] = same.float()

    def advantages(i, n):  # of the samples i, in groups of n
        return c2gspg_advantages(correct[i], seq_conf[i], n) if mode == "c2gspg" else group_advantages(R[i], n)

    if scored is None:
        return R, advantages(slice(None), G), parts
    adv = torch.zeros(len(R))
    for start in range(0, len(R), G):  # each group's advantages over its scored samples alone
        kept = start + torch.nonzero(scored[start:start + G]).view(-1)
        if len(kept):
            adv[kept] = advantages(kept, len(kept))
    parts["skipped"] = (~scored).float()
    return R.masked_fill(~scored, 0.0), adv, parts


def extra_loss(cfg, correct):
    """The term a mode adds to the policy loss (update.update's `extra`): with --c2gspg-bce seq-mean
    or token-mean, C2GSPG's 0.1 * BCE(c_theta, correct); None otherwise (the released C2GSPG run,
    whose actor never receives the BCE's labels, and every other mode)."""
    if cfg["reward"] != "c2gspg" or cfg["c2gspg_bce"] == "off":
        return None
    return c2gspg_loss(correct, cfg["c2gspg_bce"])
