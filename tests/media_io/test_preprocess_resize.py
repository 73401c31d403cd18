"""smart_resize: identical to transformers' rule, with typed errors for impossible shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference_smart_resize

from media_io.errors import BadMedia
from media_io.preprocess import smart_resize
from tests.media_io.configs import CONFIGS

QWEN = (28, 56 * 56, 28 * 28 * 1280)  # factor, min_pixels, max_pixels


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=400, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000))
def test_matches_transformers_and_keeps_invariants(config: str, height: int, width: int) -> None:
    cfg = CONFIGS[config]
    f = cfg.factor  # 28 for Qwen2-VL, 32 for MiMo-V2.5
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(BadMedia):
            smart_resize(height, width, f, cfg.min_pixels, cfg.max_pixels)
        return
    h, w = smart_resize(height, width, f, cfg.min_pixels, cfg.max_pixels)
    assert (h, w) == reference_smart_resize(height, width, f, cfg.min_pixels, cfg.max_pixels)
    assert h % f == 0 and w % f == 0 and h >= f and w >= f
    assert h * w <= cfg.max_pixels
    # min_pixels holds unless the max cap forced a side down to its factor-pixel floor.
    assert h * w >= cfg.min_pixels or f in (h, w)


@pytest.mark.parametrize(
    ("height", "width", "min_pixels", "max_pixels"),
    [
        (28, 28, 56 * 56, 28 * 28 * 1280),  # below min_pixels: scaled up
        (4032, 3024, 56 * 56, 28 * 28 * 1280),  # above max_pixels: scaled down
        (10, 2000, 56 * 56, 28 * 28 * 1280),  # exactly 200:1 is allowed
        (42, 70, 56 * 56, 28 * 28 * 1280),  # 42/28 = 1.5 rounds to even (banker's rounding)
        (720, 1280, 128 * 28 * 28, 28 * 28 * 768),  # the video bounds
        (1, 150, 56 * 56, 28 * 28 * 1280),  # a one-pixel side
    ],
)
def test_edge_cases_match_transformers(height: int, width: int, min_pixels: int, max_pixels: int) -> None:
    expected = reference_smart_resize(height, width, 28, min_pixels, max_pixels)
    assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected


@pytest.mark.parametrize(("height", "width"), [(10, 2011), (3000, 14), (1, 201)])
def test_aspect_ratio_over_200_is_bad_media_naming_the_item(height: int, width: int) -> None:
    with pytest.raises(BadMedia, match=r"aspect ratio .* above the 200:1 limit") as info:
        smart_resize(height, width, *QWEN, item="images[3]")
    assert info.value.item == "images[3]"
    assert info.value.status == 400
    assert f"{width}x{height}" in info.value.message


@pytest.mark.parametrize(("height", "width"), [(0, 10), (10, 0), (-5, 5)])
def test_empty_side_is_bad_media(height: int, width: int) -> None:
    with pytest.raises(BadMedia, match="empty side"):
        smart_resize(height, width, *QWEN)
