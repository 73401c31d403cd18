"""The file-level half of the node embedding cache: entry headers, temp files, directory walks.

Nothing here takes the cache lock or touches the index; ``embed_cache.py`` decides when these
run. The temp-file protocol::

    writer: open(tmp/<key>.<pid>.<nonce>, O_EXCL) -> flock -> write -> [cache lock] rename -> close
    sweep:  open(tmp/...) -> flock(LOCK_NB) succeeds only if no live writer -> unlink

The writer keeps the temp file's flock until after the rename, so a sweeper can only ever take
it from a writer that died (the kernel releases flocks on exit, kill -9 included).
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from encoder.caches.cache_format import (
    SLOT_OFFSET,
    CorruptEntry,
    EntryHeader,
    pack_slot,
    parse_header,
    payload_crc,
    unpack_slot,
)
from encoder.caches.cache_lock import lock_file, try_lock_file


def read_entry_header(fd: int, file_len: int) -> tuple[EntryHeader, int]:
    """The checked header of an open entry file and the index slot recorded in it."""
    head = os.pread(fd, 4096, 0)
    try:
        hdr = parse_header(head, file_len)
    except CorruptEntry:
        # A header with a very long grid list spans more than one page: read it whole and retry.
        if len(head) < 4096 or file_len <= 4096:
            raise
        header_len = int.from_bytes(head[12:16], "little")
        hdr = parse_header(os.pread(fd, min(header_len, file_len), 0), file_len)
    return hdr, unpack_slot(head)


def check_entry(path: Path, payload: bool) -> EntryHeader | None:
    """The header of the entry file at ``path`` after checking it names this key (the file name)
    and, when ``payload``, the payload crc. None when the file is gone; CorruptEntry when bad."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None  # evicted while we looked
    try:
        file_len = os.fstat(fd).st_size
        try:
            hdr = read_entry_header(fd, file_len)[0]
        except UnicodeDecodeError as e:
            raise CorruptEntry(f"undecodable key or writer: {e}") from e
        if hdr.key != path.name:
            raise CorruptEntry(f"header names key {hdr.key!r}")
        if payload:
            with mmap.mmap(fd, file_len, access=mmap.ACCESS_READ) as mm:
                crc = payload_crc(memoryview(mm)[hdr.header_len :])
            if crc != hdr.payload_crc:
                raise CorruptEntry(f"payload crc {crc:#010x} != stored {hdr.payload_crc:#010x}")
        return hdr
    finally:
        os.close(fd)


def open_tmp(tmp_dir: Path, key: str) -> tuple[int, Path]:
    """Create and flock a private temp file. A sweeper may take the flock in the instant
    between create and flock and unlink the name: then st_nlink is 0 and we try again."""
    while True:
        tmp = tmp_dir / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        lock_file(fd)
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        os.close(fd)


def entry_names(directory: Path) -> list[str]:
    """File names in ``directory`` (empty when it does not exist)."""
    try:
        return [e.name for e in os.scandir(directory)]
    except FileNotFoundError:
        return []


def dead_tmp_files(tmp_dir: Path, remove: bool) -> Iterator[str]:
    """tmp files whose writer is gone (their flock is free); removed when ``remove``."""
    try:
        names = [e.name for e in os.scandir(tmp_dir)]
    except FileNotFoundError:
        return
    for name in names:
        try:
            fd = os.open(tmp_dir / name, os.O_RDONLY)
        except FileNotFoundError:
            continue  # published or cleaned meanwhile
        try:
            if not try_lock_file(fd):
                continue  # a live writer
            if remove:
                try:
                    os.unlink(tmp_dir / name)
                except FileNotFoundError:
                    continue
            yield name
        finally:
            os.close(fd)  # also drops our flock if we took it


def write_slot(path: Path, slot: int) -> None:
    """Record the entry's index slot in its header (the one mutable field; a no-op if gone)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    try:
        os.pwrite(fd, pack_slot(slot), SLOT_OFFSET)
    finally:
        os.close(fd)
