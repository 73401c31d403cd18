"""``--quick`` smoke runs of bench.llm on the embedded default (MiMo-V2-Flash) and on the tiny
Qwen2.5-VL (``--tiny-qwen``): each finishes, the engine's greedy outputs equal transformers' token
for token, the summary carries the architecture, its target, both baselines and the verdicts, and
no round finds its prompts in the engine's prefix cache. Also the pieces the runs depend on: a
target for every architecture the loader serves, and prompt ids below the tokenizer's specials."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.common import usable_cores
from bench.llm import NO_BASELINE, TARGETS, make_prompts, regular_token_bound, tiny_qwen_dir
from llm_core.models import supported
from llm_core.tools.default_llm import ensure_default_checkpoint


def _quick(tmp_path: Path, *extra: str) -> dict[str, Any]:
    from bench.llm import main

    out = tmp_path / "llm.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--quick", "--json", str(out), *extra]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark pins torch threads for the whole process
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    assert summary["outputs_identical_to_transformers"] == summary["requests"] == 4
    assert summary["engine_tokens_per_s"] > 0 and summary["transformers_batched_tokens_per_s"] > 0
    assert summary["speedup_vs_transformers"] > 0 and summary["speedup_vs_transformers_sequential"] > 0
    target = TARGETS[summary["architecture"]]
    assert summary["target_speedup"] == target
    assert summary["meets_target_vs_batched"] == (summary["speedup_vs_transformers"] >= target)
    assert summary["torch_threads"] == usable_cores()  # by default both sides get one thread per core
    # The warm-up's prompts are not the rounds' prompts: no round is served from the prefix cache.
    assert summary["engine_cached_prompt_tokens_per_round"] == [0]
    # The engine ran its one-C-call decoder layer, not the torch modules.
    paths = {p["step"]: p for p in summary["engine_paths"]}
    assert paths["layer"]["fallback"] is None
    return summary


@pytest.mark.slow  # loads the model twice (ours and transformers') and generates with both: ~20 s CPU
@pytest.mark.timeout(300)
def test_quick_run_writes_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _quick(tmp_path, "--phases")
    assert s["architecture"] == "MiMoV2FlashForCausalLM" and s["target_speedup"] == 5.0
    # --phases: the engine thread's time per phase, one row per round (--quick: one round)
    printed = capsys.readouterr().out
    assert "engine thread time per round" in printed and "between steps" in printed
    # transformers has no sdpa for MiMo-V2-Flash: eager is the only choice, so nothing is probed
    assert s["transformers_attention"] == "eager" and s["transformers_attention_probe_s"] == {}


@pytest.mark.slow  # builds the tiny Qwen2.5-VL (~6 s), loads it twice, probes two attentions: ~15 s
@pytest.mark.timeout(300)
def test_quick_run_tiny_qwen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_BENCH_CACHE", str(tmp_path / "cache"))
    s = _quick(tmp_path, "--tiny-qwen")
    assert s["architecture"] == "Qwen2_5_VLForConditionalGeneration" and s["target_speedup"] == 3.0
    # both implementations were timed and the faster one ran the rounds
    probe = s["transformers_attention_probe_s"]
    assert set(probe) == {"eager", "sdpa"}
    assert s["transformers_attention"] == min(probe, key=probe.__getitem__)
    # built once into the cache (no temporary directory left); a second lookup reuses it
    (built,) = (tmp_path / "cache").iterdir()
    assert (built / "config.json").is_file() and (built / "tokenizer.json").is_file()
    assert tiny_qwen_dir() == built


def test_every_served_architecture_has_a_target() -> None:
    """A target, or a stated reason why transformers cannot be its baseline."""
    assert set(supported()) <= set(TARGETS) | set(NO_BASELINE)
    assert not set(TARGETS) & set(NO_BASELINE)


def test_prompt_ids_stay_below_the_special_tokens(tmp_path: Path) -> None:
    from tests.fixtures.qwen2_5_vl import BPE_VOCAB_SIZE, build_tokenizer

    # the embedded default: byte ids 0..255, specials from 256
    default = ensure_default_checkpoint()
    assert regular_token_bound(default, 512) == 256
    # the tiny Qwen2.5-VL tokenizer: BPE ids 0..479, then <|endoftext|> .. <|video_pad|>
    build_tokenizer().save_pretrained(tmp_path)
    assert regular_token_bound(tmp_path, 512) == BPE_VOCAB_SIZE == 480
    assert regular_token_bound(tmp_path, 300) == 300  # never past the embedding rows
    prompts = make_prompts(64, 1, 64, seed=0, vocab=480)
    ids = [t for p in prompts for t in p]
    assert min(ids) == 0 and 470 <= max(ids) < 480  # the whole range, nothing above it
