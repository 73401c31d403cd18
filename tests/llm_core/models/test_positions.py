"""Rotary positions: M-RoPE prompt positions equal transformers' ``get_rope_index``; generated
tokens continue by the delta; the prefix-cache limit for prompts whose video outruns the text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from epd_common.messages.cache_keys import MediaSpan
from llm_core.models.positions import LinearPositions, MediaGrid, MRopePositions, mrope_prompt_positions
from llm_core.request import Sequence

IMAGE, VIDEO, START = 90, 91, 92  # placeholder and vision-start ids of the reference model below
MERGE, TPS = 2, 2


@pytest.fixture(scope="module")
def hf_model() -> Any:
    """A tiny Qwen2.5-VL model: only its config and get_rope_index are used."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "vocab_size": 128,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 1,
            "intermediate_size": 16,
            "out_hidden_size": 32,
            "spatial_merge_size": MERGE,
            "tokens_per_second": TPS,
        },
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
    )
    return Qwen2_5_VLModel(cfg).eval()


def _prompt(parts: list[tuple[str, Any]]) -> tuple[list[int], list[MediaGrid]]:
    """Token ids and grids for text runs ("text", n) and media ("image"|"video", (t, h, w), secs)."""
    ids: list[int] = []
    grids: list[MediaGrid] = []
    for kind, spec in parts:
        if kind == "text":
            ids += [5 + i % 50 for i in range(spec)]
            continue
        grid, seconds = spec
        n = grid[0] * (grid[1] // MERGE) * (grid[2] // MERGE)
        ids.append(START)
        grids.append(MediaGrid(len(ids), n, grid, seconds))
        ids += [IMAGE if kind == "image" else VIDEO] * n
        ids.append(93)
    return ids, grids


def _reference(model: Any, ids: list[int], grids: list[MediaGrid]) -> tuple[torch.Tensor, int]:
    images = [g.grid_thw for g in grids if g.seconds_per_grid_t is None]
    videos = [g for g in grids if g.seconds_per_grid_t is not None]
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == IMAGE] = 1
    types[input_ids == VIDEO] = 2
    pos, delta = model.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor([v.grid_thw for v in videos]) if videos else None,
        second_per_grid_ts=torch.tensor([v.seconds_per_grid_t for v in videos]) if videos else None,
    )
    return pos[:, 0], int(delta[0, 0])


CASES = {
    "image": [("text", 3), ("image", ((1, 4, 6), None)), ("text", 5)],
    "two images": [
        ("text", 2),
        ("image", ((1, 6, 4), None)),
        ("text", 1),
        ("image", ((1, 8, 8), None)),
        ("text", 4),
    ],
    "video": [("text", 4), ("video", ((3, 4, 4), 1.0)), ("text", 2)],
    "slow video": [("video", ((4, 4, 4), 2.5)), ("text", 3)],  # temporal positions outrun the text
    "image and video": [("image", ((1, 4, 4), None)), ("video", ((2, 6, 4), 0.75)), ("text", 6)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_positions_equal_get_rope_index(hf_model: Any, case: str) -> None:
    ids, grids = _prompt(CASES[case])
    ours = mrope_prompt_positions(len(ids), grids, MERGE, TPS)
    ref, ref_delta = _reference(hf_model, ids, grids)
    assert torch.equal(ours.positions, ref), case
    assert ours.delta == ref_delta


def _item(grid: tuple[int, int, int], seconds: float | None) -> Any:
    modality = "image" if seconds is None else "video"
    return SimpleNamespace(
        ref=SimpleNamespace(grid_thw=(grid,), modality=modality, seconds_per_grid_t=seconds)
    )


def _sequence(case: str, outputs: int = 0) -> Sequence:
    ids, grids = _prompt(CASES[case])
    seq = Sequence(
        seq_id=case,
        prompt_ids=ids,
        media=[MediaSpan(g.start, g.length, f"k{i}") for i, g in enumerate(grids)],
        mm_items=[_item(g.grid_thw, g.seconds_per_grid_t) for g in grids],
    )
    seq.output_ids = list(range(outputs))
    return seq


@pytest.mark.parametrize("case", ["image", "slow video"])
def test_sequence_positions_across_chunks_and_decode(hf_model: Any, case: str) -> None:
    seq = _sequence(case, outputs=3)
    scheme = MRopePositions(MERGE, TPS)
    n = seq.num_prompt_tokens
    whole = scheme.positions(seq, 0, n + 3)
    chunks = torch.cat([scheme.positions(seq, a, min(a + 5, n + 3)) for a in range(0, n + 3, 5)], dim=1)
    assert torch.equal(whole, chunks)  # chunked prefill sees the same positions
    ref, _ = _reference(hf_model, *_prompt(CASES[case]))
    assert torch.equal(whole[:, :n], ref)
    # generated tokens: the last prompt position + 1 + k per axis, as generate extends position ids
    assert torch.equal(whole[:, n:], ref[:, -1:] + 1 + torch.arange(3))
    assert seq.cacheable_tokens is None  # the prompt ends in text: generation continues it


def test_prefix_cache_limit_when_the_prompt_ends_in_media() -> None:
    ids, grids = _prompt([("text", 3), ("image", ((1, 4, 6), None))])
    ids = ids[:-1]  # drop the vision end: the prompt's last token is a pad
    seq = Sequence(
        seq_id="tail",
        prompt_ids=ids,
        media=[MediaSpan(grids[0].start, grids[0].length, "k")],
        mm_items=[_item(grids[0].grid_thw, None)],
    )
    scheme = MRopePositions(MERGE, TPS)
    last = scheme.positions(seq, len(ids) - 1, len(ids))[:, 0]
    assert len(set(last.tolist())) > 1  # the axes end apart
    assert torch.equal(scheme.positions(seq, len(ids), len(ids) + 1)[:, 0], last + 1)
    assert seq.cacheable_tokens == len(ids)  # generated KV stays out of the prefix cache
    scheme.release(seq.seq_id)
    assert seq.seq_id not in scheme._prompts


@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_offsets_agree_with_positions(case: str) -> None:
    """Past the prompt, the offsets give what ``positions`` gives (the runner's decode path); inside
    a prompt with media there are none."""
    seq = _sequence(case, outputs=4)
    scheme = MRopePositions(MERGE, TPS)
    n = seq.num_prompt_tokens
    for start in range(n, n + 4):
        offsets = scheme.linear_offsets(seq, start)
        assert offsets is not None
        want = scheme.positions(seq, start, n + 4)
        assert want.tolist() == [list(range(start + o, n + 4 + o)) for o in offsets]
    assert scheme.linear_offsets(seq, 0) is None and scheme.linear_offsets(seq, n - 1) is None
    scheme.release(seq.seq_id)
    assert seq.seq_id not in scheme._generated_offsets


def test_linear_offsets_of_a_text_prompt_are_zero() -> None:
    seq = Sequence(seq_id="text", prompt_ids=[5, 6, 7, 8])
    seq.output_ids = [9, 10]
    scheme = MRopePositions(MERGE, TPS)
    assert scheme.linear_offsets(seq, 0) == scheme.linear_offsets(seq, 5) == (0, 0, 0)
    assert torch.equal(scheme.positions(seq, 0, 6), torch.arange(6).expand(3, -1))
    assert LinearPositions().linear_offsets(seq, 3) == (0,)


def test_runner_positions_equal_the_scheme_per_sequence() -> None:
    """A batch mixing a prefill chunk inside a prompt with media, a decode token and a text prompt:
    the runner's [3, T] rows equal the scheme's positions, sequence after sequence."""
    from llm_core.serving.model_runner import ModelRunner

    scheme = MRopePositions(MERGE, TPS)
    runner = ModelRunner.__new__(ModelRunner)  # only the position scheme is used
    runner.position_scheme = scheme
    chunked, decoding = _sequence("two images"), _sequence("slow video", outputs=2)
    text = Sequence(seq_id="text", prompt_ids=[5, 6, 7])
    chunked.num_computed_tokens = 3
    decoding.num_computed_tokens = decoding.num_tokens - 1
    seqs, counts = [chunked, decoding, text], [9, 1, 3]
    want = torch.cat(
        [
            scheme.positions(s, s.num_computed_tokens, s.num_computed_tokens + c)
            for s, c in zip(seqs, counts, strict=True)
        ],
        dim=1,
    )
    assert runner._positions_nd(seqs, counts) == want.tolist()


def test_linear_positions() -> None:
    seq = Sequence(seq_id=1, prompt_ids=[1, 2, 3])
    assert LinearPositions().positions(seq, 1, 3).tolist() == [[1, 2]]


def test_grid_that_does_not_match_its_run() -> None:
    with pytest.raises(ValueError, match="merges to 6 tokens"):
        mrope_prompt_positions(10, [MediaGrid(1, 5, (1, 4, 6), None)], MERGE, TPS)
