"""RLCM: GRPO with a confidence-margin reward read off the policy's hidden states.

    python train.py                                        # the offline toy world, CPU, minutes
    python train.py --nproc 2                              # the same on two CPU processes (gloo)
    python train.py --model deepseek-r1-distill-qwen-7b    # one worker per GPU of this node (FSDP2)
    python train.py --model deepseek-r1-distill-qwen-7b --plan --gpus 8 --gpu-mem 80   # memory plan
    python train.py --model deepseek-r1-distill-qwen-7b --offload   # 1-2 GPUs: state in host memory
    torchrun --nnodes 2 --nproc_per_node 8 ... train.py --model ...  # several nodes: torchrun's ranks
    python train.py --resume runs/toy                      # continue a run from its last checkpoint
    python train.py --plot runs/toy                        # redraw runs/toy/curves.png

One step: step.rl_step (README.md, "The algorithm"; docs/design.md, "One RL step"). This file runs
the steps: setup, held-out checks, checkpoints, logs, resume. Kept from GRPO: group-normalised
advantages, the clipped ratio, token-mean aggregation; dropped: the KL penalty (as released). With
one update per batch (--ppo-epochs 1) the old log-probs are the current ones detached (ratio 1).
The probe never sends a gradient into the policy: the margin enters only through the scalar reward.
"""
import os
import random
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import config
import data
import modes
import probe as probe_lib
from grpo import token_logprobs
from step import Learner, Timer, rl_step
from evaluation import heldout
from evaluation.heldout import held_out_accuracy
from harness import checkpoint as ckpt_lib, launch, lora as lora_lib, models, plan, runlog
from harness.files import UserError
from harness.parallel import MASTER, WORLD, full_state, load_sharded, refresh_sampler, setup, wrap
from harness.runfolder import RunFolder, exit_codes


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
    model, tok = models.load_model(base, dtype, cfg["trust_remote_code"])
    if lora:
        model = lora_lib.with_adapter(model, cfg, ckpt)
    model.config.use_cache = False
    if cfg["grad_ckpt"]:
        checkpoint_activations(model)
    return model.to(device), tok


def warmup_factor(s, warmup, from_zero):
    """The learning rate's factor at update s (0, 1, ...): linear warm-up to 1 over `warmup` updates.
    from_zero (verl's, the released run): s / warmup, so the first update runs at lr 0; else
    (s + 1) / warmup. warmup 10: update 0 at 0 or 0.1, update 9 at 0.9 or 1, update 10 at 1; warmup 0: 1."""
    return 1.0 if s >= warmup else (s + (0 if from_zero else 1)) / warmup


def scored(acc):
    """An accuracy as printed: nan (a --reward-fn skipped every response) is no number but words."""
    return "nothing scored (--reward-fn skipped every response)" if acc != acc else f"{acc:.3f}"


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
    out, orders = [], {}
    for c in range(cursor, cursor + count):
        epoch, i = divmod(c, len(rows))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng(seed + epoch).permutation(len(rows))
        out.append(rows[orders[epoch][i]])
    return out, cursor + count


def run(cfg):
    if cfg["steps"] == 0:
        print0("--steps 0: nothing to train; nothing was loaded or written")
        return
    device = setup(cfg["offload"])
    if device.type == "cpu":   # what runs on a CPU here (the toy, a small local model) is too small
        torch.set_num_threads(1)  # to gain from threads: they only contend (a step 10x slower)
    folder = RunFolder(cfg, print0, data.digest)  # the lock, and the checkpoint to resume from
    if folder.done:
        return
    ckpt, instruction = folder.ckpt, cfg["instruction"]
    tracker = runlog.tracker(cfg, folder.out) if MASTER else None  # before any slow loading: fails fast without wandb
    rows = data.load_rows(cfg["data"], split="train" if cfg["data"] == "toy" else None,
                          problem_field=cfg["problem_field"], answer_field=cfg["answer_field"])
    eval_rows = data.load_rows(cfg["eval_data"], split="test" if cfg["eval_data"] == "toy" else None,
                               limit=cfg["eval_n"]) if cfg["eval_n"] else []
    torch.manual_seed(cfg["seed"]), np.random.seed(cfg["seed"]), random.seed(cfg["seed"])

    # `policy` the update trains (FSDP2-sharded on several ranks), `sampler` the rollout samples from
    # (the same model on one CPU process, a bf16 copy on a GPU), `model` the module (save_pretrained)
    if torch.distributed.is_initialized():  # rank 0 reads the weights, the others get their shards
        adapt = (lambda m, meta: lora_lib.with_adapter(m, cfg, ckpt, fresh=meta)) if cfg["lora_rank"] else None
        base = lora_lib.base_of(ckpt) if adapt and ckpt else ckpt or cfg["model"]
        policy, sampler, model, tok = load_sharded(
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
        folder.start(cfg)

    def log(row, samples=()):  # a metrics row, and the step's samples
        if MASTER:
            runlog.append_jsonl(folder.metrics, [row])
            runlog.append_jsonl(folder.samples, samples)
            if tracker:
                tracker.log(row)

    def evaluate(at):
        if not eval_rows:  # --eval-n 0
            return None
        t = time.perf_counter()
        probe_stats = {} if cfg["reward"] in modes.PROBE_MODES and cfg["eval_probe_n"] > 0 else None
        acc = held_out_accuracy(sampler, tok, eval_rows, cfg, instruction, device, probe, probe_stats)
        trajs = probe_stats.pop("trajectories") if probe_stats else []
        log(dict(step=at, eval=True, eval_accuracy=acc, eval_n=len(eval_rows), eval_data=cfg["eval_data"],
                 **(probe_stats or {}), t_eval=time.perf_counter() - t))
        if MASTER:
            runlog.append_jsonl(folder.heldout, [dict(step=at, **t) for t in trajs])
        print0(f"step {at}: held-out accuracy {scored(acc)} on {len(eval_rows)} problems" + heldout.describe(probe_stats))
        return acc

    def save(at):
        model_sd, opt_sd = full_state(policy, opt)
        folder.save(at, model, model_sd, tok, lambda p: probe_lib.save(p, probe, probe_opt), dict(
            step=at, cursor=cursor, optimizer=opt_sd, scheduler=sched.state_dict()), keep=cfg["keep"])

    # resumed: the start's accuracy from the log, and whether it was of another held-out set
    first_acc, other_set = (evaluate(0), False) if step == 0 else folder.first_accuracy(cfg, len(eval_rows))
    final_acc = first_acc
    learner = Learner(policy, sampler, tok, probe, probe_opt, opt, sched, device)
    phase_sums = dict.fromkeys(Timer.PHASES, 0.0)
    bar = tqdm(range(step + 1, cfg["steps"] + 1), initial=step, total=cfg["steps"], disable=not MASTER,
               desc=cfg["reward"])
    for step in bar:
        batch_rows, cursor = next_rows(rows, cursor, cfg["prompts_per_step"], cfg["seed"])
        picked = []
        row = rl_step(step, batch_rows, learner, cfg, picked)
        refresh_sampler(sampler, policy)
        log(row, picked)
        phase_sums = {p: t + row["t_" + p] for p, t in phase_sums.items()}
        bar.set_postfix(acc=f"{row['accuracy']:.2f}", R=f"{row['reward']:+.2f}",
                        margin=f"{row.get('margin', 0.0):+.3f}", sig=f"{row['signal_frac']:.2f}",
                        roll=f"{row['t_rollout']:.1f}s", label=f"{row['t_label']:.1f}s")
        last = step == cfg["steps"]
        if last or (cfg["eval_every"] and step % cfg["eval_every"] == 0):
            final_acc = evaluate(step)
        if last or (cfg["save_every"] and step % cfg["save_every"] == 0):
            save(step)
    if MASTER:
        print0(f"\nrun: {folder.out}  (latest checkpoint: {ckpt_lib.latest_checkpoint(folder.out)})")
        if first_acc is not None and final_acc is not None:
            other = " (two different held-out sets: --eval-n or --eval-data changed on resume)"
            print0(f"held-out accuracy: {scored(first_acc)} at the start -> {scored(final_acc)} at step "
                   f"{step}" + (other if other_set else ""))
        roll = max(phase_sums["rollout"], 1e-9)
        print0("seconds per phase: " + ", ".join(
            f"{p} {t:.1f}" + ("" if p == "rollout" else f" ({t / roll:.2f}x rollout)")
            for p, t in phase_sums.items()))
        bench = " --benchmarks " + ",".join(data.TOY_BENCHMARKS) if cfg["eval_data"] == "toy" else ""
        bench += f" --toy-world {cfg['toy_world']}" if bench and cfg["toy_world"] else ""
        print0(f"curves: {runlog.plot_curves(folder.out)}")
        print0(f"next: python evaluate.py --model {folder.out}{bench}")
        if tracker:
            tracker.finish()


def main(argv=None):
    with exit_codes() as state:  # exit 2 / 3 / 130, the lock released: harness/runfolder.py
        cfg = state["cfg"] = config.resolve_args(argv)
        if cfg["plot"]:
            print(runlog.plot_curves(cfg["plot"]))
            return
        if cfg["plan"]:
            plan.check(cfg, show=True, probed=cfg["reward"] in modes.PROBE_MODES)
            return
        if not cfg["resume"]:
            ckpt_lib.check_available(cfg["model"])  # a missing model is reported before anything is read
        plan.check(cfg, probed=cfg["reward"] in modes.PROBE_MODES)  # an impossible run stops here
        workers = launch.worker_count(cfg)
        config.check_world(cfg, max(workers, WORLD))  # here, or in each worker under torchrun
        if workers <= 1:  # one process, or a worker already (0)
            return run(cfg)
        if not cfg["resume"]:
            ckpt_lib.fetch(cfg["model"])  # before the workers start: rank 0 would download in the group
        code = launch.launch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv, workers)
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
