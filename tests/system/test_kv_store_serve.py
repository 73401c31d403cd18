"""Two ``epd serve`` sharing one ``redis-server`` with a host KV tier (``--store URL
--llm-engine-host-kv-bytes N``): a chat with an image whose KV the first node evicted returns on
the second node, whose engine fetches the pages from Redis, and answers with the greedy ids of a
node without tiers."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd_common.store.local_redis import LocalRedis
from tests.epd.conftest import ServeProcess, http_json
from tests.system.conftest import child_pids, serve_pair
from tests.system.test_pd_split import ask, data_uri, ids

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def tiered_pair() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    with LocalRedis(maxmemory_bytes=256 << 20) as store:
        args = [
            "--store",
            store.url,
            "--llm-engine-host-kv-bytes",
            str(64 << 20),
            # a device pool that holds one of these chats but not the fillers as well
            "--llm-engine-kv-memory-bytes",
            str(3 << 20),
            "--llm-torch-threads",
            "1",
        ]
        with serve_pair(args) as servers:
            yield servers


def tiers(server: ServeProcess) -> dict[str, Any]:
    (pid,) = child_pids(server.proc.pid, "llm")
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    status, body = http_json("GET", f"{url}/health?check_integrity=1")
    assert status == 200 and body["integrity"] == "ok", body
    return dict(body["kv_tiers"])


@pytest.mark.timeout(400)
def test_a_chat_evicted_on_one_node_returns_on_the_other_from_redis(
    tiered_pair: tuple[ServeProcess, ServeProcess], svc: ServeProcess
) -> None:
    first, second = tiered_pair
    image = {"type": "image_url", "image_url": {"url": data_uri(77)}}
    turn1 = [
        {"role": "system", "content": "You describe pictures for a catalogue, carefully. " * 4},
        {"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]},
    ]
    reply = ask(first, turn1)
    assert reply.status == 200, reply.body
    answer = reply.body["choices"][0]["message"]["content"]
    for i in range(4):  # push the chat out of the first node's device pool (into its tiers)
        filler = [{"role": "user", "content": f"Filler {i}: " + "tell me about paging and caches. " * 12}]
        assert ask(first, filler, max_tokens=2).status == 200
    written = tiers(first)["store"]["written_pages"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
    got = ids(ask(second, turn2))
    after = tiers(second)
    want = ids(ask(svc, turn2))  # a node without tiers computes it all
    assert written > 0, tiers(first)
    assert after["store"]["fetched_pages"] > 0 and after["host"]["restored_tokens"] > 0, after
    assert got == want
