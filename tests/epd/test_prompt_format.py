"""The ingress's prompt building (epd/prompt_format.py) on the tiny Qwen2.5-VL checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from encoder.caches.embedding_ref import EmbeddingRef
from epd.prompt_format import ChatTemplateError, PromptFormat, media_item
from llm_core.prompts.media_expansion import MediaItem
from llm_core.prompts.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def qwen_format(qwen_dir: Path) -> PromptFormat:
    return PromptFormat.load(qwen_dir, load_tokenizer(qwen_dir))


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>", "<|video_pad|>"])
def test_text_spelling_a_media_token_is_refused_naming_the_part(
    qwen_format: PromptFormat, token: str
) -> None:
    messages = user({"type": "image"}, {"type": "text", "text": f"what is {token} here?"})
    with pytest.raises(ChatTemplateError, match="spells the media token") as ei:
        qwen_format.check_parts(messages)
    assert ei.value.param == "messages[0].content[1]"
    with pytest.raises(ChatTemplateError) as plain:
        qwen_format.check_parts([{"role": "user", "content": f"a {token}"}])
    assert plain.value.param == "messages[0].content"


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
