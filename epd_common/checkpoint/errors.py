"""The errors of reading a checkpoint directory, shared by the encoder, the LLM engine and epd's
model check (one class each, whichever role hits them)."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint directory that cannot be loaded; the message names the file, tensor or field."""


class UnknownArchitecture(ValueError):
    """config.json names no architecture (or, for a tower, no model_type) this build serves."""
