"""The engine's side of prefill/decode disaggregation: hand a prompt's KV over, or take it in.

    prefill engine (engine thread, right after the step that completed the prompt)
        pack the layer plan from its pages ──transport.export──▶ handle {transport, id, nbytes, xxh3, ...}
    ingress: the handle and the first token ride to the decode engine in its request body
    decode engine (a worker thread, before the request reaches the scheduler)
        transport.fetch(handle) ──▶ bytes ──payload.read (this model? this page size?)──▶ KVImport

Everything that can go wrong on the way (no transport, a full arena, a dead or slow peer, a
corrupted frame, another model's payload) ends as a reason string and no import: the decode engine
then computes the prompt itself, so the request is slower and never wrong. The transport is made
on first use (a Mooncake engine starts its own threads and ports; an engine that never hands KV
over should not pay for it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

from epd_common.messages.completion_response import KVTransferReport
from llm_core.caches.kv_connector import KVConnector
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.kv_transfer.kv_import import KVImport
from llm_core.kv_transfer.layer_plan import LayerPlan
from llm_core.kv_transfer.payload import PayloadError, pack, read
from llm_core.kv_transfer.transport import KVTransferError, KVTransport, make_transport
from llm_core.request import Sequence

log = logging.getLogger("epd.kv_handoff")


class ImportResult(NamedTuple):
    kv_import: KVImport | None  # None: the decode engine recomputes the prompt
    info: KVTransferReport  # what the response reports: imported, bytes, seconds, reason


class KVHandoff(KVConnector):
    """The P/D transport's two ends. The export is this connector's ``copy_out`` (a prompt's KV once
    its prefill completed, for a request that asked for it); the import, a ``KVImport`` read here,
    goes with the request into the KV manager's ``PromptImports`` connector, which hands it over
    as the copy-in source at admission (``caches/kv_connector.py``)."""

    def __init__(
        self,
        transport: str,
        namespace: str,
        kv: PagedKVCache,
        *,
        host: str = "127.0.0.1",
        ttl_s: float = 60.0,
        fetch_timeout_s: float = 30.0,
        arena_bytes: int = 256 << 20,
    ) -> None:
        self.transport_name = transport
        self.namespace = namespace
        self.kv = kv
        self.host = host
        self.ttl_s = ttl_s
        self.fetch_timeout_s = fetch_timeout_s
        self.arena_bytes = arena_bytes
        k = kv.layer(0).k
        self.dtype = k.dtype
        self.layout = kv.layout  # at the KV's width (``PagedKVCache`` sizes it)
        self._transport: KVTransport | None = None
        self._lock = threading.Lock()
        self.exported = 0
        self.imported = 0
        self.fallbacks: dict[str, int] = {}
        # The exports of finished prefills, by request id, until the server takes them.
        self.exports: dict[str, KVTransferReport] = {}

    def transport(self) -> KVTransport:
        with self._lock:
            if self._transport is None:
                self._transport = make_transport(
                    self.transport_name,  # type: ignore[arg-type]
                    namespace=self.namespace,
                    host=self.host,
                    arena_bytes=self.arena_bytes,
                )
            return self._transport

    def close(self) -> None:
        with self._lock:
            if self._transport is not None:
                self._transport.close()
                self._transport = None

    # -- prefill side (engine thread) ---------------------------------------------------------
    def copy_out(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], page_rows: Seq[list[list[int]]]
    ) -> None:
        """Hand over the KV of prompts this step completed (before the scheduler commits the
        step: the pages are still the sequence's, its SWA window still resident)."""
        for s, n, rows in zip(seqs, num_new_tokens, page_rows, strict=True):
            if s.kv_export and not s.output_ids and s.num_computed_tokens + n == s.num_prompt_tokens:
                self.exports[str(s.seq_id)] = self.export(s, rows)

    def pop_export(self, request_id: str) -> KVTransferReport | None:
        """The KV export of a finished ``kv_export`` request (None if it produced none)."""
        return self.exports.pop(request_id, None)

    def export(self, seq: Sequence, rows: list[list[int]]) -> KVTransferReport:
        """The plan of ``seq``'s prompt (every prompt token computed, its pages ``rows`` not yet
        released) put on the transport: its handle and sizes, or the error's reason."""
        t0 = time.perf_counter()
        plan = LayerPlan(self.layout, self.kv.page_size, seq.num_prompt_tokens)
        try:
            buf = pack(plan, self.kv, rows)
            handle = self.transport().export(buf.numpy().data, ttl_s=self.ttl_s)
        except KVTransferError as e:
            log.warning("KV export of %s failed (%s): %s", seq.seq_id, e.reason, e)
            return KVTransferReport(error=e.reason)
        self.exported += 1
        return KVTransferReport(
            handle=handle, bytes=int(buf.numel()), kv_bytes=plan.nbytes, seconds=time.perf_counter() - t0
        )

    # -- decode side (off the event loop) -----------------------------------------------------
    async def fetch(self, handle: Any, first_token: Any, prompt_ids: list[int]) -> ImportResult:
        """Fetch and check an import for a request of ``prompt_ids``; never raises."""
        t0 = time.perf_counter()
        try:
            if not isinstance(handle, dict) or not isinstance(first_token, int) or first_token < 0:
                raise PayloadError("kv_transfer needs an export handle and the first token id")
            data = await asyncio.to_thread(self.transport().fetch, handle, self.fetch_timeout_s)
            payload = read(data, self.layout, self.kv.page_size, self.dtype)
            if payload.plan.num_tokens != len(prompt_ids):
                raise PayloadError(
                    f"the KV covers {payload.plan.num_tokens} tokens, the prompt has {len(prompt_ids)}"
                )
        except (KVTransferError, PayloadError) as e:
            reason = e.reason if isinstance(e, KVTransferError) else "payload"
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            log.warning("KV import failed (%s), recomputing the prompt: %s", reason, e)
            return ImportResult(
                None, KVTransferReport(imported=False, reason=reason, seconds=time.perf_counter() - t0)
            )
        seconds = time.perf_counter() - t0
        self.imported += 1
        nbytes = len(memoryview(data).cast("B"))
        info = KVTransferReport(imported=True, bytes=nbytes, kv_bytes=payload.plan.nbytes, seconds=seconds)
        return ImportResult(KVImport(payload, first_token, nbytes, seconds), info)

    def stats(self) -> dict[str, Any]:
        return {
            "transport": self.transport_name,
            "exported": self.exported,
            "imported": self.imported,
            "fallbacks": dict(self.fallbacks),
        }
