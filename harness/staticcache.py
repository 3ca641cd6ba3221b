"""A preallocated (static) KV cache and a decode step captured as a CUDA graph, for rollout.py.

Why: a decode step of a 7B model should cost what the GPU needs to read the weights and the KV
cache (about 14 GB + 56 KiB per token per row in bf16; 6-9 ms at batch 64 and 4k context on an
H200/H100). An eager step with a growing `DynamicCache` costs Python, hundreds of kernel launches
and a copy of the whole cache per step (concatenation) on top. Here every tensor the step touches
has a fixed address and shape, so the step is recorded once per shape and replayed:

    keys, values   [R, H_kv, L, D] per layer; step t writes position W + t (`index_copy_` at a
                   device tensor, so the write position is data, not part of the graph)
    bias           [R, 1, 1, L] additive attention mask in the model dtype: 0 where a row may
                   attend (its prompt tokens and the generated positions so far), dtype-min elsewhere
    tok, pos       [R], [R, 1]: this step's input token and position id per row

Rows that finish keep decoding a pad token in place (their samples are already final); nothing is
dropped or reshaped. Shapes are bucketed (R and L rounded up by less than 1/8), so chunks of
similar size reuse one graph. One shape is alive per decoder: a chunk of another shape frees the
old buffers and graph before allocating its own, since chunks of varied width (forced answers
after cuts of 1.5k..8k tokens, one bucket every 256-512 positions) would otherwise pile up tens of
GiB of caches. The last shape lives as long as the rollout.Sampler that made it (one generate /
mc_labels call), so its memory is free again for the training update.

The attention mask is passed as `{"full_attention": bias}`, which transformers' decoder models take
as already built; so the model never looks at the cache's length and any transformers 5.x works.
Models with sliding-window layers need the dynamic path.
"""
import inspect

import torch


def bucket(x, lo):
    """x rounded up to a multiple of max(lo, 2 ** (bit_length(x) - 4)), i.e. by less than 1/8
    beyond lo: bucket(100, 1) == 104, bucket(8792, 64) == 9216, bucket(70, 64) == 128."""
    step = max(lo, 1 << max(x.bit_length() - 4, 0))
    return -(-x // step) * step


def buffer_shape(rows, width, max_new_tokens):
    """(rows, positions) of the buffers for `rows` rows of a `width`-wide prefix decoding up to
    max_new_tokens, bucketed: the last token is never written, so width + max_new_tokens - 1."""
    return bucket(rows, 1), bucket(width + max_new_tokens - 1, 64)


class StaticKV:
    """The cache object a decoder layer calls `update(key, value, layer_idx, ...)` on: writes this
    step's [R, H, 1, D] at `write_at` and returns the layer's whole [R, H, L, D] buffers."""

    def __init__(self, keys, values, write_at):
        self.keys, self.values, self.write_at = keys, values, write_at
        self.seen = 0  # host-side count, for code that asks the cache for its length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write_at, key_states)
        v.index_copy_(2, self.write_at, value_states)
        return k, v

    def get_seq_length(self, layer_idx=0):
        return self.seen


class _Shape:
    """Buffers and, on CUDA, the captured step for one bucketed shape [R rows, L positions]."""

    def __init__(self, model, cache_kw, rows, length, layers):
        k0 = layers[0].keys
        dev, dtype = k0.device, k0.dtype
        self.model, self.cache_kw = model, cache_kw
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.bias = torch.full((rows, 1, 1, length), torch.finfo(dtype).min, dtype=dtype, device=dev)
        self.write_at = torch.zeros(1, dtype=torch.long, device=dev)
        alloc = lambda x: torch.zeros((rows, x.shape[1], length, x.shape[3]), dtype=dtype, device=dev)  # noqa: E731
        self.kv = StaticKV([alloc(l.keys) for l in layers], [alloc(l.values) for l in layers], self.write_at)
        # transformers < 5.2x derives a cache position from the cache unless given one.
        self.extra = {"cache_position": self.write_at} if "cache_position" in \
            inspect.signature(model.forward).parameters else {}
        self.graph, self.logits = None, None

    def forward(self):
        out = self.model(input_ids=self.tok[:, None], attention_mask={"full_attention": self.bias},
                         position_ids=self.pos, use_cache=True, **{self.cache_kw: self.kv}, **self.extra)
        return out.logits[:, -1]

    def run(self):
        if self.tok.device.type != "cuda":
            return self.forward()
        if self.graph is None:
            # Warm up on a side stream (lazy inits, library workspaces), then record. The warm-up
            # writes this step's keys/values, which the replay below writes again identically.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.forward()
        self.graph.replay()
        return self.logits


class StaticDecoder:
    """Hands out decode steps over static buffers: those (and the graph) of the last shape asked for."""

    def __init__(self, model, cache_kw):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or \
                getattr(cfg, "use_sliding_window", False):
            raise ValueError("the static KV cache does not handle sliding-window layers: use --decode dynamic")
        self.model, self.cache_kw, self.key, self.shape = model, cache_kw, None, None

    def start(self, prefix, n, max_new_tokens):
        """Load `prefix` (its rows repeated n times) into the buffers of its shape; returns
        step(tok [R*n]) -> logits [R_bucket, V] for the next position."""
        B, W = prefix.mask.shape
        rows = B * n
        layers = prefix.cache.layers
        key = buffer_shape(rows, W, max_new_tokens)
        if key != self.key:
            self.shape = self.key = None  # the old buffers and graph go before the new ones are allocated
            self.shape, self.key = _Shape(self.model, self.cache_kw, *key, layers), key
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

        def step(tok):
            col = at[0]
            s.tok[:rows] = tok
            s.pos.add_(1)
            s.bias[:, 0, 0, col] = 0
            s.write_at.fill_(col)
            s.kv.seen = col + 1
            at[0] += 1
            return s.run()
        return step
