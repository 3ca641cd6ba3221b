"""The --reward modes: RLCM, the paper's baselines and its ablations (docs/design.md, "Baselines"):
which formula each uses and what it logs. The formulas: reward.py (RLCM's margin, the ablations'
terms), grpo.py (group advantages), baselines.py (RLCR and C2GSPG whole).

  mode           probe at    reward R                             advantages
  rlcm           .25/.5/.75  r_nat + lam * margin (--corner)      group z-score
  grpo           -           r_nat                                group z-score
  final-margin   1.0         r_nat + lam * final_margin           group z-score
  process-brier  .25/.5/.75  r_nat + lam * -mean_b (C_b - Y_b)^2  group z-score,
  final-brier    1.0         the same; unanimous groups' R = 0    so theirs are 0
  rlcr           -           correct - (correct - verbal conf)^2  group z-score
  c2gspg         -           correct (0/1)                        (r - mean r) / max(1 - c, 1e-6);
                                                                  --c2gspg-bce: + 0.1 BCE(c, r)
r_nat = 2 * correct - 1 (signed, released). config.IMPLIED sets the budgets, corner and filter a
mode implies (flags given win). The filter, RLCR's parser, C2GSPG's c: docs/design.md, "Baselines".
"""
import torch

import grade
from baselines import c2gspg_advantages, c2gspg_loss, rlcr_reward, verbal_confidence
from grpo import group_advantages
from reward import brier_reward, corner_margin, final_margin, margin_reward, total_reward
from harness import rewardfn

REWARDS = ("rlcm", "grpo", "final-margin", "process-brier", "final-brier", "rlcr", "c2gspg")
PROBE_MODES = ("rlcm", "final-margin", "process-brier", "final-brier")  # forced answers + probe
SHAPED = ("grpo",) + PROBE_MODES  # R = r_nat + lam * a calibration term (grpo: lam = 0)
BRIER_MODES = ("process-brier", "final-brier")
MARGINS = {"zero": margin_reward, "margin-corner": corner_margin, "final-margin": final_margin}
COUNTED = ("verbal_missing", "skipped")  # logged per step as a count; other components as a mean


def answer_form(mode):
    """Where a mode's responses answer (grade.extract): rlcr's last <answer> tag, else the box."""
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
    """--reward-fn's grades (harness/rewardfn.py): values [N] (0: skipped) and scored [N] bool."""
    values = [rewardfn.judge(reward_fn, t, g, r) for t, g, r in zip(texts, golds, rows)]
    return (torch.tensor([v or 0.0 for v in values], dtype=torch.float32),
            torch.tensor([v is not None for v in values], dtype=torch.bool))


def grades(texts, golds, rows, cfg):
    """The step's (correct [N], scored, judge): the mode's grades, or --reward-fn's (judged) and
    a judge(answer, i) of response i's forced answers (label.mc_labels); else scored, judge None."""
    fn = cfg["reward_fn"]
    if not fn:
        return correctness(texts, golds, cfg["grader"], cfg["reward"]), None, None
    judge = lambda answer, i: rewardfn.judge(fn, answer, golds[i], rows[i])  # noqa: E731
    return (*judged(texts, golds, rows, fn), judge)


def calibration_term(C, Y, valid, cfg):
    """The probe modes' calibration term [N]: the margin by --corner, or the negative Brier."""
    if cfg["reward"] in BRIER_MODES:
        return brier_reward(C, Y, valid)
    return MARGINS[cfg["corner"]](C, Y, valid)


def unanimous(correct, group_size, scored=None):
    """Bool [N]: True for every trajectory of a group whose answers are all right or all wrong
    (with `scored`, --reward-fn's: whose scored answers all have one value). Example: correct
    (1, 1, 0, 0, 0, 0), group_size 3 -> (False, False, False, True, True, True)."""
    g = torch.as_tensor(correct, dtype=torch.float32).view(-1, group_size)
    if scored is None:
        same = (g == g[:, :1]).all(dim=1, keepdim=True)
    else:
        s = scored.view(-1, group_size)
        same = g.masked_fill(~s, -1.0).amax(1, keepdim=True) <= g.masked_fill(~s, 2.0).amin(1, keepdim=True)
    return same.expand_as(g).reshape(-1)


def reward_and_advantages(cfg, correct, calib, texts, seq_conf, all_unanimous=None, scored=None):
    """One step's rewards R [N], advantages [N] and the mode's components {name: [N] float} (logged
    per step as means, per sample as values). correct [N] 0/1; calib [N] the probe modes'
    calibration term; texts: the responses (rlcr reads its confidence there); seq_conf [N]
    c2gspg's c; all_unanimous: whether every group of the step, on every rank, is unanimous (the
    filter's fallback; None: judged on these groups); scored [N] bool: --reward-fn's judged samples
    (None: all). An unscored sample gets R = 0 and advantage 0, out of its group's statistics."""
    mode, G = cfg["reward"], cfg["group_size"]
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
        parts = {calibration_key(mode): calib} if mode in PROBE_MODES else {}
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
    """The term a mode adds to the policy loss (update.update's `extra`): with --c2gspg-bce,
    C2GSPG's 0.1 * BCE(c_theta, correct); else None (the released C2GSPG run's, docs/design.md)."""
    if cfg["reward"] != "c2gspg" or cfg["c2gspg_bce"] == "off":
        return None
    return c2gspg_loss(correct, cfg["c2gspg_bce"])
