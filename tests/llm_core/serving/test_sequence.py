"""Sequence: token slices across the prompt / output boundary."""

from __future__ import annotations

from llm_core.serving.sequence import Sequence


def test_token_slice_equals_slicing_token_ids() -> None:
    seq = Sequence(seq_id=1, prompt_ids=[10, 11, 12, 13])
    seq.output_ids.extend([20, 21, 22])
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == seq.token_ids[start:end], (start, end)
