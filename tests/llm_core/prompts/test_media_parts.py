"""Part checks and pad-run expansion (llm_core/prompts/media_parts.py), against Qwen2VLProcessor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_core.prompts.chat_template import ChatTemplateError, load_chat_template
from llm_core.prompts.media_parts import (
    UnservedModality,
    check_message_parts,
    expand_media_placeholders,
    serves_audio,
    supported_part_types,
    unserved_part_types,
)
from llm_core.prompts.tokenizer import Tokenizer, build_default_tokenizer
from tests.llm_core.prompts.test_chat_template import CASES, IMAGE, QWEN2_VL_TEMPLATE, text, write_checkpoint

# --- placeholder expansion -----------------------------------------------------------------

PAD, VPAD = 261, 262


def test_expand_ids() -> None:
    ids = [1, PAD, 2, VPAD, 3, PAD, 4]
    out = expand_media_placeholders(ids, [3, 1], [2], PAD, VPAD)
    assert out == [1, PAD, PAD, PAD, 2, VPAD, VPAD, 3, PAD, 4]
    assert expand_media_placeholders([5, 6], [], [], PAD, VPAD) == [5, 6]
    assert expand_media_placeholders([5, 6], [], [], None, None) == [5, 6]


def test_expand_text() -> None:
    s = "a<|image_pad|>b<|video_pad|><|image_pad|>"
    out = expand_media_placeholders(s, [2, 1], [3], "<|image_pad|>", "<|video_pad|>")
    assert out == "a" + "<|image_pad|>" * 2 + "b" + "<|video_pad|>" * 3 + "<|image_pad|>"


@pytest.mark.parametrize(
    ("ids", "images", "videos", "match"),
    [
        ([PAD, PAD], [4], [], r"2 image placeholder\(s\) \(261\) but 1 image"),
        ([PAD], [4, 4], [], r"1 image placeholder\(s\) \(261\) but 2 image"),
        ([PAD], [4], [2], r"0 video placeholder\(s\) \(262\) but 1 video"),
    ],
)
def test_expand_count_mismatch(ids: list[int], images: list[int], videos: list[int], match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as ei:
        expand_media_placeholders(ids, images, videos, PAD, VPAD)
    assert ei.value.param == "messages"


def test_expand_rejects_bad_inputs() -> None:
    with pytest.raises(ChatTemplateError, match="no video token"):
        expand_media_placeholders([PAD], [1], [2], PAD, None)
    with pytest.raises(ValueError, match="positive"):
        expand_media_placeholders([PAD], [0], [], PAD, VPAD)
    with pytest.raises(TypeError):
        expand_media_placeholders("<|image_pad|>", [1], [], PAD, VPAD)  # type: ignore[call-overload,arg-type]


def test_expansion_matches_qwen2_vl_processor(tmp_path: Path) -> None:
    """Render, tokenize, expand: the ids Qwen2VLProcessor produces for the same prompt and media."""
    from transformers import AutoProcessor

    directory = write_checkpoint(tmp_path, "json", QWEN2_VL_TEMPLATE)
    template = load_chat_template(directory)
    assert template is not None
    processor = AutoProcessor.from_pretrained(str(directory))
    messages, _ = CASES["two_images_and_video"]
    prompt = template.render(messages)
    images = [np.zeros((56, 84, 3), np.uint8), np.zeros((112, 56, 3), np.uint8)]
    video = np.zeros((4, 56, 56, 3), np.uint8)
    expected = processor(text=[prompt], images=images, videos=[video], return_tensors="np")
    merge = processor.image_processor.merge_size**2
    image_counts = [int(np.prod(g)) // merge for g in expected["image_grid_thw"]]
    video_counts = [int(np.prod(g)) // merge for g in expected["video_grid_thw"]]
    assert image_counts == [6, 8] and video_counts == [8]
    tok = Tokenizer(build_default_tokenizer())
    ids = expand_media_placeholders(tok.encode(prompt), image_counts, video_counts, PAD, VPAD)
    assert ids == expected["input_ids"][0].tolist()


# --- parts the model cannot take -----------------------------------------------------------


def test_supported_part_types() -> None:
    assert supported_part_types({}) == {"text"}
    assert supported_part_types({"image_token_id": 151655}) == {"text", "image"}
    assert supported_part_types({"image_token_id": 151655, "video_token_id": 151656}) == {
        "text",
        "image",
        "video",
    }
    assert supported_part_types({"image_token_index": 32000}) == {"text", "image"}


IMAGE_ONLY = supported_part_types({"image_token_id": 151655})


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "does not take audio"),
        ({"type": "audio"}, "does not take audio"),
        ({"type": "video"}, "does not take video"),
        ({"type": "video_url", "video_url": {"url": "v.mp4"}}, "does not take video"),
        ({"type": "file"}, "unknown content part type 'file'"),
        ({"text": "no type"}, "string 'type'"),
    ],
)
def test_unsupported_part_names_the_part(part: dict[str, Any], match: str) -> None:
    messages = [{"role": "user", "content": [text("look"), part]}]
    with pytest.raises(ChatTemplateError, match=match) as ei:
        check_message_parts(messages, IMAGE_ONLY)
    assert ei.value.param == "messages[0].content[1]"
    assert str(ei.value).startswith("messages[0].content[1]: ")


def test_supported_parts_pass() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [IMAGE, {"type": "image_url", "image_url": {"url": "u"}}, text("t")]},
        {"role": "assistant", "content": None},
    ]
    check_message_parts(messages, IMAGE_ONLY)
    with pytest.raises(ChatTemplateError) as ei:
        check_message_parts([{"role": "user", "content": 5}], IMAGE_ONLY)
    assert ei.value.param == "messages[0].content"


def test_declared_audio_is_unserved_not_unknown() -> None:
    """MiMo-V2.5 declares audio (processor_config.audio_token_id): an audio part is a 415-kind error
    naming the part; for a model without audio tokens it stays a plain refusal."""
    mimo = {
        "image_token_id": 151655,
        "video_token_id": 151656,
        "processor_config": {"audio_token_id": 151669},
    }
    assert unserved_part_types(mimo) == {"audio"} and unserved_part_types({"image_token_id": 1}) == set()
    messages = [{"role": "user", "content": [text("hear"), {"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(UnservedModality, match="audio encoder is not supported yet") as ei:
        check_message_parts(messages, supported_part_types(mimo), unserved_part_types(mimo))
    assert ei.value.param == "messages[0].content[1]"
    with pytest.raises(ChatTemplateError, match="does not take audio") as plain:
        check_message_parts(messages, IMAGE_ONLY, unserved_part_types({"image_token_id": 1}))
    assert not isinstance(plain.value, UnservedModality)


def test_audio_is_served_when_the_checkpoint_carries_its_encoder(tmp_path: Path) -> None:
    """Audio is taken when the model declares it, config.json has ``audio_config`` and the
    checkpoint an ``audio_tokenizer/`` folder; without the folder (or the block) it stays a 415."""
    mimo = {
        "image_token_id": 151655,
        "video_token_id": 151656,
        "audio_config": {"group_size": 4},
        "processor_config": {"audio_token_id": 151669},
    }
    assert not serves_audio(mimo, tmp_path) and not serves_audio(mimo, None)
    (tmp_path / "audio_tokenizer").mkdir()
    assert serves_audio(mimo, tmp_path)
    assert not serves_audio({k: v for k, v in mimo.items() if k != "audio_config"}, tmp_path)
    assert not serves_audio({"image_token_id": 1, "audio_config": {}}, tmp_path)  # declares no audio
    messages = [
        {
            "role": "user",
            "content": [
                text("hear"),
                {"type": "input_audio", "input_audio": {}},
                {"type": "audio_url", "audio_url": {"url": "u"}},
            ],
        }
    ]
    check_message_parts(messages, supported_part_types(mimo, True), unserved_part_types(mimo, True))
    assert unserved_part_types(mimo, True) == set() and "audio" in supported_part_types(mimo, True)
    with pytest.raises(UnservedModality) as ei:
        check_message_parts(messages, supported_part_types(mimo), unserved_part_types(mimo))
    assert ei.value.param == "messages[0].content[1]"
