"""One pool of servers (encoder workers, LLM engines) that the ingress sends work to.

The pool owns what every kind of server needs, once:

    liveness.py   which servers are in the routing set: marks flip one at once, health checks
                  after ``fall_after`` / ``rise_after`` results in a row
    refusals.py   each server's last refusal for load, counted down (its queue drains at about
                  that pace while nothing is added)
    attempts.py   what a failed attempt means (``Verdict``: fatal, failed, unreachable, refused)
                  and the errors a call ends with
    pool.py       ``ServerPool``: the attempt loop that fails over to the next candidate, with
                  the routing policy plugged in
    ring.py       a routing policy: consistent hashing of keys (the encoder ring)

The other routing policy, KV-cache affinity or least load over LLM engines, is
``epd.llm_routing.LLMRouter``; the error classifiers that tell a refusal from an unreachable
server belong to each server's client side (``epd.encoder_router``, ``epd.engine_pool``).

It needs the standard library and uhashring only: never HTTP, a client, or the ingress; the pool
only chooses URLs and counts what happened to them.

May import: none; never: epd, epd_common, encoder, llm_core, media_io.
"""

from epd.server_pool.attempts import (
    AllAttemptsFailed,
    AttemptFailure,
    NoServerAvailable,
    Outcome,
    PassedBy,
    Verdict,
)
from epd.server_pool.liveness import Liveness
from epd.server_pool.pool import PoolConfig, RoutingPolicy, ServerPool
from epd.server_pool.refusals import RefusalClock
from epd.server_pool.ring import HashRingPolicy, RingPick

__all__ = [
    "AllAttemptsFailed",
    "AttemptFailure",
    "HashRingPolicy",
    "Liveness",
    "NoServerAvailable",
    "Outcome",
    "PassedBy",
    "PoolConfig",
    "RefusalClock",
    "RingPick",
    "RoutingPolicy",
    "ServerPool",
    "Verdict",
]
