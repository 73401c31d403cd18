"""The KV cache: the KV groups (``kv_groups``: a frozen spec per layer group, derived from the
model config), the KV storage (``kv_pool``: one shared block pool by default, ``kv_blocks`` its
layout and per-group allocators, ``page_map`` a group's pages to each layer's, ``page_pool`` the
free list), the KV manager (``kv_manager``: each sequence's pages, pins and prefix lock, a
``seq_kv.SeqKV`` kept by request id) and the SWA-aware radix prefix cache, plus the host and
store tiers below it; ``kv_transfers`` keeps, by request id, the KV each request has copied in
(imports, host-tier restores) and its store fetch.

Beside torch and numpy it reads the request record (``llm_core.request``: the record and the
request id it keeps state by; it writes nothing on them but a sequence's progress) and
``epd_common`` (the messages, the store); nothing from ``llm_core.serving``, nor ``llm_core.models``
(groups read a config through a protocol), nor the roles.

May import: llm_core.request, epd_common; never: llm_core.serving, llm_core.models.
"""
