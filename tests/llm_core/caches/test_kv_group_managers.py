"""KV groups in the KV manager and the radix cache: a full-attention model keeps one page row and
no window bookkeeping; a model with two window sizes keeps a row per window, each group freeing
what left its own window, and the prefix hit is the boundary every group's rule accepts.

A shadow "KV content" map per group stands in for the tensors (as in test_kv_manager.py): a
computed position writes the identity of its KV into its page's slot in every group; a later read
of a slot the window still needs must find it.
"""

from __future__ import annotations

import random

from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import NOT_RESIDENT, RadixCache
from llm_core.request import Sequence
from llm_core.serving.page_tables import build_page_tables

P = 4


class Shadow:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.slots: list[dict[int, tuple[int, ...]]] = [{} for _ in kv.groups]

    def write(self, seq: Sequence, n: int) -> None:
        keys = seq.cache_keys
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            for g, row in enumerate(self.kv.rows(seq)):
                self.slots[g][row[pos // P] * P + pos % P] = tuple(keys[: pos + 1])

    def check(self, seq: Sequence) -> None:
        keys = seq.cache_keys
        for g, group in enumerate(self.kv.groups):
            lo = group.first_live_page(seq.num_computed_tokens) * P
            for pos in range(lo, seq.num_computed_tokens):
                page = self.kv.rows(seq)[g][pos // P]
                assert page != NOT_RESIDENT, f"group {g}: page of {pos} dropped inside the window"
                assert self.slots[g].get(page * P + pos % P) == tuple(keys[: pos + 1]), f"group {g}@{pos}"


def step(kv: KVManager, shadow: Shadow, seq: Sequence, n: int) -> bool:
    if not kv.allocate(seq, n):
        return False
    shadow.write(seq, n)
    kv.commit(seq, n)
    if seq.num_computed_tokens == seq.num_tokens:
        seq.output_ids.append(7)
    return True


def test_full_attention_model_keeps_one_row_and_no_window_state() -> None:
    kv = KVManager([FullAttentionManager(PagePool(64, P, "full"))])
    shadow = Shadow(kv)
    a = Sequence("a", list(range(30)))
    assert kv.match_prefix(a) == 0
    for n in (9, 21, 1, 1):
        assert step(kv, shadow, a, n)
        shadow.check(a)
    st = kv.of(a)
    assert len(st.pages) == 1 and NOT_RESIDENT not in st.pages[0] and len(st.pages) == 1
    assert st.pin_end == st.prompt_pin == 0  # nothing to pin without a window
    assert kv.allocate(a, 1)
    tables = build_page_tables([a], [kv.rows(a)], [1], P)  # one group: one table, no SWA table to fill
    assert len(tables.page_tables) == len(tables.slots) == 1
    assert tables.page_tables[0][0].tolist() == st.pages[0]
    kv.check_integrity([a])
    kv.release(a)
    kv.check_integrity([])
    b = Sequence("b", [*range(30), 99, 98])
    assert kv.match_prefix(b) == 28  # every cached page of the path is a hit
    kv.check_integrity([b])
    kv.release(b)
    assert kv.radix is not None and kv.radix.evict_full(100) == 8
    kv.check_integrity([])
    assert kv.full_pool.num_used == 0


def two_windows(pages: int = 96) -> KVManager:
    return KVManager(
        [
            FullAttentionManager(PagePool(pages, P, "full")),
            SlidingWindowManager(PagePool(pages, P, "narrow"), 5),
            SlidingWindowManager(PagePool(pages, P, "wide"), 13),
        ]
    )


def test_two_window_groups_free_their_own_windows() -> None:
    kv = two_windows()
    shadow = Shadow(kv)
    seq = Sequence(0, list(range(20)))
    kv.match_prefix(seq)
    for n in (7, 13):
        assert step(kv, shadow, seq, n)
    for _ in range(30):
        assert step(kv, shadow, seq, 1)
        shadow.check(seq)
        kv.check_integrity([seq])
        narrow, wide = (sum(p != NOT_RESIDENT for p in row) for row in kv.rows(seq)[1:])
        assert narrow < wide < len(kv.rows(seq)[0])  # each window keeps what its queries read
    kv.release(seq)
    kv.check_integrity([])


def test_hit_needs_every_window_group() -> None:
    full, narrow, wide = (PagePool(32, P, n) for n in ("full", "narrow", "wide"))
    tree = RadixCache(P, (None, 5, 13), (full.free, narrow.free, wide.free))
    key = list(range(24))  # 6 pages
    rows = [full.alloc(6), narrow.alloc(6), wide.alloc(6)]
    assert all(r is not None for r in rows)
    tree.insert(key, *rows)  # type: ignore[arg-type]
    assert tree.match_prefix(key).length == 24
    # trimming the narrow group (W-1 = 4 tokens: 1 page) to the window before the node's end
    # splits the node; the hit stays at the end
    assert tree.evict_window(5, 1) == 5 and tree.match_prefix(key).length == 24
    # the wide group (W-1 = 12 tokens: 3 pages) trims the upper node to the window of its own end
    assert tree.evict_window(2, 2) == 2 and tree.match_prefix(key).length == 24
    tree.check_integrity()
    # a key that ends inside the trimmed part: neither window is live before its boundary
    assert tree.match_prefix(key[:12]).length == 0
    assert tree.num_tombstones() >= 1


def test_two_windows_reuse_a_prefix() -> None:
    rng = random.Random(0)
    kv = two_windows(pages=40)
    shadow = Shadow(kv)
    system = [rng.randrange(50) for _ in range(16)]
    held: list[Sequence] = []
    hits = 0
    for i in range(30):
        seq = Sequence(i, system + [rng.randrange(50) for _ in range(rng.randint(1, 12))], max_new_tokens=4)
        hit = kv.match_prefix(seq)
        assert hit is not None and hit % P == 0
        hits += hit > 0
        ok = True
        while ok and len(seq.output_ids) < 3:
            ok = step(kv, shadow, seq, seq.num_tokens - seq.num_computed_tokens)
        shadow.check(seq)
        held.append(seq)
        kv.check_integrity(held)
        if len(held) > 2:
            kv.release(held.pop(0))
            kv.check_integrity(held)
    for seq in held:
        kv.release(seq)
    kv.check_integrity([])
    assert hits > 10  # the shared system prompt is hit through both windows
