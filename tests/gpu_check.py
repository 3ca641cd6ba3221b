"""The node's path on one GPU in about 6 minutes (not collected by pytest; tests/test_gpu_check.py
runs its dry run):

    python tests/gpu_check.py --all --config .device/r1_distill_qwen_7b --out OUT    # on an H200
    python tests/gpu_check.py --all --dry-run --config DIR --out OUT                 # tiny, on the CPU

--config is a folder with DeepSeek-R1-Distill-Qwen-7B's config.json and tokenizer, no weights
(../shared/device/prepare.sh copies it into .device/, the folder that travels to a GPU machine).
A 4-layer cut of that model at real widths (hidden 3584, 28 heads, 4 KV heads, vocab 152,064) with
random weights goes through what one RL step of the real command does, at sizes of the real run:

  build     the bf16 generation copy on the GPU
  rollout   static decode of 4 prompts (600 random tokens, the plan's prompt length) x 6 samples x
            2048 new tokens, EOS off so every row runs to the end; then the same rollout again (the
            next RL step): the steps captured by each (one per live length, then none), the
            allocator's empty_cache calls and whether the samples agree
  labels    label.mc_labels (static, with the probe's features, as a step runs it) on 24 synthetic
            responses of 200..2048 tokens, k=4, chunks of --gen-batch 8 cuts: the static shapes
            made, alive at most at once, and alive after it
  score     the scoring forward over those trajectories, micro-batch by micro-batch as step.py runs
            it for old log-probs (--ppo-epochs > 1, C2GSPG)
  update    update.update on one micro-batch of --micro-tokens: fp32 policy under bf16 autocast,
            gradient checkpointing, AdamW (the one-GPU path without --offload)
  decode    tokens/s of the static path (live length), static-full (the whole buffer every step),
            the dynamic path and model.generate at the rollout's shape, with the bytes a step reads,
            beside the bandwidth floor (scripts/bench.py; --bandwidth, default the H200's 4.8 TB/s)
  toy_fsdp  `train.py --offload --grad-ckpt` for two toy steps in a subprocess: a one-rank FSDP2
            group (sharding, NCCL, CPU offload, refresh_sampler, the DTensor grad norm, a save);
            per step the ratio, the sampler-vs-trainer gap and the entropy

Each phase from rollout to update prints its peak (torch.cuda.max_memory_allocated, so without
the CUDA context) beside plan.estimate for the same cut and sizes. One JSON line per check on
stdout and in OUT/gpu_check.jsonl; a check that fails prints {"check": ..., "error": ...} (its
traceback goes to OUT/gpu_check.log) and the others still run; the exit code is 1 if any failed.
"""
import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project root, when run as a script
from scripts import bench  # noqa: E402
from harness import config, staticcache  # noqa: E402
import label  # noqa: E402
from harness import plan  # noqa: E402
import static_shapes  # noqa: E402  (beside this file)
from harness.checkpoint import latest_checkpoint  # noqa: E402
from grpo import pack  # noqa: E402
from harness.parallel import LogprobModel  # noqa: E402
from rollout import generate  # noqa: E402
from train import checkpoint_activations  # noqa: E402
from update import budget_ends, micro_batch, micro_batches, score, update  # noqa: E402

GiB = 2**30
# The real run's sizes where a phase has them (config.REAL: --gen-batch 8, --micro-tokens 16384),
# cut so that every check fits the time box; --dry-run shrinks widths and sizes for the CPU.
# answer_tokens: mc_labels' default, which step.py uses.
SIZES = dict(layers=4, prompts=4, group=6, prompt_len=plan.PROMPT_TOKENS, new=2048, shortest=200, k=4,
             answer_tokens=32)
DRY = dict(layers=2, prompts=2, group=2, prompt_len=16, new=16, shortest=8, k=2, answer_tokens=8,
           hidden=64, heads=4, kv_heads=2)  # the vocabulary stays: the pad id and </think> are near its end
TOY_STEPS = ["--steps", "2", "--eval-n", "0", "--offload", "--grad-ckpt", "--save-every", "1"]
TOY_DRY = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16"]  # the CPU is slow
STEP_FIELDS = ("ratio_mean", "sampler_gap", "sampler_kl_k3", "sampler_ratio_max", "entropy",
               "grad_norm", "peak_mem")


class Context(dict):
    """What the checks hand on to later ones; a missing entry names the check that did not run."""

    def __missing__(self, key):
        raise RuntimeError(f"needs {key!r} from an earlier check, which failed")


def gib(x):
    return None if x is None else round(x / GiB, 2)


@contextmanager
def phase(ctx, row):
    """Time the block and record its peak memory (CUDA) into `row`."""
    cuda = ctx["device"].type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
    row["seconds"] = round(time.perf_counter() - t, 2)
    row["peak_gib"] = gib(torch.cuda.max_memory_allocated()) if cuda else None


@contextmanager
def counting(owner, name, calls):
    """Record a call (its arguments) in `calls` for every call of owner.name inside the block."""
    f = getattr(owner, name)
    setattr(owner, name, lambda *a, **kw: calls.append(a) or f(*a, **kw))
    try:
        yield
    finally:
        setattr(owner, name, f)


def plan_terms(ctx, *names):
    """plan.estimate's peak, KV cache and label-phase terms, plus `names`, in GiB."""
    t = ctx["plan"]
    keys = ["peak", "KV cache", *names, *(k for k in t if any(w in k.lower() for w in ("label", "forced")))]
    return {k: gib(t[k]) for k in dict.fromkeys(keys) if isinstance(t.get(k), (int, float))}


def check_build(ctx):
    s, path = ctx["sizes"], ctx["args"].config
    cut = bench.cut_config(path, s["layers"])
    if ctx["args"].dry_run:
        cut.hidden_size, cut.intermediate_size = s["hidden"], 2 * s["hidden"]
        cut.num_attention_heads, cut.num_key_value_heads = s["heads"], s["kv_heads"]
        cut.head_dim = s["hidden"] // s["heads"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    row = {}
    with phase(ctx, row):
        model = bench.random_model(cut, ctx["device"]).eval().requires_grad_(False)
    vocab = min(len(tok), cut.vocab_size)
    ctx.update(cut=cut, tok=tok, model=model, vocab=vocab,
               prompts=bench.random_prompts(vocab, s["prompts"], s["prompt_len"], seed=0))
    # the run's settings with this check's sizes: what plan.estimate and update.update read
    ctx["cfg"] = {**config.COMMON, **config.REAL, "model": "gpu-check-cut", "prompts_per_step": s["prompts"],
                  "group_size": s["group"], "max_new_tokens": s["new"], "k": s["k"], "grad_ckpt": True}
    counts = plan.param_counts(cut)
    ctx["plan"] = plan.estimate(cut, ctx["cfg"], 1, "cuda", False, counts)
    return dict(row, layers=cut.num_hidden_layers, hidden=cut.hidden_size, heads=cut.num_attention_heads,
                kv_heads=cut.num_key_value_heads, vocab=cut.vocab_size, dtype=str(model.dtype),
                device=str(ctx["device"]), params=sum(p.numel() for p in model.parameters()),
                plan_params=counts[0], plan_gib={k: gib(v) for k, v in ctx["plan"].items()
                                                 if isinstance(v, (int, float))})


def check_rollout(ctx):
    s, cfg, row, again = ctx["sizes"], ctx["cfg"], {}, {}
    rollout = lambda: generate(ctx["model"], ctx["tok"], ctx["prompts"], n=s["group"],  # noqa: E731
                               max_new_tokens=s["new"], temperature=cfg["temperature"], eos_ids=[], seed=0,
                               batch_size=cfg["gen_batch"], decode="static")
    captures, emptied = [], []
    with counting(staticcache._Shape, "capture", captures), counting(torch.cuda, "empty_cache", emptied):
        with phase(ctx, row):
            out = rollout()
        first = len(captures)
        with phase(ctx, again):
            out_again = rollout()
    tokens = sum(out.lengths)
    return dict(row, rows=len(out.ids), prompt_len=s["prompt_len"], new_tokens=s["new"], tokens=tokens,
                min_len=min(out.lengths), tok_s=round(tokens / row["seconds"], 1),
                captures=[first, len(captures) - first], live_lengths=[a[2] for a in captures],
                empty_cache_calls=len(emptied), seconds_again=again["seconds"],
                same_samples=out_again.ids == out.ids, plan_gib=plan_terms(ctx, "generation copy", "prefill"))


def check_labels(ctx):
    s, cfg = ctx["sizes"], ctx["cfg"]
    n = s["prompts"] * s["group"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(s["shortest"], s["new"], n).long().tolist()
    responses = [torch.randint(ctx["vocab"], (m,), generator=g).tolist() for m in lengths]
    prompts = [ctx["prompts"][i // s["group"]] for i in range(n)]
    cuts = [label.budgets(m, cfg["budgets"]) for m in lengths]
    ctx.update(traj_prompts=prompts, responses=responses, cuts=cuts)
    stats, row = {}, {}
    with static_shapes.recording() as shapes, phase(ctx, row):
        _, feats = label.mc_labels(ctx["model"], ctx["tok"], prompts, responses, cuts, ["1"] * n, k=s["k"],
                                   max_new_tokens=s["answer_tokens"], seed=0, batch_size=cfg["gen_batch"],
                                   grader="strict", decode="static", stats=stats, features=True)
    gc.collect()  # a shape still alive now is held by something, not waiting for the collector
    return dict(row, trajectories=n, lengths=[min(lengths), max(lengths)], k=s["k"],
                batch_size=cfg["gen_batch"], forced_prompts=stats.get("forced_prompts"),
                features=sum(map(len, feats)), features_finite=all(bool(torch.isfinite(f).all()) for f in feats),
                shapes_made=len(shapes.made), shapes_max_alive=max((m["alive"] for m in shapes.made), default=0),
                shapes_max_alive_kv_gib=gib(max((m["alive_bytes"] for m in shapes.made), default=0)),
                shapes_alive_after=shapes.alive(), plan_gib=plan_terms(ctx, "generation copy", "prefill"))


def check_score(ctx):
    cfg, tok = ctx["cfg"], ctx["tok"]
    batch = pack(ctx["traj_prompts"], ctx["responses"], tok.pad_token_id)
    ends = budget_ends(batch["prompt_lens"], ctx["cuts"])
    lengths = [len(p) + len(r) for p, r in zip(ctx["traj_prompts"], ctx["responses"])]
    mbs = micro_batches(lengths, cfg["micro_tokens"])
    ctx.update(batch=batch, lengths=lengths)
    finite, n_feats, row = True, 0, {}
    with phase(ctx, row):
        for mb in mbs:
            sub, _ = micro_batch(batch, mb, ctx["device"])
            lp, feats, valid = score(ctx["model"], sub, ends[mb], cfg["temperature"], cfg["chunk_size"])
            finite &= bool(torch.isfinite(lp).all()) and bool(torch.isfinite(feats[valid]).all())
            n_feats += int(valid.sum())
    return dict(row, micro_batches=len(mbs), tokens=sum(lengths), features=n_feats, finite=finite,
                plan_gib=plan_terms(ctx, "generation copy"))


def check_update(ctx):
    cfg, device = ctx["cfg"], ctx["device"]
    lm = bench.random_model(ctx["cut"], device, dtype=torch.float32, seed=1)
    lm.config.use_cache = False
    checkpoint_activations(lm)
    policy = LogprobModel(lm)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    mb = micro_batches(ctx["lengths"], cfg["micro_tokens"])[-1]  # the longest rows come last
    adv = torch.randn(len(ctx["lengths"]), generator=torch.Generator().manual_seed(2))
    row = {}
    try:
        with phase(ctx, row):
            st = update(policy, opt, None, ctx["batch"], None, adv, [mb], cfg, device)
    finally:
        del policy, opt, lm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(row, rows=len(mb), padded_tokens=len(mb) * max(ctx["lengths"][i] for i in mb),
                loss=round(st["loss"], 4), grad_norm=st["grad_norm"],
                plan_gib=plan_terms(ctx, "training state", "generation copy", "activations",
                                    "log-prob chunk"))


def check_decode(ctx):
    s, args = ctx["sizes"], ctx["args"]
    bargs = bench.build_parser().parse_args(
        ["--samples", str(s["group"]), "--max-new-tokens", str(s["new"]), "--repeat", "1",
         "--temperature", str(ctx["cfg"]["temperature"])])
    rows = bench.measure(ctx["model"], ctx["tok"], ctx["prompts"], bargs, [], args.bandwidth)
    paths = {r.pop("path"): {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
             for r in rows}
    gpu = torch.cuda.get_device_name() if ctx["device"].type == "cuda" else "cpu"
    return dict(rows=s["prompts"] * s["group"], prompt_len=s["prompt_len"], new_tokens=s["new"], gpu=gpu,
                bandwidth_tbs=args.bandwidth, bandwidth_note="given by --bandwidth (default: the H200's), "
                "not measured", **paths)


def check_toy_fsdp(ctx):
    out = os.path.join(ctx["args"].out, "toy-fsdp")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *TOY_STEPS, "--out", out]
    cmd += TOY_DRY if ctx["args"].dry_run else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=ctx["args"].toy_timeout)
    seconds = round(time.perf_counter() - t, 1)
    if done.returncode:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"train.py exited {done.returncode} after {seconds} s: {tail}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if not r.get("eval")]
    ckpt = latest_checkpoint(out, say=lambda m: None)
    return dict(seconds=seconds, command=" ".join(cmd[1:]).replace(ROOT + os.sep, ""),
                steps=[{"step": r["step"], **{k: r.get(k) for k in STEP_FIELDS}} for r in steps],
                checkpoint=os.path.basename(ckpt) if ckpt else None)


CHECKS = [("build", check_build), ("rollout", check_rollout), ("labels", check_labels),
          ("score", check_score), ("update", check_update), ("decode", check_decode),
          ("toy_fsdp", check_toy_fsdp)]


def run_checks(checks, ctx, out):
    """Each check in turn, one JSON line for each on stdout and in OUT/gpu_check.jsonl; a failure
    becomes an "error" line (traceback in OUT/gpu_check.log). Returns the names that failed."""
    failed = []
    with open(os.path.join(out, "gpu_check.jsonl"), "w") as lines, \
            open(os.path.join(out, "gpu_check.log"), "w") as log:
        for name, fn in checks:
            try:
                row = {"check": name, **fn(ctx)}
            except Exception as e:  # noqa: BLE001  one broken phase must not hide the others
                ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(ROOT)]
                where = f"{os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno}"
                row = {"check": name, "error": f"{type(e).__name__}: {str(e)[:1500]} (at {where})"}
                log.write(f"== {name}\n{traceback.format_exc()}\n")
                failed.append(name)
            line = json.dumps(row)
            print(line, flush=True)
            lines.write(line + "\n")
            lines.flush()
    return failed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", required=True, help="run every check (" +
                   ", ".join(n for n, _ in CHECKS) + ")")
    p.add_argument("--config", default=os.path.join(ROOT, ".device", "r1_distill_qwen_7b"),
                   help="folder with the 7B config.json and tokenizer (default: .device/r1_distill_qwen_7b)")
    p.add_argument("--out", required=True, help="folder for gpu_check.jsonl, gpu_check.log and toy-fsdp/")
    p.add_argument("--dry-run", action="store_true", help="tiny widths and sizes on the CPU (the test)")
    p.add_argument("--bandwidth", type=float, default=4.8, help="GPU memory bandwidth in TB/s for the "
                   "decode floor (default 4.8, the H200's)")
    p.add_argument("--toy-timeout", type=int, default=180, help="seconds for the toy_fsdp subprocess")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from transformers.utils import logging
    logging.set_verbosity_error()  # generation-config notes would bury the JSON lines
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops gain nothing from threads on a shared CPU, as in train.py
    ctx = Context(args=args, device=device, sizes={**SIZES, **DRY} if args.dry_run else dict(SIZES))
    return 1 if run_checks(CHECKS, ctx, args.out) else 0


if __name__ == "__main__":
    sys.exit(main())
