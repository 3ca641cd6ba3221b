"""A run's configuration, resolved and checked: the flags given now > the saved config.json of a
resumed run (or a --config file) > the world defaults and a named model's recipe (harness/flags.py:
the flags, their defaults, RECIPES and LIMITS). Every value is checked before any model, data or
folder is touched.
"""
import json
import math
import os

from modes import PROBE_MODES  # harness/plan.py reads PROBE_MODES here
from harness import rewardfn
from harness.checkpoint import ALIASES
from harness.files import UserError
from harness.flags import (COMMON, FIXED_ON_RESUME, IMPLIED, LIMITS, LORA_LR_FACTOR, REAL, RECIPES, TOY,
                           TOY_IMPLIED, build_parser, fractions)

NOT_SAVED = ("resume", "config", "plot")  # how a run was started, not what it is


def check_values(cfg, limits=LIMITS):
    """UserError (one line) for the first value outside its limits; None values are skipped."""
    for key, (ok, what) in limits.items():
        v = cfg.get(key)
        if v is None:
            continue
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if bad or (isinstance(v, float) and not math.isfinite(v)) or not ok(v):
            raise UserError(f"--{key.replace('_', '-')} {v}: must be {what}")


def check_saved(saved, where):
    """UserError (one line naming the key and value as they are in the file `where`) for a value of a
    saved or given config.json that the command line would refuse: the parser's type or choices,
    then LIMITS. null is a default; keys the parser does not know are left alone."""
    actions = {a.dest: a for a in build_parser()._actions}
    for key, v in saved.items():
        a = actions.get(key)
        if a is None or v is None:
            continue
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if a.choices:
            ok, what = v in a.choices, "one of " + ", ".join(a.choices)
        elif a.type is int:
            ok, what = number and isinstance(v, int), "an integer"
        elif a.type is float:
            ok, what = number, "a number"
        elif a.type is fractions:
            ok = isinstance(v, list) and bool(v) and all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in v)
            what = "a list of fractions in (0, 1], e.g. [0.25, 0.5]"
        elif a.nargs == 0:
            ok, what = isinstance(v, bool), "true or false"
        else:
            ok, what = isinstance(v, str), "a string"
        if ok and key in LIMITS:
            ok, what = (not isinstance(v, float) or math.isfinite(v)) and LIMITS[key][0](v), LIMITS[key][1]
        if not ok:
            raise UserError(f"{json.dumps(key)}: {json.dumps(v)[:60]} in {where}: must be {what}")


def check_world(cfg, world):
    """Whole prompt groups go to the ranks in turn: a rank without one would have nothing to train
    on, and the others would wait for it in the next collective."""
    n = cfg["prompts_per_step"]
    if n < world:
        raise UserError(f"--prompts-per-step {n} leaves some of the {world} workers without a prompt: "
                        f"use --prompts-per-step >= {world} or fewer GPUs (--nproc {n})")


def check_out(path, flag="--out"):
    """A folder we can create or write into: not a link or a file, and its nearest existing parent writable."""
    if os.path.islink(path.rstrip("/") or "/"):   # dangling or not: where it points is not what was asked for
        raise UserError(f"{flag} {path} is a symbolic link (to {os.readlink(path.rstrip('/'))}): pass the folder "
                        "itself, or another path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder: pass a folder path")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable; pass a folder you can write to")



def resolve_args(argv):
    """CLI -> checked config dict: flags given now > the saved config of a resumed run > world
    defaults. trust_remote_code is only ever the flag given now."""
    given = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    check_values(given)   # the flags as typed first, so the message names what the user wrote
    saved = {}
    if given.get("resume"):
        run = given["resume"]
        saved = read_config(run)
        check_saved(saved, os.path.join(run, "config.json"))
        if saved.pop("trust_remote_code", False) and not given.get("trust_remote_code"):
            raise UserError(f"--resume {run}: the run was started with --trust-remote-code, which is "
                            "never taken from a saved config; pass it again if you trust the code there")
        check_reward_fn(saved, given, f"--resume {run}")
        for key in FIXED_ON_RESUME:
            if key in given and key in saved and given[key] != saved[key]:
                raise UserError(f"--resume {run}: --{key.replace('_', '-')} cannot change on resume "
                                f"(saved {saved[key]!r}, given {given[key]!r}); start a new run with --out")
        if "out" in given and os.path.abspath(given["out"]) != os.path.abspath(run):
            raise UserError(f"--resume {run} writes into {run}: drop --out {given['out']}")
        given["out"] = run
    elif given.get("config"):
        saved = _read_config(given["config"])
        check_saved(saved, given["config"])
        check_reward_fn(saved, given, f"--config {given['config']}")
    model = given.get("model", saved.get("model", "toy"))
    is_toy = model == "toy" or given.get("toy_world", saved.get("toy_world")) is not None
    world = {**COMMON, **(TOY if is_toy else {**REAL, **RECIPES.get(ALIASES.get(model, model), {})})}
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
    cfg["reward_fn"] = given.get("reward_fn")
    if cfg["reward_fn"]:
        rewardfn.load(cfg["reward_fn"])  # a file that does not import stops here, before any folder is made
    cfg["reward_fn_sha256"] = rewardfn.digest(cfg["reward_fn"])   # the file edited since: a change on resume
    cfg.update({k: given.get(k) for k in NOT_SAVED})
    cfg["out"] = cfg["out"] or os.path.join("runs", os.path.basename(cfg["model"].rstrip("/")))
    check_values(cfg)
    if cfg["probe_labels"] != "mc" and cfg["reward"] not in PROBE_MODES:
        raise UserError(f"--probe-labels {cfg['probe_labels']}: --reward {cfg['reward']} fits no probe; "
                        "drop it or use a probe mode (" + ", ".join(PROBE_MODES) + ")")
    check_out(cfg["out"], "--resume" if cfg["resume"] else "--out")
    return cfg


def check_reward_fn(saved, given, where):
    """A run started with --reward-fn resumes (or is copied) only with --reward-fn given again: a
    saved config names a file, and code is never run because a config says so."""
    if saved.get("reward_fn") and not given.get("reward_fn"):
        raise UserError(f"{where}: the run was started with --reward-fn {saved['reward_fn']}, which is "
                        "never taken from a saved config; pass it again if you trust that file")


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


def read_config(run, flag="--resume"):
    """RUN/config.json as a dict, or one UserError line saying what is wrong with it."""
    path = os.path.join(run, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {run}: no run there (config.json missing); "
                        "pass the --out directory of an earlier run")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (ValueError, OSError) as e:
        raise UserError(f"{flag} {run}: {path} is unreadable ({type(e).__name__}: {e}); "
                        "restore it or start a new run") from None
    if not isinstance(saved, dict):
        raise UserError(f"{flag} {run}: {path} is not a JSON object; restore it or start a new run")
    return saved


def changes(saved, cfg):
    """[(key, saved value, new value)] for saved keys whose value differs in cfg (resume bookkeeping)."""
    skip = ("resume", "out", "trust_remote_code")
    return [(k, saved[k], cfg[k]) for k in saved if k in cfg and k not in skip and saved[k] != cfg[k]]
