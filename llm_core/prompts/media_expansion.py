"""How a family lays a media item's embedding rows out in the prompt.

The chat template writes one placeholder per item (``<|vision_start|><|image_pad|><|vision_end|>``
in the Qwen2-VL family and MiMo-V2.5 alike); the family's expansion turns it into the ids its
processor would have produced for the encoder's output:

    PadRuns            each pad repeated to the item's token count (Qwen2-VL, Qwen2.5-VL,
                       MiMo-VL-7B: ``Qwen2VLProcessor``)
    TimestampedVideo   MiMo-V2.5: images and audio clips as PadRuns (an audio clip's
                       ``<mimo_audio_start><audio_pad><mimo_audio_end>``: the pad repeated to its
                       rows); a video's ``<vision_start><video_pad><vision_end>`` becomes
                       ``<video_start>``, then per temporal patch its time as "MM:SS" text tokens,
                       ``<vision_start>``, that patch's pads, ``<vision_end>``; then ``<video_end>``.
                       A video with sound (``video_audio``) also writes, after each patch (each
                       group of patches when ``video_audio_interleave_length`` > 0),
                       ``<mimo_audio_start>``, that stretch's audio pads, ``<mimo_audio_end>``.

Either way every embedding row is one pad id in the prompt, in item order, so the engine pairs
rows and pads without knowing the family (a video may span several pad runs, and a video with
sound is two items, its frames then its track, whose runs alternate; each item's rows go to its
own pad's runs).

Which audio rows follow which patch (``video_audio_pads``, the reference processor's rule): at
``r`` audio pads per second (``audio_input_id_per_second / audio_group_size``: 25 / 4 = 6.25),
patch ``i`` starting at ``t_i`` seconds takes the track's rows ``int(t_i * r)`` up to
``int(t_{i+1} * r)``; the last takes the rest. The track's rows are those from ``int(t_0 * r)``
(0 for a video sampled from its first frame) to the end of the video's last sampled frame
(``int(end * r)``) or of the track, whichever comes first: the encoder drops the others, so that
here, as for every item, the rows number the pads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple, Protocol

from llm_core.prompts.chat_template import ChatTemplateError
from llm_core.prompts.media_parts import expand_media_placeholders


class MediaItem(NamedTuple):
    """What the prompt needs to know of one encoded image, video or audio clip (from its
    EmbeddingRef; a video with sound from its frames' ref and its track's)."""

    kind: str  # "image" | "video" | "audio"
    num_tokens: int  # embedding rows = pads in the prompt (a video: its frames' pads)
    grid_t: int = 1  # temporal patches (1 for an image)
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch's first frame
    audio_tokens: int = 0  # video: rows of its audio track (audio pads it interleaves); 0: silent


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
        for it in items:
            if it.kind == "audio" or it.audio_tokens:
                raise ChatTemplateError("this model's prompt has no place for audio", "messages")
        images = [it.num_tokens for it in items if it.kind == "image"]
        videos = [it.num_tokens for it in items if it.kind == "video"]
        return expand_media_placeholders(ids, images, videos, self.image_token_id, self.video_token_id)


def repeat_pads(ids: Sequence[int], pad: int | None, counts: Sequence[int], kind: str) -> list[int]:
    """``ids`` with its i-th ``pad`` repeated ``counts[i]`` times. ``ChatTemplateError`` (param
    ``messages``) when the pads do not number the counts (the template dropped or repeated a part)
    or the model has no pad for them; ``ValueError`` for a count below 1."""
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"{kind} token counts must be positive integers, got {list(counts)}")
    found = 0 if pad is None else sum(1 for t in ids if t == pad)
    if found != len(counts):
        raise ChatTemplateError(
            f"{len(counts)} {kind}(s) supplied but the model has no {kind} token"
            if pad is None
            else f"the rendered prompt has {found} {kind} placeholder(s) ({pad}) but {len(counts)} "
            f"{kind}(s) were supplied: the chat template dropped or repeated a media part",
            "messages",
        )
    it = iter(counts)
    out: list[int] = []
    for t in ids:
        out.extend([t] * next(it) if t == pad else [t])
    return out


def video_audio_pads(timestamps: Sequence[float], audio_tokens: int, tokens_per_second: float) -> list[int]:
    """Audio pads after each temporal patch of a video with sound (the module docstring's rule):
    patch i starts at ``timestamps[i]`` seconds; the track's ``audio_tokens`` rows start at the
    first patch's time. A patch past the track's end gets none (the reference refuses such a
    video; here its frames stand without sound)."""
    if not timestamps:
        return []
    first = int(float(timestamps[0]) * tokens_per_second)
    bounds = [min(max(int(float(t) * tokens_per_second) - first, 0), audio_tokens) for t in timestamps[1:]]
    edges = [0, *bounds, audio_tokens]
    return [max(b - a, 0) for a, b in pairwise(edges)]


def interleave_groups(timestamps: Sequence[float], length: float) -> list[list[int]]:
    """Temporal patches grouped as the reference's ``video_audio_interleave_length`` does: 0, each
    patch alone; -1, all in one; L > 0, the patches of each L-second window from 0."""
    if length == 0:
        return [[i] for i in range(len(timestamps))]
    if length == -1:
        return [list(range(len(timestamps)))] if timestamps else []
    if length < 0:
        raise ValueError(f"video_audio_interleave_length must be -1, 0 or positive, got {length}")
    groups: list[list[int]] = []
    current: list[int] = []
    window = 0.0
    for i, t in enumerate(timestamps):
        while t >= window + length:
            if current:
                groups.append(current)
                current = []
            window += length
        current.append(i)
    if current:
        groups.append(current)
    return groups


def format_timestamp(seconds: float) -> str:
    """A video time as MiMo-V2.5's processor writes it: whole minutes and seconds, both floored and
    zero-padded to two digits ("01:05"; minutes keep counting past 59: "61:40")."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


@dataclass(frozen=True)
class TimestampedVideo:
    """MiMo-V2.5's layout (see the module docstring). ``encode`` tokenizes the timestamp text the
    way the model's tokenizer does (no special tokens added). The audio ids are None for a
    checkpoint without audio (then an audio item is refused)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_start_token_id: int
    video_end_token_id: int
    encode: Callable[[str], list[int]]
    audio_token_id: int | None = None
    audio_start_token_id: int | None = None
    audio_end_token_id: int | None = None
    audio_tokens_per_second: float = 25.0 / 4  # audio_input_id_per_second / audio_group_size
    interleave_length: float = 0.0  # video_audio_interleave_length (seconds; 0 per patch, -1 all)

    def expand(self, ids: Sequence[int], items: Sequence[MediaItem]) -> list[int]:
        videos = [it for it in items if it.kind == "video"]
        # Images and audio clips first, as pad runs; the video placeholders stay single pads for
        # the walk below (which writes a video's audio pads after this step has counted them).
        ids = repeat_pads(
            ids, self.image_token_id, [it.num_tokens for it in items if it.kind == "image"], "image"
        )
        audio = [it.num_tokens for it in items if it.kind == "audio"]
        ids = repeat_pads(ids, self.audio_token_id, audio, "audio")
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
        frames = [self.vision_start_token_id, *[self.video_token_id] * per_patch, self.vision_end_token_id]
        block = [self.video_start_token_id]
        if not video.audio_tokens:
            for seconds in video.timestamps:
                block += self.encode(format_timestamp(seconds)) + frames
            block.append(self.video_end_token_id)
            return block
        if (
            self.audio_token_id is None
            or self.audio_start_token_id is None
            or self.audio_end_token_id is None
        ):
            raise ChatTemplateError(
                "a video with sound supplied but the model has no audio token", "messages"
            )
        pads = video_audio_pads(video.timestamps, video.audio_tokens, self.audio_tokens_per_second)
        for group in interleave_groups(video.timestamps, self.interleave_length):
            block += self.encode(format_timestamp(video.timestamps[group[0]]))
            for _ in group:
                block += frames
            heard = sum(pads[i] for i in group)
            if heard:  # a stretch past the track's end stands without an audio block
                block += [self.audio_start_token_id, *[self.audio_token_id] * heard, self.audio_end_token_id]
        block.append(self.video_end_token_id)
        return block
