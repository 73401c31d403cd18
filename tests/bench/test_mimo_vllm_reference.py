"""bench.mimo_vllm_reference's own parts, without a vLLM: its release-path pixels are transformers'
``Qwen2VLImageProcessor``'s (the patch layout its vLLM-path pixels share), and the id agreement."""

from __future__ import annotations

import torch

from bench.mimo_vllm_reference import IMAGENET, agreement, pixels
from tests.fixtures import mimo_v2 as fx
from tests.fixtures.qwen2_5_vl import make_image


def test_release_pixels_are_the_processors() -> None:
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=fx.IMAGE_MIN_PIXELS,
        max_pixels=fx.IMAGE_MAX_PIXELS,
        image_mean=fx.CLIP_MEAN,
        image_std=fx.CLIP_STD,
    )
    for width, height in [(150, 90), (64, 128), (224, 160)]:
        img = make_image(width, height, seed=3)
        want = proc(images=[img], return_tensors="pt")["pixel_values"].double()
        got = pixels(img, "bicubic", (tuple(fx.CLIP_MEAN), tuple(fx.CLIP_STD)))
        assert got.shape == want.shape and float((got - want).abs().max()) < 1e-5
        vllm_path = pixels(img, "bilinear", IMAGENET)
        assert vllm_path.shape == want.shape and not torch.allclose(vllm_path, want)


def test_agreement() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, None)
    assert agreement([1, 9, 3, 4], [1, 2, 3, 5]) == (0.5, 1)
