"""`epd serve` flags that set more than one role (--dtype), and a former flag name."""

from __future__ import annotations

import pytest

from epd.cli import build_parser
from epd.serve_cmd import ServeConfig, config_from_args


def _config(*argv: str) -> ServeConfig:
    return config_from_args(build_parser(only="serve").parse_args(["serve", *argv]))


def test_dtype_sets_every_role() -> None:
    cfg = _config("--dtype", "float32")
    assert (cfg.encoder.dtype, cfg.llm.dtype, cfg.vllm_dtype) == ("float32", "float32", "float32")


def test_without_dtype_every_role_is_auto() -> None:
    cfg = _config()
    assert (cfg.encoder.dtype, cfg.llm.dtype, cfg.vllm_dtype) == ("auto", "auto", "auto")


def test_a_role_flag_overrides_dtype() -> None:
    cfg = _config("--dtype", "bfloat16", "--encoder-dtype", "float32", "--vllm-dtype", "float16")
    assert (cfg.encoder.dtype, cfg.llm.dtype, cfg.vllm_dtype) == ("float32", "bfloat16", "float16")
    cfg = _config("--dtype", "bfloat16", "--llm-dtype", "float32")
    assert (cfg.encoder.dtype, cfg.llm.dtype) == ("bfloat16", "float32")


def test_vllm_spellings_are_accepted() -> None:
    assert _config("--dtype", "half").llm.dtype == "float16"
    assert _config("--dtype", "float").encoder.dtype == "float32"


def test_an_unknown_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _config("--dtype", "fp64")
    assert e.value.code == 2
    assert "unknown dtype 'fp64'" in capsys.readouterr().err


def test_the_former_llm_backend_flag_still_picks_the_llm_server() -> None:
    for flag in ("--llm-server", "--llm-backend"):
        cfg = _config(flag, "vllm", "--llm-url", "http://h:1")
        assert cfg.ingress.llm_server == "vllm"
