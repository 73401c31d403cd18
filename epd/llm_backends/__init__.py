"""The language-model backends a chat is answered by, behind one interface.

    ingress: parts checked, media resolved to EmbeddingRefs (encoders, caches, store)
       ──▶ LLMBackend.chat_call(messages, items, sampling)  ─▶ ChatCall (path, body, routing keys)
       ──▶ EnginePool: routing, failover, refusals, Retry-After (same for every backend)
       ◀── each server's answer ─▶ LLMBackend.chat_result / chat_delta ─▶ ChatResult / ChatDelta

- ``epd_engine``: epd's own engine (``epd llm``): the ingress renders prompt ids with the checkpoint's
  chat template and hands EmbeddingRefs; the engine reads the embeddings from the node cache.
- ``vllm``: a vLLM server (``--enable-mm-embeds``): the chat goes as chat messages, text parts
  unchanged, each media item an ``image_embeds`` / ``video_embeds`` part with its grid and
  ``uuid`` = its MediaKey; every embedding is checked against its grid and the model's hidden size
  before it is sent (a malformed one kills vLLM's server).

May import ``epd_common``, ``encoder.caches``, ``llm_core.prompts`` / ``llm_core.serving`` (the
cache-key rule, the embedding source) and ``epd`` modules below the chat API (``engine_client``,
``media_pipeline``, ``prompt_format``); never ``epd.chat_api`` or ``epd.ingress``.
"""
