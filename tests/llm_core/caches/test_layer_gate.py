"""LayerGate: layers are marked in order, a reader of layer i blocks until i is marked, and a
failed copier wakes every reader with an error instead of leaving it blocked."""

from __future__ import annotations

import threading
import time

import pytest

from llm_core.caches.layer_gate import LayerCopyFailed, LayerGate


def test_layers_are_marked_in_order() -> None:
    gate = LayerGate(3)
    assert gate.ready == 0
    gate.mark_ready(0)
    with pytest.raises(AssertionError, match="out of order"):
        gate.mark_ready(2)
    with pytest.raises(AssertionError, match="out of order"):
        gate.mark_ready(0)  # twice
    gate.mark_ready(1)
    assert gate.ready == 2
    gate.wait(0)  # marked: returns at once
    gate.wait(1)


def _reader(gate: LayerGate, layer: int, log: list[tuple[str, int, float]]) -> threading.Thread:
    def run() -> None:
        try:
            gate.wait(layer)
            log.append(("read", layer, time.perf_counter()))
        except LayerCopyFailed:
            log.append(("failed", layer, time.perf_counter()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_reader_is_blocked_until_its_layer_is_marked() -> None:
    gate = LayerGate(3)
    log: list[tuple[str, int, float]] = []
    reader = _reader(gate, 1, log)
    gate.mark_ready(0)
    time.sleep(0.05)
    assert not log and reader.is_alive()  # layer 0 alone does not open layer 1
    marked = time.perf_counter()
    gate.mark_ready(1)
    reader.join(5)
    assert not reader.is_alive()
    assert [(kind, i) for kind, i, _ in log] == [("read", 1)]
    assert log[0][2] >= marked


def test_a_failure_wakes_every_waiting_reader_and_later_ones() -> None:
    gate = LayerGate(4)
    gate.mark_ready(0)
    log: list[tuple[str, int, float]] = []
    readers = [_reader(gate, i, log) for i in (1, 2, 3)]
    time.sleep(0.05)
    cause = ValueError("host page gone")
    gate.fail(cause)
    for r in readers:
        r.join(5)
        assert not r.is_alive()  # no deadlock: every blocked reader returned
    assert sorted((kind, i) for kind, i, _ in log) == [("failed", 1), ("failed", 2), ("failed", 3)]
    with pytest.raises(LayerCopyFailed) as info:
        gate.wait(2)  # a reader arriving after the failure does not block either
    assert info.value.__cause__ is cause
    gate.wait(0)  # a layer written before the failure stays readable
    gate.fail(RuntimeError("second"))
    assert gate.error is cause  # the first failure is the one kept


def test_a_concurrent_copier_and_reader_see_every_layer_in_order() -> None:
    n = 50
    gate = LayerGate(n)
    written: list[int] = []
    seen: list[tuple[int, int]] = []  # (layer read, layers written at that time)

    def copier() -> None:
        for i in range(n):
            written.append(i)
            gate.mark_ready(i)

    t = threading.Thread(target=copier)
    t.start()
    for i in range(n):
        gate.wait(i)
        seen.append((i, len(written)))
    t.join(5)
    assert all(done > i for i, done in seen)
