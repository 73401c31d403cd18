"""MiMo-V2.5's audio and video-with-sound prompt layout against vLLM's MiMo processor
(``vllm/transformers_utils/processors/mimo_v2_omni.py``), run in vLLM's venv in a subprocess
(``mimo_processor_vllm_ref.py``) on the same token counts: audio clips of n tokens, and videos of
128x128 frames (16 pads per temporal patch) with a track of n tokens, at interleave lengths 0
(MiMo-V2.5's), -1 and a few seconds.

What the encoder does for us and the test does here: a video's track keeps the rows from the first
patch's time to the end of its last sampled frame (the processor's ``segment_end_time``: the last
frame's time plus the sampling step), or to the track's end, whichever comes first.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from llm_core.prompts.media_expansion import MediaItem, TimestampedVideo

VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".peers" / "vllm-venv" / "bin" / "python"
if not VLLM_PYTHON.exists():  # a worktree shares the main checkout's peers
    VLLM_PYTHON = Path("/work/main/.peers/vllm-venv/bin/python")
SCRIPT = Path(__file__).with_name("mimo_processor_vllm_ref.py")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM peer venv not installed (`make vllm-peer`)"),
]

VS, VE, IMG, VID, V_START, V_END = 151652, 151653, 151655, 151656, 151670, 151671
AUD, A_START, A_END = 151669, 151673, 151674
RATE = 25.0 / 4  # audio tokens per second
PER_PATCH = (128 // 16) * (128 // 16) // 4


def encode(text: str) -> list[int]:
    return [20 if c == ":" else 10 + int(c) for c in text]


def omni(interleave: float) -> TimestampedVideo:
    return TimestampedVideo(IMG, VID, VS, VE, V_START, V_END, encode, AUD, A_START, A_END, RATE, interleave)


def video_item(times: list[float], track: int) -> MediaItem:
    """What the encoder reports for a video of frames at ``times`` with a track of ``track`` tokens:
    one timestamp per temporal pair, and the track's rows it keeps (see the module docstring)."""
    grid = times[::2]
    step = times[1] - times[0] if len(times) > 1 else 1.0
    end = times[-1] + step
    kept = min(int(end * RATE), track) - int(grid[0] * RATE)
    return MediaItem("video", PER_PATCH * len(grid), len(grid), tuple(grid), audio_tokens=kept)


def ours(case: dict) -> list[int]:
    prompt: list[int] = []
    items: list[MediaItem] = []
    for part in case["parts"]:
        if "text" in part:
            prompt += part["text"]
        elif "audio" in part:
            prompt += [A_START, AUD, A_END]
            items.append(MediaItem("audio", part["audio"]))
        else:
            prompt += [VS, VID, VE]
            items.append(video_item(part["video_audio"]["times"], part["video_audio"]["audio"]))
    return omni(case["interleave"]).expand(prompt, items)


def ten_second_clip() -> list[float]:
    """10 s at 30 fps sampled at 1 fps: frames linspace(0, 299, 10) floored, at index / 30 s."""
    return [math.floor(i * 299 / 9) / 30 for i in range(10)]


PARTS: list[list[dict]] = [
    [{"text": [1, 2]}, {"audio": 7}, {"text": [3]}],
    [{"audio": 1}],
    [{"video_audio": {"times": [0.0, 1.0, 2.0, 3.0], "audio": 26}}],  # the track outlasts the frames
    [{"video_audio": {"times": ten_second_clip(), "audio": 63}}],  # 10 s: 1001 mel frames -> 63
    [{"video_audio": {"times": [0.0, 1.0, 2.0, 3.0, 4.0], "audio": 32}}],  # odd: the last pair padded
    [
        {"text": [4]},
        {"audio": 3},
        {"text": [5, 6]},
        {"video_audio": {"times": [0.0, 0.5, 1.0, 1.5, 2.0, 2.5], "audio": 17}},
        {"text": [7]},
        {"audio": 2},
    ],
]


CASES = [{"interleave": 0, "parts": parts} for parts in PARTS] + [
    {"interleave": interleave, "parts": [{"video_audio": {"times": times, "audio": track}}, {"audio": 2}]}
    for interleave in (-1, 3, 4.5)
    for times, track in (([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 63), (ten_second_clip(), 63))
]


def test_prompt_ids_equal_vllm_processor() -> None:
    run = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), json.dumps(CASES)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for case, expected in zip(CASES, theirs, strict=True):
        got = ours(case)
        assert got == expected, case
        assert AUD in got
