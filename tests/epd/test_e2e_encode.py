"""``/v1/encode`` and friends on a real ``epd serve``: uploads, URLs, the node cache, embedding
parity with the encoder run in this process, and the operational routes."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from encoder.models.checkpoint import load_encoder
from media_io.config import PreprocessConfig
from media_io.image import decode_image
from media_io.preprocess import get_backend
from tests.epd.conftest import (
    Media,
    ServeProcess,
    embedding_of,
    http_json,
    rel_err,
    unique_jpeg,
    unique_png,
    upload,
)


def check_item(entry: dict[str, Any], modality: str) -> None:
    """Invariants of one answered item: the token count follows the grid (2x2 merge)."""
    assert re.fullmatch(r"[0-9a-f]{64}", entry["key"])
    assert entry["modality"] == modality
    (t, h, w), *_ = entry["grid_thw"]
    assert entry["num_tokens"] == t * h * w // 4
    assert entry["hidden_size"] == 256  # the embedded default encoder feeds the default LLM
    assert entry["timings_ms"]["total"] >= 0


def test_upload_jpeg_png_mp4_in_one_request_and_separately(epd_server: ServeProcess, media: Media) -> None:
    files = [
        ("photo.jpg", media.jpeg, "image/jpeg"),
        ("photo.png", media.png, "image/png"),
        ("clip.mp4", media.mp4, "video/mp4"),
    ]
    status, together = upload(epd_server, files)
    assert status == 200, together
    assert [d["name"] for d in together["data"]] == ["photo.jpg", "photo.png", "clip.mp4"]
    for entry, modality in zip(together["data"], ["image", "image", "video"], strict=True):
        check_item(entry, modality)
    assert together["data"][2]["grid_thw"][0][0] == 2  # 4 sampled frames, temporal patch 2
    assert len({d["key"] for d in together["data"]}) == 3

    for f, joint in zip(files, together["data"], strict=True):
        status, alone = upload(epd_server, [f])
        assert status == 200, alone
        (entry,) = alone["data"]
        # Same bytes, same key and grid: and the joint request already filled the cache.
        assert entry["key"] == joint["key"]
        assert entry["grid_thw"] == joint["grid_thw"]
        assert entry["cache_hit"] is True


def test_json_items_by_url_and_base64(epd_server: ServeProcess, media: Media) -> None:
    png = unique_png()
    status, body = http_json(
        "POST",
        f"{epd_server.url}/v1/encode",
        {"items": [{"url": media.jpeg_url}, {"data": base64.b64encode(png).decode()}]},
    )
    assert status == 200, body
    check_item(body["data"][0], "image")
    check_item(body["data"][1], "image")
    status, again = upload(epd_server, [("again.png", png, "image/png")])
    assert again["data"][0]["key"] == body["data"][1]["key"]


def test_repeated_media_hits_the_cache_and_is_faster(epd_server: ServeProcess) -> None:
    data = unique_jpeg(160, 120)
    status, first = upload(epd_server, [("fresh.jpg", data, "image/jpeg")])
    assert status == 200, first
    status, second = upload(epd_server, [("fresh.jpg", data, "image/jpeg")])
    assert status == 200, second
    a, b = first["data"][0], second["data"][0]
    assert a["cache_hit"] is False and b["cache_hit"] is True
    assert a["key"] == b["key"]
    # A miss decodes, preprocesses and runs the forward; a hit only hashes and looks up.
    for stage in ("decode", "preprocess", "forward"):
        assert stage in a["timings_ms"] and stage not in b["timings_ms"]
    assert b["timings_ms"]["total"] < a["timings_ms"]["total"]


@pytest.fixture(scope="module")
def reference_encoder() -> Any:
    # The same embedded default checkpoint the server's worker loaded ($EPD_HOME is shared).
    return load_encoder(None)


def test_embeddings_equal_in_process_encoder(
    epd_server: ServeProcess, media: Media, reference_encoder: Any
) -> None:
    fresh = unique_jpeg(150, 100)
    status, body = upload(
        epd_server,
        [("photo.png", media.png, "image/png"), ("fresh.jpg", fresh, "image/jpeg")],
        "?embeddings=true",
    )
    assert status == 200, body
    backend = get_backend("cpu", PreprocessConfig())
    for entry, data in zip(body["data"], [media.png, fresh], strict=True):
        served = embedding_of(entry)
        patches = backend.image(decode_image(data))
        with torch.no_grad():
            ours = reference_encoder.model(patches.pixel_values, torch.tensor([patches.grid_thw]))
        assert list(patches.grid_thw) == entry["grid_thw"][0]
        assert served.shape == ours.shape == (entry["num_tokens"], entry["hidden_size"])
        assert rel_err(served, ours) <= 1e-5

        status, raw = http_json("GET", f"{epd_server.url}/v1/embeddings/{entry['key']}")
        assert status == 200
        assert isinstance(raw, bytes)
        tensor = load_safetensors(raw)["embedding"]
        assert torch.equal(tensor, served)


def test_embeddings_as_safetensors(epd_server: ServeProcess, media: Media) -> None:
    status, body = upload(epd_server, [("photo.jpg", media.jpeg, "image/jpeg")], "?embeddings=true")
    assert status == 200
    status, raw = upload(
        epd_server, [("photo.jpg", media.jpeg, "image/jpeg")], "?embeddings=true&format=safetensors"
    )
    assert status == 200 and isinstance(raw, bytes)
    assert torch.equal(load_safetensors(raw)["embedding.0"], embedding_of(body["data"][0]))


def test_operational_routes(epd_server: ServeProcess) -> None:
    url = epd_server.url
    status, health = http_json("GET", f"{url}/health")
    assert status == 200 and health["status"] == "ok"
    # Every role says what runs its hot steps; this build has every C kernel and Pillow-SIMD.
    (encoder,) = health["paths"]["encoders"].values()
    assert encoder["jpeg_decode"].startswith("libjpeg") and encoder["patchify"].startswith("C kernel")
    assert encoder["resize"].startswith("Pillow-SIMD")
    assert health["paths"]["llm"]["layer"].startswith("one C call per layer")
    assert health["fallbacks"] == []
    # ... and the start banner said the same.
    assert "  llm: layer=one C call per layer" in "".join(epd_server.log)
    assert "WARNING slower fallback" not in "".join(epd_server.log)
    status, ready = http_json("GET", f"{url}/ready")
    assert status == 200 and ready["ready"] is True
    assert ready["encoders_up"] == ready["encoders"] == 1 and ready["engine_up"] is True
    status, models = http_json("GET", f"{url}/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["epd-default"]

    # A hit and a miss right before the scrape, so both counters have moved.
    data = unique_png()
    upload(epd_server, [("m.png", data, "image/png")])
    upload(epd_server, [("m.png", data, "image/png")])
    status, text = http_json("GET", f"{url}/metrics")
    assert status == 200 and isinstance(text, bytes)
    metrics = _samples(text.decode())
    assert metrics[('epd_requests_total{route="/v1/encode",status="200"}')] >= 2
    assert metrics["epd_embed_cache_hits_total"] >= 1
    assert metrics["epd_embed_cache_misses_total"] >= 1


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
