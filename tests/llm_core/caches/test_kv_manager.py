"""KV manager: allocation over both pools, SWA window release, prefix reuse, eviction, integrity.

A shadow "KV content" map stands in for the tensors: when a sequence computes position ``pos`` it
writes the identity of that KV (the prefix of cache keys it depends on) into the slot of its full
page and of its SWA page. Any later reader of a slot must see the KV it expects; if a locked
page had been evicted and handed to someone else, the check fails.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_common.messages.cache_keys import MediaSpan
from llm_core.caches.kv_blocks import GroupBlocks
from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_groups import window_pages
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.page_pool import PagePool
from llm_core.caches.seq_kv import NOT_RESIDENT
from llm_core.request import Sequence
from llm_core.serving.page_tables import build_page_tables

P = 4


class Shadow:
    """Slot -> identity of the KV written there, for both pools."""

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.full: dict[int, tuple[int, ...]] = {}
        self.swa: dict[int, tuple[int, ...]] = {}

    def write(self, seq: Sequence, n: int) -> None:
        keys = seq.cache_keys
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ident = tuple(keys[: pos + 1])
            self.full[self.kv.of(seq).pages[0][pos // P] * P + pos % P] = ident
            self.swa[self.kv.of(seq).pages[1][pos // P] * P + pos % P] = ident

    def check(self, seq: Sequence) -> None:
        keys = seq.cache_keys
        lo = self.kv.windows[0].first_live_page(seq.num_computed_tokens) * P
        for pos in range(seq.num_computed_tokens):
            ident = tuple(keys[: pos + 1])
            assert self.full.get(self.kv.of(seq).pages[0][pos // P] * P + pos % P) == ident, (
                f"full KV of {seq.seq_id}@{pos} lost"
            )
            if pos >= lo:
                assert self.swa.get(self.kv.of(seq).pages[1][pos // P] * P + pos % P) == ident, (
                    f"SWA KV of {seq.seq_id}@{pos} lost"
                )


def make_manager(
    full_pages: int, swa_pages: int, window: int, window_aware: bool = True, swa_blocks: int = 0
) -> KVManager:
    """A pool per group; or with ``swa_blocks`` (what an SWA page costs), one shared block pool
    of the same bytes (a full page one block) from which both groups take their pages."""
    if not swa_blocks:
        return KVManager(
            [
                FullAttentionManager(PagePool(full_pages, P, "full")),
                SlidingWindowManager(PagePool(swa_pages, P, "swa"), window),
            ],
            window_aware=window_aware,
        )
    blocks = PagePool(full_pages + swa_blocks * swa_pages, P, "blocks")
    return KVManager(
        [
            FullAttentionManager(GroupBlocks(blocks, 1, "full")),
            SlidingWindowManager(GroupBlocks(blocks, swa_blocks, "swa"), window),
        ],
        window_aware=window_aware,
    )


def run_step(kv: KVManager, shadow: Shadow, seq: Sequence, n: int) -> bool:
    if not kv.allocate(seq, n):
        return False
    shadow.write(seq, n)
    kv.commit(seq, n)
    if seq.num_computed_tokens == seq.num_tokens:
        seq.output_ids.append(7)  # the sampled token becomes the next decode input
    return True


def test_swa_pages_stay_within_window_during_decode() -> None:
    window = 9
    kv = make_manager(64, 64, window)
    shadow = Shadow(kv)
    seq = Sequence(0, list(range(30)))
    kv.match_prefix(seq)
    for chunk in (5, 3, 11, 11):  # chunked prefill; chunks smaller and larger than the window
        assert run_step(kv, shadow, seq, chunk)
        shadow.check(seq)
    for _ in range(40):
        assert run_step(kv, shadow, seq, 1)
        st = kv.of(seq)
        resident = sum(1 for p in st.pages[1] if p != NOT_RESIDENT)
        # the moving window, plus the window kept at the prompt's end (``pin_prompt_end``)
        pinned = sum(hi - lo for lo, hi in kv.windows[0].pinned_pages(st.pin_ends))
        assert st.prompt_pin == 28 and pinned == 2  # pages [(28 - 8) // 4, 28 // 4)
        assert resident <= window_pages(window, P) + pinned
        assert kv.groups[1].pool.num_used == resident
        assert kv.full_pool.num_used * P >= seq.num_computed_tokens
        shadow.check(seq)
        kv.check_integrity([seq])
    kv.release(seq)
    kv.check_integrity([])
    # full KV only before the prompt-end window and between it and the last window: two tombstones
    assert kv.radix is not None and kv.radix.num_tombstones() == 2


def test_prefix_hit_reuses_pages_and_skips_compute() -> None:
    kv = make_manager(64, 64, window=9)
    shadow = Shadow(kv)
    a = Sequence("a", list(range(40)))
    kv.match_prefix(a)
    assert run_step(kv, shadow, a, 40)
    kv.release(a)
    b = Sequence("b", [*range(40), 99, 98])
    assert kv.match_prefix(b) == 40
    shadow.check(b)  # borrowed pages hold exactly the KV b needs
    used = kv.full_pool.num_used
    assert run_step(kv, shadow, b, 2)
    assert kv.full_pool.num_used == used + 1  # only the new page
    kv.check_integrity([b])
    # A request for exactly the cached prompt must leave one token to compute (its logits), so it
    # can only resume at 36: a kept the window before 36 while it went on (``pin_prompt_end``),
    # which made the tree learn that hit.
    c = Sequence("c", list(range(40)))
    assert kv.match_prefix(c) == 36
    kv.check_integrity([b, c])
    kv.release(b)
    kv.release(c)
    kv.check_integrity([])


def test_media_with_different_keys_never_share_a_prefix() -> None:
    kv = make_manager(64, 64, window=17)  # the whole prompt stays in the window
    shadow = Shadow(kv)
    prompt = [1, 2, 3, 4] + [261] * 8 + [5, 6, 7, 8]
    a = Sequence("a", prompt, media=[MediaSpan(4, 8, "cat")])
    kv.match_prefix(a)
    assert run_step(kv, shadow, a, len(prompt))
    kv.release(a)
    same = Sequence("same", [*prompt, 9], media=[MediaSpan(4, 8, "cat")])
    other = Sequence("other", [*prompt, 9], media=[MediaSpan(4, 8, "dog")])
    assert kv.match_prefix(same) == 16
    assert kv.match_prefix(other) == 4  # only the text before the image
    kv.check_integrity([same, other])


def test_eviction_makes_room_and_failure_takes_nothing() -> None:
    kv = make_manager(12, 12, window=9)
    shadow = Shadow(kv)
    for i in range(3):
        s = Sequence(i, [i * 100 + t for t in range(16)])
        kv.match_prefix(s)
        assert run_step(kv, shadow, s, 16)
        kv.release(s)
    assert kv.full_pool.num_free == 0  # the cache holds everything
    big = Sequence("big", list(range(500, 540)))
    kv.match_prefix(big)
    assert kv.allocate(big, 40) is True  # evicted cached prefixes to make room
    shadow.write(big, 40)
    kv.commit(big, 40)
    huge = Sequence("huge", list(range(900, 920)))
    kv.match_prefix(huge)
    before = (kv.full_pool.num_free, kv.groups[1].pool.num_free)
    assert kv.allocate(huge, 20) is False
    assert (kv.full_pool.num_free, kv.groups[1].pool.num_free) == before
    kv.check_integrity([big, huge])


def test_swa_unaware_mode_keeps_every_swa_page() -> None:
    kv = make_manager(64, 64, window=9, window_aware=False)
    shadow = Shadow(kv)
    seq = Sequence(0, list(range(30)))
    kv.match_prefix(seq)
    assert run_step(kv, shadow, seq, 30)
    for _ in range(10):
        assert run_step(kv, shadow, seq, 1)
    assert kv.groups[1].pool.num_used == kv.full_pool.num_used
    kv.release(seq)
    assert kv.radix is not None and kv.radix.num_tombstones() == 0
    kv.check_integrity([])


# ---- random workloads --------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["new", "new", "step", "step", "step", "step", "finish", "preempt", "evict_swa", "evict_full"]
        ),
        st.integers(0, 1 << 30),
    ),
    min_size=30,
    max_size=80,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    window=st.sampled_from([1, 3, 5, 9, 16]),
    pages=st.integers(6, 30),
    swa_pages=st.integers(0, 24),
    window_aware=st.booleans(),
    swa_blocks=st.sampled_from([0, 1, 3]),
)
def test_random_workload_keeps_integrity_and_never_loses_locked_kv(
    ops: list[tuple[str, int]], window: int, pages: int, swa_pages: int, window_aware: bool, swa_blocks: int
) -> None:
    # SWA pools from barely one window (pressure, tombstones) to roomy (branch-point pins); a pool
    # per group, or one shared block pool (swa_blocks > 0) where either group can run the other short.
    kv = make_manager(pages, window_pages(window, P) + 2 + swa_pages, window, window_aware, swa_blocks)
    shadow = Shadow(kv)
    running: list[Sequence] = []
    history: list[list[int]] = []
    bases = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
    next_id = 0
    for op, r in ops:
        rng = random.Random(r)
        if op == "new" and len(running) < 4:
            if history and rng.random() < 0.5:  # the next turn of an earlier conversation
                prompt = rng.choice(history) + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
            else:
                prompt = rng.choice(bases) * rng.randint(1, 3) + [
                    rng.randint(0, 3) for _ in range(rng.randint(1, 9))
                ]
            seq = Sequence(next_id, prompt)
            next_id += 1
            kv.match_prefix(seq)
            shadow.check(seq)  # a hit hands out exactly the KV this prompt needs
            running.append(seq)
        elif op == "step" and running:
            seq = rng.choice(running)
            n = 1
            if seq.in_prefill:  # whole prompt or a random chunk
                n = (
                    seq.num_uncomputed_tokens
                    if rng.random() < 0.5
                    else rng.randint(1, seq.num_uncomputed_tokens)
                )
            if not run_step(kv, shadow, seq, n):
                # Out of KV: preempt by recompute, as the scheduler does.
                running.remove(seq)
                kv.release(seq)
                seq.num_computed_tokens = 0
        elif op in ("finish", "preempt") and running:
            seq = running.pop(rng.randrange(len(running)))
            kv.release(seq, cache=op == "finish" or rng.random() < 0.5)
            if op == "finish" and len(seq.token_ids) < 40:
                history.append(seq.token_ids)
        elif op == "evict_swa" and kv.radix is not None:
            kv.radix.evict_window(rng.randint(1, 4), 1)
        elif op == "evict_full" and kv.radix is not None:
            kv.radix.evict_full(rng.randint(1, 4))
        kv.check_integrity(running)
        for seq in running:
            shadow.check(seq)
    for seq in running:
        kv.release(seq)
    kv.check_integrity([])
    assert kv.radix is not None
    kv.radix.evict_full(1 << 30)
    assert kv.full_pool.num_used == 0 and kv.groups[1].pool.num_used == 0


def test_page_tables_follow_attention_batch_semantics() -> None:
    window = 9
    kv = make_manager(64, 64, window)
    shadow = Shadow(kv)
    long, short = Sequence("long", list(range(37))), Sequence("short", [5, 6, 7])
    for s in (long, short):
        kv.match_prefix(s)
        assert run_step(kv, shadow, s, s.num_tokens)
    for s in (long, short):
        assert kv.allocate(s, 1)
    tables = build_page_tables([long, short], [kv.rows(long), kv.rows(short)], [1, 1], P)
    lng, sht = kv.of(long), kv.of(short)
    assert tables.page_tables[0].dtype == torch.int32 and tables.page_tables[0].shape == (2, 10)
    assert tables.page_tables[0][0].tolist() == lng.pages[0]
    assert tables.page_tables[0][1, :1].tolist() == sht.pages[0]
    swa_row = tables.page_tables[1][0].tolist()
    # Position 37 reads keys [29, 37]: logical pages 7..9 are resident, everything before is not.
    assert all(p == NOT_RESIDENT for p in swa_row[:7]) and all(p != NOT_RESIDENT for p in swa_row[7:10])
    assert tables.page_tables[1][1, 1:].tolist() == [NOT_RESIDENT] * 9  # padding of the short row
    assert tables.slots[0].tolist() == [lng.pages[0][9] * P + 1, sht.pages[0][0] * P + 3]
    assert tables.slots[1].tolist() == [lng.pages[1][9] * P + 1, sht.pages[1][0] * P + 3]
    assert tables.slots[0].dtype == torch.int64


def test_page_table_slots_of_chunks_across_pages() -> None:
    """Write slots of chunks that start mid-page and span several pages equal the per-position
    definition (``SeqKV.full_slot`` / ``swa_slot``)."""
    kv = make_manager(64, 64, 64)
    shadow = Shadow(kv)
    a, b = Sequence("a", list(range(23))), Sequence("b", list(range(100, 111)))
    for s, first in ((a, 6), (b, 2)):
        kv.match_prefix(s)
        assert run_step(kv, shadow, s, first)  # computed up to mid-page
    counts = [a.num_tokens - a.num_computed_tokens, b.num_tokens - b.num_computed_tokens]
    for s, n in zip((a, b), counts, strict=True):
        assert kv.allocate(s, n)
    tables = build_page_tables([a, b], [kv.rows(a), kv.rows(b)], counts, P)
    want_full, want_swa = [], []
    for s, n in zip((a, b), counts, strict=True):
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
            want_full.append(kv.of(s).pages[0][pos // P] * P + pos % P)
            want_swa.append(kv.of(s).pages[1][pos // P] * P + pos % P)
    assert tables.slots[0].tolist() == want_full and tables.slots[1].tolist() == want_swa
    assert tables.slots[0].dtype == tables.slots[1].dtype == torch.int64
    a_full, b_full = kv.of(a).pages[0], kv.of(b).pages[0]
    assert tables.page_tables[0].shape == (2, len(a_full))
    assert tables.page_tables[0][1].tolist() == b_full + [NOT_RESIDENT] * (len(a_full) - len(b_full))


def test_branch_point_window_is_pinned_and_heals_the_tree() -> None:
    window = 9  # 2 pages of SWA before a boundary
    kv = make_manager(64, 64, window)
    shadow = Shadow(kv)
    system = list(range(100, 112))  # 3 pages shared by every request

    def serve(name: str, tail: list[int]) -> int:
        s = Sequence(name, system + tail)
        hit = kv.match_prefix(s)
        while s.in_prefill:
            assert run_step(kv, shadow, s, min(3, s.num_uncomputed_tokens))  # chunks move past the branch
            kv.check_integrity([s])
        kv.release(s)
        kv.check_integrity([])
        return hit

    assert serve("a", list(range(12))) == 0
    # a moved past the end of the system prompt: its window there is gone, so b cannot resume at 12.
    assert serve("b", list(range(50, 62))) == 0
    # b recomputed the system prompt and kept the window before the branch point: c hits it.
    assert serve("c", list(range(70, 82))) == 12
    assert kv.radix is not None and kv.radix.num_tombstones() >= 1


def test_pin_is_dropped_when_the_pool_is_tight() -> None:
    window = 9
    kv = make_manager(64, 12, window)  # 12 SWA pages: 4 windows, the least that allows pinning
    shadow = Shadow(kv)
    a = Sequence("a", list(range(24)))
    kv.match_prefix(a)
    assert run_step(kv, shadow, a, 24)
    kv.release(a)
    b = Sequence("b", [*range(12), *range(50, 100)])
    assert kv.match_prefix(b) == 0
    assert kv.of(b).pin_end == 12  # full KV matched 3 pages, but their window is gone
    while b.num_computed_tokens < 20:
        assert run_step(kv, shadow, b, 1)
    assert all(p != NOT_RESIDENT for p in kv.of(b).pages[1][1:3])  # the pinned window before 12
    # 40 more tokens need 10 new SWA pages; 5 are free and a's 3 cached ones can be evicted:
    # only with the pin's 2 pages back does it fit.
    assert kv.pages_needed(b, 40).per_group[1] == 10 and kv.groups[1].pool.num_free == 5
    assert kv.radix is not None and kv.radix.evictable_window_pages(1) == 3
    assert run_step(kv, shadow, b, 40)
    assert kv.of(b).pin_end == 0 and kv.of(b).pages[1][1:3] == [NOT_RESIDENT] * 2
    shadow.check(b)
    kv.check_integrity([b])
    kv.release(b)
    kv.check_integrity([])


def test_a_shared_block_pool_lends_one_group_what_the_other_does_not_use() -> None:
    """The same bytes as 4 full and 4 SWA pages (an SWA page costs 2 blocks: 12 blocks), and a
    sequence that needs 8 full pages but, window 3, never more than 2 SWA pages: a pool per group
    runs out of full pages at the fifth, the shared pool holds it all (8 + 2 x 2 = 12 blocks)."""
    outcomes = []
    for swa_blocks in (0, 2):
        kv = make_manager(4, 4, window=3, swa_blocks=swa_blocks)
        shadow = Shadow(kv)
        seq = Sequence("long", list(range(32)))
        kv.match_prefix(seq)
        done = 0
        while done < 32 and run_step(kv, shadow, seq, P):  # a page per step
            done += P
            kv.check_integrity([seq])
            shadow.check(seq)
        outcomes.append(done)
        if swa_blocks:
            blocks = kv.full_pool.blocks
            assert kv.groups[1].pool.num_used <= 2 and blocks.num_used == 8 + 2 * kv.groups[1].pool.num_used
    assert outcomes == [16, 32]
