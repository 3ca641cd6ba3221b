"""Run directories and atomic checkpoints.

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
