"""The hybrid-SWA MoE language model core (MiMo-V2-Flash compatible): model, dual-pool paged KV
cache, SWA-aware radix prefix cache, scheduler, model runner, sampling, tokenizer and the engine
process. It consumes embeddings by EmbeddingRef and knows nothing of media decoding.
"""
