"""MiMo-V2.5's LLM-side audio tower: one clip's codes -> one row per ``<|audio_pad|>``.

    codes [T', C] (C = 20 channels)
    -> pad T' up to a multiple of g = 4 by repeating the last frame's codes     [G, g, C]
    -> sum over channels of speech_embeddings[c](codes[..., c])                 [G, g, dim]
       (the tables' ``speech_zeroemb_idx`` row is the "empty channel" entry; the tokenizer's codes
       never reach it, and its stored value is used as is)
    -> input local transformer, attention within each group                    [G, g, dim]
    -> flatten each group                                                        [G, g * dim]
    -> projection: Linear -> GELU (erf) -> Linear, no biases (or one Linear)    [G, out_hidden]

Groups are independent, so the groups of several clips run as one batch; the clip boundary only
decides where the last-frame padding goes. Parameter names are the checkpoint's below
``audio_encoder.`` (``weights`` also reads the top-level ``speech_embeddings.*`` and
``audio_projection.*`` spellings).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder.models.mimo_audio.local_transformer import InputLocalTransformer
from encoder.models.mimo_audio.tower_config import AudioTowerConfig


def group_codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [T', C] (T' >= 1) -> [ceil(T'/g), g, C], the last frame repeated as padding."""
    t = codes.shape[0]
    pad = -t % group_size
    if pad:
        codes = torch.cat([codes, codes[-1:].expand(pad, -1)], dim=0)
    return codes.view(-1, group_size, codes.shape[1])


class AudioProjection(nn.Module):
    """``mlp``: Linear(in -> 4 in) -> GELU (erf) -> Linear(4 in -> out), no biases."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_features, 4 * in_features, bias=False),
            nn.GELU(),
            nn.Linear(4 * in_features, out_features, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class AudioTower(nn.Module):
    def __init__(self, cfg: AudioTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.input_local_dim
        self.speech_embeddings = nn.ModuleList([nn.Embedding(n, dim) for n in cfg.speech_vocab_size])
        self.input_local_transformer = InputLocalTransformer(cfg)
        self.projection: nn.Module
        if cfg.projection_layers == 1:
            self.projection = nn.Linear(cfg.projection_in, cfg.out_hidden_size, bias=False)
        else:
            self.projection = AudioProjection(cfg.projection_in, cfg.out_hidden_size)

    def embed(self, groups: torch.Tensor) -> torch.Tensor:
        """[G, g, C] codes -> [G, g, dim], the channels' embeddings summed."""
        out = self.speech_embeddings[0](groups[..., 0])
        for c in range(1, self.cfg.audio_channels):
            out = out + self.speech_embeddings[c](groups[..., c])
        return out

    def forward(self, clip_codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """Codes of each clip ([T'_i, >= C]) -> rows [sum_i ceil(T'_i / g), out_hidden], clips in order."""
        c, vocab = self.cfg.audio_channels, self.cfg.speech_vocab_size
        grouped = []
        for codes in clip_codes:
            if codes.dim() != 2 or codes.shape[0] == 0 or codes.shape[1] < c:
                raise ValueError(f"a clip's codes are [T' >= 1, >= {c}], got {tuple(codes.shape)}")
            grouped.append(group_codes(codes[:, :c], self.cfg.group_size))
        groups = torch.cat(grouped)  # [G, g, C]
        limits = torch.tensor(vocab, device=groups.device)
        if bool(((groups < 0) | (groups >= limits)).any()):
            raise ValueError(f"audio codes outside the speech vocabularies {vocab}")
        x = self.input_local_transformer(self.embed(groups))  # [G, g, dim]
        return self.projection(x.reshape(x.shape[0], -1))
