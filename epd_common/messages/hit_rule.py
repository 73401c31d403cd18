"""The prefix-hit rule of a sliding-window KV group, shared by the engine and its router.

Resuming a request at a page boundary ``b`` means its next query attends keys [b-W+1, b]: a
sliding-window group can serve the hit only if the ``W-1`` tokens before ``b`` (all of [0, b)
when shorter) have live KV in that group. The full-attention group serves it if every page of
[0, b) is present, which a walk over a cached path already guarantees. A boundary is a hit when
every group accepts it.

The engine's radix cache (``llm_core.caches.radix_cache``) walks nodes, its host tier
(``llm_core.caches.host_tier``) and the router's page index (``epd.llm_routing.page_index``) walk
pages; all three keep, per window
group, the run of consecutive live tokens ending at the boundary and ask ``window_accepts``. One
function, so the router's prediction cannot drift from the engine's hit; it lives beside
``page_hash`` (the pages' names) so that the router imports nothing of the engine for it.
"""

from __future__ import annotations

from collections.abc import Sequence


def window_accepts(live_run: int, boundary: int, window_tokens: int) -> bool:
    """Whether a window group serves a hit at ``boundary`` (tokens from where its pages start
    mattering): ``live_run`` tokens of live KV end there, and the group reads ``window_tokens``
    tokens before it (W-1)."""
    return live_run >= min(window_tokens, boundary)


def groups_accept(live_runs: Sequence[int], boundary: int, window_tokens: Sequence[int]) -> bool:
    """Every window group accepts ``boundary`` (``live_runs[k]``, ``window_tokens[k]``: the k-th
    window group's)."""
    return all(window_accepts(r, boundary, w) for r, w in zip(live_runs, window_tokens, strict=True))
