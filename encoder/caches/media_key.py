"""MediaKey: the name of an embedding, derived from everything that changes it.

The key is a sha256 hex digest over one canonical byte string::

    b"epd-media-key/v1\\0"                 domain tag (bump the version to re-key everything)
    u32 len(params) || params            canonical JSON: modality, preprocessing, fingerprint
    media bytes                          the raw compressed bytes, hashed in chunks
    u64 len(media)                       trailer: no (params, media) pair aliases another

Canonical JSON means sorted keys, no whitespace, ASCII only and no NaN, so the same inputs give
the same key in every process and on every machine (Python's ``hash()`` is salted per process and
is never used). A client-supplied id is never part of the key.

Hashing 64 MiB takes ~100 ms: on an event loop call ``media_key_async`` (or run ``media_key`` in
an executor yourself). hashlib releases the GIL on large updates, so a thread pool scales.

"Preprocessing" is the settings of the item's modality: ``PreprocessConfig.key_params()`` for an
image or a video, ``AudioSettings.key_params()`` (the log-mel and the pad-count rule) for audio. An
image or video key is the same bytes whatever audio settings exist; the fingerprint of an audio key
is the audio encoder's (its weights), not the vision tower's.

This module knows nothing of decoding or of where embeddings are stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from collections.abc import Iterable
from concurrent.futures import Executor

from media_io.audio_settings import AudioSettings
from media_io.config import PreprocessConfig
from media_io.errors import UnsupportedMedia

MODALITIES: tuple[str, ...] = ("image", "video", "audio")
# The settings a modality's key folds in: PreprocessConfig for pixels, AudioSettings for audio.
KeySettings = PreprocessConfig | AudioSettings
_DOMAIN = b"epd-media-key/v1\0"
# Hash in chunks so that a memoryview of a huge body is never copied as a whole.
CHUNK_BYTES = 1 << 20
# Bodies below this are hashed inline by media_key_async: an executor hop costs more than the hash.
INLINE_BYTES = 256 * 1024


def canonical_params(modality: str, preprocess: KeySettings, fingerprint: str) -> bytes:
    """The canonical JSON of everything except the media bytes that goes into the key."""
    if modality not in MODALITIES:
        raise UnsupportedMedia(f"modality must be one of {list(MODALITIES)}, got {modality!r}")
    if (modality == "audio") != isinstance(preprocess, AudioSettings):
        want = "AudioSettings" if modality == "audio" else "PreprocessConfig"
        raise TypeError(f"a {modality} key needs {want}, got {type(preprocess).__name__}")
    if not fingerprint:
        raise ValueError("media_key needs the encoder checkpoint fingerprint, got an empty string")
    doc = {"modality": modality, "preprocess": preprocess.key_params(), "fingerprint": fingerprint}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class MediaKeyHasher:
    """Incremental MediaKey for bodies that arrive in chunks (a streamed download).

    ``MediaKeyHasher(...).update(a).update(b).hexdigest() == media_key(a + b, ...)``.
    """

    def __init__(self, modality: str, preprocess: KeySettings, fingerprint: str) -> None:
        params = canonical_params(modality, preprocess, fingerprint)
        self._h = hashlib.sha256(_DOMAIN)
        self._h.update(struct.pack("<I", len(params)))
        self._h.update(params)
        self._nbytes = 0

    def update(self, chunk: bytes | bytearray | memoryview) -> MediaKeyHasher:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), CHUNK_BYTES):
            self._h.update(view[start : start + CHUNK_BYTES])
        self._nbytes += len(view)
        return self

    def hexdigest(self) -> str:
        """The key; the hasher can keep being updated (the digest is taken on a copy)."""
        h = self._h.copy()
        h.update(struct.pack("<Q", self._nbytes))
        return h.hexdigest()


def media_key(
    data: bytes | bytearray | memoryview, modality: str, preprocess: KeySettings, fingerprint: str
) -> str:
    """The 64-hex-digit MediaKey of one item's raw bytes. Pure and deterministic."""
    return MediaKeyHasher(modality, preprocess, fingerprint).update(data).hexdigest()


def media_key_chunks(
    chunks: Iterable[bytes | bytearray | memoryview],
    modality: str,
    preprocess: KeySettings,
    fingerprint: str,
) -> str:
    """The same key as ``media_key(b"".join(chunks), ...)`` without joining the chunks."""
    hasher = MediaKeyHasher(modality, preprocess, fingerprint)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


async def media_key_async(
    data: bytes | bytearray | memoryview,
    modality: str,
    preprocess: KeySettings,
    fingerprint: str,
    executor: Executor | None = None,
) -> str:
    """``media_key`` that keeps the event loop free: large bodies are hashed in ``executor``
    (the loop's default thread pool when None)."""
    if len(memoryview(data).cast("B")) < INLINE_BYTES:
        return media_key(data, modality, preprocess, fingerprint)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, media_key, data, modality, preprocess, fingerprint)
