"""The encoder worker serving audio: the tiny MiMo-V2.5 checkpoint (vision tower and audio
encoder), an audio clip in, one row per <|audio_pad|> out, cached, keyed, and bad clips refused
alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.media_key import media_key
from encoder.models.audio_checkpoint import LoadedAudioEncoder, load_audio_encoder
from encoder.serving.audio_path import audio_serving_fingerprint
from encoder.serving.worker import WorkerConfig
from epd_common.store_config import StoreConfig
from media_io.audio import decode_audio
from media_io.audio_features import log_mel
from media_io.audio_track import TrackWindow, decode_until_s, track_rows
from media_io.config import MediaLimits, PreprocessConfig
from media_io.processor_config import preprocess_config_from_dir
from tests.encoder.serving.test_worker import Served, _serving, png
from tests.media_io.audio_files import encode, tone
from tests.media_io.test_audio import unknown_codec_wav
from tests.media_io.test_sniff import _encode_video

LIMITS = MediaLimits(max_bytes=1 << 20, max_audio_seconds=5.0)


@pytest.fixture(scope="module")
def audio(mimo_v2_dir: Path) -> LoadedAudioEncoder:
    loaded = load_audio_encoder(mimo_v2_dir)
    assert isinstance(loaded, LoadedAudioEncoder)
    return loaded


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, mimo_v2_dir: Path) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("audio_worker")
    config = WorkerConfig(
        uds=str(root / "w.sock"),
        model_path=str(mimo_v2_dir),
        cache_root=str(root / "cache"),
        cache_namespace="audio",
        dtype="float32",  # the checkpoint says bfloat16: fp32 here, to compare with the fp32 encoder
        preprocess=preprocess_config_from_dir(str(mimo_v2_dir), PreprocessConfig()),
        max_wait_ms=20.0,
        patch_budget=4096,
        limits=LIMITS,
    )
    with _serving(config) as s:
        yield s


def direct_rows(audio: LoadedAudioEncoder, data: bytes) -> torch.Tensor:
    clip = decode_audio(data, audio.settings.audio, LIMITS)
    mel = log_mel([torch.from_numpy(clip.samples)], audio.settings.audio)[0]
    with torch.inference_mode():
        return audio.model([mel]).rows


def test_audio_rows_match_the_encoder_run_directly(served: Served, audio: LoadedAudioEncoder) -> None:
    data = encode(tone(1.3, 16000, (440.0, 660.0)), 16000, "flac")
    status, body, _ = served.request("POST", "/encode", data, item="clip.flac")
    assert status == 200, body
    ref = body["ref"]
    want = direct_rows(audio, data)
    pads = audio.settings.rule.pad_count(_mel_frames(data, audio))
    assert ref["modality"] == "audio" and ref["shape"] == [pads, 128] == list(want.shape)
    assert ref["grid_thw"] == [[1, 1, pads]]
    fp = audio_serving_fingerprint(audio.fingerprint)
    assert ref["key"] == media_key(data, "audio", audio.settings, fp)
    assert body["cache_hit"] is False and body["timings_ms"]["forward"] > 0
    cached = EmbedCache("audio", root=served.config.cache_root).get(ref["key"])
    assert cached is not None and cached.ref.modality == "audio"
    torch.testing.assert_close(cached.tensor, want, rtol=0, atol=1e-5)

    status, again, _ = served.request("POST", "/encode", data, modality="audio", item="again.flac")
    assert status == 200 and again["cache_hit"] is True and again["ref"] == ref
    status, first_bytes, _ = served.request("GET", f"/embeddings/{ref['key']}")
    assert status == 200
    got = load_safetensors(first_bytes)["embedding"]
    assert torch.equal(got, cached.tensor)


def _mel_frames(data: bytes, audio: LoadedAudioEncoder) -> int:
    clip = decode_audio(data, audio.settings.audio, LIMITS)
    return len(clip.samples) // audio.settings.audio.hop_length + 1


def test_concurrent_clips_each_get_their_rows(served: Served, audio: LoadedAudioEncoder) -> None:
    import asyncio

    import aiohttp

    clips = [encode(tone(s, 8000, (300.0 + 100 * i,)), 8000, "wav") for i, s in enumerate((0.2, 0.7, 1.1))]

    async def go() -> list[dict]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=served.sock)) as s:

            async def one(i: int, data: bytes) -> dict:
                async with s.post("http://worker/encode", data=data, params={"item": f"c{i}.wav"}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            return list(await asyncio.gather(*(one(i, d) for i, d in enumerate(clips))))

    bodies = asyncio.run(go())
    cache = EmbedCache("audio", root=served.config.cache_root)
    for data, body in zip(clips, bodies, strict=True):
        cached = cache.get(body["ref"]["key"])
        assert cached is not None
        torch.testing.assert_close(cached.tensor, direct_rows(audio, data), rtol=0, atol=1e-5)


def _as_m4a(mp4: bytes) -> bytes:
    """An MP4 whose brand says M4A (audio), holding only video."""
    at = mp4.index(b"ftyp") + 4
    return mp4[:at] + b"M4A " + mp4[at + 4 :]


@pytest.mark.parametrize(
    ("make", "item", "status", "text"),
    [
        (lambda: encode(tone(1.0, 8000, (440.0,)), 8000, "flac")[:4] + bytes(2000), "c.flac", 400, ""),
        (lambda: encode(tone(1.0, 8000, (440.0,)), 8000, "wav")[:44], "h.wav", 400, ""),
        (lambda: encode(tone(6.0, 8000, (440.0,)), 8000, "wav"), "long.wav", 413, "limit"),
        (lambda: _as_m4a(_encode_video("mp4", "mpeg4")), "v.m4a", 400, "no audio stream"),
        (unknown_codec_wav, "u.wav", 415, "codec"),
    ],
)
def test_bad_audio_fails_alone_with_a_named_4xx(
    served: Served, make: object, item: str, status: int, text: str
) -> None:
    assert callable(make)
    got, body, _ = served.request("POST", "/encode", make(), item=item)
    assert got == status, body
    assert body["error"]["param"] == item and text in body["error"]["message"]
    ok, _, _ = served.request("POST", "/encode", encode(tone(0.3, 8000, (500.0,)), 8000, "wav"))
    assert ok == 200  # the worker still serves audio
    ok, img, _ = served.request("POST", "/encode", png(128, 96, seed=3))
    assert ok == 200, img  # and images


def test_health_reports_the_audio_encoder(served: Served, audio: LoadedAudioEncoder) -> None:
    status, body, _ = served.request("GET", "/health")
    assert status == 200
    assert body["paths"]["log_mel"] == "torch"
    assert body["audio"]["fingerprint"] == audio_serving_fingerprint(audio.fingerprint)
    assert body["audio"]["settings"] == audio.settings.to_dict()
    assert body["audio"]["out_hidden_size"] == 128
    # the audio stage's own admission: its queue's wait and its rate, in mel frames
    assert body["audio"]["expected_wait_s"] >= 0 and body["audio"]["mel_frames_per_s"] > 0


def test_a_checkpoint_without_an_audio_tokenizer_refuses_audio(tmp_path: Path) -> None:
    from tests.fixtures.mimo_v2 import write_tiny_mimo_v2

    ckpt = write_tiny_mimo_v2(tmp_path / "ckpt", audio_tokenizer=False)
    config = WorkerConfig(
        uds=str(tmp_path / "w.sock"), model_path=str(ckpt), cache_root=str(tmp_path / "cache"), limits=LIMITS
    )
    with _serving(config) as s:
        data = encode(tone(0.5, 8000, (440.0,)), 8000, "wav")
        status, body, _ = s.request("POST", "/encode", data, item="clip.wav")
        assert status == 415 and body["error"]["param"] == "clip.wav"
        assert "audio (wav)" in body["error"]["message"] and "audio_tokenizer/" in body["error"]["message"]
        status, health, _ = s.request("GET", "/health")
        assert health["audio"] is None and "log_mel" not in health["paths"]


def _config(root: Path, ckpt: Path, name: str, store: StoreConfig | None = None) -> WorkerConfig:
    return WorkerConfig(
        uds=str(root / f"{name}.sock"),
        model_path=str(ckpt),
        cache_root=str(root / f"cache-{name}"),
        cache_namespace=name,
        dtype="float32",
        max_wait_ms=20.0,
        limits=LIMITS,
        store=store or StoreConfig(),
    )


def test_same_clip_at_once_is_encoded_once(tmp_path: Path, mimo_v2_dir: Path) -> None:
    import asyncio

    import aiohttp

    clip = encode(tone(0.9, 8000, (350.0,)), 8000, "wav")
    with _serving(_config(tmp_path, mimo_v2_dir, "sf")) as s:

        async def go() -> list[dict]:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=s.sock)) as session:

                async def one(i: int) -> dict:
                    async with session.post("http://w/encode", data=clip, params={"item": f"c{i}"}) as r:
                        assert r.status == 200, await r.text()
                        return await r.json()

                return list(await asyncio.gather(*(one(i) for i in range(4))))

        bodies = asyncio.run(go())
        assert len({b["ref"]["key"] for b in bodies}) == 1
        assert sorted(b["cache_hit"] for b in bodies) == [False, True, True, True]
        _, health, _ = s.request("GET", "/health")
        assert health["audio"]["batches"] == 1


def test_a_clip_encoded_on_one_node_is_a_store_hit_on_another(tmp_path: Path, mimo_v2_dir: Path) -> None:
    store = StoreConfig(dir=str(tmp_path / "store"), max_bytes=16 << 20)
    clip = encode(tone(0.8, 8000, (420.0,)), 8000, "wav")
    with _serving(_config(tmp_path, mimo_v2_dir, "a", store)) as a:
        status, first, _ = a.request("POST", "/encode", clip, item="a.wav")
        assert status == 200 and first["cache_hit"] is False
        _, rows_a, _ = a.request("GET", f"/embeddings/{first['ref']['key']}")
    # (the publish runs after the reply; a worker's stop waits for it)
    with _serving(_config(tmp_path, mimo_v2_dir, "b", store)) as b:
        status, second, _ = b.request("POST", "/encode", clip, item="b.wav")
        assert status == 200 and second["cache_hit"] is True
        assert second["ref"]["key"] == first["ref"]["key"] and second["ref"]["modality"] == "audio"
        _, rows_b, _ = b.request("GET", f"/embeddings/{second['ref']['key']}")
        _, health, _ = b.request("GET", "/health")
        assert health["audio"]["batches"] == 0  # nothing encoded on b
    assert torch.equal(load_safetensors(rows_a)["embedding"], load_safetensors(rows_b)["embedding"])


def test_a_tracks_sound_past_its_window_is_not_decoded_and_the_kept_rows_are_unchanged(
    audio: LoadedAudioEncoder,
) -> None:
    """A 130 s track whose video frames end at 20 s: decoded to the end of its first tokenizer
    segment plus a second (61 s), not to 130 s; every row the window keeps (and every row of that
    segment) equals the whole track's encode."""
    rate = audio.settings.audio.sample_rate
    rng = np.random.default_rng(5)
    samples = (0.3 * rng.standard_normal((1, 130 * rate)) + tone(130.0, rate, (440.0,))).astype(np.float32)
    data = encode(np.clip(samples, -1.0, 1.0), rate, "wav")
    limits = MediaLimits(max_bytes=64 << 20, max_audio_seconds=600.0)
    window = TrackWindow(0.0, 20.0)
    segment_s = audio.settings.rule.segment_size * audio.settings.audio.hop_length / rate
    until = decode_until_s(window, segment_s)
    assert segment_s == 60.0 and until == 61.0

    def rows(until_s: float | None) -> tuple[torch.Tensor, float]:
        clip = decode_audio(data, audio.settings.audio, limits, until_s=until_s)
        mel = log_mel([torch.from_numpy(clip.samples)], audio.settings.audio)[0]
        with torch.inference_mode():
            return audio.model([mel]).rows, clip.seconds

    whole, whole_s = rows(None)
    cut, cut_s = rows(until)
    assert whole_s == pytest.approx(130.0, abs=0.1) and until <= cut_s < until + 0.5  # a frame's overshoot
    kept = track_rows(int(whole.shape[0]), window, audio.settings.tokens_per_second)
    assert track_rows(int(cut.shape[0]), window, audio.settings.tokens_per_second) == kept
    first_segment = int(segment_s * audio.settings.tokens_per_second)  # 375 rows
    torch.testing.assert_close(cut[:first_segment], whole[:first_segment], rtol=0, atol=0)
