"""The fast paths that pay on a GPU, below the plain ones they equal (tests/test_rollout.py and
tests/test_label.py hold each to its plain path's samples, labels and features):

- `decode`: rollout.Sampler's loops on CUDA. `_decode_static` decodes every row in preallocated
  buffers with the step captured as a CUDA graph (harness/staticcache.py); `_decode_shared`
  (share_rows=True) gives rows whose histories agree one cache row. The reference:
  Sampler._decode_dynamic.
- `tree_answers`: label.mc_labels' forced answers and probe features along each trajectory's
  prefix tree (each problem prompt prefilled once, each trajectory once, the tail once per cut;
  the K answers of a cut share a cache row while they agree). The reference: mc_labels' plain path
  (rollout.generate on the whole forced prompts, then label.plain_features).
Nothing here imports a top-level file: the method's functions come in as arguments (`lib`).
More: docs/reference.md, "The sampler".
"""
from contextlib import nullcontext
from types import SimpleNamespace

import torch

LENGTH_GROUP = 2  # trajectories whose longest cuts have bit lengths within this many share a group


def decode(s, prefix, n, state):
    """Sampler.sample's loop on the fast paths (s a rollout.Sampler, state its _Rows): the static
    one where s.static is set, else the shared rows. close_depth: a row also stops ("stop") where
    close_depth + "{" - "}" of its text reaches 0 (label.py: 1, the brace closing `\\boxed{`)."""
    if s.close_depth is not None:
        state.depth = torch.full((len(state.done),), s.close_depth, dtype=torch.long,
                                 device=s.device)
    (_decode_static if s.static is not None else _decode_shared)(s, prefix, n, state)


def _advance(s, state, t, logits, live):
    """state.advance, then the rows whose forced box closes stop (close_depth)."""
    tok = state.advance(t, logits, live)
    if s.close_depth is not None:  # braces are one byte, inside one token (as one-byte stops)
        delta, low = braces(s, tok)
        closed = live[~state.done[live] & (state.depth[live] + low <= 0)]
        state.depth[live] += delta
        state.reason[closed], state.done[closed] = 2, True
    return tok


def braces(s, tok):
    """Per token of `tok`: ("{" minus "}" count, lowest running value of it) of its text."""
    known = s.__dict__.setdefault("_braces", {})
    ids = tok.unique()
    fresh = [i for i in ids.tolist() if i not in known]
    for i, text in zip(fresh, s.tokenizer.batch_decode([[i] for i in fresh], skip_special_tokens=True)):
        depth = low = 0
        for ch in text:
            depth += (ch == "{") - (ch == "}")
            low = min(low, depth)
        known[i] = (depth, low)
    table = torch.tensor([known[i] for i in ids.tolist()], dtype=torch.long, device=tok.device)
    return table[torch.searchsorted(ids, tok)].unbind(-1)


def _decode_shared(s, prefix, n, state):
    """Sampler._decode_dynamic with one cache row per distinct (cache row, new token) of the running
    rows (at first one per prefix row for its n samples)."""
    cache, mask, pos, logits = prefix.cache, prefix.mask, prefix.last_pos, prefix.logits
    live = torch.arange(len(logits) * n, device=s.device)  # rows still running
    src = live // n  # the cache row (and logits row) of each live row
    for t in range(s.max_new_tokens):
        tok = _advance(s, state, t, logits[src], live)
        keep = ~state.done[live]
        if t == s.max_new_tokens - 1 or int(keep.sum()) == 0:
            return
        width = logits.shape[-1]
        key, src = torch.unique(src[keep] * width + tok[keep], return_inverse=True)
        idx, live = key // width, live[keep]
        if len(idx) != len(mask) or not bool((idx == torch.arange(len(idx), device=idx.device)).all()):
            cache.batch_select_indices(idx)  # rows fork or finish (else nothing moves)
            mask, pos = mask[idx], pos[idx]
        logits, mask, pos = s._forward(cache, key % width, mask, pos)


def _decode_static(s, prefix, n, state):
    """All rows in preallocated buffers (harness/staticcache.py), finished ones masked in place."""
    rows = len(state.done)
    step = s.static.start(s.model, prefix, n, s.max_new_tokens)
    prefix.cache = None  # copied into the static buffers; free it before decoding
    live, logits = torch.arange(rows, device=s.device), prefix.logits.repeat_interleave(n, 0)
    for t in range(s.max_new_tokens):
        tok = _advance(s, state, t, logits, live)
        # A host sync per step only where stop strings need one anyway, or on CPU.
        check = s.stop_strs or s.device.type != "cuda" or t % 8 == 0
        if t == s.max_new_tokens - 1 or (check and bool(state.done.all())):
            return
        logits = step(tok)[:rows]


def tree_answers(model, tokenizer, prompts, responses, cut_lists, cuts, where, tail, k, features, lib,
                 **kw):
    """mc_labels' forced answers on the fast path -> (texts, feats): texts[j*k:(j+1)*k] the K
    answers to forced prompt j = cuts[j] = (trajectory i, cut b), where[i] the j of trajectory i's cuts; with
    features, feats the N [len(cuts_i), d] float32 CPU tensors mc_labels(features=True) returns.
    lib: (rollout.Sampler, rollout.row_generators, probe.last_layer, probe.LAST_K).
    kw: temperature, top_p, max_new_tokens, seed, batch_size, decode (mc_labels')."""
    # Each trajectory's features are read where its longest cut's forced prompt is asked (reads[j]),
    # off the row of the trajectory that asks it when theirs agree up to that cut, else off its own.
    reads, feats = [[] for _ in cuts], {} if features else None
    for i, bs in enumerate(cut_lists if features else []):
        if bs:
            j = where[i][max(range(len(bs)), key=bs.__getitem__)]
            src, last = cuts[j][0], max(bs)
            same = list(prompts[src]) == list(prompts[i]) and list(responses[src][:last]) == list(responses[i][:last])
            reads[j].append((i, list(bs), src if same else i))
    out = sample_answers(model, tokenizer, prompts, responses, cuts, tail, k, lib, reads, feats, **kw)
    if features:
        feats = [feats.get(i, torch.zeros(0, model.config.hidden_size)) for i in range(len(cut_lists))]
    return out.texts, feats


def sample_answers(model, tokenizer, prompts, responses, cuts, tail, k, lib, reads=None, features=None,
                   **kw):
    """k samples of each forced prompt `prompts[i] + responses[i][:b] + tail`, (i, b) in cuts, in
    that order (.ids and .texts [j*k:(j+1)*k] for cut j): the plain path's samples up to float
    rounding, ended at the brace that closes the forced box. The cuts go in groups of similar
    trajectory length (length_groups), so short prefixes carry no padding of long ones. reads,
    features: reads[j] lists the (trajectory i, its cuts, the trajectory whose row they are read
    off) whose features the chunk asking cut j reads into the dict features[i]."""
    out = SimpleNamespace(ids=[None] * (len(cuts) * k), texts=[None] * (len(cuts) * k))
    for js in length_groups(cuts):
        part = forced_samples(model, tokenizer, prompts, responses, [cuts[j] for j in js], tail, k, lib,
                              reads=reads and [reads[j] for j in js], features=features, **kw)
        for m, j in enumerate(js):
            out.ids[j * k:(j + 1) * k] = part.ids[m * k:(m + 1) * k]
            out.texts[j * k:(j + 1) * k] = part.texts[m * k:(m + 1) * k]
    return out


def length_groups(cuts):
    """[indices into cuts]: the cuts grouped by their trajectory's longest cut, to within a factor
    of 4 (bit lengths within LENGTH_GROUP), shortest group first."""
    longest, groups = {}, {}
    for i, b in cuts:
        longest[i] = max(longest.get(i, 0), b)
    for j, (i, _) in enumerate(cuts):
        groups.setdefault(longest[i].bit_length() // LENGTH_GROUP, []).append(j)
    return [groups[key] for key in sorted(groups)]


@torch.no_grad()
def forced_samples(model, tokenizer, prompts, responses, cut_of, tail, k, lib, temperature=0.8, top_p=1.0,
                   max_new_tokens=32, seed=None, batch_size=None, decode=None, reads=None, features=None):
    """sample_answers for one group of cuts, in the same order, the K rows of a cut sharing a cache
    row while they agree (Sampler(share_rows=True)). reads[m], aligned with cut_of: sample_answers'."""
    Sampler, row_generators, last_layer, last_k = lib
    sampler = Sampler(model, tokenizer, max_new_tokens, temperature, top_p, stop=("\n",), decode=decode,
                      share_rows=True, close_depth=1)
    batch_size = batch_size or len(cut_of)
    reads = reads or [[] for _ in cut_of]
    chunks = [(cut_of[s:s + batch_size], sum(reads[s:s + batch_size], [])) for s in range(0, len(cut_of), batch_size)]
    out = SimpleNamespace(ids=[], texts=[])
    was_training = model.training
    model.eval()
    try:
        for chunk, readers in chunks:
            gens = row_generators(seed, [list(prompts[i]) + list(responses[i][:b]) + list(tail) for i, b in chunk],
                                  k, sampler.device)  # the plain path's: keyed by the forced prompt
            # a row per trajectory asked here (or read here off its own row), its response
            # prefilled up to the longest cut asked or read off it here
            trajs = list(dict.fromkeys([i for i, _ in chunk] + [src for _, _, src in readers]))
            head = dict.fromkeys(trajs, 0)
            for i, b in chunk + [(src, max(bs)) for _, bs, src in readers]:
                head[i] = max(head[i], b)
            distinct = list(dict.fromkeys(tuple(prompts[i]) for i in trajs))
            rows = lambda xs: torch.tensor(xs, device=sampler.device)  # noqa: E731
            states = {}  # what the features need of the last layer's states of the two prefills

            def keeping(name, reduce):  # states[name] = reduce(the last layer's output)
                keep = lambda h: states.__setitem__(name, reduce(h))  # noqa: E731
                return last_layer(model, keep) if readers else nullcontext()
            # 1. each distinct problem prompt once; 2. each trajectory up to its longest cut once.
            with keeping("prompt", lambda h: h[:, -(last_k - 1):].clone()):
                pre = sampler.prefill([list(p) for p in distinct])
            pre = pre.select(rows([distinct.index(tuple(prompts[i])) for i in trajs]))
            heads = [list(responses[i][:head[i]]) for i in trajs]
            if any(heads):  # none where every cut is at 0 (responses that start with CLOSE, cut after it)
                read = readers and _reader(readers, trajs, head, prompts, distinct, states, sampler.device, last_k)
                with keeping("feats", read):
                    pre = sampler.prefill(heads, after=pre)
                for m, (i, bs, _) in enumerate(readers):
                    features[i] = states["feats"][m, :len(bs)].cpu()
            # 3. a row per cut: its trajectory's row with the response past b masked out, then the tail.
            pre = pre.select(rows([trajs.index(i) for i, _ in chunk]))
            end = pre.mask.shape[1]  # the response segment is right-aligned, ending here
            cut_col = rows([end - head[i] + b for i, b in chunk])
            pre.mask = pre.mask * (torch.arange(end, device=sampler.device) < cut_col[:, None])
            pre = sampler.prefill([list(tail)] * len(chunk), after=pre)
            ids, length, _ = sampler.sample(pre, k, gens)
            out.ids += [r[:n] for r, n in zip(ids.tolist(), length.tolist())]
    finally:
        model.train(was_training)
    out.texts = tokenizer.batch_decode(out.ids, skip_special_tokens=True)
    return out


def _reader(readers, trajs, head, prompts, distinct, states, device, last_k):
    """reduce() for the response prefill of a chunk: its output h [rows, W, d] (rows = trajs, each
    response right-aligned, head[i] long) -> the features of the readers' cuts [readers, B, d]
    (split_prefix_features) off their rows, the prompt's last positions from states["prompt"]."""
    tail = states["prompt"]  # [distinct prompts, <= last_k - 1, d], right-aligned
    tail = torch.nn.functional.pad(tail, (0, 0, last_k - 1 - tail.shape[1], 0))
    tail = tail[[distinct.index(tuple(prompts[src])) for _, _, src in readers]]
    at = torch.tensor([trajs.index(src) for _, _, src in readers], device=device)
    width = max(len(bs) for _, bs, _ in readers)
    cuts = torch.tensor([bs + [0] * (width - len(bs)) for _, bs, _ in readers], dtype=torch.long)
    plens = [len(prompts[src]) for _, _, src in readers]
    return lambda h: split_prefix_features(tail, h, [h.shape[1] - head[src] for _, _, src in readers],
                                           cuts, plens, last_k, rows=at)


def split_prefix_features(tail, segment, start, cuts, prompt_lens, last_k, rows=None):
    """prefix_features for prefixes prompt + response[:b] whose hidden states were computed in two
    pieces, the prompt and then the response on top of its cache (tree_answers' forced-answer prefill).

    For R prefix rows: tail [R, last_k - 1, d], each row's last last_k - 1 prompt positions
    (right-aligned: a prompt of P tokens fills only its last P of them); segment [S, W, d], row r's
    response position t at segment[rows[r], start[r] + t] (rows default 0 .. R - 1; several rows
    may read one segment row); cuts [R, B] long response cuts b (0 = none); prompt_lens [R].
    Returns [R, B, d] float32, prefix_features(hidden of prompt + response, P + b): the mean over
    response positions t = b - last_k .. b - 1 that exist (t < 0 reads the prompt), 0 where b = 0.
    """
    W, dev = segment.shape[1], segment.device
    cuts, start, prompt_lens = (torch.as_tensor(x, device=dev) for x in (cuts, start, prompt_lens))
    R = len(cuts)
    rows = torch.arange(R, device=dev) if rows is None else torch.as_tensor(rows, device=dev)
    t = cuts.unsqueeze(-1) - last_k + torch.arange(last_k, device=dev)               # [R, B, k]
    x = segment[rows.view(R, 1, 1), (start.view(R, 1, 1) + t).clamp(0, W - 1)]       # [R, B, k, d]
    if last_k > 1:
        own = torch.arange(R, device=dev).view(R, 1, 1)
        x = torch.where((t >= 0).unsqueeze(-1), x, tail[own, (last_k - 1 + t).clamp(0, last_k - 2)])
    use = ((cuts > 0).unsqueeze(-1) & (t + prompt_lens.view(R, 1, 1) >= 0)).float().unsqueeze(-1)
    return (x.float() * use).sum(2) / use.sum(2).clamp(min=1)
