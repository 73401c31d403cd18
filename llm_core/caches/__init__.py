"""The KV cache: the KV groups (``kv_groups``: a frozen spec per layer group, derived from the
model config), the page pools and per-layer tensors (``kv_pool``; ``kv_blocks``: the layout and
allocator of one shared block pool, to replace the per-group pools), the per-sequence page tables
(``kv_manager``) and the SWA-aware radix prefix cache, plus the host and store tiers below it;
``kv_transfers`` keeps, by request id, the KV each request has copied in (imports, host-tier
restores) and its store fetch.

Imports: torch, numpy and ``llm_core.serving.sequence`` (the record whose page rows it fills);
nothing from ``llm_core.models`` (groups read a config through a protocol) or from the roles.
"""
