"""vLLM's token route as epd writes it (epd/llm_servers/vllm_tokens.py): the request body from the
rendered prompt, and an image item that vLLM's own decoder reads back (its interpreter, from the
CPU build `make vllm-peer` installs) as the tensors epd encoded."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_servers.vllm_launch import peer_python
from epd.llm_servers.vllm_tokens import generate_body, image_item, sampling_params
from epd_common.messages.cache_keys import MediaSpan
from epd_common.messages.embedding_ref import EmbeddingRef


def _ref(key: str, rows: int) -> EmbeddingRef:
    return EmbeddingRef(key=key, dtype="float32", shape=(rows, 8), grid_thw=((1, 2, 2 * rows),))


def test_the_body_names_each_image_by_its_key_at_its_pads() -> None:
    refs = [_ref("k-a", 2), _ref("k-b", 3)]
    routing = RoutingPrompt([1, 9, 9, 2, 9, 9, 9, 3], [MediaSpan(4, 3, "k-b", 1), MediaSpan(1, 2, "k-a", 0)])
    sampling = {"max_tokens": 4, "temperature": 0, "top_logprobs": 2, "return_token_ids": True}
    body = generate_body(routing, refs, {"k-a": "A", "k-b": "B"}, sampling)
    assert body["token_ids"] == [1, 9, 9, 2, 9, 9, 9, 3] and body["output_mode"] == "text"
    assert body["return_token_ids"] is True
    assert body["sampling_params"] == {"max_tokens": 4, "temperature": 0, "logprobs": 2, "detokenize": True}
    assert body["features"] == {
        "mm_hashes": {"image": ["k-a", "k-b"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}, {"offset": 4, "length": 3}]},
        "kwargs_data": {"image": ["A", "B"]},
    }
    assert "features" not in generate_body(RoutingPrompt([1, 2]), [], {}, {})
    assert sampling_params({"stop": ["x"], "n": 1}) == {"stop": ["x"], "detokenize": True}


_DECODE = r"""
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
item = decode_mm_kwargs_item(sys.stdin.read())
out = {}
for key, elem in item.items():
    t = elem.data
    out[key] = {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.flatten().tolist(),
                "field": type(elem.field).__name__}
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)")
def test_vllm_decodes_the_image_item_epd_writes() -> None:
    emb = torch.randn(6, 8)
    encoded = image_item(emb, (1, 4, 6))
    python = peer_python()
    done = subprocess.run(
        [str(python), "-c", _DECODE], input=encoded.encode(), capture_output=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    item = json.loads(done.stdout)
    assert item["image_embeds"]["dtype"] == "torch.float32" and item["image_embeds"]["shape"] == [6, 8]
    assert torch.equal(torch.tensor(item["image_embeds"]["values"]).view(6, 8), emb)
    assert item["image_grid_thw"]["values"] == [1, 4, 6] and item["image_grid_thw"]["dtype"] == "torch.int64"
    assert item["image_embeds"]["field"] == "MultiModalFlatField"
    assert item["image_grid_thw"]["field"] == "MultiModalBatchedField"
