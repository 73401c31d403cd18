"""Fetcher against the loopback media server, data: URIs and file: URLs under a root."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from media_io.config import FetchConfig
from media_io.errors import (
    BadMedia,
    FetchFailed,
    FetchRefused,
    FetchTimeout,
    MediaError,
    MediaTooLarge,
    UnsupportedMedia,
)
from media_io.fetch import Fetcher, _open_beneath, decode_data_url
from media_io.image import decode_image
from tests.fixtures.media_server import MediaServer
from tests.media_io.bad_media import small_image

LOCAL = FetchConfig(allow_cidrs=("127.0.0.0/8", "::1/128"), connect_timeout_s=2.0, total_timeout_s=10.0)
PNG = small_image("PNG")


@pytest.fixture(scope="module")
def server() -> Iterator[MediaServer]:
    with MediaServer() as s:
        s.add("img.png", PNG, "image/png")
        for i in range(8):
            s.add(f"slow{i}.bin", bytes([i]) * 1000, delay_s=0.2)
        yield s


def fetch(url: str, cfg: FetchConfig = LOCAL) -> bytes:
    async def run() -> bytes:
        async with Fetcher(cfg) as f:
            return await f.fetch(url)

    return asyncio.run(run())


# -- http -------------------------------------------------------------------------------------------


def test_fetch_then_decode_round_trip(server: MediaServer) -> None:
    data = fetch(server.url("/m/img.png"))
    assert data == PNG
    assert decode_image(data).size == (64, 48)


def _timed_fetch_many(cfg: FetchConfig, urls: list[str]) -> tuple[list[bytes | MediaError], float]:
    async def run() -> tuple[list[bytes | MediaError], float]:
        async with Fetcher(cfg) as f:
            t0 = time.perf_counter()
            out = await f.fetch_many(urls)
            return out, time.perf_counter() - t0

    return asyncio.run(run())


def test_fetch_many_is_concurrent(server: MediaServer) -> None:
    urls = [server.url(f"/m/slow{i}.bin") for i in range(8)]  # each answers after 200 ms
    results, elapsed = _timed_fetch_many(LOCAL, urls)
    assert results == [bytes([i]) * 1000 for i in range(8)]
    assert elapsed < 0.5 * len(urls) * 0.2, f"{elapsed:.2f}s for 8 x 200 ms: not concurrent"


def test_server_latency_and_per_host_limit(server: MediaServer) -> None:
    # 8 URLs, 200 ms of server latency each, at most 2 connections to the host: 4 waves.
    urls = [server.url("/m/img.png")] * 8
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, limit_per_host=2)
    server.latency_s = 0.2
    try:
        results, elapsed = _timed_fetch_many(cfg, urls)
    finally:
        server.latency_s = 0.0
    assert results == [PNG] * 8
    assert 0.75 < elapsed < 3.0, f"{elapsed:.2f}s; expected ~0.8 s (4 waves of 200 ms)"


def test_fetch_many_isolates_failures(server: MediaServer) -> None:
    urls = [
        server.url("/m/img.png"),
        server.url("/status/404"),
        "ftp://example.com/a.png",
        server.url("/m/img.png"),
    ]

    async def run() -> list[bytes | MediaError]:
        async with Fetcher(LOCAL) as f:
            return await f.fetch_many(urls, items=["a", "b", "c", "d"])

    a, b, c, d = asyncio.run(run())
    assert a == PNG and d == PNG
    assert isinstance(b, FetchFailed) and b.item == "b" and "HTTP 404" in b.message
    assert isinstance(c, FetchRefused) and c.item == "c" and "scheme 'ftp'" in c.message


@pytest.mark.parametrize("with_length", [True, False])
def test_byte_cap(server: MediaServer, with_length: bool) -> None:
    cap = 100_000
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, max_bytes=cap)
    length = "&length=1" if with_length else ""
    assert len(fetch(server.url(f"/stream?bytes={cap}{length}"), cfg)) == cap  # exactly at the cap
    with pytest.raises(MediaTooLarge) as err:
        fetch(server.url(f"/stream?bytes={cap + 1}{length}"), cfg)
    assert err.value.status == 413
    # With a Content-Length the refusal happens before the body is read.
    assert ("Content-Length" in err.value.message) == with_length


def test_byte_cap_counts_decompressed_bytes(server: MediaServer) -> None:
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, max_bytes=100_000)
    assert fetch(server.url("/gzip?bytes=100000"), cfg) == bytes(100_000)
    with pytest.raises(MediaTooLarge, match="body exceeds"):  # ~10 kB on the wire, 10 MB inflated
        fetch(server.url("/gzip?bytes=10000000"), cfg)


def test_html_served_as_image_is_refused_by_decode(server: MediaServer) -> None:
    data = fetch(server.url("/html"))  # Content-Type says image/jpeg; the bytes say otherwise
    with pytest.raises(UnsupportedMedia, match="HTML"):
        decode_image(data, item="html")


def test_slow_server_times_out_with_504(server: MediaServer) -> None:
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, total_timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(FetchTimeout) as err:
        fetch(server.url("/trickle?bytes=4096&chunk=16&interval=0.05"), cfg)  # would take ~13 s
    assert err.value.status == 504 and "0.5s" in err.value.message
    assert time.perf_counter() - t0 < 3.0


def test_connect_timeout_is_504() -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, so connect() hangs.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for s in fillers:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        try:
            cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, connect_timeout_s=0.3, total_timeout_s=10.0)
            with pytest.raises(FetchTimeout, match=r"could not connect within 0\.3s") as err:
                fetch(f"http://127.0.0.1:{port}/x", cfg)
            assert err.value.status == 504
        finally:
            for s in fillers:
                s.close()


def test_added_latency_counts_against_the_deadline(server: MediaServer) -> None:
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, total_timeout_s=0.1)
    with pytest.raises(FetchTimeout):
        fetch(server.url("/m/slow0.bin"), cfg)  # answers after 200 ms


def test_redirect_cap(server: MediaServer) -> None:
    cfg = FetchConfig(allow_cidrs=LOCAL.allow_cidrs, max_redirects=3)
    assert fetch(server.url("/hops/3"), cfg) == b"ok"  # exactly 3 redirects
    with pytest.raises(FetchRefused, match="more than 3 redirects"):
        fetch(server.url("/hops/4"), cfg)


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirect_codes_are_followed(server: MediaServer, code: int) -> None:
    assert fetch(server.url(f"/redirect?code={code}&to=/m/img.png")) == PNG


@pytest.mark.parametrize("code", [400, 403, 404, 500, 503])
def test_http_errors(server: MediaServer, code: int) -> None:
    with pytest.raises(FetchFailed, match=f"HTTP {code}") as err:
        fetch(server.url(f"/status/{code}"))
    assert err.value.status == 400


def test_connection_refused_is_fetch_failed() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(FetchFailed, match="connection"):
        fetch(f"http://127.0.0.1:{port}/x")


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a", "gopher://x/", "javascript:alert(1)", "/relative/path"]
)
def test_unsupported_schemes_are_refused(url: str) -> None:
    with pytest.raises(FetchRefused, match="scheme"):
        fetch(url)


# -- data: ------------------------------------------------------------------------------------------


def test_data_uri_forms() -> None:
    b64 = base64.b64encode(PNG).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert fetch(f"data:image/png;base64,{b64}") == PNG
    assert fetch(f"data:image/png;base64,{wrapped}") == PNG  # line-wrapped
    assert fetch(f"data:image/png;base64,{b64.rstrip('=')}") == PNG  # padding omitted
    assert fetch(f"data:image/png;base64,{quote(b64)}") == PNG  # percent-escaped
    assert fetch(f"DATA:image/png;name=a.png;BASE64,{b64}") == PNG
    assert fetch(f"data:application/octet-stream,{quote(PNG)}") == PNG  # percent-encoded bytes
    assert fetch("data:,hello%20world") == b"hello world"


def test_large_data_uri_is_decoded_off_loop() -> None:
    payload = os.urandom(600_000)  # over the inline threshold: decoded in a worker thread
    assert fetch("data:;base64," + base64.b64encode(payload).decode()) == payload


@pytest.mark.parametrize(
    "url", ["data:image/png;base64,@@@@", "data:image/png;base64,a", "data:;base64,ab=c", "data:image/png"]
)
def test_bad_data_uris(url: str) -> None:
    with pytest.raises(BadMedia):
        fetch(url)


def test_data_uri_byte_cap() -> None:
    b64 = base64.b64encode(bytes(1000)).decode()
    with pytest.raises(MediaTooLarge):
        decode_data_url(f"data:;base64,{b64}", max_bytes=999)
    with pytest.raises(MediaTooLarge):
        decode_data_url("data:," + "a" * 1000, max_bytes=999)
    with pytest.raises(MediaTooLarge):  # 10 MB of text against a 1 kB cap
        decode_data_url("data:;base64," + "A" * 10_000_000, max_bytes=1000)
    assert len(decode_data_url(f"data:;base64,{b64}", max_bytes=1000)) == 1000


# -- file: ------------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ (the file root) with a.png, sub/b.png, links in and out; secret.txt beside root."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(PNG)
    (root / "sub" / "b.png").write_bytes(b"b")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (root / "inside_link.png").symlink_to(root / "sub" / "b.png")
    (root / "outside_link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "outside_dir").symlink_to(tmp_path, target_is_directory=True)
    return root


def _file_cfg(root: Path, max_bytes: int = 1 << 20) -> FetchConfig:
    return FetchConfig(file_root=str(root), max_bytes=max_bytes)


def test_file_urls_under_root(tree: Path) -> None:
    cfg = _file_cfg(tree)
    assert fetch(f"file://{tree}/a.png", cfg) == PNG
    assert fetch(f"file:{tree}/sub/b.png", cfg) == b"b"
    assert fetch(f"file://localhost{tree}/sub/../a.png", cfg) == PNG  # stays inside: fine
    assert fetch(f"file://{tree}/inside_link.png", cfg) == b"b"  # a link that stays inside: fine


@pytest.mark.parametrize(
    "rel",
    [
        "../secret.txt",
        "sub/../../secret.txt",
        "%2e%2e/secret.txt",
        "outside_link.txt",
        "outside_dir/secret.txt",
        "",
    ],
)
def test_file_traversal_and_symlink_escape_refused(tree: Path, rel: str) -> None:
    with pytest.raises(FetchRefused, match="outside the allowed root"):
        fetch(f"file://{tree}/{rel}", _file_cfg(tree))


def test_file_policy_errors(tree: Path) -> None:
    with pytest.raises(FetchRefused, match="no file root"):
        fetch(f"file://{tree}/a.png", FetchConfig())
    with pytest.raises(FetchRefused, match="remote host"):
        fetch(f"file://evil.example{tree}/a.png", _file_cfg(tree))
    with pytest.raises(FetchRefused, match="not a regular file"):
        fetch(f"file://{tree}/sub", _file_cfg(tree))
    with pytest.raises(FetchFailed, match="does not exist"):
        fetch(f"file://{tree}/missing.png", _file_cfg(tree))
    with pytest.raises(MediaTooLarge):
        fetch(f"file://{tree}/a.png", _file_cfg(tree, max_bytes=len(PNG) - 1))


def test_fifo_is_refused_without_blocking(tree: Path) -> None:
    os.mkfifo(tree / "pipe")  # opening a FIFO for reading would block forever without O_NONBLOCK
    with pytest.raises(FetchRefused, match="not a regular file"):
        fetch(f"file://{tree}/pipe", _file_cfg(tree))


def test_symlink_swapped_in_after_the_check_is_not_followed(tree: Path, tmp_path: Path) -> None:
    # The realpath check saw a plain directory `sub`; by open time it is a link to outside.
    # Opening component by component with O_NOFOLLOW refuses instead of following it.
    (tree / "sub" / "b.png").unlink()
    (tree / "sub").rmdir()
    (tree / "sub").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(FetchRefused, match="symlink"):
        _open_beneath(str(tree), ["sub", "secret.txt"], "sub/secret.txt", "item")
    with pytest.raises(FetchRefused, match="symlink"):
        _open_beneath(str(tree), ["outside_link.txt"], "outside_link.txt", "item")
