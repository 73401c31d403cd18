"""The frozen MiMo audio tokenizer's encoder: log-mel segments -> RVQ codes.

Per segment of T mel frames (each segment alone: nothing crosses a segment, and the result of a
segment does not depend on what else is in the batch):

    mel [T, n_mels] -> conv1 (k3, pad 1) + GELU -> conv2 (k3, stride 2, pad 1) + GELU    [T2, d]
      T2 = ceil(T / 2); positions 0..T2-1 restart in every segment
    -> encoder layers (pre-LayerNorm): x += out(attn(LN(x)))  with RoPE on q, k and the layer's
       window (``AudioTokenizerConfig.layer_window``);  x += fc2(GELU(fc1(LN(x))))
    -> x += output of layer ``encoder_skip_layer_id`` (the skip); LayerNorm
    -> (avg_pooler 2) downsample: an odd T2 gets one zero row, then conv (k2, stride 2, no bias)
       + GELU + LayerNorm                                                           [T', d]
    -> RVQ (``rvq.ResidualVQ``)                                                     codes [T', Q]

Segments are packed back to back (``Segments``); the convolutions run on a zero-padded
[S, C, T_max] batch with everything past a segment's end zeroed before the next conv, so a short
segment sees the same zeros it would see alone. (The reference's batched path instead lets a
shorter segment's conv2 and downsample read its neighbours' padding: a conv1 output past the end,
a copy of the last row; a segment alone, or the longest of its batch, reads zeros as here.)

Parameter names are the checkpoint's below ``encoder.`` except the downsample conv
(``down_sample_layer.0`` -> ``down_sample``) and the codebooks (``quantizer.vq.layers.{c}._codebook.embed``
-> ``quantizer.embed_{c}``); ``weights`` maps them. The attention's k_proj has no bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from encoder.kernels.attention import AttnBackend
from encoder.kernels.segments import Segments, make_segments
from encoder.models.mimo_audio.rope import apply_rope, rope_cos_sin
from encoder.models.mimo_audio.rvq import ResidualVQ
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.window_attention import window_attention


class TokenizerOutput(NamedTuple):
    codes: torch.Tensor  # [sum T'_s, Q] int64, segments back to back
    code_lengths: tuple[int, ...]  # T'_s per segment


class TokenizerAttention(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, window: tuple[int, int]) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads, self.head_dim = cfg.encoder_attention_heads, cfg.head_dim
        self.window, self.causal = window, cfg.encoder_causal
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = window_attention(q, k, v, seg, self.window, self.causal, backend)  # [N, H, D]
        return self.out_proj(o.reshape(n, -1))


class TokenizerLayer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, window: tuple[int, int]) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn = TokenizerAttention(cfg, window)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cos, sin, seg, backend)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def _lengths_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[S, 1, width] bool: True inside each segment."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None])[:, None, :]


class AudioTokenizerEncoder(nn.Module):
    """mel segments -> codes. ``forward`` takes the segments packed; see the module docstring."""

    def __init__(self, cfg: AudioTokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, k = cfg.d_model, cfg.kernel_size
        self.conv1 = nn.Conv1d(cfg.n_mels, d, kernel_size=k, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=k, stride=cfg.stride_size, padding=1)
        self.layers = nn.ModuleList(
            [TokenizerLayer(cfg, cfg.layer_window(i)) for i in range(cfg.encoder_layers)]
        )
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.down_sample: nn.Conv1d | None = None
        self.down_sample_norm: nn.LayerNorm | None = None
        if cfg.avg_pooler != 1:
            self.down_sample = nn.Conv1d(d, d, cfg.avg_pooler, cfg.avg_pooler, bias=False)
            self.down_sample_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.quantizer = ResidualVQ(d, cfg.codebook_size)

    def _stem(self, mel: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Packed mel [sum T, n_mels] -> packed conv output [sum T2, d] and the T2 per segment."""
        cfg, dev = self.cfg, mel.device
        lens = torch.tensor(list(lengths), device=dev)
        width = max(lengths)
        batch = mel.new_zeros(len(lengths), width, mel.shape[1])  # [S, T_max, n_mels]
        batch[torch.arange(width, device=dev)[None, :] < lens[:, None]] = mel.to(batch.dtype)
        h = F.gelu(self.conv1(batch.transpose(1, 2)))  # [S, d, T_max]; conv1 keeps the length
        conv1_lens = lens + 3 - cfg.kernel_size
        h = h * _lengths_mask(conv1_lens, h.shape[2])  # what conv2 would read alone: zeros past the end
        h = F.gelu(self.conv2(h)).transpose(1, 2)  # [S, T2_max, d]
        out_lens = [cfg.conv_frames(t) for t in lengths]
        keep = torch.arange(h.shape[1], device=dev)[None, :] < torch.tensor(out_lens, device=dev)[:, None]
        return h[keep], out_lens  # [sum T2, d]

    def _downsample(self, x: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Packed [sum T2, d] -> [sum T', d] (zero row for an odd tail, conv, GELU, LayerNorm)."""
        assert self.down_sample is not None and self.down_sample_norm is not None
        p = self.cfg.avg_pooler
        dev = x.device
        width = -(-max(lengths) // p) * p
        lens = torch.tensor(list(lengths), device=dev)
        inside = torch.arange(width, device=dev)[None, :] < lens[:, None]  # [S, width]
        batch = x.new_zeros(len(lengths), width, x.shape[1])
        batch[inside] = x
        h = F.gelu(self.down_sample(batch.transpose(1, 2))).transpose(1, 2)  # [S, width / p, d]
        out_lens = [-(-t // p) for t in lengths]
        keep = torch.arange(h.shape[1], device=dev)[None, :] < torch.tensor(out_lens, device=dev)[:, None]
        return self.down_sample_norm(h[keep]), out_lens

    def features(
        self, mel: torch.Tensor, lengths: Sequence[int], backend: AttnBackend = "auto"
    ) -> tuple[torch.Tensor, list[int]]:
        """Packed mel [sum T, n_mels] (segments of ``lengths`` frames) -> pre-RVQ features [sum T', d]."""
        if not lengths or min(lengths) <= 0 or sum(lengths) != mel.shape[0]:
            raise ValueError(f"segment lengths {list(lengths)[:8]} do not cover {mel.shape[0]} mel frames")
        x, conv_lens = self._stem(mel, lengths)
        seg = make_segments(conv_lens).to(x.device)
        positions = torch.cat([torch.arange(t, device=x.device) for t in conv_lens])  # restart per segment
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        skip: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, seg, backend)
            if self.cfg.encoder_skip_layer_id is not None and i == self.cfg.encoder_skip_layer_id - 1:
                skip = x
        if skip is not None:
            x = x + skip
        x = self.layer_norm(x)
        if self.down_sample is None:
            return x, conv_lens
        return self._downsample(x, conv_lens)

    def forward(
        self, mel: torch.Tensor, lengths: Sequence[int], backend: AttnBackend = "auto"
    ) -> TokenizerOutput:
        """Packed mel [sum T, n_mels] -> codes [sum T', Q] (the RVQ in float32)."""
        x, out_lens = self.features(mel, lengths, backend)
        return TokenizerOutput(self.quantizer.encode(x), tuple(out_lens))
