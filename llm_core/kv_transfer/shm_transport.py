"""One node: KV bytes handed over as files in /dev/shm (tmpfs, so a copy in RAM, no disk).

::

    /dev/shm/                                  (tempfile.gettempdir() where /dev/shm is absent)
      epd-kv-<namespace>-<id>.part             being written by the exporter (mode 0600)
      epd-kv-<namespace>-<id>                  complete: renamed from .part, so readers never see
                                               half a file; its mtime is set to the export's
                                               DEADLINE (export time + ttl), not its write time

Export: write ``.part``, set its mtime to the deadline, rename. Fetch: open by name (built from the
validated id, never a path from the handle; O_NOFOLLOW so a planted symlink is refused), then unlink
that name *before* reading: whoever unlinks first owns the bytes (the open descriptor keeps the
inode alive), so an export is consumed exactly once and a second fetch is "missing". The bytes are
returned as a private (copy-on-write) mapping of the unlinked file, as the node embedding cache
reads its entries: no copy (a 64 MiB bytearray costs more to zero-fill than the whole fetch), and
once unlinked and closed no one but the caller can reach the file. The one exposure, as for the
node cache: a process of the same user that opened the file before the unlink could still modify
or truncate it (a truncation would SIGBUS the reader). Our own code never does. The pages stay
in tmpfs (counted against /dev/shm's size) until the caller drops its last view of them.

Keeping the deadline in the file lets any process of the namespace reap expired exports, including
those of an exporter that was killed: each instance runs a reaper thread that unlinks complete
files whose deadline passed and ``.part`` files untouched for ``STALE_PART_S`` (a dead writer's).
``arena_bytes`` caps the bytes one exporter holds in /dev/shm at once (tmpfs is RAM).

Exporter and importer must run as the same user (the files are 0600: a prompt's KV is private).
``fetch`` is a local open and map, so it never waits on a peer: ``timeout_s`` is accepted for the
interface and not needed.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_core.kv_transfer.transport import (
    KVTransferError,
    Reason,
    check_handle,
    check_namespace,
    digest,
    make_handle,
    new_id,
    payload_view,
)

log = logging.getLogger("epd.kv_transfer")

STALE_PART_S = 300.0  # a .part file untouched this long belongs to a dead writer
_KEYS = frozenset({"transport", "namespace", "id", "nbytes", "xxh3"})
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE  # with MAP_PRIVATE: the caller's writes are copy-on-write


def default_dir() -> Path:
    """/dev/shm where it exists (Linux), else the temp directory (slower, but correct)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _name_pattern(namespace: str) -> re.Pattern[str]:
    """Exactly this namespace's files: ``epd-kv-a-*`` would also match namespace ``a-b``'s."""
    return re.compile(re.escape(f"epd-kv-{namespace}-") + r"[0-9a-f]{32}(\.part)?")


def namespace_files(namespace: str, root: Path | str | None = None) -> list[Path]:
    """Every export file (complete or being written) of ``namespace``, for a service's own clean-up."""
    pattern = _name_pattern(check_namespace(namespace))
    directory = Path(root) if root is not None else default_dir()
    return sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))


class ShmTransport:
    """``KVTransport`` over tmpfs files; see the module docstring for the file protocol.

    ``clock``: wall-clock seconds (the deadlines are file mtimes, compared across processes);
    tests inject one to expire exports without sleeping. ``reap_interval_s``: how often the reaper
    thread runs."""

    name = "shm"

    def __init__(
        self,
        namespace: str,
        *,
        arena_bytes: int = 256 << 20,
        root: Path | str | None = None,
        clock: Callable[[], float] = time.time,
        reap_interval_s: float = 1.0,
    ) -> None:
        if arena_bytes <= 0:
            raise ValueError(f"arena_bytes must be positive, got {arena_bytes}")
        self.namespace = check_namespace(namespace)
        self.root = Path(root) if root is not None else default_dir()
        self.arena_bytes = arena_bytes
        self._clock = clock
        self._prefix = f"epd-kv-{namespace}-"
        self._name_re = _name_pattern(namespace)
        self._lock = threading.Lock()
        self._exports: dict[str, tuple[int, float]] = {}  # id -> (nbytes, deadline); guarded by _lock
        self._held_bytes = 0
        self._closed = False
        self._stop = threading.Event()
        self.reap()
        self._reaper = threading.Thread(
            target=self._reap_loop, args=(reap_interval_s,), name="kv-shm-reaper", daemon=True
        )
        self._reaper.start()

    def _path(self, export_id: str) -> Path:
        return self.root / f"{self._prefix}{export_id}"

    # ------------------------------------------------------------------ exporter side
    def export(self, data: bytes | bytearray | memoryview, ttl_s: float = 60.0) -> dict[str, Any]:
        view = payload_view(data)
        nbytes = view.nbytes
        if nbytes > self.arena_bytes:
            raise KVTransferError("size", f"payload of {nbytes} bytes exceeds arena_bytes={self.arena_bytes}")
        export_id = new_id()
        deadline = self._clock() + ttl_s
        with self._lock:
            if self._closed:
                raise KVTransferError("closed", "shm transport is closed")
            if self._held_bytes + nbytes > self.arena_bytes:
                self._forget_gone_locked()
            if self._held_bytes + nbytes > self.arena_bytes:
                raise KVTransferError(
                    "size",
                    f"{self._held_bytes} of {self.arena_bytes} arena bytes held; {nbytes} more do not fit",
                )
            self._exports[export_id] = (nbytes, deadline)  # reserved before writing: the cap holds
            self._held_bytes += nbytes
        path = self._path(export_id)
        part = path.with_name(path.name + ".part")
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "wb", buffering=0) as f:
                pos = 0
                while pos < nbytes:
                    pos += f.write(view[pos:])  # a raw write may be short
            os.utime(part, (deadline, deadline))
            os.rename(part, path)
        except OSError as e:
            self._drop(export_id)
            part.unlink(missing_ok=True)
            reason: Reason = "size" if e.errno == errno.ENOSPC else "transport"
            raise KVTransferError(reason, f"could not write {part}: {e}") from e
        with self._lock:
            closed_meanwhile = export_id not in self._exports and self._closed
        if closed_meanwhile:  # close() ran during the write and could not see this file
            path.unlink(missing_ok=True)
            raise KVTransferError("closed", "shm transport was closed during the export")
        return make_handle(self.name, self.namespace, export_id, view)

    def release(self, handle: dict[str, Any]) -> None:
        try:
            fields = check_handle(
                handle, transport=self.name, namespace=self.namespace, keys=_KEYS, max_nbytes=self.arena_bytes
            )
        except KVTransferError:
            return
        if self._drop(fields.id):
            self._path(fields.id).unlink(missing_ok=True)

    def _drop(self, export_id: str) -> bool:
        """Forget one of our exports; False when it was not ours (or already dropped)."""
        with self._lock:
            entry = self._exports.pop(export_id, None)
            if entry is not None:
                self._held_bytes -= entry[0]
            return entry is not None

    def _forget_gone_locked(self) -> None:
        """Stop counting our exports that an importer consumed (their file is gone)."""
        for export_id in [i for i in self._exports if not self._path(i).exists()]:
            self._held_bytes -= self._exports.pop(export_id)[0]

    # ------------------------------------------------------------------ importer side
    def fetch(self, handle: dict[str, Any], timeout_s: float = 30.0) -> bytearray | memoryview:
        """The export's bytes as a writable private mapping of its (already unlinked) file: no copy,
        the caller's writes stay its own (copy-on-write), and the memory goes with the last view."""
        fields = check_handle(
            handle, transport=self.name, namespace=self.namespace, keys=_KEYS, max_nbytes=self.arena_bytes
        )
        if self._closed:
            raise KVTransferError("closed", "shm transport is closed")
        path = self._path(fields.id)
        try:
            # O_NONBLOCK: a FIFO planted under this name must not block the open (S_ISREG refuses it)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise KVTransferError(
                "missing", f"no export {fields.id} (released, expired or fetched)"
            ) from None
        except OSError as e:
            planted = e.errno == errno.ELOOP  # a symlink under our name: never follow it
            raise KVTransferError("invalid" if planted else "transport", f"could not open {path}: {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KVTransferError("invalid", f"{path} is not a regular file")
            try:
                os.unlink(path)  # the claim: only one fetcher's unlink succeeds
            except FileNotFoundError:
                raise KVTransferError(
                    "missing", f"export {fields.id} was fetched or reaped meanwhile"
                ) from None
            if st.st_mtime < self._clock():
                raise KVTransferError("missing", f"export {fields.id} expired")
            if st.st_size != fields.nbytes:
                raise KVTransferError(
                    "size", f"{path} holds {st.st_size} bytes, the handle says {fields.nbytes}"
                )
            if fields.nbytes == 0:
                out: bytearray | memoryview = bytearray()
            else:
                try:
                    mapping = mmap.mmap(fd, fields.nbytes, flags=mmap.MAP_PRIVATE, prot=_PROT_RW)
                except (OSError, ValueError) as e:
                    raise KVTransferError("transport", f"could not map {path}: {e}") from e
                out = memoryview(mapping)
        finally:
            os.close(fd)  # the mapping keeps the unlinked file's pages alive
        if digest(out) != fields.xxh3:
            raise KVTransferError("checksum", f"export {fields.id}: xxh3 {digest(out)} != {fields.xxh3}")
        return out

    # ------------------------------------------------------------------ reaping and closing
    def reap(self) -> int:
        """Unlink this namespace's expired exports (anyone's) and dead writers' ``.part`` files;
        forget our own expired or consumed ones. Returns the number of files unlinked."""
        now = self._clock()
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except OSError as e:
            log.warning("KV shm reaper cannot list %s: %s", self.root, e)
            return 0
        for entry in entries:
            match = self._name_re.fullmatch(entry.name)
            if match is None:
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
                if mtime < (now - STALE_PART_S if match.group(1) else now):
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass  # fetched or reaped by someone else meanwhile
            except OSError as e:
                log.warning("KV shm reaper cannot remove %s: %s", entry.path, e)
        with self._lock:
            for export_id in [i for i, (_, deadline) in self._exports.items() if deadline < now]:
                self._held_bytes -= self._exports.pop(export_id)[0]
            self._forget_gone_locked()
        return removed

    def _reap_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.reap()
            except Exception:  # the reaper must outlive any one bad pass
                log.exception("KV shm reaper pass failed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._exports)
            self._exports.clear()
            self._held_bytes = 0
        self._stop.set()
        for export_id in ids:
            self._path(export_id).unlink(missing_ok=True)
        if self._reaper is not threading.current_thread():
            self._reaper.join(5.0)

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
