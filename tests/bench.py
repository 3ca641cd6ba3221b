"""Generation throughput: the project's sampler (static and dynamic KV cache) against transformers'
own `model.generate`, on the same prompts and sampling settings, in one run.

    python tests/bench.py                  # toy model, 32 prompts x 8 samples, 48 tokens
    python tests/bench.py --shape long     # toy model, 2 x 8 rows, 1024 tokens, EOS off
    python tests/bench.py --shape 7b --config DIR --layers 4 --prompts 8 --prompt-len 2048

A developer's measurement, used by tests/gpu_check.py. The paths and what each column means:
docs/reference.md, "Decoding speed".
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
if not __package__:   # run as a file (python tests/bench.py), Python puts tests/ on the path
    sys.path.insert(0, ROOT)
import rollout  # noqa: E402
import rollout as sampling  # noqa: E402
from harness import staticcache  # noqa: E402
from harness.files import UserError  # noqa: E402
from config import check_values  # noqa: E402

CONFIG_HINT = ("a folder with the model's config.json and tokenizer, no weights (hf download "
               "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --include '*.json' --local-dir DIR)")
BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}
SHAPES = {"toy": dict(prompts=32, samples=8, max_new_tokens=48),   # defaults of the flags not given
          "long": dict(prompts=2, samples=8, max_new_tokens=1024),
          "7b": dict(prompts=32, samples=8, max_new_tokens=48)}
LIMITS = {key: (lambda v: v >= 1, ">= 1") for key in (
    "layers", "prompts", "samples", "prompt_len", "max_new_tokens", "repeat", "threads")}
LIMITS.update(temperature=(lambda v: v >= 0, ">= 0 (0: greedy)"), top_p=(lambda v: 0 < v <= 1, "in (0, 1]"),
              seed=(lambda v: 0 <= v < 2**32, "in [0, 2**32)"), bandwidth=(lambda v: v > 0, "> 0 (TB/s)"))


def cut_config(path, layers=None):
    """The config in folder `path`, cut to its first `layers` layers (None: all of them)."""
    check_config(path)
    cfg = AutoConfig.from_pretrained(path)
    if layers is None:
        return cfg
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    return cfg


def check_config(path):
    """One UserError line unless `path` (--config) holds a config.json and a tokenizer."""
    if not path:
        raise UserError(f"--config DIR is needed: {CONFIG_HINT}")
    for need in ("config.json", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(path, need)):
            raise UserError(f"no {need} in {path}: pass --config DIR, {CONFIG_HINT}")


def random_model(cfg, device, dtype=None, seed=0):
    """A model of architecture `cfg` with random weights on `device` (bf16 on CUDA, fp32 else)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def random_prompts(vocab, n_prompts, prompt_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n_prompts, prompt_len), generator=g).tolist()


def run_sampler(model, tok, prompts, args, decode, eos_ids, full=False):
    """full: the static path attends over its whole buffer at every step (static-full)."""
    with whole_buffer(full):
        out = rollout.generate(model, tok, prompts, n=args.samples, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                               eos_ids=eos_ids, decode=decode)
    return sum(out.lengths), max(out.lengths)


@contextlib.contextmanager
def whole_buffer(full=True):
    """With full, a static decode step attends over its whole buffer, not the live length."""
    live = staticcache.live_length
    if full:
        staticcache.live_length = lambda n, length: length
    try:
        yield
    finally:
        staticcache.live_length = live


def run_hf(model, tok, prompts, args, eos_ids):
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0) \
        if args.temperature > 0 else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                         num_return_sequences=args.samples, pad_token_id=pad,
                         eos_token_id=eos_ids or None, **sampling)
    new = out[:, width:]
    if eos_ids:  # count up to and including the first EOS, as the sampler's lengths do
        hit = torch.isin(new, torch.tensor(eos_ids, device=device))
        first = torch.where(hit.any(1), hit.float().argmax(1) + 1, new.shape[1])
        return int(first.sum()), new.shape[1]
    return new.numel(), new.shape[1]


def read_bytes(model, rows, context):
    """Bytes a decode step reads: weights (not the input embedding table, of which a step reads
    only `rows` rows, unless it is tied to the LM head) + the K/V of `rows` x `context` positions."""
    cfg = model.config.get_text_config()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        weights -= emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * emb.element_size()
    return weights + rows * context * kv_per_token


def floor_ms(model, rows, context, bandwidth_tbs):
    return read_bytes(model, rows, context) / (bandwidth_tbs * 1e12) * 1e3


def attended(path, rows, width, max_new_tokens):
    """(rows, mean positions) a decode step of `path` attends over, if no row stops early: step t
    (t = 0 .. max_new_tokens - 2; the first token comes from the prefill) has width + t + 1 written;
    the static paths attend over their bucketed rows and the live length or the whole buffer."""
    written = [width + t + 1 for t in range(max_new_tokens - 1)] or [width]
    if path.startswith("static"):
        rows, length = staticcache.buffer_shape(rows, width, max_new_tokens)
        written = [length if path == "static-full" else staticcache.live_length(n, length) for n in written]
    return rows, statistics.mean(written)


def measure(model, tok, prompts, args, eos_ids, bandwidth=None):
    """Every path of args.paths, args.repeat times in turn after a short warm-up: per path a dict
    of tokens, seconds (the median), tok_s, steps, ms_step, vs_generate, mb_step, for static beside
    static-full full_time and full_bytes (its ratios), and with a bandwidth floor_ms and of_floor."""
    runs = {"dynamic": lambda: run_sampler(model, tok, prompts, args, "dynamic", eos_ids),
            "static": lambda: run_sampler(model, tok, prompts, args, "static", eos_ids),
            "static-full": lambda: run_sampler(model, tok, prompts, args, "static", eos_ids, full=True),
            "generate": lambda: run_hf(model, tok, prompts, args, eos_ids)}
    paths = args.paths.split(",")
    if any(x not in runs for x in paths):
        raise UserError(f"--paths: choose from {','.join(runs)}")
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        short = argparse.Namespace(**{**vars(args), "max_new_tokens": 2})
        run_sampler(model, tok, prompts[:1], short, "dynamic", eos_ids)  # warm-up: kernels, allocator
        run_hf(model, tok, prompts[:1], short, eos_ids)
        times = {x: [] for x in paths}
        counts = {}
        for _ in range(args.repeat):
            for x in paths:
                sync()
                t = time.perf_counter()
                counts[x] = runs[x]()
                sync()
                times[x].append(time.perf_counter() - t)
    context = statistics.mean(map(len, prompts)) + args.max_new_tokens / 2
    out, width, rows = [], max(map(len, prompts)), len(prompts) * args.samples
    floor = floor_ms(model, rows, context, bandwidth) if bandwidth else None
    for x in paths:
        (tokens, steps), sec = counts[x], statistics.median(times[x])
        row = dict(path=x, tokens=tokens, seconds=sec, tok_s=tokens / sec, steps=steps,
                   ms_step=sec / max(steps, 1) * 1e3,
                   mb_step=read_bytes(model, *attended(x, rows, width, args.max_new_tokens)) / 1e6)
        if floor:
            row.update(floor_ms=floor, of_floor=floor / row["ms_step"])
        out.append(row)
    by = {r["path"]: r for r in out}
    if "static" in by and "static-full" in by:
        full, live = by["static-full"], by["static"]
        live.update(full_time=full["ms_step"] / live["ms_step"], full_bytes=full["mb_step"] / live["mb_step"])
    ref = next((r["tok_s"] for r in out if r["path"] == "generate"), None)
    for row in out:  # tokens differ a little between paths (different random streams): compare rates
        row["vs_generate"] = row["tok_s"] / ref if ref else None
    return out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="toy", help="toy; long: the toy at 2 prompts x 8 "
                   "samples x 1024 tokens, EOS off; 7b: the 7B architecture cut to --layers")
    p.add_argument("--config", help="for --shape 7b: a folder with the model's config.json and tokenizer")
    p.add_argument("--layers", type=int, default=4, help="decoder layers for --shape 7b")
    p.add_argument("--prompts", type=int, help="default 32 (long: 2)")
    p.add_argument("--samples", type=int, help="samples per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=2048, help="random prompt tokens for --shape 7b")
    p.add_argument("--max-new-tokens", type=int, help="default 48 (long: 1024)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default="dynamic,static,static-full,generate")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bandwidth", type=float, help="memory bandwidth in TB/s (looked up on CUDA; given: also on CPU)")
    p.add_argument("--threads", type=int, help="CPU threads (default 1 for the toy on CPU, as train.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_values(vars(args), LIMITS)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UserError(f"--device {args.device}: not a device; use cpu or cuda") from None
    gpus = torch.cuda.device_count()
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise UserError(f"--device {args.device}: this torch build and machine show {gpus} CUDA devices; "
                        "use --device cpu" + (" or cuda:0" if gpus else ""))
    threads = args.threads or (1 if device.type == "cpu" and args.shape != "7b" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.shape != "7b":   # the committed toy_base/ on the toy's training problems
        import data
        import toy
        path = toy.BASE_DIR
        model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        model.to(device)
        rows = toy.dataset("train")[:args.prompts]
        prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
        eos_ids = sampling.default_eos_ids(model, tok) if args.shape == "toy" else []
    else:   # the architecture in --config (no weights) with --layers random decoder layers
        model = random_model(cut_config(args.config, args.layers), device, seed=args.seed)
        tok = AutoTokenizer.from_pretrained(args.config)
        prompts, eos_ids = random_prompts(len(tok), args.prompts, args.prompt_len, args.seed), []
    model.eval()
    params = sum(q.numel() for q in model.parameters())
    print(f"{args.shape}: {model.config.num_hidden_layers} layers, {params / 1e6:.1f}M parameters, "
          f"{next(model.parameters()).dtype} on {device}; {len(prompts)} prompts x {args.samples} samples, "
          f"<= {args.max_new_tokens} new tokens, temperature {args.temperature}, top-p {args.top_p}, "
          f"threads {torch.get_num_threads()}")
    bandwidth = args.bandwidth
    if device.type == "cuda" and bandwidth is None:
        name = torch.cuda.get_device_name(device)
        bandwidth = next((v for k, v in BANDWIDTH_TBS.items() if k in name), None)
        if bandwidth is None:
            print(f"(no bandwidth known for {name}: pass --bandwidth TB/s for the floor)")
    rows = measure(model, tok, prompts, args, eos_ids, bandwidth)
    floor = bandwidth is not None
    head = f"{'path':<12}{'tokens':>9}{'seconds':>9}{'tokens/s':>10}{'steps':>7}{'ms/step':>9}{'MB/step':>9}" \
        f"{'vs generate':>13}"
    print(head + (f"{'floor ms':>10}{'of floor':>10}" if floor else ""))
    for r in rows:
        line = f"{r['path']:<12}{r['tokens']:>9}{r['seconds']:>9.2f}{r['tok_s']:>10.1f}{r['steps']:>7}" \
            f"{r['ms_step']:>9.2f}{r['mb_step']:>9.2f}"
        line += f"{r['vs_generate']:>12.2f}x" if r["vs_generate"] else f"{'':>13}"
        line += f"{r['floor_ms']:>10.2f}{r['of_floor']:>10.0%}" if floor else ""
        print(line)
    live = next((r for r in rows if "full_time" in r), None)
    if live:
        print(f"static-full / static (live length): {live['full_time']:.2f}x the time per step, "
              f"{live['full_bytes']:.2f}x the bytes read per step")
    if floor:
        context = statistics.mean(map(len, prompts)) + args.max_new_tokens / 2
        print(f"floor: {len(prompts) * args.samples} rows at mean context {context:.0f} tokens, {bandwidth} TB/s")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
