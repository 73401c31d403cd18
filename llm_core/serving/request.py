"""The request record: what a client asked for, built once by the engine and never changed.

``Request`` holds the prompt, the sampling parameters, the media and the deadline; the scheduler's
per-request state (``sequence.Sequence``) holds a reference to it and only what scheduling moves
(progress, output tokens, status). What other subsystems keep per request (the speculator's drafts,
the KV connectors' copies, the runner's generators) lives with them, keyed by ``request_id``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from epd_common.messages.cache_keys import MediaSpan
from epd_common.messages.embedding_ref import EmbeddingRef
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
