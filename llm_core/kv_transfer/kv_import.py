"""A prompt's KV received from a prefill engine, as the decode engine's sequence carries it: a
``KVSource`` (``caches/kv_source.py``) of the whole prompt."""

from __future__ import annotations

from typing import NamedTuple

from llm_core.caches.kv_pool import PagedKVCache, PageRows
from llm_core.kv_transfer.payload import Payload, write_layer_positions, write_positions


class KVImport(NamedTuple):
    payload: Payload  # the layer plan's KV, parsed and checked against this engine's model
    first_token: int  # what the prefill engine sampled after the prompt: the decode's first token
    nbytes: int  # bytes moved (the payload with its header)
    seconds: float  # the transfer's wall time

    @property
    def start(self) -> int:
        return 0

    @property
    def end(self) -> int:
        return self.payload.plan.num_tokens

    def write(self, kv: PagedKVCache, rows: PageRows, lo: int, hi: int) -> None:
        write_positions(self.payload, kv, rows, lo, hi)

    def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
        write_layer_positions(self.payload, kv, layer, rows, lo, hi)
