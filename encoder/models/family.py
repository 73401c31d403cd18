"""The interface every vision-tower family implements (one module per family in this package).

A family says where a checkpoint's config.json keeps the tower's hyper-parameters and under which
name prefixes its tensors are stored; the shared loader (``encoder.models.checkpoint``) does the strict
key, shape and dtype checks and never names a model.
"""

from __future__ import annotations

from typing import Any, Protocol


class VisionFamily(Protocol):
    MODEL_TYPES: tuple[str, ...]  # config.json "model_type" values
    # Name prefixes of the tower's tensors, tried in order ("" = a tower-only checkpoint).
    TENSOR_PREFIXES: tuple[str, ...]

    def vision_config(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """The tower's hyper-parameters from a config.json dict; None when it has none."""
        ...
