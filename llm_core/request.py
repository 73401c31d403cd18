"""The request record, read by the caches and the serving code alike: what a client asked for
(``Request``, built once by the engine and never changed) and the scheduler's state of it
(``Sequence``: tokens, cache keys and progress).

``Request`` holds the prompt, the sampling parameters, the media and the deadline; a ``Sequence``
holds a reference to it and only what scheduling moves (progress, output tokens, status). What other
subsystems keep per request (the KV manager's pages, the speculator's drafts, the KV connectors'
copies, the runner's generators) lives with them, keyed by ``request_id``.

Token layout::

    token_ids   = prompt_ids + output_ids           what the model computes, position by position
    cache_keys  = prompt_keys + output_ids          what the prefix cache matches on
    prompt_keys = prompt_ids with each media placeholder run replaced by a pseudo-id of its MediaKey

    positions   [0 ............ num_computed_tokens) KV written (full attention: all; a window: its window)
                [num_computed_tokens .. num_tokens)  still to compute (the last one is the decode input)

The scheduler and the KV manager move a ``Sequence``'s tokens, progress and status; the model runner
only reads it. The sequence holds no KV state: its pages, pins and prefix lock are the KV manager's
(``caches.seq_kv.SeqKV``, kept by request id), and the page tables a step reads are built in
``serving.page_tables``.

It sits below ``caches`` and ``serving`` and imports neither at run time: torch (a media item's
rows) and ``epd_common.messages`` (the media spans and the cache-key rule, shared with the
ingress); ``serving.sampling.SamplingParams`` is named for type checking only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from epd_common.messages.cache_keys import MediaSpan, build_cache_keys
from epd_common.messages.embedding_ref import EmbeddingRef

if TYPE_CHECKING:
    from llm_core.serving.sampling import SamplingParams

RequestId = int | str


class MultimodalInput(NamedTuple):
    """One media item of a request: its reference and embedding rows [num_tokens, hidden].

    The tensor may be a zero-copy view of the node embedding cache; the runner only reads it.
    """

    ref: EmbeddingRef
    embedding: Tensor  # [num_tokens, hidden]


@dataclass(frozen=True, eq=False)
class Request:
    """One request as the engine accepted it. Frozen: no subsystem writes to it.

    ``prompt_ids`` is a tuple (the prompt never changes); ``media[i]`` is the i-th placeholder run
    of the prompt, ``mm_items[media[i].item]`` its embedding rows. ``sampling`` None: greedy
    (tests and internal callers). ``deadline_s``: the client's timeout, None when it set none.
    """

    request_id: RequestId
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams | None = None
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    media: tuple[MediaSpan, ...] = ()
    mm_items: tuple[MultimodalInput, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    deadline_s: float | None = None
    # Hand the prompt's KV to the engine's transport when its prefill completes (prefill/decode
    # disaggregation: this engine is the prefill side).
    kv_export: bool = False

    @classmethod
    def create(
        cls,
        request_id: RequestId,
        prompt_ids: Iterable[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 16,
        stop_token_ids: Iterable[int] = (),
        media: Iterable[MediaSpan] = (),
        mm_items: Iterable[MultimodalInput] = (),
        arrival_time: float | None = None,
        deadline_s: float | None = None,
        kv_export: bool = False,
    ) -> Request:
        """A request from any iterables (lists from a caller become tuples)."""
        return cls(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop_token_ids=frozenset(stop_token_ids),
            media=tuple(media),
            mm_items=tuple(mm_items),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            deadline_s=deadline_s,
            kv_export=kv_export,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


# What a step yields per sequence: a token, None (a prefill chunk short of the end), or the tokens a
# verify step accepted (speculative decoding, ``serving.speculative``).
Sampled = int | list[int] | None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and reset to recompute)
    RUNNING = "running"  # holds KV pages and is scheduled every step
    FINISHED = "finished"  # stopped normally; pages released
    ABORTED = "aborted"  # cancelled by the client or the engine; pages released


class Sequence:
    """The scheduler's state of one request: a reference to the frozen ``Request`` and what
    scheduling moves. Identity semantics: two sequences are never equal (hashable by identity)."""

    request: Request
    output_ids: list[int]
    status: SequenceStatus
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at the last admission
    num_preemptions: int
    # Leading tokens whose KV a later prompt with the same cache keys would compute identically
    # (None: all). The model's position scheme lowers it when generated tokens sit at positions a
    # prompt would not give them (``positions.MRopePositions``); only that much enters the cache.
    cacheable_tokens: int | None

    def __init__(
        self,
        seq_id: RequestId,
        prompt_ids: Iterable[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 16,
        stop_token_ids: Iterable[int] = (),
        media: Iterable[MediaSpan] = (),
        mm_items: Iterable[MultimodalInput] = (),
        arrival_time: float | None = None,
    ) -> None:
        """A sequence of a request built from these fields (``Sequence.of`` takes a ``Request``)."""
        self._start(
            Request.create(
                seq_id, prompt_ids, sampling, max_new_tokens, stop_token_ids, media, mm_items, arrival_time
            )
        )

    @classmethod
    def of(cls, request: Request) -> Sequence:
        """The scheduler's state for ``request``, nothing computed yet."""
        seq = cls.__new__(cls)
        seq._start(request)
        return seq

    def _start(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"sequence {request.request_id!r}: empty prompt")
        self.request = request
        # a list copy: token_ids concatenates it with output_ids every step
        self._prompt_list = list(request.prompt_ids)
        self._prompt_keys = build_cache_keys(self._prompt_list, request.media)
        self.output_ids = []
        self.status = SequenceStatus.WAITING
        self.finish_reason = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.cacheable_tokens = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.num_prompt_tokens} prompt + {len(self.output_ids)} output tokens,"
            f" {self.num_computed_tokens} computed, {self.status.value})"
        )

    # ---- the request's fields (read-only) ------------------------------------------------------

    @property
    def seq_id(self) -> RequestId:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt (a list view of ``request.prompt_ids``; never written)."""
        return self._prompt_list

    @property
    def sampling(self) -> SamplingParams | None:
        return self.request.sampling

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids

    @property
    def media(self) -> tuple[MediaSpan, ...]:
        return self.request.media

    @property
    def mm_items(self) -> tuple[MultimodalInput, ...]:
        return self.request.mm_items

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def kv_export(self) -> bool:
        return self.request.kv_export

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (a decode step needs one id)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def cache_keys(self) -> list[int]:
        return self._prompt_keys + self.output_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the one decode input token is left to compute (prompt, or recompute after preemption)."""
        # num_uncomputed_tokens > 1, spelled out: the scheduler asks for every sequence every step
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)
