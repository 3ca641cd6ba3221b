"""RLCM: GRPO with a confidence-margin reward read off the policy's hidden states.

    python train.py                                        # the offline toy world, CPU, minutes
    python train.py --nproc 2                              # the same on two CPU processes (gloo)
    python train.py --model deepseek-r1-distill-qwen-7b    # one worker per GPU of this node (FSDP2)
    python train.py --model deepseek-r1-distill-qwen-7b --plan --gpus 8 --gpu-mem 80   # memory plan
    python train.py --model deepseek-r1-distill-qwen-7b --offload   # 1-2 GPUs: state in host memory
    torchrun --nnodes 2 --nproc_per_node 8 ... train.py --model ...  # several nodes: torchrun's ranks
    python train.py --resume runs/toy                      # continue a run from its last checkpoint
    python train.py --plot runs/toy                        # redraw runs/toy/curves.png

One step (DESIGN.md): rollout -> grade -> budgets -> forced answers (Monte-Carlo labels Y_b) ->
scoring forward (old log-probs + probe features) -> probe fit on this batch -> probe confidences
C_b -> margin -> R = r_nat + lam * margin -> group advantages -> one clipped policy-gradient step.

Kept from GRPO: group-normalised advantages, the clipped ratio, token-mean aggregation.
Dropped: the KL penalty (kl_coef 0, as released) and several PPO epochs (one update per batch, so
the old log-probs are the current ones detached and the ratio is exactly 1; --ppo-epochs > 1 keeps
the rollout weights' log-probs as the old ones).
The probe never sends a gradient into the policy: the margin enters only through the scalar reward.
--reward picks RLCM, a baseline (grpo, rlcr, c2gspg) or an ablation (final-margin, process-brier,
final-brier); modes.py says what each one computes.
"""
import json
import os
import random
import sys
import time
from contextlib import ExitStack, contextmanager

import numpy as np
import torch
from tqdm import tqdm

import data
import heldout
from heldout import held_out_accuracy
import launch
import modes
import plan
import probe as probe_lib
import runlog
import checkpoint as ckpt_lib
from checkpoint import UserError
import config
from config import resolve_args
from parallel import (MASTER, RANK, WORLD, all_gather, all_sum, full_state, load_optimizer, load_sharded,
                      refresh_sampler, setup, teardown, wrap)
from grpo import pack, sequence_confidence
from label import budgets, mc_labels
from metrics import ece
from rollout import generate
from score import budget_ends, score
from update import micro_batch, micro_batches, update

VOLATILE = ("t_", "tok_per_s", "peak_mem")  # metrics.jsonl fields that vary between identical runs
LOCKS = ExitStack()  # the run folder's lock, released by main() however the run ends


def print0(*a):
    if MASTER:
        tqdm.write(" ".join(str(x) for x in a))


def load_policy(name, cfg, device):
    """The policy in fp32 (bf16 compute comes from autocast / FSDP mixed precision) + tokenizer."""
    model, tok = ckpt_lib.load_model(name, torch.float32, cfg["trust_remote_code"])
    model.config.use_cache = False
    if cfg["grad_ckpt"]:
        checkpoint_activations(model)
    return model.to(device), tok


def checkpoint_activations(model):
    """Recompute each decoder layer in the backward pass (non-reentrant, works under FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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


def next_rows(rows, cursor, count, seed):
    """`count` training rows from an endless, per-epoch shuffled stream; returns (rows, cursor)."""
    out, orders = [], {}
    for c in range(cursor, cursor + count):
        epoch, i = divmod(c, len(rows))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng(seed + epoch).permutation(len(rows))
        out.append(rows[orders[epoch][i]])
    return out, cursor + count


def rl_step(step, batch_rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg, device,
            instruction, samples=None):
    """One RL step; returns its metrics row. A `samples` list receives cfg["log_samples"] of this
    rank's trajectories (runlog.pick rows)."""
    timer, G, mode = Timer(), cfg["group_size"], cfg["reward"]
    probed = mode in modes.PROBE_MODES  # forced-answer labels and the probe (modes.py)
    rows = batch_rows[RANK::WORLD]  # whole prompt groups stay on one rank
    prompts = [data.chat_prompt(tok, r["problem"], instruction, cfg["system_prompt"]) for r in rows]
    step_seed = cfg["seed"] * 1_000_003 + step * 101
    seed = step_seed + RANK  # each rank samples its own groups
    sampler.eval()
    with timer("rollout"):
        out = generate(sampler, tok, prompts, n=G, max_new_tokens=cfg["max_new_tokens"],
                       temperature=cfg["temperature"], top_p=cfg["top_p"], seed=seed,
                       batch_size=cfg["gen_batch"], decode=cfg["decode"])
    golds = [rows[i]["answer"] for i in out.prompt_index]
    traj_prompts = [prompts[i] for i in out.prompt_index]
    correct = modes.correctness(out.texts, golds, cfg["grader"], mode)
    cuts = [budgets(n, cfg["budgets"]) if probed else [] for n in out.lengths]
    labels = [[] for _ in cuts]
    if probed:
        with timer("label"):
            labels = mc_labels(sampler, tok, traj_prompts, out.ids, cuts, golds, k=cfg["k"],
                               close=cfg["forced_close"], seed=seed + 7, batch_size=cfg["gen_batch"],
                               grader=cfg["grader"], decode=cfg["decode"])

    batch = pack(traj_prompts, out.ids, tok.pad_token_id)
    ends = budget_ends(batch["prompt_lens"], cuts)
    lengths = [len(p) + len(r) for p, r in zip(traj_prompts, out.ids)]
    mbs = micro_batches(lengths, cfg["micro_tokens"])
    # One update per batch is exactly on-policy: update() uses the current log-probs, detached, as
    # the old ones, so this pass only gathers probe features (and is skipped without a probe), and
    # C2GSPG's sequence confidence c under the rollout weights.
    on_policy, c2gspg = cfg["ppo_epochs"] == 1, mode == "c2gspg"
    old_logp = None if on_policy else torch.zeros(batch["loss_mask"].shape)
    feats, seq_conf = [], torch.zeros(len(out.ids)) if c2gspg else None
    with timer("score"):
        for mb in mbs if probed or c2gspg or not on_policy else []:
            sub, L = micro_batch(batch, mb, device)
            lp, f, _ = score(sampler, sub, ends[mb], cfg["temperature"], cfg["chunk_size"],
                             logprobs=c2gspg or not on_policy)
            if not on_policy:
                old_logp[mb, :L - 1] = lp.cpu()
            if c2gspg:
                seq_conf[mb] = sequence_confidence(lp, sub["loss_mask"]).cpu()
            feats.append(f.cpu())
    feats = torch.cat(feats) if feats else torch.zeros(0)

    stats, calib, signal, C = {}, torch.zeros(len(out.ids)), torch.zeros(len(out.ids)), None
    if probed:
        with timer("probe"):
            calib, signal, stats, C = probe_margin(probe, probe_opt, feats, ends, labels, cfg, step_seed)
    R, adv, kept, parts = modes.reward_and_advantages(cfg, correct, calib, out.texts, seq_conf)
    if samples is not None:
        samples += runlog.pick(
            step, cfg["log_samples"], problem=[rows[i]["problem"] for i in out.prompt_index], answer=golds,
            text=out.texts, correct=correct.tolist(), reward=R.tolist(),
            **{k: v.tolist() for k, v in parts.items()}, length=out.lengths, budgets=cuts, Y_b=labels,
            C_b=[C[i, :len(c)].tolist() if probed else [] for i, c in enumerate(cuts)])
    # --drop-unanimous: the dropped groups' trajectories are not in the update at all
    idx = kept.nonzero().flatten().tolist()
    update_mbs = [[idx[j] for j in mb]
                  for mb in micro_batches([lengths[i] for i in idx], cfg["micro_tokens"])]

    lr = sched.get_last_lr()[0]
    with timer("update"):
        for epoch in range(cfg["ppo_epochs"]):  # stats of the last epoch are logged
            last = epoch == cfg["ppo_epochs"] - 1
            upd = update(policy, opt, sched if last else None, batch, old_logp, adv, update_mbs, cfg,
                         device, correct)
    local = [correct.sum().item(), R.sum().item(), signal.sum().item(),
             len(out.ids), sum(out.lengths), sum(f == "length" for f in out.finish),
             zero_var_groups(R, G), len(rows), *(v.sum().item() for v in parts.values())]
    acc, rsum, ssum, n, lsum, trunc, zvar, ngroups, *psums = all_sum(local, device)
    row = dict(step=step, accuracy=acc / n, reward=rsum / n,
               **{k: s if k in modes.COUNTED else s / n for k, s in zip(parts, psums)},
               signal_frac=ssum / n if probed else 0.0, **stats, zero_var_frac=zvar / max(ngroups, 1),
               len_mean=lsum / n, len_max=max(all_gather(max(out.lengths, default=0))),
               trunc_frac=trunc / n, **upd, lr=lr, **timer.t)
    row["tok_per_s"] = lsum / max(row["t_rollout"], 1e-9)
    row["peak_mem"] = peak_memory(device)
    return row


def probe_margin(probe, probe_opt, feats, ends, labels, cfg, seed):
    """Fit the probe on this batch's (feature, Y_b) pairs, then score the same prefixes with it.

    Returns (calib [N] the mode's calibration term, the margin or the negative Brier (modes.py),
    signal [N] (1 where both a solvable and an unsolvable prefix exist), stats, C [N, B] the
    probe's confidences, 0 where there is no budget). Every rank fits on the
    pooled pairs of all ranks with the same seed, so the probes stay identical without syncing weights.
    """
    valid = ends > 0
    Y = torch.zeros(ends.shape)
    for i, ys in enumerate(labels):
        Y[i, :len(ys)] = torch.tensor(ys, dtype=torch.float32)
    pooled = all_gather((feats[valid], Y[valid]))
    X_all, Y_all = torch.cat([x for x, _ in pooled]), torch.cat([y for _, y in pooled])
    bce = probe_lib.fit(probe, probe_opt, X_all, Y_all, passes=cfg["probe_passes"],
                        batch_size=cfg["probe_batch"], seed=seed)
    C = torch.zeros(ends.shape)
    C[valid] = probe_lib.predict(probe, feats[valid])
    calib = modes.calibration(C, Y, valid, cfg)
    signal = (((Y == 1) & valid).any(1) & ((Y == 0) & valid).any(1)).float()
    C_all = probe_lib.predict(probe, X_all)
    stats = dict(probe_bce=bce, probe_ece=ece(C_all.numpy(), Y_all.numpy()) if len(Y_all) else 0.0,
                 label_mean=Y_all.mean().item() if len(Y_all) else 0.0,
                 label_mixed=((Y_all > 0) & (Y_all < 1)).float().mean().item() if len(Y_all) else 0.0,
                 prefixes=len(Y_all))
    return calib, signal, stats, C


def zero_var_groups(R, G):
    return (R.view(-1, G).std(1) == 0).sum().item() if len(R) else 0


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)


def hold_lock(out):
    """One writer per run folder: rank 0 holds OUT/lock until main() ends; if another process holds
    it, every rank stops with the same one line."""
    err = None
    if MASTER:
        try:
            LOCKS.enter_context(ckpt_lib.locked(out, "training run"))
        except UserError as e:
            err = str(e)
    err = all_gather(err)[0]
    if err:
        raise UserError(err)


def run(cfg):
    if cfg["steps"] == 0:
        print0("--steps 0: nothing to train; nothing was loaded or written")
        return
    device = setup(cfg["offload"])
    if device.type == "cpu" and cfg["model"] == "toy":
        torch.set_num_threads(1)  # the toy's ops are too small to gain from threads; they only contend
    out = cfg["out"]
    held = os.path.isdir(out)
    if held:
        hold_lock(out)
    ckpt = ckpt_lib.latest_checkpoint(out, say=print0, resume=True)
    if cfg["resume"] and ckpt is None:
        raise UserError(f"--resume {out}: the run has no complete checkpoint; start it again without --resume")
    if ckpt and not cfg["resume"]:
        raise UserError(f"{out} already holds a run: pass --resume {out} to continue it, or another --out")
    if ckpt and ckpt_lib.step_of(ckpt) >= cfg["steps"]:
        print0(f"{out} is at step {ckpt_lib.step_of(ckpt)} already (--steps {cfg['steps']}): nothing to "
               "train; pass a larger --steps")
        return
    instruction = cfg["instruction"]
    tracker = runlog.tracker(cfg, out) if MASTER else None  # before any slow loading: fails fast without wandb
    split = "train" if cfg["data"] == "toy" else None
    rows = data.load_rows(cfg["data"], split=split, problem_field=cfg["problem_field"],
                          answer_field=cfg["answer_field"])
    eval_rows = data.load_rows(cfg["eval_data"], split="test" if cfg["eval_data"] == "toy" else None,
                               limit=cfg["eval_n"]) if cfg["eval_n"] else []
    torch.manual_seed(cfg["seed"]), np.random.seed(cfg["seed"]), random.seed(cfg["seed"])

    if torch.distributed.is_initialized():  # rank 0 reads the weights, the others get their shards
        policy, sampler, model, tok = load_sharded(
            ckpt or cfg["model"], device, cfg["offload"], cfg["trust_remote_code"],
            checkpoint_activations if cfg["grad_ckpt"] else None)
    else:
        model, tok = load_policy(ckpt or cfg["model"], cfg, device)
        policy, sampler = wrap(model, device)
    if cfg["max_prompt_tokens"]:
        rows, dropped = data.drop_long_prompts(rows, tok, cfg["max_prompt_tokens"], instruction)
        print0(f"training set: {len(rows)} problems, {dropped} dropped (prompt over {cfg['max_prompt_tokens']} tokens)")
        if not rows:
            raise UserError(f"every training prompt is over --max-prompt-tokens {cfg['max_prompt_tokens']}: raise it")
    data.check_context(tok, rows, instruction, getattr(model.config, "max_position_embeddings", None),
                       cfg["max_new_tokens"], cfg["data"], say=print0)
    if not held:  # a new folder: made only now that the data and the model are known to load
        hold_lock(out)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg["warmup"], 1)))
    probe = probe_lib.Probe(model.config.hidden_size)
    probe_opt = probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])
    step, cursor = 0, 0
    metrics_path = os.path.join(out, "metrics.jsonl")
    samples_path, heldout_path = os.path.join(out, "samples.jsonl"), os.path.join(out, "heldout.jsonl")
    if ckpt:
        with ckpt_lib.reading(os.path.join(ckpt, "state.pt")):
            # mmap: the optimizer state is read from rank 0 (load_optimizer broadcasts it), so other
            # ranks never page in the 8 N bytes of the full AdamW state
            state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, mmap=True)
            load_optimizer(policy, opt, state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step, cursor = state["step"], state["cursor"]
        with ckpt_lib.reading(os.path.join(ckpt, "probe.pt")):
            probe, probe_state = probe_lib.load(os.path.join(ckpt, "probe.pt"))
            probe_opt = probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])
            probe_opt.load_state_dict(probe_state)
        ckpt_lib.set_rng_state(state["rng"])  # last: building the probe above draws from torch's RNG
        ckpt_lib.apply_rates(opt, sched, cfg["lr"], probe_opt, cfg["probe_lr"])
        if MASTER:
            for path in (metrics_path, samples_path, heldout_path):
                ckpt_lib.truncate_metrics(path, step)
            changed = config.changes(config.read_config(out), cfg)
            if changed:
                ckpt_lib.write_json(os.path.join(out, "config.json"), {**cfg, "resume": None})
                print0("changed on resume (written to config.json): " +
                       ", ".join(f"{k} {a} -> {b}" for k, a, b in changed))
        print0(f"resuming {out} from step {step}")
    elif MASTER:
        os.makedirs(out, exist_ok=True)
        ckpt_lib.write_json(os.path.join(out, "config.json"), cfg)
        for path in (metrics_path, samples_path, heldout_path):
            open(path, "w").close()

    def log(row):
        if MASTER:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if tracker:
                tracker.log(row)

    def evaluate(at):
        if not eval_rows:  # --eval-n 0
            return None
        t = time.perf_counter()
        calib = {} if cfg["reward"] in modes.PROBE_MODES and cfg["eval_probe_n"] > 0 else None
        acc = held_out_accuracy(sampler, tok, eval_rows, cfg, instruction, device, probe, calib)
        trajs = calib.pop("trajectories") if calib else []
        log(dict(step=at, eval=True, eval_accuracy=acc, eval_n=len(eval_rows), **(calib or {}),
                 t_eval=time.perf_counter() - t))
        if MASTER:
            runlog.append_jsonl(heldout_path, [dict(step=at, **t) for t in trajs])
        print0(f"step {at}: held-out accuracy {acc:.3f} on {len(eval_rows)} problems" + heldout.describe(calib))
        return acc

    def save(at):
        model_sd, opt_sd = full_state(policy, opt)
        if MASTER:
            def write(tmp):
                model.save_pretrained(tmp, state_dict=model_sd)
                tok.save_pretrained(tmp)
                probe_lib.save(os.path.join(tmp, "probe.pt"), probe, probe_opt)
                torch.save(dict(step=at, cursor=cursor, optimizer=opt_sd, scheduler=sched.state_dict(),
                                rng=ckpt_lib.rng_state()), os.path.join(tmp, "state.pt"))
            ckpt_lib.save_checkpoint(out, at, write, keep=cfg["keep"])

    first_acc = evaluate(0) if step == 0 else None
    final_acc = first_acc
    phase_sums = dict.fromkeys(Timer.PHASES, 0.0)
    bar = tqdm(range(step + 1, cfg["steps"] + 1), initial=step, total=cfg["steps"], disable=not MASTER,
               desc=cfg["reward"])
    for step in bar:
        batch_rows, cursor = next_rows(rows, cursor, cfg["prompts_per_step"], cfg["seed"])
        picked = []
        row = rl_step(step, batch_rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg,
                      device, instruction, picked)
        refresh_sampler(sampler, policy)
        log(row)
        if MASTER:
            runlog.append_jsonl(samples_path, picked)
        for p in Timer.PHASES:
            phase_sums[p] += row["t_" + p]
        bar.set_postfix(acc=f"{row['accuracy']:.2f}", R=f"{row['reward']:+.2f}",
                        margin=f"{row.get('margin', 0.0):+.3f}", sig=f"{row['signal_frac']:.2f}",
                        roll=f"{row['t_rollout']:.1f}s", label=f"{row['t_label']:.1f}s")
        last = step == cfg["steps"]
        if last or (cfg["eval_every"] and step % cfg["eval_every"] == 0):
            final_acc = evaluate(step)
        if last or (cfg["save_every"] and step % cfg["save_every"] == 0):
            save(step)
    if MASTER:
        where = ckpt_lib.latest_checkpoint(out)
        print0(f"\nrun: {out}  (latest checkpoint: {where})")
        if first_acc is not None and final_acc is not None:
            print0(f"held-out accuracy: {first_acc:.3f} at the start -> {final_acc:.3f} at step {step}")
        roll = max(phase_sums["rollout"], 1e-9)
        print0("seconds per phase: " + ", ".join(
            f"{p} {t:.1f}" + ("" if p == "rollout" else f" ({t / roll:.2f}x rollout)")
            for p, t in phase_sums.items()))
        bench = " --benchmarks toy" if cfg["eval_data"] == "toy" else ""
        print0(f"curves: {runlog.plot_curves(out)}")
        print0(f"next: python evaluate.py --model {out}{bench}")
        if tracker:
            tracker.finish()


def interrupted(cfg):
    """The one line printed on Ctrl-C: where the run stands and how to continue it."""
    out = cfg and cfg["out"]
    ckpt = out and os.path.isdir(out) and ckpt_lib.latest_checkpoint(out, say=lambda m: None, resume=True)
    if not ckpt:
        return "interrupted before the first checkpoint: nothing to resume; run the command again"
    flag = " --trust-remote-code" if cfg["trust_remote_code"] else ""
    return (f"interrupted: {ckpt} is the last checkpoint; continue with: "
            f"python train.py --resume {out}{flag}")


def main(argv=None):
    cfg, stopped = None, False
    try:
        cfg = resolve_args(argv)
        if cfg["plot"]:
            print(runlog.plot_curves(cfg["plot"]))
        else:
            if cfg["plan"]:
                plan.check(cfg, show=True)
                return
            if not cfg["resume"]:
                ckpt_lib.check_available(cfg["model"])  # a missing model is reported before anything is read
            plan.check(cfg, show=False)  # an impossible run stops here, before any weights are read
            workers = launch.worker_count(cfg)
            if workers > 1:
                code = launch.launch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv,
                                     workers, torch.cuda.is_available())
                if code:
                    sys.exit(code)
                return
            run(cfg)
    except (UserError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        print(f"stopped: {e}; the last good checkpoint is left untouched", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # nothing new is finished or saved: the last checkpoint stays as it is
        stopped = True         # the line is printed below, once the progress bar has closed
    finally:
        LOCKS.close()
        teardown()
    if stopped:
        if MASTER:
            print(f"\n{interrupted(cfg)}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
