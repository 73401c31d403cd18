"""Bytes in, patches out.

Fetching (aiohttp, SSRF-guarded), image decode, video probe/sample/decode, and the two
preprocessing backends (DALI and pillow-simd + torch) that produce identical layouts.

This package knows nothing of models, caches or HTTP serving.

May import: epd_common; never: encoder, llm_core, epd.
"""
