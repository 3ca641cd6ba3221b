"""The held-out check during training: accuracy, with the same problems and seed at every check
(T 0.6), and the probe out of sample (eval_probe_bce, _ece, _auroc, eval_margin or eval_brier;
docs/reference.md) on the prefixes of the first --eval-probe-n trajectories, labelled as in a step.
"""
import numpy as np
import torch

import metrics
import baselines
import probe as probe_lib
from label import cuts_of, cut_mask, grid, mc_labels
from data import row_prompt
from rollout import generate
from harness import runlog, staticcache
from harness.parallel import RANK, WORLD, all_gather, all_sum


@torch.no_grad()
def held_out_accuracy(sampler, tok, rows, cfg, instruction, device, probe=None, probe_stats=None):
    """Accuracy on the held-out `rows`; with a `probe_stats` dict, the probe's
    calibration on the first eval_probe_n trajectories is added to it."""
    mine = rows[RANK::WORLD]
    prompts = [row_prompt(tok, r, instruction, cfg["system_prompt"]) for r in mine]
    hits, trajs = 0, []
    if prompts:
        out = generate(sampler, tok, prompts, max_new_tokens=cfg["max_new_tokens"], temperature=0.6,
                       seed=cfg["seed"] + 12345 + RANK, batch_size=cfg["gen_batch"],
                       decode=cfg["decode"])
        staticcache.release(sampler)  # as in a step: the labels' prefill must not sit on the rollout's shape
        golds = [r["answer"] for r in mine]
        hits = baselines.correctness(out.texts, golds, "math", cfg["reward"]).sum().item()
        if probe_stats is not None:
            m = len(rows[:cfg["eval_probe_n"]][RANK::WORLD])
            trajs = probe_calibration(sampler, tok, probe, prompts[:m], out, mine[:m], cfg,
                                      seed=cfg["seed"] + 54321 + RANK)
            staticcache.release(sampler)  # nor the next step's rollout prefill on the labels'
    if probe_stats is not None:
        trajs = [t for part in all_gather(trajs) for t in part]
        probe_stats.update(summary(trajs, cfg["k"]), trajectories=trajs)
    hits, n = all_sum([hits, len(mine)], device)
    return hits / n if n else float("nan")


@torch.no_grad()
def probe_calibration(model, tok, prb, prompts, out, rows, cfg, seed):
    """Label and score the trajectories `out` (a rollout.Samples, one per prompt) of `rows`: a dict
    per trajectory (problem, answer, text clipped, correct, budgets, Y_b, C_b, margin or brier)."""
    from grade import is_correct
    n = len(prompts)
    golds = [r["answer"] for r in rows]
    cuts = [cuts_of(len(ids), cfg["budgets"]) for ids in out.ids[:n]]
    labels, feats = mc_labels(model, tok, prompts, out.ids[:n], cuts, golds, k=cfg["k"], close=cfg["forced_close"],
                              seed=seed, batch_size=cfg["gen_batch"], grader=cfg["grader"], decode=cfg["decode"],
                              features=True)
    Y, feats, valid = grid(labels), grid(feats), cut_mask(cuts)
    C = torch.zeros(Y.shape)
    if valid.any():
        C[valid] = probe_lib.predict(prb, feats[valid]).cpu()
    calib = baselines.calibration_term(C, Y, valid, cfg)   # the margin, or the negative Brier
    key = baselines.calibration_key(cfg["reward"])
    return [dict(problem=runlog.clip(r["problem"]), answer=r["answer"], text=runlog.clip(t),
                 correct=int(is_correct(t, r["answer"])),
                 budgets=bs, Y_b=ys,
                 C_b=[round(c, 6) for c in C[i, :len(bs)].tolist()], **{key: calib[i].item()})
            for i, (r, t, bs, ys) in enumerate(zip(rows, out.texts, cuts, labels))]


def summary(trajectories, k):
    """The eval_probe_* numbers (docs/reference.md) from probe_calibration's dicts."""
    Y = np.array([y for t in trajectories for y in t["Y_b"]], dtype=np.float64)
    C = np.array([c for t in trajectories for c in t["C_b"]], dtype=np.float64)
    if Y.size == 0:
        return dict(eval_probe_prefixes=0)
    Cc = np.clip(C, 1e-7, 1 - 1e-7)
    right = np.rint(Y * k).astype(int)
    forced = np.concatenate([[1.0] * r + [0.0] * (k - r) for r in right])
    return dict(eval_probe_bce=float(-(Y * np.log(Cc) + (1 - Y) * np.log(1 - Cc)).mean()),
                eval_probe_ece=metrics.ece(C, Y), eval_probe_auroc=metrics.auroc(np.repeat(C, k), forced),
                **{f"eval_{key}": float(np.mean([t[key] for t in trajectories]))
                   for key in ("margin", "brier") if key in trajectories[0]},
                eval_probe_prefixes=int(Y.size))


def describe(stats):
    """'; probe on 24 held-out prefixes: BCE 0.338, ECE 0.053, AUROC 0.739', or '' without prefixes."""
    if not stats or not stats.get("eval_probe_prefixes"):
        return ""
    return ("; probe on {eval_probe_prefixes} held-out prefixes: BCE {eval_probe_bce:.3f}, "
            "ECE {eval_probe_ece:.3f}, AUROC {eval_probe_auroc:.3f}".format(**stats))
