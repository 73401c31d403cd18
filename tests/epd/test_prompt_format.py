"""The ingress's prompt building (epd/prompt_format.py) on the tiny Qwen2.5-VL checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from epd.prompt_format import PromptFormat, UnservedModality, media_item, prompt_media
from epd_common.messages.completion_request import CompletionRequestBody
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


def mimo_with_audio(root: Path, tokenizer_dir: bool) -> Path:
    """A MiMo-V2.5 checkpoint's prompt files (config.json with audio_config and processor_config,
    tokenizer, a chat template that writes audio parts as the release's placeholder), and the
    ``audio_tokenizer/`` folder when ``tokenizer_dir``."""
    import json

    from tests.fixtures import mimo_v2 as fx

    root.mkdir(parents=True, exist_ok=True)
    config = {
        **fx.text_config(),
        "audio_config": dict(fx.AUDIO_CONFIG),
        "processor_config": fx.processor_config(),
    }
    (root / "config.json").write_text(json.dumps(config))
    fx.build_tokenizer().save_pretrained(root)
    audio = (
        f"{{%- elif part['type'] == 'audio' -%}}{{{{- '{fx.AUDIO_START}{fx.AUDIO_PAD}{fx.AUDIO_END}' -}}}}"
    )
    template = fx.CHAT_TEMPLATE.replace("{%- elif 'text' in part -%}", audio + "{%- elif 'text' in part -%}")
    assert template != fx.CHAT_TEMPLATE
    (root / "chat_template.jinja").write_text(template)
    if tokenizer_dir:
        (root / "audio_tokenizer").mkdir()
    return root


def ref(modality: str, rows: int, key: str, **kw: Any) -> EmbeddingRef:
    fields: dict[str, Any] = {"grid_thw": ((1, 2, 2),), **kw}
    return EmbeddingRef(key=key, dtype="float32", shape=(rows, 8), modality=modality, **fields)


def test_mimo_with_audio_lays_out_clips_and_videos_with_sound(tmp_path: Path) -> None:
    """The checkpoint serves audio: an audio part and a video with its track become MiMo-V2.5's
    layout; the engine gets the refs in the order their rows take the pads (a silent track, none)."""
    from tests.fixtures import mimo_v2 as fx

    root = mimo_with_audio(tmp_path / "mimo", tokenizer_dir=True)
    tok = load_tokenizer(root)
    fmt = PromptFormat.load(root, tok)
    assert fmt.serves_audio
    messages = user(
        {"type": "text", "text": "hear"},
        {"type": "audio", "index": 0},
        {"type": "video", "index": 1, "audio_index": 2},
        {"type": "video", "index": 3, "audio_index": 4},
    )
    fmt.check_parts(messages)
    clip = ref("audio", 5, "clip")
    video = ref("video", 4, "vid", grid_thw=((2, 2, 4),), grid_t_timestamps=(0.0, 2.0))
    track = ref("audio", 20, "track")
    silent = ref("video", 2, "still", grid_thw=((1, 2, 4),), grid_t_timestamps=(0.0,))
    no_track = ref("audio", 0, "none")
    media, sent = prompt_media(messages, [clip, video, track, silent, no_track])
    assert media == [
        MediaItem("audio", 5),
        MediaItem("video", 4, grid_t=2, timestamps=(0.0, 2.0), audio_tokens=20),
        MediaItem("video", 2, grid_t=1, timestamps=(0.0,)),
    ]
    assert sent == [clip, video, track, silent]
    ids = fmt.prompt_ids(messages, media)

    def t(token: str) -> int:
        return fx.token_id(token)

    def stamp(text: str) -> list[int]:
        return tok.encode(text)

    vs, ve, vpad, apad = t(fx.VISION_START), t(fx.VISION_END), t(fx.VIDEO_PAD), t(fx.AUDIO_PAD)
    a0, a1 = t(fx.AUDIO_START), t(fx.AUDIO_END)
    clip_ids = [a0, *[apad] * 5, a1]
    with_sound = [t(fx.VIDEO_START)]
    with_sound += [*stamp("00:00"), vs, vpad, vpad, ve, a0, *[apad] * 12, a1]
    with_sound += [*stamp("00:02"), vs, vpad, vpad, ve, a0, *[apad] * 8, a1, t(fx.VIDEO_END)]
    still = [t(fx.VIDEO_START), *stamp("00:00"), vs, vpad, vpad, ve, t(fx.VIDEO_END)]
    start = ids.index(a0)
    assert ids[start : start + len(clip_ids) + len(with_sound) + len(still)] == clip_ids + with_sound + still
    assert ids.count(apad) == 5 + 20 and ids.count(vpad) == 4 + 2
    # the checkpoint without its audio tokenizer: a 415 naming the part
    bare = PromptFormat.load(mimo_with_audio(tmp_path / "bare", tokenizer_dir=False), tok)
    assert not bare.serves_audio
    with pytest.raises(UnservedModality) as ei:
        bare.check_parts(messages)
    assert ei.value.param == "messages[0].content[1]"


def test_a_backend_without_audio_refuses_audio_parts_by_name(tmp_path: Path) -> None:
    """vLLM servers are handed images and videos only: for a checkpoint that serves audio, an audio
    part is a 415 naming the backend and the part, and videos are laid out without their track
    (no track is fetched); images and videos still pass."""
    from epd.llm_servers.epd_engine import EpdEngineServer
    from epd.llm_servers.vllm_server import VLLMServer

    root = mimo_with_audio(tmp_path / "mimo", tokenizer_dir=True)
    fmt = PromptFormat.load(root, load_tokenizer(root))
    assert fmt.only(EpdEngineServer.modalities, EpdEngineServer.name) is fmt
    narrowed = fmt.only(VLLMServer.modalities, VLLMServer.name)
    assert fmt.serves_audio and not narrowed.serves_audio
    with pytest.raises(UnservedModality) as ei:
        narrowed.check_parts(user({"type": "text", "text": "hear"}, {"type": "audio", "index": 0}))
    assert ei.value.param == "messages[0].content[1]"
    assert "vllm LLM server does not take audio" in str(ei.value)
    narrowed.check_parts(user({"type": "video", "index": 0}, {"type": "image", "index": 1}))
    fmt.check_parts(user({"type": "audio", "index": 0}))  # the original is unchanged


def test_media_item_of_a_video_with_its_track() -> None:
    video = ref("video", 6, "v", grid_thw=((3, 2, 4),), grid_t_timestamps=(0.0, 2.0, 4.0))
    assert media_item(video, ref("audio", 30, "t")).audio_tokens == 30
    assert media_item(video, ref("audio", 0, "t")).audio_tokens == 0
    assert media_item(video).audio_tokens == 0


def test_epd_backend_sends_a_video_and_its_track_in_pad_order(tmp_path: Path) -> None:
    """The epd backend's chat call: the engine body lists the refs in the order their rows take the
    pads (clip, video, its track; a silent video's zero-row track left out) and the routing keys
    give each run its own item's pseudo-id."""
    import asyncio

    from epd.llm_servers.epd_engine import EpdEngineServer
    from epd.media_pipeline import EncodedItem
    from epd_common.messages.cache_keys import build_cache_keys, media_pseudo_id

    root = mimo_with_audio(tmp_path / "mimo", tokenizer_dir=True)
    backend = EpdEngineServer(PromptFormat.load(root, load_tokenizer(root)))
    refs = [
        ref("audio", 5, "clip"),
        ref("video", 4, "vid", grid_thw=((2, 2, 4),), grid_t_timestamps=(0.0, 2.0)),
        ref("audio", 20, "track"),
        ref("video", 2, "still", grid_thw=((1, 2, 4),), grid_t_timestamps=(0.0,)),
        ref("audio", 0, "none"),
    ]
    messages = user(
        {"type": "audio", "index": 0},
        {"type": "video", "index": 1, "audio_index": 2},
        {"type": "video", "index": 3, "audio_index": 4},
    )
    items = [EncodedItem(f"messages[0].content[{i}]", r, False) for i, r in enumerate(refs)]

    async def call() -> tuple[list[int], list[EmbeddingRef], list[int]]:
        try:
            chat = await backend.chat_call(messages, items, {})
        finally:
            await backend.close()
        routing = chat.routing  # ids + media spans; the cache keys are what epd's engine matches
        body = chat.body
        assert isinstance(body, CompletionRequestBody) and isinstance(body.prompt, list)
        return (
            cast(list[int], body.prompt),
            list(body.multimodal or []),
            build_cache_keys(list(routing.token_ids), routing.media),
        )

    prompt, sent, keys = asyncio.run(call())
    assert sent == refs[:4]
    tok = backend.prompt_format.tokenizer
    apad, vpad = tok.audio_token_id, tok.video_token_id
    runs = [(keys[i], t) for i, t in enumerate(prompt) if t in (apad, vpad)]
    clip, vid, track, still = (media_pseudo_id(k) for k in ("clip", "vid", "track", "still"))
    assert [k for k, _ in runs] == [clip] * 5 + [vid] * 2 + [track] * 12 + [vid] * 2 + [track] * 8 + [
        still
    ] * 2
