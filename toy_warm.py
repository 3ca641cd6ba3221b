"""The warm start that builds the toy world's base policy, `toy_base/` (the world is toy.py).

    path = base_model()   # the committed toy_base/ (trained here if missing)
    python toy_warm.py    # rebuilds it (or --out DIR); one thread: float sums depend on the split

What it teaches and why these settings: docs/reference.md, "The toy's warm start".
"""
import argparse
import math
import os
import random
import shutil
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from toy import (BASE_DIR, BENCHMARKS, INSTRUCTION, MODEL, RLCR_INSTRUCTION, SUFFIX, WARM, dataset,
                 implied_sum, terms_of, tokenizer, trace)

CONFIDENCES = [f"0.{d}" for d in range(1, 10)]  # the warm start's verbal confidence: any, at random


def build_model(tok, seed=0):
    """Fresh Qwen2ForCausalLM from MODEL (float32, tied embeddings, ~0.8M parameters)."""
    torch.manual_seed(seed)
    config = Qwen2Config(**MODEL, tie_word_embeddings=True, rope_theta=10000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, dtype="float32")
    return Qwen2ForCausalLM(config)


def rlcr_tail(total, rng):
    """What follows `</think>` under RLCR_INSTRUCTION: the answer, an empty analysis and a random
    confidence: the format without calibration, which `--reward rlcr` has to learn.
    17 -> "<answer>17</answer>\\n<analysis></analysis>\\n<confidence>0.4</confidence>"."""
    return (f"<answer>{total}</answer>\n<analysis></analysis>\n"
            f"<confidence>{rng.choice(CONFIDENCES)}</confidence>")


def example(tok, problem, rng, forced):
    """One warm-start sequence: (ids, loss_mask), loss on response tokens only. Plain: prompt +
    trace + </think>\\boxed{total}EOS (p_rlcr: RLCR_INSTRUCTION, rlcr_tail for the box). Forced:
    prompt + response[:b] + CLOSE + SUFFIX + implied}\\n (toy.implied_sum: "14+2")."""
    terms = terms_of(problem)
    lines, totals = trace(terms, rng)
    rlcr = not forced and rng.random() < WARM["p_rlcr"]
    content = problem + (RLCR_INSTRUCTION if rlcr else INSTRUCTION)
    prompt = tok.apply_chat_template([{"role": "user", "content": content}],
                                     add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(prompt, add_special_tokens=False)
    tail = rlcr_tail(totals[-1], rng) if rlcr else f"\\boxed{{{totals[-1]}}}"
    response = tok.encode("".join(lines) + "</think>" + tail, add_special_tokens=False) + [tok.eos_token_id]
    if not forced:
        return prompt + response, [0] * len(prompt) + [1] * len(response)
    b = rng.randint(1, len(response))
    implied = implied_sum(problem, terms, lines, totals, b)
    close = (tok.eos_token_id if rng.random() < WARM["p_eos_close"]
             else tok.convert_tokens_to_ids("</think>"))
    # A cut ending on the close token gets a second one here (label.forced_prompt adds none, as
    # released): toy_base was built so, and its labels still carry signal (tests/test_toy.py).
    head = prompt + response[:b] + [close] + tok.encode(SUFFIX, add_special_tokens=False)
    answer = tok.encode(f"{implied}}}\n", add_special_tokens=False)
    mask = ([0] * len(prompt) + [1] * b + [0] * (len(head) - len(prompt) - b)
            + [WARM["w_forced"]] * len(answer))
    return head + answer, mask


def warm_start(out, log=print):
    """Supervised warm start (AdamW, warm-up then cosine; fixed seeds, threads) into `out`, fp32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM["threads"])
    try:
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
    finally:
        torch.set_num_threads(threads)
    return out


def base_model(path=None, rebuild=False):
    """Directory of the warm-started base policy (default: the committed toy_base/), trained if
    missing or if rebuild=True. Written to a temporary sibling, then renamed into place."""
    path = os.path.abspath(path or BASE_DIR)
    if rebuild or not os.path.exists(os.path.join(path, "model.safetensors")):
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp, old = tempfile.mkdtemp(prefix=".toy_base.", dir=parent), None
        try:
            os.chmod(tmp, 0o755)
            warm_start(tmp)
            if os.path.exists(path):
                old = tempfile.mkdtemp(prefix=".toy_base.old.", dir=parent)
                os.rename(path, os.path.join(old, "base"))
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if old:
                shutil.rmtree(old, ignore_errors=True)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rebuild the toy world's warm-started base policy.")
    parser.add_argument("--out", default=BASE_DIR,
                        help="output directory (default: toy_base/)")
    args = parser.parse_args()
    print(base_model(args.out, rebuild=True))
