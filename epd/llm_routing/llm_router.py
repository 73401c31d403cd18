"""Routes prompts over several LLM engines: to the one that already holds the prompt's prefix,
unless that one is too loaded (``policy.py``).

Per engine the router keeps::

    index     what its prefix cache holds: exact from its KV events (a subscriber thread per
              engine), or approximate from what the router sent it (no events endpoint)
    load      the router's own in-flight dispatches, in prefill / decode tokens
    instance  the engine's instance id from /health: a new one means a restart, so the index
              is cleared and the event stream re-read from 0 (the load is kept: the requests
              that died with the engine end through their own ``finish``, or are reconciled)

A request's page names are its engines' ``PageNaming`` of its ids and media spans
(``page_naming``: epd's engines hash cache keys, vLLM servers their block recipe), computed once per
distinct naming and page size among the engines; an index of events is read only once the engine's
own events showed it names pages the same way. The engine never reuses the last prompt token's KV (it must compute
that token to sample), so hits are looked up for ``num_prompt_tokens - 1`` tokens.

Which engines are live is a ``Liveness`` of the server pool (``epd.server_pool``), shared with
the ``EnginePool`` (and, with split roles, with the other role's router, for an engine that serves
both); the router reads it and ``set_live`` marks it.

Threads: ``route``, ``on_health``, ``set_live``, ``record_actual``, ``stats`` and the dispatches'
``finish`` run on one thread (the event loop). Only the exact indexes are written from elsewhere
(the subscriber threads), and they lock themselves; a lookup holds one index lock for one walk
over the request's pages.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from epd.llm_routing.kv_event_subscriber import KVEventSubscriber, SubscriberCounters
from epd.llm_routing.load_counters import Dispatch, EngineLoad, LoadSnapshot
from epd.llm_routing.page_index import ApproxPageIndex, EnginePageIndex
from epd.llm_routing.page_naming import PageNaming, RoutingPrompt, as_routing_prompt, naming_for
from epd.llm_routing.policy import Candidate, RouterConfig, choose_affinity, choose_least_load
from epd.server_pool.liveness import Liveness
from epd_common.messages.kv_events import BlockStored, KVEventBatch

log = logging.getLogger("epd.llm_routing")

_ANY_HOST = {"*", "0.0.0.0", "::", "[::]", ""}


class NoEngineAvailable(Exception):
    """Every LLM engine is down (503 at the edge)."""

    status = 503


class EventSource(Protocol):
    """What the router needs of a KV event subscriber (``KVEventSubscriber``)."""

    def start(self) -> None: ...
    def stop(self, timeout_s: float = 1.0) -> None: ...
    def resync(self) -> None: ...
    def counters(self) -> SubscriberCounters: ...


# (endpoint, replay endpoint or None, topic, on_batch, on_reset) -> a source not yet started
SubscriberFactory = Callable[
    [str, str | None, str, Callable[[int, KVEventBatch], None], Callable[[], None]], EventSource
]


def _subscriber(
    endpoint: str,
    replay: str | None,
    topic: str,
    on_batch: Callable[[int, KVEventBatch], None],
    on_reset: Callable[[], None],
) -> EventSource:
    return KVEventSubscriber(endpoint, replay, on_batch, on_reset=on_reset, topic=topic)


def connect_address(endpoint: str, engine_url: str) -> str:
    """An endpoint the engine reported as bound (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) as one
    the router can connect to: the wildcard host becomes the engine URL's host."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or host not in _ANY_HOST:
        return endpoint
    target = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"tcp://{'[' + target + ']' if ':' in target else target}:{port}"


def health_windows(health: dict[str, Any]) -> tuple[int | None, ...] | None:
    """The windows an engine's hits depend on, from its /health: each KV group's, in group order
    (``kv_groups``, ``llm_core.caches.kv_groups``; None for full attention), so a full-attention
    model gives (None,). The previous release's engine, which lists no groups, gives its one
    ``sliding_window``: (None, w). None when /health says neither (a vLLM server)."""
    groups = health.get("kv_groups")
    if isinstance(groups, list):
        ordered = sorted(groups, key=lambda g: int(g.get("group", 0)))
        return tuple(None if (w := g.get("sliding_window")) is None else int(w) for g in ordered)
    window = health.get("sliding_window")
    return (None, int(window)) if window else None


class EngineStats(NamedTuple):
    url: str
    live: bool
    mode: str  # "events" (exact index) or "approximate"
    naming: str  # how its pages are named (``page_naming``): "epd", "vllm-sha256_cbor"
    # "ok" (its events name pages as the router does), "pending" (no event told yet) or
    # "mismatch: why" (routed by load: its hits are never predicted)
    naming_check: str
    page_size: int
    windows: tuple[int | None, ...]  # each KV group's window (None: full attention)
    instance_id: str | None
    load: LoadSnapshot
    index_pages: int
    events: SubscriberCounters | None  # None in approximate mode
    routed: int  # requests routed here
    recorded: int  # requests whose actual cached tokens were reported
    predicted_cached_tokens: int  # summed over the recorded requests
    actual_cached_tokens: int
    abs_error_tokens: int  # sum of |predicted - actual| (the sums alone could cancel out)


class RouterStats(NamedTuple):
    engines: tuple[EngineStats, ...]
    load_spread: float  # max / mean load over live engines (1.0 = even; load = prefill + decode)
    predicted_cached_tokens: int
    actual_cached_tokens: int


class Geometry(NamedTuple):
    """What an engine's index is built for, from its /health."""

    page_size: int
    windows: tuple[int | None, ...]  # each KV group's window (None: full attention), group order
    events_endpoint: str | None  # None: approximate mode
    replay_endpoint: str | None
    naming: str = "epd"  # the page naming scheme (``page_naming``)
    topic: str = "kv-events"  # the events' ZMQ topic (vLLM's default is "")

    def needs_new_index(self, new: Geometry) -> bool:
        """A new page size, naming or event source needs a new index; new windows only an exact one."""
        if self._replace(windows=()) != new._replace(windows=()):
            return True
        return new.events_endpoint is not None and self.windows != new.windows


@dataclass
class _Engine:
    url: str
    load: EngineLoad
    index: EnginePageIndex | ApproxPageIndex
    geometry: Geometry  # what ``index`` was built for
    source: EventSource | None = None
    instance_id: str | None = None
    # what the engine's own events said of the router's naming (set once per index, by the
    # subscriber thread: see ``_checked_apply``); an index of events is read only once it is True
    naming_ok: bool | None = True  # the default naming, epd's, needs no check
    naming_detail: str = ""
    # it went down since its index was last cleared: an engine without an instance id (vLLM) may
    # come back as a new process, whose cache is empty
    went_down: bool = False
    # the event stream's progress as health rounds see it: the batch count, and when and after how
    # many routed requests it last moved; ``stale``: it stopped while requests flowed (index dropped)
    batches_seen: int = 0
    moved_at: float | None = None
    routed_at_move: int = 0
    stale: bool = False
    routed: int = 0
    recorded: int = 0
    predicted: int = 0
    actual: int = 0
    abs_error: int = 0

    @property
    def page_size(self) -> int:
        return self.index.page_size

    @property
    def naming(self) -> PageNaming:
        return naming_for(self.geometry.naming)

    @property
    def trusted(self) -> bool:
        """Whether its index may predict hits: with a naming the engine shares by construction
        (epd's), always; with one that must be checked (vLLM's), once the engine's own events
        showed it names pages the same way (never without events: routed by load)."""
        return self.naming_ok is True and not self.stale

    def naming_check(self) -> str:
        if self.stale:
            return "stale: no KV events while requests were routed there (routed by load)"
        if self.naming_ok is None:
            return "pending" if self.source is not None else "no KV events: routed by load"
        return "ok" if self.naming_ok else f"mismatch: {self.naming_detail}"


class LLMRouter:
    """Chooses an engine per request and owns each engine's load counters and cache index."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        subscriber_factory: SubscriberFactory = _subscriber,
        liveness: Liveness | None = None,
    ) -> None:
        """Engines start in approximate mode with ``config.default_page_size``, until their first
        ``on_health`` says how they name pages and where they publish events. ``liveness``: which
        engines are up, shared with the pool that calls them (default: the router's own, every
        engine up)."""
        if not engine_urls:
            raise ValueError("the LLM router needs at least one engine url")
        if len(set(engine_urls)) != len(engine_urls):
            raise ValueError(f"an LLM engine url is listed twice: {list(engine_urls)}")
        if liveness is not None and any(u not in liveness for u in engine_urls):
            raise ValueError(f"engines {list(engine_urls)} are not all in {liveness.members}")
        self.liveness = liveness or Liveness(engine_urls, label="LLM engine")
        self.liveness.subscribe(self._on_liveness)
        self.config = config or RouterConfig()
        self._clock = clock
        self._subscriber_factory = subscriber_factory
        self._rng = random.Random(self.config.seed)
        self._rr = 0
        self._started = False
        self._engines: dict[str, _Engine] = {}
        for url in engine_urls:
            ps = self.config.default_page_size
            self._engines[url] = _Engine(
                url,
                EngineLoad(url, clock),
                ApproxPageIndex(ps, self.config.approx_ttl_s, clock),
                geometry=Geometry(ps, (None,), None, None),
            )

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the subscribers of the engines known to publish events (later ones start as found)."""
        self._started = True
        for e in self._engines.values():
            if e.source is not None:
                e.source.start()

    def close(self) -> None:
        """Stop every subscriber thread (each is asked first, then joined: about one poll in all)."""
        self._started = False
        sources = [e.source for e in self._engines.values() if e.source is not None]
        for s in sources:
            s.stop(0)
        for s in sources:
            s.stop(1.0)

    @property
    def engine_urls(self) -> list[str]:
        return list(self._engines)

    def _engine(self, url: str) -> _Engine:
        try:
            return self._engines[url]
        except KeyError:
            raise KeyError(f"{url!r} is not one of the router's engines {list(self._engines)}") from None

    # -- membership and health ----------------------------------------------------------------
    def set_live(self, url: str, live: bool) -> None:
        """Put an engine in or out of the routing set (its counters and index are kept)."""
        self._engine(url)  # KeyError for a url that is not the router's
        self.liveness.set(url, live)

    def is_live(self, url: str) -> bool:
        return self.liveness.is_up(url)

    def _on_liveness(self, url: str, up: bool) -> None:
        e = self._engines.get(url)
        if e is not None and not up:
            e.went_down = True

    def on_health(self, url: str, health: dict[str, Any]) -> None:
        """Feed one /health body of ``url``'s engine: how it names pages (``page_size``,
        its KV groups' windows), where it publishes (``kv_events_endpoint``,
        ``kv_events_replay_endpoint``; absent: approximate mode), its ``instance_id`` (a change
        clears the index) and what it holds (``request_ids`` reconciles lost decrements; its token
        counts give the external load). Never resets the load counters."""
        e = self._engine(url)
        ps = int(health.get("page_size") or e.geometry.page_size)
        windows = health_windows(health) or e.geometry.windows
        endpoint = health.get("kv_events_endpoint") or None
        replay = health.get("kv_events_replay_endpoint") or None
        geometry = Geometry(
            ps,
            windows,
            connect_address(str(endpoint), url) if endpoint else None,
            connect_address(str(replay), url) if replay and endpoint else None,
            str(health.get("page_naming") or "epd"),
            str(health.get("kv_events_topic", "kv-events")),
        )
        naming_for(geometry.naming)  # an unknown scheme fails here, not on the first request
        instance = health.get("instance_id") or health.get("started_at")
        instance_id = None if instance is None else str(instance)
        restarted = e.instance_id is not None and instance_id is not None and instance_id != e.instance_id
        if e.geometry.needs_new_index(geometry):
            self._rebuild_index(e, geometry)
        elif e.went_down and instance_id is None and e.instance_id is None:
            log.info("LLM engine %s is back (it names no instance): its index is cleared", url)
            self._clear(e)
        elif restarted:
            log.info(
                "LLM engine %s restarted (instance %s -> %s): its index is cleared",
                url,
                e.instance_id,
                instance_id,
            )
            self._clear(e)
        e.went_down = False
        self._check_stream(e)
        e.geometry = geometry
        if instance_id is not None:
            e.instance_id = instance_id
        ids = health.get("request_ids")
        if ids is not None:
            n = e.load.reconcile({str(i) for i in ids}, self.config.reconcile_grace_s)
            if n:
                log.warning("LLM engine %s does not hold %d request(s) the router counted: dropped", url, n)
        prefill = health.get("num_prefill_tokens", health.get("num_waiting_tokens"))
        decode = health.get("num_decode_tokens", health.get("num_running_tokens"))
        if prefill is not None or decode is not None:
            e.load.set_reported(int(prefill or 0), int(decode or 0))

    @staticmethod
    def _clear(e: _Engine) -> None:
        e.index.clear()
        if e.source is not None:
            e.source.resync()

    def _check_stream(self, e: _Engine) -> None:
        """An index whose stream stopped moving (or never moved) while requests kept being routed
        there no longer says what the engine holds (its evictions are missed): dropped, and asked
        again from 0 (a publisher that comes back answers the replay); back in use once batches
        arrive. The one watcher of a stream's silence: its warning names the endpoint listened to."""
        if e.source is None:
            return
        now, batches = self._clock(), e.source.counters().batches
        if batches != e.batches_seen or e.moved_at is None:
            if e.stale and batches != e.batches_seen:
                log.info("LLM engine %s: its KV events are back, its index is used again", e.url)
                e.stale = False
            e.batches_seen, e.moved_at, e.routed_at_move = batches, now, e.routed
            return
        cfg = self.config
        if (
            not e.stale
            and e.routed - e.routed_at_move >= cfg.events_stale_requests
            and now - e.moved_at > cfg.events_stale_s
        ):
            e.stale = True
            log.warning(
                "LLM engine %s: no KV event batch from %s in %.0f s while %d requests were routed "
                "there (is it publishing there?): its index is dropped, routed by load until its "
                "events come back",
                e.url,
                e.geometry.events_endpoint,
                now - e.moved_at,
                e.routed - e.routed_at_move,
            )
            self._clear(e)

    def _rebuild_index(self, e: _Engine, geometry: Geometry) -> None:
        ps, windows, endpoint, replay, naming, topic = geometry
        if e.source is not None:
            e.source.stop(0)  # its late batches go to the old index, which nobody reads any more
            e.source = None
        scheme = naming_for(naming)
        e.naming_ok, e.naming_detail = (None if scheme.needs_check else True), ""
        e.stale, e.moved_at = False, None
        if endpoint is None:
            e.index = ApproxPageIndex(ps, self.config.approx_ttl_s, self._clock)
            if scheme.needs_check:
                log.warning(
                    "LLM engine %s names its pages as %s and publishes no KV events: routed by load",
                    e.url,
                    naming,
                )
        else:
            index = EnginePageIndex(ps, windows)
            e.index = index
            e.source = self._subscriber_factory(
                endpoint, replay, topic, self._checked_apply(e, scheme, index), index.clear
            )
            if self._started:
                e.source.start()
        log.info(
            "LLM engine %s: page size %d, windows %s, %s pages, %s",
            e.url,
            ps,
            windows,
            naming,
            f"KV events from {endpoint}" if endpoint else "approximate index",
        )

    @staticmethod
    def _checked_apply(
        e: _Engine, naming: PageNaming, index: EnginePageIndex
    ) -> Callable[[int, KVEventBatch], None]:
        """The subscriber's ``on_batch``: until one stored event has told whether the engine names
        pages as ``naming`` does, each is checked (the first prompt page of a stream tells); then
        the batch goes into the index. Runs on the subscriber thread; ``naming_ok`` is one write."""

        def apply(_seq: int, batch: KVEventBatch) -> None:
            if e.naming_ok is None and e.index is index:
                for event in batch.events:
                    if not isinstance(event, BlockStored):
                        continue
                    verdict_ok: bool | None
                    if event.block_size != index.page_size:
                        verdict_ok, detail = (
                            False,
                            (f"its pages are {event.block_size} tokens, the router's {index.page_size}"),
                        )
                    else:
                        verdict_ok, detail = naming.check(event)
                    if verdict_ok is None:
                        continue
                    e.naming_ok, e.naming_detail = verdict_ok, detail
                    if verdict_ok:
                        log.info(
                            "LLM engine %s names its pages as %s: its index is used", e.url, naming.scheme
                        )
                    else:
                        log.warning(
                            "LLM engine %s does not name its pages as %s (%s): routed by load only",
                            e.url,
                            naming.scheme,
                            detail,
                        )
                    break
            index.apply(batch)

        return apply

    # -- routing ------------------------------------------------------------------------------
    def route(
        self,
        prompt: RoutingPrompt | Sequence[int],
        num_prompt_tokens: int,
        max_tokens: int,
        request_id: str,
        among: Collection[str] | None = None,
    ) -> Dispatch:
        """Choose an engine for a prompt and count it there; ``finish`` the returned dispatch when
        the request ends, however it ends. ``prompt``: its ids and media spans as the servers
        see them (plain ids: a prompt without media, or cache keys with media runs as pseudo-ids;
        ``page_naming``); ``among``: the engines to choose from
        (default: the live ones; the server pool passes its candidates: live, not tried yet)."""
        if among is None:
            live = [e for e in self._engines.values() if self.is_live(e.url)]
        else:
            live = [e for e in self._engines.values() if e.url in among]
        if not live:
            raise NoEngineAvailable(f"all {len(self._engines)} LLM engines are down or tried")
        limit = num_prompt_tokens - 1
        whole = as_routing_prompt(prompt)
        whole = whole._replace(token_ids=whole.token_ids[:num_prompt_tokens])
        hashes: dict[tuple[str, int], list[int]] = {}

        def hashes_for(e: _Engine) -> list[int]:
            geometry = (e.geometry.naming, e.page_size)
            if geometry not in hashes:
                # every whole prompt page: the lookup stops at ``limit`` by itself, and an
                # approximate index records what the engine will cache, the last page included
                hashes[geometry] = e.naming.names(whole, e.page_size)
            return hashes[geometry]

        policy = self.config.policy
        if policy == "round_robin":
            chosen = live[self._rr % len(live)]
            self._rr += 1
            hit = self._hit(chosen, hashes_for, limit)
        else:
            cands = [
                self._candidate(i, e, hashes_for if policy == "affinity" else None, limit)
                for i, e in enumerate(live)
            ]
            pick = (
                choose_affinity(cands, num_prompt_tokens, self.config, self._rng)
                if policy == "affinity"
                else choose_least_load(cands, self._rng)
            )
            chosen = live[pick.slot]
            hit = pick.hit_tokens if policy == "affinity" else self._hit(chosen, hashes_for, limit)
        if isinstance(chosen.index, ApproxPageIndex):
            chosen.index.record(hashes_for(chosen))
        chosen.routed += 1
        return chosen.load.dispatch(request_id, num_prompt_tokens, hit, max_tokens)

    @staticmethod
    def _hit(e: _Engine, hashes_for: Callable[[_Engine], list[int]], limit: int) -> int:
        """Tokens ``e`` is predicted to hit (0 while its naming is not known to match)."""
        return e.index.hit_tokens(hashes_for(e), limit) if e.trusted else 0

    def _candidate(
        self, i: int, e: _Engine, hashes_for: Callable[[_Engine], list[int]] | None, limit: int
    ) -> Candidate:
        hit = self._hit(e, hashes_for, limit) if hashes_for is not None else 0
        prefill, decode, held = e.load.prefill_tokens, e.load.decode_tokens, e.load.held_tokens
        if self.config.count_external_load:
            prefill += e.load.external_prefill_tokens
            decode += e.load.external_decode_tokens
            # the engine's own counts: a waiting request's whole prompt, a decoding one's tokens
            held += e.load.external_prefill_tokens + e.load.external_decode_tokens
        return Candidate(i, hit, prefill, decode, held)

    # -- metrics ------------------------------------------------------------------------------
    def record_actual(self, dispatch: Dispatch, cached_tokens: int) -> None:
        """The engine's ``usage.prompt_tokens_details.cached_tokens`` for a routed request: summed
        beside the prediction, the gap between the two is the drift of the index."""
        e = self._engine(dispatch.url)
        e.recorded += 1
        e.predicted += dispatch.predicted_cached_tokens
        e.actual += cached_tokens
        e.abs_error += abs(dispatch.predicted_cached_tokens - cached_tokens)

    def stats(self) -> RouterStats:
        engines = tuple(
            EngineStats(
                e.url,
                self.is_live(e.url),
                "events" if isinstance(e.index, EnginePageIndex) else "approximate",
                e.geometry.naming,
                e.naming_check(),
                e.page_size,
                e.geometry.windows,
                e.instance_id,
                e.load.snapshot(),
                len(e.index),
                e.source.counters() if e.source is not None else None,
                e.routed,
                e.recorded,
                e.predicted,
                e.actual,
                e.abs_error,
            )
            for e in self._engines.values()
        )
        loads = [self._load_of(e) for e in self._engines.values() if self.is_live(e.url)]
        mean = sum(loads) / len(loads) if loads else 0.0
        spread = max(loads) / mean if mean > 0 else 1.0
        return RouterStats(
            engines,
            spread,
            sum(s.predicted_cached_tokens for s in engines),
            sum(s.actual_cached_tokens for s in engines),
        )

    def _load_of(self, e: _Engine) -> int:
        load = e.load.tokens
        if self.config.count_external_load:
            load += e.load.external_prefill_tokens + e.load.external_decode_tokens
        return load
