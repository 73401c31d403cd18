"""KV cache groups: which layers keep which kind of KV, as frozen specs derived from the model.

A *group* is a set of layers that share one page table: a logical page ``i`` of a sequence is
one physical page for every layer of the group, so the group's KV of page ``i`` is allocated,
cached, evicted and copied as one unit. Layers fall into the same group exactly when their
``KVGroupSpec`` is equal: the same attention kind and window (what KV a query reads, hence what
must be kept) and the same KV shape (heads, dims, width: what a page holds)::

    MiMo-V2-Flash (48 layers + 1 MTP head)       Qwen2.5-VL (28 layers)
    group 0  full_attention       layers 0, 5, 11 ...      group 0  full_attention  layers 0 .. 27
    group 1  sliding_window 128   the other 39 + MTP 48

Group order is fixed: full attention first, then sliding windows from the narrowest, ties by
first layer. A full-attention model has exactly one group; a model whose layers use two window
sizes gets two sliding-window groups from the same derivation (``kv_groups``).

The multi-token-prediction heads' layers (``llm_core.models.mtp``) are sliding-window layers
whose queries trail the target's by a few positions: they read the window the target's SWA layers
keep, so they join the sliding-window group of their window and share its page table. The group
counts them (``num_mtp_layers``) so that sizing and ``/health`` can say where their bytes go.

Sinks (a learned per-head logit that absorbs attention mass) change how a layer attends, not what
KV it reads, so they are part of the spec (the kernels need to know) but keep no extra pages.

This module has no tensors and no allocator: ``kv_pool`` sizes pools from the groups, the KV
manager keeps one group manager per group (``kv_group_manager``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

GroupKind = Literal["full_attention", "sliding_window"]
FULL_ATTENTION: Final = "full_attention"
SLIDING_WINDOW: Final = "sliding_window"


@dataclass(frozen=True)
class KVGroupSpec:
    """What one layer's KV is: the attention kind, the window, the KV shape and its byte width.

    ``sliding_window`` counts the query token (a query at p reads keys [p-W+1, p]); None for full
    attention. ``sinks``: the layers add a learned sink logit per head (no KV of its own).
    """

    kind: GroupKind
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: int
    sliding_window: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.kind == FULL_ATTENTION:
            assert self.sliding_window is None, self
        else:
            assert self.kind == SLIDING_WINDOW and self.sliding_window is not None, self
            assert self.sliding_window >= 1, self
        assert self.kv_heads >= 0 and self.head_dim > 0 and self.v_head_dim > 0 and self.dtype_bytes > 0

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING_WINDOW

    @property
    def window_tokens(self) -> int | None:
        """Keys before a resumed query's position that must still be present for a prefix hit
        there: W-1 for a window, None (all of them) for full attention."""
        return None if self.sliding_window is None else self.sliding_window - 1

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer of this spec."""
        return self.kv_heads * (self.head_dim + self.v_head_dim) * self.dtype_bytes

    def describe(self) -> dict[str, object]:
        """The spec as JSON-ready fields (``/health``)."""
        return {
            "kind": self.kind,
            "sliding_window": self.sliding_window,
            "sinks": self.sinks,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "dtype_bytes": self.dtype_bytes,
        }


@dataclass(frozen=True)
class KVGroup:
    """One group: its index (the KV events' ``group_idx``), its spec and its layers.

    ``layers``: model layer indices in order; the last ``num_mtp_layers`` of them are the MTP
    heads' layers (indices past the model's own).
    """

    group_id: int
    spec: KVGroupSpec
    layers: tuple[int, ...]
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        assert self.layers and 0 <= self.num_mtp_layers <= len(self.layers), self

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token summed over the group's layers."""
        return self.num_layers * self.spec.bytes_per_token

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of this group (every layer's K and V for ``page_size`` tokens)."""
        return page_size * self.bytes_per_token

    def describe(self) -> dict[str, object]:
        return {
            "group": self.group_id,
            **self.spec.describe(),
            "num_layers": self.num_layers,
            "num_mtp_layers": self.num_mtp_layers,
        }


def kv_groups(layer_specs: Sequence[KVGroupSpec], num_mtp_layers: int = 0) -> tuple[KVGroup, ...]:
    """Group layers by equal spec (``layer_specs[i]``: layer ``i``'s; the last ``num_mtp_layers``
    are the MTP heads'). Order: full attention, then windows from the narrowest, ties by first layer.
    """
    assert layer_specs, "a model has at least one layer"
    assert 0 <= num_mtp_layers <= len(layer_specs), num_mtp_layers
    first_mtp = len(layer_specs) - num_mtp_layers
    members: dict[KVGroupSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        members.setdefault(spec, []).append(i)

    def order(spec: KVGroupSpec) -> tuple[int, int, int]:
        return (int(spec.is_sliding), spec.sliding_window or 0, members[spec][0])

    return tuple(
        KVGroup(g, spec, tuple(members[spec]), sum(1 for i in members[spec] if i >= first_mtp))
        for g, spec in enumerate(sorted(members, key=order))
    )


def layer_groups(groups: Sequence[KVGroup], num_layers: int) -> tuple[int, ...]:
    """Layer -> index of its group in ``groups`` (the order the KV manager's page rows follow)."""
    group_of = {i: k for k, g in enumerate(groups) for i in g.layers}
    assert sorted(group_of) == list(range(num_layers)), "every layer is in exactly one group"
    return tuple(group_of[i] for i in range(num_layers))


class _PerLayerConfig(Protocol):
    """What ``layer_specs_from_config`` reads: ``llm_core.models.config.DecoderConfig``."""

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def v_head_dim(self) -> int: ...

    def window(self, i: int) -> int | None: ...

    def num_kv_heads(self, i: int) -> int: ...

    def has_sinks(self, i: int) -> bool: ...


def layer_specs_from_config(
    cfg: _PerLayerConfig, dtype_bytes: int, mtp_layers: int = 0
) -> tuple[KVGroupSpec, ...]:
    """Each layer's spec, read per layer from the model config (so two window sizes in one model
    give two specs), then ``mtp_layers`` MTP head layers like the config's sliding-window layers
    (the first one's spec; ``llm_core.models.mtp`` builds them so)."""
    n = int(cfg.num_hidden_layers)
    specs = [
        layer_spec(
            cfg.window(i), cfg.num_kv_heads(i), cfg.head_dim, cfg.v_head_dim, dtype_bytes, cfg.has_sinks(i)
        )
        for i in range(n)
    ]
    if mtp_layers:
        first_window = next((s for s in specs if s.is_sliding), None)
        assert first_window is not None, "MTP heads are sliding-window layers: the model needs one to copy"
        specs += [first_window] * mtp_layers
    return tuple(specs)


def kv_groups_from_config(cfg: _PerLayerConfig, dtype_bytes: int, mtp_layers: int = 0) -> tuple[KVGroup, ...]:
    """The model's KV groups, with ``mtp_layers`` MTP head layers after its own."""
    return kv_groups(layer_specs_from_config(cfg, dtype_bytes, mtp_layers), mtp_layers)


def layer_spec(
    window: int | None, kv_heads: int, head_dim: int, v_head_dim: int, dtype_bytes: int, sinks: bool = False
) -> KVGroupSpec:
    """One layer's spec: full attention when ``window`` is None, else a window of that many keys."""
    kind: GroupKind = FULL_ATTENTION if window is None else SLIDING_WINDOW
    return KVGroupSpec(kind, int(kv_heads), int(head_dim), int(v_head_dim), dtype_bytes, window, bool(sinks))


def window_pages(window: int, page_size: int) -> int:
    """Pages of a window group one decoding sequence keeps resident: the window before the next
    query, plus its page.

    The next query at position p reads keys [p-W+1, p]: W tokens, which touch at most
    ceil((W-1)/page) + 1 pages when they start at the last slot of a page::

        W = 20, page = 8:   p-W+1 = 8k+7, p = 8k+26
        page:   |   k   |  k+1  |  k+2  |  k+3  |
        keys:          [x ......................x]        -> 4 pages = ceil(19/8) + 1
    """
    return math.ceil((window - 1) / page_size) + 1
