"""What a LoRA checkpoint rests on (--lora-rank, harness/lora.py): its base model, found by path and
content (base.json; docs/reference.md, "LoRA checkpoints"), and its adapter_config.json, checked
before peft reads it.
"""
import json
import os
import re

import torch

from harness.files import UserError, first_line, identity, write_json

BASE, CONFIG, WEIGHTS = "base.json", "adapter_config.json", "adapter_model.safetensors"


def is_adapter(path):
    return os.path.isfile(os.path.join(path, CONFIG))


def record_base(folder, base):
    """Write FOLDER/base.json for an adapter trained on `base` (a folder or a hub id)."""
    rel = os.path.relpath(base, folder) if os.path.isdir(base) else None
    write_json(os.path.join(folder, BASE), dict(path=base, relative=rel, identity=identity(base)))


def read_config(ckpt):
    """CKPT/adapter_config.json as a dict; UserError when it is not JSON, names no base, or holds a
    rank its weights do not have (peft would allocate that rank, then fail in pages)."""
    path = os.path.join(ckpt, CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({first_line(e)}): restore it from a copy of the run") from None
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str) or not base:
        raise UserError(f"{path} names no base model (base_model_name_or_path): restore it from a copy of the run")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise UserError(f"{path}: r {r!r} is not a rank (an integer >= 1): restore it from a copy of the run")
    if not cfg.get("rank_pattern"):
        _check_rank(path, os.path.join(ckpt, WEIGHTS), r)
    return cfg


def _check_rank(path, weights, r):
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(weights, "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                rank = shape[0] if "lora_A" in key else shape[-1] if "lora_B" in key else r
                if rank != r:
                    raise UserError(f"{path}: r {r}, but {weights} holds an adapter of rank {rank} ({key} has "
                                    f"shape {list(shape)}): restore adapter_config.json from a copy of the run")
    except (OSError, SafetensorError) as e:
        raise UserError(f"cannot read {weights} ({first_line(e)}): restore it from a copy of the run") from None


def base_of(ckpt):
    """The base model an adapter checkpoint was trained on: a folder holding that very model (base.json),
    or the hub id it names; UserError when it is gone or has changed, or names an adapter itself."""
    named = read_config(ckpt)["base_model_name_or_path"]
    try:
        with open(os.path.join(ckpt, BASE), encoding="utf-8") as f:
            rec = json.load(f)
        want, paths = rec["identity"], [rec["relative"] and os.path.join(ckpt, rec["relative"]), rec["path"], named]
    except FileNotFoundError:   # an older checkpoint: the base as its config names it
        want, paths = None, [named]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{os.path.join(ckpt, BASE)} is damaged ({first_line(e)}): restore it from a copy "
                        "of the run") from None
    for path in filter(None, paths):
        if os.path.isdir(path) and is_adapter(path):
            continue   # an adapter is never a base (one naming itself would recurse)
        if want is None or identity(path) == want:
            return os.path.normpath(path) if os.path.isdir(path) else path
    if want is None:
        raise UserError(f"{os.path.join(ckpt, CONFIG)}: its base {named} is an adapter checkpoint, not a model: "
                        "restore the file from a copy of the run")
    raise UserError(f"{ckpt}: the base its adapter was trained on ({rec['path']}, identity {want}) is gone or "
                    "holds another model now: restore that model there, or use another checkpoint")


def tied(model, wanted):
    """The modules among `wanted` (lora.targets; "all-linear" leaves the LM head out) whose weight
    another module shares (tie_word_embeddings): merging an adapter there would change both."""
    if wanted == "all-linear":
        return []
    if isinstance(wanted, str):   # peft reads any other string as a regular expression on the full name
        picked = lambda name: re.fullmatch(wanted, name) is not None  # noqa: E731
    else:
        picked = lambda name: name in wanted or name.split(".")[-1] in wanted  # noqa: E731
    owners = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return [name for name, m in model.named_modules() if picked(name)
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and len(owners[id(m.weight)]) > 1]
