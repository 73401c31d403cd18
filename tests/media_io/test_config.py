import dataclasses

import pytest

from media_io.config import PreprocessConfig
from tests.media_io.configs import MIMO_V25


def test_row_layout_matches_qwen2_vl() -> None:
    cfg = PreprocessConfig()
    assert cfg.factor == 28
    assert cfg.row_size == 1176


def test_row_layout_of_mimo_v25() -> None:
    assert MIMO_V25.factor == 32  # patch 16 x merge 2
    assert MIMO_V25.row_size == 1536  # (C=3, T=2, 16, 16)


def test_key_params_change_with_config() -> None:
    a = PreprocessConfig().key_params()
    b = PreprocessConfig(max_pixels=448 * 448).key_params()
    assert a != b


# A different valid value for every field: each one changes the pixels, the grid or the frames.
_OTHER: dict[str, object] = {
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 3,
    "min_pixels": 1000,
    "max_pixels": 2000 * 2000,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "fps": 1.0,
    "min_frames": 8,
    "max_frames": 3600,
    "video_min_pixels": 8192,
    "video_max_pixels": 8388608,
    "video_total_pixels": 268435456,
    "video_sampling": "mimo_v2",
}


def test_every_field_enters_the_key() -> None:
    names = [f.name for f in dataclasses.fields(PreprocessConfig)]
    assert sorted(names) == sorted(_OTHER)  # a new field needs a value here (and is then checked)
    base = PreprocessConfig().key_params()
    for name in names:
        changed = dataclasses.replace(PreprocessConfig(), **{name: _OTHER[name]}).key_params()
        assert changed != base, name


def test_equal_settings_key_equally() -> None:
    assert PreprocessConfig(fps=1).key_params() == PreprocessConfig(fps=1.0).key_params()
    assert PreprocessConfig(image_mean=[0.5, 0.5, 0.5]) == PreprocessConfig(image_mean=(0.5, 0.5, 0.5))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("patch_size", 0),
        ("merge_size", 1.5),
        ("fps", 0.0),
        ("image_std", (1.0, 0.0, 1.0)),
        ("video_sampling", "x"),
    ],
)
def test_bad_values_are_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PreprocessConfig(**{field: value})  # type: ignore[arg-type]
