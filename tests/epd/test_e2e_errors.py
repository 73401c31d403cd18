"""Bad input through HTTP on a real ``epd serve``: each answer has the right status and the JSON error
shape ``{"error": {"type", "message", "param"}}``, and the server stays healthy afterwards."""

from __future__ import annotations

from typing import Any

from tests.epd.conftest import SHARED_MAX_BODY_BYTES, Media, ServeProcess, http_json, upload
from tests.media_io.audio_files import encode as encode_audio
from tests.media_io.audio_files import tone


def check_error(status: int, body: Any, expected: int, param: str | None = "<any>") -> dict[str, Any]:
    assert status == expected, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert {"type", "message", "param"} <= set(err)
    assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    return dict(err)


def test_bad_requests_answer_json_errors_and_server_stays_healthy(
    epd_server: ServeProcess, media: Media
) -> None:
    url = epd_server.url
    encode = f"{url}/v1/encode"
    json_ct = {"content-type": "application/json"}

    status, body = http_json("POST", encode, b"{not json", json_ct)
    assert "JSON" in check_error(status, body, 400)["message"]

    status, body = http_json("POST", encode, {"items": [{"url": 3}]})
    check_error(status, body, 422, "items[0].url")
    status, body = http_json("POST", f"{url}/v1/chat/completions", {"messages": "hi"})
    check_error(status, body, 422, "messages")

    # An HTML page declared as HTML, and one served by a misconfigured origin as image/jpeg.
    status, body = upload(epd_server, [("page.html", b"<html><body>hi</body></html>", "text/html")])
    check_error(status, body, 415, "page.html")
    status, body = http_json("POST", encode, {"items": [{"url": media.server.url("/html")}]})
    check_error(status, body, 415, "items[0]")

    # Audio is recognized by its bytes and refused by name until an audio tower serves it.
    wav = encode_audio(tone(0.5, 8000, (440.0,)), 8000, "wav")
    status, body = upload(epd_server, [("clip.wav", wav, "application/octet-stream")])
    assert "audio (wav)" in check_error(status, body, 415, "clip.wav")["message"]

    status, body = upload(epd_server, [("empty.png", b"", "image/png")])
    check_error(status, body, 400, "empty.png")

    big = b"\0" * (SHARED_MAX_BODY_BYTES + 1024)
    status, body = upload(epd_server, [("big.png", big, "image/png")])
    assert "limit" in check_error(status, body, 413)["message"]

    items = [{"url": media.jpeg_url}] * 10_000
    status, body = http_json("POST", encode, {"items": items})
    assert "10000" in check_error(status, body, 413, "items")["message"]

    status, body = http_json("GET", f"{url}/v1/embeddings/{'0' * 64}")
    check_error(status, body, 404, "key")

    # Still serving: health, readiness, and a real encode.
    status, health = http_json("GET", f"{url}/health")
    assert status == 200 and health["status"] == "ok"
    assert http_json("GET", f"{url}/ready")[0] == 200
    status, body = upload(epd_server, [("photo.jpg", media.jpeg, "image/jpeg")])
    assert status == 200, body
