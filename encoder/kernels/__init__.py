"""Attention over packed variable-length segments (``segments``: what the kernels read, built by
the layouts in ``encoder.models``): the torch path and the Triton kernel.

May import: epd_common; never: encoder.models, encoder.caches, encoder.serving, media_io.
"""
