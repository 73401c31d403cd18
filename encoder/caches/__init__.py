"""The node-shared embedding cache, its file format and index, and the names of what it holds (MediaKey, EmbeddingRef)."""
