"""The cold tier: one LMDB environment on disk.

Sub-databases:
    blocks    key(16) -> codec record (header + raw KV bytes + checksum)
    heads     key(16) -> the record's head (its bytes up to the payload) and where the record lies
                        in the file (``heads.py``); written and deleted with the record
    sessions  sid(16) -> msgpack [tenant]             (sid hashes tenant and session name; the name
                        itself is never written: earlier builds wrote [tenant, name], still read)
    refs      sid(16) + key(16) -> b""          (which blocks a session references)
    atime     key(16) -> u64 little-endian      (last use, to rebuild LRU order on reopen)
    meta      b"tierkv" -> msgpack {format, hash, block_size}

Heads exist because py-lmdb touches every page of a value it returns (its "preload", so that page
faults happen with the GIL released): reading a record's header from ``blocks`` reads the whole
record from disk. Rebuilding the index from ``blocks`` read the entire store at every reopen (1 GiB
in 20 s from a cold page cache); from ``heads`` it reads a few MiB. A block without a head (written
before heads existed) is read in full once and given one. Readers trust a head only as far as the
record's own verified header agrees with it (the store compares them on every read).

Reads from a cold page cache: the map is advised MADV_RANDOM (py-lmdb's ``readahead=False``), so
touching a B-tree page or a head reads that page alone (this VM's block device reads ahead 8 MiB
around any fault otherwise: a scan of the heads read the whole store). A record is read whole, so
``prefetch(keys)`` asks the kernel for the records' pages at once (MADV_WILLNEED over each one's
place in the file, which its head keeps), before ``load`` copies them: without it, each 4 KiB page
of a record was its own synchronous read (0.05 GB/s against 1.0 GB/s with it, raw read 1.2).
Writes get readahead over the map's never-written end only (``_advise_for_writes``), and deletes
zero records without reading them: in place where the page cache holds them, in the file elsewhere
(``_scrub``). A forget's deletes zero their records in the deleting transaction. The budget's
evictions (``DeleteBlocks.evicted``), in a transaction that writes blocks, zero them just before
LMDB can first reuse their pages, once the transaction after the deleting one has committed, so
that the blocks written then overwrite zeros still in the page cache rather than zeros already
written to disk; a transaction without block writes, or with a forget's deletes, zeroes every such
record before it commits (the store's ``flush`` and ``close`` end with one). ``meta`` keeps a
ledger row of the records not yet zeroed at each commit, which ``scan`` reads after a crash
(``_defer_scrub``).

Writes a kill or a power loss cuts short: with writemap LMDB puts a value in its final pages, free
ones, inside ``put``, so the records and heads of a transaction that never commits are in the file,
in pages no snapshot references, where no forget finds them. Each is therefore put as zeros first
(``_put_records``, ``_put_heads``), and only once its place is named in ``tierkv.lock`` (past the
holder's pid, at ``_INTENT_AT``: data.mdb's inode, the transaction's id, then (offset, length)
pairs), and that note synced, are its bytes written there; the sync comes before any byte that the
OS could write back, so it holds across a power loss too (one ``fdatasync`` of the lock file per
run of block writes, a transaction's in the common case: 3.5-4 ms here). The note is dropped
(truncated) after the commit. An open keeps a note it finds (overwriting the pid in place, never
cutting the file); ``scan`` takes it where it names this file and the transaction after the last
committed one, and the next write zeroes those places before it begins, and drops the note once
its own commit has synced the zeros. ``remove_store`` drops it: it names the removed file's
inode, which the filesystem may give the next store's. A write finding a note of another file
(one a rebuild replaced) or of another transaction drops it before writing its own: only a note
of the very transaction it is (a killed one's) names pages free before it.

Protocol: reads (``load``, ``scan``, ``verify``) run in the caller's thread in short read transactions;
every write goes through ``apply(ops)``, called by the store's single writer thread, which runs
one write transaction per batch. A block is visible to readers only once that transaction has
committed. ``MapFullError`` aborts the transaction, grows the map outside any transaction
(readers are held off by a lock while it does), and retries. Where the main thread applies (the
CLI, a close after the writer ended), a signal handler's exception is raised, never taken for an
op's or the disk's failure, and what the transaction committed before it stays whole. ``close`` takes the same lock: it
waits for a read in progress (whose buffers point into the map it unmaps), and reads after it
raise ``DiskClosed``.

Space: the map never grows past ``map_cap`` = budget + ``slack(budget)``, so the file on disk
stays within that whatever LMDB's free list does (freed pages are reused only some transactions
later, and a multi-page value needs a contiguous run of them). The store counts each block at its
``footprint`` (the record and its head in whole pages). A batch that still does not fit at the cap
is applied without its block writes, which fail with ``DiskFull`` (the store keeps those blocks in
memory and evicts more from disk), and without its head rewrites; deletes and references in the
batch still apply.

Full filesystem: every page of the map has its block in the file before LMDB can write to it
(``_allocate``: ``posix_fallocate`` at open and at each growth), since a write through the map into
a hole of a full filesystem is a SIGBUS, not an error. The map grows by an eighth at a time, so
little is allocated and unused. A growth the filesystem has no room for fails the batch's block
writes with ``FilesystemFull``; deletes and references go on in the map's free pages, and fail
with ``OSError(ENOSPC)`` only where even those are used up.

Opened with ``writemap=True``: values of 1-4 MiB then write at raw-disk speed on this kind of
machine, while ``writemap=False`` ran 2-5x slower (measured when the project began).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import logging
import os
import shutil
import stat
import struct
import sys
import threading
import weakref

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import lmdb
from lmdb import verify as offline
import msgpack
import numpy as np
import torch

from ..codec import (FORMAT_VERSION, MAGIC, CorruptRecord, RecordHeader, decode, decode_header, decode_into,
                     encode_array, payload_view, record_head, record_size)
from ..hashing import HASH_VERSION, KEY_BYTES
from ..interrupts import raised_by_signal_handler
from ..interrupts import stat_or_none as _stat_or_none
from ..locks import SharedLock, on_stack
from ..transfer import Job
from ..units import absolute_path, shell_path
from . import heads as index_entry
from . import vm
from .heads import OFFSET_UNKNOWN

logger = logging.getLogger("tierkv")

_META_KEY = b"tierkv"
# In ``meta``: the evicted records not yet zeroed when a transaction committed (``DiskTier._defer_scrub``):
# msgpack {"txn": its id, "ranges": [[offset, length], ...]}.
_UNZEROED_KEY = b"unzeroed"
_LOCK_FILE = "tierkv.lock"
# In the lock file, past the holder's pid: where the records and heads of the write transaction
# in flight lie (``DiskTier._intend``): u64 data.mdb's inode, u64 the transaction's id, then u64
# pairs (offset, length), to the file's end. With writemap LMDB puts a record in its final pages
# before the commit, and a process killed before it left them in free pages, where no forget or
# clear found them. The module's docstring gives the protocol.
_INTENT_AT = 64
_PAIR = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_CHECKSUM_BYTES = 8  # the codec's trailer
# ``DiskTier._where``'s places: a record's length in the low bits (LMDB's values are below 4 GiB).
_LENGTH_BITS = 40


def _unpack_place(place: int) -> tuple[int, int]:
    return place >> _LENGTH_BITS, place & ((1 << _LENGTH_BITS) - 1)
# Small: with writemap the file is truncated to the map's size, and tools that copy or read a store
# naively (cp, a checksum) then handle all of it; a 1 GiB start made a new store's first spill only
# 1.3x faster, and the test suite's copies of small stores several times slower. And every page of
# the map is allocated on disk (``DiskTier._allocate``): at 64 MiB each new store took 64 MiB of
# disk (of memory on a tmpfs) at once, a test run's stores tens of GiB. Also the least the map grows
# by (``_headroom``): a growth costs 0.1 ms, and a batch's writes grow it by what they need at once.
_INITIAL_MAP = 1 << 20
# What a file that cannot be given more blocks reports: a full filesystem, a quota, a file-size limit.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# What a filesystem without fallocate (and without glibc's emulation of it) reports.
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.ESPIPE})
# LMDB's lock file, allocated before LMDB maps it: at least the size LMDB gives it (a 64-byte slot
# for each of its 126 readers and a header, 8 KiB here); a larger file only holds more reader slots.
_LOCK_BYTES = 16 << 10
_MAX_READERS = 126  # py-lmdb's default
_FEW_READERS = 32  # a table LMDB keeps within one page (64 bytes a slot, a header of 128 to 256)
_PAGE_HEADER = 16  # LMDB's header on the first page of a multi-page (overflow) value
_OVERFLOW_HEADER = struct.Struct("<QHHI")  # that header: page number, pad, flags, pages (LMDB 0.9, 64-bit)
_P_OVERFLOW = 0x04
_ROW_OVERHEAD = 160  # the block's B-tree nodes (blocks, heads), atime row and a session ref, on average
_DELETE_ROOM = 1 << 20  # the top of the map that only deletes and references may use


class DiskFull(RuntimeError):
    """A block write that did not fit in the LMDB map at its cap; the block stays in memory."""


class DiskSyncFailed(OSError):
    """``TieredStore.flush`` could not make its writes durable (the sync of the disk tier failed).

    Protocol: the failure is counted in ``stats()['disk_errors']`` and the disk tier is marked
    failed (``disk_failed``) before this is raised; what the flush wrote may not survive a crash."""


class RebuiltUnsynced(OSError):
    """``DiskTier.rebuild`` put the rebuilt file in place, then the sync of the store's directory
    failed: the store holds what was sound, but a crash before the next sync may bring the
    replaced file back."""


class DamagedStore(ValueError):
    """The store's LMDB file is damaged where LMDB itself reads it (its B-tree, its meta record):
    not a missing record, which is a plain miss, but a store that cannot be opened.
    ``repairable``: ``tierkv check --repair`` can rebuild it (a table's rows, which ``scan``
    reads), not where LMDB cannot open the file, the meta record cannot be read (the CLI reads its
    block size first) or a repair met the damage: there the advice to run that repair led to a
    refusal giving the same advice."""

    def __init__(self, path: str, exc: BaseException, repairable: bool = False) -> None:
        self.reason = f"{type(exc).__name__}: {exc}"
        self.repairable = repairable
        if repairable:
            advice = (f"run `tierkv check {shell_path(path)} --repair`, which rebuilds it from what is sound, or "
                      "delete the directory (its blocks are only a cache and will be recomputed) and create the "
                      "store again")
        else:
            advice = ("`tierkv check --repair` cannot rebuild it there: delete the directory (its blocks are only "
                      f"a cache and will be recomputed; `tierkv clear {shell_path(path)} --all` deletes its files) "
                      "and create the store again")
        super().__init__(f"the tierkv store at {path!r} is damaged ({self.reason}); {advice}")


class DamagedTables(lmdb.CorruptedError):
    """A write transaction that LMDB failed on its own damaged pages: ``MDB_CORRUPTED`` or
    ``MDB_PAGE_NOTFOUND``, or ``MDB_BAD_TXN`` from a transaction that no error had ended before
    (LMDB marks a transaction failed where it trips over a damaged page, at times without saying
    so: the call returns and the next one fails). Not a failing disk: with ``writemap`` nothing in
    a write transaction reads or writes the disk before its commit, whose sync reports ``EIO``."""

    def __init__(self, path: str, exc: BaseException) -> None:
        super().__init__(f"the tierkv store at {path!r} is damaged: LMDB tripped over a damaged page of its B-tree "
                         f"in a write ({type(exc).__name__}: {exc}); close the store and run `tierkv check "
                         f"{shell_path(path)} --repair`, or delete the directory (its blocks are only a cache)")


#: What LMDB and msgpack raise on a damaged B-tree page or meta record.
_DAMAGE = (lmdb.Error, msgpack.exceptions.UnpackException, UnicodeDecodeError)

#: What LMDB raises on its own damaged pages, opening a file or walking its B-tree (or on a file
#: of another LMDB format): not a failing disk.
UNREADABLE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError)


def _truncated(env: Any, file_bytes: int) -> ValueError | None:
    """Why a file of ``file_bytes`` cannot hold the pages its LMDB meta page says are in use (a
    copy or a disk that was cut short), or None. Reads the meta pages only."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if file_bytes >= needed:
        return None
    return ValueError(f"data.mdb is {file_bytes} bytes, shorter than the {needed} its pages in use need: truncated")


class FilesystemFull(DiskFull):
    """A block write refused because the filesystem under the map has no room for it: the map
    could not be given the blocks it needs to grow (``DiskTier._allocate``), or a forecast says so
    (``filesystem_short``). The block stays in memory. Deleting other records would not help:
    their pages stay allocated in the file."""


class Scrubbed(CorruptRecord):
    """A record zeroed by a delete that a crash cut short (its head may have survived it when the
    OS wrote the file's pages back out of order): a plain miss, not damage."""


class DiskClosed(lmdb.Error):
    """A read of a disk tier that was closed (by another thread, the store's ``close``)."""


#: Records this near each other are asked of the page cache together (``prefetch``).
_PREFETCH_GAP = 16 * 4096


class _HeldTxn(threading.local):
    """The read transaction of this thread's ``DiskTier.reading()``, if any, and the frame whose
    ``with`` holds it."""

    txn: lmdb.Transaction | None = None
    owner: FrameType | None = None


def _abort(begun: list[lmdb.Transaction]) -> None:
    for txn in begun:
        txn.abort()


class _Reading:
    """``DiskTier.reading()``. A class rather than a generator's context manager: a signal
    handler's exception landing as the generator's ``next()`` returned (where CPython runs a
    pending handler) left the transaction, the lock's shared side and the thread's ``_reading``
    held for as long as the exception lived (a program keeping it, as ``sys.last_value`` does):
    a remap or a close after it waited for good, and the thread's later reads went through that
    stale transaction. A handler raising as ``__exit__`` starts still leaves them, as with
    ``SharedLock``, and as there they are found stale (``locks.py``): the lock lets go of the
    reader and aborts its transaction, and this thread's reads take no transaction whose ``with``
    is no longer on their stack."""

    __slots__ = ("_tier",)

    def __init__(self, tier: "DiskTier") -> None:
        self._tier = tier

    def __enter__(self) -> None:
        tier = self._tier
        owner = sys._getframe(1)
        begun: list[lmdb.Transaction] = []  # aborted by the lock if it lets go of this reader as stale
        tier._resize_lock.enter_shared(owner, functools.partial(_abort, begun))
        try:
            # Nothing after the stores: the ``with`` statement's own cleanup covers from here.
            begun.append(tier._read_txn())
            tier._reading.owner = owner
            tier._reading.txn = begun[0]
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        tier = self._tier
        txn, tier._reading.txn = tier._reading.txn, None
        tier._reading.owner = None
        try:
            if txn is not None:
                txn.abort()  # a read transaction: nothing to commit
        finally:
            tier._resize_lock.exit_shared()


class StoreInUse(ValueError):
    """The store directory is locked by another process (or another open ``DiskTier``);
    ``this_process``: by this one."""

    def __init__(self, message: str, this_process: bool = False) -> None:
        super().__init__(message)
        self.this_process = this_process


_open_tiers: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


def weak_members(members: "weakref.WeakSet[Any]") -> list[Any]:
    """The live members of a ``WeakSet``, read from a copy of its references that one C call
    makes: a walk of the set itself raised ``RuntimeError`` ("Set changed size during iteration")
    where a close in another thread took its member out meanwhile."""
    refs = members.data.copy()  # type: ignore[attr-defined]
    return [member for member in (ref() for ref in refs) if member is not None]


def _forget_tiers_in_child() -> None:
    """After a fork, in the child: drop its copies of every tier's descriptors. The directory's
    lock (``flock``) belongs to the open file the two processes now share, so the child kept the
    store locked after its parent died, and a child's ``close`` unlocked it under the parent."""
    for tier in list(_open_tiers):
        for name in ("_lock_fd", "_data_fd"):
            fd = getattr(tier, name)
            setattr(tier, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_tiers_in_child)


def _open_here(data: os.stat_result) -> bool:
    """Whether a disk tier of this process holds the data file ``data`` (its ``stat``) open."""
    for tier in weak_members(_open_tiers):
        fd = tier._data_fd
        if fd is None:
            continue
        try:
            if os.path.samestat(os.fstat(fd), data):
                return True
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's TimeoutError, not a tier closed meanwhile
    return False


#: What ``file_damage`` names damage outside any table: where LMDB cannot be trusted to open the file.
UNOPENABLE = ("main", "file")
#: ``verify``'s reason for a record (or its head) zeroed by a delete that a crash cut short.
DELETE_CUT_SHORT = ("zeroed by a delete that a crash cut short, not damage: the store finishes the delete when it "
                    "next opens or reads the block; `check --repair` drops it now")


@dataclass(slots=True)
class FileDamage:
    """``file_damage``'s findings: table -> the first problem found there; and the tables where
    LMDB's reads are not safe (the others' damage, a page that names another page number, keys
    out of order, counts that do not add up, LMDB's reads do not trip over)."""
    tables: dict[str, str] = field(default_factory=dict)
    unsafe: set[str] = field(default_factory=set)


# Problems of ``lmdb.verify`` that LMDB's reads do not trip over (its writes do).
_READ_SAFE = ("stores mp_pgno", "record says", "keys out of order", "mp_txnid", "P_DIRTY")


def file_damage(path: str | os.PathLike[str]) -> FileDamage:
    """LMDB's own structure of the store's file checked by reading it, not through LMDB (tables
    named as ``CheckResult.damaged`` names them; ``free`` for LMDB's free list, whose damage
    only writes meet, ``file`` for its meta pages); none found where the file is sound. Read by
    py-lmdb's offline verifier (``lmdb.verify``, py-lmdb 3.0 on, which tierkv requires). Damage
    some of LMDB's own reads and writes meet with an assertion that aborts the process (a branch
    page without children, a free list that does not add up: found by fuzzing), which nothing in
    the process can catch: this finds it first. The caller must hold the directory's lock (a writer's pages
    read as damage)."""
    found = FileDamage()
    try:
        problems = offline.verify(os.fspath(path), subdir=True)
    except offline.VerifyError as exc:
        found.tables["file"] = str(exc)
        found.unsafe.add("file")
        return found
    except OSError:
        raise  # the file cannot be read: the caller says so
    except Exception as exc:  # noqa: BLE001 - the verifier's own failure (an IndexError, a struct.error...)
        if raised_by_signal_handler(exc):
            raise  # the program's (not an OSError, which is raised above): a sound file was called unsafe
        # It is written not to fall over on any file: one that makes it fall over is damaged in a
        # way it does not expect (or it has a bug). Either way its walk says nothing of where
        # LMDB's reads are safe, so the file is not to be opened.
        found.tables["file"] = (f"py-lmdb {lmdb.__version__}'s offline verifier failed on the file "
                                f"({type(exc).__name__}: {exc}): damage it does not expect, or a fault of its own")
        found.unsafe.add("file")
        return found
    if len(problems) > 1:
        # Pages of a subtree the walk could not follow read as leaked: the damage is that subtree.
        problems = [p for p in problems if "neither reachable nor in the freeDB" not in p] or problems
    for problem in problems:
        problem = str(problem)
        words = problem.split()
        known = True  # a problem of a form this reads: its phrase can tell damage LMDB's reads survive
        if "beyond EOF" in problem or "truncated" in problem:
            table = "file"  # a file cut short: LMDB's own check of its meta pages says by how much
        elif "freeDB" in problem:  # its own pages, or pages it and the tables do not account for alike
            table = "free"
        elif len(words) > 1 and words[1].rstrip(":") == "DB":
            table = words[0].rsplit("/", 1)[-1]  # a named table's: "main/refs DB: ..."
        elif "(via " in problem:
            table = problem.split("(via ", 1)[1].split()[0].rsplit("/", 1)[-1]
        elif problem.startswith("meta page "):
            table = "file"
        else:
            table, known = "file", False
        if table not in _TABLES and table != "free":
            table, known = "file", False
        found.tables.setdefault(table, problem)
        # A problem of another form (another py-lmdb's wording) is never taken for a safe one.
        if table != "free" and not (known and any([phrase in problem for phrase in _READ_SAFE])):
            found.unsafe.add(table)
    return found


_LMDB_MAGIC = struct.pack("<I", 0xBEEFC0DE)
_STORE_TABLES = {b"meta", b"blocks", b"heads", b"sessions", b"refs", b"atime"}


def _advise(fd: int, advice: str) -> None:
    """``posix_fadvise`` of the whole file, where there is one: a hint, as ``vm.madvise`` is, so a
    kernel or filesystem that refuses it (ENOSYS under some emulations) must not refuse the store,
    which every open now reads through ``_holds_store_tables``."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, getattr(os, advice))
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's TimeoutError, not the kernel's refusal


def _holds_store_tables(data: str, scan: bool = True) -> bool | None:
    """Whether the LMDB file ``data`` lists tierkv's tables and no others: the main table's root
    page, a leaf, as either meta page names it (read from the file, not through LMDB). What tells
    a tierkv store from another program's LMDB environment: the lock file does not (anyone can
    make one, tierkv does in a store copied without it, and earlier builds did in other
    programs' environments). False where a root read soundly shows another program's: a leaf
    listing a name tierkv never makes, or a branch (more names than a page holds; tierkv's are
    six); None (falsy too) where no root reads soundly. Where both meta pages are damaged the
    file is read page by page for a leaf listing tierkv's tables (``scan``; True or None)."""
    with open(data, "rb", buffering=0) as f:
        # Every open reads this: the kernel's readahead after the first page brought records
        # into the page cache (a few hundred KiB of a cold store, up to the device's readahead).
        _advise(f.fileno(), "POSIX_FADV_RANDOM")

        def page_at(offset: int, size: int) -> bytes:
            return os.pread(f.fileno(), size, offset)

        # The two meta pages: the first, and the second one page on (either may be the damaged one).
        metas: list[tuple[int, bytes]] = []
        for at in (0, 4096, 8192, 16384, 32768, 65536):
            if metas and at != metas[0][0]:
                continue  # the first meta page's page size places the second
            meta = page_at(at, 256)
            if len(meta) < 16 + 24 + 96 or meta[16:20] != _LMDB_MAGIC:
                continue
            psize = struct.unpack_from("<I", meta, 16 + 24)[0]  # the free table's md_pad: the page size
            if psize >= 4096 and psize <= 1 << 16 and not psize & (psize - 1) and at in (0, psize):
                metas.append((psize, meta))
        def lists_tables(pgno: int, psize: int) -> bool | None:
            if not 2 <= pgno < os.fstat(f.fileno()).st_size // psize:  # a table without a root: P_INVALID (~0)
                return None
            page = page_at(pgno * psize, psize)
            if len(page) != psize or struct.unpack_from("<Q", page, 0)[0] != pgno:
                return None
            flags = struct.unpack_from("<H", page, 10)[0]
            if not flags & 0x02:  # P_LEAF
                return False if flags & 0x0f == 0x01 else None  # P_BRANCH (not P_OVERFLOW or P_META)
            lower = struct.unpack_from("<H", page, 12)[0]
            names = set()
            try:
                for i in range(max(0, (lower - 16) // 2)):
                    node = struct.unpack_from("<H", page, 16 + 2 * i)[0]
                    size = struct.unpack_from("<H", page, node + 6)[0]
                    names.add(page[node + 8:node + 8 + size])
            except struct.error:
                return None
            if not names <= _STORE_TABLES:
                return False
            # Fewer: a store whose creation was cut short, or damaged; not another program's either.
            return True if {b"meta", b"blocks", b"sessions", b"refs", b"atime"} <= names else None

        found = [lists_tables(struct.unpack_from("<Q", meta, 16 + 24 + 48 + 40)[0], psize)  # the main table's root
                 for psize, meta in metas]
        if True in found:
            return True
        if metas:
            return False if False in found else None
        if not scan:
            return None
        # Both meta pages damaged: a page listing the tables is looked for, page by page (the
        # records' overflow pages skipped, as their first page counts them).
        _advise(f.fileno(), "POSIX_FADV_SEQUENTIAL")
        psize = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        pages, pgno = os.fstat(f.fileno()).st_size // psize, 2
        while pgno < pages:
            head = page_at(pgno * psize, 16)
            if len(head) < 16:
                break
            if struct.unpack_from("<Q", head, 0)[0] == pgno and struct.unpack_from("<H", head, 10)[0] & 0x04:
                pgno += max(1, struct.unpack_from("<I", head, 12)[0])  # P_OVERFLOW: its pages' count
                continue
            if lists_tables(pgno, psize):
                return True
            pgno += 1
    return None


def remove_store(path: str | os.PathLike[str]) -> list[str]:
    """Delete a store's files, for a store too damaged to clear through LMDB. Only a directory
    that holds a store's files and nothing else (``data.mdb`` a plain LMDB file whose table of
    tables lists tierkv's tables and no others, ``_holds_store_tables``; tierkv's lock file), and
    only under the directory's lock: raises
    ``StoreInUse`` where another process holds it, ``ValueError`` for anything else. The lock
    file stays (a process waiting on it keeps the same one). Returns the names removed."""
    path = absolute_path(path)
    entries = set(os.listdir(path))
    data = os.path.join(path, "data.mdb")
    # The lock file: tierkv opened it (evidence of nothing alone: anyone can make one, and tierkv
    # makes it in a store copied without it).
    if not {"data.mdb", _LOCK_FILE} <= entries or not entries <= {"data.mdb", "lock.mdb", _LOCK_FILE, _REPAIR_DIR}:
        raise ValueError(f"{path!r} holds files a tierkv store does not ({', '.join(sorted(entries))}); "
                         "not removed: delete them yourself if they are yours to delete")
    _refuse_links(path)
    found = _stat_or_none(data)
    if found is None or not stat.S_ISREG(found.st_mode):
        raise ValueError(f"{data!r} is not a plain file; not removed: delete the directory yourself if it is a "
                         "tierkv store")
    if not _holds_store_tables(data):
        raise ValueError(f"{data!r} does not list a tierkv store's tables (another program's LMDB environment, "
                         "or its table of tables is damaged too); not removed: delete the directory yourself if "
                         "it is a tierkv store")
    lock = DiskTier._lock_directory(path)
    removed = ["data.mdb"]
    try:
        os.unlink(data)
        if lock is not None:
            # The intent of a write a kill cut short names that file by its inode, which the
            # filesystem may give the next store's data.mdb.
            os.ftruncate(lock, len(str(os.getpid())))
        for name in ("lock.mdb", _REPAIR_DIR):
            target = os.path.join(path, name)
            # lstat, not os.path's helpers: they answer False to a signal handler's exception too.
            found = _stat_or_none(target, follow=False)
            if found is None:
                continue
            if stat.S_ISDIR(found.st_mode):
                shutil.rmtree(target, onerror=_raise_handlers)
            else:
                os.unlink(target)
            removed.append(name)
        _sync_directory(path)
    finally:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_UN)
            finally:
                os.close(lock)  # cut short as the flock returned, the directory stayed locked
    return removed


def footprint(record_bytes: int, page_size: int, head_bytes: int = 0) -> int:
    """Bytes a record takes in the file: whole pages (LMDB stores a large value on pages of its
    own), plus its head (on a page of its own too) and its rows. What the disk budget counts."""
    pages = -(-(record_bytes + _PAGE_HEADER) // page_size)
    if head_bytes:
        pages += -(-(index_entry.value_bytes(head_bytes, page_size) + _PAGE_HEADER) // page_size)
    return pages * page_size + _ROW_OVERHEAD


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """``flags`` as runs of equal values: (first, past-the-end, value)."""
    edges = np.flatnonzero(flags[1:] != flags[:-1]) + 1
    bounds = [0, *edges.tolist(), len(flags)]
    return [(a, b, bool(flags[a])) for a, b in zip(bounds, bounds[1:])]


def _is_zeroed(value: memoryview | bytes) -> bool:
    """Zeroed from its start, as ``_scrub`` leaves a record or head (magic first)."""
    return bytes(value[:len(MAGIC)]) == bytes(len(MAGIC))


def _session_row(value: bytes) -> tuple[str | None, str | None] | None:
    """A sessions row's (tenant, name), or None when it is damaged. Rows hold the tenant alone
    (name None): LMDB copies a B-tree page at every change to a row in it, and copies in free
    pages outlive a delete, so a name written once could be read in the file after ``forget``.
    Rows of earlier builds also hold the name."""
    try:
        row = msgpack.unpackb(value)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for bad bytes
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's: taken for a damaged row, the session and its KV were dropped
        return None
    if not isinstance(row, list) or len(row) not in (1, 2) or not (row[0] is None or isinstance(row[0], str)):
        return None
    if len(row) == 1:
        return row[0], None
    return (row[0], row[1]) if isinstance(row[1], str) else None


def _ledger_ranges(row: bytes, txn_id: int) -> list[tuple[int, int]]:
    """The records a ledger row names, if the transaction that wrote it is the last one
    committed; none otherwise (a later one has reused their pages, or the row is damaged)."""
    try:
        ledger = msgpack.unpackb(row)
        if ledger["txn"] != txn_id:
            return []
        return [(int(offset), int(length)) for offset, length in ledger["ranges"]
                if type(offset) is int and type(length) is int and offset > 0 and length > 0]
    except Exception as exc:  # noqa: BLE001 - msgpack and the shape checks raise several kinds
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's: taken for a damaged row, its evicted KV was never zeroed
        return []


def _salvage(env: Any, db: Any, read: Callable[[Any, bytes, memoryview], Any]) -> dict[bytes, Any]:
    """key -> ``read(txn, key, value)`` of the rows of a table that read, where not None: walked
    from the first row up to the first error, then, in another transaction (LMDB fails every
    call of one after an error), from the last row down to it; a damaged page hides the rows
    between."""
    rows: dict[bytes, Any] = {}
    for forward in (True, False):
        try:
            with env.begin(buffers=True) as txn:
                cursor = txn.cursor(db=db)
                more = cursor.first() if forward else cursor.last()
                while more:
                    key = bytes(cursor.key())
                    if key in rows:
                        break  # met the rows the other way found
                    got = read(txn, key, cursor.value())
                    if got is not None:
                        rows[key] = got
                    more = cursor.next() if forward else cursor.prev()
        except _DAMAGE:
            continue
    return rows


def _sized(value: Any, size: int, table: str) -> Any:
    """``value``, a key or value of ``table`` read by a scan, if it is ``size`` bytes long. Every
    key (and reference, stamp) is written at its length: another is LMDB's own node damaged,
    which the writes that follow trip over (``scan`` raises ``DamagedStore``; ``tierkv check
    --repair`` rebuilds the file)."""
    if len(value) != size:
        raise lmdb.CorruptedError(f"a row of {len(value)} bytes in table {table} ({size} expected)")
    return value


def _under(key: bytes, header: RecordHeader) -> RecordHeader:
    """``header`` if its record is stored under its own key; a record moved under another key
    (a damaged B-tree, a bad copy) would restore another conversation's KV."""
    if header.key != key:
        raise CorruptRecord("record stored under another key")
    return header


def slack(budget: int) -> int:
    """Room above the budget for LMDB's free pages and B-tree: the file never exceeds budget + this."""
    return max(4 << 20, budget // 8)


def _refuse_foreign(path: str) -> None:
    """``ValueError`` for another program's LMDB environment at ``path``, reading its files alone.
    A store makes its lock file before LMDB makes data.mdb, so only another program's directory,
    or a store copied without its lock file, has a data.mdb and no ``tierkv.lock``: there,
    data.mdb must list tierkv's tables (``_holds_store_tables``). With one, it must not list
    another program's: earlier builds left ``tierkv.lock`` in environments they then refused,
    and an open there cut the other program's file to tierkv's map and grew its lock.mdb
    before the missing meta table refused it; a store whose tables cannot be read stays a
    damaged store."""
    data = os.path.join(path, "data.mdb")
    st = _stat_or_none(data)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return
    # With a lock file, only a sound root refuses: a scan of a file whose meta pages are both
    # damaged (page by page, at every open) could only find the store's tables or nothing.
    locked = _stat_or_none(os.path.join(path, _LOCK_FILE), follow=False) is not None
    listed = _holds_store_tables(data, scan=not locked)
    if listed is False or (not listed and not locked):
        raise ValueError(f"{path!r} holds an LMDB environment that is not a tierkv store (its data.mdb does not "
                         "list a tierkv store's tables); pass a new or empty directory")


def _lock_link_refusal(lock: str) -> ValueError:
    return ValueError(f"{lock!r} is a symbolic link ({os.readlink(lock)!r}); a store's lock file must be a plain "
                      "file, since tierkv writes its pid there: remove the link (tierkv makes the file again)")


def _link_refusal(file: str) -> ValueError:
    target = os.readlink(file)
    if os.path.basename(file) == "lock.mdb":
        return ValueError(f"{file!r} is a symbolic link ({target!r}); LMDB's lock file must be a plain file in the "
                          "store's directory, since LMDB sizes and rewrites it when it opens the store (and tierkv "
                          "allocates it first): through a link, any file the link names. Remove the link (LMDB "
                          "makes the file again)")
    why = (f"{file!r} is a symbolic link ({target!r}); a store's data file must lie in its directory: a repair "
           "(`tierkv check --repair`) would put its new file in the link's place and leave the target behind, "
           "`tierkv clear --all` would not delete the target of a damaged store, and another store linking to the "
           "same file would write it under a lock of its own")
    if _stat_or_none(file) is None:  # not os.path.exists: it answers False to a handler's exception
        return ValueError(f"{why}. Its target does not exist (LMDB would make it there): remove the link")
    return ValueError(f"{why}. Replace the link with the file (`mv {os.path.join(os.path.dirname(file), target)} "
                      f"{file}`), or, to keep the store on another disk, move its whole directory there and pass "
                      "that path")


def _make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, but a signal handler's exception raised: the standard
    one asks ``os.path.exists`` and ``isdir``, which answer False to any ``OSError`` (a ``SIGALRM``
    timeout became "File exists", or a directory made again)."""
    st = _stat_or_none(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        return
    parent = os.path.dirname(path)
    if parent and parent != path and _stat_or_none(parent) is None:
        _make_dirs(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        st = _stat_or_none(path)
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise


def _is_link(path: str) -> bool:
    """``os.path.islink``, raising a signal handler's exception (a timeout's) where it answered False."""
    found = _stat_or_none(path, follow=False)
    return found is not None and stat.S_ISLNK(found.st_mode)


def _sync_directory(path: str) -> None:
    """fsync a directory, so that the names just made, renamed or removed in it outlast a crash."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _raise_handlers(function: Any, path: str, exc_info: Any) -> None:
    """``shutil.rmtree``'s ``onerror`` for a removal that may fail: a signal handler's exception
    is raised, the rest ignored (``ignore_errors`` swallowed a ``SIGALRM`` timeout too)."""
    if raised_by_signal_handler(exc_info[1]):
        raise exc_info[1]


def _refuse_links(path: str) -> None:
    """``ValueError`` where LMDB's files at ``path`` are symbolic links, before anything is written
    there: LMDB follows them (making a missing target), and so did tierkv's own writes, which
    open the files themselves (the lock file's allocation, which extended the target; data.mdb's
    zeroing and sizing). tierkv's own opens take ``O_NOFOLLOW`` as well, for a link made after
    this check."""
    for name in ("data.mdb", "lock.mdb"):
        file = os.path.join(path, name)
        st = _stat_or_none(file, follow=False)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _link_refusal(file)


def _refuse_shared(path: str) -> None:
    """``ValueError`` where a file of the store at ``path`` has another name (a hard link), read
    before anything is written there. ``cp -al`` (a snapshot tool's copy) links every file: LMDB
    and tierkv write data.mdb in place, so the "copy" changed with the original, and, the lock
    file being one inode, the process holding either store locked the other out (flock conflicts
    between open files of one inode), naming a pid that held another directory. Where only some
    files are linked (a rebuild replaced one copy's data.mdb), two data files shared one
    ``lock.mdb`` (LMDB's reader table and transaction id) or one ``tierkv.lock``."""
    for name in ("data.mdb", "lock.mdb", _LOCK_FILE):
        file = os.path.join(path, name)
        try:
            st = os.lstat(file)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            continue
        if name == "data.mdb":
            raise ValueError(f"{file!r} has {st.st_nlink} hard links: this store shares its files with another "
                             "directory (one of them a copy made with `cp -al` or `ln`), and tierkv writes them in "
                             "place, so each would change with the other and the two would share one lock; delete "
                             "the linked copy (`rm -r`: the other directory keeps its files), and copy a store with "
                             "`cp -a` instead")
        # Its data.mdb is its own: the two are separate stores (a rebuild replaced one's data.mdb,
        # or a tool that links files of equal bytes, such as two tierkv.locks holding one pid, linked
        # them). `rm -r` of either, the remedy for a `cp -al` copy, would lose a store.
        raise ValueError(f"{file!r} has {st.st_nlink} hard links: this store's data.mdb is its own, but this lock "
                         "file is another directory's too, so the two stores would share one lock; with neither "
                         f"store open, remove this one's (`rm {shell_path(file)}`: it is made again at the next "
                         "open; the other directory keeps its own), not the directory")


def _allocate_lock_file_of(path: str) -> None:
    """Before a read-only LMDB environment opens the store at ``path`` (``stored_meta``): its lock
    file's blocks, which LMDB writes through a shared map even read-only (its header, a reader
    slot). Where the file is missing (a store copied without it) LMDB made it with ``ftruncate``,
    a hole: ``tierkv stats`` on a full filesystem died with SIGBUS. An existing file keeps its size
    (a holder of the store sized its reader table by it); a missing or empty one gets
    ``_LOCK_BYTES``. ``OSError`` (ENOSPC) where the filesystem has no room for it."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's TimeoutError: the caller's, not a directory to leave to LMDB
        return  # a read-only directory, say: LMDB decides, as before
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size or _LOCK_BYTES)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the filesystem has no room for the store's "
                                        "lock file; free disk space", path) from exc
        if exc.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _headroom(map_bytes: int) -> int:
    """How much the map grows at a time: an eighth, at least the initial map. Doubling, up to
    half the map was allocated on disk and never used (the map's pages are allocated: see
    ``DiskTier._allocate``). Each growth remaps, and the pages touched after it fault into the
    new map again: an eighth keeps those to a few dozen over a store's life."""
    return max(_INITIAL_MAP, map_bytes // 8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, row-major, without a copy when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a record's header names (``dtype_name``'s inverse): the store reads records
    without importing torch itself."""
    return getattr(torch, name)


def block_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous block tensor (layers, 2, kv_heads, tokens, head_dim) as the uint8 array
    ``codec.decode_into`` fills: (layers * 2 * kv_heads, tokens, head_dim * itemsize), a view."""
    layers, two, heads, tokens, _ = tensor.shape
    return tensor.view(torch.uint8).view(layers * two * heads, tokens, -1).numpy()


# -- write operations, applied in order by the writer thread ---------------------------------
@dataclass(slots=True)
class PutBlock:
    header: RecordHeader
    tensor: Job[torch.Tensor]  # resolves to a host tensor; waited on by the writer
    record_bytes: int


@dataclass(slots=True)
class DeleteBlocks:
    """Blocks to delete, their records zeroed. ``evicted``: the budget's evictions, whose records
    may be zeroed a transaction later, just before LMDB can reuse their pages, rather than in the
    deleting one (``DiskTier._defer_scrub``); a forget's are zeroed in the transaction that
    deletes them, and synced with it. ``superseded``: a session's partial tail that a longer one
    replaced, which a close with a timeout gives up with the block writes queued before it (the
    tail that replaced it among them), rather than delete the one the disk holds; ``owner``: that
    session (sid, tenant). ``forgotten``: that session or its tenant was forgotten since, so its
    tail must go all the same: no longer in the index, no later forget would find it."""
    keys: list[bytes]
    refs: list[bytes] = field(default_factory=list)  # sid + key rows of the sessions that held them
    evicted: bool = False
    superseded: bool = False
    owner: tuple[bytes, str | None] | None = None
    forgotten: bool = False
    footprint: int = 0  # bytes the records take in the file: still there where the delete was given up


@dataclass(slots=True)
class PutRefs:
    sid: bytes
    tenant: str | None
    keys: list[bytes]


@dataclass(slots=True)
class DropRefs:
    """A session's references to ``keys`` go (and its row, with ``drop_session``). ``holders``
    (sid, tenant, key): for each of those blocks that stays on disk, the row and reference of a
    session that keeps it, written in the same transaction. So whatever became of that session's
    own ``PutRefs`` (a batch that failed, a disk that failed), no block is left on disk that no
    session's ``forget`` finds after a restart."""
    sid: bytes
    keys: list[bytes]
    drop_session: bool = False
    holders: list[tuple[bytes, str | None, bytes]] = field(default_factory=list)
    superseded: bool = False  # as DeleteBlocks': the references to a replaced partial tail
    owner: tuple[bytes, str | None] | None = None  # as DeleteBlocks'
    forgotten: bool = False


@dataclass(slots=True)
class DropSessions:
    """Several sessions' ``DropRefs``, applied in order: those a forget gathered (a tenant's
    thousands of one-block sessions queued a ``DropRefs`` each, behind a one-block delete each).
    Counted a session each (``op_count``), as they were one an op."""
    drops: list[DropRefs]


@dataclass(slots=True)
class Touch:
    stamps: dict[bytes, int]


@dataclass(slots=True)
class PutHeads:
    """Heads for sound blocks that lack one (written before heads existed) or whose head was
    damaged: key -> (the record's head, its offset), from ``ScanResult.unindexed``. Optional
    writes: skipped, like block writes, when the map is at its cap."""
    heads: dict[bytes, tuple[bytes, int]]


DiskOp = PutBlock | DeleteBlocks | PutRefs | DropRefs | DropSessions | Touch | PutHeads


@dataclass(slots=True)
class CheckResult:
    bad: list[tuple[bytes, str]] = field(default_factory=list)  # records to drop, and heads without one
    stale: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)  # sound records' damaged heads
    records: int = 0
    record_bytes: int = 0
    # Tables (LMDB sub-databases, "main" for the one listing them) whose B-tree is damaged: name ->
    # what is wrong. No row-by-row repair mends those: ``DiskTier.rebuild`` copies what is sound.
    damaged: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Rebuilt:
    """What ``DiskTier.rebuild`` kept and dropped."""
    records: int = 0  # sound records copied
    dropped: int = 0  # records not copied: damaged, unreadable, or (refs damaged) referenced by no row read soundly
    unreferenced: int = 0  # of those, sound records dropped because the damaged refs table may have held theirs
    sessions: int = 0  # sessions copied
    sessions_dropped: int = 0  # session rows or references that could not be read, or name no copied block
    stamps: int = 0  # last-use stamps copied


#: Each table's key length and value length (None: any); the main table lists the others.
_TABLES: dict[str, tuple[int | None, int | None]] = {
    "main": (None, None), "meta": (None, None), "blocks": (KEY_BYTES, None), "heads": (KEY_BYTES, None),
    "sessions": (KEY_BYTES, None), "refs": (2 * KEY_BYTES, 0), "atime": (KEY_BYTES, _U64.size)}
_REPAIR_DIR = "repair.tmp"  # where ``rebuild`` writes the new file, inside the store's directory


@dataclass(slots=True)
class ScanResult:
    headers: list[tuple[RecordHeader, int]] = field(default_factory=list)  # (header, record bytes)
    corrupt: list[bytes] = field(default_factory=list)
    # Records zeroed by a delete whose transaction never committed (the process died in it):
    # what the delete wanted, so they are finished off, not counted as damage.
    scrubbed: list[bytes] = field(default_factory=list)
    # sid -> (tenant, name: None but in rows of earlier builds, the blocks its refs name)
    sessions: dict[bytes, tuple[str | None, str | None, list[bytes]]] = field(default_factory=dict)
    # Session rows that do not read as [tenant] or [tenant, name], and refs without a row: sid -> the blocks
    # their refs name.
    bad_sessions: dict[bytes, list[bytes]] = field(default_factory=dict)
    atime: dict[bytes, int] = field(default_factory=dict)
    # Sound records without a sound head (read in full this once): key -> (head, offset) to write.
    unindexed: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    # Heads whose record is gone (a write that never landed whole, an older tierkv's delete).
    orphans: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    """One ``apply``'s bookkeeping, across the attempts a ``MapFullError`` makes it repeat."""
    # This attempt's changes of place, by key (None: deleted, or its place unknown); applied to
    # ``_where`` once the transaction commits.
    moves: dict[bytes, tuple[int, int] | None] = field(default_factory=dict)
    # Records zeroed in place by an attempt: an aborted transaction does not undo that (the map is
    # the file), so a retry finds them zeroed already.
    zeroed: set[bytes] = field(default_factory=set)
    # Evicted records to zero once the transaction commits: where each lies, kept across attempts
    # (an attempt zeroed its head, which a retry can no longer read), and this attempt's list.
    places: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    deferred: list[tuple[int, int]] = field(default_factory=list)
    defer: bool = False  # whether evicted records may be left to the next transaction
    # Records and heads this attempt wrote (offset, length): zeroed if it does not commit.
    written: list[tuple[int, int]] = field(default_factory=list)
    intended: int = 0  # how many of ``written`` the lock file's intent names (``DiskTier._intend``)


def _conflicts(op: DiskOp) -> set[bytes]:
    """The blocks (``b"k" + key``) and sessions (``b"s" + sid``) whose rows an op's outcome depends
    on the order of: a session's row and references, a forget's among them, go with its sid (a
    ``Touch`` after a block's delete only leaves a stamp that the delete would have removed)."""
    if isinstance(op, PutBlock):
        return {b"k" + op.header.key}
    if isinstance(op, PutHeads):
        return {b"k" + key for key in op.heads}
    if isinstance(op, DeleteBlocks):
        return {b"k" + key for key in op.keys} | {b"s" + ref[:KEY_BYTES] for ref in op.refs}
    if isinstance(op, DropSessions):
        return set().union(*map(_conflicts, op.drops))
    if isinstance(op, (PutRefs, DropRefs)):
        holders = op.holders if isinstance(op, DropRefs) else []
        return ({b"k" + key for key in op.keys} | {b"s" + op.sid}
                | {b"s" + sid for sid, _, _ in holders})
    return set()


def _transactions(ops: Sequence[DiskOp]) -> list[tuple[list[int], bool]]:
    """``ops``' indices split into transactions, each with whether it holds only superseded
    deletes that follow block writes.

    A delete zeroes its records in the file before its transaction commits (``_scrub``; the map
    is the file). A partial tail that a longer chain replaced, deleted in the transaction that
    writes that chain, was zeroed even when the process died before the commit: the flushed tail
    and its unflushed replacement were both lost. So its delete waits for a later transaction,
    with the other superseded deletes of the batch; an op of a block or session that one of those
    names (the same tail written again, the session forgotten) ends the wait first, keeping the
    order the store gave."""
    parts: list[tuple[list[int], bool]] = []
    now: list[int] = []
    later: list[int] = []
    later_keys: set[bytes] = set()
    writes = False
    for i, op in enumerate(ops):
        keys = _conflicts(op)
        if writes and isinstance(op, (DeleteBlocks, DropRefs)) and op.superseded:
            later.append(i)
            later_keys |= keys
        else:
            if later and not keys.isdisjoint(later_keys):
                parts += [(now, False), (later, True)]
                now, later, later_keys, writes = [], [], set(), False
            now.append(i)
            writes = writes or isinstance(op, PutBlock)
    parts += [(now, False), (later, True)]
    # No ops is still one transaction: it zeroes the evictions still owed (close and flush).
    return [(part, trailing) for part, trailing in parts if part] or [([], False)]


def op_size(op: DiskOp) -> int:
    return op.record_bytes if isinstance(op, PutBlock) else 0


def op_count(op: DiskOp) -> int:
    """How many of a write transaction's items (the writer's ``max_batch``) an op takes, and of
    the store's backlog (``WRITE_BACKLOG_OPS``): a ``DeleteBlocks`` one a block, a
    ``DropSessions`` one a session. A forget queues its deletes a few dozen blocks an op (the
    store's ``FORGET_DELETE_KEYS``); counted as one item each, 64 of them went in one transaction,
    64 times the records one took before, freeing (and zeroing) that many records' pages, with the
    B-tree pages and free-list entries that takes, where a map at its cap keeps only
    ``_DELETE_ROOM`` for deletes."""
    if isinstance(op, DropSessions):
        return len(op.drops)
    return len(op.keys) if isinstance(op, DeleteBlocks) else 1


class DiskTier:
    name = "disk"

    def __init__(self, path: str | bytes | os.PathLike[str], budget: int, block_size: int) -> None:
        self.path = self._resolve_path(path)
        self.budget = budget
        self._check_path(self.path)
        data = os.path.join(self.path, "data.mdb")
        # An empty file holds nothing to lose (LMDB creating it was cut short): made anew.
        st = _stat_or_none(data)
        fresh = st is None or st.st_size == 0
        self._lock_fd: int | None = None
        self._data_fd: int | None = None
        self.env: Any = None
        try:
            self._open(data, fresh, budget, block_size)
        except BaseException:
            # Whatever the step, another signal's handler raising at any of them too: the
            # directory's lock is not left held for the process's life (every later store on it
            # refused as in use), nor the map and the file open.
            env, self.env = self.env, None
            if env is not None:
                env.close()
            fd, self._data_fd = self._data_fd, None
            if fd is not None:
                os.close(fd)
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)  # the flock goes with it
            raise

    def _open(self, data: str, fresh: bool, budget: int, block_size: int) -> None:
        """``__init__``'s steps from the directory's lock on; what it opened is closed there if
        one raises."""
        try:
            _make_dirs(self.path)
            self._lock_fd = self._lock_directory(self.path)
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's TimeoutError: the directory is fine
            # A path under a file, a read-only filesystem (a snapshot, a backup), no permission:
            # the store is opened for writing, even by `tierkv stats`, as LMDB's readers register.
            raise type(exc)(exc.errno, f"{exc.strerror}: a tierkv store needs a directory this process can create "
                                       f"and write; pass another path, or copy the store to a writable one",
                            self.path) from None
        # A rebuild cut short (``rebuild``: killed before its new file took this one's place) left
        # its new file, as large as the records it had copied: not part of the store, removed
        # under the lock (a rebuild holds it throughout).
        made = os.path.join(self.path, _REPAIR_DIR)
        st = _stat_or_none(made, follow=False)
        if st is not None and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(made, onerror=_raise_handlers)
        self._pid = os.getpid()
        # Shared by read transactions (reads of one open run in several threads), exclusive for a
        # remap and close: none unmaps the map under a reader.
        self._resize_lock = SharedLock()
        self._reading = _HeldTxn()
        self._closed = False
        self._scratch: np.ndarray | None = None  # the writer thread's encoding buffer
        self._zeros: np.ndarray | None = None  # what a record is first put as (``_put_records``)
        self.map_cap = budget + slack(budget)
        # An existing file is opened at its own size: with writemap LMDB truncates the file to the
        # map, and opening a store (for ``tierkv check`` say) must not grow it.
        initial = min(_INITIAL_MAP, self.map_cap - _DELETE_ROOM) if fresh else os.path.getsize(data)
        # Whether the map's pages get their blocks before LMDB writes to them (``_allocate``).
        self._allocating = hasattr(os, "posix_fallocate")
        self._no_room: str | None = None  # why the last ``_allocate`` fell short of its end
        try:
            readers = self._allocate_lock_file()
            self.env = lmdb.open(self.path, map_size=initial, max_dbs=8, writemap=True, subdir=True,
                                 readahead=False, max_readers=readers)
            # Each read transaction holds a slot of LMDB's reader table (sized from the lock file:
            # ``readers`` or more) while it lasts; one past them fails (``ReadersFullError``, no
            # disk's fault). Reads of many threads wait for a slot instead (two kept spare).
            self._resize_lock.limit = max(1, self.env.max_readers() - 2)
        except UNREADABLE as exc:
            if not fresh:
                raise DamagedStore(self.path, exc) from exc
            raise
        if not fresh:
            short = _truncated(self.env, initial)
            if short is not None:
                # LMDB extended the file to its map with zeroes: its pages past the cut read as such.
                raise DamagedStore(self.path, short)
        self.page_size = self.env.stat()["psize"]
        # Records are written at least this long, so that LMDB keeps each on pages of its own
        # (a value past half a page never sits inside a B-tree leaf), as heads are (``heads.py``).
        self.min_record_bytes = self.page_size // 2
        self._map_start = self._find_map()
        # The same file as LMDB's, for zeroing deleted records in it without reading them.
        try:
            self._data_fd = os.open(data, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            if not raised_by_signal_handler(exc) and _is_link(data):
                raise _link_refusal(data) from None
            raise
        self._data_ino = os.fstat(self._data_fd).st_ino
        self._allocate_map(fresh)
        # Where each block's record lies in the file, from its head: for prefetch. One int,
        # ``offset << _LENGTH_BITS | length`` (``_place`` reads it): a tuple of two ints took 112 B
        # a block, this 36.
        self._where: dict[bytes, int] = {}
        # Evicted records deleted and not zeroed yet (``_defer_scrub``): those the last committed
        # transaction deleted; those a crash left so (read by ``scan``); and whether ``meta``
        # holds a ledger row naming some, which the next write transaction replaces or deletes.
        self._pending: list[tuple[int, int]] = []
        self._unzeroed: list[tuple[int, int]] = []
        self._unzeroed_txn = 0  # the transaction whose ledger row named ``_unzeroed``
        # What a write transaction that a kill cut short had written (the lock file's intent, read
        # by ``scan``), in pages free in the last committed snapshot: zeroed before the next write.
        self._uncommitted: list[tuple[int, int]] = []
        self._uncommitted_txn = 0
        # The lock file's note names only zeroed places (a killed write's, an aborted one's): it
        # is dropped with the next commit.
        self._intent_zeroed = False
        self._ledger_written = False
        # A store reopened with a smaller budget keeps its file (LMDB never shrinks one); the
        # store evicts down to the budget and the freed pages are reused.
        # Only deletes may grow it further: block writes go to free pages (else every reopen of a
        # file above its budget would raise the cap by as much).
        self.map_cap = max(self.map_cap, self.file_bytes() + _DELETE_ROOM)
        # Another program's LMDB environment is refused before anything is written to it.
        try:
            self._meta = self.env.open_db(b"meta", create=fresh)
        except (lmdb.NotFoundError, lmdb.IncompatibleError):
            raise ValueError(f"{self.path!r} holds an LMDB environment that is not a tierkv store; "
                             "pass a new or empty directory") from None
        except _DAMAGE as exc:
            raise DamagedStore(self.path, exc) from exc
        try:
            self._check_meta(fresh, block_size)
            self._blocks = self.env.open_db(b"blocks")
            # Created by the first write where an older store lacks it: opening writes nothing.
            self._heads: int | None = self._open_db_if_there(b"heads", create=fresh)
            self._sessions = self.env.open_db(b"sessions")
            self._refs = self.env.open_db(b"refs")
            self._atime = self.env.open_db(b"atime")
        except _DAMAGE as exc:
            raise DamagedStore(self.path, exc) from exc
        _open_tiers.add(self)

    @staticmethod
    def _lock_directory(path: str) -> int | None:
        """One process at a time per store: the index lives in the process, so a second writer would
        evict and forget behind the first one's back. Refused at open, with the holder's pid.

        The lock file (``tierkv.lock``, holding the holder's pid) is made only where a store is or
        will be: a directory without a ``data.mdb`` (or with an empty one), or one whose ``data.mdb``
        lists tierkv's tables (``_holds_store_tables``; a store of an earlier build copied without
        its lock file). Another program's LMDB environment raises ``ValueError`` with nothing
        written there. A lock file that is a symbolic link raises ``ValueError`` too: it is
        truncated and written, and through a link that would be any file the link names. So do
        LMDB's files as links (``_refuse_links``) and a store whose files have other names
        (``_refuse_shared``: a copy made with ``cp -al``)."""
        if fcntl is None:  # not POSIX: no advisory locks to take
            return None
        lock = os.path.join(path, _LOCK_FILE)
        # Before anything is written: the refusal used to come after the lock (and, in a store's
        # open, after LMDB's lock.mdb there was grown to tierkv's reader table), leaving
        # tierkv.lock, with this pid, among the other program's files.
        _refuse_links(path)
        _refuse_foreign(path)
        _refuse_shared(path)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            # ELOOP on Linux, EMLINK on FreeBSD: asked of the file, not the errno.
            if not raised_by_signal_handler(exc) and _is_link(lock):
                raise _lock_link_refusal(lock) from None
            raise
        try:
            return DiskTier._lock_file(path, fd)
        except BaseException:
            os.close(fd)  # the flock, if taken, goes with it: another signal's handler raising on the way too
            raise

    @staticmethod
    def _lock_file(path: str, fd: int) -> int:
        """``_lock_directory``'s steps once the lock file is open (``fd``), which the caller closes
        if one raises."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # NULs: the gap up to the intent of a write in flight (``_INTENT_AT``).
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip("\0").strip() or "unknown"
            if holder == str(os.getpid()):
                # A notebook cell run again, say: the first store is still open, and something
                # still refers to it (a store nobody refers to is closed when it is collected).
                raise StoreInUse(f"{path!r} is in use by another TieredStore (pid {holder}, this process): "
                                 "a store that was not closed and is still referred to (a variable, a cache "
                                 "from its open(), a server); call close() on it first (or open stores with "
                                 "`with TieredStore(...) as store:`), or keep using that one",
                                 this_process=True) from None
            raise StoreInUse(f"{path!r} is in use by another TieredStore (pid {holder}); a store directory "
                             "serves one process at a time: close the other store first, or give each "
                             "process its own directory") from None
        # The intent a killed writer left is kept for the store's next scan (the CLI takes the lock
        # too), in place: cut and written back, a kill or a power loss in between lost it.
        size = os.fstat(fd).st_size
        if size > _INTENT_AT and os.pread(fd, size - _INTENT_AT, _INTENT_AT).strip(b"\0"):
            os.pwrite(fd, str(os.getpid()).encode().ljust(_INTENT_AT, b"\0"), 0)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None  # first, as in ``close``
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _allocate_lock_file(self) -> int:
        """Give LMDB's lock file its blocks before LMDB maps it; returns the ``max_readers`` to open
        LMDB with. LMDB sizes the file with ``ftruncate`` (a hole) and writes its reader table
        through a shared map, which on a full filesystem killed the process with SIGBUS inside
        ``lmdb.open``. Where the filesystem has no room for the whole table (a lock file an earlier
        build left with a hole, say), the file is cut to one page, all allocated, and LMDB keeps
        that size, with fewer reader slots (a reader past them gets ``ReadersFullError``)."""
        if not self._allocating:
            return _MAX_READERS
        lock = os.path.join(self.path, "lock.mdb")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if not raised_by_signal_handler(exc) and _is_link(lock):
                raise _link_refusal(lock) from None
            raise
        try:
            for size, readers in ((max(os.fstat(fd).st_size, _LOCK_BYTES), _MAX_READERS), (vm.PAGE, _FEW_READERS)):
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in _UNSUPPORTED:
                        return _MAX_READERS  # no fallocate here: LMDB sizes the file itself, as before
                    if exc.errno not in _NO_ROOM:
                        raise
                    continue
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                return readers
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the filesystem has no room for the store's "
                                        "lock file; free disk space, or pass a path on another filesystem", self.path)
        finally:
            os.close(fd)

    def _allocate_map(self, fresh: bool) -> None:
        """At open: every page of the map gets its block in the file (``_allocate``). A store
        whose file is larger than its pages in use need (written before the map was allocated,
        when a doubling map left a hole of up to half the file) has its map cut back to what
        its next writes need: allocating the whole hole would take GiBs of disk no block asked
        for. Where the filesystem has not even that room, the map ends at the pages in use, all
        written, so allocated: a write that needs more pages finds the map full, as at its cap.

        Holes below the pages in use are allocated too: a build of the time punched deleted
        records' pages out of the file (``FALLOC_FL_PUNCH_HOLE``), and LMDB reuses those pages,
        from its free list, through the map (a SIGBUS on a full filesystem). Where there is no
        room for them, the tail past the pages in use is cut, so that its blocks go to the holes;
        where there is none even then, the store is refused (``OSError`` ENOSPC), not opened to
        die at its first write. (On ext4 the pages of records zeroed with ``FALLOC_FL_ZERO_RANGE``
        read as holes too: allocating them again walks their extents, a millisecond or so.)"""
        current = self.env.info()["map_size"]
        used = self.file_bytes()
        hole = used if fresh else self._first_hole(used)
        start = 0 if fresh else hole
        target = current if fresh else min(current, used + _headroom(used))
        least = min(target, 64 * self.page_size) if fresh else used
        end = self._allocate(start, target, least)
        if end < least and hole < used < current:
            # The tail's blocks go to the holes below the pages in use.
            self._map_to(used)
            end = self._allocate(start, used, used)
        if end < least:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {self._no_room}", self.path)
        self._map_to(max(end, used))

    def _allocate_file(self, name: str, size: int) -> None:
        """Create ``name`` with ``size`` bytes all allocated (``posix_fallocate``), for LMDB to
        write through a map; ``OSError`` (ENOSPC) where the filesystem has no room. Nothing where
        the OS or the filesystem cannot allocate (LMDB sizes the file itself, as before)."""
        if not self._allocating:
            return
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                return
            if exc.errno in _NO_ROOM:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the filesystem has no room for the "
                                            f"rebuilt store's {size} bytes; free disk space", name) from exc
            raise
        finally:
            os.close(fd)

    def _first_hole(self, end: int) -> int:
        """Where the data file's first hole below ``end`` begins (``SEEK_HOLE``); ``end`` if none,
        or where the OS cannot say. Unwritten extents (``FALLOC_FL_ZERO_RANGE``) may count as
        holes: allocating them again costs an extent walk, no disk."""
        if not self._allocating or self._data_fd is None or not hasattr(os, "SEEK_HOLE"):
            return end
        try:
            return min(os.lseek(self._data_fd, 0, os.SEEK_HOLE), end)
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise
            return end

    def _allocate(self, start: int, end: int, least: int) -> int:
        """Give the file its blocks over [start, end) (``posix_fallocate``), before LMDB writes
        there through the map; returns how far it got: ``end``, or as far as the filesystem had
        room for, halving the request, down to ``least``; ``start`` when not even that (and
        ``_no_room`` says why).

        Why: with ``writemap`` the map is the file, and LMDB sizes the file with ``ftruncate``,
        which leaves a hole. A page of the hole gets its block from the filesystem only when
        something first writes to it through the map; where the filesystem has none left, the
        kernel cannot return ENOSPC from a store instruction and kills the process with SIGBUS.
        LMDB writes every page it takes (new records, the B-tree pages each transaction copies,
        even a delete's) anywhere below the map's end, so checking the free space before block
        writes (``filesystem_short``) left deletes, references, stamps and a repair to die. With
        every page of the map allocated, no write through it can fault for want of space; what
        needs more room than the map has fails as ``MapFullError``, which the map's growth
        answers with an allocation that fails with ENOSPC instead: the disk-full path. The map
        grows by an eighth (``_headroom``) rather than doubling, so that what is allocated and
        unused stays small.

        Where the OS has no ``posix_fallocate`` (glibc emulates it where a filesystem lacks
        fallocate) nothing is allocated, and the free-space check alone stands, as before."""
        self._no_room = None
        if not self._allocating or end <= start or self._data_fd is None:
            return end
        size = end - start
        while True:
            try:
                os.posix_fallocate(self._data_fd, start, size)
                return start + size
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    self._allocating = False
                    logger.debug("tierkv: cannot allocate %s's file (%s); checking free space instead", self.path,
                                 exc)
                    return end
                if exc.errno not in _NO_ROOM:
                    raise
                self._no_room = (f"the filesystem under {self.path} has no room to extend the store's file "
                                 f"({exc.strerror}); free disk space, or lower disk_budget to what the "
                                 "filesystem holds")
            smaller = max(size // 2 // self.page_size * self.page_size, least - start)
            if smaller <= 0 or smaller >= size:
                return start
            size = smaller

    def _map_to(self, size: int) -> None:
        """Set the map to ``size`` bytes, the file with it (LMDB truncates the file to the map), or
        cut back an allocation that failed part-way and left the file past the map."""
        if size != self.env.info()["map_size"]:
            self.env.set_mapsize(size)
            self._map_start = self._find_map()
        elif self._data_fd is not None and os.fstat(self._data_fd).st_size > size:
            os.ftruncate(self._data_fd, size)

    @staticmethod
    def _resolve_path(path: str | bytes | os.PathLike[str]) -> str:
        """A user's path as str, ``~`` expanded (LMDB would make a directory named ``~``)."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"the disk tier's path must be a str or a path, got {type(path).__name__}; "
                            "pass None for no disk tier")
        resolved = os.fsdecode(os.fspath(path))
        if not resolved:
            raise ValueError("the disk tier's path is empty; pass a directory (it is created if missing), "
                             "or None for no disk tier")
        if "\0" in resolved:
            raise ValueError(f"the disk tier's path {resolved!r} holds a NUL character, which no file name can; "
                             "pass a directory's path")
        # Absolute: the map is found again after each remap by its file's path (/proc/self/maps),
        # which a relative one no longer named once the process changed its working directory.
        return absolute_path(os.path.expanduser(resolved))

    @staticmethod
    def _check_path(path: str) -> None:
        st = _stat_or_none(path)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"disk tier path {path!r} is a file; pass a directory (it is created if missing)")
        # LMDB's lock.mdb alone holds no data: another process creating the store there right now
        # has made it first (and holds the directory's lock, which refuses this one next).
        entries = set(os.listdir(path)) - {_LOCK_FILE, "lock.mdb"} if st is not None else set()
        if entries and "data.mdb" not in entries:
            raise ValueError(f"{path!r} is not empty and is not a tierkv store; pass a new or empty directory, "
                             "or an existing tierkv store")

    def _check_meta(self, fresh: bool, block_size: int) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(_META_KEY, db=self._meta)
            if raw is None:
                if not fresh and txn.get(b"blocks") is not None:
                    # A tierkv store's tables, and no meta record: its meta table is damaged.
                    raise DamagedStore(self.path, ValueError("its meta record cannot be found"))
                if not fresh:
                    raise ValueError(f"{self.path!r} holds an LMDB environment that is not a tierkv store; "
                                     "pass a new or empty directory")
                txn.put(_META_KEY, msgpack.packb({"format": FORMAT_VERSION, "hash": HASH_VERSION,
                                                  "block_size": block_size}), db=self._meta)
                return
        try:
            meta = msgpack.unpackb(raw)
        except Exception as exc:  # noqa: BLE001 - msgpack raises bare ValueErrors (ExtraData) too
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's: taken for damage, the open said to delete the store
            raise DamagedStore(self.path, exc) from exc
        if not isinstance(meta, dict):
            raise DamagedStore(self.path, ValueError(f"its meta record holds a {type(meta).__name__}"))
        if meta.get("format") != FORMAT_VERSION or meta.get("hash") != HASH_VERSION:
            raise ValueError(
                f"{self.path!r} was written in tierkv format {meta.get('format')} (hash {meta.get('hash')}); this "
                f"version reads format {FORMAT_VERSION} (hash {HASH_VERSION}). Use a new directory, or delete this "
                "one (its blocks are only a cache and will be recomputed)")
        if meta.get("block_size") != block_size:
            raise ValueError(f"{self.path!r} was created with block_size={meta.get('block_size')}; pass "
                             f"block_size={meta.get('block_size')} or use a new directory")

    @staticmethod
    def check_openable(path: str | bytes | os.PathLike[str]) -> str:
        """Raise the ``ValueError`` (or ``TypeError``) an open of ``path`` would raise before it
        writes anything, reading the directory alone: a bad path, a file, a directory that holds
        other files, another program's LMDB environment, LMDB's files or the lock file as symbolic
        links, files hard-linked to another directory's. For programs that must refuse a store
        before costly work: the example server checked only stores with a ``data.mdb`` before
        loading its model (``stored_meta``), and refused a new directory holding a linked
        ``lock.mdb``, or a ``data.mdb`` linked to a missing target, only once the model had loaded.
        Not a promise that an open succeeds (the store may be in use, or damaged; the directory
        may change). Returns the path as an open resolves it."""
        resolved = DiskTier._resolve_path(path)
        DiskTier._check_path(resolved)
        _refuse_links(resolved)
        _refuse_foreign(resolved)
        _refuse_shared(resolved)
        lock = os.path.join(resolved, _LOCK_FILE)
        if _is_link(lock):
            raise _lock_link_refusal(lock)
        return resolved

    @staticmethod
    def stored_meta(path: str | os.PathLike[str]) -> dict[str, int]:
        """``{"format", "hash", "block_size"}`` of the existing store at ``path``, for tools that open
        a store without knowing its block size. Raises ``ValueError`` if ``path`` holds no tierkv
        store, having written nothing in another program's LMDB environment (``_refuse_foreign``).
        Reads in a read-only environment and takes no lock (the holder may be writing):
        call it before opening a ``DiskTier`` on ``path``, never while one is open in this process,
        as LMDB must not have one environment open twice in a process."""
        path = os.fspath(path)
        not_a_store = f"{path!r} is not a tierkv store"
        _refuse_links(path)
        data = _stat_or_none(os.path.join(path, "data.mdb"))
        if data is None or not stat.S_ISREG(data.st_mode):
            raise ValueError(f"{not_a_store} (no data.mdb)")
        if data.st_size == 0:
            raise ValueError(f"{not_a_store} (its data.mdb is empty: a TieredStore opened there starts a new "
                             "store)")
        # Before LMDB's read-only environment, which makes lock.mdb where it is missing and writes
        # its reader table there: the server's block-size check left that among another
        # program's files, as did `tierkv demo --store`.
        _refuse_foreign(path)
        _refuse_shared(path)
        if _open_here(data):
            # LMDB refuses a second environment of one file in a process: its refusal was
            # answered as "is not a tierkv store", of a store this very process has open.
            raise ValueError(f"{path!r} is a tierkv store open in this process (a TieredStore or DiskTier on it): "
                             "call stored_meta before opening it, or after closing it")
        _allocate_lock_file_of(path)
        try:
            env = lmdb.open(path, readonly=True, max_dbs=8, subdir=True, readahead=False)
        except UNREADABLE as exc:
            raise DamagedStore(path, exc) from None
        except lmdb.Error as exc:
            raise ValueError(f"{not_a_store} ({exc})") from None
        # Everything from here closes the environment, a signal handler's exception too: kept open
        # by that exception's frames, it held the store's files, and a store then opened there
        # had LMDB's environment open twice in the process (whose first close drops the other's
        # locks).
        try:
            # Read-only, the map reaches past a truncated file's end, and reading there is a SIGBUS.
            short = _truncated(env, data.st_size)
            if short is not None:
                raise DamagedStore(path, short)
            # A tierkv store's tables (its main table lists them): a meta record that cannot be
            # read there is damage, not another program's environment (`tierkv clear --all`
            # removes it).
            shaped = False
            try:
                with env.begin() as txn:
                    shaped = txn.get(b"blocks") is not None
                    raw = txn.get(_META_KEY, db=env.open_db(b"meta", txn=txn, create=False))
            except (*UNREADABLE, lmdb.BadTxnError) as exc:
                raise DamagedStore(path, exc) from None
            except lmdb.Error:
                raw = None
        finally:
            env.close()
        try:
            meta = msgpack.unpackb(raw) if raw is not None else None
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's: taken for garbage, the store was called damaged or foreign
            meta = None
        fields = ("format", "hash", "block_size")
        if not isinstance(meta, dict) or not all([type(meta.get(f)) is int for f in fields]):
            if shaped:
                raise DamagedStore(path, ValueError("its meta record cannot be read"))
            raise ValueError(f"{not_a_store} (no tierkv meta record)")
        return {f: meta[f] for f in fields}

    def damaged_tables(self) -> dict[str, str]:
        """``verify``'s walk of the tables alone (``CheckResult.damaged``), without the records."""
        damaged = {}
        for name in _TABLES:
            with self._resize_lock.shared(), self._read_txn() as txn:
                why = self._table_damage(txn, name)
            if why is not None:
                damaged[name] = why
        return damaged

    def _open_db_if_there(self, name: bytes, create: bool) -> Any:
        try:
            return self.env.open_db(name, create=create)
        except lmdb.NotFoundError:
            return None

    def footprint(self, record_bytes: int, head_bytes: int = 0) -> int:
        """Bytes a record of ``record_bytes`` (of which ``head_bytes`` head) takes in this file."""
        return footprint(record_bytes, self.page_size, head_bytes)

    def footprint_of(self, header: RecordHeader, record_bytes: int) -> int:
        """``footprint`` of a record of ``record_bytes`` with ``header`` (a scanned one)."""
        return self.footprint(record_bytes, record_bytes - header.payload_nbytes - _CHECKSUM_BYTES)

    def record_count(self) -> int:
        """Rows in ``blocks`` as its B-tree counts them (for a progress bar: damage may skew it)."""
        with self._resize_lock.shared(), self._read_txn() as txn:
            return int(txn.stat(self._blocks)["entries"])

    def file_bytes(self) -> int:
        """Bytes of the file in use: the high-water mark of LMDB's pages (free ones included)."""
        return (self.env.info()["last_pgno"] + 1) * self.page_size

    # -- reads ----------------------------------------------------------------------------------
    def _find_map(self) -> int | None:
        """The map's address, looked up again after every remap (callers hold ``_resize_lock``)."""
        return vm.mapping_of(os.path.join(self.path, "data.mdb"), self.env.info()["map_size"])

    def _offset(self, buf: memoryview) -> int:
        """Where a value returned by this environment lies in its file: known for values on pages of
        their own (overflow pages stay where LMDB put them until the value is deleted), not for the
        small ones stored inside a B-tree leaf, which moves with every change to the leaf."""
        if self._map_start is None or len(buf) < self.page_size // 2:
            return OFFSET_UNKNOWN
        offset = vm.address(buf) - self._map_start
        return offset if 0 <= offset and offset + len(buf) <= self.env.info()["map_size"] else OFFSET_UNKNOWN

    def scan(self) -> ScanResult:
        """Every block's header, session references and last-use stamps, for rebuilding an index.
        Reads heads, not records: a damaged record is found when it is read (a counted miss).
        Raises ``DamagedStore`` where LMDB's own pages are damaged. (LMDB checksums none of them:
        some damage there crashes the process instead, which no check in it can catch.)"""
        try:
            return self._scan()
        except _DAMAGE as exc:
            raise DamagedStore(self.path, exc, repairable=True) from exc

    def _place(self, key: bytes) -> tuple[int, int] | None:
        """Where ``key``'s record lies in the file, (offset, length), if known."""
        place = self._where.get(key)
        return None if place is None else _unpack_place(place)

    def _scan(self) -> ScanResult:
        result = ScanResult()
        with self._resize_lock.shared(), self._read_txn() as txn:
            heads: dict[bytes, memoryview] = {}
            if self._heads is not None:
                heads = {_sized(bytes(key), KEY_BYTES, "heads"): value for key, value in txn.cursor(db=self._heads)}
            used = self.file_bytes()
            for key in txn.cursor(db=self._blocks).iternext(keys=True, values=False):
                key = _sized(bytes(key), KEY_BYTES, "blocks")
                head = heads.pop(key, None)
                if head is not None:
                    if _is_zeroed(head):
                        result.scrubbed.append(key)
                        continue
                    try:
                        header, size, offset = index_entry.decode(head)
                        result.headers.append((_under(key, header), size))
                        if offset != OFFSET_UNKNOWN and offset + size <= used:
                            self._where[header.key] = offset << _LENGTH_BITS | size  # the index's key, not a copy
                        continue
                    except CorruptRecord:
                        pass
                # No head, or a damaged one: the record's own header decides (read in full, this
                # once), and the record gets a new head.
                value = txn.get(key, db=self._blocks)
                if value is None:  # a key the cursor gave that the tree cannot find: damaged
                    result.corrupt.append(key)
                    continue
                try:
                    header = _under(key, decode_header(value))
                    result.headers.append((header, len(value)))
                    result.unindexed[key] = (index_entry.head_of(value), self._offset(value))
                except CorruptRecord:
                    (result.scrubbed if _is_zeroed(value) else result.corrupt).append(key)
            result.orphans = list(heads)
            for sid, value in txn.cursor(db=self._sessions):
                sid = _sized(bytes(sid), KEY_BYTES, "sessions")
                row = _session_row(bytes(value))
                if row is None:
                    result.bad_sessions[sid] = []
                else:
                    result.sessions[sid] = (row[0], row[1], [])
            for ref, value in txn.cursor(db=self._refs):
                ref = _sized(bytes(ref), 2 * KEY_BYTES, "refs")
                _sized(bytes(value), 0, "refs")
                entry = result.sessions.get(ref[:KEY_BYTES])
                if entry is not None:
                    entry[2].append(ref[KEY_BYTES:])
                else:  # its row is damaged, or gone (a damaged key): its session cannot be named
                    result.bad_sessions.setdefault(ref[:KEY_BYTES], []).append(ref[KEY_BYTES:])
            for key, value in txn.cursor(db=self._atime):
                # A stamp's bytes damaged only lose its block's place in the LRU order; its length
                # is LMDB's node.
                stamp = _sized(value, _U64.size, "atime")
                result.atime[_sized(bytes(key), KEY_BYTES, "atime")] = _U64.unpack(stamp)[0]
            row = txn.get(_UNZEROED_KEY, db=self._meta)
            if row is not None:
                self._unzeroed, self._unzeroed_txn = _ledger_ranges(bytes(row), txn.id()), txn.id()
                self._ledger_written = True
            self._uncommitted, self._uncommitted_txn = self._read_intent(txn.id()), txn.id()
        return result

    @property
    def closed(self) -> bool:
        """``close`` (or a ``rebuild``) began: the environment is closed, or left to the process's
        exit where a read outlasted the close's timeout."""
        return self._closed

    @property
    def owes_zeros(self) -> bool:
        """Evicted records not zeroed yet; ``apply([])`` zeroes them, durably."""
        return bool(self._unzeroed or self._pending or self._ledger_written or self._uncommitted)

    def verify(self, on_record: Callable[[int], None] | None = None,
               unsafe: dict[str, str] | None = None) -> CheckResult:
        """Every record checked in full (header, length, checksum, key), and its head against it,
        unlike ``scan``, which reads heads only. ``bad``: the records to drop, and heads without a
        record; ``stale``: sound records whose head is damaged or differs (rewritten by
        ``PutHeads``). A record without any head is sound (``scan`` gives it one). ``on_record(record
        bytes)`` is called after each record, for a progress bar. ``damaged``: the tables whose
        B-tree is damaged (``_table_damage``; every table is walked, not only the records), which
        only ``rebuild`` mends; ``unsafe`` (``file_damage``): tables damaged already, not walked
        (the records neither, for ``blocks``). One read transaction per table."""
        result = CheckResult(damaged=dict(unsafe or {}))
        # A transaction per table: LMDB fails every call of one after its first error. (No
        # writer runs meanwhile: the store commands hold the directory's lock.)
        for name in _TABLES:
            if name in result.damaged:
                continue  # ``unsafe``: ``file_damage`` found it damaged where LMDB's reads may abort
            with self._resize_lock.shared(), self._read_txn() as txn:
                why = self._table_damage(txn, name)
            if why is not None:
                result.damaged[name] = why
        if unsafe and "blocks" in unsafe:
            return result
        with self._resize_lock.shared(), self._read_txn() as txn:
            try:
                self._verify_records(txn, result, on_record)
            except _DAMAGE as exc:
                result.damaged.setdefault("blocks", f"{type(exc).__name__}: {exc}")
        return result

    def _verify_records(self, txn: lmdb.Transaction, result: CheckResult,
                        on_record: Callable[[int], None] | None) -> None:
        heads = self._heads if "heads" not in result.damaged else None
        for key, value in txn.cursor(db=self._blocks):
            key = bytes(key)
            try:
                if not self._in_place(value):
                    # Its row's page number is damaged: LMDB's delete of it would free pages of
                    # other values (the header of the pages it points at says how many).
                    result.damaged.setdefault("blocks", "a row that points at pages not its record's")
                    raise CorruptRecord("its row points at pages that are not its record")
                head = txn.get(key, db=heads) if heads is not None else None
                if _is_zeroed(value) or (head is not None and _is_zeroed(head)):
                    # What ``_scrub`` leaves (head first, then the record, from its start) when a
                    # crash cuts its transaction short: not damage, and a delete to finish, never
                    # to undo. Decoded, it read as "bad magic".
                    raise CorruptRecord(DELETE_CUT_SHORT)
                _under(key, decode(value)[0])
                if head is not None and not self._heads_record(head, value):
                    result.stale[key] = (index_entry.head_of(value), self._offset(value))
            except CorruptRecord as exc:
                result.bad.append((key, str(exc)))
            result.records += 1
            result.record_bytes += len(value)
            if on_record is not None:
                on_record(len(value))
        if heads is not None:
            cursor = txn.cursor(db=self._blocks)
            for key in txn.cursor(db=heads).iternext(keys=True, values=False):
                if not cursor.set_key(key):
                    result.bad.append((bytes(key), "an index entry (head) without its record"))

    def _in_place(self, value: memoryview) -> bool:
        """Whether a value of ``blocks`` or ``heads`` on pages of its own (at least half a page)
        lies where its pages' own header says, as long as it says; True for a shorter one (inside
        a leaf: an earlier build's), and where the map's address is not known."""
        if len(value) < self.page_size // 2:
            return True
        offset = self._offset(value)
        return offset == OFFSET_UNKNOWN or self._record_pages((offset, len(value)))

    def _table_damage(self, txn: lmdb.Transaction, name: str) -> str | None:
        """Why the B-tree of table ``name`` is damaged, or None. Its rows walked in order: each key
        of the table's length, after the one before it, found again by a search from the root,
        each value of the table's length (heads: on pages of their own, where those pages say),
        and as many rows as the table counts. LMDB checksums none of its pages: a damaged node
        reads through a cursor, and then fails the write that deletes near it (every time: the
        store can neither forget there nor be cleared)."""
        key_bytes, value_bytes = _TABLES[name]
        db = None if name == "main" else {"meta": self._meta, "blocks": self._blocks, "heads": self._heads,
                                           "sessions": self._sessions, "refs": self._refs,
                                           "atime": self._atime}[name]
        if name == "heads" and db is None:
            return None  # an older store's: made by the first write
        try:
            entries = txn.stat(db)["entries"] if db is not None else self.env.stat()["entries"]
            cursor, probe = txn.cursor(db=db), txn.cursor(db=db)
            previous, rows = b"", 0
            # Records (blocks) are read in full by the caller; here only their keys.
            values = name != "blocks"
            for key in cursor.iternext(keys=True, values=False):
                key = bytes(key)
                if key_bytes is not None and len(key) != key_bytes:
                    return f"a key of {len(key)} bytes ({key_bytes} expected)"
                if name == "main" and key not in {n.encode() for n in _TABLES}:
                    return f"a table {key!r} that a tierkv store does not have"
                if rows and key <= previous:
                    return "keys out of order"
                if not probe.set_key(key):
                    return "a key that a search from the root does not find"
                if values and name != "main":
                    value = cursor.value()
                    if value_bytes is not None and len(value) != value_bytes:
                        return f"a value of {len(value)} bytes ({value_bytes} expected)"
                    if name == "heads" and not self._in_place(value):
                        return "a row that points at pages not its value's"
                previous, rows = key, rows + 1
            if rows != entries:
                return f"{rows} rows walked, {entries} counted"
        except _DAMAGE as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # -- rebuilding a damaged file ---------------------------------------------------------------
    def rebuild(self, damaged: Collection[str], block_size: int, unsafe: Collection[str] = ()) -> Rebuilt:
        """Copy what is sound into a new file and put it in place of this one; the tier is closed
        afterwards. For damage in LMDB's own B-tree (``CheckResult.damaged``), which no write in
        place mends: LMDB's writes trip over it (and fail every time), and dropping a damaged
        table frees the pages its damaged rows point at, other values' among them.

        Copied: each record that verifies in full under its key (a head zeroed by a delete that a
        crash cut short drops it: that delete is finished, never undone), the sessions and
        references that read soundly and name a copied block of their session's tenant, the
        last-use stamps of copied blocks and the meta record. Not copied: the blocks that only a
        session dropped so referenced (``forget`` of that session could no longer find them);
        with ``refs`` damaged, every block that no reference read soundly names (one a lost
        reference named would stay where its session's ``forget`` cannot find it; blocks of
        turns without a session go with them, recomputed). Heads are not copied: the store's
        next scan writes them (``ScanResult.unindexed``). ``unsafe`` (``file_damage``): tables not
        read at all (LMDB's reads there may abort the process), as if empty. Needs free space for
        the records kept; raises ``OSError`` (ENOSPC) before writing anything where the
        filesystem lacks it."""
        made = os.path.join(self.path, _REPAIR_DIR)
        shutil.rmtree(made, onerror=_raise_handlers)  # a repair cut short
        with self._resize_lock:
            if self._closed:
                raise DiskClosed(f"the disk tier at {self.path} is closed")
            st, fs = os.fstat(self._data_fd), os.fstatvfs(self._data_fd)  # type: ignore[arg-type]
            if st.st_blocks * 512 + (64 << 20) > fs.f_bavail * fs.f_frsize:
                raise OSError(errno.ENOSPC, f"rebuilding the store needs up to {st.st_blocks * 512} bytes free "
                                            f"next to it, and the filesystem has {fs.f_bavail * fs.f_frsize}; "
                                            "free space, or delete the store with `tierkv clear "
                                            f"{shell_path(self.path)} --all`")
            result = Rebuilt()
            seen = 0

            def record(txn: lmdb.Transaction, key: bytes, value: memoryview) -> tuple[str | None] | None:
                nonlocal seen
                seen += 1
                return self._sound_tenant(txn, key, value, damaged)

            damaged = {*damaged, *unsafe}

            def salvage(name: str, db: Any, read: Callable[[Any, bytes, memoryview], Any]) -> dict[bytes, Any]:
                return {} if name in unsafe else _salvage(self.env, db, read)

            tenants = {key: tenant for key, (tenant,) in salvage("blocks", self._blocks, record).items()}
            refs = salvage("refs", self._refs, lambda _t, k, v: True if len(k) == 2 * KEY_BYTES and not len(v)
                           else None)
            rows = salvage("sessions", self._sessions, lambda _t, k, v: bytes(v) if len(k) == KEY_BYTES and
                           _session_row(bytes(v)) is not None else None)
            stamps = salvage("atime", self._atime, lambda _t, k, v: bytes(v) if len(k) == KEY_BYTES and
                             len(v) == _U64.size else None)
            by_session: dict[bytes, list[bytes]] = {}
            for ref in refs:
                by_session.setdefault(ref[:KEY_BYTES], []).append(ref[KEY_BYTES:])
            kept_sessions: dict[bytes, tuple[bytes, list[bytes]]] = {}
            doomed: set[bytes] = set()  # blocks of sessions dropped: their forget could not find them
            for sid, keys in by_session.items():
                keys = [key for key in keys if key in tenants]
                owners = {tenants[key] for key in keys}
                row = rows.get(sid)
                if row is None and "sessions" in damaged and len(owners) == 1:
                    row = msgpack.packb([next(iter(owners))])  # a session only references its tenant's blocks
                parsed = _session_row(row) if row is not None else None
                if keys and parsed is not None and owners == {parsed[0]}:
                    kept_sessions[sid] = (row, keys)
                else:
                    doomed.update(keys)
                    result.sessions_dropped += 1
            held = {key for _row, keys in kept_sessions.values() for key in keys}
            doomed -= held
            if "refs" in damaged:
                lost = {key for key in tenants if key not in held}
                result.unreferenced = len(lost - doomed)
                doomed |= lost
            keys = sorted(key for key in tenants if key not in doomed)
            os.mkdir(made)  # in the store's directory; os.makedirs asks os.path.exists (a timeout answered False)
            try:
                # Not writemap: LMDB would size the new file to the map at once (a hole) and write
                # its pages through the map, which on a filesystem filled meanwhile (by another
                # program) kills the process with SIGBUS; written with write(2), that is ENOSPC,
                # and the store stays as it was. The lock file, which LMDB writes through a map
                # whatever the flag, is allocated first, as the store's own is.
                self._allocate_file(os.path.join(made, "lock.mdb"), _LOCK_BYTES)
                # Room past the pages this file uses, which hold at most what the copy does: the
                # copy, written in several transactions, needs pages for each one's copy-on-write
                # besides its content, and a map the size of a file with no free page (a store
                # rebuilt, not written since, opens at its own size) failed a second repair with
                # MapFullError. From the pages used, not the map: address space (no writemap here:
                # the file grows only as far as the copy writes), which a `ulimit -v` may refuse.
                info = self.env.info()
                used = (info["last_pgno"] + 1) * self.page_size
                room = -(-(used + used // 4 + (64 << 20)) // vm.PAGE) * vm.PAGE
                new = lmdb.open(made, map_size=room, max_dbs=8, writemap=False, subdir=True, readahead=False)
            except BaseException:
                shutil.rmtree(made, onerror=_raise_handlers)
                raise
            try:
                dbs = {name: new.open_db(name.encode()) for name in ("meta", "blocks", "sessions", "refs", "atime")}
                copied = set()
                for start in range(0, len(keys), 256):  # LMDB bounds a transaction's dirty pages
                    try:
                        with self.env.begin(buffers=True) as txn, new.begin(write=True) as out:
                            for key in keys[start:start + 256]:
                                value = txn.get(key, db=self._blocks)  # found again from the root
                                if value is not None and self._sound_tenant(txn, key, value, damaged) is not None:
                                    out.put(key, value, db=dbs["blocks"])
                                    copied.add(key)
                    except _DAMAGE:
                        # A search from the root that trips over the damage (the cursor found these
                        # keys): the batch's records are dropped, one at a time the rest of it.
                        copied -= set(keys[start:start + 256])
                        for key in keys[start:start + 256]:
                            try:
                                with self.env.begin(buffers=True) as txn, new.begin(write=True) as out:
                                    value = txn.get(key, db=self._blocks)
                                    if value is not None and self._sound_tenant(txn, key, value, damaged) is not None:
                                        out.put(key, value, db=dbs["blocks"])
                                        copied.add(key)
                            except _DAMAGE:
                                pass
                with new.begin(write=True) as out:
                    out.put(_META_KEY, msgpack.packb({"format": FORMAT_VERSION, "hash": HASH_VERSION,
                                                      "block_size": block_size}), db=dbs["meta"])
                    for sid, (row, session_keys) in kept_sessions.items():
                        session_keys = [key for key in session_keys if key in copied]
                        if not session_keys:
                            result.sessions_dropped += 1
                            continue
                        result.sessions += 1
                        out.put(sid, row, db=dbs["sessions"])
                        for key in session_keys:
                            out.put(sid + key, b"", db=dbs["refs"])
                    for key, stamp in stamps.items():
                        if key in copied:
                            out.put(key, stamp, db=dbs["atime"])
                            result.stamps += 1
                new.sync(True)
            except BaseException:
                new.close()
                shutil.rmtree(made, onerror=_raise_handlers)  # the store stays as it was
                raise
            new.close()
            result.records = len(copied)
            result.dropped = seen - len(copied)
            self._closed = True
            self.env.close()
        # Taken first, as in ``close``: cut short as ``os.close`` returned, the caller's ``close``
        # closed the number again (another file's, once the process reuses it).
        fd, self._data_fd = self._data_fd, None
        if fd is not None:
            os.close(fd)
        os.replace(os.path.join(made, "data.mdb"), os.path.join(self.path, "data.mdb"))
        try:
            _sync_directory(self.path)
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise
            # Not the store as it was any more: a caller saying so after this was wrong.
            raise RebuiltUnsynced(exc.errno, f"the rebuilt file is in place, but syncing {self.path} failed: "
                                             f"{exc.strerror}") from exc
        finally:
            shutil.rmtree(made, onerror=_raise_handlers)
            self._unlock()
            _open_tiers.discard(self)  # as in close
        return result

    def _sound_tenant(self, txn: lmdb.Transaction, key: bytes, value: memoryview,
                      damaged: Collection[str]) -> tuple[str | None] | None:
        """(its tenant,) for a record that verifies in full where it lies (its head, where the
        heads table is sound, not zeroed by a delete); None for any other."""
        try:
            if len(key) != KEY_BYTES or not self._in_place(value):
                return None
            header = _under(key, decode(value)[0])
            if "heads" not in damaged and self._heads is not None:
                head = txn.get(key, db=self._heads)
                if head is not None and _is_zeroed(head):
                    return None
        except CorruptRecord:
            return None
        return (header.tenant,)

    def _heads_record(self, head: memoryview, record: memoryview) -> bool:
        try:
            _header, size, offset = index_entry.decode(head)
        except CorruptRecord:
            return False
        known = self._offset(record)  # unknown where the map's address is (no /proc)
        return size == len(record) and index_entry.head_of(head) == index_entry.head_of(record) and \
            (offset == known or OFFSET_UNKNOWN in (offset, known))

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Start reading these blocks' records from disk, all at once, without waiting: a hint (a
        block not found, or whose place is unknown, is skipped). ``load`` then finds the pages
        read, or on their way."""
        with self._resize_lock.shared():
            start = self._map_start
            if start is None or self._closed:
                return
            # The OS's page, not LMDB's: mincore answers and madvise takes whole OS pages, and
            # LMDB's page differs from the OS's on 64 KiB-page kernels (LMDB's is 32 KiB at most)
            # and in a store made on another machine (it keeps the file's own).
            page = vm.PAGE
            records = sorted(((start + where[0]) // page * page, start + where[0] + where[1])
                             for where in map(self._place, keys) if where is not None)
            # Records written together lie one after another in the file, a B-tree page or two
            # between them: the page cache is asked once a run of them, not once a record.
            runs: list[list[tuple[int, int]]] = []
            for begin, end in records:
                if runs and begin - runs[-1][-1][1] <= _PREFETCH_GAP:
                    runs[-1].append((begin, end))
                else:
                    runs.append([(begin, end)])
            for run in runs:
                first = run[0][0]
                cached = vm.residency(first, max(end for _, end in run) - first)
                for begin, end in run:
                    # Asked of the page cache first: a readahead request walks every page of the
                    # record even where all are cached, eight times as long as this question.
                    if cached is None or not vm.every_page(cached[(begin - first) // page:-(-(end - first) // page)]):
                        vm.madvise(begin, end - begin, vm.MADV_WILLNEED)

    def _read_txn(self) -> lmdb.Transaction:
        """A read transaction (callers hold ``_resize_lock``)."""
        if self._closed:
            raise DiskClosed(f"the disk tier at {self.path} is closed")
        return self.env.begin(buffers=True)

    def read_into(self, key: bytes, into: Callable[[RecordHeader], np.ndarray]) -> RecordHeader:
        """Read and verify one block into the destination ``into(header)`` returns (see
        ``codec.decode_into``: the whole payload, or its first tokens into a larger buffer).
        Raises ``KeyError`` if it is absent and ``CorruptRecord`` if it fails any check. Call
        ``prefetch`` first when the page cache may not hold the record (one synchronous read per
        page otherwise)."""
        held = self._reading
        txn = held.txn
        if txn is not None:
            if on_stack(held.owner, sys._getframe(1)):  # inside this thread's ``reading()``
                return self._read_in(txn, key, into)
            # Left by a ``reading()`` whose exit a signal handler's exception cut short: the lock
            # aborts it as it lets go of that reader (at the shared holding below).
            held.txn = held.owner = None
        with self._resize_lock.shared(), self._read_txn() as txn:
            return self._read_in(txn, key, into)

    def reading(self) -> _Reading:
        """Within it, this thread's ``read_into`` calls share one read transaction (an open's few
        records in turn): a transaction and the shared lock a record cost more than the copy of
        a short restore's small records, right after a forward. A remap waits for the whole of
        it: hold it around reads only, never across a wait for something else. Not nested."""
        return _Reading(self)

    def _read_in(self, txn: lmdb.Transaction, key: bytes, into: Callable[[RecordHeader], np.ndarray]
                 ) -> RecordHeader:
        buf = txn.get(key, db=self._blocks)
        if buf is None:
            raise KeyError(key)
        if _is_zeroed(buf):
            raise Scrubbed("record zeroed by a delete")
        # The only copy: from the memory map into the destination, inside the transaction
        # that keeps the map's pages valid, checksummed on the way.
        return _under(key, decode_into(buf, into))

    def load(self, key: bytes, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
             ) -> tuple[RecordHeader, torch.Tensor]:
        """One block as a tensor of its own, made by ``empty(shape, dtype)``; raises as
        ``read_into``."""
        made: list[torch.Tensor] = []

        def destination(header: RecordHeader) -> np.ndarray:
            made.append(empty(header.shape, torch_dtype(header.dtype)))
            return block_bytes(made[0])

        header = self.read_into(key, destination)
        return header, made[0]

    # -- writes (writer thread only) ------------------------------------------------------------
    def apply(self, ops: Sequence[DiskOp]) -> list[BaseException | None]:
        """Write transactions for ``ops``, in order; one entry per op: None, or the error it failed
        with. One transaction, but for superseded deletes that follow block writes: those go in
        one more, after it (``_transactions``). An error that the first transaction raises is
        raised: nothing was applied. A signal handler's exception (in an apply run by the main
        thread) is raised wherever it lands, what committed before it kept."""
        results: list[BaseException | None] = [None] * len(ops)
        for n, (part, trailing) in enumerate(_transactions(ops)):
            try:
                done = self._apply([ops[i] for i in part], trailing)
            except Exception as exc:  # noqa: BLE001 - after a commit: only this part's ops failed
                # The caller's timeout, not its ops' failure: handed back as their errors, it was
                # lost. Only the writer thread sends batches of two transactions today (the CLI's
                # repair and a close's ``apply([])`` write no blocks), where it never happens.
                if n == 0 or raised_by_signal_handler(exc):
                    raise
                done = [exc] * len(part)
            for i, result in zip(part, done):
                results[i] = result
        return results

    def _apply(self, ops: Sequence[DiskOp], trailing: bool = False) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(ops)
        need = sum(op.record_bytes for op in ops if isinstance(op, PutBlock))
        self._reserve(need)
        short = self._filesystem_short(need) if need else None
        if any([isinstance(op, PutBlock) for op in ops]):
            self._advise_for_writes()
        self._zero_owed()
        full = False
        batch = _Batch()
        # With no block write to reuse the pages, or a forget's delete, whose flush must find every
        # delete up to it zeroed on disk: evicted records are zeroed in this transaction, and those
        # still pending before it, synced by its commit.
        # (A trailing transaction of superseded deletes follows one with block writes: the pages
        # those reuse are still ahead.)
        batch.defer = (trailing or any([isinstance(op, PutBlock) for op in ops])) and \
            not any([isinstance(op, DeleteBlocks) and not op.evicted and not op.superseded for op in ops])
        if not batch.defer:
            pending, self._pending = self._pending, []
            self._zero(pending)
        while True:
            created = self._heads is None
            batch.moves = {}
            batch.deferred = []
            txn_id: int | None = None
            cut: BaseException | None = None
            try:
                with self.env.begin(write=True, buffers=True) as txn:
                    txn_id = txn.id()
                    if created:
                        # A handle opened in a transaction lives only if that transaction commits.
                        self._heads = self.env.open_db(b"heads", txn=txn)
                    run: dict[bytes, tuple[PutBlock, memoryview]] = {}  # block writes not put yet, by key
                    for i, op in enumerate(ops):
                        if isinstance(op, PutBlock):
                            if full or short:
                                results[i] = FilesystemFull(short) if short else DiskFull(
                                    f"the disk tier's LMDB map is at its cap ({self.map_cap} bytes)")
                                continue
                            try:
                                payload = payload_view(op.header, tensor_bytes(op.tensor.wait()))
                            except BaseException as exc:  # noqa: BLE001 - reported through this op's job
                                if raised_by_signal_handler(exc):
                                    raise  # a main thread's apply: its caller's timeout, not the block's
                                results[i] = exc
                                continue
                            if op.header.key in run:
                                # Its put frees the pages of the earlier one's, which a put after
                                # it may take before the earlier one is written there.
                                self._put_records(txn, run.values(), batch)
                                run = {}
                            run[op.header.key] = (op, payload)
                            continue
                        if isinstance(op, (DeleteBlocks, PutHeads)):
                            # A delete or a head after a block write must find it written. The
                            # other ops touch no record or head: the run, and its one sync of
                            # the lock file, go on past them.
                            self._put_records(txn, run.values(), batch)
                            run = {}
                        if isinstance(op, PutHeads):
                            if not (full or short):
                                self._put_heads(txn, op, batch)
                        else:
                            self._apply_one(txn, op, batch)
                    self._put_records(txn, run.values(), batch)
                    unzeroed = self._pending + batch.deferred
                    if unzeroed:
                        txn.put(_UNZEROED_KEY, msgpack.packb({"txn": txn.id(), "ranges": unzeroed}), db=self._meta)
                    elif self._ledger_written:
                        txn.delete(_UNZEROED_KEY, db=self._meta)
            except BaseException as exc:
                if txn_id is not None and self._committed(txn_id):
                    # Raised as the transaction's exit returned, committed (a signal handler's
                    # exception, in a main thread's apply): its records are live, not an aborted
                    # attempt's to zero. Its bookkeeping is done below, then it is raised.
                    cut = exc
                else:
                    if created:
                        self._heads = None
                    # With writemap the records and heads an aborted transaction wrote are in the
                    # file, in pages no committed snapshot references: no later delete of the
                    # store's finds them, so their KV and token ids stayed in free pages.
                    self._zero_written(batch)
                    if isinstance(exc, (lmdb.BadTxnError, lmdb.CorruptedError, lmdb.PageNotFoundError)) and \
                            not isinstance(exc, DamagedTables):
                        # The first error of a fresh transaction (each attempt is one): its pages, not
                        # the disk. Taken for an I/O error, it blamed the disk and said to retry.
                        raise DamagedTables(self.path, exc) from exc
                    if not isinstance(exc, lmdb.MapFullError):
                        raise
                    results = [None] * len(ops)
                    # Block writes stop short of the cap: deletes and references, which must not be
                    # lost (a lost delete brings forgotten KV back), keep the top of the map.
                    if self._grow(self.map_cap - _DELETE_ROOM if not full else self.map_cap):
                        continue
                    no_room = self._no_room
                    # The filesystem had no room to grow the map: block writes stay in memory, and
                    # nothing leaves the disk for them (``FilesystemFull``).
                    short = short or no_room
                    if not full:
                        full = True
                        continue
                    if no_room is None:
                        # Even the room kept for them is used up: the cap gives way once more rather
                        # than lose a delete (or treat a full disk as a failed one).
                        self.map_cap += _DELETE_ROOM
                        if self._grow(self.map_cap):
                            continue
                        if self._no_room is None:
                            raise
                        no_room = self._no_room
                        self.map_cap -= _DELETE_ROOM
                    # Not even the pages the deletes and references need: an error the store counts,
                    # keeping those owed and retrying them, where a write into a hole was a SIGBUS.
                    raise OSError(errno.ENOSPC, no_room) from exc
            # Committed: what raises from here (a signal handler's exception, in a main thread's
            # apply: the CLI's, a close's) leaves the transaction's records alone. Inside the
            # ``try`` above, its ``except`` zeroed them as an aborted attempt's: blocks committed
            # and then read as damaged, or their heads as a delete's to finish.
            # LMDB reuses the pages a transaction freed from the second transaction after it
            # on (the one after may still need them, should its meta page not land). So the
            # records the previous one deleted are zeroed now, and those of this one after
            # the next commit: zeros that the blocks written in between do not overwrite
            # reach the disk with that next commit. Never later: the list is swapped at
            # once, and a record not zeroed now is dropped from it (the next transaction may
            # reuse its pages), whatever raises below.
            previous, self._pending = self._pending, batch.deferred
            try:
                self._ledger_written = bool(unzeroed)
                if batch.intended or self._intent_zeroed:
                    if not batch.intended:
                        # A transaction that changed nothing commits without a sync: the zeros
                        # the note's drop vouches for must reach the disk first all the same.
                        self.env.sync(True)
                    self._intent_done()
                    self._intent_zeroed = False
                for key, where in batch.moves.items():
                    if where is None:
                        self._where.pop(key, None)
                    else:
                        self._where[key] = where[0] << _LENGTH_BITS | where[1]
                if full:
                    # Back below the room (LMDB keeps the map at least as large as the pages
                    # in use), so that the next batch's block writes cannot take it.
                    self._set_map(self.map_cap - _DELETE_ROOM)
            finally:
                self._zero(previous)
            if cut is not None:
                raise cut
            return results

    def _committed(self, txn_id: int) -> bool:
        """Whether the write transaction ``txn_id`` committed (LMDB's last one is it, or later)."""
        try:
            return self.env.info()["last_txnid"] >= txn_id
        except lmdb.Error:
            return False

    def _put_records(self, txn: lmdb.Transaction, run: Collection[tuple[PutBlock, memoryview]], batch: _Batch
                     ) -> None:
        """Put block records (``payload``s encoded) and their heads, each first as zeros of its
        length. With writemap LMDB copies a value into its final pages, free ones, inside ``put``,
        and only then tells where they are: a kill during or just after the copy of the record
        itself left its KV there, named nowhere. So the places are learnt from zeros, named in the
        lock file (``_intend``, synced), and only then written: the record encoded straight into
        the map (where the scratch buffer's copy went before: no more bytes move), its head copied.

        At least half a page (``min_record_bytes``): a small record inside a B-tree leaf was copied
        with every change to the leaf, and a delete zeroed only the leaf's last copy, so a
        forgotten block's KV stayed on the free list."""
        if not run:
            return
        fills: list[tuple[PutBlock, memoryview, int, int, bytes, int]] = []
        for op, payload in run:
            key = op.header.key
            if txn.cursor(db=self._blocks).set_key(key):
                # Written again (after a delete that failed, say): LMDB would leave the old record's
                # pages on the free list as they are.
                self._scrub(txn, key, batch)
            size = record_size(op.header, self.min_record_bytes)
            offset = self._put_zeros(txn, key, size, self._blocks, batch)
            if offset == OFFSET_UNKNOWN:  # not in the map (never with writemap): put as it is
                value = encode_array(op.header, payload, self._scratch, self.min_record_bytes)
                if value.base is not self._scratch and value is not self._scratch:
                    self._scratch = value
                txn.put(key, value, db=self._blocks)
            batch.moves[key] = (offset, size) if offset != OFFSET_UNKNOWN else None
            head = index_entry.encode(record_head(op.header, self.min_record_bytes), offset, self.page_size)
            at = self._put_zeros(txn, key, len(head), self._heads, batch)
            if at == OFFSET_UNKNOWN:
                txn.put(key, head, db=self._heads)
            fills.append((op, payload, offset, size, head, at))
        self._intend(txn, batch)
        for op, payload, offset, size, head, at in fills:
            if offset != OFFSET_UNKNOWN:
                address = self._map_start + offset  # type: ignore[operator]
                place = np.frombuffer((ctypes.c_char * size).from_address(address), dtype=np.uint8)
                record = encode_array(op.header, payload, place, self.min_record_bytes)
                if record.ctypes.data != place.ctypes.data or record.nbytes != size:
                    raise RuntimeError(f"tierkv: a record encoded to {record.nbytes} bytes, not the {size} put for it")
            if at != OFFSET_UNKNOWN:
                ctypes.memmove(self._map_start + at, head, len(head))  # type: ignore[operator]

    def _put_zeros(self, txn: lmdb.Transaction, key: bytes, size: int, db: Any, batch: _Batch) -> int:
        """Put ``size`` zeros under ``key`` in ``db``; where they lie in the file (noted in
        ``batch.written``), or ``OFFSET_UNKNOWN``."""
        if self._zeros is None or self._zeros.nbytes < size:
            # Never written: every page of it is the kernel's one zero page, read from the cache.
            self._zeros = np.zeros(size, dtype=np.uint8)
        txn.put(key, self._zeros[:size], db=db)
        value = txn.get(key, db=db)
        offset = self._offset(value) if value is not None and len(value) == size else OFFSET_UNKNOWN
        if offset != OFFSET_UNKNOWN:
            batch.written.append((offset, size))
        return offset

    def _intend(self, txn: lmdb.Transaction, batch: _Batch) -> None:
        """Name in the lock file where this attempt's new records and heads lie, for ``scan`` to
        zero after a kill before the commit, and sync it: before their bytes are written there
        (``_put_records``), so that neither a kill nor a power loss (after the OS wrote some of
        those pages back) can leave a record's bytes in the file with its place named nowhere."""
        if self._lock_fd is None or batch.intended == len(batch.written):
            return
        try:
            if batch.intended == 0:
                header = _PAIR.pack(self._data_ino, txn.id())
                if os.fstat(self._lock_fd).st_size > _INTENT_AT and \
                        os.pread(self._lock_fd, _PAIR.size, _INTENT_AT) != header:
                    # Another file's note (one a rebuild replaced) or a committed transaction's:
                    # the places it names past this note's may be in use now, and a kill before
                    # this commit had the next open zero them. (Only a note of this very
                    # transaction, a killed one's, names pages free before it: kept.)
                    os.ftruncate(self._lock_fd, _INTENT_AT)
                os.pwrite(self._lock_fd, header, _INTENT_AT)
            new = batch.written[batch.intended:]
            os.pwrite(self._lock_fd, b"".join(_PAIR.pack(*where) for where in new),
                      _INTENT_AT + _PAIR.size * (1 + batch.intended))
            os.fdatasync(self._lock_fd)
            batch.intended = len(batch.written)
        except OSError as exc:  # only the crash case's zeroing is lost; the write goes on
            if raised_by_signal_handler(exc):
                raise  # a main thread's apply (the CLI's): its caller's timeout, not the lock file's
            logger.debug("tierkv: could not note a write in %s's lock file (%s)", self.path, exc)

    def _intent_done(self) -> None:
        """Drop the lock file's intent: its transaction committed, or its records are zeroed."""
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, len(str(self._pid)))
            except OSError as exc:
                if raised_by_signal_handler(exc):
                    raise  # a main thread's apply: dropped by the next commit instead
                # A committed transaction's intent is ignored (its id is not ahead of LMDB's).

    def _zero_written(self, batch: _Batch) -> None:
        """Zero what an attempt that did not commit wrote (``_Batch.written``)."""
        written, batch.written = batch.written, []
        if batch.intended:
            # Its note goes with the next commit, which syncs these zeros: kept past it (a commit
            # without block writes writes no note of its own), the next note, written over it,
            # named the pages that commit took too, and a kill before that one's commit had the
            # next open zero them (the store damaged).
            self._intent_zeroed = True
        batch.intended = 0  # a retry writes its own intent over this one's
        if self._map_start is None:
            return
        # A signal handler's exception (a main thread's apply: the CLI's, a close's) is raised once
        # every place is zeroed: taken for a failed zeroing and logged, it was lost, the attempt
        # retried after a MapFullError as if never cut, and the places after it kept their KV.
        cut: BaseException | None = None
        for offset, length in written:
            try:
                ctypes.memset(self._map_start + offset, 0, length)
            except Exception as exc:  # noqa: BLE001 - the batch's own error is the one to raise
                if not raised_by_signal_handler(exc):
                    logger.warning("tierkv: could not zero the records of a write that failed in %s (%s)",
                                   self.path, exc)
                    continue
                cut = cut or exc
                try:  # the handler may have run before memset did: zeroing twice is harmless
                    ctypes.memset(self._map_start + offset, 0, length)
                except Exception as again:  # noqa: BLE001
                    if not raised_by_signal_handler(again):
                        logger.warning("tierkv: could not zero the records of a write that failed in %s (%s)",
                                       self.path, again)
        if cut is not None:
            raise cut

    def _apply_one(self, txn: lmdb.Transaction, op: DiskOp, batch: _Batch) -> None:
        if isinstance(op, DeleteBlocks):
            for key in op.keys:
                if not (op.evicted and batch.defer and self._defer_scrub(txn, key, batch)):
                    self._scrub(txn, key, batch)
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._heads)
                txn.delete(key, db=self._atime)
                batch.moves[key] = None
            for ref in op.refs:
                txn.delete(ref, db=self._refs)
        elif isinstance(op, PutRefs):
            txn.put(op.sid, msgpack.packb([op.tenant]), db=self._sessions)
            for key in op.keys:
                txn.put(op.sid + key, b"", db=self._refs)
        elif isinstance(op, DropRefs):
            for holder, tenant, key in op.holders:
                txn.put(holder, msgpack.packb([tenant]), db=self._sessions)
                txn.put(holder + key, b"", db=self._refs)
            for key in op.keys:
                txn.delete(op.sid + key, db=self._refs)
            if op.drop_session:
                txn.delete(op.sid, db=self._sessions)
                # Every reference of the session goes with its row, also those to blocks the store
                # no longer lists for it (a write that failed, a commit's references written ahead
                # of blocks never written): a reference without its row reads as damage at reopen.
                refs = txn.cursor(db=self._refs)
                if refs.set_range(op.sid):
                    while bytes(refs.key()[:KEY_BYTES]) == op.sid and refs.delete():
                        pass
        elif isinstance(op, DropSessions):
            for drop in op.drops:
                self._apply_one(txn, drop, batch)
        elif isinstance(op, Touch):
            for key, stamp in op.stamps.items():
                txn.put(key, _U64.pack(stamp), db=self._atime)
        else:
            raise TypeError(f"unknown disk operation {op!r}")

    def _put_heads(self, txn: lmdb.Transaction, op: PutHeads, batch: _Batch) -> None:
        """Heads for blocks on disk, put as records are (``_put_records``): they hold the blocks'
        token ids, and a kill before the commit left them in free pages, where the block's
        forget later did not reach them."""
        records = txn.cursor(db=self._blocks)  # set_key, unlike get, does not read the record
        fills: list[tuple[int, bytes]] = []
        for key, (head, offset) in op.heads.items():
            if records.set_key(key):
                value = index_entry.encode(head, offset, self.page_size)
                at = self._put_zeros(txn, key, len(value), self._heads, batch)
                if at == OFFSET_UNKNOWN:
                    txn.put(key, value, db=self._heads)
                else:
                    fills.append((at, value))
                size = index_entry.decode(value)[1]
                batch.moves[key] = (offset, size) if offset != OFFSET_UNKNOWN else None
        self._intend(txn, batch)
        for at, value in fills:
            ctypes.memmove(self._map_start + at, value, len(value))  # type: ignore[operator]

    def _scrub(self, txn: lmdb.Transaction, key: bytes, batch: _Batch) -> None:
        """Zero a block's head, then its record, where they lie before deleting them. LMDB is
        copy-on-write: a delete only moves the pages to the free list, and the KV (and the token
        ids in the head) would stay in the file until the pages are reused. With ``writemap`` the
        map is the file, writable, so the bytes are overwritten in place. A reader still holding
        the old snapshot then fails its checksum: a miss. The zeroing reaches the file even if the
        transaction never commits (the process dies in it): ``scan`` then finds the head zeroed
        from its start (it goes first) and finishes the delete.

        A record whose place is known is not read to be zeroed. Its whole pages that the page
        cache holds are zeroed in place, and stay cached for the writes that reuse them; the
        others are zeroed in the file (``vm.zero_range``: no data written, blocks kept allocated
        so that reusing them cannot fail for want of space); the ends of its first and last page
        in place. Zeroing a cold record through the map read it page by page first: evictions at
        the disk budget, whose victims are the coldest blocks, ran 10x slower. Zeroing cached
        pages in the file dropped them from the cache instead, and each write that reused one
        faulted it in again: a spill at the disk budget ran at 0.28-0.37 of a raw write, 0.46-0.69
        with them zeroed in place (``benchmarks.micro``)."""
        head = txn.get(key, db=self._heads) if self._heads is not None else None
        expected = None
        if head is not None and len(head):
            try:
                expected = index_entry.head_of(head)
            except CorruptRecord:
                pass
            ctypes.memset(vm.address(head), 0, len(head))
        if key in batch.zeroed and key not in batch.moves:
            return  # zeroed by an attempt that did not commit; still this committed record
        where = batch.moves[key] if key in batch.moves else self._place(key)
        if expected is None or where is None or not self._zero_in_file(where, expected):
            value = txn.get(key, db=self._blocks)
            if value is not None and len(value):
                ctypes.memset(vm.address(value), 0, len(value))
        batch.zeroed.add(key)

    def _defer_scrub(self, txn: lmdb.Transaction, key: bytes, batch: _Batch) -> bool:
        """For an evicted block: zero its head now, and leave its record to be zeroed once the
        next transaction commits (``batch.deferred``; ``_apply`` keeps a ledger row of them in
        ``meta``, which ``scan`` reads after a crash). False, touching nothing, where ``_scrub``
        must zero it in this transaction: a record written in this one (LMDB may reuse its pages
        before the commit), or one whose place is not known for certain.

        Why: zeroed in the deleting transaction, the records' pages reached the disk twice, as
        zeros with its commit and as the data of the blocks that reuse them two commits later: a
        spill at the disk budget ran at 0.4-0.56 of a raw write + fsync, the deletes' commit as
        long as the write. Zeroed just before the first transaction that may reuse them, the
        zeros are still in the page cache when the blocks it writes overwrite them, and only the
        pages no block took are written as zeros. Until then a record's KV stays in the file's
        free pages, where no read of the store finds it. A transaction without block writes, or
        with a forget's deletes (``batch.defer`` false), zeroes its own evicted records and every
        pending one before it commits, so the store's ``flush()``, which ends with one such, finds
        every delete before it zeroed on disk."""
        if key in batch.moves:
            return False
        head = txn.get(key, db=self._heads) if self._heads is not None else None
        where = batch.places.get(key)
        if where is None:
            where = self._place(key)
            try:
                expected = index_entry.head_of(head) if head is not None and len(head) else None
            except CorruptRecord:
                expected = None
            if expected is None or where is None or not self._record_pages(where, expected):
                return False
            batch.places[key] = where
        if head is not None and len(head):
            ctypes.memset(vm.address(head), 0, len(head))
        batch.deferred.append(where)
        return True

    def _zero(self, records: list[tuple[int, int]]) -> None:
        """Zero evicted records (offset, length) whose pages no transaction can have reused yet."""
        # A signal handler's exception (a main thread's apply: the CLI's, a close's) is raised
        # once every record is zeroed: taken for a failed zeroing, the caller's timeout was lost.
        cut: BaseException | None = None
        for offset, length in records:
            try:
                self._zero_pages(offset, length)
            except Exception as exc:  # noqa: BLE001 - the batch committed: zeroed in place, or logged
                if cut is None and raised_by_signal_handler(exc):
                    cut = exc
                # Each record on its own, through the map at worst: one that failed dropped every
                # record after it, whose KV stayed in free pages where no later forget reached it.
                try:
                    ctypes.memset(self._map_start + offset, 0, length)  # type: ignore[operator]
                except Exception as again:  # noqa: BLE001
                    if raised_by_signal_handler(again):
                        cut = cut or again  # as memset returned: zeroed
                    else:
                        logger.warning("tierkv: could not zero an evicted record in %s (%s); its KV stays in "
                                       "free pages until LMDB reuses them", self.path, exc)
        if cut is not None:
            raise cut

    def _read_intent(self, committed: int) -> list[tuple[int, int]]:
        """The places the lock file's intent names, where its transaction never committed: one
        past ``committed`` (the last that did), in this very file (a rebuild replaced it)."""
        size = os.fstat(self._lock_fd).st_size if self._lock_fd is not None else 0
        if size <= _INTENT_AT:
            return []
        raw = os.pread(self._lock_fd, size - _INTENT_AT, _INTENT_AT)  # type: ignore[arg-type]
        pairs = [_PAIR.unpack_from(raw, i) for i in range(0, len(raw) - _PAIR.size + 1, _PAIR.size)]
        if not pairs or pairs[0] != (self._data_ino, committed + 1):
            return []
        # The open cuts the file back to the pages in use and some headroom (``_allocate_map``): a
        # place across that end lost its tail, not its head, which a place dropped whole kept.
        end = min(os.fstat(self._data_fd).st_size, self.env.info()["map_size"])  # type: ignore[arg-type]
        return [(offset, min(length, end - offset)) for offset, length in pairs[1:] if length and offset < end]

    def _zero_owed(self) -> None:
        """Zero the evicted records the ledger row of the last committed transaction names (a
        crash came before they were): where they still are, and overlap no block stored since.
        And what a write that a kill cut short had written: pages no snapshot holds."""
        if self._uncommitted:
            uncommitted, self._uncommitted = self._uncommitted, []
            if self.env.info()["last_txnid"] == self._uncommitted_txn:  # else those pages may be reused
                self._zero(uncommitted)
            # Dropped once the zeros are on disk, with the next commit's sync: dropped now, a power
            # loss could keep the drop and lose the zeros. (Until then this transaction, of the same
            # id, writes its own intent over it: either names only pages free before it.)
            self._intent_zeroed = True
        if not self._unzeroed:
            return
        if self.env.info()["last_txnid"] != self._unzeroed_txn:
            self._unzeroed = []  # a transaction committed since the scan read the row: it may reuse them
            return
        # Records do not overlap: their ends are sorted too.
        live = [_unpack_place(place) for place in sorted(self._where.values())]
        starts = [offset for offset, _ in live]
        for offset, length in self._unzeroed:
            i = bisect.bisect_left(starts, offset + length)  # the records that start before its end
            clash = i > 0 and sum(live[i - 1]) > offset
            if not clash and self._record_pages((offset, length)):
                self._zero_pages(offset, length)
        self._unzeroed = []

    def _record_pages(self, where: tuple[int, int], expected: bytes | None = None) -> bool:
        """Whether LMDB's header of the overflow pages just before ``where`` (offset, length)
        names exactly those pages and, given ``expected`` (its head, its key among the bytes), the
        record there begins with it."""
        offset, length = where
        page = self.page_size
        first_page = offset - _PAGE_HEADER
        if self._map_start is None or self._data_fd is None or (expected is not None and len(expected) > length) or \
                first_page % page or first_page < 0 or offset + length > (self.env.info()["last_pgno"] + 1) * page:
            return False
        start = self._map_start + offset
        pgno, _pad, flags, pages = _OVERFLOW_HEADER.unpack(ctypes.string_at(start - _PAGE_HEADER, _PAGE_HEADER))
        if pgno != first_page // page or not flags & _P_OVERFLOW or pages != -(-(length + _PAGE_HEADER) // page):
            return False
        return expected is None or ctypes.string_at(start, len(expected)) == expected

    def _zero_in_file(self, where: tuple[int, int], expected: bytes) -> bool:
        """Zero the record at ``where`` (offset, length); False, touching nothing, unless it is
        the record ``_record_pages`` expects there."""
        if not self._record_pages(where, expected):
            return False
        self._zero_pages(*where)
        return True

    def _zero_pages(self, offset: int, length: int) -> None:
        """Zero a record's bytes, without reading them: its whole pages in place where the page
        cache holds them, in the file elsewhere; the ends of its first and last page in place."""
        page = self.page_size
        assert self._map_start is not None
        start = self._map_start + offset
        first, last = -(-offset // page) * page, (offset + length) // page * page
        if last <= first:
            ctypes.memset(start, 0, length)
            return
        # The first page begins with LMDB's own page header, which the delete still reads.
        ctypes.memset(start, 0, first - offset)
        ctypes.memset(self._map_start + last, 0, offset + length - last)
        cached = vm.resident(self._map_start + first, last - first)
        if cached is None:
            cached = np.zeros(-(-(last - first) // vm.PAGE), dtype=bool)
        for begin, end, in_cache in _runs(cached):
            begin, end = first + begin * vm.PAGE, min(first + end * vm.PAGE, last)
            if in_cache or not vm.zero_range(self._data_fd, begin, end - begin):
                ctypes.memset(self._map_start + begin, 0, end - begin)

    def _grow(self, limit: int, at_least: int = 0) -> bool:
        """Grow the map (by ``_headroom``, up to ``limit``), its new pages allocated first
        (``_allocate``: as far as the filesystem has room); False when it did not grow: at
        ``limit``, or no room (``_no_room`` then says why)."""
        self._no_room = None
        current = self.env.info()["map_size"]
        if min(max(current + _headroom(current), at_least), limit) <= current:
            # At the cap: every batch asks (``_reserve``, a MapFullError), and the exclusive side
            # waits for every read in progress and holds back new ones. Only this thread sets
            # the map's size, so the answer holds without the lock.
            return False
        with self._resize_lock:
            current = self.env.info()["map_size"]
            size = min(max(current + _headroom(current), at_least), limit)
            if size <= current:
                return False
            size = self._allocate(current, size, current + self.page_size)
            self._map_to(size)
            return size > current

    def _set_map(self, size: int) -> None:
        """Shrink the map to ``size``, or as near as the pages in use let LMDB (it never maps
        fewer). The readers' lock only where the map really changes: asked after every batch at a
        full map, it waited for every read in progress and held back new ones to remap the map
        at the size it had (only this thread sets it, so the check holds without the lock)."""
        info = self.env.info()
        if max(size, (info["last_pgno"] + 1) * self.page_size) >= info["map_size"]:
            return
        with self._resize_lock:
            if size < self.env.info()["map_size"]:
                self.env.set_mapsize(size)
                self._map_start = self._find_map()

    def _advise_for_writes(self) -> None:
        """Readahead over the map's never-written end, none over the rest (writer thread). Pages
        faulted in without readahead come one at a time; with it, in large folios: into a fresh
        store, puts ran 1.7x faster (0.25 s against 0.41 s for 256 MiB). The written part stays
        MADV_RANDOM, so that a B-tree page or a head read from disk is that page alone."""
        if self._map_start is None:
            return
        length = self.env.info()["map_size"]
        # In the OS's pages, which madvise's start must fall on: LMDB's are smaller on a kernel of
        # 64 KiB pages (at most 32 KiB), and there the advice was refused for good.
        used = min(-(-self.file_bytes() // vm.PAGE) * vm.PAGE, length)
        vm.madvise(self._map_start, used, vm.MADV_RANDOM)
        vm.madvise(self._map_start + used, length - used, vm.MADV_NORMAL)

    def filesystem_short(self, nbytes: int) -> str | None:
        """Why a batch of ``nbytes`` of records must not be written, or None: it would take the
        file past its allocated blocks by more than the filesystem has free. Refused up front (its
        blocks stay in memory, as at the map's cap), and the store evicts nothing for it. Where
        the map is allocated (``_allocate``) this is a forecast, and the allocation that grows the
        map is what keeps a write through the map from a SIGBUS; elsewhere (no fallocate) it is
        the only guard, and covers neither the B-tree's pages nor another process filling the
        disk between this check and the write.

        For threads other than the writer's (a commit's forecast): ``env.info()`` reads the meta
        page inside the map, which the writer's remaps unmap (LMDB then answered EINVAL, and
        could fault), so this holds the lock's shared side as a read does."""
        with self._resize_lock.shared():
            return self._filesystem_short(nbytes)

    def _filesystem_short(self, nbytes: int) -> str | None:
        """``filesystem_short`` in the writer thread, the only one that remaps: no lock."""
        if self._data_fd is None:
            return None
        try:
            fs, st = os.fstatvfs(self._data_fd), os.fstat(self._data_fd)
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise  # a commit's forecast in the main thread: the program's SIGALRM timeout
            return None
        info = self.env.info()
        # Pessimistic: as if every page went past the last one in use (LMDB reuses freed pages
        # first), plus room for the B-tree's own pages.
        end = (info["last_pgno"] + 1) * self.page_size + nbytes * 11 // 10 + 64 * self.page_size
        missing = end - st.st_blocks * 512
        free = fs.f_bavail * fs.f_frsize
        if missing <= free:
            return None
        return (f"the filesystem under {self.path} has {free} bytes free, fewer than the {missing} these block "
                "writes may need; they stay in memory. Free disk space, or lower disk_budget to what the "
                "filesystem holds")

    def _reserve(self, nbytes: int) -> None:
        """Grow the map before a batch that would not fit, rather than fail and redo it
        (MapFullError remains the fallback: free pages and overheads are estimates)."""
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.page_size
        if used + nbytes * 1.1 > info["map_size"]:
            self._grow(self.map_cap - _DELETE_ROOM, used + 2 * nbytes)

    def sync(self) -> None:
        # The caller's thread (a flush), not the writer's: LMDB syncs the map, which a remap of
        # the writer's unmaps (EINVAL, and the store took its disk for failed).
        with self._resize_lock.shared():
            self.env.sync(True)

    def close(self, timeout: float | None = None) -> bool:
        """Wait for a read in progress (up to ``timeout`` seconds), then close; False when the read
        did not end: the map is then left open (to the process's exit) and later reads fail."""
        if os.getpid() != self._pid:
            # A forked child: the environment is the parent's (LMDB must not be used across a fork,
            # and a lock another thread held at the fork is never released here).
            self._closed = True
            return True
        if not self._resize_lock.acquire(timeout=-1 if timeout is None else timeout):
            self._closed = True
            return False
        try:
            self._closed = True
            self.env.close()
            self._scratch = None  # the largest record encoded (KV and token ids), kept for reuse
        finally:
            self._resize_lock.release()
        # Taken first: a close cut short as ``os.close`` returned, then done again, closed the
        # number twice (another file's, once the process reuses it).
        fd, self._data_fd = self._data_fd, None
        if fd is not None:
            os.close(fd)
        self._unlock()
        # Now, not by the set's callback as the tier is freed: an exception a signal handler
        # raises there is lost ("Exception ignored in ... _remove").
        _open_tiers.discard(self)
        return True
