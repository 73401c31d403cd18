"""Sequence: token slices across the prompt / output boundary."""

from __future__ import annotations

import pytest

from epd_common.messages.cache_keys import (
    MediaRows,
    MediaSpan,
    MediaSpanError,
    build_cache_keys,
    media_pseudo_id,
    media_spans,
)
from llm_core.request import Sequence


def test_token_slice_equals_slicing_token_ids() -> None:
    seq = Sequence(seq_id=1, prompt_ids=[10, 11, 12, 13])
    seq.output_ids.extend([20, 21, 22])
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == seq.token_ids[start:end], (start, end)


IMG, VID = 90, 91


def test_media_spans_one_run_per_image() -> None:
    prompt = [1, IMG, IMG, IMG, 2, VID, VID, 3]
    spans = media_spans(prompt, [IMG, VID], [("a", 3), ("b", 2)])
    assert spans == [MediaSpan(1, 3, "a", 0, 0), MediaSpan(5, 2, "b", 1, 0)]


def test_media_spans_a_video_over_several_runs() -> None:
    """A MiMo-V2.5 video: one run per temporal patch, timestamp text between; each run takes the
    next rows of the same item."""
    prompt = [1, IMG, IMG, 2, 7, 7, VID, VID, 8, 7, 7, VID, VID, 8, 7, 7, VID, VID, 8, 3]
    spans = media_spans(prompt, [IMG, VID], [("img", 2), ("vid", 6)])
    assert spans == [
        MediaSpan(1, 2, "img", 0, 0),
        MediaSpan(6, 2, "vid", 1, 0),
        MediaSpan(11, 2, "vid", 1, 2),
        MediaSpan(16, 2, "vid", 1, 4),
    ]


@pytest.mark.parametrize(
    ("prompt", "media", "match"),
    [
        ([1, IMG, IMG, 2], [("a", 3)], "end before media 0"),
        ([1, IMG, IMG, IMG, 2], [("a", 2)], "has 3 tokens but media 0 has 2 rows left"),
        ([IMG, 2, IMG], [("a", 1)], "1 media placeholder run"),
        ([1, 2], [("a", 1)], "end before media 0"),
    ],
)
def test_media_spans_mismatch_is_a_typed_error(
    prompt: list[int], media: list[tuple[str, int]], match: str
) -> None:
    with pytest.raises(MediaSpanError, match=match):
        media_spans(prompt, [IMG, VID], media)


AUD = 92


def test_media_spans_pair_each_item_with_its_own_pad() -> None:
    """A MiMo-V2.5 video with sound: per temporal patch its video run, then its audio run; the
    video item takes the video runs, its track (the next item) the audio runs, then an audio clip
    takes the next audio run."""
    prompt = [1, VID, VID, 8, AUD, 9, 7, VID, VID, 8, AUD, AUD, 9, 3, AUD, AUD, AUD, 4]
    media = [MediaRows("vid", 4, VID), MediaRows("track", 3, AUD), MediaRows("clip", 3, AUD)]
    spans = media_spans(prompt, [IMG, VID, AUD], media)
    assert spans == [
        MediaSpan(1, 2, "vid", 0, 0),
        MediaSpan(4, 1, "track", 1, 0),
        MediaSpan(7, 2, "vid", 0, 2),
        MediaSpan(10, 2, "track", 1, 1),
        MediaSpan(14, 3, "clip", 2, 0),
    ]
    keys = build_cache_keys(prompt, spans)
    assert keys[4] == keys[10] == media_pseudo_id("track") != keys[14] == media_pseudo_id("clip")
    assert keys[1] == keys[8] == media_pseudo_id("vid")


@pytest.mark.parametrize(
    ("media", "match"),
    [
        # the track's rows do not cover its runs: the clip would take the second one
        ([MediaRows("v", 2, VID), MediaRows("t", 1, AUD)], "1 media placeholder run"),
        ([MediaRows("v", 2, VID), MediaRows("t", 2, AUD)], "has 2 tokens but media 1 has 1 rows"),
        # listed against prompt order
        ([MediaRows("t", 3, AUD), MediaRows("v", 2, VID)], "not in prompt order"),
        ([MediaRows("v", 2, IMG), MediaRows("t", 2, AUD)], "end before media 0"),
    ],
)
def test_media_spans_by_pad_mismatches(media: list[MediaRows], match: str) -> None:
    prompt = [1, VID, 8, AUD, 9, VID, 8, AUD, AUD, 9]
    with pytest.raises(MediaSpanError, match=match):
        media_spans(prompt, [IMG, VID, AUD], media)


def test_prefix_keys_differ_for_different_audio() -> None:
    """Same prompt, different clips: the keys part at the audio run (prefix cache and routing)."""
    prompt = [1, 2, AUD, AUD, AUD, 3]

    def keys(key: str) -> list[int]:
        return build_cache_keys(prompt, media_spans(prompt, [AUD], [MediaRows(key, 3, AUD)]))

    a, b = keys("clip-a"), keys("clip-b")
    assert a[:2] == b[:2] == [1, 2] and a[2:5] != b[2:5] and a[5:] == b[5:] == [3]
    assert keys("clip-a") == a
