"""Log-mel features against torchaudio's MelSpectrogram (the processor MiMo-V2.5 ships calls it),
batching, and the pad-count rule against the documented arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
import torchaudio

from media_io.audio_config import AudioConfig
from media_io.audio_features import log_mel, mel_frames
from media_io.audio_tokens import AudioTokenRule


def _reference(clip: torch.Tensor, cfg: AudioConfig) -> torch.Tensor:
    """The processor's features: torchaudio's spectrogram, then log(clip(., 1e-7)), [T, n_mels]."""
    spec = torchaudio.transforms.MelSpectrogram(
        sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, hop_length=cfg.hop_length,
        win_length=cfg.window_size, f_min=cfg.f_min, f_max=cfg.f_max, n_mels=cfg.n_mels,
        power=1.0, center=True,
    )(clip[None])  # fmt: skip
    return torch.log(torch.clip(spec, min=1e-7))[0].transpose(0, 1)


def _speechlike(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n) / 24000
    voiced = 0.3 * torch.sin(2 * math.pi * 180 * t) * (1 + torch.sin(2 * math.pi * 3 * t))
    return (voiced + 0.05 * torch.randn(n, generator=g)).float()


@pytest.mark.parametrize("seconds", [0.1, 1.0, 7.31])
def test_features_match_torchaudio(seconds: float) -> None:
    cfg = AudioConfig()
    clip = _speechlike(int(seconds * cfg.sample_rate), seed=int(seconds * 100))
    ours = log_mel([clip], cfg)[0]
    ref = _reference(clip, cfg)
    assert ours.shape == ref.shape == (mel_frames(len(clip), cfg), 128)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_silence_hits_the_floor() -> None:
    ours = log_mel([torch.zeros(2400)])[0]
    assert torch.equal(ours, torch.full_like(ours, math.log(1e-7)))


def test_other_settings_match_torchaudio() -> None:
    cfg = AudioConfig(
        sample_rate=16000, n_fft=512, window_size=400, hop_length=160, n_mels=80, f_min=20.0, f_max=7600.0
    )
    clip = _speechlike(16000, seed=5)
    assert (log_mel([clip], cfg)[0] - _reference(clip, cfg)).abs().max().item() <= 1e-4


def test_a_batch_gives_each_clip_its_own_rows() -> None:
    # each clip framed on its own: only the BLAS blocking of the shared matmul may differ (1 ulp)
    clips = [_speechlike(n, seed=n) for n in (2400, 24000, 13337, 600)]
    batched = log_mel(clips)
    for clip, rows in zip(clips, batched, strict=True):
        alone = log_mel([clip])[0]
        assert rows.shape == alone.shape
        torch.testing.assert_close(rows, alone, rtol=0, atol=1e-6)


def _documented_pads(seconds: float) -> int:
    """MiMo-V2.5's pad count, step by step as documented: 100 mel frames per second (centred, so
    one more), the tokenizer's two k=3 convolutions (padding 1; the second strides 2), the average
    pooler of 2 and groups of 4, each rounding up."""
    samples = round(seconds * 24000)
    t = samples // 240 + 1
    t = t + 3 - 3
    t = (t + 2 - 3) // 2 + 1
    t = math.ceil(t / 2)
    return math.ceil(t / 4)


@pytest.mark.parametrize("seconds", [0.1, 1.0, 59.9, 60.0, 60.1, 600.0])
def test_pad_counts_follow_the_documented_rule(seconds: float) -> None:
    cfg, rule = AudioConfig(), AudioTokenRule()
    frames = mel_frames(round(seconds * cfg.sample_rate), cfg)
    assert rule.pad_count(frames) == _documented_pads(seconds)
    # about 6.25 per second
    assert abs(rule.pad_count(frames) - 6.25 * seconds) <= 2


@pytest.mark.parametrize("seconds", [59.9, 60.0, 60.1, 600.0, 61.37])
def test_segments_give_the_clip_count(seconds: float) -> None:
    """The tokenizer runs 60 s segments: their code frames add up to the whole clip's, and so do
    the pooled frames the pads are grouped from."""
    rule = AudioTokenRule()
    frames = mel_frames(round(seconds * 24000), AudioConfig())
    segments = rule.segment_lengths(frames)
    assert sum(segments) == frames and all(0 < s <= 6000 for s in segments)
    assert sum(rule.code_frames(s) for s in segments) == rule.code_frames(frames)
    assert sum(rule.pooled_frames(s) for s in segments) == rule.pooled_frames(frames)
