import pytest

from epd.cli import build_parser, main


def test_unknown_subcommand_is_an_error() -> None:
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_parser_lists_serve() -> None:
    assert "serve" in build_parser().format_help()
