from media_io.config import PreprocessConfig


def test_row_layout_matches_qwen2_vl() -> None:
    cfg = PreprocessConfig()
    assert cfg.factor == 28
    assert cfg.row_size == 1176


def test_key_params_change_with_config() -> None:
    a = PreprocessConfig().key_params()
    b = PreprocessConfig(max_pixels=448 * 448).key_params()
    assert a != b
