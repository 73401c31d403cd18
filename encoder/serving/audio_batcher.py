"""Cross-request batching for the audio encoder: ``AudioBatcher``, a ``ForwardBatcher`` whose items
are clips' log-mels ([T, n_mels], on the model's device) and whose unit is a mel frame
(``encoder.serving.forward_batcher`` has the queue, the dispatch and the forward streams).

Clips from different requests are packed into one call of ``MiMoAudioEncoder``, which cuts every
clip into ``segment_size`` (60 s) segments and runs all segments of the batch as one packed
tokenizer pass; nothing crosses a segment, so a clip's rows do not depend on its companions.

A clip longer than one segment is split at segment boundaries into parts of whole segments, as many
parts as there are forward streams (none larger than the budget), so a long clip's forwards run on
several streams at once:

    clip of 10 min, 2 streams, budget 4 segments:  [ s0 s1 s2 s3 ][ s4 s5 s6 s7 ][ s8 s9 ]
    clip of 10 min, 4 streams:                     [ s0 s1 s2 ][ s3 s4 s5 ][ s6 s7 s8 ][ s9 ]

When a segment's codes fill whole groups (6000 frames -> 1500 codes -> 375 groups) no group
straddles two segments, so a clip's rows are its parts' rows one after the other
(``MiMoAudioEncoder``'s docstring); otherwise a group would straddle two parts, and the clip is
never split.

This module knows nothing of HTTP, audio decoding or the embedding cache.
"""

from __future__ import annotations

import torch

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.serving.forward_batcher import ForwardBatcher

# Mel frames in one forward by default: 4 segments (4 minutes at 100 frames per second).
DEFAULT_SEGMENTS_PER_FORWARD = 4
# At least an hour of audio may wait (360000 frames, ~180 MB of float32 mels at 128 bands).
MIN_QUEUE_FRAMES = 400_000


class AudioBatcher(ForwardBatcher[torch.Tensor]):
    """Batches clips' log-mels ([T, n_mels]) into shared forwards of ``model``; each result is the
    clip's ``<|audio_pad|>`` rows [pad_count(T), out_hidden]."""

    def __init__(
        self,
        model: MiMoAudioEncoder,
        frame_budget: int | None = None,
        max_wait_ms: float = 5.0,
        max_queue_frames: int | None = None,
        output_device: str | torch.device = "cpu",
        forward_streams: int = 1,
    ) -> None:
        segment = model.tower.cfg.rule.segment_size
        budget = frame_budget if frame_budget is not None else DEFAULT_SEGMENTS_PER_FORWARD * segment
        super().__init__(
            budget,
            max_wait_ms,
            max_queue_frames if max_queue_frames is not None else max(8 * budget, MIN_QUEUE_FRAMES),
            output_device,
            forward_streams,
            unit="mel frames",
            thread_name="epd-encoder-audio",
        )
        self.model = model
        self.segment = segment
        rule = model.tower.cfg.rule
        # whether a segment's codes fill whole groups (then parts of whole segments are independent)
        self.splittable = (
            segment % rule.stride_size == 0 and rule.pooled_frames(segment) % rule.group_size == 0
        )

    def _validate(self, mel: torch.Tensor) -> int:
        n_mels = self.model.tower.cfg.n_mels
        if mel.dim() != 2 or mel.shape[0] == 0 or mel.shape[1] != n_mels:
            raise ValueError(f"a clip's log-mel is [T >= 1, {n_mels}], got {tuple(mel.shape)}")
        return int(mel.shape[0])

    def _split(self, mel: torch.Tensor) -> list[torch.Tensor]:
        """Parts of whole segments (see the module docstring); the clip itself when it is one
        segment, the streams are one, or a segment's codes do not fill whole groups."""
        frames, seg = mel.shape[0], self.segment
        segments = -(-frames // seg)
        if segments == 1 or self.forward_streams == 1 or not self.splittable:
            return [mel]
        per = max(1, min(self.budget // seg, -(-segments // self.forward_streams)))  # segments per part
        step = per * seg
        return [mel[a : a + step] for a in range(0, frames, step)]

    def _forward(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            out = self.model(items)
            rows = out.rows.to(self.output_device)  # [sum pad_counts, out_hidden]
        # Clone so one kept embedding does not pin the whole batch's output buffer.
        return [part.clone() for part in rows.split(list(out.pad_counts))] if len(items) > 1 else [rows]
