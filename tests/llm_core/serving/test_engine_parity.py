"""Engine parity: greedy generation through the paged engine equals transformers' ``generate``.

Reference: ``MiMoV2FlashForCausalLM.generate(do_sample=False)`` on the tiny checkpoint
(``sliding_window = 8``), for 8 prompts of different lengths (9..70 tokens, all but one longer than
the window), run as one left-padded batch. The engine must reproduce all 64 tokens of every prompt:
alone, with the prompt's prefix served from the radix cache, under chunked prefill with chunks
smaller than the window, and with all 8 requests in flight at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine, StepOutput
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig

NEW_TOKENS = 64
PROMPT_LENS = (70, 9, 33, 50, 17, 41, 25, 60)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_reference(tiny_mimo_hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers greedy continuations (64 tokens) of every prompt, one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = tiny_mimo_hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [row[width:].tolist() for row in out]


def make_engine(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 512, **kw})
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)
    engine.start()
    return engine


async def _run(engine: LLMEngine, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[StepOutput]:
    return [out async for out in engine.generate(prompt, sampling)]


def run_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[StepOutput]]:
    """All prompts submitted at once (concurrently in flight)."""

    async def main() -> list[list[StepOutput]]:
        return list(await asyncio.gather(*(_run(engine, p) for p in prompts)))

    return asyncio.run(main())


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def check_kv_released(engine: LLMEngine) -> None:
    """After all requests finished, every used page belongs to the prefix cache alone."""
    engine.scheduler.kv.check_integrity([])
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def test_greedy_matches_transformers(
    loaded: Any, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    engine = make_engine(loaded)
    try:
        (outs,) = run_all(engine, prompts[:1])
        assert tokens(outs) == hf_reference[0]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].num_output_tokens == NEW_TOKENS
        check_kv_released(engine)
    finally:
        engine.stop()


def test_greedy_with_prompt_from_prefix_cache(
    loaded: Any, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    engine = make_engine(loaded)
    try:
        # First request: one token after a 48-token prefix of the prompt. It leaves the prefix's KV
        # in the tree: all 3 full pages, and the SWA page holding the window before position 48.
        asyncio.run(_run(engine, prompts[0][:48], SamplingParams(temperature=0.0, max_tokens=1)))
        (outs,) = run_all(engine, prompts[:1])
        assert outs[-1].num_cached_tokens == 48
        assert tokens(outs) == hf_reference[0]
        # And once more: now the whole prompt (and more) is in the tree.
        (again,) = run_all(engine, prompts[:1])
        assert again[-1].num_cached_tokens >= 48
        assert tokens(again) == hf_reference[0]
        check_kv_released(engine)
    finally:
        engine.stop()


def test_greedy_under_chunked_prefill(
    loaded: Any, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    # 5-token chunks: smaller than the window (8), so every chunk attends into the previous ones.
    engine = make_engine(loaded, max_num_batched_tokens=5, enable_prefix_cache=False)
    try:
        (outs,) = run_all(engine, prompts[:1])
        assert tokens(outs) == hf_reference[0]
        assert engine.stats().steps_total >= len(prompts[0]) // 5 + NEW_TOKENS - 1
        check_kv_released(engine)
    finally:
        engine.stop()


def test_greedy_in_a_batch_of_8(loaded: Any, prompts: list[list[int]], hf_reference: list[list[int]]) -> None:
    # A chunk cap keeps several prompts prefilling while others decode in the same steps.
    engine = make_engine(loaded, max_num_batched_tokens=64, max_prefill_chunk=24)
    try:
        results = run_all(engine, prompts)
        for i, outs in enumerate(results):
            assert tokens(outs) == hf_reference[i], f"prompt {i} (len {len(prompts[i])})"
        assert engine.stats().steps_total < 8 * NEW_TOKENS  # they really ran together
        check_kv_released(engine)
    finally:
        engine.stop()


def test_greedy_under_preemption(
    loaded: Any, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    # KV for about two of the eight requests at full length: running sequences are preempted
    # (their KV back to the prefix cache), recomputed later, and still give the reference tokens.
    engine = make_engine(loaded, kv_memory_bytes=430 << 10, max_num_batched_tokens=64)
    try:
        results = run_all(engine, prompts)
        for i, outs in enumerate(results):
            assert tokens(outs) == hf_reference[i], f"prompt {i} (len {len(prompts[i])})"
        assert engine.scheduler.num_preemptions > 0
        check_kv_released(engine)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def loaded_bf16(tiny_mimo_dir: Any) -> LoadedLLM:
    """The tiny checkpoint in bf16: weights and KV pools in bf16, the CPU layer kernel computing in
    float32 (``llm_core.backends.selector``)."""
    loaded = load_llm(tiny_mimo_dir, dtype=torch.bfloat16)
    assert loaded.model.backends.layer.name == "cpu"
    return loaded


def test_bf16_greedy_is_the_same_alone_batched_chunked_and_cached(
    loaded_bf16: LoadedLLM, prompts: list[list[int]]
) -> None:
    """bf16 through the layer kernel: each prompt alone (no prefix cache) is the reference; all 8 in
    flight with chunked prefill, then again from the prefix cache, give the same ids."""
    engine = make_engine(loaded_bf16, enable_prefix_cache=False)
    try:
        alone = [tokens(outs) for p in prompts for outs in run_all(engine, [p])]
    finally:
        engine.stop()
    engine = make_engine(loaded_bf16, max_num_batched_tokens=64, max_prefill_chunk=24)
    try:
        for attempt in ("batched", "cached"):
            results = run_all(engine, prompts)
            for i, outs in enumerate(results):
                assert tokens(outs) == alone[i], f"{attempt}: prompt {i} (len {len(prompts[i])})"
            if attempt == "cached":  # every prompt of two pages or more starts from the cache
                assert all(
                    o[-1].num_cached_tokens > 0 for o, p in zip(results, prompts, strict=True) if len(p) >= 32
                )
        check_kv_released(engine)
    finally:
        engine.stop()
