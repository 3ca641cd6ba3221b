"""CUDA check for a GPU machine (not collected by pytest): the 7B shapes in bf16, random weights.

    python tests/gpu_check.py [--layers 28] [--rows 64] [--new 256]

Builds DeepSeek-R1-Distill-Qwen-7B's architecture from the shared config (no weights needed) and
measures the phases that dominate a real step: batched generation with a shared-prefill KV cache,
the scoring forward (chunked log-probs + probe features), and one forward/backward of the policy
loss with gradient checkpointing. Prints one JSON line per phase with seconds and peak memory.
"""
import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import chat_prompt  # noqa: E402  (the project root, when run as a script)
from grpo import pack, token_logprobs
from rollout import generate
from score import budget_ends, score
from train import checkpoint_activations

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "shared", "fixtures", "r1_distill_qwen_7b")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def report(phase, t0, **extra):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")
    print(json.dumps(dict(phase=phase, seconds=round(time.perf_counter() - t0, 2),
                          peak_gib=round(peak, 2), **extra)), flush=True)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=FIXTURE)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", type=int, default=64, help="sequences generated (prompts x group)")
    p.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    p.add_argument("--hidden", type=int, help="shrink the width (a dry run off the GPU)")
    args = p.parse_args()
    cfg = AutoConfig.from_pretrained(args.config)
    cfg.num_hidden_layers = args.layers
    if args.hidden:
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = args.hidden, 2 * args.hidden, 4
        cfg.num_key_value_heads = 2
    tok = AutoTokenizer.from_pretrained(args.config)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    report("build", t0, params=n_params)

    prompts = [chat_prompt(tok, "What is 1+1?")] * (args.rows // 8)
    t0 = time.perf_counter()
    out = generate(model, tok, prompts, n=8, max_new_tokens=args.new, temperature=0.8, seed=0)
    n_tok = sum(out.lengths)
    report("generate", t0, tokens=n_tok, max_id=max(max(i) for i in out.ids), vocab=len(tok))
    assert max(max(i) for i in out.ids) < len(tok)

    trajs = [p_ for p_ in (prompts[i] for i in out.prompt_index)]
    batch = {k: v.to(DEVICE) for k, v in pack(trajs, out.ids, tok.pad_token_id).items()}
    cuts = [[max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4)] for n in out.lengths]
    ends = budget_ends(batch["prompt_lens"].cpu(), cuts)
    t0 = time.perf_counter()
    old, feats, valid = score(model, batch, ends, temperature=0.8, chunk_size=1024)
    report("score", t0, feats=list(feats.shape), finite=bool(torch.isfinite(old).all()))

    model.train()
    checkpoint_activations(model)
    mb = {k: v[:8] for k, v in batch.items()}
    t0 = time.perf_counter()
    logp = token_logprobs(model, mb["input_ids"], mb["attention_mask"], 0.8, 1024)
    loss = -(logp * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
    loss.backward()
    report("train_fwd_bwd_8seq", t0, loss=round(loss.item(), 4),
           grad_ok=all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None))


if __name__ == "__main__":
    main()
