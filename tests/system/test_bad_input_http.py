"""Bad input through the HTTP API of a real ``epd serve``.

Every hostile or broken request gets its documented 4xx with the JSON error shape
``{"error": {"type", "message", "param"}}``: the bad-media corpora as uploads and as URLs (served
by the loopback media server), malformed multipart, wrong content types, oversize bodies (declared
and chunked), 10k items, invalid JSON and schema errors. Afterwards the service is still healthy
and encodes; shared memory is checked at shutdown by the ``svc`` fixture.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
from collections.abc import Iterator

import pytest

from media_io.errors import BadMedia, MediaError, MediaTooLarge, UnsupportedMedia
from tests.epd.conftest import Reply, ServeProcess, multipart, request, unique_png
from tests.fixtures.media_server import MediaServer
from tests.media_io import bad_video
from tests.media_io.bad_media import EXPECTED, bad_image_corpus
from tests.system.conftest import SVC_MAX_BODY_BYTES, check_error

_STATUS: dict[type[MediaError], int] = {BadMedia: 400, UnsupportedMedia: 415, MediaTooLarge: 413}


def _video_corpus() -> dict[str, tuple[bytes, tuple[int, ...]]]:
    """name -> (bytes, acceptable statuses). A corrupt payload may be concealed by the decoder."""
    return {
        "audio_only.mp4": (bad_video.audio_only_mp4(), (400, 415)),
        "truncated.mp4": (bad_video.truncated_mp4(), (400, 415)),
        "truncated_faststart.mp4": (bad_video.truncated_mp4(faststart=True), (400,)),
        "huge_duration.mp4": (bad_video.huge_duration_mp4(), (413,)),
        "corrupt_header.mp4": (bad_video.corrupt_header(), (400, 415)),
        "corrupt_payload.mp4": (bad_video.corrupt_payload(), (200, 400)),
    }


# The image corpus's expectations are for the image decoder. Over HTTP an octet-stream upload takes
# its modality from the bytes: an MP4 header named .jpg is a video whose container is broken (400).
_HTTP_OVERRIDES: dict[str, tuple[int, ...]] = {"video_as_image.jpg": (400,)}


def _corpus() -> Iterator[tuple[str, bytes, tuple[int, ...]]]:
    for name, data in bad_image_corpus().items():
        expected = EXPECTED[name]
        statuses: tuple[int, ...] = (200,) if expected is None else (_STATUS[expected],)
        yield name, data, _HTTP_OVERRIDES.get(name, statuses)
    for name, (data, statuses) in _video_corpus().items():
        yield name, data, statuses


CORPUS = list(_corpus())


def _check_item(reply: Reply, statuses: tuple[int, ...], param: str) -> None:
    if reply.status == 200 and 200 in statuses:
        assert len(reply.body["data"]) == 1, reply.body
        return
    check_error(reply, tuple(s for s in statuses if s != 200), param)


@pytest.mark.timeout(120)
def test_bad_media_as_uploads_and_urls(svc: ServeProcess, origin: MediaServer) -> None:
    encode = f"{svc.url}/v1/encode"
    for name, data, statuses in CORPUS:
        if not data:  # an empty upload is refused before sniffing (400, named)
            reply = request("POST", encode, *multipart([(name, data, "application/octet-stream")]))
            check_error(reply, 400, name)
            continue
        reply = request("POST", encode, *multipart([(name, data, "application/octet-stream")]))
        _check_item(reply, statuses, name)
        url = origin.add(f"bad-{name}", data, "application/octet-stream")
        reply = request("POST", encode, {"items": [{"url": url}]})
        _check_item(reply, statuses, "items[0]")
        # As a base64 data item in JSON too: the same bytes, the same answer.
        reply = request("POST", encode, {"items": [{"data": base64.b64encode(data).decode()}]})
        _check_item(reply, statuses, "items[0]")
    assert request("GET", f"{svc.url}/health").status == 200


def _chunked_post(svc: ServeProcess, path: str, chunks: Iterator[bytes], ctype: str) -> Reply:
    """POST with Transfer-Encoding: chunked (no Content-Length: the limit must count bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=60)
    try:
        # The server may answer 413 and close before the whole body went out.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request("POST", path, body=chunks, headers={"content-type": ctype}, encode_chunked=True)
        resp = conn.getresponse()
        raw = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        return Reply(
            resp.status, json.loads(raw) if "json" in headers.get("content-type", "") else raw, headers
        )
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_malformed_requests_get_documented_errors(svc: ServeProcess) -> None:
    url = svc.url
    encode = f"{url}/v1/encode"
    chat = f"{url}/v1/chat/completions"
    json_ct = {"content-type": "application/json"}

    # Malformed multipart: garbage after a boundary, a missing boundary, a truncated body.
    boundary = {"content-type": "multipart/form-data; boundary=xyz"}
    check_error(request("POST", encode, b"--xyz\r\nthis is not a part header\r\n\r\n", boundary), 400, "body")
    # Without a boundary nothing parses: no media items (422) or a parse error (400).
    check_error(request("POST", encode, b"--abc\r\n", {"content-type": "multipart/form-data"}), (400, 422))
    body, headers = multipart([("p.png", unique_png(), "image/png")])
    # A body cut mid-part: the parser drops the incomplete part (422, no items) or fails (400).
    check_error(request("POST", encode, body[: len(body) // 2], headers), (400, 422))
    # A multipart form with only text fields carries no media.
    form = b'--xyz\r\nContent-Disposition: form-data; name="note"\r\n\r\nhello\r\n--xyz--\r\n'
    check_error(request("POST", encode, form, boundary), (400, 422))

    # Wrong content types: the request's and an upload's.
    check_error(request("POST", encode, b"hello", {"content-type": "text/plain"}), 415, "content-type")
    check_error(request("POST", encode, b"hello"), 415, "content-type")
    check_error(request("POST", encode, *multipart([("a.txt", b"words", "text/plain")])), 415, "a.txt")

    # Oversize: declared by Content-Length, and streamed chunked without one.
    big = b"\0" * (SVC_MAX_BODY_BYTES + 1)
    err = check_error(request("POST", encode, *multipart([("big.png", big, "image/png")])), 413)
    assert str(SVC_MAX_BODY_BYTES) in err["message"], err
    chunks = iter([b"\0" * 65536] * (SVC_MAX_BODY_BYTES // 65536 + 2))
    check_error(_chunked_post(svc, "/v1/encode", chunks, "application/json"), 413)

    # Too many items: JSON and multipart.
    items = [{"url": "http://127.0.0.1:9/x.png"}] * 10_000
    assert "10000" in check_error(request("POST", encode, {"items": items}), 413, "items")["message"]
    files = [(f"f{i}.png", b"\x89PNG", "image/png") for i in range(65)]
    check_error(request("POST", encode, *multipart(files)), (400, 413))

    # Invalid JSON and schema errors, on encode and chat.
    for target in (encode, chat):
        assert "JSON" in check_error(request("POST", target, b"{not json", json_ct), 400)["message"]
        check_error(request("POST", target, b"\xff\xfe", json_ct), 400)
        check_error(request("POST", target, [1, 2]), 422)
    check_error(request("POST", encode, {"items": "x"}), 422, "items")
    check_error(request("POST", encode, {"items": [7]}), 422, "items[0]")
    check_error(request("POST", encode, {"items": [{"url": 3}]}), 422, "items[0].url")
    check_error(request("POST", encode, {"items": [{"url": "a", "data": "b"}]}), 422)
    check_error(request("POST", encode, {"items": [{"url": "http://x/a.png", "modality": "text"}]}), 422)
    check_error(request("POST", encode, {"items": [{"data": "!!not base64!!"}]}), (400, 422))
    check_error(request("POST", f"{encode}?format=xml", {"items": []}), 400, "format")
    check_error(request("POST", chat, {"messages": "hi"}), 422, "messages")
    check_error(request("POST", chat, {"messages": [{"role": "user", "content": "hi"}], "n": 2}), 422, "n")
    check_error(request("POST", chat, {"messages": [{"role": "wizard", "content": "hi"}]}), (400, 422))
    check_error(request("GET", f"{url}/v1/embeddings/NOT-HEX"), 400, "key")
    check_error(request("GET", f"{url}/no/such/route"), 404)
    check_error(request("GET", encode), 405)

    # Still healthy and serving.
    assert request("GET", f"{url}/health").body["status"] == "ok"
    assert request("GET", f"{url}/ready").status == 200
    reply = request("POST", encode, *multipart([("ok.png", unique_png(), "image/png")]))
    assert reply.status == 200, reply.body
