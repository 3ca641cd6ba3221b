"""A preallocated (static) KV cache and a decode step captured as a CUDA graph, for harness/fast.py:
the dynamic loop's samples, at fixed addresses, one bucketed shape alive per model. Why:
docs/reference.md, "The static decoder". Models with sliding-window layers need the dynamic path."""
import gc
import inspect
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

LIVE_MIN = 64  # the shortest live length a step attends over
BLOCK = 128  # keys per block of the fused step's attention: a row reads ceil(written / BLOCK)
_CAPTURED = [0]  # decode steps recorded in this process (see captures)


def captures():
    """Decode steps recorded so far in this process, one per new (shape, live length)."""
    return _CAPTURED[0]


def bucket(x, lo, bits=4):
    """x rounded up to a multiple of max(lo, 2 ** (bit_length(x) - bits)), i.e. by less than
    2 ** (1 - bits) beyond lo: bucket(100, 1) == 104, bucket(8792, 64) == 9216,
    bucket(70, 64) == 128; bits=2: bucket(300, 64, 2) == 384, bucket(400, 64, 2) == 512."""
    step = max(lo, 1 << max(x.bit_length() - bits, 0))
    return -(-x // step) * step


def buffer_shape(rows, width, max_new_tokens):
    """(rows, positions) of the buffers for `rows` rows of a `width`-wide prefix decoding up to
    max_new_tokens, bucketed: the last token is never written, so width + max_new_tokens - 1."""
    return bucket(rows, 1), bucket(width + max_new_tokens - 1, 64)


def live_length(n, length):
    """Positions a step attends over when n are written: n rounded up to a multiple of LIVE_MIN,
    above 2 * LIVE_MIN to 2^k or 1.5 x 2^k, and at most `length` (the buffers')."""
    return min(bucket(n, LIVE_MIN, bits=2), length)


def fuse(model):
    """[(qkv weight, qkv bias, gate-up weight, gate-up bias)] per layer of a Qwen2 or Llama model
    (else None); q, k, v (and gate, up) parameters become row slices of them: one GEMM, no copy."""
    if getattr(model.config, "model_type", None) not in ("qwen2", "llama"):
        return None
    groups = [[(a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)]
              for a, m in ((layer.self_attn, layer.mlp) for layer in model.model.layers)]
    if any(type(x) is not torch.nn.Linear for g in groups for x in g[0] + g[1]):
        return None  # an adapter's layers (peft), say
    return [tuple(_joined([getattr(x, w) for x in g]) for g in group for w in ("weight", "bias"))
            for group in groups]


def _joined(params):
    """`params` stacked into one tensor, whose row slices they become (None: no biases)."""
    if params[0] is None:
        return None
    whole, at = torch.cat([p.data for p in params]), 0
    for p in params:
        p.data, at = whole[at:at + len(p)], at + len(p)
    return whole


def compiled(fn, device):
    """fn compiled on CUDA, one static graph per shape (flex decoding needs a static batch), past
    dynamo's limit of 8 (then eager): only a shape's warm-up and capture call it. Eager off CUDA."""
    return torch._dynamo.config.patch(recompile_limit=256)(torch.compile(fn, dynamic=False)) \
        if device.type == "cuda" else fn


class StaticKV:
    """The cache object a decoder layer calls `update(key, value, layer_idx, ...)` on: writes
    this step's [R, H, 1, D] at `write_at` and returns the layer's [R, H, live, D] buffer views."""

    def __init__(self, keys, values, write_at):
        self.keys, self.values, self.write_at = keys, values, write_at
        self.live = keys[0].shape[2]  # positions the step attends over (set before each forward)
        self.seen = 0  # host-side count, for code that asks the cache for its length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write_at, key_states)
        v.index_copy_(2, self.write_at, value_states)
        return k[:, :, :self.live], v[:, :, :self.live]

    def get_seq_length(self, layer_idx=0):
        return self.seen


class _Shape:
    """Buffers and, on CUDA, the captured steps (one per live length) for one bucketed shape
    [R rows, L positions]. Holds no reference to the model, so `decoder`'s entry goes with it."""

    def __init__(self, model, cache_kw, rows, length, layers, fused):
        k0 = layers[0].keys
        dev, dtype = k0.device, k0.dtype
        self.cache_kw, self.length = cache_kw, length
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.bias = torch.full((rows, 1, 1, length), torch.finfo(dtype).min, dtype=dtype, device=dev)
        self.write_at = torch.zeros(1, dtype=torch.long, device=dev)
        alloc = lambda x: torch.zeros((rows, x.shape[1], length, x.shape[3]), dtype=dtype, device=dev)  # noqa: E731
        self.kv = StaticKV([alloc(l.keys) for l in layers], [alloc(l.values) for l in layers], self.write_at)
        # transformers < 5.2x derives a cache position from the cache unless given one.
        self.extra = {"cache_position": self.write_at} if "cache_position" in \
            inspect.signature(model.forward).parameters else {}
        self.steps = {}  # live length -> (graph, its logits); (None, None) where steps run eagerly
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.fused = fuse(model) if fused else None  # after the buffers: the old shape's are gone
        if self.fused:  # the block mask reads `lengths` (0: a finished row) each step, in a graph too
            self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
            self.blocks = torch.zeros((rows, 1, 1), dtype=torch.int32, device=dev)
            every = torch.arange(-(-length // BLOCK), dtype=torch.int32, device=dev).repeat(rows, 1, 1, 1)
            lengths, bias = self.lengths, self.bias  # not self: no cycle keeps the buffers past release
            keep = lambda b, h, q, kv: (kv < lengths[b]) & (bias[b, 0, 0, kv] == 0)  # noqa: E731
            group = model.config.num_attention_heads // k0.shape[1]  # a KV head's query heads: its rows
            self.mask = BlockMask.from_kv_blocks(self.blocks, every,
                                                 BLOCK_SIZE=BLOCK, mask_mod=keep, seq_lengths=(group, length))
            # RMSNorm, rotary, SiLU-mul; a module is an argument, so one graph serves every layer
            small = (lambda norm, x: norm(x), apply_rotary_pos_emb, lambda act, gate, up: act(gate) * up)
            self.norm, self.rotary, self.silu_mul = [compiled(f, dev) if fused == "compiled" else f for f in small]
            self.attend = compiled(flex_attention, dev)

    def forward(self, model, n):
        """One eager step over the first n positions -> logits [R, V]."""
        if self.fused:
            return self.fused_forward(model)
        self.kv.live = n
        out = model(input_ids=self.tok[:, None], attention_mask={"full_attention": self.bias[..., :n]},
                    position_ids=self.pos, use_cache=True, **{self.cache_kw: self.kv}, **self.extra)
        return out.logits[:, -1]

    def fused_forward(self, model):
        """A Qwen2 or Llama step written out -> logits [R, V]: one GEMM for q, k, v, one for gate
        and up (fuse); flex_attention over each row's written blocks only (none for finished rows),
        a KV head's query heads as its query rows (flex decoding: one pass over K/V per KV head)."""
        m, R = model.model, len(self.tok)
        x = m.embed_tokens(self.tok[:, None])
        cos, sin = m.rotary_emb(x, self.pos)
        self.blocks.copy_((self.lengths + BLOCK - 1).div(BLOCK, rounding_mode="floor").view(R, 1, 1))
        for layer, (wqkv, bqkv, wgu, bgu), k, v in zip(m.layers, self.fused, self.kv.keys, self.kv.values):
            a, (_, H, _, D) = layer.self_attn, k.shape
            q, kn, vn = F.linear(self.norm(layer.input_layernorm, x), wqkv, bqkv).view(R, -1, D).split(
                [len(wqkv) // D - 2 * H, H, H], 1)
            q, kn = self.rotary(q[:, :, None], kn[:, :, None], cos, sin)
            k.index_copy_(2, self.write_at, kn)
            v.index_copy_(2, self.write_at, vn[:, :, None])
            o = self.attend(q.reshape(R, H, -1, D), k, v, block_mask=self.mask, scale=a.scaling)
            x = x + a.o_proj(o.reshape(R, 1, -1))
            gate, up = F.linear(self.norm(layer.post_attention_layernorm, x), wgu, bgu).chunk(2, -1)
            x = x + layer.mlp.down_proj(self.silu_mul(layer.mlp.act_fn, gate, up))
        return model.lm_head(self.norm(m.norm, x))[:, -1]

    def capture(self, model, n):
        """(graph, logits) of the step over n positions, recorded on CUDA after a warm-up on a side
        stream (lazy inits, library workspaces); the warm-up writes this step's keys and values,
        which the replay writes again identically. Elsewhere (None, None): the step runs eagerly."""
        if self.tok.device.type != "cuda":
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(model, n)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)  # not torch.cuda.graph: it empties the cache first
            try:
                logits = self.forward(model, n)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return graph, logits

    def run(self, model, n):
        if n not in self.steps:
            _CAPTURED[0] += 1
            self.steps[n] = self.capture(model, n)
        graph, logits = self.steps[n]
        if graph is None:
            return self.forward(model, n)
        graph.replay()
        return logits


class StaticDecoder:
    """Hands out decode steps over static buffers: those (and graphs) of the last shape asked for."""

    def __init__(self, model, cache_kw):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or \
                getattr(cfg, "use_sliding_window", False):
            raise ValueError("the static KV cache does not handle sliding-window layers: use --decode dynamic")
        self.cache_kw, self.key, self.shape = cache_kw, None, None
        self.fused = False  # fused_forward (True; "compiled": small ops too): off until a GPU ran it

    def drop(self):
        """Frees the buffers and graphs now (a fused shape's compile leaves them in cyclic garbage)."""
        fused, self.shape, self.key = self.shape is not None and self.shape.fused, None, None
        if fused:
            gc.collect()

    def start(self, model, prefix, n, max_new_tokens):
        """Load `prefix` (its rows repeated n times) into the buffers of its shape; returns
        step(tok [R*n], done [R*n]) -> logits [R_bucket, V] for the next position."""
        (B, W), layers = prefix.mask.shape, prefix.cache.layers
        rows, k0 = B * n, layers[0].keys
        # dtype and device too: graphs read the weights at their addresses, which a model.to()
        # moves; fused: the two steps' graphs and buffers differ
        key = (*buffer_shape(rows, W, max_new_tokens), k0.dtype, k0.device, self.fused)
        if key != self.key:
            self.drop()  # the old buffers and graphs go before the new ones are allocated
            self.shape, self.key = _Shape(model, self.cache_kw, *key[:2], layers, self.fused), key
        s = self.shape
        for dst, src in zip(s.kv.keys + s.kv.values, [l.keys for l in layers] + [l.values for l in layers]):
            # Row i*n + j <- prefix row i, without materialising the repeat.
            dst[:rows].view(B, n, *dst.shape[1:])[:, :, :, :W].copy_(src[:, None])
        s.bias.fill_(torch.finfo(s.bias.dtype).min)
        s.bias[:rows, 0, 0, :W].masked_fill_(prefix.mask.repeat_interleave(n, 0).bool(), 0)
        s.pos.zero_()
        s.pos[:rows] = prefix.last_pos.repeat_interleave(n, 0)
        s.tok.zero_()
        at = [W]

        def step(tok, done):
            col = at[0]
            s.tok[:rows] = tok
            if s.fused:
                s.lengths[:rows] = torch.where(done, 0, col + 1)
            s.pos.add_(1)
            s.bias[:, 0, 0, col] = 0
            s.write_at.fill_(col)
            s.kv.seen = col + 1
            at[0] += 1
            return s.run(model, s.length if s.fused else live_length(col + 1, s.length))
        return step


_DECODERS = weakref.WeakKeyDictionary()


def decoder(model, cache_kw):
    """The model's StaticDecoder, kept as long as the model: the shape of one call (its buffers and
    captured steps) serves the next call of that shape, until `release` or another shape."""
    if model not in _DECODERS:
        _DECODERS[model] = StaticDecoder(model, cache_kw)
    return _DECODERS[model]


def release(model):
    """Frees the model's static buffers and captured steps, for what needs the memory next."""
    if model in _DECODERS:
        _DECODERS[model].drop()
