"""``POST /v1/encode`` and ``GET /v1/embeddings/{key}``.

Encode accepts a multipart upload (every file field is one item) or JSON
``{"items": [{"url": ...} | {"data": ...}]}``; it answers per item the MediaKey, modality,
grid_thw, token count, whether the node cache already had it, and stage timings. With
``?embeddings=true`` the tensors come back too: base64 in the JSON, or with
``&format=safetensors`` a safetensors body whose metadata carries the same JSON.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from epd.http import read_json
from epd.ingress import Ingress
from epd.media_pipeline import EncodedItem
from epd.media_request import MediaSource, check_item_count, json_items_sources, upload_source
from epd_common.admission import request_deadline_s
from epd_common.errors import APIError, bad_request

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")


async def _sources(ingress: Ingress, request: Request) -> list[MediaSource]:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    max_items = ingress.config.max_items
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=max_items, max_fields=max_items)
        except (MultiPartException, HTTPException) as exc:
            # Inside an app starlette re-raises parser errors as HTTPException(400, message).
            detail = exc.message if isinstance(exc, MultiPartException) else exc.detail
            raise APIError(400, f"malformed or over-limit multipart body: {detail}", param="body") from exc
        try:
            uploads = [(k, v) for k, v in form.multi_items() if isinstance(v, UploadFile)]
            check_item_count(len(uploads), max_items, "files")
            return [
                upload_source(up.filename or field, up.content_type or "", await up.read(), i)
                for i, (field, up) in enumerate(uploads)
            ]
        finally:
            await form.close()
    if ctype == "application/json":
        return json_items_sources(await read_json(request, ingress.config.max_json_body_bytes), max_items)
    raise APIError(
        415,
        f"content type {ctype or 'none'!r} is not accepted; send multipart/form-data or application/json",
        type="unsupported_media_type",
        param="content-type",
    )


def _item_json(item: EncodedItem) -> dict[str, Any]:
    ref = item.ref
    return {
        "name": item.name,
        "key": ref.key,
        "modality": ref.modality,
        "grid_thw": [list(g) for g in ref.grid_thw],
        "num_tokens": ref.num_tokens,
        "hidden_size": ref.shape[1],
        "dtype": ref.dtype,
        "cache_hit": item.cache_hit,
        "timings_ms": {k: round(v, 3) for k, v in item.timings_ms.items()},
    }


def _tensor(ingress: Ingress, key: str) -> torch.Tensor:
    cached = ingress.cache.get(key)
    if cached is None:
        raise APIError(
            404, f"embedding {key} is not in the node cache (evicted or never encoded)", type="not_found"
        )
    return cached.tensor


async def encode(ingress: Ingress, request: Request) -> Response:
    with_embeddings = request.query_params.get("embeddings", "false").lower() in ("1", "true", "yes")
    fmt = request.query_params.get("format", "json")
    if fmt not in ("json", "safetensors"):
        raise bad_request(f"format must be 'json' or 'safetensors', got {fmt!r}", "format")
    deadline = request_deadline_s(request.headers, ingress.config.max_queue_wait_s)
    ingress.pipeline.check_capacity(1, deadline)  # a full pipeline costs a refused request no parsing
    sources = await _sources(ingress, request)
    if not with_embeddings:
        items = await ingress.pipeline.resolve_all(sources, deadline)
        return JSONResponse({"object": "list", "data": [_item_json(it) for it in items]})
    # The entries are leased until read (``epd.media_lease``): a request's own items cannot evict
    # each other before the answer has them, and 413 says when they cannot fit the cache together.
    held = ingress.pipeline.lease_for(deadline)
    try:
        items = await ingress.pipeline.resolve_all(sources, deadline, held)
        # the tensors stay valid once read, even if the entries are evicted after the release
        tensors = {it.ref.key: _tensor(ingress, it.ref.key) for it in items}
    finally:
        held.release()
    body: dict[str, Any] = {"object": "list", "data": [_item_json(it) for it in items]}
    if fmt == "safetensors":
        payload = save_safetensors(
            {f"embedding.{i}": tensors[it.ref.key].contiguous() for i, it in enumerate(items)},
            metadata={"items": json.dumps(body["data"])},
        )
        return Response(payload, media_type="application/octet-stream")
    for entry, it in zip(body["data"], items, strict=True):
        t = tensors[it.ref.key].contiguous()
        entry["embedding"] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode(),
        }
    return JSONResponse(body)


async def embedding(ingress: Ingress, request: Request) -> Response:
    key = request.path_params["key"]
    if not _KEY_RE.match(key):
        raise bad_request("the key must be a lowercase hex MediaKey", "key")
    cached = ingress.cache.get(key)
    if cached is None:
        raise APIError(404, f"embedding {key} is not in the node cache", type="not_found", param="key")
    ref = cached.ref
    payload = save_safetensors(
        {"embedding": cached.tensor.contiguous()},
        metadata={
            "key": ref.key,
            "modality": ref.modality,
            "grid_thw": json.dumps([list(g) for g in ref.grid_thw]),
        },
    )
    return Response(payload, media_type="application/octet-stream")
