"""Where models and runs live: aliases, run directories, atomic checkpoints.

`resolve_model` turns what follows --model (alias, `toy`, HF id, model, checkpoint or run directory)
into what from_pretrained loads. A checkpoint is written into a fresh `.tmp` folder, fsynced and
renamed whole; a damaged one is skipped, never pruned (docs/reference.md, "What a run leaves").
"""
import json
import os
import random
import shutil
import struct
import sys
import zipfile
from contextlib import contextmanager

import numpy as np
import torch

import toy   # --model toy: the toy world's committed warm start (toy.BASE_DIR; `python toy.py` rebuilds it)
from harness.files import UserError, first_line, fresh_name

PREFIX = "step_"
CONFIG = "adapter_config.json"  # a LoRA checkpoint (harness/lora.py) holds this for config.json
ALIASES = {
    "deepseek-r1-distill-qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "qwen3-4b-instruct": "Qwen/Qwen3-4B-Instruct-2507",
    # the authors' released RLCM checkpoints (the paper's 7B at step 600, the 4B at step 240)
    "rlcm-7b": "Melodramas/RLCM-DeepSeek-R1-Distill-Qwen-7B",
    "rlcm-4b": "Melodramas/RLCM-Qwen3-4B-Instruct",
}


def resolve_model(name):
    """Alias, HF id, model dir, checkpoint dir or run dir (-> its latest complete checkpoint)."""
    if name == "toy":
        if not os.path.exists(os.path.join(toy.BASE_DIR, "model.safetensors")):
            raise UserError(f"--model toy: {toy.BASE_DIR} is missing; rebuild it with python toy.py")
        return toy.BASE_DIR
    if name in ALIASES:
        return ALIASES[name]
    if os.path.isdir(os.path.join(name, "checkpoints")):
        ckpt = latest_checkpoint(name)
        if ckpt is None:
            raise UserError(f"run directory {name} has no complete checkpoint under checkpoints/")
        return ckpt
    if os.path.isdir(name):
        return name
    # owner/name is an HF id unless `owner` is a local folder (runs/typo: say so, not ask the hub)
    if name.count("/") == 1 and not name.startswith((".", "/")) and not os.path.isdir(name.split("/")[0]):
        return name
    if "/" in name:
        raise UserError(f"model directory {name} does not exist")
    raise UserError(f"model {name!r} is not a directory, an HF id (owner/name) or an alias "
                    f"({', '.join(['toy', *ALIASES])})")


def check_available(name):
    """UserError before any data is read for a model that cannot load (also: offline, not cached)."""
    path = resolve_model(name)
    if os.path.isdir(path):
        return
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
        raise UserError(f"model {name!r} ({path}) is not in the local Hugging Face cache and the hub is "
                        f"offline (HF_HUB_OFFLINE): download it first (hf download {path}) or pass a local directory")


def fetch(name):
    """Download an HF model before the workers start (rank 0 would, while the others wait)."""
    path = resolve_model(name)
    from huggingface_hub import constants, snapshot_download
    if os.path.isdir(path) or constants.HF_HUB_OFFLINE:
        return
    try:
        snapshot_download(path, ignore_patterns=["*.bin", "*.pth", "*.pt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"])
    except (OSError, ValueError) as e:
        first = first_line(e, 300)
        raise UserError(f"cannot download model {name!r} ({path}): {first} -- check the name, the network "
                        "and your access (hf auth login), or pass a local directory") from None


def is_adapter(path):
    return os.path.isfile(os.path.join(path, CONFIG))


def step_of(ckpt):
    return int(os.path.basename(ckpt)[len(PREFIX):])


def checkpoints(run_dir):
    """Published checkpoint directories of a run (step_NNNNNN, no .tmp), oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())
    return [os.path.join(root, n) for n in names]


def _safetensors_ok(path):
    """The header parses and the file is as long as the header says (a cut-off copy is not)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return os.path.getsize(path) == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, struct.error, MemoryError, OverflowError):
        return False


def _zip_ok(path):
    """torch.save files are zip archives: a cut-off one has no readable central directory."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def missing(ckpt, resume=False):
    """What a checkpoint lacks to be loaded as a model (resume: state.pt and probe.pt too), [] if nothing."""
    try:
        names = os.listdir(ckpt)
    except OSError:   # a file, or removed meanwhile
        return ["the folder"]
    config = CONFIG if is_adapter(ckpt) else "config.json"
    need = (config, "state.pt", "probe.pt") if resume else (config,)
    lack = [n for n in need if not os.path.isfile(os.path.join(ckpt, n))]
    lack += [f"{n} (cut short)" for n in ("state.pt", "probe.pt")
             if os.path.isfile(os.path.join(ckpt, n)) and not _zip_ok(os.path.join(ckpt, n))]
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if not weights:
        lack.append("model.safetensors")
    lack += [f"{n} (cut short)" for n in weights if not _safetensors_ok(os.path.join(ckpt, n))]
    return lack


def latest_checkpoint(run_dir, say=None, resume=False):
    """The newest complete checkpoint; incomplete newer ones are named with what they lack through `say`."""
    say = say or (lambda msg: print(msg, file=sys.stderr))
    for ckpt in reversed(checkpoints(run_dir)):
        lack = missing(ckpt, resume)
        if not lack:
            return ckpt
        if not os.path.lexists(ckpt):   # pruned by the run's writer while we looked: a newer one exists
            return latest_checkpoint(run_dir, say, resume)
        say(f"skipping incomplete checkpoint {ckpt}: missing {', '.join(lack)}")
    return None


@contextmanager
def reading(path):
    """Turn a damaged or refused torch file into one UserError line (torch's own message for a
    refused pickle advises weights_only=False, which would run whatever code the file holds)."""
    import pickle
    try:
        yield
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds objects other than tensors and plain data, so it was not "
                        "loaded (that could run code): it was not written by this code") from None
    except (RuntimeError, EOFError, KeyError, zipfile.BadZipFile) as e:
        first = first_line(e)
        raise UserError(f"{path} is damaged ({first}): use an earlier checkpoint") from None


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


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder):
    """fsync every file under folder, then the folders: a crash after the rename finds them whole."""
    for d, _, names in os.walk(folder, topdown=False):
        for n in names:
            _fsync(os.path.join(d, n))
        _fsync(d)


def save_checkpoint(run_dir, step, write, keep=2):
    """write(tmp_dir) fills a fresh folder, published atomically; then all but the last `keep` (0: all)
    complete ones at or below `step` are pruned. A failed write (a full disk) is one UserError line."""
    from safetensors import SafetensorError
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"{PREFIX}{step:06d}")
    os.makedirs(root, exist_ok=True)
    for n in os.listdir(root):   # left by a killed save (we hold the run's lock: no one else saves)
        if n.startswith(PREFIX) and n.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    tmp = fresh_name(final)
    os.mkdir(tmp)
    try:
        write(tmp)
        _sync_tree(tmp)   # on disk before the rename publishes it and any older one is pruned
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError, SafetensorError)):   # torch.save says RuntimeError
            first = first_line(e)
            raise UserError(f"cannot write checkpoint {final} ({first}): is the disk full? The checkpoints "
                            "saved before it are intact") from None
        raise
    old = fresh_name(final) if os.path.lexists(final) else None
    if old:   # the same step saved again (after a fallback): old one aside
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(root)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    done = [c for c in checkpoints(run_dir) if step_of(c) <= step and not missing(c, resume=True)]
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def apply_rates(opt, sched, lr, probe_opt, probe_lr):
    """Rates given with --resume replace those restored with the optimizer states."""
    if sched.base_lrs != [lr] * len(opt.param_groups):
        sched.base_lrs = [lr] * len(opt.param_groups)
        for g, fn in zip(opt.param_groups, sched.lr_lambdas):
            g["initial_lr"], g["lr"] = lr, lr * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]
    for g in probe_opt.param_groups:
        g["lr"] = probe_lr
