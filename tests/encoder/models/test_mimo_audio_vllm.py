"""MiMo-V2.5's audio encoder against vLLM's own modules (``vllm/model_executor/models/mimo_audio.py``:
``MiMoAudioTokenizer`` and its ``AudioEncoder`` with the RVQ, ``tokenize_audio_batch``, and
``MimoAudioEncoder.get_audio_feature``, the tower ``mimo_v2_omni.py``'s audio path calls).

vLLM runs in its own venv (``make vllm-peer``), in a subprocess (``mimo_audio_vllm_ref.py``) given
the tiny checkpoint's directory and a file of log-mels, on CPU in float32 at world size 1; nothing
there needs vLLM's distributed state. What was checked which way:

- vLLM's modules: the tokenizer encoder (convolutions, RoPE, layers, skip, LayerNorms, downsample),
  the RVQ encode, the segmenting into 60 s pieces and the batching of segments, the code grouping
  and last-frame padding, the speech embeddings, the input local transformer (transformers'
  Qwen2Model, bidirectional), the projection, and the checkpoint names as vLLM maps them.
- Written in the test instead: the tokenizer's attention kernel only. vLLM calls the CUDA-only
  ``flash_attn_varlen_func``; the subprocess puts in its place flash-attention's contract written
  out in float64 (per segment, the (left, right) window, causal). The unmarked
  ``test_mimo_audio.py`` checks the same math against a float64 reference of the whole path.

Codes must be identical, rows within 1e-4. One difference is kept out of the cases on purpose:
vLLM batches all segments of a call in one padded tensor, and a segment shorter than the longest
whose length is not a multiple of 4 then reads its padding (a conv1 output past its end, a copy of
its last row) where alone it reads zeros; ours computes every segment as if alone (its batch mates
never change a clip's rows). So batched cases use lengths that are multiples of 4 except for the
longest clip, and the one short odd clip batched with a longer one (case 5) is compared with vLLM
running it alone (case 6); the test prints whether vLLM's batched codes for it differ.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from media_io.audio_features import log_mel
from tests.encoder.models.mimo_audio_fixture import tiny_mel, write_tiny_audio_checkpoint
from tests.encoder.models.test_mimo_audio import build

VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".peers" / "vllm-venv" / "bin" / "python"
if not VLLM_PYTHON.exists():  # a worktree shares the main checkout's peers
    VLLM_PYTHON = Path("/work/main/.peers/vllm-venv/bin/python")
SCRIPT = Path(__file__).with_name("mimo_audio_vllm_ref.py")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM peer venv not installed (`make vllm-peer`)"),
]

VARIANTS = {"hybrid window": {}, "causal": {"encoder_causal": True}}


def _speech_like(seconds: float) -> torch.Tensor:
    """A 24 kHz chirp with noise, through the project's own log-mel (the model's real input path)."""
    n = int(seconds * 24000)
    t = torch.arange(n, dtype=torch.float64) / 24000
    gen = torch.Generator().manual_seed(7)
    wave = 0.3 * torch.sin(2 * math.pi * (200 * t + 400 * t**2)) + 0.05 * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    return log_mel([wave.float()])[0]


def _cases() -> list[list[torch.Tensor]]:
    return [
        [tiny_mel(1237, 1)],  # odd, alone
        [tiny_mel(400, 2), tiny_mel(1237, 3), tiny_mel(812, 4)],  # batched: the odd one is the longest
        [tiny_mel(7000, 5)],  # 70 s: segments of 6000 and 1000 frames
        [tiny_mel(5, 6)],  # 50 ms: 2 codes, one group
        [_speech_like(3.07)],  # real features
        [tiny_mel(9, 8), tiny_mel(1237, 3)],  # vLLM's batching reads the short odd clip's padding:
        [tiny_mel(9, 8)],  # ... so the 9-frame clip is compared with vLLM running it alone
    ]


# (case, clip) -> the (case, clip) of vLLM's output that ours must equal, where not the same.
COMPARED_WITH = {(5, 0): (6, 0)}


@pytest.mark.timeout(1200)  # vLLM's import alone takes about a minute on a busy 2-core machine
def _clip_rows(ref: dict[str, torch.Tensor], w: int, case: int, clip: int) -> torch.Tensor:
    """vLLM's rows of one clip of a case (its rows are the case's clips back to back)."""
    pads = ref[f"w{w}.case{case}.pads"].tolist()
    return torch.split(ref[f"w{w}.case{case}.rows"], pads)[clip]


def test_matches_vllm(tmp_path: Path) -> None:
    dirs = [
        write_tiny_audio_checkpoint(tmp_path / f"w{k}", seed=11 + k, tokenizer_overrides=o)
        for k, o in enumerate(VARIANTS.values())
    ]
    cases = _cases()
    mels_file, out_file = tmp_path / "mels.safetensors", tmp_path / "vllm.safetensors"
    save_file(
        {f"case{i}.clip{j}": m.contiguous() for i, c in enumerate(cases) for j, m in enumerate(c)},
        str(mels_file),
    )
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), str(mels_file), str(out_file), *(str(ck.root) for ck in dirs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = load_file(str(out_file))
    report = []
    for w, ck in enumerate(dirs):
        enc: MiMoAudioEncoder = build(ck)
        worst = 0.0
        for i, clips in enumerate(cases):
            with torch.no_grad():
                ours = enc(clips)
            assert list(ours.pad_counts) == ref[f"w{w}.case{i}.pads"].tolist()
            theirs = {j: _clip_rows(ref, w, i, j) for j in range(len(clips))}
            for j, (codes, rows) in enumerate(
                zip(ours.codes, torch.split(ours.rows, ours.pad_counts), strict=True)
            ):
                ri, rj = COMPARED_WITH.get((i, j), (i, j))
                if (ri, rj) != (i, j):
                    batched_differs = not torch.equal(
                        ref[f"w{w}.case{i}.clip{j}.codes"], ref[f"w{w}.case{ri}.clip{rj}.codes"]
                    )
                    report.append(
                        f"vLLM's codes of case {i} clip {j} batched differ from alone: {batched_differs}"
                    )
                    theirs[j] = _clip_rows(ref, w, ri, rj)
                assert torch.equal(codes, ref[f"w{w}.case{ri}.clip{rj}.codes"].long()), (w, i, j)
                worst = max(worst, (rows - theirs[j]).abs().max().item())
        report.append(f"{list(VARIANTS)[w]}: max |rows - vLLM| = {worst:.3g}")
        assert worst <= 1e-4, report
    print("; ".join(report))
