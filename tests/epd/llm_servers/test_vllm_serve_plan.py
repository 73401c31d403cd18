"""What ``epd serve --llm-server vllm`` starts: no epd engine; one supervised local vLLM on the same
checkpoint without --llm-url, none with it (epd/serve_cmd.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd import serve_cmd
from epd.cli import build_parser
from epd.llm_servers.vllm_routing import KVEventsAt, local_kv_events, remove_local
from epd.placement import CpuSplit, plan_split
from epd.serve_cmd import ServeConfig, config_from_args, cpu_split, plan


@pytest.fixture(autouse=True)
def _no_socket_folders_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A plan with a local vLLM makes its KV-event socket folder (serve removes it at exit; a
    plan made here never serves): removed after each test."""
    made: list[KVEventsAt] = []

    def recording() -> KVEventsAt:
        made.append(local_kv_events())
        return made[-1]

    monkeypatch.setattr(serve_cmd, "local_kv_events", recording)
    yield
    for events in made:
        remove_local(events)


def serve_config(*argv: str) -> ServeConfig:
    return config_from_args(build_parser(only="serve").parse_args(["serve", *argv]))


def test_local_vllm_child(qwen_dir: Path) -> None:
    cfg = serve_config(
        "--model",
        str(qwen_dir),
        "--llm-server",
        "vllm",
        "--vllm-python",
        sys.executable,
        "--vllm-arg=--max-num-seqs 8",
    )
    p = plan(cfg)
    names = [c.name for c in p.children]
    assert "vllm" in names and not any(n.startswith("llm") for n in names)
    child = next(c for c in p.children if c.name == "vllm")
    assert child.argv[:3] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
    assert child.argv[child.argv.index("--model") + 1] == str(qwen_dir)
    assert child.argv[-2:] == ("--max-num-seqs", "8")
    assert p.ingress.llm_server == "vllm"
    assert p.ingress.llm_urls == (child.health_url.removesuffix("/health"),)
    assert p.llm_children == {"vllm": p.ingress.llm_urls[0]}  # the supervisor marks it down and up
    # what the router needs of it: block hashes it can recompute, cached tokens, its KV events
    argv = child.argv
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert "--enable-prompt-tokens-details" in argv
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq" and events["topic"] == ""
    assert p.ingress.vllm_kv_events == (f"{events['endpoint']},{events['replay_endpoint']}",)


def test_the_local_vllm_runs_on_its_own_cores(qwen_dir: Path) -> None:
    cfg = serve_config("--model", str(qwen_dir), "--llm-server", "vllm", "--vllm-python", sys.executable)
    split = CpuSplit((1,), (0,))
    child = next(c for c in plan(cfg, split).children if c.name == "vllm")
    assert child.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    if shutil.which("taskset"):
        assert child.argv[1:3] == ("-c", "1") and child.argv[3] == sys.executable
    assert cpu_split(cfg) == plan_split("auto", os.sched_getaffinity(0))
    assert (
        cpu_split(serve_config("--model", str(qwen_dir), "--llm-server", "vllm", "--cpu-split", "off"))
        is None
    )
    # epd's own engines, or vLLM servers elsewhere: nothing to place
    assert (
        cpu_split(serve_config("--model", str(qwen_dir), "--llm-server", "vllm", "--llm-url", "http://a:1"))
        is None
    )


def test_remote_vllm_servers_start_nothing(qwen_dir: Path) -> None:
    cfg = serve_config(
        "--model",
        str(qwen_dir),
        "--llm-server",
        "vllm",
        "--llm-url",
        "http://a:8000",
        "--llm-url",
        "http://b:8000",
    )
    p = plan(cfg)
    assert [c.name for c in p.children if not c.name.startswith("encoder")] == []
    assert p.ingress.llm_urls == ("http://a:8000", "http://b:8000")


def test_no_split_roles_with_vllm(qwen_dir: Path) -> None:
    cfg = serve_config(
        "--model",
        str(qwen_dir),
        "--llm-server",
        "vllm",
        "--llm-prefill-instances",
        "1",
        "--llm-decode-instances",
        "1",
    )
    with pytest.raises(SystemExit, match="no prefill/decode split"):
        plan(cfg)
