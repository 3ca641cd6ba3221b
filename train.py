"""RLCM: GRPO with a confidence-margin reward read off the policy's hidden states.

    python train.py                                        # the offline toy world, CPU, minutes
    python train.py --model deepseek-r1-distill-qwen-7b    # one GPU (bf16)
    torchrun --nproc_per_node 8 train.py --model deepseek-r1-distill-qwen-7b --data deepscaler
    python train.py --resume runs/toy                      # continue a run from its last checkpoint

One step (DESIGN.md): rollout -> grade -> budgets -> forced answers (Monte-Carlo labels Y_b) ->
scoring forward (old log-probs + probe features) -> probe fit on this batch -> probe confidences
C_b -> margin -> R = r_nat + lam * margin -> group advantages -> one clipped policy-gradient step.

Kept from GRPO: group-normalised advantages, the clipped ratio, token-mean aggregation.
Dropped: the KL penalty (kl_coef 0, as released) and several PPO epochs (one update per batch).
The probe never sends a gradient into the policy: the margin enters only through the scalar reward.
"""
import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from tqdm import tqdm

import data
import probe as probe_lib
import checkpoint as ckpt_lib
from checkpoint import UserError
from config import resolve_args
from parallel import MASTER, RANK, WORLD, all_gather, all_sum, full_state, load_optimizer, refresh_sampler, setup, teardown, wrap
from grpo import group_advantages, pack, policy_loss
from label import budgets, mc_labels
from metrics import ece
from reward import margin_reward, total_reward
from rollout import generate
from score import budget_ends, score

VOLATILE = ("t_", "tok_per_s", "peak_mem")  # metrics.jsonl fields that vary between identical runs


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


def micro_batches(lengths, max_tokens):
    """Split indices into consecutive micro-batches of at most max_tokens padded tokens."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


@torch.no_grad()
def held_out_accuracy(sampler, tok, rows, cfg, instruction, device):
    """Accuracy on a fixed slice of the held-out split at the evaluation temperature (0.6) with a
    fixed seed, so every check of a run samples the same way."""
    mine = rows[RANK::WORLD]
    prompts = [data.chat_prompt(tok, r["problem"], instruction) for r in mine]
    hits = 0
    if prompts:
        out = generate(sampler, tok, prompts, max_new_tokens=cfg["max_new_tokens"], temperature=0.6,
                       seed=cfg["seed"] + 12345 + RANK, batch_size=cfg["gen_batch"], decode=cfg.get("decode"))
        hits = sum(data.is_correct(t, r["answer"]) for t, r in zip(out.texts, mine))
    hits, n = all_sum([hits, len(mine)], device)
    return hits / max(n, 1)


def rl_step(step, batch_rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg, device,
            instruction):
    timer, G, rlcm = Timer(), cfg["group_size"], cfg["reward"] == "rlcm"
    rows = batch_rows[RANK::WORLD]  # whole prompt groups stay on one rank
    prompts = [data.chat_prompt(tok, r["problem"], instruction) for r in rows]
    step_seed = cfg["seed"] * 1_000_003 + step * 101
    seed = step_seed + RANK  # each rank samples its own groups
    sampler.eval()
    with timer("rollout"):
        out = generate(sampler, tok, prompts, n=G, max_new_tokens=cfg["max_new_tokens"],
                       temperature=cfg["temperature"], top_p=cfg["top_p"], seed=seed,
                       batch_size=cfg["gen_batch"], decode=cfg.get("decode"))
    golds = [rows[i]["answer"] for i in out.prompt_index]
    traj_prompts = [prompts[i] for i in out.prompt_index]
    correct = torch.tensor([data.is_correct(t, g) for t, g in zip(out.texts, golds)], dtype=torch.float32)
    cuts = [budgets(n) if rlcm else [] for n in out.lengths]
    labels = [[] for _ in cuts]
    if rlcm:
        with timer("label"):
            labels = mc_labels(sampler, tok, traj_prompts, out.ids, cuts, golds, k=cfg["k"],
                               close=cfg["forced_close"], seed=seed + 7, batch_size=cfg["gen_batch"],
                               decode=cfg.get("decode"))

    batch = pack(traj_prompts, out.ids, tok.pad_token_id)
    ends = budget_ends(batch["prompt_lens"], cuts)
    lengths = [len(p) + len(r) for p, r in zip(traj_prompts, out.ids)]
    mbs = micro_batches(lengths, cfg["micro_tokens"])
    old_logp, feats = torch.zeros(batch["loss_mask"].shape), []
    with timer("score"):
        for mb in mbs:
            sub, L = micro_batch(batch, mb, device)
            lp, f, _ = score(sampler, sub, ends[mb], cfg["temperature"], cfg["chunk_size"])
            old_logp[mb, :L - 1] = lp.cpu()
            feats.append(f.cpu())
    feats = torch.cat(feats) if feats else torch.zeros(0)

    stats, margin, signal = {}, torch.zeros(len(out.ids)), torch.zeros(len(out.ids))
    if rlcm:
        with timer("probe"):
            margin, signal, stats = probe_margin(probe, probe_opt, feats, ends, labels, cfg, step_seed)
    R = total_reward(correct, margin, lam=cfg["lam"] if rlcm else 0.0)
    adv = group_advantages(R, G)

    lr = sched.get_last_lr()[0]
    with timer("update"):
        upd = update(policy, opt, sched, batch, old_logp, adv, mbs, cfg, device)
    local = [correct.sum().item(), R.sum().item(), margin.sum().item(), signal.sum().item(),
             len(out.ids), sum(out.lengths), sum(f == "length" for f in out.finish),
             zero_var_groups(R, G), len(rows)]
    acc, rsum, msum, ssum, n, lsum, trunc, zvar, ngroups = all_sum(local, device)
    row = dict(step=step, accuracy=acc / n, reward=rsum / n, margin=msum / n,
               signal_frac=ssum / n if rlcm else 0.0, **stats, zero_var_frac=zvar / max(ngroups, 1),
               len_mean=lsum / n, len_max=max(all_gather(max(out.lengths, default=0))),
               trunc_frac=trunc / n, **upd, lr=lr, **timer.t)
    row["tok_per_s"] = lsum / max(row["t_rollout"], 1e-9)
    row["peak_mem"] = peak_memory(device)
    return row


def probe_margin(probe, probe_opt, feats, ends, labels, cfg, seed):
    """Fit the probe on this batch's (feature, Y_b) pairs, then score the same prefixes with it.

    Returns (margin [N], signal [N] (1 where both a solvable and an unsolvable prefix exist),
    stats). Every rank fits on the pooled pairs of all ranks with the same seed, so the probes
    stay identical without syncing weights.
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
    margin = margin_reward(C, Y, valid, corner=cfg["corner"])
    signal = (((Y == 1) & valid).any(1) & ((Y == 0) & valid).any(1)).float()
    C_all = probe_lib.predict(probe, X_all)
    stats = dict(probe_bce=bce, probe_ece=ece(C_all.numpy(), Y_all.numpy()) if len(Y_all) else 0.0,
                 label_mean=Y_all.mean().item() if len(Y_all) else 0.0,
                 label_mixed=((Y_all > 0) & (Y_all < 1)).float().mean().item() if len(Y_all) else 0.0,
                 prefixes=len(Y_all))
    return margin, signal, stats


def micro_batch(batch, rows, device):
    """The `pack` batch restricted to `rows` and cut to their longest sequence L; returns (sub, L)."""
    sub = {k: v[rows].to(device) for k, v in batch.items()}
    L = int(sub["attention_mask"].sum(1).max())
    cut = {"input_ids": L, "attention_mask": L, "loss_mask": L - 1}
    return {k: v[:, :cut[k]] if k in cut else v for k, v in sub.items()}, L


def zero_var_groups(R, G):
    return (R.view(-1, G).std(1) == 0).sum().item() if len(R) else 0


def update(policy, opt, sched, batch, old_logp, adv, mbs, cfg, device):
    """One optimizer step over all micro-batches; the loss is the token-mean over the whole batch."""
    policy.train()
    mask = batch["loss_mask"]
    weights = mask.sum(1) if cfg["agg"] == "token-mean" else torch.ones(len(mask))
    total = all_sum([weights.sum().item()], device)[0]
    # FSDP averages gradients over ranks, so each rank's share is scaled back up by WORLD
    n_mb = int(max(all_gather(len(mbs))))
    sums = dict.fromkeys(("loss", "clip_frac", "kl", "ratio_mean"), 0.0)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and WORLD == 1 else nullcontext()
    for j in range(n_mb):
        mb = mbs[min(j, len(mbs) - 1)] if mbs else [0]
        scale = weights[mb].sum().item() * WORLD / max(total, 1.0) if j < len(mbs) else 0.0
        sub, L = micro_batch(batch, mb, device)
        with amp:
            logp = policy(sub["input_ids"], sub["attention_mask"], cfg["temperature"], cfg["chunk_size"])
        loss, st = policy_loss(logp.float(), old_logp[mb, :L - 1].to(device), adv[mb].to(device),
                               sub["loss_mask"], cfg["clip_low"], cfg["clip_high"], agg=cfg["agg"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss ({loss.item()}) in micro-batch {j}")
        (loss * scale).backward()
        for key, value in (("loss", loss.item()), *st.items()):
            sums[key] += value * scale / WORLD  # weighted like the loss: a batch-wide mean
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg["grad_clip"])
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm ({grad_norm})")
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return dict(zip(sums, all_sum(list(sums.values()), device)), grad_norm=grad_norm)


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)


def run(cfg):
    device = setup()
    if device.type == "cpu" and cfg["model"] == "toy":
        torch.set_num_threads(1)  # the toy's ops are too small to gain from threads; they only contend
    out = cfg["out"]
    ckpt = ckpt_lib.latest_checkpoint(out)
    if cfg["resume"] and ckpt is None:
        raise UserError(f"--resume {out}: the run has no checkpoint yet; start it again without --resume")
    if ckpt and not cfg["resume"]:
        raise UserError(f"{out} already holds a run: pass --resume {out} to continue it, or another --out")
    is_toy = cfg["model"] == "toy"
    instruction = "" if is_toy else data.INSTRUCTION
    split = "train" if cfg["data"] == "toy" else None
    rows = data.load_rows(cfg["data"], split=split, problem_field=cfg["problem_field"],
                          answer_field=cfg["answer_field"])
    eval_rows = data.load_rows(cfg["eval_data"], split="test" if cfg["eval_data"] == "toy" else None,
                               limit=cfg["eval_n"])
    torch.manual_seed(cfg["seed"]), np.random.seed(cfg["seed"]), random.seed(cfg["seed"])

    model, tok = load_policy(ckpt or cfg["model"], cfg, device)
    policy, sampler = wrap(model, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg["warmup"], 1)))
    probe = probe_lib.Probe(model.config.hidden_size)
    probe_opt = probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])
    step, cursor = 0, 0
    metrics_path = os.path.join(out, "metrics.jsonl")
    if ckpt:
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True)
        load_optimizer(policy, opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        probe, probe_state = probe_lib.load(os.path.join(ckpt, "probe.pt"))
        probe_opt = probe_lib.make_optimizer(probe, lr=cfg["probe_lr"])
        probe_opt.load_state_dict(probe_state)
        ckpt_lib.set_rng_state(state["rng"])
        step, cursor = state["step"], state["cursor"]
        if MASTER:
            ckpt_lib.truncate_metrics(metrics_path, step)
        print0(f"resuming {out} from step {step}")
    elif MASTER:
        os.makedirs(out, exist_ok=True)
        ckpt_lib.write_json(os.path.join(out, "config.json"), cfg)
        open(metrics_path, "w").close()

    def log(row):
        if MASTER:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def evaluate(at):
        t = time.perf_counter()
        acc = held_out_accuracy(sampler, tok, eval_rows, cfg, instruction, device)
        log(dict(step=at, eval=True, eval_accuracy=acc, eval_n=len(eval_rows),
                 t_eval=time.perf_counter() - t))
        print0(f"step {at}: held-out accuracy {acc:.3f} on {len(eval_rows)} problems")
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
               desc="rlcm" if cfg["reward"] == "rlcm" else "grpo")
    for step in bar:
        batch_rows, cursor = next_rows(rows, cursor, cfg["prompts_per_step"], cfg["seed"])
        row = rl_step(step, batch_rows, policy, sampler, tok, probe, probe_opt, opt, sched, cfg,
                      device, instruction)
        refresh_sampler(sampler, policy)
        log(row)
        for p in Timer.PHASES:
            phase_sums[p] += row["t_" + p]
        bar.set_postfix(acc=f"{row['accuracy']:.2f}", R=f"{row['reward']:+.2f}",
                        margin=f"{row['margin']:+.3f}", sig=f"{row['signal_frac']:.2f}",
                        roll=f"{row['t_rollout']:.1f}s", label=f"{row['t_label']:.1f}s")
        last = step == cfg["steps"]
        if last or (cfg["eval_every"] and step % cfg["eval_every"] == 0):
            final_acc = evaluate(step)
        if last or step % cfg["save_every"] == 0:
            save(step)
    if MASTER:
        where = ckpt_lib.latest_checkpoint(out)
        print0(f"\nrun: {out}  (latest checkpoint: {where})")
        if first_acc is not None and cfg["steps"] > 0:
            print0(f"held-out accuracy: {first_acc:.3f} at the start -> {final_acc:.3f} at step {step}")
        roll = max(phase_sums["rollout"], 1e-9)
        print0("seconds per phase: " + ", ".join(
            f"{p} {t:.1f}" + ("" if p == "rollout" else f" ({t / roll:.2f}x rollout)")
            for p, t in phase_sums.items()))
        bench = " --benchmarks toy" if cfg["eval_data"] == "toy" else ""
        print0(f"next: python evaluate.py --model {out}{bench}")


def main(argv=None):
    try:
        run(resolve_args(argv))
    except (UserError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        print(f"stopped: {e}; the last good checkpoint is left untouched", file=sys.stderr)
        sys.exit(3)
    finally:
        teardown()


if __name__ == "__main__":
    main()
