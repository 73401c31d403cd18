"""SGLang's benchmark client, as a user runs it, against ``epd serve --model DIR`` (issue #32).

``python -m sglang.bench_serving --backend vllm-chat --dataset-name image`` reads the served id from
``/v1/models``, loads the processor from that id (the directory as typed), builds prompt text from
random vocabulary ids (so the text may spell special tokens) and sends images as data URLs. Every
request must succeed, without ``--served-model-name``.

The client is not a dependency of the project: it lives in a throwaway venv (``SGLANG_VENV``,
default ``/tmp/sglang-venv``), installed e.g. with

    python3 -m venv /tmp/sglang-venv
    /tmp/sglang-venv/bin/pip install sglang        # or --no-deps sglang plus what bench_serving imports

and the test is skipped when that venv has no ``sglang``. Nothing is fetched from the Hub.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.epd.conftest import start_serve, stop_serve

SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", "/tmp/sglang-venv"))
SGLANG_PY = SGLANG_VENV / "bin" / "python"


def _sglang_available() -> bool:
    if not SGLANG_PY.exists():
        return False
    probe = subprocess.run(
        [str(SGLANG_PY), "-c", "import importlib.util as u; raise SystemExit(u.find_spec('sglang') is None)"],
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not _sglang_available(), reason=f"no sglang in {SGLANG_VENV} (see the module docstring)"
    ),
]


def _bench(url: str, out: Path, *dataset_args: str) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        str(SGLANG_PY), "-m", "sglang.bench_serving",
        "--backend", "vllm-chat", "--base-url", url,
        "--num-prompts", "16", "--max-concurrency", "8",
        "--random-input-len", "48", "--random-output-len", "8",
        "--seed", "1", "--disable-tqdm",
        "--output-file", str(out), "--output-details",
        *dataset_args,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"bench_serving exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    assert out.exists(), f"bench_serving wrote no result:\n{done.stdout[-4000:]}"
    result = json.loads(out.read_text().strip().splitlines()[-1])
    errors = [e for e in result.get("errors", []) if e]
    assert result["completed"] == 16 and not errors, (
        f"completed {result['completed']} of 16; errors: {errors[:3]}"
    )
    return result


def test_sglang_bench_serving_against_epd(qwen_dir: Path, tmp_path: Path) -> None:
    server = start_serve(["--model", str(qwen_dir)])
    try:
        # The client reads the id from /v1/models and loads the processor from it: no --served-model-name.
        image = _bench(
            server.url, tmp_path / "image.jsonl",
            "--dataset-name", "image", "--image-count", "1", "--image-resolution", "224x320",
        )  # fmt: skip
        assert image["total_input_vision_tokens"] > 0
        # random-ids decodes random vocabulary ids, special tokens included: text, never a 400.
        _bench(server.url, tmp_path / "random_ids.jsonl", "--dataset-name", "random-ids")
    finally:
        stop_serve(server)
