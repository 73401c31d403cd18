"""What one failed attempt on a server means, and the errors a pool call ends with.

A classifier (one per kind of server: it knows its client's errors) turns an exception into a
``Verdict``::

    FATAL        the request's own fault (bad media, a 4xx): raised at once, no other server
    FAILED       worth another server (a 5xx, a timeout); the server stays in the routing set
    UNREACHABLE  worth another server, and the server leaves the routing set until it is
                 marked up (a health check, the supervisor)
    REFUSED      too busy, come back in ``retry_after_s``: worth another server, and the wait
                 is counted down (``RefusalClock``)
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Outcome(enum.Enum):
    FATAL = "fatal"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"


class Verdict(NamedTuple):
    outcome: Outcome
    retry_after_s: float | None = None  # REFUSED: the wait the server named


FATAL = Verdict(Outcome.FATAL)
FAILED = Verdict(Outcome.FAILED)
UNREACHABLE = Verdict(Outcome.UNREACHABLE)


def refused(retry_after_s: float | None) -> Verdict:
    return Verdict(Outcome.REFUSED, retry_after_s)


class AttemptFailure(NamedTuple):
    url: str
    error: BaseException
    verdict: Verdict


class PassedBy(Exception):
    """The server was not sent the request: its last refusal, counted down, is still past the
    request's deadline."""

    status = 503

    def __init__(self, url: str, wait_s: float, deadline_s: float) -> None:
        self.url = url
        self.retry_after_s = wait_s
        super().__init__(
            f"{url}: refused recently; expected wait {wait_s:.1f} s is past the {deadline_s:g} s deadline"
        )


class NoServerAvailable(Exception):
    """The pool has no server to try at all (none configured, or every one down): 503."""

    status = 503


class AllAttemptsFailed(Exception):
    """Every server tried for one request failed with a verdict worth another server."""

    status = 503

    def __init__(self, label: str, what: str, attempts: list[AttemptFailure]) -> None:
        """``label``: what a server is called; ``what``: the request, for the message."""
        self.attempts = attempts
        tried = "; ".join(f"{a.url}: {a.error!r}" for a in attempts)
        about = f" for {what}" if what else ""
        super().__init__(f"all {len(attempts)} {label}s failed{about}: {tried}")

    @property
    def refusals(self) -> list[AttemptFailure]:
        """The attempts refused for load (a passed-by server included)."""
        return [a for a in self.attempts if a.verdict.outcome is Outcome.REFUSED]

    @property
    def retry_after_s(self) -> float | None:
        """The shortest wait a refusing server named (None: none refused for load)."""
        waits = [a.verdict.retry_after_s for a in self.refusals if a.verdict.retry_after_s is not None]
        return min(waits) if waits else None
