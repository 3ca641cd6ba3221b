"""The GPU check of the 7B recipe on one H100 80 GB, planned to use at most 8 minutes of a lend's 15 with
the machine's start, so that a rerun fits (time-boxed; not collected by pytest: tests/test_gpu_check.py
runs its dry run):

    python tests/gpu_check.py --all --config DIR --out OUT              # on an H100 (or an H200)
    python tests/gpu_check.py --all --dry-run --config DIR --out OUT    # tiny, on the CPU

--config DIR is a folder with DeepSeek-R1-Distill-Qwen-7B's config.json and tokenizer, no weights
(`hf download deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --include "*.json" --local-dir DIR`). The
maintainers' prepared GPU machine runs it through `.device/check.sh`, with its own copy of that
folder and the pinned wheels. The model is that architecture at its full depth (28 layers, hidden
3584, 28 heads over 4 KV heads, vocab 152,064, N = 7.62 B) with random weights. Sizes are one rank's
of the 8-GPU recipe (4 prompts x 6 samples = 24 rows). The checks run in this order, what a first GPU
run most needs first; the seconds are estimates for an H100 (CHECKS), and a check the time box has
no room for is skipped:

  check        what it runs                                                                    H100, est.
  world8       rank 0 of the 8-GPU recipe in one process, under torch's fake process group (world 8;    75 s
               its collectives move no data: one rank's memory and compute, no communication): the
               policy meta-built and sharded by parallel.wrap as checkpoint.load_sharded does (random
               weights; the bf16 copy filled by refresh_sampler), real AdamW; rank 0's phases at the
               recipe's shapes: the rollout's static buffers (24 x 9216: a prefill of 4 x 600 tokens,
               32 steps), the labels' widest chunk (2 responses of 8000 tokens), one update micro-batch
               of 16,384 tokens with checkpointing and the AdamW step (its tokens/s); each phase's
               seconds and peak, and the peak allocated and reserved beside the plan's for 8 x 80 GiB
               (52.9 GiB, less its runtime)
  build        the fp32 trainer (4 N = 30.5 GB) and parallel.wrap's bf16 copy (2 N = 15.2 GB), as       15 s
               train.py holds them in one process; the torch, transformers, peft and NCCL versions
  decode       a 1 GiB device copy (the bandwidth measured); then 24 rows after prompts of 6000 tokens,  150 s
               255 steps each of: static-sdpa, the model's own step (masked SDPA over the live length's
               bucket: the default); fused (StaticDecoder.fused: one QKV and one gate-up GEMM,
               flex_attention over the written 128-key blocks, a KV head's 7 query heads as its query
               rows); fused-compiled (its RMSNorm, rotary and SiLU-mul compiled too). Each path a
               warm-up call (compiles, captures), then a timed one: ms a step, % of the floor at the
               card's own bandwidth (memory clock x bus width) and at the copy's, the kernel inductor
               chose for flex_attention (flex decoding or the main kernel) and the top kernels of
               three replayed steps, which name the attention kernel that ran
  fp32_tokens  4 layers at 7B width in fp32, weights large enough that no token is decided by rounding:    90 s
               fused and fused-compiled against static-sdpa, 24 rows x 64 tokens after 512-token
               prompts, EOS on (some rows finish): the same tokens and finish reasons, and the largest
               |log-prob difference|, which holds the Triton kernels to the plain step
  rollout      rollout.generate, static, scores on, EOS off: 24 rows x 512 tokens after 600-token      15 s
               prompts, then again warm and without scores; the captures counted and timed
  labels       label.mc_labels at real lengths: 24 random responses of 200..8000 tokens, 72 cuts,       20 s
               k = 4, chunks of 8 cuts (buffers up to 32 x 7168), features on; the captures counted
  toy_fsdp     train.py --offload --grad-ckpt, 2 toy steps: a one-rank FSDP2 group (sharding, CPU      40 s
               offload, refresh_sampler, the DTensor grad norm, a save, parallel.leave)
  toy_eval     evaluate.py on the toy benchmark with the toy base: the static path, the post-hoc      60 s
               probe, the early exit

Each in-process check records its seconds and the most memory it added above what was held when it
began (torch.cuda.max_memory_allocated; on the CPU tests/live_bytes.py), beside the plan's terms for
what it allocates (harness/plan.py, the check's sizes), their sum and measured / planned; the toy
runs their step rows' peak_mem beside the plan's peak for their settings (less the runtime on a GPU,
which peak_mem does not see). A ratio above 1 is memory no plan term counts.

What one GPU cannot show: anything between ranks. Neither a one-rank group nor the fake one moves
data between ranks, so NCCL's traffic, the time of FSDP2's gathers and reduce-scatters, and ranks
waiting on each other are not measured; nor anything that needs trained weights (lengths, labels and
accuracies of random weights mean nothing).

Out: OUT/gpu_check.jsonl (a JSON line per check, also on stdout), OUT/gpu_check.txt (the summary
table, also printed, headed by the packages it measured with and the plan's device time) and
OUT/gpu_check.log (tracebacks, the toy runs' output): three files; the toy runs write into a temporary
folder, removed at the end. A failing check is an {"check", "error"} line and the others still run; a
check the time box has no room for, an {"check", "skipped"} line. The exit code is 1 if any failed.
"""
import argparse
import copy
import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project root, when run as a script
import label  # noqa: E402
import rollout  # noqa: E402
import static_shapes  # noqa: E402  (beside this file)
from grpo import pack, token_logprobs  # noqa: E402
import rollout as sampling  # noqa: E402
from harness import parallel, plan, staticcache  # noqa: E402
from harness.checkpoint import latest_checkpoint  # noqa: E402
from harness.files import UserError  # noqa: E402
from config import COMMON, REAL  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402  (beside this file)
import bench  # noqa: E402  (beside this file)
from train import checkpoint_activations  # noqa: E402
from grpo import micro_batches, update  # noqa: E402
from label import FORCED  # noqa: E402

GiB = 2**30
SHAPE = staticcache._Shape  # the static decoder's buffer set, whose captures `capturing` times
# Sizes on the GPU: one rank of the 8-GPU recipe (config.py: REAL); --dry-run takes DRY's for the CPU.
SIZES = dict(layers=None, prompts=4, group=6, prompt_len=plan.PROMPT_TOKENS, rollout_new=512,
             shortest=200, longest=REAL["max_new_tokens"], k=4, answer_tokens=plan.FORCED_ANSWER,
             decode_prompt=6000, decode_steps=256, profile_steps=3, copy_mib=1024,
             fp32_layers=4, fp32_prompt=512, fp32_steps=64,
             eval_flags=["--limit", "16", "--probe-questions", "16", "--probe-samples", "4"],
             world=8, world_steps=32, recipe={})
# the vocabulary stays (the pad id and </think> are near its end); prompt_len is the toy world's,
# which the plan assumes for --model toy
DRY = dict(layers=2, hidden=64, heads=4, kv_heads=2, prompts=2, group=2, prompt_len=plan.TOY_PROMPT_TOKENS,
           rollout_new=16, shortest=8, longest=48, k=2, answer_tokens=8, decode_prompt=40, decode_steps=8,
           copy_mib=16, fp32_layers=1, fp32_prompt=16, fp32_steps=8, world_steps=4,
           recipe=dict(group_size=2, max_new_tokens=48, micro_tokens=128, chunk_size=128, k=2),
           eval_flags=["--limit", "4", "--n-samples", "2", "--probe-questions", "4", "--probe-samples", "2"])
TOY_DRY = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16"]  # the CPU is slow
STEP_FIELDS = ("ratio_mean", "sampler_gap", "sampler_kl_k3", "sampler_ratio_max", "entropy", "grad_norm",
               "captures", "t_rollout", "t_label", "t_update", "peak_mem")


class Context(dict):
    """What the checks hand on to later ones; a missing entry names the check that did not run."""

    def __missing__(self, key):
        raise RuntimeError(f"needs {key!r} from an earlier check, which failed")


def gib(x):
    """Bytes in GiB to 4 significant digits (the dry run's are a few KiB)."""
    return None if x is None else float(f"{x / GiB:.4g}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def phase(ctx, row):
    """Time the block; put its seconds into `row`, and what was held when it began (CUDA) and the
    most it added above that: yields a namespace whose .added (bytes) is set at the end."""
    device, m = ctx["device"], SimpleNamespace(added=None)
    cuda, held = device.type == "cuda", 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        row["held_gib"] = gib(held)
    meter = nullcontext() if cuda else LiveBytes()
    t = time.perf_counter()
    with meter:
        yield m
    sync(device)
    row["seconds"] = round(time.perf_counter() - t, 2)
    m.added = torch.cuda.max_memory_allocated() - held if cuda else meter.peak
    row["added_gib"] = gib(m.added)


def versus_plan(row, measured, terms):
    """The plan's terms (name -> bytes) for what `measured` bytes are, their sum and measured / sum."""
    total = sum(terms.values())
    row.update(plan_gib={k: gib(v) for k, v in terms.items()}, expected_gib=gib(total),
               ratio=round(measured / total, 3) if total and measured is not None else None)
    return row


@contextmanager
def capturing(device):
    """The static decoder's captures inside the block (a CUDA graph each on a GPU, after one warm-up
    step; on the CPU the eager step it would be): count, live lengths and seconds."""
    rec, capture = SimpleNamespace(count=0, lengths=[], seconds=0.0), SHAPE.capture

    def timed(shape, model, n):
        sync(device)
        t = time.perf_counter()
        out = capture(shape, model, n)
        sync(device)
        rec.count, rec.seconds = rec.count + 1, rec.seconds + time.perf_counter() - t
        rec.lengths.append(n)
        return out
    SHAPE.capture = timed
    try:
        yield rec
    finally:
        SHAPE.capture = capture


def run_cfg(ctx, new):
    """The run's settings with this check's sizes and `new` tokens: what plan.estimate and update read."""
    s = ctx["sizes"]
    return {**COMMON, **REAL, "model": "toy" if ctx["args"].dry_run else "gpu-check",
            "prompts_per_step": s["prompts"], "group_size": s["group"], "max_new_tokens": new, "k": s["k"],
            "grad_ckpt": True}


def planned(ctx, new):
    return plan.estimate(ctx["cfg"], run_cfg(ctx, new), 1, ctx["device"].type, False, ctx["counts"])


def model_config(ctx):
    """The 7B's config (tiny widths with --dry-run) and tokenizer into ctx, for the first check that needs them."""
    if "cfg" in ctx:
        return
    s, args = ctx["sizes"], ctx["args"]
    cfg = bench.cut_config(args.config, s["layers"])
    if args.dry_run:
        cfg.hidden_size, cfg.intermediate_size = s["hidden"], 2 * s["hidden"]
        cfg.num_attention_heads, cfg.num_key_value_heads = s["heads"], s["kv_heads"]
        cfg.head_dim = s["hidden"] // s["heads"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.config)
    vocab = min(len(tok), cfg.vocab_size)
    ctx.update(cfg=cfg, tok=tok, vocab=vocab, counts=plan.param_counts(cfg),
               prompts=bench.random_prompts(vocab, s["prompts"], s["prompt_len"], seed=0))


def check_build(ctx):
    """The trainer and its bf16 copy, as train.py holds them; the sampler stays for the decode (the
    trainer, which no later check updates, goes)."""
    model_config(ctx)
    s, device, cfg = ctx["sizes"], ctx["device"], ctx["cfg"]
    row = {}
    with phase(ctx, row) as m:  # train.load_policy's order, then its one-process wrap
        lm = bench.random_model(cfg, device, dtype=torch.float32, seed=0)
        lm.config.use_cache = False
        checkpoint_activations(lm)
        policy, sampler = parallel.wrap(lm, device, token_logprobs)
    ctx["sampler"] = sampler.eval()
    assert plan.prompt_tokens(run_cfg(ctx, 1)) == s["prompt_len"], "the plan assumes another prompt length"
    t = planned(ctx, s["rollout_new"])
    versus_plan(row, m.added, {"generation copy": t["generation copy"],
                               "fp32 weights (training state / 4)": t["training state"] / 4})
    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    versions = {name: version(name) for name in ("torch", "transformers", "peft")}
    versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if gpu else None  # torch's bundled one
    return dict(row, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                kv_heads=cfg.num_key_value_heads, vocab=cfg.vocab_size, params=sum(p.numel() for p in lm.parameters()),
                plan_params=ctx["counts"][0], sampler_dtype=str(next(sampler.parameters()).dtype),
                device=gpu.name if gpu else "cpu", device_gib=gib(gpu.total_memory) if gpu else None, **versions,
                headline=f"{ctx['counts'][0] / 1e9:.2f} B parameters, {cfg.num_hidden_layers} layers; "
                         f"{gpu.name if gpu else 'cpu'}, " + ", ".join(f"{k} {v}" for k, v in versions.items()))


def version(package):
    """The installed version of `package`, None where it is missing (peft may be, on a GPU machine)."""
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed(package)
    except PackageNotFoundError:
        return None


def check_rollout(ctx):
    s, sampler, device = ctx["sizes"], ctx["sampler"], ctx["device"]
    cfg, row = run_cfg(ctx, s["rollout_new"]), {}
    with capturing(device) as caps, static_shapes.recording() as shapes, phase(ctx, row) as m:
        out = rollout.generate(sampler, ctx["tok"], ctx["prompts"], n=s["group"], max_new_tokens=s["rollout_new"],
                               temperature=cfg["temperature"], eos_ids=[], seed=0, batch_size=cfg["gen_batch"],
                               decode="static", scores=True)
    t0 = time.perf_counter()  # the same call warm and without scores: what scoring costs a step
    rollout.generate(sampler, ctx["tok"], ctx["prompts"], n=s["group"], max_new_tokens=s["rollout_new"],
                     temperature=cfg["temperature"], eos_ids=[], seed=0, batch_size=cfg["gen_batch"],
                     decode="static")
    sync(device)
    plain_ms = (time.perf_counter() - t0) / (s["rollout_new"] - 1) * 1e3
    staticcache.release(sampler)  # as train.py does before the labels
    t = planned(ctx, s["rollout_new"])
    versus_plan(row, m.added, {"KV cache": t["KV cache"], "prefill": t["prefill"]})
    decode_s = row["seconds"] - caps.seconds
    ms = decode_s / (s["rollout_new"] - 1) * 1e3  # the prefill (2400 tokens) counted in: about 1 %
    return dict(row, rows=len(out.ids), new_tokens=s["rollout_new"], tokens=sum(out.lengths), min_len=min(out.lengths),
                ms_step=round(ms, 2), ms_step_no_scores_warm=round(plain_ms, 2),
                captures=caps.count, capture_seconds=round(caps.seconds, 2),
                live_lengths=caps.lengths, kv_vs_plan=round(shapes.made[-1]["bytes"] / t["KV cache"], 3),
                headline=f"{len(out.ids)} rows x {s['rollout_new']} tokens: {ms:.2f} ms a step "
                         f"({plain_ms:.2f} warm without scores), "
                         f"{caps.count} captures in {caps.seconds:.2f} s")


def check_labels(ctx):
    s, sampler, device = ctx["sizes"], ctx["sampler"], ctx["device"]
    cfg, n = run_cfg(ctx, s["longest"]), s["prompts"] * s["group"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(s["shortest"], s["longest"], n).long().tolist()
    responses = [torch.randint(ctx["vocab"], (m,), generator=g).tolist() for m in lengths]
    prompts = [ctx["prompts"][i // s["group"]] for i in range(n)]
    cuts = [label.cuts_of(m, cfg["budgets"]) for m in lengths]
    stats, row, answers = {}, {}, label.forced_answers

    def counted(*a, **kw):  # the distinct forced prompts mc_labels asks (forced_answers' cuts)
        stats["forced_prompts"] = len(a[5])
        return answers(*a, **kw)
    label.forced_answers = counted
    try:
        with capturing(device) as caps, static_shapes.recording() as shapes, phase(ctx, row) as m:
            _, feats = label.mc_labels(sampler, ctx["tok"], prompts, responses, cuts, ["1"] * n, k=s["k"],
                                       sampling=dict(FORCED, max_new_tokens=s["answer_tokens"]),
                                       seed=0, batch_size=cfg["gen_batch"],
                                       grader="strict", decode="static", features=True)
    finally:
        label.forced_answers = answers
    staticcache.release(sampler)  # as train.py does before the update
    t = planned(ctx, s["longest"])
    versus_plan(row, m.added, {"label KV cache": t["label KV cache"], "label prefill": t["label prefill"]})
    alive_kv = max((x["alive_bytes"] for x in shapes.made), default=0)
    return dict(row, trajectories=n, lengths=[min(lengths), max(lengths)], k=s["k"], batch_size=cfg["gen_batch"],
                forced_prompts=stats.get("forced_prompts"), features=sum(map(len, feats)),
                features_finite=all(bool(torch.isfinite(f).all()) for f in feats),
                captures=caps.count, capture_seconds=round(caps.seconds, 2), shapes_made=len(shapes.made),
                shapes_max_alive=max((x["alive"] for x in shapes.made), default=0), shapes_max_alive_kv_gib=gib(alive_kv),
                kv_vs_plan=round(alive_kv / t["label KV cache"], 3),
                headline=f"{stats.get('forced_prompts')} cuts of responses up to {max(lengths)} tokens: "
                         f"{len(shapes.made)} shapes, {caps.count} captures in {caps.seconds:.2f} s")


def copy_bandwidth(device, mib, reps=10):
    """TB/s of a device-to-device copy of `mib` MiB, counting the bytes read and the bytes written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - t) / 1e12


def card_bandwidth(device):
    """The card's own peak memory bandwidth in TB/s: its memory clock (kHz) x bus width, double data
    rate (an H100 SXM's 3.35, an H200's 4.8); None on the CPU, or where torch does not say them."""
    p = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    clock, bus = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    return 2 * clock * 1e3 * bus / 8 / 1e12 if clock and bus else None


@contextmanager
def flex_kernel():
    """The kernel inductor chooses for flex_attention while compiling inside the block, from its debug
    line ("Use flex decoding True/False"): yields a list that fills with "flex decoding" (split-KV, one
    pass over K/V per KV head) or "flex attention" (the main kernel); empty where nothing compiled."""
    chosen, logger = [], logging.getLogger("torch._inductor.kernel")

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Use flex decoding"):
                chosen.append("flex decoding" if record.args[0] else "flex attention")
    keep, was = Keep(), (logger.level, logger.propagate)
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # inductor's other debug lines stay out of the output
    try:
        yield chosen
    finally:
        logger.removeHandler(keep)
        logger.setLevel(was[0])
        logger.propagate = was[1]


@contextmanager
def profiled(device, first, count):
    """A profile of the decode steps first .. first + count - 1 inside the block (each a graph replay on a
    GPU): yields a list that fills with its kernels (ops on the CPU), [name, ms a step], longest first."""
    top, run, calls = [], SHAPE.run, [0]
    cuda = device.type == "cuda"
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda
                                              else torch.profiler.ProfilerActivity.CPU])

    def counted(shape, model, n):
        calls[0] += 1
        if calls[0] == first:
            sync(device)
            prof.start()
        out = run(shape, model, n)
        if calls[0] == first + count - 1:
            sync(device)
            prof.stop()
        return out
    SHAPE.run = counted
    try:
        yield top
    finally:
        SHAPE.run = run
    if calls[0] >= first + count - 1:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
        top += [[e.key[:90], round(getattr(e, key) / count / 1e3, 4)] for e in events if getattr(e, key) > 0]


ATTENTION = re.compile("attention|attn|fmha|flash|sdpa|flex|_tem_", re.IGNORECASE)  # SDPA's kernels, flex's Triton template


def decode_call(model, tok, prompts, s, fused):
    """One decode of `prompts` x s["group"] rows, s["decode_steps"] tokens, EOS off, timed apart from its
    prefill -> (seconds, captures). fused: StaticDecoder.fused (False: the model's own step)."""
    sampler = sampling.Sampler(model, tok, max_new_tokens=s["decode_steps"], temperature=0.8, eos_ids=[],
                               decode="static")
    was, sampler.static.fused = sampler.static.fused, fused
    try:
        prefix = sampler.prefill(prompts)
        gen = rollout.chunk_generators(0, 1, sampler.device)[0]
        before = staticcache.captures()
        sync(sampler.device)
        t = time.perf_counter()
        sampler.sample(prefix, s["group"], gen)
        sync(sampler.device)
        return time.perf_counter() - t, staticcache.captures() - before
    finally:
        sampler.static.fused = was


DECODE_PATHS = {"static-sdpa": False, "fused": True, "fused-compiled": "compiled"}  # name -> StaticDecoder.fused


def check_decode(ctx):
    s, args, device, tok = ctx["sizes"], ctx["args"], ctx["device"], ctx["tok"]
    model = ctx["sampler"].eval()
    t0 = time.perf_counter()
    measured = copy_bandwidth(device, s["copy_mib"])
    card = args.bandwidth or card_bandwidth(device)
    prompts = bench.random_prompts(ctx["vocab"], s["prompts"], s["decode_prompt"], seed=1)
    rows, width, steps = s["prompts"] * s["group"], s["decode_prompt"], s["decode_steps"]
    floor_bytes = bench.read_bytes(model, *bench.attended("dynamic", rows, width, steps))  # the exact live K/V
    floor = {"card": round(floor_bytes / (card * 1e12) * 1e3, 3) if card else None,
             "copy": round(floor_bytes / (measured * 1e12) * 1e3, 3)}
    paths, kernel = {}, None
    for name, fused in DECODE_PATHS.items():
        try:  # a warm-up call compiles and captures, the last few of its steps profiled; the timed call replays
            with flex_kernel() as chosen, profiled(device, steps - 1 - s["profile_steps"], s["profile_steps"]) as top:
                warm, warm_caps = decode_call(model, tok, prompts, s, fused)
            sec, caps = decode_call(model, tok, prompts, s, fused)
            ms = sec / (steps - 1) * 1e3  # the first token comes from the prefill
            # the fused step reads the written positions (to a block), the model's the live length's bucket
            read = bench.read_bytes(model, *bench.attended("dynamic" if fused else "static", rows, width, steps))
            kernel = (chosen or [kernel])[-1] if fused else None  # flex's graph for the shape: compiled once
            paths[name] = dict(ms_step=round(ms, 3), captures=caps, warm_up_seconds=round(warm, 2),
                               warm_up_captures=warm_caps, mb_step=round(read / 1e6, 1),
                               of_floor=round(floor["card"] / ms, 3) if card else None,
                               of_copy_floor=round(floor["copy"] / ms, 3),
                               flex_kernel=kernel, attention_kernels=[k for k in top if ATTENTION.search(k[0])][:3],
                               top_kernels=top[:8])
        except Exception as e:  # noqa: BLE001  one path's failure leaves the others' numbers
            ctx["log"].write(f"== decode {name}\n{traceback.format_exc()}\n")
            paths[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        staticcache.release(model)  # each path's buffers and graphs go before the next's
    gc.collect()
    at = f"{card:.3g} TB/s, the card's" if card else f"{measured:.3g} TB/s, a copy's"
    return dict(seconds=round(time.perf_counter() - t0, 2), rows=rows, prompt_len=width, steps=steps,
                copy_tbs=float(f"{measured:.4g}"), card_tbs=float(f"{card:.4g}") if card else None,
                floor_ms=floor, floor_mb_step=round(floor_bytes / 1e6, 1), paths=paths,
                headline=", ".join(f"{k} {v['ms_step']:.2f} ms ({100 * (v['of_floor'] or v['of_copy_floor']):.0f} %"
                                   + (f", {v['flex_kernel']}" if v["flex_kernel"] else "") + ")"
                                   for k, v in paths.items() if "ms_step" in v)
                         + f" a step; floor {floor['card'] or floor['copy']:.2f} ms at {at}")


def check_fp32_tokens(ctx):
    """A few layers at 7B width in fp32: the fused step's tokens (compiled: Triton on a GPU) against the
    model's own step's, with EOS on so that finished rows are in it; weights large enough (std 3 /
    sqrt(hidden)) that rounding decides no token."""
    s, device, tok = ctx["sizes"], ctx["device"], ctx["tok"]
    cfg = copy.deepcopy(ctx["cfg"])  # the dry run's tiny widths too
    cfg.num_hidden_layers = s["fp32_layers"]
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:s["fp32_layers"]]
    t0 = time.perf_counter()
    lm = bench.random_model(cfg, device, dtype=torch.float32, seed=5).eval()
    randomize(lm, 3 / cfg.hidden_size ** 0.5)
    prompts = bench.random_prompts(ctx["vocab"], s["prompts"], s["fp32_prompt"], seed=2)
    decoder = staticcache.decoder(lm, sampling.Sampler(lm, tok).cache_kw)

    def sample(fused, eos):
        decoder.fused = fused
        return rollout.generate(lm, tok, prompts, n=s["group"], max_new_tokens=s["fp32_steps"], temperature=1.0,
                                seed=0, eos_ids=eos, decode="static", scores=True)
    try:
        eos = [sample(False, []).ids[1][s["fp32_steps"] // 4]]  # a token a row samples: some rows finish
        ref, paths, kernel = sample(False, eos), {}, None
        for name, fused in list(DECODE_PATHS.items())[1:]:
            with flex_kernel() as chosen:
                out = sample(fused, eos)
            kernel = (chosen or [kernel])[-1]
            same = out.ids == ref.ids and out.finish == ref.finish
            gap = max((abs(a - b) for x, y in zip(out.logprobs, ref.logprobs) for a, b in zip(x, y)), default=0.0)
            paths[name] = dict(same_tokens=same, max_logprob_diff=float(f"{gap:.3g}"), flex_kernel=kernel)
    finally:
        staticcache.release(lm)
        del lm
        gc.collect()
    return dict(seconds=round(time.perf_counter() - t0, 2), layers=cfg.num_hidden_layers, rows=len(ref.ids),
                steps=s["fp32_steps"], finished_early=sum(f == "eos" for f in ref.finish), paths=paths,
                headline=", ".join(f"{k}: {'the same tokens' if v['same_tokens'] else 'OTHER TOKENS'} "
                                   f"(max |d logp| {v['max_logprob_diff']:.2g})" for k, v in paths.items())
                         + f" as static-sdpa's, {sum(f == 'eos' for f in ref.finish)} of {len(ref.ids)} rows ended by EOS")


@torch.no_grad()
def randomize(lm, std):
    """Random weights in place, into each rank's shard of a sharded model: norms 1, the rest N(0, std^2)."""
    for name, p in lm.named_parameters():
        x = p.to_local() if hasattr(p, "to_local") else p
        x.fill_(1.0) if name.endswith("norm.weight") else x.normal_(0.0, std)


@contextmanager
def rank0_scatters(world):
    """torch 2.11's fake group leaves a reduce-scatter's output unset (2.13's fills it with rank 0's
    chunk): garbage gradients could make the norm non-finite. Inside the block, 2.13's fill, always."""
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    was = {n: getattr(dist, n) for n in names}

    def filled(fn):
        def call(output, input, *args, **kwargs):
            work = fn(output, input, *args, **kwargs)  # the fake group's is done when it returns
            output.copy_(input.reshape(world, -1)[0].view_as(output))
            return work
        return call
    for n in names:
        setattr(dist, n, filled(was[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, was[n])


def check_world8(ctx):
    """Rank 0 of the 8-GPU recipe in one process, under torch's fake process group of 8: its
    collectives return at once with rank 0's own data in every slot, so shards, gather buffers and the
    phases' memory and compute are one rank's, and no communication is measured."""
    model_config(ctx)
    free_models(ctx)
    s, device, config, tok = ctx["sizes"], ctx["device"], ctx["cfg"], ctx["tok"]
    world, cuda = s["world"], device.type == "cuda"
    recipe = {**COMMON, **REAL, "model": "toy" if ctx["args"].dry_run else "gpu-check", **s["recipe"]}
    t = plan.estimate(config, recipe, world, device.type, False, ctx["counts"])
    P, new, group, k = plan.prompt_tokens(recipe), recipe["max_new_tokens"], recipe["group_size"], recipe["k"]
    prompts = bench.random_prompts(ctx["vocab"], -(-recipe["prompts_per_step"] // world), P, seed=3)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    was, parallel.WORLD, row, phases = parallel.WORLD, world, {}, {}  # what slots() and all_sum read
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    meter, t0 = nullcontext() if cuda else LiveBytes(), time.perf_counter()
    held = torch.cuda.memory_allocated() if cuda else 0  # what earlier checks left (LiveBytes starts at 0)

    def peak():  # the most bytes this check has held at once so far
        return torch.cuda.max_memory_allocated() - held if cuda else meter.peak

    @contextmanager
    def timed(name):  # seconds, and the check's peak so far (GiB) at the end of the phase
        sync(device)
        start = time.perf_counter()
        yield
        sync(device)
        phases[name] = dict(seconds=round(time.perf_counter() - start, 2), peak_gib=gib(peak()))
    try:
        with meter:
            with timed("build"):  # as checkpoint.load_sharded does it, random weights for rank 0's reads
                with torch.device("meta"):
                    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                lm.config.use_cache = False
                checkpoint_activations(lm)
                policy, sampler = parallel.wrap(lm, device, token_logprobs)
                policy.to_empty(device=device)
                torch.manual_seed(0)
                randomize(lm, config.initializer_range)
                parallel.rebuild_buffers(lm, device)
                sampler.to_empty(device=device)
                parallel.refresh_sampler(sampler, policy, frozen=True)  # the gathers' buffers; 8 x rank 0's
                parallel.rebuild_buffers(sampler, device)
            opt = torch.optim.AdamW(policy.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
            with timed("rollout"), static_shapes.recording() as kv:  # the static path's buffers, a few steps
                smp = sampling.Sampler(sampler, tok, max_new_tokens=new, eos_ids=[], decode="static")
                prefix = smp.prefill(prompts)
                step = smp.static.start(sampler, prefix, group, new)
                prefix.cache, logits = None, prefix.logits.repeat_interleave(group, 0)
                done = torch.zeros(len(logits), dtype=torch.bool, device=device)
                for _ in range(s["world_steps"]):  # greedy: the tokens do not matter here
                    logits = step(logits.argmax(-1), done)[:len(done)]
            staticcache.release(sampler)
            g = torch.Generator().manual_seed(4)  # the longest responses: the labels' widest chunk
            longest = [torch.randint(ctx["vocab"], (new,), generator=g).tolist() for _ in range(2)]
            cuts = [label.cuts_of(new, recipe["budgets"])] * 2
            with timed("labels"), static_shapes.recording() as lab:
                label.mc_labels(sampler, tok, prompts[:1] * 2, longest, cuts, ["1"] * 2, k=k, seed=0,
                                batch_size=recipe["gen_batch"],  # plan.FORCED_ANSWER tokens
                                grader="strict", decode="static", features=True)
            half = recipe["micro_tokens"] // 2  # two rows of half the micro-batch each: one micro-batch
            batch = pack(prompts[:1] * 2, [r[:half - P] for r in longest], tok.pad_token_id)
            mbs = micro_batches(batch["attention_mask"].sum(1).tolist(), recipe["micro_tokens"])
            with timed("update"), rank0_scatters(world):
                st = update(policy, opt, batch, None, torch.tensor([1.0, -1.0]), mbs, recipe, device)
    finally:
        parallel.WORLD = was
        dist.destroy_process_group()
    top, reserved = peak(), torch.cuda.max_memory_reserved() if cuda else None  # the allocator's, fragments too
    local = lambda ts: sum(x.to_local().numel() * x.element_size() for x in ts)  # noqa: E731  rank 0's shards
    moments = [x for v in opt.state.values() for x in v.values() if hasattr(x, "to_local")]
    weights, adam = local(policy.parameters()), local(moments)
    del policy, sampler, lm, opt, moments, step, logits
    gc.collect()
    # the plan's peak less its runtime, which max_memory_allocated does not see (nor LiveBytes)
    kept = {name: t[name] for name in ("training state", "generation copy")}  # through every phase
    versus_plan(row, top, {**kept, "largest phase": t["peak"] - sum(kept.values()) - t["runtime"]})
    times = ", ".join(f"{name} {v['seconds']:.1f} s" for name, v in phases.items())
    tok_s = round(batch["attention_mask"].numel() / phases["update"]["seconds"])  # forward, backward, AdamW
    mem = f"{gib(top):.4g} GiB allocated ({row['ratio']} x)" + (f", {gib(reserved):.4g} reserved ("
                                                                f"{reserved / row['expected_gib'] / GiB:.3f} x)" if cuda else "")
    return dict(row, seconds=round(time.perf_counter() - t0, 2), added_gib=gib(top), world=world,
                reserved_gib=gib(reserved), reserved_ratio=round(reserved / row["expected_gib"] / GiB, 3) if cuda else None,
                update_tok_s=tok_s,
                phases=phases, plan_peak_gib=gib(t["peak"]), weights_gib=gib(weights), adam_gib=gib(adam),
                plan_state_gib=gib(t["training state"]), kv_shape=[kv.made[0]["rows"], kv.made[0]["length"]],
                plan_kv_shape=list(t["kv_shape"]), label_shapes=[[x["rows"], x["length"]] for x in lab.made],
                plan_label_shape=list(t["label_kv_shape"]), micro_batches=len(mbs),
                micro_tokens=int(batch["attention_mask"].numel()), grad_norm=st["grad_norm"],
                headline=f"rank 0 of {world}, fake group (its memory and compute, no communication): peak "
                         f"{mem} against the plan's {gib(t['peak']):.4g} GiB less runtime; update {tok_s} "
                         f"tokens/s; {times}")


def free_models(ctx):
    """Drop the in-process models before a toy run (it is another process on the same GPU)."""
    for key in ("sampler", "lm", "policy", "rollout"):
        ctx.pop(key, None)
    gc.collect()
    if ctx["device"].type == "cuda":
        torch.cuda.empty_cache()


def recover(ctx):
    """After a failed check (an out-of-memory, say): free the static buffers it may have left with the
    sampler, and the allocator's cache, so that the next checks have the memory they would have had."""
    if "sampler" in ctx:
        staticcache.release(ctx["sampler"])
    gc.collect()
    if ctx.get("device") is not None and ctx["device"].type == "cuda":
        torch.cuda.empty_cache()


def subprocess_run(ctx, name, script, flags):
    """`python script flags --out TMP/name`, in the time the box leaves -> (folder, seconds)."""
    out = os.path.join(ctx["tmp"], name)
    cmd = [sys.executable, os.path.join(ROOT, script), *flags, "--out", out]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    timeout = ctx["time_left"](ctx["args"].toy_timeout)
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = round(time.perf_counter() - t, 1)
    tail = (done.stdout + done.stderr).strip().splitlines()[-30:]
    ctx["log"].write(f"== {name}: {' '.join(cmd[1:])}\n" + "\n".join(tail) + "\n")
    if done.returncode:
        raise RuntimeError(f"{script} exited {done.returncode} after {seconds} s: " + " | ".join(tail[-6:]))
    return out, seconds


def train_toy(ctx, name, flags):
    """Two toy RL steps of train.py with `flags`: their step rows and checkpoint, beside the plan."""
    free_models(ctx)
    flags = ["--steps", "2", "--eval-n", "0", "--save-every", "1", *flags]
    out, seconds = subprocess_run(ctx, name, "train.py", flags + (TOY_DRY if ctx["args"].dry_run else []))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if not r.get("eval")]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cuda = ctx["device"].type == "cuda"
    t = plan.estimate(plan.model_config(cfg["model"]), cfg, 1, ctx["device"].type, bool(cfg.get("offload")))
    ckpt = latest_checkpoint(out, say=lambda m: None)
    row = dict(seconds=seconds, command=" ".join(["train.py", *flags]),
               steps=[{"step": r["step"], **{k: r.get(k) for k in STEP_FIELDS}} for r in steps],
               checkpoint=os.path.basename(ckpt) if ckpt else None, added_gib=max(r["peak_mem"] for r in steps))
    versus_plan(row, row["added_gib"] * GiB, {"peak" + (" less runtime" if cuda else ""):
                                              t["peak"] - (t["runtime"] if cuda else 0)})
    return row, ckpt


def check_toy_fsdp(ctx):
    row, _ = train_toy(ctx, "toy-fsdp", ["--offload", "--grad-ckpt"])
    last = row["steps"][-1]
    return dict(row, headline=f"2 steps on a one-rank group, sampler gap {last['sampler_gap']:.2e}, "
                              f"update {last['t_update']:.1f} s; saved {row['checkpoint']}")


def check_toy_eval(ctx):
    free_models(ctx)
    out, seconds = subprocess_run(ctx, "toy-eval", "evaluate.py",
                                  ["--model", "toy", "--benchmarks", "toy", *ctx["sizes"]["eval_flags"]])
    with open(os.path.join(out, "results.json")) as f:
        res = next(iter(json.load(f).values()))
    b, probe = res["benchmarks"]["toy"], res.get("posthoc_probe", {})
    exits = [{k: e.get(k) for k in ("epsilon", "exit_rate", "test_risk")} for e in b.get("early_exit", [])]
    return dict(seconds=seconds, model="toy", device=res["provenance"]["device"],
                confidence=res["confidence"], n=b["n"], acc=b["acc"], ece=b["ece"], probe_val_bce=probe.get("val_bce"),
                probe_base_bce=probe.get("base_bce"), early_exit=exits,
                headline=f"{b['n']} samples of the toy: acc {b['acc']:.3f}, ECE {b['ece']:.3f}, post-hoc probe, "
                         f"early exit at {len(exits)} risks")


# (name, check, seconds it is given on an H100: the module docstring's estimate), in the order they run
CHECKS = [("world8", check_world8, 75), ("build", check_build, 15), ("decode", check_decode, 150),
          ("fp32_tokens", check_fp32_tokens, 90), ("rollout", check_rollout, 15), ("labels", check_labels, 20),
          ("toy_fsdp", check_toy_fsdp, 40), ("toy_eval", check_toy_eval, 60)]
START_UP = 120  # seconds of device time before the first check: the machine's start, the wheels, imports (est.)
DEVICE_SECONDS = 480  # the most one run may use of a lend's 15 minutes, so that a rerun fits


def device_plan(checks, box):
    """(device seconds planned, a line saying them): the start-up and, in order, the checks whose
    estimates fit the time box; those after that run only if earlier ones leave time."""
    used, fit, later = 0, [], []
    for name, _, needs in checks:
        fits = used + needs <= box
        used += needs if fits else 0
        (fit if fits else later).append(f"{name} {needs}")
    total = START_UP + used
    return total, (f"plan on one H100: start-up {START_UP} + " + " + ".join(fit) + f" = {total} s of device time "
                   f"({total / 60:.1f} of {DEVICE_SECONDS // 60} min)" + (f"; if time is left: {', '.join(later)}"
                                                                        if later else ""))


def run_checks(checks, ctx, out, deadline=None):
    """Each check in turn, one JSON line for each on stdout and in OUT/gpu_check.jsonl; a failure
    becomes an "error" line (traceback in OUT/gpu_check.log), a check that would end past `deadline`
    (time.monotonic()) a "skipped" one. Returns the rows."""
    rows = []
    ctx["time_left"] = lambda cap: cap if deadline is None else max(1, min(cap, deadline - time.monotonic()))
    with open(os.path.join(out, "gpu_check.jsonl"), "w") as lines, \
            open(os.path.join(out, "gpu_check.log"), "w") as log:
        ctx["log"] = log
        for name, fn, needs in checks:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < needs:
                row = {"check": name, "skipped": f"the time box has {left:.0f} s left, it needs about {needs} s"}
            else:
                try:
                    row = {"check": name, **fn(ctx)}
                except Exception as e:  # noqa: BLE001  one broken phase must not hide the others
                    ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(ROOT)]
                    where = f" (at {os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno})" if ours else ""
                    row = {"check": name, "error": f"{type(e).__name__}: {str(e)[:1500]}{where}"}
                    log.write(f"== {name}\n{traceback.format_exc()}\n")
                    recover(ctx)
            line = json.dumps(row)
            print(line, flush=True)
            lines.write(line + "\n")
            lines.flush()
            log.flush()
            rows.append(row)
    return rows


def summary(rows, seconds):
    """The table of gpu_check.txt: the packages it measured with, the device time planned, then a line
    per check with its seconds, memory against the plan and the number that matters."""
    num = lambda v, w, f: " " + (format(v, f"{w - 1}{f}") if isinstance(v, (int, float)) else "-".rjust(w - 1))  # noqa: E731
    packages = ", ".join(f"{name} {version(name) or 'missing'}" for name in ("torch", "transformers", "peft"))
    lines = [f"gpu_check: {seconds:.0f} s in all, measured with {packages}",
             device_plan(CHECKS, DEVICE_SECONDS - START_UP)[1],
             "memory: what a check added (GiB) against the plan's terms for it",
             f"{'check':<12}{'seconds':>9}{'added':>9}{'planned':>9}{'ratio':>7}  result"]
    for r in rows:
        text = r.get("headline") or r.get("error") or r.get("skipped", "")
        lines.append(f"{r['check']:<12}{num(r.get('seconds'), 9, '.1f')}{num(r.get('added_gib'), 9, '.4g')}"
                     f"{num(r.get('expected_gib'), 9, '.4g')}{num(r.get('ratio'), 7, '.2f')}  "
                     + ("" if "headline" in r else "ERROR " if "error" in r else "SKIPPED ") + text[:300])
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", required=True, help="run every check (" +
                   ", ".join(name for name, *_ in CHECKS) + ")")
    p.add_argument("--config", help="a folder with DeepSeek-R1-Distill-Qwen-7B's config.json and tokenizer, "
                   "no weights (module docstring)")
    p.add_argument("--out", required=True, help="folder for gpu_check.jsonl, gpu_check.txt and gpu_check.log")
    p.add_argument("--dry-run", action="store_true", help="tiny widths and sizes on the CPU (the test)")
    p.add_argument("--bandwidth", type=float, help="memory bandwidth in TB/s for the decode floor, beside a "
                   "measured copy's (default: the card's own, from its memory clock and bus width)")
    p.add_argument("--time-box", type=float, help=f"seconds for every check together (default "
                   f"{DEVICE_SECONDS - START_UP}: {DEVICE_SECONDS} s of device time less the start-up; none with "
                   "--dry-run); a check without room for its estimate is skipped")
    p.add_argument("--toy-timeout", type=int, help="seconds at most for each toy run (default 120; 900 with --dry-run)")
    args = p.parse_args(argv)
    try:
        bench.check_config(args.config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.time_box is None:
        args.time_box = 0 if args.dry_run else DEVICE_SECONDS - START_UP
    args.toy_timeout = args.toy_timeout or (900 if args.dry_run else 120)
    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    print(device_plan(CHECKS, args.time_box or DEVICE_SECONDS - START_UP)[1], flush=True)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # generation-config notes and deprecations would bury the JSON lines
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops gain nothing from threads on a shared CPU, as in train.py
    tmp = tempfile.mkdtemp(prefix="gpu_check_")  # the toy runs: outside OUT, which brings back few files
    ctx = Context(args=args, device=device, tmp=tmp, sizes={**SIZES, **DRY} if args.dry_run else dict(SIZES))
    try:
        rows = run_checks(CHECKS, ctx, args.out, start + args.time_box if args.time_box else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = summary(rows, time.monotonic() - start)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
        f.write(table)
    print(table, end="")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
