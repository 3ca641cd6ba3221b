"""Batched sampling with a KV cache: rollouts, forced answers and evaluation all go through here.

    samples = generate(model, tokenizer, prompts, n=8, max_new_tokens=1024, temperature=0.8, seed=0)
    samples.ids[i * 8 + j]   # j-th continuation of prompts[i]: generated ids only, EOS/stop included

How one chunk of prompts is generated:
  1. prefill: the chunk's B prompts, LEFT-padded to the longest, in one forward pass; position ids
     are `cumsum(attention_mask) - 1` (clamped at 0) so every prompt starts at position 0.
  2. share: the KV cache, the last logits, mask and positions are repeated n times along the batch
     (`DynamicCache.batch_repeat_interleave`), so the n samples of a prompt share its prefill.
  3. decode: one forward pass per new token over the running rows, keeping only the last position's
     logits. Once a quarter of the batch has finished, finished rows are dropped from the batch and
     from the KV cache (`batch_select_indices`), so a few long samples do not drag the rest along.

Sampling: temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the
smallest set of top tokens whose probability reaches top_p. Ids the tokenizer does not have
(the 7B model's embedding has 152,064 rows, the tokenizer about 151,666 ids) are never sampled.
"""
import inspect
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache


@dataclass
class Samples:
    """Generation results in prompt-major order: the n samples of prompt i sit at i*n .. i*n+n-1."""
    ids: list[list[int]]    # generated ids, EOS / stop token included, no padding
    texts: list[str]        # tokenizer.decode(ids, skip_special_tokens=True)
    lengths: list[int]      # len(ids)
    finish: list[str]       # "eos" | "stop" | "length"
    prompt_index: list[int] # which prompt each sample continues


_REASONS = ("running", "eos", "stop", "length")


def default_eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config and the tokenizer (R1: 151643), deduplicated."""
    ids = []
    for eos in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                tokenizer.eos_token_id):
        ids += eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return sorted(set(int(i) for i in ids))


def sample_next(logits, temperature=1.0, top_p=1.0, generator=None):
    """Next token per row. logits [R, V] float -> ids [R] long.

    temperature 0: argmax. Otherwise p = softmax(logits / temperature); with top_p < 1 a token is
    kept when the probability mass of the tokens ranked before it is < top_p (so the top one always
    is); torch.multinomial samples from the kept, unnormalised mass.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, order = probs.sort(dim=-1, descending=True)
        keep = (p_sorted.cumsum(-1) - p_sorted) < top_p
        pick = torch.multinomial(p_sorted * keep, 1, generator=generator)
        return order.gather(-1, pick).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name is deprecated, removal 5.40).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _keeps_last_logits(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def _generate_chunk(model, tokenizer, prompts, n, max_new_tokens, temperature, top_p,
                    stop_strs, stop_ids, eos_ids, pad_id, generator):
    """One chunk: B prompts -> (ids [B*n, T] long on device, lengths [B*n], reasons [B*n])."""
    device = next(model.parameters()).device
    cache_kw = _cache_kwarg(model)
    extra = {"logits_to_keep": 1} if _keeps_last_logits(model) else {}
    vocab = len(tokenizer)

    # 1. prefill, left padded: real tokens sit at the right end so the next token is column -1 for every row.
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                use_cache=True, **{cache_kw: cache}, **extra)
    logits = out.logits[:, -1]

    # 2. share the prefill: rows i*n .. i*n+n-1 continue prompt i.
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    pos = positions[:, -1:]
    rows = logits.shape[0]

    # 3. decode. Only this step's [live, V] logits exist; generated ids go into a preallocated buffer.
    ids = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    reason = torch.zeros(rows, dtype=torch.long, device=device)
    length = torch.zeros(rows, dtype=torch.long, device=device)
    live = torch.arange(rows, device=device)  # rows still in the model's batch
    eos_t = torch.tensor(eos_ids, dtype=torch.long, device=device)
    stop_t = torch.tensor(stop_ids, dtype=torch.long, device=device)
    # Each token decodes to at least one character, so a stop string of k characters ending at the
    # new token lies within the last k tokens; a few more absorb partial UTF-8 bytes.
    window = max((len(s) for s in stop_strs), default=0) + 4
    for t in range(max_new_tokens):
        logits = logits.float()
        if logits.shape[-1] > vocab:
            logits[:, vocab:] = float("-inf")
        tok = torch.where(done[live], pad_id, sample_next(logits, temperature, top_p, generator))
        ids[live, t] = tok
        active = ~done[live]
        length[live] += active.long()
        hit_eos = active & torch.isin(tok, eos_t)
        hit_stop = active & ~hit_eos & torch.isin(tok, stop_t)
        reason[live] = torch.where(hit_eos, 1, torch.where(hit_stop, 2, reason[live]))
        done[live] |= hit_eos | hit_stop
        if stop_strs:
            # The one host copy per step: the last few tokens of each running row, decoded in one
            # batched call and searched.
            running = live[~done[live]].tolist()
            tails = tokenizer.batch_decode(ids[running, max(0, t + 1 - window):t + 1].tolist(),
                                           skip_special_tokens=True) if running else []
            hits = [r for r, text in zip(running, tails) if any(s in text for s in stop_strs)]
            if hits:
                hit = torch.tensor(hits, device=device)
                reason[hit], done[hit] = 2, True
        keep = ~done[live]
        n_keep = int(keep.sum())
        if t == max_new_tokens - 1 or n_keep == 0:
            break
        if n_keep <= 0.75 * len(live):
            # Drop finished rows from the batch (and their KV cache) so long tails decode cheaply.
            idx = keep.nonzero().squeeze(1)
            cache.batch_select_indices(idx)
            live, tok, mask, pos = live[idx], tok[idx], mask[idx], pos[idx]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        pos = pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                    use_cache=True, **{cache_kw: cache}, **extra)
        logits = out.logits[:, -1]
    reason = torch.where(done, reason, 3)
    return ids, length, reason


def generate(model, tokenizer, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0,
             stop=(), eos_ids=None, seed=None, batch_size=None, progress=False) -> Samples:
    """Sample n continuations of each prompt. prompts: list of token-id lists (chat template applied).

    stop: strings (stop once the generated text contains one) and/or token ids; the token that
    completes a stop is kept. eos_ids default to the generation config's and tokenizer's EOS.
    seed: a torch.Generator on the model's device, seeded once per call, so the same seed, prompts
    and batch_size give the same samples. batch_size: prompts per chunk (rows = batch_size * n).
    """
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (the chat template adds some)")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if isinstance(stop, (str, int)):
        stop = (stop,)
    stop_strs = [s for s in stop if isinstance(s, str) and s]
    stop_ids = [int(s) for s in stop if not isinstance(s, str)]
    eos_ids = default_eos_ids(model, tokenizer) if eos_ids is None else [int(i) for i in eos_ids]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    device = next(model.parameters()).device
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    batch_size = batch_size or max(len(prompts), 1)

    was_training = model.training
    model.eval()
    result = Samples([], [], [], [], [])
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc="generate", disable=not progress):
            chunk = [list(map(int, p)) for p in prompts[start:start + batch_size]]
            ids, length, reason = _generate_chunk(
                model, tokenizer, chunk, n, max_new_tokens, temperature, top_p,
                stop_strs, stop_ids, eos_ids, pad_id, generator)
            ids, length, reason = ids.tolist(), length.tolist(), reason.tolist()
            for r in range(len(ids)):
                result.ids.append(ids[r][:length[r]])
                result.lengths.append(length[r])
                result.finish.append(_REASONS[reason[r]])
                result.prompt_index.append(start + r // n)
    finally:
        model.train(was_training)
    result.texts = tokenizer.batch_decode(result.ids, skip_special_tokens=True) if result.ids else []
    return result
