"""The benchmark's media: a generated corpus of camera-like JPEGs and 1-minute video clips.

Base images are synthetic photos (``media_io.preprocess.synthetic``) at sizes from 448x448 up to
1920x1080; clips are H.264 MP4 from the test clip factory (``tests.fixtures.video_factory``). Both
are generated once and cached as files under a directory, keyed by their parameters, so a second
run starts at once.

Cold-cache requests need *new bytes* every time (the MediaKey hashes the raw bytes) while doing
the same decode work as the base image. :func:`unique_variant` gets both by inserting a JPEG
comment (COM) segment carrying a nonce right after the SOI marker (for MP4 clips: a trailing
``free`` box):

    base:     FF D8 | FF E0 APP0 ... | FF DB ... | FF DA scan ... | FF D9
    variant:  FF D8 | FF FE len "epd-bench <nonce>" | FF E0 APP0 ... (unchanged)

Decoders skip COM segments, so the pixels (and the decode, resize and forward cost) are those of
the base image, but every byte-hashing cache, ours included, sees a new image.

This module knows nothing of HTTP or of the services under test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from media_io.preprocess.synthetic import encode, synthetic_photo
from tests.fixtures.video_factory import make_clip

# (width, height): a spread from the smallest common upload to 1080p, landscape and portrait.
DEFAULT_IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (448, 448),
    (640, 480),
    (800, 600),
    (720, 1280),
    (1024, 768),
    (1280, 720),
    (1600, 900),
    (1920, 1080),
)
QUICK_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((448, 448), (640, 480))

_SOI = b"\xff\xd8"
_COM = b"\xff\xfe"


class CorpusItem(NamedTuple):
    """One base media file of the corpus."""

    name: str  # file name under the corpus dir, also its name on the media server
    data: bytes
    content_type: str
    width: int
    height: int


def default_corpus_dir() -> Path:
    """Where generated media is cached: ``$EPD_HOME/bench-media`` (default ~/.cache/epd/bench-media)."""
    from epd_common.settings import epd_home

    return epd_home() / "bench-media"


def _cached(path: Path, make: object) -> bytes:
    """Read ``path``, or write ``make()`` to it atomically (tmp + rename) and return it."""
    if path.is_file():
        return path.read_bytes()
    assert callable(make)
    data: bytes = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{id(data)}")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


def image_corpus(
    root: Path,
    sizes: Sequence[tuple[int, int]] = DEFAULT_IMAGE_SIZES,
    seed: int = 0,
    quality: int = 90,
) -> list[CorpusItem]:
    """One JPEG per size (synthetic photo, ``quality``), generated once under ``root/images``."""
    out: list[CorpusItem] = []
    for i, (w, h) in enumerate(sizes):
        name = f"img-{w}x{h}-s{seed + i}-q{quality}.jpg"
        data = _cached(
            root / "images" / name,
            lambda w=w, h=h, i=i: encode(synthetic_photo(w, h, seed=seed + i), "JPEG", quality),
        )
        out.append(CorpusItem(name, data, "image/jpeg", w, h))
    return out


def unique_variant(data: bytes, nonce: str) -> bytes:
    """``data`` (JPEG or MP4) made into new bytes that decode to the same pixels.

    JPEG: a COM segment holding ``nonce`` after SOI. MP4: a top-level ``free`` box holding
    ``nonce`` appended after the last box (players and demuxers skip ``free`` boxes).
    """
    payload = f"epd-bench {nonce}".encode()
    if data.startswith(_SOI):
        if len(payload) + 2 > 0xFFFF:
            raise ValueError(f"nonce too long for a JPEG segment: {len(nonce)} bytes")
        segment = _COM + (len(payload) + 2).to_bytes(2, "big") + payload
        return _SOI + segment + data[len(_SOI) :]
    if data[4:8] == b"ftyp":
        return data + (len(payload) + 8).to_bytes(4, "big") + b"free" + payload
    raise ValueError("unique_variant needs JPEG or MP4 bytes (no SOI marker or ftyp box found)")


def video_corpus(
    root: Path,
    count: int = 2,
    seconds: float = 60.0,
    width: int = 640,
    height: int = 360,
    fps: float = 24.0,
) -> list[CorpusItem]:
    """``count`` H.264 MP4 clips of ``seconds`` each (keyframe every 2 s), generated once.

    Clips differ by their encoder quality (crf), so every clip has distinct bytes.
    """
    out: list[CorpusItem] = []
    for i in range(count):
        name = f"clip-{width}x{height}-{fps:g}fps-{seconds:g}s-{i}.mp4"

        def make(i: int = i) -> bytes:
            data: bytes = make_clip(width, height, fps, seconds, keyint=max(1, round(2 * fps)), crf=23 + i)
            return data

        out.append(CorpusItem(name, _cached(root / "videos" / name, make), "video/mp4", width, height))
    return out


def digest(data: bytes) -> str:
    """A short content digest for logs and JSON (not a MediaKey)."""
    return hashlib.sha256(data).hexdigest()[:16]
