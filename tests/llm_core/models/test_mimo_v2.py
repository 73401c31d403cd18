"""MiMo-V2.5 (``MiMoV2ForCausalLM``) through our loader and the engine process, against transformers'
``MiMoV2FlashForCausalLM`` on the tiny checkpoint in the released layout (``tests.fixtures.mimo_v2``).

The reference gets the same weights by the tests' own reading of the checkpoint
(``tests.fixtures.mimo_v2_reference``: FP8 block dequantization and the per-rank de-interleave of
the fused qkv_proj, sharing no code with llm_core), the same rope thetas, window
(``sliding_window_size`` + the query, as transformers reads it) and sinks:

- prefill logits equal transformers' within 1e-4 relative in fp32 (dense and paged forward);
- 64 greedy tokens through ``/v1/completions`` of ``epd llm --model DIR`` equal transformers'
  ``generate``: alone, again from the prefix cache, in a batch of 8, and under chunked prefill;
- the shards holding only the vision tower or audio are never opened; the MTP heads are loaded;
- load errors (truncated shard, missing scale, wrong block size, qkv rows that do not divide by the
  rank count, a bad MTP tensor) name the tensor; ``epd/model_check.py`` accepts the directory.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from epd_common.checkpoint import shards as shard_reader
from llm_core.models.checkpoint import CheckpointError, LoadedLLM, load_llm
from llm_core.models.config import FULL, SLIDING
from llm_core.prompts.tokenizer import load_tokenizer
from tests.fixtures import mimo_v2 as fx
from tests.fixtures.mimo_v2_reference import (
    read_checkpoint,
    reference_model,
    reference_state,
    split_qkv,
    weight,
)
from tests.fixtures.qwen2_5_vl import CORPUS
from tests.llm_core.models.test_decoder import PagedSeq, free_lists, make_kv, rel_err, step

REPO = Path(__file__).resolve().parents[3]
NEW_TOKENS = 64
REL_TOL = 1e-4


def prompts(model_dir: Path) -> list[list[int]]:
    """8 prompts of 37-46 tokens (past the 17-key window) sharing a 10-token prefix."""
    tok = load_tokenizer(model_dir)
    out = [tok.encode(f"{CORPUS[0]} {CORPUS[9 + i]}") for i in range(8)]
    assert all(2 * fx.WINDOW < len(p) < 50 for p in out), [len(p) for p in out]
    return out


def reference_generate(model: Any, ids: list[int]) -> list[int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=gen)
    return [int(t) for t in out[0, len(ids) :]]


@pytest.fixture(scope="module")
def hf(mimo_v2_dir: Path) -> Any:
    return reference_model(mimo_v2_dir)


@pytest.fixture(scope="module")
def ours(mimo_v2_dir: Path) -> LoadedLLM:
    return load_llm(mimo_v2_dir)


@pytest.fixture(scope="module")
def expected(mimo_v2_dir: Path, hf: Any) -> list[list[int]]:
    return [reference_generate(hf, p) for p in prompts(mimo_v2_dir)]


# ---------------------------------------------------------------------------------------------
# Config, loading, parity


def test_fixture_has_the_release_layout(mimo_v2_dir: Path) -> None:
    """What the loader is judged on: the shards, dtypes, per-rank scale tiling and token ids."""
    cfg = json.loads((mimo_v2_dir / "config.json").read_text())
    index = json.loads((mimo_v2_dir / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, set[str]] = {}
    for name, file in index.items():
        by_file.setdefault(file, set()).add(name)
    assert set(by_file) == {*fx.SHARDS, fx.MTP_FILE}
    assert all(n.startswith("visual.") for n in by_file[fx.VISION_SHARD])
    assert all(n.startswith(("speech_embeddings.", "audio_encoder.")) for n in by_file[fx.AUDIO_SHARD])
    assert all(n.startswith("model.mtp.layers.") for n in by_file[fx.MTP_FILE])
    raw = read_checkpoint(mimo_v2_dir)
    assert raw["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    # 2 ranks x ceil(544 / 128) = 10 scale rows (the whole 1088 rows would tile to 9); SWA 2 x 6 (vs 11)
    assert raw["model.layers.0.self_attn.qkv_proj.weight"].shape == (1088, 128)
    assert raw["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (10, 1)
    assert raw["model.layers.1.self_attn.qkv_proj.weight"].shape == (1408, 128)
    assert raw["model.layers.1.self_attn.qkv_proj.weight_scale_inv"].shape == (12, 1)
    assert raw["model.mtp.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (12, 1)
    assert raw["model.layers.1.self_attn.qkv_proj.weight_scale_inv"].dtype == torch.float32
    assert raw["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert raw["model.layers.1.self_attn.attention_sink_bias"].dtype == torch.bfloat16
    assert "model.layers.0.self_attn.attention_sink_bias" not in raw  # full layers have no sinks
    assert raw["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert raw["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert raw["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["visual.patch_embed.proj.weight"].dtype == torch.bfloat16
    assert cfg["quantization_config"]["ignored_layers"][0] == "model.layers.0.self_attn.o_proj"
    # the config's token ids are the tokenizer's
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mimo_v2_dir)
    proc = cfg["processor_config"]
    for key, token in [
        ("image_token_id", fx.IMAGE_PAD),
        ("video_token_id", fx.VIDEO_PAD),
        ("vision_start_token_id", fx.VISION_START),
        ("vision_end_token_id", fx.VISION_END),
    ]:
        assert cfg[key] == proc[key] == tok.convert_tokens_to_ids(token), key
    for key, token in [
        ("video_start_token_id", fx.VIDEO_START),
        ("video_end_token_id", fx.VIDEO_END),
        ("audio_token_id", fx.AUDIO_PAD),
        ("audio_start_token_id", fx.AUDIO_START),
        ("audio_end_token_id", fx.AUDIO_END),
        ("pad_token_id", fx.ENDOFTEXT),
    ]:
        assert proc[key] == tok.convert_tokens_to_ids(token), key
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids(fx.IM_END) == tok.eos_token_id
    assert len(tok) < cfg["vocab_size"]
    assert cfg["vision_config"]["out_hidden_size"] == cfg["hidden_size"]


def test_config_reads_the_release_spelling(ours: LoadedLLM) -> None:
    cfg = ours.config
    assert ours.architecture == "MiMoV2ForCausalLM"
    assert cfg.layer_types == (FULL, SLIDING, SLIDING, SLIDING, SLIDING, FULL, SLIDING)
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 6
    assert cfg.sliding_window == fx.WINDOW + 1  # sliding_window_size previous tokens + the query
    assert (cfg.num_kv_heads(0), cfg.num_kv_heads(1)) == (2, 4)
    assert (cfg.rope_theta_of(0), cfg.rope_theta_of(1)) == (1e7, 1e4)
    assert cfg.rotary_dim(0) == cfg.rotary_dim(1) == 32  # int(96 * 0.334)
    assert cfg.has_sinks(1) and not cfg.has_sinks(0)
    assert cfg.attention_value_scale == 0.707 and cfg.routed_scaling_factor == 1.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.eos_token_id == fx.token_id(fx.IM_END)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"n_shared_experts": 1}, "n_shared_experts=1"),
        ({"hybrid_block_size": 4}, "hybrid_block_size=4"),
        ({"attention_projection_layout": "split"}, "attention_projection_layout='split'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling="),
        ({"num_key_value_heads": 4, "swa_num_key_value_heads": 2}, "key/value heads=2 do not split"),
    ],
)
def test_config_errors_name_the_field(edit: dict[str, Any], message: str) -> None:
    from llm_core.models import mimo_v2
    from llm_core.models.config import ConfigError

    raw = {**fx.text_config(), **edit}
    with pytest.raises(ConfigError, match=message):
        mimo_v2.parse_config(raw)


def test_weights_equal_the_reference_reading(mimo_v2_dir: Path, ours: LoadedLLM) -> None:
    """Every decoder tensor is exactly the test's own dequantized / de-interleaved value."""
    cfg = json.loads((mimo_v2_dir / "config.json").read_text())
    ref = reference_state(read_checkpoint(mimo_v2_dir), cfg)
    state = ours.model.state_dict()
    assert set(ref) <= set(state)
    for name, want in ref.items():
        assert torch.equal(state[name].float(), want), name
    router = ours.model.model.decoder_layers()[1].mlp.gate  # type: ignore[union-attr]
    assert router.weight.dtype == torch.float32


@pytest.mark.parametrize("index", [0, 3, 7])
def test_prefill_logits_match_transformers(mimo_v2_dir: Path, ours: LoadedLLM, hf: Any, index: int) -> None:
    ids = torch.tensor(prompts(mimo_v2_dir)[index])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    dense = ours.model.forward_dense(ids[None])[0]
    assert rel_err(dense, ref) <= REL_TOL
    kv = make_kv(ours.config, 8)
    paged = ours.model.compute_logits(step(ours.model, kv, [PagedSeq(*free_lists(8, seed=index))], [ids]))
    assert rel_err(paged, ref) <= REL_TOL, rel_err(paged, ref)


def test_mtp_heads_are_loaded_and_checked(mimo_v2_dir: Path, ours: LoadedLLM) -> None:
    assert ours.mtp is not None and len(ours.mtp.heads()) == fx.NUM_MTP_LAYERS
    raw = read_checkpoint(mimo_v2_dir)
    cfg = json.loads((mimo_v2_dir / "config.json").read_text())
    for i, head in enumerate(ours.mtp.heads()):
        p = f"model.mtp.layers.{i}."
        q, k, v = split_qkv(
            raw[p + "self_attn.qkv_proj.weight"],
            raw[p + "self_attn.qkv_proj.weight_scale_inv"],
            cfg["num_attention_heads"],
            cfg["swa_num_key_value_heads"],
            cfg["head_dim"],
            cfg["v_head_dim"],
            cfg["num_key_value_heads"],
        )
        attn = head.self_attn
        assert torch.equal(attn.q_proj.weight, q) and torch.equal(attn.k_proj.weight, k)
        assert torch.equal(attn.v_proj.weight, v)
        assert attn.sinks is not None and torch.equal(
            attn.sinks, raw[p + "self_attn.attention_sink_bias"].float()
        )
        assert torch.equal(head.eh_proj.weight, raw[p + "eh_proj.weight"].float())
        assert torch.equal(head.mlp.down_proj.weight, weight(raw, p + "mlp.down_proj.weight"))
        assert torch.equal(head.final_layernorm.weight, raw[p + "final_layernorm.weight"].float())
        assert all(t.dtype == torch.float32 for t in head.state_dict().values())


def test_never_opens_vision_or_audio_shards(mimo_v2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real = shard_reader.safe_open

    def spy(path: str, **kw: Any) -> Any:
        opened.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(shard_reader, "safe_open", spy)  # the shared shard reader
    load_llm(mimo_v2_dir)
    assert sorted(set(opened)) == sorted([fx.SHARDS[0], fx.SHARDS[1], fx.MTP_FILE])
    assert (mimo_v2_dir / fx.AUDIO_SHARD).is_file()


def test_checkpoint_without_a_tower(tmp_path: Path, ours: LoadedLLM) -> None:
    """``vision_config={}``: no vision_config, no visual.* tensors; the language model is the same."""
    d = fx.write_tiny_mimo_v2(tmp_path / "llm_only", vision_config={})
    assert "vision_config" not in json.loads((d / "config.json").read_text())
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.startswith("visual.") for n in index) and fx.VISION_SHARD not in index.values()
    loaded = load_llm(d)
    ids = torch.arange(20)[None]
    assert torch.equal(loaded.model.forward_dense(ids), ours.model.forward_dense(ids))


def test_bf16_load(mimo_v2_dir: Path, ours: LoadedLLM) -> None:
    """The checkpoint's own dtype: FP8 weights dequantized straight to bf16, the router kept fp32."""
    bf16 = load_llm(mimo_v2_dir, dtype=torch.bfloat16)
    layer = bf16.model.model.decoder_layers()[1]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32  # type: ignore[union-attr]
    want = ours.model.model.decoder_layers()[1].self_attn.q_proj.weight.bfloat16()
    assert torch.equal(layer.self_attn.q_proj.weight, want)


# ---------------------------------------------------------------------------------------------
# Load errors name the tensor


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _edit_shard(d: Path, file: str, edit: dict[str, torch.Tensor | None]) -> None:
    path = d / file
    tensors = load_file(str(path))
    for name, t in edit.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


def _shard_of(d: Path, name: str) -> str:
    return str(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name])


def _tensor(d: Path, name: str) -> torch.Tensor:
    with safe_open(str(d / _shard_of(d, name)), framework="pt") as f:
        return f.get_tensor(name)


def test_truncated_shard_names_the_tensor(mimo_v2_dir: Path, tmp_path: Path) -> None:
    d = _copy(mimo_v2_dir, tmp_path)
    path = d / fx.SHARDS[1]
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    last = max((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")[1]
    path.write_bytes(raw[:-1000])  # the last tensor's bytes are cut short
    with pytest.raises(CheckpointError, match=rf"{fx.SHARDS[1]}: unreadable.*truncated: tensor '{last}'"):
        load_llm(d)


def test_missing_scale_names_the_tensor(mimo_v2_dir: Path, tmp_path: Path) -> None:
    d = _copy(mimo_v2_dir, tmp_path)
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
    _edit_shard(d, _shard_of(d, name), {name: None})
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}'.*FP8 tensor 'model\.layers\.2\.mlp"):
        load_llm(d)


def test_wrong_block_size_names_the_tensor(mimo_v2_dir: Path, tmp_path: Path) -> None:
    d = _copy(mimo_v2_dir, tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"  # [2, 1] for [256, 128] in 128x128 blocks
    _edit_shard(d, _shard_of(d, name), {name: torch.ones(4, 2)})  # as if quantized in 64x64 blocks
    with pytest.raises(
        CheckpointError, match=rf"'{name}' has shape \(4, 2\).*128x128 blocks.*needs \(2, 1\)"
    ):
        load_llm(d)
    # the config's block size disagreeing with the stored scales: the first scale read is named
    d2 = _copy(mimo_v2_dir, tmp_path / "b")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv' has shape .*64x64 blocks"):
        load_llm(d2)


def test_qkv_rows_not_dividing_by_ranks_name_the_tensor(mimo_v2_dir: Path, tmp_path: Path) -> None:
    d = _copy(mimo_v2_dir, tmp_path)
    name = "model.layers.5.self_attn.qkv_proj.weight"  # 1088 rows = 2 ranks x 544
    _edit_shard(d, _shard_of(d, name), {name: _tensor(d, name)[:-1].contiguous()})
    with pytest.raises(CheckpointError, match=rf"'{name}' has 1087 rows, which do not divide into 2"):
        load_llm(d)


def test_bad_mtp_tensor_is_named(mimo_v2_dir: Path, tmp_path: Path) -> None:
    d = _copy(mimo_v2_dir, tmp_path)
    name = "model.mtp.layers.1.eh_proj.weight"
    _edit_shard(d, fx.MTP_FILE, {name: _tensor(d, name)[:, :128].contiguous()})
    with pytest.raises(
        CheckpointError, match=rf"'{name}' has shape \(128, 128\), the config implies \(128, 256\)"
    ):
        load_llm(d)
    d2 = _copy(mimo_v2_dir, tmp_path / "b")
    _edit_shard(d2, fx.MTP_FILE, {"model.mtp.layers.2.final_layernorm.weight": None})
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.mtp\.layers\.2\.final_layernorm\.weight'"
    ):
        load_llm(d2)


def test_model_check_accepts_the_directory(mimo_v2_dir: Path) -> None:
    from epd.model_check import check_model_dir

    raw = read_checkpoint(mimo_v2_dir)
    summary = check_model_dir(mimo_v2_dir)
    assert summary.architecture == "MiMoV2ForCausalLM"
    visual = {n: t for n, t in raw.items() if n.startswith("visual.")}
    language = {n: t for n, t in raw.items() if n.startswith(("model.", "lm_head."))}  # MTP heads included
    assert summary.vision.params == sum(t.numel() for t in visual.values())
    assert summary.vision.dtype == "BF16"
    assert summary.language.params == sum(
        t.numel() for n, t in language.items() if not n.endswith("_scale_inv")
    )
    assert summary.language.bytes == sum(t.numel() * t.element_size() for t in language.values())
    assert summary.language.dtype == "F8_E4M3"


# ---------------------------------------------------------------------------------------------
# Greedy decoding through the engine process (``epd llm``), against transformers' generate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextmanager
def llm_process(model_dir: Path, log: Path, *flags: str) -> Iterator[str]:
    """``epd llm --model DIR`` in fp32 on the CPU; yields its URL once /health answers."""
    port = _free_port()
    namespace = f"mimo-v2-test-{os.getpid()}-{port}"
    cmd = [sys.executable, "-m", "epd.cli", "llm", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--torch-threads", "1", "--cache-namespace", namespace]
    # 512-token sequences (not the checkpoint's 8192): the KV budget's split then leaves the SWA pool
    # room to keep a repeated prompt's window pinned while it decodes (needed for the cache hits below)
    cmd += ["--engine-max-model-len", "512"]
    with log.open("w") as out:
        proc = subprocess.Popen([*cmd, *flags], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                _http("GET", f"{url}/health", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"epd llm did not start:\n{log.read_text()[-4000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(f"/dev/shm/epd-{namespace}", ignore_errors=True)


def _complete(url: str, ids: list[int]) -> list[int]:
    body = {
        "prompt": ids,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice = _http("POST", f"{url}/v1/completions", body)["choices"][0]
    assert choice["prompt_token_ids"] == ids
    return [int(t) for t in choice["token_ids"]]


def _batch(url: str, batch: list[list[int]]) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda ids: _complete(url, ids), batch))


@pytest.mark.parametrize(
    "flags",
    [(), ("--engine-max-num-batched-tokens", "8")],
    ids=["whole-prefill", "chunked-prefill"],
)
def test_greedy_through_the_engine_process_equals_generate(
    mimo_v2_dir: Path, expected: list[list[int]], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    batch = prompts(mimo_v2_dir)
    assert len({tuple(e) for e in expected}) == len(expected)  # distinct answers: no degenerate model
    with llm_process(mimo_v2_dir, tmp_path / "llm.log", *flags) as url:
        for i in (0, 1, 2):  # alone
            assert _complete(url, batch[i]) == expected[i], f"prompt {i} alone"
        # Again, twice: the first repeat finds the prompt's full-layer KV in the tree but not the SWA
        # window before it (dropped as the first run decoded on), recomputes and heals it; the
        # second is served from the prefix cache (kv_manager.py, "Branch points").
        for i in (0, 1, 2):
            assert _complete(url, batch[i]) == expected[i], f"prompt {i} repeated"
        cached = _http("GET", f"{url}/health")["cached_prompt_tokens_total"]
        for i in (0, 1, 2):
            assert _complete(url, batch[i]) == expected[i], f"prompt {i} from the prefix cache"
        health = _http("GET", f"{url}/health")
        assert health["cached_prompt_tokens_total"] - cached >= 3 * 2 * 16  # >= 2 pages of each prompt
        steps = health["steps_total"]
        assert _batch(url, batch) == expected  # all 8 at once
        # batched: far fewer engine steps than 8 sequences one after the other would take
        assert _http("GET", f"{url}/health")["steps_total"] - steps < 4 * NEW_TOKENS
