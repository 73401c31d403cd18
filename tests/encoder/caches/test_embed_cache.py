import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from encoder.caches.cache_format import PAGE, CorruptEntry, parse_header
from encoder.caches.cache_lock import FileLock
from encoder.caches.embed_cache import (
    CacheError,
    CacheNotFound,
    EmbedCache,
    EntryTooLarge,
    InvalidKey,
    default_root,
)
from epd_common.messages.embedding_ref import EmbeddingRef


def key(i: int) -> str:
    return hashlib.sha256(f"media-{i}".encode()).hexdigest()


def entry_bytes(rows: int, cols: int, itemsize: int = 4) -> int:
    return PAGE + rows * cols * itemsize


def dir_bytes(root: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(root / "entries"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_roundtrip_all_dtypes_and_metadata(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root, writer="enc-0")
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        t = torch.randn(12, 40).to(dtype)
        ref = cache.put(key(i), t, [(1, 4, 6), (2, 2, 2)], "video")
        assert ref.shape == (12, 40) and ref.grid_thw == ((1, 4, 6), (2, 2, 2)) and ref.modality == "video"
        got = cache.get(key(i))
        assert got is not None
        assert got.tensor.dtype == dtype and torch.equal(got.tensor, t)
        assert got.ref == ref
        assert got.meta.writer == "enc-0" and got.meta.hits == 1
        assert got.meta.bytes == entry_bytes(12, 40, t.element_size())
    assert cache.get(key(99)) is None
    s = cache.stats()
    assert (s.hits, s.misses, s.inserts, s.entries) == (3, 1, 3, 3)
    assert s.used_bytes == dir_bytes(root)
    cache.close()


def test_video_timing_survives_the_header_and_json(root: Path) -> None:
    """A video's seconds per temporal patch and its per-patch timestamps come back from another
    handle's read, and through EmbeddingRef's JSON; 700 timestamps push the header past a page."""
    cache = EmbedCache("t", capacity_bytes=1 << 22, root=root)
    stamps = tuple(i * 2.0 + 0.25 for i in range(700))
    t = torch.randn(700, 8)
    ref = cache.put(key(0), t, [(700, 2, 2)], "video", seconds_per_grid_t=2.0, grid_t_timestamps=stamps)
    assert ref.grid_t_timestamps == stamps
    other = EmbedCache("t", capacity_bytes=1 << 22, root=root)
    got = other.get(key(0))
    assert got is not None and got.ref == ref and torch.equal(got.tensor, t)
    assert got.ref.seconds_per_grid_t == 2.0 and got.ref.grid_t_timestamps == stamps
    assert EmbeddingRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    image = cache.put(key(1), t, [(1, 28, 100)], "image")
    assert image.grid_t_timestamps == () and cache.get(key(1)) is not None
    with pytest.raises(CacheError, match="timestamps"):
        cache.put(key(2), t, [(1, 2, 2)], "video", grid_t_timestamps=(0.0,) * 70000)
    other.close()
    cache.close()


def test_view_survives_eviction_and_writes_stay_private(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    t = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    cache.put(key(0), t, [(1, 16, 16)], "image")
    got = cache.get(key(0))
    assert got is not None
    assert cache.evict(key(0)) and not cache.contains(key(0))
    assert torch.equal(got.tensor, t)  # mapping holds the unlinked inode
    cache.put(key(1), t, [(1, 16, 16)], "image")
    view = cache.get(key(1))
    assert view is not None
    view.tensor.zero_()  # copy-on-write: the shared entry is untouched
    again = cache.get(key(1))
    assert again is not None and torch.equal(again.tensor, t)


def test_first_writer_wins_for_a_key(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    a, b = torch.zeros(8, 8), torch.ones(8, 8)
    cache.put(key(0), a, [(1, 4, 8)], "image")
    cache.put(key(0), b, [(1, 4, 8)], "image")
    got = cache.get(key(0))
    assert got is not None and torch.equal(got.tensor, a)
    assert cache.stats().inserts == 1


def test_lru_eviction_keeps_recently_read_entries_and_the_budget(root: Path) -> None:
    size = entry_bytes(64, 64)
    cache = EmbedCache("t", capacity_bytes=3 * size, root=root)
    for i in range(3):
        cache.put(key(i), torch.full((64, 64), float(i)), [(1, 16, 16)], "image")
    assert cache.get(key(0)) is not None  # 0 is now the most recent; 1 is the LRU
    cache.put(key(3), torch.full((64, 64), 3.0), [(1, 16, 16)], "image")
    assert [cache.contains(key(i)) for i in range(4)] == [True, False, True, True]
    for i in range(4, 30):
        cache.put(key(i), torch.full((64, 64), float(i)), [(1, 16, 16)], "image")
        assert dir_bytes(root) <= 3 * size and cache.stats().used_bytes <= 3 * size
    s = cache.stats()
    assert s.evictions == 30 - 3 and s.evicted_bytes == (30 - 3) * size


def test_entry_count_limit_evicts_like_the_byte_budget(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 24, root=root, max_entries=4)
    for i in range(10):
        cache.put(key(i), torch.zeros(2, 2), [(1, 1, 4)], "image")
    assert cache.stats().entries == 4
    assert [cache.contains(key(i)) for i in range(6, 10)] == [True] * 4


def test_request_errors_name_the_problem(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=2 * PAGE, root=root)
    with pytest.raises(InvalidKey, match="cache key"):
        cache.put("../etc/passwd", torch.zeros(1, 1), [(1, 1, 1)], "image")
    with pytest.raises(InvalidKey):
        cache.get("a/b")
    with pytest.raises(CacheError, match="2-D"):
        cache.put(key(0), torch.zeros(4), [(1, 1, 4)], "image")
    with pytest.raises(CacheError, match="modality"):
        cache.put(key(0), torch.zeros(1, 4), [(1, 1, 4)], "text")
    with pytest.raises(EntryTooLarge, match="exceeds capacity"):
        cache.put(key(0), torch.zeros(1024, 8), [(1, 32, 32)], "image")
    with pytest.raises(CacheError, match="namespace"):
        EmbedCache("bad/name", root=root)


def test_read_only_open_changes_nothing(root: Path) -> None:
    with pytest.raises(CacheNotFound):
        EmbedCache("t", root=root, read_only=True)
    assert not root.exists()
    writer = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    writer.put(key(0), torch.ones(4, 4), [(1, 2, 8)], "image")
    before_stats = writer.stats()
    before_meta = writer.meta(key(0))
    ro = EmbedCache("t", root=root, read_only=True)
    got = ro.get(key(0))
    assert got is not None and torch.equal(got.tensor, torch.ones(4, 4))
    assert ro.get(key(1)) is None
    assert ro.entries() and ro.verify().ok
    assert writer.stats() == before_stats and writer.meta(key(0)) == before_meta
    with pytest.raises(CacheError, match="read-only"):
        ro.evict(key(0))


def test_capacity_is_shared_by_the_namespace(root: Path) -> None:
    a = EmbedCache("t", capacity_bytes=5 * PAGE, root=root)
    b = EmbedCache("t", root=root)
    assert b.capacity_bytes == 5 * PAGE
    EmbedCache("t", capacity_bytes=9 * PAGE, root=root)
    assert a.capacity_bytes == 9 * PAGE


def test_default_roots_are_per_namespace() -> None:
    assert default_root("svc-a") != default_root("svc-b")
    assert default_root("svc-a").name == "epd-svc-a"


def test_verify_catches_a_flipped_payload_byte_and_get_drops_a_bad_header(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    for i in range(3):
        cache.put(key(i), torch.randn(16, 16), [(1, 4, 16)], "image")
    assert cache.verify().ok
    with open(root / "entries" / key(1), "r+b") as f:
        f.seek(PAGE + 5)
        b = f.read(1)
        f.seek(PAGE + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    report = cache.verify()
    assert not report.ok and [f.key for f in report.failures] == [key(1)]
    assert "payload crc" in report.failures[0].reason
    with open(root / "entries" / key(2), "r+b") as f:
        f.seek(20)
        f.write(b"\x7f")
    with pytest.raises(CorruptEntry, match="crc"):
        parse_header((root / "entries" / key(2)).read_bytes(), (root / "entries" / key(2)).stat().st_size)
    assert cache.get(key(2)) is None and not cache.contains(key(2))


def test_sweep_removes_dead_tmp_files_only(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    dead = root / "tmp" / f"{key(0)}.999999.dead"
    dead.write_bytes(b"x" * 100)
    live = root / "tmp" / f"{key(1)}.1.live"
    live.write_bytes(b"y" * 100)
    live_lock = FileLock(live)  # another open file description holds its flock: a live writer
    with live_lock.held():
        assert cache.verify().orphan_tmp == 1
        assert cache.sweep() == 1
        assert not dead.exists() and live.exists()
    assert cache.sweep() == 1 and not live.exists()


def test_sweep_rebuilds_a_lost_index_from_the_entries(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    for i in range(5):
        cache.put(key(i), torch.full((8, 8), float(i)), [(1, 2, 32)], "image")
    cache.close()
    (root / "index").unlink()
    reopened = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    s = reopened.stats()
    assert s.entries == 5 and s.used_bytes == dir_bytes(root)
    got = reopened.get(key(3))
    assert got is not None and got.meta.hits == 1 and torch.equal(got.tensor, torch.full((8, 8), 3.0))
    assert reopened.verify().ok and reopened.verify().unindexed == 0


def test_clear_and_entries(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    for i in range(4):
        cache.put(key(i), torch.zeros(3, 5), [(1, 3, 5)], "image")
    assert sorted(m.key for m in cache.entries()) == sorted(key(i) for i in range(4))
    assert cache.clear() == 4
    assert cache.stats().entries == 0 and cache.stats().used_bytes == 0 and dir_bytes(root) == 0


def test_threads_of_one_process_share_the_lock_safely(root: Path) -> None:
    size = entry_bytes(32, 32)
    cache = EmbedCache("t", capacity_bytes=6 * size, root=root)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(40):
                k = key(base * 100 + i % 15)
                cache.put(k, torch.full((32, 32), float(i % 15)), [(1, 16, 16)], "image")
                got = cache.get(k)
                assert got is None or torch.equal(got.tensor, torch.full((32, 32), float(i % 15)))
                assert cache.stats().used_bytes <= 6 * size
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.verify().ok and cache.stats().used_bytes == dir_bytes(root)


def open_files_under(root: Path) -> list[str]:
    """Paths (relative to ``root``) of this process's open descriptors on files under ``root``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = Path(os.readlink(f"/proc/self/fd/{name}"))
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
        if target.is_relative_to(root):
            out.append(str(target.relative_to(root)))
    return sorted(out)


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (the index is mmap'ed while a cache is open)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(str(path)) for line in f)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_close_releases_everything_and_twice_is_a_no_op(root: Path) -> None:
    t = torch.arange(8 * 8, dtype=torch.float32).view(8, 8)
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=root)
    cache.put(key(0), t, [(1, 2, 32)], "image")
    view = cache.get(key(0))
    assert view is not None
    # Python's mmap keeps a duplicate descriptor of each mapped file: the index and the view's entry.
    assert open_files_under(root) == sorted(["lock", "index", f"entries/{key(0)}"])
    assert mapped(root / "index")
    cache.close()
    assert open_files_under(root) == [f"entries/{key(0)}"] and not mapped(root / "index")
    assert torch.equal(view.tensor, t)  # a view taken before close keeps its own mapping
    del view
    assert open_files_under(root) == []

    # A second close must not touch descriptors: the lock's old number is reused by the next open.
    other = root / "other"
    with open(other, "w") as f:
        cache.close()
        with cache:  # __exit__ closes a third time
            pass
        assert os.fstat(f.fileno()).st_ino == os.stat(other).st_ino
        f.write("still open")
    assert other.read_text() == "still open" and open_files_under(root) == []

    # Closing released only this process's handles: the entry and the counters stay for the next open.
    with EmbedCache("t", root=root) as reopened:
        got = reopened.get(key(0))
        assert got is not None and torch.equal(got.tensor, t)
        assert reopened.stats().entries == 1 and reopened.stats().inserts == 1
        del got
    read_only = EmbedCache("t", root=root, read_only=True)
    assert read_only.stats().hits == 2 and open_files_under(root) == ["index"]
    read_only.close()
    read_only.close()
    assert open_files_under(root) == [] and not mapped(root / "index")
