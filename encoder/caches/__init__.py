"""The node-shared embedding cache, its file format and index, and the MediaKey rule (``media_key.py``).

What it hands out (``EmbeddingRef``) and the interface its readers use (``EmbeddingReader``) are
``epd_common.messages``'s: the LLM engine reads this cache without importing the encoder. A
MediaKey folds in the preprocessing settings, which are ``media_io``'s.

May import: epd_common, media_io; never: encoder.models, encoder.serving, llm_core, epd.
"""
