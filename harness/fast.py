"""The fast loop of rollout.Sampler, `decode`, which pays on a GPU (harness/staticcache.py's CUDA
graphs) and equals the plain one (tests/test_rollout.py holds it to Sampler._decode_dynamic's
samples). More: docs/reference.md, "The sampler"."""
from itertools import accumulate

import torch


def decode(s, prefix, n, state):
    """Sampler.sample's loop on CUDA (s a rollout.Sampler, state its _Rows): every row in the static
    buffers, finished ones masked in place. close_depth: a row also stops ("stop") once its text has
    closed close_depth more braces than it opened (label.py: 1, the brace closing `\\boxed{`)."""
    rows = len(state.done)
    if s.close_depth is not None:
        state.depth = torch.full((rows,), s.close_depth, dtype=torch.long, device=s.device)
    step = s.static.start(s.model, prefix, n, s.max_new_tokens)
    prefix.cache = None  # copied into the static buffers; free it before decoding
    live, logits = torch.arange(rows, device=s.device), prefix.logits.repeat_interleave(n, 0)
    for t in range(s.max_new_tokens):
        tok = state.advance(t, logits, live)
        if s.close_depth is not None:  # braces are one byte, inside one token (as one-byte stops)
            delta, low = braces(s, tok)
            closed = live[~state.done[live] & (state.depth[live] + low <= 0)]
            state.depth[live] += delta
            state.reason[closed], state.done[closed] = 2, True
        # A host sync per step only where stop strings need one anyway, or on CPU.
        check = s.stop_strs or s.device.type != "cuda" or t % 8 == 0
        if t == s.max_new_tokens - 1 or (check and bool(state.done.all())):
            return
        logits = step(tok, state.done)[:rows]


def braces(s, tok):
    """Per token of `tok`: ("{" minus "}" count, lowest running value of it) of its text."""
    known = s.__dict__.setdefault("_braces", {})
    ids = tok.unique()
    fresh = [i for i in ids.tolist() if i not in known]
    for i, text in zip(fresh, s.tokenizer.batch_decode([[i] for i in fresh], skip_special_tokens=True)):
        running = [0, *accumulate((ch == "{") - (ch == "}") for ch in text)]
        known[i] = (running[-1], min(running))
    table = torch.tensor([known[i] for i in ids.tolist()], dtype=torch.long, device=tok.device)
    return table[torch.searchsorted(ids, tok)].unbind(-1)
