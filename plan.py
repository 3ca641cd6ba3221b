"""Memory plan: what one GPU (or the host) must hold for a model and a run's settings, from the
model's config alone (the model is built on the meta device: no weights are read).

    python train.py --model deepseek-r1-distill-qwen-7b --plan --gpus 8 --gpu-mem 80

Terms per device, with N parameters, W devices (ranks) and bf16 = 2 bytes:
  training state  fp32 params + fp32 grads + AdamW (2 x fp32)   16 N / W   (FSDP2 shards them)
  generation copy bf16 full weights on every rank                2 N
  FSDP gather     the root (embeddings, LM head) and two decoder layers unsharded while they run:
                  bf16 params + bf16 grads + fp32 reduce buffer  8 (N_root + 2 N_layer)
  KV cache        rows one rank generates at once x tokens x layers x 2 (K, V) x kv_heads x head_dim x 2,
                  the larger of the rollout (min(gen_batch, prompts per rank) x group_size rows of
                  prompt + max_new_tokens) and the forced answers (gen_batch x k rows of prompt +
                  3/4 max_new_tokens + the forced tail)
  prefill         one layer's forward (T x (8 d + 3 d_ff)) over the prompts that fill that cache
  activations     one micro-batch of micro_tokens tokens: with checkpointing each layer keeps its
                  input (T x d) and one layer is recomputed at a time (T x (8 d + 3 d_ff))
  log-prob chunk  chunk_size positions x vocab fp32 logits, log-softmax and its gradient (x 3)
  runtime         CUDA context and allocator slack (1 GiB), or the Python/torch process on CPU

Phases do not overlap: rollout holds the KV cache and prefill, the update holds the gather,
activations and log-prob chunk. peak = training state + generation copy + runtime + max(rollout, update).
With --offload (FSDP2's CPUOffloadPolicy) the training state lives in host memory (16 N / W per
rank) and the optimizer step runs on the CPU: slower, but the GPU keeps only the rest.
On CPU (the toy world) everything is fp32 and one process uses the policy as its generation copy.
"""
import torch

from checkpoint import UserError
from config import PROBE_MODES

GiB = 2**30
PROMPT_TOKENS = 600     # training prompts longer than this are dropped when the data is loaded
TOY_PROMPT_TOKENS = 32  # the toy world's chat prompts are at most 14 tokens
FORCED_TAIL = 64        # forced-answer suffix + the 32 sampled answer tokens, rounded up
RUNTIME = {"cuda": 1.0 * GiB, "cpu": 1.0 * GiB}


def model_config(name, trust_remote_code=False):
    """The transformers config of a --model value, without reading its weights."""
    from transformers import AutoConfig
    from checkpoint import resolve_model
    path = resolve_model(name)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"cannot read the config of model {name!r}: {first}") from None


def param_counts(config):
    """(total, root, one decoder layer) parameter counts, from a model built on the meta device."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    layer = sum(p.numel() for p in layers[0].parameters())
    return total, total - layer * len(layers), layer


def kv_bytes_per_token(config, dtype_bytes):
    """K and V of every layer for one token: layers x 2 x kv_heads x head_dim x dtype."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv * head_dim * dtype_bytes


def estimate(config, cfg, world, device="cuda", offload=False, counts=None):
    """Bytes per device for each term (dict, in the order printed) plus 'peak' and 'host'."""
    total, root, layer = counts or param_counts(config)
    cuda = device == "cuda"
    act_bytes = 2 if cuda else 4
    d, d_ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    state = 16 * total / world
    shared_copy = not cuda and world == 1  # wrap(): one CPU process samples with the policy itself
    gen_copy = 0 if shared_copy else act_bytes * total
    prompts_here = -(-cfg["prompts_per_step"] // world)
    per_token = kv_bytes_per_token(config, act_bytes)
    layer_acts = lambda tokens: tokens * (8 * d + 3 * d_ff) * act_bytes  # noqa: E731  one layer's forward
    P, G = prompt_tokens(cfg), cfg["group_size"]
    # rollout: gen_batch prompts prefilled at once, their KV repeated for the G samples
    prompts = min(cfg["gen_batch"], prompts_here)
    phases = [(prompts * G, P + cfg["max_new_tokens"], layer_acts(prompts * P))]
    if cfg.get("reward", "rlcm") in PROBE_MODES:  # forced answers: a prefix per budget, <= max budget
        fractions = cfg.get("budgets", (0.25, 0.5, 0.75))
        forced = min(cfg["gen_batch"], prompts_here * G * len(fractions))
        prefix = P + int(cfg["max_new_tokens"] * max(fractions))
        phases.append((forced * cfg["k"], prefix + FORCED_TAIL, layer_acts(forced * prefix)))
    kv_rows, kv_seq, prefill = max(phases, key=lambda r: r[0] * r[1] * per_token + r[2])
    kv = kv_rows * kv_seq * per_token
    gather = 8 * (root + 2 * layer) if world > 1 or offload else 0
    T = max(cfg["micro_tokens"], P + cfg["max_new_tokens"])  # a micro-batch holds >= 1 sequence
    one_layer = layer_acts(T)
    acts = (config.num_hidden_layers * T * d * act_bytes + one_layer) if cfg["grad_ckpt"] \
        else config.num_hidden_layers * one_layer
    chunk = 3 * cfg["chunk_size"] * vocab * 4  # chunks run over the micro-batch's flattened positions
    terms = {"training state": 0.0 if offload else state, "generation copy": gen_copy,
             "FSDP gather": gather, "KV cache": kv, "prefill": prefill, "activations": acts,
             "log-prob chunk": chunk, "runtime": RUNTIME[device]}
    update = gather + acts + chunk
    terms["peak"] = terms["training state"] + gen_copy + RUNTIME[device] + max(kv + prefill, update)
    terms["host"] = state if offload else 0.0
    terms["kv_shape"] = (kv_rows, kv_seq)
    return terms


def prompt_tokens(cfg):
    return TOY_PROMPT_TOKENS if cfg["model"] == "toy" else PROMPT_TOKENS


def fixes(config, cfg, world, device, mem, counts):
    """The cheapest change that fits, tried in order of cost: a smaller --gen-batch or --micro-tokens
    (slower, nothing else changes), --offload (much slower optimizer step), more GPUs."""
    def peak(c, w=world, off=cfg.get("offload", False)):
        return estimate(config, c, w, device, off, counts)["peak"]
    for flag, key in (("--gen-batch", "gen_batch"), ("--micro-tokens", "micro_tokens")):
        c = dict(cfg)
        while c[key] > 1:
            c[key] //= 2
            if peak(c) <= mem:
                return f"{flag} {c[key]} (peak {peak(c) / GiB:.1f} GiB)"
    if not cfg.get("offload") and peak(cfg, off=True) <= mem:
        host = estimate(config, cfg, world, device, True, counts)["host"]
        return f"--offload (peak {peak(cfg, off=True) / GiB:.1f} GiB, host {host / GiB:.0f} GiB per GPU)"
    for w in range(world + 1, 1025):
        if peak(cfg, w) <= mem:
            return f"{w} GPUs (--gpus {w}: peak {peak(cfg, w) / GiB:.1f} GiB)"
    return "a smaller model" + (" or a machine with GPUs" if device == "cpu" else "")


def detected(nproc=None):
    """(device type, devices, GiB per device) of this machine."""
    import os
    if "WORLD_SIZE" in os.environ:  # under torchrun (or launch.py): the ranks that shard the model
        nproc = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        n = nproc or torch.cuda.device_count()
        return "cuda", n, torch.cuda.get_device_properties(0).total_memory / GiB
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return "cpu", nproc or 1, host


def check(cfg, show=False, log=print):
    """Print the plan (show=True) and raise UserError when the peak exceeds the device memory.

    --gpus / --gpu-mem describe a node other than this one (planning from a laptop); otherwise the
    detected devices are used.
    """
    device, world, mem = detected(cfg.get("nproc"))
    if cfg.get("gpus") or cfg.get("gpu_mem"):
        device = "cuda"
        world = cfg.get("gpus") or world
        mem = cfg.get("gpu_mem") or (mem if torch.cuda.is_available() else 80.0)
    config = model_config(cfg["model"], cfg.get("trust_remote_code", False))
    counts = param_counts(config)
    offload = bool(cfg.get("offload"))
    t = estimate(config, cfg, world, device, offload, counts)
    where = f"{world} x {mem:.0f} GiB {'GPU' if device == 'cuda' else 'CPU process'}"
    if show:
        size = f"{counts[0] / 1e9:.2f} B" if counts[0] >= 1e9 else f"{counts[0] / 1e6:.2f} M"
        log(f"plan: {cfg['model']} ({size} parameters) on {where}"
            f"{' with --offload' if offload else ''}; per {'GPU' if device == 'cuda' else 'process'}:")
        notes = {"KV cache": "{} rows x {} tokens".format(*t["kv_shape"]),
                 "prefill": "one layer's forward over the prompts prefilled with that cache",
                 "activations": "checkpointed" if cfg["grad_ckpt"] else "no checkpointing",
                 "training state": "on the host (--offload)" if offload else "params, grads, AdamW (sharded)"}
        for name in ("training state", "generation copy", "FSDP gather", "KV cache", "prefill",
                     "activations", "log-prob chunk", "runtime", "peak"):
            log(f"  {name:<16}{t[name] / GiB:8.2f} GiB  {notes.get(name, '')}".rstrip())
        if offload:
            log(f"  {'host memory':<16}{t['host'] / GiB:8.2f} GiB  per rank: "
                f"{t['host'] * world / GiB:.0f} GiB per node, plus 4 N bytes on rank 0 while the weights load")
    if t["peak"] > mem * GiB:
        raise UserError(f"plan: peak {t['peak'] / GiB:.1f} GiB per device exceeds {mem:.0f} GiB on "
                        f"{where}; cheapest fix: {fixes(config, cfg, world, device, mem * GiB, counts)}")
    if show:
        log(f"fits: peak {t['peak'] / GiB:.1f} of {mem:.0f} GiB")
    return t
