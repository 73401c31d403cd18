"""The speculator's per-request state, keyed by request id (``speculative.py``).

The speculator writes it after each step (``Speculator.extend``); the scheduler reads how many
drafts a sequence has and cuts them to what a step verifies, and resets a request's state where
its MTP KV must be recomputed (admission, preemption); the runner reads the drafts it packs and
verifies. None of it lives on the scheduler's ``Sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from llm_core.request import RequestId


@dataclass(eq=False)
class DraftState:
    """One request's speculation: ``draft_ids``, the tokens the MTP heads propose after the last
    known token (verified by the next step), and for a sampled request ``draft_probs`` [V] each,
    the distribution each was drawn from; ``mtp_start``, the first position whose MTP KV is not yet
    computed from known tokens (every MTP layer recomputes from there); ``mtp_h0`` [rows, hidden],
    the target's hidden states at positions ``mtp_start`` .. of the rows computed before this step
    (the MTP layers' input there)."""

    draft_ids: list[int] = field(default_factory=list)
    draft_probs: list[Tensor] = field(default_factory=list)
    mtp_start: int = 0
    mtp_h0: Tensor | None = None


class DraftStates:
    """Every running request's ``DraftState``, by request id (made on first use)."""

    def __init__(self) -> None:
        self._by_id: dict[RequestId, DraftState] = {}

    def of(self, request_id: RequestId) -> DraftState:
        state = self._by_id.get(request_id)
        if state is None:
            state = self._by_id[request_id] = DraftState()
        return state

    def drafts(self, request_id: RequestId) -> list[int]:
        """The request's drafts ([] when it has none)."""
        state = self._by_id.get(request_id)
        return state.draft_ids if state is not None else []

    def keep(self, request_id: RequestId, n: int) -> None:
        """Keep the first ``n`` drafts (what this step verifies)."""
        state = self._by_id.get(request_id)
        if state is not None and n < len(state.draft_ids):
            state.draft_ids, state.draft_probs = state.draft_ids[:n], state.draft_probs[:n]

    def reset(self, request_id: RequestId, start: int) -> None:
        """Forget drafts and MTP state: the heads' KV is recomputed from ``start`` on (admission
        with a prefix hit, preemption, a range whose KV was copied in)."""
        self._by_id[request_id] = DraftState(mtp_start=start)

    def release(self, request_id: RequestId) -> None:
        self._by_id.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_id)
