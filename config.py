"""The run's configuration: every flag of train.py, its default in each world (TOY, REAL, COMMON,
a model's RECIPES, a --reward mode's IMPLIED) and its allowed values (LIMITS). resolve_args: flags
given now > a resumed run's config.json (or a --config file) > the defaults, all checked first."""
import argparse
import contextlib
import json
import math
import os
import sys

import grade
import toy
from data import INSTRUCTION, RLCR_INSTRUCTION
from grpo import AGGS
from baselines import REWARDS  # the --reward modes
from rollout import DECODES
from harness.checkpoint import ALIASES, check_out, read_config
from harness.files import UserError
from harness.runlog import TRACKERS, check_tracker

NOT_SAVED = ("resume", "config")  # how a run was started, not what it is
# Settings earlier versions saved: the value this version acts as, and the last commit that had the
# flag. A run saved with another value would resume as another experiment: refused.
DROPPED = dict(problem_field=(None, "ccafa30"), answer_field=(None, "ccafa30"),
               probe_batch=(16, "d51ef88"), log_samples=(4, "d51ef88"),
               eval_probe_n=(32, "d51ef88"), probe_labels=("mc", "a0ee24b"),
               reward_fn=(None, "4391ed1"), wandb=(None, "d70acb7"), wandb_run=(None, "d70acb7"))

# Defaults that depend on the world (docs/design.md, "Defaults"): the toy sizes for 2 CPU cores, the
# real ones from the released run script. Why the toy's lr and lam: docs/reference.md (the end).
TOY = dict(data="toy", eval_data="toy", steps=45, prompts_per_step=16, group_size=8, lr=2e-5,
           lam=1.0, warmup=3, warmup_from_zero=False, weight_decay=0.0, max_new_tokens=72,
           eval_n=500, eval_every=10, save_every=10, grad_ckpt=False, micro_tokens=8192,
           gen_batch=256, grader="math", instruction="")  # toy problems are complete user messages
# The released run script (save_freq=40: the paper's steps 560 and 600; verl's AdamW decay and
# warm-up). The toy keeps its own (no decay, the first update at lr / warmup): its README numbers.
REAL = dict(data="deepscaler", eval_data="math500", steps=600, prompts_per_step=32, group_size=6,
            lr=1e-6, warmup=10, warmup_from_zero=True, weight_decay=0.01, max_new_tokens=8000,
            max_prompt_tokens=600, eval_n=100, eval_every=50, save_every=40, grad_ckpt=True,
            micro_tokens=16384, instruction=INSTRUCTION, grader="strict",  # the released reward
            gen_batch=8)  # 8 prompts x 6 = 48 rows x 8k tokens: ~22 GB of KV cache for the 7B
# hub id -> what its own released run script changes in REAL (docs/reference.md: the 4B's recipe)
RECIPES = {"Qwen/Qwen3-4B-Instruct-2507": dict(steps=240)}
COMMON = dict(model="toy", trust_remote_code=False, temperature=0.8, top_p=1.0, reward="rlcm",
              lam=0.1, k=4, forced_close="think", corner="zero", budgets=(0.25, 0.5, 0.75),
              max_prompt_tokens=0, probe_lr=1e-3, probe_passes=16, probe_hidden=None, grad_clip=1.0,
              clip_low=0.2, clip_high=0.2, agg="token-mean", chunk_size=1024, seed=0, keep=2,
              out=None, resume=None, system_prompt=None, ppo_epochs=1, offload=False,
              offload_grads="gpu", nproc=None, gpus=None, gpu_mem=None, plan=False, decode=None,
              drop_unanimous=False, c2gspg_bce="off", lora_rank=0, lora_alpha=32.0,
              lora_targets="all-linear", toy_world=None, report_to="none")
# Under --lora-rank the default --lr is this many times the world's full fine-tuning rate ("LoRA
# Without Regret", Schulman et al. 2025: about 10x; TRL's GRPO recipe: 1e-5 against 1e-6).
LORA_LR_FACTOR = 10

# What a --reward mode implies (docs/design.md, "Baselines"). Flags given now win; a resumed run of
# the same mode keeps what it saved; a saved config of another mode loses what its mode implied.
IMPLIED = {"final-margin": dict(budgets=(1.0,), corner="final-margin"),
           "process-brier": dict(drop_unanimous=True),
           "final-brier": dict(budgets=(1.0,), drop_unanimous=True),
           "rlcr": dict(instruction=RLCR_INSTRUCTION, grader="minerva")}  # the released RLCR reward
# The toy world (256 positions, bare sums) asks for RLCR's format with its own short prompt.
TOY_IMPLIED = {"rlcr": dict(instruction=toy.RLCR_INSTRUCTION)}


def fractions(text):
    """--budgets "0.25,0.5,0.75" -> (0.25, 0.5, 0.75); each fraction of the response in (0, 1]."""
    with contextlib.suppress(ValueError):
        out = tuple(float(f) for f in text.split(",") if f.strip())
        if out and all(0 < f <= 1 for f in out):
            return out
    raise argparse.ArgumentTypeError(f"{text!r}: give fractions in (0, 1], e.g. 0.25,0.5,0.75 or 1")


# Allowed values: (test, what it says); floats must also be finite; flags not here are unchecked.
LIMITS = {
    **dict.fromkeys(("prompts_per_step", "max_new_tokens", "gen_batch", "k", "probe_passes", "gpus",
                     "micro_tokens", "chunk_size", "keep", "ppo_epochs", "nproc"),
                    (lambda v: v >= 1, ">= 1")),
    **dict.fromkeys(("lam", "warmup", "weight_decay", "clip_high"), (lambda v: v >= 0, ">= 0")),
    **dict.fromkeys(("probe_lr", "lr", "grad_clip", "lora_alpha"), (lambda v: v > 0, "> 0")),
    "steps": (lambda v: v >= 0, ">= 0 (0: nothing to train)"),
    "group_size": (lambda v: v >= 2, ">= 2 (advantages are normalised within a prompt's group)"),
    "temperature": (lambda v: v > 0, "> 0 (log-probs are taken at the sampling temperature)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "probe_hidden": (lambda v: v >= 0, ">= 0 (0: the linear probe)"),
    "clip_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "save_every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0: at the start and the end only)"),
    "eval_n": (lambda v: v >= 0, ">= 0 (0: no held-out check)"),
    "max_prompt_tokens": (lambda v: v >= 0, ">= 0 (0: keep every prompt)"),
    "gpu_mem": (lambda v: v > 0, "> 0 (GiB)"),
    "lora_rank": (lambda v: v >= 0, ">= 0 (0: full fine-tuning)"),
}
# Refused on --resume: the saved data cursor, RNG states or probe would refer to another run. Others
# apply from the next step, written to config.json (--lr, --probe-lr: replace the saved rates).
FIXED_ON_RESUME = ("model", "data", "seed", "reward", "probe_hidden", "lora_rank", "lora_alpha",
                   "lora_targets", "toy_world")


def dflt(key):
    """A flag's default for its help: one value, or the toy's and the real models'."""
    toy, real = TOY.get(key, COMMON.get(key)), REAL.get(key, COMMON.get(key))
    return f"default {toy}" if toy == real else f"toy {toy}, real models {real}"


def build_parser():   # every default None: resolve_args fills them. More: docs/reference.md
    def add(g, flag, text, **kw):   # a flag whose help ends with its default(s)
        g.add_argument(flag, help=f"{text} ({dflt(flag[2:].replace('-', '_'))})", **kw)
    fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    p = argparse.ArgumentParser(description=(
        "train.py: RL with a confidence-margin reward (RLCM), or a --reward baseline, on the "
        "offline toy world (the default) or a model; --resume continues a run (or starts one in an "
        "empty folder)."), epilog=(
        f"defaults: {fmt(COMMON)}. toy world: {fmt(TOY)}. real models: {fmt(REAL)}."))
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="toy | deepseek-r1-distill-qwen-7b | qwen3-4b-instruct | HF id")
    g.add_argument("--data", help="toy | deepscaler | HF dataset id | local json/jsonl/parquet")
    g.add_argument("--eval-data", help="held-out set for the accuracy check (toy test / math500)")
    g.add_argument("--toy-world", choices=(toy.WORLD,),
                   help="a --model folder's toy world: the toy's defaults apply")
    add(g, "--max-prompt-tokens", "cap", type=int)
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="run the model's own code; give it again with --resume")
    g.add_argument("--instruction", help="text after every problem (saved; evaluate.py reuses it)")
    g.add_argument("--system-prompt", help="a system turn (saved; evaluate.py reuses it)")
    g = p.add_argument_group("rollout")
    add(g, "--prompts-per-step", "problems per RL step", type=int)
    add(g, "--group-size", "samples per problem, a group", type=int)
    add(g, "--max-new-tokens", "response cap in tokens", type=int)
    add(g, "--temperature", "sampling temperature", type=float)
    g.add_argument("--top-p", type=float, help=f"nucleus sampling's top-p ({dflt('top_p')}: off)")
    add(g, "--gen-batch", "prompts per generation call", type=int)
    g.add_argument("--decode", choices=DECODES,
                   help="KV cache: static + CUDA graphs (default on CUDA) or dynamic (on CPU)")
    g = p.add_argument_group("reward, labels and probe (docs/design.md, Baselines)")
    add(g, "--reward", "method or baseline", choices=REWARDS)
    g.add_argument("--drop-unanimous", action=argparse.BooleanOptionalAction,
                   help="reward 0 for all-right or all-wrong groups (Brier modes: on, as released)")
    g.add_argument("--c2gspg-bce", choices=("off", "seq-mean", "token-mean"),
                   help="c2gspg: add 0.1 x BCE(c_theta, correct); off: as released")
    add(g, "--lam", "R = r_nat + lam x calibration", type=float)
    add(g, "--k", "forced answers per prefix", type=int)
    add(g, "--forced-close", "</think> (paper) or EOS (released)", choices=("think", "eos"))
    add(g, "--budgets", "cuts, fractions of each response", type=fractions, metavar="F,F,...")
    add(g, "--corner", "the margin when a side is empty",
        choices=("zero", "margin-corner", "final-margin"))
    g.add_argument("--grader", type=grade.grader_spec, metavar="{strict,math,minerva},FILE.py:FN",
                   help=f"r_nat's and Y_b's ({dflt('grader')}); FILE.py:FN: your own (README)")
    add(g, "--probe-lr", "the probe's learning rate", type=float)
    add(g, "--probe-passes", "passes per fit", type=int)
    g.add_argument("--probe-hidden", type=int, metavar="N",
                   help="the probe d -> N -> 1 (default d/4, as released); 0: linear d -> 1")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help=f"policy learning rate ({dflt('lr')}; "
                   f"{LORA_LR_FACTOR}x under --lora-rank)")
    add(g, "--warmup", "linear warm-up updates", type=int)
    g.add_argument("--warmup-from-zero", action=argparse.BooleanOptionalAction,
                   help=f"first update at lr 0 (verl's; {dflt('warmup_from_zero')})")
    add(g, "--weight-decay", "AdamW decay", type=float)
    add(g, "--grad-clip", "gradient-norm clip", type=float)
    add(g, "--clip-low", "PPO's ratio clip: 1 - clip-low", type=float)
    add(g, "--clip-high", "PPO's ratio clip: 1 + clip-high", type=float)
    add(g, "--agg", "loss aggregation", choices=AGGS)
    add(g, "--micro-tokens", "per micro-batch", type=int)
    add(g, "--chunk-size", "per LM-head call", type=int)
    add(g, "--grad-ckpt", "gradient checkpointing", action=argparse.BooleanOptionalAction)
    add(g, "--ppo-epochs", "updates per batch", type=int)
    g.add_argument("--offload", action="store_true", default=None,
                   help="params, grads and AdamW state in host memory (FSDP2): the 7B on 1-2 GPUs")
    g.add_argument("--offload-grads", choices=("gpu", "host"),
                   help="with --offload: grads to the host once a step (gpu) or every micro-batch")
    g.add_argument("--lora-rank", type=int, help="LoRA adapter rank (0: full fine-tuning)")
    add(g, "--lora-alpha", "LoRA scale alpha", type=float)
    add(g, "--lora-targets", "e.g. q_proj,v_proj")
    g = p.add_argument_group("devices")
    g.add_argument("--nproc", type=int, help="worker processes (default: every GPU; 1 on CPU)")
    g.add_argument("--plan", action="store_true", default=None,
                   help="print the per-GPU memory plan and exit")
    g.add_argument("--gpus", type=int, help="plan for this many GPUs")
    g.add_argument("--gpu-mem", type=float, help="plan for GPUs of this many GiB")
    g = p.add_argument_group("run")
    add(g, "--steps", "RL steps in all", type=int)
    g.add_argument("--out", help="run directory (default runs/<model>)")
    add(g, "--seed", "seeds sampling, data order and the probe", type=int)
    add(g, "--save-every", "checkpoint period", type=int)
    add(g, "--keep", "checkpoints kept", type=int)
    add(g, "--eval-every", "held-out check every N steps, 0: start and end", type=int)
    add(g, "--eval-n", "held-out problems, 0: no check", type=int)
    g.add_argument("--resume", metavar="RUN_DIR", help="continue from the last checkpoint; "
                   "refused: " + ", ".join("--" + k.replace("_", "-") for k in FIXED_ON_RESUME))
    g.add_argument("--config", metavar="FILE", help="start a new run from a saved config.json")
    g.add_argument("--report-to", choices=TRACKERS,
                   help="mirror metrics.jsonl to wandb or trackio (pip install it; default none)")
    return p


# What a config.json may hold: every flag, every world's default, and what a run records of itself.
KNOWN = ({a.dest for a in build_parser()._actions} | set(COMMON) | set(TOY) | set(REAL)
         | {"data_sha256", "provenance"})


def check_values(cfg, limits=LIMITS):
    """UserError (one line) for the first value outside its limits; None values are skipped."""
    for key, (ok, what) in limits.items():
        v = cfg.get(key)
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if v is not None and (bad or (isinstance(v, float) and not math.isfinite(v)) or not ok(v)):
            raise UserError(f"--{key.replace('_', '-')} {v}: must be {what}")


def check_saved(saved, where):
    """UserError (one line) for a value in the config file `where` that its flag would refuse."""
    actions = {a.dest: a for a in build_parser()._actions}
    for key, v in saved.items():
        a = actions.get(key)
        if a is None or v is None:
            continue
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if a.choices:
            ok, what = v in a.choices, "one of " + ", ".join(map(str, a.choices))
        elif a.type is int:
            ok, what = number and isinstance(v, int), "an integer"
        elif a.type is float:
            ok, what = number, "a number"
        elif a.type is fractions:
            ok, what = isinstance(v, list) and bool(v), "a list of fractions in (0, 1]"
            ok = ok and all(type(f) in (int, float) and 0 < f <= 1 for f in v)
        elif a.nargs == 0:
            ok, what = isinstance(v, bool), "true or false"
        else:
            ok, what = isinstance(v, str), "a string"
        if ok and a.type not in (None, str, int, float, fractions):   # --grader's spec
            try:
                a.type(v)
            except argparse.ArgumentTypeError as e:
                ok, what = False, str(e).partition(": must be ")[2]
        if not ok:
            raise UserError(f"{where}: {key} {json.dumps(v)[:60]} is refused: must be {what}, "
                            f"as --{key.replace('_', '-')}")


def check_dropped(saved, flag, path):
    """An older version's settings: refused on --resume (another experiment), named on --config."""
    gone = {k: v for k, v in saved.items() if k not in KNOWN and k not in DROPPED}
    if gone:
        raise UserError(f"{flag} {path}: {', '.join(list(gone)[:4])} is no setting train.py ever "
                        "had: is it a run's config.json?")
    other = {k: v for k, v in saved.items() if k in DROPPED and v != DROPPED[k][0]}
    said = ", ".join(f"{k}={v!r} (last in {DROPPED[k][1]})" for k, v in other.items())
    if other and flag == "--resume":
        raise UserError(f"{flag} {path}: the run has settings this version no longer has: {said}; "
                        "resume it with that version, or start a new run")
    if other:
        print(f"{flag} {path}: settings this version no longer has are ignored: {said}",
              file=sys.stderr)


def check_world(cfg, world):
    """Prompt groups go to the ranks in turn: a rank without one would stall the next collective."""
    n = cfg["prompts_per_step"]
    if n < world:
        raise UserError(f"--prompts-per-step {n} leaves some of the {world} workers without a "
                        f"prompt: use --prompts-per-step >= {world} or fewer GPUs (--nproc {n})")


def resolve_args(argv):
    """CLI -> checked config dict (precedence: the module docstring)."""
    given = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    check_values(given)   # the flags as typed first, so the message names what the user wrote
    run = given.get("resume")
    if run and not (os.path.isdir(run) and set(os.listdir(run)) - {"lock"}):
        if "out" in given and os.path.abspath(given["out"]) != os.path.abspath(run):
            raise UserError(f"--resume {run} writes into {run}: drop --out {given['out']}")
        given["out"] = given.pop("resume")   # a new run: one command for every requeue
    flag = "--resume" if given.get("resume") else "--config" if given.get("config") else None
    saved = {}
    if flag:
        path = given[flag[2:]]
        saved = read_config(path, flag)
        if flag == "--config":   # a saved config minus how and where that run was started
            saved = {k: v for k, v in saved.items() if k not in NOT_SAVED + ("out", "provenance")}
        check_saved(saved, path if flag == "--config" else os.path.join(path, "config.json"))
        check_dropped(saved, flag, path)
    if given.get("resume"):
        if saved.pop("trust_remote_code", False) and not given.get("trust_remote_code"):
            raise UserError(f"--resume {run}: the run was started with --trust-remote-code, never "
                            "taken from a saved config: pass it again if you trust the code there")
        for key in FIXED_ON_RESUME:
            if key in given and key in saved and given[key] != saved[key]:
                raise UserError(f"--resume {run}: --{key.replace('_', '-')} cannot change on resume "
                                f"(saved {saved[key]!r}, given {given[key]!r}); start a new run with --out")
        if "out" in given and os.path.abspath(given["out"]) != os.path.abspath(run):
            raise UserError(f"--resume {run} writes into {run}: drop --out {given['out']}")
        given["out"] = run
    saved = {k: v for k, v in saved.items() if k in KNOWN}  # config.json keeps the rest (RunFolder)
    model = given.get("model", saved.get("model", "toy"))
    is_toy = model == "toy" or given.get("toy_world", saved.get("toy_world")) is not None
    real = {**REAL, **RECIPES.get(ALIASES.get(model, model), {})}
    world = {**COMMON, **(TOY if is_toy else real)}
    cfg = {**world, **saved, **given}
    if saved.get("reward") != cfg["reward"]:
        # Another mode than the saved one (--config): what the saved mode implied goes back to the
        # defaults, so --config FINAL_BRIER --reward rlcm trains with rlcm's budgets and no filter.
        implied = {k: world[k] for k in IMPLIED.get(saved.get("reward"), {})}
        implied.update(IMPLIED.get(cfg["reward"], {}))
        if is_toy:
            implied.update(TOY_IMPLIED.get(cfg["reward"], {}))
        cfg.update({k: v for k, v in implied.items() if k not in given})
    if cfg["lora_rank"] and "lr" not in given and "lr" not in saved:
        cfg["lr"] = LORA_LR_FACTOR * world["lr"]
    cfg["trust_remote_code"] = bool(given.get("trust_remote_code"))
    cfg.update({k: given.get(k) for k in NOT_SAVED})
    cfg["out"] = cfg["out"] or os.path.join("runs", os.path.basename(cfg["model"].rstrip("/")))
    check_values(cfg)
    check_tracker(cfg["report_to"])
    if ":" in cfg["grader"]:
        grade.user_grader(cfg["grader"])   # imported and tried once: a broken one stops here
    check_out(cfg["out"], *(("--resume", None) if cfg["resume"] else ("--out", "train.py")))
    return cfg
