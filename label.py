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

Cost: every distinct forced prompt of the batch goes into one `rollout.generate` call (chunked by
`batch_size`); each is prefilled once and its KV cache is repeated for its K samples, so a
trajectory costs at most len(budgets) prefix prefills (batched with all others) plus
K * (answer length) decode positions per prefix. Identical forced prompts (samples of one problem
that agree up to the cut, common for short prefixes) are labelled once and share their Y_b: it
estimates the same probability. The trajectory's own KV cache from the rollout is not reused.
"""
from rollout import generate
from grade import answers_match

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
              batch_size=None, stats=None, grader="math"):
    """Monte-Carlo labels Y_b for every (trajectory, budget) pair, in batched calls.

    prompts, responses: N lists of token ids; budget_lists: N lists of budgets b;
    golds: N gold answers; grader: "strict" or "math" (grade.py). Returns N lists of floats in
    [0, 1], aligned with budget_lists.
    If `stats` is a dict, the number of forced prompts and sampled answers is added to it.
    """
    where, unique = [], {}  # (trajectory, budget) -> index of its distinct forced prompt
    for p, r, bs in zip(prompts, responses, budget_lists):
        where.append([unique.setdefault(tuple(forced_prompt(p, r, b, tokenizer, close, suffix)),
                                        len(unique)) for b in bs])
    gold_of = {}
    for i, js in enumerate(where):
        for j in js:
            gold_of.setdefault(j, golds[i])  # equal prompts mean the same problem, hence the same gold
    if not unique:
        return [[] for _ in prompts]
    out = generate(model, tokenizer, [list(f) for f in unique], n=k, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, stop=("\n",), seed=seed,
                   batch_size=batch_size)
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
