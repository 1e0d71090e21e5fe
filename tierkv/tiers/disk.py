"""The cold tier: one LMDB environment on disk.

Sub-databases:
    blocks    key(16) -> codec record (header + raw KV bytes + checksum)
    sessions  sid(16) -> msgpack [tenant, session name]
    refs      sid(16) + key(16) -> b""          (which blocks a session references)
    atime     key(16) -> u64 little-endian      (last use, to rebuild LRU order on reopen)
    meta      b"tierkv" -> msgpack {format, hash, block_size}

Protocol: reads (``load``, ``scan``, ``verify``) run in the caller's thread in short read transactions;
every write goes through ``apply(ops)``, called by the store's single writer thread, which runs
one write transaction per batch. A block is visible to readers only once that transaction has
committed. ``MapFullError`` aborts the transaction, grows the map outside any transaction
(readers are held off by a lock while it does), and retries.

Space: the map never grows past ``map_cap`` = budget + ``slack(budget)``, so the file on disk
stays within that whatever LMDB's free list does (freed pages are reused only some transactions
later, and a multi-page value needs a contiguous run of them). The store counts each block at its
``footprint`` (the record rounded up to whole pages). A batch that still does not fit at the cap
is applied without its block writes, which fail with ``DiskFull``: the store keeps those blocks in
memory and evicts more from disk; deletes and references in the batch still apply.

Opened with ``writemap=True``: values of 1-4 MiB then write at raw-disk speed on this kind of
machine, while ``writemap=False`` ran 2-5x slower (DESIGN.md).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import lmdb
import msgpack
import numpy as np
import torch

from ..codec import FORMAT_VERSION, MAGIC, CorruptRecord, RecordHeader, decode, decode_header, decode_into, encode_array
from ..hashing import HASH_VERSION, KEY_BYTES
from ..transfer import Job

_META_KEY = b"tierkv"
_LOCK_FILE = "tierkv.lock"
_U64 = struct.Struct("<Q")
_INITIAL_MAP = 64 << 20
_PAGE_HEADER = 16  # LMDB's header on the first page of a multi-page (overflow) value
_ROW_OVERHEAD = 128  # the block's B-tree node, atime row and a session ref, on average
_DELETE_ROOM = 1 << 20  # the top of the map that only deletes and references may use


class DiskFull(RuntimeError):
    """A block write that did not fit in the LMDB map at its cap; the block stays in memory."""


class StoreInUse(ValueError):
    """The store directory is locked by another process (or another open ``DiskTier``)."""


def footprint(record_bytes: int, page_size: int) -> int:
    """Bytes a record takes in the file: whole pages (LMDB stores a large value on pages of its
    own), plus its rows. What the disk budget counts."""
    pages = -(-(record_bytes + _PAGE_HEADER) // page_size)
    return pages * page_size + _ROW_OVERHEAD


def _under(key: bytes, header: RecordHeader) -> RecordHeader:
    """``header`` if its record is stored under its own key; a record moved under another key
    (a damaged B-tree, a bad copy) would restore another conversation's KV."""
    if header.key != key:
        raise CorruptRecord("record stored under another key")
    return header


def slack(budget: int) -> int:
    """Room above the budget for LMDB's free pages and B-tree: the file never exceeds budget + this."""
    return max(4 << 20, budget // 8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, row-major, without a copy when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


# -- write operations, applied in order by the writer thread ---------------------------------
@dataclass(slots=True)
class PutBlock:
    header: RecordHeader
    tensor: Job[torch.Tensor]  # resolves to a host tensor; waited on by the writer
    record_bytes: int


@dataclass(slots=True)
class DeleteBlocks:
    keys: list[bytes]
    refs: list[bytes] = field(default_factory=list)  # sid + key rows of the sessions that held them


@dataclass(slots=True)
class PutRefs:
    sid: bytes
    tenant: str | None
    name: str
    keys: list[bytes]


@dataclass(slots=True)
class DropRefs:
    sid: bytes
    keys: list[bytes]
    drop_session: bool = False


@dataclass(slots=True)
class Touch:
    stamps: dict[bytes, int]


DiskOp = PutBlock | DeleteBlocks | PutRefs | DropRefs | Touch


@dataclass(slots=True)
class ScanResult:
    headers: list[tuple[RecordHeader, int]] = field(default_factory=list)  # (header, record bytes)
    corrupt: list[bytes] = field(default_factory=list)
    # Records zeroed by a delete whose transaction never committed (the process died in it):
    # what the delete wanted, so they are finished off, not counted as damage.
    scrubbed: list[bytes] = field(default_factory=list)
    sessions: dict[bytes, tuple[str | None, str, list[bytes]]] = field(default_factory=dict)
    atime: dict[bytes, int] = field(default_factory=dict)


def op_size(op: DiskOp) -> int:
    return op.record_bytes if isinstance(op, PutBlock) else 0


class DiskTier:
    name = "disk"

    def __init__(self, path: str | os.PathLike[str], budget: int, block_size: int) -> None:
        self.path = os.fspath(path)
        self.budget = budget
        self._check_path(self.path)
        fresh = not os.path.exists(os.path.join(self.path, "data.mdb"))
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = self._lock_directory(self.path)
        self._resize_lock = threading.Lock()
        self._scratch: np.ndarray | None = None  # the writer thread's encoding buffer
        self.map_cap = budget + slack(budget)
        self.env = lmdb.open(self.path, map_size=min(_INITIAL_MAP, self.map_cap - _DELETE_ROOM), max_dbs=8,
                             writemap=True, subdir=True, readahead=False)
        self.page_size = self.env.stat()["psize"]
        # A store reopened with a smaller budget keeps its file (LMDB never shrinks one); the
        # store evicts down to the budget and the freed pages are reused.
        # Only deletes may grow it further: block writes go to free pages (else every reopen of a
        # file above its budget would raise the cap by as much).
        self.map_cap = max(self.map_cap, self.file_bytes() + _DELETE_ROOM)
        try:
            # Another program's LMDB environment is refused before anything is written to it.
            try:
                self._meta = self.env.open_db(b"meta", create=fresh)
            except (lmdb.NotFoundError, lmdb.IncompatibleError):
                raise ValueError(f"{self.path!r} holds an LMDB environment that is not a tierkv store; "
                                 "pass a new or empty directory") from None
            self._check_meta(fresh, block_size)
            self._blocks = self.env.open_db(b"blocks")
            self._sessions = self.env.open_db(b"sessions")
            self._refs = self.env.open_db(b"refs")
            self._atime = self.env.open_db(b"atime")
        except BaseException:
            self.env.close()
            self._unlock()
            raise

    @staticmethod
    def _lock_directory(path: str) -> int | None:
        """One process at a time per store: the index lives in the process, so a second writer would
        evict and forget behind the first one's back. Refused at open, with the holder's pid."""
        if fcntl is None:  # not POSIX: no advisory locks to take
            return None
        fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreInUse(f"{path!r} is in use by another TieredStore (pid {holder}); a store directory "
                             "serves one process at a time: close the other store first, or give each "
                             "process its own directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    @staticmethod
    def _check_path(path: str) -> None:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"disk tier path {path!r} is a file; pass a directory (it is created if missing)")
        entries = set(os.listdir(path)) - {_LOCK_FILE} if os.path.isdir(path) else set()
        if entries and "data.mdb" not in entries:
            raise ValueError(f"{path!r} is not empty and is not a tierkv store; pass a new or empty directory, "
                             "or an existing tierkv store")

    def _check_meta(self, fresh: bool, block_size: int) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(_META_KEY, db=self._meta)
            if raw is None:
                if not fresh:
                    raise ValueError(f"{self.path!r} holds an LMDB environment that is not a tierkv store; "
                                     "pass a new or empty directory")
                txn.put(_META_KEY, msgpack.packb({"format": FORMAT_VERSION, "hash": HASH_VERSION,
                                                  "block_size": block_size}), db=self._meta)
                return
        meta = msgpack.unpackb(raw)
        if meta.get("format") != FORMAT_VERSION or meta.get("hash") != HASH_VERSION:
            raise ValueError(
                f"{self.path!r} was written in tierkv format {meta.get('format')} (hash {meta.get('hash')}); this "
                f"version reads format {FORMAT_VERSION} (hash {HASH_VERSION}). Use a new directory, or delete this "
                "one (its blocks are only a cache and will be recomputed)")
        if meta.get("block_size") != block_size:
            raise ValueError(f"{self.path!r} was created with block_size={meta.get('block_size')}; pass "
                             f"block_size={meta.get('block_size')} or use a new directory")

    @staticmethod
    def stored_meta(path: str | os.PathLike[str]) -> dict[str, int]:
        """``{"format", "hash", "block_size"}`` of the existing store at ``path``, for tools that open
        a store without knowing its block size. Raises ``ValueError`` if ``path`` holds no tierkv
        store. Reads in a read-only environment and takes no lock (the holder may be writing):
        call it before opening a ``DiskTier`` on ``path``, never while one is open in this process,
        as LMDB must not have one environment open twice in a process."""
        path = os.fspath(path)
        not_a_store = f"{path!r} is not a tierkv store"
        if not os.path.isfile(os.path.join(path, "data.mdb")):
            raise ValueError(f"{not_a_store} (no data.mdb)")
        try:
            env = lmdb.open(path, readonly=True, max_dbs=8, subdir=True, readahead=False)
        except lmdb.Error as exc:
            raise ValueError(f"{not_a_store} ({exc})") from None
        try:
            with env.begin() as txn:
                raw = txn.get(_META_KEY, db=env.open_db(b"meta", txn=txn, create=False))
        except lmdb.Error:
            raw = None
        finally:
            env.close()
        try:
            meta = msgpack.unpackb(raw) if raw is not None else None
        except Exception:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
            meta = None
        fields = ("format", "hash", "block_size")
        if not isinstance(meta, dict) or not all(type(meta.get(f)) is int for f in fields):
            raise ValueError(f"{not_a_store} (no tierkv meta record)")
        return {f: meta[f] for f in fields}

    def footprint(self, record_bytes: int) -> int:
        """Bytes a record of ``record_bytes`` takes in this environment's file."""
        return footprint(record_bytes, self.page_size)

    def file_bytes(self) -> int:
        """Bytes of the file in use: the high-water mark of LMDB's pages (free ones included)."""
        return (self.env.info()["last_pgno"] + 1) * self.page_size

    # -- reads ----------------------------------------------------------------------------------
    def scan(self) -> ScanResult:
        """Every block's header, session references and last-use stamps, for rebuilding an index."""
        result = ScanResult()
        with self._resize_lock, self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=self._blocks):
                key = bytes(key)
                try:
                    header = _under(key, decode_header(value))
                    result.headers.append((header, len(value)))
                except CorruptRecord:
                    if bytes(value[:len(MAGIC)]) == bytes(len(MAGIC)):  # zeroed from its start
                        result.scrubbed.append(key)
                    else:
                        result.corrupt.append(key)
            for sid, value in txn.cursor(db=self._sessions):
                tenant, name = msgpack.unpackb(bytes(value))
                result.sessions[bytes(sid)] = (tenant, name, [])
            for ref, _ in txn.cursor(db=self._refs):
                ref = bytes(ref)
                entry = result.sessions.get(ref[:KEY_BYTES])
                if entry is not None:
                    entry[2].append(ref[KEY_BYTES:])
            for key, value in txn.cursor(db=self._atime):
                result.atime[bytes(key)] = _U64.unpack(value)[0]
        return result

    def verify(self, on_record: Callable[[int], None] | None = None) -> list[tuple[bytes, str]]:
        """Every record checked in full (header, length, checksum, key), unlike ``scan``, which
        reads headers only; returns ``(key, reason)`` of the bad ones. ``on_record(record bytes)``
        is called after each record, for a progress bar. One read transaction: a consistent view."""
        bad: list[tuple[bytes, str]] = []
        with self._resize_lock, self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=self._blocks):
                key = bytes(key)
                try:
                    _under(key, decode(value)[0])
                except CorruptRecord as exc:
                    bad.append((key, str(exc)))
                if on_record is not None:
                    on_record(len(value))
        return bad

    def load(self, key: bytes, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
             ) -> tuple[RecordHeader, torch.Tensor]:
        """Read and verify one block into a tensor made by ``empty``. Raises ``KeyError`` if it is
        absent and ``CorruptRecord`` if it fails any check."""
        with self._resize_lock, self.env.begin(buffers=True) as txn:
            buf = txn.get(key, db=self._blocks)
            if buf is None:
                raise KeyError(key)
            made: list[torch.Tensor] = []

            def destination(header: RecordHeader) -> memoryview:
                made.append(empty(header.shape, getattr(torch, header.dtype)))
                return memoryview(made[0].view(torch.uint8).numpy().reshape(-1))

            # The only copy: from the memory map into the destination, inside the transaction
            # that keeps the map's pages valid, checksummed on the way.
            header = _under(key, decode_into(buf, destination))
        return header, made[0]

    # -- writes (writer thread only) ------------------------------------------------------------
    def apply(self, ops: Sequence[DiskOp]) -> list[BaseException | None]:
        """One write transaction for ``ops``; one entry per op: None, or the error it failed with."""
        return self._apply(ops)

    def _apply(self, ops: Sequence[DiskOp]) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(ops)
        self._reserve(sum(op.record_bytes for op in ops if isinstance(op, PutBlock)))
        full = False
        while True:
            try:
                with self.env.begin(write=True, buffers=True) as txn:
                    for i, op in enumerate(ops):
                        if isinstance(op, PutBlock):
                            if full:
                                results[i] = DiskFull("the disk tier's LMDB map is at its cap "
                                                      f"({self.map_cap} bytes)")
                                continue
                            # Encoded inside the transaction into one reused buffer: put() copies it
                            # into the map at once, and fresh multi-MiB buffers would cost page faults.
                            try:
                                value = encode_array(op.header, tensor_bytes(op.tensor.wait()), self._scratch)
                            except BaseException as exc:  # noqa: BLE001 - reported through this op's job
                                results[i] = exc
                                continue
                            if value.base is not self._scratch and value is not self._scratch:
                                self._scratch = value
                            txn.put(op.header.key, value, db=self._blocks)
                        else:
                            self._apply_one(txn, op)
                if full:
                    # Back below the room (LMDB keeps the map at least as large as the pages in
                    # use), so that the next batch's block writes cannot take it.
                    self._set_map(self.map_cap - _DELETE_ROOM)
                return results
            except lmdb.MapFullError:
                results = [None] * len(ops)
                # Block writes stop short of the cap: deletes and references, which must not be
                # lost (a lost delete brings forgotten KV back), keep the top of the map.
                if self._grow(self.map_cap - _DELETE_ROOM if not full else self.map_cap):
                    continue
                if not full:
                    full = True
                    continue
                # Even the room kept for them is used up: the cap gives way once more rather than
                # lose a delete (or treat a full disk as a failed one).
                self.map_cap += _DELETE_ROOM
                if not self._grow(self.map_cap):
                    raise

    def _apply_one(self, txn: lmdb.Transaction, op: DiskOp) -> None:
        if isinstance(op, DeleteBlocks):
            for key in op.keys:
                self._scrub(txn, key)
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._atime)
            for ref in op.refs:
                txn.delete(ref, db=self._refs)
        elif isinstance(op, PutRefs):
            txn.put(op.sid, msgpack.packb([op.tenant, op.name]), db=self._sessions)
            for key in op.keys:
                txn.put(op.sid + key, b"", db=self._refs)
        elif isinstance(op, DropRefs):
            for key in op.keys:
                txn.delete(op.sid + key, db=self._refs)
            if op.drop_session:
                txn.delete(op.sid, db=self._sessions)
        elif isinstance(op, Touch):
            for key, stamp in op.stamps.items():
                txn.put(key, _U64.pack(stamp), db=self._atime)
        else:
            raise TypeError(f"unknown disk operation {op!r}")

    def _scrub(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Zero a record's bytes where they lie before deleting it. LMDB is copy-on-write: a delete
        only moves the pages to the free list, and the KV would stay in the file until the pages
        are reused. With ``writemap`` the map is the file, writable, so the bytes are overwritten
        in place. A reader still holding the old snapshot then fails its checksum: a miss. The
        zeroing reaches the file even if the transaction never commits (the process dies in it):
        ``scan`` then finds a record zeroed from its start and finishes the delete."""
        value = txn.get(key, db=self._blocks)
        if value is not None and len(value):
            address = np.frombuffer(value, dtype=np.uint8).__array_interface__["data"][0]
            ctypes.memset(address, 0, len(value))

    def _grow(self, limit: int, at_least: int = 0) -> bool:
        """Grow the map (doubling, up to ``limit``); False when it is already there."""
        with self._resize_lock:
            current = self.env.info()["map_size"]
            size = min(max(current * 2, at_least), limit)
            if size <= current:
                return False
            self.env.set_mapsize(size)
            return True

    def _set_map(self, size: int) -> None:
        with self._resize_lock:
            if size < self.env.info()["map_size"]:
                self.env.set_mapsize(size)

    def _reserve(self, nbytes: int) -> None:
        """Grow the map before a batch that would not fit, rather than fail and redo it
        (MapFullError remains the fallback: free pages and overheads are estimates)."""
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.page_size
        if used + nbytes * 1.1 > info["map_size"]:
            self._grow(self.map_cap - _DELETE_ROOM, used + 2 * nbytes)

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()
        self._unlock()
