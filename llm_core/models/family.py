"""The interface every LLM model family implements (one module per family in this package).

A family turns a checkpoint's config.json into the decoder's ``DecoderConfig`` (the shared decoder:
full and sliding-window attention layers, dense or MoE MLPs, optional q/k/v biases, sinks and
M-RoPE), names which of the checkpoint's tensors are the language model's and what they are called
in our module tree, and says how token indices become rotary positions. Shared code (the loader,
the engine, the kernels) asks the family and never names a model.
"""

from __future__ import annotations

from typing import Any, Protocol

from llm_core.models.config import DecoderConfig
from llm_core.models.positions import PositionScheme


class LLMFamily(Protocol):
    """A model family on the LLM side. Implementations are modules with these names."""

    ARCHITECTURES: tuple[str, ...]  # config.json "architectures" values this family serves
    MODEL_TYPES: tuple[str, ...]  # config.json "model_type" values (used when architectures is absent)

    def parse_config(self, raw: dict[str, Any]) -> DecoderConfig:
        """config.json -> the decoder config; ``ConfigError`` naming the field on a bad value."""
        ...

    def tensor_name(self, disk_name: str) -> str | None:
        """The state-dict name of a checkpoint tensor, or None when it is not the language model's
        (a vision tower, MTP heads): such tensors are never read, and shards holding only them
        are never opened."""
        ...

    def position_scheme(self, raw: dict[str, Any]) -> PositionScheme:
        """How this family places tokens for rotary embedding (1-D, or M-RoPE's three axes)."""
        ...
