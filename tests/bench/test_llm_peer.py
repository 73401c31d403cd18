"""bench.llm_peer's harness: the stream tally, llama.cpp's KV log lines, agreement, our KV figure,
a real drive of `epd llm`; and with `make peers` built, a short run against llama-server."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llm_peer
from bench.llm_peer import (
    OURS,
    StreamTally,
    agreement,
    agreement_ids,
    llama_kv_bytes,
    ours_kv_per_sequence,
    run_level,
    serve_ours,
)
from bench.peers import Peers, PeersMissing
from llm_core.tools.default_llm import ensure_default_checkpoint


def test_a_chunk_of_two_tokens_gives_its_gap_then_zero() -> None:
    t = StreamTally(10.0)
    t.add([5], None, 10.5)  # first token: TTFT 0.5
    t.add([6, 7], None, 10.7)  # two at once after 0.2
    t.add([], None, 10.8)  # a chunk without tokens (the final one)
    r = t.result()
    assert r.ids == [5, 6, 7] and r.tokens == 3
    assert r.ttft_s == pytest.approx(0.5)
    assert r.gaps_s == pytest.approx([0.2, 0.0])


def test_a_running_count_wins_over_the_ids_a_chunk_carries() -> None:
    # llama.cpp sends no chunk for a token that ends inside a UTF-8 sequence: the next chunk carries
    # its own id only, while the running count says two arrived
    t = StreamTally(0.0)
    t.add([1], 1, 0.1)
    t.add([3], 3, 0.4)
    t.add([], 3, 0.5)
    r = t.result()
    assert r.tokens == 3 and r.gaps_s == pytest.approx([0.3, 0.0])


LOG = """
llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells
llama_kv_cache:        CPU KV buffer size =     6.00 MiB
llama_kv_cache: size =    6.00 MiB (  8192 cells,   2 layers,  1/1 seqs), K (f16):    4.00 MiB, V (f16):    2.00 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 768 cells
llama_kv_cache: size =    3.38 MiB (   768 cells,   6 layers,  1/1 seqs), K (f16):    2.25 MiB, V (f16):    1.12 MiB
"""


def test_llama_kv_lines_are_summed_per_cache() -> None:
    total, caches = llama_kv_bytes(LOG)
    assert [(c["cells"], c["layers"]) for c in caches] == [(8192, 2), (768, 6)]
    assert total == int((6.00 + 3.38) * 2**20)


def test_agreement_counts_identical_outputs_and_common_prefixes() -> None:
    a = agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 3, 4], [1, 2, 9, 9]])
    assert a["identical"] == 1 and a["of"] == 2
    assert a["mean_common_prefix"] == pytest.approx((1.0 + 0.5) / 2)
    long = [list(range(40)), list(range(40))]
    late = [list(range(40)), [*range(32), 0, *range(33, 40)]]  # differs at token 33 only
    b = agreement(long, late)
    assert b["identical"] == 1 and b["first32_identical"] == 2


def test_our_kv_per_sequence_is_full_layers_plus_the_window() -> None:
    kv = ours_kv_per_sequence(ensure_default_checkpoint(), 8192)
    # the default: 2 full layers x 2 KV heads x (64 + 32) dims x fp32, every token
    assert kv["full_bytes"] == 2 * 2 * 96 * 4 * 8192
    # 6 SWA layers x 4 heads x 96 x fp32 over the pages a 128-token window spans (9 of 16 tokens)
    assert kv["swa_tokens"] == 144 and kv["swa_bytes"] == 6 * 4 * 96 * 4 * 144
    assert kv["bytes"] == kv["full_bytes"] + kv["swa_bytes"]
    bf16 = ours_kv_per_sequence(ensure_default_checkpoint(), 8192, "bfloat16")  # epd llm --dtype bfloat16
    assert bf16["bytes"] * 2 == kv["bytes"] and bf16["dtype"] == "torch.bfloat16"


def test_the_harness_measures_a_real_epd_llm(tmp_path: Path) -> None:
    with serve_ours(ensure_default_checkpoint(), threads=1, max_seqs=4, log_dir=tmp_path) as url:
        rows = {c: run_level(url, OURS, c, max_tokens=6, seed=3, repeat=0) for c in (1, 2)}
        ids = agreement_ids(url, OURS, 2, max_tokens=6, seed=3)
        again = agreement_ids(url, OURS, 1, max_tokens=6, seed=3)
    for c in (1, 2):
        row = rows[c]
        assert row["requests"] == llm_peer.MIN_REQUESTS
        assert row["output_tokens"] == 6 * llm_peer.MIN_REQUESTS
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert row["itl_p50_s"] > 0 and row["tokens_per_s"] > 0
    assert len(ids) == 16 and all(len(x) == 6 for x in ids)
    assert agreement(ids, again)["identical"] == 16  # greedy: the same ids at any concurrency


def _peers() -> Peers | None:
    try:
        return Peers.find()
    except PeersMissing:
        return None


@pytest.mark.skipif(_peers() is None, reason="llama.cpp not built (`make peers`)")
def test_a_short_run_against_llama_server(tmp_path: Path) -> None:
    peers = _peers()
    assert peers is not None
    small = llm_peer.model_dirs(["small"])["small"]
    row = llm_peer.run_size("small", small, peers, tmp_path, [1, 2], 8, seed=5, repeats=1)
    for c in (1, 2):
        assert row["levels"][c]["epd"]["output_tokens"] == row["levels"][c]["llama.cpp"]["output_tokens"]
        assert row["levels"][c]["ratio"] > 0
    assert row["agreement"]["of"] == 16
    assert row["agreement"]["mean_common_prefix"] > 0.5, row["agreement"]  # the same model on both sides
    # in float32 throughout llama.cpp computes our greedy ids (all 16 in the benchmark's runs; a
    # batch of other rows can still flip a near-tie on either side: GEMMs are not row-invariant)
    assert row["agreement_f32"]["identical"] >= 14, row["agreement_f32"]
    assert row["agreement_f32"]["mean_common_prefix"] > 0.9, row["agreement_f32"]
    kv = row["kv_8k"]["llama.cpp"]
    assert [len(kv[k]["caches"]) for k in ("server_default", "swa_full")] == [2, 2]  # full and SWA
    # --swa-full keeps every token in the SWA cache too
    assert kv["swa_full"]["caches"][1]["cells"] == 8192 > kv["server_default"]["caches"][1]["cells"]
