"""Chained page hashes (epd_common/messages/page_hash.py)."""

from __future__ import annotations

import subprocess
import sys

import xxhash

from epd_common.messages.page_hash import page_hashes


def test_chain_is_the_documented_rule() -> None:
    """h_i = xxh3_64(h_{i-1} as 8 little-endian bytes | the page's keys as int64 LE | media keys)."""
    keys = [5, 6, 7, 8, -3, -3, 9, 10, 11]
    got = page_hashes(keys, 4, [[], ["ab" * 32]])
    h0 = xxhash.xxh3_64_intdigest(
        b"\0" * 8 + b"".join(k.to_bytes(8, "little", signed=True) for k in keys[:4])
    )
    body = b"".join(k.to_bytes(8, "little", signed=True) for k in keys[4:8])
    h1 = xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + body + b"\0" + ("ab" * 32).encode())
    assert got == [h0, h1]  # the partial third page has no hash


def test_shared_prefix_shares_hashes_and_a_difference_changes_every_later_page() -> None:
    a = page_hashes(list(range(16)), 4)
    b = page_hashes([*range(8), 99, *range(9, 16)], 4)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # continuing from a parent equals hashing the whole prefix
    assert page_hashes(list(range(8, 16)), 4, parent=a[1]) == a[2:]
    # other media at the same place: other names
    assert page_hashes([1, 2, 3, 4], 4, [["k1"]]) != page_hashes([1, 2, 3, 4], 4, [["k2"]])


def test_same_in_another_process() -> None:
    """Not Python's salted hash: another interpreter computes the same names."""
    code = "from epd_common.messages.page_hash import page_hashes; print(page_hashes(list(range(12)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(page_hashes(list(range(12)), 4))
