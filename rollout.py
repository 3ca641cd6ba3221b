"""Batched sampling with a KV cache: rollouts, evaluation and label.py's forced answers.

    samples = generate(model, tokenizer, prompts, n=8, max_new_tokens=1024, temperature=0.8, seed=0)
    samples.ids[i * 8 + j]   # j-th continuation of prompts[i]: generated ids only, EOS/stop included

`generate` runs a `Sampler`: one prefill of a chunk of prompts, then a decode loop in which each
row samples its next token (`sample_next`). `Sampler._decode_dynamic` is the plain loop, the one a
CPU runs (each step a prefill of one token per row); on CUDA the same samples come faster from
harness/fast.py (a static cache with CUDA graphs): tests/test_rollout.py holds them equal. How the
paths differ and why they draw the same samples: docs/reference.md, "The sampler"."""
import hashlib
import inspect
from array import array
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache

from harness import fast, staticcache

DECODES = ("static", "dynamic")
REASONS = ("running", "eos", "stop", "length")


@dataclass
class Prefix:
    """The state after a prefill: R rows that can be continued or sampled from.

    cache: DynamicCache over W columns; mask [R, W] long (1 = a real token; holes are allowed);
    last_pos [R, 1]: position id of each row's last token; logits [R, V]: next-token logits.
    """
    cache: DynamicCache
    mask: torch.Tensor
    last_pos: torch.Tensor
    logits: torch.Tensor


def default_eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config and the tokenizer, deduplicated."""
    config = getattr(model, "generation_config", None)
    ids = (getattr(config, "eos_token_id", None), tokenizer.eos_token_id)
    ids = [i for x in ids if x is not None for i in (x if isinstance(x, (list, tuple)) else [x])]
    return sorted(set(map(int, ids)))


def default_decode(model) -> str:
    return "static" if next(model.parameters()).device.type == "cuda" else "dynamic"


def row_generators(seed, prompts, n, device):
    """One generator per row i*n + j (prompt i of `prompts`, id lists, sampled n times), seeded
    from a hash of (seed, prompt i's ids, j): a row's draws depend on nothing else. None: None."""
    if seed is None:
        return None
    keys = [f"{seed}:".encode() + array("q", p).tobytes() + j.to_bytes(4, "little")
            for p in prompts for j in range(n)]
    digests = [hashlib.blake2b(k, digest_size=8).digest() for k in keys]
    return [torch.Generator(device).manual_seed(int.from_bytes(d, "little") >> 1) for d in digests]


def sample_next(logits, temperature=1.0, top_p=1.0, noise=None):
    """Next token per row. logits [R, V] float, noise [R, V] ~ Exp(1) -> ids [R] long.
    temperature 0: argmax. Else p = softmax(logits / temperature), v kept when the mass ranked
    before it is < top_p (the top one always is), the sample argmax over kept v of p_v / noise_v:
    token v wins with probability p_v / sum(p) (noise_v > 0; an infinite one only makes v lose)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, order = probs.sort(dim=-1, descending=True)
        drop = (p_sorted.cumsum(-1) - p_sorted) >= top_p
        probs = probs.scatter(-1, order, p_sorted.masked_fill(drop, 0))
    return (probs / noise).argmax(-1)


def token_scores(logits, tok, temperature=1.0):
    """(log-prob of tok [R], entropy [R]) under softmax(logits / temperature), logits [R, V] float
    (-inf where an id is masked); temperature 0 is scored at 1."""
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, tok[:, None]).squeeze(-1), torch.special.entr(logp.exp()).sum(-1)


class Sampler:
    """The sampling settings of one call. static (the model's static decoder) and close_depth: the
    fast loop's (harness/fast.py)."""

    def __init__(self, model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0, stop=(),
                 eos_ids=None, decode=None, close_depth=None):
        self.model, self.tokenizer = model, tokenizer
        self.decode = decode or default_decode(model)  # train.py and evaluate.py check the flags
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        if any(not isinstance(s, str) or len(s.encode()) != 1 for s in stop):  # each inside one token
            raise ValueError(f"stop strings must be one byte, as the labels' '\\n' is; got {list(stop)}")
        self.stop_strs = list(stop)
        self.eos_ids = default_eos_ids(model, tokenizer) if eos_ids is None else [int(i) for i in eos_ids]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.device, self.close_depth = next(model.parameters()).device, close_depth  # fast.py's depth
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed `past_key_values` to `cache` (the old name goes in 5.40)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.step_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.static = staticcache.decoder(model, self.cache_kw) if self.decode == "static" else None
        self._has_stop = {}

    def stop_tokens(self, tok):
        """The ids among `tok` whose text contains a one-byte stop string (one host copy per step)."""
        ids = tok.unique().tolist()
        fresh = [i for i in ids if i not in self._has_stop]
        for i, text in zip(fresh, self.tokenizer.batch_decode([[i] for i in fresh], skip_special_tokens=True)):
            self._has_stop[i] = any(x in text for x in self.stop_strs)
        return torch.tensor([i for i in ids if self._has_stop[i]], dtype=torch.long, device=tok.device)

    @torch.no_grad()
    def prefill(self, seqs, after=None) -> Prefix:
        """One eager forward over `seqs` (R non-empty id lists), each LEFT-padded to the longest and
        appended after `after` (a Prefix of R rows, whose cache is extended in place) or from scratch."""
        toks = [torch.tensor(s, dtype=torch.long) for s in seqs]
        left = partial(pad_sequence, batch_first=True, padding_side="left")
        ids = left(toks, padding_value=self.pad_id).to(self.device)
        seg = left([torch.ones_like(t) for t in toks]).to(self.device)  # 1 on the tokens of seqs
        mask = seg if after is None else torch.cat([after.mask, seg], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        cache = DynamicCache(config=self.model.config) if after is None else after.cache
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.cache_kw: cache}, **self.step_kw)
        return Prefix(cache, mask, positions[:, -1:], out.logits[:, -1])

    @torch.no_grad()
    def sample(self, prefix, n=1, generator=None, scores=False):
        """n continuations of every row of `prefix` (consumed) -> ids [R*n, T], lengths [R*n],
        reasons [R*n] (into REASONS); row i*n + j continues prefix row i. generator: one, or one per
        row (row_generators). scores: also each id's log-prob [R*n, T] and entropy sum [R*n]."""
        state = _Rows(self, prefix.logits.shape[0] * n, generator, scores)
        if self.static is not None:  # CUDA's fast loop, the same samples
            fast.decode(self, prefix, n, state)
        else:
            self._decode_dynamic(prefix, n, state)
        out = state.ids, state.length, torch.where(state.done, state.reason, 3)  # 3: "length"
        return out if state.logp is None else (*out, state.logp, state.entropy)

    def _decode_dynamic(self, prefix, n, state):
        """The plain loop: each step prefills one token per cache row until every row finishes; one
        cache row per distinct (cache row, token), so samples share one while they agree (a tree)."""
        live = torch.arange(len(prefix.logits) * n, device=self.device)  # rows running
        pre, src, width = prefix, live // n, prefix.logits.shape[-1]  # src: a live row's cache row
        for t in range(self.max_new_tokens):
            tok = state.advance(t, pre.logits[src], live)
            keep = ~state.done[live]
            if t == self.max_new_tokens - 1 or not keep.any():
                return
            key, src = torch.unique(src[keep] * width + tok[keep], return_inverse=True)
            idx, live = key // width, live[keep]
            if len(idx) != len(pre.mask) or not bool((idx == torch.arange(len(idx), device=idx.device)).all()):
                pre.cache.batch_select_indices(idx)  # rows fork or finish (else nothing moves)
                pre.mask = pre.mask[idx]
            pre = self.prefill((key % width)[:, None].tolist(), after=pre)


class _Rows:
    """Per-row bookkeeping shared by the decode loops: sampling, ids, lengths, finish reasons, scores."""

    def __init__(self, s, rows, generator, scores=False):
        self.s, self.generator, dev = s, generator, s.device
        self.ids = torch.full((rows, s.max_new_tokens), s.pad_id, dtype=torch.long, device=dev)
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.reason = torch.zeros(rows, dtype=torch.long, device=dev)
        self.length = torch.zeros(rows, dtype=torch.long, device=dev)
        self.logp = torch.zeros((rows, s.max_new_tokens), device=dev) if scores else None
        self.entropy = torch.zeros(rows, device=dev) if scores else None
        self.eos = torch.tensor(s.eos_ids, dtype=torch.long, device=dev)
        self.vocab = len(s.tokenizer)

    def advance(self, t, logits, live):
        """Step t of rows `live` from logits [len(live), V] -> their tokens (pad where done)."""
        s = self.s
        logits = logits.float()
        if logits.shape[-1] > self.vocab:
            logits = logits.clone()
            logits[:, self.vocab:] = float("-inf")
        noise, done = None, self.done[live]
        if s.temperature > 0 and isinstance(self.generator, list):  # a stream per row: the running rows draw
            noise = torch.full_like(logits, 0.5)
            at = live.tolist()
            for m in (~done).nonzero().squeeze(1).tolist():
                noise[m] = torch.rand(logits.shape[-1], device=logits.device, generator=self.generator[at[m]])
            noise = noise.log_().neg_()
        elif s.temperature > 0:  # Exp(1) = -log(U) for every row of the chunk, live or not (see the docstring)
            noise = torch.rand((len(self.done), logits.shape[-1]), device=logits.device, generator=self.generator)
            noise = noise[live].log_().neg_()
        tok = torch.where(done, s.pad_id, sample_next(logits, s.temperature, s.top_p, noise))
        self.ids[live, t] = tok
        if self.logp is not None:
            logp, entropy = token_scores(logits, tok, s.temperature)
            self.logp[live, t] = logp.masked_fill(done, 0)
            self.entropy[live] += entropy.masked_fill(done, 0)
        self.length[live] += (~done).long()
        hit_eos = ~done & torch.isin(tok, self.eos)
        self.reason[live] = torch.where(hit_eos, 1, self.reason[live])
        self.done[live] = done | hit_eos
        if s.stop_strs:
            running = live[~self.done[live]]
            hits = running[torch.isin(tok[~self.done[live]], s.stop_tokens(tok))]
            self.reason[hits], self.done[hits] = 2, True
        return tok


@dataclass
class Samples:
    """Generation results in prompt-major order: the n samples of prompt i sit at i*n .. i*n+n-1."""
    ids: list[list[int]]    # generated ids, EOS / stop token included, no padding
    texts: list[str]        # tokenizer.decode(ids, skip_special_tokens=True)
    lengths: list[int]      # len(ids)
    finish: list[str]       # "eos" | "stop" | "length"
    prompt_index: list[int] # which prompt each sample continues
    logprobs: list[list[float]] = field(default_factory=list)  # per id: its log-prob (token_scores)
    entropy_sum: list[float] = field(default_factory=list)     # the ids' entropy sum (token_scores)


def generate(model, tokenizer, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0,
             stop=(), eos_ids=None, seed=None, batch_size=None, progress=False, decode=None,
             scores=False, chunks=None, keyed=False) -> Samples:
    """Sample n continuations of each prompt (token-id lists, chat template applied); the same seed,
    prompts and batch_size (prompts per chunk) give the same samples on every decode path.
    keyed: a generator per row (row_generators). stop: one-byte strings (kept). scores:
    Samples.logprobs, .entropy_sum. chunks: the chunks to sample (None: all). progress: a bar."""
    sampler = Sampler(model, tokenizer, max_new_tokens, temperature, top_p, stop, eos_ids, decode)
    batch_size = batch_size or max(len(prompts), 1)
    starts = range(0, len(prompts), batch_size)
    gens = chunk_generators(seed, len(starts), sampler.device)
    todo = [(starts[i], gens[i]) for i in (range(len(starts)) if chunks is None else chunks)]
    was_training = model.training
    model.eval()
    result = Samples([], [], [], [], [])
    for start, gen in tqdm(todo, desc=progress if isinstance(progress, str) else "generate", disable=not progress):
        chunk = [list(map(int, p)) for p in prompts[start:start + batch_size]]
        gen = row_generators(seed, chunk, n, sampler.device) if keyed else gen
        out = sampler.sample(sampler.prefill(chunk), n, gen, scores)
        ids, length, reason, *scored = (x.tolist() for x in out)
        result.ids += [x[:m] for x, m in zip(ids, length)]
        result.lengths += length
        result.finish += [REASONS[x] for x in reason]
        result.prompt_index += [start + r // n for r in range(len(ids))]
        if scores:
            result.logprobs += [x[:m] for x, m in zip(scored[0], length)]
            result.entropy_sum += scored[1]
    model.train(was_training)
    result.texts = tokenizer.batch_decode(result.ids, skip_special_tokens=True) if result.ids else []
    return result


def chunk_generators(seed, count, device):
    """One generator per chunk, each seeded from `seed`: a chunk's samples do not depend on how
    many random draws earlier chunks made (the static path may run a few steps past the end)."""
    if seed is None:
        return [None] * count
    seeds = torch.randint(2 ** 62, (count,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [torch.Generator(device).manual_seed(s) for s in seeds]
