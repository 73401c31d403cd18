"""What a prompt is routed on: its ids and media spans as the server sees them (``RoutingPrompt``),
from which each server's page naming derives its page names (``epd.llm_routing.page_naming``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd.llm_routing.page_naming import RoutingPrompt
from epd_common.messages.cache_keys import MediaRows, MediaSpanError, media_spans
from llm_core.prompts.tokenizer import Tokenizer


def routing_prompt(
    tokenizer: Tokenizer, prompt: Any, media: Sequence[tuple[str, int, str]] = ()
) -> RoutingPrompt:
    """Token ids and, per media run, its span and MediaKey (``media``: (key, rows, modality) per
    item in prompt order; each item's rows go to its modality's pad runs, as the engine pairs
    them). A string prompt is tokenized; a prompt the engine will refuse routes on its plain ids
    (the engine answers the 4xx), anything else on nothing (load only)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_text(prompt)  # a request's text: spelled specials stay characters
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        return RoutingPrompt([])
    if not media:
        return RoutingPrompt(ids)  # no run is paired (a prompt with runs but no media is refused)
    pads = tokenizer.media_pad_ids
    if any(modality not in pads for _, _, modality in media):
        return RoutingPrompt(ids)
    rows = [MediaRows(key, n, pads[modality]) for key, n, modality in media]
    try:
        return RoutingPrompt(ids, media_spans(ids, pads.values(), rows))
    except MediaSpanError:
        return RoutingPrompt(ids)


def prompt_cache_keys(
    tokenizer: Tokenizer, prompt: Any, media: Sequence[tuple[str, int, str]] = ()
) -> list[int]:
    """Token ids, each media run replaced by its MediaKey's pseudo-id: what epd's engine's prefix
    cache matches (``Sequence.cache_keys``)."""
    return routing_prompt(tokenizer, prompt, media).cache_keys()
