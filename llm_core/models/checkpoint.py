"""Load a language model checkpoint directory (or the embedded default) into DecoderForCausalLM, the
shared decoder. config.json's architecture picks the family (``llm_core.models``: MiMo-V2-Flash,
MiMo-V2.5, the Qwen2.5-VL family), which parses the config, names the language model's tensors (a
vision tower's shards are never opened), converts them into the decoder's layout (its
``tensor_converter``: e.g. MiMo-V2.5's FP8 dequantization and fused q/k/v split) and gives the
rotary position scheme. Tensors the family names under ``mtp.`` are loaded into ``mtp.MTPHeads``
(``LoadedLLM.mtp``). For MiMo-V2-Flash:

Accepted layouts (config.json + weights):

- ``model.safetensors`` or sharded ``model.safetensors.index.json`` + shards;
- experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers'
  ``save_pretrained`` and the original release write) or fused (``mlp.experts.gate_up_proj``
  [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I], transformers' in-memory layout);
- sinks as ``self_attn.attention_sink_bias`` (on disk) or ``self_attn.sinks``;
- ``model.mtp.*`` (multi-token-prediction heads) is skipped; with tied embeddings ``lm_head`` may
  be absent.

Loading is strict: any missing or unexpected tensor, or a shape mismatch, raises CheckpointError
naming the tensor; so does a truncated or corrupt shard (naming the file and the first tensor whose
bytes are cut off). The router (``mlp.gate.*``) stays fp32 whatever ``dtype`` is asked for.

The embedded default (``load_llm(None)``) is generated once from a fixed seed with the agreed small
config and stored under ``default_model_dir()/llm-<hash of the recipe>``; it is written to a temporary directory and
renamed into place so concurrent first starts never see a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from epd_common.settings import default_checkpoint_dir, epd_home
from llm_core.models import UnknownArchitecture, family_for, mimo_v2_flash
from llm_core.models.config import ConfigError, DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.family import TensorFormatError, tensor_converter_of
from llm_core.models.moe import TopKRouter
from llm_core.models.mtp import MTP_PREFIX, MTPFormatError, MTPHeads, num_layers_in, split_mtp_state
from llm_core.models.positions import LinearPositions, PositionScheme

DEFAULT_SEED = 20260101
# Bump when the default's generation (init_random_weights, the tokenizer) changes: the directory
# name hashes this together with the config and seed.
DEFAULT_RECIPE_VERSION = 1
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(Exception):
    """A checkpoint directory that cannot be loaded; the message names the file or tensor."""


class LoadedLLM(NamedTuple):
    model: DecoderForCausalLM
    config: DecoderConfig
    model_dir: Path
    positions: PositionScheme = LinearPositions()  # the family's rotary position scheme
    architecture: str = "MiMoV2FlashForCausalLM"
    mtp: MTPHeads | None = None  # multi-token-prediction heads, when the checkpoint has them (not run yet)


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


def default_model_dir() -> Path:
    """Root for embedded default checkpoints (``$EPD_HOME`` or ~/.cache/epd)."""
    return epd_home()


# ---- reading tensors -------------------------------------------------------------------------------


def weight_files(model_dir: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """The safetensors files holding tensors ``wanted`` accepts: with an index, only the shards
    that list one (a vision tower's shards are never opened by the LLM); without, every file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = [model_dir / name for name in sorted({f for t, f in weight_map.items() if wanted(t)})]
        if not files:
            raise CheckpointError(f"{index} lists none of the tensors this role reads")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight shard {f} listed in the index is missing")
    return files


def read_state_dict(model_dir: Path, rename: Callable[[str], str | None] | None = None) -> dict[str, Tensor]:
    """The checkpoint's tensors under their state-dict names. ``rename`` maps an on-disk name to
    ours, or to None for a tensor that is not this role's (never read); by default the MiMo
    family's (names kept, ``model.mtp.*`` skipped). Tensors are read through safetensors' memory
    map, one at a time. An unreadable file raises ``CheckpointError`` naming it (and, when it is
    cut short, the first tensor whose bytes are missing)."""
    rename = rename or mimo_v2_flash.tensor_name
    tensors: dict[str, Tensor] = {}
    for path in weight_files(model_dir, lambda name: rename(name) is not None):
        disk_name = None
        try:
            with safe_open(str(path), framework="pt") as f:
                for disk_name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    name = rename(disk_name)
                    if name is None:
                        continue
                    if name in tensors:
                        raise CheckpointError(
                            f"tensor {disk_name!r} ({name}) appears more than once in {model_dir}"
                        )
                    tensors[name] = f.get_tensor(disk_name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            where = f" reading tensor {disk_name!r}" if disk_name is not None else ""
            raise CheckpointError(
                f"{path}: unreadable safetensors file{where} ({e}){_truncation(path)}"
            ) from e
    return tensors


def _truncation(path: Path) -> str:
    """'; ...' naming the first tensor whose bytes lie past the end of ``path``, or '' when the file
    is not cut short (or its header cannot tell)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                return f"; the file is truncated: {size} bytes, its header alone needs {8 + n}"
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return ""
    data = size - 8 - n
    cut = [
        (int(v["data_offsets"][1]), k)
        for k, v in header.items()
        if isinstance(v, dict) and "data_offsets" in v and int(v["data_offsets"][1]) > data
    ]
    if not cut:
        return ""
    end, name = min(cut)
    return f"; the file is truncated: tensor {name!r} needs {end} data bytes, the file holds {data}"


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
    path: str | Path | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedLLM:
    """Load a checkpoint directory, or the embedded default when ``path`` is None (created on first use)."""
    model_dir = ensure_default_checkpoint() if path is None else Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    raw = read_config_json(model_dir)
    try:
        family = family_for(raw)
        config = family.parse_config(raw)
        # built before any tensor is read: a quantization the family cannot convert fails here
        convert = tensor_converter_of(family)(raw, config, dtype)
    except (ConfigError, UnknownArchitecture) as e:
        raise CheckpointError(f"{model_dir}/config.json: {e}") from e
    with torch.device("meta"):  # no throw-away random init of a possibly large model
        skeleton = DecoderForCausalLM(config)
    model = skeleton.to_empty(device="cpu").to(dtype)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.float()  # routing decisions are made in fp32, as in the reference
    try:
        state = to_model_layout(convert(read_state_dict(model_dir, family.tensor_name)), config)
    except (TensorFormatError, ConfigError) as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    mtp_state = split_mtp_state(state)
    load_state_dict_strict(model, state)
    del state
    model = model.to(device).eval()
    model.tie_weights()
    model.fuse_weights()
    model.requires_grad_(False)  # serving only; also lets inference-mode tensors mix with weights
    mtp = _load_mtp(mtp_state, config, dtype, device, model_dir) if mtp_state else None
    architecture = str(family.ARCHITECTURES[0])
    return LoadedLLM(model, config, model_dir, family.position_scheme(raw), architecture, mtp)


def _load_mtp(
    state: dict[str, Tensor],
    config: DecoderConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    where: Path,
) -> MTPHeads:
    """The multi-token-prediction heads from their tensors (``mtp.`` stripped), strictly checked."""
    try:
        num_layers = num_layers_in(state)
    except MTPFormatError as e:
        raise CheckpointError(f"{where}: {e}") from e
    with torch.device("meta"):
        skeleton = MTPHeads(config, num_layers)
    heads = skeleton.to_empty(device="cpu").to(dtype)
    load_state_dict_strict(heads, state, prefix="model." + MTP_PREFIX)
    return heads.to(device).eval().requires_grad_(False)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict; ``CheckpointError`` naming the file otherwise."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw


# ---- the embedded default ------------------------------------------------------------------------


def init_random_weights(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random init (normal(0, std) matrices, unit norms, zero router bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def write_checkpoint(model: DecoderForCausalLM, out_dir: Path) -> None:
    """Write config.json + model.safetensors in the on-disk layout (per-expert, attention_sink_bias)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, Tensor] = {}
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
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")


def ensure_default_checkpoint(root: Path | None = None) -> Path:
    """Create the embedded default checkpoint under ``root/llm-<recipe hash>`` once; return it.

    The directory name hashes the config, seed and recipe version, so changing the default never
    loads a checkpoint an older release generated."""
    target = default_checkpoint_dir(
        root or default_model_dir(), "llm", (default_llm_config(), DEFAULT_SEED, DEFAULT_RECIPE_VERSION)
    )
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llm-", dir=target.parent))
    try:
        model = DecoderForCausalLM(default_llm_config())
        init_random_weights(model, DEFAULT_SEED)
        write_checkpoint(model, tmp)
        try:
            from llm_core.prompts.tokenizer import save_default_tokenizer
        except ImportError:
            pass
        else:
            save_default_tokenizer(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another writer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
