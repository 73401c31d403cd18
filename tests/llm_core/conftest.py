"""Shared llm_core fixtures: a tiny random MiMo-V2-Flash checkpoint written by transformers.

The checkpoint is the reference for every parity test in llm_core (model, engine): it is written once
per test session by ``MiMoV2FlashForCausalLM.save_pretrained`` (so the on-disk layout is exactly what
transformers writes: per-expert MLP weights, ``attention_sink_bias``), beside the byte-level
``tokenizer.json`` (a checkpoint directory must ship one), with shapes chosen so that

- both layer types appear several times (7 layers: 0 and 5 full attention, the rest sliding window),
- prompts of a few dozen tokens exceed the window (``sliding_window = 8``),
- GQA is exercised in both layer types (8 query heads; 2 KV heads full, 4 KV heads SWA),
- ``v_head_dim`` (16) differs from ``head_dim`` (32) and the rotary dim is partial (int(32 * 0.334) = 10),
- routing uses groups (4 experts in 2 groups, top-1 group, top-2 experts) with a non-zero
  ``e_score_correction_bias`` so the selection bias matters.

Weights are drawn with a larger std than the transformers default so attention is far from uniform
and the sinks carry real mass; otherwise a broken mask or a dropped sink could hide in the noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch

from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.prompts.tokenizer import save_default_tokenizer

# Tiny matmuls gain nothing from intra-op threads, and on a loaded machine the thread hand-off costs
# ~100x the work itself; one thread keeps these tests fast and their timing stable.
torch.set_num_threads(1)

TINY_MIMO_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 7,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # SWA layers get 2x = 4
    "head_dim": 32,
    "v_head_dim": 16,
    "sliding_window": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1024,
    "initializer_range": 0.08,
    "eos_token_id": 256,
    "bos_token_id": None,
    "tie_word_embeddings": False,
}

TINY_MIMO_SEED = 1234


def build_tiny_mimo(out_dir: Path, tokenizer: bool = True, **overrides: Any) -> Path:
    """Write the tiny random checkpoint (config.json + model.safetensors) into ``out_dir``, with the
    byte-level tokenizer as its ``tokenizer.json`` (its 263 ids fit the 512 embedding rows) unless
    ``tokenizer`` is False; ``overrides`` change ``TINY_MIMO_CONFIG``'s fields."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    torch.manual_seed(TINY_MIMO_SEED)
    config = MiMoV2FlashConfig(**{**TINY_MIMO_CONFIG, **overrides})
    model = MiMoV2FlashForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(TINY_MIMO_SEED + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.copy_(torch.randn(param.shape, generator=gen) * 1.5)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer:
        save_default_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_mimo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny MiMo-V2-Flash checkpoint written by transformers' save_pretrained."""
    return build_tiny_mimo(tmp_path_factory.mktemp("tiny_mimo"))


@pytest.fixture(scope="session")
def tiny_mimo_hf(tiny_mimo_dir: Path) -> Any:
    """transformers' MiMoV2FlashForCausalLM loaded from ``tiny_mimo_dir`` (fp32, eager attention, eval)."""
    from transformers import MiMoV2FlashForCausalLM

    model = MiMoV2FlashForCausalLM.from_pretrained(
        tiny_mimo_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def loaded(tiny_mimo_dir: Path) -> LoadedLLM:
    """The tiny checkpoint loaded through our own loader (once per test module)."""
    return load_llm(tiny_mimo_dir)


class SimdKernel(Protocol):
    """A C-kernel wrapper module (``cpu_attention``, ``cpu_moe``)."""

    def simd(self) -> str | None: ...
    def set_simd(self, name: str) -> None: ...


def simd_fixture(kernel: SimdKernel) -> Any:
    """A fixture that runs a test once per SIMD level of ``kernel`` ("avx512" and "avx2" where the
    kernel and the CPU have them, "scalar"), restoring the level the kernel chose at import
    afterwards."""

    @pytest.fixture(params=["avx512", "avx2", "scalar"])
    def simd(request: pytest.FixtureRequest) -> Iterator[str]:
        before = kernel.simd()
        assert before is not None
        try:
            kernel.set_simd(request.param)
        except ValueError:
            pytest.skip(f"{request.param} is not available in this kernel on this CPU")
        yield request.param
        kernel.set_simd(before)

    return simd


@pytest.fixture(params=["small_m", "blas"])
def expert_product(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test with every routed expert through the small-M product, then through BLAS
    (``cpu_moe.set_blas_min_rows``), restoring the threshold chosen at import afterwards."""
    from llm_core.kernels import cpu_moe

    before = cpu_moe.blas_min_rows(), cpu_moe.bf16_blas_min_rows()
    rows = 1 if request.param == "blas" else 1 << 30
    cpu_moe.set_blas_min_rows(rows, rows)  # bf16 weights too
    yield request.param
    cpu_moe.set_blas_min_rows(*before)
