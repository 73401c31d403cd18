"""Download media bytes for a request: ``http(s)``, ``data:`` and ``file:`` URLs.

One ``Fetcher`` owns one aiohttp ``ClientSession`` for the life of the process, so connections
are pooled (``limit_total`` overall, ``limit_per_host`` per host) and every download of every
request shares them. The URLs of one request download concurrently (``fetch_many``).

What each download is held to:

- **SSRF guard** (media_io.ssrf): the host of the URL and of every redirect hop is checked; names
  are resolved by ``GuardedResolver``, which hands the connector only vetted addresses. aiohttp's
  own redirect following is off; we follow ``Location`` ourselves, at most ``max_redirects`` hops,
  and only to ``http(s)``.
- **Byte cap**: ``Content-Length`` is checked before the body is read, then bytes are counted
  while streaming (a server may omit or lie about the length; compressed bodies are counted after
  decompression) -> MediaTooLarge.
- **Time**: a connect timeout per socket and one total deadline for the whole download, redirects
  included -> FetchTimeout (504).
- ``data:`` URIs (base64 or percent-encoded) are decoded here; ``file:`` URLs are served only from
  under ``FetchConfig.file_root``, opened component by component without following symlinks so
  neither ``..`` nor a symlink (even one swapped in after the check) can escape the root.

Everything that goes wrong with one URL is a ``MediaError`` naming that URL; the session and the
other URLs are unaffected. This module knows nothing of media formats.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import os
import stat
from collections.abc import Sequence
from types import TracebackType
from urllib.parse import unquote, unquote_to_bytes

import aiohttp
from yarl import URL

from media_io.config import FetchConfig
from media_io.errors import BadMedia, FetchFailed, FetchRefused, FetchTimeout, MediaError, MediaTooLarge
from media_io.ssrf import AddressPolicy, GuardedResolver

_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 256 * 1024
# data: payloads at least this long are decoded in a worker thread so the event loop keeps serving.
_INLINE_DECODE_MAX = 256 * 1024


def describe_url(url: str, limit: int = 96) -> str:
    """A short, log-safe label for a URL (data: URIs can be megabytes long)."""
    if len(url) <= limit:
        return url
    return f"{url[: limit - 24]}... ({len(url)} chars)"


class Fetcher:
    """Async downloader with one shared, pooled, SSRF-guarded aiohttp session.

    Use as ``async with Fetcher(cfg) as f: data = await f.fetch(url)``, or call ``start()`` and
    ``close()`` around the process lifetime. Safe for concurrent use by many tasks of one loop.
    """

    def __init__(self, cfg: FetchConfig = FetchConfig()) -> None:
        self.cfg = cfg
        self.policy = AddressPolicy(cfg.allow_hosts, cfg.allow_cidrs)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Create the session (needs the running loop). Idempotent."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(self.policy),
            limit=self.cfg.limit_total,
            limit_per_host=self.cfg.limit_per_host,
        )
        # `sock_connect` rather than `connect`: waiting for a pooled connection is not a connect
        # failure. The total deadline is enforced per download (redirects included) in fetch().
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        headers = {"User-Agent": self.cfg.user_agent, **self.cfg.extra_headers}
        # trust_env=False: no proxy from the environment may bypass the address policy.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers, trust_env=False
        )

    async def close(self) -> None:
        """Close the session and its pooled connections. Idempotent."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Fetcher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- public API -------------------------------------------------------------------------------

    async def fetch(self, url: str, item: str | None = None) -> bytes:
        """The bytes at ``url`` (``http``, ``https``, ``data:``, ``file:``).

        ``item`` names the media in errors (defaults to a short form of the URL).
        Raises FetchRefused (policy), FetchFailed (HTTP error, connection or DNS failure),
        FetchTimeout (504), MediaTooLarge (byte cap), BadMedia (malformed data: URI).
        """
        item = item if item is not None else describe_url(url)
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme == "data":
            return await self._fetch_data(url, item)
        if scheme == "file":
            return await asyncio.to_thread(read_file_url, url, self.cfg.file_root, self.cfg.max_bytes, item)
        if scheme in ("http", "https"):
            return await self._fetch_http(url, item)
        raise FetchRefused(f"unsupported URL scheme {scheme!r} (use http, https, data or file)", item)

    async def fetch_many(
        self, urls: Sequence[str], items: Sequence[str] | None = None
    ) -> list[bytes | MediaError]:
        """Fetch all ``urls`` concurrently; result ``i`` is the bytes of ``urls[i]`` or its error.

        One URL's failure never fails the others. Concurrency is bounded by the session's pool.
        """
        assert items is None or len(items) == len(urls), "one item name per URL"
        names = list(items) if items is not None else [describe_url(u) for u in urls]
        return list(
            await asyncio.gather(*(self._fetch_or_error(u, n) for u, n in zip(urls, names, strict=True)))
        )

    async def _fetch_or_error(self, url: str, item: str) -> bytes | MediaError:
        try:
            return await self.fetch(url, item)
        except MediaError as exc:
            return exc

    # -- http(s) ----------------------------------------------------------------------------------

    async def _fetch_http(self, url: str, item: str) -> bytes:
        assert self._session is not None, "Fetcher used outside `async with` (call start() first)"
        total = self.cfg.total_timeout_s
        try:
            async with asyncio.timeout(total):
                return await self._follow(url, item)
        except TimeoutError as exc:
            # Our deadline, or aiohttp's socket connect timeout (a TimeoutError subclass).
            what = (
                f"could not connect within {self.cfg.connect_timeout_s:g}s"
                if isinstance(exc, aiohttp.ConnectionTimeoutError)
                else f"download did not finish within {total:g}s"
            )
            raise FetchTimeout(what, item) from exc

    async def _follow(self, url: str, item: str) -> bytes:
        """GET ``url``, following up to ``max_redirects`` redirects, each hop re-checked."""
        assert self._session is not None
        try:
            current = URL(url)
        except (ValueError, TypeError) as exc:
            raise FetchRefused(f"invalid URL: {exc}", item) from exc
        for hop in range(self.cfg.max_redirects + 1):
            self._check_target(current, item)
            try:
                async with self._session.get(current, allow_redirects=False) as resp:
                    if resp.status in _REDIRECT_CODES and "Location" in resp.headers:
                        current = self._next_hop(current, resp.headers["Location"], hop, item)
                        continue
                    if resp.status >= 400 or resp.status < 200 or resp.status in _REDIRECT_CODES:
                        raise FetchFailed(f"HTTP {resp.status} {resp.reason or ''} from {current}", item)
                    return await self._read_body(resp, item)
            except TimeoutError:
                raise  # aiohttp's connect timeout is also a ClientError; _fetch_http maps it
            except FetchRefused as exc:
                # Raised by GuardedResolver deep in the connector, which does not know the item.
                raise FetchRefused(exc.message, item) from exc
            except aiohttp.ClientConnectorDNSError as exc:
                raise FetchFailed(f"could not resolve host {current.host!r}", item) from exc
            except aiohttp.ClientResponseError as exc:
                raise FetchFailed(f"bad HTTP response from {current}: {exc.message}", item) from exc
            except aiohttp.ClientError as exc:
                raise FetchFailed(f"connection to {current.host!r} failed: {exc}", item) from exc
        raise AssertionError("unreachable: the loop returns or raises")

    def _check_target(self, url: URL, item: str) -> None:
        if url.scheme not in ("http", "https"):
            raise FetchRefused(f"redirect to unsupported scheme {url.scheme!r} refused", item)
        host = url.raw_host
        if not host:
            raise FetchRefused(f"URL has no host: {url}", item)
        self.policy.check_url_host(host, item)

    def _next_hop(self, current: URL, location: str, hop: int, item: str) -> URL:
        if hop >= self.cfg.max_redirects:
            raise FetchRefused(f"more than {self.cfg.max_redirects} redirects (last to {location!r})", item)
        try:
            return current.join(URL(location))
        except (ValueError, TypeError) as exc:
            raise FetchFailed(f"invalid redirect Location {location!r}: {exc}", item) from exc

    async def _read_body(self, resp: aiohttp.ClientResponse, item: str) -> bytes:
        cap = self.cfg.max_bytes
        if resp.content_length is not None and resp.content_length > cap:
            raise MediaTooLarge(f"Content-Length {resp.content_length} exceeds the {cap}-byte limit", item)
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > cap:
                raise MediaTooLarge(f"body exceeds the {cap}-byte limit (stopped at {size} bytes)", item)
            chunks.append(chunk)
        return b"".join(chunks)

    # -- data: ------------------------------------------------------------------------------------

    async def _fetch_data(self, url: str, item: str) -> bytes:
        if len(url) < _INLINE_DECODE_MAX:
            return decode_data_url(url, self.cfg.max_bytes, item)
        return await asyncio.to_thread(decode_data_url, url, self.cfg.max_bytes, item)


def decode_data_url(url: str, max_bytes: int, item: str | None = None) -> bytes:
    """The payload of a ``data:[<mediatype>][;base64],<data>`` URI (RFC 2397).

    Base64 payloads may contain whitespace, percent-escapes and may omit padding (as browsers
    accept); anything else outside the base64 alphabet is BadMedia. Raises MediaTooLarge when the
    decoded size exceeds ``max_bytes`` (hopeless payloads are refused before decoding).
    """
    head, sep, payload = url.partition(",")
    if not sep:
        raise BadMedia("malformed data: URI (no ',' before the payload)", item)
    params = [p.strip().lower() for p in head[len("data:") :].split(";")]
    if params and params[-1] == "base64":
        # Refuse hopeless payloads before allocating the decoded copy. Whitespace and escapes
        # make the text longer than 4/3 of the bytes, so allow 2x slack; the exact check follows.
        if len(payload) > 2 * (max_bytes * 4 // 3 + 4):
            raise MediaTooLarge(f"data: URI payload exceeds the {max_bytes}-byte limit", item)
        text = unquote(payload) if "%" in payload else payload
        text = "".join(text.split())  # drop ASCII whitespace (line-wrapped base64)
        text += "=" * (-len(text) % 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadMedia(f"invalid base64 in data: URI ({exc})", item) from exc
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaTooLarge(f"data: URI payload exceeds the {max_bytes}-byte limit", item)
    return data


# -- file: -----------------------------------------------------------------------------------------


def read_file_url(url: str, root: str | None, max_bytes: int, item: str | None = None) -> bytes:
    """The bytes of a ``file:`` URL whose real path lies under ``root`` (blocking; run in a thread).

    The URL path is absolute (``file:///srv/media/a.jpg``). Its realpath must be inside the
    realpath of ``root``; then the file is opened from a descriptor of ``root``, one component at
    a time with O_NOFOLLOW, so a symlink swapped in after the realpath check is refused rather
    than followed. Only regular files are read (never a FIFO or device).
    """
    if root is None:
        raise FetchRefused("file: URLs are disabled (no file root configured)", item)
    parsed = URL(url)
    if parsed.host not in (None, "", "localhost"):
        raise FetchRefused(f"file: URL with remote host {parsed.host!r} refused", item)
    path = unquote(parsed.raw_path)
    if "\x00" in path or not path.startswith("/"):
        raise FetchRefused(f"file: URL path {path!r} is not an absolute path", item)
    root_real = os.path.realpath(root)
    target = os.path.realpath(path)
    if os.path.commonpath([root_real, target]) != root_real or target == root_real:
        raise FetchRefused(f"file: path {path!r} is outside the allowed root", item)
    parts = os.path.relpath(target, root_real).split(os.sep)
    assert parts and ".." not in parts, parts

    fd = _open_beneath(root_real, parts, path, item)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FetchRefused(f"file: path {path!r} is not a regular file", item)
        if st.st_size > max_bytes:
            raise MediaTooLarge(f"file is {st.st_size} bytes, over the {max_bytes}-byte limit", item)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, _CHUNK):
            size += len(chunk)
            if size > max_bytes:  # the file grew after fstat
                raise MediaTooLarge(f"file exceeds the {max_bytes}-byte limit", item)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_beneath(root: str, parts: list[str], shown: str, item: str | None) -> int:
    """Open ``root/parts...`` without following any symlink; returns a file descriptor."""
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for comp in parts[:-1]:
            next_fd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise FetchFailed(f"file: path {shown!r} does not exist", item) from exc
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FetchRefused(f"file: path {shown!r} changed to a symlink while opening", item) from exc
        raise FetchFailed(f"cannot open file: path {shown!r}: {exc.strerror}", item) from exc
    finally:
        os.close(dir_fd)
