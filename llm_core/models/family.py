"""The interface every LLM model family implements (one module per family in this package).

A family turns a checkpoint's config.json into the decoder's ``DecoderConfig`` (the shared decoder:
full and sliding-window attention layers, dense or MoE MLPs, optional q/k/v biases, sinks and
M-RoPE), names which of the checkpoint's tensors are the language model's and what they are called
in our module tree, and says how token indices become rotary positions. Shared code (the loader,
the engine, the kernels) asks the family and never names a model.

Two hooks are optional (a family module that does not define one gets the default here):

    tensor_converter(raw, config, dtype)   the family's step from the tensors as stored (already
                                           renamed by ``tensor_name``) to the decoder's state dict:
                                           e.g. FP8 block dequantization and splitting a fused
                                           q/k/v projection. Built before any tensor is read, so
                                           a config it cannot convert fails first. Default:
                                           tensors pass as they are; a ``quantization_config``
                                           is refused.
    media_expansion(raw, encode)           how the chat template's placeholder for an image or
                                           video becomes the prompt ids the model was trained on
                                           (``llm_core.prompts.media_expansion``; ``encode``
                                           tokenizes text the family writes around the pads).
                                           Default: pad runs at the item's token count with
                                           config.json's ``image_token_id`` / ``video_token_id``
                                           (``Qwen2VLProcessor``).

Names a family maps under ``MTP_PREFIX`` ("mtp.") are its multi-token-prediction heads: the loader
puts them into ``mtp.MTPHeads`` instead of the decoder. A family module that sets
``MTP_NEEDS_DECLARATION = True`` (MiMo-V2-Flash) has them read only when config.json declares
``num_nextn_predict_layers`` > 0 (transformers' config for it has no such field and drops them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from llm_core.models.config import ConfigError, DecoderConfig
from llm_core.models.positions import PositionScheme
from llm_core.prompts.media_expansion import MediaExpansion, PadRuns

# on-disk tensors (under tensor_name's names) -> the decoder's state-dict tensors
TensorConverter = Callable[[dict[str, Tensor]], dict[str, Tensor]]


class TensorFormatError(ValueError):
    """A stored tensor a family cannot turn into its module weight (dtype, shape, a missing scale);
    the message names the tensor."""


class LLMFamily(Protocol):
    """A model family on the LLM side. Implementations are modules with these names; which
    architectures a module serves is the registry's row (``epd_common.checkpoint.registry``)."""

    def parse_config(self, raw: dict[str, Any]) -> DecoderConfig:
        """config.json -> the decoder config; ``ConfigError`` naming the field on a bad value."""
        ...

    def tensor_name(self, disk_name: str) -> str | None:
        """The state-dict name of a checkpoint tensor, or None when it is not the language model's
        (a vision tower, audio): such tensors are never read, and shards holding only them are
        never opened. Names under ``mtp.`` go to the multi-token-prediction heads."""
        ...

    def position_scheme(self, raw: dict[str, Any]) -> PositionScheme:
        """How this family places tokens for rotary embedding (1-D, or M-RoPE's three axes)."""
        ...


class ConverterFactory(Protocol):
    def __call__(self, raw: dict[str, Any], config: DecoderConfig, dtype: torch.dtype) -> TensorConverter: ...


def plain_tensor_converter(raw: dict[str, Any], config: DecoderConfig, dtype: torch.dtype) -> TensorConverter:
    """The default ``tensor_converter``: tensors are the module weights as stored; a checkpoint
    that declares a ``quantization_config`` is refused (``ConfigError`` naming the method)."""
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"quantized checkpoints (quant_method={method!r}) are not supported for this architecture;"
            " convert the weights to bf16/fp32 first"
        )
    return lambda tensors: tensors


def tensor_converter_of(family: LLMFamily) -> ConverterFactory:
    """The family's ``tensor_converter`` hook, or ``plain_tensor_converter`` when it defines none."""
    return cast(ConverterFactory, getattr(family, "tensor_converter", plain_tensor_converter))


class ExpansionFactory(Protocol):
    def __call__(self, raw: dict[str, Any], encode: Callable[[str], list[int]]) -> MediaExpansion: ...


def pad_run_expansion(raw: dict[str, Any], encode: Callable[[str], list[int]]) -> MediaExpansion:
    """The default ``media_expansion``: one run of pads per item, ids from config.json."""
    image, video = raw.get("image_token_id"), raw.get("video_token_id")
    return PadRuns(image if isinstance(image, int) else None, video if isinstance(video, int) else None)


def media_expansion_of(family: LLMFamily) -> ExpansionFactory:
    """The family's ``media_expansion`` hook, or ``pad_run_expansion`` when it defines none."""
    return cast(ExpansionFactory, getattr(family, "media_expansion", pad_run_expansion))
