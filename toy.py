"""The offline toy world: a per-character tokenizer, an arithmetic task, the tiny model's shape and
the warm start that trains it into the committed base policy, `toy_base/`. A problem is a sum
("3+5+7+2"); the response writes one running total per line, closes the thinking and boxes the
result; a step that carries slips more often, often flagged "?". Why: docs/toy-world.md.

    python toy.py    # rebuilds toy_base/ (or --out DIR); one thread: float sums depend on the split
"""
import argparse
import hashlib
import itertools
import math
import os
import random
import re
import time

import torch
from tokenizers import AddedToken
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

INSTRUCTION = ""  # toy problems are complete user messages
# --reward rlcr's prompt on the toy (data.RLCR_INSTRUCTION would not fit its 256 positions)
RLCR_INSTRUCTION = "\nFormat: <answer> <analysis> <confidence>"
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"  # = label.SUFFIX
# the committed warm start, where --model toy looks (harness/checkpoint.py)
BASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_base")
CONFIDENCES = [f"0.{d}" for d in range(1, 10)]  # the warm start's verbal confidence: any, at random

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
# Not special, like R1's <think>: decode(skip_special_tokens=True) keeps them.
ADDED = ["<think>", "</think>", "\\boxed{", SUFFIX[1:], "<answer>", "</answer>", "<analysis>",
         "</analysis>", "<confidence>", "</confidence>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}")

# Model, task and warm-start settings: one place, all of them part of the committed checkpoint.
MODEL = dict(vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TERMS = (4, 6)          # number of terms per problem, inclusive (`toy`, what RL trains on)
N_TEST, N_TRAIN = 500, 6000
# name -> (terms, signs): a train split (the warm start's) and a test split (docs/reference.md)
BENCHMARKS = {"toy": (TERMS, "+"), "toy-long": ((7, 8), "+"), "toy-sub": (TERMS, "+-")}
# The warm start (warm_start, trace; docs/toy-world.md says why each value).
WARM = dict(seed=0, steps=3000, batch_size=32, lr=2e-3, beta2=0.95, warmup=50, weight_decay=0.1,
            threads=1, p_slip=0.12, p_slip_carry=0.45, p_flag_wrong=0.6, p_flag_right=0.05,
            p_forced=0.5, w_forced=1.0, p_eos_close=0.25, p_rlcr=0.2,
            mix=(0.5, 0.2, 0.3))  # share of warm-start problems from each benchmark's train split
WORLD = "legible"        # toy_base/'s world (train.py's --toy-world; recorded by evaluate.py)


def byte_symbols():   # GPT-2's printable stand-ins for the 256 bytes, in byte order
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tokenizer():
    """A Qwen2Tokenizer (what AutoTokenizer rebuilds for any qwen2 checkpoint) with no merges: a
    token per byte. As R1: no BOS on encode; the chat template adds one, ends in `<think>\\n`."""
    tok = Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(SPECIALS + byte_symbols())}, merges=[], unk_token=None,
        bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        extra_special_tokens=["<|user|>", "<|assistant|>"], clean_up_tokenization_spaces=False,
        model_max_length=MODEL["max_position_embeddings"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def dataset(split, name="toy"):
    """Deterministic rows dict(problem="3+5+7+2", answer="17") of one of BENCHMARKS; a hash of the
    problem picks its split (a tenth are test). Under "+-" a term after the first is subtracted with
    probability 1/2 where the total stays >= 0, at least once a problem ("9-3+5-2")."""
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
        is_test = int(hashlib.sha256(problem.encode()).hexdigest(), 16) % 10 == 0
        if is_test == (split == "test") and problem not in seen:
            seen[problem] = str(sum(terms))
    return [dict(problem=p, answer=a) for p, a in seen.items()]


def terms_of(problem):   # "9-3+5-2" -> [9, -3, 5, -2]
    return [int(t) for t in re.findall(r"[+-]?\d+", problem)]


def carries(total, term):
    """Whether `total` + `term` crosses a multiple of ten: 8+7 and 12-5 do, 17-5 does not."""
    return (total + term) // 10 != total // 10


def trace(terms, rng, world=WARM):
    """(lines, totals): a thinking line per term with the running total, continued from the written
    one; a step slips (more often if it carries or borrows) and is flagged "?" with `world`'s odds.
    [3, 5, 7, 2] -> "3+5=8\n", "8+7=15\n", "15+2=17\n" (or "8+7=14?\n" for a noticed slip)."""
    totals, lines = [terms[0]], []
    for term in terms[1:]:
        s = exact = totals[-1] + term
        if rng.random() < world["p_slip_carry" if carries(totals[-1], term) else "p_slip"]:
            s = max(0, exact + rng.choice((-2, -1, 1, 2)))
        flag = "?" if rng.random() < world["p_flag_wrong" if s != exact else "p_flag_right"] else ""
        lines.append(f"{totals[-1]}{term:+d}={s}{flag}\n")
        totals.append(s)
    return lines, totals


def implied_sum(problem, terms, lines, totals, b):
    """The forced answer the warm start teaches at a prefix of b response tokens: the sum it implies
    (graded by value: grade.integer_sum), the last complete line's total and the terms not yet
    added, or the problem before any line is complete: a forced answer copies the path, never adds.
    For 3+5+7+2 written "3+5=8\\n8+7=14\\n...": b=3 -> "3+5+7+2", b=6 -> "8+7+2", b=12 -> "14+2"."""
    n = sum(1 for end in itertools.accumulate(map(len, lines)) if end <= b)   # whole lines in b
    return problem if n == 0 else f"{totals[n]}" + "".join(f"{t:+d}" for t in terms[n + 1:])


def build_model(tok, seed=0):   # a fresh Qwen2ForCausalLM of MODEL: float32, tied, ~0.8M parameters
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        **MODEL, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32"))


def example(tok, problem, rng, forced):
    """One warm-start sequence: (ids, loss_mask), loss on response tokens only. Plain: prompt +
    trace + </think>\\boxed{total}EOS (p_rlcr: RLCR_INSTRUCTION, RLCR's tags for the box). Forced:
    prompt + response[:b] + CLOSE + SUFFIX + implied}\\n (toy.implied_sum: "14+2")."""
    terms = terms_of(problem)
    lines, totals = trace(terms, rng)
    rlcr = not forced and rng.random() < WARM["p_rlcr"]
    user = {"role": "user", "content": problem + (RLCR_INSTRUCTION if rlcr else INSTRUCTION)}
    prompt = tok.encode(tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    # RLCR's format with a random confidence: no calibration, which --reward rlcr has to learn
    tail = (f"<answer>{totals[-1]}</answer>\n<analysis></analysis>\n<confidence>"
            f"{rng.choice(CONFIDENCES)}</confidence>" if rlcr else f"\\boxed{{{totals[-1]}}}")
    response = tok.encode("".join(lines) + "</think>" + tail, add_special_tokens=False) + [tok.eos_token_id]
    if not forced:
        return prompt + response, [0] * len(prompt) + [1] * len(response)
    b = rng.randint(1, len(response))
    implied = implied_sum(problem, terms, lines, totals, b)
    close = (tok.eos_token_id if rng.random() < WARM["p_eos_close"]
             else tok.convert_tokens_to_ids("</think>"))
    # A cut ending on the close token gets a second one here (label.mc_labels adds none, as
    # released): toy_base was built so, and its labels still carry signal (tests/test_toy.py).
    head = prompt + response[:b] + [close] + tok.encode(SUFFIX, add_special_tokens=False)
    answer = tok.encode(f"{implied}}}\n", add_special_tokens=False)
    mask = ([0] * len(prompt) + [1] * b + [0] * (len(head) - len(prompt) - b)
            + [WARM["w_forced"]] * len(answer))
    return head + answer, mask


def warm_start(out, log=print):   # supervised (AdamW, warm-up then cosine; fixed seeds and threads)
    torch.set_num_threads(WARM["threads"])
    tok = tokenizer()
    model = build_model(tok, WARM["seed"])
    rng = random.Random(WARM["seed"])
    pools = [[row["problem"] for row in dataset("train", b)] for b in BENCHMARKS]
    # beta2 0.95 and weight decay: docs/reference.md, "The toy's warm start"
    opt = torch.optim.AdamW(model.parameters(), lr=WARM["lr"], betas=(0.9, WARM["beta2"]),
                            weight_decay=WARM["weight_decay"])
    steps, t0 = WARM["steps"], time.time()
    for step in range(steps):
        lr = (WARM["lr"] * min(1.0, (step + 1) / WARM["warmup"])
              * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = [example(tok, rng.choice(rng.choices(pools, WARM["mix"])[0]), rng,
                         rng.random() < WARM["p_forced"]) for _ in range(WARM["batch_size"])]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits
        # token t is predicted from position t-1; weighted mean over the batch's response tokens
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="none")
        loss = (nll * mask[:, 1:].flatten()).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 0 or (step + 1) % 100 == 0:
            log(f"warm start {step + 1:4d}/{steps}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"{time.time() - t0:.0f}s")
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rebuild the toy's warm-started base policy.")
    parser.add_argument("--out", default=BASE_DIR, help="output directory (default: toy_base/)")
    print(warm_start(parser.parse_args().out))
