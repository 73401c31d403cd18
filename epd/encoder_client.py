"""HTTP client the ingress uses to talk to encoder workers (local ports or remote hosts).

A 4xx from a worker is the item's fault (bad media) and is raised as ``APIError`` carrying the
worker's status and message; connection errors, 429 and 5xx raise the router's
``WorkerUnavailable`` so that it tries the next worker of the ring (a refusal for load carries the
worker's Retry-After, its expected wait). One 503 is neither: ``cache_full`` (the node cache is
held by leases, whichever worker of the node encodes) is raised as ``WorkerCacheFull``, with the
bytes the entry needed, for the request to decide (``epd.media_lease``).
"""

from __future__ import annotations

from typing import Any

import aiohttp
from safetensors.torch import load as load_safetensors

from epd.encoder_router import WorkerUnavailable
from epd_common.admission import DEADLINE_HEADER
from epd_common.errors import CACHE_FULL, ENTRY_BYTES_HEADER, APIError
from epd_common.messages.encode_reply import EncodeReply


class WorkerCacheFull(APIError):
    """A worker encoded the item but the node cache had no room that leases did not hold."""

    def __init__(
        self, message: str, item: str, needed_bytes: int | None, retry_after_s: float | None
    ) -> None:
        super().__init__(503, message, type=CACHE_FULL, param=item, retry_after_s=retry_after_s or 1.0)
        self.needed_bytes = needed_bytes


class EncoderClient:
    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 600.0) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def encode(
        self,
        worker_url: str,
        data: bytes,
        modality: str,
        item: str,
        deadline_s: float | None = None,
        track: bool = False,
    ) -> EncodeReply:
        """``deadline_s``: what is left of the client's deadline (the worker admits against it);
        ``track``: ``data`` is a video and its sound track is wanted (modality audio)."""
        params = {"modality": modality, "item": item, **({"track": "1"} if track else {})}
        headers = {DEADLINE_HEADER: f"{deadline_s:.3f}"} if deadline_s is not None else None
        try:
            async with self.session.post(
                f"{worker_url}/encode", data=data, params=params, timeout=self.timeout, headers=headers
            ) as resp:
                if resp.status == 200:
                    raw = await resp.read()
                    try:
                        return EncodeReply.decode(raw)
                    except ValueError as exc:  # the worker's fault: the ring tries the next one
                        raise WorkerUnavailable(
                            worker_url, f"answered 200 with a reply that is not an EncodeReply: {exc}"
                        ) from exc
                body = await _json_or_none(resp)
                err = (body or {}).get("error") or {}
                if resp.status == 503 and isinstance(err, dict) and err.get("type") == CACHE_FULL:
                    raise WorkerCacheFull(
                        str(err.get("message", "the node cache is full of leased entries")),
                        item,
                        _int_header(resp, ENTRY_BYTES_HEADER),
                        _retry_after(resp),
                    )
                if 400 <= resp.status < 500 and resp.status != 429:
                    raise APIError(
                        resp.status,
                        str(err.get("message", f"encoder refused the item ({resp.status})")),
                        type=str(err.get("type", "bad_media")),
                        param=item,
                    )
                message = str(((body or {}).get("error") or {}).get("message", ""))
                raise WorkerUnavailable(
                    worker_url,
                    f"answered {resp.status}" + (f": {message}" if message else ""),
                    status=resp.status,
                    retry_after_s=_retry_after(resp) if resp.status in (429, 503) else None,
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise WorkerUnavailable(worker_url, f"{type(exc).__name__}: {exc}") from exc

    async def health(self, worker_url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
        try:
            async with self.session.get(
                f"{worker_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return await _json_or_none(resp) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def fetch_embedding(self, ref_url: str) -> Any:
        """Download a remote embedding (safetensors body, tensor 'embedding') -> torch.Tensor."""
        try:
            async with self.session.get(ref_url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise WorkerUnavailable(ref_url, f"answered {resp.status}", status=resp.status)
                payload = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise WorkerUnavailable(ref_url, str(exc)) from exc
        return load_safetensors(payload)["embedding"]


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    """A Retry-After given in seconds (the workers' form); None when absent or a date."""
    try:
        return float(resp.headers.get("Retry-After", ""))
    except ValueError:
        return None


def _int_header(resp: aiohttp.ClientResponse, name: str) -> int | None:
    value = resp.headers.get(name, "")
    return int(value) if value.isdigit() else None


async def _json_or_none(resp: aiohttp.ClientResponse) -> dict[str, Any] | None:
    try:
        body = await resp.json(content_type=None)
    except (ValueError, aiohttp.ContentTypeError):
        return None
    return body if isinstance(body, dict) else None
