"""Media parts of a chat: which a model takes, and the pad runs that stand for them in its prompt.

- ``supported_part_types`` / ``check_message_parts``: a part the model cannot take (a video for an
  image-only model, audio for a model without an audio encoder: ``serves_audio``) is refused before anything is fetched, naming ``messages[i].content[j]``
  (text that spells a media token is not refused: it is tokenized as text, see
  ``llm_core.prompts.request_text``);
- ``expand_media_placeholders``: the one pad a chat template writes per item, repeated to the
  item's token count (Qwen2-VL's processor: grid ``t*h*w // merge_size**2``).

How a family lays out a whole media item (pads, timestamps, start/end tokens) is
``llm_core.prompts.media_expansion``; it builds on these.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from llm_core.prompts.chat_template import ChatTemplateError

# Content part type -> the modality it carries (OpenAI names and transformers' names).
PART_MODALITIES: Mapping[str, str] = {
    "text": "text",
    "image": "image",
    "image_url": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "input_audio": "audio",
    "audio_url": "audio",
}


# --- what the model takes --------------------------------------------------------------------


class UnservedModality(ChatTemplateError):
    """A part the model takes but whose encoder its checkpoint does not carry (MiMo-V2.5's audio
    without the ``audio_tokenizer/`` folder): HTTP 415."""


AUDIO_TOKENIZER_DIR = "audio_tokenizer"


def _token_sources(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Where config.json keeps token ids: its top level and MiMo-V2.5's ``processor_config`` block."""
    nested = config.get("processor_config")
    return [config, nested] if isinstance(nested, Mapping) else [config]


def declares_audio(config: Mapping[str, Any]) -> bool:
    """The model has audio placeholders: ``audio_token_id`` at the top level of config.json or in
    its ``processor_config``."""
    return any(isinstance(c.get("audio_token_id"), int) for c in _token_sources(config))


def serves_audio(config: Mapping[str, Any], model_dir: str | Path | None) -> bool:
    """The model takes audio and its checkpoint carries the audio encoder the encoder workers run:
    it declares audio, config.json has an ``audio_config`` block (the language-side tower) and the
    directory an ``audio_tokenizer/`` folder (the frozen tokenizer, MiMo-V2.5's release layout)."""
    return (
        model_dir is not None
        and declares_audio(config)
        and isinstance(config.get("audio_config"), Mapping)
        and (Path(model_dir) / AUDIO_TOKENIZER_DIR).is_dir()
    )


def unserved_part_types(config: Mapping[str, Any], audio_served: bool = False) -> frozenset[str]:
    """Modalities the model declares that its checkpoint has no encoder for: audio, unless
    ``audio_served`` (``serves_audio``)."""
    return frozenset({"audio"} if declares_audio(config) and not audio_served else ())


def supported_part_types(config: Mapping[str, Any], audio_served: bool = False) -> frozenset[str]:
    """The modalities a model takes, from its ``config.json``: text always; image when it declares
    ``image_token_id`` (or LLaVA's ``image_token_index``); video when it declares ``video_token_id``;
    audio when ``audio_served`` (``serves_audio``: declared, and the checkpoint has the encoder)."""
    kinds = {"text"}
    if isinstance(config.get("image_token_id", config.get("image_token_index")), int):
        kinds.add("image")
    if isinstance(config.get("video_token_id"), int):
        kinds.add("video")
    if audio_served:
        kinds.add("audio")
    return frozenset(kinds)


def check_message_parts(
    messages: Sequence[Mapping[str, Any]],
    supported: Collection[str],
    unserved: Collection[str] = (),
    why: Mapping[str, str] | None = None,
) -> None:
    """Raise ``ChatTemplateError`` naming the first part (``messages[i].content[j]``) whose modality
    is not in ``supported`` (see ``supported_part_types``) or whose type is unknown;
    ``UnservedModality`` when the modality is one the model takes but nothing here encodes or
    hands on (``unserved``; ``why[modality]``: the reason, default: no encoder)."""
    takes = ", ".join(k for k in ("text", "image", "video", "audio") if k in supported)
    for mi, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ChatTemplateError("content must be a string or a list of parts", f"messages[{mi}].content")
        for pi, part in enumerate(content):
            param = f"messages[{mi}].content[{pi}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if not isinstance(kind, str):
                raise ChatTemplateError("a content part must be an object with a string 'type'", param)
            modality = PART_MODALITIES.get(kind)
            if modality is None:
                raise ChatTemplateError(
                    f"unknown content part type {kind!r} (this model takes {takes})", param
                )
            if modality in unserved and modality not in supported:
                reason = (why or {}).get(modality, f"this model's {modality} encoder is not supported yet")
                raise UnservedModality(reason, param)
            if modality not in supported:
                raise ChatTemplateError(
                    f"this model does not take {modality} input (part type {kind!r}; it takes {takes})", param
                )


# --- placeholder expansion -------------------------------------------------------------------


@overload
def expand_media_placeholders(
    text_or_ids: str,
    image_counts: Sequence[int],
    video_counts: Sequence[int],
    image_token: str | None,
    video_token: str | None,
) -> str: ...


@overload
def expand_media_placeholders(
    text_or_ids: Sequence[int],
    image_counts: Sequence[int],
    video_counts: Sequence[int],
    image_token: int | None,
    video_token: int | None,
) -> list[int]: ...


def expand_media_placeholders(
    text_or_ids: str | Sequence[int],
    image_counts: Sequence[int],
    video_counts: Sequence[int],
    image_token: str | int | None,
    video_token: str | int | None,
) -> str | list[int]:
    """Repeat the i-th image pad ``image_counts[i]`` times and the i-th video pad
    ``video_counts[i]`` times, in order (``Qwen2VLProcessor``: grid ``t*h*w // merge_size**2``).

    Works on token ids (tokens are ids; the preferred form: tokenize the rendered prompt, then
    expand) or on text (tokens are strings). A token of None means the model has no such
    placeholder. Raises ``ChatTemplateError`` (param ``messages``) when the prompt's pads of a kind
    do not number the items supplied (a template that dropped or repeated a media part), and
    ``ValueError`` for a count below 1.
    """
    is_text = isinstance(text_or_ids, str)
    for counts in (image_counts, video_counts):
        bad = [n for n in counts if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"media token counts must be positive integers, got {bad[0]!r}")
    pads: dict[str | int, tuple[str, Sequence[int]]] = {}
    for token, kind, counts in ((image_token, "image", image_counts), (video_token, "video", video_counts)):
        if token is None:
            if counts:
                raise ChatTemplateError(
                    f"{len(counts)} {kind}(s) supplied but the model has no {kind} token", "messages"
                )
            continue
        if isinstance(token, str) != is_text or isinstance(token, bool):
            raise TypeError(f"the {kind} token must be a {'str' if is_text else 'int'} here, got {token!r}")
        pads[token] = (kind, counts)
    if not pads:
        return text_or_ids if isinstance(text_or_ids, str) else list(text_or_ids)
    pieces: list[Any] = (
        re.split("(" + "|".join(re.escape(str(t)) for t in pads) + ")", text_or_ids)
        if isinstance(text_or_ids, str)
        else list(text_or_ids)
    )
    found = {token: sum(1 for p in pieces if p == token) for token in pads}
    for token, (kind, counts) in pads.items():
        if found[token] != len(counts):
            raise ChatTemplateError(
                f"the rendered prompt has {found[token]} {kind} placeholder(s) ({token!r}) but "
                f"{len(counts)} {kind}(s) were supplied: the chat template dropped or repeated a media part",
                "messages",
            )
    remaining = {token: iter(counts) for token, (_, counts) in pads.items()}
    out: list[Any] = []
    for p in pieces:
        if p in remaining:
            out.extend([p] * next(remaining[p]))
        else:
            out.append(p)
    return "".join(out) if is_text else [int(t) for t in out]
