"""Text in and out: the tokenizer and the checkpoint's chat template.

May import: epd_common; never: llm_core.models, llm_core.caches, llm_core.serving.
"""
