"""Attention over packed variable-length segments: the torch path and the Triton kernel."""
