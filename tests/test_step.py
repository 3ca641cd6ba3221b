"""step.rlcm_step, the one-screen RLCM step, against step.rl_step, the step train.py runs: the same
toy batch and seed must give the same metrics and the same weights after the step."""
import torch

from harness import config
import data
import probe as probe_lib
import step
import train
from harness.parallel import wrap

CPU = torch.device("cpu")
# --lam: not total_reward's default 0.1, so a step that ignores cfg["lam"] differs;
# --grad-clip: the step's gradient norm here is about 0.6, so a step without the clip differs.
# The toy's --micro-tokens 8192 holds these 16 responses in one micro-batch, as rlcm_step takes them.
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--lam", "0.5",
         "--grad-clip", "0.1"]


def start(cfg):
    """The toy base policy, a fresh probe and both optimisers, built as train.run builds them."""
    model, tok = train.load_policy("toy", cfg, CPU)
    torch.manual_seed(cfg["seed"])  # the probe's initial weights and its dropout draw from here
    probe = probe_lib.Probe(model.config.hidden_size)
    probe_opt = probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg["warmup"], 1)))
    return model, tok, probe, probe_opt, opt, sched


def weights(*modules):
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_rlcm_step_equals_rl_step_on_a_toy_batch(tmp_path):
    cfg = config.resolve_args([*SMALL, "--out", str(tmp_path)])
    rows = data.load_rows("toy", split="train")[16:20]  # 3 of its 16 responses have margin signal

    model, tok, probe, probe_opt, opt, sched = start(cfg)
    before = weights(model, probe)
    policy, sampler = wrap(model, CPU)
    full = step.rl_step(1, rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg, CPU,
                        cfg["instruction"])
    full_weights = weights(model, probe)

    model, tok, probe, probe_opt, opt, _ = start(cfg)
    ref = step.rlcm_step(model, tok, probe, probe_opt, opt, rows, cfg, 1)

    # the batch can tell a wrong step apart: some answers right, some wrong, a margin that moves R
    assert 0 < full["accuracy"] < 1 and full["margin"] != 0 and full["signal_frac"] > 0
    # equal, not close: N = 16 responses, and dividing by 16 is exact in float32 too, so rl_step's
    # float64 sum / N and rlcm_step's float32 mean are the same number
    assert ref == {k: full[k] for k in ("accuracy", "reward", "margin", "loss")}, (ref, full)
    after = weights(model, probe)
    assert len(after) == len(full_weights)
    assert all(torch.equal(a, b) for a, b in zip(after, full_weights))  # the policy's, then the probe's
    assert not all(torch.equal(a, b) for a, b in zip(before, full_weights))  # the step moved the policy
