"""Reading a JSON request body without letting it hold up the event loop or the process.

    bytes:   at most ``max_bytes`` (``--max-json-body-bytes``, default 8 MiB: JSON carries URLs
             and a few data: URIs; uploads, up to ``--max-body-bytes``, go as multipart), counted
             as the body streams in (413 past it, before it is all in memory)
    objects: at most ``MAX_CONTAINERS`` objects and arrays, counted on the bytes before parsing
             (every ``{`` and ``[``, strings included: an over-count only): building Python
             objects is what a parse spends its time on (2.5 M empty lists: ~1 s here)
    parse:   msgspec; a body over ``OFF_LOOP_BYTES`` is parsed, and its depth walked, on a worker
             thread. msgspec holds the GIL while it builds the objects, so the thread spares the
             loop the walk, not the parse: the caps bound the parse (an 8 MiB array of small
             integers, the densest body the caps admit: ~70 ms on a 2-core Xeon)
    shape:   nesting at most ``MAX_DEPTH`` deep; numbers msgspec can hold (a 5,000-digit integer or
             1e999 is a 400, not a 500)

Every failure is an APIError naming what was wrong.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import Request

from epd_common.errors import APIError, bad_request

MAX_DEPTH = 64  # an OpenAI chat body is ~6 deep (messages[i].content[j].image_url.url)
MAX_CONTAINERS = 50_000  # objects + arrays: a chat of 64 media parts has a few hundred
OFF_LOOP_BYTES = 256 * 1024  # parsing this much takes ~0.3 ms on the loop; more goes to a thread


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the JSON body is larger than the limit of {limit} bytes (--max-json-body-bytes; send "
        "large media as multipart uploads or URLs)",
        type="request_too_large",
    )


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's JSON body, parsed and checked (see the module docstring)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > MAX_CONTAINERS:
        raise APIError(
            413,
            f"the JSON body has up to {containers} objects and arrays, over the limit of {MAX_CONTAINERS}",
            type="request_too_large",
            param="body",
        )
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels", "body") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", "body") from exc
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """400 when containers nest deeper than ``limit`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise bad_request(f"the body nests deeper than {limit} levels", "body")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
