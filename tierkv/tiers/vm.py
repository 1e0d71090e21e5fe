"""What the disk tier asks of the OS about LMDB's memory map and file (Linux). Every call is a
hint or an optimisation with a fallback: each returns False (or None) where the OS cannot do it,
and the caller then does the plain thing; a signal handler's exception in one (a ``SIGALRM``
timeout's ``TimeoutError``, an ``OSError`` too) is raised, never taken for the OS's answer. py-lmdb
does not tell the map's address; /proc does."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

from ..interrupts import raised_by_signal_handler

MADV_NORMAL, MADV_RANDOM, MADV_WILLNEED = 0, 1, 3
PAGE = mmap.PAGESIZE
# Not FALLOC_FL_PUNCH_HOLE: LMDB reuses freed pages through its map, and a write fault on a hole
# needs a block the filesystem may no longer have: SIGBUS, where a full disk must be a DiskFull.
_FALLOC_ZERO_RANGE = 0x10 | 0x01  # FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def madvise(start: int, length: int, advice: int) -> bool:
    try:
        return _c().madvise(start, length, advice) == 0
    except (OSError, AttributeError, TypeError) as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's TimeoutError, not the OS's answer
        return False


def zero_range(fd: int, offset: int, length: int) -> bool:
    """Zero a page-aligned range of a file without writing data (ext4, xfs: unwritten extents,
    still allocated); its cached pages are dropped."""
    try:
        return _c().fallocate(fd, _FALLOC_ZERO_RANGE, offset, length) == 0
    except (OSError, AttributeError, TypeError) as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's TimeoutError, not the OS's answer
        return False


def residency(start: int, length: int) -> bytearray | None:
    """mincore's answer for the mapped, page-aligned range ``[start, start + length)``: one byte
    per page, its low bit set where the page cache holds the page; None where the OS cannot tell."""
    pages = -(-length // PAGE)
    vec = bytearray(pages)
    try:
        if _c().mincore(start, length, (ctypes.c_ubyte * pages).from_buffer(vec)) != 0:
            return None
    except (OSError, AttributeError, TypeError) as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's TimeoutError, not the OS's answer
        return None
    return vec


def resident(start: int, length: int) -> np.ndarray | None:
    """Which pages of the mapped, page-aligned range ``[start, start + length)`` the page cache
    holds: one bool per page, or None where the OS cannot tell."""
    vec = residency(start, length)
    return None if vec is None else (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)


# The bytes mincore gives a resident page: the low bit set (the others are reserved).
_RESIDENT = bytes(range(1, 256, 2))


def every_page(vec: bytes | bytearray) -> bool:
    """Whether every page of (a slice of) ``residency``'s answer is resident: one C scan, asked
    before every open's disk reads, where numpy's calls cost more, right after a forward."""
    return not vec.translate(None, _RESIDENT)


def all_resident(start: int, length: int) -> bool:
    """Whether the page cache holds every page of the mapped range (False where the OS cannot
    tell)."""
    vec = residency(start, length)
    return vec is not None and every_page(vec)


def mapping_of(path: str, length: int) -> int | None:
    """Start address of this process's shared mapping of ``path`` that spans ``length`` bytes
    (the kernel rounds a mapping up to whole pages), or None."""
    span = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        real = os.path.realpath(path, strict=True)  # strict: else an OSError inside is answered, a timeout too
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5] == real:
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    if high - low == span:
                        return low
    except (OSError, ValueError) as exc:
        if raised_by_signal_handler(exc):
            raise
    return None


def address(buf: memoryview) -> int:
    """The address of a buffer's first byte."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]
