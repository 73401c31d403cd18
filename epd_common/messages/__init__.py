"""The messages that cross between epd's roles (ingress, encoder, LLM engine), as msgspec Structs.

Owns: what a role sends another over HTTP or hands it by name: ``EmbeddingRef`` (an embedding
named by its ``MediaKey``), the cache-key rule (a prompt's prefix-cache keys, each media run
replaced by a pseudo-id of its MediaKey: the ingress routes on exactly what the engine matches),
the engine's completion request and its response and stream chunks, the node embedding
cache as a reader sees it (``EmbeddingReader``), and what an engine's prefix cache publishes for
routers: its pages' names (``page_hash``: chained xxh3 over token ids and MediaKeys), the rule
that says which page boundary is a prefix hit (``hit_rule``: the engine's radix cache and the
router's page index ask the same function) and its KV events (``kv_events``: vLLM's schema as
msgpack).

Why here, under ``epd_common``: every role already imports ``epd_common`` and nothing in it
imports a role, so a message defined here makes no role depend on another; the encoder, the
engine and the ingress each import the same Struct and none imports another's package for it.

It needs the standard library, msgspec, and for the page names and KV events xxhash, numpy and
msgpack (the wire formats). No torch at run time, no media, model or serving code: a Struct here
is a schema, and the code that acts on a message stays with the role that owns it.

May import: none; never: encoder, llm_core, media_io, epd.
"""
