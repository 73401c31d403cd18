"""The keys a prompt is routed on: what the engine's prefix cache matches (``Sequence.cache_keys``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd_common.messages.cache_keys import MediaRows, MediaSpanError, build_cache_keys, media_spans
from llm_core.prompts.tokenizer import Tokenizer


def prompt_cache_keys(
    tokenizer: Tokenizer, prompt: Any, media: Sequence[tuple[str, int, str]] = ()
) -> list[int]:
    """Token ids, each media run replaced by its MediaKey's pseudo-id (``media``: (key, rows,
    modality) per item in prompt order; each item's rows go to its modality's pad runs, as the
    engine pairs them). A string prompt is tokenized; a prompt the engine will refuse routes on
    its plain ids (the engine answers the 4xx), anything else on nothing (load only)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_text(prompt)  # a request's text: spelled specials stay characters
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        return []
    if not media:
        return ids  # no run becomes a pseudo-id (a prompt with runs but no media is refused)
    pads = tokenizer.media_pad_ids
    if any(modality not in pads for _, _, modality in media):
        return ids
    rows = [MediaRows(key, n, pads[modality]) for key, n, modality in media]
    try:
        return build_cache_keys(ids, media_spans(ids, pads.values(), rows))
    except MediaSpanError:
        return ids
