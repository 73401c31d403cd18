"""Moving one request's packed KV bytes from a prefill engine to a decode engine.

``transport.py`` holds the interface and the handle checks; ``shm_transport.py`` moves bytes
between processes of one node through /dev/shm, ``mooncake_transport.py`` between nodes through
Mooncake's transfer engine. Nothing here knows what the bytes are: the engines pack and unpack them.

May import: llm_core.caches, epd_common; never: llm_core.serving, llm_core.models.
"""
