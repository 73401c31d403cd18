"""The KV cache: the dual (full / sliding-window) page pools, the per-sequence page tables and the SWA-aware radix prefix cache."""
