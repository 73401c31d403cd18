"""What crosses between the engine thread and asyncio callers: per-request output state and streams.

    engine thread                                   event loop
    RequestState.add_token / .output ── StepOutput ──▶ OutputQueue ──▶ RequestStream (async iter)
                     deliver(): one call_soon_threadsafe per loop per step

``RequestState`` turns sampled ids into text deltas: incremental detokenization (never half a
UTF-8 character), stop strings matched on the text and trimmed, and a held-back tail while a stop
string could still be forming. Without stop strings nothing on the engine thread needs the text,
so it is rendered where and when a consumer first reads ``StepOutput.text`` (``_LazyText``), with
the same deltas. It knows nothing of scheduling or the model.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_core.prompts.tokenizer import IncrementalDetokenizer, Tokenizer
from llm_core.request import Sequence
from llm_core.serving.sampling import SamplingParams, find_stop, stop_holdback


class StepOutput:
    """What one step produced for one request (usually one token).

    ``text`` is the new text safe to show (stop strings trimmed, partial characters held back). A
    request without stop strings renders it only when some consumer reads it (``_LazyText``): the
    engine thread never detokenizes for a client that only wants ids.
    """

    __slots__ = (
        "_index",
        "_lazy",
        "_text",
        "finish_reason",
        "finished",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        text: str | None,
        finished: bool,
        finish_reason: str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
        lazy: _LazyText | None = None,
        index: int = 0,
    ) -> None:
        """``text`` None: output ``index`` of ``lazy`` renders it when it is first read."""
        assert text is not None or lazy is not None
        self.request_id = request_id
        self.token_ids = token_ids  # new ids this step (stop ids included, though not rendered)
        self.finished = finished
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error"
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.num_cached_tokens = num_cached_tokens  # prompt tokens served by the prefix cache
        self._text = text
        self._lazy = lazy
        self._index = index

    @property
    def text(self) -> str:
        if self._text is None:
            assert self._lazy is not None
            self._text = self._lazy.text(self._index)
            self._lazy = None
        return self._text

    def __repr__(self) -> str:
        return (
            f"StepOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, text={self.text!r}, "
            f"finished={self.finished!r}, finish_reason={self.finish_reason!r}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, num_output_tokens={self.num_output_tokens}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


class _LazyText:
    """One request's output text, rendered in output order when a consumer first reads it.

    The engine thread records what each output renders (``add``: its ids to detokenize, and
    whether the sequence ends there, which flushes held-back characters); a reader on any thread
    renders every output up to the one it reads (``text``), so outputs read out of order, or not
    at all, still get the deltas an eager rendering would have given them. Only for requests
    without stop strings: with them the engine must see the text to stop (``RequestState``).
    """

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self._detok = detok
        self._pending: list[tuple[list[int], bool]] = []  # per output: ids to render, flush after
        self._texts: list[str] = []  # the rendered outputs' text, in order
        self._lock = threading.Lock()  # two readers on different threads render in turn

    def add(self, ids: list[int], flush: bool) -> int:
        """Record the next output (engine thread); returns its index."""
        self._pending.append((ids, flush))
        return len(self._pending) - 1

    def text(self, index: int) -> str:
        with self._lock:
            detok, texts = self._detok, self._texts
            while len(texts) <= index:
                ids, flush = self._pending[len(texts)]
                parts = [detok.add(t) for t in ids]
                if flush:
                    parts.append(detok.flush())
                texts.append("".join(parts))
            return texts[index]


@dataclass
class RequestState:
    """Output-side state of one request; touched by the engine thread only (``queue`` excepted)."""

    seq: Sequence
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    queue: OutputQueue
    loop: asyncio.AbstractEventLoop
    holdback: int  # characters a running stream holds back (a stop string may still form)
    text: str = ""  # all rendered output text so far (after stop-string trimming; eager only)
    emitted: int = 0  # characters of ``text`` already sent
    done: bool = False
    # Without stop strings the text is rendered when read (``_LazyText``); ids of this step's
    # output so far, and whether it flushes.
    lazy: _LazyText | None = None
    _lazy_ids: list[int] = field(default_factory=list)
    _lazy_flush: bool = False

    @classmethod
    def create(
        cls, seq: Sequence, sampling: SamplingParams, tokenizer: Tokenizer, loop: asyncio.AbstractEventLoop
    ) -> RequestState:
        detok = tokenizer.detokenizer()
        lazy = None if sampling.stop else _LazyText(detok)
        return cls(seq, sampling, detok, OutputQueue(loop), loop, stop_holdback(sampling.stop), lazy=lazy)

    def add_token(self, token_id: int, render: bool, last: bool) -> bool:
        """Render one sampled id (``render=False`` for stop ids); True when a stop string matched.

        ``last``: the sequence ends with this token, so held-back partial characters are flushed.
        On a match the text is cut where the stop string starts.
        """
        if self.lazy is not None:  # no stop strings: rendered by whoever reads the output's text
            if render:
                self._lazy_ids.append(token_id)
            self._lazy_flush = self._lazy_flush or last
            return False
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
        self.done = self.done or finished
        s = self.seq
        if self.lazy is not None:
            index = self.lazy.add(self._lazy_ids, self._lazy_flush)
            self._lazy_ids, self._lazy_flush = [], False
            return StepOutput(
                str(s.seq_id),
                ids,
                None,
                finished,
                reason,
                len(s.prompt_ids),
                len(s.output_ids),
                s.num_cached_tokens,
                self.lazy,
                index,
            )
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
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


class OutputQueue:
    """One request's outputs on their way to its stream, on the event loop (``deliver`` hops there).

    What ``asyncio.Queue`` does for its single consumer, at about half the cost per item: no size
    bound, no task accounting, one waiter (every step puts one item into each running request's
    queue, so this is per token and per request).
    """

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque[StepOutput] = collections.deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: StepOutput) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> StepOutput | None:
        """The oldest item, or None when there is none."""
        return self._items.popleft() if self._items else None

    def wait(self) -> asyncio.Future[None]:
        """A future done at the next put (await it, then ``get_nowait``): one object per wait, where
        an ``async def get`` would add a coroutine."""
        waiter = self._waiter = self._loop.create_future()
        return waiter


class RequestStream:
    """Async iterator over one request's ``StepOutput``s. Closing it early aborts the request."""

    def __init__(self, request_id: str, queue: OutputQueue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self._finished:
            raise StopAsyncIteration
        queue = self._queue
        out = queue.get_nowait()
        while out is None:
            try:
                await queue.wait()
            except BaseException:
                self.close()  # cancelled while waiting: the client is gone
                raise
            out = queue.get_nowait()
        if out.finished:
            self._finished = True
        return out

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)
