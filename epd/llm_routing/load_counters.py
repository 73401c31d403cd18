"""The load the router itself put on each engine: its in-flight dispatches, in tokens.

A dispatch counts in one of two phases::

    route ──────────── first token ──────────────────── finish / error / disconnect
          prefill_tokens               decode_tokens
          (prompt tokens not           (prompt + output tokens so far: the KV the request
           predicted cached)            holds and every decode step reads)

Beside the phases, ``held_tokens`` (prompt + output so far, from the route on) is the KV the
request holds or is about to hold: the balance guard's measure (``policy.balanced``), because a
request waiting for its prefill on a busy engine is work there even when its prompt is mostly
cached, and counting only its uncached part makes the busiest engine look the lightest.

Decode tokens are the tokens the request holds now, not ``prompt + max_tokens``: clients set
``max_tokens`` as a bound, often tens of times the answer they get, and charging that bound would
make an engine look busy for requests that end in a second. The caller reports output tokens as
they stream (``add_output_tokens``); a non-streamed request counts its prompt until it ends.

The counters belong to the router: incremented on route, decremented by ``Dispatch.finish``
(idempotent; call it from ``finally`` or use the dispatch as a context manager) and never reset
by a health check. The one correction comes from the engine's own list of the requests it holds
(``reconcile``): a dispatch older than a grace period that the engine does not hold is a lost
decrement (the response path never called ``finish``) and is dropped. The grace keeps a request
that is still on the wire to the engine from being dropped.

Used from one thread (the event loop); nothing here locks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection
from types import TracebackType
from typing import NamedTuple


class Dispatch:
    """One request sent to one engine; ``finish`` (or leaving the ``with`` block) ends its load."""

    __slots__ = (
        "_key",
        "_owner",
        "decode_started",
        "finished",
        "max_tokens",
        "output_tokens",
        "predicted_cached_tokens",
        "prompt_tokens",
        "request_id",
        "started_at",
        "url",
    )

    def __init__(
        self,
        owner: EngineLoad,
        key: int,
        request_id: str,
        prompt_tokens: int,
        predicted_cached_tokens: int,
        max_tokens: int,
        started_at: float,
    ) -> None:
        self._owner = owner
        self._key = key
        self.url = owner.url
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.predicted_cached_tokens = predicted_cached_tokens
        self.max_tokens = max_tokens
        self.started_at = started_at
        self.output_tokens = 0
        self.decode_started = False
        self.finished = False

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine has to compute (0 once the first token is out)."""
        return 0 if self.decode_started else self.prompt_tokens - self.predicted_cached_tokens

    @property
    def decode_tokens(self) -> int:
        """Tokens the request holds while decoding (0 before the first token)."""
        return self.prompt_tokens + self.output_tokens if self.decode_started else 0

    @property
    def held_tokens(self) -> int:
        """Tokens the request holds, or will once prefilled (from the route on)."""
        return self.prompt_tokens + self.output_tokens

    def first_token(self) -> None:
        """The prefill is done: the request moves from prefill to decode load (idempotent)."""
        if not self.decode_started and not self.finished:
            self._owner._change(self, decode_started=True, output_tokens=self.output_tokens)

    def add_output_tokens(self, n: int) -> None:
        """``n`` more tokens streamed out (implies the first token); never past ``max_tokens``."""
        if self.finished or n <= 0:
            return
        self._owner._change(
            self, decode_started=True, output_tokens=min(self.max_tokens, self.output_tokens + n)
        )

    def finish(self) -> None:
        """The request ended (done, failed or abandoned). Safe to call any number of times."""
        if not self.finished:
            self._owner._remove(self)

    def __enter__(self) -> Dispatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()

    def __repr__(self) -> str:
        phase = "done" if self.finished else "decode" if self.decode_started else "prefill"
        return (
            f"Dispatch({self.request_id!r} -> {self.url} {phase} {self.prefill_tokens}+{self.decode_tokens})"
        )


class LoadSnapshot(NamedTuple):
    inflight: int  # the router's dispatches still counted
    prefill_tokens: int
    decode_tokens: int
    external_prefill_tokens: int  # what the engine reported beyond the router's own (other ingresses)
    external_decode_tokens: int
    corrected: int  # lost decrements dropped by ``reconcile`` so far
    held_tokens: int  # prompt + output tokens of every dispatch, either phase


class EngineLoad:
    """The in-flight dispatches of one engine and their token sums (kept incrementally)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self._clock = clock
        self._inflight: dict[int, Dispatch] = {}  # keyed by a counter: request ids may repeat
        self._keys = itertools.count()
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.held_tokens = 0
        self.external_prefill_tokens = 0
        self.external_decode_tokens = 0
        self.corrected = 0

    @property
    def tokens(self) -> int:
        """Prefill + decode tokens of the router's own dispatches."""
        return self.prefill_tokens + self.decode_tokens

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def dispatch(
        self, request_id: str, prompt_tokens: int, predicted_cached_tokens: int, max_tokens: int
    ) -> Dispatch:
        assert 0 <= predicted_cached_tokens <= prompt_tokens, (predicted_cached_tokens, prompt_tokens)
        d = Dispatch(
            self,
            next(self._keys),
            request_id,
            prompt_tokens,
            predicted_cached_tokens,
            max_tokens,
            self._clock(),
        )
        self._inflight[d._key] = d
        self.prefill_tokens += d.prefill_tokens
        self.held_tokens += d.held_tokens
        return d

    def _change(self, d: Dispatch, *, decode_started: bool, output_tokens: int) -> None:
        self.prefill_tokens -= d.prefill_tokens
        self.decode_tokens -= d.decode_tokens
        self.held_tokens -= d.held_tokens
        d.decode_started = decode_started
        d.output_tokens = output_tokens
        self.prefill_tokens += d.prefill_tokens
        self.decode_tokens += d.decode_tokens
        self.held_tokens += d.held_tokens

    def _remove(self, d: Dispatch) -> None:
        del self._inflight[d._key]
        self.prefill_tokens -= d.prefill_tokens
        self.decode_tokens -= d.decode_tokens
        self.held_tokens -= d.held_tokens
        d.finished = True

    def reconcile(self, held_request_ids: Collection[str], grace_s: float) -> int:
        """Drop dispatches older than ``grace_s`` whose request the engine does not hold (their
        ``finish`` was lost); returns how many. Later ``finish`` calls on them do nothing."""
        held = held_request_ids if isinstance(held_request_ids, set | frozenset) else set(held_request_ids)
        cutoff = self._clock() - grace_s
        lost = [d for d in self._inflight.values() if d.started_at <= cutoff and d.request_id not in held]
        for d in lost:
            self._remove(d)
        self.corrected += len(lost)
        return len(lost)

    def set_reported(self, prefill_tokens: int, decode_tokens: int) -> None:
        """The engine's own count of its prefill / decode tokens: what exceeds the router's is
        load from elsewhere (other ingresses). It lags by a health interval and counts a waiting
        request's whole prompt (cached or not), so it is an estimate; the router adds it only when
        configured to."""
        self.external_prefill_tokens = max(0, prefill_tokens - self.prefill_tokens)
        self.external_decode_tokens = max(0, decode_tokens - self.decode_tokens)

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            len(self._inflight),
            self.prefill_tokens,
            self.decode_tokens,
            self.external_prefill_tokens,
            self.external_decode_tokens,
            self.corrected,
            self.held_tokens,
        )
