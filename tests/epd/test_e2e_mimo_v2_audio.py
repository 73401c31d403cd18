"""``epd serve --model DIR`` on the tiny MiMo-V2.5 checkpoint (its audio encoder: the
``audio_tokenizer/`` folder and the ``audio_encoder.*`` tensors), audio through ``/v1/encode``:

- an ``audio/*`` upload gives one row per <|audio_pad|>: the rows of the audio encoder run directly
  on ``log_mel(decode_audio(bytes))``, keyed by the audio settings and the audio fingerprint;
- the same clip again (an octet-stream upload, a JSON data: item, a JSON http URL item) is a
  node-cache hit with identical rows;
- bad clips get the 4xx naming the item, and the service keeps serving.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from encoder.caches.media_key import media_key
from encoder.models.audio_checkpoint import LoadedAudioEncoder, load_audio_encoder
from encoder.serving.audio_path import audio_serving_fingerprint
from media_io.audio import decode_audio
from media_io.audio_features import log_mel
from tests.epd.conftest import Media, ServeProcess, embedding_of, http_json, start_serve, stop_serve, upload
from tests.media_io.audio_files import encode, tone
from tests.media_io.test_audio import unknown_codec_wav


@pytest.fixture(scope="module")
def server(mimo_v2_dir: Path) -> Iterator[ServeProcess]:
    srv = start_serve(
        ["--model", str(mimo_v2_dir), "--encoder-dtype", "float32", "--llm-dtype", "float32",
         "--llm-engine-max-model-len", "1024", "--fetch-allow-cidrs", "127.0.0.0/8"]
    )  # fmt: skip
    try:
        yield srv
    finally:
        assert stop_serve(srv) == 0, srv.tail()


@pytest.fixture(scope="module")
def audio(mimo_v2_dir: Path) -> LoadedAudioEncoder:
    loaded = load_audio_encoder(mimo_v2_dir)
    assert isinstance(loaded, LoadedAudioEncoder)
    return loaded


def direct_rows(audio: LoadedAudioEncoder, data: bytes) -> torch.Tensor:
    clip = decode_audio(data, audio.settings.audio)
    mel = log_mel([torch.from_numpy(clip.samples)], audio.settings.audio)[0]
    with torch.inference_mode():
        return audio.model([mel]).rows


def test_audio_upload_is_encoded_then_a_cache_hit(
    server: ServeProcess, audio: LoadedAudioEncoder, media: Media
) -> None:
    data = encode(tone(2.2, 22050, (330.0, 550.0)), 22050, "mp3")
    status, reply = upload(server, [("song.mp3", data, "audio/mpeg")], "?embeddings=true")
    assert status == 200, reply
    item = reply["data"][0]
    want = direct_rows(audio, data)
    assert item["modality"] == "audio" and item["name"] == "song.mp3" and item["cache_hit"] is False
    assert item["num_tokens"] == want.shape[0] and item["grid_thw"] == [[1, 1, want.shape[0]]]
    assert item["key"] == media_key(
        data, "audio", audio.settings, audio_serving_fingerprint(audio.fingerprint)
    )
    first = embedding_of(item)
    torch.testing.assert_close(first, want, rtol=0, atol=1e-5)

    status, again = upload(server, [("same.bin", data, "application/octet-stream")], "?embeddings=true")
    assert status == 200, again
    assert again["data"][0]["cache_hit"] is True and again["data"][0]["key"] == item["key"]
    assert torch.equal(embedding_of(again["data"][0]), first)

    uri = "data:audio/mpeg;base64," + base64.b64encode(data).decode()
    status, js = http_json("POST", f"{server.url}/v1/encode", {"items": [{"data": uri, "modality": "audio"}]})
    assert status == 200, js
    assert js["data"][0]["cache_hit"] is True and js["data"][0]["key"] == item["key"]

    url = media.server.add("song.mp3", data, "audio/mpeg")
    status, js = http_json("POST", f"{server.url}/v1/encode", {"items": [{"url": url}]})
    assert status == 200, js
    assert js["data"][0]["cache_hit"] is True and js["data"][0]["key"] == item["key"]


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (encode(tone(1.0, 8000, (440.0,)), 8000, "flac")[:4] + bytes(2000), 400),  # corrupt
        (encode(tone(1.0, 8000, (440.0,)), 8000, "wav")[:44], 400),  # a header, no samples
        (unknown_codec_wav(), 415),
    ],
)
def test_bad_audio_is_a_4xx_naming_the_upload(server: ServeProcess, data: bytes, status: int) -> None:
    got, reply = upload(server, [("bad.wav", data, "audio/wav")])
    assert got == status, reply
    assert reply["error"]["param"] == "bad.wav"
    ok, _ = upload(server, [("ok.wav", encode(tone(0.4, 8000, (600.0,)), 8000, "wav"), "audio/wav")])
    assert ok == 200
