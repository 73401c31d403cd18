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
import io
import json
import math
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder.caches.media_key import media_key
from encoder.models.audio_checkpoint import LoadedAudioEncoder, load_audio_encoder
from encoder.serving.audio_path import audio_serving_fingerprint
from media_io.audio import decode_audio
from media_io.audio_features import log_mel
from tests.epd.conftest import Media, ServeProcess, embedding_of, http_json, start_serve, stop_serve, upload
from tests.fixtures import mimo_v2 as fx
from tests.media_io.audio_files import encode, tone
from tests.media_io.test_audio import unknown_codec_wav

REQUEST_MEDIA_S = 12.0  # one request's audio and video together (each test's fit)


@pytest.fixture(scope="module")
def server(mimo_v2_dir: Path) -> Iterator[ServeProcess]:
    srv = start_serve(
        ["--model", str(mimo_v2_dir), "--encoder-dtype", "float32", "--llm-dtype", "float32",
         "--llm-engine-max-model-len", "1024", "--fetch-allow-cidrs", "127.0.0.0/8",
         "--limits-max-request-media-seconds", str(REQUEST_MEDIA_S)]
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


# ---------------------------------------------------------------------------------------------
# Chat: an audio part, and a video with sound, against references written here


def _pads_for_samples(samples: int) -> int:
    """MiMo-V2.5's pad count as documented: 100 centred mel frames a second (hop 240 at 24 kHz),
    the tokenizer's k=3 convolutions (the second strides 2), the pooler of 2, groups of 4."""
    t = samples // 240 + 1
    t = (t + 2 - 3) // 2 + 1
    return math.ceil(math.ceil(t / 2) / 4)


def _wav_samples(data: bytes) -> torch.Tensor:
    """A 16-bit mono WAV's samples as float32 in [-1, 1) (the standard library's reader)."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return torch.from_numpy(pcm.astype(np.float32) / 32768.0)


def _reference_rows(model_dir: Path, samples: torch.Tensor) -> torch.Tensor:
    """torchaudio's log-mel, then the float64 reference of the audio encoder written from the
    reference notes (tests/encoder/models/test_mimo_audio.py), on the checkpoint's tensors."""
    import torchaudio
    from safetensors.torch import load_file

    from tests.encoder.models.mimo_audio_fixture import TinyAudioCheckpoint
    from tests.encoder.models.test_mimo_audio import reference_clip
    from tests.fixtures.mimo_v2_reference import read_checkpoint

    spec = torchaudio.transforms.MelSpectrogram(
        sample_rate=24000, n_fft=960, hop_length=240, win_length=960, n_mels=128, power=1.0, center=True
    )(samples[None])
    mel = torch.log(torch.clip(spec, min=1e-7))[0].T  # [T, 128]
    config = json.loads((model_dir / "config.json").read_text())
    tok_dir = model_dir / "audio_tokenizer"
    main = {
        k: v.float()
        for k, v in read_checkpoint(model_dir).items()
        if k.startswith(("audio_encoder.", "speech_"))
    }
    ck = TinyAudioCheckpoint(
        model_dir,
        config,
        json.loads((tok_dir / "config.json").read_text()),
        {k: v.float() for k, v in load_file(str(tok_dir / "model.safetensors")).items()},
        main,
    )
    return reference_clip(mel, ck)[1].float()


def test_audio_chat_equals_the_reference(server: ServeProcess, mimo_v2_dir: Path) -> None:
    from tests.epd.test_e2e_mimo_v2 import chat, reference_answer, template_ids

    rng = np.random.default_rng(11)
    voice = tone(1.7, 24000, (220.0,), amplitude=0.4)[0] + rng.normal(0, 0.05, 40800).astype(np.float32)
    data = encode(voice[None].astype(np.float32), 24000, "wav")
    question = "What is said?"
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
    reply = chat(server, messages)
    choice = reply["choices"][0]

    samples = _wav_samples(data)
    pads = _pads_for_samples(len(samples))
    audio_pad = fx.token_id(fx.AUDIO_PAD)
    rendered = template_ids(mimo_v2_dir, ["audio"], question)
    at = rendered.index(audio_pad)
    assert rendered[at - 1] == fx.token_id(fx.AUDIO_START) and rendered[at + 1] == fx.token_id(fx.AUDIO_END)
    expected_prompt = rendered[:at] + [audio_pad] * pads + rendered[at + 1 :]
    assert choice["prompt_token_ids"] == expected_prompt
    assert reply["usage"]["audio_tokens"] == pads and reply["usage"]["audios"] == 1

    rows = _reference_rows(mimo_v2_dir, samples)
    assert rows.shape[0] == pads
    assert choice["token_ids"] == reference_answer(mimo_v2_dir, expected_prompt, audio_pad, rows)

    again = chat(server, messages)  # the same clip: a cache hit, the same answer
    assert again["usage"]["cached_media"] == 1
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def _video_with_sound(path: Path, seconds: int, sound_s: float) -> Path:
    """A 96x64 clip at 10 fps (lossless H.264) with a 24 kHz mono AAC track of ``sound_s`` seconds."""
    import av

    from tests.fixtures.qwen2_5_vl import make_video_frames

    frames = make_video_frames(seconds * 10, 96, 64, seed=5)
    with av.open(str(path), "w", format="mp4") as out:
        video = out.add_stream("libx264rgb", rate=10)
        video.width, video.height, video.pix_fmt = 96, 64, "rgb24"
        video.options = {"qp": "0", "preset": "ultrafast", "g": "4"}
        audio = out.add_stream("aac", rate=24000, layout="mono")
        for rgb in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        sound = tone(sound_s, 24000, (300.0,), amplitude=0.3)
        for start in range(0, sound.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(sound[:, start : start + 1024]), "fltp", "mono"
            )
            frame.sample_rate, frame.pts = 24000, start
            for packet in audio.encode(frame):
                out.mux(packet)
        for packet in audio.encode():
            out.mux(packet)
    return path


def _track_samples(path: Path) -> int:
    """Samples of the clip's audio stream at 24 kHz, decoded here with PyAV directly."""
    import av

    with av.open(str(path)) as c:
        return sum(f.samples for f in c.decode(c.streams.audio[0]))


def _documented_window(seconds: int) -> tuple[list[float], float]:
    """A ``seconds`` clip at 10 fps sampled as MiMo-V2.5's processor documents it: 1 fps, at least
    8 frames (its ``min_frames`` is null: the fallback), an even count, ``linspace(0, frames - 1,
    count)`` floored; the temporal patches start at every second sampled frame; the sound is laid
    out up to the last sampled frame plus one sampled spacing."""
    frames = seconds * 10
    count = max(int(frames / 10 * 1.0), 8) // 2 * 2
    stamps = [int(i) / 10 for i in np.linspace(0, frames - 1, num=count)]
    return stamps[::2], stamps[-1] + (stamps[1] - stamps[0])


@pytest.mark.parametrize(
    ("seconds", "sound_s", "stamps"),
    [
        (10, 9.5, ("00:00", "00:02", "00:04", "00:06", "00:08")),  # the track ends inside the video
        (7, 9.5, ("00:00", "00:01", "00:03", "00:05")),  # the track runs past the window: cut
    ],
)
def test_video_with_sound_is_interleaved_as_documented(
    server: ServeProcess,
    mimo_v2_dir: Path,
    tmp_path: Path,
    seconds: int,
    sound_s: float,
    stamps: tuple[str, ...],
) -> None:
    """Per temporal patch (10 s: at 0.0, 2.2, 4.4, 6.6, 8.8 s; 7 s: at 0.0, 1.9, 3.9, 5.9 s): its
    "MM:SS", <vision_start>, its video pads, <vision_end>, then <mimo_audio_start>, the track's pads
    from int(t_i * 6.25) to int(t_(i+1) * 6.25) (the last patch: to int(end * 6.25), at most the
    track's own count; end = 11.0 s and 7.8 s), <mimo_audio_end>; <video_end> after."""
    from transformers import AutoTokenizer

    from tests.epd.test_e2e_mimo_v2 import _data_uri, chat, template_ids

    clip = _video_with_sound(tmp_path / "sound.mp4", seconds=seconds, sound_s=sound_s)
    question = "What is heard?"
    part = {"type": "video_url", "video_url": {"url": _data_uri(clip.read_bytes(), "video/mp4")}}
    reply = chat(server, [{"role": "user", "content": [part, {"type": "text", "text": question}]}])

    total = _pads_for_samples(_track_samples(clip))
    starts, end = _documented_window(seconds)
    edges = [int(t * 6.25) for t in starts] + [min(int(end * 6.25), total)]
    per_patch = reply["usage"]["video_tokens"] // len(starts)
    tok = AutoTokenizer.from_pretrained(str(mimo_v2_dir))
    vs, ve, vpad = fx.token_id(fx.VISION_START), fx.token_id(fx.VISION_END), fx.token_id(fx.VIDEO_PAD)
    a_start, a_end, apad = fx.token_id(fx.AUDIO_START), fx.token_id(fx.AUDIO_END), fx.token_id(fx.AUDIO_PAD)
    block = [fx.token_id(fx.VIDEO_START)]
    for i, stamp in enumerate(stamps):
        block += tok.encode(stamp, add_special_tokens=False) + [vs] + [vpad] * per_patch + [ve]
        block += [a_start] + [apad] * (edges[i + 1] - edges[i]) + [a_end]
    block.append(fx.token_id(fx.VIDEO_END))
    rendered = template_ids(mimo_v2_dir, ["video"], question)
    at = rendered.index(vpad)
    expected = rendered[: at - 1] + block + rendered[at + 2 :]
    assert reply["choices"][0]["prompt_token_ids"] == expected  # what the engine received
    assert reply["usage"]["video_tokens"] == per_patch * len(starts)
    assert reply["usage"]["audio_tokens"] == edges[-1] < (total if seconds == 7 else total + 1)
    assert reply["usage"]["videos"] == 1 and reply["usage"]["audios"] == 0
    assert len(reply["choices"][0]["token_ids"]) == 16


def test_a_requests_media_seconds_are_capped_together(server: ServeProcess) -> None:
    """Each clip is within every per-clip cap; together they pass the request's, found from their
    headers before any is decoded: a 413 naming the flag and the clip that crossed it."""
    clip = encode(tone(7.0, 8000, (440.0,)), 8000, "wav")
    status, body = upload(server, [("a.wav", clip, "audio/wav"), ("b.wav", clip, "audio/wav")])
    assert status == 413, body
    error = body["error"]
    assert error["type"] == "media_too_large" and "--limits-max-request-media-seconds" in error["message"]
    assert error["param"] in ("a.wav", "b.wav")  # the one whose seconds crossed the cap
    status, body = upload(server, [("a.wav", clip, "audio/wav")])
    assert status == 200, body
