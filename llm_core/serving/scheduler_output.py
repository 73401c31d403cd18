"""What one scheduled step hands the model runner: the runner's only input.

The scheduler builds a ``SchedulerOutput`` once its pages are allocated; the runner reads it and
nothing else of the scheduler or the KV manager (it reads the scheduled sequences' tokens and
progress, which it never changes)."""

from __future__ import annotations

from dataclasses import dataclass

from llm_core.caches.kv_transfers import KVTransfers
from llm_core.request import Sequence
from llm_core.serving.kv_copy import CopyPlan, plan_copies


@dataclass(frozen=True, eq=False)
class SchedulerOutput:
    """One step: compute tokens [num_computed, num_computed + num_new_tokens[b]) of ``seqs[b]``.

    ``page_rows[b]``: the page row per KV group of ``seqs[b]`` (``KVManager.rows``) the step's
    page tables and write slots are built from, its pages for the new tokens allocated.
    ``copies``: the KV copied in rather than computed this step (``kv_copy.plan_copies``: which
    chunks copy, which compute, the copies to run before or beside the forward); None when no
    chunk copies. The lists are the scheduler's and are not changed once the output is built.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    page_rows: list[list[list[int]]]
    copies: CopyPlan | None = None

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        page_rows: list[list[list[int]]],
        transfers: KVTransfers | None = None,
    ) -> SchedulerOutput:
        """The output of a step whose pages are allocated (copies planned where a chunk copies
        from a source in ``transfers``)."""
        copies = None
        if transfers is not None and len(transfers) and any(transfers.copying(s) for s in seqs):
            copies = plan_copies(seqs, num_new_tokens, page_rows, transfers)
        return cls(seqs, num_new_tokens, page_rows, copies)
