"""``epd serve --model DIR``: check the directory before any role starts, and say what it holds.

Every role loads its own part of the directory in its own process, so a broken directory would
otherwise surface as one child failing while the others run (a half-started service). This check
runs in the serve process first and reads only metadata (config.json, the safetensors headers,
the tokenizer, the chat template, the processor files):

    config.json             parses; its architecture is one the engine serves (the list if not)
    tokenizer.json          present and within the embedding rows
    chat template           compiles
    processor files         parse
    vision tower            config present; its tensors are in the weights; its output width
                            (``vision_config.out_hidden_size``) is the language model's hidden size

Each failure is a ``ModelDirError`` naming the file, field or tensor. ``ModelSummary.describe``
is the start banner's line: architecture, parameters, dtype and bytes per role.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import NamedTuple

from encoder.models import family_for as vision_family_for
from encoder.models.checkpoint import VISION_ANCHOR, read_vision_config
from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError, UnknownArchitecture
from epd_common.checkpoint.registry import language_architecture
from epd_common.checkpoint.shards import TensorHeader, shard_map, tensor_headers
from llm_core.models import family_for
from llm_core.models.config import ConfigError
from llm_core.models.fp8 import SCALE_SUFFIX
from llm_core.prompts.chat_template import TemplateFileError, load_chat_template
from llm_core.prompts.tokenizer import TokenizerError, load_tokenizer
from media_io.processor_config import ProcessorConfigError, preprocess_config_from_dir

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4}


class ModelDirError(ValueError):
    """A checkpoint directory that cannot serve every role; names what is wrong and where."""


class RoleWeights(NamedTuple):
    params: int
    bytes: int
    dtype: str  # the stored dtype of most parameters ("BF16", "F32", "F8_E4M3", ...)


class ModelSummary(NamedTuple):
    path: Path
    architecture: str
    vision: RoleWeights
    language: RoleWeights

    def describe(self) -> str:
        def role(name: str, w: RoleWeights) -> str:
            return f"{name} {w.params / 1e6:.1f}M params ({w.dtype}, {w.bytes / 2**20:.1f} MiB)"

        return (
            f"model {self.path}: {self.architecture}; {role('vision tower', self.vision)}, "
            f"{role('language model', self.language)}"
        )


def check_model_dir(path: str | Path) -> ModelSummary:
    """Check ``path`` serves every role (see the module docstring); raises ``ModelDirError``."""
    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(f"{root}: not a checkpoint directory")
    try:
        raw = read_config_json(root)
        family = family_for(raw)
        llm_config = family.parse_config(raw)
        load_tokenizer(root)
        load_chat_template(root)
        preprocess_config_from_dir(root)
        vision_config = read_vision_config(root)
    except (
        CheckpointError,
        UnknownArchitecture,
        ConfigError,
        TokenizerError,
        TemplateFileError,
        ProcessorConfigError,
    ) as e:
        raise ModelDirError(str(e)) from e
    if vision_config.out_hidden_size != llm_config.hidden_size:
        raise ModelDirError(
            f"{root / 'config.json'}: vision_config.out_hidden_size={vision_config.out_hidden_size} differs "
            f"from the language model's hidden_size={llm_config.hidden_size}: the tower's embeddings "
            "cannot stand in for its tokens"
        )
    shapes = _tensor_headers(root)
    # A full checkpoint keeps the tower under a prefix of its family ("" is a tower-only checkpoint).
    prefixes = tuple(p for p in vision_family_for(raw).TENSOR_PREFIXES if p)
    anchors = [p + VISION_ANCHOR for p in prefixes]
    if not any(a in shapes for a in anchors):
        raise ModelDirError(f"{root}: no vision tower tensors in the weights (looked for {anchors})")
    vision = {n: s for n, s in shapes.items() if n.startswith(prefixes)}
    language = {n: s for n, s in shapes.items() if family.tensor_name(n) is not None and n not in vision}
    if not language:
        raise ModelDirError(f"{root}: no language-model tensors in the weights")
    return ModelSummary(root, language_architecture(raw).name, _role(vision), _role(language))


def _role(headers: dict[str, TensorHeader]) -> RoleWeights:
    """Parameters, stored bytes and dtype of one role's tensors. Block-quantization scales
    (``<weight>_scale_inv``) count in the bytes but are not parameters; the dtype is the one most
    parameters are stored in (an FP8 checkpoint has about as many fp32 scale tensors as weights)."""
    weights = {n: v for n, v in headers.items() if not n.endswith(SCALE_SUFFIX)}
    params = sum(n for n, _ in weights.values())
    size = sum(n * _DTYPE_BYTES.get(d, 4) for n, d in headers.values())
    dtypes: Counter[str] = Counter()
    for n, d in weights.values():
        dtypes[d] += n
    return RoleWeights(params, size, dtypes.most_common(1)[0][0] if dtypes else "-")


def _tensor_headers(root: Path) -> dict[str, TensorHeader]:
    """name -> (elements, stored dtype) from every weight file's header (no tensor is read)."""
    try:
        return tensor_headers(shard_map(root))
    except CheckpointError as e:
        raise ModelDirError(str(e)) from e
