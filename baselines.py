"""The --reward modes: RLCM, the paper's baselines and its ablations (docs/design.md, "Baselines"):
which formula each uses and what it logs. The formulas: reward.py (RLCM's margin, the ablations'
terms), grpo.py (group advantages); RLCR and C2GSPG whole below.

  mode           probe at    reward R                             advantages
  rlcm           .25/.5/.75  r_nat + lam * margin (--corner)      group z-score
  grpo           -           r_nat                                group z-score
  final-margin   1.0         r_nat + lam * final_margin           group z-score
  process-brier  .25/.5/.75  r_nat + lam * -mean_b (C_b - Y_b)^2  group z-score,
  final-brier    1.0         the same; unanimous groups' R = 0    so theirs are 0
  rlcr           -           correct - (correct - verbal conf)^2  group z-score
  c2gspg         -           correct (0/1)                        (r - mean r) / max(1 - c, 1e-6);
                                                                  --c2gspg-bce: + 0.1 BCE(c, r)
r_nat = 2 * correct - 1 (signed, released). config.IMPLIED sets budgets, corner and filter a mode
implies (flags given win). The filter, RLCR's parser, C2GSPG's c: docs/design.md, "Baselines"."""
import re

import torch

import grade
from grpo import group_advantages, micro_batch
from label import forward_pass
from reward import brier_reward, corner_margin, final_margin, margin_reward, total_reward
from harness.parallel import all_sum

_NUMBER = re.compile(r"[-+]?\d*\.?\d+")  # released: the first such number, no exponent ("1e-3" -> 1)


def verbal_confidence(text):
    """(confidence, invalid) as the released RLCR scorer reads it (rlcr.extract_answer_and_confidence):
    the last `<confidence>(.*?)</confidence>` match (tags case-sensitive), its first number; [0, 1]
    as is, (1, 100] / 100: "0.8" -> 0.8, "85" or "85%" -> 0.85. No tag, no number, or a value below 0
    or above 100 -> (0.5, True): RL cannot earn a sure 1.0 or 0.0 by writing "150" or "-3". The
    matches are the regex's, found by str.find moving forward: linear, however many tags repeat."""
    span, pos = None, 0
    while (start := text.find("<confidence>", pos)) >= 0:
        end = text.find("</confidence>", start + len("<confidence>"))
        if end < 0:
            break
        span, pos = (start + len("<confidence>"), end), end + len("</confidence>")
    m = _NUMBER.search(text, *span) if span else None
    v = float(m.group()) if m else -1.0
    return ((v if v <= 1 else v / 100), False) if 0 <= v <= 100 else (0.5, True)


def rlcr_reward(correct, conf):
    """RLCR's reward on verbal confidence: correct - (correct - conf)^2, [N] -> [N] (correct 0/1)."""
    c = torch.as_tensor(correct)
    c = c if c.is_floating_point() else c.float()
    return c - (c - torch.as_tensor(conf).to(c.device, c.dtype)) ** 2


def sequence_confidence(logp, mask):
    """C2GSPG's confidence c = exp(sum_t logp * m / sum_t m) per sequence, clipped to [0, 1 - 1e-6]:
    logp, mask [N, T] -> [N]. Differentiable (the loss's c_theta); detach it for the advantage."""
    m = mask.to(logp.dtype)
    return torch.exp((logp * m).sum(-1) / m.sum(-1).clamp(min=1)).clamp(max=1 - 1e-6)


def c2gspg_advantages(rewards01, conf, group_size):
    """C2GSPG's advantage: A = (r - mean_group r) / max(1 - c, 1e-6), [N] -> [N]; rewards01: 0/1
    correctness; conf: the sequence confidence c, detached (the BCE term is c2gspg_loss)."""
    r = torch.as_tensor(rewards01, dtype=torch.float32)
    c = torch.as_tensor(conf).detach().to(r.device, torch.float32)
    g = r.view(-1, group_size)
    centred = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    return centred / (1 - c).clamp(min=1e-6)


def c2gspg_bce(c, rewards01):
    """C2GSPG's confidence loss per sequence: -(r log c + (1 - r) log(1 - c)), [N] -> [N]. c is
    clamped to [1e-6, 1 - 1e-6] so the log stays finite."""
    c = c.clamp(1e-6, 1 - 1e-6)
    r = torch.as_tensor(rewards01, dtype=c.dtype, device=c.device)
    return -(r * torch.log(c) + (1 - r) * torch.log1p(-c))


def c2gspg_loss(correct, form="seq-mean"):
    """C2GSPG's term of the policy loss, grpo.update's `extra` (name, coefficient, term): 0.1 *
    BCE(c_theta, correct [N] 0/1), logged as c2gspg_bce, as the mean over sequences ("seq-mean") or
    with every response token carrying its sequence's BCE ("token-mean", the released agg_loss)."""
    def bce(logp, mask, rows):
        per_seq = c2gspg_bce(sequence_confidence(logp, mask), correct[rows].to(logp.device))
        return per_seq if form == "seq-mean" else per_seq[:, None].expand(mask.shape)
    return "c2gspg_bce", 0.1, bce


REWARDS = ("rlcm", "grpo", "final-margin", "process-brier", "final-brier", "rlcr", "c2gspg")
PROBE_MODES = ("rlcm", "final-margin", "process-brier", "final-brier")  # forced answers + probe
SHAPED = ("grpo",) + PROBE_MODES  # R = r_nat + lam * a calibration term (grpo: lam = 0)
BRIER_MODES = ("process-brier", "final-brier")
MARGINS = {"zero": margin_reward, "margin-corner": corner_margin, "final-margin": final_margin}
COUNTED = ("verbal_missing",)  # logged per step as a count; other components as a mean


def calibration_key(mode):
    """The name a probe mode's calibration term is logged under: "brier" or "margin"."""
    return "brier" if mode in BRIER_MODES else "margin"


def correctness(texts, golds, grader, mode):
    """0/1 float [N]: the last box against the gold answer; rlcr: the last <answer> tag instead."""
    form = grade.answer_form(mode)
    return torch.tensor([grade.is_correct(t, g, grader, form) for t, g in zip(texts, golds)],
                        dtype=torch.float32)


def calibration_term(C, Y, valid, cfg):
    """The probe modes' calibration term [N]: the margin by --corner, or the negative Brier."""
    return (brier_reward if cfg["reward"] in BRIER_MODES else MARGINS[cfg["corner"]])(C, Y, valid)


def unanimous(correct, group_size):
    """Bool [N]: True for every trajectory of a group whose answers are all right or all wrong.
    Example: correct (1, 1, 0, 0, 0, 0), group_size 3 -> (False, False, False, True, True, True)."""
    g = torch.as_tensor(correct, dtype=torch.float32).view(-1, group_size)
    same = (g == g[:, :1]).all(dim=1, keepdim=True)
    return same.expand_as(g).reshape(-1)


def reward_and_advantages(cfg, correct, calib, texts, seq_conf, all_unanimous=None):
    """One step's rewards R [N], advantages [N] and the mode's components {name: [N] float} (logged
    per step as means, per sample as values). correct [N] 0/1; calib [N] the probe modes'
    calibration term; texts: the responses (rlcr reads its confidence there); seq_conf [N]
    c2gspg's c; all_unanimous: whether every group of the step, on every rank, is unanimous (the
    filter's fallback; None: judged on these groups)."""
    mode, G = cfg["reward"], cfg["group_size"]
    if mode == "rlcr":
        conf, missing = map(list, zip(*[verbal_confidence(t) for t in texts])) if texts else ([], [])
        conf = torch.tensor(conf, dtype=torch.float32)
        R = rlcr_reward(correct, conf)
        parts = dict(verbal_conf=conf, verbal_missing=torch.tensor(missing, dtype=torch.float32),
                     rlcr_brier=(correct - conf) ** 2)
    elif mode == "c2gspg":
        R, parts = correct.clone(), dict(seq_conf=seq_conf)
    else:
        R = total_reward(correct, calib, lam=0.0 if mode == "grpo" else cfg["lam"])
        parts = {calibration_key(mode): calib} if mode in PROBE_MODES else {}
    if cfg["drop_unanimous"]:
        same = unanimous(correct, G)
        if bool(same.all()) if all_unanimous is None else all_unanimous:
            same = torch.zeros_like(same)  # every group unanimous: no filter this step, as released
        R = R.masked_fill(same, 0.0)
        parts["dropped"] = same.float()
    adv = c2gspg_advantages(correct, seq_conf, G) if mode == "c2gspg" else group_advantages(R, G)
    return R, adv, parts


def extra_loss(cfg, correct):
    """The term a mode adds to the policy loss (grpo.update's `extra`): with --c2gspg-bce,
    C2GSPG's 0.1 * BCE(c_theta, correct); else None (the released C2GSPG run's, docs/design.md)."""
    off = cfg["reward"] != "c2gspg" or cfg["c2gspg_bce"] == "off"
    return None if off else c2gspg_loss(correct, cfg["c2gspg_bce"])


def all_unanimous(correct, cfg, device):
    """--drop-unanimous: whether every group of the step, on every rank, is unanimous (then the
    filter is off for the step, reward_and_advantages); None without the filter."""
    if not cfg["drop_unanimous"]:
        return None
    return all_sum([float((~unanimous(correct, cfg["group_size"])).sum())], device)[0] == 0


@torch.no_grad()
def scoring_pass(learner, batch, mbs, correct, cfg):
    """(seq_conf [N] C2GSPG's c, old_logp [N, T] for --ppo-epochs > 1, extra: C2GSPG's loss term)
    under the rollout weights, each None unless asked for: one update per batch is on-policy."""
    on_policy, c2gspg = cfg["ppo_epochs"] == 1, cfg["reward"] == "c2gspg"
    seq_conf, old_logp = torch.zeros(len(batch["loss_mask"])), torch.zeros(batch["loss_mask"].shape)
    for mb in mbs:
        sub, L = micro_batch(batch, mb, learner.device)
        lp, _, _ = forward_pass(learner.sampler, sub, None, cfg["temperature"], cfg["chunk_size"])
        seq_conf[mb] = sequence_confidence(lp, sub["loss_mask"]).cpu()
        old_logp[mb, :L - 1] = lp.cpu()
    return seq_conf if c2gspg else None, None if on_policy else old_logp, extra_loss(cfg, correct)
