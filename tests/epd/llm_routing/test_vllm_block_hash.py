"""The router's recomputation of vLLM's block hashes and its reading of vLLM's event batches,
against vLLM's own code (the CPU build `make vllm-peer` installs, run in its own interpreter):
``hash_block_tokens`` with ``sha256_cbor`` over prompts with media items at every alignment, and
an ``EventBatch`` of vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` as its
publisher encodes it."""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_routing.vllm_block_hash import VLLMBlockNaming, full_block_hashes, media_ranges
from epd.llm_servers.vllm_launch import peer_python
from epd_common.messages.cache_keys import MediaSpan
from epd_common.messages.kv_events import BlockRemoved, BlockStored, decode_batch, external_hash

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)"),
]

# vLLM's own hashing: a request's mm features sorted by offset, extra keys per block from its
# generate_block_hash_extra_keys, hashes from hash_block_tokens (run in vLLM's interpreter)
_VLLM_HASHES = r"""
import json, sys
from types import SimpleNamespace
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
k.init_none_hash(sha256_cbor)
cases = json.loads(sys.stdin.read())
out = []
for case in cases:
    feats = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
             for o, n, i in case["media"]]
    req = SimpleNamespace(mm_features=feats, lora_request=None, cache_salt=None, prompt_embeds=None)
    ids, bs, parent, mm, hashes = case["ids"], case["bs"], None, 0, []
    for b in range(len(ids) // bs):
        extra, mm = k.generate_block_hash_extra_keys(req, b * bs, (b + 1) * bs, mm)
        parent = k.hash_block_tokens(sha256_cbor, parent, ids[b * bs:(b + 1) * bs], extra)
        hashes.append(parent.hex())
    out.append(hashes)
print(json.dumps(out))
"""

_VLLM_EVENTS = r"""
import sys
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
import msgspec
stored = BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(8)),
                     block_size=4, lora_id=None, medium="GPU", lora_name=None,
                     extra_keys=[(("key-a", 1),), None], group_idx=0,
                     kv_cache_spec_kind="full_attention")
batch = EventBatch(ts=12.5, events=[stored, BlockRemoved(block_hashes=[7], medium="GPU"),
                                    AllBlocksCleared()], data_parallel_rank=0)
sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(batch))
"""


def _run_in_vllm(script: str, stdin: bytes = b"") -> bytes:
    python = peer_python()
    assert python is not None
    done = subprocess.run(
        [str(python), "-c", script], input=stdin, capture_output=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout


def _cases() -> list[dict[str, object]]:
    """Prompts with 0-3 media items at random places, some crossing blocks, some adjacent, one
    exactly filling a block, block sizes 4, 16, 128."""
    rng = random.Random(0)
    cases: list[dict[str, object]] = []
    for bs in (4, 16, 128):
        for trial in range(8):
            n = bs * rng.randint(1, 6) + rng.randint(0, bs - 1)
            ids = [rng.randrange(0, 150_000) for _ in range(n)]
            media, at = [], rng.randint(0, max(0, n // 3))
            for j in range(trial % 4):
                length = rng.choice([1, bs, bs + 3, max(1, n // 5)])
                if at + length > n:
                    break
                media.append((at, length, f"{trial:02d}{j}" + "ab" * 31))
                at += length + rng.choice([0, 0, 2, bs])
            cases.append({"ids": ids, "bs": bs, "media": media})
    cases.append({"ids": list(range(8)), "bs": 4, "media": [(0, 4, "k" * 64), (4, 4, "k" * 64)]})
    return cases


def test_block_hashes_equal_vllms_own() -> None:
    cases = _cases()
    theirs = json.loads(_run_in_vllm(_VLLM_HASHES, json.dumps(cases).encode()))
    naming = VLLMBlockNaming()
    for case, want in zip(cases, theirs, strict=True):
        ids, bs = case["ids"], case["bs"]
        assert isinstance(ids, list) and isinstance(bs, int) and isinstance(case["media"], list)
        spans = [MediaSpan(o, n, key, item) for item, (o, n, key) in enumerate(case["media"])]
        ours = full_block_hashes(ids, media_ranges(spans), bs)
        assert [h.hex() for h in ours] == want, case
        names = naming.names(RoutingPrompt(ids, spans), bs)
        assert names == [external_hash(bytes.fromhex(h)) for h in want]


def test_vllms_event_batches_decode() -> None:
    batch = decode_batch(_run_in_vllm(_VLLM_EVENTS))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == (2**64 - 1, 7) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(8)) and stored.block_size == 4
    assert stored.extra_keys == ((("key-a", 1),), None)
    assert removed.block_hashes == (7,)
    assert type(cleared).__name__ == "AllBlocksCleared"
