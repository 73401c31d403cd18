"""A prompt's KV received from a prefill engine, as the decode engine's sequence carries it."""

from __future__ import annotations

from typing import NamedTuple

from llm_core.kv_transfer.payload import Payload


class KVImport(NamedTuple):
    payload: Payload  # the layer plan's KV, parsed and checked against this engine's model
    first_token: int  # what the prefill engine sampled after the prompt: the decode's first token
    nbytes: int  # bytes moved (the payload with its header)
    seconds: float  # the transfer's wall time
