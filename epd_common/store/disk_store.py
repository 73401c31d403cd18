"""The local-disk tier: one file per key under a directory, a byte budget, LRU by last access.

::

    <directory>/
      data/<sha256(key)>          one entry: header (below) + the value; the mtime is its last access
      tmp/<sha256>.<pid>.<nonce>  in-flight writes, renamed into data/ when complete
      claims/<sha256(key)>        claim markers: expiry + owner token, published with link(2)
      claims.lock                 flock held while an expired marker is taken over or removed

    entry file:
    offset  size  field
    0       8     magic b"EPDSTORE"
    8       2     version (1)
    10      2     key length
    12      4     crc32 of [0, 12) + [16, 32) + the key: a torn or foreign header is refused
    16      8     expires: unix seconds (float64), 0 = never
    24      8     value length
    32      ...   key (ascii) | value

Write: the file goes to ``tmp/`` and is renamed into ``data/``, so readers see a whole entry or
none. The key inside the header makes a (theoretical) sha256 collision a miss, never another key's
bytes. The value itself has no checksum here: values carry their own (the node cache's entry
format) and the caller checks them.

Budget: each process keeps an in-memory LRU of the files it knows (size, last access), rebuilt by
a scan at open and every ``rescan_interval_s`` at a put, and evicts the least recently used files
until its total is under ``max_bytes``. Several processes may share the directory; each sees the
others' files only at its next rescan, so between rescans the directory may exceed the budget by
what the others wrote. Before evicting a file a process checks its mtime: one that another process
read since is moved to the recent end instead. Files may vanish at any point (another process
evicted or deleted them): every file operation tolerates it.

Expiry is wall-clock time (``clock``) because it is compared across processes; an expired entry is
a miss and is deleted when found.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from epd_common.store.store import (
    StoreError,
    StoreStats,
    Value,
    check_items,
    check_key,
    check_keys,
    check_ttl,
)

log = logging.getLogger("epd.store")

MAGIC = b"EPDSTORE"
VERSION = 1
_HEADER = struct.Struct("<8sHHIdQ")  # magic, version, key_len, crc, expires, value_len: 32 bytes
_CLAIM = struct.Struct("<d16s")  # expires, owner token
STALE_TMP_S = 300.0  # a tmp file untouched this long belongs to a dead writer
_REORDER_SLACK_S = 1e-3  # an mtime newer than ours by more than this was touched by someone else


def _crc(head: bytes, key: bytes) -> int:
    return zlib.crc32(key, zlib.crc32(head[16:32], zlib.crc32(head[:12])))


def pack_header(key: str, expires: float, value_len: int) -> bytes:
    raw = key.encode("ascii")
    head = _HEADER.pack(MAGIC, VERSION, len(raw), 0, expires, value_len)
    return _HEADER.pack(MAGIC, VERSION, len(raw), _crc(head, raw), expires, value_len) + raw


class _Header:
    __slots__ = ("expires", "length", "value_len")

    def __init__(self, expires: float, value_len: int, length: int) -> None:
        self.expires = expires
        self.value_len = value_len
        self.length = length  # header + key: the value's offset


def _read_header(fd: int, key: str) -> _Header | None:
    """The header of the open entry ``fd`` if it is a valid entry *of ``key``*, else None."""
    raw_key = key.encode("ascii")
    data = os.pread(fd, _HEADER.size + len(raw_key), 0)
    if len(data) < _HEADER.size:
        return None
    magic, version, key_len, crc, expires, value_len = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or key_len != len(raw_key):
        return None
    if data[_HEADER.size :] != raw_key or crc != _crc(data[: _HEADER.size], raw_key):
        return None
    return _Header(expires, value_len, _HEADER.size + key_len)


class DiskStore:
    """``Store`` over files in ``directory`` (created if absent), at most ``max_bytes`` of files
    per process's view (see the module docstring). ``clock``: wall-clock seconds, for expiry
    (tests inject one)."""

    name = "disk"

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        *,
        clock: Callable[[], float] = time.time,
        rescan_interval_s: float = 30.0,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._clock = clock
        self._rescan_interval_s = rescan_interval_s
        self._data = self.directory / "data"
        self._tmp = self.directory / "tmp"
        self._claims = self.directory / "claims"
        self._token = secrets.token_bytes(16)  # names this instance as a claim owner
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, tuple[int, float]] = OrderedDict()  # name -> (size, last access)
        self._bytes = 0
        self._last_scan = 0.0
        self._closed = False
        self._hits = self._misses = self._errors = self._puts = 0
        try:
            for d in (self._data, self._tmp, self._claims):
                d.mkdir(parents=True, exist_ok=True)
            self._sweep_tmp()
            with self._lock:
                self._rescan()
                self._evict()  # the budget may be smaller than the last user's
        except OSError as e:
            raise StoreError("unavailable", f"cannot open the store directory {self.directory}: {e}") from e

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _name(key: str) -> str:
        return hashlib.sha256(key.encode("ascii")).hexdigest()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("unavailable", f"the disk store at {self.directory} was closed")

    @contextmanager
    def _os_errors(self, what: str) -> Iterator[None]:
        """OSErrors of the block as ``StoreError("unavailable")``, counted."""
        try:
            yield
        except OSError as e:
            with self._lock:
                self._errors += 1
            raise StoreError("unavailable", f"{what} in {self.directory}: {e}") from e

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for path in self._tmp.iterdir():
            with suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()

    def _rescan(self) -> None:
        """Rebuild the LRU from the files on disk (ours and other processes'); holds ``_lock``."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(self._data) as it:
            for entry in it:
                with suppress(FileNotFoundError):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        self._lru = OrderedDict((name, (size, mtime)) for mtime, name, size in found)
        self._bytes = sum(size for _, _, size in found)
        self._last_scan = time.monotonic()

    def _forget(self, name: str) -> None:
        """Drop ``name`` from the LRU (the file is gone or about to be); holds ``_lock``."""
        old = self._lru.pop(name, None)
        if old is not None:
            self._bytes -= old[0]

    def _evict(self) -> None:
        """Unlink least recently used files until the total fits; holds ``_lock``."""
        reordered = 0
        while self._bytes > self.max_bytes and self._lru:
            name, (size, seen) = next(iter(self._lru.items()))
            path = self._data / name
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                self._forget(name)  # evicted or deleted by another process
                continue
            if mtime > seen + _REORDER_SLACK_S and reordered < len(self._lru):
                self._lru[name] = (size, mtime)  # read by another process since: recent again
                self._lru.move_to_end(name)
                reordered += 1
                continue
            with suppress(FileNotFoundError):
                path.unlink()
            self._forget(name)

    def _drop_if_same(self, fd: int, path: Path, name: str) -> None:
        """Unlink ``path`` if it still is the file open as ``fd`` (not a fresh replacement)."""
        with suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
        with self._lock:
            self._forget(name)

    def _open_entry(self, key: str) -> tuple[int, _Header] | None:
        """The open fd and header of ``key``'s live entry, or None (absent, expired, foreign)."""
        name = self._name(key)
        path = self._data / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            with self._lock:
                self._forget(name)  # evicted or deleted by another process, if we listed it
            return None
        try:
            header = _read_header(fd, key)
            live = header is not None and (header.expires == 0 or header.expires > self._clock())
            if header is not None and os.fstat(fd).st_size != header.length + header.value_len:
                live = False  # truncated (or grown): not what a writer renamed into place
            if live and header is not None:
                return fd, header
            if header is not None:
                self._drop_if_same(fd, path, name)  # expired or damaged: make room now
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------ Store
    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        self._check_open()
        out = []
        with self._os_errors("exists"):
            for key in keys:
                opened = self._open_entry(key)
                if opened is not None:
                    os.close(opened[0])
                out.append(opened is not None)
        return out

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        self._check_open()
        out: list[bytes | None] = []
        with self._os_errors("get"):
            for key in keys:
                out.append(self._get_one(key))
        hits = sum(v is not None for v in out)
        with self._lock:
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def _get_one(self, key: str) -> bytes | None:
        opened = self._open_entry(key)
        if opened is None:
            return None
        fd, header = opened
        try:
            value = os.pread(fd, header.value_len, header.length)
        finally:
            os.close(fd)
        if len(value) != header.value_len:
            return None  # truncated under us
        name = self._name(key)
        now = time.time()
        with suppress(FileNotFoundError):
            os.utime(self._data / name, (now, now))  # the mtime is the last access, for every process
        with self._lock:
            if name in self._lru:
                self._lru[name] = (self._lru[name][0], now)
                self._lru.move_to_end(name)
        return value

    def put(self, items: Sequence[tuple[str, Value]], ttl_s: float | None = None) -> None:
        ttl = check_ttl(ttl_s)
        checked = check_items(items, self.max_bytes)
        for key, value in checked:
            if _HEADER.size + len(key) + len(value) > self.max_bytes:
                raise StoreError(
                    "too_large",
                    f"the entry of {key!r} ({len(value)} bytes + header) is over "
                    f"the store's whole budget of {self.max_bytes} bytes",
                )
        self._check_open()
        expires = 0.0 if ttl is None else self._clock() + ttl
        with self._os_errors("put"):
            for key, value in checked:
                self._put_one(key, value, expires)

    def _put_one(self, key: str, value: bytes | memoryview, expires: float) -> None:
        name = self._name(key)
        header = pack_header(key, expires, len(value))
        tmp = self._tmp / f"{name}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with open(tmp, "xb") as f:
                f.write(header)
                f.write(value)
            size = len(header) + len(value)
            with self._lock:
                os.replace(tmp, self._data / name)
                self._forget(name)
                self._lru[name] = (size, time.time())  # >= the file's mtime (set by the write)
                self._bytes += size
                self._puts += 1
                if time.monotonic() - self._last_scan > self._rescan_interval_s:
                    self._rescan()
                self._evict()
        except BaseException:
            with suppress(FileNotFoundError):
                tmp.unlink()
            raise

    def delete(self, keys: Sequence[str]) -> None:
        keys = check_keys(keys)
        self._check_open()
        with self._os_errors("delete"):
            for key in keys:
                name = self._name(key)
                with suppress(FileNotFoundError):
                    (self._data / name).unlink()
                with self._lock:
                    self._forget(name)

    # ------------------------------------------------------------------ claims
    @contextmanager
    def _claims_locked(self) -> Iterator[None]:
        fd = os.open(self.directory / "claims.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # drops the flock

    def _read_claim(self, path: Path) -> tuple[float, bytes] | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) != _CLAIM.size:
            return 0.0, b""  # not a marker we wrote (markers are published whole): expired
        expires, token = _CLAIM.unpack(data)
        return expires, token

    def _create_claim(self, path: Path, ttl: float) -> bool:
        """Publish a complete marker at ``path`` if none is there. ``link`` is the atomic
        create-if-absent (like O_CREAT|O_EXCL) of a file that already holds its expiry, so no
        one can read a marker half written and take it for an expired one."""
        tmp = self._tmp / f"claim.{os.getpid()}.{secrets.token_hex(8)}"
        try:
            with open(tmp, "xb") as f:
                f.write(_CLAIM.pack(self._clock() + ttl, self._token))
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            with suppress(FileNotFoundError):
                tmp.unlink()
        return True

    def claim(self, key: str, ttl_s: float) -> bool:
        ttl = check_ttl(ttl_s, required=True)
        assert ttl is not None
        path = self._claims / self._name(check_key(key))
        self._check_open()
        with self._os_errors("claim"):
            if self._create_claim(path, ttl):
                return True
            # Taken: maybe by a claimer that died. Takeover and unclaim hold the flock, so two
            # processes cannot both replace the same expired marker (the fast path above only
            # creates, and O_EXCL lets one creator win).
            with self._claims_locked():
                held = self._read_claim(path)
                if held is not None and held[0] > self._clock():
                    return False
                with suppress(FileNotFoundError):
                    path.unlink()
                return self._create_claim(path, ttl)

    def unclaim(self, key: str) -> None:
        path = self._claims / self._name(check_key(key))
        self._check_open()
        with self._os_errors("unclaim"), self._claims_locked():
            held = self._read_claim(path)
            if held is not None and held[1] == self._token:
                with suppress(FileNotFoundError):
                    path.unlink()

    # ------------------------------------------------------------------ the rest
    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                kind=self.name,
                location=str(self.directory),
                entries=len(self._lru),
                bytes=self._bytes,
                hits=self._hits,
                misses=self._misses,
                errors=self._errors,
                puts=self._puts,
            )

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r}, max_bytes={self.max_bytes})"
