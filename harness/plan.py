"""Memory plans from the model's config alone (built on the meta device: no weights are read):
`check` for train.py --plan and before every start; `label_chunk` sizes evaluation's early exit.
The terms and how a peak sums them: docs/reference.md, "The memory plans"."""
import os

import torch

from harness import lora
from harness.checkpoint import resolve_model
from harness.files import UserError, first_line
from harness.staticcache import buffer_shape  # the buffers StaticDecoder allocates

GiB = 2**30
PROMPT_TOKENS = 600     # training prompts longer than this are dropped when the data is loaded
TOY_PROMPT_TOKENS = 16  # the toy world's chat prompts are at most 14 tokens
FORCED_SUFFIX = 32      # CLOSE + the forced suffix after a cut (18 tokens for R1), rounded up
FORCED_ANSWER = 32      # tokens sampled per forced answer (label.mc_labels)
RUNTIME = 1.0 * GiB      # the CUDA context or the process itself
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The named models' config.json, shipped in configs/NAME/ for plans offline (RLCM's: their bases')
SHIPPED = {"deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "DeepSeek-R1-Distill-Qwen-7B",
           "Melodramas/RLCM-DeepSeek-R1-Distill-Qwen-7B": "DeepSeek-R1-Distill-Qwen-7B",
           "Qwen/Qwen3-4B-Instruct-2507": "Qwen3-4B-Instruct-2507",
           "Melodramas/RLCM-Qwen3-4B-Instruct": "Qwen3-4B-Instruct-2507"}


def model_config(name, trust_remote_code=False):
    """The transformers config of a --model value, weights unread (a named hub model's: SHIPPED)."""
    from transformers import AutoConfig
    path = resolve_model(name)
    path = os.path.join(ROOT, "configs", SHIPPED[path]) if path in SHIPPED else path
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config of model {name!r}: {first_line(e, 300)} -- "
                        "offline? pass a local folder holding its config.json") from None


def param_counts(config, lora_targets="all-linear"):
    """Parameter counts: (total, root, one decoder layer, the adapter's per unit of LoRA rank)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    layer = sum(p.numel() for p in layers[0].parameters())
    return total, total - layer * len(layers), layer, lora.adapter_params(model, 1, lora_targets)


def kv_bytes_per_token(config, dtype_bytes):
    """K and V of every layer for one token: layers x 2 x kv_heads x head_dim x dtype."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv * head_dim * dtype_bytes


def estimate(config, cfg, world, device="cuda", offload=False, counts=None, probed=True):
    """Bytes per device for each term (in the order printed), 'peak', 'host' (rank 0's), 'host
    node' and the static shapes; probed: --reward labels forced answers (baselines.PROBE_MODES)."""
    total, root, layer, per_rank = counts or param_counts(config, cfg.get("lora_targets", "all-linear"))
    cuda = device == "cuda"
    act_bytes = 2 if cuda else 4
    d, d_ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    sharded, adapter = world > 1 or offload, cfg.get("lora_rank", 0) * per_rank
    if adapter:  # the frozen base and the adapter's fp32 state; one process samples with the policy
        state, adapter_state = (4 if sharded else act_bytes) * total / world, 16 * adapter / world
        gen_copy = act_bytes * total if sharded or cuda else 0
    else:
        state, adapter_state = 16 * total / world, 0.0
        gen_copy = 0 if not cuda and world == 1 else act_bytes * total  # wrap(): the policy samples
    prompts_here = -(-cfg["prompts_per_step"] // world)
    per_token = kv_bytes_per_token(config, act_bytes)
    layer_acts = lambda n: n * (8 * d + 3 * d_ff) * act_bytes  # noqa: E731  a layer's forward, n tokens
    P, G, new = prompt_tokens(cfg), cfg["group_size"], cfg["max_new_tokens"]
    # rollout: gen_batch prompts prefilled at once, their KV repeated for the G samples
    prompts = min(cfg["gen_batch"], prompts_here)
    kv_shape = buffer_shape(prompts * G, P, new)
    kv, prefill = kv_shape[0] * kv_shape[1] * per_token, layer_acts(prompts * P)
    label_shape, label_kv, label_prefill = (0, 0), 0, 0
    if probed:
        # forced answers: gen_batch cuts x k rows; the chunk's prefill cache is still held
        fractions = cfg.get("budgets", (0.25, 0.5, 0.75))
        cuts = min(cfg["gen_batch"], prompts_here * G * len(fractions))
        width = P + int(new * max(fractions)) + FORCED_SUFFIX
        label_shape = buffer_shape(cuts * cfg["k"], width, FORCED_ANSWER)
        label_kv = label_shape[0] * label_shape[1] * per_token
        label_prefill = layer_acts(cuts * width) + cuts * width * per_token
    gather = (act_bytes if adapter else 8) * (root + 2 * layer) if sharded else 0
    T = max(cfg["micro_tokens"], P + new)  # a micro-batch holds >= 1 sequence
    one_layer = layer_acts(T)
    kept = config.num_hidden_layers * (T * d * act_bytes if cfg["grad_ckpt"] else one_layer)
    acts = kept + (2 if cfg["grad_ckpt"] else 1) * one_layer
    chunk = 3 * cfg["chunk_size"] * vocab * 4  # chunks run over the micro-batch's flat positions
    held = 4 * (adapter or total) if offload and cfg.get("offload_grads", "gpu") == "gpu" else 0
    largest = max(layer, vocab * d)
    staged = 4 * largest / world if cuda and offload else 0  # a host shard's fp32 copy on the GPU
    merge = 8 * adapter / config.num_hidden_layers + 8 * d * d_ff if adapter else 0  # lora.merge_into
    refresh = (act_bytes * largest * (1 + 1 / world) + staged + merge) if sharded else 0
    terms = {"training state": 0.0 if offload else state,
             "adapter state": 0.0 if offload else adapter_state, "generation copy": gen_copy,
             "FSDP gather": gather, "KV cache": kv, "prefill": prefill, "label KV cache": label_kv,
             "label prefill": label_prefill, "activations": acts, "log-prob chunk": chunk,
             "held grads": held, "refresh": refresh, "runtime": RUNTIME}
    terms["peak"] = terms["training state"] + terms["adapter state"] + gen_copy + RUNTIME + \
        max(kv + prefill, label_kv + label_prefill, gather + acts + chunk + held, refresh)
    # host: rank 0 loads the fp32 weights (4 N) and gathers 12 N at a save; --offload's shards
    offloaded = state + adapter_state if offload else 0.0
    rank0 = offloaded + (max(4 * total, 12 * (adapter or total)) if sharded else 0.0)
    return {**terms, "host": rank0, "host node": rank0 + (world - 1) * offloaded,
            "kv_shape": kv_shape, "label_kv_shape": label_shape}


def label_chunk(cuts, k, width, config, free):
    """Cuts per chunk of forced answers (label.mc_labels' batch_size) that fit `free` bytes. One
    cut holds at `width` positions, bf16: its prefill cache row, k rows of static buffers and one
    layer's expanded K/V, twice (SDPA's repeat and the concatenation)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    cut_bytes = width * ((1 + k) * kv_bytes_per_token(config, 2) + 2 * 2 * heads * head_dim * 2)
    return max(1, min(cuts, int(free // cut_bytes)))


def free_bytes(device):
    """Bytes a new allocation can still get (free and cached), less a tenth for fragmentation."""
    free, _ = torch.cuda.mem_get_info(device)
    return 0.9 * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def prompt_tokens(cfg):
    return TOY_PROMPT_TOKENS if cfg["model"] == "toy" else PROMPT_TOKENS


def fixes(config, cfg, world, device, mem, counts, probed=True):
    """The cheapest change that fits, tried in this order."""
    def peak(c, w=world, off=cfg.get("offload", False)):
        return estimate(config, c, w, device, off, counts, probed)["peak"]
    host_grads = peak(dict(cfg, offload_grads="host"))
    if cfg.get("offload") and cfg.get("offload_grads", "gpu") == "gpu" and host_grads <= mem:
        return f"--offload-grads host (peak {host_grads / GiB:.1f} GiB: slower update)"
    for flag, key in (("--gen-batch", "gen_batch"), ("--micro-tokens", "micro_tokens")):
        c = dict(cfg)
        while c[key] > 1:
            c[key] //= 2
            if peak(c) <= mem:
                return f"{flag} {c[key]} (peak {peak(c) / GiB:.1f} GiB)"
    adapted = peak(dict(cfg, lora_rank=32))
    lora = None if cfg.get("lora_rank") or adapted > mem else \
        f"--lora-rank 32 (peak {adapted / GiB:.1f} GiB: trains a LoRA adapter, not every weight)"
    fix = "a smaller model" + (" or a machine with GPUs" if device == "cpu" else "")
    off = next((c for c in (cfg, dict(cfg, offload_grads="host")) if peak(c, off=True) <= mem), None)
    if not cfg.get("offload") and off:
        host = estimate(config, off, world, device, True, counts, probed)["host node"]
        flag = "--offload" + (" --offload-grads host" if off is not cfg else "")
        fix = f"{flag} (peak {peak(off, off=True) / GiB:.1f} GiB, host {host / GiB:.0f} GiB per node)"
    else:
        w = next((w for w in range(world + 1, 1025) if peak(cfg, w) <= mem), None)
        if w:
            fix = f"{w} GPUs (--gpus {w}: peak {peak(cfg, w) / GiB:.1f} GiB)"
    return f"{lora}; to keep full fine-tuning: {fix}" if lora else fix


def detected(nproc=None):
    """(device type, devices, GiB per device) of this machine."""
    if "WORLD_SIZE" in os.environ:  # torchrun or parallel.launch: the ranks that shard the model
        nproc = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        n = nproc or torch.cuda.device_count()
        return "cuda", n, torch.cuda.get_device_properties(0).total_memory / GiB
    return "cpu", nproc or 1, host_ram() / GiB


def host_ram():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check(cfg, show=False, log=print, probed=True):
    """Print the plan (show); UserError when the peak exceeds the device memory (--gpus / --gpu-mem:
    another node's)."""
    device, world, mem = detected(cfg.get("nproc"))
    here = not (cfg.get("gpus") or cfg.get("gpu_mem"))
    if not here:
        device, world = "cuda", cfg.get("gpus") or world
        mem = cfg.get("gpu_mem") or (mem if torch.cuda.is_available() else 80.0)
    config = model_config(cfg["model"], cfg.get("trust_remote_code", False))
    counts = param_counts(config, cfg.get("lora_targets", "all-linear"))
    offload = bool(cfg.get("offload"))
    t = estimate(config, cfg, world, device, offload, counts, probed)
    where = f"{world} x {mem:.0f} GiB {'GPU' if device == 'cuda' else 'CPU process'}"
    if show:
        size = f"{counts[0] / 1e9:.2f} B" if counts[0] >= 1e9 else f"{counts[0] / 1e6:.2f} M"
        rank = cfg.get("lora_rank", 0)
        lora_note = f" with --lora-rank {rank} ({rank * counts[3] / 1e6:.1f} M adapter parameters)" if rank else ""
        log(f"plan: {cfg['model']} ({size} parameters) on {where}{lora_note}"
            f"{' with --offload' if offload else ''}; per {'GPU' if device == 'cuda' else 'process'}:")
        notes = {"KV cache": "rollout: %s rows x %s tokens" % t["kv_shape"],
                 "label KV cache": "forced answers: %s rows x %s tokens" % t["label_kv_shape"]}
        hidden = {"adapter state": not rank, "held grads": not t["held grads"], "refresh": not t["refresh"]}
        for name in [n for n in list(t)[:list(t).index("peak") + 1] if not hidden.get(n)]:  # estimate's order
            log(f"  {name:<16}{t[name] / GiB:8.2f} GiB  {notes.get(name, '')}".rstrip())
        others = f"; {(t['host node'] - t['host']) / (world - 1) / GiB:.2f} GiB each other rank" if world > 1 else ""
        at = "loading (the fp32 base)" if rank else "a save (the full fp32 model and AdamW state)"
        log(f"  {'host':<16}{t['host'] / GiB:8.2f} GiB  rank 0 at {at}"
            f"{others}; {t['host node'] / GiB:.0f} GiB per node")
    if here and t["host node"] > host_ram() and os.environ.get("RANK", "0") == "0":
        log(f"warning: the plan needs {t['host node'] / GiB:.0f} GiB of host memory at a save, this machine "
            f"has {host_ram() / GiB:.0f} GiB")
    if t["peak"] > mem * GiB:
        raise UserError(f"plan: peak {t['peak'] / GiB:.1f} GiB per device exceeds {mem:.0f} GiB on "
                        f"{where}; cheapest fix: {fixes(config, cfg, world, device, mem * GiB, counts, probed)}")
    if show:
        log(f"fits: peak {t['peak'] / GiB:.1f} of {mem:.0f} GiB")
    return t

