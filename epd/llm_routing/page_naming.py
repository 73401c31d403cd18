"""How a server names the pages of its prefix cache, so the router can name a prompt's pages the
same way and look them up in the index built from that server's KV events.

    RoutingPrompt (token ids as the server sees them + each media run's span and MediaKey)
        ── PageNaming.names(prompt, page_size) ──▶ one int per whole page, chained: the name of
           page i stands for every token and media item of pages [0, i]

Two schemes, chosen per server from what it reports (``scheme``):

- ``"epd"``: epd's engines (``epd_common.messages.page_hash``): xxh3 over the cache keys (media
  runs as their MediaKeys' pseudo-ids). The engine publishes the same names, computed by the same
  code, so there is nothing to check.
- ``"vllm-sha256_cbor"``: a vLLM server's block hashes (``vllm_block_hash``), recomputed from the
  prompt ids and the media's uuids. The recipe is checked against the server's own events before
  its index is trusted (``check``): a server that hashes otherwise is routed by load.

A naming knows nothing of engines, URLs or load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from epd_common.messages.cache_keys import MediaSpan, build_cache_keys
from epd_common.messages.kv_events import BlockStored
from epd_common.messages.page_hash import page_hashes


class RoutingPrompt(NamedTuple):
    """A prompt as the router names its pages: ``token_ids`` as the server will see them (media
    runs as their placeholder ids) and ``media``, each run's span with its item's MediaKey. Ids
    with no spans are a prompt without media (or one whose runs are already pseudo-ids)."""

    token_ids: Sequence[int]
    media: Sequence[MediaSpan] = ()

    def cache_keys(self) -> list[int]:
        """The ids with each media run as its MediaKey's pseudo-id: what epd's engine matches."""
        return build_cache_keys(list(self.token_ids), self.media) if self.media else list(self.token_ids)


def as_routing_prompt(prompt: RoutingPrompt | Sequence[int]) -> RoutingPrompt:
    """Plain ids are a prompt without media."""
    return prompt if isinstance(prompt, RoutingPrompt) else RoutingPrompt(list(prompt))


class NamingCheck(NamedTuple):
    """What one stored event said of a naming: ``ok`` None when the event cannot tell (not the
    first page of a prompt, or carrying no tokens)."""

    ok: bool | None
    detail: str = ""


class PageNaming(Protocol):
    scheme: str
    # whether a server's events must show it names pages this way before its index is read
    needs_check: bool

    def names(self, prompt: RoutingPrompt, page_size: int) -> list[int]:
        """The name of every whole page of ``prompt`` (a trailing partial page has none)."""
        ...

    def check(self, event: BlockStored) -> NamingCheck:
        """Whether the server named the pages of ``event`` as ``names`` would."""
        ...


class EpdPageNaming:
    """epd's engines: ``page_hashes`` over the cache keys (the engine's own code)."""

    scheme = "epd"
    needs_check = False  # the engine names its pages with this very code

    def names(self, prompt: RoutingPrompt, page_size: int) -> list[int]:
        return page_hashes(prompt.cache_keys(), page_size)

    def check(self, event: BlockStored) -> NamingCheck:
        return NamingCheck(True)


_SCHEMES: dict[str, PageNaming] = {"epd": EpdPageNaming()}


def register(naming: PageNaming) -> None:
    _SCHEMES[naming.scheme] = naming


def naming_for(scheme: str) -> PageNaming:
    """The naming of ``scheme``; ValueError naming the known ones."""
    try:
        return _SCHEMES[scheme]
    except KeyError:
        raise ValueError(f"unknown page naming {scheme!r}; known: {sorted(_SCHEMES)}") from None
