"""vLLM's own MiMo-V2.5 raw-image path against its embeddings input (a real vLLM, the CPU build;
skipped without it). vLLM's CPU build cannot run the release's windowed tower (its window kernel is
Triton-only), so the tiny checkpoint here has a tower of full-attention blocks without sinks
(``tests.fixtures.mimo_v2_vllm``, ``full_attention_tower=True``), which vLLM runs on raw images.

The rows vLLM's tower computed for an image (captured by its EC producer), sent back by hand as
``image_embeds``, give exactly vLLM's greedy ids for the raw image: the embeddings input is plumbed
exactly, so the answers epd's rows give differ from vLLM's raw-image answers only through the rows
(docs/models.md: the reference differences, measured by ``bench.mimo_vllm_reference``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd.llm_servers.vllm_launch import VLLMProcess, free_port, peer_python
from tests.epd.conftest import http_json
from tests.fixtures import mimo_v2 as fx
from tests.fixtures.mimo_v2_vllm import write_tiny_mimo_v2_vllm
from tests.fixtures.qwen2_5_vl import make_image
from tests.fixtures.vllm_raw_tower import (
    captured_rows,
    chat_body,
    embeds_part,
    raw_image_part,
    raw_tower_launch,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)"),
]

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def full_tower_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mimo_v2_vllm(tmp_path_factory.mktemp("mimo_v2_vllm_full"), full_attention_tower=True)


@pytest.fixture(scope="module")
def ec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def vllm(
    full_tower_dir: Path, ec_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMProcess]:
    launch = raw_tower_launch(full_tower_dir, free_port(), ec_dir)
    log = tmp_path_factory.mktemp("vllm_log") / "vllm.log"
    with VLLMProcess(launch, log, ready_timeout_s=290.0) as server:
        yield server


def _chat(vllm: VLLMProcess, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = http_json("POST", f"{vllm.url}/v1/chat/completions", body)
    assert status == 200, reply
    return dict(reply)


@pytest.mark.parametrize(("width", "height", "seed"), [(150, 90, 7), (64, 128, 8)])
def test_its_own_rows_sent_by_hand_give_its_raw_image_ids(
    vllm: VLLMProcess, full_tower_dir: Path, ec_dir: Path, width: int, height: int, seed: int
) -> None:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    img = make_image(width, height, seed)
    question = "Describe the picture."
    raw = _chat(vllm, chat_body(full_tower_dir, raw_image_part(img, f"raw-{seed}"), question, NEW_TOKENS))
    rows = captured_rows(ec_dir, f"raw-{seed}")
    h, w = smart_resize(height, width, 32, fx.IMAGE_MIN_PIXELS, fx.IMAGE_MAX_PIXELS)
    grid = (1, h // 16, w // 16)
    assert rows.shape == (h * w // 1024, fx.HIDDEN)
    assert raw["prompt_token_ids"].count(fx.token_id(fx.IMAGE_PAD)) == rows.shape[0]

    by_hand = _chat(
        vllm, chat_body(full_tower_dir, embeds_part(rows, grid, f"hand-{seed}"), question, NEW_TOKENS)
    )
    assert by_hand["prompt_token_ids"] == raw["prompt_token_ids"]
    assert by_hand["choices"][0]["token_ids"] == raw["choices"][0]["token_ids"]
    assert len(raw["choices"][0]["token_ids"]) == NEW_TOKENS
