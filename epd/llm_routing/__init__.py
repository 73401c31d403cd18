"""Routing prompts over several LLM engines by what their prefix caches hold (KV-cache affinity).

page_naming.py           how a server names its pages (RoutingPrompt -> page names), per scheme
vllm_block_hash.py       vLLM's block-hash recipe (sha256_cbor), checked on its own events
page_index.py            what one engine caches (exact from KV events, or approximate) and
                         the radix cache's hit rule over it
kv_event_subscriber.py   one engine's ZMQ event stream (ours or vLLM's), with gap replay and
                         restart detection
load_counters.py         the router's own in-flight load per engine (Dispatch handles)
policy.py                RouterConfig and the choice: affinity cost with a balance guard,
                         round robin, least load
llm_router.py            LLMRouter: the engines, their health, route(), stats()

The router is the policy of the LLM engines' server pool (``epd.server_pool``, through
``epd.engine_pool``): liveness, refusals and failover are the pool's; which engines are up it
reads from the pool's ``Liveness``. Beside ``epd.server_pool`` it takes only the definitions of
page names, the hit rule and the KV events (``epd_common.messages``); never a client, the ingress
or the engine.

May import: epd.server_pool, epd_common.messages; never: epd.engine_client, epd.engine_pool,
epd.ingress, llm_core, encoder.
"""

from epd.llm_routing import vllm_block_hash as _vllm_block_hash  # registers vLLM's page naming
from epd.llm_routing.llm_router import EngineStats, LLMRouter, NoEngineAvailable, RouterStats
from epd.llm_routing.load_counters import Dispatch
from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_routing.policy import RouterConfig

__all__ = [
    "Dispatch",
    "EngineStats",
    "LLMRouter",
    "NoEngineAvailable",
    "RouterConfig",
    "RouterStats",
    "RoutingPrompt",
]
del _vllm_block_hash
