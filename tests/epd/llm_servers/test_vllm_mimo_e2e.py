"""``epd serve --llm-server vllm`` on MiMo-V2.5 with a real vLLM (the CPU build `make vllm-peer`
installs; skipped without it): the tiny checkpoint in the form vLLM runs (``tests.fixtures.
mimo_v2_vllm``: BF16, V padded to the head dim, the release's windowed tower with sinks), served by
the vLLM epd starts itself with the family's launch profile (``--trust-remote-code``, every
multimodal limit 0: embeddings only; config.json's ``rope_theta`` as ``--hf-overrides``, which the
fixture's plain config class would otherwise lose under transformers 5).

- Images: the greedy ids through epd equal transformers' ``MiMoV2FlashForCausalLM`` on the same
  weights fed epd's prompt ids (the chat template's, one pad per row) with epd's rows at the pads
  and plain 1-D positions; a repeated image is a node-cache hit with the same answer.
- Videos and audio: 415 naming the backend and why, and nothing reaches vLLM (which itself refuses
  ``video_embeds`` for this class).
- A cached embedding of the wrong width is never sent: 502, vLLM stays up.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from encoder.caches.embed_cache import EmbedCache
from epd.llm_servers.vllm_embeds import EmbeddingGeometry
from epd.llm_servers.vllm_launch import peer_python
from epd.llm_servers.vllm_server import ModelInfo, VLLMServer
from epd.prompt_format import PromptFormat
from llm_core.prompts.tokenizer import load_tokenizer
from tests.epd.conftest import ServeProcess, forge_cached_embedding, http_json, serving_with_local_vllm
from tests.epd.llm_servers.test_vllm_e2e import SupervisedVLLM
from tests.epd.test_e2e_mimo_v2 import _data_uri, _png
from tests.fixtures import mimo_v2 as fx
from tests.fixtures.mimo_v2_reference import reference_model
from tests.fixtures.mimo_v2_vllm import WINDOW
from tests.fixtures.qwen2_5_vl import make_image

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)"),
]

NEW_TOKENS = 16
IMAGE_PAD = fx.token_id(fx.IMAGE_PAD)


@pytest.fixture(scope="module")
def epd(mimo_v2_vllm_dir: Path) -> Iterator[ServeProcess]:
    with serving_with_local_vllm(mimo_v2_vllm_dir, "--encoder-dtype", "float32") as server:
        yield server


@pytest.fixture(scope="module")
def vllm(epd: ServeProcess) -> SupervisedVLLM:
    (url,) = [e["url"] for e in http_json("GET", f"{epd.url}/health")[1]["llm_routing"]["engines"]]
    server = SupervisedVLLM(url)
    assert server.alive and server.healthy()
    return server


def image_part(seed: int, width: int = 150, height: int = 90) -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": _data_uri(_png(make_image(width, height, seed)), "image/png")},
    }


def chat(epd: ServeProcess, content: list[dict[str, Any]], expect: int = 200) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    status, reply = http_json("POST", f"{epd.url}/v1/chat/completions", body)
    assert status == expect, reply
    return dict(reply)


def template_ids(model_dir: Path, images: int, text: str) -> list[int]:
    """transformers' rendering and tokenization of one user turn (one placeholder per image); the
    tokenizer class named directly (the directory's auto_map would ask to run its config code)."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(str(model_dir))
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    out = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"])


def epd_rows(epd: ServeProcess, key: str) -> torch.Tensor:
    """The embedding epd's node cache holds under ``key`` (what was sent to vLLM)."""
    cache = EmbedCache(namespace=f"serve-{epd.port}")
    try:
        entry = cache.get(key, touch=False)
        assert entry is not None, key
        return entry.tensor.clone()
    finally:
        cache.close()


def reference_ids(model_dir: Path, prompt: list[int], rows: torch.Tensor) -> list[int]:
    """transformers' greedy tokens for ``prompt`` with ``rows`` at its image pads (positions 0..L-1)."""
    from transformers import GenerationConfig

    model = reference_model(model_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        mask = ids[0] == IMAGE_PAD
        assert int(mask.sum()) == rows.shape[0]
        embeds[0, mask] = rows.to(embeds.dtype)
        gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), generation_config=gen)
    return [int(t) for t in out[0, -NEW_TOKENS:]]


def _routed(epd: ServeProcess) -> int:
    (row,) = http_json("GET", f"{epd.url}/health")[1]["llm_routing"]["engines"]
    return int(row["routed"])


def test_the_supervised_vllm_runs_the_profile(vllm: SupervisedVLLM) -> None:
    pid = vllm.pid()
    assert pid is not None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "--trust-remote-code" in argv and "--enable-mm-embeds" in argv
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image":0,"video":0,"audio":0}'
    assert argv[argv.index("--hf-overrides") + 1] == '{"rope_theta": 10000000.0}'


@pytest.mark.parametrize("seeds", [(7,), (8, 9)], ids=["one_image", "two_images"])
def test_images_equal_the_reference(
    epd: ServeProcess, vllm: SupervisedVLLM, mimo_v2_vllm_dir: Path, seeds: tuple[int, ...]
) -> None:
    question = "Describe the picture."
    content = [
        *(image_part(s, 150 - 40 * i, 90 + 32 * i) for i, s in enumerate(seeds)),
        {"type": "text", "text": question},
    ]
    reply = chat(epd, content)
    choice = reply["choices"][0]
    prompt = choice["prompt_token_ids"]
    per_image = [epd_rows(epd, m["key"]) for m in reply["media"]]
    rows = torch.cat(per_image)
    # the chat template's ids, each image's pad expanded to its rows (as the release's processor lays it out)
    rendered = template_ids(mimo_v2_vllm_dir, len(seeds), question)
    counts = iter(r.shape[0] for r in per_image)
    expanded = [t for tok in rendered for t in ([tok] * next(counts) if tok == IMAGE_PAD else [tok])]
    assert prompt == expanded and rows.shape == (prompt.count(IMAGE_PAD), fx.HIDDEN)
    assert len(prompt) + NEW_TOKENS <= WINDOW  # inside the window: vLLM attends one key fewer past it
    assert choice["token_ids"] == reference_ids(mimo_v2_vllm_dir, prompt, rows)

    again = chat(epd, content)
    assert all(m["cache_hit"] for m in again["media"]) and again["usage"]["cached_media"] == len(seeds)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    assert vllm.alive


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_videos_and_audio_are_415_before_anything_is_sent(
    epd: ServeProcess, vllm: SupervisedVLLM, kind: str
) -> None:
    part = (
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
        if kind == "video"
        else {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    )
    before = _routed(epd)
    status, reply = http_json(
        "POST",
        f"{epd.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], "max_tokens": 2},
    )
    assert status == 415, reply
    message = reply["error"]["message"]
    assert f"vllm LLM server does not take {kind} input" in message and "vLLM 0.32" in message, message
    assert reply["error"]["param"] == "messages[0].content[0]"
    assert _routed(epd) == before and vllm.alive and vllm.healthy()


def test_vllm_itself_takes_no_video_embeddings(vllm: SupervisedVLLM, mimo_v2_vllm_dir: Path) -> None:
    """Why videos are refused: sent by hand, vLLM 0.32 answers a 400 for this class."""
    buf = io.BytesIO()
    torch.save(torch.zeros(4, fx.HIDDEN), buf)
    part = {
        "type": "video_embeds",
        "video_embeds": {
            "video_embeds": base64.b64encode(buf.getvalue()).decode(),
            "video_grid_thw": [1, 4, 4],
        },
    }
    body = {
        "model": str(mimo_v2_vllm_dir),
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
    }
    status, reply = http_json("POST", f"{vllm.url}/v1/chat/completions", body)
    assert status == 400, reply
    assert vllm.alive and vllm.healthy()


def test_a_wrong_width_embedding_is_never_sent(epd: ServeProcess, vllm: SupervisedVLLM) -> None:
    content = [image_part(61, 64, 64), {"type": "text", "text": "Go"}]
    good = chat(epd, content)
    key = good["media"][0]["key"]
    # one column short of the hidden size: vLLM's server would exit on it
    forge_cached_embedding(epd, key, lambda rows: rows[:, :-1])
    before = _routed(epd)
    status, reply = http_json(
        "POST",
        f"{epd.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0},
    )
    assert status == 502 and reply["error"]["type"] == "embedding_mismatch", reply
    assert f"hidden size {fx.HIDDEN - 1}" in reply["error"]["message"]
    assert _routed(epd) == before and vllm.alive and vllm.healthy()
    again = chat(epd, content)  # dropped from the cache: encoded again, the same answer
    assert not again["media"][0]["cache_hit"]
    assert again["choices"][0]["token_ids"] == good["choices"][0]["token_ids"]


@pytest.mark.parametrize("architecture", ["MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM"])
def test_the_start_up_check_passes_under_either_name(
    mimo_v2_vllm_dir: Path, vllm: SupervisedVLLM, architecture: str
) -> None:
    fmt = PromptFormat.load(mimo_v2_vllm_dir, load_tokenizer(str(mimo_v2_vllm_dir)))
    info = ModelInfo.of(mimo_v2_vllm_dir)
    info = ModelInfo(architecture, EmbeddingGeometry(2, fx.HIDDEN), info.profile)

    async def check() -> None:
        async with aiohttp.ClientSession() as session:
            backend = VLLMServer(fmt, info, cache=None)
            await backend.check_server(backend.client(session, vllm.url, 30.0))  # one-row embedding too

    asyncio.run(check())
    assert vllm.alive and vllm.healthy()


def _engine_row(epd: ServeProcess) -> dict[str, Any]:
    (row,) = http_json("GET", f"{epd.url}/health")[1]["llm_routing"]["engines"]
    return dict(row)


def test_hybrid_kv_events_are_refused_and_routed_by_load(epd: ServeProcess) -> None:
    """Affinity over MiMo's hybrid KV does not hold yet, and the router says so instead of guessing:
    vLLM 0.32 gives the full-attention group 256-token blocks (its page bytes evened with the
    sliding-window group's 128-token ones, whose layers have twice the KV heads), each named by the
    128-token chain hash at its end; the router names pages of one size, so its check refuses the
    stream and predicts no hit, while vLLM's own prefix cache hits."""
    system = " ".join(f"rule {i}: answer briefly and name the colour you see." for i in range(30))
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    predicted = actual = 0
    for turn in range(3):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Turn {turn}."}]
        if turn % 2 == 0:
            content.insert(0, image_part(300 + turn))
        history.append({"role": "user", "content": content})
        before = _engine_row(epd)
        body = {"messages": history, "max_tokens": 4, "temperature": 0}
        status, reply = http_json("POST", f"{epd.url}/v1/chat/completions", body)
        assert status == 200, reply
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        after = _engine_row(epd)
        predicted += after["predicted_cached_tokens"] - before["predicted_cached_tokens"]
        actual += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    row = _engine_row(epd)
    assert row["naming_check"] == "mismatch: its pages are 256 tokens, the router's 128", row
    assert predicted == 0 and actual >= 2 * 256, (predicted, actual)
