"""Speculative decoding with MTP heads: the greedy ids of every request equal those of the engine
without speculation, for k = 1, 2, 3: alone, in a batch of 8 of different lengths, after a prefix
hit, under chunked prefill, near a full pool (preemption), with an image; KV bookkeeping holds.

Random heads accept (almost) nothing, so the accept / commit / rollback paths are also driven by an
*oracle* proposer: the real heads run (their KV is written), then the drafts are replaced by the
reference continuation with every third draft made wrong, so verify steps accept 0 .. k drafts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.models.mtp import MTPHeads
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import MultimodalInput, Sequence
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from llm_core.serving.speculative import Speculator, accept_greedy
from tests.llm_core.caches.test_host_tier import history_turns
from tests.llm_core.serving.test_engine import prompt_of

N_OUT = 24


def random_heads(config: Any, n: int = 3, seed: int = 0) -> MTPHeads:
    heads = MTPHeads(config, n)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(
                torch.ones_like(p)
                if name.endswith("norm.weight")
                else torch.randn(p.shape, generator=g) * 0.02
            )
    return heads.eval().requires_grad_(False)


class OracleSpeculator(Speculator):
    """The heads run as usual, then propose the reference continuation, every third draft wrong."""

    reference: dict[tuple[int, ...], list[int]]

    def extend(self, seqs: Any, page_rows: Any, starts: Any, new_tokens: Any, hidden: Any) -> None:
        super().extend(seqs, page_rows, starts, new_tokens, hidden)
        for s, new in zip(seqs, new_tokens, strict=True):
            st = self.states.of(s.seq_id)
            if not st.draft_ids:
                continue
            want = self.reference[tuple(s.prompt_ids)]
            done = len(s.output_ids) + len(new)
            drafts = want[done : done + len(st.draft_ids)]
            st.draft_ids = [t if (done + i) % 3 else (t + 1) % 256 for i, t in enumerate(drafts)]


def engine(
    loaded: Any, k: int, oracle: dict[tuple[int, ...], list[int]] | None = None, **kw: Any
) -> LLMEngine:
    cfg = EngineConfig(
        **{"kv_memory_bytes": 4 << 20, "max_model_len": 1024, "page_size": 4, "speculative_steps": k, **kw}
    )
    e = LLMEngine(
        loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg, mtp=random_heads(loaded.config)
    )
    if oracle is not None and e.runner.speculator is not None:
        spec = e.runner.speculator
        e.runner.speculator = OracleSpeculator(spec.heads, spec.target, spec.kv, spec.k, spec.sampling)
        e.runner.speculator.reference = oracle  # type: ignore[attr-defined]
        e.scheduler.drafts = e.runner.speculator.states  # the drafts the scheduler cuts are the new one's
    e.start()
    return e


def run_all(e: LLMEngine, prompts: list[list[int]], mm: Any = (), together: bool = True) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)

    async def one(p: list[int]) -> list[int]:
        ids: list[int] = []
        async for out in e.generate(p, sp, mm):
            ids.extend(out.token_ids)
        return ids

    async def go() -> list[list[int]]:
        if together:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    try:
        return asyncio.run(go())
    finally:
        e.scheduler.kv.check_integrity(e.scheduler.running)


def check(loaded: Any, prompts: list[list[int]], mm: Any = (), together: bool = True, **kw: Any) -> list[int]:
    """Asserts the ids are the plain engine's for every k, with and without the oracle; returns
    each speculative run's preemption count."""
    plain = engine(loaded, 0, **kw)
    try:
        want = run_all(plain, prompts, mm, together)
    finally:
        plain.stop()
    oracle = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    preemptions = []
    for k in (1, 2, 3):
        for ref in (None, oracle):
            e = engine(loaded, k, ref, **kw)
            try:
                got = run_all(e, prompts, mm, together)
                spec = e.runner.speculator
                assert spec is not None
                c = spec.counters()
                preemptions.append(e.scheduler.num_preemptions)
            finally:
                e.stop()
            assert got == want, (k, ref is not None)
            assert c.verify_steps > 0
            if ref is not None:
                assert c.accepted > 0 and c.acceptance_length > 1.2, c  # the accept paths ran
    return preemptions


def test_accept_greedy() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_alone(loaded: Any) -> None:
    check(loaded, [prompt_of(37, 1)])


def test_a_batch_of_8_of_different_lengths(loaded: Any) -> None:
    check(loaded, [prompt_of(5 + 23 * i, 10 + i) for i in range(8)])


def test_after_a_prefix_hit_and_under_chunked_prefill(loaded: Any) -> None:
    shared = prompt_of(150, 3)
    prompts = [shared + prompt_of(9, 4), shared + prompt_of(30, 5), shared + prompt_of(2, 6)]
    check(loaded, prompts, together=False, max_prefill_chunk=24)


def test_near_a_full_pool_with_preemption(loaded: Any) -> None:
    preemptions = check(loaded, [prompt_of(30 + 9 * i, 20 + i) for i in range(8)], kv_memory_bytes=200 << 10)
    assert min(preemptions) > 0, preemptions


def test_with_an_image(loaded: Any) -> None:
    turns, mm = history_turns(loaded)
    check(loaded, [turns[0]], list[MultimodalInput](mm))


def test_greedy_and_sampled_requests_share_a_batch(loaded: Any) -> None:
    e = engine(loaded, 2)
    try:

        async def go() -> tuple[list[int], list[int]]:
            async def one(p: list[int], sp: SamplingParams) -> list[int]:
                ids: list[int] = []
                async for out in e.generate(p, sp):
                    ids.extend(out.token_ids)
                return ids

            greedy = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)
            hot = SamplingParams(temperature=0.8, max_tokens=N_OUT, ignore_eos=True, seed=1)
            a, b = await asyncio.gather(one(prompt_of(20, 1), greedy), one(prompt_of(30, 2), hot))
            return a, b

        a, b = asyncio.run(go())
    finally:
        e.stop()
    assert len(a) == N_OUT and len(b) == N_OUT


def test_more_steps_than_heads_is_refused(loaded: Any) -> None:
    cfg = EngineConfig(speculative_steps=4)
    with pytest.raises(ValueError, match="needs 4 MTP heads"):
        LLMEngine(
            loaded.model,
            loaded.config,
            load_tokenizer(loaded.model_dir),
            cfg,
            mtp=random_heads(loaded.config),
        )
    assert Sequence  # the module's state lives in Speculator.states (draft_state.py), by request id


P0 = [0.30, 0.05, 0.25, 0.10, 0.20, 0.10]  # the target's distribution at the first drafted position
P1 = [0.10, 0.40, 0.05, 0.15, 0.10, 0.20]  # ... at the second
P2 = [0.25, 0.25, 0.10, 0.10, 0.20, 0.10]  # ... at the bonus position
Q0 = [0.05, 0.40, 0.05, 0.30, 0.10, 0.10]  # the drafts' distributions: far from the target's
Q1 = [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]
N_SAMPLES = 20000
CHI2_CRIT_DF5 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs, strict=True))


def emitted(rule: Any, seed: int = 0) -> tuple[list[int], list[int]]:
    """Counts of the first and second emitted tokens over N_SAMPLES verify steps of 2 drafts."""
    g = torch.Generator().manual_seed(seed)
    q = torch.tensor([Q0, Q1])
    p = torch.tensor([P0, P1, P2])
    first, second = [0] * 6, [0] * 6
    for _ in range(N_SAMPLES):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = rule(drafts, q, p, g)
        first[out[0]] += 1
        second[out[1] if len(out) > 1 else int(torch.multinomial(p[1], 1, generator=g))] += 1
    return first, second


def test_rejection_sampling_keeps_the_targets_distribution() -> None:
    from llm_core.serving.speculative import accept_sampled

    first, second = emitted(accept_sampled)
    assert chi2(first, P0) < CHI2_CRIT_DF5, first
    assert chi2(second, P1) < CHI2_CRIT_DF5, second


def test_a_wrong_acceptance_rule_fails_the_same_check() -> None:
    def accept_if_likely_under_q(drafts: list[int], q: Any, p: Any, g: Any) -> list[int]:
        # wrong: keeps a draft with probability q/p instead of p/q
        from llm_core.serving.speculative import accept_sampled

        return accept_sampled(drafts, p[:2], torch.cat([q, p[2:]]), g)

    first, _ = emitted(accept_if_likely_under_q)
    assert chi2(first, P0) > CHI2_CRIT_DF5, first


def test_sampled_requests_speculate_in_the_engine(loaded: Any) -> None:
    """End to end: sampled requests draft from the heads and verify by rejection sampling in the
    engine's steps (the distribution itself is checked above, where it can be counted exactly)."""
    e = engine(loaded, 2)
    try:
        sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)

        async def go() -> list[list[int]]:
            async def one(i: int) -> list[int]:
                ids: list[int] = []
                async for out in e.generate(prompt_of(12, 7), sp):
                    ids.extend(out.token_ids)
                return ids

            return list(await asyncio.gather(*(one(i) for i in range(16))))

        outs = asyncio.run(go())
        spec = e.runner.speculator
        assert spec is not None and spec.counters().verify_steps > 0
    finally:
        e.stop()
    assert all(len(o) == 3 for o in outs)


class RandomDrafts(Speculator):
    """The heads run as usual; then each draft is the reference token or a wrong one at random
    (``miss`` of them), so verify steps accept any number of drafts."""

    reference: dict[tuple[int, ...], list[int]]
    rng: Any
    miss: float

    def extend(self, seqs: Any, page_rows: Any, starts: Any, new_tokens: Any, hidden: Any) -> None:
        super().extend(seqs, page_rows, starts, new_tokens, hidden)
        for s, new in zip(seqs, new_tokens, strict=True):
            st = self.states.of(s.seq_id)
            if st.draft_ids:
                want = self.reference[tuple(s.prompt_ids)]
                done = len(s.output_ids) + len(new)
                drafts = want[done : done + len(st.draft_ids)]
                st.draft_ids = [t if self.rng.random() > self.miss else (t + 7) % 256 for t in drafts]


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(3, 90), min_size=2, max_size=7),
    shared=st.integers(0, 40),
    k=st.integers(1, 3),
    miss=st.sampled_from([0.0, 0.3, 0.7]),
    pool_kib=st.sampled_from([300, 600, 4096]),  # the smallest still holds the longest request
    seed=st.integers(0, 1000),
)
def test_random_workloads_with_rejections_keep_the_ids_and_the_kv_books(
    loaded: Any, lengths: list[int], shared: int, k: int, miss: float, pool_kib: int, seed: int
) -> None:
    import random

    head = prompt_of(shared, seed) if shared else []
    prompts = [head + prompt_of(n, seed + 1 + i) for i, n in enumerate(lengths)]
    kw = {"kv_memory_bytes": pool_kib << 10}
    plain = engine(loaded, 0, **kw)
    try:
        want = run_all(plain, prompts)
    finally:
        plain.stop()
    e = engine(loaded, k, **kw)
    spec = e.runner.speculator
    assert spec is not None
    rd = RandomDrafts(spec.heads, spec.target, spec.kv, spec.k, spec.sampling)
    rd.reference = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    rd.rng, rd.miss = random.Random(seed), miss
    e.runner.speculator = rd
    e.scheduler.drafts = rd.states  # the drafts the scheduler cuts are the new one's
    try:
        got = run_all(e, prompts)  # check_integrity runs after the batch, before stop
        assert e.check_integrity() == "ok"
    finally:
        e.stop()
    assert got == want
