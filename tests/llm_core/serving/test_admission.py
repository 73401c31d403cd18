"""The engine's admission by expected wait: the first token's wait from the tokens of work waiting
ahead over measured tokens per second, refusals with the wait as Retry-After, the client's shorter
timeout, an idle engine takes anything, a long answer is not refused for its own decode."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import Sequence
from llm_core.serving.admission import EngineAdmission
from llm_core.serving.engine import EngineOverloaded, LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig


def seq(prompt: int, max_new: int, computed: int = 0, out: int = 0) -> Sequence:
    s = Sequence(seq_id=f"s{prompt}-{max_new}", prompt_ids=list(range(1, prompt + 1)), max_new_tokens=max_new)
    s.num_computed_tokens = computed
    s.output_ids = [7] * out
    return s


def test_work_is_the_prompt_left_and_the_expected_output_left() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    assert a.work(seq(40, 10), a.fill()) == 50  # nothing computed, max_tokens at its word
    assert a.work(seq(40, 10, computed=40, out=4), a.fill()) == 6
    est = a.estimate([seq(40, 10), seq(40, 10, computed=40, out=4)], seq(30, 20))
    assert (est.tokens_ahead, est.prompt_own) == (56, 30)
    assert est.wait_s == pytest.approx((56 + 30) / 100.0)  # its first token: after its prompt
    assert est.start_s == pytest.approx(56 / 100.0)


def test_an_imported_prompt_costs_no_prompt_work() -> None:
    imported = seq(40, 10)  # its KV source is the engine's (by request id): the predicate says so
    a = EngineAdmission(seed_tokens_per_s=100.0, copied_in=lambda s: s is imported)
    assert a.work(imported, fill=1.0) == 10


def test_the_output_estimate_learns_how_much_of_max_tokens_requests_use() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    for _ in range(4):  # requests that ask for 400 tokens and stop after 40
        a.observe_finished(seq(10, 400, computed=10, out=40))
    assert a.fill() == pytest.approx(0.1)
    assert a.work(seq(10, 400), a.fill()) == pytest.approx(10 + 40)


def test_a_shared_prefix_is_not_counted_as_work_again() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    done = seq(100, 10, computed=100, out=10)
    done.num_cached_tokens = 75  # recent prompts found three quarters of themselves cached
    a.observe_finished(done)
    assert a.hit() == pytest.approx(0.75)
    assert a.work(seq(100, 10), fill=1.0, hit=a.hit()) == pytest.approx(25 + 10)
    assert a.work(seq(100, 10, computed=90), fill=1.0, hit=a.hit()) == pytest.approx(
        10 + 10
    )  # started: exact


def test_the_rate_is_measured_from_steps_after_the_seed() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    for _ in range(7):
        a.observe_step(tokens=64, seconds=0.01)
    assert a.rate.per_s() == 100.0  # the seed until 8 steps
    a.observe_step(tokens=64, seconds=0.01)
    assert a.rate.per_s() == pytest.approx(6400.0)


def make_engine(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 256, **kw})
    return LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)


def test_submit_refuses_past_the_deadline_and_an_idle_engine_takes_anything(loaded: Any) -> None:
    # 10 tokens/s assumed (never started, so never measured), a 3 s deadline
    engine = make_engine(loaded, admission_seed_tokens_per_s=10.0, max_queue_wait_s=3.0)

    async def go() -> None:
        big = SamplingParams(max_tokens=100)  # 103 tokens of work: 10 s, taken by an idle engine
        engine.submit([1, 2, 3], big)
        with pytest.raises(EngineOverloaded) as exc:
            engine.submit([4, 5, 6], SamplingParams(max_tokens=1))  # first token: (103 + 3) / 10 s
        assert exc.value.reason == "wait"
        assert exc.value.retry_after_s == pytest.approx(10.6)
        assert "103 tokens of work waiting ahead and 3 of its prompt" in str(exc.value)

    asyncio.run(go())
    assert engine.stats().refusals == {"wait": 1}


def test_a_long_answer_is_not_refused_for_its_own_decode(loaded: Any) -> None:
    engine = make_engine(loaded, admission_seed_tokens_per_s=10.0, max_queue_wait_s=3.0)

    async def go() -> None:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=5))  # 8 tokens ahead: 0.8 s
        # 200 output tokens at 10 tokens/s would take 20 s, but its first token comes in 1.1 s
        engine.submit([4, 5, 6], SamplingParams(max_tokens=200))

    asyncio.run(go())
    assert engine.stats().refusals == {}


def test_the_client_timeout_shortens_the_deadline_over_http(loaded: Any) -> None:
    engine = make_engine(loaded, admission_seed_tokens_per_s=10.0, max_queue_wait_s=30.0)

    async def fill() -> None:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=7))  # 10 tokens: 1 s ahead

    asyncio.run(fill())
    client = TestClient(create_app(engine))  # no lifespan: the step thread does not start
    body = {"prompt": [4, 5, 6], "max_tokens": 7}
    r = client.post("/v1/completions", json=body, headers={"X-Request-Timeout": "1.2"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded"
    assert r.headers["Retry-After"] == "2"  # (10 + 3) / 10 = 1.3 s, rounded up
    assert "1.2 s deadline" in r.json()["error"]["message"]
    text = client.get("/metrics").text
    assert 'epd_llm_refusals_total{reason="wait"} 1.0' in text
    assert "epd_llm_expected_wait_seconds 1.3" in text


def test_the_estimate_learns_how_late_requests_admitted_behind_others_were() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    guess = a.estimate([seq(50, 50)], seq(10, 10))
    a.admitted("seeded", guess, now=0.0)
    a.first_token("seeded", now=100.0)  # the seed rate's error is not the model's
    for _ in range(8):
        a.observe_step(tokens=10, seconds=0.1)
    est = a.estimate([seq(50, 50)], seq(10, 10))
    assert est.measured and est.correction == 1.0
    for i in range(10):  # each first token came 1.5x later than estimated (the machine slowed)
        a.admitted(i, est, now=0.0)
        a.first_token(i, now=1.5 * est.wait_s)
        a.ended(i)
    a.admitted("aborted", est, now=0.0)
    a.ended("aborted")  # gone before its first token: says nothing of time
    later = a.estimate([seq(50, 50)], seq(10, 10))
    assert later.correction == pytest.approx(1.5)
    assert later.wait_s == pytest.approx(1.5 * est.wait_s)
    for i in range(64):  # faster than estimated: never made optimistic below 1
        a.admitted(i, est, now=0.0)
        a.first_token(i, now=0.5 * est.wait_s)
    assert a.correction() == 1.0


def test_the_wait_is_scaled_for_the_late_tail_and_retry_after_for_the_typical_request() -> None:
    a = EngineAdmission(seed_tokens_per_s=100.0)
    for _ in range(8):
        a.observe_step(tokens=10, seconds=0.1)
    est = a.estimate([seq(50, 50)], seq(10, 10))
    # of the last 64, 2 came twice as late as estimated: the tail is what a read timeout fails
    for i in range(100):
        a.admitted(i, est, now=0.0)
        a.first_token(i, now=(2.0 if i % 30 == 0 else 1.0) * est.wait_s)
    later = a.estimate([seq(50, 50)], seq(10, 10))
    assert later.correction == pytest.approx(2.0)  # the 99th percentile of the last 64
    assert later.wait_s == pytest.approx(2.0 * est.wait_s)
    # Retry-After: when the queue is expected to have drained (median lateness 1)
    assert later.wait_s * later.retry_scale == pytest.approx(est.wait_s)
