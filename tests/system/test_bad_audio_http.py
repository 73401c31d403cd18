"""Bad audio through the HTTP API of a real ``epd serve`` of the tiny MiMo-V2.5 checkpoint (its
audio encoder served): corrupt, header-only, unknown codec, too long, no audio stream and empty
clips, as uploads, as URLs and as chat parts. Each gets its 4xx naming the item or part; the
service then still encodes and answers audio; at shutdown every process has exited and no shared
memory is left (``stop_checked``)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.epd.conftest import ServeProcess, multipart, request, start_serve
from tests.fixtures.media_server import MediaServer
from tests.media_io import bad_video
from tests.media_io.audio_files import encode, tone
from tests.media_io.test_audio import unknown_codec_wav
from tests.system.conftest import check_error, shm_entries, stop_checked

MAX_AUDIO_S = 5.0


@pytest.fixture(scope="module")
def audio_svc(mimo_v2_dir: Path) -> Iterator[ServeProcess]:
    before = shm_entries("serve-")
    server = start_serve(
        ["--model", str(mimo_v2_dir), "--dtype", "float32", "--llm-engine-max-model-len", "1024",
         "--fetch-allow-cidrs", "127.0.0.0/8", "--limits-max-audio-seconds", str(MAX_AUDIO_S)]
    )  # fmt: skip
    try:
        yield server
    finally:
        stop_checked(server, before)


def _corpus() -> dict[str, tuple[bytes, int]]:
    """name -> (bytes, status)."""
    flac = encode(tone(1.0, 8000, (440.0,)), 8000, "flac")
    wav = encode(tone(1.0, 8000, (440.0,)), 8000, "wav")
    return {
        "corrupt.flac": (flac[:4] + bytes(2000), 400),
        "header_only.wav": (wav[:44], 400),
        "unknown_codec.wav": (unknown_codec_wav(), 415),
        "too_long.wav": (encode(tone(MAX_AUDIO_S + 2, 8000, (440.0,)), 8000, "wav"), 413),
        "too_long.aac": (
            encode(tone(MAX_AUDIO_S + 2, 8000, (440.0,)), 8000, "aac"),
            413,
        ),  # no header duration
    }


@pytest.mark.timeout(180)
def test_bad_audio_is_refused_by_name_and_nothing_leaks(audio_svc: ServeProcess, origin: MediaServer) -> None:
    encode_url = f"{audio_svc.url}/v1/encode"
    chat_url = f"{audio_svc.url}/v1/chat/completions"
    for name, (data, status) in _corpus().items():
        reply = request("POST", encode_url, *multipart([(name, data, "audio/wav")]))
        check_error(reply, status, name)
        url = origin.add(f"bad-{name}", data, "application/octet-stream")
        reply = request("POST", encode_url, {"items": [{"url": url, "modality": "audio"}]})
        check_error(reply, status, "items[0]")
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode()}}
        reply = request(
            "POST", chat_url, {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        )
        check_error(reply, status, "messages[0].content[0]")
        part = {"type": "audio_url", "audio_url": {"url": url}}
        reply = request(
            "POST", chat_url, {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        )
        check_error(reply, status, "messages[0].content[0]")

    # A video container without sound sent as audio, and empty data: the client's errors, named.
    silent = bad_video.truncated_mp4(keep=1.0)
    reply = request(
        "POST", encode_url, {"items": [{"data": base64.b64encode(silent).decode(), "modality": "audio"}]}
    )
    check_error(reply, 400, "items[0]")
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    reply = request("POST", chat_url, {"messages": [{"role": "user", "content": [part]}]})
    check_error(reply, 400, "messages[0].content[0].input_audio.data")

    # Still serving audio: a good clip is encoded, and a chat with it is answered.
    good = encode(tone(1.2, 16000, (500.0,)), 16000, "mp3")
    reply = request("POST", encode_url, *multipart([("good.mp3", good, "audio/mpeg")]))
    assert reply.status == 200 and reply.body["data"][0]["modality"] == "audio", reply.body
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(good).decode(), "format": "mp3"}}
    reply = request("POST", chat_url, {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
    assert reply.status == 200, reply.body
    assert request("GET", f"{audio_svc.url}/health").status == 200
