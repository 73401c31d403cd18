"""Run vLLM's MiMo audio modules on a tiny checkpoint: the reference side of test_mimo_audio_vllm.

Run by the vLLM venv's python (not ours), it imports nothing of this project:

    python mimo_audio_vllm_ref.py MELS.safetensors OUT.safetensors WEIGHTS_DIR [WEIGHTS_DIR ...]

MELS holds ``case{i}.clip{j}`` log-mels [T, 128]; each case is one call of vLLM's
``MimoAudioEncoder.get_audio_feature`` (its clips batched together as the model batches them) and
one of ``tokenize_audio_batch`` (the codes). For the k-th weights dir OUT gets ``w{k}.case{i}.rows``
[sum pads, hidden], ``w{k}.case{i}.pads`` (rows per clip) and ``w{k}.case{i}.clip{j}.codes`` [T', 20].

Everything runs in float32 on CPU at world size 1; nothing needs vLLM's distributed state (the
modules are plain torch and transformers' Qwen2Model). The one part that cannot run here is the
tokenizer's attention kernel, ``vllm.vllm_flash_attn.flash_attn_varlen_func`` (CUDA only): it is
replaced by ``_varlen_attention`` below, flash-attention's documented contract written out in plain
float64 torch (per ``cu_seqlens`` segment, key j visible to query i when i - left <= j <= i + right
with -1 unlimited, and j <= i when causal; softmax scale 1/sqrt(head_dim)).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    window_size=(-1, -1),
    softmax_scale=None,
    **_,
):
    left, right = int(window_size[0]), int(window_size[1])
    out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    bounds = cu_seqlens_q.tolist()
    for s, e in itertools.pairwise(bounds):
        qs, ks, vs = (x[s:e].double().transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        scores = (qs @ ks.transpose(1, 2)) * scale
        i = torch.arange(e - s)[:, None]
        j = torch.arange(e - s)[None, :]
        visible = torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        if causal:
            visible &= j <= i
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _install_attention() -> None:
    shim = types.ModuleType("vllm.vllm_flash_attn")
    shim.flash_attn_varlen_func = _varlen_attention  # type: ignore[attr-defined]
    sys.modules["vllm.vllm_flash_attn"] = shim


def _load_encoder(weights: Path):  # -> vLLM's MimoAudioEncoder, imported late
    from vllm.model_executor.models.mimo_audio import (
        MimoAudioEncoder,
        MiMoAudioTokenizer,
        MiMoAudioTokenizerConfig,
    )

    config = json.loads((weights / "config.json").read_text())
    encoder = MimoAudioEncoder(config["audio_config"], model_path="")
    # The main checkpoint's names as vLLM's MiMoV2OmniForCausalLM maps them (hf_to_vllm_mapper:
    # speech_embeddings. -> audio_encoder.speech_embeddings.), then below its audio_encoder.
    state = {}
    for name, tensor in load_file(str(weights / "model_audio.safetensors")).items():
        if name.startswith("speech_embeddings."):
            name = "audio_encoder." + name
        state[name.removeprefix("audio_encoder.")] = tensor
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("input_local_transformer.embed_tokens.")]
    if missing or unexpected:
        raise SystemExit(f"tower load: missing {missing}, unexpected {unexpected}")
    # MimoAudioEncoder._load_audio_tokenizer does this too, then casts to bf16; kept in fp32 here.
    tok_dir = weights / "audio_tokenizer"
    tokenizer = MiMoAudioTokenizer(
        MiMoAudioTokenizerConfig(**json.loads((tok_dir / "config.json").read_text()))
    )
    missing, _ = tokenizer.load_state_dict(load_file(str(tok_dir / "model.safetensors")), strict=False)
    missing = [m for m in missing if m.startswith("encoder.")]
    if missing:
        raise SystemExit(f"tokenizer load: missing {missing}")
    encoder.audio_tokenizer = tokenizer.float().eval().requires_grad_(False)
    return encoder.float().eval()


def main() -> None:
    mels_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    _install_attention()
    torch.manual_seed(0)
    from vllm.model_executor.models.mimo_audio import tokenize_audio_batch

    mels = load_file(str(mels_path))
    cases = sorted({k.split(".")[0] for k in mels}, key=lambda c: int(c[4:]))
    out: dict[str, torch.Tensor] = {}
    for w, weights in enumerate(sys.argv[3:]):
        encoder = _load_encoder(Path(weights))
        with torch.no_grad():
            for case in cases:
                clips = sorted(
                    (k for k in mels if k.startswith(case + ".")), key=lambda k: int(k.split("clip")[1])
                )
                batch = [mels[k] for k in clips]
                rows, pads = encoder.get_audio_feature(batch)
                out[f"w{w}.{case}.rows"] = rows.contiguous()
                out[f"w{w}.{case}.pads"] = torch.tensor(pads)
                codes = tokenize_audio_batch(
                    batch, encoder.audio_tokenizer.encoder, segment_size=encoder.audio_segment_size
                )
                for k, c in zip(clips, codes, strict=True):
                    out[f"w{w}.{k}.codes"] = c.contiguous()
    save_file(out, str(out_path))


if __name__ == "__main__":
    main()
