"""LLMServerConfig: the engine process's thread count from the command line, its check, and that
``serve_llm`` makes the engine thread and the CPU layer kernel use it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from epd.config_cli import add_dataclass_args, dataclass_from_args
from llm_core.kernels import cpu_layer
from llm_core.serving.server_config import LLMServerConfig

REPO = Path(__file__).resolve().parents[3]

# Run in a fresh process (torch's thread count is process-wide): ``serve_llm`` with uvicorn replaced
# by a client that starts the app (its lifespan starts the engine thread) and asks for a completion,
# while the layer kernel's ``set_threads`` records what each forward passes it. The requested count
# is one more than torch's default here, so it cannot pass by being the default.
SERVE_AND_RECORD = """
import json, sys, threading
from pathlib import Path

import torch
import uvicorn
from starlette.testclient import TestClient

import encoder.caches.embed_cache as embed_cache
from llm_core.kernels import cpu_layer
from llm_core.serving import server
from llm_core.serving.server_config import EngineConfig, LLMServerConfig

model_dir, cache_root = sys.argv[1], Path(sys.argv[2])
embed_cache.default_root = lambda namespace: cache_root / namespace  # not /dev/shm
default = torch.get_num_threads()
requested = default + 1
calls = []
kernel_set_threads = cpu_layer.set_threads


def recording_set_threads(n):
    in_use = kernel_set_threads(n)
    calls.append({"thread": threading.current_thread().name, "n": n, "in_use": in_use})
    return in_use


cpu_layer.set_threads = recording_set_threads
seen = {}


def run_with_a_client(app, **kwargs):
    seen["server_thread"] = torch.get_num_threads()
    with TestClient(app) as client:
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text


uvicorn.run = run_with_a_client
engine = EngineConfig(kv_memory_bytes=4 << 20, max_model_len=256)
server.serve_llm(LLMServerConfig(model_path=model_dir, engine=engine, torch_threads=requested))
print(json.dumps({"default": default, "requested": requested, "calls": calls, **seen}))
"""


def test_torch_threads_flag() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, LLMServerConfig)
    assert dataclass_from_args(LLMServerConfig, parser.parse_args([])).torch_threads is None
    config = dataclass_from_args(LLMServerConfig, parser.parse_args(["--torch-threads", "3"]))
    assert config.torch_threads == 3


def test_torch_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        LLMServerConfig(torch_threads=0)


@pytest.mark.skipif(not cpu_layer.AVAILABLE, reason="the CPU decoder-layer kernel is not built")
def test_torch_threads_reach_the_engine_thread_and_the_layer_kernel(
    tiny_mimo_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_AND_RECORD, str(tiny_mimo_dir), str(tmp_path / "cache")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    n = got["requested"]
    assert n != got["default"]
    # One call per forward (prefill, then each decode step), all on the engine's own thread: torch's
    # count there (what the model passes on) is the configured one, and the kernel's pool took it.
    assert len(got["calls"]) >= 2
    assert all(c == {"thread": "llm-engine", "n": n, "in_use": n} for c in got["calls"]), got["calls"]
    assert got["server_thread"] == n  # and the server's own thread
