"""The tokenizer's residual vector quantizer, encode side: codes from features.

For codebook c (sizes e.g. [1024, 1024, 256, 128, ...]) in order, the code of each row is its
nearest entry by Euclidean distance, and the entry is subtracted before the next codebook:

    r_0 = x;   code_c = argmin_k |r_c - E_c[k]|^2;   r_{c+1} = r_c - E_c[code_c]

Distances are ``|r|^2 - 2 r.E^T + |E|^2`` in float32 (the reference's expansion; the codes are a
discrete choice, so the same arithmetic keeps near ties falling the same way); the first index wins a
tie. Checkpoint names: ``encoder.quantizer.vq.layers.{c}._codebook.embed`` [size_c, d_model].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class ResidualVQ(nn.Module):
    """Codebooks as buffers ``embed_{c}`` [size_c, dim] (frozen; float32 whatever the model dtype)."""

    def __init__(self, dim: int, sizes: Sequence[int]) -> None:
        super().__init__()
        self.sizes = tuple(sizes)
        for c, size in enumerate(self.sizes):
            self.register_buffer(f"embed_{c}", torch.zeros(size, dim, dtype=torch.float32))

    def codebook(self, c: int) -> torch.Tensor:
        book = getattr(self, f"embed_{c}")
        assert isinstance(book, torch.Tensor)
        return book

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> codes [N, num_codebooks] int64."""
        residual = x.float()
        codes = []
        for c in range(len(self.sizes)):
            book = self.codebook(c).float()  # [K, dim]
            dist = (
                residual.pow(2).sum(1, keepdim=True) - 2 * residual @ book.t() + book.pow(2).sum(1)[None, :]
            )
            idx = dist.argmin(dim=1)  # [N]
            residual = residual - book[idx]
            codes.append(idx)
        return torch.stack(codes, dim=1)
