"""The run's configuration: world defaults (toy vs real model), the command line, and resume.

Precedence: flags given now > the saved config.json of a resumed run > the defaults below.
"""
import argparse
import json
import os

from checkpoint import UserError

# Defaults that depend on the world: the toy sizes for 2 CPU cores, the real ones from DESIGN.md.
TOY = dict(data="toy", eval_data="toy", steps=30, prompts_per_step=16, group_size=8, lr=2e-5,
           warmup=3, max_new_tokens=48, eval_n=200, eval_every=10, save_every=10, grad_ckpt=False,
           micro_tokens=8192, gen_batch=256)
REAL = dict(data="deepscaler", eval_data="math500", steps=600, prompts_per_step=64, group_size=8,
            lr=1e-6, warmup=10, max_new_tokens=8192, eval_n=100, eval_every=50, save_every=50,
            grad_ckpt=True, micro_tokens=16384, gen_batch=8)  # 8 prompts x 8 = 64 rows x 8k tokens: ~30 GB KV
COMMON = dict(model="toy", problem_field=None, answer_field=None, trust_remote_code=False,
              temperature=0.8, top_p=1.0, reward="rlcm", lam=0.1, k=4, forced_close="think",
              corner="zero", probe_lr=1e-3, probe_passes=16, probe_batch=16, grad_clip=1.0,
              clip_low=0.2, clip_high=0.2, agg="token-mean", chunk_size=1024, seed=0, keep=2,
              out=None, resume=None, decode=None)



def build_parser():
    """Every default is None here: unset flags are filled from COMMON and TOY/REAL in resolve_args."""
    fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=(
        f"defaults: {fmt(COMMON)}. toy world: {fmt(TOY)}. real models: {fmt(REAL)}."))
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="toy | deepseek-r1-distill-qwen-7b | qwen3-4b-instruct | HF id | local dir")
    g.add_argument("--data", help="toy | deepscaler | HF dataset id | local json/jsonl/parquet")
    g.add_argument("--problem-field")
    g.add_argument("--answer-field")
    g.add_argument("--eval-data", help="held-out set for the accuracy check (default: toy test / math500)")
    g.add_argument("--trust-remote-code", action="store_true", default=None)
    g = p.add_argument_group("rollout")
    g.add_argument("--prompts-per-step", type=int)
    g.add_argument("--group-size", type=int)
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--gen-batch", type=int, help="prompts per generation call")
    g.add_argument("--decode", choices=("static", "dynamic"),
                   help="KV cache for decoding: static + CUDA graphs (default on CUDA) or dynamic (default on CPU)")
    g = p.add_argument_group("reward, labels and probe")
    g.add_argument("--reward", choices=("rlcm", "grpo"))
    g.add_argument("--lam", type=float)
    g.add_argument("--k", type=int, help="forced answers per prefix")
    g.add_argument("--forced-close", choices=("think", "eos"),
                   help="token before the forced suffix: </think> (paper) or EOS (released code)")
    g.add_argument("--corner", choices=("zero", "one-sided"))
    g.add_argument("--probe-lr", type=float)
    g.add_argument("--probe-passes", type=int)
    g.add_argument("--probe-batch", type=int)
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--grad-clip", type=float)
    g.add_argument("--clip-low", type=float)
    g.add_argument("--clip-high", type=float)
    g.add_argument("--agg", choices=("token-mean", "seq-mean", "seq-sum-norm"))
    g.add_argument("--micro-tokens", type=int, help="tokens per micro-batch (gradient accumulation)")
    g.add_argument("--chunk-size", type=int, help="positions per LM-head call when computing log-probs")
    g.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int)
    g.add_argument("--out", help="run directory (default runs/<model>)")
    g.add_argument("--seed", type=int)
    g.add_argument("--save-every", type=int)
    g.add_argument("--keep", type=int, help="checkpoints kept")
    g.add_argument("--eval-every", type=int, help="held-out accuracy every N steps (0: start and end only)")
    g.add_argument("--eval-n", type=int, help="held-out problems in the accuracy check")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint")
    return p


def resolve_args(argv):
    """CLI -> config dict: flags given now > the saved config of a resumed run > world defaults."""
    given = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    saved = {}
    if given.get("resume"):
        path = os.path.join(given["resume"], "config.json")
        if not os.path.isfile(path):
            raise UserError(f"--resume {given['resume']}: no run there (config.json missing); "
                            "pass the --out directory of an earlier run")
        with open(path) as f:
            saved = json.load(f)
        given["out"] = given["resume"]
    model = given.get("model", saved.get("model", "toy"))
    cfg = {**COMMON, **(TOY if model == "toy" else REAL), **saved, **given}
    cfg["resume"] = given.get("resume")
    cfg["out"] = cfg["out"] or os.path.join("runs", os.path.basename(cfg["model"].rstrip("/")))
    return cfg
