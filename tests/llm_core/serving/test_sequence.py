"""Sequence: token slices across the prompt / output boundary."""

from __future__ import annotations

import pytest

from epd_common.messages.cache_keys import MediaSpan, MediaSpanError, media_spans
from llm_core.serving.sequence import Sequence


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
