"""The attempt loop over a pool of servers, with the routing policy plugged in.

One call::

    candidates = live members not tried yet        (every member, when all were down at the start
                                                    and ``all_down_tries_all``)
    pick = policy.choose(request, candidates)      (the ring's next owner; the lowest affinity cost)
    passed by when its counted-down refusal is past the deadline (``pass_by_refused``)
    fn(pick) ──ok──▶ the result
             ──error──▶ classify: FATAL raises; REFUSED counts the wait down; UNREACHABLE takes
                        the server out; then the next candidate, up to ``max_attempts``
    none left ──▶ AllAttemptsFailed (each attempt and its verdict; the shortest wait a refusal named)

The members of a pool may be a subset of its ``Liveness``: with split roles the prefill and the
decode pools share the liveness of an engine that serves both.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from epd.server_pool.attempts import (
    AllAttemptsFailed,
    AttemptFailure,
    NoServerAvailable,
    Outcome,
    PassedBy,
    Verdict,
    refused,
)
from epd.server_pool.liveness import Liveness
from epd.server_pool.refusals import RefusalClock

log = logging.getLogger("epd.server_pool")

T = TypeVar("T")


class Picked(Protocol):
    """What a policy chose: at least the server's url (an LLM dispatch carries its load too)."""

    @property
    def url(self) -> str: ...


R_contra = TypeVar("R_contra", contravariant=True)
P_co = TypeVar("P_co", bound=Picked, covariant=True)
R = TypeVar("R")
P = TypeVar("P", bound=Picked)


class RoutingPolicy(Protocol[R_contra, P_co]):
    """Chooses one of ``candidates`` (never empty) for ``request``."""

    def choose(self, request: R_contra, candidates: Sequence[str]) -> P_co: ...


# classify an attempt's exception (each kind of server knows its client's errors)
Classifier = Callable[[BaseException], Verdict]
# (a failed attempt, whether the call moves on to another server): metrics
FailureHook = Callable[[AttemptFailure, bool], None]


@dataclass(frozen=True)
class PoolConfig:
    label: str  # what logs and errors call a server: "encoder worker", "LLM engine"
    max_attempts: int | None = None  # servers one call tries at most (None: every candidate)
    # every server down when a call starts: try them all anyway (better a likely failure than a
    # certain one) instead of failing at once
    all_down_tries_all: bool = False
    # pass a server by, unsent, while its counted-down refusal is past the call's deadline
    pass_by_refused: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"PoolConfig.max_attempts must be >= 1, got {self.max_attempts}")


class ServerPool(Generic[R, P]):
    """Routes calls over servers with failover. Use from one event loop."""

    def __init__(
        self,
        liveness: Liveness,
        policy: RoutingPolicy[R, P],
        classify: Classifier,
        config: PoolConfig,
        *,
        members: Sequence[str] | None = None,
        refusals: RefusalClock | None = None,
        on_failure: FailureHook | None = None,
    ) -> None:
        """``members``: the servers of ``liveness`` this pool routes over (default: all of them,
        as they are at each call); ``refusals``: shared with other pools over the same servers."""
        if members is not None and any(m not in liveness for m in members):
            raise ValueError(f"pool members {list(members)} are not all in {liveness.members}")
        self.liveness = liveness
        self.policy = policy
        self.classify = classify
        self.config = config
        self.refusals = refusals or RefusalClock()
        self.on_failure = on_failure
        self._members = None if members is None else tuple(members)

    @property
    def members(self) -> list[str]:
        return self.liveness.members if self._members is None else list(self._members)

    @property
    def live_members(self) -> list[str]:
        return self.liveness.up_among(self.members)

    def expected_wait_s(self) -> float:
        """The shortest wait any live member would give a new request (``RefusalClock``)."""
        return self.refusals.least(self.live_members)

    def candidates(self, tried: Collection[str] = (), all_down: bool = False) -> list[str]:
        """Live members not in ``tried``; every member not tried when ``all_down``."""
        pool = self.members if all_down else self.live_members
        return [u for u in pool if u not in tried]

    def all_down(self) -> bool:
        """Whether a call starting now would try every member (all are down, and the pool is
        configured to try them anyway)."""
        return self.config.all_down_tries_all and not self.live_members

    async def call(
        self,
        request: R,
        fn: Callable[[P], Awaitable[T]],
        deadline_s: float | None = None,
        what: str = "",
    ) -> T:
        """Run ``fn`` on the server the policy picks for ``request``, failing over to the next
        pick as the classifier allows. ``deadline_s``: what is left of the request's deadline
        (with ``pass_by_refused``); ``what``: the request, for the error message."""
        members = self.members
        if not members:
            raise NoServerAvailable(f"no {self.config.label}s are configured")
        all_down = self.all_down()
        tried: list[str] = []
        failures: list[AttemptFailure] = []
        candidates = self.candidates(tried, all_down)
        if not candidates:
            raise NoServerAvailable(f"all {len(members)} {self.config.label}s are down: {members}")
        while candidates and not self._spent(tried):
            pick = self.policy.choose(request, candidates)
            url = pick.url
            tried.append(url)
            wait = self.refusals.wait_s(url)
            if self.config.pass_by_refused and deadline_s is not None and wait > 0 and wait > deadline_s:
                failure = AttemptFailure(url, PassedBy(url, wait, deadline_s), refused(wait))
            else:
                try:
                    return await fn(pick)
                except Exception as e:
                    verdict = self.classify(e)
                    if verdict.outcome is Outcome.FATAL:
                        raise
                    failure = AttemptFailure(url, e, verdict)
                    self._note(failure)
            failures.append(failure)
            candidates = self.candidates(tried, all_down)
            moving_on = bool(candidates) and not self._spent(tried)
            self._log(failure, what, moving_on)
            if self.on_failure is not None:
                self.on_failure(failure, moving_on)
        raise AllAttemptsFailed(self.config.label, what, failures)

    def _spent(self, tried: Sequence[str]) -> bool:
        cap = self.config.max_attempts
        return cap is not None and len(tried) >= cap

    def _note(self, failure: AttemptFailure) -> None:
        url, _, verdict = failure
        if verdict.outcome is Outcome.REFUSED and verdict.retry_after_s is not None:
            self.refusals.note(url, verdict.retry_after_s)
        elif verdict.outcome is Outcome.UNREACHABLE:
            self.liveness.set(url, False)

    def _log(self, failure: AttemptFailure, what: str, moving_on: bool) -> None:
        if isinstance(failure.error, PassedBy):
            return
        then = "trying the next" if moving_on else "no other left"
        about = f" for {what}" if what else ""
        if failure.verdict.outcome is Outcome.REFUSED:  # routine under load: not a warning
            log.debug("%s %s refused%s: %s; %s", self.config.label, failure.url, about, failure.error, then)
        else:
            log.warning("%s %s failed%s: %r; %s", self.config.label, failure.url, about, failure.error, then)
