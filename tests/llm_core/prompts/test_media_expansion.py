"""Media layouts in the prompt (llm_core/prompts/media_expansion.py)."""

from __future__ import annotations

import pytest

from llm_core.prompts.chat_template import ChatTemplateError
from llm_core.prompts.media_expansion import MediaItem, PadRuns, TimestampedVideo, format_timestamp

# ids as in MiMo-V2.5's config.json (processor_config)
VS, VE, IMG, VID, V_START, V_END = 151652, 151653, 151655, 151656, 151670, 151671


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (digits 0-9 -> 10-19, ':' -> 20)."""
    return [20 if c == ":" else 10 + int(c) for c in text]


MIMO = TimestampedVideo(IMG, VID, VS, VE, V_START, V_END, encode)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "00:00"), (1.999, "00:01"), (59.5, "00:59"), (60.0, "01:00"), (65.25, "01:05"), (3700.0, "61:40")],
)
def test_format_timestamp(seconds: float, text: str) -> None:
    assert format_timestamp(seconds) == text


def test_ten_second_clip_at_one_fps() -> None:
    """10 s sampled at 1 fps: 10 frames, 5 temporal patches at 0, 2, 4, 6, 8 s; a 64x96-pixel frame
    (grid h=4, w=6 patches of 16) gives 6 tokens per patch. The documented layout, written out."""
    video = MediaItem("video", num_tokens=5 * 6, grid_t=5, timestamps=(0.0, 2.0, 4.0, 6.0, 8.0))
    prompt = [1, 2, VS, VID, VE, 3]
    expected = [1, 2, V_START]
    for ts in ("00:00", "00:02", "00:04", "00:06", "00:08"):
        expected += [10, 10 + int(ts[1]), 20, 10 + int(ts[3]), 10 + int(ts[4])]
        expected += [VS] + [VID] * 6 + [VE]
    expected += [V_END, 3]
    assert MIMO.expand(prompt, [video]) == expected


def test_images_and_videos_keep_their_order() -> None:
    items = [
        MediaItem("image", 3),
        MediaItem("video", 4, grid_t=2, timestamps=(0.0, 61.0)),
        MediaItem("image", 1),
    ]
    prompt = [VS, IMG, VE, 7, VS, VID, VE, 8, VS, IMG, VE]
    out = MIMO.expand(prompt, items)
    assert out == [
        *[VS, IMG, IMG, IMG, VE, 7],
        *[V_START, 10, 10, 20, 10, 10, VS, VID, VID, VE, 10, 11, 20, 10, 11, VS, VID, VID, VE, V_END],
        *[8, VS, IMG, VE],
    ]
    assert sum(1 for t in out if t in (IMG, VID)) == sum(it.num_tokens for it in items)


def test_pad_runs_match_the_counts() -> None:
    runs = PadRuns(IMG, VID)
    assert runs.expand([VS, IMG, VE, VS, VID, VE], [MediaItem("image", 2), MediaItem("video", 3, 3)]) == [
        *[VS, IMG, IMG, VE],
        *[VS, VID, VID, VID, VE],
    ]


def test_mismatches_are_errors() -> None:
    video = MediaItem("video", 4, grid_t=2, timestamps=(0.0, 2.0))
    with pytest.raises(ChatTemplateError, match="0 video placeholder") as ei:
        MIMO.expand([1, 2], [video])
    assert ei.value.param == "messages"
    with pytest.raises(ChatTemplateError, match="vision_start"):
        MIMO.expand([1, VID, VE], [video])
    with pytest.raises(ValueError, match="1 timestamps"):
        MIMO.expand([VS, VID, VE], [video._replace(timestamps=(0.0,))])
    with pytest.raises(ValueError, match="does not split"):
        MIMO.expand([VS, VID, VE], [video._replace(num_tokens=5)])
