import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from epd.config_cli import add_dataclass_args, dataclass_from_args


@dataclass(frozen=True)
class Inner:
    page_size: int = 16
    ratio: float | None = None


@dataclass(frozen=True)
class Outer:
    host: str = "127.0.0.1"
    port: int = 8000
    verbose: bool = False
    allow_hosts: tuple[str, ...] = ()
    model_path: str | None = None
    rule: Literal["qwen2_vl", "mimo_v2"] = "qwen2_vl"
    engine: Inner = field(default_factory=Inner)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Outer)
    return parser.parse_args(argv)


def test_defaults_come_from_the_dataclass() -> None:
    assert dataclass_from_args(Outer, _parse([])) == Outer()


def test_flags_override_fields_including_nested_and_repeated() -> None:
    args = _parse(
        [
            "--port",
            "9000",
            "--verbose",
            "--allow-hosts",
            "a",
            "--allow-hosts",
            "b",
            "--engine-page-size",
            "32",
        ]
    )
    cfg = dataclass_from_args(Outer, args)
    assert cfg.port == 9000 and cfg.verbose is True
    assert cfg.allow_hosts == ("a", "b")
    assert cfg.engine == Inner(page_size=32)


def test_base_values_survive_unset_flags() -> None:
    base = Outer(host="0.0.0.0", engine=Inner(ratio=0.5))
    cfg = dataclass_from_args(Outer, _parse(["--model-path", "/m"]), base=base)
    assert cfg == Outer(host="0.0.0.0", model_path="/m", engine=Inner(ratio=0.5))


def test_bad_value_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        _parse(["--port", "eighty"])
    with pytest.raises(SystemExit):  # a Literal field takes only its values
        _parse(["--rule", "llava"])


def test_to_argv_round_trips() -> None:
    from epd.config_cli import dataclass_to_argv

    cfg = Outer(
        port=1,
        verbose=True,
        allow_hosts=("x", "y"),
        model_path="/m",
        rule="mimo_v2",
        engine=Inner(page_size=8, ratio=0.25),
    )
    assert dataclass_from_args(Outer, _parse(dataclass_to_argv(cfg))) == cfg
    assert dataclass_to_argv(Outer()) == []
