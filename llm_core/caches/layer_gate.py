"""A per-layer ready counter between a KV copier and the forward that reads the copied KV.

Why: KV that arrives by copy (``caches/kv_source.py``) can be written layer by layer beside the
forward of the same step instead of in a step of its own. The forward reads layer i's KV right
before layer i's attention (``PagedKVCache.layer``), so it only has to wait for layer i, not for
the whole copy::

    copier thread   copy L0 | mark 0 | copy L1 | mark 1 | copy L2 | mark 2 ...
    forward         wait 0 -> layer 0 | wait 1 -> layer 1 | wait 2 -> layer 2 ...

The copier marks layers in order (``mark_ready(0)``, ``mark_ready(1)``, ...), so one counter says
everything: layers ``[0, ready)`` are written. A copier that fails calls ``fail``: every reader
waiting (now or later) raises ``LayerCopyFailed`` instead of blocking forever.
"""

from __future__ import annotations

import threading


class LayerCopyFailed(RuntimeError):
    """The copier failed (or was cancelled) before the layer a reader waits for was written."""


class LayerGate:
    """Layers ``[0, ready)`` are written; ``wait(i)`` blocks until ``i < ready`` or a failure."""

    def __init__(self, num_layers: int) -> None:
        assert num_layers >= 1, num_layers
        self.num_layers = num_layers
        self._ready = 0  # only grows; read without the lock on the fast path (an int is atomic)
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def ready(self) -> int:
        """How many leading layers are written."""
        return self._ready

    @property
    def error(self) -> BaseException | None:
        """What the copier failed with (None: no failure so far). A copier checks it to stop
        early when the reader side gave up (``fail`` from the reader: a forward that raised)."""
        return self._error

    def mark_ready(self, i: int) -> None:
        """Layer ``i`` is written; layers must be marked in order, each once."""
        with self._cond:
            if i != self._ready:
                raise AssertionError(f"layer {i} marked ready out of order (next is {self._ready})")
            self._ready = i + 1
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """No further layer will be marked: wake every reader; those not yet served raise. The first
        failure is kept (a later one, e.g. the reader's cancel after the copier's error, is not)."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def wait(self, i: int) -> None:
        """Block until layer ``i`` is written; ``LayerCopyFailed`` when the copier failed first."""
        if i < self._ready:  # the common case once the copier is ahead: no lock taken
            return
        assert 0 <= i < self.num_layers, (i, self.num_layers)
        with self._cond:
            while i >= self._ready and self._error is None:
                self._cond.wait()
            if i >= self._ready:
                raise LayerCopyFailed(f"KV copy of layer {i} did not complete") from self._error
