"""bench.kv_affinity without a service: the trace is deterministic per seed, a session's history
grows by exactly its previous turn, sessions share exactly the system prompt, images recur in the
history once sent; the KV budget splits as the engine's own ``plan_group_pools`` does and leaves round
robin short of what it needs; and the summary arithmetic (gains, load ratio, verdicts) on
hand-made results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.kv_affinity import (
    TARGET_HIT_RATE_GAIN,
    EngineShare,
    PolicyResult,
    TurnRecord,
    policy_result,
    summarize,
    summarize_rounds,
)
from bench.kv_affinity_trace import (
    IMAGE_TOKENS,
    TraceConfig,
    estimate_prompt_tokens,
    kv_budget,
    make_trace,
    session_peak_tokens,
    system_tokens,
    turn_messages,
    user_message,
)
from llm_core.caches.kv_pool import KVCacheConfig, KVLayout, plan_group_pools
from llm_core.models.checkpoint import default_llm_config

CFG = TraceConfig(sessions=6, turns=5, seed=3)


def _replies(n: int, session: int) -> list[str]:
    return [f"reply {session}/{i} \ufffd\ufffd" for i in range(n)]


def _images_of(messages: list[dict[str, Any]]) -> list[str]:
    return [
        p["image_url"]["url"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    ]


def test_trace_is_deterministic_per_seed() -> None:
    a, b = make_trace(CFG), make_trace(CFG)
    assert a == b  # text and image bytes
    other = make_trace(TraceConfig(sessions=6, turns=5, seed=4))
    assert other.system != a.system
    assert [t.text for t in other.sessions[0].turns] != [t.text for t in a.sessions[0].turns]
    assert a.requests == 30 and len(a.system) == CFG.system_chars


def test_user_messages_and_images_have_the_configured_sizes() -> None:
    trace = make_trace(TraceConfig(sessions=8, turns=8, seed=1))
    turns = [t for s in trace.sessions for t in s.turns]
    assert all(100 <= len(t.text.encode()) <= 200 for t in turns)
    # about one turn in four carries an image; every image differs (per session and turn)
    images = [t.image for t in turns if t.image is not None]
    assert 0.1 < len(images) / len(turns) < 0.45
    assert len(set(images)) == len(images)
    assert all(img[:2] == b"\xff\xd8" for img in images)  # JPEG


def test_history_grows_by_exactly_the_previous_turn() -> None:
    trace = make_trace(CFG)
    for s in trace.sessions:
        replies = _replies(len(s.turns), s.index)
        for t in range(1, len(s.turns)):
            prev = turn_messages(trace, s, t - 1, replies[: t - 1])
            cur = turn_messages(trace, s, t, replies[:t])
            assert cur[: len(prev)] == prev
            assert cur[len(prev) :] == [
                {"role": "assistant", "content": replies[t - 1]},
                user_message(s.turns[t]),
            ]
    with pytest.raises(ValueError, match="replies"):
        turn_messages(trace, trace.sessions[0], 2, ["only one"])


def test_sessions_share_exactly_the_system_prompt() -> None:
    trace = make_trace(CFG)
    firsts = [turn_messages(trace, s, 0, []) for s in trace.sessions]
    assert all(m[0] == {"role": "system", "content": trace.system} for m in firsts)
    texts = [s.turns[0].text for s in trace.sessions]
    # The user message opens with a per-session tag, so past the system message two sessions
    # share "<|im_start|>user\n" (6 tokens) and a few characters: less than a 16-token page.
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            common = next(
                (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            assert 6 + common < 16
    # and no user text of one session appears in another's
    all_texts = [{t.text for t in s.turns} for s in trace.sessions]
    assert sum(len(t) for t in all_texts) == len(set().union(*all_texts))


def test_images_recur_in_the_history() -> None:
    trace = make_trace(CFG)
    seen_any = False
    for s in trace.sessions:
        replies = _replies(len(s.turns), s.index)
        sent: list[str] = []
        for t in range(len(s.turns)):
            images = _images_of(turn_messages(trace, s, t, replies[:t]))
            # every image sent earlier is in this prompt again, in order, then this turn's own
            assert images[: len(sent)] == sent
            new = images[len(sent) :]
            assert len(new) == (s.turns[t].image is not None)
            sent = images
            seen_any |= bool(new) and t < len(s.turns) - 1
    assert seen_any, "the seed should give at least one image before a session's last turn"


def test_prompt_estimate_counts_bytes_template_and_images() -> None:
    trace = make_trace(CFG)
    s = trace.sessions[0]
    msgs = turn_messages(trace, s, 0, [])
    text = len(trace.system) + len(s.turns[0].text)
    image = (IMAGE_TOKENS + 2) if s.turns[0].image is not None else 0
    assert estimate_prompt_tokens(msgs) == text + image + 10 + 8 + 11
    assert system_tokens(trace) == len(trace.system) + 10
    # the peak counts every reply at 3 bytes per token and the last answer
    last = len(s.turns) - 1
    assert session_peak_tokens(trace, s, 16) == (
        estimate_prompt_tokens(turn_messages(trace, s, last, ["x" * 48] * last)) + 16
    )


@pytest.mark.parametrize(("sessions", "turns", "concurrency"), [(16, 6, 8), (4, 3, 8), (32, 4, 16)])
def test_kv_budget_splits_like_the_engine_and_starves_round_robin(
    sessions: int, turns: int, concurrency: int
) -> None:
    trace = make_trace(TraceConfig(sessions=sessions, turns=turns))
    b = kv_budget(trace, concurrency, 4, 16)
    layout = KVLayout.from_model_config(default_llm_config(), torch.float32)
    # the engine gets the pages the budget names (the engine's own split from the two flags)
    plan = plan_group_pools(layout.groups, KVCacheConfig(b.kv_memory_bytes, b.page_size, b.swa_fraction))
    assert plan == (b.full_pages, b.swa_pages)
    # the CLI hands the fraction over as repr(): it round-trips exactly
    assert float(repr(b.swa_fraction)) == b.swa_fraction
    full_tokens = b.full_pages * b.page_size
    assert b.affinity_tokens < full_tokens < b.round_robin_tokens
    # room for at least one whole session beyond the even share
    peak = max(session_peak_tokens(trace, s, 16) for s in trace.sessions) - system_tokens(trace)
    assert full_tokens - b.affinity_tokens >= peak


def _share(url: str, prompt: int, cached: int) -> EngineShare:
    return EngineShare(url, 1, prompt, cached, cached, cached)


def _result(
    policy: str, prompt: int, cached: int, wall: float, loads: list[int], errors: int = 0
) -> PolicyResult:
    engines = tuple(_share(f"e{i}", load, 0) for i, load in enumerate(loads))
    return PolicyResult(policy, 10, errors, prompt, cached, wall, 5.0, 9.0, engines, (0.5,), ("events",))


def test_summary_gains_and_load_ratio() -> None:
    results = {
        "affinity": _result("affinity", 10_000, 6_000, 10.0, [100, 200, 300, 400]),
        "round_robin": _result("round_robin", 10_000, 4_000, 20.0, [250, 250, 250, 250]),
        "least_load": _result("least_load", 10_000, 3_000, 16.0, [250, 250, 250, 250]),
    }
    s = summarize(results)
    assert s["hit_rate_gain"] == pytest.approx(0.6 / 0.4 - 1)  # +50%
    assert s["input_throughput_gain"] == pytest.approx(1000 / 500 - 1)  # +100%
    assert s["max_load_ratio"] == pytest.approx(400 / 250)  # 1.6: above 1.5
    assert s["vs_least_load"]["hit_rate_gain"] == pytest.approx(0.6 / 0.3 - 1)
    assert s["vs_least_load"]["input_throughput_gain"] == pytest.approx(1000 / 625 - 1)
    assert s["meets_hit_rate_target"] is True and s["meets_input_throughput_target"] is True
    assert s["meets_load_target"] is False and s["meets_all_targets"] is False
    assert s["policies"]["round_robin"]["hit_rate"] == pytest.approx(0.4)
    assert s["policies"]["affinity"]["engine_loads"] == [100, 200, 300, 400]
    json.dumps(s)  # plain JSON


def test_summary_marks_nothing_met_that_was_not_measured() -> None:
    aff = _result("affinity", 10_000, 6_000, 10.0, [250, 250, 250, 250])
    only_aff = summarize({"affinity": aff})
    assert only_aff["hit_rate_gain"] is None and only_aff["meets_hit_rate_target"] is None
    assert only_aff["meets_input_throughput_target"] is None and only_aff["meets_all_targets"] is None
    assert only_aff["max_load_ratio"] == 1.0 and only_aff["meets_load_target"] is True
    # a policy with failed requests is not compared
    broken = summarize(
        {"affinity": aff, "round_robin": _result("round_robin", 9_000, 1, 9.0, [1] * 4, errors=1)}
    )
    assert broken["hit_rate_gain"] is None and broken["meets_hit_rate_target"] is None
    # round robin without a single hit: the relative gain is undefined, not met
    zero = summarize({"affinity": aff, "round_robin": _result("round_robin", 9_000, 0, 9.0, [1] * 4)})
    assert zero["hit_rate_gain"] is None and zero["meets_hit_rate_target"] is None
    assert zero["input_throughput_gain"] is not None
    # exactly at the target counts as met
    edge = summarize(
        {
            "affinity": _result("affinity", 1000, 500, 1.0, [1] * 4),
            "round_robin": _result("round_robin", 1000, 400, 1.3, [1] * 4),
        }
    )
    assert edge["hit_rate_gain"] == pytest.approx(TARGET_HIT_RATE_GAIN)
    assert edge["meets_hit_rate_target"] is (edge["hit_rate_gain"] >= TARGET_HIT_RATE_GAIN)


def test_policy_result_sums_turns_and_skips_failures() -> None:
    records = [
        TurnRecord(0, 0, 700, 600, 0.010, 0.05, None),
        TurnRecord(0, 1, 900, 700, 0.020, 0.05, None),
        TurnRecord(1, 0, 700, 0, 0.030, 0.05, None),
        TurnRecord(1, 1, 0, 0, 0.0, 0.01, "HTTP 503: busy"),
    ]
    engines = [EngineShare("a", 2, 1400, 600, 600, 600), EngineShare("b", 1, 900, 700, 650, 700)]
    r = policy_result("affinity", records, 2.0, engines)
    assert (r.requests, r.errors, r.prompt_tokens, r.cached_tokens) == (4, 1, 2300, 1300)
    assert r.hit_rate == pytest.approx(1300 / 2300)
    assert r.input_tokens_per_s == pytest.approx(1150)
    assert r.hit_rate_by_turn == pytest.approx((600 / 1400, 700 / 900))
    assert r.ttft_p50_ms == pytest.approx(20.0) and r.ttft_p90_ms == pytest.approx(28.0)
    assert [e.load for e in r.engines] == [800, 200]
    assert r.max_load_ratio == pytest.approx(800 / 500)
    # every request failed: no TTFT (NaN), no tokens
    empty = policy_result("round_robin", records[3:], 1.0, [])
    assert math.isnan(empty.ttft_p50_ms) and empty.prompt_tokens == 0 and empty.max_load_ratio == 1.0


def test_help_runs_without_a_service(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.kv_affinity import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--policies" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--policies", "affinity,random"], ["--swa-fraction", "0.5"]])
def test_bad_flags_are_refused_before_any_service_starts(flags: list[str], tmp_path: Path) -> None:
    from bench.kv_affinity import main

    with pytest.raises(SystemExit) as exc:
        main([*flags, "--log-dir", str(tmp_path)])
    assert exc.value.code == 2


def test_rounds_take_the_median_of_each_gain_and_judge_it() -> None:
    def round_(aff_wall: float, aff_cached: int, top: int) -> dict[str, PolicyResult]:
        return {
            "affinity": _result("affinity", 10_000, aff_cached, aff_wall, [100, 100, 100, top]),
            "round_robin": _result("round_robin", 10_000, 4_000, 10.0, [100] * 4),
        }

    # input tokens/s gains +25%, +100%, +42.9%; hit gains +50%, +25%, +10%; max/mean load 1.0, 1.82, 1.47
    rounds = [round_(8.0, 6_000, 100), round_(5.0, 5_000, 250), round_(7.0, 4_400, 175)]
    s = summarize_rounds(rounds)
    assert s["input_throughput_gain"] == pytest.approx(10.0 / 7.0 - 1)  # the middle round's
    assert s["hit_rate_gain"] == pytest.approx(0.25)
    assert s["max_load_ratio"] == pytest.approx(175 / 118.75)
    assert s["meets_input_throughput_target"] is True and s["meets_hit_rate_target"] is True
    assert s["meets_load_target"] is True and s["meets_all_targets"] is True
    assert [r["input_throughput_gain"] for r in s["rounds"]] == pytest.approx([0.25, 1.0, 10.0 / 7.0 - 1])
    # one round: the round's own summary
    assert summarize_rounds(rounds[:1])["input_throughput_gain"] == pytest.approx(0.25)
    assert summarize_rounds(rounds[:1])["meets_input_throughput_target"] is False
    json.dumps(s)
