"""The ids a model is served as (vLLM's ``--served-model-name``), for the engine and the ingress
alike: the names given, else the checkpoint path as the user typed it, else the embedded default's
id. What a request may name and what a response reports: ``epd.served_model``."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MODEL_ID = "epd-default"  # the id of the embedded default model


def served_model_names(names: Sequence[str], model_path: str | None) -> tuple[str, ...]:
    """``names`` when given, else ``(model_path,)`` as typed, else ``(DEFAULT_MODEL_ID,)``."""
    return tuple(names) if names else (model_path or DEFAULT_MODEL_ID,)
