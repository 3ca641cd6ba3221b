"""Live tensor bytes on any device, CPU included: a dispatch mode that counts each storage an op
creates from its allocation until it is freed, and keeps the peak. What the memory tests hold the
plan's terms against where torch.cuda.max_memory_allocated is not at hand."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """with LiveBytes() as m: ...; then m.peak: the most bytes that storages made inside the block
    held at once (storages made before it are not counted), m.now: those still alive. Sees the
    backward's ops as well (autograd carries the mode to the ops it runs). A view made inside the
    block of a tensor made before it looks like a new storage: name such tensors in `known`."""

    def __init__(self, known=()):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0
        self.known = {t.untyped_storage().data_ptr() for t in known}

    def _free(self, key):
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)  # a DTensor holds no storage: its local shard does
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.known:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out
