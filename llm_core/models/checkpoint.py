"""Load a language model checkpoint directory (or the embedded default) into DecoderForCausalLM, the
shared decoder. config.json's architecture picks the family (``llm_core.models``: MiMo-V2-Flash,
MiMo-V2.5, the Qwen2.5-VL family), which parses the config, names the language model's tensors (a
vision tower's shards are never opened), converts them into the decoder's layout (its
``tensor_converter``: e.g. MiMo-V2.5's FP8 dequantization and fused q/k/v split) and gives the
rotary position scheme. Tensors the family names under ``mtp.`` are loaded into ``mtp.MTPHeads``
(``LoadedLLM.mtp``); config.json's ``num_nextn_predict_layers``, when present, says how many heads
there are (0: none are read; a count that differs from the tensors' is an error; declared heads
whose tensors are all absent leave ``mtp`` None, as in a checkpoint stripped of them), and a family
with ``MTP_NEEDS_DECLARATION`` (MiMo-V2-Flash) reads its ``model.mtp.*`` only when the count is
declared. For MiMo-V2-Flash:

Accepted layouts (config.json + weights, both read by the readers every role shares,
``epd_common.checkpoint``):

- ``model.safetensors``, or sharded ``model.safetensors.index.json`` + shards (in sub-folders
  too), or loose shards without an index;
- experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers'
  ``save_pretrained`` and the original release write) or fused (``mlp.experts.gate_up_proj``
  [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I], transformers' in-memory layout);
- sinks as ``self_attn.attention_sink_bias`` (on disk) or ``self_attn.sinks``;
- ``model.mtp.layers.{i}.*`` (multi-token-prediction heads, sinks as ``attention_sink_bias``)
  loaded when config.json declares ``num_nextn_predict_layers``, skipped otherwise (transformers'
  config has no such field and its model drops them); with tied embeddings ``lm_head`` may be
  absent.

Loading is strict: any missing or unexpected tensor, or a shape mismatch, raises CheckpointError
naming the tensor; so does a truncated or corrupt shard (naming the file and the first tensor whose
bytes are cut off). The router (``mlp.gate.*``) stays fp32 whatever ``dtype`` is asked for.

The embedded default's config (``default_llm_config``) and seed live here; its files (the weights,
the distilled MTP heads, the tokenizer) are written by a tools step, ``llm_core.tools.default_llm``,
which ``epd serve`` and ``epd llm`` run when no model is given. The loader only reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from epd_common.checkpoint.config_json import CONFIG_FILE, read_config_json
from epd_common.checkpoint.errors import CheckpointError
from epd_common.checkpoint.registry import language_architecture
from epd_common.checkpoint.shards import read_tensors, shard_map
from llm_core.models import UnknownArchitecture, family_for, mimo_v2_flash
from llm_core.models.config import ConfigError, DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.family import TensorFormatError, tensor_converter_of
from llm_core.models.moe import TopKRouter
from llm_core.models.mtp import MTP_PREFIX, MTPFormatError, MTPHeads, num_layers_in, split_mtp_state
from llm_core.models.positions import LinearPositions, PositionScheme

DEFAULT_SEED = 20260101  # the embedded default's weights (``llm_core.tools.default_llm``)
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # config.json's head count
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class LoadedLLM(NamedTuple):
    model: DecoderForCausalLM
    config: DecoderConfig
    model_dir: Path
    positions: PositionScheme = LinearPositions()  # the family's rotary position scheme
    architecture: str = "MiMoV2FlashForCausalLM"
    mtp: MTPHeads | None = None  # multi-token-prediction heads, when the checkpoint has them


def default_llm_config() -> DecoderConfig:
    """The agreed embedded model: 8 layers, window 128, 8 experts top-2, hidden 256, vocab 512."""
    return DecoderConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        swa_num_key_value_heads=4,
        head_dim=64,
        v_head_dim=32,
        sliding_window=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=32768,
        eos_token_id=256,
    )


# ---- reading tensors -------------------------------------------------------------------------------


def read_state_dict(model_dir: Path, rename: Callable[[str], str | None] | None = None) -> dict[str, Tensor]:
    """The checkpoint's tensors under their state-dict names. ``rename`` maps an on-disk name to
    ours, or to None for a tensor that is not this role's (never read; with an index, shards
    holding only such tensors are never opened); by default the MiMo family's decoder tensors
    (names kept, ``model.mtp.*`` skipped). Tensors are read through safetensors' memory map. An
    unreadable file raises ``CheckpointError`` naming it (and, when it is cut short, the first
    tensor whose bytes are missing)."""
    rename = rename or _decoder_only(mimo_v2_flash.tensor_name)
    shards = shard_map(model_dir)
    if shards.index is not None and not shards.file_list(lambda n: rename(n) is not None):
        raise CheckpointError(f"{shards.index} lists none of the tensors this role reads")
    tensors: dict[str, Tensor] = {}
    for disk_name, t in read_tensors(shards, lambda n: rename(n) is not None).tensors.items():
        name = rename(disk_name)
        assert name is not None  # read only when renamed
        if name in tensors:
            raise CheckpointError(f"tensor {disk_name!r} ({name}) appears more than once in {model_dir}")
        tensors[name] = t
    return tensors


def _decoder_only(rename: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """``rename`` without the MTP heads' tensors (they are then never read)."""

    def name(disk_name: str) -> str | None:
        ours = rename(disk_name)
        return None if ours is None or ours.startswith(MTP_PREFIX) else ours

    return name


def declared_mtp_layers(raw: dict[str, Any]) -> int | None:
    """config.json's ``num_nextn_predict_layers`` (top level, else ``text_config``), or None when it
    has none; ``ConfigError`` for a value that is not a count."""
    text = raw.get("text_config")
    value = raw.get(MTP_LAYERS_KEY, text.get(MTP_LAYERS_KEY) if isinstance(text, dict) else None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{MTP_LAYERS_KEY}={value!r} is not a count of MTP layers")
    return value


def to_model_layout(raw: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Rename / fuse on-disk tensors into DecoderForCausalLM's state-dict layout."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, t in raw.items():
        m = _PER_EXPERT.match(name)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
            continue
        out[name.replace("self_attn.attention_sink_bias", "self_attn.sinks")] = t
    n = config.n_routed_experts
    for prefix, projs in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = projs.get(proj, {})
            missing = [e for e in range(n) if e not in have]
            if missing:
                raise CheckpointError(f"missing tensor {prefix}.{missing[0]}.{proj}.weight")
            extra = sorted(e for e in have if e >= n)
            if extra:
                raise CheckpointError(
                    f"unexpected tensor {prefix}.{extra[0]}.{proj}.weight (n_routed_experts={n})"
                )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shapes = {tuple(t.shape) for t in projs[proj].values()}
            if len(shapes) != 1:
                raise CheckpointError(f"{prefix}.*.{proj}.weight: experts disagree in shape {sorted(shapes)}")
        gate = torch.stack([projs["gate_proj"][e] for e in range(n)])  # [E, I, H]
        up = torch.stack([projs["up_proj"][e] for e in range(n)])  # [E, I, H]
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])  # [E, H, I]
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_state_dict_strict(model: nn.Module, state: dict[str, Tensor], prefix: str = "") -> None:
    """Copy ``state`` into ``model`` in place (converting to each target's dtype); every parameter and
    persistent buffer must be present with its shape and a float dtype. ``prefix`` goes before the
    names in error messages (the module's place in the checkpoint)."""
    expected = model.state_dict()
    if isinstance(model, DecoderForCausalLM) and model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"missing tensor {prefix + missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {prefix + unexpected[0]!r} ({len(unexpected)} unexpected in all)"
        )
    with torch.no_grad():
        for name, target in expected.items():
            src = state[name]
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {prefix + name!r} has shape {tuple(src.shape)}, the config implies "
                    f"{tuple(target.shape)}"
                )
            if not (src.is_floating_point() or src.is_complex()):
                raise CheckpointError(f"tensor {prefix + name!r} has non-float dtype {src.dtype}")
            target.copy_(src.to(target.dtype))


def load_llm(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedLLM:
    """Load a checkpoint directory (the embedded default's: ``llm_core.tools.default_llm``)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    raw = read_config_json(model_dir)
    try:
        family = family_for(raw)
        config = family.parse_config(raw)
        # built before any tensor is read: a quantization the family cannot convert fails here
        convert = tensor_converter_of(family)(raw, config, dtype)
        declared = declared_mtp_layers(raw)
    except (ConfigError, UnknownArchitecture) as e:
        raise CheckpointError(f"{model_dir / CONFIG_FILE}: {e}") from e
    # whether model.mtp.* are read at all: by the declared count, else by the family's convention
    wants_mtp = declared > 0 if declared is not None else not getattr(family, "MTP_NEEDS_DECLARATION", False)
    rename = family.tensor_name if wants_mtp else _decoder_only(family.tensor_name)
    with torch.device("meta"):  # no throw-away random init of a possibly large model
        skeleton = DecoderForCausalLM(config)
    model = skeleton.to_empty(device="cpu").to(dtype)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.float()  # routing decisions are made in fp32, as in the reference
    try:
        state = to_model_layout(convert(read_state_dict(model_dir, rename)), config)
    except (TensorFormatError, ConfigError) as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    mtp_state = split_mtp_state(state)
    load_state_dict_strict(model, state)
    del state
    model = model.to(device).eval()
    model.tie_weights()
    model.after_load()  # backends for this device and dtype, and the weight layout they read
    model.requires_grad_(False)  # serving only; also lets inference-mode tensors mix with weights
    mtp = _load_mtp(mtp_state, config, dtype, device, model_dir, declared) if mtp_state else None
    if mtp is not None:
        mtp.after_load(model.backends)  # the target's backends, and the packed layout a paged forward reads
    architecture = language_architecture(raw).name
    return LoadedLLM(model, config, model_dir, family.position_scheme(raw), architecture, mtp)


def _load_mtp(
    state: dict[str, Tensor],
    config: DecoderConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    where: Path,
    declared: int | None = None,
) -> MTPHeads:
    """The multi-token-prediction heads from their tensors (``mtp.`` stripped), strictly checked;
    ``declared``: config.json's head count, which the tensors must match."""
    try:
        num_layers = num_layers_in(state)
    except MTPFormatError as e:
        raise CheckpointError(f"{where}: {e}") from e
    if declared is not None and num_layers != declared:
        raise CheckpointError(
            f"{where}: config.json declares {MTP_LAYERS_KEY}={declared}, the checkpoint has tensors "
            f"for {num_layers} MTP heads (model.mtp.layers.0 .. {num_layers - 1})"
        )
    with torch.device("meta"):
        skeleton = MTPHeads(config, num_layers)
    heads = skeleton.to_empty(device="cpu").to(dtype)
    load_state_dict_strict(heads, state, prefix="model." + MTP_PREFIX)
    return heads.to(device).eval().requires_grad_(False)


# ---- the embedded default ------------------------------------------------------------------------


def write_checkpoint(model: DecoderForCausalLM, out_dir: Path, mtp: MTPHeads | None = None) -> None:
    """Write config.json + model.safetensors in the on-disk layout (per-expert, attention_sink_bias);
    with ``mtp``, its heads as ``model.mtp.layers.{i}.*`` and their count in config.json
    (``num_nextn_predict_layers``), the release's spelling."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, Tensor] = {}
    if mtp is not None:
        for name, t in mtp.state_dict().items():  # layers.{i}.* (no fused copies: not persistent)
            disk = "model." + MTP_PREFIX + name.replace("self_attn.sinks", "self_attn.attention_sink_bias")
            tensors[disk] = t.contiguous()
    for name, t in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                tensors[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                tensors[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[name.replace("self_attn.sinks", "self_attn.attention_sink_bias")] = t.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    if mtp is not None:
        hf[MTP_LAYERS_KEY] = mtp.num_layers
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
