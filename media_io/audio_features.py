"""Log-mel features of mono clips, batched over clips, in torch on any device.

    clip [N] ──reflect-pad n_fft/2 each side──▶ frames [N // hop + 1, n_fft] (Hann window, zero
    padded to n_fft where the window is shorter) ──rfft, |.|^power──▶ [T, n_fft/2 + 1]
    ──@ mel filters [n_fft/2 + 1, n_mels]──▶ [T, n_mels] ──log(clamp(., floor))──▶ features

Every clip is framed on its own (its reflect padding is its own), then the frames of all clips go
through one FFT and one matmul: a batch gives each clip the rows it gets alone (to the rounding of
the matmul's blocking, an ulp).

The mel filters are triangles on the HTK mel scale, ``mel(f) = 2595 log10(1 + f / 700)``: n_mels + 2
points evenly spaced in mel between f_min and f_max; filter m rises linearly from point m to
point m + 1 and falls to point m + 2, evaluated at the FFT bin frequencies k * sr / n_fft, with no
area normalisation. That is the spectrogram MiMo-V2.5's processor computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from media_io.audio_config import AudioConfig


def mel_frames(num_samples: int, cfg: AudioConfig) -> int:
    """Rows of ``log_mel`` for a clip of ``num_samples`` (centred frames: one per hop, plus one)."""
    return num_samples // cfg.hop_length + 1


def log_mel(clips: Sequence[Tensor], cfg: AudioConfig = AudioConfig()) -> list[Tensor]:
    """One [T_i, n_mels] float32 tensor per clip ([N_i] float32, mono, at ``cfg.sample_rate``),
    on the clips' device. A clip shorter than n_fft / 2 + 1 samples cannot be reflect-padded and
    is padded with zeros beyond its end first (its row count is unchanged)."""
    if not clips:
        return []
    device = clips[0].device
    half = cfg.n_fft // 2
    framed = [_frames(c.to(device=device, dtype=torch.float32), half, cfg) for c in clips]
    counts = [f.shape[0] for f in framed]
    window = _window(cfg, device)  # [n_fft]
    spectrum = torch.fft.rfft(torch.cat(framed) * window, n=cfg.n_fft)  # [sum T_i, n_fft/2 + 1]
    magnitude = spectrum.abs()
    if cfg.power != 1.0:
        magnitude = magnitude.pow(cfg.power)
    mel = magnitude @ _filters(cfg, device)  # [sum T_i, n_mels]
    return list(torch.log(torch.clamp(mel, min=cfg.log_floor)).split(counts))


def _frames(clip: Tensor, half: int, cfg: AudioConfig) -> Tensor:
    """[T, n_fft] overlapping frames of ``clip`` [N], centred: T = N // hop + 1."""
    n = clip.shape[0]
    rows = n // cfg.hop_length + 1
    if n <= half:  # reflect padding needs more samples than it mirrors
        clip = torch.nn.functional.pad(clip, (0, half + 1 - n))
    padded = torch.nn.functional.pad(clip[None, None], (half, half), mode="reflect")[0, 0]
    return padded.unfold(0, cfg.n_fft, cfg.hop_length)[:rows]


@lru_cache(maxsize=8)
def _window_cpu(cfg: AudioConfig) -> Tensor:
    """A periodic Hann window of ``window_size``, centred in ``n_fft`` zeros."""
    w = torch.hann_window(cfg.window_size, periodic=True, dtype=torch.float32)
    left = (cfg.n_fft - cfg.window_size) // 2
    return torch.nn.functional.pad(w, (left, cfg.n_fft - cfg.window_size - left))


def _window(cfg: AudioConfig, device: torch.device) -> Tensor:
    return _window_cpu(cfg).to(device)


@lru_cache(maxsize=8)
def _filters_cpu(cfg: AudioConfig) -> Tensor:
    """[n_fft/2 + 1, n_mels] float32 triangular filters (see the module docstring), computed in
    float64 then rounded once."""
    f_max = cfg.sample_rate / 2 if cfg.f_max is None else cfg.f_max
    bins = torch.linspace(0, cfg.sample_rate / 2, cfg.n_fft // 2 + 1, dtype=torch.float64)  # Hz
    lo, hi = _hz_to_mel(cfg.f_min), _hz_to_mel(f_max)
    points = _mel_to_hz(torch.linspace(lo, hi, cfg.n_mels + 2, dtype=torch.float64))  # [n_mels + 2] Hz
    widths = points[1:] - points[:-1]  # [n_mels + 1]
    offsets = points[None, :] - bins[:, None]  # [bins, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]  # 0 at point m, 1 at point m + 1
    falling = offsets[:, 2:] / widths[1:]  # 1 at point m + 1, 0 at point m + 2
    return torch.clamp(torch.minimum(rising, falling), min=0.0).to(torch.float32)


def _filters(cfg: AudioConfig, device: torch.device) -> Tensor:
    return _filters_cpu(cfg).to(device)


def _hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: Tensor) -> Tensor:
    return 700.0 * (torch.pow(10.0, mel / 2595.0) - 1.0)
