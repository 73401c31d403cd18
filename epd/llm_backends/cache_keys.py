"""The keys a prompt is routed on: what the engine's prefix cache matches (``Sequence.cache_keys``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd_common.messages.cache_keys import MediaSpanError, build_cache_keys, media_spans
from llm_core.prompts.tokenizer import Tokenizer


def prompt_cache_keys(tokenizer: Tokenizer, prompt: Any, media: Sequence[tuple[str, int]] = ()) -> list[int]:
    """Token ids, each media run replaced by its MediaKey's pseudo-id (``media``: (key, rows) per
    item in prompt order). A string prompt is tokenized; a prompt the engine will refuse routes on
    its plain ids (the engine answers the 4xx), anything else on nothing (load only)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_text(prompt)  # a request's text: spelled specials stay characters
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        return []
    pads = [t for t in (tokenizer.image_token_id, tokenizer.video_token_id) if t is not None]
    try:
        return build_cache_keys(ids, media_spans(ids, pads, list(media)))
    except MediaSpanError:
        return ids
