"""End-to-end fixtures: a real ``epd serve`` subprocess and a loopback media server.

One ``epd serve`` (ingress + one encoder worker + the LLM engine, embedded default models) is shared
by every e2e test of the session: starting one takes tens of seconds on a loaded machine. Tests that
need a cache miss use media no other test sends (``unique_png`` / ``unique_jpeg``), so the order in
which tests run does not matter.

    test ──HTTP──▶ epd serve (subprocess, free loopback port) ──fetch──▶ MediaServer (thread)

Stopping a server sends SIGTERM (the path a real deployment takes) and checks that the children
exited and that the node cache's shared memory (/dev/shm/epd-serve-<port>) is gone.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from encoder.caches.embed_cache import EmbedCache
from epd.supervisor import group_alive
from tests.fixtures.media_server import MediaServer
from tests.fixtures.video_factory import make_clip

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 45.0
# The shared server's body cap: large enough for every upload of the suite, small enough that the
# oversize test sends only a few MiB.
SHARED_MAX_BODY_BYTES = 2 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeProcess:
    """A running ``epd serve`` child and what is needed to talk to it and stop it."""

    proc: subprocess.Popen[str]
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def shm_dir(self) -> Path:
        return Path(f"/dev/shm/epd-serve-{self.port}")

    def tail(self, n: int = 40) -> str:
        return "".join(self.log[-n:])


def _pump(proc: subprocess.Popen[str], log: list[str], ready: threading.Event) -> None:
    """Collect the child's merged stdout/stderr; flag the readiness line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        if line.startswith("epd serving on "):
            ready.set()


def forge_cached_embedding(
    server: ServeProcess, key: str, edit: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replace ``key``'s entry in ``server``'s node cache by ``edit`` of its tensor, under the same
    grid: an embedding that no longer fits what its ref says (the LLM server must never get it)."""
    cache = EmbedCache(namespace=f"serve-{server.port}")
    try:
        real = cache.get(key, touch=False)
        assert real is not None
        cache.evict(key)
        cache.put(key, edit(real.tensor).clone(), real.ref.grid_thw, real.ref.modality)
    finally:
        cache.close()


@contextlib.contextmanager
def serving_with_local_vllm(model_dir: Path, *extra: str) -> Iterator[ServeProcess]:
    """``epd serve --model DIR --llm-server vllm`` with the local vLLM it starts itself (1 GiB of
    KV, float32) and ``extra`` flags; on leaving, epd stops and its vLLM processes with it."""
    server = start_serve(
        ["--model", str(model_dir), "--llm-server", "vllm", "--vllm-kv-cache-gib", "1",
         "--vllm-dtype", "float32", *extra],
        timeout_s=600,
    )  # fmt: skip
    try:
        yield server
    finally:
        assert stop_serve(server) == 0, server.tail()


def start_serve(args: Sequence[str], timeout_s: float = START_TIMEOUT_S) -> ServeProcess:
    """Start ``epd serve --port <free> *args`` and wait until it announced itself and /ready is 200."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd.cli", "serve", "--port", str(port), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a failed start can be cleaned up whole
    )
    server = ServeProcess(proc, port)
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, server.log, ready), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.25):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            raise RuntimeError(
                f"epd serve did not start (exit {proc.returncode}) within {timeout_s:.0f} s:\n{server.tail()}"
            )
    # The ingress announces once uvicorn listens; the engine may still be finishing its own start.
    while True:
        with contextlib.suppress(OSError):
            status, _ = http_json("GET", f"{server.url}/ready")
            if status == 200:
                return server
        if time.monotonic() > deadline:
            stop_serve(server)
            raise RuntimeError(f"epd serve never became ready:\n{server.tail()}")
        time.sleep(0.25)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def stop_serve(server: ServeProcess) -> int:
    """SIGTERM the server, wait for it, and return its exit code (SIGKILL its group on a hang)."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(server.proc)
            raise AssertionError(
                f"epd serve ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{server.tail()}"
            ) from None
    # The children (encoder worker, engine, their decode pools) share the server's process group;
    # the supervisor stops them before exiting, so the group must empty out within moments.
    deadline = time.monotonic() + 5.0
    while group_alive(server.proc.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            raise AssertionError(f"children of epd serve outlived it:\n{server.tail()}")
        time.sleep(0.1)
    return int(server.proc.returncode)


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # parsed JSON when the answer is JSON, else the raw bytes
    headers: dict[str, str]


def request(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> Reply:
    """One HTTP request with the standard library, keeping the response headers (lower-cased)."""
    hdrs = dict(headers or {})
    data: bytes | None
    if body is None or isinstance(body, bytes):
        data = body
    else:
        data = json.dumps(body).encode()
        hdrs.setdefault("content-type", "application/json")
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, got = resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), exc.headers
    lowered = {k.lower(): v for k, v in got.items()}
    parsed: Any = json.loads(raw) if "json" in lowered.get("content-type", "") else raw
    return Reply(int(status), parsed, lowered)


def http_json(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 120.0
) -> tuple[int, Any]:
    """``request`` without the headers: (status, parsed JSON or raw bytes)."""
    reply = request(method, url, body, headers, timeout)
    return reply.status, reply.body


# -- requests --------------------------------------------------------------------------------------

ImageFile = tuple[str, bytes, str]


def multipart(files: list[ImageFile]) -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body with one file field per (filename, bytes, content type)."""
    boundary = "epd-test-boundary-7d1c"
    parts = []
    for i, (name, data, ctype) in enumerate(files):
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file{i}"; filename="{name}"\r\n'
            f"Content-Type: {ctype}\r\n\r\n"
        ).encode()
        parts.append(head + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


def upload(server: ServeProcess, files: list[ImageFile], query: str = "") -> tuple[int, Any]:
    body, headers = multipart(files)
    return http_json("POST", f"{server.url}/v1/encode{query}", body, headers)


def embedding_of(entry: dict[str, Any]) -> torch.Tensor:
    emb = entry["embedding"]
    raw = np.frombuffer(base64.b64decode(emb["data"]), dtype=np.dtype(emb["dtype"]))
    return torch.from_numpy(raw.copy()).reshape(emb["shape"])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# -- media -----------------------------------------------------------------------------------------

_unique = itertools.count()


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A smooth, seed-dependent RGB picture (gradients plus noise: every pixel matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    arr = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def image_bytes(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


def unique_png(width: int = 64, height: int = 48) -> bytes:
    """PNG bytes no other test of the session sends (a guaranteed cache miss on first use)."""
    return image_bytes(photo(width, height, 10_000 + next(_unique)), "PNG")


def unique_jpeg(width: int = 96, height: int = 64) -> bytes:
    return image_bytes(photo(width, height, 20_000 + next(_unique)), "JPEG")


@dataclass(frozen=True)
class Media:
    """The fixed media of the session and their URLs on the loopback media server."""

    server: MediaServer
    jpeg: bytes
    png: bytes
    mp4: bytes
    jpeg_url: str
    png_url: str
    mp4_url: str


@pytest.fixture(scope="session")
def media() -> Iterator[Media]:
    jpeg = image_bytes(photo(120, 90, 1), "JPEG")
    png = image_bytes(photo(70, 60, 2), "PNG")
    # 2 s at 4 fps, 96x64: sampled at 2 fps into 4 frames (2 temporal patches).
    mp4 = make_clip(width=96, height=64, fps=4.0, seconds=2.0)
    with MediaServer() as server:
        yield Media(
            server,
            jpeg,
            png,
            mp4,
            server.add("photo.jpg", jpeg, "image/jpeg"),
            server.add("photo.png", png, "image/png"),
            server.add("clip.mp4", mp4, "video/mp4"),
        )


@pytest.fixture(scope="session")
def epd_server(media: Media) -> Iterator[ServeProcess]:
    """The shared ``epd serve`` with the embedded default models; loopback fetches allowed."""
    server = start_serve(
        [
            "--fetch-allow-cidrs",
            "127.0.0.0/8",
            "--max-body-bytes",
            str(SHARED_MAX_BODY_BYTES),
            "--health-interval-s",
            "0.5",
        ]
    )
    try:
        yield server
    finally:
        code = stop_serve(server)
        assert code == 0, f"epd serve exited with {code}:\n{server.tail()}"
        assert not server.shm_dir.exists(), f"{server.shm_dir} was left behind"


def serve_fails_at_start(args: Sequence[str]) -> str:
    """Run ``epd serve *args`` (on a free port), which must exit 1 before announcing itself or
    starting any role; returns its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "epd.cli", "serve", "--port", str(free_port()), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "epd serving on" not in proc.stdout  # nothing was announced, no child was started
    return proc.stderr
