"""MiMo-V2.5's audio encoder as a checkpoint family: where a checkpoint keeps it and how it loads
(the registry's ``audio`` column, ``epd_common.checkpoint.registry``; the shared loader is
``encoder.models.audio_checkpoint``).

    config.json  ``audio_config`` (the tower) + ``processor_config``'s audio fields (log-mel and
                 pad-count rule)
    audio_tokenizer/config.json, audio_tokenizer/model.safetensors     the frozen tokenizer
    the main checkpoint's ``speech_embeddings.*`` / ``audio_encoder.*`` / ``audio_projection.*``
                 tensors (only the shards that list one are opened)

A checkpoint has an audio encoder when it has both the ``audio_config`` block and the
``audio_tokenizer/`` folder; with only one of them it has none (the worker then refuses audio
with 415, naming the missing part).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from encoder.models.mimo_audio.weights import load_tokenizer, load_tower, tower_param_name
from epd_common.checkpoint.config_json import read_json_object
from epd_common.checkpoint.shards import read_tensors, shard_map
from media_io.audio_config import AudioConfig
from media_io.audio_settings import AudioSettings

TOKENIZER_DIR = "audio_tokenizer"


def missing_part(path: Path, raw: dict[str, Any]) -> str | None:
    """What the checkpoint lacks for an audio encoder (None: it has one)."""
    if not isinstance(raw.get("audio_config"), dict):
        return "config.json has no audio_config"
    if not (path / TOKENIZER_DIR / "config.json").is_file():
        return f"no {TOKENIZER_DIR}/ folder (config.json and model.safetensors)"
    return None


def settings(raw: dict[str, Any]) -> AudioSettings:
    """The log-mel and pad-count settings of ``processor_config`` (MiMo-V2.5's when absent)."""
    p = raw.get("processor_config") or {}
    tower = AudioTowerConfig.from_dicts(raw["audio_config"], p)
    fmax = p.get("audio_fmax")
    audio = AudioConfig(
        sample_rate=int(p.get("audio_sampling_rate", 24000)),
        n_fft=int(p.get("audio_nfft", 960)),
        window_size=int(p.get("audio_window_size", 960)),
        hop_length=int(p.get("audio_hop_length", 240)),
        n_mels=int(p.get("audio_n_mels", 128)),
        f_min=float(p.get("audio_fmin") or 0.0),
        f_max=None if fmax is None else float(fmax),
    )
    per_second = float(p.get("audio_input_id_per_second", 25.0))
    return AudioSettings(audio, tower.rule, per_second / tower.rule.group_size)


def load(
    path: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> tuple[MiMoAudioEncoder, dict[str, Any], dict[str, torch.Tensor]]:
    """The encoder (eval, frozen, on ``device``), its canonical config (for the fingerprint) and
    every tensor it was built from (prefixed ``tokenizer/`` and ``tower/``)."""
    tower_cfg = AudioTowerConfig.from_dicts(raw["audio_config"], raw.get("processor_config"))
    tok_raw = read_json_object(path / TOKENIZER_DIR / "config.json")
    tok_cfg = AudioTokenizerConfig.from_dict(tok_raw)
    tok_tensors = read_tensors(shard_map(path / TOKENIZER_DIR), lambda n: n.startswith("encoder.")).tensors
    tower_tensors = read_tensors(shard_map(path), lambda n: tower_param_name(n) is not None).tensors
    model = MiMoAudioEncoder(
        load_tokenizer(tok_cfg, tok_tensors, dtype), load_tower(tower_cfg, tower_tensors, dtype)
    )
    config = {"audio_config": raw["audio_config"], "tokenizer": tok_raw}
    tensors = {f"tokenizer/{k}": v for k, v in tok_tensors.items()}
    tensors.update({f"tower/{k}": v for k, v in tower_tensors.items()})
    return model.to(device), config, tensors
