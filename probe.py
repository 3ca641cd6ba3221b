"""The confidence probe: a small network on the policy's hidden states that predicts the chance that
a forced answer at a prefix is right. By default the released code's MLP d -> d/4 -> 1;
--probe-hidden 0 trains the design card's linear probe d -> 1 (train.py). Fitted each RL step on
(feature, Y_b) pairs; its prediction C_b = sigmoid(probe(h_b)) feeds the margin reward. No gradient
reaches the policy from here."""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.files import UserError


class Probe(nn.Module):
    """MLP d -> hidden -> 1 (Linear, ReLU, Dropout, Linear); hidden defaults to d // 4, hidden=0 gives
    a linear probe d -> 1. forward: x [..., d] -> logits [...]."""

    def __init__(self, dim, hidden=None, dropout=0.1):
        super().__init__()
        self.dim = int(dim)
        self.hidden = self.dim // 4 if hidden is None else int(hidden)
        self.p_drop = float(dropout)
        self.net = nn.Linear(self.dim, 1) if self.hidden == 0 else nn.Sequential(
            nn.Linear(self.dim, self.hidden), nn.ReLU(), nn.Dropout(self.p_drop),
            nn.Linear(self.hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


LAST_K = 4  # positions averaged before each cut (the released avg_last_k)


def prefix_features(hidden, ends, last_k=LAST_K):
    """Mean hidden state over the last_k positions before each prefix end.
    hidden [N, L, d]; ends [N, B] long absolute exclusive ends, <= 0 padding -> feats [N, B, d]
    float32 (0 where not valid) and valid [N, B] bool (= ends > 0):
      feats[n, b] = mean(hidden[n, p] for p in max(e - last_k, 0) .. e - 1),  e = ends[n, b]"""
    n, L, d = hidden.shape
    ends = torch.as_tensor(ends, dtype=torch.long, device=hidden.device)
    if (ends > L).any():
        raise ValueError(f"a prefix end exceeds the sequence length {L}")
    valid = ends > 0
    pos = ends.unsqueeze(-1) - last_k + torch.arange(last_k, device=hidden.device)   # [N, B, k]
    use = (pos >= 0) & valid.unsqueeze(-1)
    rows = torch.arange(n, device=hidden.device).view(n, 1, 1)
    gathered = hidden[rows, pos.clamp(0, L - 1)].float()                             # [N, B, k, d]
    w = use.float().unsqueeze(-1)
    feats = (gathered * w).sum(2) / w.sum(2).clamp(min=1)
    return feats, valid


@contextmanager
def last_layer(model, fn):
    """Inside the block, fn(hidden) sees the last decoder layer's output [R, L, d] (before the final
    norm) of every forward of `model` (a transformers causal LM): the states the features read."""
    def hook(module, args, output):  # returns None: the output goes on unchanged
        fn(output[0] if isinstance(output, tuple) else output)
    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def make_optimizer(probe, lr=1e-3, weight_decay=0.01):
    """AdamW over the probe's parameters (lr 1e-3, weight decay 0.01, as in the released code)."""
    return torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)


def fit(probe, opt, feats, targets, passes=16, batch_size=16, seed=0):
    """BCE-with-logits on soft targets, feats [M, d], targets [M] in [0, 1], `passes` passes in an
    order seeded by `seed`, dropout on -> the last pass's mean BCE per sample (nan if M == 0)."""
    dev = next(probe.parameters()).device
    feats, targets = (torch.as_tensor(x).float().to(dev) for x in (feats, targets))
    if ((targets < 0) | (targets > 1)).any() or targets.isnan().any():
        raise ValueError("probe targets must lie in [0, 1]")
    m = feats.shape[0]
    gen, total = torch.Generator().manual_seed(seed), 0.0
    probe.train()
    for _ in range(passes):
        order, total = torch.randperm(m, generator=gen).to(dev), 0.0
        for s in range(0, m, batch_size):
            idx = order[s:s + batch_size]
            loss = F.binary_cross_entropy_with_logits(probe(feats[idx]), targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * idx.numel()
    return total / m if m else float("nan")


@torch.no_grad()
def predict(probe, feats):
    """Probabilities sigmoid(probe(feats)): feats [M, d] -> [M] in (0, 1); eval mode, no grad.
    FloatingPointError for a NaN or inf feature or probability: none reaches a reward or a file."""
    probe.eval()
    feats = torch.as_tensor(feats).float().to(next(probe.parameters()).device)
    out = torch.sigmoid(probe(feats))
    if not (torch.isfinite(feats).all() and torch.isfinite(out).all()):
        raise FloatingPointError("the probe's features or confidences are NaN or inf: the model's "
                                 "hidden states or the probe's weights hold NaN or inf")
    return out


class NotAProbe(UserError):
    """A file that is not a probe saved by `save` (one line, like every UserError)."""


def save(path, probe, opt=None, **extra):
    """Write {dim, hidden, dropout, state_dict, optimizer, **extra} to `path` (or a binary file)."""
    torch.save({"dim": probe.dim, "hidden": probe.hidden, "dropout": probe.p_drop,
                "state_dict": {k: v.detach().cpu() for k, v in probe.state_dict().items()},
                "optimizer": opt.state_dict() if opt is not None else None, **extra}, path)


def shapes(dim, hidden):
    """The state dict of Probe(dim, hidden), as {name: shape}, without building it."""
    if hidden == 0:
        return {"net.weight": (1, dim), "net.bias": (1,)}
    return {"net.0.weight": (hidden, dim), "net.0.bias": (hidden,), "net.3.weight": (1, hidden), "net.3.bias": (1,)}


def damage(blob):
    """What makes a loaded blob not a probe saved by `save`, else None. Sizes are checked against
    the tensors it holds: a claimed dim of 20000 is refused before anything so big is allocated."""
    if not isinstance(blob, dict):
        return f"a {type(blob).__name__}, not a dict"
    dim, hidden, p, sd = (blob.get(k) for k in ("dim", "hidden", "dropout", "state_dict"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, hidden)) or dim < 1 or hidden < 0:
        return f"dim {dim!r} and hidden {hidden!r} are not sizes"
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        return f"dropout {p!r} is not a probability"
    want = shapes(dim, hidden)
    if not isinstance(sd, dict) or sorted(sd) != sorted(want) or any(
            not isinstance(sd[k], torch.Tensor) or tuple(sd[k].shape) != want[k] for k in want):
        return f"its weights are not those of a probe of dim {dim}, hidden {hidden}"
    opt = blob.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and {"state", "param_groups"} <= opt.keys()):
        return "its optimizer state is not one"
    return None


def load(path):
    """A saved probe (on CPU) -> (probe, optimizer state or None); NotAProbe for a file that is not
    one (`damage`), FloatingPointError for NaN or inf weights."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if why := damage(blob):
        raise NotAProbe(f"{path} is not a probe saved by this code ({why}): use an earlier checkpoint")
    if not all(torch.isfinite(t).all() for t in blob["state_dict"].values()):
        raise FloatingPointError(f"{path} holds NaN or inf probe weights")
    probe = Probe(blob["dim"], blob["hidden"], blob["dropout"])
    probe.load_state_dict(blob["state_dict"])
    return probe, blob["optimizer"]


def restore(path, lr):
    """A saved probe and its optimizer (make_optimizer at rate lr, then the saved state): a resume."""
    probe, state = load(path)
    opt = make_optimizer(probe, lr=lr)
    opt.load_state_dict(state)
    return probe, opt
