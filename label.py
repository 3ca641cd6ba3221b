"""Monte-Carlo labels for reasoning prefixes: truncate, force an answer K times, count.

    b      = min(T, round(f * T))   for f in (0.25, 0.5, 0.75)    (T: response tokens, EOS included)
    forced = prompt + response[:b] + CLOSE + SUFFIX                (CLOSE: `</think>` or EOS)
    Y_b    = (1/K) * sum_k 1[answer_k == gold]    (grade.answers_match; --reward-fn: its mean value)

`mc_labels` is the algorithm; its answers come from `sample_answers`: the plain path (tree=False,
the one to read and the one a CPU runs) or, on CUDA, the fast path along each trajectory's prefix
tree, which gives the same labels and features (tests/test_label.py::test_plain_and_tree_labels_are_equal_on_the_toy_whatever_the_chunk,
::test_plain_and_tree_features_are_equal_on_the_toy). More: docs/reference.md, "... the method's leaves".
"""
from contextlib import nullcontext

import torch

from decode import Sampler, row_generators
from grade import answers_match
from grpo import logprobs_from_hidden
from probe import LAST_K, last_layer, prefix_features, split_prefix_features
from rollout import Samples, generate
from harness import staticcache

LENGTH_GROUP = 2  # trajectories whose longest cuts have bit lengths within this many share a group
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"


def cuts_of(length, budgets=(0.25, 0.5, 0.75)):
    """The cuts (token counts) the budgets (fractions) give: cuts_of(8) == [2, 4, 6], cuts_of(3) ==
    [1, 2], cuts_of(0) == []."""
    return sorted({b for b in (min(length, round(f * length)) for f in budgets) if b > 0})


def labelled(cut_lists, labels, feats=None):
    """(cut_lists, labels) without the cuts whose label is None (--reward-fn skipped all K
    answers); with feats (mc_labels(features=True)'s), (cut_lists, labels, feats) likewise."""
    keep = [[m for m, y in enumerate(ys) if y is not None] for ys in labels]
    out = [[bs[m] for m in ms] for bs, ms in zip(cut_lists, keep)], \
        [[ys[m] for m in ms] for ys, ms in zip(labels, keep)]
    return out if feats is None else (*out, [f[ms] for f, ms in zip(feats, keep)])


def grid(lists, width=None):
    """N per-trajectory lists aligned with their cuts (floats, or [n_i, d] tensors) -> a zero-padded
    [N, width] (or [N, width, d]) float32 tensor, width = the longest list (at least 1)."""
    width = width or max(1, max((len(x) for x in lists), default=0))
    tensors = [torch.as_tensor(x, dtype=torch.float32) for x in lists]
    out = torch.zeros(len(lists), width, *(tensors[0].shape[1:] if tensors else ()))
    for i, x in enumerate(tensors):
        out[i, :len(x)] = x
    return out


def cut_mask(cut_lists):
    """[N, B] bool, True at the cuts of each list: where grid(...) of lists aligned with them is real."""
    return grid([[1] * len(bs) for bs in cut_lists]) > 0


def close_id(tokenizer, close="think"):
    """Token id inserted between the prefix and the suffix: `</think>` or the EOS token."""
    if close == "eos":
        return tokenizer.eos_token_id
    tid = tokenizer.convert_tokens_to_ids("</think>")
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError("the tokenizer has no `</think>` token: use --forced-close eos")
    return tid


def forced_prompt(prompt, response, b, tokenizer, close="think", suffix=SUFFIX):
    """Token ids `prompt + response[:b] + [CLOSE] + ids(suffix)` (lists of ints), CLOSE left out
    where response[:b] already ends on it (module docstring)."""
    cid = close_id(tokenizer, close)
    return list(prompt) + list(response[:closed_cut(response, b, cid)]) + [cid] + \
        tokenizer.encode(suffix, add_special_tokens=False)


def closed_cut(response, b, close):
    """b, or b - 1 where response[:b] ends on the close id: the prefix before CLOSE + SUFFIX, so
    that the close token is never doubled."""
    return b - 1 if b > 0 and response[b - 1] == close else b


def forced_answer(text):
    """The text up to the brace closing the forced `\\boxed{`, or None if it never closes.

    forced_answer("17}\\n") == "17"; forced_answer("\\frac{1}{2}} so") == "\\frac{1}{2}".
    """
    depth = 1
    for i, ch in enumerate(text):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return text[:i].strip()
    return None


def mc_labels(model, tokenizer, prompts, responses, cut_lists, golds, k=4, temperature=0.8,
              top_p=1.0, max_new_tokens=32, close="think", suffix=SUFFIX, seed=None,
              batch_size=None, stats=None, grader="math", decode=None, tree=None, judge=None,
              features=False):
    """Y_b for every (trajectory, cut b): the share of K answers forced after the cut that match
    the gold under `grader` (module docstring).

    prompts, responses: N lists of token ids; cut_lists: N lists of cuts b; golds: N answers.
    Returns N lists of floats in [0, 1], aligned with cut_lists. stats: a dict the numbers of
    prefixes, forced prompts and answers are added to. tree (None: on CUDA only, where the prefix
    tree pays), decode, batch_size: sample_answers'.
    judge(answer, i) -> float in [0, 1] or None: --reward-fn's value in place of the grader
    (harness/rewardfn.py); Y_b is then the mean of the values given, None where none is.
    features=True: returns (labels, feats), feats N float32 CPU tensors [len(cuts), d] of
    probe.prefix_features at every cut: tree=False plain_features, tree=True the same off a prefill.
    """
    cuda = torch.cuda.is_available()
    tree, static = cuda if tree is None else tree, cuda if decode is None else decode == "static"
    if static:  # the rollout's static buffers would sit under the labels' prefills (and the update)
        staticcache.release(model)
    # 1. The forced prompt after every cut. Equal ones (samples of a problem that agree up to the
    #    cut, common for short prefixes) estimate the same probability: each is asked once.
    tail = forced_prompt([], [], 0, tokenizer, close, suffix)  # CLOSE + SUFFIX, the same after every cut
    index, cuts, where = {}, [], []  # cuts[j]: the (trajectory, b) of distinct forced prompt j
    for i, (p, r, bs) in enumerate(zip(prompts, responses, cut_lists)):
        where.append([])  # the j of each of trajectory i's cuts
        for b in bs:
            b = closed_cut(r, b, tail[0])  # a cut ending on CLOSE is asked without a second one
            j = index.setdefault((*p, *r[:b], *tail), len(cuts))  # forced_prompt(p, r, b, ...)
            if j == len(cuts):
                cuts.append((i, b))
            where[-1].append(j)
    # Each trajectory's features are read where its longest cut's forced prompt is asked (reads[j]),
    # off the row of the trajectory that asks it when theirs agree up to that cut, else off its own.
    reads, feats = [[] for _ in cuts], {} if features else None
    for i, bs in enumerate(cut_lists if features and tree else []):
        if bs:
            j = where[i][max(range(len(bs)), key=bs.__getitem__)]
            src, last = cuts[j][0], max(bs)
            same = list(prompts[src]) == list(prompts[i]) and list(responses[src][:last]) == list(responses[i][:last])
            reads[j].append((i, list(bs), src if same else i))
    if not cuts:
        return (where, [torch.zeros(0, model.config.hidden_size) for _ in where]) if features else where
    # 2. K answers to each: texts[j*k:(j+1)*k] for forced prompt j.
    texts = sample_answers(model, tokenizer, prompts, responses, cuts, tail, k, temperature, top_p,
                           max_new_tokens, seed, batch_size, decode, tree, reads, feats).texts
    if static:  # the update needs the memory the labels' decode buffers hold
        staticcache.release(model)
    # 3. Y_b = the share of them that match the gold; a box that never closes is wrong.
    y = []
    for j, (i, _) in enumerate(cuts):
        answers = [forced_answer(t) for t in texts[j * k:(j + 1) * k]]
        if judge is None:
            y.append(sum(a is not None and answers_match(a, golds[i], grader) for a in answers) / k)
        else:
            values = [v for v in (0.0 if a is None else judge(a, i) for a in answers) if v is not None]
            y.append(sum(values) / len(values) if values else None)
    if stats is not None:
        stats["prefixes"] = stats.get("prefixes", 0) + sum(map(len, where))
        stats["forced_prompts"] = stats.get("forced_prompts", 0) + len(cuts)
        stats["answers"] = stats.get("answers", 0) + len(cuts) * k
    labels = [[y[j] for j in js] for js in where]
    if not features:
        return labels
    if not tree:  # the plain path
        return labels, [plain_features(model, p, r, bs) for p, r, bs in zip(prompts, responses, cut_lists)]
    return labels, [feats.get(i, torch.zeros(0, model.config.hidden_size)) for i in range(len(where))]


def plain_features(model, prompt, response, cuts):
    """The probe's features at the cuts of one trajectory, the plain way: one forward over prompt +
    response (update.forward_pass), probe.prefix_features before each cut: [len(cuts), d] fp32 CPU."""
    ids = torch.tensor([list(prompt) + list(response)], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        _, feats, _ = forward_pass(model, dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                            cut_ends([len(prompt)], [cuts]), logprobs=False)
    finally:
        model.train(was_training)
    return feats[0, :len(cuts)].cpu()


def cut_ends(prompt_lens, cut_lists, width=None):
    """Absolute exclusive ends `len(prompt_i) + b` as a [N, B] long tensor (0 = no budget)."""
    width = width or max((len(bs) for bs in cut_lists), default=0)
    ends = torch.zeros(len(cut_lists), max(width, 1), dtype=torch.long)
    for i, bs in enumerate(cut_lists):
        ends[i, :len(bs)] = torch.tensor(bs, dtype=torch.long) + int(prompt_lens[i])
    return ends


@torch.no_grad()
def forward_pass(model, batch, ends=None, temperature=1.0, chunk_size=1024, last_k=LAST_K,
                 final_norm=False, logprobs=True):
    """Old log-probs and probe features from one forward.

    batch: `grpo.pack` output (input_ids / attention_mask [N, L]); ends: [N, B] absolute ends, or
    None for no features. Returns (old_logp [N, L-1] float32 or None, feats [N, B, d] float32 and
    valid [N, B] bool, or None and None). final_norm: the post-hoc probe's feature, the final normed
    state of the last token before each end, in place of probe.prefix_features' training one.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    captured = {}
    keep = nullcontext() if ends is None or final_norm else last_layer(
        model, lambda hidden: captured.setdefault("feats", prefix_features(hidden, ends.to(ids.device), last_k)))
    with keep:
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # no K/V kept
    feats, valid = captured.get("feats", (None, None))
    if final_norm and ends is not None:
        feats, valid = prefix_features(hidden, ends.to(ids.device), 1)
    old_logp = None
    if logprobs:
        old_logp = logprobs_from_hidden(hidden, model.lm_head, ids[:, 1:], temperature,
                                        chunk_size).float()
    return old_logp, feats, valid


def sample_answers(model, tokenizer, prompts, responses, cuts, tail, k, temperature=0.8, top_p=1.0,
                   max_new_tokens=32, seed=None, batch_size=None, decode=None, tree=True, reads=None,
                   features=None):
    """k samples of each forced prompt `prompts[i] + responses[i][:b] + tail`, (i, b) in cuts, in
    that order (Samples.ids and .texts [j*k:(j+1)*k] for cut j), stopping at a newline.

    tree=False, the plain path: rollout.generate on the whole forced prompts. tree=True, the fast
    path (`_forced_samples`): the same samples up to float rounding, ended at the brace that closes
    the forced box, the prefill shared along the prefix tree. Both sample the cuts in groups of
    similar trajectory length (_length_groups), so short prefixes carry no padding of long ones.
    batch_size: forced prompts per chunk; decode: rollout's. reads, features (fast path): reads[j]
    lists the (trajectory i, its cuts, the trajectory whose row they are read off) whose features
    the chunk asking cut j reads into the dict features[i].
    """
    out = Samples([None] * (len(cuts) * k), [None] * (len(cuts) * k), [], [], [])
    for js in _length_groups(cuts):
        group = [cuts[j] for j in js]
        kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                  batch_size=batch_size, decode=decode)
        if not tree:  # the plain path
            forced = [list(prompts[i]) + list(responses[i][:b]) + list(tail) for i, b in group]
            part = generate(model, tokenizer, forced, n=k, stop=("\n",), keyed=True, **kw)
        else:  # the fast path
            part = _forced_samples(model, tokenizer, prompts, responses, group, tail, k=k, **kw,
                                   reads=reads and [reads[j] for j in js], features=features)
        for m, j in enumerate(js):
            out.ids[j * k:(j + 1) * k] = part.ids[m * k:(m + 1) * k]
            out.texts[j * k:(j + 1) * k] = part.texts[m * k:(m + 1) * k]
    return out


def _length_groups(cuts):
    """[indices into cuts]: the cuts grouped by their trajectory's longest cut, to within a factor
    of 4 (bit lengths within LENGTH_GROUP), shortest group first."""
    longest, groups = {}, {}
    for i, b in cuts:
        longest[i] = max(longest.get(i, 0), b)
    for j, (i, _) in enumerate(cuts):
        groups.setdefault(longest[i].bit_length() // LENGTH_GROUP, []).append(j)
    return [groups[key] for key in sorted(groups)]


@torch.no_grad()
def _forced_samples(model, tokenizer, prompts, responses, cut_of, tail, k, temperature, top_p,
                    max_new_tokens, seed=None, batch_size=None, decode=None, reads=None, features=None):
    """sample_answers' fast path for one group of cuts, in the same order, the K rows of a cut
    sharing a cache row while they agree (Sampler(share_rows=True)). reads[m], aligned with cut_of:
    sample_answers' reads."""
    sampler = Sampler(model, tokenizer, max_new_tokens, temperature, top_p, stop=("\n",), decode=decode,
                      share_rows=True, close_depth=1)
    batch_size = batch_size or len(cut_of)
    reads = reads or [[] for _ in cut_of]
    chunks = [(cut_of[s:s + batch_size], sum(reads[s:s + batch_size], [])) for s in range(0, len(cut_of), batch_size)]
    out = Samples([], [], [], [], [])
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
            # 1. each distinct problem prompt once; 2. each trajectory up to its longest cut once.
            with _keeping(model, readers, states, "prompt", lambda h: h[:, -(LAST_K - 1):].clone()):
                pre = sampler.prefill([list(p) for p in distinct])
            pre = pre.select(rows([distinct.index(tuple(prompts[i])) for i in trajs]))
            heads = [list(responses[i][:head[i]]) for i in trajs]
            if any(heads):  # none where every cut is at 0 (responses that start with CLOSE, cut after it)
                read = readers and _reader(readers, trajs, head, prompts, distinct, states, sampler.device)
                with _keeping(model, readers, states, "feats", read):
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


def _keeping(model, on, states, name, reduce):
    """A context in which states[name] = reduce(the last layer's output of the forward run in it),
    or nothing when not `on`."""
    return last_layer(model, lambda h: states.__setitem__(name, reduce(h))) if on else nullcontext()


def _reader(readers, trajs, head, prompts, distinct, states, device):
    """reduce() for the response prefill of a chunk: its output h [rows, W, d] (rows = trajs, each
    response right-aligned, head[i] long) -> the features of the readers' cuts [readers, B, d]
    (probe.split_prefix_features) off their rows, the prompt's last positions from states["prompt"]."""
    tail = states["prompt"]  # [distinct prompts, <= LAST_K - 1, d], right-aligned
    tail = torch.nn.functional.pad(tail, (0, 0, LAST_K - 1 - tail.shape[1], 0))
    tail = tail[[distinct.index(tuple(prompts[src])) for _, _, src in readers]]
    at = torch.tensor([trajs.index(src) for _, _, src in readers], device=device)
    cuts = grid([bs for _, bs, _ in readers]).long()
    plens = [len(prompts[src]) for _, _, src in readers]
    return lambda h: split_prefix_features(tail, h, [h.shape[1] - head[src] for _, _, src in readers],
                                           cuts, plens, rows=at)
