"""HTTP client the ingress uses to talk to an LLM server's OpenAI-compatible endpoints (our engine's
``/v1/completions``; a server kind's client may call another path, e.g. vLLM's ``/v1/chat/completions``).

The engine's own errors (4xx) pass through with their message; an unreachable or crashed engine
becomes a 503 with Retry-After so that clients retry once the supervisor has restarted it.

Streams are read as bytes: each ``data:`` line is decoded once by msgspec (the router counts its
tokens and reads its usage), and a chunk that carries only choices keeps its bytes
(``StreamedChunk.raw``) so that a route which passes chunks through as they are writes them out
without encoding them again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import msgspec
from aiohttp.http_exceptions import HttpProcessingError

from epd.engine_body import EngineBody, streamed
from epd.server_pool.refusals import MAX_WAIT_S
from epd_common.admission import DEADLINE_HEADER
from epd_common.errors import APIError


class StreamedChunk(dict[str, Any]):
    """One streamed chunk as the server wrote it, decoded. ``raw``: the server's JSON bytes when
    the chunk has no ``usage`` and no ``kv_transfer`` (the fields the pool rewrites: the P/D split
    replaces the usage's cached tokens and takes the transfer report off the first chunk); None
    otherwise, when the chunk must be encoded from the dict. ``opaque``: not decoded at all (a
    relayed stream's token chunk: the dict is empty, ``raw`` is all there is)."""

    __slots__ = ("opaque", "raw")

    def __init__(self, decoded: dict[str, Any], raw: bytes, opaque: bool = False) -> None:
        super().__init__(decoded)
        self.raw: bytes | None = None if "usage" in decoded or "kv_transfer" in decoded else raw
        self.opaque = opaque


def _needs_decoding(data: bytes) -> bool:
    """Whether a relayed chunk carries what epd reads: an error, or the usage (a token chunk of
    vLLM's has neither key; a text that spells one is escaped, ``\"usage\"``, so it never
    matches)."""
    return data.startswith(b'{"error"') or b'"usage"' in data


_decode_json = msgspec.json.Decoder().decode
log = logging.getLogger("epd.engine_client")


def engine_unavailable(detail: str) -> APIError:
    return APIError(
        503, f"the LLM engine is unavailable: {detail}", type="engine_unavailable", retry_after_s=2.0
    )


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float = 600.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)

    large_bodies = False  # a server kind whose requests carry tensors serializes them off the loop
    # how answers to clients name this server (its URL is internal: logs only); the pool numbers them
    label = "the LLM server"

    def prepare(self, body: EngineBody) -> EngineBody:
        """The body as this server takes it (a server kind's client names its served model here)."""
        return body

    async def complete(
        self,
        body: EngineBody,
        request_id: str | None = None,
        deadline_s: float | None = None,
        path: str = "/v1/completions",
    ) -> dict[str, Any]:
        """Non-streaming call of ``path`` -> the server's JSON body. ``request_id`` goes out as
        ``X-Request-Id``: the engine lists it in its /health while it holds the request;
        ``deadline_s`` as ``X-Request-Timeout``: the engine admits against it."""
        try:
            async with await self._post(
                path, self.prepare(streamed(body, False)), request_id, deadline_s
            ) as resp:
                payload = await _read_json(resp)
                self.raise_for_status(resp, payload)
                choices = payload.get("choices")
                if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
                    raise self.malformed("an answer without choices")
                return payload
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def stream(
        self,
        body: EngineBody,
        request_id: str | None = None,
        deadline_s: float | None = None,
        path: str = "/v1/completions",
        relay: bool = False,
    ) -> AsyncGenerator[StreamedChunk, None]:
        """Streaming completion: yields each SSE ``data:`` JSON chunk until ``[DONE]``. ``relay``:
        token chunks are not decoded (``opaque``): only an error or the usage is.

        Closing the generator (client went away) closes the engine connection, which aborts the
        request in the engine.
        """
        try:
            async with await self._post(
                path, self.prepare(streamed(body, True)), request_id, deadline_s
            ) as resp:
                if resp.status != 200:
                    self.raise_for_status(resp, await _read_json(resp))
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    if relay and not _needs_decoding(data):
                        yield StreamedChunk({}, data, opaque=True)
                        continue
                    try:
                        decoded = _decode_json(data)
                    except msgspec.DecodeError as exc:
                        raise self.malformed(f"a stream chunk that is not JSON ({exc})") from exc
                    if not isinstance(decoded, dict):
                        raise self.malformed("a stream chunk that is not a JSON object")
                    chunk = StreamedChunk(decoded, data)
                    if "error" in chunk:
                        raise self._stream_error(chunk["error"])
                    yield chunk
        except (ValueError, HttpProcessingError) as exc:  # a line beyond the reader's buffer
            raise self.malformed(f"a stream line too long to read ({type(exc).__name__})") from exc
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self._unavailable(exc) from exc

    def malformed(self, what: str) -> APIError:
        """An answer this server should never give (not JSON, missing fields, a line too long):
        a 502 naming the server by its label (its address goes to the log only), never a 500."""
        log.warning("%s (%s) sent %s", self.label, self.base_url, what)
        return APIError(502, f"{self.label} sent {what}", type="upstream_error")

    def _unavailable(self, exc: BaseException) -> APIError:
        """Unreachable: the client learns which server by label and what kind of failure; the
        address and the library's text (which name hosts and ports) go to the log."""
        log.warning("%s (%s) unreachable: %s: %s", self.label, self.base_url, type(exc).__name__, exc)
        return engine_unavailable(f"{self.label}: {type(exc).__name__}")

    def _stream_error(self, err: Any) -> APIError:
        """An error event in a stream: a 4xx (the request's fault) keeps its status, anything else
        is the server's failure (502)."""
        if not isinstance(err, dict):
            return self.malformed("an error event that is not an object")
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 500 else 502
        return APIError(status, str(err.get("message")), type=str(err.get("type") or "upstream_error"))

    def raise_for_status(self, resp: aiohttp.ClientResponse, payload: dict[str, Any]) -> None:
        """A non-200 answer as the APIError the client gets (a server kind's client may map its
        server's statuses otherwise)."""
        _raise_for_engine_status(resp, payload)

    async def _post(
        self, path: str, body: EngineBody, request_id: str | None, deadline_s: float | None
    ) -> aiohttp.ClientResponse:
        """POST ``body``; once more on a fresh connection when a pooled one turns out closed by the
        server before it answered (a server whose keep-alive is shorter than the pool's: vLLM's
        uvicorn keeps idle connections 5 s, the pool 15). A refused connection is not retried."""
        # a body of embeddings is megabytes of base64: serialized off the event loop, once
        data = await asyncio.to_thread(_dumps, body) if self.large_bodies else _dumps(body)
        headers = {**_headers(request_id, deadline_s), "Content-Type": "application/json"}
        for attempt in (0, 1):
            try:
                return await self.session.post(
                    f"{self.base_url}{path}", data=data, timeout=self.timeout, headers=headers
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt or isinstance(exc, aiohttp.ClientConnectorError):
                    raise  # refused, or a second failure: the server is down
        raise AssertionError("unreachable")

    async def get_json(self, path: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """GET ``path`` -> its JSON object, or None when unreachable or not 200."""
        try:
            async with self.session.get(
                f"{self.base_url}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return await _read_json(resp) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None

    async def health(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The /health body ({} for a server that answers 200 with none), None when down."""
        return await self.get_json("/health", timeout_s)


def _dumps(body: EngineBody) -> bytes:
    """The request's JSON (msgspec: a body may hold message Structs, e.g. EmbeddingRefs)."""
    return msgspec.json.encode(body)


def _headers(request_id: str | None, deadline_s: float | None) -> dict[str, str]:
    out = {"X-Request-Id": request_id} if request_id else {}
    if deadline_s is not None:
        out[DEADLINE_HEADER] = f"{deadline_s:.3f}"
    return out


async def _read_json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        body = _decode_json(await resp.read())
    except ValueError:  # msgspec.DecodeError: not JSON
        body = None
    return body if isinstance(body, dict) else {}


def _raise_for_engine_status(resp: aiohttp.ClientResponse, payload: dict[str, Any]) -> None:
    if resp.status == 200:
        return
    err = payload.get("error", {}) if isinstance(payload.get("error"), dict) else {}
    message = str(err.get("message", f"engine answered {resp.status}"))
    if resp.status in (429, 503):
        try:
            retry = float(resp.headers.get("Retry-After", "1"))
        except ValueError:  # an HTTP date (a proxy's): not what the engines send
            retry = 1.0
        # a server's word, bounded: no day-long shut-out, no nan reaching the client's header
        retry = min(max(retry, 0.0), MAX_WAIT_S) if math.isfinite(retry) else 1.0
        raise APIError(
            resp.status,
            message,
            type=str(err.get("type", "overloaded")),
            param=err.get("param"),
            retry_after_s=retry,
        )
    if 400 <= resp.status < 500:
        raise APIError(
            resp.status, message, type=str(err.get("type", "invalid_request_error")), param=err.get("param")
        )
    raise engine_unavailable(message)
