"""Fidelity end to end: ``epd serve`` on checkpoints written by transformers answers what transformers
computes on the same inputs.

One server for the module, started with ``--encoder-model`` (a tiny random Qwen2.5-VL checkpoint) and
``--llm-model`` (a tiny random MiMo-V2-Flash checkpoint with the byte-level tokenizer.json beside it).
The same checkpoint without its tokenizer.json must not start at all: the error names the file.

- ``/v1/encode?embeddings=true`` equals Qwen2VLImageProcessor + Qwen2_5_VisionTransformerPretrainedModel
  on the same image bytes (relative error <= 1e-3: different resize code paths feed the same model).
- ``/v1/completions`` with token-id prompts, greedy, equals ``generate(do_sample=False)`` token for
  token, for prompts shorter and longer than the sliding window (8 in this checkpoint).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tests.encoder.hf_fixtures import hf_vision_model, save_hf_full_model
from tests.epd.conftest import (
    ServeProcess,
    embedding_of,
    http_json,
    image_bytes,
    photo,
    rel_err,
    serve_fails_at_start,
    start_serve,
    stop_serve,
    upload,
)
from tests.llm_core.conftest import build_tiny_mimo

VISION_SEED = 5
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fidelity")
    save_hf_full_model(hf_vision_model(seed=VISION_SEED), root / "vision")
    return root / "vision", build_tiny_mimo(root / "mimo")


@pytest.fixture(scope="module")
def fidelity_server(checkpoints: tuple[Path, Path]) -> Iterator[ServeProcess]:
    vision_dir, mimo_dir = checkpoints
    server = start_serve(
        ["--encoder-model", str(vision_dir), "--llm-model", str(mimo_dir), "--served-model-name", "tiny"]
    )
    try:
        yield server
    finally:
        assert stop_serve(server) == 0, server.tail()
        assert not server.shm_dir.exists(), f"{server.shm_dir} was left behind"


def test_embeddings_match_transformers(fidelity_server: ServeProcess) -> None:
    from transformers import Qwen2VLImageProcessor

    cases = [
        ("wide.jpg", image_bytes(photo(150, 100, 7), "JPEG")),
        ("tall.png", image_bytes(photo(60, 130, 8), "PNG")),
    ]
    status, body = upload(
        fidelity_server,
        [(name, data, "application/octet-stream") for name, data in cases],
        "?embeddings=true",
    )
    assert status == 200, body
    processor = Qwen2VLImageProcessor()
    model = hf_vision_model(seed=VISION_SEED)
    for entry, (_, data) in zip(body["data"], cases, strict=True):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        ref_in = processor(images=img, return_tensors="pt")
        with torch.no_grad():
            ref = model(ref_in["pixel_values"], grid_thw=ref_in["image_grid_thw"]).pooler_output
        assert entry["grid_thw"] == ref_in["image_grid_thw"].tolist()
        served = embedding_of(entry)
        assert served.shape == ref.shape
        assert rel_err(served, ref) <= 1e-3


@pytest.fixture(scope="module")
def hf_mimo(checkpoints: tuple[Path, Path]) -> Any:
    from transformers import MiMoV2FlashForCausalLM

    model = MiMoV2FlashForCausalLM.from_pretrained(
        checkpoints[1], dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_greedy_completion_ids_match_transformers_generate(
    fidelity_server: ServeProcess, hf_mimo: Any
) -> None:
    gen = torch.Generator().manual_seed(11)
    # Ids across the model's whole vocabulary: the checkpoint has no tokenizer.json, so the
    # server's tokenizer (byte-level default) knows fewer ids than the model embeds.
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23)]
    for prompt in prompts:
        status, body = http_json(
            "POST",
            f"{fidelity_server.url}/v1/completions",
            {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["prompt_token_ids"] == prompt
        with torch.no_grad():
            out = hf_mimo.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert choice["token_ids"] == out[0, len(prompt) :].tolist()


def test_chat_with_an_image_on_the_real_checkpoints(fidelity_server: ServeProcess) -> None:
    """E -> P -> D on the transformers-written checkpoints (encoder out 64 = LLM hidden 64), with the
    byte-level default tokenizer the ingress falls back to."""
    from base64 import b64encode

    uri = "data:image/png;base64," + b64encode(image_bytes(photo(64, 64, 9), "PNG")).decode()
    part = {"type": "image_url", "image_url": {"url": uri}}
    status, body = http_json(
        "POST",
        f"{fidelity_server.url}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["image_tokens"] == 4  # 64x64 -> 56x56 -> 4x4 patches -> 2x2 merged


def test_checkpoint_without_tokenizer_fails_at_start(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    """No silent byte-level fallback for a user's checkpoint: `epd serve` exits before starting any
    role, and says which file is missing."""
    _, mimo_dir = checkpoints
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(mimo_dir, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    stderr = serve_fails_at_start(["--llm-model", str(bare)])
    assert f"epd serve: {bare / 'tokenizer.json'} not found" in stderr
