"""How the ingress turns a chat into prompt ids for the served model.

    messages (parts: text | image | video) --check against what the model takes--> 4xx naming a part
    media resolved to EmbeddingRefs (token counts)
    --render--> text --tokenize--> ids --expand each pad into its item's token count--> prompt ids

Two renderers, chosen once at start from the LLM's checkpoint directory:

- the checkpoint's own chat template (``llm_core.prompts.chat_template``: jinja2 as transformers renders
  it), then the pads it writes (one ``<|image_pad|>`` / ``<|video_pad|>`` per item, with the ids
  from config.json's ``image_token_id`` / ``video_token_id``) expanded to the encoder's counts, as
  the model's own processor does;
- without a template (the embedded default), the tokenizer's built-in ChatML, which writes the runs
  at their lengths itself.

Which parts the model takes comes from config.json: images need ``image_token_id`` (or the
tokenizer's image pad), videos ``video_token_id``; audio never.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_core.models.checkpoint import CheckpointError, read_config_json
from llm_core.prompts.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    check_message_parts,
    expand_media_placeholders,
    load_chat_template,
    supported_part_types,
)
from llm_core.prompts.tokenizer import Tokenizer


class PromptFormat:
    """The served model's chat format: which parts it takes and how its prompt ids are built."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        image_token_id: int | None,
        video_token_id: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.supported = supported_part_types(
            {"image_token_id": image_token_id, "video_token_id": video_token_id}
        )

    @classmethod
    def load(cls, model_dir: str | Path | None, tokenizer: Tokenizer) -> PromptFormat:
        """The format of the checkpoint at ``model_dir`` (None: the embedded default's ChatML).
        Raises ``TemplateFileError`` (naming the file) for a template that does not compile."""
        if model_dir is None:
            return cls(tokenizer, None, tokenizer.image_token_id, tokenizer.video_token_id)
        config = _config(Path(model_dir))
        image = config.get("image_token_id", tokenizer.image_token_id)
        video = config.get("video_token_id", tokenizer.video_token_id)
        return cls(tokenizer, load_chat_template(model_dir), image, video)

    def check_parts(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """A 4xx (``ChatTemplateError`` with ``param`` ``messages[i].content[j]``) for a part the
        model cannot take; call before any media is fetched."""
        check_message_parts(messages, self.supported)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], counts: Sequence[int]) -> list[int]:
        """Prompt ids of ``messages`` (content parts ``{"type": "text", "text"}`` or
        ``{"type": "image" | "video"}``), the i-th media part taking ``counts[i]`` tokens."""
        kinds = [p["type"] for m in messages for p in m["content"] if p["type"] != "text"]
        assert len(kinds) == len(counts), (kinds, counts)
        if self.template is None:
            it = iter(counts)
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
            text = self.tokenizer.apply_chat_template(with_counts, add_generation_prompt=True)
            return self.tokenizer.encode(text)
        text = self.template.render(
            [{"role": m["role"], "content": [_template_part(p) for p in m["content"]]} for m in messages],
            add_generation_prompt=True,
        )
        ids = self.tokenizer.encode(text)
        images = [n for k, n in zip(kinds, counts, strict=True) if k == "image"]
        videos = [n for k, n in zip(kinds, counts, strict=True) if k == "video"]
        return expand_media_placeholders(ids, images, videos, self.image_token_id, self.video_token_id)


def _template_part(part: Mapping[str, Any]) -> dict[str, Any]:
    if part["type"] == "text":
        return {"type": "text", "text": part["text"]}
    return {"type": part["type"]}


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        return read_config_json(model_dir)
    except CheckpointError:
        return {}  # the engine's loader reports a missing or broken config.json with its path


__all__ = ["ChatTemplateError", "PromptFormat"]
