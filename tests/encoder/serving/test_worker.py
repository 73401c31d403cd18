"""The encoder worker served by uvicorn on a unix socket: encode, cache hits, errors, reads, health."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from safetensors.torch import load as load_safetensors

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.media_key import media_key
from encoder.models.checkpoint import load_encoder, random_encoder, save_vision_checkpoint
from encoder.models.config import VisionConfig
from encoder.serving.worker import WorkerConfig, plan_workers
from encoder.serving.worker_app import EncoderWorker, build_app, serving_fingerprint
from media_io.config import MediaLimits
from media_io.image import decode_image
from media_io.preprocess import get_backend
from media_io.video import decode_video
from tests.fixtures.video_factory import make_clip
from tests.uvicorn_thread import serve_in_thread

CFG = VisionConfig(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
    window_size=56, fullatt_block_indexes=(1,),
)  # fmt: skip


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.ones((height, 1, 3), np.float32)
    pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


class Served:
    def __init__(self, config: WorkerConfig, sock: str) -> None:
        self.config = config
        self.sock = sock

    def request(
        self, method: str, path: str, data: bytes | None = None, **params: str
    ) -> tuple[int, Any, dict]:
        async def go() -> tuple[int, Any, dict]:
            async with (
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.sock)) as s,
                s.request(method, f"http://worker{path}", data=data, params=params) as r,
            ):
                body = await r.read()
                ctype = r.headers.get("content-type", "")
                return r.status, json.loads(body) if "json" in ctype else body, dict(r.headers)

        return asyncio.run(go())


@contextlib.contextmanager
def _serving(config: WorkerConfig) -> Iterator[Served]:
    """The worker app of ``config`` served on its unix socket in a thread, until the block ends."""
    assert config.uds is not None
    with serve_in_thread(uvicorn.Config(build_app(config), uds=config.uds, log_level="warning"), "worker"):
        yield Served(config, config.uds)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("worker")
    save_vision_checkpoint(random_encoder(CFG, seed=21), root / "ckpt")
    sock = str(root / "w.sock")
    config = WorkerConfig(
        uds=sock,
        model_path=str(root / "ckpt"),
        cache_root=str(root / "cache"),
        cache_namespace="test",
        public_url="http://encoder-7:8001",
        max_wait_ms=20.0,
        patch_budget=4096,
        limits=MediaLimits(max_bytes=1 << 20),
    )
    with _serving(config) as served:
        yield served


def direct_embedding(served: Served, patches: Any) -> torch.Tensor:
    model = load_encoder(served.config.model_path).model
    with torch.inference_mode():
        return model(patches.pixel_values, torch.tensor([patches.grid_thw]))


def test_image_miss_then_hit_matches_direct_pipeline(served: Served) -> None:
    data = png(168, 112, seed=1)
    status, body, _ = served.request("POST", "/encode", data, modality="image", item="photo.png")
    assert status == 200, body
    ref = body["ref"]
    fingerprint = serving_fingerprint(load_encoder(served.config.model_path).fingerprint, "cpu")
    assert ref["key"] == media_key(data, "image", served.config.preprocess, fingerprint)
    assert ref["grid_thw"] == [[1, 8, 12]] and ref["shape"] == [24, 16] and ref["modality"] == "image"
    assert ref["url"] == f"http://encoder-7:8001/embeddings/{ref['key']}"
    assert body["cache_hit"] is False
    assert set(body["timings_ms"]) == {"decode", "preprocess", "queue", "forward"}
    assert body["timings_ms"]["forward"] > 0

    status, again, _ = served.request("POST", "/encode", data)  # modality sniffed
    assert status == 200 and again["cache_hit"] is True and again["ref"] == ref

    cache = EmbedCache("test", root=served.config.cache_root)
    cached = cache.get(ref["key"])
    assert cached is not None and cached.ref.grid_thw == ((1, 8, 12),)
    patches = get_backend("cpu").image(decode_image(data))
    expected = direct_embedding(served, patches)
    torch.testing.assert_close(cached.tensor, expected, rtol=1e-5, atol=1e-6)

    status, raw, _ = served.request("GET", f"/embeddings/{ref['key']}")
    assert status == 200
    torch.testing.assert_close(load_safetensors(raw)["embedding"], cached.tensor, rtol=0, atol=0)


def test_video_item(served: Served) -> None:
    data = make_clip(width=64, height=48, fps=4.0, seconds=2.0)
    status, body, _ = served.request("POST", "/encode", data, modality="video", item="clip.mp4")
    assert status == 200, body
    t, h, w = body["ref"]["grid_thw"][0]
    assert t >= 2 and body["ref"]["modality"] == "video" and body["ref"]["shape"] == [t * h * w // 4, 16]
    frames = decode_video(data, served.config.preprocess, workers=1)
    expected = direct_embedding(served, get_backend("cpu").video(frames.frames))
    cached = EmbedCache("test", root=served.config.cache_root).get(body["ref"]["key"])
    assert cached is not None
    torch.testing.assert_close(cached.tensor, expected, rtol=1e-5, atol=1e-6)


def test_concurrent_items_batch_and_stay_correct(served: Served) -> None:
    items = [png(112 + 28 * i, 84, seed=10 + i) for i in range(4)]

    async def go() -> list[dict]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=served.sock)) as s:

            async def one(i: int, data: bytes) -> dict:
                async with s.post("http://worker/encode", data=data, params={"item": f"img{i}"}) as r:
                    assert r.status == 200
                    return await r.json()

            return await asyncio.gather(*(one(i, d) for i, d in enumerate(items)))

    bodies = asyncio.run(go())
    cache = EmbedCache("test", root=served.config.cache_root)
    for data, body in zip(items, bodies, strict=True):
        expected = direct_embedding(served, get_backend("cpu").image(decode_image(data)))
        cached = cache.get(body["ref"]["key"])
        assert cached is not None
        torch.testing.assert_close(cached.tensor, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("data", "params", "status", "kind", "text"),
    [
        (b"<!doctype html><html>nope</html>", {"item": "page.html"}, 415, "unsupported_media_type", ""),
        (b"", {"item": "empty"}, 400, "bad_media", "empty"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {"item": "trunc.png"}, 400, "bad_media", ""),
        (b"\x89PNG\r\n\x1a\n", {"item": "x", "modality": "video"}, 400, "bad_media", "sent as video"),
        (b"\x89PNG\r\n\x1a\n", {"item": "x", "modality": "text"}, 400, "invalid_request", "modality"),
    ],
)
def test_bad_media_fails_alone_with_named_error(
    served: Served, data: bytes, params: dict, status: int, kind: str, text: str
) -> None:
    got, body, _ = served.request("POST", "/encode", data, **params)
    assert got == status, body
    assert body["error"]["type"] == kind
    assert text in body["error"]["message"]
    assert body["error"]["param"] in (params.get("item"), "modality")
    ok, _, _ = served.request("POST", "/encode", png(56, 56, seed=99))  # the worker still serves
    assert ok == 200


def test_oversized_body_refused(served: Served) -> None:
    status, body, _ = served.request(
        "POST", "/encode", b"\x89PNG\r\n\x1a\n" + bytes(2 << 20), item="huge.png"
    )
    assert status == 413 and body["error"]["type"] == "media_too_large"
    assert str(2 << 20) in body["error"]["message"] or "exceeds" in body["error"]["message"]


def test_embeddings_route_errors(served: Served) -> None:
    status, body, _ = served.request("GET", "/embeddings/" + "0" * 64)
    assert status == 404 and body["error"]["type"] == "not_found"
    status, body, _ = served.request("GET", "/embeddings/bad.key")
    assert status == 400 and body["error"]["param"] == "key"


def test_audio_is_recognized_and_refused_by_a_vision_encoder(served: Served) -> None:
    from tests.media_io.audio_files import encode, tone

    wav = encode(tone(0.5, 8000, (440.0,)), 8000, "wav")
    status, body, _ = served.request("POST", "/encode", wav, item="clip.wav")
    assert status == 415 and body["error"]["param"] == "clip.wav"
    assert "audio (wav)" in body["error"]["message"]


def test_error_bodies_have_the_shared_shape(served: Served) -> None:
    # the same {"type", "message", "param", "code"} body as every other role's errors
    status, body, _ = served.request("GET", "/embeddings/" + "0" * 64)
    assert status == 404 and set(body["error"]) == {"type", "message", "param", "code"}
    assert body["error"]["code"] == 404


def test_a_node_cache_held_by_leases_is_a_retryable_503_saying_what_the_entry_needs(served: Served) -> None:
    root = served.config.cache_root
    assert served.request("POST", "/encode", png(56, 56, seed=70))[0] == 200
    cache = EmbedCache("test", root=root)
    before = cache.capacity_bytes
    try:
        # another request holds everything cached, and nothing else fits
        with cache.lease([m.key for m in cache.entries()], ttl_s=60):
            EmbedCache("test", capacity_bytes=cache.stats().used_bytes, root=root).close()
            status, body, headers = served.request("POST", "/encode", png(56, 56, seed=71), item="new.png")
            assert status == 503, body
            assert (body["error"]["type"], body["error"]["param"]) == ("cache_full", "new.png")
            assert "leased by requests in flight" in body["error"]["message"]
            lower = {k.lower(): v for k, v in headers.items()}
            assert int(lower["x-entry-bytes"]) > 0 and lower["retry-after"] == "1"
    finally:
        EmbedCache("test", capacity_bytes=before, root=root).close()
        cache.close()
    assert served.request("POST", "/encode", png(56, 56, seed=71))[0] == 200  # released: room again


def test_health_and_metrics(served: Served) -> None:
    status, health, _ = served.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["fingerprint"] == serving_fingerprint(
        load_encoder(served.config.model_path).fingerprint, "cpu"
    )
    assert health["queue_depth"] == 0 and health["out_hidden_size"] == 16
    served.request("POST", "/encode", png(56, 84, seed=5))
    status, text, _ = served.request("GET", "/metrics")
    assert status == 200
    metrics = text.decode()
    assert 'epd_encoder_requests_total{outcome="miss"}' in metrics
    assert 'epd_encoder_stage_seconds_bucket{le="0.001",stage="forward"}' in metrics


def test_plan_workers_divides_cpu_cores() -> None:
    base = WorkerConfig(port=9000, device="cpu")
    plans = plan_workers(base, cpu_workers=2)
    assert [p.port for p in plans] == [9000, 9001]
    assert all(p.torch_threads and p.torch_threads >= 1 for p in plans)
    assert all(p.forward_streams and p.forward_streams >= 1 for p in plans)
    socks = plan_workers(WorkerConfig(uds="/tmp/w.sock", device="cpu"), cpu_workers=2)
    assert [p.uds for p in socks] == ["/tmp/w.sock.0", "/tmp/w.sock.1"]
    with pytest.raises(ValueError, match="dtype"):
        WorkerConfig(dtype="int8")


def test_plan_workers_cpu_spends_cores_on_single_threaded_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("encoder.serving.worker.usable_cores", lambda: 8)
    (one,) = plan_workers(WorkerConfig(device="cpu"))
    assert (one.forward_streams, one.torch_threads) == (8, 1)
    halves = plan_workers(WorkerConfig(device="cpu"), cpu_workers=2)
    assert [(p.forward_streams, p.torch_threads) for p in halves] == [(4, 1), (4, 1)]
    (wide,) = plan_workers(WorkerConfig(device="cpu", torch_threads=4))
    assert (wide.forward_streams, wide.torch_threads) == (2, 4)
    (fixed,) = plan_workers(WorkerConfig(device="cpu", forward_streams=2))
    assert (fixed.forward_streams, fixed.torch_threads) == (2, 4)
    assert WorkerConfig(device="cpu").batch_budget() == 4096
    assert WorkerConfig(device="cpu", patch_budget=100).batch_budget() == 100
    with pytest.raises(ValueError, match="forward_streams"):
        WorkerConfig(forward_streams=0)


def _burst(sock: str, items: list[bytes]) -> list[tuple[int, dict, dict]]:
    async def go() -> list[tuple[int, dict, dict]]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock, limit=0)) as s:

            async def one(i: int, data: bytes) -> tuple[int, dict, dict]:
                async with s.post("http://worker/encode", data=data, params={"item": f"b{i}"}) as r:
                    return r.status, await r.json(), dict(r.headers)

            return await asyncio.gather(*(one(i, d) for i, d in enumerate(items)))

    return asyncio.run(go())


BURST = 150


def test_a_burst_the_worker_drains_in_time_is_taken_whole(tmp_path: Path) -> None:
    # 150 distinct uploads at once to a fresh worker (its rate measured on this burst alone: the
    # rate is items per second, and a module worker's earlier videos would set it): far past the
    # old fixed limit of 64 in flight, drained well within the 10 s deadline, so every one is served
    save_vision_checkpoint(random_encoder(CFG, seed=21), tmp_path / "ckpt")
    config = WorkerConfig(
        uds=str(tmp_path / "w.sock"), model_path=str(tmp_path / "ckpt"), cache_root=str(tmp_path / "cache"),
        cache_namespace="burst", patch_budget=4096,
    )  # fmt: skip
    items = [png(56, 56, seed=70_000 + i) for i in range(BURST)]
    with _serving(config) as worker:
        got = _burst(worker.sock, items)
        _, metrics, _ = worker.request("GET", "/metrics")
    assert [status for status, _, _ in got] == [200] * BURST, [b for s, b, _ in got if s != 200][:3]
    assert len({body["ref"]["key"] for _, body, _ in got}) == BURST
    assert b'epd_encoder_refusals_total{reason="wait"}' not in metrics
    peak = next(line for line in metrics.splitlines() if line.startswith(b"epd_encoder_inflight_peak_items "))
    assert float(peak.split()[1]) > 64  # more at once than the old fixed limit let in


SMALL_PATCHES = 16  # a 56x56 image: a 4x4 grid of 14-pixel patches


@pytest.fixture()
def slow_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A worker that believes it serves 16 patches (one 56x56 image) per second and may let an item
    be done in 2.5 s: one small item ahead fits, two do not. Its batcher holds a lone item for
    1 s, so a request sent right after another finds it in flight."""
    root = tmp_path_factory.mktemp("slow-worker")
    save_vision_checkpoint(random_encoder(CFG, seed=21), root / "ckpt")
    sock = str(root / "w.sock")
    config = WorkerConfig(
        uds=sock, model_path=str(root / "ckpt"), cache_root=str(root / "cache"), cache_namespace="slow",
        max_wait_ms=1000.0, patch_budget=4096, max_queue_wait_s=2.5,
        admission_seed_patches_per_s=float(SMALL_PATCHES),
    )  # fmt: skip
    with _serving(config) as served:
        yield served


def test_an_item_that_would_wait_past_the_deadline_is_refused_with_the_expected_wait(
    slow_worker: Served,
) -> None:
    got = _burst(slow_worker.sock, [png(56, 56, seed=80_000 + i) for i in range(6)])
    statuses = sorted(status for status, _, _ in got)
    assert statuses == [200] * 2 + [503] * 4, statuses
    for status, body, headers in got:
        if status == 503:
            assert body["error"]["type"] == "overloaded" and "expected wait 3.0 s" in body["error"]["message"]
            assert headers["Retry-After"] == "3"  # two items ahead and its own at 1 item/s
    _, metrics, _ = slow_worker.request("GET", "/metrics")
    assert b'epd_encoder_refusals_total{reason="wait"} 4.0' in metrics
    # once the queue drained, the next item is taken
    assert _burst(slow_worker.sock, [png(56, 56, seed=80_100)])[0][0] == 200


def _after_one_in_flight(sock: str, then: list[tuple[bytes, dict[str, str]]]) -> list[tuple[int, dict]]:
    """Send one small item, and while the batcher holds it, each of ``then`` in turn."""
    return _after_one_in_flight_of(sock, png(56, 56, seed=81_000), then)


def _after_one_in_flight_of(
    sock: str, first_item: bytes, then: list[tuple[bytes, dict[str, str]]]
) -> list[tuple[int, dict]]:
    """Send ``first_item``, and while it is in flight, each of ``then`` in turn."""

    async def go() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock, limit=0)) as s:

            async def post(data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
                async with s.post("http://worker/encode", data=data, headers=headers) as r:
                    return r.status, await r.json()

            first = asyncio.create_task(post(first_item, {}))
            await asyncio.sleep(0.3)
            out = [await post(data, headers) for data, headers in then]
            assert (await first)[0] == 200
            return out

    return asyncio.run(go())


def test_admission_counts_patches_and_honours_a_shorter_client_timeout(slow_worker: Served) -> None:
    got = _after_one_in_flight(
        slow_worker.sock,
        [
            (png(84, 84, seed=81_001), {}),  # 36 patches: (16 + 36) / 16 = 3.25 s > 2.5 s
            (png(56, 56, seed=81_002), {"X-Request-Timeout": "1.5"}),  # 2 s > the client's 1.5 s
            (png(56, 56, seed=81_003), {"X-Request-Timeout": "60"}),  # 2 s: a longer timeout is not
            # the server's deadline, but 2 s is within both
            # 64 patches take 4 s alone, past any 2.5 s deadline: judged by its turn, (16 + 16) / 16
            (png(112, 112, seed=81_004), {}),
        ],
    )
    assert [status for status, _ in got] == [503, 503, 200, 200], got
    assert "36 of its own" in got[0][1]["error"]["message"]
    assert "1.5 s deadline" in got[1][1]["error"]["message"]


def test_an_admitted_item_whose_turn_comes_too_late_is_shed_not_answered_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker believed it fast (a high seed rate) and admitted the second item; the first one's
    decode then held the only decode thread past the second's due time (its client gave 1 s): the
    second is shed with a 503 when its turn comes, not computed and answered after its client left."""
    slow_seed = 90_000
    slow = png(56, 56, seed=slow_seed)
    decode = EncoderWorker._decode_preprocess

    def held_decode(self: EncoderWorker, data: bytes, *args: Any) -> Any:
        if data == slow:
            time.sleep(1.5)  # a neighbour took the core while this decode ran
        return decode(self, data, *args)

    monkeypatch.setattr(EncoderWorker, "_decode_preprocess", held_decode)
    save_vision_checkpoint(random_encoder(CFG, seed=21), tmp_path / "ckpt")
    config = WorkerConfig(
        uds=str(tmp_path / "w.sock"), model_path=str(tmp_path / "ckpt"), cache_root=str(tmp_path / "cache"),
        cache_namespace="late", decode_threads=1, max_wait_ms=1.0, admission_seed_patches_per_s=1e6,
    )  # fmt: skip
    with _serving(config) as worker:
        got = _after_one_in_flight_of(
            worker.sock, slow, [(png(56, 56, seed=slow_seed + 1), {"X-Request-Timeout": "1"})]
        )
        _, metrics, _ = worker.request("GET", "/metrics")
    status, body = got[0]
    assert status == 503 and body["error"]["type"] == "overloaded", got
    assert "shed rather than answered late" in body["error"]["message"]
    assert b'epd_encoder_refusals_total{reason="late"} 1.0' in metrics
