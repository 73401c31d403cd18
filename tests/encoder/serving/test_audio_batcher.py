"""AudioBatcher: clips from different callers share forwards of the audio encoder, and a long clip
is split at segment boundaries across the forward streams, with the rows each gets alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from encoder.models.mimo_audio.weights import load_tokenizer, load_tower
from encoder.serving.audio_batcher import AudioBatcher
from encoder.serving.batcher import QueueFull
from tests.encoder.models.mimo_audio_fixture import tiny_mel, write_tiny_audio_checkpoint

SEGMENT = 48  # mel frames per tokenizer segment here (12 codes, 3 whole groups; the release: 6000)


def _encoder(root: Path, segment: int) -> MiMoAudioEncoder:
    ck = write_tiny_audio_checkpoint(root, audio_overrides={"audio_segment_size": segment})
    tok = load_tokenizer(AudioTokenizerConfig.from_dict(ck.tokenizer_config), ck.tokenizer_tensors)
    cfg = AudioTowerConfig.from_dicts(ck.config["audio_config"], ck.config["processor_config"])
    return MiMoAudioEncoder(tok, load_tower(cfg, ck.main_tensors))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> MiMoAudioEncoder:
    return _encoder(tmp_path_factory.mktemp("audio"), SEGMENT)


def _alone(model: MiMoAudioEncoder, mel: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model([mel]).rows


def test_concurrent_clips_share_a_forward(model: MiMoAudioEncoder) -> None:
    mels = [tiny_mel(t, seed=t) for t in (9, 37, 3, 30)]

    async def run() -> tuple[list[torch.Tensor], int]:
        async with AudioBatcher(model, frame_budget=10_000, max_wait_ms=200) as b:
            rows = await asyncio.gather(*(b.encode(m) for m in mels))
            return list(rows), b.stats().batches

    rows, batches = asyncio.run(run())
    assert batches == 1
    for mel, got in zip(mels, rows, strict=True):
        assert got.shape[0] == model.tower.cfg.rule.pad_count(mel.shape[0])
        torch.testing.assert_close(got, _alone(model, mel), atol=1e-5, rtol=0)


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_a_long_clip_split_across_streams_gets_its_rows(model: MiMoAudioEncoder, streams: int) -> None:
    mel = tiny_mel(5 * SEGMENT + 13, seed=5)  # 6 segments, the last short

    async def run() -> tuple[torch.Tensor, int]:
        async with AudioBatcher(model, frame_budget=4 * SEGMENT, max_wait_ms=0, forward_streams=streams) as b:
            got = await b.encode(mel)
            return got, b.stats().batches

    got, batches = asyncio.run(run())
    assert batches == (1 if streams == 1 else streams)
    torch.testing.assert_close(got, _alone(model, mel), atol=1e-5, rtol=0)


def test_a_segment_that_cuts_a_group_is_never_split(tmp_path: Path) -> None:
    odd = _encoder(tmp_path, 40)  # 40 frames -> 10 codes: 2.5 groups
    assert not AudioBatcher(odd, forward_streams=4).splittable
    assert AudioBatcher(odd, forward_streams=4)._split(tiny_mel(200, 0))[0].shape[0] == 200


def test_bad_mel_and_a_full_queue_are_refused(model: MiMoAudioEncoder) -> None:
    async def run() -> None:
        async with AudioBatcher(model, frame_budget=64, max_wait_ms=5000, max_queue_frames=50) as b:
            with pytest.raises(ValueError, match="log-mel"):
                await b.encode(torch.zeros(10, 80))
            first = asyncio.ensure_future(b.encode(tiny_mel(40, 0)))
            await asyncio.sleep(0.01)
            with pytest.raises(QueueFull, match="mel frames"):
                await b.encode(tiny_mel(20, 1))
            first.cancel()

    asyncio.run(run())
