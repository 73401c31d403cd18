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


@dataclass(frozen=True)
class AudioSettings:
    audio: AudioConfig = field(default_factory=AudioConfig)
    rule: AudioTokenRule = field(default_factory=AudioTokenRule)

    def key_params(self) -> dict[str, object]:
        """Every field of both parts (each one changes the rows or their count)."""
        return {"audio": self.audio.key_params(), "tokens": dataclasses.asdict(self.rule)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (/health); ``from_dict`` reads it back to an equal value."""
        return {"audio": self.audio.key_params(), "rule": dataclasses.asdict(self.rule)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioSettings:
        return cls(AudioConfig(**d["audio"]), AudioTokenRule(**d["rule"]))
