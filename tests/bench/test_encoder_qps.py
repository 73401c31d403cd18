"""The encoder QPS benchmark's parts: fresh-bytes media variants, the load generator's two modes
against a real loopback HTTP server, batch packing for the ceiling, the summary arithmetic, and
a ``--quick`` smoke run of the whole benchmark (baseline and `epd serve` as subprocesses)."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from bench import report
from bench.ceiling import Ceiling, measure, pack
from bench.loadgen import (
    LoadResult,
    Outcome,
    closed_loop,
    merge_results,
    new_session,
    open_loop,
    poisson_schedule,
)
from bench.media_corpus import image_corpus, unique_variant
from bench.qps_summary import interleaved_ceiling, summarize
from media_io.sniff import sniff
from tests.fixtures.video_factory import make_clip

# -- media ------------------------------------------------------------------------------------------


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_jpeg_variants_are_new_bytes_with_identical_pixels(tmp_path: Path) -> None:
    (item,) = image_corpus(tmp_path, ((96, 64),), seed=3)
    a, b = unique_variant(item.data, "run-1"), unique_variant(item.data, "run-2")
    assert len({item.data, a, b}) == 3
    assert sniff(a).format == sniff(item.data).format == "jpeg"
    np.testing.assert_array_equal(_pixels(a), _pixels(item.data))
    np.testing.assert_array_equal(_pixels(b), _pixels(item.data))
    # Cached: a second call reads the same bytes back instead of generating again.
    assert image_corpus(tmp_path, ((96, 64),), seed=3)[0].data == item.data


def _frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), mode="r") as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_mp4_variants_are_new_bytes_with_identical_frames() -> None:
    clip = make_clip(64, 48, fps=8.0, seconds=1.0)
    variant = unique_variant(clip, "nonce-7")
    assert variant != clip and variant.startswith(clip)
    assert sniff(variant).modality == "video"
    got, want = _frames(variant), _frames(clip)
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_variant_refuses_formats_it_cannot_rewrite() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    with pytest.raises(ValueError, match="JPEG or MP4"):
        unique_variant(buf.getvalue(), "x")


# -- load generator ---------------------------------------------------------------------------------


class _Server:
    """A real aiohttp server on loopback that sleeps ``delay_s`` per request and counts concurrency."""

    def __init__(self, delay_s: float, fail_every: int = 0) -> None:
        self.delay_s = delay_s
        self.fail_every = fail_every
        self.active = 0
        self.max_active = 0
        self.seen: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body["items"][0]["url"])
        arrival = len(self.seen)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        if self.fail_every and arrival % self.fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=503)
        item = {"cache_hit": body["items"][0]["url"].endswith("hot"), "timings_ms": {"forward": 1.5}}
        return web.json_response({"data": [item]})

    async def __aenter__(self) -> _Server:
        app = web.Application()
        app.router.add_post("/v1/encode", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1/encode"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _body(i: int) -> dict[str, Any]:
    return {"items": [{"url": f"http://media/{i}" + ("-hot" if i % 2 else "")}]}


def test_closed_loop_holds_exactly_the_concurrency_and_sends_each_request_once() -> None:
    async def run() -> tuple[LoadResult, _Server]:
        async with _Server(delay_s=0.03) as server, new_session() as session:
            done: list[int] = []
            result = await closed_loop(
                session, server.url, _body, concurrency=3, requests=12, on_done=lambda: done.append(1)
            )
            assert len(done) == 12
            return result, server

    result, server = asyncio.run(run())
    assert server.max_active == 3
    assert sorted(server.seen) == sorted(_body(i)["items"][0]["url"] for i in range(12))
    assert [o.seq for o in result.outcomes] == list(range(12))
    assert result.errors == 0 and len(result.ok) == 12
    assert all(o.latency_s >= 0.03 for o in result.outcomes)
    assert [o.cache_hit for o in result.outcomes] == [bool(i % 2) for i in range(12)]
    assert result.outcomes[0].server_ms == {"forward": 1.5}
    # 12 requests, 3 at a time, 30 ms each: at least 4 rounds of wall time.
    assert result.wall_s >= 4 * 0.03
    assert result.qps == pytest.approx(12 / result.wall_s)


def test_open_loop_does_not_wait_for_answers_and_counts_failures() -> None:
    async def run() -> tuple[LoadResult, _Server]:
        async with _Server(delay_s=0.3, fail_every=5) as server, new_session() as session:
            return await open_loop(session, server.url, _body, rate=40.0, requests=10, seed=1), server

    t0 = time.perf_counter()
    result, server = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    # Ten 300 ms requests one after another would take 3 s; sent on schedule they overlap.
    assert elapsed < 2.0
    assert server.max_active > 1
    assert result.errors == 2 and len(result.ok) == 8
    assert all(o.status == 503 and "boom" in (o.error or "") for o in result.outcomes if not o.ok)
    schedule = poisson_schedule(40.0, 10, seed=1)
    for o, at in zip(result.outcomes, schedule, strict=True):
        assert o.start_s >= at - 1e-3  # never sent early


def test_poisson_schedule_is_seeded_increasing_with_the_right_mean_gap() -> None:
    times = poisson_schedule(50.0, 4000, seed=7)
    assert times == poisson_schedule(50.0, 4000, seed=7)
    assert times != poisson_schedule(50.0, 4000, seed=8)
    assert times[0] == 0.0
    gaps = np.diff(times)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.06)
    # Exponential gaps: standard deviation equals the mean.
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_schedule(0.0, 3, seed=0)


# -- ceiling packing and summary --------------------------------------------------------------------


def test_pack_keeps_order_and_respects_the_budget() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 5000) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 9000)
        batches = pack(sizes, budget)
        assert [i for b in batches for i in b] == list(range(len(sizes)))
        for b in batches:
            assert len(b) == 1 or sum(sizes[i] for i in b) <= budget
        for b, nxt in itertools.pairwise(batches):  # greedy: the next item did not fit
            assert sum(sizes[i] for i in b) + sizes[nxt[0]] > budget


def _result(latencies: list[float], mode: str = "closed", hit: bool = False) -> LoadResult:
    outs = [Outcome(i, 0.1 * i, 0.1 * i + lat, 200, hit, None, {}) for i, lat in enumerate(latencies)]
    return LoadResult(mode, 4.0, outs, max(o.end_s for o in outs))


def test_summary_ratios_come_from_the_matching_runs() -> None:
    base = _result([1.0] * 10)
    ours = _result([0.5] * 30)
    hot = _result([0.01] * 30, hit=True)
    runs = [
        report.Run("baseline", "cold", base, service_cpu_s=4.0),
        report.Run("ours", "cold", ours, service_cpu_s=6.0),
        report.Run("ours", "hot", hot),
    ]
    records = [report.record(r) for r in runs]
    assert records[0]["latency_ms"]["p90"] == pytest.approx(1000.0)
    assert records[2]["cache_hit_rate"] == 1.0
    ceiling = type("C", (), {"images_per_s": ours.qps * 2, "cpu_ms_per_image": 150.0})()
    s = summarize(records, ceiling)
    assert s["qps_ratio"] == pytest.approx(ours.qps / base.qps)
    assert s["p90_ratio"] == pytest.approx(0.5)
    assert s["ceiling_fraction"] == pytest.approx(0.5)
    assert s["ceiling_over_baseline_qps"] == pytest.approx(2 * ours.qps / base.qps)
    assert s["baseline_cpu_ms_per_request"] == pytest.approx(400.0)  # 4 s over 10 requests
    assert s["ours_cpu_ms_per_request"] == pytest.approx(200.0)
    assert s["cpu_fraction"] == pytest.approx(0.75)
    assert records[2]["service_cpu_ms_per_request"] is None
    assert s["hot_hit_rate"] == 1.0
    assert s["targets_met"]["p90_ratio<=1"] and not s["targets_met"]["ceiling_fraction>=0.8"]
    assert s["errors"] == 0 and s["video_qps"] is None


def test_ceiling_streams_share_the_corpus_and_restore_threads() -> None:
    import torch

    from encoder.models.checkpoint import random_encoder
    from encoder.models.config import VisionConfig
    from media_io.preprocess import Patches

    cfg = VisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
        window_size=56, fullatt_block_indexes=(1,),
    )  # fmt: skip
    model = random_encoder(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    items = [
        Patches(torch.randn(h * w, 1176, generator=gen), (1, h, w)) for h, w in ((8, 8), (4, 12), (6, 6))
    ]
    threads = torch.get_num_threads()
    c = measure(model, items, patch_budget=100, min_seconds=0.2, streams=2, threads=1)
    assert torch.get_num_threads() == threads
    assert (c.streams, c.threads, c.patch_budget) == (2, 1, 100)
    assert c.images > 0 and c.seconds >= 0.2 and c.cpu_s > 0
    assert c.images_per_s == pytest.approx(c.images / c.seconds)
    # Whole batches only: every image counted came with its batch (sizes 64 | 48 | 36 at budget 100).
    assert c.patches_per_s / c.images_per_s == pytest.approx((64 + 48 + 36) / 3, rel=0.2)
    with pytest.raises(ValueError, match="streams"):
        measure(model, items, patch_budget=100, min_seconds=0.1, streams=0)


def test_interleaved_ceiling_is_the_mean_of_each_points_best() -> None:
    def c(rate: float, streams: int, cpu_s: float) -> Ceiling:
        return Ceiling(rate, rate * 1000, 10, 1.0, 4096, streams, 2 // streams, cpu_s)

    got = interleaved_ceiling([[c(8.0, 2, 2.0), c(6.0, 1, 2.5)], [c(5.0, 1, 1.8), c(7.0, 2, 2.2)]])
    assert got is not None and got.points == 2 and got.images_per_s == pytest.approx(7.5)
    assert got.cpu_ms_per_image == pytest.approx(180.0)  # the cheapest run: 1.8 s over 10 images
    assert interleaved_ceiling([]) is None


# -- smoke ------------------------------------------------------------------------------------------


@pytest.mark.slow  # three processes import torch: ~30 s on an idle 2-core machine
@pytest.mark.timeout(300)
def test_quick_run_writes_summary_json_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.encoder_qps import main

    monkeypatch.setenv("EPD_HOME", str(tmp_path / "home"))
    out = tmp_path / "qps.json"
    rc = main(
        ["--quick", "--no-ceiling", "--video-clips", "0", "--json", str(out), "--log-dir", str(tmp_path)]
    )
    doc = json.loads(out.read_text())
    assert rc == 0, doc["results"]
    s = doc["summary"]
    assert s["errors"] == 0
    assert s["baseline_qps"] > 0 and s["ours_qps"] > 0 and s["qps_ratio"] > 0
    assert s["hot_hit_rate"] == 1.0  # the cold URLs again: all node-cache hits
    phases = {(r["service"], r["phase"], r["mode"]) for r in doc["results"]}
    assert ("baseline", "cold", "open") in phases and ("ours", "cold", "open") in phases
    assert out.with_suffix(".png").stat().st_size > 0


def test_stage_table_reports_medians_per_run() -> None:
    outs = [Outcome(i, 0.0, 1.0, 200, False, None, {"forward": float(i), "decode": 2.0}) for i in range(5)]
    rec = report.record(report.Run("ours", "cold", LoadResult("closed", 2.0, outs, 1.0)))
    names, rows = report.stage_table([rec])
    assert names == ["decode", "forward"]
    assert rows == [["ours cold closed", 2.0, 2.0]]


def test_merged_rounds_add_walls_and_keep_every_outcome_in_order() -> None:
    a = LoadResult("closed", 2.0, [Outcome(i, 5.0 + i, 6.0 + i, 200, False, None, {}) for i in range(3)], 3.0)
    b = LoadResult("closed", 2.0, [Outcome(i, 1.0 + i, 1.5 + i, 200, False, None, {}) for i in range(2)], 1.5)
    m = merge_results([a, b])
    assert m.wall_s == 4.5 and m.qps == pytest.approx(5 / 4.5)
    assert [o.seq for o in m.outcomes] == list(range(5))
    assert sorted(m.latencies_s()) == sorted(a.latencies_s() + b.latencies_s())
    assert m.outcomes[0].start_s == 0.0 and m.outcomes[3].start_s == 3.0  # b starts where a's wall ended
    with pytest.raises(AssertionError):
        merge_results([a, LoadResult("open", 2.0, a.outcomes, 3.0)])


def test_tree_cpu_seconds_counts_children() -> None:
    import os
    import signal
    import subprocess
    import sys

    from bench.service_proc import tree_cpu_seconds

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    spin = [sys.executable, "-c", busy]
    # A parent that starts a spinning child and then waits: the child's CPU counts for the parent.
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess; subprocess.run({spin!r})"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        got = 0.0
        while time.monotonic() < deadline and got < 0.3:
            time.sleep(0.1)
            got = tree_cpu_seconds(parent.pid) or 0.0
        assert got >= 0.3
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # parent and child: their own process group
        parent.wait()
    assert tree_cpu_seconds(parent.pid) is None


@pytest.mark.slow  # three processes import torch, and a ceiling: ~40 s on an idle 2-core machine
@pytest.mark.timeout(300)
def test_pipeline_bound_run_uses_the_small_tower_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.encoder_qps import main

    monkeypatch.setenv("EPD_HOME", str(tmp_path / "home"))
    out = tmp_path / "qps.json"
    rc = main(
        ["--quick", "--pipeline-bound", "--no-open", "--video-clips", "0", "--json", str(out), "--log-dir", str(tmp_path)]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0, doc["results"]
    s = doc["summary"]
    assert s["pipeline_bound"] is True and s["errors"] == 0
    assert 0 < s["forward_fraction"] < 1
    assert set(s["targets_met"]) == {"qps_ratio>=2", "p90_ratio<=0.82", "forward_fraction<=0.2"}
    assert "encoder-pipeline-" in doc["config"]["encoder_model"]


def test_both_services_are_started_on_the_given_tower(tmp_path: Path) -> None:
    from bench.qps_run import _baseline_process, _ours_process

    tower = tmp_path / "tower"
    base = _baseline_process(tmp_path, tower).cmd
    ours = _ours_process(tmp_path, "ns", [], tower).cmd
    assert base[base.index("--model") + 1] == str(tower)
    assert ours[ours.index("--encoder-model") + 1] == str(tower)
    assert "--model" not in _baseline_process(tmp_path, None).cmd
    assert "--encoder-model" not in _ours_process(tmp_path, "ns", [], None).cmd


def test_the_pipeline_tower_is_a_real_checkpoint_a_fifth_of_the_default() -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from bench.pipeline_tower import ensure_pipeline_tower
    from encoder.models.checkpoint import load_encoder

    small, default = load_encoder(str(ensure_pipeline_tower())), load_encoder(None)
    assert small.config.out_hidden_size == default.config.out_hidden_size
    grid = torch.tensor([[1, 32, 32]])  # a 448x448 image: 1024 patches
    pixels = torch.randn(1024, 3 * 2 * 14 * 14)
    flops = []
    for m in (small.model, default.model):
        with torch.inference_mode(), FlopCounterMode(display=False) as count:
            out = m(pixels, grid)
        assert out.shape == (256, 256)  # 2x2 merge: 256 rows of the LLM width
        flops.append(count.get_total_flops())
    assert flops[0] * 5 < flops[1], flops  # ~0.12 vs ~0.66 GFLOP
