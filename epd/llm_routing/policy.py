"""How the router picks an engine for a prompt, given each engine's predicted hit and load.

``affinity`` (the default), lowest cost wins, as Dynamo's KV router scores::

    cost = prefill_weight * (prompt tokens not cached there + prefill tokens queued there)
         + decode_weight  * (decode tokens active there)

after SGLang's balance guard has removed the overloaded engines from the candidates:

    drop e  when  load(e) - min_load > balance_abs_tokens  AND  load(e) > balance_rel * min_load
    (load = prefill tokens + held tokens: the prompt tokens still to compute, and the prompt and
     output tokens every in-flight request holds, waiting ones included)

The guard's load counts a waiting request's whole prompt, the cost only its uncached part: with
high hit rates the uncached parts are small, and an engine with five sessions queued behind its
prefills looked lighter than one decoding a single long one (one vLLM server of four took 56 of
96 requests of ``bench.kv_affinity --backend vllm``, max/mean load 2.2).

The guard is what keeps a miss from piling onto a hot engine (a prefix that lives only on the
overloaded engine is recomputed elsewhere rather than queued behind it), and it keeps affinity
among the engines that pass (unlike dropping to pure least-load when imbalanced). Ties break at
random: with a fixed order every cold request would go to engine 0.

``round_robin`` and ``least_load`` (lowest prefill + decode tokens, random ties) are the baselines
the affinity policy is measured against; they ignore the cache.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

Policy = Literal["affinity", "round_robin", "least_load"]
POLICIES: tuple[Policy, ...] = ("affinity", "round_robin", "least_load")


@dataclass(frozen=True)
class RouterConfig:
    policy: Policy = "affinity"
    prefill_weight: float = 1.0  # a: per prompt token to compute (uncached + queued)
    decode_weight: float = 1.0  # b: per token held by decoding requests
    # The guard (SGLang's cache_aware thresholds, on tokens instead of request counts): an
    # engine must exceed the lightest by both margins to be dropped.
    balance_abs_tokens: int = 4096
    balance_rel: float = 1.5
    approx_ttl_s: float = 120.0  # how long an engine without KV events is assumed to keep a prompt
    # An event stream that stopped while requests flowed (the engine stores pages for them, so it
    # must have published): after this long without a batch and at least ``events_stale_requests``
    # routed, its index is dropped and the engine routed by load until its events come back.
    events_stale_s: float = 10.0
    events_stale_requests: int = 8
    # a dispatch the engine does not report holding is dropped after this long (lost decrement)
    reconcile_grace_s: float = 2.0
    # Add the engine's reported tokens beyond the router's own to its load: right when several
    # ingresses share the engines; off by default because the report lags a health interval and
    # counts a waiting request's cached prompt too, which one ingress would see as phantom load.
    count_external_load: bool = False
    # page size assumed for an engine that has not reported its own yet (approximate index only)
    default_page_size: int = 16
    seed: int = 0  # the tie-break RNG's

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"RouterConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("prefill_weight", "decode_weight", "balance_abs_tokens", "reconcile_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.balance_rel < 1.0:
            raise ValueError(f"RouterConfig.balance_rel must be >= 1, got {self.balance_rel}")
        if self.approx_ttl_s <= 0:
            raise ValueError(f"RouterConfig.approx_ttl_s must be > 0, got {self.approx_ttl_s}")
        if self.default_page_size < 1:
            raise ValueError(f"RouterConfig.default_page_size must be >= 1, got {self.default_page_size}")


class Candidate(NamedTuple):
    """One live engine as the policy sees it for one request."""

    slot: int  # position in the list of live engines the router passed
    hit_tokens: int  # prompt tokens predicted cached there
    prefill_tokens: int  # queued prefill load
    decode_tokens: int  # active decode load
    held_tokens: int  # prompt + output tokens of every in-flight request, waiting ones included

    @property
    def load(self) -> int:
        """What least-load compares: queued prefill + active decode tokens."""
        return self.prefill_tokens + self.decode_tokens

    @property
    def guard_load(self) -> int:
        """What the balance guard compares: prefill still to compute + tokens held."""
        return self.prefill_tokens + self.held_tokens


def balanced(candidates: Sequence[Candidate], config: RouterConfig) -> list[Candidate]:
    """The candidates the guard keeps (never empty: the lightest always passes)."""
    floor = min(c.guard_load for c in candidates)
    return [
        c
        for c in candidates
        if not (
            c.guard_load - floor > config.balance_abs_tokens and c.guard_load > config.balance_rel * floor
        )
    ]


def affinity_cost(c: Candidate, num_prompt_tokens: int, config: RouterConfig) -> float:
    return config.prefill_weight * (num_prompt_tokens - c.hit_tokens + c.prefill_tokens) + (
        config.decode_weight * c.decode_tokens
    )


def pick_lowest(candidates: Sequence[Candidate], costs: Sequence[float], rng: random.Random) -> Candidate:
    """The candidate of lowest cost; equal lowest costs are broken at random."""
    low = min(costs)
    tied = [c for c, cost in zip(candidates, costs, strict=True) if cost == low]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose_affinity(
    candidates: Sequence[Candidate], num_prompt_tokens: int, config: RouterConfig, rng: random.Random
) -> Candidate:
    kept = balanced(candidates, config)
    return pick_lowest(kept, [affinity_cost(c, num_prompt_tokens, config) for c in kept], rng)


def choose_least_load(candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
    return pick_lowest(candidates, [float(c.load) for c in candidates], rng)
