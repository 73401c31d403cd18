"""Load a vision tower from a Hugging Face checkpoint directory, or the embedded default.

The checkpoint's config.json names the tower family (the shared registry,
``epd_common.checkpoint.registry``, by model_type); the family parses its config, builds its tower
and maps the tensors on disk to the tower's state dict (``encoder.models.family.VisionFamily``).
config.json and the weights are read by the readers every role shares
(``epd_common.checkpoint``): model.safetensors, or shards listed in model.safetensors.index.json
(in sub-folders too), or loose shards; the tower's tensors sit under one of the family's name
prefixes.

Only the vision tensors are read (shards holding only LLM or audio weights are never opened). Key
sets and shapes are checked strictly; every problem raises ``CheckpointError`` naming the file,
tensor or model_type. The fingerprint (sha256 over the canonical config, each tensor's name, shape,
stored dtype and bytes digest, and the compute dtype) identifies the embedding function: it feeds
the MediaKey so that a different checkpoint never reuses cached embeddings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from safetensors.torch import save_file

from encoder.models import family_for
from encoder.models.config import VisionConfig
from encoder.models.family import PATCH_EMBED, VisionFamily, VisionTower, VisionTowerConfig
from epd_common.checkpoint.config_json import CONFIG_FILE, read_config_json
from epd_common.checkpoint.errors import CheckpointError, UnknownArchitecture
from epd_common.checkpoint.generated import write_once
from epd_common.checkpoint.shards import read_tensors, shard_map
from epd_common.settings import default_checkpoint_dir, epd_home

# The tensor every tower has (the patch embedding), under its family's prefix: finds the prefix.
VISION_ANCHOR = PATCH_EMBED

# The embedded default (a value, not a code path: it loads through its family like any checkpoint):
# a small Qwen2.5-VL-shaped tower (window + full blocks, 2x2 merge, SwiGLU, head dim 32), so that a
# 448x448 image (1024 patches, ~1.1 GFLOP, half of it in the two full-attention blocks) takes tens
# of milliseconds on one CPU core.
DEFAULT_CONFIG = VisionConfig(
    depth=4,
    hidden_size=64,
    intermediate_size=192,
    num_heads=2,
    out_hidden_size=256,
    window_size=112,
    fullatt_block_indexes=(1, 3),
)
DEFAULT_SEED = 20250101
# Bump when random_encoder's generation changes: the default's directory name hashes this too.
DEFAULT_RECIPE_VERSION = 1


class LoadedEncoder(NamedTuple):
    model: VisionTower
    config: VisionTowerConfig
    fingerprint: str  # hex sha256


def default_model_dir() -> Path:
    """Where embedded defaults live: $EPD_HOME, else ~/.cache/epd."""
    return epd_home()


def read_vision_config(path: Path) -> VisionTowerConfig:
    """The tower config of the checkpoint directory ``path`` (full or vision-only)."""
    return _read_vision_family(path)[0]


def _read_vision_family(path: Path) -> tuple[VisionTowerConfig, VisionFamily]:
    """The tower's config and its family (which knows the tensor prefixes), from one config.json read."""
    raw = read_config_json(path)
    cfg_file = path / CONFIG_FILE
    try:
        family = family_for(raw)
    except UnknownArchitecture as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e
    vision = family.vision_config(raw)
    if vision is None:
        raise CheckpointError(f"{cfg_file}: model_type {raw.get('model_type')!r} without a vision_config")
    try:
        return family.parse_vision_config(vision), family
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: bad vision config: {e}") from e


def _family_of(cfg: VisionTowerConfig) -> VisionFamily:
    """The family a config belongs to (the one its own config.json body names)."""
    return family_for(cfg.to_hf_dict())


def _read_tensors(path: Path, cfg: VisionTowerConfig, family: VisionFamily) -> dict[str, torch.Tensor]:
    """The tower's tensors (names without the prefix), after strict key, shape and dtype checks.
    Only the files holding a tower tensor are opened."""
    shards = shard_map(path)
    prefixes = family.TENSOR_PREFIXES
    prefix = next((p for p in prefixes if p + VISION_ANCHOR in shards.files), None)
    if prefix is None:
        raise CheckpointError(
            f"{path}: no vision tower weights (looked for {[p + VISION_ANCHOR for p in prefixes]})"
        )
    expected = family.disk_shapes(cfg)
    # vision-only (prefix ""): everything at top level must belong to the tower
    read = read_tensors(shards, lambda name: name.startswith(prefix))
    tensors = {name[len(prefix) :]: t for name, t in read.tensors.items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {[prefix + m for m in missing[:8]]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {[prefix + u for u in unexpected[:8]]}")
    for name, t in tensors.items():
        where = read.files[prefix + name]
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(
                f"{where}: tensor {prefix + name} has shape {tuple(t.shape)}, expected {expected[name]}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor {prefix + name} has non-float dtype {t.dtype}")
    return tensors


def fingerprint(cfg: VisionTowerConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """sha256 over the canonical config, every tensor's (name, shape, dtype, bytes digest) and the
    compute dtype (bf16 and fp32 runs of one checkpoint give different embeddings)."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).reshape(-1).numpy().data).hexdigest()
        h.update(f"\n{name}|{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}|{digest}".encode())
    h.update(f"\ncompute_dtype={str(dtype).removeprefix('torch.')}".encode())
    return h.hexdigest()


def load_checkpoint_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedEncoder:
    """Load the vision tower from a Hugging Face checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
    cfg, family = _read_vision_family(path)
    tensors = _read_tensors(path, cfg, family)
    fp = fingerprint(cfg, tensors, dtype)
    state = family.to_module_state(cfg, {name: t.to(dtype) for name, t in tensors.items()})
    with torch.device("meta"):  # no weights allocated twice: the checkpoint's tensors are assigned
        model = family.build_tower(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    tower = cast(VisionTower, model.to(device).eval().requires_grad_(False))
    tower.resolve_attention(torch.device(device))  # "auto" resolved once, for this device
    return LoadedEncoder(tower, cfg, fp)


def save_vision_checkpoint(model: VisionTower, path: str | Path) -> None:
    """Write ``model`` as a checkpoint its family loads back (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    module = cast(torch.nn.Module, model)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(
        _family_of(cfg).to_disk_state(cfg, state), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    hf = cfg.to_hf_dict()
    hf["dtype"] = str(model.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def random_encoder(cfg: VisionTowerConfig, seed: int) -> Any:
    """A tower (of ``cfg``'s family) with weights drawn from a fixed seed: N(0, 1/fan_in) tensors,
    zero biases, unit norms. Same seed and config give the same bytes on every CPU.

    Typed ``Any``: callers get their family's concrete tower (a ``VisionTower`` and an nn.Module)."""
    model = _family_of(cfg).build_tower(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "ln_q" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def ensure_default_checkpoint(root: Path | None = None) -> Path:
    """Create the embedded default checkpoint under ``root/encoder-<recipe hash>`` once; return it.

    The directory name hashes the config, seed and recipe version, so changing the default never
    loads a checkpoint an older release generated. Concurrent workers see either no checkpoint or a
    complete one (``epd_common.checkpoint.generated.write_once``).
    """
    target = default_checkpoint_dir(
        root or default_model_dir(), "encoder", (DEFAULT_CONFIG, DEFAULT_SEED, DEFAULT_RECIPE_VERSION)
    )
    return write_once(
        target,
        lambda tmp: save_vision_checkpoint(random_encoder(DEFAULT_CONFIG, DEFAULT_SEED), tmp),
        complete=lambda d: (d / CONFIG_FILE).is_file(),
    )


def load_encoder(
    path: str | Path | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedEncoder:
    """Load a checkpoint directory; ``None`` means the embedded default under default_model_dir()."""
    if path is None:
        path = ensure_default_checkpoint()
    return load_checkpoint_dir(path, dtype=dtype, device=device)
