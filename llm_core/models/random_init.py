"""Deterministic random weights for generated checkpoints (the embedded default, its MTP heads,
test fixtures): the same seed gives the same tensors on every machine (one CPU generator, drawn
in parameter order)."""

from __future__ import annotations

import torch
from torch import nn


def init_random_weights(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """normal(0, std) for every parameter but norm weights (1), router score biases zeroed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
