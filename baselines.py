"""The paper's two baselines, each whole in one place; modes.py switches them on (--reward rlcr,
--reward c2gspg). Torch and the standard library only.

RLCR: the policy states its confidence in a final <confidence> tag (its answer in an <answer> tag);
  conf  = verbal_confidence(text): "85" -> 0.85, "0.3" -> 0.3, missing or outside [0, 100] -> 0.5
          (and counted)
  R     = correct - (correct - conf)^2   (correct 0/1)              advantages: group z-score
C2GSPG: the confidence is the policy's own sequence probability;
  c     = exp(mean_t log p(token_t)) of the response (sequence_confidence)
  R     = correct (0/1),  A = (R - mean_group R) / max(1 - c, 1e-6), c under the rollout weights
  loss  = the clipped policy loss; with --c2gspg-bce also 0.1 * BCE(c_theta_n, correct_n), c_theta
          differentiable (c2gspg_loss: the extra term update.update adds). Off by default: the
          released launcher sets the weight, but its actor drops the labels before the loss.
"""
import re

import torch

_NUMBER = re.compile(r"[-+]?\d*\.?\d+")  # released: the first such number, no exponent ("1e-3" -> 1)


def verbal_confidence(text):
    """(confidence, invalid) as the released RLCR scorer reads it (rlcr.extract_answer_and_confidence):
    the last `<confidence>(.*?)</confidence>` match (tags case-sensitive), its first number; [0, 1]
    as is, (1, 100] / 100: "0.8" -> 0.8, "85" or "85%" -> 0.85. No tag, no number, or a value below 0
    or above 100 -> (0.5, True): RL cannot earn a sure 1.0 or 0.0 by writing "150" or "-3".

    The matches are the regex's, found by str.find moving forward: linear in the text, however many
    "<confidence>" a policy repeats.
    """
    span, pos = None, 0
    while (start := text.find("<confidence>", pos)) >= 0:
        end = text.find("</confidence>", start + len("<confidence>"))
        if end < 0:
            break
        span, pos = (start + len("<confidence>"), end), end + len("</confidence>")
    m = _NUMBER.search(text, *span) if span else None
    v = float(m.group()) if m else -1.0
    if not 0 <= v <= 100:
        return 0.5, True
    return (v if v <= 1 else v / 100), False


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
    """C2GSPG's term of the policy loss, update.update's `extra` (name, coefficient, term): 0.1 *
    BCE(c_theta, correct [N] 0/1), logged as c2gspg_bce, as the mean over sequences ("seq-mean") or
    with every response token carrying its sequence's BCE ("token-mean", the released agg_loss).
    """
    def bce(logp, mask, rows):
        per_seq = c2gspg_bce(sequence_confidence(logp, mask), correct[rows].to(logp.device))
        return per_seq if form == "seq-mean" else per_seq[:, None].expand(mask.shape)
    return "c2gspg_bce", 0.1, bce
