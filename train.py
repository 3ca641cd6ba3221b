"""RLCM: GRPO with a confidence-margin reward read off the policy's hidden states.

    python train.py                                        # the offline toy world, CPU, minutes
    python train.py --nproc 2                              # the same on two CPU processes (gloo)
    python train.py --model deepseek-r1-distill-qwen-7b    # one worker per GPU of this node (FSDP2)
    python train.py --model deepseek-r1-distill-qwen-7b --plan --gpus 8 --gpu-mem 80   # memory plan
    python train.py --model deepseek-r1-distill-qwen-7b --offload   # 1-2 GPUs: state in host memory
    torchrun --nnodes 2 --nproc_per_node 8 ... train.py --model ...  # several nodes: torchrun's ranks
    python train.py --resume runs/toy                      # continue a run, or start it if absent
    python train.py --report-to wandb                      # mirror the metrics to wandb (or trackio)

One step: rl_step below (README.md, "The algorithm"; docs/design.md, "One RL step"); the rest of this
file runs the steps. Kept from GRPO: group-normalised advantages, the clipped ratio, token-mean
aggregation; dropped: the KL penalty (as released). The probe sends no gradient into the policy."""
import math
import os
import random
import signal
import sys
import time
from collections import namedtuple
from contextlib import contextmanager

import numpy as np
import torch
from tqdm import tqdm

import baselines
import config
import data
import probe as probe_lib
from baselines import PROBE_MODES
from grade import answer_form, is_correct
from grpo import group_advantages, micro_batches, pack, token_logprobs, update
from label import cut_mask, cuts_of, grid, mc_labels
from metrics import advantage_parts, ece, heldout_probe
from reward import margin_reward, total_reward
from rollout import generate
from harness import checkpoint as ckpt_lib, lora as lora_lib, plan, runlog, staticcache, verifier
from harness.checkpoint import Preempted, RunFolder, exit_codes
from harness.files import UserError
from harness.parallel import (MASTER, RANK, WORLD, all_gather, all_sum, full_state, launch,
                              leave, refresh_sampler, setup, worker_count, wrap)

# What a step works on: `policy` the update trains, `sampler` the rollout samples from (run below)
Learner = namedtuple("Learner", "policy sampler tok probe probe_opt opt sched device")
SAMPLER_GAP = ("sampler_gap", "sampler_kl_k3", "sampler_ratio_max")  # grpo.update's


def rl_step(step, rows, prompts, learner, cfg, timer=None):
    """One RL step on this rank's rows and their prompts (token ids) -> what it computed, a dict."""
    G, seed, timer = cfg["group_size"], cfg["seed"] * 1_000_003 + step * 101, timer or Timer()
    with timer("rollout"):  # 1. rollout: G responses per prompt; each rank samples its own
        out = generate(learner.sampler.eval(), learner.tok, prompts, n=G, seed=seed + RANK, scores=True,
                       max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                       top_p=cfg["top_p"], batch_size=cfg["gen_batch"], decode=cfg["decode"])
    prompts, rows = [prompts[i] for i in out.prompt_index], [rows[i] for i in out.prompt_index]
    golds = [r["answer"] for r in rows]
    # 2. grade: 1 if the response's last \boxed{} (rlcr: <answer>) holds the gold answer, else 0
    form = answer_form(cfg["reward"])
    correct = torch.tensor([float(is_correct(t, g, cfg["grader"], form)) for t, g in zip(out.texts, golds)])
    # 3. cut each response at 25/50/75 % of its tokens (grpo, rlcr, c2gspg: nowhere)
    cuts = [cuts_of(n, cfg["budgets"]) if cfg["reward"] in PROBE_MODES else [] for n in out.lengths]
    with timer("label"):  # force K answers after each cut: Y_b the share right, h_b the states before
        Y_b, h_b = mc_labels(learner.sampler, learner.tok, prompts, out.ids, cuts, golds, k=cfg["k"],
                             seed=seed + RANK + 7, close=cfg["forced_close"], batch_size=cfg["gen_batch"],
                             decode=cfg["decode"], grader=cfg["grader"], features=True)
    Y, h, valid = grid(Y_b), grid(h_b), cut_mask(cuts)  # [N, B], [N, B, d], [N, B]: zero-padded
    with timer("probe"):  # 4. fit the probe on every rank's (h_b, Y_b); C_b = sigmoid(probe(h_b))
        fitted = fit_probe(learner.probe, learner.probe_opt, h[valid], Y[valid], cfg, seed)
        C = torch.zeros(Y.shape).index_put((valid,), probe_lib.predict(learner.probe, h[valid]))
    # 5. R = r_nat + lam * margin; advantages: R normalised within each prompt's group of G
    margin = margin_reward(C, Y, valid)
    R = total_reward(correct, margin, lam=cfg["lam"])
    adv = group_advantages(R, G)
    parts = dict(margin=margin)  # R's terms, logged (the other modes log theirs)
    batch = pack(prompts, out.ids, learner.tok.pad_token_id, out.logprobs)
    mbs = micro_batches(batch["attention_mask"].sum(1).tolist(), cfg["micro_tokens"])
    old_logp = extra = None  # on-policy: the update's own log-probs, detached, are the old ones
    if (cfg["reward"], cfg["corner"], cfg["drop_unanimous"], cfg["ppo_epochs"]) != PLAIN:
        parts, R, adv, old_logp, extra = other_mode(learner, batch, mbs, out, correct, C, Y, valid,
                                                    cfg, timer)
    with timer("update"):  # 6. clipped policy-gradient steps over micro-batches, one per --ppo-epochs
        updates = [update(learner.policy, learner.opt, batch, old_logp, adv, mbs, cfg, learner.device,
                          extra) for _ in range(cfg["ppo_epochs"])]
        learner.sched.step()
    return dict(rows=rows, out=out, correct=correct, cuts=cuts, Y_b=Y_b, Y=Y, C=C,
                valid=valid, R=R, parts=parts, fitted=fitted, updates=updates)


PLAIN = ("rlcm", "zero", False, 1)  # rl_step's plain path: the paper's RLCM, on policy


def other_mode(learner, batch, mbs, out, correct, C, Y, valid, cfg, timer):
    """rl_step past the paper's RLCM (other --reward modes, --corner, --drop-unanimous, --ppo-epochs
    > 1) -> R's terms, R, the advantages, the scoring pass's log-probs and a mode's loss term."""
    seq_conf = old_logp = extra = None
    if cfg["ppo_epochs"] > 1 or cfg["reward"] == "c2gspg":  # a pass under the rollout weights
        with timer("score"):
            seq_conf, old_logp, extra = baselines.scoring_pass(learner, batch, mbs, correct, cfg)
    probed = cfg["reward"] in PROBE_MODES
    calib = baselines.calibration_term(C, Y, valid, cfg) if probed else torch.zeros(len(correct))
    unanimous = baselines.all_unanimous(correct, cfg, learner.device)
    R, adv, parts = baselines.reward_and_advantages(cfg, correct, calib, out.texts, seq_conf,
                                                    unanimous)
    return parts, R, adv, old_logp, extra


def fit_probe(probe, probe_opt, X, Y, cfg, seed):
    """Fit the probe on the (h_b, Y_b) pairs X [M, d], Y [M] of every rank (one fit, one seed on
    every rank: equal probes) -> (its BCE, X, Y pooled)."""
    if WORLD > 1:
        X, Y = (torch.cat(parts) for parts in zip(*all_gather((X, Y))))
    bce = probe_lib.fit(probe, probe_opt, X, Y, passes=cfg["probe_passes"], seed=seed)  # batches of 16
    return bce, X, Y


class Timer:
    """A step's seconds per phase (t_*)."""
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


def logged_step(step, rows, learner, cfg):
    """rl_step on this rank's share of `rows` and what the loop logs of it: (metrics row, samples)."""
    rows = rows[RANK::WORLD]  # whole groups per rank
    prompts = [data.row_prompt(learner.tok, r, cfg["instruction"], cfg["system_prompt"]) for r in rows]
    lr, timer, captured = learner.sched.get_last_lr()[0], Timer(), staticcache.captures()
    got = rl_step(step, rows, prompts, learner, cfg, timer)
    row = step_row(step, cfg, got, learner, lr, timer, staticcache.captures() - captured)
    return row, samples_of(step, cfg, got)


def samples_of(step, cfg, got):
    """4 of this rank's trajectories of a step (rl_step's `got`), spread over it: samples.jsonl."""
    out, rows, cuts = got["out"], got["rows"], got["cuts"]
    C_b = [got["C"][i, :len(c)].tolist() for i, c in enumerate(cuts)]
    return runlog.pick(step, 4, problem=[r["problem"] for r in rows], answer=[r["answer"] for r in rows],
                       text=out.texts, correct=got["correct"].tolist(), reward=got["R"].tolist(),
                       **{k: v.tolist() for k, v in got["parts"].items()}, length=out.lengths,
                       cuts=cuts, Y_b=got["Y_b"], C_b=C_b)


def step_row(step, cfg, got, learner, lr, timer, captures):
    """The step's row of metrics.jsonl (docs/reference.md): means over every rank's samples, the
    probe's stats, the last update's (one per epoch) with the first's sampler gap, timings."""
    G, out, correct, R = cfg["group_size"], got["out"], got["correct"], got["R"]
    n, probed, parts, upds = len(out.ids), cfg["reward"] in PROBE_MODES, got["parts"], got["updates"]
    shaped = cfg["reward"] in baselines.SHAPED  # R = r_nat + lam * calib: its share of |A| is logged
    a_nat, a_cal = advantage_parts(correct.cpu(), R.cpu(), G) if shaped else (0.0, 0.0)
    zero_var = (R.view(-1, G).std(1) == 0).sum().item() if len(R) else 0  # groups whose R all agree
    Y, valid = got["Y"], got["valid"]  # signal: a solvable and an unsolvable cut in one response
    signal = (((Y == 1) & valid).any(1) & ((Y == 0) & valid).any(1)).float()
    mine = dict(  # this rank's sums, summed over every rank in one all-reduce
        correct=correct.sum().item(), reward=R.sum().item(), signal=signal.sum().item(), n=n,
        tokens=sum(out.lengths), truncated=sum(f == "length" for f in out.finish),
        zero_var=zero_var, groups=n // G, entropy=sum(out.entropy_sum), captures=captures,
        a_nat=a_nat, a_cal=a_cal, **{"part " + k: v.sum().item() for k, v in parts.items()})
    s = dict(zip(mine, all_sum(list(mine.values()), learner.device)))
    n, tokens = s["n"], s["tokens"]
    row = dict(step=step, accuracy=s["correct"] / n, reward=s["reward"] / n,
               **{k: s["part " + k] / (1 if k in baselines.COUNTED else n) for k in parts},
               signal_frac=s["signal"] / n if probed else 0.0, **(probe_metrics(learner, got) if probed else {}),
               zero_var_frac=s["zero_var"] / max(s["groups"], 1), len_mean=tokens / n,
               len_max=max(all_gather(max(out.lengths, default=0))), trunc_frac=s["truncated"] / n,
               **{k: v for k, v in upds[-1].items() if k not in SAMPLER_GAP},
               **{k: upds[0][k] for k in SAMPLER_GAP}, entropy=s["entropy"] / max(tokens, 1), lr=lr,
               captures=int(s["captures"]), **timer.t)
    row["tok_per_s"] = tokens / max(row["t_rollout"], 1e-9)
    if shaped:  # the share of sum |A| the calibration term sets (metrics.advantage_parts)
        row["calib_adv_share"] = s["a_cal"] / max(s["a_nat"] + s["a_cal"], 1e-12)
    row["peak_mem"] = peak_memory(learner.device)
    return row


def probe_metrics(learner, got):
    """The probe's numbers of a step, over every rank's pairs; nan (its fit) where none was labelled."""
    bce, X_all, Y_all = got["fitted"]
    if not len(Y_all):  # no labelled prefix (responses too short to cut): no fit
        return dict(probe_bce=math.nan, probe_ece=math.nan, label_mean=0.0, label_mixed=0.0, prefixes=0)
    C_all = probe_lib.predict(learner.probe, X_all)
    return dict(probe_bce=bce, probe_ece=ece(C_all.numpy(), Y_all.numpy()), label_mean=Y_all.mean().item(),
                label_mixed=((Y_all > 0) & (Y_all < 1)).float().mean().item(), prefixes=len(Y_all))


@torch.no_grad()
def held_out_accuracy(sampler, tok, rows, cfg, device, probe=None, probe_stats=None):
    """The held-out check: accuracy on `rows`, the same problems and seed (T 0.6) each time; into a
    `probe_stats` dict, the probe on the first 32 trajectories' prefixes, labelled."""
    mine = rows[RANK::WORLD]
    prompts = [data.row_prompt(tok, r, cfg["instruction"], cfg["system_prompt"]) for r in mine]
    hits, trajs = 0, []
    if prompts:
        out = generate(sampler, tok, prompts, max_new_tokens=cfg["max_new_tokens"], temperature=0.6,
                       seed=cfg["seed"] + 12345 + RANK, batch_size=cfg["gen_batch"],
                       decode=cfg["decode"])
        staticcache.release(sampler)  # as in a step: free the rollout's shape before the labels
        golds = [r["answer"] for r in mine]
        grader = cfg["grader"] if ":" in cfg["grader"] else "math"   # --grader FILE.py:FN: yours
        hits = baselines.correctness(out.texts, golds, grader, cfg["reward"]).sum().item()
        if probe_stats is not None:
            m = len(rows[:32][RANK::WORLD])
            trajs = probe_calibration(sampler, tok, probe, prompts[:m], out, mine[:m], cfg,
                                      seed=cfg["seed"] + 54321 + RANK, grader=grader)
            staticcache.release(sampler)  # nor the next step's rollout prefill on the labels'
    if probe_stats is not None:
        trajs = [t for part in all_gather(trajs) for t in part]
        probe_stats.update(heldout_probe(trajs, cfg["k"]), trajectories=trajs)
    hits, n = all_sum([hits, len(mine)], device)
    return hits / n if n else math.nan


@torch.no_grad()
def probe_calibration(model, tok, prb, prompts, out, rows, cfg, seed, grader="math"):
    """Label and score the trajectories `out` (a rollout.Samples, one per prompt) of `rows`: a dict
    per trajectory (problem, answer, text clipped, correct, cuts, Y_b, C_b, margin or brier)."""
    n = len(prompts)
    cuts = [cuts_of(len(ids), cfg["budgets"]) for ids in out.ids[:n]]
    labels, feats = mc_labels(model, tok, prompts, out.ids[:n], cuts, [r["answer"] for r in rows],
                              k=cfg["k"], close=cfg["forced_close"], batch_size=cfg["gen_batch"],
                              seed=seed, grader=cfg["grader"], decode=cfg["decode"], features=True)
    Y, feats, valid = grid(labels), grid(feats), cut_mask(cuts)
    C = torch.zeros(Y.shape)
    if valid.any():
        C[valid] = probe_lib.predict(prb, feats[valid]).cpu()
    calib = baselines.calibration_term(C, Y, valid, cfg)   # the margin, or the negative Brier
    key = baselines.calibration_key(cfg["reward"])
    return [dict(problem=runlog.clip(r["problem"]), answer=r["answer"], text=runlog.clip(t),
                 correct=int(is_correct(t, r["answer"], grader)), cuts=cs, Y_b=ys,
                 C_b=[round(c, 6) for c in C[i, :len(cs)].tolist()], **{key: calib[i].item()})
            for i, (r, t, cs, ys) in enumerate(zip(rows, out.texts, cuts, labels))]


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)


def print0(*a):
    if MASTER:
        tqdm.write(" ".join(str(x) for x in a))


def load_policy(cfg, device, ckpt=None):
    """The policy (from checkpoint `ckpt` when resuming) + tokenizer. Full fine-tuning: fp32 weights
    (bf16 compute comes from autocast / FSDP mixed precision). --lora-rank: the base with an fp32
    adapter (harness/lora.py); on one GPU the frozen base is bf16 (it samples from a merged bf16 copy)."""
    lora = cfg["lora_rank"] > 0
    dtype = torch.bfloat16 if lora and device.type == "cuda" and WORLD == 1 and not cfg["offload"] else torch.float32
    base = lora_lib.base_of(ckpt) if lora and ckpt else ckpt or cfg["model"]  # LoRA: ckpt's base
    model, tok = ckpt_lib.load_model(base, dtype, cfg["trust_remote_code"])
    if lora:
        model = ckpt_lib.with_adapter(model, cfg, ckpt)
    model.config.use_cache = False
    if cfg["grad_ckpt"]:
        checkpoint_activations(model)
    return model.to(device), tok


def warmup_factor(s, warmup, from_zero):
    """The lr's factor at update s (0, 1, ...): a linear warm-up to 1 over `warmup` updates, from
    s / warmup with from_zero (verl's: the first update at lr 0), else (s + 1) / warmup."""
    return 1.0 if s >= warmup else (s + (0 if from_zero else 1)) / warmup


def checkpoint_activations(model):
    """Recompute each decoder layer in the backward pass (non-reentrant, works under FSDP2)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def new_probe(cfg, dim):
    """A fresh probe (hidden None: d // 4, 0: linear) and its optimizer, the same on every rank:
    loading moves torch's RNG differently per rank (peft's LoRA init), and the probe's init and its
    fit's dropout draw from it, so it is reseeded from the run's seed (a run without LoRA: as it was)."""
    torch.manual_seed(cfg["seed"])
    probe = probe_lib.Probe(dim, cfg["probe_hidden"])
    return probe, probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])


def next_rows(rows, cursor, count, seed):
    """`count` training rows from an endless, per-epoch shuffled stream; returns (rows, cursor)."""
    at = [divmod(c, len(rows)) for c in range(cursor, cursor + count)]  # (epoch, index in it)
    orders = {e: np.random.default_rng(seed + e).permutation(len(rows)) for e in {e for e, _ in at}}
    return [rows[orders[e][i]] for e, i in at], cursor + count


STOP = []  # SIGTERM or SIGUSR1 (a scheduler's notice): the run stops after the step, saved


def run(cfg, argv=()):
    STOP.clear()
    if cfg["steps"] == 0:
        return print0("--steps 0: nothing to train; nothing was loaded or written")
    device = setup(cfg["offload"])
    if device.type == "cpu":   # what runs on a CPU here (the toy, a small local model) is too small
        torch.set_num_threads(1)  # to gain from threads: they only contend (a step 10x slower)
    folder = RunFolder(cfg, print0, data.digest)  # the lock, and the checkpoint to resume from
    if folder.done:
        return
    verifier.start()   # the grader's sympy import overlaps the model's load, outside the step timers
    ckpt, instruction = folder.ckpt, cfg["instruction"]
    rows = data.load_rows(cfg["data"], split="train" if cfg["data"] == "toy" else None)
    eval_rows = data.load_rows(cfg["eval_data"], split="test" if cfg["eval_data"] == "toy" else None,
                               limit=cfg["eval_n"]) if cfg["eval_n"] else []
    torch.manual_seed(cfg["seed"]), np.random.seed(cfg["seed"]), random.seed(cfg["seed"])

    # `policy` the update trains (FSDP2-sharded on several ranks), `sampler` the rollout samples from
    # (the same model on one CPU process, a bf16 copy on a GPU), `model` the module (save_pretrained)
    if torch.distributed.is_initialized():  # rank 0 reads the weights, the others get their shards
        adapt = (lambda m, meta: ckpt_lib.with_adapter(m, cfg, ckpt, fresh=meta)) if cfg["lora_rank"] else None
        base = lora_lib.base_of(ckpt) if adapt and ckpt else ckpt or cfg["model"]
        policy, sampler, model, tok = ckpt_lib.load_sharded(
            base, device, token_logprobs, cfg["offload"], cfg["trust_remote_code"],
            checkpoint_activations if cfg["grad_ckpt"] else None, adapt)
    else:
        model, tok = load_policy(cfg, device, ckpt)
        policy, sampler = wrap(model, device, token_logprobs)
    if cfg["max_prompt_tokens"]:
        rows, dropped = data.drop_long_prompts(rows, tok, cfg["max_prompt_tokens"], instruction)
        print0(f"training set: {len(rows)} problems, {dropped} dropped (prompt over {cfg['max_prompt_tokens']} tokens)")
        if not rows:
            raise UserError(f"every training prompt is over --max-prompt-tokens {cfg['max_prompt_tokens']}: raise it")
    data.check_context(tok, rows, instruction, getattr(model.config, "max_position_embeddings", None),
                       cfg["max_new_tokens"], cfg["data"], say=print0, system=cfg["system_prompt"])
    folder.lock()
    # under --lora-rank only the adapter requires gradients: AdamW holds state for it alone
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg["lr"],
                            weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, cfg["warmup"], cfg["warmup_from_zero"]))
    probe, probe_opt = new_probe(cfg, model.config.hidden_size)
    step, cursor = 0, 0
    if ckpt:
        probe, probe_opt, step, cursor = folder.restore(cfg, policy, opt, sched, probe_lib.restore)
        for g in opt.param_groups:   # the restored state's decay gives way to the config's, like --lr
            g["weight_decay"] = cfg["weight_decay"]
    else:
        folder.start(dict(cfg, provenance=runlog.provenance(["train.py", *argv], device, WORLD)))
    tracked = MASTER and cfg["report_to"] != "none"   # wandb or trackio: rank 0 mirrors the logs
    tracker = runlog.Tracker(cfg["report_to"], folder.out, cfg) if tracked else None
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: STOP.append(signal.Signals(signum).name))

    def log(row, samples=()):  # a metrics row, and the step's samples
        if MASTER:
            runlog.append_jsonl(folder.metrics, [row])
            runlog.append_jsonl(folder.samples, samples)
            if tracker:
                tracker.log([row])

    def held_out(at):
        if not eval_rows:  # --eval-n 0
            return None
        t = time.perf_counter()
        probe_stats = {} if cfg["reward"] in baselines.PROBE_MODES else None
        acc = held_out_accuracy(sampler, tok, eval_rows, cfg, device, probe, probe_stats)
        trajs = probe_stats.pop("trajectories") if probe_stats else []
        log(dict(step=at, eval=True, eval_accuracy=acc, eval_n=len(eval_rows), eval_data=cfg["eval_data"],
                 **(probe_stats or {}), t_eval=time.perf_counter() - t))
        said = (probe_stats or {}).get("eval_probe_prefixes") and (
            "; probe on {eval_probe_prefixes} held-out prefixes: BCE {eval_probe_bce:.3f}, "
            "ECE {eval_probe_ece:.3f}, AUROC {eval_probe_auroc:.3f}".format(**probe_stats))
        print0(f"step {at}: held-out accuracy {acc:.3f} on {len(eval_rows)} problems{said or ''}")
        if MASTER:
            runlog.append_jsonl(folder.heldout, [dict(step=at, **t) for t in trajs])
            runlog.plot_curves(folder.out)
        return acc

    def save(at):
        model_sd, opt_sd = full_state(policy, opt)
        folder.save(at, model, model_sd, tok, lambda p: probe_lib.save(p, probe, probe_opt), dict(
            step=at, cursor=cursor, optimizer=opt_sd, scheduler=sched.state_dict()), keep=cfg["keep"])
        if MASTER:
            runlog.plot_curves(folder.out)

    # resumed: the start's accuracy from the log, and whether it was of another held-out set
    first_acc, other_set = (held_out(0), False) if step == 0 else folder.first_accuracy(cfg, len(eval_rows))
    final_acc = first_acc
    learner = Learner(policy, sampler, tok, probe, probe_opt, opt, sched, device)
    bar = tqdm(range(step + 1, cfg["steps"] + 1), initial=step, total=cfg["steps"], disable=not MASTER,
               desc=cfg["reward"])
    for step in bar:
        batch_rows, cursor = next_rows(rows, cursor, cfg["prompts_per_step"], cfg["seed"])
        row, samples = logged_step(step, batch_rows, learner, cfg)
        refresh_sampler(sampler, policy)
        log(row, samples)
        bar.set_postfix(acc=f"{row['accuracy']:.2f}", R=f"{row['reward']:+.2f}",
                        margin=f"{row.get('margin', 0.0):+.3f}", sig=f"{row['signal_frac']:.2f}",
                        roll=f"{row['t_rollout']:.1f}s", label=f"{row['t_label']:.1f}s")
        last = step == cfg["steps"]
        if last or (cfg["eval_every"] and step % cfg["eval_every"] == 0):
            final_acc = held_out(step)
        saved = last or (cfg["save_every"] and step % cfg["save_every"] == 0)
        if saved:
            save(step)
        if not last and all_sum([len(STOP)], device)[0]:   # every rank stops at the same step
            if not saved:
                save(step)
            bar.close()
            by = (STOP or ["a signal to another rank"])[0]
            raise Preempted(f"stopped by {by} after step {step}, saved: "
                            f"{ckpt_lib.latest_checkpoint(folder.out)}; continue with: python train.py --resume "
                            f"{folder.out}" + (" --trust-remote-code" if cfg["trust_remote_code"] else ""))
    if tracker:
        tracker.finish()
    if MASTER:
        print0(f"\nrun: {folder.out}  (latest checkpoint: {ckpt_lib.latest_checkpoint(folder.out)})")
        if first_acc is not None and final_acc is not None:
            other = " (two different held-out sets: --eval-n or --eval-data changed on resume)"
            print0(f"held-out accuracy: {first_acc:.3f} at the start -> {final_acc:.3f} at step "
                   f"{step}" + (other if other_set else ""))
        bench = " --benchmarks " + ",".join(data.TOY_BENCHMARKS) if cfg["eval_data"] == "toy" else ""
        print0(f"curves: {os.path.join(folder.out, 'curves.png')}")   # drawn by the last step's save
        print0(f"next: python evaluate.py --model {folder.out}{bench}")


def main(argv=None):
    with exit_codes() as state:  # exit 2 / 3 / 130, the lock released: harness/checkpoint.py
        cfg = state["cfg"] = config.resolve_args(argv)
        if cfg["plan"]:
            plan.check(cfg, show=True, probed=cfg["reward"] in baselines.PROBE_MODES)
            return
        if not cfg["resume"]:
            ckpt_lib.check_available(cfg["model"])  # a missing model is reported before anything is read
        plan.check(cfg, probed=cfg["reward"] in baselines.PROBE_MODES)  # an impossible run stops here
        workers = worker_count(cfg)
        config.check_world(cfg, max(workers, WORLD))  # here, or in each worker under torchrun
        if workers <= 1:  # one process, or a worker already (0)
            return run(cfg, sys.argv[1:] if argv is None else argv)
        if not cfg["resume"]:
            ckpt_lib.fetch(cfg["model"])  # before the workers start: rank 0 would download in the group
        code = launch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv, workers)
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
    leave()  # a worker of a process group exits here without the interpreter's finalization
