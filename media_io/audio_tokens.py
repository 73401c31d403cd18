"""How many ``<|audio_pad|>`` rows an audio clip becomes: the rule of MiMo-V2.5's processor, from
its ``processor_config`` fields (``audio_kernel_size``, ``audio_stride_size``, ``audio_avg_pooler``,
``audio_group_size``, ``audio_segment_size``).

    mel frames T ──conv k, pad 1 (same length)──▶ T ──conv k, stride s, pad 1──▶ (T + 2 - k) // s + 1
    ──average pool p (ceil)──▶ ceil(. / p) ──groups of g frames (ceil)──▶ pads

At 24 kHz and hop 240 that is 100 mel frames, 50 codes, 25 pooled frames and 6.25 pads per second.
The audio tokenizer runs on segments of ``segment_size`` mel frames (60 s); with an even segment
size the strided conv gives the same count per segment as over the whole clip, so the count of a
long clip is the count of its frames (``segment_lengths`` says where the segments fall).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AudioTokenRule:
    kernel_size: int = 3
    stride_size: int = 2
    avg_pooler: int = 2
    group_size: int = 4
    segment_size: int = 6000  # mel frames per tokenizer pass (60 s at 100 frames per second)

    def __post_init__(self) -> None:
        for name in ("kernel_size", "stride_size", "avg_pooler", "group_size", "segment_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AudioTokenRule.{name} must be a positive int, got {value!r}")

    def code_frames(self, mel_frames: int) -> int:
        """Frames out of the tokenizer's two convolutions (its codes) for ``mel_frames`` in."""
        same = mel_frames + 3 - self.kernel_size
        return (same + 2 - self.kernel_size) // self.stride_size + 1

    def pooled_frames(self, mel_frames: int) -> int:
        """Frames after the average pooler: the rows the LLM-side tower groups."""
        return -(-self.code_frames(mel_frames) // self.avg_pooler)

    def pad_count(self, mel_frames: int) -> int:
        """``<|audio_pad|>`` tokens of a clip of ``mel_frames`` (one per group)."""
        if mel_frames <= 0:
            raise ValueError(f"an audio clip has at least one mel frame, got {mel_frames}")
        return -(-self.pooled_frames(mel_frames) // self.group_size)

    def segment_lengths(self, mel_frames: int) -> list[int]:
        """The tokenizer's segments of a clip: whole ``segment_size`` runs, then the remainder."""
        full, rest = divmod(mel_frames, self.segment_size)
        return [self.segment_size] * full + ([rest] if rest else [])
