"""One RL step as train.py runs it: `rl_step` (README.md, "The algorithm"), then the helpers through
which ranks, the scoring pass, the probe's fit and the metrics row enter it; the modes: modes.py."""
import math
import time
from collections import namedtuple
from contextlib import contextmanager

import torch

import modes
import probe as probe_lib
from baselines import sequence_confidence
from grpo import pack
from label import cuts_of, cut_mask, grid, labelled, mc_labels
from metrics import advantage_parts, ece
from data import row_prompt
from rollout import generate
from update import micro_batch, micro_batches, forward_pass, update
from harness import runlog, staticcache
from harness.parallel import RANK, WORLD, all_gather, all_sum

# What a step works on (train.py: `policy` the update trains, `sampler` the rollout samples from)
Learner = namedtuple("Learner", "policy sampler tok probe probe_opt opt sched device")
SAMPLER_GAP = ("sampler_gap", "sampler_kl_k3", "sampler_ratio_max")  # update.py's module docstring


def rl_step(step, rows, run, cfg, samples=None):
    """One RL step on this rank's share of `rows` (run: a Learner) -> all ranks' metrics row."""
    G, probed, timer = cfg["group_size"], cfg["reward"] in modes.PROBE_MODES, Timer()
    rows, seed = rows[RANK::WORLD], cfg["seed"] * 1_000_003 + step * 101  # whole groups per rank
    prompts = [row_prompt(run.tok, r, cfg["instruction"], cfg["system_prompt"]) for r in rows]
    with timer("rollout"):  # 1. rollout: G responses per prompt, each rank sampling its own
        out = generate(run.sampler.eval(), run.tok, prompts, n=G, seed=seed + RANK, scores=True,
                       max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                       top_p=cfg["top_p"], batch_size=cfg["gen_batch"], decode=cfg["decode"])
    staticcache.release(run.sampler)  # no label chunk reuses the rollout's shape: free it first
    traj, prompts = [rows[i] for i in out.prompt_index], [prompts[i] for i in out.prompt_index]
    golds = [r["answer"] for r in traj]
    # 2. grade: 1 if the last \boxed{} (rlcr: <answer>) is right, else 0, or --reward-fn's value
    correct, scored, judge = modes.grades(out.texts, golds, traj, cfg)
    # 3. a probe mode cuts each response at 25/50/75 % of its tokens and forces K answers at each
    #    cut: Y_b = the share right; h_b = the states before the cut. 4. The probe fits (h_b, Y_b)
    cuts = [cuts_of(n, cfg["budgets"]) if probed and (scored is None or scored[i]) else []
            for i, n in enumerate(out.lengths)]  # none where --reward-fn skipped the response
    labels, C, calib, signal, stats = [[] for _ in cuts], None, *torch.zeros(2, len(cuts)), {}
    if probed:
        with timer("label"):
            labels, feats = mc_labels(run.sampler, run.tok, prompts, out.ids, cuts, golds,
                                      k=cfg["k"], seed=seed + RANK + 7, close=cfg["forced_close"],
                                      batch_size=cfg["gen_batch"], decode=cfg["decode"],
                                      grader=cfg["grader"], judge=judge, features=True)
        cuts, labels, feats = labelled(cuts, labels, feats)  # less cuts with no judged answer
        with timer("probe"):  # C_b = sigmoid(probe(h_b)), the margin (modes.calibration_term_term)
            calib, signal, stats, C = probe_margin(run.probe, run.probe_opt, grid(feats),
                                                   grid(labels), cut_mask(cuts), cfg, seed)
    batch = pack(prompts, out.ids, run.tok.pad_token_id, out.logprobs)
    mbs = micro_batches([len(p) + len(r) for p, r in zip(prompts, out.ids)], cfg["micro_tokens"])
    seq_conf, old_logp = rollout_scores(run, batch, mbs, cfg, timer)  # C2GSPG's c; --ppo-epochs > 1
    # 5. R = r_nat + lam * margin; advantages: R normalised within each prompt's group (modes.py)
    R, adv, parts = modes.reward_and_advantages(cfg, correct, calib, out.texts, seq_conf,
                                                all_unanimous(run, cfg, correct, scored), scored)
    if samples is not None:
        samples += picked(step, cfg, traj, out, correct, R, parts, cuts, labels, C)
    # 6. clipped policy-gradient steps over micro-batches; one per batch is on-policy (update.py)
    lr, last = run.sched.get_last_lr()[0], cfg["ppo_epochs"] - 1  # sched steps after the last
    staticcache.release(run.sampler)  # the update needs the memory the last decode's buffers hold
    with timer("update"):  # one update per --ppo-epochs
        upds = [update(run.policy, run.opt, run.sched if e == last else None, batch, old_logp, adv,
                       mbs, cfg, run.device, modes.extra_loss(cfg, correct)) for e in range(last + 1)]
    return metrics_row(step, cfg, run, out, correct, scored, R, parts, signal, stats, upds, lr, timer)


class Timer:
    """A step's seconds per phase (t_*) and the static decode steps it captured (captures)."""
    PHASES = ("rollout", "label", "score", "probe", "update")

    def __init__(self):
        self.t, self.captured = {"t_" + p: 0.0 for p in self.PHASES}, staticcache.captures()

    @contextmanager
    def __call__(self, phase):
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t["t_" + phase] += time.perf_counter() - start


def rollout_scores(run, batch, mbs, cfg, timer):
    """(seq_conf [N] C2GSPG's c, old_logp [N, T] for --ppo-epochs > 1) under the rollout weights,
    each None unless asked for: one update per batch is on-policy (update() detaches its own)."""
    on_policy, c2gspg = cfg["ppo_epochs"] == 1, cfg["reward"] == "c2gspg"
    if on_policy and not c2gspg:
        return None, None
    seq_conf, old_logp = torch.zeros(len(batch["loss_mask"])), torch.zeros(batch["loss_mask"].shape)
    with timer("score"):
        for mb in mbs:
            sub, L = micro_batch(batch, mb, run.device)
            lp, _, _ = forward_pass(run.sampler, sub, None, cfg["temperature"], cfg["chunk_size"])
            seq_conf[mb] = sequence_confidence(lp, sub["loss_mask"]).cpu()
            old_logp[mb, :L - 1] = lp.cpu()
    return seq_conf if c2gspg else None, None if on_policy else old_logp


def all_unanimous(run, cfg, correct, scored):
    """--drop-unanimous: whether every group of the step, on every rank, is unanimous (then the
    filter is off for the step, modes.reward_and_advantages); None without the filter."""
    mixed = (~modes.unanimous(correct, cfg["group_size"], scored)).sum()
    return all_sum([float(mixed)], run.device)[0] == 0 if cfg["drop_unanimous"] else None


def all_summed(sums, device):
    """{name: this rank's sum} -> {name: the sum over every rank}, in one all-reduce."""
    return dict(zip(sums, all_sum(list(sums.values()), device)))


def picked(step, cfg, traj, out, correct, R, parts, cuts, labels, C):
    """rl_step's `samples`: cfg["log_samples"] of this rank's trajectories (samples.jsonl)."""
    C_b = [C[i, :len(c)].tolist() if C is not None else [] for i, c in enumerate(cuts)]
    return runlog.pick(step, cfg["log_samples"], problem=[r["problem"] for r in traj],
                       answer=[r["answer"] for r in traj], text=out.texts, correct=correct.tolist(),
                       reward=R.tolist(), **{k: v.tolist() for k, v in parts.items()},
                       length=out.lengths, budgets=cuts, Y_b=labels, C_b=C_b)


def metrics_row(step, cfg, run, out, correct, scored, R, parts, signal, stats, upds, lr, timer):
    """The step's row of metrics.jsonl (docs/reference.md): means over every rank's samples, the
    probe's stats, the last update's (upds: one per epoch) with the first's sampler gap, timings."""
    G, n, probed = cfg["group_size"], len(out.ids), cfg["reward"] in modes.PROBE_MODES
    shaped = cfg["reward"] in modes.SHAPED  # R = r_nat + lam * calib: its share of |A| is logged
    a_nat, a_cal = advantage_parts(correct.cpu(), R.cpu(), G) if shaped else (0.0, 0.0)
    zero_var = (R.view(-1, G).std(1) == 0).sum().item() if len(R) else 0  # groups whose R all agree
    s = all_summed(dict(
        correct=correct.sum().item(), judged=n if scored is None else scored.sum().item(),
        reward=R.sum().item(), signal=signal.sum().item(), n=n, tokens=sum(out.lengths),
        truncated=sum(f == "length" for f in out.finish), zero_var=zero_var, groups=n // G,
        entropy=sum(out.entropy_sum), captures=staticcache.captures() - timer.captured, a_nat=a_nat,
        a_cal=a_cal, **{"part " + k: v.sum().item() for k, v in parts.items()}), run.device)
    n, tokens = s["n"], s["tokens"]
    acc = s["correct"] / s["judged"] if s["judged"] else math.nan  # nan: --reward-fn scored none
    row = dict(step=step, accuracy=acc, reward=s["reward"] / n,
               **{k: s["part " + k] / (1 if k in modes.COUNTED else n) for k in parts},
               signal_frac=s["signal"] / n if probed else 0.0, **stats,
               zero_var_frac=s["zero_var"] / max(s["groups"], 1), len_mean=tokens / n,
               len_max=max(all_gather(max(out.lengths, default=0))), trunc_frac=s["truncated"] / n,
               **{k: v for k, v in upds[-1].items() if k not in SAMPLER_GAP},
               **{k: upds[0][k] for k in SAMPLER_GAP}, entropy=s["entropy"] / max(tokens, 1), lr=lr,
               captures=int(s["captures"]), **timer.t)
    row["tok_per_s"] = tokens / max(row["t_rollout"], 1e-9)
    if shaped:  # the share of sum |A| the calibration term sets (metrics.advantage_parts)
        row["calib_adv_share"] = s["a_cal"] / max(s["a_nat"] + s["a_cal"], 1e-12)
    row["peak_mem"] = peak_memory(run.device)
    return row


def probe_margin(probe, probe_opt, feats, Y, valid, cfg, seed):
    """Fit the probe on the (feature, Y_b) pairs of every rank, feats [N, B, d] and Y [N, B] where
    valid [N, B] (label.grid); score this rank's -> (calib [N] modes.calibration_term, signal [N] 1
    where a solvable and an unsolvable prefix both exist, stats, C [N, B] the confidences, 0 off
    the cuts). --probe-labels shuffled fits on labels permuted; C and calib use the real ones."""
    pooled = all_gather((feats[valid], Y[valid]))  # one fit, one seed on every rank: equal probes
    X_all, Y_all = torch.cat([x for x, _ in pooled]), torch.cat([y for _, y in pooled])
    fit_Y = shuffled(Y_all, seed) if cfg.get("probe_labels") == "shuffled" else Y_all
    bce = probe_lib.fit(probe, probe_opt, X_all, fit_Y, passes=cfg["probe_passes"],
                        batch_size=cfg["probe_batch"], seed=seed)
    C = torch.zeros(Y.shape)
    C[valid] = probe_lib.predict(probe, feats[valid])
    calib = modes.calibration_term(C, Y, valid, cfg)
    signal = (((Y == 1) & valid).any(1) & ((Y == 0) & valid).any(1)).float()
    C_all, some = probe_lib.predict(probe, X_all), len(Y_all) > 0
    # no labelled prefix (--reward-fn skipped everything): no fit, its numbers are nan
    stats = dict(probe_bce=bce if some else math.nan,
                 probe_ece=ece(C_all.numpy(), Y_all.numpy()) if some else math.nan,
                 label_mean=Y_all.mean().item() if some else 0.0,
                 label_mixed=((Y_all > 0) & (Y_all < 1)).float().mean().item() if some else 0.0,
                 prefixes=len(Y_all))
    return calib, signal, stats, C


def shuffled(Y, seed):
    """Y [P] permuted by a permutation drawn from `seed` alone (the run's seed and step: the same on
    every rank and after a resume; torch's global RNG left alone): [1, 0, .5] -> e.g. [0, .5, 1].
    The probe can then learn the labels' base rate, but not what a prefix says about its label."""
    return Y[torch.randperm(len(Y), generator=torch.Generator().manual_seed(seed))]


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)
