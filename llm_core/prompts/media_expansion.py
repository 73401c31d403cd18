"""How a family lays a media item's embedding rows out in the prompt.

The chat template writes one placeholder per item (``<|vision_start|><|image_pad|><|vision_end|>``
in the Qwen2-VL family and MiMo-V2.5 alike); the family's expansion turns it into the ids its
processor would have produced for the encoder's output:

    PadRuns            each pad repeated to the item's token count (Qwen2-VL, Qwen2.5-VL,
                       MiMo-VL-7B: ``Qwen2VLProcessor``)
    TimestampedVideo   MiMo-V2.5: images as PadRuns; a video's
                       ``<vision_start><video_pad><vision_end>`` becomes
                       ``<video_start>``, then per temporal patch its time as "MM:SS" text tokens,
                       ``<vision_start>``, that patch's pads, ``<vision_end>``; then ``<video_end>``

Either way every embedding row is one pad id in the prompt, in item order, so the engine pairs
rows and pads without knowing the family (a video may span several pad runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from llm_core.prompts.chat_template import ChatTemplateError
from llm_core.prompts.media_parts import expand_media_placeholders


class MediaItem(NamedTuple):
    """What the prompt needs to know of one encoded image or video (from its EmbeddingRef)."""

    kind: str  # "image" | "video"
    num_tokens: int  # embedding rows = pads in the prompt
    grid_t: int = 1  # temporal patches (1 for an image)
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch's first frame


class MediaExpansion(Protocol):
    def expand(self, ids: Sequence[int], items: Sequence[MediaItem]) -> list[int]:
        """``ids`` (a rendered, tokenized prompt with one placeholder per item) with each item laid
        out at its token count. ``ChatTemplateError`` (param ``messages``) when the placeholders do
        not match the items."""
        ...


@dataclass(frozen=True)
class PadRuns:
    """Each item's pad id repeated ``num_tokens`` times (``Qwen2VLProcessor``)."""

    image_token_id: int | None
    video_token_id: int | None

    def expand(self, ids: Sequence[int], items: Sequence[MediaItem]) -> list[int]:
        images = [it.num_tokens for it in items if it.kind == "image"]
        videos = [it.num_tokens for it in items if it.kind == "video"]
        return expand_media_placeholders(ids, images, videos, self.image_token_id, self.video_token_id)


def format_timestamp(seconds: float) -> str:
    """A video time as MiMo-V2.5's processor writes it: whole minutes and seconds, both floored and
    zero-padded to two digits ("01:05"; minutes keep counting past 59: "61:40")."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


@dataclass(frozen=True)
class TimestampedVideo:
    """MiMo-V2.5's layout (see the module docstring). ``encode`` tokenizes the timestamp text the
    way the model's tokenizer does (no special tokens added)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_start_token_id: int
    video_end_token_id: int
    encode: Callable[[str], list[int]]

    def expand(self, ids: Sequence[int], items: Sequence[MediaItem]) -> list[int]:
        videos = [it for it in items if it.kind == "video"]
        # Images first, as pad runs; the video placeholders stay single pads for the walk below.
        ids = PadRuns(self.image_token_id, None).expand(ids, [it for it in items if it.kind == "image"])
        found = sum(1 for t in ids if t == self.video_token_id)
        if found != len(videos):
            raise ChatTemplateError(
                f"the rendered prompt has {found} video placeholder(s) ({self.video_token_id}) but "
                f"{len(videos)} video(s) were supplied: the chat template dropped or repeated a media part",
                "messages",
            )
        out: list[int] = []
        pending = iter(videos)
        i = 0
        while i < len(ids):
            if ids[i] != self.video_token_id:
                out.append(ids[i])
                i += 1
                continue
            # The template wrote <vision_start><video_pad><vision_end>: the block replaces all three.
            if (
                not out
                or out[-1] != self.vision_start_token_id
                or ids[i + 1 : i + 2] != [self.vision_end_token_id]
            ):
                raise ChatTemplateError(
                    "a video placeholder is not written as <|vision_start|><|video_pad|><|vision_end|> "
                    "by the chat template",
                    "messages",
                )
            out.pop()
            out.extend(self._video_block(next(pending)))
            i += 2
        return out

    def _video_block(self, video: MediaItem) -> list[int]:
        if video.grid_t < 1 or video.num_tokens % video.grid_t:
            raise ValueError(
                f"a video of {video.num_tokens} tokens does not split into {video.grid_t} temporal patches"
            )
        if len(video.timestamps) != video.grid_t:
            raise ValueError(
                f"a video of {video.grid_t} temporal patches came with {len(video.timestamps)} timestamps "
                "(the encoder must report one per temporal patch for this model)"
            )
        per_patch = video.num_tokens // video.grid_t
        block = [self.video_start_token_id]
        for seconds in video.timestamps:
            block += self.encode(format_timestamp(seconds))
            block += [
                self.vision_start_token_id,
                *[self.video_token_id] * per_patch,
                self.vision_end_token_id,
            ]
        block.append(self.video_end_token_id)
        return block
