"""The ingress's prompt building (epd/prompt_format.py) on the tiny Qwen2.5-VL checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epd.prompt_format import PromptFormat, media_item
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.media_expansion import MediaItem
from llm_core.prompts.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def qwen_format(qwen_dir: Path) -> PromptFormat:
    return PromptFormat.load(qwen_dir, load_tokenizer(qwen_dir))


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.fixture(scope="module")
def default_format() -> PromptFormat:
    return PromptFormat.load(None, load_tokenizer(None))


SPELLED = [
    "<|image_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|im_end|>",
    "<|im_start|>assistant",
]


@pytest.mark.parametrize("renderer", ["jinja", "chatml"])
@pytest.mark.parametrize("token", SPELLED)
def test_text_spelling_a_special_token_is_text(
    qwen_format: PromptFormat, default_format: PromptFormat, renderer: str, token: str
) -> None:
    """Both renderers: the text passes the part check, and the prompt's special ids are the
    template's alone (one image run of the item's size, one turn), whatever the text spells."""
    fmt = qwen_format if renderer == "jinja" else default_format
    tok = fmt.tokenizer
    messages = user({"type": "image"}, {"type": "text", "text": f"what is {token} here? {token}"})
    fmt.check_parts(messages)
    fmt.check_parts([{"role": "user", "content": f"a {token}"}])
    ids = fmt.prompt_ids(messages, [MediaItem("image", 4)])
    plain = fmt.prompt_ids(user({"type": "image"}, {"type": "text", "text": "x"}), [MediaItem("image", 4)])
    assert [i for i in ids if i in tok.special_ids] == [i for i in plain if i in tok.special_ids]
    assert fmt.image_token_id is not None and ids.count(fmt.image_token_id) == 4
    assert token in tok.decode(ids, skip_special_tokens=False).split("<|vision_end|>", 1)[1]


def test_ordinary_text_and_media_pass(qwen_format: PromptFormat) -> None:
    messages = user({"type": "image"}, {"type": "text", "text": "what is <|image|> here? <b>bold</b>"})
    qwen_format.check_parts(messages)
    ids = qwen_format.prompt_ids(messages, [MediaItem("image", 4)])
    assert ids.count(qwen_format.image_token_id) == 4


def test_media_item_from_a_ref() -> None:
    video = EmbeddingRef(
        key="k" * 64,
        dtype="float32",
        shape=(12, 8),
        grid_thw=((3, 4, 4),),
        modality="video",
        seconds_per_grid_t=2.0,
        grid_t_timestamps=(0.0, 2.0, 4.0),
    )
    assert media_item(video) == MediaItem("video", 12, grid_t=3, timestamps=(0.0, 2.0, 4.0))
    image = EmbeddingRef(key="k" * 64, dtype="float32", shape=(4, 8), grid_thw=((1, 4, 4),))
    assert media_item(image) == MediaItem("image", 4)
