"""Checkpoint names -> the audio modules' parameters, with strict checks.

Tokenizer (``audio_tokenizer/model.safetensors``): the encoder's tensors are ``encoder.*``; the
file also holds the decoder, the vocoder and the quantizer's training state (``inited``,
``cluster_size``, ``embed_avg``), which encoding never reads and which are skipped. Two names
differ from the module's (``tokenizer`` docstring):

    encoder.down_sample_layer.0.weight              -> down_sample.weight
    encoder.quantizer.vq.layers.{c}._codebook.embed -> quantizer.embed_{c}

Tower (the main checkpoint): ``audio_encoder.<name>`` -> ``<name>``, and the other spellings the
public loaders accept (/work/shared/reference/mimo_v25.md section 6 "Name handling"):

    speech_embeddings.{c}.weight        -> speech_embeddings.{c}.weight   (top level, as released)
    audio_projection.*                  -> projection.*

``audio_encoder.input_local_transformer.embed_tokens.weight`` (the unused token table of a Qwen2
model) is skipped. A missing tensor or one of the wrong shape is an ``AudioWeightsError`` naming the
checkpoint name and both shapes; a tensor under the tower's or encoder's prefix that maps to no
parameter is logged and skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping

import torch
from torch import nn

from encoder.models.mimo_audio.tokenizer import AudioTokenizerEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower import AudioTower
from encoder.models.mimo_audio.tower_config import AudioTowerConfig

log = logging.getLogger(__name__)

_CODEBOOK = re.compile(r"quantizer\.vq\.layers\.(\d+)\._codebook\.(\w+)$")
_TOWER_SKIPPED = ("input_local_transformer.embed_tokens.", "input_local_transformer.rotary_emb.")


class AudioWeightsError(ValueError):
    """A tensor the audio modules need is missing from the checkpoint or has the wrong shape."""


def tokenizer_param_name(name: str) -> str | None:
    """The tokenizer module's parameter for a checkpoint name, or None (not read)."""
    if not name.startswith("encoder."):
        return None
    rest = name[len("encoder.") :]
    m = _CODEBOOK.match(rest)
    if m:
        return f"quantizer.embed_{m.group(1)}" if m.group(2) == "embed" else None
    if rest.startswith("position_embedding."):
        return None
    return rest.replace("down_sample_layer.0.", "down_sample.", 1)


def tokenizer_checkpoint_name(param: str) -> str:
    m = re.match(r"quantizer\.embed_(\d+)$", param)
    if m:
        return f"encoder.quantizer.vq.layers.{m.group(1)}._codebook.embed"
    return "encoder." + param.replace("down_sample.", "down_sample_layer.0.", 1)


def tower_param_name(name: str) -> str | None:
    """The tower module's parameter for a main-checkpoint name, or None (not the tower's)."""
    if name.startswith("speech_embeddings."):
        return name
    if name.startswith("audio_projection."):
        return "projection." + name[len("audio_projection.") :]
    if name.startswith("audio_encoder."):
        rest = name[len("audio_encoder.") :]
        return None if rest.startswith(_TOWER_SKIPPED) else rest
    return None


def tower_checkpoint_name(param: str) -> str:
    return "audio_encoder." + param


def _load(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    param_name: Callable[[str], str | None],
    checkpoint_name: Callable[[str], str],
    what: str,
) -> None:
    expected = module.state_dict()
    found: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        param = param_name(name)
        if param is None:
            continue
        if param not in expected:
            log.warning("%s: checkpoint tensor %r maps to no parameter; skipped", what, name)
            continue
        if param in found:
            raise AudioWeightsError(f"{what}: two checkpoint tensors map to {checkpoint_name(param)!r}")
        want = tuple(expected[param].shape)
        if tuple(tensor.shape) != want:
            raise AudioWeightsError(f"{what}: {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
        found[param] = tensor
    missing = [checkpoint_name(p) for p in expected if p not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AudioWeightsError(f"{what}: missing tensor {missing[0]!r}{more}")
    with torch.no_grad():
        for param, tensor in found.items():
            expected[param].copy_(tensor)


def load_tokenizer(
    cfg: AudioTokenizerConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> AudioTokenizerEncoder:
    """The tokenizer's encoder from ``audio_tokenizer/model.safetensors`` tensors, eval and frozen;
    weights in ``dtype``, codebooks always float32 (the RVQ's distances)."""
    module = AudioTokenizerEncoder(cfg)
    _load(module, tensors, tokenizer_param_name, tokenizer_checkpoint_name, "audio tokenizer")
    module.to(dtype)
    module.quantizer.float()
    return module.eval().requires_grad_(False)


def load_tower(
    cfg: AudioTowerConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> AudioTower:
    """The LLM-side tower from the main checkpoint's audio tensors, eval and frozen."""
    module = AudioTower(cfg)
    _load(module, tensors, tower_param_name, tower_checkpoint_name, "audio tower")
    return module.to(dtype).eval().requires_grad_(False)
