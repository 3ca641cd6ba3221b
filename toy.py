"""The offline toy world: a per-character tokenizer, an arithmetic task and the tiny model's shape.

`python train.py` runs the whole RLCM loop on this world on a laptop CPU in minutes, through
exactly the code used for DeepSeek-R1-Distill-Qwen: chat template, generation that starts inside
the thinking, `</think>`, `\\boxed{}` answers, forced answers after a truncated prefix, grading.

Task. The user message is a sum of 4-6 single-digit terms, e.g. "3+5+7+2" (`toy`, what RL trains
on). The toy benchmarks (BENCHMARKS) add two the warm start also covers: `toy-long`, 7-8 terms (the
toy's "AIME": more lines to slip on than RL ever sees), and `toy-sub`, 4-6 terms some of which are
subtracted, "9-6+7+1" (the toy's "OOD": a skill of the warm start that RL never practises). The ideal
response writes one running total per line, closes the thinking and boxes the result:

    <|bos|><|user|>3+5+7+2<|assistant|><think>\\n      (the prompt, from the chat template)
    3+5=8\\n8+7=15\\n15+2=17\\n</think>\\boxed{17}<|eos|>  (the response)

A step that carries or borrows (8+7) slips more often than one that does not, and a slip is often
marked with "?" after the written total ("8+7=14?"), the trace going on from that total: the
world's errors are ones the model can see coming and notice, which is what RLCM's probe and margin
act on (docs/toy-world.md: the design, each choice's reason, and the premises measured on it).

Tokenizer. One token per byte (a byte-level BPE with no merges, the pipeline AutoTokenizer
rebuilds for every qwen2 checkpoint, R1 included), so any text round-trips exactly; specials
<|bos|> <|eos|> <|pad|> <|user|> <|assistant|>; added but not special, like R1: <think>, </think>,
\\boxed{ and the forced sentence, so the forced suffix "\\n" + sentence is two tokens.

Base policy. toy_warm.py warm-starts a tiny Qwen2ForCausalLM (MODEL) on this world's traces into
the committed `toy_base/` (`toy_warm.base_model()`; `python toy_warm.py` rebuilds it).
"""
import hashlib
import itertools
import os
import random
import re

from tokenizers import AddedToken
from transformers import Qwen2Tokenizer

INSTRUCTION = ""  # toy problems are complete user messages
# --reward rlcr on the toy: the prompt that asks for RLCR's answer format (the toy's stand-in for
# prompts.RLCR_INSTRUCTION, which would not fit its 256 positions); see toy_warm.rlcr_tail.
RLCR_INSTRUCTION = "\nFormat: <answer> <analysis> <confidence>"
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"  # = label.SUFFIX
BASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_base")

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
# Not special, like R1's <think>: decode(skip_special_tokens=True) keeps them.
ADDED = ["<think>", "</think>", "\\boxed{", SUFFIX[1:], "<answer>", "</answer>", "<analysis>", "</analysis>",
         "<confidence>", "</confidence>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}"
)


# Model, task and warm-start settings: one place, all of them part of the committed checkpoint.
MODEL = dict(vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TERMS = (4, 6)          # number of terms per problem, inclusive (`toy`, what RL trains on)
N_TEST, N_TRAIN = 500, 6000
# The toy benchmarks (the module docstring; "Overall" is their unweighted mean): name -> (terms,
# signs). Each has a train split (the warm start's) and a test split (the benchmark).
BENCHMARKS = {"toy": (TERMS, "+"), "toy-long": ((7, 8), "+"), "toy-sub": (TERMS, "+-")}
# The warm start (toy_warm.py; docs/toy-world.md says why each value): a slip is likelier where a
# step carries or borrows (p_slip_carry), a wrong line is often flagged with "?" (p_flag_wrong).
WARM = dict(seed=0, steps=3000, batch_size=32, lr=2e-3, beta2=0.95, warmup=50, weight_decay=0.1,
            threads=1, p_slip=0.12, p_slip_carry=0.45, p_flag_wrong=0.6, p_flag_right=0.05,
            p_forced=0.5, w_forced=1.0, p_eos_close=0.25, p_rlcr=0.2,
            mix=(0.5, 0.2, 0.3))  # share of warm-start problems from each benchmark's train split
# The world (`legible`: toy_base/), and the study's control without a written signal, whose traces
# never flag a slip: the same rows and the same warm start but for the `?`.
WORLD = "legible"
WORLDS = {WORLD: WARM, "legible-quiet": dict(WARM, p_flag_wrong=0.0, p_flag_right=0.0)}


def byte_symbols():
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (byte-level BPE alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tokenizer():
    """Byte-level BPE with no merges, so every character (byte) is one token, plus R1's mechanics:
    no BOS on encode, the chat template adds exactly one and ends in `<|assistant|><think>\\n`.
    It is a Qwen2Tokenizer because that is what AutoTokenizer rebuilds for any qwen2 checkpoint
    (R1 included): same pre-tokenizer, byte-level decoder, exact round trip of any text."""
    vocab = {t: i for i, t in enumerate(SPECIALS + byte_symbols())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token="<|bos|>",
                         eos_token="<|eos|>", pad_token="<|pad|>",
                         extra_special_tokens=["<|user|>", "<|assistant|>"],
                         clean_up_tokenization_spaces=False,
                         model_max_length=MODEL["max_position_embeddings"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _is_test(problem):
    return int(hashlib.sha256(problem.encode()).hexdigest(), 16) % 10 == 0


def dataset(split, name="toy"):
    """Deterministic rows dict(problem="3+5+7+2", answer="17") of one of BENCHMARKS; train and test
    are disjoint because a hash of the problem text picks its split (a tenth of all problems are
    test). Under "+-" each term after the first is subtracted with probability 1/2 where the running
    total stays >= 0, and a problem subtracts at least once ("9-3+5-2")."""
    if split not in ("train", "test"):
        raise ValueError(f"toy split must be 'train' or 'test', got {split!r}")
    if name not in BENCHMARKS:
        raise ValueError(f"unknown toy benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    (lo, hi), signs = BENCHMARKS[name]
    rng = random.Random(f"legible-{name}-{split}")   # a fixed seed per benchmark and split
    n, seen = (N_TEST if split == "test" else N_TRAIN), {}
    while len(seen) < n:
        terms = [rng.randint(1, 9) for _ in range(rng.randint(lo, hi))]
        for i in range(1, len(terms)) if signs == "+-" else ():
            if rng.random() < 0.5 and sum(terms[:i]) >= terms[i]:
                terms[i] = -terms[i]
        problem = "".join(f"{t:+d}" for t in terms)[1:]
        if signs == "+-" and "-" not in problem:   # a sum alone is the training distribution's
            continue
        if _is_test(problem) == (split == "test") and problem not in seen:
            seen[problem] = str(sum(terms))
    return [dict(problem=p, answer=a) for p, a in seen.items()]


def terms_of(problem):
    """"9-3+5-2" -> [9, -3, 5, -2]."""
    return [int(t) for t in re.findall(r"[+-]?\d+", problem)]


def carries(total, term):
    """Whether adding `term` to `total` crosses a multiple of ten (a carry, or a borrow for a
    subtracted term): 8+7 and 12-5 do, 3+5 and 17-5 do not."""
    return (total + term) // 10 != total // 10


def trace(terms, rng, world=WARM):
    """Thinking lines with running totals, continued from the written total: a step that carries or
    borrows slips (by +-1 or +-2, never below 0) with world's p_slip_carry and the others with p_slip,
    and a wrong total is flagged with "?" with p_flag_wrong, a right one with p_flag_right. Returns
    (lines, totals), lines[i] = f"{totals[i]}+{terms[i+1]}={totals[i+1]}" + flag + "\\n" (with "-" and
    the term's size for a subtracted term): [3, 5, 7, 2] -> "3+5=8\n", "8+7=15\n", "15+2=17\n" (or "8+7=14?\n"
    for a noticed slip)."""
    totals, lines = [terms[0]], []
    for term in terms[1:]:
        s = totals[-1] + term
        if rng.random() < world["p_slip_carry" if carries(totals[-1], term) else "p_slip"]:
            s = max(0, s + rng.choice((-2, -1, 1, 2)))
        flag = "?" if rng.random() < world["p_flag_wrong" if s != totals[-1] + term else "p_flag_right"] else ""
        lines.append(f"{totals[-1]}{term:+d}={s}{flag}\n")
        totals.append(s)
    return lines, totals


def lines_done(lines, b):
    """How many of `lines` a prefix of b response tokens holds whole (one token per character)."""
    return sum(1 for end in itertools.accumulate(map(len, lines)) if end <= b)


def implied_sum(problem, terms, lines, totals, b):
    """The forced answer the warm start teaches: the answer a prefix of b response tokens implies, written as
    the sum it implies, so that a forced answer copies the written path and the problem instead of
    adding in the model's head (graded by value: grade.integer_sum): the last complete line's total
    followed by the terms not yet added, the problem itself before any line is complete. It reads
    nothing the final answer does not: the last written total is the final answer's too.
    For 3+5+7+2 written as "3+5=8\\n8+7=14\\n...": b=3 -> "3+5+7+2", b=6 -> "8+7+2", b=12 -> "14+2"."""
    done = lines_done(lines, b)
    return problem if done == 0 else f"{totals[done]}" + "".join(f"{t:+d}" for t in terms[done + 1:])

