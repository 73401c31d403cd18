"""Leaf modules every epd package may import: settings and runtime paths, admission, the client
error channel, native-build checks, which code MKL runs (``mkl_dispatch``, applied before torch
loads), the cluster store (``store``), what a checkpoint directory is
(``checkpoint``: the one config.json and safetensors reader, ``CheckpointError``, the architecture
registry) and what the roles send each other (``messages``: ``EmbeddingRef``, the cache-key rule,
the engine's completion request and chunks, the embedding-cache reader interface).

It depends on third-party libraries only (the registry names model families by import path and
imports them only when asked).

May import: none; never: encoder, llm_core, media_io, epd.
"""
