"""Monte-Carlo labels for reasoning prefixes: truncate, force an answer K times, count.

For a response of T generated tokens (EOS included) RLCM cuts it at

    b = min(T, round(f * T))   for f in (0.25, 0.5, 0.75)     (Python round: half to even)

drops zeros and duplicates, and asks the policy to answer right now from each prefix:

    forced = prompt + response[:b] + CLOSE + SUFFIX
    SUFFIX = "\\nIf I were to output the final answer now, it would be \\\\boxed{"

CLOSE is `</think>` (close="think", the paper's description) or the tokenizer's EOS token
(close="eos", what the released code inserts). K continuations are sampled (K=4, temperature 0.8,
top-p 1.0, at most 32 tokens, stop at a newline); the forced answer is the text up to the brace that
closes the forced `\\boxed{` (unclosed: wrong), and the label is

    Y_b = (1/K) * sum_k 1[answer_k == gold]     (== under the run's grader: grade.answers_match)

Cost: the forced prompts of a trajectory share everything before their cut, so their prefill
follows that tree (`_forced_samples`, called per group of similar trajectory length so short
prefixes carry no padding of long ones): per chunk, each distinct problem prompt is
prefilled once, each trajectory's response up to its longest cut once on top of it, and each cut
adds only CLOSE + SUFFIX on top of the trajectory's cache with the columns past the cut masked out.
So a trajectory costs one prefix prefill plus len(budgets) short suffixes (before: len(budgets)
full forced prompts), plus K * (answer length) decode positions per prefix, where the K answers
of a prefix share one cache row and one forward for as long as they agree (on the dynamic path:
`rollout.Sampler(share_rows=True)`; the samples are the same as without). Identical forced
prompts (samples of one problem that agree up to the cut, common for short prefixes) are labelled
once and share their Y_b: it estimates the same probability. Sampling ends at the brace closing
the forced box as well as at a newline: nothing after it changes the answer. The rollout's KV
cache is not kept: holding it from the rollout until labelling would cost the whole batch's cache
in memory.
"""
import torch

from grade import answers_match
from rollout import Sampler, Samples, chunk_generators

LENGTH_GROUP = 2  # trajectories whose longest cuts have bit lengths within this many share a group
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"


def budgets(length, fractions=(0.25, 0.5, 0.75)):
    """Relative truncation points: budgets(8) == [2, 4, 6], budgets(3) == [1, 2], budgets(0) == []."""
    return sorted({b for b in (min(length, round(f * length)) for f in fractions) if b > 0})


def absolute_budgets(length, every):
    """Absolute truncation points every `every` tokens, up to and including `length` if it falls on one.

    absolute_budgets(1200, 500) == [500, 1000]; used for post-hoc probes at evaluation.
    """
    return list(range(every, length + 1, every))


def close_id(tokenizer, close="think"):
    """Token id inserted between the prefix and the suffix: `</think>` or the EOS token."""
    if close == "eos":
        return tokenizer.eos_token_id
    if close == "think":
        tid = tokenizer.convert_tokens_to_ids("</think>")
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError("the tokenizer has no `</think>` token: use --forced-close eos")
        return tid
    raise ValueError(f"close must be 'think' or 'eos', got {close!r}")


def forced_prompt(prompt, response, b, tokenizer, close="think", suffix=SUFFIX):
    """Token ids `prompt + response[:b] + [CLOSE] + ids(suffix)` (lists of ints)."""
    return list(prompt) + list(response[:b]) + [close_id(tokenizer, close)] + \
        tokenizer.encode(suffix, add_special_tokens=False)


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


def mc_labels(model, tokenizer, prompts, responses, budget_lists, golds, k=4, temperature=0.8,
              top_p=1.0, max_new_tokens=32, close="think", suffix=SUFFIX, seed=None,
              batch_size=None, stats=None, grader="math", decode=None):
    """Monte-Carlo labels Y_b for every (trajectory, budget) pair, in batched calls.

    prompts, responses: N lists of token ids; budget_lists: N lists of budgets b;
    golds: N gold answers; grader: "strict" or "math" (grade.py). Returns N lists of floats in
    [0, 1], aligned with budget_lists.
    If `stats` is a dict, the number of forced prompts and sampled answers is added to it.
    decode: rollout's decode path ("static" | "dynamic" | None: static on CUDA).
    """
    tail = forced_prompt([], [], 0, tokenizer, close, suffix)  # CLOSE + SUFFIX, the same after every cut
    where, unique, cut_of = [], {}, []  # cut_of[j]: the (trajectory, budget) of distinct forced prompt j
    for i, (p, r, bs) in enumerate(zip(prompts, responses, budget_lists)):
        where.append([])
        for b in bs:
            j = unique.setdefault((*p, *r[:b]), len(unique))
            cut_of += [(i, b)] if j == len(cut_of) else []
            where[-1].append(j)
    gold_of = {}
    for i, js in enumerate(where):
        for j in js:
            gold_of.setdefault(j, golds[i])  # equal prompts mean the same problem, hence the same gold
    if not unique:
        return [[] for _ in prompts]
    # Sampled in groups of similar trajectory length (its longest cut, within a factor of 4), so
    # short prefixes do not carry the padding of long ones through prefill and decode.
    longest, groups = {}, {}
    for i, b in cut_of:
        longest[i] = max(longest.get(i, 0), b)
    for j, (i, _) in enumerate(cut_of):
        groups.setdefault(longest[i].bit_length() // LENGTH_GROUP, []).append(j)
    out = Samples([], [None] * (len(cut_of) * k), [], [], [])
    for g, js in enumerate(groups[key] for key in sorted(groups)):
        part = _forced_samples(model, tokenizer, prompts, responses, [cut_of[j] for j in js], tail, k=k,
                               temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               seed=None if seed is None else seed + 7919 * g, batch_size=batch_size,
                               decode=decode)
        for m, j in enumerate(js):
            out.texts[j * k:(j + 1) * k] = part.texts[m * k:(m + 1) * k]
    y = []
    for j in range(len(unique)):
        answers = (forced_answer(t) for t in out.texts[j * k:(j + 1) * k])
        y.append(sum(a is not None and answers_match(a, gold_of[j], grader) for a in answers) / k)
    labels = [[y[j] for j in js] for js in where]
    if stats is not None:
        stats["prefixes"] = stats.get("prefixes", 0) + sum(map(len, where))
        stats["forced_prompts"] = stats.get("forced_prompts", 0) + len(unique)
        stats["answers"] = stats.get("answers", 0) + len(unique) * k
    return labels


@torch.no_grad()
def _forced_samples(model, tokenizer, prompts, responses, cut_of, tail, k, temperature, top_p,
                    max_new_tokens, seed=None, batch_size=None, decode=None):
    """k samples of each forced prompt `prompts[i] + responses[i][:b] + tail`, (i, b) in cut_of, in
    that order (Samples.texts[j*k:(j+1)*k] for cut j), stopping at a newline or at the brace that
    closes the forced box (the answer is complete there).

    The samples of rollout.generate(forced prompts, n=k, stop="\\n", seed, batch_size) up to float
    rounding, cut at that brace, with the prefill shared along the prefix tree (module docstring).
    """
    sampler = Sampler(model, tokenizer, max_new_tokens, temperature, top_p, stop=("\n",), decode=decode,
                      share_rows=True, close_depth=1)
    batch_size = batch_size or len(cut_of)
    chunks = [cut_of[s:s + batch_size] for s in range(0, len(cut_of), batch_size)]
    out = Samples([], [], [], [], [])
    was_training = model.training
    model.eval()
    try:
        for chunk, gen in zip(chunks, chunk_generators(seed, len(chunks), sampler.device)):
            trajs = list(dict.fromkeys(i for i, _ in chunk))
            longest = {i: max(b for t, b in chunk if t == i) for i in trajs}
            distinct = list(dict.fromkeys(tuple(prompts[i]) for i in trajs))
            rows = lambda xs: torch.tensor(xs, device=sampler.device)  # noqa: E731
            # 1. each distinct problem prompt once; 2. each trajectory up to its longest cut once.
            pre = sampler.prefill([list(p) for p in distinct])
            pre = pre.select(rows([distinct.index(tuple(prompts[i])) for i in trajs]))
            pre = sampler.prefill([list(responses[i][:longest[i]]) for i in trajs], after=pre)
            # 3. a row per cut: its trajectory's row with the response past b masked out, then the tail.
            pre = pre.select(rows([trajs.index(i) for i, _ in chunk]))
            end = pre.mask.shape[1]  # the response segment is right-aligned, ending here
            cut_col = rows([end - longest[i] + b for i, b in chunk])
            pre.mask = pre.mask * (torch.arange(end, device=sampler.device) < cut_col[:, None])
            pre = sampler.prefill([list(tail)] * len(chunk), after=pre)
            ids, length, _ = sampler.sample(pre, k, gen)
            out.ids += [r[:n] for r, n in zip(ids.tolist(), length.tolist())]
    finally:
        model.train(was_training)
    out.texts = tokenizer.batch_decode(out.ids, skip_special_tokens=True)
    return out
