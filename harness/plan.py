"""Memory plan: what one GPU (or the host) must hold for a model and a run's settings, from the
model's config alone (the model is built on the meta device: no weights are read).

    python train.py --model deepseek-r1-distill-qwen-7b --plan --gpus 8 --gpu-mem 80

Terms per device, with N parameters, W devices (ranks) and bf16 = 2 bytes:
  training state  fp32 params + fp32 grads + AdamW (2 x fp32)   16 N / W   (FSDP2 shards them)
  generation copy bf16 full weights on every rank                2 N
  FSDP gather     the root (embeddings, LM head) and two decoder layers unsharded while they run:
                  bf16 params + bf16 grads + fp32 reduce buffer  8 (N_root + 2 N_layer)
  KV cache        the rollout's static buffers (harness/staticcache.py): rows x positions x layers x 2 (K, V)
                  x kv_heads x head_dim x 2, as the decoder buckets them: rows = min(gen_batch,
                  prompts per rank) x group_size, positions = prompt + max_new_tokens - 1, rounded up
                  (24 x 9216 for 24 x 8599 on the released recipe)
  prefill         one layer's forward (T x (8 d + 3 d_ff) x 2) over the prompts that fill that cache
  label KV cache  the forced answers' static buffers: a chunk of gen_batch cuts x k rows, positions =
                  prompt + the longest cut (3/4 of max_new_tokens) + the forced suffix + the answer
                  - 1, bucketed; one chunk's shape is alive at a time
  label prefill   one layer's forward over the chunk's prefixes plus their prefill cache (one row per
                  cut), which is held while the static buffers are filled from it; the probe's
                  features are read off those rows (a trajectory whose tokens differ from the one
                  that asks its longest cut's forced prompt right at that cut adds a row: rare)
  activations     one micro-batch of micro_tokens tokens: with checkpointing each layer keeps its
                  input (T x d), and the backward of one layer holds its recomputed forward buffers
                  (T x (8 d + 3 d_ff)) and their gradients (as much again); without, every layer
                  keeps its buffers and one layer's gradients come on top
  log-prob chunk  chunk_size positions x vocab x 3 fp32: a chunk's backward holds its recomputed
                  log-softmax, the gradient gather scatters into and log-softmax's gradient
  refresh         sharded runs, after the update: the generation copy is refreshed one group at a time
                  (parallel.gather_into: a decoder layer, or one parameter outside the layers, the
                  largest being the embedding, vocab x d) through one buffer sized for the largest
                  group g1: its shard and the gathered group in the copy's dtype, 2 g1 (1 + 1 / W),
                  and with --offload on a GPU one parameter's fp32 shard on its way from the host, at
                  most 4 g1 / W
  runtime         CUDA context and allocator slack (1 GiB), or the Python/torch process on CPU

Phases do not overlap: the rollout holds its KV cache and prefill, the labels theirs, the update
the gather, activations and log-prob chunk, the refresh its group (the step frees the rollout's
static buffers before the first label prefill, and the labels' before the update: tests/test_plan.py
holds both; tests/test_parallel.py holds the refresh term to the bytes a two-rank refresh allocates).
peak = training state + generation copy + runtime + max(rollout, labels, update, refresh).
With --offload (FSDP2's CPUOffloadPolicy) the training state lives in host memory (16 N / W per
rank) and the optimizer step runs on the CPU: slower, but the GPU keeps only the rest. The update
then accumulates the micro-batches' gradients unsharded in fp32 on the GPU and reduces them once
(update.py): +4 N ("held grads"; the adapter's 4 n under LoRA); --offload-grads host reduces and
copies them after every micro-batch instead (no such term, a blocking copy per micro-batch).
Host memory (sharded runs: several GPUs or --offload): rank 0 reads the fp32 weights (4 N) to
broadcast them, and at every save gathers the full fp32 model and AdamW state (parallel.full_state:
4 N + 8 N = 12 N, 91 GB for the 7B), on top of its offloaded shard; the Python processes themselves
are not counted. The check refuses on device memory only: the host may be another machine
(--gpus / --gpu-mem), so host memory is printed, and flagged when it exceeds this machine's RAM.
On CPU (the toy world) everything is fp32 and one process uses the policy as its generation copy.

With --lora-rank R (harness/lora.py) only the adapter trains: n = R x (in + out) summed over the
adapted linear layers. The frozen base holds no fp32 master, gradients or AdamW state:
  training state  the frozen base: bf16 on one GPU (2 N), the fp32 shards (4 N / W) when sharded
  adapter state   fp32 params + grads + AdamW of the adapter                16 n / W
  generation copy on one GPU a plain bf16 copy with the adapter merged (2 N: lora.merged_copy; sampling
                  with the fp32 adapter on the bf16 base would cast each adapted linear's input to
                  fp32, T x (4 in + 8 out) more per prefill, 8 GiB in the 7B's label prefill), the
                  same when sharded; none in a CPU process
  refresh         sharded, as above, plus the merge: a layer's adapter gathered in fp32 (8 n / L)
                  and one linear's W + s B A in fp32 beside its cast (8 d d_ff at most)
  FSDP gather     the gathered layers' params only (no gradients for frozen weights)
  host            rank 0 reads the fp32 base to broadcast it (4 N); a save gathers the adapter and
                  its AdamW state only (12 n)
"""
import os

import torch

from harness import lora, models
from harness.files import UserError, first_line
from harness.staticcache import buffer_shape  # the buffers StaticDecoder allocates

GiB = 2**30
PROMPT_TOKENS = 600     # training prompts longer than this are dropped when the data is loaded
TOY_PROMPT_TOKENS = 16  # the toy world's chat prompts are at most 14 tokens
FORCED_SUFFIX = 32      # CLOSE + the forced suffix after a cut (18 tokens for R1), rounded up
FORCED_ANSWER = 32      # tokens sampled per forced answer (label.mc_labels)
RUNTIME = {"cuda": 1.0 * GiB, "cpu": 1.0 * GiB}


def model_config(name, trust_remote_code=False):
    """The transformers config of a --model value, without reading its weights: a named model's shipped
    config.json (models.SHIPPED: no hub), else its folder's or the hub's."""
    from transformers import AutoConfig
    path = models.config_path(name)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = first_line(e, 300)
        raise UserError(f"cannot read the config of model {name!r}: {first} -- offline? pass a local folder "
                        "holding its config.json") from None


def param_counts(config, lora_targets="all-linear"):
    """(total, root, one decoder layer, adapter parameters per unit of LoRA rank on lora_targets)
    parameter counts, from a model built on the meta device."""
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
    """Bytes per device for each term (dict, in the order printed) plus 'peak', the host memory
    ('host': rank 0's, 'host node': all ranks'), and the static shapes ('kv_shape', 'label_kv_shape').
    probed: the --reward mode labels forced answers and fits a probe (modes.PROBE_MODES)."""
    total, root, layer, per_rank = counts or param_counts(config, cfg.get("lora_targets", "all-linear"))
    cuda = device == "cuda"
    act_bytes = 2 if cuda else 4
    d, d_ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    sharded = world > 1 or offload
    adapter = cfg.get("lora_rank", 0) * per_rank
    if adapter:  # the frozen base and the adapter's fp32 state; one process samples with the policy
        state = (4 * total if sharded else act_bytes * total) / world
        adapter_state = 16 * adapter / world
        gen_copy = act_bytes * total if sharded or cuda else 0
    else:
        state, adapter_state = 16 * total / world, 0.0
        shared_copy = not cuda and world == 1  # wrap(): one CPU process samples with the policy itself
        gen_copy = 0 if shared_copy else act_bytes * total
    prompts_here = -(-cfg["prompts_per_step"] // world)
    per_token = kv_bytes_per_token(config, act_bytes)
    layer_acts = lambda tokens: tokens * (8 * d + 3 * d_ff) * act_bytes  # noqa: E731  one layer's forward
    P, G, new = prompt_tokens(cfg), cfg["group_size"], cfg["max_new_tokens"]
    # rollout: gen_batch prompts prefilled at once, their KV repeated for the G samples
    prompts = min(cfg["gen_batch"], prompts_here)
    kv_shape = buffer_shape(prompts * G, P, new)
    kv, prefill = kv_shape[0] * kv_shape[1] * per_token, layer_acts(prompts * P)
    label_shape, label_kv, label_prefill = (0, 0), 0, 0
    if probed:
        # forced answers (label._forced_samples): chunks of gen_batch cuts x k rows after the prompt,
        # the longest cut (3/4 of the response) and the forced tail; the chunk's own prefill cache
        # (one row per cut) is still held while the static buffers are filled from it.
        fractions = cfg.get("budgets", (0.25, 0.5, 0.75))
        cuts = min(cfg["gen_batch"], prompts_here * G * len(fractions))
        width = P + int(new * max(fractions)) + FORCED_SUFFIX
        label_shape = buffer_shape(cuts * cfg["k"], width, FORCED_ANSWER)
        label_kv = label_shape[0] * label_shape[1] * per_token
        label_prefill = layer_acts(cuts * width) + cuts * width * per_token
    gather = (act_bytes if adapter else 8) * (root + 2 * layer) if sharded else 0
    T = max(cfg["micro_tokens"], P + new)  # a micro-batch holds >= 1 sequence
    one_layer = layer_acts(T)
    # kept: each layer's input with checkpointing, else every layer's buffers; then the backward of
    # one layer: its buffers recomputed (checkpointing) and their gradients
    kept = config.num_hidden_layers * (T * d * act_bytes if cfg["grad_ckpt"] else one_layer)
    acts = kept + (2 if cfg["grad_ckpt"] else 1) * one_layer
    chunk = 3 * cfg["chunk_size"] * vocab * 4  # chunks run over the micro-batch's flattened positions
    held = 4 * (adapter or total) if offload and cfg.get("offload_grads", "gpu") == "gpu" else 0
    # the refresh's groups: each decoder layer, the embedding and an untied LM head, gathered in turn
    # through one buffer sized for the largest (parallel.refresh_sampler)
    largest = max(layer, vocab * d)
    staged = 4 * largest / world if cuda and offload else 0  # a host shard's fp32 copy on the GPU
    merge = 8 * adapter / config.num_hidden_layers + 8 * d * d_ff if adapter else 0  # lora.merge_into
    refresh = (act_bytes * largest * (1 + 1 / world) + staged + merge) if sharded else 0
    terms = {"training state": 0.0 if offload else state, "adapter state": 0.0 if offload else adapter_state,
             "generation copy": gen_copy,
             "FSDP gather": gather, "KV cache": kv, "prefill": prefill, "label KV cache": label_kv,
             "label prefill": label_prefill, "activations": acts, "log-prob chunk": chunk,
             "held grads": held, "refresh": refresh, "runtime": RUNTIME[device]}
    update = gather + acts + chunk + held
    terms["peak"] = terms["training state"] + terms["adapter state"] + gen_copy + RUNTIME[device] + \
        max(kv + prefill, label_kv + label_prefill, update, refresh)
    # Host: rank 0 loads the fp32 weights (4 N) to broadcast them, and at every save gathers the
    # full fp32 model and AdamW state (parallel.full_state, cpu_offload: 4 N + 8 N; the adapter's
    # alone under LoRA); --offload keeps each rank's shard of the training state there.
    offloaded = state + adapter_state if offload else 0.0
    rank0 = offloaded + (max(4 * total, 12 * (adapter or total)) if sharded else 0.0)
    terms["host"] = rank0
    terms["host node"] = rank0 + (world - 1) * offloaded
    terms["kv_shape"], terms["label_kv_shape"] = kv_shape, label_shape
    return terms


def label_chunk(cuts, k, width, config, free):
    """Cuts per chunk of forced answers (label.mc_labels' batch_size) that fit `free` bytes: at most
    `cuts`, fewer where one chunk of them at `width` positions (prompt + the longest cut + the tail)
    cannot hold, per cut, the prefill cache row it selects (width x K/V bytes per token), its k rows
    of static buffers filled from it (k x width) and the masked tail prefill's expanded K/V of one
    layer (width x 2 x heads x head_dim, twice: SDPA's repeat and the cache's concatenation), in bf16.
    evaluate.py's early exit (64 rows, k = 1, AIME's 8000 tokens) needs it on an 80 GB GPU."""
    return max(1, min(cuts, int(free // cut_bytes(k, width, config))))


def cut_bytes(k, width, config):
    """What one cut of a chunk of forced answers holds at `width` positions (label_chunk), bf16."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return width * ((1 + k) * kv_bytes_per_token(config, 2) + 2 * 2 * heads * head_dim * 2)


def free_bytes(device):
    """Bytes a new allocation can still get on a CUDA device: free on the device plus what torch's
    allocator holds unused (it frees those before it reports an out-of-memory), less a tenth for
    fragmentation and the workspaces of kernels."""
    free, _ = torch.cuda.mem_get_info(device)
    return 0.9 * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def prompt_tokens(cfg):
    return TOY_PROMPT_TOKENS if cfg["model"] == "toy" else PROMPT_TOKENS


def fixes(config, cfg, world, device, mem, counts, probed=True):
    """The cheapest change that fits, tried in order of cost: a smaller --gen-batch or --micro-tokens
    (slower, nothing else changes; under --offload first --offload-grads host), --lora-rank 32 (an
    adapter trains instead of every weight: a deviation from the paper's full fine-tuning), --offload
    (much slower optimizer step; with --offload-grads host where the held gradients do not fit), more
    GPUs."""
    def peak(c, w=world, off=cfg.get("offload", False)):
        return estimate(config, c, w, device, off, counts, probed)["peak"]
    if cfg.get("offload") and cfg.get("offload_grads", "gpu") == "gpu" and \
            peak(dict(cfg, offload_grads="host")) <= mem:
        return f"--offload-grads host (peak {peak(dict(cfg, offload_grads='host')) / GiB:.1f} GiB: slower update)"
    for flag, key in (("--gen-batch", "gen_batch"), ("--micro-tokens", "micro_tokens")):
        c = dict(cfg)
        while c[key] > 1:
            c[key] //= 2
            if peak(c) <= mem:
                return f"{flag} {c[key]} (peak {peak(c) / GiB:.1f} GiB)"
    lora = None
    if not cfg.get("lora_rank") and peak(dict(cfg, lora_rank=32)) <= mem:
        lora = f"--lora-rank 32 (peak {peak(dict(cfg, lora_rank=32)) / GiB:.1f} GiB: trains a LoRA adapter, not every weight)"
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
    if "WORLD_SIZE" in os.environ:  # under torchrun (or harness/launch.py): the ranks that shard the model
        nproc = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        n = nproc or torch.cuda.device_count()
        return "cuda", n, torch.cuda.get_device_properties(0).total_memory / GiB
    return "cpu", nproc or 1, host_ram() / GiB


def host_ram():
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check(cfg, show=False, log=print, probed=True):
    """Print the plan (show=True) and raise UserError when the peak exceeds the device memory.

    --gpus / --gpu-mem describe a node other than this one (planning from a laptop); otherwise the
    detected devices are used. probed: as in estimate.
    """
    device, world, mem = detected(cfg.get("nproc"))
    here = not (cfg.get("gpus") or cfg.get("gpu_mem"))
    if not here:
        device = "cuda"
        world = cfg.get("gpus") or world
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
        notes = {"KV cache": "rollout: {} rows x {} tokens".format(*t["kv_shape"]),
                 "prefill": "one layer's forward over the prompts prefilled with that cache",
                 "label KV cache": "forced answers: {} rows x {} tokens".format(*t["label_kv_shape"]),
                 "label prefill": "one layer's forward and the prefill cache of one chunk of cuts",
                 "activations": "checkpointed" if cfg["grad_ckpt"] else "no checkpointing",
                 "held grads": "fp32 gradients held unsharded until the last micro-batch",
                 "refresh": "the generation copy's refresh: its largest group (a layer or the embedding) gathered",
                 "training state": "on the host (--offload)" if offload else
                 ("the frozen base" if rank else "params, grads, AdamW (sharded)"),
                 "adapter state": "fp32 params, grads, AdamW of the adapter",
                 "generation copy": ("none: samples with the policy" if not t["generation copy"] else
                                     "bf16, the adapter merged") if rank else ""}
        for name in ("training state", *(("adapter state",) if rank else ()), "generation copy", "FSDP gather", "KV cache", "prefill",
                     "label KV cache", "label prefill", "activations", "log-prob chunk",
                     *(("held grads",) if t["held grads"] else ()), *(("refresh",) if t["refresh"] else ()),
                     "runtime", "peak"):
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
