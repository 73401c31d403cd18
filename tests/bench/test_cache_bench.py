"""bench.cache_hits: a smoke run end to end (its summary and the invariants the design guarantees),
and the churn and ingress simulations on workloads where the outcome is exact."""

import json
from pathlib import Path

import numpy as np
import pytest

from bench.cache_churn import run_churn_case
from bench.cache_hits import main
from bench.cache_ingress import run_ingress_stream
from bench.cache_sim import Workload, make_workload


def test_cache_hits_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cache_hits.json"
    argv = ["--requests", "400", "--media", "200", "--latency-reps", "5", "--round-trip-reps", "5"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert 0.0 <= s["hit_rate_baseline"] <= s["hit_rate_ours"] <= 1.0
    assert s["hit_rate_gain"] >= 0.0 and s["read_1mib_p50_ms"] > 0
    assert {r["name"] for r in doc["results"]["hit_rates"]} >= {
        "ring + node cache (ours)",
        "rr + worker cache (baseline)",
    }
    assert doc["machine"]["cpu_cores"] >= 1

    # The attribution is the four rows' ratios, nothing else.
    a = s["attribution"]
    assert a["total"] == pytest.approx(s["hit_rate_gain"])
    assert a["routing_alone"] == pytest.approx(s["hit_rate_ring_worker_cache"] / s["hit_rate_baseline"] - 1)
    assert a["sharing_alone"] == pytest.approx(s["hit_rate_rr_node_cache"] / s["hit_rate_baseline"] - 1)
    assert a["sharing_on_ring"] == pytest.approx(s["hit_rate_ours"] / s["hit_rate_ring_worker_cache"] - 1)

    death, join = s["churn"]["death"], s["churn"]["join"]
    # After a death the node cache keeps the dead worker's entries and bytes: never fewer hits.
    assert death["node_cache"]["hit_rate"] >= death["worker_cache"]["hit_rate"]
    for event in (death, join):
        # A moved key was only ever cached by its old owner: a per-worker cache cannot have it, and
        # neither can a node cache on the other node.
        assert event["worker_cache"]["first_touch_hits_same_node"] == 0
        for design in ("node_cache", "worker_cache"):
            assert event[design]["first_touch_hits_other_node"] == 0
            assert event[design]["first_touches_same_node"] <= event[design]["moved_same_node"]

    ing = s["ingress"]
    assert s["ingress_hit_fraction"] == pytest.approx(ing["ingress_hits"] / ing["requests"])
    assert 0.0 < s["ingress_hit_fraction"] < 1.0
    assert ing["ingress_hits"] + ing["local_calls"] + ing["remote_calls"] == ing["requests"]
    # A worker on the ingress's node reads the cache the ingress has just missed in.
    assert ing["local_hits"] == 0
    # Every remote answer is copied into the ingress's node cache, once.
    assert ing["copies"] == ing["remote_calls"]

    rt = s["round_trip"]
    assert rt["body_bytes"] > 0 and 0 < rt["ingress_hit_p50_ms"] < rt["worker_round_trip_p50_ms"]


def _roomy_workload(n_media: int, n_requests: int, warm_all: bool) -> Workload:
    # Budget for every item several times over: nothing is ever evicted, so outcomes are exact.
    w = make_workload(n_media, n_requests, alpha=1.0, seed=3, cache_fraction=4.0)
    if warm_all:  # every item once first: all of them cached before anything happens
        return w._replace(stream=np.concatenate([np.arange(n_media), w.stream]))
    return w


@pytest.mark.parametrize("event", ["death", "join"])
def test_churn_node_cache_keeps_every_moved_key_that_stays_on_its_node(tmp_path: Path, event: str) -> None:
    w = _roomy_workload(120, 600, warm_all=True)
    at, window = 120, 600
    node = run_churn_case(w, tmp_path / "node", event, shared=True, at=at, window=window)
    per_worker = run_churn_case(w, tmp_path / "worker", event, shared=False, at=at, window=window)
    for r in (node, per_worker):
        assert r.window == window and r.moved_keys > 0
        assert r.first_touch_same > 0 and r.first_touch_other > 0
        assert r.first_touch_other_hits == 0
    assert (node.moved_keys, node.first_touch_same) == (per_worker.moved_keys, per_worker.first_touch_same)
    # Everything was cached and nothing evicted: the node cache hits every such first request,
    # a per-worker cache none, and elsewhere both hit everything.
    assert node.first_touch_same_hits == node.first_touch_same
    assert per_worker.first_touch_same_hits == 0
    assert node.hits == window - node.first_touch_other
    assert per_worker.hits == window - per_worker.first_touches


def test_churn_without_an_event_moves_nothing(tmp_path: Path) -> None:
    w = _roomy_workload(120, 600, warm_all=False)
    r = run_churn_case(w, tmp_path, "none", shared=True, at=300, window=300)
    assert r.moved_keys == r.first_touches == 0
    with pytest.raises(ValueError, match="unknown churn event"):
        run_churn_case(w, tmp_path / "bad", "reboot", shared=True, at=10, window=10)


def test_ingress_with_room_for_everything_encodes_each_item_once(tmp_path: Path) -> None:
    w = _roomy_workload(150, 800, warm_all=False)
    s = run_ingress_stream(w, tmp_path)
    distinct = len(set(w.stream.tolist()))
    assert s.requests == 800
    assert s.encodes == distinct  # a miss is always a first request
    # The ingress's node ends up with every embedding (its own or copied), so every repeat is
    # answered there and no worker is ever called for a cached item.
    assert s.ingress_hits == s.requests - distinct
    assert s.local_hits == s.remote_hits == 0
    assert s.copies == s.remote_calls > 0
    assert s.local_calls + s.remote_calls == distinct
