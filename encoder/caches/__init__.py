"""The node-shared embedding cache, its file format and index, and the MediaKey rule (``media_key.py``).

What it hands out (``EmbeddingRef``) and the interface its readers use (``EmbeddingReader``) are
``epd_common.messages``'s: the LLM engine reads this cache without importing the encoder.
"""
