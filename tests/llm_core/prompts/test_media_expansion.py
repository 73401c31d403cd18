"""Media layouts in the prompt (llm_core/prompts/media_expansion.py)."""

from __future__ import annotations

import pytest

from llm_core.prompts.chat_template import ChatTemplateError
from llm_core.prompts.media_expansion import (
    MediaItem,
    PadRuns,
    TimestampedVideo,
    format_timestamp,
    interleave_groups,
    video_audio_pads,
)

# ids as in MiMo-V2.5's config.json (processor_config)
VS, VE, IMG, VID, V_START, V_END = 151652, 151653, 151655, 151656, 151670, 151671
AUD, A_START, A_END = 151669, 151673, 151674


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (digits 0-9 -> 10-19, ':' -> 20)."""
    return [20 if c == ":" else 10 + int(c) for c in text]


MIMO = TimestampedVideo(IMG, VID, VS, VE, V_START, V_END, encode)
OMNI = TimestampedVideo(IMG, VID, VS, VE, V_START, V_END, encode, AUD, A_START, A_END, 25.0 / 4, 0.0)


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


def stamp(text: str) -> list[int]:
    return encode(text)


def test_one_audio_clip() -> None:
    """§4: ``[151673] + [151669] * n + [151674]``; the template's one pad becomes n."""
    prompt = [1, A_START, AUD, A_END, 2]
    assert OMNI.expand(prompt, [MediaItem("audio", 7)]) == [1, A_START, *[AUD] * 7, A_END, 2]


def test_a_video_with_sound_interleaves_per_patch() -> None:
    """§4's ``video_audio`` at interleave length 0, written out: per temporal patch its time, its
    video pads between vision start/end, then that patch's slice of the track's pads between audio
    start/end. Patches at 0, 2, 4 s; at 6.25 pads per second the slices start at int(t * 6.25):
    0, 12, 25; the track's 30 rows end the last slice: 12, 13, 5 pads."""
    video = MediaItem("video", 3 * 4, grid_t=3, timestamps=(0.0, 2.0, 4.0), audio_tokens=30)
    clip = MediaItem("audio", 2)
    prompt = [1, VS, VID, VE, 2, A_START, AUD, A_END, 3]
    expected = [1, V_START]
    for text, heard in (("00:00", 12), ("00:02", 13), ("00:04", 5)):
        expected += stamp(text) + [VS] + [VID] * 4 + [VE] + [A_START] + [AUD] * heard + [A_END]
    expected += [V_END, 2, A_START, AUD, AUD, A_END, 3]
    assert OMNI.expand(prompt, [video, clip]) == expected
    # every row has one pad: the frames' 12, the track's 30, the clip's 2
    out = OMNI.expand(prompt, [video, clip])
    assert out.count(VID) == 12 and out.count(AUD) == 30 + 2


def test_video_audio_pads_follow_the_reference_rule() -> None:
    # slices start at int(t * rate) from the first patch's; the last takes the rest
    assert video_audio_pads((0.0, 2.0, 4.0), 30, 6.25) == [12, 13, 5]
    assert video_audio_pads((0.0, 1.1, 2.2), 20, 6.25) == [6, 7, 7]  # int(6.875), int(13.75)
    assert video_audio_pads((1.0, 3.0), 20, 6.25) == [12, 8]  # from int(6.25) = 6: 18 - 6
    # a track that ends early: the patches past its end hear nothing
    assert video_audio_pads((0.0, 2.0, 4.0), 10, 6.25) == [10, 0, 0]
    assert video_audio_pads((), 5, 6.25) == []


def test_interleave_groups() -> None:
    times = (0.0, 2.0, 4.0, 6.0, 9.0)
    assert interleave_groups(times, 0) == [[0], [1], [2], [3], [4]]
    assert interleave_groups(times, -1) == [[0, 1, 2, 3, 4]]
    assert interleave_groups(times, 4.0) == [[0, 1], [2, 3], [4]]
    assert interleave_groups(times, 3.0) == [[0, 1], [2], [3], [4]]


def test_a_group_of_patches_shares_one_audio_block_and_past_the_end_has_none() -> None:
    grouped = TimestampedVideo(IMG, VID, VS, VE, V_START, V_END, encode, AUD, A_START, A_END, 6.25, 4.0)
    video = MediaItem("video", 3 * 2, grid_t=3, timestamps=(0.0, 2.0, 4.0), audio_tokens=20)
    frames = [VS, VID, VID, VE]
    assert grouped.expand([VS, VID, VE], [video]) == [
        V_START,
        *stamp("00:00"), *frames, *frames, A_START, *[AUD] * 20, A_END,
        *stamp("00:04"), *frames,  # past the track's 20 rows (from 25): no audio block
        V_END,
    ]  # fmt: skip


def test_audio_mismatches_are_errors() -> None:
    with pytest.raises(ChatTemplateError, match="1 audio placeholder") as ei:
        OMNI.expand([A_START, AUD, A_END], [])
    assert ei.value.param == "messages"
    with pytest.raises(ChatTemplateError, match="0 audio placeholder"):
        OMNI.expand([1, 2], [MediaItem("audio", 3)])
    # a model without audio ids takes neither audio clips nor videos with sound
    with pytest.raises(ChatTemplateError, match="no audio token"):
        MIMO.expand([A_START, AUD, A_END], [MediaItem("audio", 3)])
    with pytest.raises(ChatTemplateError, match="no audio token"):
        MIMO.expand([VS, VID, VE], [MediaItem("video", 2, grid_t=1, timestamps=(0.0,), audio_tokens=4)])
    for item in (MediaItem("audio", 3), MediaItem("video", 2, audio_tokens=3)):
        with pytest.raises(ChatTemplateError, match="no place for audio"):
            PadRuns(IMG, VID).expand([VS, VID, VE], [item])
    with pytest.raises(ValueError, match="positive"):
        OMNI.expand([A_START, AUD, A_END], [MediaItem("audio", 0)])


def test_mimo_v2_reads_its_audio_layout_from_processor_config() -> None:
    from llm_core.models.mimo_v2 import media_expansion

    block = {
        "image_token_id": IMG,
        "video_token_id": VID,
        "vision_start_token_id": VS,
        "vision_end_token_id": VE,
        "video_start_token_id": V_START,
        "video_end_token_id": V_END,
    }
    audio = {
        "audio_token_id": AUD,
        "audio_start_token_id": A_START,
        "audio_end_token_id": A_END,
        "audio_input_id_per_second": 25.0,
        "audio_group_size": 4,
        "video_audio_interleave_length": 0.0,
    }
    assert media_expansion({"processor_config": {**block, **audio}}, encode) == OMNI
    silent = media_expansion({"processor_config": block}, encode)
    assert isinstance(silent, TimestampedVideo) and silent.audio_token_id is None
