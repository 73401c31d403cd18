"""Frozen settings of audio preprocessing: everything that changes an audio clip's features, so
that the whole of it can enter the clip's MediaKey.

The defaults are MiMo-V2.5's ``processor_config`` audio fields: 24 kHz mono, a log-mel of 128 bands
from a 960-point STFT (40 ms Hann window) every 240 samples (10 ms, 100 frames per second),
magnitude (power 1), frames centred on their sample, ``log(clamp(mel, 1e-7))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class AudioConfig:
    sample_rate: int = 24000
    n_fft: int = 960
    window_size: int = 960
    hop_length: int = 240
    n_mels: int = 128
    f_min: float = 0.0
    f_max: float | None = None  # None: the Nyquist frequency, sample_rate / 2
    power: float = 1.0
    log_floor: float = 1e-7

    def __post_init__(self) -> None:
        for name in ("sample_rate", "n_fft", "window_size", "hop_length", "n_mels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AudioConfig.{name} must be a positive int, got {value!r}")
        if self.window_size > self.n_fft:
            raise ValueError(
                f"AudioConfig.window_size ({self.window_size}) must not exceed n_fft ({self.n_fft})"
            )
        top = self.sample_rate / 2 if self.f_max is None else self.f_max
        if not 0.0 <= self.f_min < top <= self.sample_rate / 2:
            raise ValueError(
                f"AudioConfig needs 0 <= f_min < f_max <= sample_rate / 2, got f_min={self.f_min}, "
                f"f_max={self.f_max}, sample_rate={self.sample_rate}"
            )
        if not self.power > 0 or not self.log_floor > 0:
            raise ValueError(
                f"AudioConfig.power and log_floor must be positive, got {self.power}, {self.log_floor}"
            )
        # canonical types, so that equal settings key equally (0 and 0.0 Hz)
        object.__setattr__(self, "f_min", float(self.f_min))
        object.__setattr__(self, "power", float(self.power))
        object.__setattr__(self, "log_floor", float(self.log_floor))
        if self.f_max is not None:
            object.__setattr__(self, "f_max", float(self.f_max))

    @property
    def frames_per_second(self) -> float:
        """Mel frames per second of audio (MiMo-V2.5: 100)."""
        return self.sample_rate / self.hop_length

    def key_params(self) -> dict[str, object]:
        """Every field: each one changes the features (see ``PreprocessConfig.key_params``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
