"""``epd serve --model DIR`` on the tiny MiMo-V2.5 checkpoint in the released layout
(``tests.fixtures.mimo_v2``: FP8 language model with fused qkv, BF16 MiMo ViT, audio tensors, the
processor_config block), through ``/v1/chat/completions``:

- an image: the prompt ids are the chat template's, tokenized by transformers, with the pad run at
  the token count transformers' ``Qwen2VLImageProcessor`` gives for the checkpoint's values (patch
  16, merge 2, its pixel bounds, mean/std); the greedy answer equals transformers'
  ``MiMoV2FlashForCausalLM`` (``tests.fixtures.mimo_v2_reference``) fed that prompt with the pads'
  rows replaced by the plain reference tower (``tests.fixtures.mimo_vit_reference``) run on the
  processor's pixels; again in a second turn (node cache, prefix cache);
- a 10 s clip at 1 fps: ``<|video_start|>``, per temporal patch its "MM:SS" time as text, its pads
  between ``<|vision_start|>`` / ``<|vision_end|>``, then ``<|video_end|>``, written out here from the
  documented layout; usage reports the token counts;
- an empty audio part: 400 naming it (audio chats: ``test_e2e_mimo_v2_audio``); text spelling a
  media token is text: answered, with none of its special ids in the prompt.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.epd.conftest import ServeProcess, http_json, start_serve, stop_serve
from tests.fixtures import mimo_v2 as fx
from tests.fixtures.mimo_v2_reference import read_checkpoint, reference_model
from tests.fixtures.mimo_vit_reference import reference_tower
from tests.fixtures.qwen2_5_vl import make_image, make_video_frames, write_video

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def server(mimo_v2_dir: Path) -> Iterator[ServeProcess]:
    # fp32 end to end, as the reference runs (the checkpoint's own dtype would be bf16)
    srv = start_serve(
        [
            "--model",
            str(mimo_v2_dir),
            "--encoder-dtype",
            "float32",
            "--llm-dtype",
            "float32",
            "--llm-engine-max-model-len",
            "1024",
        ]
    )
    try:
        yield srv
    finally:
        assert stop_serve(srv) == 0, srv.tail()


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def chat(server: ServeProcess, messages: list[dict[str, Any]], expect: int = 200) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
    status, reply = http_json("POST", f"{server.url}/v1/chat/completions", body)
    assert status == expect, reply
    return dict(reply)


def template_ids(model_dir: Path, kinds: list[str], text: str) -> list[int]:
    """transformers' rendering and tokenization of one user turn (one placeholder per item)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": text}]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def processor_pixels(img: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """transformers' Qwen2VLImageProcessor with the checkpoint's values: [N, 1536] rows and the grid."""
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=fx.IMAGE_MIN_PIXELS,
        max_pixels=fx.IMAGE_MAX_PIXELS,
        image_mean=fx.CLIP_MEAN,
        image_std=fx.CLIP_STD,
    )
    out = proc(images=[img], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return out["pixel_values"].float(), (t, h, w)


def reference_answer(model_dir: Path, ids: list[int], pad: int, rows: torch.Tensor) -> list[int]:
    """transformers' greedy tokens for ``ids`` whose ``pad`` positions take ``rows`` instead."""
    from transformers import GenerationConfig

    model = reference_model(model_dir)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids_t)
        mask = ids_t[0] == pad
        assert int(mask.sum()) == rows.shape[0]
        embeds[0, mask] = rows.to(embeds.dtype)
        gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        out = model.generate(
            inputs_embeds=embeds, attention_mask=torch.ones_like(ids_t), generation_config=gen
        )
    return [int(t) for t in out[0, -NEW_TOKENS:]]


def vision_tower(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {k: v for k, v in read_checkpoint(model_dir).items() if k.startswith("visual.")}
    return tensors, config["vision_config"]


def test_image_chat_equals_the_reference(server: ServeProcess, mimo_v2_dir: Path) -> None:
    img = make_image(150, 90, seed=7)
    pixels, grid = processor_pixels(img)
    pads = grid[0] * grid[1] * grid[2] // 4
    question = "Describe the picture."
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _data_uri(_png(img), "image/png")}},
                {"type": "text", "text": question},
            ],
        }
    ]
    reply = chat(server, messages)
    choice = reply["choices"][0]
    image_pad = fx.token_id(fx.IMAGE_PAD)
    rendered = template_ids(mimo_v2_dir, ["image"], question)
    at = rendered.index(image_pad)
    expected_prompt = rendered[:at] + [image_pad] * pads + rendered[at + 1 :]
    assert choice["prompt_token_ids"] == expected_prompt
    assert reply["usage"]["image_tokens"] == pads and reply["usage"]["images"] == 1

    tensors, vcfg = vision_tower(mimo_v2_dir)
    rows = reference_tower(pixels, [grid], tensors, vcfg)
    expected = reference_answer(mimo_v2_dir, expected_prompt, image_pad, rows)
    assert choice["token_ids"] == expected

    history = [
        *messages,
        {"role": "assistant", "content": choice["message"]["content"]},
        {"role": "user", "content": "And the colours?"},
    ]
    again = chat(server, history)
    assert again["usage"]["cached_media"] == 1
    assert again["choices"][0]["prompt_token_ids"][: len(expected_prompt)] == expected_prompt


def test_ten_second_video_has_timestamps(server: ServeProcess, mimo_v2_dir: Path, tmp_path: Path) -> None:
    """10 s at 10 fps, sampled at 1 fps: frames 0, 11, ..., 99 (numpy's integer linspace), pairs
    starting at frames 0, 22, 44, 66, 88 = 0.0, 2.2, 4.4, 6.6, 8.8 s; 96x64 frames are within the
    per-frame budget, so 4 x 6 patches = 6 tokens per temporal patch, 5 patches."""
    clip = write_video(tmp_path / "clip.mp4", make_video_frames(100, 96, 64, seed=3), fps=10)
    question = "What moves?"
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": _data_uri(clip.read_bytes(), "video/mp4")}},
                {"type": "text", "text": question},
            ],
        }
    ]
    reply = chat(server, messages)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(mimo_v2_dir))
    vs, ve = fx.token_id(fx.VISION_START), fx.token_id(fx.VISION_END)
    vpad = fx.token_id(fx.VIDEO_PAD)
    block = [fx.token_id(fx.VIDEO_START)]
    for stamp in ("00:00", "00:02", "00:04", "00:06", "00:08"):
        block += tok.encode(stamp, add_special_tokens=False) + [vs] + [vpad] * 6 + [ve]
    block.append(fx.token_id(fx.VIDEO_END))
    rendered = template_ids(mimo_v2_dir, ["video"], question)
    at = rendered.index(vpad)
    assert rendered[at - 1] == vs and rendered[at + 1] == ve
    expected = rendered[: at - 1] + block + rendered[at + 2 :]
    assert reply["choices"][0]["prompt_token_ids"] == expected
    assert reply["usage"]["video_tokens"] == 30 and reply["usage"]["videos"] == 1
    assert len(reply["choices"][0]["token_ids"]) == NEW_TOKENS


def test_empty_audio_is_400_and_spelled_media_tokens_are_text(
    server: ServeProcess, mimo_v2_dir: Path
) -> None:
    # The checkpoint now carries its audio encoder (audio_tokenizer/): an audio part is taken, and
    # an empty one is the client's error, named (the 415 of a checkpoint without the encoder is
    # tested in tests/epd/test_prompt_format.py and tests/encoder/serving/test_worker_audio.py).
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    status, reply = http_json(
        "POST",
        f"{server.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hear"}, audio]}]},
    )
    assert status == 400, reply
    assert reply["error"]["param"] == "messages[0].content[1].input_audio.data"
    spelled = f"what is {fx.VIDEO_START}{fx.VIDEO_PAD}{fx.AUDIO_PAD} <|im_end|>?"
    reply = chat(server, [{"role": "user", "content": spelled}])
    specials = set(range(fx.BPE_VOCAB_SIZE, fx.BPE_VOCAB_SIZE + len(fx.MIMO_SPECIAL_TOKENS)))
    ids = reply["choices"][0]["prompt_token_ids"]
    template = template_ids(mimo_v2_dir, [], "x")
    assert [i for i in ids if i in specials] == [i for i in template if i in specials]


def test_video_frames_are_sampled_as_documented() -> None:
    """The documented rule the video test relies on, checked on its own numbers."""
    idx = np.unique(np.linspace(0, 99, 10).astype(np.int64)).tolist()
    assert idx == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]
    assert [round(i / 10, 3) for i in idx[::2]] == [0.0, 2.2, 4.4, 6.6, 8.8]
