"""Chained content hashes of full KV pages: the names a router uses for what an engine caches.

    h(page i) = xxh3_64( h(page i-1) | the page's cache keys | the MediaKeys of media inside it )

as unsigned 64-bit integers (``h(page -1)`` = 0). The cache keys are the prompt's token ids with
each media run replaced by its MediaKey's pseudo-id (``sequence.build_cache_keys``), so two prompts
share a page hash exactly when they share every token and every image up to the end of that page:
the same rule as the radix cache's match, which makes a router's prefix lookup and the engine's hit
agree. Python's ``hash`` is never used (it is salted per process); the hashes are the same on every
machine and in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

SEED = 0  # xxh3 seed; part of the naming scheme (a router computing hashes itself uses it too)


def page_hashes(
    cache_keys: Sequence[int],
    page_size: int,
    media_keys_per_page: Sequence[Sequence[str]] = (),
    parent: int = 0,
) -> list[int]:
    """The chained hash of every full page of ``cache_keys`` (a trailing partial page has none).

    ``media_keys_per_page[i]``: the MediaKeys of the media whose runs overlap page i (empty when
    absent), hashed after the page's keys so the page's name carries its media's identity even for a
    consumer that does not know the pseudo-id rule. ``parent``: the hash of the page before the
    first one (0 at the start of a sequence)."""
    full = len(cache_keys) // page_size
    keys = np.asarray(cache_keys[: full * page_size], dtype="<i8")  # negative pseudo-ids fit int64
    out: list[int] = []
    h = parent
    for i in range(full):
        hasher = xxhash.xxh3_64(seed=SEED)
        hasher.update(h.to_bytes(8, "little"))
        hasher.update(keys[i * page_size : (i + 1) * page_size].tobytes())
        for key in media_keys_per_page[i] if i < len(media_keys_per_page) else ():
            hasher.update(b"\x00" + key.encode("ascii"))
        h = hasher.intdigest()
        out.append(h)
    return out
