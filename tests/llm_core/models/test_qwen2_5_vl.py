"""The Qwen2.5-VL family through our loaders and engine, against transformers on a tiny random
checkpoint (``tests.fixtures.qwen2_5_vl``: window and full blocks in the tower, M-RoPE, sharded).

The processor's pixel values go through our encoder loaded from the same directory, and its
embeddings into our language model loaded from it too:

- prefill logits with images and a video equal ``Qwen2_5_VLForConditionalGeneration``'s (fp32,
  relative error <= 1e-4);
- 32 greedy tokens through the paged engine equal ``generate``: alone, from the prefix cache, under
  chunked prefill with chunks smaller than an image's token count, and all scenarios at once;
- the language model opens only the shards that hold its tensors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from encoder.models.checkpoint import load_encoder
from epd_common.checkpoint import shards as shard_reader
from epd_common.messages.cache_keys import find_placeholder_runs, media_spans
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.models.positions import MRopePositions
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import MultimodalInput, Sequence
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from tests.fixtures.qwen2_5_vl import (
    SCENARIOS,
    prepare_inputs,
    reference_generate,
    reference_prefill_logits,
    scenario_messages,
)

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def qwen_llm(qwen_dir: Path) -> LoadedLLM:
    return load_llm(qwen_dir)


class Case:
    """One scenario: the processor's prompt ids, our encoder's embeddings, transformers' answers."""

    def __init__(self, qwen_dir: Path, media_dir: Path, name: str) -> None:
        messages = scenario_messages(name, media_dir)
        inputs = prepare_inputs(qwen_dir, messages)
        self.prompt: list[int] = inputs["input_ids"][0].tolist()
        encoder = load_encoder(qwen_dir).model
        self.mm: list[MultimodalInput] = []
        seconds = iter(inputs.get("second_per_grid_ts") or [])
        for modality, pix, grids in (
            ("image", inputs.get("pixel_values"), inputs.get("image_grid_thw")),
            ("video", inputs.get("pixel_values_videos"), inputs.get("video_grid_thw")),
        ):
            if pix is None:
                continue
            row = 0
            for i, grid in enumerate(grids.tolist()):
                n = grid[0] * grid[1] * grid[2]
                with torch.no_grad():
                    emb = encoder(pix[row : row + n], torch.tensor([grid]))  # [n / 4, hidden]
                row += n
                ref = EmbeddingRef(
                    key=f"{name}-{modality}-{i}",
                    dtype="float32",
                    shape=(emb.shape[0], emb.shape[1]),
                    grid_thw=(tuple(grid),),  # type: ignore[arg-type]
                    modality=modality,
                    seconds_per_grid_t=float(next(seconds)) if modality == "video" else None,
                )
                self.mm.append(MultimodalInput(ref, emb))
        # In prompt order (the engine pairs placeholder runs with refs in order): the processor
        # lists images and videos apart, each in its own order.
        tok = load_tokenizer(qwen_dir)
        starts = {
            modality: iter(s for s, _ in find_placeholder_runs(self.prompt, [pad]))
            for modality, pad in (("image", tok.image_token_id), ("video", tok.video_token_id))
        }
        at = {id(m): next(starts[m.ref.modality]) for m in self.mm}
        self.mm.sort(key=lambda m: at[id(m)])
        self.spans = media_spans(
            self.prompt,
            [tok.image_token_id, tok.video_token_id],
            [(m.ref.key, m.ref.num_tokens) for m in self.mm],
        )
        self.expected = reference_generate(qwen_dir, messages, NEW_TOKENS)
        self.logits = reference_prefill_logits(qwen_dir, messages)


@pytest.fixture(scope="module")
def cases(qwen_dir: Path, media_dir: Path) -> dict[str, Case]:
    return {name: Case(qwen_dir, media_dir, name) for name in SCENARIOS}


def test_family_and_shards(qwen_dir: Path, qwen_llm: LoadedLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    assert qwen_llm.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert isinstance(qwen_llm.positions, MRopePositions)
    cfg = qwen_llm.config
    assert cfg.mrope_section == (4, 6, 6) and cfg.attention_bias and cfg.num_window_layers == 0
    opened: list[str] = []
    real = shard_reader.safe_open

    def spy(path: str, **kw: Any) -> Any:
        opened.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(shard_reader, "safe_open", spy)  # the shared shard reader
    load_llm(qwen_dir)
    shards = sorted(p.name for p in qwen_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert shards[-1] not in opened  # the last shard holds only vision tensors
    assert sorted(set(opened)) == shards[: len(set(opened))]


@pytest.mark.parametrize("name", SCENARIOS)
def test_prefill_logits_match_transformers(qwen_llm: LoadedLLM, cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    model = qwen_llm.model
    ids = torch.tensor(case.prompt)
    with torch.inference_mode():
        emb = model.embed(ids).clone()  # [S, hidden], media rows written over the placeholders
        for span, item in zip(case.spans, case.mm, strict=True):
            emb[span.start : span.start + span.length] = item.embedding
    seq = Sequence(seq_id=name, prompt_ids=case.prompt, media=case.spans, mm_items=case.mm)
    rope = qwen_llm.positions.positions(seq, 0, len(case.prompt))  # [3, S]
    logits = model.forward_dense(ids[None], input_embeds=emb, rope_positions=rope)[0]
    err = (logits - case.logits).norm() / case.logits.norm()
    assert err <= 1e-4, float(err)


def _engine(loaded: LoadedLLM, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 8 << 20, "max_model_len": 1024, **kw})
    engine = LLMEngine(
        loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg, positions=loaded.positions
    )
    engine.start()
    return engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


async def _ids(engine: LLMEngine, case: Case) -> list[int]:
    return [t async for out in engine.generate(case.prompt, GREEDY, case.mm) for t in out.token_ids]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "chunked"])
def test_greedy_equals_generate(qwen_llm: LoadedLLM, cases: dict[str, Case], kw: dict[str, Any]) -> None:
    engine = _engine(qwen_llm, **kw)
    try:
        for name, case in cases.items():
            assert asyncio.run(_ids(engine, case)) == case.expected, name
        # the same prompts again: their prefixes are now in the radix cache
        before = engine.stats().cached_prompt_tokens_total
        for name, case in cases.items():
            assert asyncio.run(_ids(engine, case)) == case.expected, f"{name} from the prefix cache"
        assert engine.stats().cached_prompt_tokens_total > before

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(_ids(engine, c) for c in cases.values())))

        assert asyncio.run(together()) == [c.expected for c in cases.values()]
    finally:
        engine.stop()
