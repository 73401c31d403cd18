"""Admission by expected wait: admit work while what is queued ahead of it would drain within the
deadline at the rate this stage has been serving, instead of a fixed count.

A burst that drains in a few seconds is absorbed whole; only real overload (a queue that would take
longer than the deadline to drain) is refused, and the refusal's Retry-After is the drain time the
stage expects, not a constant. Work is counted in the stage's own unit (an encoder's patches, an
engine's tokens, an ingress's items):

    rate = ServiceRate(seed_per_s=2000.0)     # a stage's measured units per busy second
    rate.started(now); ...; rate.finished(now, units=patches)
    wait = rate.expected_wait_s(queued + own) # when a new unit of work would be done
    if wait > deadline_s and queued: refuse(retry_after=wait)

A stage that measures itself step by step (the LLM engine) feeds ``observe(units, seconds)``
instead of ``started``/``finished``.

The rate is measured over busy time only (time with work in flight), so an idle stage keeps the
rate it last showed rather than decaying towards zero; and only from completions that had company
(another unit still in flight), whose spacing is the stage's throughput: a lone unit's completion
is its latency, which understates a stage that overlaps or batches. Failed units (a bad input
refused in a millisecond) are not samples either, nor do they cut the busy time the next
completion is measured over. A batch's completions, delivered one by one within a blink of each
other (``CLUMP_FRACTION`` of the busy time before the first), are one sample, a clump: counted apart, the first four delivered of a batch of 150 were four samples, 4
items over the whole batch's time, a rate 40 times too low that refused the rest of a burst the
stage was about to drain. It is the units completed per busy second over the samples of the last
``max_age_s`` seconds (at most ``window``, at least ``min_samples`` of the newest whatever their
age), so a batching stage is measured over a few batches, while a slow stage keeps its last few
samples however old. Until ``min_samples`` it is the seed (a guess no benchmark set: being wrong
only makes the first burst's estimate wrong for a moment).

The deadline is the server's (``max_queue_wait_s``) unless the client sends a shorter one
(``request_deadline_s``): a client that gives up after 2 s is better told at once than left to
time out in the queue; a longer client timeout does not lengthen the server's queue, which bounds
every other client's wait too.

A stage admits against a share of that deadline (``DEADLINE_SHARE``, ``admission_bound_s``): its
estimate covers the wait it can see, its own queue; the answer's way out (a server's stream, the
ingress, the client's own event loop) is in no stage's estimate, and under sustained overload on
two shared cores it took up to a second of a 10 s deadline, which put the admitted P99 past it.

The rate moves while work waits (a machine shared with other jobs, a mix that changes), and work
admitted at the bound's edge is late whenever it slows. So each stage learns its estimate's error
(``Lateness``): of recent work admitted behind other work, how much later it was done than
estimated, and scales its wait by the ``LATENESS_QUANTILE`` of that (at least 1, at most 3). The
quantile is the one the deadline is meant to bound: a client's timeout fails the late tail, not
the median (scaled for the 90th, one admitted request in a hundred came past the deadline under
sustained overload). A refusal's Retry-After is when the queue is expected to have drained, the
wait scaled by the median lateness instead:

    wait = lateness.scaled(raw_wait)         # raw_wait: the queue ahead at ``per_s``
    if wait > admission_bound_s(deadline): refuse(retry_after=lateness.typical(raw_wait))
    lateness.admitted(token, raw_wait); ...; lateness.done(token)   # what the error is learned from

And when an admitted item's turn comes, a stage re-checks it against the deadline
(``late_bound_s``): an item that would not be done in time is shed (503, Retry-After) rather
than computed for a client that has given up; on a machine whose neighbours took the cores
after the item was admitted, that is what keeps the admitted requests' tail within the deadline.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping

# Headers that carry the client's own timeout, in seconds: ours (the ingress forwards what is left
# of a request's deadline under it), and the one OpenAI's SDKs send with their read timeout.
DEADLINE_HEADERS = ("x-request-timeout", "x-stainless-read-timeout")
DEADLINE_HEADER = "X-Request-Timeout"

# The share of a request's deadline a stage's expected wait may take (the rest is the answer's way
# out, which no stage's estimate sees; module doc).
DEADLINE_SHARE = 0.9


# Of actual / estimated completion times: what a stage's wait is scaled by (module doc).
LATENESS_QUANTILE = 0.99
# Estimates the error is learned from (the default): below, a step's fixed cost is most of the wait
# and the ratio says nothing of the queue.
MIN_ESTIMATE_S = 0.5

# A completion that follows the previous one within this fraction of the busy time that opened the
# previous sample (or within CLUMP_S) is the same clump: a batch's items delivered one by one.
CLUMP_FRACTION = 0.05
CLUMP_S = 200e-6


class ServiceRate:
    """Completions per busy second of one stage (not thread-safe: call from one thread or loop)."""

    def __init__(
        self, seed_per_s: float, window: int = 1024, min_samples: int = 4, max_age_s: float = 5.0
    ) -> None:
        assert seed_per_s > 0 and window >= min_samples >= 1 and max_age_s > 0
        self.seed_per_s = seed_per_s
        self.window = window
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._in_flight = 0
        self._busy_since: float | None = None  # when the current busy period (or sample) began
        self._spaced = False  # a completion happened in this busy period (the next one is spacing)
        # the busy time that opened the newest sample, while completions may still join it (a clump)
        self._open_gap: float | None = None
        # (when, units done, busy seconds) per sample: a completion and the busy time since the last
        self._samples: deque[tuple[float, float, float]] = deque()
        self._units = 0.0  # sums over the samples (per_s is asked on every admission)
        self._busy = 0.0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def started(self, now: float | None = None) -> None:
        """A unit of work entered the stage."""
        if self._in_flight == 0:
            self._busy_since = time.monotonic() if now is None else now
            self._spaced = False
        self._in_flight += 1

    def finished(self, now: float | None = None, ok: bool = True, units: float = 1.0) -> None:
        """A piece of work of ``units`` left the stage; ``ok`` False: it failed (it stops taking
        capacity, but its time says nothing of the rate)."""
        assert self._in_flight > 0, "finished() without started()"
        now = time.monotonic() if now is None else now
        assert self._busy_since is not None
        # A failure leaves the clock alone: the busy time since the last completion belongs to the
        # next one. Restarting it here, refusals interleaved with completions (a full queue
        # refusing 45 items/s while 37/s were done) cut every gap short: the rate read 2.5x what
        # was served and Retry-After half the real drain.
        if ok:
            # The first completion of a busy period is the pipeline's latency, not its spacing: a
            # burst of 200 into an idle stage would read as a few items per second and be refused.
            if self._in_flight >= 2 and self._spaced:
                gap = max(now - self._busy_since, 0.0)
                if self._open_gap is not None and gap < max(CLUMP_S, CLUMP_FRACTION * self._open_gap):
                    self._merge(now, units, gap)
                else:
                    self._add(now, units, gap)
                    self._open_gap = gap
            else:
                self._open_gap = None
            self._spaced = True
            self._busy_since = now
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_since = None

    def observe(self, units: float, seconds: float, now: float | None = None) -> None:
        """One measured stretch of busy time directly (a stage that times its own steps)."""
        if units > 0 and seconds > 0:
            self._add(time.monotonic() if now is None else now, units, seconds)

    def _merge(self, now: float, units: float, seconds: float) -> None:
        """A completion of the clump the newest sample opened joins that sample."""
        _, u, b = self._samples[-1]
        self._samples[-1] = (now, u + units, b + seconds)
        self._units += units
        self._busy += seconds

    def _add(self, now: float, units: float, seconds: float) -> None:
        self._samples.append((now, units, seconds))
        self._units += units
        self._busy += seconds
        while len(self._samples) > self.window or (
            len(self._samples) > self.min_samples and now - self._samples[0][0] > self.max_age_s
        ):
            _, u, b = self._samples.popleft()
            self._units -= u
            self._busy -= b

    @property
    def measured(self) -> bool:
        """Whether the rate is measured yet (else it is the seed)."""
        return len(self._samples) >= self.min_samples

    def per_s(self) -> float:
        """Units per busy second over the recent window (the seed until enough samples)."""
        if not self.measured:
            return self.seed_per_s
        units, busy = self._units, self._busy  # callers on other threads hold the stage's lock
        # nothing done in the window (every completion a store hit, say): no rate to speak of
        return units / busy if busy > 1e-9 and units > 1e-9 else self.seed_per_s

    def mean_sample_s(self) -> float:
        """Busy seconds per sample (per step, for a stage that observes its steps)."""
        return self._busy / len(self._samples) if self._samples else 0.0

    def expected_wait_s(self, units: float) -> float:
        """How long ``units`` of work (e.g. those queued ahead of a new one) take at ``per_s``."""
        return max(units, 0.0) / self.per_s()


class Lateness:
    """How much later than estimated a stage's recent admitted work was done (module doc). Not
    thread-safe: call from one thread or loop, or under the stage's lock."""

    def __init__(
        self, window: int = 64, min_known: int = 8, most: float = 3.0, min_estimate_s: float = MIN_ESTIMATE_S
    ) -> None:
        """``min_estimate_s``: the shortest estimate learned from. The error that matters is the
        one near the admission bound: a stage whose fixed costs (an upload's parse, a decode) are
        a large share of a short wait learns only from waits near the bound (``near_bound_s``),
        or a short wait's ratio would scale the long ones."""
        self.min_known = min_known
        self.most = most
        self.min_estimate_s = min_estimate_s
        self._errors: deque[float] = deque(maxlen=window)  # actual / estimated
        self._pending: dict[object, tuple[float, float]] = {}  # token -> (admitted at, estimate)

    def scale(self, *quantiles: float) -> list[float]:
        """The error at each of ``quantiles`` (actual / estimated, within [1, ``most``]; 1 until
        ``min_known`` are known), from one sort."""
        if len(self._errors) < self.min_known:
            return [1.0] * len(quantiles)
        ordered = sorted(self._errors)
        return [min(max(ordered[int(q * (len(ordered) - 1))], 1.0), self.most) for q in quantiles]

    def scaled(self, wait_s: float) -> float:
        """``wait_s`` scaled for the late tail (``LATENESS_QUANTILE``): what admission bounds."""
        return wait_s * self.scale(LATENESS_QUANTILE)[0]

    def typical(self, wait_s: float) -> float:
        """``wait_s`` scaled by the median error: when the queue is expected to have drained."""
        return wait_s * self.scale(0.5)[0]

    def admitted(self, token: object, estimate_s: float, now: float | None = None) -> None:
        """``token``'s work was admitted, expected done in ``estimate_s`` (unscaled; only an
        estimate from a measured rate: the seed's is a guess, its error says nothing)."""
        self._pending[token] = (time.monotonic() if now is None else now, estimate_s)

    def done(self, token: object, now: float | None = None) -> None:
        """``token``'s work was done: its error is learned (estimates of ``min_estimate_s`` up)."""
        start = self._pending.pop(token, None)
        if start is not None and start[1] >= self.min_estimate_s:
            now = time.monotonic() if now is None else now
            self._errors.append((now - start[0]) / start[1])

    def ended(self, token: object) -> None:
        """``token``'s work left unfinished (aborted, failed): nothing is learned."""
        self._pending.pop(token, None)


def request_deadline_s(headers: Mapping[str, str], server_s: float) -> float:
    """The deadline a request is admitted against: ``server_s`` or the client's shorter timeout
    (``DEADLINE_HEADERS``; a value that is not a positive number is ignored)."""
    for name in DEADLINE_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            return min(server_s, value)
    return server_s


def admission_bound_s(deadline_s: float) -> float:
    """The expected wait a stage admits a request of ``deadline_s`` within (``DEADLINE_SHARE``)."""
    return deadline_s * DEADLINE_SHARE


def late_bound_s(deadline_s: float) -> float:
    """When admitted work of a ``deadline_s`` request is due: halfway between the admission bound
    and the deadline. Work that would not be done by then is shed when its turn comes (a 503 with
    Retry-After), not finished late: a client whose timeout is the deadline would not see it."""
    return deadline_s * (1.0 + DEADLINE_SHARE) / 2.0


def near_bound_s(deadline_s: float) -> float:
    """Estimates a stage whose fixed costs weigh on short waits learns its lateness from (half
    the admission bound of ``deadline_s``: ``Lateness``)."""
    return admission_bound_s(deadline_s) / 2


def bound_text(deadline_s: float) -> str:
    """What a refusal says it exceeded: the bound and the deadline it is a share of."""
    return f"{admission_bound_s(deadline_s):.1f} s (of the {deadline_s:g} s deadline, the rest kept for the way out)"


def seconds_left(deadline_at: float | None) -> float | None:
    """What is left of a ``time.monotonic()`` deadline, in seconds, to send on (at least a
    millisecond: the next stage then refuses, rather than reading 0 as no deadline)."""
    return None if deadline_at is None else max(deadline_at - time.monotonic(), 0.001)


def retry_after_header(wait_s: float) -> str:
    """An HTTP Retry-After value (whole seconds, at least 1) for an expected wait."""
    return str(max(1, math.ceil(wait_s)))
