"""What a model is, by content: a short hash of its folder's files, so that a folder trained again,
replaced or copied over is never taken for the model it held before (evaluate.py's samples, results
and post-hoc probes, reproduce.py's "evaluated already", a LoRA adapter's base).

    identity.of("runs/x/checkpoints/step_000002")   # '3f9c0a...': equal for a copy, new for a retrain

A file of at most WHOLE bytes is hashed whole. A larger one (a 7B model's 4 GB shards) is hashed by
its size, its first HEAD bytes (a safetensors header: every tensor's name, dtype, shape and offset)
and SAMPLES slices spread evenly over it: training changes every weight, so a retrained model
differs in every slice, while a 15 GB model costs a few MB of reading. The optimizer's and the
probe's states (state.pt, probe.pt) are not the model and are left out; a LoRA checkpoint's
base.json (harness/adapter.py) holds its base's identity, so an adapter's identity covers its base.
"""
import hashlib
import os

WHOLE = 64 << 20
HEAD, SAMPLES, SLICE = 1 << 20, 64, 1 << 16
NOT_THE_MODEL = ("state.pt", "probe.pt")


def _file(h, path):
    size = os.path.getsize(path)
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        if size <= WHOLE:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return
        h.update(f.read(HEAD))
        for k in range(SAMPLES):
            f.seek(HEAD + (size - HEAD - SLICE) * k // (SAMPLES - 1))
            h.update(f.read(SLICE))


def of(path):
    """A 16-hex-digit hash of a model folder's files (names and content; sub-folders such as eval/
    are not the model); a hub id or alias stands for itself."""
    if not os.path.isdir(path):
        return path
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name in NOT_THE_MODEL or name.startswith(".") or not os.path.isfile(full):
            continue
        h.update(f"{name}\0".encode())
        _file(h, full)
    return h.hexdigest()[:16]
