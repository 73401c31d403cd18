"""The KV transport interface: move one opaque byte buffer from an exporter to an importer.

::

    prefill engine (exporter)                           decode engine (importer, a worker thread)
    handle = t.export(buf, ttl_s)  -- JSON, through -->  data = t.fetch(handle, timeout_s)
                                      the ingress
    t.release(handle) once the decode side answered, or the exporter's reaper frees it after ttl_s

A transport knows nothing of KV: the engine packs a request's layer plan into one buffer and
unpacks what ``fetch`` returns. What every transport guarantees, because the decode engine's only
fallback is to recompute the prefill (slower, never wrong):

- ``fetch`` returns exactly the exported bytes or raises ``KVTransferError``; never a prefix, never
  another export's bytes (the size and xxh3_64 of the payload travel in the handle and are checked).
- ``fetch`` gives up within ``timeout_s`` (plus scheduling slack) however the peer misbehaves.
- A handle is untrusted input (it crossed HTTP): ``check_handle`` validates every field before
  anything is opened or read, so a forged handle cannot name a file, an address outside the
  exporter's arena, or a size beyond ``arena_bytes``.
- Every failure is a ``KVTransferError`` whose ``reason`` says which kind, so callers can count them.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import xxhash

Reason = Literal["missing", "timeout", "checksum", "size", "transport", "closed", "invalid"]
"""Why a transfer failed:

- ``missing``: no such export (released, expired, already fetched, or the exporter restarted)
- ``timeout``: the peer did not answer within ``timeout_s``
- ``checksum``: the bytes arrived but their xxh3_64 differs from the handle's (corruption, or a
  region reused under a stale handle)
- ``size``: a payload larger than the arena, a full arena, or bytes of the wrong length
- ``transport``: the transport itself failed (peer unreachable, engine error, not installed)
- ``closed``: this transport was closed
- ``invalid``: the handle is malformed (wrong transport or namespace, bad id, bad field types)
"""

TransportName = Literal["shm", "mooncake"]

ID_RE = re.compile(r"[0-9a-f]{32}")
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # the node cache's rule
_XXH3_RE = re.compile(r"[0-9a-f]{16}")
XXH3_SEED = 0


class KVTransferError(Exception):
    """A transfer that did not deliver; ``reason`` is one of ``Reason``, the message says why."""

    def __init__(self, reason: Reason, message: str) -> None:
        assert reason in get_args(Reason), reason
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason


class KVTransport(Protocol):
    """Moves byte buffers between processes; one instance per process and transport.

    Thread-safe: ``export``/``release`` run on the engine's thread, ``fetch`` on worker threads.
    An instance both exports and fetches; exporter and importer must use the same ``namespace``
    (and, for the size check, the same ``arena_bytes``).
    """

    name: str

    def export(self, data: bytes | bytearray | memoryview, ttl_s: float = 60.0) -> dict[str, Any]:
        """Copy ``data`` (C-contiguous) out of the caller's hands and return its handle.

        The handle is a small JSON-able dict: ``transport``, ``namespace``, ``id``, ``nbytes``,
        ``xxh3`` (16 hex digits) plus the transport's own fields. The copy is held until
        ``release`` or ``ttl_s`` seconds, whichever comes first. Raises ``KVTransferError("size")``
        when it does not fit."""
        ...

    def fetch(self, handle: dict[str, Any], timeout_s: float = 30.0) -> bytearray | memoryview:
        """The exported bytes in a writable buffer the caller owns (nothing else writes to it; the
        caller may keep views of it, e.g. ``torch.frombuffer``). Blocking: call it from a worker
        thread. Verified against the handle's size and xxh3 before it is returned."""
        ...

    def release(self, handle: dict[str, Any]) -> None:
        """Exporter side: free the export now. Idempotent; unknown or malformed handles are ignored."""
        ...

    def close(self) -> None:
        """Free everything this instance exported; later calls raise ``KVTransferError("closed")``."""
        ...


@dataclass(frozen=True)
class HandleFields:
    """The fields every transport's handle carries, validated."""

    id: str
    nbytes: int
    xxh3: str


def new_id() -> str:
    """128 random bits: unguessable, so a handle cannot be forged for someone else's export."""
    return secrets.token_hex(16)


def payload_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat byte view (no copy); non-contiguous views are a caller bug."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("KV transports move C-contiguous buffers only")
    return view.cast("B")


def digest(data: bytes | bytearray | memoryview) -> str:
    """xxh3_64 of ``data`` as 16 hex digits (a string: JSON readers that parse numbers as doubles
    would round a 64-bit integer)."""
    return f"{xxhash.xxh3_64_intdigest(data, seed=XXH3_SEED):016x}"


def int_field(handle: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``handle[key]`` as an int in [lo, hi]; a bool, float or string is refused."""
    value = handle.get(key)
    if type(value) is not int:
        raise KVTransferError("invalid", f"handle field {key!r} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        reason: Reason = "size" if key == "nbytes" else "invalid"
        raise KVTransferError(reason, f"handle field {key!r} = {value} is outside [{lo}, {hi}]")
    return value


def str_field(handle: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    """``handle[key]`` as a string that fully matches ``pattern``."""
    value = handle.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise KVTransferError("invalid", f"handle field {key!r} = {value!r} must match {pattern.pattern}")
    return value


def make_handle(
    transport: str, namespace: str, export_id: str, view: memoryview, **extra: Any
) -> dict[str, Any]:
    """A handle's common fields (those ``check_handle`` validates) plus the transport's own."""
    return {
        "transport": transport,
        "namespace": namespace,
        "id": export_id,
        "nbytes": view.nbytes,
        "xxh3": digest(view),
        **extra,
    }


def check_handle(
    handle: object, *, transport: str, namespace: str, keys: frozenset[str], max_nbytes: int
) -> HandleFields:
    """Validate a received handle's common fields; ``keys`` is the transport's exact key set.

    Unknown keys are refused too: a handle from another version of the exporter falls back to a
    recompute rather than being half understood."""
    if not isinstance(handle, dict):
        raise KVTransferError("invalid", f"a handle is a dict, got {type(handle).__name__}")
    if handle.get("transport") != transport:
        raise KVTransferError(
            "invalid", f"handle is for transport {handle.get('transport')!r}, this is {transport!r}"
        )
    if set(handle) != keys:
        raise KVTransferError("invalid", f"handle keys {sorted(handle)} differ from {sorted(keys)}")
    if handle.get("namespace") != namespace:
        raise KVTransferError(
            "invalid", f"handle is for namespace {handle.get('namespace')!r}, this is {namespace!r}"
        )
    return HandleFields(
        id=str_field(handle, "id", ID_RE),
        nbytes=int_field(handle, "nbytes", 0, max_nbytes),
        xxh3=str_field(handle, "xxh3", _XXH3_RE),
    )


def check_namespace(namespace: str) -> str:
    if not NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"namespace must match {NAMESPACE_RE.pattern}, got {namespace!r}")
    return namespace


def make_transport(
    name: TransportName, *, namespace: str, host: str = "127.0.0.1", arena_bytes: int = 256 << 20
) -> KVTransport:
    """The transport called ``name``.

    ``arena_bytes``: the most bytes one instance holds exported at once (and so the largest
    payload); ``host``: the address Mooncake listens on and puts in its handles (ignored by
    ``shm``). Mooncake missing raises ``KVTransferError("transport")`` saying what to install."""
    if name == "shm":
        from llm_core.kv_transfer.shm_transport import ShmTransport

        return ShmTransport(namespace, arena_bytes=arena_bytes)
    if name == "mooncake":
        from llm_core.kv_transfer.mooncake_transport import MooncakeTransport

        return MooncakeTransport(namespace, host=host, arena_bytes=arena_bytes)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(get_args(TransportName))}")
