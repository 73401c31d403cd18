"""Names of dtypes and devices as config fields and flags spell them, shared by every role."""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# How long the encoder workers and LLM engines keep an idle HTTP connection open: longer than the
# ingress's client pool keeps one (aiohttp's 15 s), so the client always closes first. The other
# way round (uvicorn's 5 s default), a pooled connection the server just closed can be reused and
# the request fails with "Server disconnected" though the server was fine.
INTERNAL_KEEP_ALIVE_S = 30
CLIENT_KEEP_ALIVE_S = 15.0

AUTO_DTYPE = "auto"  # the checkpoint's own dtype (config.json), float32 when it names none

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_dtype(owner: str, name: str) -> None:
    """Raise ValueError naming ``owner`` (e.g. "WorkerConfig.dtype") when ``name`` is not a known dtype."""
    if name != AUTO_DTYPE and name not in DTYPES:
        raise ValueError(f"{owner} must be {AUTO_DTYPE!r} or one of {sorted(DTYPES)}, got {name!r}")


def resolve_dtype(name: str, model_dir: str | Path | None) -> torch.dtype:
    """``name`` as a torch dtype; "auto" reads ``dtype`` / ``torch_dtype`` from the checkpoint's
    config.json (top level, else ``text_config``): a bf16 release stays bf16 unless told otherwise.
    The embedded defaults (no directory) and configs that name no float dtype get float32."""
    if name != AUTO_DTYPE:
        return DTYPES[name]
    if model_dir is None:
        return torch.float32
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return torch.float32  # the loader reports a missing or broken config.json itself
    for scope in (raw, raw.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key) if isinstance(scope, dict) else None
            if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
                return DTYPES[value.removeprefix("torch.")]
    return torch.float32


def resolve_device(name: str) -> torch.device:
    """ "auto" is CUDA when present, else the CPU; anything else is taken as a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with torch on ``n`` intra-op threads, then restore the count (reduction splits,
    and so the last bits of some results, depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, the model's Python objects: ~200k for the
    ingress alone) out of the garbage collector's sight. A full collection walks every tracked
    object, ~85 ms for those on this kind of machine and more under load, and it runs on the
    event loop: /health answered in 540 ms under overload before this, 5 ms at the median.

    The frozen objects no longer count as long-lived, so CPython's brake on full collections
    (wait until a quarter of the long-lived objects are new) no longer holds them back: one would
    follow every 10th middle-generation collection, every few seconds under load. The third
    threshold puts that back to one in 100."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)


def serve_internal(app: Any, *, uds: str | None, host: str, port: int, log_level: str) -> None:
    """Serve an internal role's app (encoder worker, LLM engine) with uvicorn until interrupted:
    on the unix socket ``uds`` when set, else ``host:port``; its keep-alive outlasts the
    ingress's pool (``INTERNAL_KEEP_ALIVE_S``). uvicorn picks uvloop and httptools up itself."""
    import uvicorn

    where: dict[str, Any] = {"uds": uds} if uds else {"host": host, "port": port}
    uvicorn.run(app, log_level=log_level, timeout_keep_alive=INTERNAL_KEEP_ALIVE_S, **where)
