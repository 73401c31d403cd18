"""Parsing of the media a request carries, before anything is fetched or decoded.

Three shapes arrive at the ingress:

* ``multipart/form-data`` uploads to ``/v1/encode`` (every file field is one item),
* JSON ``{"items": [{"url": ...} | {"data": ...}]}`` to ``/v1/encode``,
* OpenAI chat messages whose content parts are ``image_url`` / ``video_url``, and, for a model
  that takes audio, ``input_audio`` (base64 ``data`` and its ``format``) / ``audio_url``.

Each becomes a ``MediaSource``: either bytes already in hand or a URL to fetch. Limits on the
number of items are enforced here so that a 10k-item request is refused before any work starts.

A video of a chat for a model that takes audio is two sources, in order: the video, then its audio
track (``audio_track=True``, the same URL or bytes, ``modality_hint="audio"``); the chat part names
both (``{"type": "video", "index": i, "audio_index": i + 1}``). The track resolves to an
EmbeddingRef of modality "audio" whose rows are the track's pads in the prompt, or to zero rows
when the container has no audio stream (then the video is laid out without sound).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal, Required, TypedDict

from epd_common.errors import APIError, bad_request, unprocessable

Modality = Literal["image", "video", "audio"]

# Content types an upload may declare. Anything else (text/html, application/json, ...) is refused
# with 415 before we look at the bytes; octet-stream and a missing type fall through to sniffing.
_ACCEPTED_UPLOAD_PREFIXES = ("image/", "video/", "audio/")
_NEUTRAL_UPLOAD_TYPES = ("application/octet-stream", "")


@dataclass(frozen=True)
class MediaSource:
    """One media item of a request. Exactly one of ``data`` and ``url`` is set."""

    name: str  # how errors name the item: "items[2]", "messages[0].content[1]", or the upload's filename
    data: bytes | None = None
    url: str | None = None
    modality_hint: Modality | None = None  # from the part type or the upload's content type
    # The audio track of the video source just before it (same url or data): see the module docstring.
    audio_track: bool = False

    def __post_init__(self) -> None:
        assert (self.data is None) != (self.url is None), "exactly one of data and url"


def check_item_count(n: int, max_items: int, param: str) -> None:
    if n == 0:
        raise unprocessable("the request has no media items", param)
    if n > max_items:
        raise APIError(413, f"{n} media items in one request; the limit is {max_items}", param=param)


def upload_source(filename: str, content_type: str, data: bytes, index: int) -> MediaSource:
    """A multipart file field -> MediaSource; refuses declared non-media types with 415."""
    ctype = content_type.split(";")[0].strip().lower()
    name = filename or f"files[{index}]"
    hint: Modality | None = None
    if ctype.startswith("image/"):
        hint = "image"
    elif ctype.startswith("video/"):
        hint = "video"
    elif ctype.startswith("audio/"):
        hint = "audio"
    elif ctype not in _NEUTRAL_UPLOAD_TYPES:
        raise APIError(
            415,
            f"upload {name!r} has content type {ctype!r}; expected image/*, video/*, audio/* or "
            "application/octet-stream",
            type="unsupported_media_type",
            param=name,
        )
    if not data:
        raise bad_request(f"upload {name!r} is empty", name)
    return MediaSource(name=name, data=data, modality_hint=hint)


def json_item_source(item: Any, index: int) -> MediaSource:
    """One element of ``{"items": [...]}``: ``{"url": str}`` or ``{"data": base64 | data: URI}``."""
    name = f"items[{index}]"
    if not isinstance(item, dict):
        raise unprocessable(f"{name} must be an object with 'url' or 'data'", name)
    url, data = item.get("url"), item.get("data")
    hint = item.get("modality")
    if hint is not None and hint not in ("image", "video", "audio"):
        raise unprocessable(
            f"{name}.modality must be 'image', 'video' or 'audio', got {hint!r}", f"{name}.modality"
        )
    if (url is None) == (data is None):
        raise unprocessable(f"{name} must have exactly one of 'url' and 'data'", name)
    if url is not None:
        if not isinstance(url, str) or not url:
            raise unprocessable(f"{name}.url must be a non-empty string", f"{name}.url")
        return MediaSource(name=name, url=url, modality_hint=hint)
    if not isinstance(data, str) or not data:
        raise unprocessable(f"{name}.data must be a non-empty base64 string or data: URI", f"{name}.data")
    if data.startswith("data:"):
        return MediaSource(name=name, url=data, modality_hint=hint)
    return MediaSource(name=name, data=decode_base64(data, f"{name}.data"), modality_hint=hint)


def json_items_sources(body: Any, max_items: int) -> list[MediaSource]:
    if not isinstance(body, dict) or not isinstance(body.get("items"), list):
        raise unprocessable("the JSON body must be an object with an 'items' list", "items")
    items: list[Any] = body["items"]
    check_item_count(len(items), max_items, "items")
    return [json_item_source(item, i) for i, item in enumerate(items)]


def decode_base64(text: str, param: str) -> bytes:
    try:
        out = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param} is not valid base64: {exc}", param) from exc
    if not out:
        raise bad_request(f"{param} decodes to zero bytes", param)
    return out


class ContentPart(TypedDict, total=False):
    """One part of a parsed message: ``{"type": "text", "text"}``, or ``{"type": modality, "index"}``
    with ``index`` into ``ChatPrompt.media`` (a video with its track also ``audio_index``; an audio
    part of a chat parsed without audio has no index)."""

    type: Required[str]
    text: str
    index: int
    audio_index: int


class ChatMessage(TypedDict):
    """One parsed message: its role and its content as a list of parts."""

    role: str
    content: list[ContentPart]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with media parts replaced by markers, plus the media in order of appearance.

    ``messages`` keeps the OpenAI structure but every content becomes a list of
    ``{"type": "text", "text": ...}`` and ``{"type": "image" | "video" | "audio", "index": i}``
    parts, where ``i`` indexes ``media`` (a video with its track also has ``"audio_index"``). Audio
    parts of a chat parsed without audio stay ``{"type": "audio"}``, indexing nothing.
    """

    messages: list[ChatMessage]
    media: list[MediaSource]


_ROLES = ("system", "user", "assistant", "tool")


# ``input_audio.format`` values taken (OpenAI's wav and mp3, and the containers the decoder reads);
# the content is sniffed whatever the format says.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac")


def chat_prompt(messages: Any, max_items: int, audio: bool = False) -> ChatPrompt:
    """Validate OpenAI chat ``messages`` and pull out their media parts. ``audio``: the model takes
    audio (its audio parts become sources, each video also its track's); otherwise audio parts
    stay unparsed markers for the model's part check to refuse (415 or 400)."""
    if not isinstance(messages, list) or not messages:
        raise unprocessable("'messages' must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    media: list[MediaSource] = []
    for m_idx, msg in enumerate(messages):
        where = f"messages[{m_idx}]"
        if not isinstance(msg, dict):
            raise unprocessable(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise unprocessable(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
        parts = _content_parts(msg.get("content"), f"{where}.content", media, audio)
        out.append({"role": role, "content": parts})
        # a video's track is part of the video: the limit counts the parts
        if sum(not m.audio_track for m in media) > max_items:
            raise APIError(413, f"more than {max_items} media items in one request", param="messages")
    return ChatPrompt(messages=out, media=media)


def _content_parts(content: Any, where: str, media: list[MediaSource], audio: bool) -> list[ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise unprocessable(f"{where} must be a string or a list of parts", where)
    parts: list[ContentPart] = []
    for p_idx, part in enumerate(content):
        pwhere = f"{where}[{p_idx}]"
        if not isinstance(part, dict):
            raise unprocessable(f"{pwhere} must be an object", pwhere)
        ptype = part.get("type")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise unprocessable(f"{pwhere}.text must be a string", f"{pwhere}.text")
            parts.append({"type": "text", "text": text})
        elif ptype in ("image_url", "video_url"):
            modality: Modality = "image" if ptype == "image_url" else "video"
            url = _part_url(part.get(ptype), f"{pwhere}.{ptype}")
            parts.append({"type": modality, "index": len(media)})
            media.append(MediaSource(name=pwhere, url=url, modality_hint=modality))
            if modality == "video" and audio:
                parts[-1]["audio_index"] = len(media)
                media.append(MediaSource(name=pwhere, url=url, modality_hint="audio", audio_track=True))
        elif ptype in ("input_audio", "audio_url", "audio"):
            if not audio:
                # Kept (never fetched) so the model's part check answers for it: 415 for a model
                # that takes audio we cannot encode, 400 for one that takes none.
                parts.append({"type": "audio"})
                continue
            parts.append({"type": "audio", "index": len(media)})
            media.append(_audio_source(part, ptype, pwhere))
        else:
            raise unprocessable(
                f"{pwhere}.type must be 'text', 'image_url', 'video_url', 'input_audio' or "
                f"'audio_url', got {ptype!r}",
                f"{pwhere}.type",
            )
    return parts


def _audio_source(part: dict[str, Any], ptype: str, where: str) -> MediaSource:
    """An ``input_audio`` part (``{"data": base64, "format": ...}``) or an ``audio_url`` one
    (``{"url": http(s) or data: URI}``; transformers' ``audio`` part the same) as a source."""
    if ptype != "input_audio":
        return MediaSource(
            name=where, url=_part_url(part.get(ptype), f"{where}.{ptype}"), modality_hint="audio"
        )
    body = part.get("input_audio")
    if not isinstance(body, dict):
        raise unprocessable(
            f"{where}.input_audio must be an object with 'data' and 'format'", f"{where}.input_audio"
        )
    fmt = body.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS):
        raise bad_request(
            f"{where}.input_audio.format {fmt!r} is not one of {list(AUDIO_FORMATS)}",
            f"{where}.input_audio.format",
        )
    data = body.get("data")
    if not isinstance(data, str):
        raise unprocessable(f"{where}.input_audio.data must be a base64 string", f"{where}.input_audio.data")
    if not data:
        raise bad_request(f"{where}.input_audio.data is empty", f"{where}.input_audio.data")
    if data.startswith("data:"):
        return MediaSource(name=where, url=data, modality_hint="audio")
    return MediaSource(
        name=where, data=decode_base64(data, f"{where}.input_audio.data"), modality_hint="audio"
    )


def _part_url(value: Any, where: str) -> str:
    # OpenAI sends {"url": "..."}; a bare string is accepted as well.
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise unprocessable(f"{where}.url must be a non-empty string", f"{where}.url")
    return url
