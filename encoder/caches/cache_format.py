"""The binary layout of one embedding-cache entry file. No pickle: every field has a fixed place.

::

    offset  size  field
    0       8     magic b"EPDEMBED"
    8       2     version (2)
    10      1     dtype code (DTYPES)
    11      1     modality code (MODALITIES)
    12      4     header_len: payload offset, a multiple of PAGE (the payload is page aligned)
    16      8     rows (tokens)
    24      8     cols (hidden)
    32      8     payload_len = rows * cols * itemsize
    40      8     created (unix ns)
    48      4     payload crc32
    52      4     header crc32: over [0, 52) and [64, var_end) (the slot block is excluded)
    56      2     key length      58  2  writer length      60  2  grid count   62  2  timestamp count
    64      8     SLOT BLOCK: index slot (u32) + reserved; the only bytes written after publish
    72      ...   key (ascii) | writer (utf-8) | grid_thw as u32 triples | seconds_per_grid_t (f64,
                  NaN for none: a video's seconds per temporal patch, which M-RoPE spaces by) |
                  grid_t_timestamps as f64 (a video's time of each temporal patch, for models
                  that write timestamps into the prompt)
    ...     pad to header_len
    header_len    payload: the tensor, row-major, little endian

Everything but the slot block is immutable once the file has its final name, so a reader that
checked the header crc sees exactly what the writer wrote. This module knows nothing of files,
locks or eviction: it only packs and parses bytes.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import NamedTuple

MAGIC = b"EPDEMBED"
VERSION = 3  # 2: seconds_per_grid_t after the grid triples; 3: grid_t_timestamps after it
MAX_TIMESTAMPS = 0xFFFF  # the count is a u16
PAGE = 4096
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
MODALITIES: tuple[str, ...] = ("image", "video", "audio")  # codes 0, 1, 2

_FIXED = struct.Struct("<8sHBBIQQQQIIHHHH")  # 64 bytes: offsets 0..63 above
_SLOT = struct.Struct("<II")  # 8 bytes at SLOT_OFFSET
SLOT_OFFSET = 64
_VAR_OFFSET = SLOT_OFFSET + _SLOT.size  # 72
_CRC_OFFSET = 52  # header crc field; bytes before it are covered
MAX_KEY = 128
MAX_WRITER = 256
NO_SLOT = 0xFFFFFFFF
assert _FIXED.size == SLOT_OFFSET


class CorruptEntry(Exception):
    """An entry file whose bytes do not form a valid entry; the message says which check failed."""


class EntryHeader(NamedTuple):
    """The parsed immutable header of one entry."""

    key: str
    dtype: str
    shape: tuple[int, int]
    grid_thw: tuple[tuple[int, int, int], ...]
    modality: str
    writer: str
    created_ns: int
    header_len: int
    payload_len: int
    payload_crc: int
    seconds_per_grid_t: float | None = None
    grid_t_timestamps: tuple[float, ...] = ()

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def header_len_for(key: str, writer: str, n_grid: int, n_timestamps: int = 0) -> int:
    """Bytes before the payload: the variable part rounded up to a page."""
    var = len(key.encode("ascii")) + len(writer.encode("utf-8")) + 12 * n_grid + 8 + 8 * n_timestamps
    return -(-(_VAR_OFFSET + var) // PAGE) * PAGE


def pack_header(
    *,
    key: str,
    dtype: str,
    shape: tuple[int, int],
    grid_thw: tuple[tuple[int, int, int], ...],
    modality: str,
    writer: str,
    created_ns: int,
    payload_crc: int,
    seconds_per_grid_t: float | None = None,
    grid_t_timestamps: tuple[float, ...] = (),
) -> bytes:
    """The header bytes (``header_len`` long) for a payload of ``shape`` ``dtype`` values."""
    key_b, writer_b = key.encode("ascii"), writer.encode("utf-8")
    assert len(key_b) <= MAX_KEY and len(writer_b) <= MAX_WRITER, "key/writer length checked by the cache"
    assert dtype in DTYPES and modality in MODALITIES
    assert len(grid_t_timestamps) <= MAX_TIMESTAMPS, "timestamp count checked by the cache"
    rows, cols = shape
    header_len = header_len_for(key, writer, len(grid_thw), len(grid_t_timestamps))
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        DTYPES.index(dtype),
        MODALITIES.index(modality),
        header_len,
        rows,
        cols,
        rows * cols * ITEMSIZE[dtype],
        created_ns,
        payload_crc,
        0,  # header crc, filled below
        len(key_b),
        len(writer_b),
        len(grid_thw),
        len(grid_t_timestamps),
    )
    seconds = math.nan if seconds_per_grid_t is None else float(seconds_per_grid_t)
    var = (
        key_b
        + writer_b
        + b"".join(struct.pack("<III", *g) for g in grid_thw)
        + struct.pack("<d", seconds)
        + struct.pack(f"<{len(grid_t_timestamps)}d", *grid_t_timestamps)
    )
    crc = zlib.crc32(var, zlib.crc32(fixed[:_CRC_OFFSET]))
    out = bytearray(header_len)
    out[: _FIXED.size] = fixed
    struct.pack_into("<I", out, _CRC_OFFSET, crc)
    _SLOT.pack_into(out, SLOT_OFFSET, NO_SLOT, 0)
    out[_VAR_OFFSET : _VAR_OFFSET + len(var)] = var
    return bytes(out)


def parse_header(buf: bytes | memoryview, file_len: int) -> EntryHeader:
    """Parse and check the header at the start of ``buf`` (at least the header's bytes).

    Raises ``CorruptEntry`` when the magic, version, codes, header crc or the file length
    (``file_len`` = header + payload) do not match.
    """
    if len(buf) < _VAR_OFFSET:
        raise CorruptEntry(f"file is {len(buf)} bytes, shorter than the {_VAR_OFFSET}-byte fixed header")
    (
        magic,
        version,
        dtype_c,
        mod_c,
        header_len,
        rows,
        cols,
        payload_len,
        created,
        pcrc,
        hcrc,
        klen,
        wlen,
        ngrid,
        nstamps,
    ) = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptEntry(f"unsupported version {version} (this build reads {VERSION})")
    if dtype_c >= len(DTYPES) or mod_c >= len(MODALITIES):
        raise CorruptEntry(f"bad dtype code {dtype_c} or modality code {mod_c}")
    var_end = _VAR_OFFSET + klen + wlen + 12 * ngrid + 8 + 8 * nstamps
    if header_len % PAGE or var_end > header_len or len(buf) < var_end:
        raise CorruptEntry(f"header_len {header_len} does not hold the {var_end}-byte header")
    crc = zlib.crc32(bytes(buf[_VAR_OFFSET:var_end]), zlib.crc32(bytes(buf[:_CRC_OFFSET])))
    if crc != hcrc:
        raise CorruptEntry(f"header crc {crc:#010x} != stored {hcrc:#010x}")
    dtype = DTYPES[dtype_c]
    if payload_len != rows * cols * ITEMSIZE[dtype]:
        raise CorruptEntry(f"payload_len {payload_len} != {rows}x{cols} {dtype}")
    if file_len != header_len + payload_len:
        raise CorruptEntry(f"file is {file_len} bytes, header says {header_len + payload_len}")
    pos = _VAR_OFFSET
    key = bytes(buf[pos : pos + klen]).decode("ascii")
    pos += klen
    writer = bytes(buf[pos : pos + wlen]).decode("utf-8")
    pos += wlen
    grid = tuple(struct.unpack_from("<III", buf, pos + 12 * i) for i in range(ngrid))
    (seconds,) = struct.unpack_from("<d", buf, pos + 12 * ngrid)
    stamps = struct.unpack_from(f"<{nstamps}d", buf, pos + 12 * ngrid + 8)
    return EntryHeader(
        key=key,
        dtype=dtype,
        shape=(rows, cols),
        grid_thw=grid,
        modality=MODALITIES[mod_c],
        writer=writer,
        created_ns=created,
        header_len=header_len,
        payload_len=payload_len,
        payload_crc=pcrc,
        seconds_per_grid_t=None if math.isnan(seconds) else seconds,
        grid_t_timestamps=tuple(stamps),
    )


def pack_slot(slot: int) -> bytes:
    """The slot block (written in place with pwrite at SLOT_OFFSET)."""
    return _SLOT.pack(slot, 0)


def unpack_slot(buf: bytes | memoryview) -> int:
    """The index slot recorded in a header (NO_SLOT when none)."""
    return int(_SLOT.unpack_from(buf, SLOT_OFFSET)[0])


def payload_crc(payload: bytes | memoryview) -> int:
    """crc32 of the payload (~0.4 ms per MiB here): checked by ``verify``, not on every read."""
    return zlib.crc32(payload)
