"""Decode mirrors (dense per-batch KV for CPU decode) against the paged gather path they replace.

Pools are poisoned with NaN (tests.llm_core.test_model.make_kv), so a mirror column that was never
written, or a stale one that is not masked, shows up as NaN or a large error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llm_core import decode_mirror
from llm_core.checkpoint import LoadedLLM
from llm_core.decode_mirror import DecodeStep, _continues
from tests.llm_core.test_model import PagedSeq, free_lists, make_kv, prompt, step


def test_mirror_steps_equal_gather_steps(loaded: LoadedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences decode together past the window (the SWA ring wraps) and past the full
    capacity (it grows); one leaves halfway (rebuild). Every step equals the gather path."""
    monkeypatch.setattr(decode_mirror, "GROW", 8)
    rebuilds: list[int] = []
    real_rebuild = decode_mirror._rebuild

    def counting_rebuild(*args: Any) -> Any:
        rebuilds.append(1)
        return real_rebuild(*args)

    monkeypatch.setattr(decode_mirror, "_rebuild", counting_rebuild)
    model = loaded.model
    kv = make_kv(loaded.config, 40)
    full_free, swa_free = free_lists(40, 9)
    seqs = [PagedSeq(full_free, swa_free) for _ in range(3)]
    ids = [prompt(60, seed=20 + i) for i in range(3)]
    starts = [5, 12, 3]
    step(model, kv, seqs, [ids[i][: starts[i]] for i in range(3)])  # prefill
    gather_path: Any = lambda *args: None  # noqa: E731  (the model then gathers from the pools)
    live = [0, 1, 2]
    for t in range(30):
        if t == 15:
            live = [0, 2]  # sequence 1 finishes: the next step is a different batch
        chunks = [ids[i][starts[i] + t : starts[i] + t + 1] for i in live]
        mirrored = step(model, kv, [seqs[i] for i in live], chunks)
        assert not mirrored.isnan().any(), t
        for i in live:  # the same step again through the gather path (rewrites identical KV)
            seqs[i].len -= 1
        with monkeypatch.context() as m:
            m.setattr(model, "_mirror_for", gather_path)
            gathered = step(model, kv, [seqs[i] for i in live], chunks)
        torch.testing.assert_close(mirrored, gathered, rtol=1e-5, atol=1e-5)
    mirror = model._mirrors[kv]
    assert max(lm.k.shape[2] for lm in mirror._layers.values()) > 8  # the full capacity grew
    # Rebuilt on the first decode step, after the batch changed and when a full layer outgrew its
    # columns (every 8 positions here); every other step only wrote one column per layer.
    layers = loaded.config.num_hidden_layers
    assert layers * 2 <= len(rebuilds) <= layers * 2 + 2 * 6


def test_continues_only_for_the_same_sequences_one_token_on() -> None:
    page = 4
    prev = DecodeStep(torch.tensor([5, 9]), torch.tensor([[3, 7, 0], [1, 2, 6]], dtype=torch.int32), page)
    nxt = DecodeStep(torch.tensor([6, 10]), torch.tensor([[3, 7, 0], [1, 2, 6]], dtype=torch.int32), page)
    assert _continues(prev, nxt)
    # sequence 0 crossed into a new page: its padding entry became a real page
    crossed = DecodeStep(torch.tensor([6, 10]), torch.tensor([[3, 7, 8], [1, 2, 6]], dtype=torch.int32), page)
    assert _continues(prev, crossed)
    moved = DecodeStep(torch.tensor([6, 10]), torch.tensor([[3, 5, 0], [1, 2, 6]], dtype=torch.int32), page)
    assert not _continues(prev, moved)  # a page holding an earlier token changed: other sequence
    assert not _continues(prev, DecodeStep(torch.tensor([6, 9]), nxt.full_table, page))  # no step
    assert not _continues(prev, DecodeStep(torch.tensor([6]), nxt.full_table[:1], page))  # batch changed
    swapped = DecodeStep(torch.tensor([10, 6]), nxt.full_table.flip(0), page)
    assert not _continues(prev, swapped)  # same sequences, other order
