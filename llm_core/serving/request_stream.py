"""What crosses between the engine thread and asyncio callers: per-request output state and streams.

    engine thread                                   event loop
    RequestState.add_token / .output ── StepOutput ──▶ asyncio.Queue ──▶ RequestStream (async iter)
                     deliver(): one call_soon_threadsafe per loop per step

``RequestState`` turns sampled ids into text deltas: incremental detokenization (never half a
UTF-8 character), stop strings matched on the text and trimmed, and a held-back tail while a stop
string could still be forming. It knows nothing of scheduling or the model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llm_core.prompts.tokenizer import IncrementalDetokenizer, Tokenizer
from llm_core.serving.sampling import SamplingParams, find_stop, stop_holdback
from llm_core.serving.sequence import Sequence


class StepOutput(NamedTuple):
    """What one step produced for one request (usually one token)."""

    request_id: str
    token_ids: list[int]  # new ids this step (stop ids included, though not rendered)
    text: str  # new text safe to show (stop strings trimmed, partial characters held back)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache


@dataclass
class RequestState:
    """Output-side state of one request; touched by the engine thread only (``queue`` excepted)."""

    seq: Sequence
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    queue: asyncio.Queue[StepOutput]
    loop: asyncio.AbstractEventLoop
    holdback: int  # characters a running stream holds back (a stop string may still form)
    text: str = ""  # all rendered output text so far (after stop-string trimming)
    emitted: int = 0  # characters of ``text`` already sent
    done: bool = False

    @classmethod
    def create(
        cls, seq: Sequence, sampling: SamplingParams, tokenizer: Tokenizer, loop: asyncio.AbstractEventLoop
    ) -> RequestState:
        return cls(
            seq, sampling, tokenizer.detokenizer(), asyncio.Queue(), loop, stop_holdback(sampling.stop)
        )

    def add_token(self, token_id: int, render: bool, last: bool) -> bool:
        """Render one sampled id (``render=False`` for stop ids); True when a stop string matched.

        ``last``: the sequence ends with this token, so held-back partial characters are flushed.
        On a match the text is cut where the stop string starts.
        """
        checked = self.emitted
        if render:
            self.text += self.detok.add(token_id)
        if last:
            self.text += self.detok.flush()
        if not self.sampling.stop:
            return False
        match = find_stop(self.text, self.sampling.stop, checked)
        if match is None:
            return False
        self.text = self.text[: match.start]
        return True

    def output(self, ids: list[int], finished: bool, reason: str | None) -> StepOutput:
        """The StepOutput carrying ``ids`` and the text that became safe to show."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        self.done = self.done or finished
        s = self.seq
        return StepOutput(
            request_id=str(s.seq_id),
            token_ids=ids,
            text=delta,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=len(s.output_ids),
            num_cached_tokens=s.num_cached_tokens,
        )


def deliver(outs: list[tuple[RequestState, StepOutput]]) -> None:
    """Hand outputs to their event loops: one thread hop per loop per step, not per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestState, StepOutput]]] = {}
    for req, out in outs:
        by_loop.setdefault(req.loop, []).append((req, out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[RequestState, StepOutput]]) -> None:
    for req, out in items:
        req.queue.put_nowait(out)


class RequestStream:
    """Async iterator over one request's ``StepOutput``s. Closing it early aborts the request."""

    def __init__(
        self, request_id: str, queue: asyncio.Queue[StepOutput], abort: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:
            self.close()  # cancelled while waiting: the client is gone
            raise
        if out.finished:
            self._finished = True
        return out

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)
