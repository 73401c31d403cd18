"""The embedded default's distilled MTP heads (llm_core/tools/mtp_distill.py,
llm_core/models/checkpoint.py) and MiMo-V2-Flash's model.mtp.* loading: the default loads with 3
trained heads that draft better than random ones, a short distillation lowers the loss and is
deterministic, the greedy data are the dense reference's, and the acceptance shortcut equals
explicit draft chains."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_core.models.checkpoint import (
    DEFAULT_SEED,
    CheckpointError,
    LoadedLLM,
    default_llm_config,
    load_llm,
    write_checkpoint,
)
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.mtp import MTPHeads
from llm_core.models.random_init import init_random_weights
from llm_core.tools.default_llm import DEFAULT_MTP_LAYERS, DISTILL_REPORT, ensure_default_checkpoint
from llm_core.tools.mtp_distill import (
    DistillRecipe,
    acceptance_lengths,
    chain_logits,
    distill_mtp_heads,
    draft_chain_dense,
    greedy_sequences,
    init_heads,
)

PROMPT_LEN = 16


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default, built here (its heads distilled: tens of seconds, once per process)."""
    return ensure_default_checkpoint(tmp_path_factory.mktemp("epd_home"))


@pytest.fixture(scope="module")
def default(default_dir: Path) -> LoadedLLM:
    return load_llm(default_dir)


@pytest.fixture(scope="module")
def fresh_data(default: LoadedLLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """12 greedy continuations of prompts the distillation never saw (another seed): ids, h0, greedy."""
    prompts = torch.randint(0, 256, (12, PROMPT_LEN), generator=torch.Generator().manual_seed(99))
    ids, h0, greedy, _ = greedy_sequences(default.model, prompts, 32)
    return ids, h0, greedy


def _untrained_target(seed: int = DEFAULT_SEED) -> DecoderForCausalLM:
    model = DecoderForCausalLM(default_llm_config())
    init_random_weights(model, seed)
    model.after_load()  # the packed layout its paged forward reads
    return model.eval().requires_grad_(False)


def test_default_has_three_trained_heads(default_dir: Path, default: LoadedLLM) -> None:
    raw = json.loads((default_dir / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == DEFAULT_MTP_LAYERS == 3
    assert default.mtp is not None and default.mtp.num_layers == 3
    # on disk in the release spelling, and what was loaded is what was written
    tensors = load_file(str(default_dir / "model.safetensors"))
    sink = "model.mtp.layers.2.self_attn.attention_sink_bias"
    assert sink in tensors and not any(k.endswith("self_attn.sinks") for k in tensors)
    for name, t in default.mtp.state_dict().items():
        disk = "model.mtp." + name.replace("self_attn.sinks", "self_attn.attention_sink_bias")
        assert torch.equal(tensors[disk], t), name
    # the heads are trained: not the seeded random init
    random_heads = MTPHeads(default.config, 3)
    init_heads(random_heads, 0)
    assert not torch.equal(default.mtp.layers[0].eh_proj.weight, random_heads.layers[0].eh_proj.weight)


def test_default_report_shows_trained_acceptance(default_dir: Path) -> None:
    report = json.loads((default_dir / DISTILL_REPORT).read_text())
    assert report["seed"] == DEFAULT_SEED
    assert report["recipe"] == dataclasses.asdict(DistillRecipe())
    assert report["acceptance"]["1"] > 1.3
    assert report["acceptance"]["1"] <= report["acceptance"]["2"] <= report["acceptance"]["3"]
    assert report["acceptance_start"]["1"] < 1.05  # random heads: ~1.0 (nothing accepted)
    assert all(e < s for s, e in zip(report["loss_start"], report["loss_end"], strict=True))


def test_loaded_heads_draft_on_new_prompts(
    default: LoadedLLM, fresh_data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """The default's heads as loaded from its checkpoint, on prompts they were not trained on."""
    ids, h0, _ = fresh_data
    assert default.mtp is not None
    trained, _ = acceptance_lengths(default.model, default.mtp, ids, h0, PROMPT_LEN)
    random_heads = MTPHeads(default.config, 3)
    init_heads(random_heads, 1)
    untrained, _ = acceptance_lengths(default.model, random_heads, ids, h0, PROMPT_LEN)
    assert trained[1] > 1.3 and untrained[1] < 1.05
    assert trained[3] > trained[1]


def test_acceptance_shortcut_equals_explicit_chains(
    default: LoadedLLM, fresh_data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Accepted drafts read off one teacher-forced pass == those of chains run one draft at a time."""
    ids, h0, _ = fresh_data
    heads = default.mtp
    assert heads is not None
    accepted_total = 0
    for seq, h in zip(ids[:3], h0[:3], strict=True):
        logits = chain_logits(default.model, heads, seq, h)
        for f in range(PROMPT_LEN - 1, seq.shape[0] - 5, 3):
            truth = seq[f + 2 : f + 5].tolist()  # the target's greedy t_{f+2} .. t_{f+4}
            drafts = draft_chain_dense(default.model, heads, seq[: f + 2], 3)
            explicit = next((m for m in range(3) if drafts[m] != truth[m]), 3)
            hits = [int(logits[j][f].argmax()) == truth[j] for j in range(3)]
            shortcut = next((m for m in range(3) if not hits[m]), 3)
            assert explicit == shortcut, (f, drafts, truth)
            assert drafts[:explicit] == truth[:explicit]
            accepted_total += explicit
    assert accepted_total > 0  # the comparison saw accepted drafts, not only misses


def test_greedy_data_are_the_dense_greedy_ids() -> None:
    model = _untrained_target()
    model.after_load()  # as served (load_llm packs the weights)
    prompts = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    ids, h0, greedy, _ = greedy_sequences(model, prompts, 6)
    for row, seq in zip(prompts, ids, strict=True):
        ref = row.tolist()
        for _ in range(6):  # the plain reference loop: one dense forward per token
            ref.append(int(model.forward_dense(torch.tensor([ref]))[0, -1].argmax()))
        assert seq.tolist() == ref
    logits = model.forward_dense(ids[:1])[0]  # h0 is forward_dense's hidden, exactly
    assert torch.equal(torch.nn.functional.linear(h0[0], model.lm_head.weight), logits)
    assert torch.equal(greedy[:, 9:-1], ids[:, 10:])


def test_short_distillation_lowers_loss_and_is_deterministic() -> None:
    model = _untrained_target()
    recipe = DistillRecipe(num_prompts=6, num_eval_prompts=2, new_tokens=12, steps=6, batch_size=2)
    runs = []
    for _ in range(2):
        heads = MTPHeads(model.config, 3)
        report = distill_mtp_heads(model, heads, 123, recipe)
        runs.append((heads.state_dict(), report))
    (a, ra), (b, rb) = runs
    assert all(e < s for s, e in zip(ra.loss_start, ra.loss_end, strict=True))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert dataclasses.replace(ra, seconds={}) == dataclasses.replace(rb, seconds={})
    other = MTPHeads(model.config, 3)
    distill_mtp_heads(model, other, 124, recipe)  # another seed trains other heads
    assert not torch.equal(other.state_dict()["layers.0.eh_proj.weight"], a["layers.0.eh_proj.weight"])
    assert not any(p.requires_grad for p in heads.parameters())


# ---- MiMo-V2-Flash checkpoints with model.mtp.* ----------------------------------------------------


def _flash_with_heads(tmp_path: Path, num_heads: int) -> Path:
    cfg = dataclasses.replace(default_llm_config(), num_hidden_layers=2, layer_types=(), mlp_layer_types=())
    model = DecoderForCausalLM(cfg)
    init_random_weights(model, seed=3)
    heads = MTPHeads(cfg, num_heads)
    init_heads(heads, 4)
    write_checkpoint(model, tmp_path, mtp=heads)
    return tmp_path


def _set_declared(d: Path, value: object) -> None:
    raw = json.loads((d / "config.json").read_text())
    if value is None:
        raw.pop("num_nextn_predict_layers")
    else:
        raw["num_nextn_predict_layers"] = value
    (d / "config.json").write_text(json.dumps(raw))


def test_flash_heads_load_when_declared(tmp_path: Path) -> None:
    d = _flash_with_heads(tmp_path / "c", 2)
    loaded = load_llm(d)
    assert loaded.mtp is not None and loaded.mtp.num_layers == 2
    written = load_file(str(d / "model.safetensors"))
    assert torch.equal(
        loaded.mtp.layers[1].self_attn.sinks, written["model.mtp.layers.1.self_attn.attention_sink_bias"]
    )


def test_flash_heads_are_skipped_unless_declared(tmp_path: Path) -> None:
    d = _flash_with_heads(tmp_path / "c", 2)
    for value in (None, 0):  # transformers' config (no field), or declared absent
        _set_declared(d, value)
        loaded = load_llm(d)
        assert loaded.mtp is None
    # stripped heads with the count left in config.json: served without heads
    _set_declared(d, 2)
    tensors = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if "mtp" not in k}
    save_file(tensors, str(d / "model.safetensors"))
    assert load_llm(d).mtp is None


def test_flash_head_count_must_match(tmp_path: Path) -> None:
    d = _flash_with_heads(tmp_path / "c", 2)
    _set_declared(d, 3)
    with pytest.raises(CheckpointError, match=r"num_nextn_predict_layers=3.*2 MTP heads"):
        load_llm(d)
    _set_declared(d, "three")
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers='three'"):
        load_llm(d)


def test_flash_head_tensors_are_strict(tmp_path: Path) -> None:
    d = _flash_with_heads(tmp_path / "c", 2)
    name = "model.mtp.layers.1.mlp.up_proj.weight"
    tensors = load_file(str(d / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.mtp\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_llm(d)
    shutil.rmtree(d)
