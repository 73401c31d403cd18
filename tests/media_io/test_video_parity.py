"""End-to-end parity with transformers' Qwen2VLVideoProcessor.

Reference: every frame decoded to RGB with PyAV at the source size, then
``Qwen2VLVideoProcessor(do_sample_frames=True, fps=2, cap_pixels_per_frame=True)``, which picks
the sampled frames from that array itself (so its own ``sample_frames`` is what our indices are
checked against). transformers' own PyAV loader (``transformers.video_utils.read_video_pyav``,
what ``load_video(backend="pyav")`` calls) does less work for the same frames: with PyAV's
default decoder settings (slice threading) it decodes from the start only up to the last
sampled index, keeps the sampled ``av.VideoFrame`` objects and converts only those to RGB
(``to_ndarray(format="rgb24")``) at the end; ``test_transformers_pyav_loader_keeps_the_reference_frames``
checks that its frames are the reference's. Ours: ``decode_video`` (sampled frames only, resized
in the decoder) then the cpu preprocessing backend. Same indices, same grid, pixel_values within
mean |diff| <= 0.01 and max |diff| <= 0.15.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav

from media_io.config import PreprocessConfig
from media_io.preprocess import get_backend
from media_io.video import decode_video
from tests.fixtures.video_factory import make_clip, make_vfr_clip


def _decode_all(data: bytes) -> tuple[VideoMetadata, np.ndarray]:
    """The clip's metadata as transformers' loader reads it, and every frame: [N, H, W, 3] RGB."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        meta = VideoMetadata(
            total_num_frames=int(stream.frames),
            fps=float(stream.average_rate),
            duration=float(stream.frames / stream.average_rate),
            height=stream.height,
            width=stream.width,
        )
        full = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])  # [N, H, W, 3]
    return meta, full


def _reference(data: bytes, max_video_tokens: int) -> tuple[list[int], torch.Tensor, tuple[int, int, int]]:
    meta, full = _decode_all(data)
    ref = Qwen2VLVideoProcessor(max_video_tokens=max_video_tokens)
    indices = [int(i) for i in ref.sample_frames(meta, fps=2.0).tolist() if i < len(full)]
    out = ref(
        videos=[full],
        video_metadata=[meta],
        do_sample_frames=True,
        fps=2.0,
        cap_pixels_per_frame=True,
        return_tensors="pt",
    )
    grid = tuple(int(x) for x in out["video_grid_thw"][0].tolist())
    return indices, out["pixel_values_videos"], grid  # type: ignore[return-value]


CASES = {
    "upscale-320x240": (lambda: make_clip(320, 240, fps=10.0, seconds=3.0, keyint=7, bframes=2), 128_000),
    "downscale-1280x720": (lambda: make_clip(1280, 720, fps=6.0, seconds=2.0, keyint=5), 128_000),
    "odd-size-330x250": (lambda: make_clip(330, 250, fps=5.0, seconds=2.0, keyint=3), 128_000),
    "budget-640x360": (lambda: make_clip(640, 360, fps=8.0, seconds=2.0, keyint=4), 500),
    "vfr-320x240": (
        lambda: make_vfr_clip([0, 90, 200, 230, 600, 650, 990, 1400, 1500, 2100, 2150], keyint=3),
        128_000,
    ),
}


@pytest.mark.parametrize(
    ("case", "workers"),
    [(c, 1) for c in CASES] + [("upscale-320x240", 2), ("vfr-320x240", 2)],
)
def test_pixel_values_match_the_reference(case: str, workers: int) -> None:
    make, max_video_tokens = CASES[case]
    data = make()
    ref_indices, ref_pixels, ref_grid = _reference(data, max_video_tokens)
    cfg = PreprocessConfig(video_total_pixels=int(max_video_tokens * 28 * 28 * 0.9))

    out = decode_video(data, cfg, workers=workers)
    patches = get_backend("cpu", cfg).video(out.frames)

    assert out.indices == ref_indices
    assert patches.grid_thw == ref_grid
    assert patches.pixel_values.shape == ref_pixels.shape
    # measured: 0.0 on every case (the resize is the reference's own op on the same RGB)
    diff = (patches.pixel_values - ref_pixels).abs()
    assert diff.mean().item() <= 0.01
    assert diff.max().item() <= 0.15


@pytest.mark.parametrize("case", ["upscale-320x240", "vfr-320x240"])
def test_transformers_pyav_loader_keeps_the_reference_frames(case: str) -> None:
    data = CASES[case][0]()
    meta, full = _decode_all(data)
    processor = Qwen2VLVideoProcessor()
    indices = [int(i) for i in processor.sample_frames(meta, fps=2.0).tolist() if i < len(full)]

    def sample(metadata: VideoMetadata, **kwargs: object) -> np.ndarray:
        return np.asarray(processor.sample_frames(metadata, fps=2.0))

    loaded, loaded_meta = read_video_pyav(io.BytesIO(data), sample_indices_fn=sample)  # type: ignore[arg-type]
    assert len(indices) < len(full)  # the case samples: the loader must leave frames out
    assert loaded_meta.total_num_frames == len(full)
    np.testing.assert_array_equal(loaded, full[indices])
