"""The model ids served (epd/served_model.py): ``--model DIR`` serves DIR as typed,
``--served-model-name`` (repeatable) overrides it, the engines serve the same ids, an unknown id
is vLLM's 404, and the old flags still work with a warning."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from epd.cli import build_parser
from epd.config import IngressConfig
from epd.serve_cmd import ServeConfig, config_from_args, plan
from epd.served_model import DEFAULT_MODEL_ID, resolve_model
from epd_common.errors import APIError
from llm_core.serving.server_config import LLMServerConfig


def serve_config(*argv: str) -> ServeConfig:
    return config_from_args(build_parser(only="serve").parse_args(["serve", *argv]))


def engine_names(cfg: ServeConfig) -> list[tuple[str, ...]]:
    """The ids each engine child of ``epd serve`` will serve, read back from its command line."""
    parser = build_parser(only="llm")
    out = []
    for child in plan(cfg).children:
        if child.name.startswith("llm"):
            argv = list(child.argv)
            args = parser.parse_args(argv[argv.index("llm") :])
            out.append(
                LLMServerConfig(served_model_name=tuple(args.served_model_name or ())).served_model_names
            )
    return out


def test_the_embedded_default_is_epd_default() -> None:
    cfg = serve_config()
    assert cfg.ingress.served_model_names == (DEFAULT_MODEL_ID,) == ("epd-default",)
    assert engine_names(cfg) == [("epd-default",)]
    assert IngressConfig().served_model_names == LLMServerConfig().served_model_names == ("epd-default",)


@pytest.mark.parametrize("typed", ["models/Qwen2.5-VL-3B-Instruct", "./m/../m/", "/abs/dir"])
def test_model_dir_as_typed_is_the_id(typed: str) -> None:
    cfg = serve_config("--model", typed)
    assert cfg.ingress.served_model_names == (typed,)
    assert cfg.llm.served_model_names == (typed,)
    assert plan(cfg).ingress.served_model_names == (typed,)
    assert LLMServerConfig(model_path=typed).served_model_names == (typed,)  # `epd llm --model DIR`


def test_split_llm_model_is_the_id() -> None:
    assert serve_config("--llm-model", "some/llm").ingress.served_model_names == ("some/llm",)


def test_served_model_name_is_repeatable_and_reaches_the_engines() -> None:
    cfg = serve_config("--model", "dir", "--served-model-name", "a", "--served-model-name", "b")
    assert cfg.ingress.served_model_names == ("a", "b")
    assert cfg.ingress.model_name == "a"  # what responses report
    assert engine_names(cfg) == [("a", "b")]
    cfg = serve_config("--served-model-name", "a", "--llm-instances", "2")
    assert engine_names(cfg) == [("a",), ("a",)]


@pytest.mark.parametrize("flag", ["--model-name", "--llm-served-model-name"])
def test_deprecated_flags_still_name_the_model_and_warn(flag: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="epd.served_model"):
        cfg = serve_config("--model", "dir", flag, "old")
    assert cfg.ingress.served_model_names == ("old",) and cfg.llm.served_model_names == ("old",)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert flag in caplog.text and "deprecated" in caplog.text and "--served-model-name" in caplog.text


def test_no_warning_without_deprecated_flags(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="epd.served_model"):
        serve_config("--model", "dir", "--served-model-name", "x")
    assert not caplog.records


def test_a_request_may_name_any_served_id() -> None:
    config = IngressConfig(served_model_name=("first", "second"))
    assert resolve_model(config, "second") == "first"
    assert resolve_model(config, "first") == "first"
    assert resolve_model(config, None) == "first"
    assert resolve_model(config, "") == "first"
    assert resolve_model(IngressConfig(llm_model_dir="d/"), "d/") == "d/"


def test_an_unknown_model_is_vllms_404() -> None:
    config = IngressConfig(llm_model_dir="models/qwen")
    with pytest.raises(APIError) as ei:
        resolve_model(config, "epd-default")
    err = ei.value
    assert (err.status, err.type, err.param) == (404, "NotFoundError", "model")
    assert err.message == "The model `epd-default` does not exist."
    with pytest.raises(APIError) as bad:
        resolve_model(config, 5)
    assert bad.value.status == 400 and bad.value.param == "model"


def test_ingress_lists_every_served_id() -> None:
    from epd.ingress_app import build_app

    client = TestClient(  # no lifespan: nothing starts or polls
        build_app(IngressConfig(encoder_urls=("http://127.0.0.1:9",), served_model_name=("a", "b")))
    )
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["a", "b"]
    assert all(m["object"] == "model" for m in data)
