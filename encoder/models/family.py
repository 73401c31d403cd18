"""The interface every vision-tower family implements (one module per family in this package), and
the small ``VisionTower`` protocol that the loader, the batcher and the worker program against.

A family says where a checkpoint's config.json keeps the tower's hyper-parameters, turns them into
its own frozen config object, builds its tower, and maps the tower's state dict to and from the
tensors on disk (names below the family's prefix, shapes, reshapes such as the Conv3d patch
embedding stored as a Linear). The shared loader (``encoder.models.checkpoint``) does the strict
key, shape and dtype checks through this interface and never names a model.

    config.json --vision_config()--> raw dict --parse_vision_config()--> config (frozen)
    config --build_tower()--> tower (nn.Module, VisionTower)
    disk tensors (prefix stripped) --to_module_state()--> tower state dict   (disk_shapes() checks)
    tower state dict --to_disk_state()--> disk tensors (full names) for config.to_hf_dict()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Self

import torch

Grid = tuple[int, int, int]  # (t, h, w) of one item, in patches

# The patch embedding every tower has: a Conv3d whose stride equals its kernel, stored on disk as
# [C, in_channels, temporal, patch, patch] and kept in the towers as a Linear [C, patch_dim]
# (on pre-cut patch rows the two are the same map). Its name also finds a family's tensor prefix.
PATCH_EMBED = "patch_embed.proj.weight"


class VisionTowerConfig(Protocol):
    """What shared code reads from any tower's config (the batcher, the worker, model_check)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def out_hidden_size(self) -> int: ...  # width of one output row (the LLM's hidden size)
    @property
    def in_channels(self) -> int: ...
    @property
    def patch_size(self) -> int: ...  # pixels per patch side
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def spatial_merge_size(self) -> int: ...
    @property
    def patch_dim(self) -> int: ...  # values in one input row: in_channels * temporal * patch^2
    @property
    def merge_unit(self) -> int: ...  # patches folded into one output row (4 for 2x2)
    @property
    def head_dim(self) -> int: ...  # one attention head's width (which attention kernel runs)

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form (hashed into the checkpoint fingerprint)."""
        ...

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json body that ``family_for`` and ``parse_vision_config`` read back as this config."""
        ...


class VisionTower(Protocol):
    """A vision tower as the batcher and worker use it (an ``nn.Module``).

    ``forward(pixel_values [N, patch_dim], grid_thw [K, 3]) -> [N // merge_unit, out_hidden_size]``;
    items packed in order, item i's output its t*h*w // merge_unit consecutive rows, attention never
    crossing an item (so batched equals alone). ``layout(grids)`` is the pure-of-grids part of a
    forward (built off the hot path, cached); ``forward_layout`` runs with it.
    """

    @property
    def config(self) -> VisionTowerConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...

    def eval(self) -> Self: ...  # nn.Module's
    def layout(self, grids: Sequence[Grid]) -> Any: ...
    def forward_layout(self, pixel_values: torch.Tensor, layout: Any) -> torch.Tensor: ...
    def resolve_attention(self, device: torch.device) -> None: ...  # "auto" resolved once, at load
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor: ...


class VisionFamily(Protocol):
    """A tower family. Implementations are modules with these names; which model types a module
    serves is the registry's row (``epd_common.checkpoint.registry``)."""

    # Name prefixes of the tower's tensors, tried in order ("" = a tower-only checkpoint).
    TENSOR_PREFIXES: tuple[str, ...]

    def vision_config(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """The tower's hyper-parameters from a config.json dict; None when it has none."""
        ...

    def parse_vision_config(self, vision: dict[str, Any]) -> VisionTowerConfig:
        """The family's config object; ``ValueError`` / ``TypeError`` naming a bad field."""
        ...

    def build_tower(self, config: Any) -> torch.nn.Module:
        """A tower (also a ``VisionTower``) with unspecified weights.

        May run under ``torch.device("meta")``: the loader then assigns every state-dict tensor,
        so whatever else the tower needs (non-persistent buffers) must be made on the CPU here.
        """
        ...

    def disk_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint holds for this tower (names without the prefix) -> shape."""
        ...

    def to_module_state(self, config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Disk tensors (prefix stripped, shapes checked) -> the tower's state dict."""
        ...

    def to_disk_state(self, config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tower's state dict -> the tensors (full names) of a checkpoint whose config.json is
        ``config.to_hf_dict()``."""
        ...


def conv3d_patch_shape(cfg: VisionTowerConfig) -> tuple[int, int, int, int, int]:
    """The patch embedding as stored: [C, in_channels, temporal, patch, patch]."""
    return (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)


def module_shapes(tower: torch.nn.Module, cfg: VisionTowerConfig) -> dict[str, tuple[int, ...]]:
    """The disk shapes of a tower whose state dict maps one to one to its checkpoint except the
    patch embedding (Linear in the tower, Conv3d on disk). ``tower`` may live on the meta device."""
    shapes = {name: tuple(t.shape) for name, t in tower.state_dict().items()}
    shapes[PATCH_EMBED] = conv3d_patch_shape(cfg)
    return shapes


def patch_embed_to_linear(
    cfg: VisionTowerConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` with the Conv3d patch weight [C, in, T, P, P] viewed as the Linear [C, patch_dim]
    (row values in (in, T, P, P) order, which is how the preprocessing cuts a patch)."""
    state = dict(tensors)
    state[PATCH_EMBED] = state[PATCH_EMBED].reshape(cfg.hidden_size, cfg.patch_dim)
    return state


def patch_embed_to_conv3d(cfg: VisionTowerConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``patch_embed_to_linear``."""
    tensors = dict(state)
    tensors[PATCH_EMBED] = tensors[PATCH_EMBED].reshape(conv3d_patch_shape(cfg)).contiguous()
    return tensors
