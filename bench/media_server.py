"""A small loopback HTTP media server for tests and benchmarks.

An aiohttp web app running on its own event loop in a background thread, so synchronous tests,
``asyncio.run`` tests and benchmarks can all use it the same way::

    with MediaServer(latency_s=0.2) as server:          # or: base = server.start(); server.stop()
        server.add("cat.jpg", jpeg_bytes, "image/jpeg")
        url = server.url("/m/cat.jpg")

Routes (all GET):

    /m/{name}                 a blob registered with ``add`` (404 if unknown)
    /redirect?to=URL[&code=302]
                              one redirect to URL (absolute or relative)
    /hops/{n}?to=URL          a chain: /hops/n -> /hops/n-1 -> ... -> /hops/0 -> URL (or 200 "ok")
    /status/{code}            an empty response with that status
    /stream?bytes=N[&length=1][&chunk=K]
                              N zero bytes; with ``length=1`` a Content-Length header is sent,
                              otherwise the body is chunked (the size is only known by counting)
    /trickle?bytes=N[&chunk=K][&interval=S]
                              N bytes sent K at a time, S seconds apart (a slow server)
    /gzip?bytes=N             N zero bytes sent gzip-compressed (``Content-Encoding: gzip``): a
                              Content-Length of a few kB for a body that inflates to N bytes
    /html                     an HTML page served as ``image/jpeg`` (a misconfigured origin)

``latency_s`` (settable at any time) delays every response before its headers; ``hits`` counts
requests per path.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections import Counter
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from aiohttp.typedefs import Handler

HTML_PAGE = b"<!DOCTYPE html><html><head><title>Not Found</title></head><body>nope</body></html>"


@dataclass(frozen=True)
class Blob:
    data: bytes
    content_type: str = "application/octet-stream"
    delay_s: float = 0.0


class MediaServer:
    """Serves registered bytes and misbehaving-server scenarios on 127.0.0.1 (an ephemeral port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, latency_s: float = 0.0) -> None:
        self.host = host
        self.port = port
        self.latency_s = latency_s
        self.hits: Counter[str] = Counter()
        self._blobs: dict[str, Blob] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._base_url: str | None = None

    # -- content ----------------------------------------------------------------------------------

    def add(
        self, name: str, data: bytes, content_type: str = "application/octet-stream", delay_s: float = 0.0
    ) -> str:
        """Register ``data`` under ``/m/{name}``; returns its absolute URL (once started)."""
        self._blobs[name] = Blob(data, content_type, delay_s)
        return self.url(f"/m/{name}") if self._base_url else f"/m/{name}"

    def url(self, path: str) -> str:
        assert self._base_url is not None, "MediaServer.start() first"
        return self._base_url + path

    @property
    def base_url(self) -> str:
        assert self._base_url is not None, "MediaServer.start() first"
        return self._base_url

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving in a background thread; returns the base URL (``http://host:port``)."""
        assert self._thread is None, "already started"
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # surfaced to the starting thread below
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            assert self._runner is not None
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="media-server", daemon=True)
        self._thread.start()
        if not ready.wait(10.0):
            raise RuntimeError("media server did not start within 10 s")
        if failure:
            raise RuntimeError("media server failed to start") from failure[0]
        return self.base_url

    def stop(self) -> None:
        """Stop the server and join its thread (idempotent)."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._thread = None
        self._loop = None

    def __enter__(self) -> MediaServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def _start_site(self) -> None:
        app = web.Application(middlewares=[self._latency_middleware])
        app.router.add_get("/m/{name}", self._blob)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/hops/{n}", self._hops)
        app.router.add_get("/status/{code}", self._status)
        app.router.add_get("/stream", self._stream)
        app.router.add_get("/trickle", self._trickle)
        app.router.add_get("/gzip", self._gzip)
        app.router.add_get("/html", self._html)
        # A short shutdown timeout: stop() must not wait for a trickling response to finish.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._base_url = f"http://{host}:{port}"

    # -- handlers ---------------------------------------------------------------------------------

    @web.middleware
    async def _latency_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.hits[request.path] += 1
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        return await handler(request)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        blob = self._blobs.get(request.match_info["name"])
        if blob is None:
            raise web.HTTPNotFound()
        if blob.delay_s > 0:
            await asyncio.sleep(blob.delay_s)
        return web.Response(body=blob.data, content_type=blob.content_type)

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        code = int(request.query.get("code", "302"))
        return web.Response(status=code, headers={"Location": request.query["to"]})

    async def _hops(self, request: web.Request) -> web.StreamResponse:
        n = int(request.match_info["n"])
        to = request.query.get("to")
        if n > 0:
            location = f"/hops/{n - 1}" + (f"?to={to}" if to else "")
            return web.Response(status=302, headers={"Location": location})
        if to:
            return web.Response(status=302, headers={"Location": to})
        return web.Response(body=b"ok")

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=int(request.match_info["code"]), body=b"")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query["bytes"])
        chunk = int(request.query.get("chunk", "65536"))
        resp = web.StreamResponse()
        if request.query.get("length") == "1":
            resp.content_length = n
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        sent = 0
        try:
            while sent < n:
                k = min(chunk, n - sent)
                await resp.write(bytes(k))
                sent += k
            await resp.write_eof()
        except ConnectionError:
            pass  # the client stopped reading (byte cap): expected
        return resp

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("bytes", "1024"))
        chunk = int(request.query.get("chunk", "16"))
        interval = float(request.query.get("interval", "0.1"))
        resp = web.StreamResponse()
        resp.content_length = n
        await resp.prepare(request)
        sent = 0
        try:
            while sent < n:
                k = min(chunk, n - sent)
                await resp.write(b"\xff" * k)
                sent += k
                await asyncio.sleep(interval)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client gave up (timeout): expected
        return resp

    async def _gzip(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query["bytes"])
        body = gzip.compress(bytes(n), compresslevel=9, mtime=0)
        return web.Response(body=body, headers={"Content-Encoding": "gzip"})

    async def _html(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=HTML_PAGE, content_type="image/jpeg")
