"""The embedded default language model's files, written once: a tools step, run by ``epd serve``
and ``epd llm`` when no model is given (and by tests and benchmarks that use the default).

The target's weights come from ``init_random_weights`` with ``DEFAULT_SEED`` over
``default_llm_config()`` (both in ``llm_core.models.checkpoint``, which only reads checkpoints);
``DEFAULT_MTP_LAYERS`` multi-token-prediction heads are then distilled from it
(``mtp_distill.distill_mtp_heads``, tens of seconds on a CPU) and written beside it, with the
distillation's report as ``mtp_distill.json``, and the default tokenizer. The directory,
``default_model_dir()/llm-<hash of the recipe>``, is written to a temporary directory and renamed
into place, so concurrent first starts never see a half-written checkpoint.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from torch import Tensor

from epd_common.checkpoint.config_json import CONFIG_FILE
from epd_common.checkpoint.generated import write_once
from epd_common.settings import default_checkpoint_dir, epd_home
from llm_core.models.checkpoint import DEFAULT_SEED, default_llm_config, load_llm, write_checkpoint
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.mtp import MTPHeads
from llm_core.models.random_init import init_random_weights
from llm_core.tools.mtp_distill import DistillRecipe, distill_mtp_heads

# Bump when the default's generation (init_random_weights, the tokenizer, the heads' distillation)
# changes: the directory name hashes this together with the config, seed and distillation recipe.
# 2: the default gained DEFAULT_MTP_LAYERS distilled MTP heads.
DEFAULT_RECIPE_VERSION = 2
# The embedded default's MTP heads (MiMo-V2-Flash ships 3) and how they are distilled.
DEFAULT_MTP_LAYERS = 3
DEFAULT_DISTILL = DistillRecipe()
DISTILL_REPORT = "mtp_distill.json"


def default_model_dir() -> Path:
    """Root for embedded default checkpoints (``$EPD_HOME`` or ~/.cache/epd)."""
    return epd_home()


def _default_recipe() -> tuple[Any, ...]:
    """Everything the embedded default's files depend on (hashed into its directory name)."""
    return (default_llm_config(), DEFAULT_SEED, DEFAULT_RECIPE_VERSION, DEFAULT_MTP_LAYERS, DEFAULT_DISTILL)


# The default's distilled heads (state dict) and report, once per process: distilling takes tens of
# seconds and gives the same weights every time, so a second root (tests) copies them.
_default_heads: dict[str, tuple[dict[str, Tensor], dict[str, Any]]] = {}
_default_heads_lock = threading.Lock()


def _distilled_default_heads(model_dir: Path) -> tuple[MTPHeads, dict[str, Any]]:
    """The default's MTP heads, distilled from the target as ``load_llm`` serves it (fused weights,
    eval) from ``model_dir``, and the distillation report as JSON."""
    key = repr(_default_recipe())
    heads = MTPHeads(default_llm_config(), DEFAULT_MTP_LAYERS)
    with _default_heads_lock:  # concurrent first starts in one process distil once
        cached = _default_heads.get(key)
        if cached is None:
            target = load_llm(model_dir).model
            report = distill_mtp_heads(target, heads, DEFAULT_SEED, DEFAULT_DISTILL).to_json()
            cached = _default_heads[key] = ({k: v.clone() for k, v in heads.state_dict().items()}, report)
    heads.load_state_dict(cached[0])
    return heads.eval().requires_grad_(False), cached[1]


def ensure_default_checkpoint(root: Path | None = None) -> Path:
    """Create the embedded default checkpoint under ``root/llm-<recipe hash>`` once; return it.

    The target's weights come from ``init_random_weights`` with ``DEFAULT_SEED``; its
    ``DEFAULT_MTP_LAYERS`` heads are then distilled from it (``mtp_distill.distill_mtp_heads``, tens
    of seconds on a CPU) and written beside it, with the distillation's report as
    ``mtp_distill.json``. The directory name hashes the config, seed, recipe version and
    distillation recipe, so changing the default never loads a checkpoint an older release
    generated."""
    target = default_checkpoint_dir(root or default_model_dir(), "llm", _default_recipe())
    return write_once(
        target,
        _write_default,
        complete=lambda d: (d / CONFIG_FILE).is_file() and (d / "model.safetensors").is_file(),
    )


def _write_default(out_dir: Path) -> None:
    """The embedded default's files (see ``ensure_default_checkpoint``) into ``out_dir``."""
    model = DecoderForCausalLM(default_llm_config())
    init_random_weights(model, DEFAULT_SEED)
    write_checkpoint(model, out_dir)  # the target alone: loaded back to distill the heads from
    heads, report = _distilled_default_heads(out_dir)
    write_checkpoint(model, out_dir, mtp=heads)
    (out_dir / DISTILL_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    try:
        from llm_core.prompts.tokenizer import save_default_tokenizer
    except ImportError:
        pass
    else:
        save_default_tokenizer(out_dir)
