"""Which GOPs to decode: sampled frames grouped into keyframe runs, runs split into segments.

    display order:  K . . . . K . . . . . . K . . . . K . . .      K = keyframe, * = sampled
    sampled:        *     *       *     *       *       *
    runs:           [K0: *,*] [K1: *,*]   [K2: *]  [K3: *]          one run per keyframe with targets
    segments:       [run0, run1]          [run2, run3]             contiguous runs, balanced by cost

A run decodes forward from its keyframe to its last target; its cost is that many frames. Runs are
split into contiguous segments of similar cost, one decode task each. Within a segment the decoder
seeks to a run's keyframe unless it is only a few frames past the previous run's last target
(``Run.seek``), in which case decoding on is cheaper than a decoder flush. GOPs that hold no
sampled frame are never decoded.

This module is pure planning over a ``FrameTable``: it opens no container and decodes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from media_io.video_probe import FrameTable

# Decode forward instead of seeking when the next run's keyframe is at most this many frames
# past the previous run's last target.
RESEEK_GAP_FRAMES = 8


class Target(NamedTuple):
    """One output frame: the source frame shown at ``pts`` goes to ``slot`` of the output."""

    pts: int
    slot: int


class Run(NamedTuple):
    """Frames decoded forward from one keyframe; ``targets`` ascend by pts."""

    keyframe_pts: int
    targets: tuple[Target, ...]
    seek: bool  # seek to the keyframe (True), or keep decoding from the previous run
    cost: int  # frames decoded for this run (from the keyframe, or from the previous target)


class Segment(NamedTuple):
    """Contiguous runs decoded by one task."""

    runs: tuple[Run, ...]

    @property
    def cost(self) -> int:
        return sum(r.cost for r in self.runs)

    @property
    def num_targets(self) -> int:
        return sum(len(r.targets) for r in self.runs)


def plan_runs(table: FrameTable, indices: Sequence[int]) -> list[Run]:
    """Group the sampled display-order ``indices`` (ascending) into runs, one per keyframe."""
    assert all(b >= a for a, b in itertools.pairwise(indices)), "indices must ascend"
    pts = table.pts
    key_pos = np.searchsorted(pts, table.keyframe_pts)  # [K] display position of each keyframe
    runs: list[Run] = []
    groups: dict[int, list[Target]] = {}
    order: list[int] = []
    for slot, idx in enumerate(indices):
        assert 0 <= idx < len(pts), (idx, len(pts))
        k = int(np.searchsorted(table.keyframe_pts, pts[idx], side="right")) - 1
        assert k >= 0, "the first frame is always a keyframe (FrameTable invariant)"
        if k not in groups:
            groups[k] = []
            order.append(k)
        groups[k].append(Target(int(pts[idx]), slot))
    last_pos = -1  # display position of the previous run's last target
    for k in order:
        targets = groups[k]
        start = int(key_pos[k])
        end = int(np.searchsorted(pts, targets[-1].pts))
        seek = last_pos < 0 or start - last_pos > RESEEK_GAP_FRAMES
        cost = end - start + 1 if seek else end - last_pos
        runs.append(Run(int(table.keyframe_pts[k]), tuple(targets), seek, cost))
        last_pos = end
    return runs


def split_segments(runs: Sequence[Run], num_segments: int) -> list[Segment]:
    """Cut ``runs`` into at most ``num_segments`` contiguous segments of similar cost.

    Every segment starts with a seek (a worker begins with a fresh decoder).
    """
    assert num_segments >= 1
    if not runs:
        return []
    total = sum(r.cost for r in runs)
    segments: list[Segment] = []
    current: list[Run] = []
    acc = 0
    for run in runs:
        # close the current segment once it reached its share of the cost
        if current and acc >= total * (len(segments) + 1) / num_segments:
            segments.append(Segment(tuple(current)))
            current = []
        if not current and not run.seek:
            run = run._replace(seek=True)
        current.append(run)
        acc += run.cost
    segments.append(Segment(tuple(current)))
    return segments
