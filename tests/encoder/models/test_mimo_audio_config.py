"""The audio configs read the release's spellings and refuse what the modules would get wrong."""

from __future__ import annotations

import pytest
import torch

from encoder.models.mimo_audio.tokenizer_config import NO_WINDOW, AudioTokenizerConfig
from encoder.models.mimo_audio.tower_config import AudioTowerConfig, per_channel
from media_io.audio_tokens import AudioTokenRule
from tests.encoder.models.mimo_audio_fixture import AUDIO_CONFIG, PROCESSOR_AUDIO, TOKENIZER_CONFIG

RELEASE_AUDIO_CONFIG = {  # config.json's audio_config as released (reference section 1)
    "audio_channels": 20,
    "audio_segment_size": 6000,
    "group_size": 4,
    "input_full_attention": True,
    "input_local_attn_heads": 16,
    "input_local_dim": 1024,
    "input_local_head_dim": 64,
    "input_local_hidden_dropout": 0.0,
    "input_local_intermediate_size": 4096,
    "input_local_layers": 6,
    "out_hidden_size": 4096,
    "partial_rotary_factor": 1.0,
    "projection_layers": 2,
    "rope_theta": 640000,
    "add_post_norm": True,
    "speech_vocab_size": "1280",
    "speech_zeroemb_idx": "1024",
}


def test_release_audio_config_is_the_default() -> None:
    cfg = AudioTowerConfig.from_dicts(RELEASE_AUDIO_CONFIG, PROCESSOR_AUDIO)
    assert cfg == AudioTowerConfig()
    assert cfg.head_dim == 64 and cfg.projection_in == 4096
    assert cfg.rule == AudioTokenRule()


def test_per_channel_spellings() -> None:
    assert per_channel("1280", 3, "v") == (1280, 1280, 1280)
    assert per_channel(7, 2, "v") == (7, 7)
    assert per_channel("1025-1025-129", 3, "v") == (1025, 1025, 129)
    with pytest.raises(ValueError, match="2 values for 3 audio channels"):
        per_channel("1025-129", 3, "v")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partial_rotary_factor": 0.334}, "partial_rotary_factor"),
        ({"input_local_head_dim": 32}, "input_local_head_dim"),
        ({"projection_layers": 3}, "projection_layers"),
        ({"group_size": 8}, "disagrees"),
        ({"speech_vocab_size": "10-10"}, "2 values for 20"),
    ],
)
def test_tower_config_refusals(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AudioTowerConfig.from_dicts({**RELEASE_AUDIO_CONFIG, **change}, PROCESSOR_AUDIO)


def test_processor_must_agree() -> None:
    with pytest.raises(ValueError, match="audio_channels"):
        AudioTowerConfig.from_dicts(RELEASE_AUDIO_CONFIG, {**PROCESSOR_AUDIO, "audio_channels": 8})
    with pytest.raises(ValueError, match="audio_zeroemb_idx"):
        AudioTowerConfig.from_dicts(RELEASE_AUDIO_CONFIG, {**PROCESSOR_AUDIO, "audio_zeroemb_idx": [0] * 20})


def test_tokenizer_config_fixture() -> None:
    cfg = AudioTokenizerConfig.from_dict(TOKENIZER_CONFIG)
    assert cfg.codebook_size == (1024, 1024, 256) + (128,) * 17
    assert cfg.encoder_attn_window_size == (8, 8)
    # hybrid, 2 per block: even layers windowed, odd layers full
    assert [cfg.layer_window(i) for i in range(4)] == [(8, 8), NO_WINDOW, (8, 8), NO_WINDOW]
    assert cfg.head_dim == 8
    assert cfg.conv_frames(6000) == 3000 and cfg.code_frames(6000) == 1500 and cfg.code_frames(5) == 2
    tower = AudioTowerConfig.from_dicts(AUDIO_CONFIG, PROCESSOR_AUDIO)
    assert tower.audio_channels == 20 and tower.input_local_dim == 32


def test_tokenizer_config_defaults_are_the_reference_class_defaults() -> None:
    cfg = AudioTokenizerConfig.from_dict({"encoder_attn_window_size": None})
    assert cfg.avg_pooler == 1 and cfg.encoder_attn_window_size == NO_WINDOW
    assert cfg.codebook_size == (1024,) * 12
    assert [cfg.layer_window(i) for i in range(cfg.encoder_layers)] == [NO_WINDOW] * 8
    # not hybrid: every layer takes the window
    assert AudioTokenizerConfig.from_dict({"encoder_attn_window_size": [4, 0]}).layer_window(1) == (4, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_quantizers": 0}, "no RVQ"),
        ({"d_model": 30, "encoder_attention_heads": 4}, "even head width"),
        ({"encoder_skip_layer_id": 9, "encoder_layers": 4}, "not a layer"),
        ({"activation_function": "relu"}, "activation_function"),
    ],
)
def test_tokenizer_config_refusals(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AudioTokenizerConfig.from_dict({**TOKENIZER_CONFIG, **change})


def test_release_tower_shapes_and_size() -> None:
    """At the release's config the tower has the checkpoint's shapes (reference sections 6 and 7:
    speech_embeddings [1280, 1024], projection.mlp.0 [16384, 4096], mlp.2 [4096, 16384]) and 261M
    parameters. Built on the meta device: no memory."""
    from encoder.models.mimo_audio.tower import AudioTower

    with torch.device("meta"):
        tower = AudioTower(AudioTowerConfig.from_dicts(RELEASE_AUDIO_CONFIG, PROCESSOR_AUDIO))
    shapes = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    assert shapes["speech_embeddings.19.weight"] == (1280, 1024)
    assert shapes["projection.mlp.0.weight"] == (16384, 4096)
    assert shapes["projection.mlp.2.weight"] == (4096, 16384)
    assert shapes["input_local_transformer.layers.5.self_attn.q_proj.bias"] == (1024,)
    assert "input_local_transformer.layers.5.self_attn.o_proj.bias" not in shapes
    assert round(sum(v.numel() for v in tower.parameters()) / 1e6) == 261
