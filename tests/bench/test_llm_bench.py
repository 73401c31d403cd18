"""A ``--quick`` smoke run of bench.llm: it finishes, the engine's greedy outputs equal transformers'
token for token, the summary carries both baselines and the target verdicts, and no round finds
its prompts in the engine's prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.common import usable_cores


@pytest.mark.slow  # loads the model twice (ours and transformers') and generates with both: ~20 s CPU
@pytest.mark.timeout(300)
def test_quick_run_writes_summary(tmp_path: Path) -> None:
    from bench.llm import TARGET_SPEEDUP, main

    out = tmp_path / "llm.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--quick", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark pins torch threads for the whole process
    s = json.loads(out.read_text())["summary"]
    assert s["outputs_identical_to_transformers"] == s["requests"] == 4
    assert s["engine_tokens_per_s"] > 0 and s["transformers_batched_tokens_per_s"] > 0
    assert s["speedup_vs_transformers"] > 0 and s["speedup_vs_transformers_sequential"] > 0
    assert s["target_speedup"] == TARGET_SPEEDUP
    assert s["meets_target_vs_batched"] == (s["speedup_vs_transformers"] >= TARGET_SPEEDUP)
    assert s["torch_threads"] == usable_cores()  # by default both sides get one thread per core
    # The warm-up's prompts are not the rounds' prompts: no round is served from the prefix cache.
    assert s["engine_cached_prompt_tokens_per_round"] == [0]
