"""The part of a packed vision tower (a ``family.VisionTower``) that every family shares.

A tower takes items packed back to back, ``pixel_values [N, patch_dim]`` with ``grid_thw [K, 3]``,
and returns ``[N // merge_unit, out_hidden_size]``. Everything that depends only on the grids (token
orders, rotary positions, attention segments) is the family's layout, built on the CPU and cached;
this base keeps device copies of it, checks the input against it and runs the patch embedding, and
leaves the blocks to the family:

    grid_thw --cpu_layout()--> layout (CPU, cached by the family) --layout()--> on the model's device
    pixel_values [N, patch_dim] --patch_embed--> [N, C] --encode(x, layout)--> [N // unit, out]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch
from torch import nn

from encoder.kernels.attention import AttnBackend, resolve_backend
from encoder.models.family import Grid, VisionTowerConfig
from encoder.models.packed_layout import PackedLayout

ConfigT = TypeVar("ConfigT", bound=VisionTowerConfig)
LayoutT = TypeVar("LayoutT", bound=PackedLayout)

# Device copies of layouts kept per model: a server sees few distinct batch shapes, and each copy
# is small (a few int tensors per batch), so 64 makes steady traffic upload nothing.
DEVICE_LAYOUTS = 64


class PatchEmbed(nn.Module):
    """The patch embedding as a Linear [patch_dim -> C] without bias: on pre-cut patch rows it is
    the checkpoint's Conv3d with stride = kernel (``family.PATCH_EMBED``)."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class PackedTower(nn.Module, Generic[ConfigT, LayoutT], ABC):
    """Base of the towers: a family subclasses it with its config and layout types, builds its
    blocks after ``super().__init__`` (so ``patch_embed`` is registered, and draws its random init,
    first: state-dict order and seeded weights stay as they were), and gives ``cpu_layout`` and
    ``encode``."""

    def __init__(self, cfg: ConfigT, attn_backend: AttnBackend) -> None:
        super().__init__()
        self.config = cfg
        self.attn_backend: AttnBackend = attn_backend
        self.patch_embed = PatchEmbed(cfg)
        self._device_layouts: OrderedDict[tuple[tuple[Grid, ...], str], LayoutT] = OrderedDict()

    def resolve_attention(self, device: torch.device) -> None:
        """Resolve an "auto" attention backend for ``device``, once, at load (``resolve_backend``)."""
        self.attn_backend = resolve_backend(self.attn_backend, device, self.config.head_dim)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @abstractmethod
    def cpu_layout(self, grids: Sequence[Grid]) -> LayoutT:
        """The family's layout of a batch with these grids, on the CPU (``ValueError`` on bad grids)."""

    @abstractmethod
    def encode(self, x: torch.Tensor, layout: LayoutT) -> torch.Tensor:
        """The family's blocks and merger: ``x`` [N, C] embedded patches in input row order, ``layout``
        on x's device -> [N // merge_unit, out_hidden_size], merge units in input order."""

    def layout(self, grids: Sequence[Grid]) -> LayoutT:
        """The layout of a batch with these grids, on the model's device.

        Built on the CPU (cached per distinct grids by the family) and, off the CPU, kept in a small
        per-model cache of device copies so repeated batch shapes upload nothing.
        """
        cpu_layout = self.cpu_layout(grids)
        device = self.device
        if device.type == "cpu":
            return cpu_layout
        key = (tuple((int(t), int(h), int(w)) for t, h, w in grids), str(device))
        cached = self._device_layouts.get(key)
        if cached is None:
            cached = cpu_layout.to(device)
            self._device_layouts[key] = cached
            while len(self._device_layouts) > DEVICE_LAYOUTS:
                self._device_layouts.popitem(last=False)  # least recently used
        else:
            self._device_layouts.move_to_end(key)
        return cached

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        return self.forward_layout(pixel_values, self.layout(grids))

    def forward_layout(self, pixel_values: torch.Tensor, layout: LayoutT) -> torch.Tensor:
        """Forward with a precomputed layout (the batcher builds it off the hot path)."""
        n, patch_dim = layout.positions.shape[0], self.config.patch_dim
        if pixel_values.dim() != 2 or pixel_values.shape != (n, patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({n}, {patch_dim}) "
                "from grid_thw"
            )
        layout = layout.to(self.device)
        x = self.patch_embed(pixel_values.to(self.device, non_blocking=True))  # [N, C], input order
        return self.encode(x, layout)
