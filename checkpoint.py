"""Where models and runs live: aliases, run directories, atomic checkpoints.

`resolve_model` turns what a user types after --model into something from_pretrained loads:
an alias (`deepseek-r1-distill-qwen-7b`), `toy`, an HF id, a model directory, a checkpoint
directory, or a run directory (its latest checkpoint).

    RUN/config.json                      the resolved configuration (written at start)
    RUN/metrics.jsonl                    one row per step, plus held-out evaluation rows
    RUN/checkpoints/step_000010/         the policy (save_pretrained) + tokenizer, loadable by
                                         AutoModelForCausalLM / AutoTokenizer as they are
                         probe.pt        the probe and its optimizer (probe.save format)
                         state.pt        policy optimizer, scheduler, RNG states, data cursor, step

A checkpoint is written under `step_000010.tmp` and renamed when complete, so a crash mid-write
never replaces or damages the last good one; only the last `keep` are kept.
"""
import json
import os
import random
import shutil

import numpy as np
import torch

PREFIX = "step_"
ALIASES = {
    "deepseek-r1-distill-qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "qwen3-4b-instruct": "Qwen/Qwen3-4B-Instruct-2507",
}


class UserError(ValueError):
    """A problem the user can fix (bad name, missing file, offline hub): printed as one line."""


def resolve_model(name):
    """Alias, HF id, model dir, checkpoint dir or run dir (-> its latest complete checkpoint)."""
    if name == "toy":
        import toy  # the offline world; builds its base policy on first use
        return toy.base_model()
    if name in ALIASES:
        return ALIASES[name]
    if os.path.isdir(os.path.join(name, "checkpoints")):
        ckpt = latest_checkpoint(name)
        if ckpt is None:
            raise UserError(f"run directory {name} has no complete checkpoint under checkpoints/")
        return ckpt
    if os.path.isdir(name):
        return name
    # owner/name is an HF id unless `owner` is a local folder (runs/typo: say so instead of asking the hub)
    if name.count("/") == 1 and not name.startswith((".", "/")) and not os.path.isdir(name.split("/")[0]):
        return name
    if "/" in name:
        raise UserError(f"model directory {name} does not exist")
    raise UserError(f"model {name!r} is not a directory, an HF id (owner/name) or an alias "
                    f"({', '.join(['toy', *ALIASES])})")


def load_model(name, dtype=torch.float32, trust_remote_code=False):
    """(model, tokenizer) for a --model value; any loading failure becomes one UserError line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        where = "" if path == name else f" ({path})"
        raise UserError(f"cannot load model {name!r}{where}: {first} -- offline? download it first "
                        "(hf download ID) or pass a local directory with weights") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def checkpoints(run_dir):
    """Complete checkpoint directories of a run, oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())
    return [os.path.join(root, n) for n in names]


def latest_checkpoint(run_dir):
    found = checkpoints(run_dir)
    return found[-1] if found else None


def rng_state():
    _, keys, pos, *_ = np.random.get_state()
    # numpy's state as a tensor, so that torch.load(weights_only=True) can read it back
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
             "numpy_pos": int(pos), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"]))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir, step, write, keep=2):
    """Call write(tmp_dir) to fill a new checkpoint, then publish it atomically and prune old ones."""
    final = os.path.join(run_dir, "checkpoints", f"{PREFIX}{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    if os.path.exists(final):  # the same step saved again (e.g. the last step): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def truncate_metrics(path, last_step):
    """Drop rows logged after the checkpoint we resume from (they will be produced again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)
