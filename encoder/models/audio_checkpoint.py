"""Load a checkpoint's audio encoder beside its vision tower, when it has one.

The registry's row for the checkpoint's architecture names its audio family
(``epd_common.checkpoint.registry.audio_family``; MiMo-V2.5: ``encoder.models.mimo_audio.family``);
the family says whether the directory holds a whole audio encoder (``missing_part``), reads its
log-mel and pad-count settings (``settings``) and builds it (``load``). A checkpoint without one
loads as ``NoAudio`` carrying the reason, which the worker's 415 names.

The fingerprint (sha256 over the canonical configs, each tensor's name, shape, stored dtype and
bytes, and the compute dtype, as ``encoder.models.checkpoint.fingerprint``) identifies the audio
embedding function: it enters every audio MediaKey, so other weights never reuse cached rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from epd_common.checkpoint.config_json import CONFIG_FILE, read_config_json
from epd_common.checkpoint.errors import CheckpointError
from epd_common.checkpoint.registry import audio_family
from media_io.audio_settings import AudioSettings


class LoadedAudioEncoder(NamedTuple):
    model: MiMoAudioEncoder
    settings: AudioSettings  # the log-mel and pad-count rule its inputs are made with
    fingerprint: str  # hex sha256
    out_hidden_size: int


class NoAudio(NamedTuple):
    reason: str  # what the checkpoint lacks, for the 415


def load_audio_encoder(
    path: str | Path | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedAudioEncoder | NoAudio:
    """The audio encoder of the checkpoint directory ``path`` (None: the embedded default, which
    has none)."""
    if path is None:
        return NoAudio("the embedded default model has no audio encoder")
    path = Path(path)
    raw = read_config_json(path)
    family = audio_family(raw)
    if family is None:
        return NoAudio(f"model_type {raw.get('model_type')!r} has no audio encoder")
    missing = family.missing_part(path, raw)
    if missing is not None:
        return NoAudio(f"the checkpoint has no audio encoder ({missing})")
    try:
        settings = family.settings(raw)
        model, config, tensors = family.load(path, raw, dtype, torch.device(device))
        model.resolve_attention(torch.device(device))  # "auto" resolved once, for this device
    except (TypeError, ValueError) as e:  # configs that disagree, missing or misshapen tensors
        raise CheckpointError(f"{path / CONFIG_FILE}: bad audio encoder: {e}") from e
    fp = _fingerprint(config, settings, tensors, dtype)
    return LoadedAudioEncoder(model, settings, fp, model.tower.cfg.out_hidden_size)


def _fingerprint(
    config: dict[str, object], settings: AudioSettings, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> str:
    h = hashlib.sha256(b"audio\0")
    doc = {"config": config, "settings": settings.key_params()}
    h.update(json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).reshape(-1).numpy().data).hexdigest()
        h.update(f"\n{name}|{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}|{digest}".encode())
    h.update(f"\ncompute_dtype={str(dtype).removeprefix('torch.')}".encode())
    return h.hexdigest()
