"""The language-model core (the P and D roles): ``models`` (the language-model families, found
through the shared registry ``epd_common.checkpoint.registry``, and the shared hybrid-SWA MoE
decoder), ``backends`` (which attention, MoE, norm and layer kernels run, chosen once per engine),
``caches`` (paged KV per KV group: full attention and each sliding window; the group-aware radix
prefix cache), ``kernels`` (paged attention and the CPU / Triton paths under the backends),
``prompts`` (tokenizer, chat template), ``serving`` (scheduler, model runner, sampling, the engine
and its process) and ``tools`` (offline work over the models: MTP head distillation).

It consumes embeddings by EmbeddingRef and knows nothing of media decoding.

What it shares with the other roles (EmbeddingRef, the cache-key rule, the completion request and
its chunks, the embedding cache as a reader sees it) comes from ``epd_common.messages``; it never
imports ``encoder``, ``media_io`` or ``epd``. The request record (``request``) sits below
``caches`` and ``serving``, which both import it.

May import: epd_common; never: encoder, media_io, epd.
"""
