"""EncodeBatcher: batched equals alone, budget and wait policy, failure isolation, back-pressure."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from encoder.models.checkpoint import random_encoder
from encoder.models.config import VisionConfig
from encoder.models.tower import VisionTransformer
from encoder.serving.batcher import BatcherStats, EncodeBatcher, EncodeResult, QueueFull
from media_io.preprocess import Patches

CFG = VisionConfig(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
    window_size=56, fullatt_block_indexes=(1,),
)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> VisionTransformer:
    return random_encoder(CFG, seed=11)


def patches(grid: tuple[int, int, int], seed: int) -> Patches:
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    return Patches(torch.randn(t * h * w, 1176, generator=gen), grid)


def alone(model: VisionTransformer, p: Patches) -> torch.Tensor:
    with torch.inference_mode():
        return model(p.pixel_values, torch.tensor([p.grid_thw]))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_batched_equals_alone_images_and_video(model: VisionTransformer) -> None:
    items = [patches((1, 8, 12), 0), patches((3, 4, 6), 1), patches((1, 6, 10), 2), patches((2, 4, 4), 3)]

    async def run() -> list:
        async with EncodeBatcher(model, patch_budget=4096, max_wait_ms=200) as b:
            return await asyncio.gather(*(b.encode_timed(p) for p in items))

    results = asyncio.run(run())
    assert [r.batch_items for r in results] == [4, 4, 4, 4]
    for r, p in zip(results, items, strict=True):
        ref = alone(model, p)
        assert r.embedding.shape == ref.shape == (p.pixel_values.shape[0] // 4, 16)
        assert rel_err(r.embedding, ref) <= 1e-5


def test_budget_splits_batches_in_order(model: VisionTransformer) -> None:
    items = [patches((1, 8, 8), i) for i in range(5)]  # 64 patches each

    async def run() -> tuple[list[EncodeResult], BatcherStats]:
        async with EncodeBatcher(model, patch_budget=128, max_wait_ms=100) as b:
            res = await asyncio.gather(*(b.encode_timed(p) for p in items))
            return res, b.stats()

    results, stats = asyncio.run(run())
    assert [r.batch_items for r in results] == [2, 2, 2, 2, 1]
    assert stats.batches == 3 and stats.items == 5 and stats.patches == 320
    assert stats.queue_items == 0 and stats.queue_patches == 0
    for r, p in zip(results, items, strict=True):
        assert rel_err(r.embedding, alone(model, p)) <= 1e-5


def test_oversized_item_runs_alone(model: VisionTransformer) -> None:
    big, small = patches((1, 16, 16), 0), patches((1, 4, 4), 1)

    async def run() -> list:
        async with EncodeBatcher(model, patch_budget=64, max_wait_ms=50) as b:
            return list(await asyncio.gather(b.encode_timed(big), b.encode_timed(small)))

    r_big, r_small = asyncio.run(run())
    assert r_big.batch_items == 1 and r_small.batch_items == 1
    assert rel_err(r_big.embedding, alone(model, big)) <= 1e-5


def test_full_budget_does_not_wait(model: VisionTransformer) -> None:
    async def run() -> float:
        async with EncodeBatcher(model, patch_budget=64, max_wait_ms=5000) as b:
            t0 = time.perf_counter()
            await b.encode(patches((1, 8, 8), 0))  # exactly one budget
            return time.perf_counter() - t0

    assert asyncio.run(run()) < 2.0


def test_lone_item_waits_at_most_max_wait(model: VisionTransformer) -> None:
    async def run() -> float:
        async with EncodeBatcher(model, patch_budget=10_000, max_wait_ms=50) as b:
            return (await b.encode_timed(patches((1, 4, 4), 0))).queue_ms

    queue_ms = asyncio.run(run())
    assert 40 <= queue_ms < 2000


def test_failing_item_fails_only_itself(model: VisionTransformer) -> None:
    good = [patches((1, 4, 4), 0), patches((2, 4, 4), 1)]
    # A tensor with no data: passes the shape checks, fails inside the forward (real failure, no mock).
    bad = Patches(torch.empty(16, 1176, device="meta"), (1, 4, 4))

    async def run() -> tuple[list[Any], BatcherStats]:
        async with EncodeBatcher(model, patch_budget=4096, max_wait_ms=200) as b:
            res = await asyncio.gather(
                b.encode_timed(good[0]), b.encode_timed(bad), b.encode_timed(good[1]), return_exceptions=True
            )
            after = await b.encode(good[0])  # the batcher survives
            return [*res, after], b.stats()

    (r0, r_bad, r1, after), stats = asyncio.run(run())
    assert isinstance(r_bad, Exception)
    assert r0.batch_items == 3 and r1.batch_items == 3
    assert rel_err(r0.embedding, alone(model, good[0])) <= 1e-5
    assert rel_err(r1.embedding, alone(model, good[1])) <= 1e-5
    assert torch.equal(after, r0.embedding) or rel_err(after, r0.embedding) <= 1e-5
    assert stats.failed_items == 1 and stats.retried_batches == 1


def test_bad_shapes_rejected_before_queueing(model: VisionTransformer) -> None:
    async def run() -> None:
        async with EncodeBatcher(model) as b:
            with pytest.raises(ValueError, match="does not match grid_thw"):
                await b.encode(Patches(torch.zeros(15, 1176), (1, 4, 4)))
            with pytest.raises(ValueError, match="whole merge groups"):
                await b.encode(Patches(torch.zeros(12, 1176), (1, 3, 4)))
            assert b.stats().queue_items == 0

    asyncio.run(run())


def test_queue_full_and_stop_fails_pending(model: VisionTransformer) -> None:
    async def run() -> None:
        b = EncodeBatcher(model, patch_budget=64, max_wait_ms=10_000, max_queue_patches=40)
        await b.start()
        first = asyncio.ensure_future(b.encode(patches((1, 4, 4), 0)))  # 16 patches, waits for companions
        second = asyncio.ensure_future(b.encode(patches((1, 4, 4), 1)))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="32 patches queued"):
            await b.encode(patches((1, 4, 4), 2))
        await b.stop()
        for f in (first, second):
            with pytest.raises(RuntimeError, match="stopped"):
                await f

    asyncio.run(run())


def test_event_loop_stays_responsive_during_forward(model: VisionTransformer) -> None:
    async def run() -> tuple[float, float]:
        async with EncodeBatcher(model, patch_budget=100_000, max_wait_ms=0) as b:
            gaps: list[float] = []
            done = False

            async def ticker() -> None:
                last = time.perf_counter()
                while not done:
                    await asyncio.sleep(0.002)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            await b.encode(patches((4, 32, 32), 0))  # 4096 patches: a forward of many ms
            elapsed = time.perf_counter() - t0
            done = True
            await tick
            return max(gaps), elapsed

    max_gap, elapsed = asyncio.run(run())
    assert max_gap < max(0.5 * elapsed, 0.05), (max_gap, elapsed)


def test_streams_take_fair_shares_of_the_queue(model: VisionTransformer) -> None:
    items = [patches((1, 8, 8), i) for i in range(4)]  # 64 patches each, all queued at once

    async def run() -> tuple[list[EncodeResult], BatcherStats]:
        async with EncodeBatcher(model, patch_budget=4096, max_wait_ms=100, forward_streams=2) as b:
            res = await asyncio.gather(*(b.encode_timed(p) for p in items))
            return res, b.stats()

    results, stats = asyncio.run(run())
    # The budget would take all four; a free stream takes only half of the queue, so the other
    # stream gets the rest instead of idling.
    assert [r.batch_items for r in results] == [2, 2, 2, 2]
    assert stats.batches == 2 and stats.items == 4 and stats.queue_items == 0
    for r, p in zip(results, items, strict=True):
        assert rel_err(r.embedding, alone(model, p)) <= 1e-5


@pytest.mark.parametrize("streams", [1, 2])
def test_second_stream_does_not_wait_for_the_first_forward(model: VisionTransformer, streams: int) -> None:
    big = [patches((4, 32, 32), i) for i in range(2)]  # 4096 patches each: one budget apiece

    async def run() -> list:
        async with EncodeBatcher(model, patch_budget=4096, max_wait_ms=0, forward_streams=streams) as b:
            return await asyncio.gather(*(b.encode_timed(p) for p in big))

    first, second = asyncio.run(run())
    assert first.batch_items == second.batch_items == 1
    if streams == 1:  # queued behind the first item's forward
        assert second.queue_ms >= 0.8 * first.forward_ms
    else:  # dispatched to the free stream at once
        assert second.queue_ms < 0.5 * first.forward_ms
    for r, p in zip((first, second), big, strict=True):
        assert rel_err(r.embedding, alone(model, p)) <= 1e-5


def test_stop_fails_items_of_every_running_stream(model: VisionTransformer) -> None:
    async def run() -> list:
        b = EncodeBatcher(model, patch_budget=4096, max_wait_ms=0, forward_streams=2)
        await b.start()
        futs = [asyncio.ensure_future(b.encode(patches((4, 32, 32), i))) for i in range(3)]
        await asyncio.sleep(0.02)  # two forwards running, one item queued
        await b.stop()
        return await asyncio.gather(*futs, return_exceptions=True)

    outs = asyncio.run(run())
    assert len(outs) == 3
    for out in outs:  # finished before the stop, or failed cleanly; never left hanging
        assert isinstance(out, torch.Tensor) or (isinstance(out, RuntimeError) and "stopped" in str(out))


@pytest.mark.parametrize("streams", [1, 2])
def test_video_larger_than_the_budget_splits_by_frames(model: VisionTransformer, streams: int) -> None:
    video = patches((5, 8, 8), 7)  # 5 temporal frames of 64 patches
    image = patches((1, 4, 4), 8)

    async def run() -> tuple[list[EncodeResult], BatcherStats]:
        async with EncodeBatcher(model, patch_budget=128, max_wait_ms=50, forward_streams=streams) as b:
            res = await asyncio.gather(b.encode_timed(video), b.encode_timed(image))
            return list(res), b.stats()

    (r_video, r_image), stats = asyncio.run(run())
    # Parts of 2 + 2 + 1 frames, never more than the budget in one forward; the image rides along.
    assert stats.items == 4 and stats.patches == 5 * 64 + 16
    assert r_video.embedding.shape == (5 * 64 // 4, 16)
    assert rel_err(r_video.embedding, alone(model, video)) <= 1e-5
    assert rel_err(r_image.embedding, alone(model, image)) <= 1e-5
    assert r_video.forward_ms > 0
