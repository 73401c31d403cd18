"""The language-model core (the P and D roles): ``models`` (the family registry and the shared
hybrid-SWA MoE decoder), ``caches`` (paged KV per KV group: full attention and each sliding
window; the group-aware radix prefix cache), ``kernels`` (paged attention and the CPU / Triton
paths under the decoder), ``prompts`` (tokenizer, chat template) and ``serving`` (scheduler,
model runner, sampling, the engine and its process).

It consumes embeddings by EmbeddingRef and knows nothing of media decoding.
"""
