import base64

import pytest

from epd.media_request import MediaSource, chat_prompt, json_items_sources, upload_source
from epd_common.errors import APIError


def test_json_items_url_data_and_data_uri() -> None:
    raw = b"\x89PNG fake"
    body = {
        "items": [
            {"url": "https://example.com/a.jpg"},
            {"data": base64.b64encode(raw).decode()},
            {"data": "data:image/png;base64," + base64.b64encode(raw).decode(), "modality": "image"},
        ]
    }
    a, b, c = json_items_sources(body, max_items=8)
    assert a.url == "https://example.com/a.jpg" and a.data is None
    assert b.data == raw and b.name == "items[1]"
    assert c.url is not None and c.url.startswith("data:") and c.modality_hint == "image"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"nope": []}, 422, "items"),
        ({"items": []}, 422, "items"),
        ({"items": [{"url": "x", "data": "eA=="}]}, 422, "items[0]"),
        ({"items": [{"data": "%%%"}]}, 400, "items[0].data"),
        ({"items": [{"url": 5}]}, 422, "items[0].url"),
        ({"items": [{"url": "u", "modality": "text"}]}, 422, "items[0].modality"),
        ({"items": [{"url": "u"}] * 10_000}, 413, "items"),
    ],
)
def test_json_items_errors_name_the_parameter(body: object, status: int, param: str) -> None:
    with pytest.raises(APIError) as info:
        json_items_sources(body, max_items=64)
    assert info.value.status == status
    assert info.value.param == param


def test_upload_content_types() -> None:
    assert upload_source("a.jpg", "image/jpeg", b"x", 0).modality_hint == "image"
    assert upload_source("a.mp4", "video/mp4", b"x", 0).modality_hint == "video"
    assert upload_source("a.bin", "application/octet-stream", b"x", 0).modality_hint is None
    with pytest.raises(APIError) as info:
        upload_source("page.html", "text/html; charset=utf-8", b"<html>", 0)
    assert info.value.status == 415 and info.value.param == "page.html"
    with pytest.raises(APIError) as info:
        upload_source("empty.jpg", "image/jpeg", b"", 0)
    assert info.value.status == 400


def test_chat_prompt_collects_media_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "https://h/a.png"}},
                {"type": "video_url", "video_url": {"url": "https://h/b.mp4"}},
            ],
        },
    ]
    prompt = chat_prompt(messages, max_items=4)
    assert [m.url for m in prompt.media] == ["https://h/a.png", "https://h/b.mp4"]
    assert [m.modality_hint for m in prompt.media] == ["image", "video"]
    assert prompt.messages[1]["content"][1] == {"type": "image", "index": 0}
    assert prompt.messages[1]["content"][2] == {"type": "video", "index": 1}


def test_chat_prompt_keeps_audio_parts_for_the_model_check() -> None:
    """Audio is never fetched here; the part stays so the model's check can answer 415 or 400."""
    content = [{"type": "text", "text": "hear"}, {"type": "input_audio", "input_audio": {"data": ""}}]
    prompt = chat_prompt([{"role": "user", "content": content}], max_items=4)
    assert prompt.messages[0]["content"][1] == {"type": "audio"} and prompt.media == []


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "file"}]}], "messages[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_chat_prompt_schema_errors(messages: object, param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_prompt(messages, max_items=4)
    assert info.value.status == 422 and info.value.param == param


WAV_B64 = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()


def hear(*parts: dict[str, object]) -> list[dict[str, object]]:
    return [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hear"}, *parts]},
    ]


def test_chat_prompt_audio_parts_become_sources() -> None:
    """For a model that takes audio: input_audio (base64 or a data: URI) and audio_url (http(s) or
    data:) parts are audio sources; a video is two sources, the video then its track."""
    messages = hear(
        {"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "https://h/a.mp3"}},
        {"type": "input_audio", "input_audio": {"data": f"data:audio/wav;base64,{WAV_B64}", "format": "WAV"}},
        {"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{WAV_B64}"}},
        {"type": "video_url", "video_url": {"url": "https://h/v.mp4"}},
    )
    prompt = chat_prompt(messages, max_items=5, audio=True)
    media = prompt.media
    assert media[0] == MediaSource(
        "messages[1].content[1]", data=base64.b64decode(WAV_B64), modality_hint="audio"
    )
    assert media[1] == MediaSource("messages[1].content[2]", url="https://h/a.mp3", modality_hint="audio")
    assert media[2].url is not None and media[2].url.startswith("data:audio/wav;base64,")
    assert media[3].url is not None and media[3].url.startswith("data:audio/mpeg;base64,")
    assert media[4] == MediaSource("messages[1].content[5]", url="https://h/v.mp4", modality_hint="video")
    assert media[5] == MediaSource(
        "messages[1].content[5]", url="https://h/v.mp4", modality_hint="audio", audio_track=True
    )
    content = prompt.messages[1]["content"]
    assert [p.get("index") for p in content[1:5]] == [0, 1, 2, 3]
    assert all(p["type"] == "audio" for p in content[1:5])
    assert content[5] == {"type": "video", "index": 4, "audio_index": 5}
    # the limit counts parts: a video's track is part of it
    with pytest.raises(APIError) as info:
        chat_prompt(messages, max_items=4, audio=True)
    assert info.value.status == 413
    # a model that takes no audio: the video is one source, and audio parts stay markers
    plain = chat_prompt(messages, max_items=5)
    assert [m.modality_hint for m in plain.media] == ["video"]
    assert plain.messages[1]["content"][2] == {"type": "audio"}


@pytest.mark.parametrize(
    ("part", "status", "param"),
    [
        (
            {"type": "input_audio", "input_audio": {"data": "no!base64", "format": "wav"}},
            400,
            ".input_audio.data",
        ),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, 400, ".input_audio.data"),
        (
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "midi"}},
            400,
            ".input_audio.format",
        ),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": 3}}, 400, ".input_audio.format"),
        ({"type": "input_audio", "input_audio": {"data": 5}}, 422, ".input_audio.data"),
        ({"type": "input_audio", "input_audio": "AAAA"}, 422, ".input_audio"),
        ({"type": "input_audio"}, 422, ".input_audio"),
        ({"type": "audio_url", "audio_url": {}}, 422, ".audio_url.url"),
        ({"type": "audio_url", "audio_url": {"url": ""}}, 422, ".audio_url.url"),
    ],
)
def test_chat_prompt_bad_audio_parts_name_the_part(part: dict[str, object], status: int, param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_prompt(hear(part), max_items=4, audio=True)
    assert info.value.status == status
    assert info.value.param == "messages[1].content[1]" + param
    assert "messages[1].content[1]" in info.value.message
