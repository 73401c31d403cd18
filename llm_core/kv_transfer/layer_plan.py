"""What a prefill engine hands a decode engine for one prompt: the layer plan, per KV group.

After prefilling ``P`` prompt tokens, the decode engine's first query (at position P) reads, per
KV group (``caches.kv_groups``)::

    full-attention group       keys [0, P)             every page: ceil(P / page) pages
    sliding-window group (W)   keys [P-W+1, P)         only the pages of its last window

A window group's pages sent start where the engine itself keeps them (``KVManager.free_out_of_window``): at
the window of the last page boundary ``b = P // page * page``, i.e. page ``(b - W + 1) // page``.
That is at most one page more than the query needs, and it makes every SWA page the decode engine
holds complete, so when its prefix cache learns the prefix, a later request that resumes at ``b``
finds a valid window (pages below it arrive as tombstones: full KV only).

For MiMo-V2.5-Pro's plan (70 layers, 10 full, window 128) at 32K tokens this is ~6.8x less than
every layer's KV (``all_layers_nbytes``): the SWA layers cost a constant 128-144 tokens each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from llm_core.caches.kv_groups import KVGroup, layer_groups
from llm_core.caches.kv_pool import KVLayout


@dataclass(frozen=True)
class LayerPlan:
    layout: KVLayout  # the model's layer types, KV heads and dims; dtype_bytes is the KV's width
    page_size: int
    num_tokens: int  # P: prompt tokens whose KV moves

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.num_tokens < 1:
            raise ValueError(f"a layer plan needs page_size >= 1 and num_tokens >= 1, got {self}")

    @property
    def num_pages(self) -> int:
        """Pages of a full-attention layer: every token's (the last one may be partial)."""
        return math.ceil(self.num_tokens / self.page_size)

    @cached_property
    def groups(self) -> tuple[KVGroup, ...]:
        """The layout's KV groups (full attention first, then each window)."""
        return self.layout.groups

    @cached_property
    def layer_group(self) -> tuple[int, ...]:
        """Layer -> index of its group in ``groups``."""
        return layer_groups(self.groups, self.layout.num_layers)

    def first_page(self, group: KVGroup) -> int:
        """The first page of ``group`` sent: 0 for full attention; for a window, the window of the
        last page boundary, as the engine keeps it."""
        window = group.spec.sliding_window
        if window is None:
            return 0
        b = self.num_tokens // self.page_size * self.page_size
        return max(0, b - window + 1) // self.page_size

    def group_of(self, layer: int) -> KVGroup:
        return self.groups[self.layer_group[layer]]

    def pages_of(self, layer: int) -> range:
        """Logical pages of ``layer`` that move."""
        return range(self.first_page(self.group_of(layer)), self.num_pages)

    def heads_of(self, layer: int) -> int:
        return self.group_of(layer).spec.kv_heads

    def page_bytes(self, layer: int) -> int:
        """K and V bytes of one page of ``layer``."""
        return self.page_size * self.group_of(layer).spec.bytes_per_token

    @property
    def nbytes(self) -> int:
        """KV bytes the plan moves (the payload without its header)."""
        return sum(len(self.pages_of(i)) * self.page_bytes(i) for i in range(self.layout.num_layers))

    @property
    def all_layers_nbytes(self) -> int:
        """What moving every layer's KV for every page would cost (a plan that ignores the window)."""
        return sum(self.num_pages * self.page_bytes(i) for i in range(self.layout.num_layers))
