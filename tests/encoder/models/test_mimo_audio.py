"""MiMo-V2.5's audio encoder (encoder/models/mimo_audio) against a plain float64 reference.

The reference below is written from /work/shared/reference/mimo_v25.md section 6 and the tokenizer's
config semantics (the window pattern, the skip, the downsample), in float64, one segment and one
group at a time, with explicit masks and softmax, and shares no code with the package: it checks
the whole path (tokenizer encoder, RVQ codes, speech embeddings, input local transformer,
projection). ``test_mimo_audio_vllm`` (marked ``vllm``) checks the same weights against vLLM's own
modules. Here also: row counts against ``AudioTokenRule``, batch and segment invariance, and the
loader's names and errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from encoder.models.mimo_audio.encoder import MiMoAudioEncoder
from encoder.models.mimo_audio.tokenizer_config import AudioTokenizerConfig
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from encoder.models.mimo_audio.weights import AudioWeightsError, load_tokenizer, load_tower
from media_io.audio_tokens import AudioTokenRule
from tests.encoder.models.mimo_audio_fixture import TinyAudioCheckpoint, tiny_mel, write_tiny_audio_checkpoint

Tensors = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# The float64 reference


def _ln(x: torch.Tensor, w: Tensors, name: str) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * weight


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / 2**0.5))


def _rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, H, D]: transformers' x * cos + rotate_half(x) * sin with the angles repeated twice."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * freqs[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [L, 1, D]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[L, H, D] each, visible [L, L] -> [L, H * D]."""
    scores = torch.einsum("ihd,jhd->hij", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _linear(x: torch.Tensor, w: Tensors, name: str, bias: bool = True) -> torch.Tensor:
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if bias else y


def reference_codes(mel: torch.Tensor, tok: dict[str, object], w: Tensors) -> torch.Tensor:
    """One segment's codes [T', Q]; ``w`` the tokenizer file's tensors in float64."""
    x = mel.double().T[None]  # [1, n_mels, T]
    x = _gelu(F.conv1d(x, w["encoder.conv1.weight"], w["encoder.conv1.bias"], padding=1))
    x = _gelu(F.conv1d(x, w["encoder.conv2.weight"], w["encoder.conv2.bias"], stride=2, padding=1))
    x = x[0].T  # [L, d]
    n, heads = x.shape[0], int(tok["encoder_attention_heads"])  # type: ignore[call-overload]
    left, right = tok["encoder_attn_window_size"]  # type: ignore[misc]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    skip = None
    for layer in range(int(tok["encoder_layers"])):  # type: ignore[call-overload]
        p = f"encoder.layers.{layer}."
        full = bool(tok["hybrid_attention"]) and layer % 2 == 1
        visible = torch.ones(n, n, dtype=torch.bool)
        if not full and left >= 0:
            visible &= j >= i - left
        if not full and right >= 0:
            visible &= j <= i + right
        if tok["encoder_causal"]:
            visible &= j <= i
        h = _ln(x, w, p + "self_attn_layer_norm")
        q = _linear(h, w, p + "self_attn.q_proj").view(n, heads, -1)
        k = _linear(h, w, p + "self_attn.k_proj", bias=False).view(n, heads, -1)
        v = _linear(h, w, p + "self_attn.v_proj").view(n, heads, -1)
        pos = torch.arange(n)
        theta = float(tok["rope_theta"])  # type: ignore[arg-type]
        x = x + _linear(
            _attend(_rotary(q, pos, theta), _rotary(k, pos, theta), v, visible), w, p + "self_attn.out_proj"
        )
        h = _ln(x, w, p + "final_layer_norm")
        x = x + _linear(_gelu(_linear(h, w, p + "fc1")), w, p + "fc2")
        if layer + 1 == tok["encoder_skip_layer_id"]:
            skip = x.clone()
    x = _ln(x + skip if skip is not None else x, w, "encoder.layer_norm")
    if n % 2:
        x = torch.cat([x, torch.zeros(1, x.shape[1], dtype=x.dtype)])
    pairs = x.view(-1, 2, x.shape[1])  # [T', 2, d]
    kernel = w["encoder.down_sample_layer.0.weight"]  # [d, d, 2]
    x = _gelu(torch.einsum("tkc,ock->to", pairs, kernel))
    x = _ln(x, w, "encoder.down_sample_norm")
    codes = []
    for c in range(int(tok["num_quantizers"])):  # type: ignore[call-overload]
        book = w[f"encoder.quantizer.vq.layers.{c}._codebook.embed"]
        idx = ((x[:, None, :] - book[None, :, :]) ** 2).sum(-1).argmin(-1)
        x = x - book[idx]
        codes.append(idx)
    return torch.stack(codes, dim=1)


def reference_rows(codes: torch.Tensor, audio: dict[str, object], w: Tensors) -> torch.Tensor:
    """One clip's rows [ceil(T'/4), hidden] from its codes [T', 20]; ``w`` the main tensors in float64."""
    g = int(audio["group_size"])  # type: ignore[call-overload]
    heads = int(audio["input_local_attn_heads"])  # type: ignore[call-overload]
    while codes.shape[0] % g:
        codes = torch.cat([codes, codes[-1:]])
    rows = []
    t = "audio_encoder.input_local_transformer."
    for group in codes.view(-1, g, codes.shape[1]):
        x = sum(w[f"speech_embeddings.{c}.weight"][group[:, c]] for c in range(group.shape[1]))
        assert isinstance(x, torch.Tensor)
        for layer in range(int(audio["input_local_layers"])):  # type: ignore[call-overload]
            p = f"{t}layers.{layer}."
            h = _rms(x, w[p + "input_layernorm.weight"])
            q, k, v = (_linear(h, w, f"{p}self_attn.{n}_proj").view(g, heads, -1) for n in "qkv")
            pos = torch.arange(g)
            theta = float(audio["rope_theta"])  # type: ignore[arg-type]
            o = _attend(_rotary(q, pos, theta), _rotary(k, pos, theta), v, torch.ones(g, g, dtype=torch.bool))
            x = x + _linear(o, w, p + "self_attn.o_proj", bias=False)
            h = _rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = _linear(h, w, p + "mlp.gate_proj", False), _linear(h, w, p + "mlp.up_proj", False)
            x = x + _linear(F.silu(gate) * up, w, p + "mlp.down_proj", False)
        x = _rms(x, w[t + "norm.weight"]).reshape(-1)
        hidden = _gelu(x @ w["audio_encoder.projection.mlp.0.weight"].T)
        rows.append(hidden @ w["audio_encoder.projection.mlp.2.weight"].T)
    return torch.stack(rows)


def reference_clip(mel: torch.Tensor, ck: TinyAudioCheckpoint) -> tuple[torch.Tensor, torch.Tensor]:
    tok64 = {k: v.double() for k, v in ck.tokenizer_tensors.items()}
    main64 = {k: v.double() for k, v in ck.main_tensors.items()}
    segments = AudioTokenRule().segment_lengths(mel.shape[0])
    parts = torch.split(mel, segments)
    codes = torch.cat([reference_codes(p, ck.tokenizer_config, tok64) for p in parts])
    return codes, reference_rows(codes, ck.config["audio_config"], main64)


# ---------------------------------------------------------------------------------------------
# The package under test


def build(ck: TinyAudioCheckpoint) -> MiMoAudioEncoder:
    tok = load_tokenizer(AudioTokenizerConfig.from_dict(ck.tokenizer_config), ck.tokenizer_tensors)
    audio = ck.config["audio_config"]
    tower = load_tower(AudioTowerConfig.from_dicts(audio, ck.config["processor_config"]), ck.main_tensors)
    return MiMoAudioEncoder(tok, tower)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAudioCheckpoint:
    return write_tiny_audio_checkpoint(tmp_path_factory.mktemp("mimo_audio"))


WINDOWS = {
    "symmetric": {},  # the band kernel's path
    "causal": {"encoder_causal": True},
    "asymmetric": {"encoder_attn_window_size": [6, 2]},
}


@pytest.mark.parametrize("variant", sorted(WINDOWS))
def test_matches_float64_reference(tmp_path: Path, variant: str) -> None:
    ck = write_tiny_audio_checkpoint(tmp_path, seed=3, tokenizer_overrides=WINDOWS[variant])
    mels = [tiny_mel(t, seed=t) for t in (37, 611, 5, 400)]
    with torch.no_grad():
        out = build(ck)(mels)
    assert out.pad_counts == tuple(AudioTokenRule().pad_count(m.shape[0]) for m in mels)
    worst = 0.0
    for mel, codes, rows in zip(mels, out.codes, torch.split(out.rows, list(out.pad_counts)), strict=True):
        ref_codes, ref_rows = reference_clip(mel, ck)
        assert torch.equal(codes, ref_codes)
        worst = max(worst, (rows.double() - ref_rows).abs().max().item())
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 8, 9, 10, 17, 100, 5990, 6000, 6010])
def test_row_count_is_the_pad_formula(tiny: TinyAudioCheckpoint, frames: int) -> None:
    """0.1 s is 10 frames, 1 s 100, 59.9 s 5990, 60 s 6000, 60.1 s 6010."""
    with torch.no_grad():
        out = build(tiny)([tiny_mel(frames, seed=frames)])
    assert out.rows.shape == (AudioTokenRule().pad_count(frames), 48)
    assert out.codes[0].shape == (AudioTokenRule().pooled_frames(frames), 20)


def test_a_clip_gets_the_same_rows_in_any_batch(tiny: TinyAudioCheckpoint) -> None:
    """Odd lengths next to longer clips included: each segment is computed as if alone."""
    mels = [tiny_mel(t, seed=t) for t in (9, 1237, 3, 402, 77)]
    enc = build(tiny)
    with torch.no_grad():
        batched = enc(mels)
        alone = [enc([m]) for m in mels]
    for i, one in enumerate(alone):
        assert torch.equal(batched.codes[i], one.codes[0])
    torch.testing.assert_close(batched.rows, torch.cat([a.rows for a in alone]), atol=1e-5, rtol=0)


def test_long_clip_is_its_60s_pieces(tiny: TinyAudioCheckpoint) -> None:
    """A 70 s clip (segments of 6000 and 1000 frames) gives the rows of its two pieces encoded as
    clips: 6000 frames are 1500 codes, 375 whole groups, so no group straddles the cut."""
    mel = tiny_mel(7000, seed=70)
    enc = build(tiny)
    with torch.no_grad():
        whole = enc([mel])
        pieces = enc([mel[:6000], mel[6000:]])
    assert whole.pad_counts == (AudioTokenRule().pad_count(7000),) == (sum(pieces.pad_counts),)
    assert torch.equal(whole.codes[0], torch.cat(pieces.codes))
    torch.testing.assert_close(whole.rows, pieces.rows, atol=1e-5, rtol=0)


def test_checkpoint_name_spellings(tiny: TinyAudioCheckpoint) -> None:
    """``audio_encoder.speech_embeddings.*`` and ``audio_projection.*`` load as the release's names do."""
    renamed = {}
    for name, tensor in tiny.main_tensors.items():
        name = "audio_encoder." + name if name.startswith("speech_embeddings.") else name
        renamed[name.replace("audio_encoder.projection.", "audio_projection.")] = tensor
    renamed["audio_encoder.input_local_transformer.embed_tokens.weight"] = torch.zeros(3, 32)  # skipped
    cfg = AudioTowerConfig.from_dicts(tiny.config["audio_config"], tiny.config["processor_config"])
    a, b = load_tower(cfg, tiny.main_tensors), load_tower(cfg, renamed)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)


def test_missing_and_misshaped_tensors_are_named(tiny: TinyAudioCheckpoint) -> None:
    tok_cfg = AudioTokenizerConfig.from_dict(tiny.tokenizer_config)
    tower_cfg = AudioTowerConfig.from_dicts(tiny.config["audio_config"], tiny.config["processor_config"])
    tensors = dict(tiny.tokenizer_tensors)
    del tensors["encoder.quantizer.vq.layers.7._codebook.embed"]
    with pytest.raises(
        AudioWeightsError, match=r"missing tensor 'encoder\.quantizer\.vq\.layers\.7\._codebook\.embed'"
    ):
        load_tokenizer(tok_cfg, tensors)
    tensors = dict(tiny.tokenizer_tensors)
    del tensors["encoder.down_sample_layer.0.weight"]
    with pytest.raises(AudioWeightsError, match=r"missing tensor 'encoder\.down_sample_layer\.0\.weight'"):
        load_tokenizer(tok_cfg, tensors)
    tensors = {**tiny.tokenizer_tensors, "encoder.layers.2.fc1.weight": torch.zeros(64, 31)}
    with pytest.raises(
        AudioWeightsError,
        match=r"'encoder\.layers\.2\.fc1\.weight' has shape \[64, 31\], expected \[64, 32\]",
    ):
        load_tokenizer(tok_cfg, tensors)
    main = dict(tiny.main_tensors)
    del main["speech_embeddings.19.weight"]
    with pytest.raises(
        AudioWeightsError, match=r"missing tensor 'audio_encoder\.speech_embeddings\.19\.weight'"
    ):
        load_tower(tower_cfg, main)
    main = {**tiny.main_tensors, "audio_encoder.projection.mlp.2.weight": torch.zeros(4096, 512)}
    with pytest.raises(
        AudioWeightsError, match=r"projection\.mlp\.2\.weight' has shape \[4096, 512\], expected \[48, 512\]"
    ):
        load_tower(tower_cfg, main)


def test_codes_outside_the_vocabulary_are_refused(tiny: TinyAudioCheckpoint) -> None:
    tower = build(tiny).tower
    codes = torch.zeros(5, 20, dtype=torch.long)
    codes[2, 4] = 1280
    with pytest.raises(ValueError, match="outside the speech vocabularies"):
        tower([codes])


def test_tokenizer_and_processor_must_agree(tiny: TinyAudioCheckpoint) -> None:
    tok = load_tokenizer(AudioTokenizerConfig.from_dict(tiny.tokenizer_config), tiny.tokenizer_tensors)
    processor = {**tiny.config["processor_config"], "audio_avg_pooler": 4}
    tower = load_tower(AudioTowerConfig.from_dicts(tiny.config["audio_config"], processor), tiny.main_tensors)
    with pytest.raises(ValueError, match="avg_pooler: tokenizer 2, processor 4"):
        MiMoAudioEncoder(tok, tower)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
def test_triton_attention_path_gives_the_same_codes(tiny: TinyAudioCheckpoint) -> None:
    """The symmetric window and the full layers go through ``band_attention``'s Triton kernel on CUDA
    (the interpreter here): same codes, rows to float32 rounding."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    enc = build(tiny).to(device)
    mels = [tiny_mel(t, seed=t).to(device) for t in (33, 70)]
    with torch.no_grad():
        a, b = enc(mels, backend="torch"), enc(mels, backend="triton")
    for ca, cb in zip(a.codes, b.codes, strict=True):
        assert torch.equal(ca, cb)
    torch.testing.assert_close(a.rows, b.rows, atol=1e-4, rtol=0)
