"""Names of dtypes and devices as config fields and flags spell them, shared by every role."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_dtype(owner: str, name: str) -> None:
    """Raise ValueError naming ``owner`` (e.g. "WorkerConfig.dtype") when ``name`` is not a known dtype."""
    if name not in DTYPES:
        raise ValueError(f"{owner} must be one of {sorted(DTYPES)}, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """ "auto" is CUDA when present, else the CPU; anything else is taken as a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
