"""ModelRunner.prepare: the decode path (one token per sequence, page tables kept across steps) and
the packed path's array-built positions give what the per-sequence definitions give.

The reference for every step is built here from the definitions, sharing no code with the runner:
token ``i`` of a sequence at ``positions(seq, i, i + 1)`` of its scheme, its write slots
``SeqKV.full_slot`` / ``swa_slot``, its page-table rows (one table per KV group) the sequence's page lists padded with
NOT_RESIDENT, ``cu_seqlens_q`` the running sum of the new-token counts.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from epd_common.messages.cache_keys import MediaSpan, media_spans
from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.page_map import GroupPageMap
from llm_core.caches.page_pool import PagePool
from llm_core.caches.seq_kv import NOT_RESIDENT
from llm_core.models.positions import LinearPositions, MRopePositions, PositionScheme
from llm_core.request import Sequence
from llm_core.serving.model_runner import ModelRunner, StepInputs
from llm_core.serving.sampling import Sampler

P = 4  # page size
MERGE, TPS = 2, 2
IMAGE = 90


HIDDEN = 8


def make_runner(scheme: PositionScheme | None = None) -> ModelRunner:
    """A runner whose ``prepare`` can run: it reads the page size, the page map (here a pool per
    group: the tables are the groups'), the position scheme and, for media, the model's token
    embeddings (zeros here)."""
    kv: Any = SimpleNamespace(page_size=P, page_map=GroupPageMap((0, 1)))
    model: Any = SimpleNamespace(embed=lambda ids: torch.zeros(ids.shape[0], HIDDEN))
    return ModelRunner(model, kv, Sampler(0), positions=scheme)


def make_manager(window: int) -> KVManager:
    return KVManager(
        [
            FullAttentionManager(PagePool(512, P, "full")),
            SlidingWindowManager(PagePool(512, P, "swa"), window),
        ]
    )


def image_sequence(seq_id: str, text_before: int, text_after: int, grid: tuple[int, int, int]) -> Sequence:
    """A prompt with one image run (M-RoPE grid ``grid``), whose generated tokens sit at offsets."""
    n = grid[0] * (grid[1] // MERGE) * (grid[2] // MERGE)
    ids = [5 + i for i in range(text_before)] + [IMAGE] * n + [7] * text_after
    ref = SimpleNamespace(grid_thw=(grid,), modality="image", seconds_per_grid_t=None)
    item = SimpleNamespace(ref=ref, embedding=torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN))
    return Sequence(seq_id, ids, media=[MediaSpan(text_before, n, f"img-{seq_id}")], mm_items=[item])


def reference(
    scheme: PositionScheme, kv: KVManager, seqs: list[Sequence], counts: list[int]
) -> dict[str, Any]:
    """The step's inputs from the definitions (see the module docstring)."""
    ids, pos, full_slots, swa_slots, lens, cu = [], [], [], [], [], [0]
    width = max(1, max(len(kv.of(s).pages[0]) for s in seqs))
    for s, n in zip(seqs, counts, strict=True):
        start = s.num_computed_tokens
        for i in range(start, start + n):
            ids.append(s.token_ids[i])
            pos.append(scheme.positions(s, i, i + 1)[:, 0].tolist())
            full_slots.append(kv.of(s).pages[0][i // P] * P + i % P)
            swa_slots.append(kv.of(s).pages[1][i // P] * P + i % P)
        lens.append(start + n)
        cu.append(cu[-1] + n)
    positions = torch.tensor(pos).t()  # [dims, T]
    return {
        "input_ids": ids,
        "positions": (positions[0] if scheme.dims == 1 else positions).tolist(),
        "full_slots": full_slots,
        "swa_slots": swa_slots,
        "seq_lens": lens,
        "cu_seqlens_q": cu,
        "full_page_table": [
            kv.of(s).pages[0] + [NOT_RESIDENT] * (width - len(kv.of(s).pages[0])) for s in seqs
        ],
        "swa_page_table": [
            kv.of(s).pages[1] + [NOT_RESIDENT] * (width - len(kv.of(s).pages[1])) for s in seqs
        ],
    }


def check_inputs(inp: StepInputs, want: dict[str, Any], seqs: list[Sequence], counts: list[int]) -> None:
    b = inp.batch
    got = {
        "input_ids": inp.input_ids.tolist(),
        "positions": inp.positions.tolist(),
        "full_slots": b.slots[0].tolist(),
        "swa_slots": b.slots[1].tolist(),
        "seq_lens": b.seq_lens.tolist(),
        "cu_seqlens_q": b.cu_seqlens_q.tolist(),
        "full_page_table": b.page_tables[0].tolist(),
        "swa_page_table": b.page_tables[1].tolist(),
    }
    assert got == want
    assert b.slots[0].dtype == b.slots[1].dtype == inp.input_ids.dtype == inp.positions.dtype == torch.int64
    assert b.page_tables[0].dtype == b.seq_lens.dtype == b.cu_seqlens_q.dtype == torch.int32
    assert b.max_seqlen_q == max(counts)
    ends = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts, strict=True)]
    assert inp.sample_seqs == [i for i, e in enumerate(ends) if e]
    assert inp.sample_rows.tolist() == [sum(counts[: i + 1]) - 1 for i in inp.sample_seqs]


def snapshot(inp: StepInputs) -> list[list[Any]]:
    b = inp.batch
    tensors = (inp.input_ids, inp.positions, *b.slots, *b.page_tables)
    return [t.tolist() for t in tensors]


def prefill(kv: KVManager, seqs: list[Sequence], whole: bool = True) -> None:
    """KV for each whole prompt and its first sampled token appended (the next step decodes that
    one), or (``whole=False``) KV for all but the prompt's last token."""
    for s in seqs:
        kv.match_prefix(s)
        n = s.num_tokens - (0 if whole else 1)
        assert kv.allocate(s, n)
        kv.commit(s, n)
        if whole:
            s.output_ids.append(3)


@pytest.mark.parametrize("scheme_name", ["linear", "mrope"])
def test_decode_steps_equal_the_definitions(scheme_name: str) -> None:
    """Forty decode steps of sequences that cross page boundaries at different steps, drop SWA pages
    (window 6) and leave or join the batch: the decode path's inputs equal the reference every step,
    and a step's tensors stay what they were after later steps patch the kept tables."""
    scheme: PositionScheme = LinearPositions() if scheme_name == "linear" else MRopePositions(MERGE, TPS)
    runner = make_runner(scheme)
    kv = make_manager(window=6)
    rng = random.Random(0)
    seqs = [Sequence(f"text{i}", [rng.randrange(50) for _ in range(3 + 5 * i)]) for i in range(3)]
    if scheme_name == "mrope":  # generated tokens at offsets != 0 (the image spans more rows than columns)
        seqs += [image_sequence("img0", 2, 3, (1, 8, 4)), image_sequence("img1", 5, 1, (1, 4, 12))]
    prefill(kv, seqs)
    kept: list[tuple[StepInputs, list[list[Any]]]] = []
    for step in range(40):
        if step == 12:  # the longest leaves the batch (the tables narrow), a short one joins it
            kv.release(seqs.pop(max(range(len(seqs)), key=lambda i: seqs[i].num_tokens)))
            late = Sequence("late", [rng.randrange(50) for _ in range(9)])
            prefill(kv, [late])
            seqs.append(late)
        for s in seqs:
            assert kv.allocate(s, 1)
        counts = [1] * len(seqs)
        assert (
            runner._prepare_decode(seqs, [kv.rows(s) for s in seqs]) is not None
        )  # the decode path serves these steps
        inp = runner.prepare(seqs, counts, [kv.rows(s) for s in seqs])
        check_inputs(inp, reference(scheme, kv, seqs, counts), seqs, counts)
        kept.append((inp, snapshot(inp)))
        for s in seqs:
            kv.commit(s, 1)
            s.output_ids.append(rng.randrange(50))
    assert any(p == NOT_RESIDENT for s in seqs for p in kv.of(s).pages[1])  # the window did drop pages
    for inp, snap in kept:
        assert snapshot(inp) == snap


def test_decode_path_declines_what_it_does_not_cover() -> None:
    """A one-token prefill chunk (not the sequence's last token) and the last prompt token of a
    prompt with media go through the packed path, with the same inputs as the definitions."""
    scheme = MRopePositions(MERGE, TPS)
    runner = make_runner(scheme)
    kv = make_manager(window=64)
    chunked = Sequence("chunked", list(range(10, 20)))
    media = image_sequence("media", 2, 2, (1, 4, 4))
    decoding = Sequence("decoding", list(range(30, 36)))
    prefill(kv, [media], whole=False)
    prefill(kv, [decoding])
    kv.match_prefix(chunked)
    assert kv.allocate(chunked, 4)
    kv.commit(chunked, 4)
    for seqs in ([chunked, decoding], [media, decoding]):
        for s in seqs:
            assert kv.allocate(s, 1)
        counts = [1] * len(seqs)
        assert runner._prepare_decode(seqs, [kv.rows(s) for s in seqs]) is None
        check_inputs(
            runner.prepare(seqs, counts, [kv.rows(s) for s in seqs]),
            reference(scheme, kv, seqs, counts),
            seqs,
            counts,
        )


@pytest.mark.parametrize("with_media_chunk", [False, True])
def test_packed_step_equals_the_definitions(with_media_chunk: bool) -> None:
    """A mixed step: prefill chunks that start mid-page and span pages, decode tokens of prompts
    with and without media; with a chunk inside a media prompt (no offsets there) as well."""
    scheme = MRopePositions(MERGE, TPS)
    runner = make_runner(scheme)
    kv = make_manager(window=64)
    text = Sequence("text", list(range(40, 63)))
    media_done = image_sequence("media_done", 3, 2, (1, 8, 4))
    decoding = Sequence("decoding", list(range(10, 17)))
    prefill(kv, [media_done, decoding])
    kv.match_prefix(text)
    assert kv.allocate(text, 5)
    kv.commit(text, 5)
    seqs, counts = [text, media_done, decoding], [11, 1, 1]
    if with_media_chunk:
        media_chunk = image_sequence("media_chunk", 1, 4, (1, 4, 8))
        kv.match_prefix(media_chunk)
        assert kv.allocate(media_chunk, 2)
        kv.commit(media_chunk, 2)
        seqs, counts = [*seqs, media_chunk], [*counts, 6]
    for s, n in zip(seqs, counts, strict=True):
        assert kv.allocate(s, n)
    inp = runner._prepare_packed(seqs, counts, [kv.rows(s) for s in seqs])
    check_inputs(inp, reference(scheme, kv, seqs, counts), seqs, counts)
    if with_media_chunk:  # its chunk (positions 2..7) lies inside the image run (1..8): rows 1..6
        assert inp.input_embeds is not None
        assert torch.equal(inp.input_embeds[-6:], media_chunk.mm_items[0].embedding[1:7])
        assert not inp.input_embeds[:-6].any()
    else:
        assert inp.input_embeds is None


def test_media_rows_follow_their_runs_across_chunks() -> None:
    """A video over two pad runs (MiMo-V2.5's layout: a timestamp between them): each run gets the
    item's next rows, also when a chunk boundary cuts a run."""
    video = 91
    ids = [1, video, video, 2, 3, video, video, 4]
    emb = torch.arange(4 * HIDDEN, dtype=torch.float32).view(4, HIDDEN) + 1.0
    item = SimpleNamespace(ref=SimpleNamespace(modality="video"), embedding=emb)
    spans = media_spans(ids, [video], [("v", 4)])
    runner = make_runner(LinearPositions())
    expected = torch.zeros(len(ids), HIDDEN)
    expected[[1, 2, 5, 6]] = emb
    for cut in (len(ids), 2, 6):  # one step, and two chunks cutting the first or the second run
        seq = Sequence("v", ids, media=spans, mm_items=[item])
        got = []
        for lo, hi in ((0, cut), (cut, len(ids))):
            if lo == hi:
                continue
            seq.num_computed_tokens = lo
            got.append(runner._media_embeds([seq], [hi - lo], torch.tensor(ids[lo:hi])))
        assert torch.equal(torch.cat(got), expected), cut
