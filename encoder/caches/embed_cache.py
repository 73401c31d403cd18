"""The node embedding cache: one tmpfs directory shared by every process of a node.

::

    /dev/shm/epd-<namespace>/          (``root``; one namespace per service on a host)
      lock                             flock: every mutation of entries/ and index holds it
      index                            counters + one LRU record per entry (cache_index.py)
      entries/<key>                    one immutable file per embedding (cache_format.py)
      tmp/<key>.<pid>.<nonce>          in-flight writes; the writer holds a flock on the file

Write: the payload goes to a private ``tmp/`` file (no lock held), then under the lock the cache
evicts LRU entries until the new one fits the byte budget, adds the index record, and renames the
file into ``entries/``. A rename is atomic, so readers see the whole entry or none of it.

Read: open + mmap (MAP_PRIVATE) + ``torch.frombuffer``: a zero-copy view that stays valid after
the entry is evicted (the mapping holds the inode) and that a consumer can write to without
touching the shared copy (copy-on-write). Reads take the lock only to bump LRU stats.

Lease (``cache_lease.py``): ``lease(keys, ttl_s)`` pins entries that a request will read, in the
shared index, so that no process's put evicts them until the lease is released or expires; a put
that could only fit by evicting a leased entry raises ``CacheFull`` (retry later) instead.

Crash safety (kill -9 anywhere): flocks die with their process; a dead writer's ``tmp/`` file
is unlocked, so ``sweep`` (run at every start) deletes it; bookkeeping is ordered so that a crash
can only over-count used bytes, and ``sweep`` rebuilds the index from the entry files.

This module knows nothing of encoders or HTTP: keys, tensors and bytes only.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from encoder.caches.cache_files import (
    check_entry,
    dead_tmp_files,
    entry_names,
    open_tmp,
    read_entry_header,
    write_slot,
)
from encoder.caches.cache_format import (
    ITEMSIZE,
    MAX_TIMESTAMPS,
    MAX_WRITER,
    MODALITIES,
    SLOT_OFFSET,
    CorruptEntry,
    EntryHeader,
    header_len_for,
    pack_header,
    pack_slot,
    payload_crc,
)
from encoder.caches.cache_index import Record, SharedIndex
from encoder.caches.cache_lease import CacheLease
from encoder.caches.cache_lock import FileLock
from encoder.caches.cache_types import (
    CachedEmbedding,
    CacheError,
    CacheFull,
    CacheNotFound,
    CacheStats,
    EntryMeta,
    EntryTooLarge,
    InvalidKey,
    NotCached,
    VerifyFailure,
    VerifyReport,
    check_key,
    default_root,
)
from epd_common.messages.embedding_ref import EmbeddingRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BYTES = 1 << 30
DEFAULT_MAX_ENTRIES = 16384
_DTYPES = ("float32", "bfloat16", "float16")


def _torch() -> ModuleType:
    """torch, imported on first put/get: the inspector CLI's stats/ls/verify start without it."""
    import torch

    return torch


_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def ref_of(hdr: EntryHeader) -> EmbeddingRef:
    """The EmbeddingRef an entry's header describes."""
    return EmbeddingRef(
        key=hdr.key,
        dtype=hdr.dtype,
        shape=hdr.shape,
        grid_thw=hdr.grid_thw,
        modality=hdr.modality,
        seconds_per_grid_t=hdr.seconds_per_grid_t,
        grid_t_timestamps=hdr.grid_t_timestamps,
    )


def entry_size(ref: EmbeddingRef, writer: str = "") -> int:
    """The bytes an entry of ``ref`` takes (its header and payload, as ``put`` counts them; a
    long ``writer`` name can add a header page)."""
    rows, cols = ref.shape
    header = header_len_for(ref.key, writer, len(ref.grid_thw), len(ref.grid_t_timestamps))
    return header + rows * cols * ITEMSIZE.get(ref.dtype, 4)


class EmbedCache:
    """A bytes-bounded LRU cache of embeddings shared by every process of a node.

    Open one instance per process (it reopens its lock after a fork). ``capacity_bytes`` is
    stored in the shared index: None keeps the namespace's current budget (1 GiB when new); a
    value sets it for every process. ``read_only`` opens without creating, sweeping or
    counting anything (the inspector CLI uses it).
    """

    def __init__(
        self,
        namespace: str = "default",
        capacity_bytes: int | None = None,
        root: Path | str | None = None,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        read_only: bool = False,
        writer: str | None = None,
    ) -> None:
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise CacheError(f"namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise CacheError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.namespace = namespace
        self.root = Path(root) if root is not None else default_root(namespace)
        self.read_only = read_only
        self.writer = writer or f"{socket.gethostname()}:{os.getpid()}"
        self._entries_dir = self.root / "entries"
        self._tmp_dir = self.root / "tmp"
        self._lock: FileLock | None = None
        if read_only:
            if not (self.root / "index").exists():
                raise CacheNotFound(f"no embedding cache at {self.root}")
            if not SharedIndex.valid_file(self.root / "index"):
                raise CacheError(f"{self.root}/index is from another version; a read-write open rebuilds it")
            self._index = SharedIndex(self.root / "index", 0, read_only=True)
            return
        self.root.mkdir(mode=0o777, parents=True, exist_ok=True)
        for d in (self._entries_dir, self._tmp_dir):
            d.mkdir(mode=0o777, exist_ok=True)
        self._lock = FileLock(self.root / "lock")
        with self._lock.held():
            self._index = SharedIndex(self.root / "index", max_entries)
            if capacity_bytes is not None or self._index.counter("capacity_bytes") == 0:
                self._index.set("capacity_bytes", capacity_bytes or DEFAULT_CAPACITY_BYTES)
        self.sweep()

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _locked(self) -> Iterator[SharedIndex]:
        if self._lock is None:
            raise CacheError(f"cache at {self.root} was opened read-only")
        with self._lock.held():
            yield self._index

    def _path(self, key: str) -> Path:
        return self._entries_dir / check_key(key)

    @property
    def capacity_bytes(self) -> int:
        return self._index.counter("capacity_bytes")

    def _unlink_entry(self, idx: SharedIndex, rec: Record) -> bool:
        """Unlink then drop the record (this order keeps the byte count conservative)."""
        try:
            os.unlink(self._entries_dir / rec.key)
            existed = True
        except FileNotFoundError:
            existed = False
        idx.remove(rec.slot)
        return existed

    def _make_room(self, idx: SharedIndex, size: int, key: str = "") -> None:
        """Evict LRU entries that no lease protects until ``size`` more bytes and one more record
        fit; ``CacheFull`` when only leased ones are left. Lock held."""
        capacity = idx.counter("capacity_bytes")
        now = time.time_ns()
        while idx.counter("used_bytes") + size > capacity or not idx.has_free_slot():
            victim = idx.oldest(now)
            if victim is None:
                if not idx.any_used():  # no record left: the counters drifted (a crash)
                    idx.clear_records()
                    break
                entries, leased = idx.leased(now)
                raise CacheFull(
                    f"put({key}): {size} bytes do not fit the {capacity}-byte node cache: {leased} bytes"
                    f" ({entries} entries) are leased by requests in flight, the rest is in use",
                    needed_bytes=size,
                    capacity_bytes=capacity,
                    leased_bytes=leased,
                )
            self._unlink_entry(idx, victim)
            idx.add("evictions")
            idx.add("evicted_bytes", victim.size)

    def _meta(self, hdr: EntryHeader, rec: Record | None) -> EntryMeta:
        return EntryMeta(
            key=hdr.key,
            dtype=hdr.dtype,
            shape=hdr.shape,
            grid_thw=hdr.grid_thw,
            modality=hdr.modality,
            bytes=hdr.file_len,
            created_ns=hdr.created_ns,
            last_access_ns=rec.last_access_ns if rec else hdr.created_ns,
            hits=rec.hits if rec else 0,
            writer=hdr.writer,
        )

    def _record_for(self, key: str, slot: int) -> Record | None:
        if 0 <= slot < self._index.nslots:
            rec = self._index.record(slot)
            if rec.key == key and self._index.rec["used"][slot]:
                return rec
        found = self._index.find(key)
        return self._index.record(found) if found is not None else None

    # ------------------------------------------------------------------ API
    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        grid_thw: Sequence[Sequence[int]],
        modality: str,
        writer: str | None = None,
        seconds_per_grid_t: float | None = None,
        grid_t_timestamps: Sequence[float] = (),
    ) -> EmbeddingRef:
        """Store ``tensor`` [tokens, hidden] under ``key`` and return its EmbeddingRef
        (``seconds_per_grid_t``: a video's seconds per temporal patch; ``grid_t_timestamps``: the
        time of each temporal patch; both kept in the header).

        Entries are immutable: when ``key`` is already cached (another writer won) the existing
        entry stays and its ref is returned. Evicts least recently used entries to stay within
        the byte budget, never a leased one; raises ``EntryTooLarge`` when the entry alone
        exceeds the budget and ``CacheFull`` when it fits only by evicting leased entries.
        """
        path = self._path(key)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dim() != 2 or dtype not in _DTYPES or tensor.numel() == 0:
            raise CacheError(
                f"put({key}): need a non-empty 2-D float32/bfloat16/float16 tensor, "
                f"got shape {tuple(tensor.shape)} {tensor.dtype}"
            )
        if modality not in MODALITIES:
            raise CacheError(f"put({key}): modality must be one of {list(MODALITIES)}, got {modality!r}")
        if any(len(g) != 3 for g in grid_thw):
            raise CacheError(f"put({key}): grid_thw must be (t, h, w) triples, got {grid_thw!r}")
        grid = tuple((int(g[0]), int(g[1]), int(g[2])) for g in grid_thw)
        stamps = tuple(float(x) for x in grid_t_timestamps)
        if len(stamps) > MAX_TIMESTAMPS:
            raise CacheError(f"put({key}): {len(stamps)} timestamps, at most {MAX_TIMESTAMPS}")
        writer = (writer or self.writer)[:MAX_WRITER]
        rows, cols = int(tensor.shape[0]), int(tensor.shape[1])
        size = header_len_for(key, writer, len(grid), len(stamps)) + rows * cols * ITEMSIZE[dtype]
        ref = EmbeddingRef(
            key=key,
            dtype=dtype,
            shape=(rows, cols),
            grid_thw=grid,
            modality=modality,
            seconds_per_grid_t=seconds_per_grid_t,
            grid_t_timestamps=stamps,
        )
        if size > self.capacity_bytes:
            raise EntryTooLarge(f"put({key}): entry of {size} bytes exceeds capacity {self.capacity_bytes}")
        if path.exists():
            return ref

        data = tensor.detach().to("cpu").contiguous().view(_torch().uint8).reshape(-1).numpy()
        payload = data.data  # memoryview of the tensor bytes, no copy
        now = time.time_ns()
        header = pack_header(
            key=key,
            dtype=dtype,
            shape=(rows, cols),
            grid_thw=grid,
            modality=modality,
            writer=writer,
            created_ns=now,
            payload_crc=payload_crc(payload),
            seconds_per_grid_t=seconds_per_grid_t,
            grid_t_timestamps=stamps,
        )
        fd, tmp = open_tmp(self._tmp_dir, key)
        try:
            os.write(fd, header)
            written = 0
            while written < len(payload):
                written += os.write(fd, payload[written:])
            with self._locked() as idx:
                if path.exists():  # lost the race to an identical entry: keep the first
                    os.unlink(tmp)
                    return ref
                self._make_room(idx, size, key)
                slot = idx.insert(key, size, created_ns=now, last_access_ns=now)
                os.pwrite(fd, pack_slot(slot), SLOT_OFFSET)
                os.rename(tmp, path)
                idx.add("inserts")
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)  # releases the tmp flock only after the rename
        return ref

    def get(self, key: str, touch: bool = True) -> CachedEmbedding | None:
        """The cached embedding for ``key`` (a zero-copy view), or None.

        ``touch`` records the read (hit/miss counters, LRU time, entry hits); the view stays
        valid even if the entry is evicted right after.
        """
        touch = touch and not self.read_only
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if touch:
                with self._locked() as idx:
                    idx.add("misses")
            return None
        try:
            file_len = os.fstat(fd).st_size
            try:
                hdr, slot = read_entry_header(fd, file_len)
                if hdr.key != key:
                    raise CorruptEntry(f"header names key {hdr.key!r}")
            except CorruptEntry as e:
                log.warning("embedding cache %s: dropping corrupt entry %s: %s", self.root, key, e)
                if touch:
                    self.evict(key)  # so that the next put can replace it
                    with self._locked() as idx:
                        idx.add("misses")
                return None
            # MAP_PRIVATE: pages are shared with the page cache until someone writes to them.
            mm = mmap.mmap(fd, file_len, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        rows, cols = hdr.shape
        torch = _torch()
        tensor = torch.frombuffer(
            mm, dtype=getattr(torch, hdr.dtype), count=rows * cols, offset=hdr.header_len
        ).view(rows, cols)  # [tokens, hidden]
        rec: Record | None
        if touch:
            with self._locked() as idx:
                idx.add("hits")
                if not idx.touch(slot, key, time.time_ns()):
                    found = idx.find(key)
                    if found is not None:
                        idx.touch(found, key, time.time_ns())
                rec = self._record_for(key, slot)
        else:
            rec = self._record_for(key, slot)
        return CachedEmbedding(tensor=tensor, ref=ref_of(hdr), meta=self._meta(hdr, rec))

    def lease(self, keys: Sequence[str], ttl_s: float) -> CacheLease:
        """Pin ``keys`` against eviction by any process for at most ``ttl_s`` seconds (release it,
        or use it as a context manager). All or none: ``NotCached`` names a key that is not
        cached. ``evict`` and ``clear`` still remove a leased entry (they are explicit)."""
        return CacheLease.take(self._locked, self._entries_dir, keys, ttl_s)

    def entry_bytes(self, key: str) -> bytes | None:
        """The entry file's bytes as they are (header, checksums, payload), or None: what the
        shared store keeps (``embedding_tier.py``)."""
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the node-wide counter ``name`` (``cache_index.COUNTERS``)."""
        if not self.read_only:
            with self._locked() as idx:
                idx.add(name, n)

    def counter(self, name: str) -> int:
        return self._index.counter(name)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is cached now (no counters touched)."""
        return self._path(key).exists()

    def stats(self) -> CacheStats:
        idx = self._index
        return CacheStats(
            root=str(self.root),
            capacity_bytes=idx.counter("capacity_bytes"),
            used_bytes=idx.counter("used_bytes"),
            entries=idx.used_count(),
            hits=idx.counter("hits"),
            misses=idx.counter("misses"),
            inserts=idx.counter("inserts"),
            evictions=idx.counter("evictions"),
            evicted_bytes=idx.counter("evicted_bytes"),
            removals=idx.counter("removals"),
            store_hits=idx.counter("store_hits"),
            store_misses=idx.counter("store_misses"),
            store_corrupt=idx.counter("store_corrupt"),
            store_puts=idx.counter("store_puts"),
        )

    def header(self, key: str) -> EntryHeader | None:
        """The parsed header of ``key`` (raises CorruptEntry when it is damaged)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return read_entry_header(fd, os.fstat(fd).st_size)[0]
        finally:
            os.close(fd)

    def meta(self, key: str) -> EntryMeta | None:
        """Metadata of one entry without counting a read."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            hdr, slot = read_entry_header(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return self._meta(hdr, self._record_for(key, slot))

    def entries(self) -> list[EntryMeta]:
        """Metadata of every readable entry (corrupt ones are left to ``verify``)."""
        out: list[EntryMeta] = []
        for name in entry_names(self._entries_dir):
            try:
                m = self.meta(name)
            except (CorruptEntry, InvalidKey):
                continue
            if m is not None:
                out.append(m)
        return out

    def evict(self, key: str) -> bool:
        """Remove ``key``; readers holding its view keep their data. False when absent."""
        path = self._path(key)
        with self._locked() as idx:
            found = idx.find(key)
            if found is not None:
                existed = self._unlink_entry(idx, idx.record(found))
            else:
                try:
                    os.unlink(path)
                    existed = True
                except FileNotFoundError:
                    existed = False
            if existed:
                idx.add("removals")
            return existed

    def clear(self) -> int:
        """Remove every entry; returns how many files were removed."""
        removed = 0
        with self._locked() as idx:
            for name in entry_names(self._entries_dir):
                with suppress(FileNotFoundError):
                    os.unlink(self._entries_dir / name)
                    removed += 1
            idx.clear_records()
            idx.add("removals", removed)
        return removed

    def verify(self) -> VerifyReport:
        """Check every entry's header and payload crc and the index against the directory.

        Read-only: changes nothing, not even access times.
        """
        failures: list[VerifyFailure] = []
        checked = unindexed = 0
        names = entry_names(self._entries_dir)
        for name in names:
            try:
                if check_entry(self._entries_dir / name, payload=True) is None:
                    continue
            except CorruptEntry as e:
                failures.append(VerifyFailure(name, str(e)))
            checked += 1
            unindexed += self._index.find(name) is None
        present = set(names)
        missing = sum(1 for r in self._index.records() if r.key not in present and not self.contains(r.key))
        orphans = sum(1 for _ in dead_tmp_files(self._tmp_dir, remove=False))
        return VerifyReport(checked, failures, orphans, unindexed, missing)

    def sweep(self) -> int:
        """Remove dead writers' tmp files and corrupt entries, rebuild the index from the
        directory (keeping LRU stats of entries it knew) and enforce the budget. Returns the
        number of files removed. Runs at every (writable) open."""
        removed = 0
        with self._locked() as idx:
            removed += sum(1 for _ in dead_tmp_files(self._tmp_dir, remove=True))
            known = {r.key: r for r in idx.records()}
            found: list[tuple[str, EntryHeader]] = []
            for name in entry_names(self._entries_dir):
                try:
                    hdr = check_entry(self._entries_dir / name, payload=False)
                except CorruptEntry as e:
                    log.warning("embedding cache %s: sweeping bad entry %s: %s", self.root, name, e)
                    with suppress(FileNotFoundError):
                        os.unlink(self._entries_dir / name)
                    removed += 1
                    continue
                if hdr is not None:
                    found.append((name, hdr))
            idx.clear_records()
            # Oldest first, so that if there are more files than slots the newest survive.
            found.sort(key=lambda kh: known[kh[0]].last_access_ns if kh[0] in known else kh[1].created_ns)
            now = time.time_ns()
            for name, hdr in found:
                old = known.get(name)
                if not idx.has_free_slot():
                    try:
                        self._make_room(idx, 0)
                    except CacheFull:  # every slot is leased: this file goes, not theirs
                        with suppress(FileNotFoundError):
                            os.unlink(self._entries_dir / name)
                        removed += 1
                        continue
                # a live lease carries over (another process holds it); an expired one is dropped
                leased = old is not None and old.created_ns == hdr.created_ns and old.protected(now)
                slot = idx.insert(
                    name,
                    hdr.file_len,
                    created_ns=hdr.created_ns,
                    last_access_ns=old.last_access_ns if old else hdr.created_ns,
                    hits=old.hits if old else 0,
                    pins=old.pins if old is not None and leased else 0,
                    lease_until_ns=old.lease_until_ns if old is not None and leased else 0,
                )
                write_slot(self._entries_dir / name, slot)
            try:
                self._make_room(idx, 0)
            except CacheFull as e:  # over budget until those leases end; puts wait for them
                log.warning("embedding cache %s: %s", self.root, e)
            idx.add("sweeps")
        return removed

    def close(self) -> None:
        self._index.close()
        if self._lock is not None:
            self._lock.close()

    def __enter__(self) -> EmbedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_reader(namespace: str, writer: str) -> EmbedCache | None:
    """This node's cache of ``namespace`` for a process that reads it (an ``EmbeddingReader``;
    created when absent: encoders may start later), or None when there is no usable one here
    (the reader then fetches each ref's url). ``writer`` names the process in the cache's stats."""
    try:
        return EmbedCache(namespace=namespace, writer=writer)
    except (CacheError, OSError) as e:
        log.warning("embedding cache %r unavailable (%s); only ref URLs will be fetched", namespace, e)
        return None


__all__ = [
    "CacheError",
    "CacheFull",
    "CacheLease",
    "CacheNotFound",
    "CacheStats",
    "CachedEmbedding",
    "EmbedCache",
    "EntryMeta",
    "EntryTooLarge",
    "InvalidKey",
    "NotCached",
    "VerifyFailure",
    "VerifyReport",
    "default_root",
    "entry_size",
    "open_reader",
]
