"""The cache-key rule: what a prompt's prefix is matched on, so that the ingress routes a prompt on
exactly the keys the engine's prefix cache will match.

    cache keys = prompt ids, each media placeholder run replaced by a pseudo-id of its MediaKey

The placeholder runs are paired with the request's media in order (``media_spans``): each item
takes the next runs of its own placeholder id (an image's ``<|image_pad|>``, an audio clip's
``<|audio_pad|>``), so a MiMo-V2.5 video with sound, whose video and audio runs alternate patch
by patch, pairs its video rows and its track's rows each with their own runs. A pseudo-id is
negative, so it never equals a vocabulary id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from epd_common.messages.embedding_ref import MediaKey


class MediaSpan(NamedTuple):
    """A placeholder run in the prompt: ``length`` pad tokens at ``start`` for the media ``key``,
    taking that item's embedding rows ``row`` .. ``row + length`` (an item may span several runs:
    a MiMo-V2.5 video has one per temporal patch, its timestamps in between)."""

    start: int
    length: int
    key: MediaKey
    item: int = 0  # index of the item in the request's media (``Sequence.mm_items``)
    row: int = 0  # the item's first embedding row in this run


class MediaSpanError(ValueError):
    """The prompt's placeholder runs do not match the media supplied with the request (400);
    ``item`` is the index of the media item that does not line up, when one does not."""

    status = 400

    def __init__(self, message: str, item: int | None = None) -> None:
        super().__init__(message)
        self.item = item


def media_pseudo_id(key: MediaKey) -> int:
    """A negative id derived from a MediaKey; it never collides with a vocabulary id (all >= 0).

    Every token of a placeholder run gets the same pseudo-id: the run's position and length are
    already fixed by the tokens before it, so one id per run is enough to keep different media
    apart while the same media at the same place still shares the prefix.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") >> 1)


def find_placeholder_runs(prompt_ids: Iterable[int], placeholder_ids: Iterable[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of one placeholder id, in prompt order."""
    pad = set(placeholder_ids)
    runs: list[tuple[int, int]] = []
    prev = None
    for i, t in enumerate(prompt_ids):
        if t in pad and t == prev:
            s, n = runs[-1]
            runs[-1] = (s, n + 1)
        elif t in pad:
            runs.append((i, 1))
        prev = t
    return runs


class MediaRows(NamedTuple):
    """One media item as the prompt pairs it: its key, its embedding rows and the placeholder id
    those rows go to (None: whichever of the placeholder ids comes next, the pairing of a caller
    that lists items of one kind, or items whose runs never interleave)."""

    key: MediaKey
    rows: int
    pad: int | None = None


def media_spans(
    prompt_ids: list[int],
    placeholder_ids: Iterable[int],
    media: Sequence[tuple[MediaKey, int] | MediaRows],
) -> list[MediaSpan]:
    """Pair the prompt's placeholder runs with the media (``(key, rows)`` or ``MediaRows`` each, in
    prompt order): every item takes the next runs not yet taken whose id is its ``pad`` (any of
    ``placeholder_ids`` when None) until their lengths add up to its rows (one run per item in the
    Qwen2-VL layout; a MiMo-V2.5 video one per temporal patch, its audio track too). Spans come
    back in prompt order. Typed error when runs and rows do not line up, or when an item's first
    run comes before the previous item's (the media are not in prompt order)."""
    items = [MediaRows(*m) for m in media]
    pads = set(placeholder_ids) | {m.pad for m in items if m.pad is not None}
    runs = [(start, n, prompt_ids[start]) for start, n in find_placeholder_runs(prompt_ids, pads)]
    taken_runs = [False] * len(runs)
    # per placeholder id (None: any), the index of the first run it has not looked past yet
    cursor: dict[int | None, int] = {}
    spans: list[MediaSpan] = []
    prev_first = -1
    for index, (key, rows, pad) in enumerate(items):
        taken = 0
        r = cursor.get(pad, 0)
        while taken < rows:
            while r < len(runs) and (taken_runs[r] or (pad is not None and runs[r][2] != pad)):
                r += 1
            if r == len(runs):
                raise MediaSpanError(
                    f"the prompt's media placeholder runs end before media {index} ({rows} rows) is "
                    f"placed ({taken} rows so far; {len(media)} media were given)",
                    index,
                )
            start, n, _ = runs[r]
            if taken + n > rows:
                raise MediaSpanError(
                    f"placeholder run at token {start} has {n} tokens but media {index} has "
                    f"{rows - taken} rows left to place",
                    index,
                )
            if taken == 0:
                if start < prev_first:
                    raise MediaSpanError(
                        f"media {index}'s first placeholder run (token {start}) comes before the "
                        "previous item's: the media are not in prompt order",
                        index,
                    )
                prev_first = start
            taken_runs[r] = True
            spans.append(MediaSpan(start, n, key, index, taken))
            taken += n
        cursor[pad] = r
    extra = taken_runs.count(False)
    if extra:
        raise MediaSpanError(
            f"the prompt has {extra} media placeholder run(s) beyond the {len(media)} media given"
        )
    spans.sort(key=lambda s: s.start)
    return spans


def build_cache_keys(prompt_ids: list[int], spans: Iterable[MediaSpan]) -> list[int]:
    """``prompt_ids`` with each span's tokens replaced by its media's pseudo-id."""
    keys = list(prompt_ids)
    for span in spans:
        if span.start < 0 or span.start + span.length > len(keys):
            raise MediaSpanError(f"media span {span} lies outside the prompt of {len(keys)} tokens")
        pid = media_pseudo_id(span.key)
        keys[span.start : span.start + span.length] = [pid] * span.length
    return keys
