"""The KV cache: the KV groups (``kv_groups``: a frozen spec per layer group, derived from the
model config), the KV storage (``kv_pool``: one shared block pool by default, ``kv_blocks`` its
layout and per-group allocators, ``page_map`` a group's pages to each layer's, ``page_pool`` the
free list), the per-sequence page tables
(``kv_manager``) and the SWA-aware radix prefix cache, plus the host and store tiers below it;
``kv_transfers`` keeps, by request id, the KV each request has copied in (imports, host-tier
restores) and its store fetch.

Imports: torch, numpy and ``llm_core.serving.sequence`` (the record whose page rows it fills);
nothing from ``llm_core.models`` (groups read a config through a protocol) or from the roles.
"""
