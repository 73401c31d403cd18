"""The encoder worker's audio path: what a worker with an audio encoder does with a clip besides
what every item goes through (MediaKey, node cache, store tier, single-flight, admission:
``worker_app``).

    bytes ──decode_audio (24 kHz mono, caps)──▶ samples [N] ──log_mel (torch, on the encoder's
    device)──▶ mel [T, n_mels]        (both in the worker's decode pool: ``mel``)
    mel ──AudioBatcher (clips of several requests in one encoder call)──▶ rows [pads, hidden]

Keys: an audio MediaKey folds ``AudioSettings`` (rate, log-mel, pad-count rule) and
``fingerprint`` (the audio encoder's weights and the log-mel implementation), never the vision
tower's, so image and video keys do not depend on whether a worker has an audio encoder.
The log-mel is ours (``media_io.audio_features``, "torch"); torchaudio is not used at runtime.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from encoder.models.audio_checkpoint import LoadedAudioEncoder
from encoder.serving.audio_batcher import AudioBatcher
from encoder.serving.forward_batcher import EncodeResult
from media_io.audio import decode_audio
from media_io.audio_features import log_mel
from media_io.config import MediaLimits

LOG_MEL_PATH = "torch"  # what /health paths.log_mel reports (our own implementation)


def audio_serving_fingerprint(audio_fingerprint: str, mel_path: str = LOG_MEL_PATH) -> str:
    """What every audio MediaKey of a worker folds in: the audio encoder's weights and the log-mel
    implementation (another implementation keys apart)."""
    return hashlib.sha256(f"{audio_fingerprint}|log_mel={mel_path}".encode()).hexdigest()


class AudioPath:
    """A worker's audio encoder with its batcher."""

    def __init__(self, audio: LoadedAudioEncoder, max_wait_ms: float, forward_streams: int) -> None:
        self.audio = audio
        self.settings = audio.settings
        self.fingerprint = audio_serving_fingerprint(audio.fingerprint)
        self.batcher = AudioBatcher(audio.model, max_wait_ms=max_wait_ms, forward_streams=forward_streams)
        self.device = audio.model.tokenizer.conv1.weight.device

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def warm_up(self) -> None:
        """One short forward before serving (kernel selection, allocator growth)."""
        frames = min(100, self.settings.rule.segment_size)
        with torch.inference_mode():
            self.audio.model([torch.zeros(frames, self.settings.audio.n_mels, device=self.device)])

    def mel(
        self,
        data: bytes,
        limits: MediaLimits,
        item: str | None,
        timings: dict[str, float],
        until_s: float | None = None,
    ) -> torch.Tensor:
        """Runs in the decode pool: the clip's log-mel [T, n_mels] float32 on the encoder's device
        (of its first ``until_s`` seconds or a little more, when given). Fills timings["decode"]
        and timings["preprocess"] (the log-mel), in ms. Raises the ``MediaError`` of
        ``decode_audio`` (naming ``item``) for a bad clip."""
        t0 = time.perf_counter()
        clip = decode_audio(data, self.settings.audio, limits, item, until_s)
        t1 = time.perf_counter()
        samples = torch.from_numpy(clip.samples).to(self.device)  # [N] float32 mono
        with torch.inference_mode():
            mel = log_mel([samples], self.settings.audio)[0]  # [N // hop + 1, n_mels]
        timings["decode"] = (t1 - t0) * 1000.0
        timings["preprocess"] = (time.perf_counter() - t1) * 1000.0
        return mel

    @property
    def segment_s(self) -> float:
        """Seconds of sound the audio tokenizer encodes on its own (``AudioTokenRule``)."""
        audio = self.settings.audio
        return self.settings.rule.segment_size * audio.hop_length / audio.sample_rate

    async def rows(self, mel: torch.Tensor) -> EncodeResult:
        """The clip's rows [pad_count(T), hidden], one per ``<|audio_pad|>``."""
        return await self.batcher.encode_timed(mel)

    def health(self) -> dict[str, Any]:
        """What the ingress needs to key audio as this worker does, and the batcher's load."""
        s = self.batcher.stats()
        return {
            "fingerprint": self.fingerprint,
            "settings": self.settings.to_dict(),
            "out_hidden_size": self.audio.out_hidden_size,
            "queue_frames": s.queue_patches,
            "batches": s.batches,
        }
