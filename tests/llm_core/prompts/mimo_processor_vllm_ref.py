"""Run in vLLM's venv by ``test_media_expansion_vllm.py``: the prompt ids vLLM's MiMo processor
(``vllm/transformers_utils/processors/mimo_v2_omni.py``, ``MiMoVLProcessor.process``) lays out.

argv[1]: a JSON list of cases, each ``{"interleave": video_audio_interleave_length, "parts": [...]}``;
parts are ``{"text": [ids]}``, ``{"audio": n}`` (a clip
of n audio tokens, given as 4n pre-tokenized code frames, which the processor groups by 4), or
``{"video_audio": {"times": [...], "audio": n}}`` (128x128 frames at those times, and a track of
n audio tokens). Prints a JSON list of id lists.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.transformers_utils.processors.mimo_v2_omni import (
    AudioInput,
    Content,
    MiMoVLProcessor,
    VideoAudioInput,
)

CHANNELS, GROUP = 20, 4


class CharTokenizer:
    """One id per character: digits 0-9 -> 10-19, ':' -> 20 (as the test's stand-in)."""

    def encode(self, text: str) -> list[int]:
        return [20 if c == ":" else 10 + int(c) for c in text]


def processor(interleave: float) -> MiMoVLProcessor:
    return MiMoVLProcessor(
        CharTokenizer(),
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        fps=1.0,
        max_frames=3600,
        image_min_pixels=8192,
        image_max_pixels=8388608,
        video_min_pixels=8192,
        video_max_pixels=8388608,
        video_total_max_pixels=268435456,
        audio_channels=CHANNELS,
        audio_group_size=GROUP,
        audio_input_id_per_second=25.0,
        video_audio_interleave_length=interleave,
        image_token_id=151655,
        video_token_id=151656,
        audio_token_id=151669,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        audio_start_token_id=151673,
        audio_end_token_id=151674,
        video_start_token_id=151670,
        video_end_token_id=151671,
        pad_token_id=151643,
    )


def codes(tokens: int) -> torch.Tensor:
    return torch.zeros(GROUP * tokens, CHANNELS, dtype=torch.long)


def content(part: dict) -> Content:
    if "text" in part:
        return Content("text", list(part["text"]))
    if "audio" in part:
        return Content("audio", AudioInput(audio=codes(part["audio"])))
    va = part["video_audio"]
    times = torch.tensor(va["times"], dtype=torch.float64)
    frames = torch.zeros(len(times), 3, 128, 128)
    return Content("video_audio", VideoAudioInput(video=(frames, times), audio=codes(va["audio"])))


def main() -> None:
    out = [
        processor(case["interleave"]).process([content(p) for p in case["parts"]]).input_ids.tolist()
        for case in json.loads(sys.argv[1])
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
