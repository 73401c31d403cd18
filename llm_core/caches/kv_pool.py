"""Paged KV storage for the KV groups: the per-layer KV tensors, the pages that index them and
their sizing.

Full-attention layers need every token's KV for the life of the sequence; a sliding-window layer
only ever reads the last W tokens of its window. The model's layers form KV groups
(``kv_groups``: a frozen spec each, one per attention kind and window; ``KVLayout`` is the tuple
of them); a page id of a group means the same token slots in every layer of the group, so one page
table row per group serves all its layers (``PagedKVCache.layer_group``).

By default every group takes its pages from one shared pool of equal blocks (``kv_blocks``), so
no budget split is guessed ahead: a group uses what the others leave (the chat overload test ran
its SWA pool out at 87% while the full pool sat at 5% before). A block is a row of every slot
tensor; a layer is a contiguous view of its slot tensor, so the kernels address it as a per-layer
tensor, and a page map (``page_map``) turns each group's page table into the layers' views::

    MiMo-V2-Flash: 9 full layers (4 KV heads), 39 SWA + MTP (8 heads); a slot = one SWA layer's page
    full page  1 block   two full layers' pages share a slot (scale 2): 5 slots
    SWA page   8 blocks  five SWA layers per block

With ``KVCacheConfig.window_fraction`` (a fixed split asked for), or for groups whose pages do not
pack evenly into one slot size, each group has a pool of its own instead, sized by
``plan_group_pools``; its layers' tensors are then indexed by the group's page ids directly.

This module knows nothing of sequences or prefix caching: the allocators (``page_pool``,
``kv_blocks.GroupBlocks``) hand out page ids and take them back; who owns a page is the KV
manager's business (one group manager per group, ``kv_group_manager``). The allocators have no
tensors, so they run in a metadata-only mode too (capacity benchmarks of a 70-layer plan on a
laptop); ``PagedKVCache`` adds the tensors on top.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from llm_core.caches.kv_blocks import BlockLayout, GroupBlocks, LayoutError, plan_block_layout
from llm_core.caches.kv_groups import (
    KVGroup,
    KVGroupSpec,
    kv_groups,
    kv_groups_from_config,
    layer_groups,
    layer_spec,
    window_pages,
)
from llm_core.caches.layer_gate import LayerGate
from llm_core.caches.page_map import BlockPageMap, GroupPageMap, PageMap
from llm_core.caches.page_pool import PageAllocator, PagePool, check_blocks

# A sequence's page rows, one per KV group in ``PagedKVCache.groups`` order: row ``g``'s entry ``i``
# is group g's physical page of logical page i (``KVManager.rows``).
PageRows = Sequence[list[int]]

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}


# The KV dtypes that KV bytes (a prefill/decode hand-off, a stored page) may carry, by name.
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def kv_dtype_name(dtype: torch.dtype) -> str | None:
    """``dtype``'s name in ``KV_DTYPES``, or None for a dtype KV bytes cannot carry."""
    return next((name for name, dt in KV_DTYPES.items() if dt == dtype), None)


@dataclass(frozen=True)
class KVLayout:
    """What the KV cache needs to know about a model: its KV groups (``kv_groups``), in group order.

    Kept independent of the model config class so capacity planning works for any layer plan
    (e.g. a 70-layer model that is never instantiated, ``hybrid``). Each group's spec carries its
    window and KV shape; ``dtype_bytes`` (every group's) is the KV's width.
    """

    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        assert self.groups, "a model has at least one layer"
        assert len({g.spec.dtype_bytes for g in self.groups}) == 1, "one KV width for every group"
        layer_groups(self.groups, self.num_layers)  # every layer in exactly one group

    @classmethod
    def of_layers(cls, layer_specs: Sequence[KVGroupSpec], num_mtp_layers: int = 0) -> KVLayout:
        """The layout of per-layer specs (the last ``num_mtp_layers`` are the MTP heads')."""
        return cls(kv_groups(layer_specs, num_mtp_layers))

    @classmethod
    def hybrid(
        cls,
        layer_windows: Sequence[int | None],
        *,
        full_kv_heads: int,
        window_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        dtype_bytes: int = 2,
        num_mtp_layers: int = 0,
    ) -> KVLayout:
        """A plan by window per layer (None: full attention): full-attention layers with
        ``full_kv_heads`` KV heads, windowed ones with ``window_kv_heads``, no sinks; the last
        ``num_mtp_layers`` are the MTP heads'."""
        return cls.of_layers(
            [
                layer_spec(
                    w, full_kv_heads if w is None else window_kv_heads, head_dim, v_head_dim, dtype_bytes
                )
                for w in layer_windows
            ],
            num_mtp_layers,
        )

    @classmethod
    def from_model_config(
        cls, cfg: Any, dtype: torch.dtype = torch.bfloat16, *, mtp_layers: int = 0
    ) -> KVLayout:
        """Layout of a decoder config (``llm_core.models.config.DecoderConfig``: a window, KV heads
        and sinks per layer) or of transformers' MiMo config (``layer_types``, one
        ``sliding_window``; windowed layers have the checkpoint's window-layer KV head count, else
        twice the full count as in MiMo-V2-Flash; sinks not read).

        ``mtp_layers``: that many windowed layers appended after the model's (indices
        ``num_hidden_layers ..``), for the multi-token-prediction heads' KV (``llm_core.models.mtp``);
        they join the first window's group and share its page table.
        """
        assert mtp_layers >= 0, mtp_layers
        width = _DTYPE_BYTES[dtype]
        if hasattr(cfg, "window"):  # our DecoderConfig: every layer's own window, heads and sinks
            return cls(kv_groups_from_config(cfg, width, mtp_layers))
        n, window = int(cfg.num_hidden_layers), int(cfg.sliding_window)
        types = getattr(cfg, "layer_types", None) or [
            "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
        ]
        windows = [window if str(t).startswith("sliding") else None for t in types] + [window] * mtp_layers
        full_heads = int(cfg.num_key_value_heads)
        window_heads = getattr(cfg, "swa_num_key_value_heads", None) or 2 * full_heads  # the checkpoint's key
        return cls.hybrid(
            windows,
            full_kv_heads=full_heads,
            window_kv_heads=int(window_heads),
            head_dim=int(cfg.head_dim),
            v_head_dim=int(getattr(cfg, "v_head_dim", None) or cfg.head_dim),
            dtype_bytes=width,
            num_mtp_layers=mtp_layers,
        )

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @property
    def dtype_bytes(self) -> int:
        return self.groups[0].spec.dtype_bytes

    def with_dtype_bytes(self, width: int) -> KVLayout:
        """The same groups with KV ``width`` bytes wide."""
        return KVLayout(
            tuple(
                dataclasses.replace(g, spec=dataclasses.replace(g.spec, dtype_bytes=width))
                for g in self.groups
            )
        )

    def bytes_per_token(self, sliding: bool | None = None) -> int:
        """K and V bytes of one token summed over every layer (``sliding`` True / False: over the
        windowed / full-attention layers only)."""
        return sum(g.bytes_per_token for g in self.groups if sliding is None or g.spec.is_sliding == sliding)

    def describe(self) -> list[dict[str, object]]:
        """The groups as JSON-ready fields, with their layers (a P/D payload's header)."""
        return [{**g.describe(), "layers": list(g.layers)} for g in self.groups]

    @classmethod
    def from_description(cls, groups: Sequence[dict[str, Any]]) -> KVLayout:
        """The inverse of ``describe`` (``KeyError`` / ``TypeError`` / ``AssertionError`` when it is not one)."""
        out = []
        for i, d in enumerate(groups):
            window = d["sliding_window"]
            spec = layer_spec(
                None if window is None else int(window),
                int(d["kv_heads"]),
                int(d["head_dim"]),
                int(d["v_head_dim"]),
                int(d["dtype_bytes"]),
                bool(d["sinks"]),
            )
            out.append(KVGroup(i, spec, tuple(int(x) for x in d["layers"]), int(d["num_mtp_layers"])))
        return cls(tuple(out))


@dataclass(frozen=True)
class KVCacheConfig:
    """Memory budget, and where the storage splits it ahead (a pool per group).

    ``window_fraction`` None (the default): one shared block pool (``PagedKVCache.from_budget``),
    no split. Set: a pool per group, the window groups' pools taking that share of
    ``memory_budget_bytes``. ``plan_group_pools`` (a pool per group without a fraction: groups that
    do not pack into blocks) makes the pools run out together for sequences of
    ``balance_context_len`` tokens (``balanced_window_share``), after setting aside
    ``window_headroom_tokens`` of window pages for the prefill in flight: a step computing T
    prefill tokens holds their windowed KV on top of the windows (until they leave the window),
    so the step's token budget is the natural value.
    """

    memory_budget_bytes: int
    page_size: int = 16
    window_fraction: float | None = None
    balance_context_len: int = 8192
    window_headroom_tokens: int = 0

    def __post_init__(self) -> None:
        if self.memory_budget_bytes <= 0 or self.page_size <= 0:
            raise ValueError(f"need a positive budget and page size, got {self}")
        if self.window_fraction is not None and not 0.0 < self.window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in (0, 1), got {self.window_fraction}")


def balanced_window_share(groups: Sequence[KVGroup], context_len: int, page_size: int) -> float:
    """The window groups' share of the budget at which every pool runs out together for
    ``context_len``: one sequence of that many tokens holds ceil(L/page) pages of each
    full-attention group and (between steps) its window's pages of each window group; the split
    is the ratio of their bytes."""
    return _window_share(groups, _demand(groups, context_len, page_size))


def _demand(groups: Sequence[KVGroup], context_len: int, page_size: int) -> list[int]:
    """Bytes one sequence of ``context_len`` tokens holds in each group's pool between steps."""
    pages = math.ceil(context_len / page_size)
    return [
        (pages if w is None else min(window_pages(w, page_size), pages)) * g.page_bytes(page_size)
        for g in groups
        for w in (g.spec.sliding_window,)
    ]


def _window_share(groups: Sequence[KVGroup], demand: Sequence[int]) -> float:
    """The window groups' share of ``demand``, strictly between 0 and 1."""
    windowed = sum(d for g, d in zip(groups, demand, strict=True) if g.spec.is_sliding)
    full = sum(demand) - windowed
    if full == 0:
        return 1.0 - 1e-9
    if windowed == 0:
        return 1e-9
    return windowed / (full + windowed)


def plan_group_pools(groups: Sequence[KVGroup], cfg: KVCacheConfig) -> tuple[int, ...]:
    """Pages of each group's pool (``groups`` order) from ``cfg.memory_budget_bytes``.

    The windows (their pages summed) get ``window_fraction`` of the budget, or else
    ``window_headroom_tokens`` of pages plus the share at which full and window pages run out
    together for ``balance_context_len`` tokens; several windows divide that in proportion to what
    such a sequence holds in each. Every full-attention group holds every logical page, so they
    share one page count from the rest."""
    page, budget = cfg.page_size, cfg.memory_budget_bytes
    demand = _demand(groups, cfg.balance_context_len, page)
    page_bytes = [g.page_bytes(page) for g in groups]
    windows = [i for i, g in enumerate(groups) if g.spec.is_sliding]
    full_page = sum(b for g, b in zip(groups, page_bytes, strict=True) if not g.spec.is_sliding)
    window_page = sum(page_bytes[i] for i in windows)
    if window_page == 0 or full_page == 0:  # one layer kind only: the other's pages hold no bytes
        window_budget = 0 if window_page == 0 else budget
    elif cfg.window_fraction is not None:
        window_budget = int(budget * cfg.window_fraction)
    else:
        headroom = min(math.ceil(cfg.window_headroom_tokens / page) * window_page, budget // 2)
        window_budget = headroom + int((budget - headroom) * _window_share(groups, demand))
    window_demand = sum(demand[i] for i in windows)
    n_full = (budget - window_budget) // full_page if full_page else 0
    pages = [
        (window_budget * demand[i] // window_demand if window_demand else 0) // page_bytes[i]
        if g.spec.is_sliding and page_bytes[i]
        else n_full
        for i, g in enumerate(groups)
    ]
    # A pool of zero-byte pages (a group with no KV heads) costs nothing: as many pages as the most
    # any other pool has, since the KV manager keeps one page per logical page in every group.
    most = max(pages, default=0)
    return tuple(most if b == 0 else n for n, b in zip(pages, page_bytes, strict=True))


def _pool_name(group: KVGroup) -> str:
    """ "full", or "window128" (messages and integrity checks)."""
    return "full" if group.spec.sliding_window is None else f"window{group.spec.sliding_window}"


class LayerKV(NamedTuple):
    """One layer's paged KV: k [N, page, Hkv, head_dim], v [N, page, Hkv, v_head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    window: int | None  # its group's window (keys per query); None for full attention
    # the layer's view (``page_map``): which of the batch's page tables and slot lists it reads;
    # with a pool per group, the index of its group in ``PagedKVCache.groups`` (not otherwise)
    group: int


class PagedKVCache:
    """The KV tensors of every layer plus the page allocator of each KV group that indexes them.

    Layer i: k [N_i, page, Hkv_i, head_dim], v [N_i, page, Hkv_i, v_head_dim], in its group's KV
    shape. Shared block pool: N_i = num_blocks x the layer's scale, a contiguous view of its slot
    tensor, indexed by the layer's physical pages (``physical``, the batch's view tables). A pool
    per group: N_i = the group's pages, indexed by the group's page ids. Either way a flat slot
    ``page * page_size + offset`` addresses ``k.view(-1, H, D)[slot]``.

    ``gate``: while KV is copied in beside a forward (``serving/kv_copy.py``), the copier's
    ``LayerGate``: ``layer(i)`` (what the model reads) waits until the copier marked layer i, and
    the copier writes through ``layer_storage(i)``, which never waits. None (the default, and
    every step without such a copy): ``layer`` costs one attribute check.
    """

    def __init__(
        self,
        layout: KVLayout,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        group_pages: int | Sequence[int] | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """Each layer's tensors take its group's KV shape (``layout.groups``), so a model without
        window layers has no window pages and one with two window sizes has two window groups.

        ``num_blocks``: one shared pool of that many blocks (``kv_blocks``) from which every group
        takes its pages. Else ``group_pages``: a pool per group, of ``group_pages[g]`` pages (one
        int: that many for every group)."""
        # the layout at the tensors' width, so what it says of bytes is what they hold
        self.layout = layout = layout.with_dtype_bytes(torch.empty((), dtype=dtype).element_size())
        self.page_size = page_size
        self.groups = layout.groups
        # layer -> index of its group in ``groups`` (the KV manager's page rows are in this order)
        self.layer_group: tuple[int, ...] = layer_groups(self.groups, layout.num_layers)
        names = [_pool_name(g) for g in self.groups]
        self.blocks: PagePool | None = None  # the shared block pool, when there is one
        self.block_layout: BlockLayout | None = None
        self.pools: tuple[PageAllocator, ...]
        self.page_map: PageMap
        if num_blocks is not None:
            assert group_pages is None, "a shared block pool or a pool per group, not both"
            self._layers = self._shared_storage(num_blocks, names, dtype, device)
        else:
            if group_pages is None:
                raise ValueError("need num_blocks (a shared pool) or group_pages (a pool per group)")
            if isinstance(group_pages, int):
                group_pages = [group_pages] * len(self.groups)
            if len(group_pages) != len(self.groups):
                raise ValueError(f"{len(group_pages)} pool sizes for {len(self.groups)} KV groups")
            self._layers = self._group_storage(group_pages, names, dtype, device)
        self.gate: LayerGate | None = None

    def _group_storage(
        self, group_pages: Sequence[int], names: list[str], dtype: torch.dtype, device: torch.device | str
    ) -> list[LayerKV]:
        """A pool per group and a K and a V tensor per layer: [pages of its group, page, H, D]."""
        self.pools = tuple(
            PagePool(n, self.page_size, name) for n, name in zip(group_pages, names, strict=True)
        )
        self.page_map = GroupPageMap(self.layer_group)
        layers = []
        for group in self.layer_group:
            spec, n = self.groups[group].spec, group_pages[group]
            k = torch.zeros(n, self.page_size, spec.kv_heads, spec.head_dim, dtype=dtype, device=device)
            v = torch.zeros(n, self.page_size, spec.kv_heads, spec.v_head_dim, dtype=dtype, device=device)
            layers.append(LayerKV(k, v, spec.sliding_window, group))
        return layers

    def _shared_storage(
        self, num_blocks: int, names: list[str], dtype: torch.dtype, device: torch.device | str
    ) -> list[LayerKV]:
        """One block pool, a K and a V slot tensor per slot ([num_blocks, slot elements]), and each
        layer a contiguous view of its slot tensor: [num_blocks * scale, page, H, D]."""
        plan = plan_block_layout(self.groups, self.page_size)
        self.block_layout = plan
        self.blocks = PagePool(num_blocks, self.page_size, "blocks")
        groups = tuple(
            GroupBlocks(self.blocks, k, name) for k, name in zip(plan.blocks_per_page, names, strict=True)
        )
        self.pools = groups
        self.page_map = BlockPageMap(plan, groups)
        k_slots = [
            torch.zeros(num_blocks, plan.slot_k_elems, dtype=dtype, device=device)
            for _ in range(plan.num_slots)
        ]
        v_slots = [
            torch.zeros(num_blocks, plan.slot_v_elems, dtype=dtype, device=device)
            for _ in range(plan.num_slots)
        ]
        layers = []
        for i, slot in enumerate(plan.layers):
            spec, n = self.groups[slot.group].spec, num_blocks * slot.scale
            k = k_slots[slot.tensor].view(n, self.page_size, spec.kv_heads, spec.head_dim)
            v = v_slots[slot.tensor].view(n, self.page_size, spec.kv_heads, spec.v_head_dim)
            layers.append(LayerKV(k, v, spec.sliding_window, self.page_map.layer_view[i]))
        return layers

    @classmethod
    def from_budget(
        cls,
        layout: KVLayout,
        cfg: KVCacheConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """Pages sized from a byte budget (bytes counted at ``dtype``'s width, whatever the layout
        was derived at): one shared block pool, or with ``cfg.window_fraction`` (a fixed split
        asked for), or groups whose pages do not pack into equal blocks (``LayoutError``), a pool
        per group (``plan_group_pools``)."""
        width = _DTYPE_BYTES[dtype]
        sized = layout.with_dtype_bytes(width)
        if cfg.window_fraction is None:
            try:
                blocks = plan_block_layout(sized.groups, cfg.page_size)
            except LayoutError:
                pass
            else:
                n = blocks.num_blocks(cfg.memory_budget_bytes, width)
                return cls(layout, cfg.page_size, dtype, device, num_blocks=n)
        pages = plan_group_pools(sized.groups, cfg)
        return cls(layout, cfg.page_size, dtype, device, group_pages=pages)

    def group_pool(self, group: KVGroup) -> PageAllocator:
        """The pool that holds ``group``'s pages."""
        return self.pools[self.groups.index(group)]

    def describe_groups(self) -> list[dict[str, object]]:
        """Each KV group's spec, layers and pages (``/health``): ``num_pages`` is the most it can
        hold (alone, when the pool is shared), ``page_bytes`` what one of its pages takes of the
        pool (``blocks_per_page`` blocks when shared) and ``bytes`` their product."""
        out: list[dict[str, object]] = []
        for g, pool in zip(self.groups, self.pools, strict=True):
            if self.block_layout is not None:
                page_bytes = pool.blocks_per_page * self.block_bytes
            else:
                layer = self._layers[g.layers[0]]
                page_bytes = g.num_layers * (layer.k[0].nbytes + layer.v[0].nbytes) if pool.num_pages else 0
            out.append(
                {
                    **g.describe(),
                    "page_size": self.page_size,
                    "blocks_per_page": pool.blocks_per_page,
                    "num_pages": pool.num_pages,
                    "num_free_pages": pool.num_free,
                    "page_bytes": page_bytes,
                    "bytes": page_bytes * pool.num_pages,
                }
            )
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the shared pool (0 without one)."""
        if self.block_layout is None:
            return 0
        return self.block_layout.block_bytes(self._layers[0].k.element_size())

    def describe_pool(self) -> dict[str, object]:
        """The storage as a whole (``/health`` ``kv_pool``): shared blocks, or a pool per group,
        and the bytes of every KV tensor."""
        if self.blocks is None:
            tensors = sum(layer.k.nbytes + layer.v.nbytes for layer in self._layers)
        else:  # the layers are views of the slot tensors: count those
            tensors = self.blocks.num_pages * self.block_bytes
        if self.blocks is None:
            return {"shared": False, "bytes": tensors}
        return {
            "shared": True,
            "num_blocks": self.blocks.num_pages,
            "num_free_blocks": self.blocks.num_free,
            "block_bytes": self.block_bytes,
            "bytes": tensors,
        }

    def physical(self, layer: int, pages: Sequence[int]) -> list[int]:
        """Layer ``layer``'s pages in its tensors for its group's page ids ``pages`` (a sequence's
        or a tree node's row; -1 entries stay -1): what page reads and writes outside the kernels
        index ``layer_storage(layer).k`` with."""
        return self.page_map.physical(layer, pages)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> LayerKV:
        """KV of model layer ``i``, once a copy in flight (``gate``) has written it."""
        gate = self.gate
        if gate is not None:
            gate.wait(i)
        return self._layers[i]

    def layer_storage(self, i: int) -> LayerKV:
        """Layer ``i``'s tensors without waiting on ``gate``: for the copier that opens it."""
        return self._layers[i]

    def check_integrity(self) -> None:
        """Each pool's free list, and with a shared pool, that the groups' pages take exactly the
        blocks in use."""
        for pool in self.pools:
            pool.check_integrity()
        if self.blocks is not None:
            check_blocks(self.blocks, self.pools)
