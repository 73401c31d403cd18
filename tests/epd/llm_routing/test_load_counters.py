"""The router's own load counters: phases, idempotent finish, and the reconciliation of lost
decrements against the requests the engine says it holds."""

from __future__ import annotations

import pytest

from epd.llm_routing.load_counters import EngineLoad


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_dispatch_moves_from_prefill_to_decode_and_ends_once() -> None:
    load = EngineLoad("http://e0", Clock())
    d = load.dispatch("r1", prompt_tokens=100, predicted_cached_tokens=64, max_tokens=8)
    # waiting: 36 tokens to compute, its whole prompt held (the balance guard's measure)
    assert (load.prefill_tokens, load.decode_tokens, load.held_tokens, load.inflight) == (36, 0, 100, 1)
    d.first_token()
    assert (load.prefill_tokens, load.decode_tokens, load.held_tokens) == (0, 100, 100)
    d.add_output_tokens(3)
    d.add_output_tokens(20)  # never past max_tokens
    assert (load.decode_tokens, load.held_tokens, d.output_tokens) == (108, 108, 8)
    d.finish()
    d.finish()
    d.add_output_tokens(1)  # late chunks after the end change nothing
    assert (load.prefill_tokens, load.decode_tokens, load.held_tokens, load.inflight) == (0, 0, 0, 0)
    assert load.snapshot().held_tokens == 0
    assert d.finished


def test_output_without_first_token_call_counts_as_decode() -> None:
    load = EngineLoad("http://e0", Clock())
    d = load.dispatch("r1", 10, 0, 100)
    d.add_output_tokens(1)
    assert (load.prefill_tokens, load.decode_tokens) == (0, 11)


def test_the_context_manager_finishes_on_error() -> None:
    load = EngineLoad("http://e0", Clock())
    with pytest.raises(RuntimeError), load.dispatch("r1", 10, 0, 4) as d:
        d.first_token()
        raise RuntimeError("client went away")
    assert load.tokens == 0 and load.inflight == 0


def test_repeated_request_ids_are_counted_apart() -> None:
    load = EngineLoad("http://e0", Clock())
    a = load.dispatch("same", 10, 0, 4)
    b = load.dispatch("same", 20, 0, 4)
    a.finish()
    assert (load.prefill_tokens, load.inflight) == (20, 1)
    b.finish()
    assert load.tokens == 0


def test_reconcile_drops_only_old_dispatches_the_engine_does_not_hold() -> None:
    clock = Clock()
    load = EngineLoad("http://e0", clock)
    lost = load.dispatch("lost", 50, 0, 4)
    held = load.dispatch("held", 30, 0, 4)
    clock.now += 1.0
    young = load.dispatch("young", 20, 0, 4)  # may still be on the wire to the engine
    assert load.reconcile(["held"], grace_s=2.0) == 0  # nothing is older than the grace yet
    clock.now += 1.5
    assert load.reconcile(["held"], grace_s=2.0) == 1
    assert load.prefill_tokens == 50 and load.corrected == 1 and lost.finished
    lost.finish()  # the response path's late finish does not decrement twice
    assert load.prefill_tokens == 50
    held.finish()
    young.finish()
    assert load.tokens == 0 and load.inflight == 0


def test_the_engines_report_beyond_the_routers_own_is_external() -> None:
    load = EngineLoad("http://e0", Clock())
    d = load.dispatch("r", 100, 40, 4)
    load.set_reported(prefill_tokens=160, decode_tokens=30)
    snap = load.snapshot()
    assert (snap.external_prefill_tokens, snap.external_decode_tokens) == (100, 30)
    load.set_reported(prefill_tokens=10, decode_tokens=0)  # never negative
    assert load.snapshot().external_prefill_tokens == 0
    d.finish()
