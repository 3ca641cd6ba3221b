"""Records the static decoder's buffer sets (staticcache._Shape) as they are built: how many are
alive at each allocation and the K/V bytes they hold then, for the memory tests."""
import weakref
from contextlib import contextmanager

from harness import staticcache


def kv_bytes(shape):
    return sum(t.numel() * t.element_size() for t in shape.kv.keys + shape.kv.values)


class Shapes:
    """Installed with monkeypatch (tests) or by `recording` (tests/gpu_check.py); `made` lists
    (rows, length, K/V bytes, shapes alive, bytes alive) per allocation, the new shape included.
    `phase` is copied into each entry when set."""

    def __init__(self, monkeypatch=None):
        self.made, self.live, self.phase = [], [], None
        record = self

        class Recorded(staticcache._Shape):
            def __init__(self, model, cache_kw, rows, length, layers, *rest):
                super().__init__(model, cache_kw, rows, length, layers, *rest)
                record.live = [(r, b) for r, b in record.live if r() is not None] + \
                    [(weakref.ref(self), kv_bytes(self))]
                record.made.append(dict(rows=rows, length=length, bytes=kv_bytes(self), phase=record.phase,
                                        alive=len(record.live), alive_bytes=sum(b for _, b in record.live)))
        self.cls = Recorded
        if monkeypatch is not None:
            monkeypatch.setattr(staticcache, "_Shape", Recorded)

    def alive(self):
        """How many of the recorded shapes are still alive."""
        return sum(r() is not None for r, _ in self.live)


@contextmanager
def recording():
    """Shapes recorded inside the block, outside pytest."""
    shapes, base = Shapes(), staticcache._Shape
    staticcache._Shape = shapes.cls
    try:
        yield shapes
    finally:
        staticcache._Shape = base
