"""MiMoAudioEncoder: log-mel clips -> ``<|audio_pad|>`` rows, the tokenizer and the tower together.

Each clip is cut into ``audio_segment_size`` (6000 frame, 60 s) segments plus a remainder
(``AudioTokenRule.segment_lengths``); all segments of all clips go through the tokenizer as one
packed batch (each segment on its own, see ``tokenizer``); each clip's codes are the concatenation
of its segments'; the tower groups each clip's codes and runs all groups as one batch. A clip of
T mel frames gives ``AudioTokenRule.pad_count(T)`` rows (checked).

With an even segment size a segment's code count is a multiple of the group size (6000 frames ->
1500 codes -> 375 groups), so no group straddles two segments: the rows of a long clip are the rows
of its 60 s pieces, each encoded as a clip, one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from encoder.kernels.attention import AttnBackend, resolve_backend
from encoder.models.mimo_audio.tokenizer import AudioTokenizerEncoder
from encoder.models.mimo_audio.tower import AudioTower


class AudioEncoding(NamedTuple):
    rows: torch.Tensor  # [sum of pad_counts, out_hidden_size], clips in order
    pad_counts: tuple[int, ...]  # rows per clip (= <|audio_pad|> tokens)
    codes: tuple[torch.Tensor, ...]  # per clip [T'_i, Q] int64, the tokenizer's codes


class MiMoAudioEncoder(nn.Module):
    def __init__(self, tokenizer: AudioTokenizerEncoder, tower: AudioTower) -> None:
        super().__init__()
        tc, wc = tokenizer.cfg, tower.cfg
        rule = wc.rule
        mismatch = [
            f"{name}: tokenizer {a}, processor {b}"
            for name, a, b in (
                ("kernel_size", tc.kernel_size, rule.kernel_size),
                ("stride_size", tc.stride_size, rule.stride_size),
                ("avg_pooler", tc.avg_pooler, rule.avg_pooler),
                ("n_mels", tc.n_mels, wc.n_mels),
            )
            if a != b
        ]
        if tc.num_quantizers < wc.audio_channels:
            mismatch.append(f"codebooks: tokenizer {tc.num_quantizers} < audio_channels {wc.audio_channels}")
        if mismatch:
            raise ValueError("audio tokenizer and audio_config disagree: " + "; ".join(mismatch))
        self.tokenizer = tokenizer
        self.tower = tower
        self.attn_backend: AttnBackend = "auto"

    def resolve_attention(self, device: torch.device) -> None:
        """Resolve an "auto" attention backend for ``device``, once, at load (``resolve_backend``)."""
        self.attn_backend = resolve_backend(self.attn_backend, device, self.tokenizer.cfg.head_dim)

    def forward(self, mels: Sequence[torch.Tensor], backend: AttnBackend | None = None) -> AudioEncoding:
        """Clips' log-mels, each [T_i, n_mels] -> rows and per-clip counts. ``backend``: the
        attention kernel (None: the one resolved at load)."""
        rule = self.tower.cfg.rule
        if not mels:
            raise ValueError("no audio clips to encode")
        for m in mels:
            if m.dim() != 2 or m.shape[0] == 0 or m.shape[1] != self.tower.cfg.n_mels:
                raise ValueError(
                    f"a clip's log-mel is [T >= 1, {self.tower.cfg.n_mels}], got {tuple(m.shape)}"
                )
        seg_lens = [rule.segment_lengths(m.shape[0]) for m in mels]
        flat = [t for segs in seg_lens for t in segs]
        weight = self.tokenizer.conv1.weight
        packed = torch.cat([m.to(device=weight.device, dtype=weight.dtype) for m in mels])  # [sum T, n_mels]
        out = self.tokenizer(packed, flat, self.attn_backend if backend is None else backend)
        per_clip = [
            sum(out.code_lengths[i : i + len(s)]) for i, s in zip(_offsets(seg_lens), seg_lens, strict=True)
        ]
        codes = tuple(torch.split(out.codes, per_clip))
        rows = self.tower(codes)
        counts = tuple(-(-n // self.tower.cfg.group_size) for n in per_clip)
        for m, n in zip(mels, counts, strict=True):
            assert n == rule.pad_count(m.shape[0]), (m.shape[0], n)
        return AudioEncoding(rows, counts, codes)


def _offsets(groups: Sequence[Sequence[int]]) -> list[int]:
    out, at = [], 0
    for g in groups:
        out.append(at)
        at += len(g)
    return out
