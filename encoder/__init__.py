"""The vision encoder side (the E role): ``models`` (the tower families and loading a tower through
the shared checkpoint reader and registry, ``epd_common.checkpoint``),
``kernels`` (varlen attention), ``caches`` (the node-shared embedding cache and the names of what it
holds) and ``serving`` (the cross-request batcher and the worker process; the ingress's ring over the
workers is ``epd.encoder_router``).

It knows nothing of the language model or of the ingress's HTTP API.

May import: epd_common, media_io; never: llm_core, epd.
"""
