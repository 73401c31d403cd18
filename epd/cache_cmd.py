"""``epd cache``: inspect and manage a node's embedding cache.

    epd cache stats [--store URL | --store-dir DIR] [--llm-url URL]
                                       capacity, used, entries, hit rate, evictions, this node's
                                       store hits; the shared tier's entries and bytes; each
                                       engine's KV tiers (host memory, store: pages, bytes, hits)
    epd cache ls [--sort recent|size|hits] [--limit N]
    epd cache show KEY                 metadata, header + checksum check, first values
    epd cache verify                   checksum every entry; exit 1 on any failure
    epd cache evict KEY                remove one entry
    epd cache clear [--yes]            remove every entry (asks first)
    epd cache watch [--interval S] [--count N]

Every command takes ``--namespace``/``--root`` (which cache) and ``--json`` (for scripts).
Read-only commands open the cache read-only: they never change it, not even access times or
hit counters. KEY may be any unique prefix of a key.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from encoder.caches.cache_format import CorruptEntry, payload_crc
from encoder.caches.embed_cache import CacheError, CacheStats, EmbedCache, EntryMeta, InvalidKey, default_root
from epd_common.store import open_store
from epd_common.store.store import StoreError, StoreStats

_SORTS = {
    "recent": lambda m: -m.last_access_ns,
    "size": lambda m: -m.bytes,
    "hits": lambda m: -m.hits,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    common.add_argument("--namespace", default="default", help="cache namespace (default: %(default)s)")
    common.add_argument("--root", type=Path, default=None, help="cache directory (default: /dev/shm/epd-NS)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = parser.add_subparsers(dest="cache_command", required=True)
    stats = sub.add_parser(
        "stats",
        parents=[common],
        allow_abbrev=False,
        help="capacity, used bytes, entries, hit rate, evictions; with --store / --store-dir the shared tier too",
    )
    stats.add_argument("--store", metavar="URL", help="the shared tier's redis://HOST:PORT (Redis or Valkey)")
    stats.add_argument("--store-dir", metavar="DIR", help="the shared tier's directory (disk tier)")
    stats.add_argument(
        "--llm-url",
        action="append",
        default=[],
        metavar="URL",
        help="an LLM engine (repeatable): its KV tiers below the prefix cache (host memory, store)",
    )
    ls = sub.add_parser("ls", parents=[common], allow_abbrev=False, help="list entries")
    ls.add_argument("--sort", choices=sorted(_SORTS), default="recent")
    ls.add_argument("--limit", type=int, default=50, help="at most this many rows (0: all)")
    show = sub.add_parser(
        "show", parents=[common], allow_abbrev=False, help="one entry: metadata, checks, first values"
    )
    show.add_argument("key")
    show.add_argument("--values", type=int, default=8, help="how many leading values to print")
    sub.add_parser(
        "verify", parents=[common], allow_abbrev=False, help="checksum every entry (exit 1 on failure)"
    )
    evict = sub.add_parser("evict", parents=[common], allow_abbrev=False, help="remove one entry")
    evict.add_argument("key")
    clear = sub.add_parser("clear", parents=[common], allow_abbrev=False, help="remove every entry")
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    watch = sub.add_parser("watch", parents=[common], allow_abbrev=False, help="live statistics")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    watch.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: never)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _age(ns: int) -> str:
    s = max(0.0, time.time() - ns / 1e9)
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _stats_json(s: CacheStats) -> dict[str, Any]:
    return {**s._asdict(), "hit_rate": s.hit_rate}


def _meta_json(m: EntryMeta) -> dict[str, Any]:
    d = m._asdict()
    d["shape"] = list(m.shape)
    d["grid_thw"] = [list(g) for g in m.grid_thw]
    return d


def _stats_table(s: CacheStats) -> Table:
    t = Table(title=f"embedding cache {s.root}", show_header=False)
    t.add_column("field")
    t.add_column("value", justify="right")
    pct = 100 * s.used_bytes / s.capacity_bytes if s.capacity_bytes else 0.0
    rows = [
        ("capacity", _human(s.capacity_bytes)),
        ("used", f"{_human(s.used_bytes)} ({pct:.1f}%)"),
        ("entries", str(s.entries)),
        ("hits / misses", f"{s.hits} / {s.misses}"),
        ("hit rate", f"{100 * s.hit_rate:.1f}%"),
        ("inserts", str(s.inserts)),
        ("evictions", f"{s.evictions} ({_human(s.evicted_bytes)})"),
        ("removals", str(s.removals)),
        (
            "store hits / misses",
            f"{s.store_hits} / {s.store_misses} (corrupt {s.store_corrupt}, puts {s.store_puts})",
        ),
    ]
    for r in rows:
        t.add_row(*r)
    return t


def _resolve(cache: EmbedCache, key: str) -> str:
    """``key`` itself when cached, else the one entry whose key starts with it."""
    with suppress(InvalidKey):
        if cache.contains(key):
            return key
    matches = [m.key for m in cache.entries() if m.key.startswith(key)]
    if len(matches) != 1:
        what = "no entry" if not matches else f"{len(matches)} entries"
        raise CacheError(f"{what} in {cache.root} match key {key!r}")
    return matches[0]


def _open(args: argparse.Namespace, read_only: bool) -> EmbedCache:
    return EmbedCache(args.namespace, root=args.root, read_only=read_only)


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        return _run(args, console)
    except CacheError as e:
        root = args.root or default_root(args.namespace)
        if args.json:
            print(json.dumps({"error": {"type": type(e).__name__, "message": str(e), "root": str(root)}}))
        else:
            console.print(f"[red]error:[/red] {e}")
        return 2


def _emit(args: argparse.Namespace, console: Console, doc: Any, table: Table | None) -> None:
    if args.json:
        print(json.dumps(doc, indent=2))
    elif table is not None:
        console.print(table)


def _run(args: argparse.Namespace, console: Console) -> int:
    commands = {
        "stats": _stats,
        "ls": _ls,
        "show": _show,
        "verify": _verify,
        "evict": _evict,
        "clear": _clear,
        "watch": _watch,
    }
    return commands[args.cache_command](args, console)


def _stats(args: argparse.Namespace, console: Console) -> int:
    s = _open(args, read_only=True).stats()
    doc = _stats_json(s)
    tier = _store_stats(args)
    if tier is not None:
        doc["store"] = tier._asdict()
    engines = {url: _engine_kv_tiers(url) for url in getattr(args, "llm_url", [])}
    if engines:
        doc["llm_kv_tiers"] = engines
    _emit(args, console, doc, _stats_table(s))
    if tier is not None and not args.json:
        console.print(_store_table(tier))
    if not args.json:
        for url, tiers in engines.items():
            console.print(_kv_tiers_table(url, tiers))
    return 0


def _engine_kv_tiers(url: str) -> dict[str, Any]:
    """An engine's ``/health`` ``kv_tiers``: per tier (host, store) its sizes and counters."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5.0) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise CacheError(f"the LLM engine at {url} did not answer /health: {e}") from e
    tiers = body.get("kv_tiers")
    if not isinstance(tiers, dict):
        raise CacheError(f"{url}/health has no kv_tiers: is it an epd llm engine?")
    return tiers


def _kv_tiers_table(url: str, tiers: dict[str, Any]) -> Table:
    t = Table(title=f"KV tiers of {url}" + ("" if tiers else ": none (no --engine-host-kv-bytes)"))
    t.add_column("tier")
    t.add_column("field")
    t.add_column("value", justify="right")
    for tier, fields in tiers.items():
        for name, value in fields.items():
            shown = _human(value) if name.endswith("bytes") and isinstance(value, int) else str(value)
            t.add_row(tier, name, shown)
    return t


def _store_stats(args: argparse.Namespace) -> StoreStats | None:
    """The shared tier's own view (entries, bytes; hits and misses as this process saw them)."""
    if not (getattr(args, "store", None) or getattr(args, "store_dir", None)):
        return None
    try:
        store = open_store(args.store, args.store_dir, 1 << 62)
    except ValueError as e:
        raise CacheError(str(e)) from e
    assert store is not None
    try:
        return store.stats()
    except StoreError as e:
        raise CacheError(f"the store at {args.store or args.store_dir} did not answer: {e}") from e
    finally:
        store.close()


def _store_table(s: StoreStats) -> Table:
    t = Table(title=f"shared store ({s.kind}) {s.location}", show_header=False)
    t.add_column("field")
    t.add_column("value", justify="right")
    for name, value in (("entries", str(s.entries)), ("bytes", _human(s.bytes)), ("errors", str(s.errors))):
        t.add_row(name, value)
    return t


def _ls(args: argparse.Namespace, console: Console) -> int:
    metas = sorted(_open(args, read_only=True).entries(), key=_SORTS[args.sort])
    if args.limit > 0:
        metas = metas[: args.limit]
    table = Table(title=f"entries by {args.sort}")
    for col in ("key", "dtype", "shape", "grid_thw", "modality", "size", "hits", "last access", "writer"):
        table.add_column(col, justify="right" if col in ("size", "hits") else "left")
    for m in metas:
        table.add_row(
            m.key[:16],
            m.dtype,
            f"{m.shape[0]}x{m.shape[1]}",
            ",".join("x".join(map(str, g)) for g in m.grid_thw),
            m.modality,
            _human(m.bytes),
            str(m.hits),
            _age(m.last_access_ns) + " ago",
            m.writer,
        )
    _emit(args, console, [_meta_json(m) for m in metas], table)
    return 0


def _verify(args: argparse.Namespace, console: Console) -> int:
    report = _open(args, read_only=True).verify()
    doc = {
        "ok": report.ok,
        "checked": report.checked,
        "failures": [f._asdict() for f in report.failures],
        "orphan_tmp": report.orphan_tmp,
        "unindexed": report.unindexed,
        "missing": report.missing,
    }
    table = Table(title=f"verify: {report.checked} entries, {len(report.failures)} failed")
    table.add_column("key", no_wrap=True)
    table.add_column("problem")
    for f in report.failures:
        table.add_row(f.key, f.reason)
    table.caption = (
        f"orphan tmp files: {report.orphan_tmp}, unindexed: {report.unindexed}, "
        f"index records without a file: {report.missing}"
    )
    _emit(args, console, doc, table)
    return 0 if report.ok else 1


def _evict(args: argparse.Namespace, console: Console) -> int:
    cache = _open(args, read_only=False)
    key = _resolve(cache, args.key)
    removed = cache.evict(key)
    _emit(args, console, {"key": key, "evicted": removed}, None)
    if not args.json:
        console.print(f"evicted {key}" if removed else f"{key} was not cached")
    return 0 if removed else 1


def _clear(args: argparse.Namespace, console: Console) -> int:
    cache = _open(args, read_only=False)
    if not args.yes:
        answer = input(f"Remove all {cache.stats().entries} entries from {cache.root}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("aborted")
            return 1
    n = cache.clear()
    _emit(args, console, {"removed": n}, None)
    if not args.json:
        console.print(f"removed {n} entries")
    return 0


def _show(args: argparse.Namespace, console: Console) -> int:
    import torch  # only `show` reads values; the other commands start without torch

    cache = _open(args, read_only=True)
    key = _resolve(cache, args.key)
    try:
        hdr = cache.header(key)
        got = cache.get(key, touch=False)
    except CorruptEntry as e:
        _emit(args, console, {"key": key, "header_ok": False, "problem": str(e)}, None)
        if not args.json:
            console.print(f"[red]{key}: bad header: {e}[/red]")
        return 1
    if hdr is None or got is None:
        raise CacheError(f"{key} was evicted while being read")
    raw = got.tensor.reshape(-1)  # [tokens * hidden], still the zero-copy view
    crc_ok = payload_crc(raw.view(torch.uint8).numpy().data) == hdr.payload_crc
    # JSON has no NaN/inf: a damaged payload prints them as strings.
    first = [v if math.isfinite(v) else str(v) for v in raw[: max(0, args.values)].float().tolist()]
    doc = {**_meta_json(got.meta), "header_ok": True, "payload_crc_ok": crc_ok, "first_values": first}
    table = Table(title=key, show_header=False)
    table.add_column("field")
    table.add_column("value")
    for k, v in doc.items():
        if k != "key":
            table.add_row(k, str(v))
    _emit(args, console, doc, table)
    return 0 if crc_ok else 1


def _watch(args: argparse.Namespace, console: Console) -> int:
    cache = _open(args, read_only=True)
    n = 0
    if args.json:
        while args.count <= 0 or n < args.count:
            if n:
                time.sleep(args.interval)
            print(json.dumps({"time": time.time(), **_stats_json(cache.stats())}), flush=True)
            n += 1
        return 0
    with Live(_stats_table(cache.stats()), console=console, refresh_per_second=4, transient=False) as live:
        n = 1
        while args.count <= 0 or n < args.count:
            time.sleep(args.interval)
            live.update(_stats_table(cache.stats()))
            n += 1
    return 0
