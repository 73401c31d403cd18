import asyncio
import dataclasses
import hashlib
import itertools
import os
import subprocess
import sys

import pytest

from encoder.caches.media_key import MediaKeyHasher, media_key, media_key_async, media_key_chunks
from media_io.audio_config import AudioConfig
from media_io.audio_settings import AudioSettings
from media_io.audio_tokens import AudioTokenRule
from media_io.config import PreprocessConfig
from media_io.errors import UnsupportedMedia

CFG = PreprocessConfig()
FP = "ckpt-fingerprint-0123"
DATA = bytes(range(256)) * 1000


def test_key_is_64_hex_and_deterministic() -> None:
    k = media_key(DATA, "image", CFG, FP)
    assert len(k) == 64 and all(c in "0123456789abcdef" for c in k)
    assert media_key(bytes(DATA), "image", PreprocessConfig(), FP) == k


def test_every_input_changes_the_key() -> None:
    base = media_key(DATA, "image", CFG, FP)
    variants = [
        media_key(DATA[:-1], "image", CFG, FP),
        media_key(DATA[:-1] + b"\x01", "image", CFG, FP),
        media_key(DATA, "video", CFG, FP),
        media_key(DATA, "image", CFG, FP + "x"),
        media_key(DATA, "image", dataclasses.replace(CFG, max_pixels=CFG.max_pixels - 28 * 28), FP),
        media_key(DATA, "image", dataclasses.replace(CFG, fps=1.0), FP),
        media_key(DATA, "image", dataclasses.replace(CFG, image_mean=(0.5, 0.5, 0.5)), FP),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_key_is_not_a_plain_hash_of_the_bytes() -> None:
    # The params are part of the digest, so a bare sha256 of the media never equals a key.
    assert media_key(DATA, "image", CFG, FP) != hashlib.sha256(DATA).hexdigest()


def test_chunked_and_streamed_hashing_match_one_shot() -> None:
    one_shot = media_key(DATA, "video", CFG, FP)
    cuts = [0, 1, 1000, 77_777, len(DATA)]
    chunks = [DATA[a:b] for a, b in itertools.pairwise(cuts)]
    assert media_key_chunks(chunks, "video", CFG, FP) == one_shot
    hasher = MediaKeyHasher("video", CFG, FP)
    for c in chunks:
        hasher.update(memoryview(c))
    assert hasher.hexdigest() == one_shot
    assert hasher.hexdigest() == one_shot  # digest does not consume the state


def test_boundary_between_params_and_bytes_is_unambiguous() -> None:
    # Moving bytes between the fingerprint and the media must not collide.
    assert media_key(b"ab", "image", CFG, "fp") != media_key(b"b", "image", CFG, "fpa")
    assert media_key(b"", "image", CFG, FP) != media_key(b"\x00", "image", CFG, FP)


def test_bad_modality_is_a_typed_error_naming_it() -> None:
    with pytest.raises(UnsupportedMedia, match="text"):
        media_key(DATA, "text", CFG, FP)
    with pytest.raises(ValueError, match="fingerprint"):
        media_key(DATA, "image", CFG, "")


def test_async_variant_matches_for_small_and_large_bodies() -> None:
    big = os.urandom(1 << 20)

    async def both() -> tuple[str, str]:
        return (
            await media_key_async(DATA[:100], "image", CFG, FP),
            await media_key_async(big, "image", CFG, FP),
        )

    small_k, big_k = asyncio.run(both())
    assert small_k == media_key(DATA[:100], "image", CFG, FP)
    assert big_k == media_key(big, "image", CFG, FP)


def test_same_key_in_a_fresh_process() -> None:
    code = (
        "from encoder.caches.media_key import media_key; from media_io.config import PreprocessConfig;"
        "print(media_key(bytes(range(256)) * 1000, 'image', PreprocessConfig(), 'ckpt-fingerprint-0123'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == media_key(DATA, "image", CFG, FP)


AUDIO = AudioSettings()


def test_image_keys_are_unchanged_by_audio_support() -> None:
    # Pinned: the key of these bytes as every release before audio derived it (image and video
    # keys must not move, or every cached embedding would be lost).
    assert media_key(b"abc", "image", CFG, "fp") == _pinned_key(b"abc", "image", CFG, "fp")
    assert media_key(DATA, "video", CFG, FP) == _pinned_key(DATA, "video", CFG, FP)


def _pinned_key(data: bytes, modality: str, cfg: PreprocessConfig, fp: str) -> str:
    """The v1 key derivation written out (domain tag, params JSON, bytes, length trailer)."""
    import json
    import struct

    params = json.dumps(
        {"modality": modality, "preprocess": cfg.key_params(), "fingerprint": fp},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode()
    h = hashlib.sha256(b"epd-media-key/v1\0" + struct.pack("<I", len(params)) + params + data)
    h.update(struct.pack("<Q", len(data)))
    return h.hexdigest()


def test_audio_settings_change_the_audio_key() -> None:
    base = media_key(DATA, "audio", AUDIO, FP)
    variants = [
        media_key(DATA[:-1], "audio", AUDIO, FP),
        media_key(DATA, "audio", AUDIO, FP + "x"),
        media_key(DATA, "audio", AudioSettings(AudioConfig(sample_rate=16000)), FP),
        media_key(DATA, "audio", AudioSettings(AudioConfig(n_mels=80)), FP),
        media_key(DATA, "audio", AudioSettings(AudioConfig(log_floor=1e-5)), FP),
        media_key(DATA, "audio", AudioSettings(rule=AudioTokenRule(group_size=2)), FP),
        media_key(DATA, "audio", AudioSettings(rule=AudioTokenRule(segment_size=3000)), FP),
        media_key(DATA, "image", CFG, FP),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert media_key(DATA, "audio", AudioSettings(), FP) == base  # equal settings, equal key
    assert AudioSettings.from_dict(AUDIO.to_dict()) == AUDIO


def test_settings_must_match_the_modality() -> None:
    with pytest.raises(TypeError, match="AudioSettings"):
        media_key(DATA, "audio", CFG, FP)
    with pytest.raises(TypeError, match="PreprocessConfig"):
        media_key(DATA, "image", AUDIO, FP)
