"""vLLM's prefix-cache block hashes, recomputed by the router from the prompt ids and media spans it
sends, so that a vLLM server's KV events can be matched without asking it anything.

The recipe (vLLM 0.32, ``--prefix-caching-hash-algo sha256_cbor``; the default ``sha256`` pickles
Python objects and cannot be recomputed outside vLLM's process)::

    H(x)        = SHA-256 of the canonical CBOR of x          (bytes, 32)
    root        = H("vllm-none-hash")                          (the seed when PYTHONHASHSEED is unset)
    block i     = H([parent, [its block_size token ids], extra])    parent = block i-1's hash, or root
    extra       = [["mm", uuid, item offset - block start], ...] for each media item overlapping the
                  block, in prompt order; null when there is none
    on the wire = the hash's low 64 bits, as an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)

A media item is one feature in vLLM's request: its placeholder range runs from its first pad to its
last (``offset``, ``length``), and its identifier is the ``uuid`` the chat part or the token-in
request names, which epd sets to the item's MediaKey. Only whole blocks are hashed.

Whether a server really hashes this way (its algorithm, seed, block size, identifiers) is checked on
its own events (``VLLMBlockNaming.check``): the first stored block of a prompt (no parent) carries its
token ids and extra keys, from which its hash must come out as the event says.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import cbor2

from epd.llm_routing.page_naming import NamingCheck, RoutingPrompt, register
from epd_common.messages.cache_keys import MediaSpan
from epd_common.messages.kv_events import BlockStored, external_hash

SCHEME = "vllm-sha256_cbor"
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for a cryptographic hash when PYTHONHASHSEED is unset


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class MediaRange(NamedTuple):
    """One media item as vLLM places it: from its first placeholder to its last."""

    offset: int
    length: int
    identifier: str


def media_ranges(spans: Sequence[MediaSpan]) -> list[MediaRange]:
    """Each item's range (spans of one item, several runs for a MiMo-V2.5 video, merge into one),
    in prompt order."""
    first: dict[int, int] = {}
    end: dict[int, int] = {}
    key: dict[int, str] = {}
    for s in spans:
        first[s.item] = min(first.get(s.item, s.start), s.start)
        end[s.item] = max(end.get(s.item, 0), s.start + s.length)
        key[s.item] = s.key
    return sorted((MediaRange(first[i], end[i] - first[i], key[i]) for i in first), key=lambda r: r.offset)


def block_extra_keys(ranges: Sequence[MediaRange], start: int, end: int) -> tuple[Any, ...] | None:
    """The extra keys of the block [start, end): every item that overlaps it, with its offset from
    the block's start (negative when it began in an earlier block)."""
    keys = tuple(
        ("mm", r.identifier, r.offset - start)
        for r in ranges
        if r.offset < end and start < r.offset + r.length
    )
    return keys or None


def full_block_hashes(
    token_ids: Sequence[int],
    ranges: Sequence[MediaRange],
    block_size: int,
    seed: str = DEFAULT_SEED,
    parent: bytes | None = None,
) -> list[bytes]:
    """The 32-byte hash of every whole block; ``parent``: the hash before the first (None: the
    root, as for the first block of a prompt)."""
    bounds = [(b * block_size, (b + 1) * block_size) for b in range(len(token_ids) // block_size)]
    blocks = ((token_ids[s:e], block_extra_keys(ranges, s, e)) for s, e in bounds)
    return list(hash_chain(blocks, seed, parent))


def hash_chain(
    blocks: Iterable[tuple[Sequence[int], tuple[Any, ...] | None]], seed: str, parent: bytes | None = None
) -> Iterator[bytes]:
    """Each block's hash, (its tokens, its tagged extra keys) chained onto the one before."""
    h = parent if parent is not None else sha256_cbor(seed)
    for tokens, extra in blocks:
        h = sha256_cbor((h, tuple(tokens), extra))
        yield h


class VLLMBlockNaming:
    """The page naming of a vLLM server started with ``--prefix-caching-hash-algo sha256_cbor``."""

    scheme = SCHEME
    needs_check = True

    def __init__(self, seed: str = DEFAULT_SEED) -> None:
        self.seed = seed

    def names(self, prompt: RoutingPrompt, page_size: int) -> list[int]:
        ranges = media_ranges(prompt.media)
        return [external_hash(h) for h in full_block_hashes(prompt.token_ids, ranges, page_size, self.seed)]

    def check(self, event: BlockStored) -> NamingCheck:
        """A root event (no parent) with its tokens: its hashes recomputed from what it carries."""
        n = len(event.block_hashes)
        if event.parent_block_hash is not None or not n or len(event.token_ids) != n * event.block_size:
            return NamingCheck(None)
        extra = event.extra_keys or (None,) * n
        if len(extra) != n:
            return NamingCheck(None)
        tagged = [t for t in map(_tagged, extra) if not isinstance(t, bool)]
        if len(tagged) != n:
            return NamingCheck(None)  # LoRA, a salt or prompt embeds: not what epd sends
        bs = event.block_size
        blocks = ((event.token_ids[i * bs : (i + 1) * bs], keys) for i, keys in enumerate(tagged))
        for i, (h, want) in enumerate(zip(hash_chain(blocks, self.seed), event.block_hashes, strict=True)):
            if external_hash(h) != want:
                return NamingCheck(
                    False,
                    f"block {i} of a stored prompt hashes to {external_hash(h):#x} here, "
                    f"{want:#x} there: start it with --prefix-caching-hash-algo sha256_cbor and "
                    "without PYTHONHASHSEED",
                )
        return NamingCheck(True)


def _tagged(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | bool | None:
    """An event's untagged extra keys of one block as the hash takes them: (uuid, offset) pairs
    become ("mm", uuid, offset); False for any other kind of key."""
    if keys is None:
        return None
    out = []
    for k in keys:
        if not (isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], str) and isinstance(k[1], int)):
            return False
        out.append(("mm", k[0], k[1]))
    return tuple(out)


register(VLLMBlockNaming())
