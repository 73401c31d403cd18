"""What a prefill engine hands a decode engine for one prompt: the layer plan.

After prefilling ``P`` prompt tokens, the decode engine's first query (at position P) reads, per
layer type::

    full-attention layer   keys [0, P)             every page: ceil(P / page) pages
    sliding-window layer   keys [P-W+1, P)         only the pages of the last window

The SWA pages sent start where the engine itself keeps them (``KVManager.free_out_of_window``): at
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

    @property
    def swa_first_page(self) -> int:
        """The first SWA page sent: the window of the last page boundary, as the engine keeps it."""
        b = self.num_tokens // self.page_size * self.page_size
        return max(0, b - self.layout.sliding_window + 1) // self.page_size

    def pages_of(self, layer: int) -> range:
        """Logical pages of ``layer`` that move."""
        first = self.swa_first_page if self.layout.layer_is_swa[layer] else 0
        return range(first, self.num_pages)

    def heads_of(self, layer: int) -> int:
        return self.layout.swa_kv_heads if self.layout.layer_is_swa[layer] else self.layout.full_kv_heads

    def page_bytes(self, layer: int) -> int:
        """K and V bytes of one page of ``layer``."""
        lay = self.layout
        return self.page_size * self.heads_of(layer) * (lay.head_dim + lay.v_head_dim) * lay.dtype_bytes

    @property
    def nbytes(self) -> int:
        """KV bytes the plan moves (the payload without its header)."""
        return sum(len(self.pages_of(i)) * self.page_bytes(i) for i in range(self.layout.num_layers))

    @property
    def all_layers_nbytes(self) -> int:
        """What moving every layer's KV for every page would cost (a plan that ignores the window)."""
        return sum(self.num_pages * self.page_bytes(i) for i in range(self.layout.num_layers))
