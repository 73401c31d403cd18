"""Rotary positions of a sequence's tokens: what a model family's position scheme computes.

Two schemes:

- ``LinearPositions`` (MiMo-V2-Flash and every 1-D rotary model): token ``i`` is at position ``i``.
- ``MRopePositions`` (the Qwen2-VL family's M-RoPE): three position axes (temporal, height, width).
  Text advances all three together; a media item's placeholder run takes a 3-D grid. Transformers'
  ``Qwen2_5_VLModel.get_rope_index`` is the reference; with ``cur`` the next text position::

      text run of n tokens     (cur .. cur + n - 1) on every axis;         cur += n
      media (t, h, w) patches  gh = h / merge, gw = w / merge, gt = t:
                               temporal  cur + floor(k * interval), k < gt  (interval: 1 for an
                                         image; tokens_per_second * seconds per temporal grid for a
                                         video, in float32 as the reference computes it)
                               height    cur + r, r < gh;  width  cur + c, c < gw
                               (row-major over (k, r, c): the encoder's merged token order)
                               cur += max(gh, gw)
      generated token k        the last prompt position + 1 + k, per axis (what ``generate`` does:
                               it extends the position ids from their last column)

Prefix-cache rule: the positions of a prompt token depend only on the tokens and media before
it, which its cache key names (each media run's key is its MediaKey, and a MediaKey fixes the
grid), so a cached prompt prefix holds KV at exactly the positions a new prompt would compute.
A generated token's KV is reusable by a later prompt only if that prompt would give it the same
position: true when the prompt ends in text (every axis at ``cur - 1``, so generation continues
the text), which every chat prompt does (it ends with the assistant header). A prompt that ends
inside a media run leaves its axes apart; then only the prompt's KV enters the prefix cache
(``Sequence.cacheable_tokens``).

The schemes read a sequence and never change its tokens; ``MRopePositions`` keeps the prompt's
positions per sequence (computed at the first step) until ``release``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from llm_core.request import Sequence


class PositionScheme(Protocol):
    """How a model turns token indices into rotary positions."""

    dims: int  # 1: positions [T]; 3: positions [3, T] (M-RoPE)

    def positions(self, seq: Sequence, start: int, end: int) -> Tensor:
        """int64 [dims, end - start]: the positions of tokens start .. end - 1 of ``seq``."""
        ...

    def linear_offsets(self, seq: Sequence, start: int) -> tuple[int, ...] | None:
        """Per-axis offsets ``o`` (``dims`` of them) with token ``i`` at position ``i + o[a]`` on
        axis ``a`` for every ``i >= start``, when such offsets exist; None otherwise (then the
        caller asks ``positions``). A cheap path for decode steps, where ``positions`` would build
        a tensor per sequence."""
        ...

    def release(self, seq_id: int | str) -> None:
        """Forget what was kept for a sequence (it finished or was aborted)."""
        ...


class LinearPositions:
    """Token i at position i."""

    dims = 1

    def positions(self, seq: Sequence, start: int, end: int) -> Tensor:
        return torch.arange(start, end, dtype=torch.int64)[None]  # [1, n]

    def linear_offsets(self, seq: Sequence, start: int) -> tuple[int, ...]:
        return (0,)

    def release(self, seq_id: int | str) -> None:
        return None


class MediaGrid(NamedTuple):
    """One placeholder run for M-RoPE: where it is, its patch grid, and its temporal spacing."""

    start: int
    length: int
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    seconds_per_grid_t: float | None  # video: seconds per temporal patch; None for an image


class PromptPositions(NamedTuple):
    positions: Tensor  # int64 [3, prompt length]
    delta: int  # get_rope_index's rope delta: max position + 1 - prompt length (reported, not used)
    next_text: int  # where text after the prompt would continue (``cur``)

    @property
    def continues_text(self) -> bool:
        """Whether generation continues at ``next_text`` on every axis (the prompt ends in text)."""
        n = self.positions.shape[1]
        return n == 0 or bool((self.positions[:, -1] == self.next_text - 1).all())


def mrope_prompt_positions(
    num_tokens: int, grids: Seq[MediaGrid], spatial_merge_size: int, tokens_per_second: float
) -> PromptPositions:
    """The M-RoPE positions of a prompt of ``num_tokens`` whose placeholder runs are ``grids`` (in
    prompt order); see the module docstring for the rule."""
    pos = torch.empty(3, num_tokens, dtype=torch.int64)
    cur, i = 0, 0
    for g in grids:
        assert i <= g.start and g.start + g.length <= num_tokens, (g, i, num_tokens)
        n_text = g.start - i
        pos[:, i : g.start] = torch.arange(cur, cur + n_text)
        cur += n_text
        t, h, w = g.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != g.length:
            raise ValueError(
                f"media run at {g.start} has {g.length} placeholders but its grid {g.grid_thw} "
                f"merges to {t * gh * gw} tokens"
            )
        if g.seconds_per_grid_t is None:
            temporal = torch.zeros(t, dtype=torch.int64)
        else:
            # float32, as the reference multiplies an int64 range by a float32 tensor, then truncates
            interval = torch.tensor(tokens_per_second, dtype=torch.float32) * torch.tensor(
                g.seconds_per_grid_t, dtype=torch.float32
            )
            temporal = (torch.arange(t, dtype=torch.int64) * interval).long()
        tt, hh, ww = torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, g.start : g.start + g.length] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(gh, gw)
        i = g.start + g.length
    pos[:, i:] = torch.arange(cur, cur + num_tokens - i)
    cur += num_tokens - i
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return PromptPositions(pos, delta, cur)


class MRopePositions:
    """M-RoPE positions from a sequence's media runs and the grids of its embeddings.

    Each of ``seq.mm_items`` must carry ``.ref`` with ``grid_thw`` (one (t, h, w)), ``modality``
    and, for a video, ``seconds_per_grid_t`` (EmbeddingRef)."""

    dims = 3

    def __init__(self, spatial_merge_size: int, tokens_per_second: float) -> None:
        self.spatial_merge_size = spatial_merge_size
        self.tokens_per_second = tokens_per_second
        self._prompts: dict[int | str, PromptPositions] = {}
        # per sequence: where generated token k sits, minus its index (n_prompt + k), per axis
        self._generated_offsets: dict[int | str, tuple[int, int, int]] = {}

    def prompt(self, seq: Sequence) -> PromptPositions:
        """The prompt's positions (computed once per sequence); also sets how much of the
        sequence's KV the prefix cache may keep (see the module docstring)."""
        got = self._prompts.get(seq.seq_id)
        if got is None:
            grids = []
            for span, item in zip(seq.media, seq.mm_items, strict=True):
                ref = item.ref
                (grid,) = ref.grid_thw
                seconds = ref.seconds_per_grid_t if ref.modality == "video" else None
                if ref.modality == "video" and seconds is None:
                    seconds = 1.0  # what the reference assumes when it is not told
                grids.append(MediaGrid(span.start, span.length, grid, seconds))
            got = mrope_prompt_positions(
                seq.num_prompt_tokens, grids, self.spatial_merge_size, self.tokens_per_second
            )
            self._prompts[seq.seq_id] = got
            seq.cacheable_tokens = None if got.continues_text else seq.num_prompt_tokens
        return got

    def positions(self, seq: Sequence, start: int, end: int) -> Tensor:
        p = self.prompt(seq)
        n_prompt = seq.num_prompt_tokens
        parts = []
        if start < n_prompt:
            parts.append(p.positions[:, start : min(end, n_prompt)])
        if end > n_prompt:
            k = torch.arange(max(start, n_prompt) - n_prompt, end - n_prompt, dtype=torch.int64)
            last = p.positions[:, -1:] if n_prompt else torch.full((3, 1), -1, dtype=torch.int64)
            parts.append(last + 1 + k[None])  # [3, n]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def linear_offsets(self, seq: Sequence, start: int) -> tuple[int, int, int] | None:
        """Past the prompt, generated token ``n_prompt + k`` is at the last prompt position + 1 + k
        on each axis: offset last + 1 - n_prompt. A prompt without media is at i on every axis,
        and so are its generated tokens (offsets 0). A start inside a prompt with media: None."""
        offsets = self._generated_offsets.get(seq.seq_id)
        if offsets is None:
            if not seq.media:  # what ``prompt`` would give, without building its [3, n] tensor
                offsets = (0, 0, 0)
            else:
                n_prompt = seq.num_prompt_tokens
                last = self.prompt(seq).positions[:, -1].tolist()
                t, h, w = (int(v) + 1 - n_prompt for v in last)
                offsets = (t, h, w)
            self._generated_offsets[seq.seq_id] = offsets
        return offsets if start >= seq.num_prompt_tokens or not seq.media else None

    def release(self, seq_id: int | str) -> None:
        self._prompts.pop(seq_id, None)
        self._generated_offsets.pop(seq_id, None)
