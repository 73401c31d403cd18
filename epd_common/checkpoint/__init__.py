"""What a checkpoint directory is, for every role: the one ``config.json`` reader
(``config_json``), the one safetensors shard reader (``shards``: an index with shards, possibly in
sub-folders, or loose ``*.safetensors`` files), the one ``CheckpointError`` (``errors``) and the
registry from config.json's architecture to the language-model family, the tower family, the
processor settings (``registry``) and how a vLLM server serves it (``vllm_profile``).

It needs the standard library, ``safetensors`` and ``torch`` (``shards`` only); the registry names
the families by import path and resolves them when asked, so importing it loads neither model
stack. Importing this package imports none of its modules.

May import: none; never: encoder, llm_core, media_io, epd.
"""
