"""Batched sampling with a KV cache, for rollouts, evaluation and label.py's plain path (its fast
path builds a decode.Sampler itself).

    samples = generate(model, tokenizer, prompts, n=8, max_new_tokens=1024, temperature=0.8, seed=0)
    samples.ids[i * 8 + j]   # j-th continuation of prompts[i]: generated ids only, EOS/stop included

Decoding is "dynamic" (the reference loop: decode.py, Sampler._decode_dynamic) or "static" (CUDA
graphs, the default on CUDA): the same samples for a seed (docs/reference.md).
"""
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from decode import REASONS, Sampler, row_generators


@dataclass
class Samples:
    """Generation results in prompt-major order: the n samples of prompt i sit at i*n .. i*n+n-1."""
    ids: list[list[int]]    # generated ids, EOS / stop token included, no padding
    texts: list[str]        # tokenizer.decode(ids, skip_special_tokens=True)
    lengths: list[int]      # len(ids)
    finish: list[str]       # "eos" | "stop" | "length"
    prompt_index: list[int] # which prompt each sample continues
    logprobs: list[list[float]] = field(default_factory=list)  # per id: the sampler's log-prob (Scores)
    entropy_sum: list[float] = field(default_factory=list)     # sum over the ids of the entropy (Scores)


def generate(model, tokenizer, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0,
             stop=(), eos_ids=None, seed=None, batch_size=None, progress=False, decode=None,
             scores=False, chunks=None, keyed=False) -> Samples:
    """Sample n continuations of each prompt. prompts: list of token-id lists (chat template applied).

    stop: strings (stop once the generated text contains one) and/or token ids, the token that
    completes a stop kept. eos_ids: default the generation config's and tokenizer's. seed: the same
    seed, prompts and batch_size give the same samples, on either decode path. scores:
    Samples.logprobs and .entropy_sum under softmax(logits / temperature), not top-p's (else []).
    batch_size: prompts per chunk (rows = batch_size * n). decode: "static" | "dynamic" | None
    (static on CUDA). chunks: the indices of the chunks to sample (None: all), each with the
    generator it has in a call that runs them all (evaluation/benchmarks.py). progress: a bar (a string:
    its label). keyed: a generator per row, seeded from (seed, its prompt, its sample index), so a
    prompt's samples do not depend on batch_size or the other prompts (label.py's forced answers).
    """
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (the chat template adds some)")
    sampler = Sampler(model, tokenizer, max_new_tokens, temperature, top_p, stop, eos_ids, decode)
    batch_size = batch_size or max(len(prompts), 1)
    starts = range(0, len(prompts), batch_size)
    gens = chunk_generators(seed, len(starts), sampler.device)
    todo = [(starts[i], gens[i]) for i in (range(len(starts)) if chunks is None else chunks)]

    was_training = model.training
    model.eval()
    result = Samples([], [], [], [], [])
    try:
        for start, gen in tqdm(todo, desc=progress if isinstance(progress, str) else "generate", disable=not progress):
            chunk = [list(map(int, p)) for p in prompts[start:start + batch_size]]
            gen = row_generators(seed, chunk, n, sampler.device) if keyed else gen
            out = sampler.sample(sampler.prefill(chunk), n, gen, scores)
            ids, length, reason, *scored = (x.tolist() for x in out)
            for r in range(len(ids)):
                result.ids.append(ids[r][:length[r]])
                if scores:
                    result.logprobs.append(scored[0][r][:length[r]])
                    result.entropy_sum.append(scored[1][r])
                result.lengths.append(length[r])
                result.finish.append(REASONS[reason[r]])
                result.prompt_index.append(start + r // n)
    finally:
        model.train(was_training)
    result.texts = tokenizer.batch_decode(result.ids, skip_special_tokens=True) if result.ids else []
    return result


def chunk_generators(seed, count, device):
    """One generator per chunk, each seeded from `seed`: a chunk's samples do not depend on how
    many random draws earlier chunks made (the static path may run a few steps past the end)."""
    if seed is None:
        return [None] * count
    base = torch.Generator().manual_seed(seed)
    seeds = torch.randint(2 ** 62, (count,), generator=base).tolist()
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]
