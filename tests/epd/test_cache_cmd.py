import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encoder.caches.cache_format import PAGE
from encoder.caches.embed_cache import EmbedCache
from epd.cli import build_parser, main


def key(i: int) -> str:
    return hashlib.sha256(f"media-{i}".encode()).hexdigest()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache"
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=r, writer="enc-test")
    for i in range(3):
        cache.put(key(i), torch.full((4 * (i + 1), 8), float(i)), [(1, 2, 2 * (i + 1))], "image")
    for _ in range(2):
        cache.get(key(2))
    cache.get(key(9))  # a miss
    cache.close()
    return r


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, object]:
    rc = main(["cache", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def snapshot(root: Path) -> tuple[object, ...]:
    cache = EmbedCache("t", root=root, read_only=True)
    return (cache.stats(), sorted(cache.entries()), sorted(p.name for p in (root / "entries").iterdir()))


def test_cache_is_registered_in_the_cli() -> None:
    assert "cache" in build_parser().format_help()


def test_stats_ls_show_verify_are_read_only(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(root)
    rc, stats = run_json(capsys, "stats", "--root", str(root))
    assert rc == 0 and isinstance(stats, dict)
    assert stats["entries"] == 3 and stats["hits"] == 2 and stats["misses"] == 1
    assert stats["capacity_bytes"] == 1 << 20 and abs(stats["hit_rate"] - 2 / 3) < 1e-9

    rc, rows = run_json(capsys, "ls", "--root", str(root), "--sort", "size")
    assert rc == 0 and isinstance(rows, list)
    assert [r["key"] for r in rows] == [key(2), key(1), key(0)]
    rc, rows = run_json(capsys, "ls", "--root", str(root), "--sort", "hits", "--limit", "1")
    assert isinstance(rows, list) and [(r["key"], r["hits"]) for r in rows] == [(key(2), 2)]

    rc, shown = run_json(capsys, "show", key(1)[:12], "--root", str(root), "--values", "3")
    assert rc == 0 and isinstance(shown, dict)
    assert shown["key"] == key(1) and shown["shape"] == [8, 8] and shown["grid_thw"] == [[1, 2, 4]]
    assert shown["header_ok"] and shown["payload_crc_ok"] and shown["first_values"] == [1.0, 1.0, 1.0]
    assert shown["writer"] == "enc-test"

    rc, report = run_json(capsys, "verify", "--root", str(root))
    assert rc == 0 and isinstance(report, dict) and report["ok"] and report["checked"] == 3

    assert main(["cache", "stats", "--root", str(root)]) == 0  # rich table path
    assert main(["cache", "ls", "--root", str(root)]) == 0
    assert main(["cache", "show", key(0), "--root", str(root)]) == 0
    assert "capacity" in capsys.readouterr().out
    assert snapshot(root) == before  # not even access times or hit counters moved


def test_verify_fails_on_a_corrupt_entry(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open(root / "entries" / key(0), "r+b") as f:
        f.seek(PAGE)
        f.write(b"\xff\xff\xff\xff")
    rc, report = run_json(capsys, "verify", "--root", str(root))
    assert rc == 1 and isinstance(report, dict)
    assert [f["key"] for f in report["failures"]] == [key(0)]
    assert main(["cache", "verify", "--root", str(root)]) == 1
    assert "1 failed" in capsys.readouterr().out
    rc, shown = run_json(capsys, "show", key(0), "--root", str(root))
    assert rc == 1 and isinstance(shown, dict) and shown["payload_crc_ok"] is False


def test_evict_and_clear(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, out = run_json(capsys, "evict", key(0), "--root", str(root))
    assert rc == 0 and out == {"key": key(0), "evicted": True}
    assert not EmbedCache("t", root=root, read_only=True).contains(key(0))
    rc, out = run_json(capsys, "evict", key(0), "--root", str(root))
    assert rc == 2 and isinstance(out, dict) and "no entry" in out["error"]["message"]

    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["cache", "clear", "--root", str(root)]) == 1
    assert "aborted" in capsys.readouterr().out
    assert EmbedCache("t", root=root, read_only=True).stats().entries == 2
    rc, out = run_json(capsys, "clear", "--yes", "--root", str(root))
    assert rc == 0 and out == {"removed": 2}
    assert EmbedCache("t", root=root, read_only=True).stats().entries == 0


def test_watch_prints_count_snapshots(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "watch", "--root", str(root), "--json", "--interval", "0.01", "--count", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and all(line["entries"] == 3 for line in lines)
    assert main(["cache", "watch", "--root", str(root), "--interval", "0.01", "--count", "2"]) == 0


def test_missing_cache_is_an_error_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    rc, out = run_json(capsys, "stats", "--root", str(missing))
    assert rc == 2 and isinstance(out, dict) and "no embedding cache" in out["error"]["message"]
    assert not missing.exists()


def test_installed_epd_script_prints_stats_json(root: Path) -> None:
    epd = Path(sys.executable).with_name("epd")
    out = subprocess.run(
        [str(epd), "cache", "stats", "--json", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["entries"] == 3 and stats["root"] == str(root)


def test_stats_shows_an_engines_kv_tiers(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real engine on loopback with a host tier: a prompt pushed out of its small pool is spilled,
    and ``epd cache stats --llm-url`` reports the host tier's pages and bytes."""
    import socket
    import threading
    import time

    import uvicorn

    from llm_core.serving.engine import LLMEngine
    from llm_core.serving.sampling import SamplingParams
    from llm_core.serving.server import create_app
    from llm_core.serving.server_config import EngineConfig
    from llm_core.tools.default_llm import ensure_default_checkpoint

    cfg = EngineConfig(kv_memory_bytes=6 << 20, max_model_len=512, host_kv_bytes=32 << 20)
    engine = LLMEngine.from_checkpoint(ensure_default_checkpoint(), cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        import asyncio

        async def fill() -> None:
            sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            for i in range(6):  # distinct prompts, more than the pool holds: the oldest are spilled
                async for _ in engine.generate([40 + i] + [65 + (j * 7 + i) % 50 for j in range(300)], sp):
                    pass

        asyncio.run(fill())
        rc, out = run_json(capsys, "stats", "--root", str(root), "--llm-url", url)
        assert rc == 0 and isinstance(out, dict), out
        host = out["llm_kv_tiers"][url]["host"]
        assert host["pages"] > 0 and host["bytes"] > 0 and host["spilled_pages"] > 0, host
        assert main(["cache", "stats", "--root", str(root), "--llm-url", url]) == 0
        assert "KV tiers of" in capsys.readouterr().out
    finally:
        server.should_exit = True
        thread.join(10)
    rc, out = run_json(capsys, "stats", "--root", str(root), "--llm-url", url)  # the engine is gone
    assert rc == 2 and isinstance(out, dict) and "did not answer" in out["error"]["message"]


def test_ls_shows_an_audio_entry_as_audio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=tmp_path / "c", writer="enc-test")
    cache.put(key(7), torch.ones(5, 8), [(1, 1, 5)], "audio")
    cache.close()
    rc, rows = run_json(capsys, "ls", "--root", str(tmp_path / "c"))
    assert rc == 0 and isinstance(rows, list)
    assert [(r["modality"], r["grid_thw"]) for r in rows] == [("audio", [[1, 1, 5]])]
    assert main(["cache", "ls", "--root", str(tmp_path / "c")]) == 0
    assert "audio" in capsys.readouterr().out
