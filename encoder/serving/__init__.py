"""The encoder worker process and its HTTP app, and the cross-request batcher (the ingress routes
over the workers with ``epd.encoder_router``).

May import: encoder.caches, encoder.kernels, encoder.models, epd_common, media_io; never: llm_core,
epd.
"""
