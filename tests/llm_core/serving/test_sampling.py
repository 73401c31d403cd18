"""Sampler: greedy, filters, seeded reproducibility independent of the batch, stop strings."""

from __future__ import annotations

import pytest
import torch

from llm_core.serving.sampling import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    find_stop,
    stop_holdback,
)


def _logits(b: int, v: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    params = [SamplingParams(temperature=0.0)] * 5
    out = Sampler(seed=0)(logits, params, [None] * 5)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_takes_the_first_largest_and_nan_as_largest() -> None:
    """Ties go to the first index and a NaN counts as the largest value (torch.argmax's answer),
    whatever computes it."""
    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2], [nan, 5, nan, 1], [-inf, -inf, -inf, -inf], [0.0, -0.0, 0.0, -1], [2, inf, inf, 1]]
    logits = torch.tensor(rows)
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out.tolist() == [1, 0, 0, 0, 1] and out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_one_is_argmax_at_any_temperature() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    for _ in range(5):
        assert torch.equal(Sampler()(logits, params, [None] * 4), logits.argmax(-1))


def test_top_k_and_top_p_restrict_support() -> None:
    logits = _logits(1, v=32)
    order = logits[0].argsort(descending=True)
    sampler = Sampler(seed=1)
    topk = {int(sampler(logits, [SamplingParams(temperature=2.0, top_k=3)], [None])) for _ in range(300)}
    assert topk <= set(order[:3].tolist()) and len(topk) > 1
    # top_p: the kept set is the shortest prefix (by probability) whose mass reaches p.
    probs = torch.softmax(logits[0], -1)[order]
    n_keep = int((probs.cumsum(0) < 0.5).sum()) + 1
    got = {int(sampler(logits, [SamplingParams(top_p=0.5)], [None])) for _ in range(300)}
    assert got <= set(order[:n_keep].tolist())


def test_sampling_matches_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    sampler = Sampler(seed=3)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[int(sampler(logits, [SamplingParams()], [None]))] += 1
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_seeded_rows_independent_of_batch() -> None:
    v = 50
    target = _logits(1, v, seed=7)
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_logits: torch.Tensor, row: int, steps: int = 20) -> list[int]:
        b = batch_logits.shape[0]
        params = [SamplingParams(temperature=0.7, seed=i) if i != row else p for i in range(b)]
        gens = [q.make_generator() for q in params]
        sampler = Sampler()
        return [int(sampler(batch_logits, params, gens)[row]) for _ in range(steps)]

    alone = run(target, 0)
    batch = torch.cat([_logits(3, v, seed=9), target, _logits(2, v, seed=11)])
    assert run(batch, 3) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_params_validation_names_field() -> None:
    cases = [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids"),
    ]
    for kwargs, param in cases:
        with pytest.raises(SamplingParamsError) as ei:
            SamplingParams(**kwargs)
        assert ei.value.param == param


def test_find_stop_earliest_and_straddling() -> None:
    assert find_stop("hello world", ["world", "lo"]) == (3, "lo")
    assert find_stop("abc", ["x"]) is None
    # Text checked up to 4 chars ("abST"); "STOP" straddles that point and is still found.
    assert find_stop("abSTOP", ["STOP"], search_from=4) == (2, "STOP")
    assert stop_holdback(["STOP", "x"]) == 3
    assert stop_holdback([]) == 0
