"""The language-model servers a chat is answered by, behind one interface.

    ingress: parts checked, media resolved to EmbeddingRefs (encoders, caches, store)
       ──▶ LLMServer.chat_call(messages, items, sampling)  ─▶ ChatCall (path, body, routing keys)
       ──▶ EnginePool: routing, failover, refusals, Retry-After (same for every server kind)
       ◀── each server's answer ─▶ LLMServer.chat_result / chat_delta ─▶ ChatResult / ChatDelta

- ``epd_engine``: epd's own engine (``epd llm``): the ingress renders prompt ids with the checkpoint's
  chat template and hands EmbeddingRefs; the engine reads the embeddings from the node cache.
- ``vllm``: a vLLM server (``--enable-mm-embeds``): the chat goes as chat messages, text parts
  unchanged, each media item an ``image_embeds`` / ``video_embeds`` part with its grid and
  ``uuid`` = its MediaKey; every embedding is checked against its grid and the model's hidden size
  before it is sent (a malformed one kills vLLM's server).

Beside ``epd_common`` it takes the cache reader from ``encoder.caches``, the tokenizer and the
request text from ``llm_core.prompts``, ``MultimodalInput`` from ``llm_core.request``, the
embedding source from ``llm_core.serving``, and the ``epd`` modules below the chat API (the config,
the engine client and the bodies it sends, the router, the parsed chat messages, the media
pipeline, the prompt format); never the chat API or the ingress.

May import: epd_common, encoder.caches, llm_core.prompts, llm_core.request,
llm_core.serving.embedding_source, epd.config, epd.engine_body, epd.engine_client, epd.llm_routing,
epd.media_pipeline, epd.media_request, epd.prompt_format; never: epd.chat_api, epd.ingress.
"""
