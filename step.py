"""One RL step, twice. `rlcm_step` is the whole RLCM step on one screen, to read: one process, one
update per batch, built from the functions `rl_step` calls. `rl_step` is the step train.py runs and
logs: the same computation (tests/test_step.py holds the two equal) with ranks, micro-batches,
--ppo-epochs > 1, the baselines and ablations (modes.py), timers and the metrics row.
"""
import math
import time
from contextlib import contextmanager

import torch

import modes
import probe as probe_lib
from baselines import sequence_confidence
from grade import is_correct
from grpo import group_advantages, pack, policy_loss, token_logprobs
from label import budgets, cut_mask, grid, labelled, mc_labels
from metrics import advantage_parts, ece
from prompts import row_prompt
from reward import margin_reward, total_reward
from rollout import generate
from update import micro_batch, micro_batches, score, update
from harness import rewardfn, runlog, staticcache
from harness.parallel import RANK, WORLD, all_gather, all_sum


def rlcm_step(model, tok, probe, probe_opt, opt, rows, cfg, step):
    """One RLCM step on one process (model: a transformers causal LM that samples and trains) ->
    its metrics. The same samples, metrics and weights as rl_step with --reward rlcm, --ppo-epochs 1
    and one micro-batch; the learning-rate schedule is left to the caller."""
    G, seed = cfg["group_size"], cfg["seed"] * 1_000_003 + step * 101  # rl_step's seeds
    prompts = [row_prompt(tok, r, cfg["instruction"], cfg["system_prompt"]) for r in rows]
    # 1. rollout: G responses per prompt, each right (1) or wrong (0) by its last \boxed{}
    model.eval()
    out = generate(model, tok, prompts, n=G, max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                   top_p=cfg["top_p"], seed=seed, batch_size=cfg["gen_batch"], decode=cfg["decode"])
    prompts, golds = [prompts[i] for i in out.prompt_index], [rows[i]["answer"] for i in out.prompt_index]
    correct = torch.tensor([float(is_correct(t, g, cfg["grader"])) for t, g in zip(out.texts, golds)])
    # 2. cut each response at 25/50/75 % of its tokens, force K answers there: Y_b = share of right ones;
    #    h_b, the last layer's hidden states before each cut, come from the forced answers' prefill
    cuts = [budgets(n, cfg["budgets"]) for n in out.lengths]
    ys, hs = mc_labels(model, tok, prompts, out.ids, cuts, golds, k=cfg["k"], close=cfg["forced_close"],
                       seed=seed + 7, batch_size=cfg["gen_batch"], grader=cfg["grader"], decode=cfg["decode"],
                       features=True)
    Y, h, valid = grid(ys), grid(hs), cut_mask(cuts)  # [N, B(, d)], B: most cuts
    # 3. fit the probe on this batch's (h_b, Y_b), then read C_b = sigmoid(probe(h_b))
    probe_lib.fit(probe, probe_opt, h[valid], Y[valid], passes=cfg["probe_passes"],
                  batch_size=cfg["probe_batch"], seed=seed)
    C = torch.zeros(Y.shape)
    C[valid] = probe_lib.predict(probe, h[valid])
    # 4. R = r_nat + lam * margin (mean C_b where Y_b = 1 minus mean C_b where Y_b = 0), r_nat = +-1;
    #    advantages: R normalised within each prompt's group
    margin = margin_reward(C, Y, valid)
    R = total_reward(correct, margin, lam=cfg["lam"])
    adv = group_advantages(R, G)
    # 5. one clipped policy-gradient step; on-policy, so the old log-probs are the current ones detached
    model.train()
    batch = pack(prompts, out.ids, tok.pad_token_id)
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], cfg["temperature"],
                          cfg["chunk_size"])
    loss, _ = policy_loss(logp, logp.detach(), adv, batch["loss_mask"], cfg["clip_low"], cfg["clip_high"],
                          agg=cfg["agg"], norm_const=cfg["max_new_tokens"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    return dict(accuracy=correct.mean().item(), reward=R.mean().item(), margin=margin.mean().item(),
                loss=loss.item())


SAMPLER_GAP = ("sampler_gap", "sampler_kl_k3", "sampler_ratio_max")  # update.py's module docstring


class Timer:
    PHASES = ("rollout", "label", "score", "probe", "update")

    def __init__(self):
        self.t = {"t_" + p: 0.0 for p in self.PHASES}

    @contextmanager
    def __call__(self, phase):
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t["t_" + phase] += time.perf_counter() - start


def rl_step(step, batch_rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg, device,
            instruction, samples=None):
    """One RL step; returns its metrics row. A `samples` list receives cfg["log_samples"] of this
    rank's trajectories (runlog.pick rows)."""
    timer, G, mode = Timer(), cfg["group_size"], cfg["reward"]
    probed = mode in modes.PROBE_MODES  # forced-answer labels and the probe (modes.py)
    rows = batch_rows[RANK::WORLD]  # whole prompt groups stay on one rank
    prompts = [row_prompt(tok, r, instruction, cfg["system_prompt"]) for r in rows]
    step_seed = cfg["seed"] * 1_000_003 + step * 101
    seed = step_seed + RANK  # each rank samples its own groups
    captured = staticcache.captures()
    sampler.eval()
    with timer("rollout"):
        out = generate(sampler, tok, prompts, n=G, max_new_tokens=cfg["max_new_tokens"],
                       temperature=cfg["temperature"], top_p=cfg["top_p"], seed=seed,
                       batch_size=cfg["gen_batch"], decode=cfg["decode"], scores=True)
    staticcache.release(sampler)  # no label chunk reuses the rollout's shape: free it before their prefill
    golds = [rows[i]["answer"] for i in out.prompt_index]
    traj_prompts = [prompts[i] for i in out.prompt_index]
    fn, scored, judge = cfg["reward_fn"], None, None  # --reward-fn: the user's correctness (harness/rewardfn.py)
    if fn:
        traj_rows = [rows[i] for i in out.prompt_index]
        correct, scored = modes.judged(out.texts, golds, traj_rows, fn)
        judge = lambda answer, i: rewardfn.judge(fn, answer, golds[i], traj_rows[i])  # noqa: E731
    else:
        correct = modes.correctness(out.texts, golds, cfg["grader"], mode)
    cuts = [budgets(n, cfg["budgets"]) if probed else [] for n in out.lengths]
    if fn:  # a skipped rollout gets no forced answers and no labels
        cuts = [bs if s else [] for bs, s in zip(cuts, scored.tolist())]
    labels, feats = [[] for _ in cuts], []
    if probed:  # the labels, and the probe's features from the forced answers' prefill (label.py)
        with timer("label"):
            labels, feats = mc_labels(sampler, tok, traj_prompts, out.ids, cuts, golds, k=cfg["k"],
                                      close=cfg["forced_close"], seed=seed + 7, batch_size=cfg["gen_batch"],
                                      grader=cfg["grader"], decode=cfg["decode"], judge=judge, features=True)
        if fn:
            cuts, labels, feats = labelled(cuts, labels, feats)

    batch = pack(traj_prompts, out.ids, tok.pad_token_id, out.logprobs)
    lengths = [len(p) + len(r) for p, r in zip(traj_prompts, out.ids)]
    mbs = micro_batches(lengths, cfg["micro_tokens"])
    # One update per batch is exactly on-policy: update() uses the current log-probs, detached, as
    # the old ones. So a scoring pass under the rollout weights runs only for the old log-probs of
    # several updates per batch, or for C2GSPG's sequence confidence c.
    on_policy, c2gspg = cfg["ppo_epochs"] == 1, mode == "c2gspg"
    old_logp = None if on_policy else torch.zeros(batch["loss_mask"].shape)
    seq_conf = torch.zeros(len(out.ids)) if c2gspg else None
    if c2gspg or not on_policy:
        with timer("score"):
            for mb in mbs:
                sub, L = micro_batch(batch, mb, device)
                lp, _, _ = score(sampler, sub, None, cfg["temperature"], cfg["chunk_size"])
                if not on_policy:
                    old_logp[mb, :L - 1] = lp.cpu()
                if c2gspg:
                    seq_conf[mb] = sequence_confidence(lp, sub["loss_mask"]).cpu()

    stats, calib, signal, C = {}, torch.zeros(len(out.ids)), torch.zeros(len(out.ids)), None
    if probed:
        with timer("probe"):
            calib, signal, stats, C = probe_margin(probe, probe_opt, grid(feats), grid(labels), cut_mask(cuts),
                                                   cfg, step_seed)
    all_unanimous = None
    if cfg["drop_unanimous"]:  # the filter's fallback looks at every rank's groups
        all_unanimous = all_sum([float((~modes.unanimous(correct, G, scored)).sum())], device)[0] == 0
    R, adv, parts = modes.reward_and_advantages(cfg, correct, calib, out.texts, seq_conf, all_unanimous,
                                                scored)
    shaped = mode in modes.SHAPED   # R = r_nat + lam * calib: its calibration share is logged
    a_nat, a_cal = advantage_parts(correct.cpu(), R.cpu(), G) if shaped else (0.0, 0.0)
    if samples is not None:
        samples += runlog.pick(
            step, cfg["log_samples"], problem=[rows[i]["problem"] for i in out.prompt_index], answer=golds,
            text=out.texts, correct=correct.tolist(), reward=R.tolist(),
            **{k: v.tolist() for k, v in parts.items()}, length=out.lengths, budgets=cuts, Y_b=labels,
            C_b=[C[i, :len(c)].tolist() if probed else [] for i, c in enumerate(cuts)])

    lr = sched.get_last_lr()[0]
    gaps = []  # the sampler gap of each epoch; the first is before any optimizer step
    staticcache.release(sampler)  # the update needs the memory of the last decode's static buffers
    with timer("update"):
        for epoch in range(cfg["ppo_epochs"]):  # stats of the last epoch are logged
            last = epoch == cfg["ppo_epochs"] - 1
            upd = update(policy, opt, sched if last else None, batch, old_logp, adv, mbs, cfg,
                         device, modes.extra_loss(cfg, correct))
            gaps.append({k: upd.pop(k) for k in SAMPLER_GAP})
    local = [correct.sum().item(), len(out.ids) if scored is None else scored.sum().item(), R.sum().item(),
             signal.sum().item(), len(out.ids), sum(out.lengths), sum(f == "length" for f in out.finish),
             zero_var_groups(R, G), len(rows), sum(out.entropy_sum), staticcache.captures() - captured,
             a_nat, a_cal, *(v.sum().item() for v in parts.values())]
    acc, judged, rsum, ssum, n, lsum, trunc, zvar, ngroups, esum, caps, a_nat, a_cal, *psums = all_sum(local, device)
    row = dict(step=step, accuracy=acc / judged if judged else math.nan, reward=rsum / n,   # nan: nothing scored
               **{k: s if k in modes.COUNTED else s / n for k, s in zip(parts, psums)},
               signal_frac=ssum / n if probed else 0.0, **stats, zero_var_frac=zvar / max(ngroups, 1),
               len_mean=lsum / n, len_max=max(all_gather(max(out.lengths, default=0))),
               trunc_frac=trunc / n, **upd, **gaps[0], entropy=esum / max(lsum, 1), lr=lr,
               captures=int(caps), **timer.t)  # static decode steps captured, all ranks (staticcache.captures)
    row["tok_per_s"] = lsum / max(row["t_rollout"], 1e-9)
    if shaped:   # the share of sum |A| the calibration term sets (metrics.advantage_parts)
        row["calib_adv_share"] = a_cal / max(a_nat + a_cal, 1e-12)
    row["peak_mem"] = peak_memory(device)
    return row


def probe_margin(probe, probe_opt, feats, Y, valid, cfg, seed):
    """Fit the probe on this batch's (feature, Y_b) pairs, feats [N, B, d] and Y [N, B] where valid
    [N, B] (label.grid), then score the same prefixes with it.

    Returns (calib [N] the mode's calibration term, the margin or the negative Brier (modes.py),
    signal [N] (1 where both a solvable and an unsolvable prefix exist), stats, C [N, B] the
    probe's confidences, 0 where there is no budget). Every rank fits on the
    pooled pairs of all ranks with the same seed, so the probes stay identical without syncing weights.
    --probe-labels shuffled (a control, not the method): the fit sees the labels permuted across the
    step's cuts (shuffled), while C and the margin are still those of the real prefixes and labels.
    """
    pooled = all_gather((feats[valid], Y[valid]))
    X_all, Y_all = torch.cat([x for x, _ in pooled]), torch.cat([y for _, y in pooled])
    fit_Y = shuffled(Y_all, seed) if cfg.get("probe_labels") == "shuffled" else Y_all
    bce = probe_lib.fit(probe, probe_opt, X_all, fit_Y, passes=cfg["probe_passes"],
                        batch_size=cfg["probe_batch"], seed=seed)
    C = torch.zeros(Y.shape)
    C[valid] = probe_lib.predict(probe, feats[valid])
    calib = modes.calibration(C, Y, valid, cfg)
    signal = (((Y == 1) & valid).any(1) & ((Y == 0) & valid).any(1)).float()
    C_all = probe_lib.predict(probe, X_all)
    # no labelled prefix (a --reward-fn that skips everything): the probe was not fitted, its numbers are nan
    stats = dict(probe_bce=bce if len(Y_all) else math.nan,
                 probe_ece=ece(C_all.numpy(), Y_all.numpy()) if len(Y_all) else math.nan,
                 label_mean=Y_all.mean().item() if len(Y_all) else 0.0,
                 label_mixed=((Y_all > 0) & (Y_all < 1)).float().mean().item() if len(Y_all) else 0.0,
                 prefixes=len(Y_all))
    return calib, signal, stats, C


def shuffled(Y, seed):
    """Y [P] permuted by a permutation drawn from `seed` alone (the run's seed and step: the same on
    every rank and after a resume; torch's global RNG is left alone): [1., 0., 0.5] -> e.g. [0., 0.5, 1.].
    With it the probe can learn the labels' base rate but nothing a prefix says about its own label."""
    return Y[torch.randperm(len(Y), generator=torch.Generator().manual_seed(seed))]


def zero_var_groups(R, G):
    return (R.view(-1, G).std(1) == 0).sum().item() if len(R) else 0


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)
