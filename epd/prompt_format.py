"""How the ingress turns a chat into prompt ids for the served model.

    messages (parts: text | image | video | audio) --check against what the model takes--> 4xx naming a part
    media resolved to EmbeddingRefs (token counts, a video's temporal patches and their times, and
    for a video with sound its track's ref)
    --render--> text --tokenize--> ids --the family lays each item out--> prompt ids

Text from the request is text: rendering and tokenizing go through ``llm_core.prompts.request_text``,
so only the template's own special tokens become special ids; ``<|im_end|>`` or ``<|image_pad|>``
written in a message is tokenized as the characters it is.

Two renderers, chosen once at start from the LLM's checkpoint directory:

- the checkpoint's own chat template (``llm_core.prompts.chat_template``: jinja2 as transformers
  renders it), then the placeholder it writes per item laid out by the model family's
  ``media_expansion`` (``llm_core.prompts.media_expansion``: pad runs at the encoder's counts for the
  Qwen2-VL family; MiMo-V2.5 also writes each video's timestamps), as the model's own processor does;
- without a template (the embedded default), the tokenizer's built-in ChatML, which writes the runs
  at their lengths itself.

Which parts the model takes comes from the checkpoint: images need ``image_token_id`` (or the
tokenizer's image pad), videos ``video_token_id``; audio needs the model to declare it and the
checkpoint to carry its encoder (``serves_audio``: ``audio_config`` and an ``audio_tokenizer/``
folder). A model that declares audio without the encoder gets a 415 naming the part. A model that
takes audio hears each video's track too: the video's item carries its track's rows
(``media_item``), which the family lays out beside the frames.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epd.media_request import ChatMessage
from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.models import family_for
from llm_core.models.family import media_expansion_of
from llm_core.prompts.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from llm_core.prompts.media_expansion import MediaExpansion, MediaItem, PadRuns
from llm_core.prompts.media_parts import (
    UnservedModality,
    check_message_parts,
    serves_audio,
    supported_part_types,
    unserved_part_types,
)
from llm_core.prompts.request_text import encode_chat
from llm_core.prompts.tokenizer import Tokenizer


class PromptFormat:
    """The served model's chat format: which parts it takes and how its prompt ids are built."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        image_token_id: int | None,
        video_token_id: int | None,
        expansion: MediaExpansion | None = None,
        unserved: frozenset[str] = frozenset(),
        audio: bool = False,
    ) -> None:
        """``audio``: the model takes audio (``serves_audio``); its expansion must lay it out."""
        self.tokenizer = tokenizer
        self.template = template
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.expansion = expansion or PadRuns(image_token_id, video_token_id)
        self.serves_audio = audio
        self.supported = supported_part_types(
            {"image_token_id": image_token_id, "video_token_id": video_token_id}, audio
        )
        self.unserved = unserved
        self.unserved_why: dict[str, str] = {}  # modality -> why it is not served (default: no encoder)

    def only(self, modalities: frozenset[str], server: str, because: str = "") -> PromptFormat:
        """This format for an LLM server that hands only ``modalities`` to its server: a part of
        another modality the model takes gets 415 naming the server kind and ``because`` (and a video is
        laid out without its sound track when audio is dropped)."""
        dropped = (self.supported - {"text"}) - modalities
        if not dropped:
            return self
        why = f": {because}" if because else ""
        out = copy.copy(self)
        out.supported = self.supported - dropped
        out.unserved = self.unserved | dropped
        out.unserved_why = {
            **self.unserved_why,
            **{m: f"the {server} LLM server does not take {m} input{why}" for m in dropped},
        }
        out.serves_audio = self.serves_audio and "audio" not in dropped
        return out

    @classmethod
    def load(cls, model_dir: str | Path | None, tokenizer: Tokenizer) -> PromptFormat:
        """The format of the checkpoint at ``model_dir`` (None: the embedded default's ChatML).
        Raises ``TemplateFileError`` (naming the file) for a template that does not compile."""
        if model_dir is None:
            return cls(tokenizer, None, tokenizer.image_token_id, tokenizer.video_token_id)
        config = _config(Path(model_dir))
        image = config.get("image_token_id", tokenizer.image_token_id)
        video = config.get("video_token_id", tokenizer.video_token_id)
        expansion = media_expansion_of(family_for(config))(config, tokenizer.encode) if config else None
        audio = serves_audio(config, model_dir)
        return cls(
            tokenizer,
            load_chat_template(model_dir),
            image,
            video,
            expansion,
            unserved_part_types(config, audio),
            audio,
        )

    def check_parts(self, messages: Sequence[ChatMessage]) -> None:
        """A 4xx (``ChatTemplateError`` with ``param`` ``messages[i].content[j]``) for a part the
        model cannot take; call before any media is fetched."""
        check_message_parts(messages, self.supported, self.unserved, self.unserved_why)

    def prompt_ids(self, messages: Sequence[ChatMessage], media: Sequence[MediaItem]) -> list[int]:
        """Prompt ids of ``messages`` (content parts ``{"type": "text", "text"}`` or
        ``{"type": "image" | "video" | "audio"}``), the i-th media part being ``media[i]``. The
        messages' text never becomes special ids (``request_text``); the template's specials do."""
        kinds = [p["type"] for m in messages for p in m["content"] if p["type"] != "text"]
        assert kinds == [it.kind for it in media], (kinds, media)
        if self.template is None:
            it = iter(item.num_tokens for item in media)
            with_counts = [
                {
                    "role": m["role"],
                    "content": [
                        p if p["type"] == "text" else {"type": p["type"], "num_tokens": next(it)}
                        for p in m["content"]
                    ],
                }
                for m in messages
            ]
            return encode_chat(
                self.tokenizer,
                with_counts,
                lambda chat: self.tokenizer.apply_chat_template(chat, add_generation_prompt=True),
            )
        template = self.template
        ids = encode_chat(
            self.tokenizer,
            [{"role": m["role"], "content": [_template_part(p) for p in m["content"]]} for m in messages],
            lambda chat: template.render(chat, add_generation_prompt=True),
        )
        return self.expansion.expand(ids, media)


def media_item(ref: EmbeddingRef, track: EmbeddingRef | None = None) -> MediaItem:
    """What the prompt needs of an encoded item: its kind, rows, temporal patches and their times;
    for a video, ``track`` is its audio track's ref (None, or zero rows: a video without sound)."""
    return MediaItem(
        kind=ref.modality,
        num_tokens=ref.num_tokens,
        grid_t=sum(g[0] for g in ref.grid_thw) if ref.modality == "video" else 1,
        timestamps=ref.grid_t_timestamps,
        audio_tokens=track.num_tokens if track is not None else 0,
    )


def prompt_media(
    messages: Sequence[ChatMessage], refs: Sequence[EmbeddingRef]
) -> tuple[list[MediaItem], list[EmbeddingRef]]:
    """The media of a parsed chat (``epd.media_request.chat_prompt``: parts index ``refs``, a video
    with its track also by ``audio_index``), in part order: one MediaItem per part, and the refs the
    engine receives, in the order their rows take the prompt's pads (a video, then its track; a
    track of zero rows, a video without sound, is left out)."""
    items: list[MediaItem] = []
    sent: list[EmbeddingRef] = []
    for m in messages:
        for p in m["content"]:
            if "index" not in p:
                continue
            ref = refs[p["index"]]
            track = refs[p["audio_index"]] if "audio_index" in p else None
            items.append(media_item(ref, track))
            sent.append(ref)
            if track is not None and track.num_tokens:
                sent.append(track)
    return items, sent


def _template_part(part: Mapping[str, Any]) -> dict[str, Any]:
    if part["type"] == "text":
        return {"type": "text", "text": part["text"]}
    return {"type": part["type"]}


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        return read_config_json(model_dir)
    except CheckpointError:
        return {}  # the engine's loader reports a missing or broken config.json with its path


__all__ = ["ChatTemplateError", "PromptFormat", "UnservedModality", "media_item", "prompt_media"]
