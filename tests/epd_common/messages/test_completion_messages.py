"""The engine's completion request and response messages: strict decoding that names the bad
field, and responses that encode to the JSON the engine has always written."""

from __future__ import annotations

import json

import msgspec
import pytest

from epd_common.messages.completion_request import KVTransfer, RequestBodyError, decode_completion_request
from epd_common.messages.completion_response import (
    CompletionChoice,
    CompletionChunk,
    KVTransferReport,
    encode,
    kv_transfer_report,
    sse_event,
    usage,
)
from epd_common.messages.embedding_ref import EmbeddingRef

REF = EmbeddingRef("ab" * 32, "float32", (4, 8), ((1, 4, 4),), "image", None, None, ())


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "x", "stop": [1]}', "stop"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": [1, true]}', "prompt"),
        (b'{"prompt": "x", "multimodal": "k"}', "multimodal"),
        (b'{"prompt": "x", "multimodal": [{"key": "k"}]}', "multimodal[0]"),
        (b'{"prompt": "x", "kv_transfer": [1]}', "kv_transfer"),
        (b"[1, 2]", None),
        (b"{not json", None),
    ],
)
def test_a_bad_field_is_named(raw: bytes, param: str | None) -> None:
    with pytest.raises(RequestBodyError) as err:
        decode_completion_request(raw)
    assert err.value.param == param and str(err.value)


def test_the_second_bad_ref_is_named_by_its_index() -> None:
    good = REF.to_json()
    bad = {**good, "shape": [4, 8, 1]}
    raw = json.dumps({"prompt": [1], "multimodal": [good, bad]}).encode()
    with pytest.raises(RequestBodyError) as err:
        decode_completion_request(raw)
    assert err.value.param == "multimodal[1]" and "shape" in str(err.value)


def test_absent_null_and_unknown_fields() -> None:
    body = decode_completion_request(b'{"prompt": [1, 2], "max_tokens": null, "model": "m", "user": "u"}')
    assert body.prompt == [1, 2] and body.max_tokens is None and body.temperature is None
    assert decode_completion_request(b'{"prompt": "x"}').max_tokens is msgspec.UNSET
    transfer = decode_completion_request(
        b'{"kv_transfer": {"import": {"id": "a"}, "first_token": 3}}'
    ).kv_transfer
    assert transfer is not None and transfer.handle == {"id": "a"} and transfer.first_token == 3
    assert decode_completion_request(b'{"kv_transfer": {"export": true}}').kv_transfer.handle is msgspec.UNSET  # type: ignore[union-attr]


def test_refs_decode_to_the_struct() -> None:
    raw = json.dumps({"prompt": [1], "multimodal": [REF.to_json()]}).encode()
    assert decode_completion_request(raw).multimodal == [REF]


def test_embedding_ref_json_round_trip() -> None:
    ref = EmbeddingRef("k1", "bfloat16", (6, 8), ((3, 2, 2),), "video", "http://x/k1", 0.5, (0.0, 0.5, 1.0))
    doc = ref.to_json()
    assert (
        doc["shape"] == [6, 8]
        and doc["grid_thw"] == [[3, 2, 2]]
        and doc["grid_t_timestamps"] == [0.0, 0.5, 1.0]
    )
    assert set(doc) == {f for f in ref.__struct_fields__}  # every field is written, defaults too
    assert EmbeddingRef.from_json(json.loads(json.dumps(doc))) == ref
    with pytest.raises(ValueError, match="shape"):
        EmbeddingRef.from_json({**doc, "shape": [6]})


def test_chunks_encode_as_before() -> None:
    choice = CompletionChoice(text="hi", finish_reason=None)
    chunk = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])
    assert json.loads(encode(chunk)) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}],
    }
    chunk.choices = []
    chunk.usage = usage(3, 2, 1)
    event = sse_event(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_the_kv_hand_off_report_reads_back_what_the_engine_writes() -> None:
    """The engine writes the report on its answer, the ingress's P/D hand-off reads it back from
    the decoded JSON; one Struct both sides import, so the wire shape is written once."""
    export = KVTransferReport(handle={"transport": "shm", "name": "x"}, bytes=96, kv_bytes=64, seconds=0.5)
    wire = json.loads(msgspec.json.encode(export))
    assert wire == {"handle": {"transport": "shm", "name": "x"}, "bytes": 96, "kv_bytes": 64, "seconds": 0.5}
    assert kv_transfer_report(wire) == export
    failed = KVTransferReport(imported=False, reason="checksum")
    assert json.loads(msgspec.json.encode(failed)) == {"imported": False, "reason": "checksum"}
    # absent, or not a report: no hand-off (the prompt is recomputed), never an exception
    assert kv_transfer_report(None) is None
    assert kv_transfer_report({"bytes": "many"}) is None and kv_transfer_report([1]) is None
    # the request side: an import as the decode engine decodes it
    body = decode_completion_request(
        msgspec.json.encode({"prompt": [1], "kv_transfer": KVTransfer(handle=export.handle, first_token=7)})
    )
    assert body.kv_transfer == KVTransfer(handle=export.handle, first_token=7)
