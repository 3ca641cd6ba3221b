"""The run's configuration: world defaults (toy vs real model), the command line, and resume.

Precedence: flags given now > the saved config.json of a resumed run > the defaults below.
"""
import argparse
import json
import os

import data
from checkpoint import UserError

# Defaults that depend on the world: the toy sizes for 2 CPU cores, the real ones from DESIGN.md.
TOY = dict(data="toy", eval_data="toy", steps=45, prompts_per_step=16, group_size=8, lr=1e-4,
           warmup=3, max_new_tokens=48, eval_n=500, eval_every=10, save_every=10, grad_ckpt=False,
           micro_tokens=8192, gen_batch=256, grader="math",
           instruction="")  # toy problems are complete user messages
# The released run script: 32 prompts x 6 samples, 8000 new tokens, prompts over 600 tokens dropped.
REAL = dict(data="deepscaler", eval_data="math500", steps=600, prompts_per_step=32, group_size=6,
            lr=1e-6, warmup=10, max_new_tokens=8000, max_prompt_tokens=600, eval_n=100, eval_every=50,
            save_every=50, grad_ckpt=True, micro_tokens=16384, instruction=data.INSTRUCTION,
            grader="strict",  # the released training reward
            gen_batch=8)  # 8 prompts x 6 = 48 rows x 8k tokens: ~22 GB of KV cache for the 7B
COMMON = dict(model="toy", problem_field=None, answer_field=None, trust_remote_code=False,
              temperature=0.8, top_p=1.0, reward="rlcm", lam=0.1, k=4, forced_close="think",
              corner="zero", budgets=(0.25, 0.5, 0.75), max_prompt_tokens=0, probe_lr=1e-3, probe_passes=16, probe_batch=16, grad_clip=1.0,
              clip_low=0.2, clip_high=0.2, agg="token-mean", chunk_size=1024, seed=0, keep=2,
              out=None, resume=None, system_prompt=None, log_samples=4, eval_probe_n=32, wandb=None,
              wandb_run=None)
NOT_SAVED = ("resume", "config", "plot")  # how a run was started, not what it is

DATA_HELP = ("toy | deepscaler | HF dataset id | local json/jsonl/parquet. deepscaler (40k problems, "
             "downloads) is a superset of the released training set, the GRPO-LEAD stage-1 file "
             "(7,721 problems, stage1_data.json in the authors' repository; not on the hub): "
             "--data stage1_data.json reproduces it")


def fractions(text):
    """--budgets "0.25,0.5,0.75" -> (0.25, 0.5, 0.75); each fraction of the response in (0, 1]."""
    try:
        out = tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        out = ()
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions in (0, 1], e.g. 0.25,0.5,0.75 or 1.0")
    return out


def build_parser():
    """Every default is None here: unset flags are filled from COMMON and TOY/REAL in resolve_args."""
    fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=(
        f"defaults: {fmt(COMMON)}. toy world: {fmt(TOY)}. real models: {fmt(REAL)}."))
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="toy | deepseek-r1-distill-qwen-7b | qwen3-4b-instruct | HF id | local dir")
    g.add_argument("--data", help=DATA_HELP)
    g.add_argument("--problem-field")
    g.add_argument("--answer-field")
    g.add_argument("--eval-data", help="held-out set for the accuracy check (default: toy test / math500)")
    g.add_argument("--max-prompt-tokens", type=int,
                   help="drop training problems whose chat prompt is longer (600 for real models, as "
                        "released; 0 keeps all)")
    g.add_argument("--trust-remote-code", action="store_true", default=None)
    g.add_argument("--instruction", help="text appended to every problem in the user turn (saved; "
                   "evaluate.py reuses it for this run's checkpoints)")
    g.add_argument("--system-prompt", help="system turn before the problem (saved and reused like --instruction)")
    g = p.add_argument_group("rollout")
    g.add_argument("--prompts-per-step", type=int)
    g.add_argument("--group-size", type=int)
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--gen-batch", type=int, help="prompts per generation call")
    g = p.add_argument_group("reward, labels and probe")
    g.add_argument("--reward", choices=("rlcm", "grpo"))
    g.add_argument("--lam", type=float)
    g.add_argument("--k", type=int, help="forced answers per prefix")
    g.add_argument("--forced-close", choices=("think", "eos"),
                   help="token before the forced suffix: </think> (paper) or EOS (released code)")
    g.add_argument("--budgets", type=fractions, metavar="F,F,...",
                   help="truncation points as fractions of each response (0.25,0.5,0.75; 1.0 alone "
                        "for the final-only ablations)")
    g.add_argument("--corner", choices=("zero", "margin-corner", "final-margin"),
                   help="margin when only one side exists: 0 (RLCM); mean C / 1 - mean C (released "
                        "margin_corner); final-margin: +mean C / -mean C and 0 when both exist (released "
                        "conf_diff_v3; with --budgets 1.0, the Final-Margin ablation)")
    g.add_argument("--grader", choices=("strict", "math"),
                   help="grader of r_nat and of the forced answers of Y_b: strict (released training "
                        "reward: last \\boxed{ and gold stripped, a trailing .0 and leading zeros "
                        "dropped, then equal strings) or math (normaliser + math-verify, as evaluate.py)")
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
    g.add_argument("--config", metavar="FILE", help="start a new run from a saved config.json (flags given win)")
    g = p.add_argument_group("what the run leaves (runlog.py, heldout.py)")
    g.add_argument("--log-samples", type=int, help="trajectories per step written to RUN/samples.jsonl")
    g.add_argument("--eval-probe-n", type=int, help="held-out trajectories labelled at each held-out check "
                   "to measure the probe out of sample (0: off)")
    g.add_argument("--wandb", metavar="PROJECT", help="mirror metrics to Weights & Biases (pip install wandb)")
    g.add_argument("--wandb-run", metavar="NAME", help="W&B run name")
    g.add_argument("--plot", metavar="RUN", help="only draw RUN/curves.png from RUN/metrics.jsonl and exit")
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
    elif given.get("config"):
        saved = _read_config(given["config"])
    model = given.get("model", saved.get("model", "toy"))
    cfg = {**COMMON, **(TOY if model == "toy" else REAL), **saved, **given}
    cfg.update({k: given.get(k) for k in NOT_SAVED})
    cfg["out"] = cfg["out"] or os.path.join("runs", os.path.basename(cfg["model"].rstrip("/")))
    return cfg


def _read_config(path):
    """A saved config.json minus where and how that run was started (its --out is not reused)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--config {path}: cannot read it ({e}); pass a run's config.json") from None
    if not isinstance(saved, dict):
        raise UserError(f"--config {path}: not a config (a JSON object of settings); pass a run's config.json")
    return {k: v for k, v in saved.items() if k not in NOT_SAVED + ("out",)}
