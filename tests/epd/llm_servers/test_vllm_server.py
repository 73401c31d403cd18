"""vLLM's answers as the chat path's typed results (epd/llm_servers/vllm_server.py), the model
facts read from config.json, and the local vLLM argv (epd/llm_servers/vllm_launch.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from epd.llm_servers.vllm_launch import API_SERVER_MODULE, VLLMLaunch, find_vllm, launch_args
from epd.llm_servers.vllm_server import ModelInfo, VLLMServer


def backend() -> VLLMServer:
    return VLLMServer.__new__(VLLMServer)  # the parsers use no state


def test_whole_answer() -> None:
    out = {
        "choices": [
            {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "token_ids": [5, 6]}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": None},
        "prompt_token_ids": [1, 2, 3],
    }
    r = backend().chat_result(out)
    assert (r.text, r.finish_reason, r.token_ids, r.prompt_token_ids) == ("hi", "stop", [5, 6], [1, 2, 3])
    assert r.usage == {"prompt_tokens": 9, "completion_tokens": 2}  # vLLM's nulls dropped


def test_stream_chunks() -> None:
    b = backend()
    first = b.chat_delta(
        {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    )
    assert first.text == "" and first.finish_reason is None and first.usage is None
    mid = b.chat_delta({"choices": [{"delta": {"content": " world"}, "finish_reason": None}]})
    assert mid.text == " world"
    end = b.chat_delta({"choices": [{"delta": {}, "finish_reason": "length"}]})
    assert end.finish_reason == "length"
    usage = b.chat_delta({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    assert usage.usage == {"prompt_tokens": 3, "completion_tokens": 1}


def test_model_info_of_a_qwen_layout(tmp_path: Path) -> None:
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {"hidden_size": 2048},
        "vision_config": {"spatial_merge_size": 2, "out_hidden_size": 2048},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = ModelInfo.of(tmp_path)
    assert info.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert info.geometry == (2, 2048)


def test_launch_argv_and_environment() -> None:
    launch = VLLMLaunch(
        "/ckpt",
        8123,
        python=sys.executable,
        served_model_names=("a",),
        extra_args=launch_args(["--max-num-seqs 64"]),
    )
    argv = launch.argv()
    assert argv[:3] == [sys.executable, "-m", API_SERVER_MODULE]
    assert "--enable-mm-embeds" in argv and argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--max-num-seqs", "64"]  # the user's last: they override ours
    assert argv[argv.index("--served-model-name") + 1] == "a"
    assert launch.environ()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert launch.url == "http://127.0.0.1:8123"


def test_no_vllm_anywhere_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EPD_PEERS_DIR", str(tmp_path))  # no peer venv here
    monkeypatch.setenv("PATH", str(tmp_path))  # and no vllm on PATH
    with pytest.raises(RuntimeError, match="make vllm-peer"):
        find_vllm()
    assert find_vllm("/some/python") == ["/some/python", "-m", API_SERVER_MODULE]
