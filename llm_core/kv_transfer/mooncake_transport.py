"""Across nodes: KV bytes pulled by the importer from the exporter's memory with Mooncake's
transfer engine, in P2P mode over TCP (no etcd, no metadata server).

::

    exporter process                                   importer process
    TransferEngine A (listens on host:rpc_port)        TransferEngine B
    arena (arena_bytes, registered once)               receive buffers (registered once each)
    +--------+-----------------+------+--------+       +--------------------------+
    | region | region          | free | region |  <--  | transfer_sync_read, in   |
    +--------+-----------------+------+--------+ (TCP) | chunks of one buffer     |
    one region = one export, 64-byte aligned:          +--------------------------+
      [0, 8)  MAGIC   [8, 24) the id's 16 bytes   [24, 32) nbytes u64 LE   [32, 32 + nbytes) payload

The handle carries the exporter's session (``host:port``) and the region's address: Mooncake does
not exchange addresses itself, and its server refuses any read outside a registered buffer, so a
forged address cannot reach memory outside the arena (the only memory an export engine registers).
A forged session can still make the importer open a TCP connection to any host:port it can reach
(it sends Mooncake's handshake there and fails): handles must come from the service's own ingress. The importer reads header and payload in one
go and checks the header's id: freeing a region (``release``, or the reaper after ttl) wipes its
header, so a stale handle is "missing" rather than someone else's bytes; a region freed and reused
*during* a read shows as "checksum". A zero-byte export still takes a region, so it behaves like
any other (it can be missing).

Timeouts: Mooncake's calls block (a stopped peer blocks them until its socket dies) but release the
GIL, so each fetch runs its reads on a thread of its own and waits at most ``timeout_s``. On timeout
that thread keeps its receive buffer until its call returns, so a late completion lands only in a
buffer no one else holds; it never touches what ``fetch`` returns (a fresh bytearray).

Engines are per process and role (export, import), started on first use and never destroyed
(destroying one holds the GIL for about a second); ``close`` unregisters this instance's memory. So
a prefill engine (export only) and a decode engine (fetch only) each run one.

Mooncake logs "No RDMA devices found" and "Local segment descriptor not found" at start: both are
harmless with TCP. Needs ``pip install mooncake-transfer-engine-non-cuda``
(the plain wheel links libcudart) and the ``libibverbs1`` system package even for TCP.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_core.kv_transfer.transport import (
    KVTransferError,
    check_handle,
    check_namespace,
    digest,
    int_field,
    make_handle,
    new_id,
    payload_view,
    str_field,
)

log = logging.getLogger("epd.kv_transfer")

MAGIC = b"EPDKV\x00\x00\x01"
_HEADER = struct.Struct("<8s16sQ")  # MAGIC, the id as bytes, nbytes
HEADER_BYTES = _HEADER.size  # 32
ALIGN = 64
_KEYS = frozenset({"transport", "namespace", "id", "nbytes", "xxh3", "session", "ptr"})
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}:[1-9][0-9]{0,4}")
INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (not the CUDA wheel) and "
    "apt-get install libibverbs1 (needed even for TCP)"
)


def load_engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class, or a ``KVTransferError("transport")`` saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:
        raise KVTransferError("transport", f"Mooncake is not importable ({e}); {INSTALL_HINT}") from e
    return TransferEngine


_ENGINES: dict[tuple[int, str, str], Any] = {}  # (pid, host, "export" | "import") -> TransferEngine
_ENGINES_LOCK = threading.Lock()
_RETIRED_ARENAS: list[mmap.mmap] = []  # closed arenas: address space kept, pages returned


def _engine(engine_class: Any, host: str, role: str) -> Any:
    """The process's engine for ``host`` and ``role``, started on first use and never destroyed.

    Destroying a TransferEngine holds the GIL for about a second (its listener threads are
    joined), which would stall every thread of an engine process; so transports share one per
    role and ``close`` only unregisters memory. Exports and imports use separate engines so that
    an importer's receive buffers are never served to peers. The pid in the key keeps a forked
    child from using its parent's (dead) engine threads."""
    key = (os.getpid(), host, role)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            engine = engine_class()
            rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise KVTransferError(
                    "transport", f"Mooncake TransferEngine.initialize({host!r}) returned {rc}"
                )
            _ENGINES[key] = engine
        return _ENGINES[key]


def _address(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


@dataclass
class _Region:
    offset: int
    size: int  # header + payload, rounded up to ALIGN
    nbytes: int  # the payload
    deadline: float


class _Arena:
    """First-fit allocator over [0, capacity); ``free`` is sorted by offset and coalesced, so
    every byte is in exactly one free extent or one region. Not thread-safe (the caller locks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size)

    def alloc(self, size: int) -> int | None:
        for i, (offset, extent) in enumerate(self.free):
            if extent >= size:
                if extent == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, extent - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        i = 0
        while i < len(self.free) and self.free[i][0] < offset:
            i += 1
        self.free.insert(i, (offset, size))
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:  # merge with the next
            self.free[i] = (offset, size + self.free.pop(i + 1)[1])
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:  # merge with the previous
            prev_offset, prev_size = self.free[i - 1]
            self.free[i - 1] = (prev_offset, prev_size + self.free.pop(i)[1])


class _ExportSide:
    """The exporter's registered arena and its regions; called under the owner's lock."""

    def __init__(self, engine: Any, host: str, arena_bytes: int) -> None:
        self.engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        # private anonymous memory: pages exist once written, and MADV_DONTNEED really frees them
        self.mapping = mmap.mmap(-1, arena_bytes, flags=mmap.MAP_PRIVATE)
        self.buffer = np.frombuffer(self.mapping, dtype=np.uint8)
        self.base = _address(self.buffer)
        rc = engine.register_memory(self.base, arena_bytes)
        if rc != 0:
            raise KVTransferError("transport", f"Mooncake register_memory of the arena returned {rc}")
        self.arena = _Arena(arena_bytes)
        self.regions: dict[str, _Region] = {}

    def free(self, export_id: str) -> None:
        region = self.regions.pop(export_id)
        self.buffer[region.offset : region.offset + HEADER_BYTES] = 0  # a stale handle now reads "missing"
        self.arena.release(region.offset, region.size)

    def close(self) -> None:
        # Unregistered, the engine's server refuses new reads of the arena; one already being
        # served may still be sending from it, so the mapping is never unmapped: its pages are
        # dropped (reads see zeros, which fail the importer's header check) and the address
        # range is retired for the life of the process.
        self.engine.unregister_memory(self.base)
        self.regions.clear()
        self.mapping.madvise(mmap.MADV_DONTNEED)
        _RETIRED_ARENAS.append(self.mapping)


class _ReceivePool:
    """Registered receive buffers, lent one per fetch; at most ``max_buffers`` exist."""

    def __init__(self, engine: Any, buffer_bytes: int, max_buffers: int) -> None:
        self.engine = engine
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._free: list[np.ndarray] = []
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self, deadline: float) -> np.ndarray | None:
        """A buffer, or None when none came free before ``deadline`` (time.monotonic)."""
        with self._cond:
            while not self._free and self._count >= self.max_buffers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._free:
                return self._free.pop()
            buf = np.empty(self.buffer_bytes, dtype=np.uint8)
            rc = self.engine.register_memory(_address(buf), self.buffer_bytes)
            if rc != 0:
                raise KVTransferError(
                    "transport", f"Mooncake register_memory of a receive buffer returned {rc}"
                )
            self._count += 1
            return buf

    def give_back(self, buf: np.ndarray) -> None:
        with self._cond:
            if self._closed:
                self.engine.unregister_memory(_address(buf))
                return
            self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Unregister the idle buffers; busy ones are unregistered when their fetch returns them."""
        with self._cond:
            self._closed = True
            for buf in self._free:
                self.engine.unregister_memory(_address(buf))
            self._free.clear()


class _FetchJob:
    """One fetch's reads, run on its own thread so the caller can stop waiting."""

    def __init__(self, engine: Any, session: str, remote: int, export_id: str, nbytes: int) -> None:
        self.engine, self.session, self.remote = engine, session, remote
        self.export_id, self.nbytes = export_id, nbytes
        self.out = bytearray(nbytes)
        self.error: KVTransferError | None = None
        self.abandoned = False  # set by the caller on timeout: stop after the current chunk
        self.done = threading.Event()

    def run(self, pool: _ReceivePool, buf: np.ndarray) -> None:
        try:
            self._read_chunks(buf)
        except KVTransferError as e:
            self.error = e
        except Exception as e:  # an engine binding error must reach the caller, not kill the thread
            self.error = KVTransferError("transport", f"Mooncake read failed: {e!r}")
        finally:
            pool.give_back(buf)  # only now: no call of ours can still write into it
            self.done.set()

    def _read_chunks(self, buf: np.ndarray) -> None:
        #   remote: [header | payload .......................................]
        #   chunks:  [ buf.nbytes   ][ buf.nbytes   ][ rest ]   the first one starts with the header
        total = HEADER_BYTES + self.nbytes
        local, view, out = _address(buf), buf.data, memoryview(self.out)
        pos = 0
        while pos < total and not self.abandoned:
            n = min(buf.nbytes, total - pos)
            rc = self.engine.transfer_sync_read(self.session, local, self.remote + pos, n)
            if rc != 0:
                raise KVTransferError("transport", f"Mooncake read from {self.session} returned {rc}")
            start = 0
            if pos == 0:
                magic, raw_id, nbytes = _HEADER.unpack_from(view)
                if magic != MAGIC or raw_id != bytes.fromhex(self.export_id):
                    raise KVTransferError("missing", f"export {self.export_id} was released or expired")
                if nbytes != self.nbytes:
                    raise KVTransferError(
                        "size", f"export holds {nbytes} bytes, the handle says {self.nbytes}"
                    )
                start = HEADER_BYTES
            out[pos + start - HEADER_BYTES : pos + n - HEADER_BYTES] = view[start:n]
            pos += n


class MooncakeTransport:
    """``KVTransport`` over Mooncake TCP; see the module docstring for the layout and timeouts.

    ``host``: the address this process listens on and names in its handles (reachable by the
    importers). ``recv_bytes``: size of one receive buffer (larger payloads are read in chunks);
    ``max_recv_buffers``: how many fetches run at once. ``clock`` (monotonic seconds) decides
    expiry; tests inject one."""

    name = "mooncake"

    def __init__(
        self,
        namespace: str,
        *,
        host: str = "127.0.0.1",
        arena_bytes: int = 256 << 20,
        recv_bytes: int = 64 << 20,
        max_recv_buffers: int = 4,
        clock: Callable[[], float] = time.monotonic,
        reap_interval_s: float = 1.0,
    ) -> None:
        if arena_bytes <= HEADER_BYTES:
            raise ValueError(f"arena_bytes must exceed {HEADER_BYTES}, got {arena_bytes}")
        if recv_bytes <= HEADER_BYTES or max_recv_buffers < 1:
            raise ValueError(f"need recv_bytes > {HEADER_BYTES} and max_recv_buffers >= 1")
        self.namespace = check_namespace(namespace)
        self.host = host
        self.arena_bytes = arena_bytes
        self.max_payload = arena_bytes - HEADER_BYTES
        self._recv_bytes = min(recv_bytes, arena_bytes)
        self._max_recv_buffers = max_recv_buffers
        self._engine_class = load_engine_class()
        self._clock = clock
        self._reap_interval_s = reap_interval_s
        self._lock = threading.Lock()
        self._export: _ExportSide | None = None
        self._pool: _ReceivePool | None = None
        self._closed = False
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ------------------------------------------------------------------ exporter side
    def _export_side(self) -> _ExportSide:
        """Under ``_lock``."""
        if self._export is None:
            engine = _engine(self._engine_class, self.host, "export")
            self._export = _ExportSide(engine, self.host, self.arena_bytes)
            self._reaper = threading.Thread(target=self._reap_loop, name="kv-mooncake-reaper", daemon=True)
            self._reaper.start()
        return self._export

    def export(self, data: bytes | bytearray | memoryview, ttl_s: float = 60.0) -> dict[str, Any]:
        view = payload_view(data)
        nbytes = view.nbytes
        if nbytes > self.max_payload:
            raise KVTransferError("size", f"payload of {nbytes} bytes exceeds the arena's {self.max_payload}")
        size = -(-(HEADER_BYTES + nbytes) // ALIGN) * ALIGN
        export_id = new_id()
        with self._lock:
            if self._closed:
                raise KVTransferError("closed", "mooncake transport is closed")
            side = self._export_side()
            self._reap_locked(side)
            offset = side.arena.alloc(size)
            if offset is None:
                raise KVTransferError(
                    "size", f"no free run of {size} bytes in the {self.arena_bytes}-byte arena (exports held)"
                )
            # The copy runs under the lock: the arena's bytes are the only state, and exports
            # come from one engine thread; fetches do not take this lock.
            side.buffer[offset + HEADER_BYTES : offset + HEADER_BYTES + nbytes] = np.frombuffer(
                view, np.uint8
            )
            _HEADER.pack_into(side.buffer.data, offset, MAGIC, bytes.fromhex(export_id), nbytes)
            side.regions[export_id] = _Region(offset, size, nbytes, self._clock() + ttl_s)
            session, ptr = side.session, side.base + offset
        return make_handle(self.name, self.namespace, export_id, view, session=session, ptr=ptr)

    def release(self, handle: dict[str, Any]) -> None:
        try:
            fields = check_handle(
                handle, transport=self.name, namespace=self.namespace, keys=_KEYS, max_nbytes=self.max_payload
            )
        except KVTransferError:
            return  # not a handle of ours: nothing to free
        with self._lock:
            side = self._export
            region = None if side is None else side.regions.get(fields.id)
            if (
                side is not None
                and region is not None
                and handle["session"] == side.session
                and handle["ptr"] == side.base + region.offset
                and region.nbytes == fields.nbytes
            ):
                side.free(fields.id)

    def reap(self) -> int:
        """Free the exports whose ttl passed; returns how many."""
        with self._lock:
            return 0 if self._export is None else self._reap_locked(self._export)

    def _reap_locked(self, side: _ExportSide) -> int:
        now = self._clock()
        expired = [i for i, region in side.regions.items() if region.deadline < now]
        for export_id in expired:
            side.free(export_id)
        return len(expired)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._reap_interval_s):
            try:
                self.reap()
            except Exception:  # the reaper must outlive any one bad pass
                log.exception("KV mooncake reaper pass failed")

    # ------------------------------------------------------------------ importer side
    def fetch(self, handle: dict[str, Any], timeout_s: float = 30.0) -> bytearray | memoryview:
        fields = check_handle(
            handle, transport=self.name, namespace=self.namespace, keys=_KEYS, max_nbytes=self.max_payload
        )
        session = str_field(handle, "session", _SESSION_RE)
        if not 0 < int(session.rsplit(":", 1)[1]) < 65536:
            raise KVTransferError("invalid", f"handle field 'session' = {session!r} has no valid port")
        ptr = int_field(handle, "ptr", 1, (1 << 64) - 1 - HEADER_BYTES - fields.nbytes)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise KVTransferError("closed", "mooncake transport is closed")
            if self._pool is None:
                engine = _engine(self._engine_class, self.host, "import")
                self._pool = _ReceivePool(engine, self._recv_bytes, self._max_recv_buffers)
            pool = self._pool
        job = _FetchJob(pool.engine, session, ptr, fields.id, fields.nbytes)
        buf = pool.acquire(deadline)
        if buf is None:
            raise KVTransferError("timeout", f"no receive buffer came free within {timeout_s} s")
        try:
            threading.Thread(target=job.run, args=(pool, buf), name="kv-mooncake-fetch", daemon=True).start()
        except RuntimeError as e:  # no thread to run it: the buffer was never used
            pool.give_back(buf)
            raise KVTransferError("transport", f"cannot start a fetch thread: {e}") from e
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            job.abandoned = True
            raise KVTransferError(
                "timeout", f"{session} did not deliver {fields.nbytes} bytes within {timeout_s} s"
            )
        if job.error is not None:
            raise job.error
        if digest(job.out) != fields.xxh3:
            raise KVTransferError("checksum", f"export {fields.id}: xxh3 {digest(job.out)} != {fields.xxh3}")
        return job.out

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            side, self._export = self._export, None
            pool = self._pool
            if side is not None:
                side.close()
        self._stop.set()
        if pool is not None:
            pool.close()  # buffers still lent to stuck reads are unregistered when those return
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(5.0)

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
