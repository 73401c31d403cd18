"""KV copied beside the forward (``serving/kv_copy.py``): a returning session whose history comes
back from the host tier gives the recomputed greedy ids with the copy overlapped and without; with
overlap the restore's chunk crosses the copy's end (copy and compute in one step); a corrupted copy
changes the ids (the comparison can fail); the forward's layer i really waits for layer i's copy;
a failing copy or forward is re-raised with the gate cleared; and an import's per-layer writes
equal its whole-chunk write."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

from llm_core.caches.host_restore import HostRestore
from llm_core.caches.kv_pool import KVLayout, LayerKV, PagedKVCache, PageRows
from llm_core.caches.layer_gate import LayerCopyFailed
from llm_core.kv_transfer.kv_import import KVImport
from llm_core.kv_transfer.layer_plan import LayerPlan
from llm_core.kv_transfer.payload import pack, read
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.kv_copy import CopyJob, LayeredCopy
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.caches.test_host_tier import history_turns, session
from tests.llm_core.serving.test_engine import prompt_of


def make_engine(loaded: Any, overlap: bool, host: bool = True) -> LLMEngine:
    cfg = EngineConfig(
        kv_memory_bytes=288 << 10,  # the device pool holds about one history, not the fillers too
        max_model_len=512,
        page_size=4,
        host_kv_bytes=16 << 20 if host else 0,
        kv_copy_overlap=overlap,
    )
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)
    # Both ends of the switch, set here whether or not the engine passes the config on.
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, kv_copy_overlap=overlap)
    engine.runner.kv_copy_overlap = overlap
    engine.start()
    return engine


def run_session(engine: LLMEngine, loaded: Any) -> list[list[int]]:
    turns, mm = history_turns(loaded)
    try:
        return session(engine, turns, mm, [prompt_of(90, 100 + i) for i in range(4)])
    finally:
        engine.stop()


def use_source(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, cls: type[HostRestore]) -> None:
    """The engine's host tier hands out ``cls`` restores (a subclass changing ``write_layer``)."""
    host = engine.scheduler.kv.host_tier
    assert host is not None
    restore = host.restore

    def wrapped(*args: Any, **kwargs: Any) -> HostRestore:
        r = restore(*args, **kwargs)
        return cls(r.start, r.end, r.pages, r.page_size, r.tier)

    monkeypatch.setattr(host, "restore", wrapped)


@pytest.fixture(scope="module")
def recomputed(loaded: Any) -> list[list[int]]:
    """The session's ids on an engine without a host tier: the evicted history is recomputed."""
    return run_session(make_engine(loaded, overlap=True, host=False), loaded)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_restored_session_gives_the_recomputed_ids(
    loaded: Any, recomputed: list[list[int]], overlap: bool
) -> None:
    engine = make_engine(loaded, overlap)
    host = engine.scheduler.kv.host_tier
    got = run_session(engine, loaded)
    assert host is not None and host.restored_tokens > 0
    assert got == recomputed
    if overlap:  # the restore's chunk crossed its end: copied and computed in one step
        assert engine.runner.num_overlapped_copies > 0
    else:
        assert engine.runner.num_overlapped_copies == 0


class HalfK(HostRestore):
    """A wrong copy: full layers' K of the copied positions halved."""

    def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
        super().write_layer(kv, layer, rows, lo, hi)
        dst = kv.layer_storage(layer)
        if dst.window is not None:
            return
        p, pages = self.page_size, kv.physical(layer, rows[0])  # this layer's pages in its tensor
        for pos in range(lo, hi):
            dst.k[pages[pos // p], pos % p] *= 0.5


def test_a_corrupted_copy_changes_the_ids(
    loaded: Any, recomputed: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(loaded, overlap=True)
    use_source(monkeypatch, engine, HalfK)
    got = run_session(engine, loaded)
    assert engine.runner.num_overlapped_copies > 0
    assert got[0] == recomputed[0]  # the first turn restores nothing
    assert got != recomputed


def test_the_forward_waits_for_each_layers_copy(
    loaded: Any, recomputed: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy whose layer 1 is slow: while it sleeps the forward computes layer 0 (the overlap), and
    it reads layer 1 only once that layer's copy is done (the wait)."""
    events: list[tuple[str, float]] = []  # in the order they happened (list.append is atomic)

    class SlowLayer1(HostRestore):
        def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
            beside = layer == 1 and kv.gate is not None  # a copy beside a forward, not before it
            if beside:
                events.append(("copy1-start", time.perf_counter()))
                time.sleep(0.2)
            super().write_layer(kv, layer, rows, lo, hi)
            if beside:
                events.append(("copy1-done", time.perf_counter()))

    engine = make_engine(loaded, overlap=True)
    use_source(monkeypatch, engine, SlowLayer1)
    kv = engine.kv
    layer = kv.layer

    def recorded(i: int) -> LayerKV:
        gated = kv.gate is not None
        out = layer(i)  # returns once the gate (if any) has layer i
        if gated and i < 2:
            events.append((f"read{i}", time.perf_counter()))
        return out

    monkeypatch.setattr(kv, "layer", recorded)
    got = run_session(engine, loaded)
    assert got == recomputed
    kinds = [k for k, _ in events]
    assert kinds.count("read1") >= 1 and kinds.count("read1") == kinds.count("copy1-done")
    # Each layered copy: copy1-start, then the forward's read0 during the sleep, then copy1-done,
    # and only then read1.
    for n in range(kinds.count("read1")):
        start = [i for i, k in enumerate(kinds) if k == "copy1-start"][n]
        done = [i for i, k in enumerate(kinds) if k == "copy1-done"][n]
        read0 = [i for i, k in enumerate(kinds) if k == "read0"][n]
        read1 = [i for i, k in enumerate(kinds) if k == "read1"][n]
        assert start < read0 < done < read1, kinds
        assert events[read1][1] >= events[done][1]


def test_an_imports_per_layer_writes_equal_its_chunk_write() -> None:
    layout = KVLayout.hybrid(
        (None, 6, 6, None), full_kv_heads=2, window_kv_heads=4, head_dim=8, v_head_dim=6, dtype_bytes=4
    )
    page = 4
    src = PagedKVCache(layout, page, group_pages=16)
    gen = torch.Generator().manual_seed(3)
    for i in range(layout.num_layers):
        lk = src.layer_storage(i)
        lk.k.copy_(torch.randn(lk.k.shape, generator=gen))
        lk.v.copy_(torch.randn(lk.v.shape, generator=gen))
    plan = LayerPlan(layout, page, 22)
    rows = list(range(6))
    payload = read(bytearray(pack(plan, src, [rows, rows]).numpy().tobytes()), layout, page, torch.float32)
    imp = KVImport(payload, first_token=7, nbytes=0, seconds=0.0)
    dst_rows = [9, 3, 5, 0, 12, 7]
    whole, layered = PagedKVCache(layout, page, group_pages=16), PagedKVCache(layout, page, group_pages=16)
    for lo, hi in ((0, 9), (9, 22)):  # two chunks, the second reaching the window pages
        imp.write(whole, [dst_rows, dst_rows], lo, hi)
        for i in range(layout.num_layers):
            imp.write_layer(layered, i, [dst_rows, dst_rows], lo, hi)
    for i in range(layout.num_layers):
        a, b = whole.layer_storage(i), layered.layer_storage(i)
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert any(whole.layer_storage(i).k.abs().sum() > 0 for i in range(layout.num_layers))


class RecordingSource:
    """A ``KVSource`` that writes nothing: records the layers asked for, fails at ``fail_at``."""

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.layers: list[int] = []
        self.fail_at, self.delay_s = fail_at, delay_s

    start, end, first_token = 0, 8, None

    def write(self, kv: PagedKVCache, rows: PageRows, lo: int, hi: int) -> None:
        for i in range(kv.num_layers):
            self.write_layer(kv, i, rows, lo, hi)

    def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
        time.sleep(self.delay_s)
        if layer == self.fail_at:
            raise ValueError(f"layer {layer} lost")
        self.layers.append(layer)


def small_kv() -> PagedKVCache:
    return PagedKVCache(
        KVLayout.hybrid((None, 6, 6, None, 6), full_kv_heads=2, window_kv_heads=4, head_dim=8, v_head_dim=8),
        4,
        group_pages=4,
    )


def test_a_failed_copy_fails_the_forward_with_its_error_and_clears_the_gate() -> None:
    kv = small_kv()
    src = RecordingSource(fail_at=2)
    copy = LayeredCopy(kv, [CopyJob(src, [[0, 1], [0, 1]], 0, 8)])
    with pytest.raises(ValueError, match="layer 2 lost") as info, copy:
        for i in range(kv.num_layers):
            kv.layer(i)  # the forward: layer 2 never opens
    assert isinstance(info.value.__context__, LayerCopyFailed)  # what the forward saw
    assert src.layers == [0, 1] and kv.gate is None
    kv.layer(3)  # no gate: never blocks


def test_a_failed_forward_stops_the_copy_and_keeps_its_own_error() -> None:
    kv = small_kv()
    src = RecordingSource(delay_s=0.05)
    jobs = [CopyJob(src, [[0, 1], [0, 1]], 0, 8), CopyJob(src, [[2, 3], [2, 3]], 0, 8)]
    with pytest.raises(RuntimeError, match="forward"), LayeredCopy(kv, jobs):
        kv.layer(0)
        raise RuntimeError("forward failed")
    assert kv.gate is None
    assert src.layers[:2] == [0, 0] and len(src.layers) < 2 * kv.num_layers  # layer-major, cut short
