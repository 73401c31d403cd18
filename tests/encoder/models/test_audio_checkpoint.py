"""Loading a checkpoint's audio encoder through the registry (``encoder.models.audio_checkpoint``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from encoder.models.audio_checkpoint import LoadedAudioEncoder, NoAudio, load_audio_encoder
from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from encoder.models.mimo_audio.weights import load_tokenizer, load_tower
from media_io.audio_settings import AudioSettings
from tests.encoder.models.mimo_audio_fixture import tiny_mel
from tests.fixtures.mimo_v2 import AUDIO_SHARD, write_tiny_mimo_v2


def test_loads_the_fixture_audio_encoder(mimo_v2_dir: Path) -> None:
    loaded = load_audio_encoder(mimo_v2_dir)
    assert isinstance(loaded, LoadedAudioEncoder)
    assert loaded.settings == AudioSettings()  # the fixture keeps the release's audio fields
    assert loaded.out_hidden_size == 128
    assert loaded.model.attn_backend == "torch"  # "auto" resolved at load, for the CPU
    again, bf16 = load_audio_encoder(mimo_v2_dir), load_audio_encoder(mimo_v2_dir, dtype=torch.bfloat16)
    assert isinstance(again, LoadedAudioEncoder) and isinstance(bf16, LoadedAudioEncoder)
    assert again.fingerprint == loaded.fingerprint and bf16.fingerprint != loaded.fingerprint
    # the same modules built by hand from the files give the same rows
    raw = json.loads((mimo_v2_dir / "config.json").read_text())
    tok_cfg = AudioTokenizerConfig.from_dict(
        json.loads((mimo_v2_dir / "audio_tokenizer" / "config.json").read_text())
    )
    tower_cfg = AudioTowerConfig.from_dicts(raw["audio_config"], raw["processor_config"])
    direct = MiMoAudioEncoder(
        load_tokenizer(tok_cfg, load_file(str(mimo_v2_dir / "audio_tokenizer" / "model.safetensors"))),
        load_tower(tower_cfg, load_file(str(mimo_v2_dir / AUDIO_SHARD))),
    )
    mels = [tiny_mel(150, 0), tiny_mel(9, 1)]
    with torch.inference_mode():
        got, want = loaded.model(mels), direct(mels)
    assert got.pad_counts == want.pad_counts == (10, 1)
    torch.testing.assert_close(got.rows, want.rows, rtol=0, atol=0)


def test_no_audio_encoder_says_what_is_missing(tmp_path: Path, qwen_dir: Path) -> None:
    no_tok = write_tiny_mimo_v2(tmp_path / "m", vision_config={}, audio_tokenizer=False)
    got = load_audio_encoder(no_tok)
    assert isinstance(got, NoAudio) and "audio_tokenizer/" in got.reason
    got = load_audio_encoder(qwen_dir)
    assert isinstance(got, NoAudio) and "qwen2_5_vl" in got.reason
    assert isinstance(load_audio_encoder(None), NoAudio)
