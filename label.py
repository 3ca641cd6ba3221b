"""Monte-Carlo labels for reasoning prefixes: truncate, force an answer K times, count.

    b      = min(T, round(f * T))   for f in (0.25, 0.5, 0.75)    (T: response tokens, EOS included)
    forced = prompt + response[:b] + CLOSE + SUFFIX                (CLOSE: `</think>` or EOS)
    Y_b    = (1/K) * sum_k 1[answer_k == gold]    (grade.answers_match)

`mc_labels` is the algorithm. Its forced answers come from rollout.generate on the whole forced
prompts (tree=False: the plain path, the one a CPU runs) or, on CUDA, from harness/fast.py along
each trajectory's prefix tree: the same labels and features (tests/test_label.py).
"""
from contextlib import nullcontext

import torch

from grade import answers_match, forced_answer
from grpo import logprobs_from_hidden
from probe import LAST_K, last_layer, prefix_features
from rollout import Sampler, generate, row_generators
from harness import fast, staticcache
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"


def cuts_of(length, budgets=(0.25, 0.5, 0.75)):
    """The cuts (token counts) the budgets (fractions) give: cuts_of(8) == [2, 4, 6], cuts_of(3) ==
    [1, 2], cuts_of(0) == []."""
    return sorted({b for b in (min(length, round(f * length)) for f in budgets) if b > 0})


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


def mc_labels(model, tokenizer, prompts, responses, cut_lists, golds, k=4, temperature=0.8,
              top_p=1.0, max_new_tokens=32, close="think", suffix=SUFFIX, seed=None,
              batch_size=None, stats=None, grader="math", decode=None, tree=None, features=False):
    """Y_b for every (trajectory, cut b) (module docstring) -> N lists of floats in [0, 1], aligned
    with cut_lists. prompts, responses: N lists of token ids; cut_lists: N lists of cuts b.
    tree: the fast path (None: on CUDA). stats: a dict given the counts of prefixes and forced
    prompts. features=True: (labels, feats), feats N [len(cuts), d] (plain_features)."""
    tree = torch.cuda.is_available() if tree is None else tree
    static = decode == "static" or decode is None and torch.cuda.is_available()
    if static:  # the rollout's static buffers would sit under the labels' prefills (and the update)
        staticcache.release(model)
    # 1. The forced prompt after every cut. Equal ones (samples of a problem that agree up to the
    #    cut, common for short prefixes) estimate the same probability: each is asked once.
    tail = [close_id(tokenizer, close)] + tokenizer.encode(suffix, add_special_tokens=False)
    index, cuts, where = {}, [], []  # cuts[j]: the (trajectory, b) of distinct forced prompt j
    for i, (p, r, bs) in enumerate(zip(prompts, responses, cut_lists)):
        where.append([])  # the j of each of trajectory i's cuts
        for b in bs:
            b = closed_cut(r, b, tail[0])  # a cut ending on CLOSE is asked without a second one
            j = index.setdefault((*p, *r[:b], *tail), len(cuts))  # forced_prompt(p, r, b, ...)
            if j == len(cuts):
                cuts.append((i, b))
            where[-1].append(j)
    if not cuts:
        return (where, [torch.zeros(0, model.config.hidden_size) for _ in where]) if features else where
    # 2. K answers to each: texts[j*k:(j+1)*k] for forced prompt j.
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
              batch_size=batch_size, decode=decode)
    if tree:  # on CUDA: the same answers (and features) off each trajectory's prefix tree
        lib = (Sampler, row_generators, last_layer, LAST_K)
        texts, feats = fast.tree_answers(model, tokenizer, prompts, responses, cut_lists, cuts, where,
                                         tail, k, features, lib, **kw)
    else:
        forced = [list(prompts[i]) + list(responses[i][:b]) + list(tail) for i, b in cuts]
        texts = generate(model, tokenizer, forced, n=k, stop=("\n",), keyed=True, **kw).texts
    if static:  # the update needs the memory the labels' decode buffers hold
        staticcache.release(model)
    # 3. Y_b = the share of them that match the gold; a box that never closes is wrong.
    y = []
    for j, (i, _) in enumerate(cuts):
        answers = [forced_answer(t) for t in texts[j * k:(j + 1) * k]]
        y.append(sum(a is not None and answers_match(a, golds[i], grader) for a in answers) / k)
    if stats is not None:
        stats.update(prefixes=sum(map(len, where)), forced_prompts=len(cuts))
    labels = [[y[j] for j in js] for js in where]
    if not features:
        return labels
    if not tree:  # the plain path: a forward over each trajectory
        feats = [plain_features(model, *x) for x in zip(prompts, responses, cut_lists)]
    return labels, feats


@torch.no_grad()
def plain_features(model, prompt, response, cuts):
    """The probe's features at the cuts of one trajectory, the plain way: one forward over prompt +
    response, probe.prefix_features before each cut -> [len(cuts), d] float32 CPU."""
    ids = torch.tensor([list(prompt) + list(response)], device=next(model.parameters()).device)
    ends, got = torch.tensor([[len(prompt) + b for b in cuts]], dtype=torch.long), []
    with last_layer(model, lambda h: got.append(prefix_features(h, ends)[0])):
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return got[0][0].cpu()


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
