"""AudioSettings: everything that turns an audio clip's bytes into its ``<|audio_pad|>`` rows
besides the model's weights, as one frozen value: the decode rate and log-mel (``AudioConfig``)
and the pad-count rule (``AudioTokenRule``: kernel, stride, pooler, group, segment size).

It is what an audio MediaKey folds in next to the encoder's fingerprint
(``encoder.caches.media_key``), the audio counterpart of ``PreprocessConfig`` for images and
videos; the worker reports it in /health (``to_dict``) and the ingress rebuilds it from there
(``from_dict``) so that both derive the same keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from media_io.audio_config import AudioConfig
from media_io.audio_tokens import AudioTokenRule
from media_io.config import PreprocessConfig

# MiMo-V2.5's pads per second of sound: audio_input_id_per_second 25 / audio_group_size 4
TOKENS_PER_SECOND = 25.0 / 4


@dataclass(frozen=True)
class AudioSettings:
    audio: AudioConfig = field(default_factory=AudioConfig)
    rule: AudioTokenRule = field(default_factory=AudioTokenRule)
    # Pads per second of sound (``audio_input_id_per_second / audio_group_size``, 25 / 4): where a
    # video's sound track is cut (``media_io.audio_track``) and how its pads follow the frames.
    tokens_per_second: float = TOKENS_PER_SECOND
    # Set for a video's sound track: the video's settings, whose sampled frames decide which of the
    # track's rows are kept (``for_track``). None: a clip of its own, every row kept.
    track_of: PreprocessConfig | None = None

    def __post_init__(self) -> None:
        if not self.tokens_per_second > 0:
            raise ValueError(f"AudioSettings.tokens_per_second must be > 0, got {self.tokens_per_second!r}")
        object.__setattr__(self, "tokens_per_second", float(self.tokens_per_second))

    def for_track(self, video: PreprocessConfig) -> AudioSettings:
        """These settings for the sound track of a video preprocessed with ``video``."""
        return dataclasses.replace(self, track_of=video)

    def key_params(self) -> dict[str, object]:
        """Every field of both parts (each one changes the rows or their count); for a track also
        what cuts it: the pads per second and the video's frame sampling."""
        params: dict[str, object] = {
            "audio": self.audio.key_params(),
            "tokens": dataclasses.asdict(self.rule),
        }
        v = self.track_of
        if v is not None:
            params["track"] = {
                "tokens_per_second": self.tokens_per_second,
                "video_sampling": v.video_sampling,
                "fps": v.fps,
                "min_frames": v.min_frames,
                "max_frames": v.max_frames,
                "temporal_patch_size": v.temporal_patch_size,
            }
        return params

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (/health); ``from_dict`` reads it back to an equal value (a track's
        video settings are the reader's own: ``for_track``)."""
        return {
            "audio": self.audio.key_params(),
            "rule": dataclasses.asdict(self.rule),
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioSettings:
        return cls(
            AudioConfig(**d["audio"]),
            AudioTokenRule(**d["rule"]),
            float(d.get("tokens_per_second", TOKENS_PER_SECOND)),
        )
