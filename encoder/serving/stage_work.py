"""The work admitted to one of a worker's encode stages, for admission by expected wait.

A worker has a stage per kind of input: the vision tower's batcher (images and videos, counted in
patches) and, with an audio encoder, the audio batcher (clips, counted in mel frames). Each drains
its own queue at its own rate, so each keeps its own units and its own measured rate: a new
item's wait is the work admitted ahead of it in its stage, over that stage's rate. (One rate over
both would price a mel frame as a patch.)

    stage = StageWork("patches", seed_per_s=20000.0)
    stage.admit(key, units)         # estimated units (from the header), in flight
    stage.correct(key, real_units)  # once decoded: the real count replaces the estimate
    stage.finish(key, ok)           # done: the rate learns from it
    stage.expected_wait_s(units)    # the queue ahead plus ``units``, at the measured rate, scaled
                                    # for how late recent items were (``admission.Lateness``)

Not thread-safe: the worker's event loop calls it.
"""

from __future__ import annotations

from epd_common.admission import Lateness, ServiceRate, near_bound_s


class StageWork:
    def __init__(self, unit: str, seed_per_s: float, deadline_s: float = 10.0) -> None:
        """``deadline_s``: the worker's (``max_queue_wait_s``): lateness is learned near its bound."""
        self.unit = unit  # what its work is counted in ("patches", "mel frames"), for messages
        self.rate = ServiceRate(seed_per_s)
        # of items against the wait they were admitted with (a decode's fixed cost weighs on short ones)
        self.lateness = Lateness(min_estimate_s=near_bound_s(deadline_s))
        self._units: dict[str, float] = {}  # per admitted key: its units (estimated, then real)
        self.queued = 0.0  # their sum: the work ahead of a new item

    def __contains__(self, key: str) -> bool:
        return key in self._units

    def admit(self, key: str, units: float) -> None:
        if self.queued and self.rate.measured:  # behind other work, at a measured rate
            self.lateness.admitted(key, self.rate.expected_wait_s(self.queued + units))
        self._units[key] = units
        self.queued += units
        self.rate.started()

    def correct(self, key: str, units: float) -> None:
        """The item's real units replace its estimate (in the work ahead of later items, and as
        what its completion measures)."""
        if key in self._units:
            self.queued += units - self._units[key]
            self._units[key] = units

    def finish(self, key: str, ok: bool) -> None:
        units = self._units.pop(key)
        self.queued = max(self.queued - units, 0.0) if self._units else 0.0
        self.rate.finished(ok=ok, units=units)
        (self.lateness.done if ok else self.lateness.ended)(key)

    def expected_wait_s(self, units: float = 0.0) -> float:
        """When a new item of ``units`` would be done: the work ahead of it and its own, scaled
        for the late tail of recent items (what admission bounds)."""
        return self.lateness.scaled(self.rate.expected_wait_s(self.queued + units))

    def typical_wait_s(self, units: float = 0.0) -> float:
        """The same scaled by the median lateness: when the queue is expected to have drained."""
        return self.lateness.typical(self.rate.expected_wait_s(self.queued + units))
