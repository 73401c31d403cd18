"""LLMEngine behaviour: multimodal injection parity, seeded sampling, stops, abort, admission."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.models.positions import MRopePositions
from llm_core.prompts.tokenizer import (
    AUDIO_PAD,
    VISION_END,
    VISION_START,
    Tokenizer,
    build_default_tokenizer,
    load_tokenizer,
)
from llm_core.request import MultimodalInput
from llm_core.serving.engine import EngineOverloaded, EngineRequestError, LLMEngine, StepOutput
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig

AUDIO_START, AUDIO_END = "<|mimo_audio_start|>", "<|mimo_audio_end|>"


def make_engine(loaded: Any, start: bool = True, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 512, **kw})
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)
    if start:
        engine.start()
    return engine


async def collect(engine: LLMEngine, prompt: list[int], sp: SamplingParams, mm: Any = ()) -> list[StepOutput]:
    return [o async for o in engine.generate(prompt, sp, mm)]


def ids_of(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def media_ref(key: str, rows: int, hidden: int, modality: str = "image") -> EmbeddingRef:
    return EmbeddingRef(
        key=key, dtype="float32", shape=(rows, hidden), grid_thw=((1, 2, rows * 2),), modality=modality
    )


def dense_greedy(model: Any, prompt: list[int], spans: list[tuple[int, torch.Tensor]], n: int) -> list[int]:
    """Reference: full recompute with forward_dense each step, media rows written into the embeddings."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        t = torch.tensor(ids)
        with torch.inference_mode():
            emb = model.embed(t).clone()  # [S, hidden]
            for start, rows in spans:
                emb[start : start + rows.shape[0]] = rows
            logits = model.forward_dense(t[None], input_embeds=emb)  # [1, S, vocab]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_multimodal_embeddings_match_dense_reference(loaded: Any) -> None:
    tok = load_tokenizer(loaded.model_dir)
    hidden = loaded.config.hidden_size
    g = torch.Generator().manual_seed(3)
    img = torch.randn(6, hidden, generator=g) * 0.5  # [6, hidden]
    vid = torch.randn(4, hidden, generator=g) * 0.5  # [4, hidden]
    prompt = (
        prompt_of(11, 1)
        + tok.encode(VISION_START)
        + [tok.image_token_id] * 6
        + tok.encode(VISION_END + "and")
        + tok.encode(VISION_START)
        + [tok.video_token_id] * 4
        + tok.encode(VISION_END)
        + prompt_of(5, 2)
    )
    img_at, vid_at = prompt.index(tok.image_token_id), prompt.index(tok.video_token_id)
    expected = dense_greedy(loaded.model, prompt, [(img_at, img), (vid_at, vid)], 12)
    # The media must matter, or the test could not catch rows written to the wrong place.
    assert expected != dense_greedy(loaded.model, prompt, [], 12)

    mm = [
        MultimodalInput(media_ref("img", 6, hidden), img),
        MultimodalInput(media_ref("vid", 4, hidden, "video"), vid),
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Whole prompt in one step, then 4-token chunks that cut both media spans.
    for kw in ({}, {"max_num_batched_tokens": 4}):
        engine = make_engine(loaded, **kw)
        try:
            assert ids_of(asyncio.run(collect(engine, prompt, sp, mm))) == expected, kw
        finally:
            engine.stop()


def audio_tokenizer() -> Tokenizer:
    """The tiny checkpoint's byte-level tokenizer plus MiMo-V2.5's audio placeholders (ids 263..265,
    inside the tiny model's 512 embedding rows)."""
    hf = build_default_tokenizer()
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (AUDIO_START, AUDIO_PAD, AUDIO_END)]
    )
    return Tokenizer(hf)


def test_audio_rows_match_dense_reference(loaded: Any) -> None:
    """An audio clip and a video with sound (its frames' runs and its track's runs interleaved per
    temporal patch): each item's rows land on its own pads, in item order, as in a dense reference
    with the rows written at the pads."""
    tok = audio_tokenizer()
    a_start, apad, a_end = (tok.encode(t)[0] for t in (AUDIO_START, AUDIO_PAD, AUDIO_END))
    vs, ve, vpad = tok.encode(VISION_START)[0], tok.encode(VISION_END)[0], tok.video_token_id
    assert apad == tok.audio_token_id and vpad is not None
    hidden = loaded.config.hidden_size
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(5, hidden, generator=g) * 0.5  # [5, hidden]: 5 audio pads
    vid = torch.randn(4, hidden, generator=g) * 0.5  # [4, hidden]: 2 patches of 2 pads
    track = torch.randn(3, hidden, generator=g) * 0.5  # [3, hidden]: 1 + 2 audio pads
    prompt = [*prompt_of(7, 1), a_start, *([apad] * 5), a_end, *prompt_of(3, 2)]
    prompt += [*b"00:00", vs, vpad, vpad, ve, a_start, apad, a_end]
    prompt += [*b"00:02", vs, vpad, vpad, ve, a_start, apad, apad, a_end, *prompt_of(4, 3)]
    clip_at = prompt.index(apad)
    v0 = prompt.index(vpad)
    v1 = prompt.index(vpad, v0 + 2)
    t0 = prompt.index(apad, v0)
    t1 = prompt.index(apad, v1)
    rows = [(clip_at, clip), (v0, vid[:2]), (v1, vid[2:]), (t0, track[:1]), (t1, track[1:])]
    expected = dense_greedy(loaded.model, prompt, rows, 10)
    assert expected != dense_greedy(loaded.model, prompt, rows[:1], 10)  # the track matters

    mm = [
        MultimodalInput(media_ref("clip", 5, hidden, "audio"), clip),
        MultimodalInput(media_ref("vid", 4, hidden, "video"), vid),
        MultimodalInput(media_ref("track", 3, hidden, "audio"), track),
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cfg = EngineConfig(kv_memory_bytes=4 << 20, max_model_len=512, max_num_batched_tokens=4)
    engine = LLMEngine(loaded.model, loaded.config, tok, cfg)
    engine.start()
    try:
        assert ids_of(asyncio.run(collect(engine, prompt, sp, mm))) == expected
    finally:
        engine.stop()
    # Rows in the wrong order (the track before its video) or a tokenizer without the audio pad:
    # refused, naming the item.
    for tokenizer, items, param in (
        (tok, [mm[0], mm[2], mm[1]], "multimodal[2]"),
        (load_tokenizer(loaded.model_dir), mm, "multimodal[0]"),
    ):
        bad = LLMEngine(loaded.model, loaded.config, tokenizer, cfg)

        async def submit(engine: LLMEngine = bad, items: list[MultimodalInput] = items) -> None:
            engine.submit(prompt, sp, items)

        with pytest.raises(EngineRequestError) as ei:
            asyncio.run(submit())
        assert ei.value.param == param, str(ei.value)


def test_mrope_engines_refuse_media_over_several_runs_and_audio(loaded: Any) -> None:
    """M-RoPE places each image or video as one grid: a video over two runs (MiMo-V2.5's layout)
    or audio is refused at submit, naming the item, before any step runs."""
    tok = audio_tokenizer()
    hidden = loaded.config.hidden_size
    vpad, apad = tok.video_token_id, tok.audio_token_id
    assert vpad is not None and apad is not None
    cfg = EngineConfig(kv_memory_bytes=4 << 20, max_model_len=512)
    engine = LLMEngine(loaded.model, loaded.config, tok, cfg, positions=MRopePositions(2, 2.0))
    sp = SamplingParams(max_tokens=2)
    cases = [
        (
            [1, vpad, vpad, 2, vpad, vpad, 3],
            MultimodalInput(media_ref("v", 4, hidden, "video"), torch.zeros(4, hidden)),
        ),
        ([1, apad, apad, 3], MultimodalInput(media_ref("a", 2, hidden, "audio"), torch.zeros(2, hidden))),
    ]
    for prompt, item in cases:

        async def submit(prompt: list[int] = prompt, item: MultimodalInput = item) -> None:
            engine.submit(prompt, sp, [item])

        with pytest.raises(EngineRequestError, match="M-RoPE") as ei:
            asyncio.run(submit())
        assert ei.value.param == "multimodal[0]"


def test_multimodal_alignment_errors_name_the_item(loaded: Any) -> None:
    tok = load_tokenizer(loaded.model_dir)
    hidden = loaded.config.hidden_size
    engine = make_engine(loaded, start=False)
    prompt = [*b"look: ", *[tok.image_token_id] * 3, *b"!"]
    sp = SamplingParams(max_tokens=4)
    cases = [
        ([], "multimodal"),  # a run without media
        (
            [MultimodalInput(media_ref("a", 4, hidden), torch.zeros(4, hidden))],
            "multimodal[0]",
        ),  # 3 != 4 rows
        ([MultimodalInput(media_ref("a", 3, 8), torch.zeros(3, 8))], "multimodal[0]"),  # hidden size
        ([MultimodalInput(media_ref("a", 3, hidden, "video"), torch.zeros(3, hidden))], "multimodal[0]"),
    ]

    async def submit(mm: list[MultimodalInput]) -> None:
        engine.submit(prompt, sp, mm)

    for mm, param in cases:
        with pytest.raises(EngineRequestError) as ei:
            asyncio.run(submit(mm))
        assert ei.value.param == param, str(ei.value)


def test_seeded_sampling_is_independent_of_the_batch(loaded: Any) -> None:
    sp = SamplingParams(temperature=1.0, top_k=50, seed=77, max_tokens=16, ignore_eos=True)
    prompt = prompt_of(20, 4)
    engine = make_engine(loaded)
    try:
        alone = ids_of(asyncio.run(collect(engine, prompt, sp)))

        async def crowd() -> list[list[StepOutput]]:
            others = [
                collect(
                    engine, prompt_of(9 + i, 10 + i), SamplingParams(temperature=0.8, max_tokens=20, seed=i)
                )
                for i in range(3)
            ]
            return list(await asyncio.gather(collect(engine, prompt, sp), *others))

        together = ids_of(asyncio.run(crowd())[0])
        assert together == alone
        greedy = ids_of(asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16))))
        assert alone != greedy  # it really sampled
    finally:
        engine.stop()


def test_stop_strings_stop_ids_and_streamed_text(loaded: Any) -> None:
    tok = load_tokenizer(loaded.model_dir)
    prompt = [*b"The quick brown fox jumps over"]
    engine = make_engine(loaded)
    try:
        base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        ref = asyncio.run(collect(engine, prompt, base))
        ref_ids = ids_of(ref)
        ref_text = "".join(o.text for o in ref)
        assert ref_text == tok.decode(ref_ids)  # streamed deltas add up to the decoded output

        # Stop id: the output ends at its first occurrence; the id is returned but not rendered.
        stop_id = next(t for t in ref_ids[5:] if t < 256)
        cut = ref_ids.index(stop_id)
        outs = asyncio.run(
            collect(engine, prompt, SamplingParams(**{**base.__dict__, "stop_token_ids": (stop_id,)}))
        )
        assert ids_of(outs) == ref_ids[: cut + 1]
        assert outs[-1].finish_reason == "stop"
        assert "".join(o.text for o in outs) == tok.decode(ref_ids[:cut])

        # Stop string taken from the middle of the reference text: the output is cut before it.
        mid = len(ref_text) // 2
        stop = ref_text[mid : mid + 2]
        expected = ref_text[: ref_text.find(stop)]
        outs = asyncio.run(
            collect(engine, prompt, SamplingParams(**{**base.__dict__, "stop": ("\x00never", stop)}))
        )
        assert outs[-1].finish_reason == "stop"
        assert "".join(o.text for o in outs) == expected
        assert len(ids_of(outs)) < len(ref_ids)
        engine.scheduler.kv.check_integrity([])
    finally:
        engine.stop()


def test_abort_on_early_exit_frees_kv(loaded: Any) -> None:
    engine = make_engine(loaded)
    try:

        async def leave_early() -> int:
            n = 0
            async for _ in engine.generate(prompt_of(30, 6), SamplingParams(max_tokens=300, ignore_eos=True)):
                n += 1
                if n == 3:
                    break  # closing the generator aborts the request
            return n

        assert asyncio.run(leave_early()) == 3
        deadline = time.monotonic() + 5
        while engine.scheduler.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.scheduler.num_running == 0
        engine.scheduler.kv.check_integrity([])
        assert engine.stats().num_running == 0
    finally:
        engine.stop()


def test_admission_is_bounded(loaded: Any) -> None:
    engine = make_engine(loaded, start=False, max_waiting=2)  # not started: requests stay waiting
    sp = SamplingParams(max_tokens=4)

    async def fill() -> None:
        engine.submit([1, 2, 3], sp)
        engine.submit([1, 2, 3], sp)
        with pytest.raises(EngineOverloaded) as ei:
            engine.submit([1, 2, 3], sp)
        assert ei.value.retry_after_s > 0
        with pytest.raises(EngineRequestError) as e2:
            engine.submit([1] * 500, SamplingParams(max_tokens=100))
        assert e2.value.param == "max_tokens"

    asyncio.run(fill())
    assert engine.stats().num_waiting == 2


def test_failed_forward_fails_only_that_batch(loaded: Any) -> None:
    engine = make_engine(loaded, start=False)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(*args)

    engine.runner.execute = flaky  # type: ignore[method-assign]
    engine.start()
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        failed = asyncio.run(collect(engine, prompt_of(12, 7), sp))
        assert failed[-1].finished and failed[-1].finish_reason == "error"
        engine.scheduler.kv.check_integrity([])
        ok = asyncio.run(collect(engine, prompt_of(12, 7), sp))  # the engine keeps serving
        assert ok[-1].finish_reason == "length" and len(ids_of(ok)) == 4
    finally:
        engine.stop()


def test_stop_leaves_resources_open_while_a_step_still_runs(loaded: Any) -> None:
    """A step thread that outlives stop's join keeps what it writes to: the transports and the
    store are closed only once the thread is gone (a later stop does it)."""
    import threading

    engine = make_engine(loaded, start=False)
    release = threading.Event()
    closed: list[str] = []

    class Events:
        def close(self) -> None:
            closed.append("kv_events")

    engine.kv_events = Events()  # type: ignore[assignment]
    engine._thread = threading.Thread(target=release.wait, daemon=True)  # a step that will not end yet
    engine._thread.start()
    engine.stop(timeout_s=0.05)
    assert closed == [] and engine._thread is not None
    release.set()
    engine.stop()
    assert closed == ["kv_events"] and engine._thread is None


def recorded_batch_sizes(engine: LLMEngine) -> list[int]:
    """The number of sequences of each step the engine runs from now on (filled as it runs)."""
    real = engine.runner.execute
    batches: list[int] = []

    def record(batch: Any) -> Any:
        batches.append(len(batch.seqs))
        return real(batch)

    engine.runner.execute = record  # type: ignore[method-assign]
    return batches


def test_an_idle_engine_gathers_a_burst_into_its_first_step(loaded: Any) -> None:
    """Requests arriving one after another, each within ``burst_quiet_ms`` of the last, share the
    first step; once they stop coming the step starts without waiting out ``burst_gather_ms``."""
    engine = make_engine(loaded, start=False, burst_gather_ms=5000.0, burst_quiet_ms=300.0)
    batches = recorded_batch_sizes(engine)
    engine.start()
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def burst() -> tuple[list[list[StepOutput]], float]:
        tasks = []
        for i in range(4):  # 30 ms apart: well inside the 300 ms quiet window
            tasks.append(asyncio.ensure_future(collect(engine, prompt_of(8, 20 + i), sp)))
            await asyncio.sleep(0.03)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*tasks)
        return outs, time.perf_counter() - t0

    try:
        outs, after_last = asyncio.run(burst())
        assert all(o[-1].finish_reason == "length" for o in outs)
        assert batches[0] == 4, batches  # one step took the whole burst
        assert after_last < 4.0, after_last  # it began once the burst went quiet, not at the cap
    finally:
        engine.stop()


def test_a_burst_that_fills_a_step_starts_without_waiting_for_quiet(loaded: Any) -> None:
    """The gather ends once the waiting prompts fill a step (``max_num_batched_tokens``), however
    long the quiet it would otherwise wait for; a lone request waits the quiet once."""
    engine = make_engine(
        loaded, start=False, burst_gather_ms=20_000.0, burst_quiet_ms=4000.0, max_num_batched_tokens=32
    )
    batches = recorded_batch_sizes(engine)
    engine.start()
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def burst() -> float:
        t0 = time.perf_counter()
        # 2 x 16 prompt tokens fill the 32-token step: submitted together, the first step starts at once
        await asyncio.gather(*(collect(engine, prompt_of(16, 40 + i), sp) for i in range(2)))
        return time.perf_counter() - t0

    try:
        took = asyncio.run(burst())
        assert batches[0] == 2, batches
        assert took < 4.0, took  # neither the 4 s quiet nor its 12 s within a burst
    finally:
        engine.stop()
