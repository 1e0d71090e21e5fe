"""``TieredStore``: the block index, the LRU policy, and every move between tiers.

Protocol of one conversation turn::

    cache = store.open(model, input_ids, session=..., tenant=...)   # restore the longest prefix
    out = model.generate(input_ids, past_key_values=cache, ...)
    cache.commit(out)                                                # hand new blocks over

* ``open`` walks the chain of block keys of ``input_ids``: whole blocks while their keys hit and
  their stored token ids agree, then the stored continuation (a partial tail, or a block that
  diverges later) that shares the most leading tokens, capped at ``L - 1`` tokens. Disk blocks
  are read and verified before ``open`` returns (a bad record must shorten the restore, not
  corrupt it), outside the store lock, with the planned blocks pinned; the copies to the device
  start at once, layer-major, and ``open`` returns without waiting for them. Hit blocks are
  promoted to the device tier. On a CPU device tier, a disk block neither memory tier can take
  is read straight into the cache's own buffer (``_in_place``), not into a block tensor.
* ``commit`` stores the blocks the store lacks: into the device tier (demoting the least recently
  used blocks device -> host -> dropped), and, with a disk tier, through to disk by the
  background writer. Blocks are immutable, so each is written once and leaving a memory tier
  never costs a write.
* Memory tiers are exclusive (a block rests on the device or in the host tier); the disk tier
  is inclusive. A block rests in some tier or is not in the index at all.
* Tiers hold copy jobs, not finished tensors: a block being moved is already accounted for in
  its new tier, and its readers wait on (or, on CUDA, order their stream after) the copy.
  Nothing on the generation path waits for a move to finish.
* A block is visible on disk only after its write transaction committed; until then it is
  served from the write's own host buffer (``_inflight``), so leaving a memory tier never waits
  for the disk.
* A turn pins the blocks it restores or commits: its own placements never evict them, and it
  touches them tail first, so eviction takes a conversation's tail before the prefix it needs.
  A call's pins, and an open's holds on pool buffers, are handed over (``_orphaned_pins``,
  ``_held_leases``: one C call) before any point of its cleanup where a signal's handler runs,
  and let go from there, so that a cleanup cut short leaves them to the next call's ``_reap``,
  never pinned or held for good.
* Sessions reference blocks; ``forget`` drops references and deletes blocks no live session
  still references, from every tier.
* Ctrl-C in the main thread is held off inside ``open``, a commit, ``forget``, ``flush`` and
  ``stats`` (``interrupts.py``) and raised as the call ends, with tiers, index and pins
  consistent; it is not held off while a call waits for the lock to start, it stops an open's
  disk reads at the next block, and an open that then finds the lock taken raises at once,
  leaving its pins to the next call that takes the lock.
* Another signal's handler (a ``SIGALRM`` timeout) is not held off. Bookkeeping it cuts short
  is noted before it begins and finished by the next call's ``_reap`` (``close`` runs one before
  its writer drains): a block's entry following its tiers (``_unsettled``), a delete on disk
  queued again (``_deleting``), a session left with no block of its own untracked (``_hollow``),
  the room a refused write asked for (``_disk_goal``), a write whose queueing was cut short
  failed as not queued, the outcome of a write let go of by a delete or queued again over it
  counted (``_let_go_writes``), a commit's cleanup (its chain touched and referenced: ``_ending``), a
  forget's session dropped (``_forgetting``, with the blocks it dropped, whose continuations no
  session references go too; the session leaves the index last), then the forget itself done
  again whole (``_forgets_owed``: the sessions it had not reached, and a tenant's blocks of no
  session; let go last), a gathering of deletes whose exit was cut short
  ended and what it gathered queued (each taken out of ``_gathered`` only once queued).
* A store with a disk tier that is still open when the interpreter exits is closed then (its
  queued writes drained, for up to ``EXIT_CLOSE_TIMEOUT_S``): the writer is a daemon thread, and
  the writes it still held were lost at every exit without ``close()``.
* A store dropped without ``close()`` (nothing refers to it any more) is closed when it is
  collected, on a thread of its own: its queued writes land and its directory is let go. Its
  writer thread reaches it through a weak reference (``_WriterLink``), or the thread would keep it
  alive, its directory locked, until the process exits. A new store on a directory that a store
  of this process still locks collects garbage and waits for those closes once before giving up.

Policy works on keys and sizes; tensors pass through opaquely between tiers and the copy engine.
"""

from __future__ import annotations

import _thread
import atexit
import dataclasses
import functools
import gc
import itertools
import logging
import os
import sys
import struct
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import lmdb
import msgpack
import numpy as np
import xxhash

from .cache import IN_PLACE, UNREAD, TieredCache, describe_model, layer_skips, restore_slots, sequence_ids_of, \
    token_ids_of, unread_blocks
from .codec import CorruptRecord, RecordHeader, record_size
from .events import CommitEvent, EventLog, MoveEvent, OpenEvent, Subscription
from .hashing import KEY_BYTES, block_key, chain_keys, check_name, key_of_bytes, root_key, token_bytes
from .index import BlockMeta, DiskState, Index, Tier, narrow_ids
from .index import common_prefix as _common_prefix
from .interrupts import defer_interrupts, pending_check, raise_pending, raised_by_signal_handler
from .owed import OwedOps
from .readers import Latch, ReadPool, helper_threads
from .tiers import DeviceTier, DiskTier, HostTier
from .tiers.disk import (UNREADABLE, DamagedTables, DeleteBlocks, DiskFull, DiskOp, DiskSyncFailed, DropRefs,
                         DropSessions, FilesystemFull, PutBlock, PutHeads, PutRefs, StoreInUse,
                         Scrubbed, Touch, block_bytes, dtype_name, op_count, op_size, slack, torch_dtype,
                         weak_members)
from .pool import HostPool
from .transfer import (BackgroundWriter, CopyEngine, Job, WriteAbandoned, WriteNotQueued, copy_timer, cpu_wait_seconds,
                       resolve_device, thread_binding)
from .units import format_bytes, parse_bytes, seconds_or_none, shell_path, whole_number

logger = logging.getLogger("tierkv")
#: Tokens per block at most: a block is the unit of every move, and one of a million tokens is
#: already gigabytes of KV for a large model (a huge one also overflowed the store's meta record).
MAX_BLOCK_SIZE = 1 << 20
POOL_IN_FLIGHT = 128 << 20  # host pool room beyond the host budget: blocks being written or restored
_UNSET: Any = object()


def _session_id(tenant: str | None, session: str) -> bytes:
    # Names are data: msgpack keeps ("a\0b", "c") and ("a", "b\0c") apart.
    return xxhash.xxh3_128_digest(msgpack.packb(["session", tenant, session], use_bin_type=True))



# Every open of a model and tenant has the same root: computed once (msgpack and a hash, cold
# in an open right after a forward: 20 us).
_root_key = functools.lru_cache(maxsize=1024)(root_key)
#: Restored tokens per tier, none yet.
_NO_TOKENS = {t.value: 0 for t in Tier}


def _first_item(data: bytes, item: int) -> int | None:
    """Index of the first int64 ``item`` in ``token_bytes`` ``data``, or None (a bytes search,
    not numpy's comparison: cold after a forward, that cost 60-75 us)."""
    if not -(1 << 63) <= item < 1 << 63:
        return None  # no int64 id equals it
    needle = struct.pack("<q", item)
    at = data.find(needle)
    while at >= 0 and at % 8:
        at = data.find(needle, at + 1)
    return at // 8 if at >= 0 else None


def _same_ids(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two 1-d arrays of ids are equal. Not ``np.array_equal``, which answers False for
    any exception inside it (``except Exception``), a signal handler's (a ``SIGALRM`` timeout)
    included: the timeout vanished, and a commit raised that its ids were not the conversation's."""
    return a.shape[0] == b.shape[0] and bool((a == b).all())


#: How long the disk writer gathers writes before a transaction. Each transaction ends in a sync
#: (a whole-map msync and a meta-page msync: ~12 ms on the machine of benchmarks/RESULTS.md), and
#: at a light load every turn's few blocks went in their own one: the writer was never idle, and
#: its syncs slowed the turns. A flush, a forget, a close, a full batch (``write_batch_bytes``) or
#: ``LINGER_BYTES`` of queued writes (whose buffers stay held meanwhile) cut it short.
#: Until their transaction commits, blocks are served from memory, so nothing waits for it either.
WRITE_LINGER_S = 0.1
LINGER_BYTES = 16 << 20
#: Bytes of block writes queued for the disk tier past which a commit waits (after its own work,
#: off the lock) until the writer is back under it. The queued blocks' host copies stay held until
#: their transaction commits, outside every budget: commits that outpace the disk grew that queue,
#: and on CUDA the pinned buffers past the pool, without bound. Waiting keeps write-through's
#: promise (every committed block reaches the disk); the disk's pace is then the commits' pace.
WRITE_BACKLOG_BYTES = 1 << 30
#: Queued disk writes of any kind (blocks, references, deletes, stamps) past which a commit waits
#: as it does past WRITE_BACKLOG_BYTES. References, deletes and stamps weigh no bytes: turns that
#: wrote no block (a shared prompt, a returning session) queued a PutRefs, DropRefs and Touch each,
#: none of them counted, and about 950 piled up behind a writer starved of CPU. 16 of the writer's
#: 64-item transactions: a disk keeping up drains them in a fraction of a second. Counted as the
#: writer counts a transaction's items (``op_count``: a ``DeleteBlocks`` a block each, each
#: block's record zeroed in the file): counted an op each, 1024 of a forget's 64-block deletes
#: were about 65k block deletes, 1024 transactions. A forget of more blocks than this makes the
#: next commit wait for the writer to come back within it.
WRITE_BACKLOG_OPS = 1024
#: How long a commit waits for a writer that settles nothing before it stops waiting.
WRITE_STALL_S = 10.0
#: Owed deletes (and references) a flush queues again while the disk has failed: one of the
#: writer's transactions' worth, counted as the writer counts them (``op_count``: a forget's
#: ``DeleteBlocks`` a block each; 64 of those ops were 64 transactions, and were the probe until
#: it counted blocks). Queued whole at every flush, a long list cost a failed transaction per 64
#: of them (50,000 owed: 782 transactions, 2.5 to 3.9 s a flush on a disk that fails at
#: once; a disk slow to fail takes its I/O timeout for each), and commits then waited behind them
#: (WRITE_BACKLOG_OPS). When one of them lands the rest go in the same flush, so a flush after the
#: disk came back still lands everything owed; those that fail again go to the back of the list.
OWED_RETRY_PROBE = 64
#: Bytes of records one open reads from disk from which they are read side by side, in helper
#: threads as well as the calling one (``readers.ReadPool``). A read is a copy and a checksum, and
#: two of them at once share the memory bus: on the 2-core VM of benchmarks/RESULTS.md an open of
#: 64 MiB took 0.58-0.73 of its one-thread time, of 32 MiB 0.87-0.90, of 4 and 16 MiB 1.03-1.07.
PARALLEL_READ_BYTES = 32 << 20
#: Bytes of records one thread reads in one read transaction (``DiskTier.reading``) before it
#: begins another: a remap and a close wait for the transaction, and reads of any size take this
#: path where their destinations are mixed (a CPU store whose host tier takes only the tail).
READ_TXN_BYTES = 32 << 20
#: Blocks a forget, or the evictions that make room on disk, delete per queued ``DeleteBlocks``.
#: One op a block, forgetting a long session (thousands of blocks), or reopening under a smaller
#: disk budget, queued that many ops, each a job to reap and, on a failed disk, an owed entry of
#: its own. The writer still puts no more than a transaction's 64 items' worth of blocks
#: in one transaction, and the backlog counts them a block each (``op_count``, WRITE_BACKLOG_OPS).
FORGET_DELETE_KEYS = 64


#: A commit finds the partial tails its chain supersedes among the session's blocks while the
#: session holds at most this many per block of the chain (and the root), else by looking up the
#: continuations of the chain's blocks, which costs more a block but not more a session's block.
SCAN_SESSION_KEYS = 4
#: Forgets remembered for the turns in flight (``TieredStore._forgotten_since``).
_FORGETS_KEPT = 4096
#: Blocks dropped by session forgets, remembered for the turns in flight (``_first_forgotten``).
_FORGOTTEN_BLOCKS_KEPT = 1 << 16


def _abandonable(op: DiskOp) -> bool:
    """What a close with a timeout may give up (``BackgroundWriter``'s ``abandonable``)."""
    return isinstance(op, PutBlock) or (isinstance(op, (DeleteBlocks, DropRefs)) and op.superseded
                                        and not op.forgotten)


def _narrowed(op: DeleteBlocks, keys: list[bytes], refs: list[bytes]) -> DeleteBlocks:
    """``op`` for ``keys`` of its blocks only (an owed delete retried), of the same nature: an
    eviction's zeroing still deferred, a superseded tail's delete still a close's to give up
    (rebuilt without, a retried one was deleted at a close(timeout) that gave up the write of
    the tail replacing it, and the flushed tail was lost)."""
    return dataclasses.replace(op, keys=keys, refs=refs, footprint=op.footprint * len(keys) // len(op.keys))


def _remember(entries: dict[Any, int], keys: Iterable[Any], clock: int, kept: int, floor: int) -> int:
    """Note ``keys`` at ``clock`` in ``entries`` (kept in clock order); past ``kept`` entries the
    older half goes. Returns the floor: turns opened before it cannot tell what went since."""
    for key in keys:
        entries.pop(key, None)  # re-inserted last
        entries[key] = clock
    if len(entries) > kept:
        old = list(entries.items())[:len(entries) // 2]
        for key, _ in old:
            del entries[key]
        floor = old[-1][1]
    return floor


def write_batch_bytes(disk_budget: int) -> int:
    """The most block bytes one write transaction takes: 64 MiB, less under a disk budget below
    4 GiB. A transaction's puts need free pages besides those its own evictions free (LMDB reuses
    a page only some transactions after it was freed), and the room above the budget is
    ``slack``. A store of 16 MiB at its budget, its turns' writes gathered up to 16 MiB at a time,
    had 313 of 1650 writes fail with DiskFull, each taking as much again off the disk, which ended
    a quarter full; with batches of an eighth of the slack, none failed."""
    return min(64 << 20, slack(disk_budget) // 8)


#: How long closing the still-open stores at interpreter exit may drain their disk writes; what is
#: still queued then is dropped (and logged), and a transaction in flight is waited for as long
#: again, so that a stuck disk cannot hang the exit.
EXIT_CLOSE_TIMEOUT_S = 60.0
_open_stores: "weakref.WeakSet[TieredStore]" = weakref.WeakSet()


def _stores_open() -> list[TieredStore]:
    """The stores in ``_open_stores`` (``weak_members``: a close in another thread takes its store
    out, ``_release``, as the close of a dropped store does while the next store on its directory
    looks for its writer)."""
    return weak_members(_open_stores)


#: Closes of stores dropped without ``close()`` that are still running (``TieredStore.__del__``).
_dropped: dict[threading.Thread, str | None] = {}  # each close's thread, and its store's directory
#: How long a new store waits for the batch in flight of another store of this process on its
#: directory (one that may be held by nothing but that batch) before it is refused as in use.
BUSY_WRITER_WAIT_S = 5.0


def _close_dropped(store: "TieredStore", own_thread: bool = True) -> None:
    path = store._disk.path if store._disk is not None else None
    logger.warning("tierkv: a TieredStore at %s was dropped without close(); closing it now (its queued writes "
                   "land first). Close stores, or open them with `with TieredStore(...) as store:`", path)
    # Not on the thread that dropped the store (no thread to be had): the program's own, whose
    # current device (where its device="cuda" tensors go) must stay its own, as close() there.
    bind = thread_binding(store.device) if own_thread else None
    if bind is not None:
        # Its flush waits for the memory tiers' CUDA copies, on this new thread: on GPU 0,
        # whose context the wait made in a process whose store is on another GPU.
        try:
            bind()
        except Exception:  # noqa: BLE001 - the close needs none of it, and goes on
            pass
    try:
        store._close(None)
    except Exception:  # noqa: BLE001 - nobody is left to raise it to
        logger.exception("tierkv: closing a dropped store at %s failed; its queued writes may be lost", path)
    finally:
        # Else store -> _link -> held -> store is a cycle that keeps the closed store (its index,
        # _inflight buffers, the disk tier's scratch, on CUDA its pinned pool arenas) until a full
        # garbage collection, which a long-running process may not run for hours.
        if store._released and store._link is not None:
            store._link.held = None
        _dropped.pop(threading.current_thread(), None)


def _wait_for_dropped(timeout: float, path: str | None = None) -> None:
    """Join the closes of dropped stores (on the directory ``path``, or all)."""
    for thread, where in list(_dropped.items()):
        if path is None or where == path:
            thread.join(timeout)


class _WriterLink:
    """The disk writer's way to its store: a weak reference, so that a store nobody holds is
    collected (and closed) rather than kept alive by its own writer thread. ``TieredStore.__del__``
    sets ``held`` for the close: a store collected with the garbage of a reference cycle has its
    weak references cleared before its finaliser runs."""

    __slots__ = ("_ref", "held", "_disk")

    def __init__(self, store: "TieredStore") -> None:
        self._ref = weakref.ref(store)
        self.held: TieredStore | None = None
        self._disk = store._disk

    def __call__(self, ops: list[DiskOp]) -> list[BaseException | None]:
        store = self.held if self.held is not None else self._ref()
        if store is None:
            # A store in collected garbage: gc cleared its weak references (and ran their callbacks,
            # and other finalisers, any of which may let this thread run) before its __del__ sets
            # ``held``. Its writes still land; only its counters miss them, and it is being closed.
            assert self._disk is not None
            return self._disk.apply(ops)
        return store._apply_writes(ops)


def _landed(job: Job[None]) -> bool:
    """The job is done, without an error (``Job.error``: an ``except`` around ``wait`` swallowed
    a signal handler's exception there as the job's)."""
    return job.done() and job.error() is None


def _open_disk_tier(path: str | os.PathLike[str], budget: int, block_size: int) -> DiskTier:
    """``DiskTier(...)``; where a store of this process still locks the directory, garbage is
    collected, a busy writer of a store there gets ``BUSY_WRITER_WAIT_S`` to end its batch, and the
    closes of dropped stores on that directory are waited for (``EXIT_CLOSE_TIMEOUT_S`` each),
    then the lock is tried once more: a store dropped a moment ago, held only by a reference
    cycle, or by its writer thread for the rest of a batch, must not refuse the next one."""
    try:
        return DiskTier(path, budget, block_size)
    except StoreInUse as exc:
        if not exc.this_process:
            raise
    where = DiskTier._resolve_path(path)
    writers = [store._writer for store in _stores_open()
               if store._disk is not None and store._disk.path == where and store._writer is not None]
    for writer in writers:
        try:
            writer.flush(BUSY_WRITER_WAIT_S)  # past its batch in flight, the writer holds no store
        except TimeoutError as exc:
            if raised_by_signal_handler(exc):
                raise  # the program's SIGALRM timeout, not the flush's: it was lost, and the open waited on
            # A store still in use whose disk is slow: refused below, as it is in use.
    gc.collect()
    _wait_for_dropped(EXIT_CLOSE_TIMEOUT_S, where)
    return DiskTier(path, budget, block_size)


@atexit.register
def _close_at_exit() -> None:
    _wait_for_dropped(EXIT_CLOSE_TIMEOUT_S)
    for store in _stores_open():
        if not store._released:  # a forked child's copies close nothing (``_close``)
            try:
                store._close(EXIT_CLOSE_TIMEOUT_S, grace=EXIT_CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - one store's failure must not keep the others open
                # A signal handler's exception (a SIGALRM timeout the program set for work that has
                # ended) too: logged, not raised. No caller is left to take it: CPython prints an
                # atexit callback's exception and exits as it would have (exit status unchanged), so
                # raising it would only leave the stores after this one unclosed, their queued writes
                # lost. Ctrl-C's KeyboardInterrupt, which a person sends to stop the exit, is not
                # caught here.
                logger.exception("tierkv: closing a store at exit failed; its queued writes are lost")


class _StoreLock(_thread.RLock):
    """The store's lock: re-entrant; ``with`` waits for it polling for a Ctrl-C held off by a
    section already open (``raise_pending``), and lets go of it in C. A context manager of its
    own around the lock had its release in a Python ``__exit__``: another signal's handler
    raising as that began (CPython runs one at a Python function's start) left the lock held by
    the main thread for good, and a close or a turn from any other thread waited forever (found
    by cutting ``open`` at every point). ``__enter__`` is Python, and an acquire cut short as it
    returned is undone there; ``__exit__`` is the C one, where no handler runs."""

    __slots__ = ()

    def __enter__(self) -> bool:
        held = self._recursion_count()  # this thread may hold it already
        try:
            while not self.acquire(timeout=0.05):
                raise_pending()
        except BaseException:
            if self._recursion_count() > held:
                self.release()
            raise
        return True


@dataclasses.dataclass(slots=True, eq=False)
class _CommitEnd:
    """A commit's cleanup (``TieredStore._end_commit``), noted in ``_ending`` before the commit
    changes anything and taken out last: a cleanup that another signal's handler cut short (as
    it started, even) is finished by the next call's ``_reap``. ``spans`` (start, end, key): the
    blocks the commit covers, its chain those of them in the index, from the first on; not a
    list of the blocks it placed, which a handler raising as a placement's last call returned
    left without the block (stored, but not the session's). ``referenced``: the commit's own,
    filled as it places blocks; ``new``: the blocks whose references the disk still needs, fixed
    by the cleanup's first run (a run again finds the index references made)."""

    sid: bytes | None
    tenant: str | None
    session: str | None
    root: bytes
    ids: np.ndarray
    spans: list[tuple[int, int, bytes]]
    referenced: set[bytes] = dataclasses.field(default_factory=set)
    new: list[bytes] | None = None


class _GatheringDeletes:
    """``TieredStore._gathering_deletes``: a class, not a generator's context manager, whose
    ``__enter__`` returns from ``next()`` (a C call, where CPython runs a pending signal's
    handler): one raising there left the store gathering, for as long as its exception lived,
    with the deletes it gathered queued by no one until another write came."""

    __slots__ = ("_store", "_outer")

    def __init__(self, store: "TieredStore") -> None:
        self._store = store
        self._outer = False

    def __enter__(self) -> None:
        store = self._store
        self._outer = not store._gathering
        store._gathering = True

    def __exit__(self, *exc: object) -> None:
        if self._outer:
            store = self._store
            store._gathering = False
            store._submit_gathered()


def _reaches_further(windows: tuple[int | None, ...], sizes: list[int], miss: int, unread: int, buffer: Any) -> bool:
    """Whether a restore cut short before block ``miss`` needs tokens the reads of the whole one
    left out: blocks no window reached (``unread``), or a layer's part of the buffer (``buffer``,
    laid out from the whole restore's ``layer_skips``)."""
    if unread_blocks(windows, sizes[:miss]) < unread:
        return True
    return buffer is not None and (layer_skips(windows, sizes[:miss]) or [0] * len(buffer.skips)) != buffer.skips


def _first_miss(found: list[Any], reads: dict[int, Any]) -> int | None:
    """The first planned block that was to be read from disk and was not (``_read_disk_blocks``),
    or None."""
    for i, where in enumerate(found):
        if where is None and not isinstance(reads.get(i), Job):
            return i
    return None


class TieredStore:
    """A hierarchical KV-cache store: device, host and (optionally) LMDB disk tiers.

    ``TieredStore(path="kvstore/", device=None, device_budget="2GiB", host_budget="16GiB",
    disk_budget="256GiB", block_size=256)``:

    * ``path``: the disk tier's directory (``~`` expanded; created if missing), or None for no disk
      tier. A directory serves one process at a time: another process's store there is refused
      (``ValueError`` naming its pid), as are another program's LMDB directory and a store made
      with another ``block_size``. Reopening a store rebuilds its index from the disk.
    * ``device``: the hot tier's device, where the model must be; None is CUDA when available,
      else the CPU.
    * ``device_budget``, ``host_budget``, ``disk_budget``: hard caps on bytes at rest in each
      tier, an int or a string such as ``"512MiB"`` or ``"1.5GB"`` (KiB/MiB/GiB/TiB are powers of
      1024, KB/MB/GB/TB of 1000); 0 keeps nothing at rest there. With a disk tier every committed
      block is also written through to disk in the background.
    * ``block_size``: tokens per block, the unit of prefix hashing and of moves.

    Bad arguments raise ``TypeError``/``ValueError`` saying what to pass instead. Use it as a
    context manager, or call ``close()``: a store left open is closed at interpreter exit.
    """

    def __init__(self, path: str | os.PathLike[str] | None = "kvstore/", device: object = None,
                 device_budget: int | str = "2GiB", host_budget: int | str = "16GiB",
                 disk_budget: int | str = "256GiB", block_size: int = 256) -> None:
        block_size = whole_number(block_size, "block_size (tokens per block)", 1, "; 256 is a good default",
                                  maximum=MAX_BLOCK_SIZE)
        self.block_size = block_size
        self.device = resolve_device(device)
        budgets = {name: parse_bytes(value, name) for name, value in
                   (("device_budget", device_budget), ("host_budget", host_budget), ("disk_budget", disk_budget))}
        cuda = self.device.type == "cuda"
        self._device = DeviceTier(budgets["device_budget"], self.device)
        # On CUDA host buffers come from a pool allocated once: the host tier's budget, plus room
        # for blocks on their way to disk or back. On CPU the tiers hand tensors over, no copies.
        pool = HostPool(budgets["host_budget"] + POOL_IN_FLIGHT, pinned=True) if cuda else None
        self._host = HostTier(budgets["host_budget"], pinned=cuda, pool=pool)
        self._engine = CopyEngine(self.device, host_alloc=self._host.alloc if cuda else None)
        self._disk: DiskTier | None = None
        self._writer: BackgroundWriter[DiskOp] | None = None
        self._readers = ReadPool(helper_threads(), thread_binding(self.device))
        self._index = Index()
        self._lock = _StoreLock()
        self._pending_writes: dict[bytes, tuple[Job[None], RecordHeader]] = {}
        # The writes of ``_pending_writes`` in the order they were queued, (key, job): the writer is
        # one FIFO thread, so a reap asks them in turn and stops at the first not done, its cost
        # the writes that landed since the last (it asked every queued write: 0.65 ms a reap, a
        # commit's, behind 1,000 of them). An entry whose key no longer tracks its job (let go of
        # by a delete, or queued again) is passed over as it comes to the front, its outcome
        # counted first if it was let go of (``_let_go_writes``).
        self._write_order: deque[tuple[bytes, Job[None]]] = deque()
        # Writes let go of while queued (a delete of their block: a forget, an eviction from disk,
        # a superseded tail), by job, with their header: their block's index entry is no longer
        # theirs, but a refusal or an I/O error of theirs is still the disk's, counted (and acted
        # on) as the walk of ``_write_order`` comes to them. Dropped untracked, such a failure went
        # uncounted, and an I/O error left the disk trusted.
        self._let_go_writes: dict[Job[None], RecordHeader] = {}
        # Tracked writes and deletes (their key; None: a delete) whose submit is under way or was
        # cut short: the only jobs that finish out of the queue's order (failed as not queued,
        # ``_done_or_not_queued``), reaped where they lie, not left behind a write not yet done.
        self._submitting: dict[Job[None], bytes | None] = {}
        # Blocks resting in memory only whose write found no room (the map at its cap, the
        # filesystem full, or only pinned blocks to evict): their headers, for the write that is
        # tried again when they leave memory and at every flush (``_write_again``).
        self._unwritten: dict[bytes, RecordHeader] = {}
        self._inflight: dict[bytes, Job[Any]] = {}  # host copies of blocks whose disk write is queued
        # The disk tier's bytes that reaps of writes refused at the map's cap evict down to
        # (``_free_disk``); None when none asks.
        self._disk_goal: int | None = None
        self._stamps: dict[bytes, int] = {}
        self._pinned: Counter[bytes] = Counter()  # blocks that opens or commits in progress must keep
        self._orphaned_pins: deque[bytes] = deque()  # pins whose call ended, to let go (_unpin_orphans)
        self._held_leases: list[dict[Any, Any]] = []  # pool holds of opens that ended (_let_go_leases)
        # Deletes and references whose batch is queued, and those whose batch failed: retried at
        # every flush and at close, since a lost delete would bring forgotten KV back after a
        # restart, and a lost reference would leave a session's blocks where its forget cannot
        # find them.
        # In the order queued: a reap asks them from the front (_reap_deletes); one cut short
        # unqueued (_submitting) leaves it from where it lies.
        self._deletes: deque[tuple[DeleteBlocks | DropRefs | DropSessions | PutRefs, Job[None]]] = deque()
        self._deletes_queued = 0  # deletes and references ever queued (flush: those its reap queued)
        self._left_on_disk = [0, 0]  # blocks, bytes: deletes a close(timeout) gave up (_stop_writer)
        self._committing: set[bytes] = set()  # the session of the commit running (_untrack_if_hollow)
        self._ending: list[_CommitEnd] = []  # commits whose cleanup is not done (_end_commit)
        # Sessions a block's removal may have left with no block of their own, until
        # _untrack_if_hollow has looked at them (_reap looks at those an exception left here).
        self._hollow: set[bytes] = set()
        # Blocks an eviction from disk or a drop is taking out, until their entry follows the
        # tiers (_settle): one another signal's handler cut short is settled by the next _reap.
        self._unsettled: set[bytes] = set()
        # Deletes on disk under way (``_delete_on_disk``), by id: one an exception cut short is
        # done again by the next _reap.
        self._deleting: dict[int, tuple[Any, ...]] = {}
        # Sessions a forget is dropping: their blocks' keys, the keys it dropped so far and the
        # partial tails among those (_forget_session).
        self._forgetting: dict[bytes, tuple[list[bytes], list[bytes], list[BlockMeta]]] = {}
        # Forgets under way, by their ``_note_forget`` key, noted before they drop anything and let
        # go last (``_forget``): one cut short is done again whole by the next _reap, the sessions
        # it had not reached and (a tenant's) the blocks no session references included.
        self._forgets_owed: dict[tuple[str, Any], None] = {}
        self._owed = OwedOps()
        # A forget's (or the evictions') block deletes, gathered into one op until it holds
        # FORGET_DELETE_KEYS blocks or another write is queued (_gathering_deletes), and the
        # forgotten sessions' (sid, keys), whose DropRefs go after them; None and empty outside.
        self._gathered: DeleteBlocks | None = None
        self._gathered_drops: list[tuple[bytes, list[bytes]]] = []
        self._gathering = False
        # Sessions whose row may be on disk (found there at open, or a PutRefs of theirs landed):
        # a failed DropRefs of any other has nothing on disk to delete (_reap_deletes).
        self._sessions_on_disk: set[bytes] = set()
        self._clock = 0
        # Forgets by the clock they ran at (key: ("session", name), ("sid", sid) or ("tenant",
        # tenant)): a turn opened before a forget of its session or tenant keeps nothing at its
        # commit, which would write the forgotten conversation back (_forgotten_since).
        self._forget_clock = 0
        self._forgotten: dict[tuple[str, Any], int] = {}
        self._forgotten_floor = 0  # older entries were let go: turns opened before it keep nothing
        # The blocks each session forget dropped, by the clock of that forget: a turn opened before
        # it (of any session, or none) that restored one keeps nothing from it on at its commit.
        self._forgotten_blocks: dict[bytes, int] = {}
        self._forgotten_blocks_floor = 0
        self._closed = False  # no new turns, flushes or forgets
        self._released = False  # the tiers are let go (the disk tier closed): close is done
        self._pid = os.getpid()
        self._hits = {t.value: 0 for t in Tier}
        self._misses = 0
        self._discarded = 0  # restored tokens that the cache threw away and recomputed
        # Turns whose ids differed from their session's last stored conversation, and the stored
        # tokens past the difference that they computed again (``_diverged``).
        self._diverged_turns = 0
        self._diverged_tokens = 0
        self._evictions = 0
        self._corrupt = 0
        self._disk_errors = 0
        self._disk_full = 0  # block writes that found no room under the LMDB map's cap
        self._warned_filesystem = False  # the warning that the filesystem had no room, given once
        self._disk_failed = False  # after an I/O error: no more writes through to disk
        self._disk_damaged = False  # that error was LMDB's damaged pages, not the disk
        # Bytes per direction, for benchmarks and metrics; the disk figures count what committed.
        self._moved = {"device_to_host": 0, "host_to_device": 0, "host_to_disk": 0, "disk_to_host": 0}
        self._read_seconds = 0.0
        self._write_seconds = 0.0  # the writer thread's time in transactions
        self._write_cpu_wait = 0.0  # the part of it the writer waited for a CPU (Linux)
        self._backlog_limit = WRITE_BACKLOG_BYTES
        self._backlog_ops = WRITE_BACKLOG_OPS
        self._commit_wait = 0.0  # seconds commits waited for the disk writer's backlog
        self._warned_backlog = False
        self._events = EventLog()
        # Last, with everything else in place: from the directory's lock on, a failure (or another
        # signal's handler raising, up to the constructor's last step) is undone by a close.
        try:
            if path is not None:
                self._disk = _open_disk_tier(path, budgets["disk_budget"], block_size)
                self._link = _WriterLink(self)
                # At a close with a timeout only block writes may be given up, and with them the
                # deletes of the partial tails they replace (or a flushed tail would be lost): other
                # deletes and session references are small, and dropping them would bring forgotten
                # data back.
                self._writer = BackgroundWriter(self._link, name="tierkv-disk-writer", size_of=op_size,
                                                count_of=op_count, abandonable=_abandonable, device=self.device,
                                                linger=WRITE_LINGER_S, linger_bytes=LINGER_BYTES,
                                                max_batch_bytes=write_batch_bytes(budgets["disk_budget"]))
                self._load_index()
                _open_stores.add(self)
            logger.info("tierkv store opened: path=%s tiers=%s budgets device=%s host=%s disk=%s, %d blocks found",
                        path, ",".join([f"device({self.device})", "host(pinned)" if self.device.type == "cuda"
                                        else "host", *(["disk"] if path is not None else [])]),
                        format_bytes(self._device.budget), format_bytes(self._host.budget),
                        format_bytes(budgets["disk_budget"]) if path is not None else "none", len(self._index.blocks))
        except BaseException:
            # Else the writer thread and the directory's lock outlive the failed constructor (held
            # by its exception's frames, as long as that is kept), and every retry in this process
            # finds the store in use.
            if self._disk is not None:
                try:
                    self._close(0)
                except Exception as exc:  # noqa: BLE001 - the first error is the one to report
                    if raised_by_signal_handler(exc):
                        # A SIGALRM timeout's, say, cutting the release short: the directory stayed
                        # locked (every retry in this process found the store in use), and the
                        # timeout was logged as a failed release. Finished, then raised.
                        try:
                            self._close(0)
                        except Exception:  # noqa: BLE001 - the handler's exception is the one to raise
                            logger.exception("tierkv: releasing a store that failed to open also failed")
                        raise
                    logger.exception("tierkv: releasing a store that failed to open also failed")
            raise

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "TieredStore":
        if self._closed:
            # As a closed file's: a `with` block of a closed store ran on to its first call.
            raise ValueError("this TieredStore is closed; create a new TieredStore(path, ...) to use it again")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A finaliser runs on whichever thread dropped the last reference (the disk writer's
        # among them, which a close joins) and at any point of its work: the close gets a thread
        # of its own, which holds the store until it is done.
        state = self.__dict__
        if state.get("_released", True) or state.get("_link") is None or state.get("_pid") != os.getpid():
            return
        if sys.is_finalizing():
            # Python 3.11 starts the thread but never runs it (Thread.start() then waits forever), and
            # a daemon writer no longer runs: the process exit releases the lock; LMDB is atomic.
            return
        self._link.held = self
        thread = threading.Thread(target=_close_dropped, args=(self,), name="tierkv-close-dropped", daemon=True)
        _dropped[thread] = self._disk.path if self._disk is not None else None
        try:
            thread.start()
        except RuntimeError:  # the interpreter is shutting down: no new threads
            _dropped.pop(thread, None)
            if self._writer is None or not self._writer.on_thread():
                _close_dropped(self, own_thread=False)

    def subscribe(self, maxlen: int = 100_000) -> Subscription:
        """Events of this store (opens, commits, moves) for an observer such as
        ``tierkv.metrics``; see ``tierkv.events``. The store only appends to the queue."""
        return self._events.subscribe(maxlen)

    def _check_open(self, committing: bool = False) -> None:
        if self._closed:
            if committing:
                # A new store cannot take this cache (it is its own store's): "create a new
                # TieredStore to use it again" sent the caller round to this same error.
                raise ValueError("this cache's TieredStore was closed before its commit, and a closed store keeps "
                                 "nothing: this turn's KV is lost (the next turn recomputes it). Commit each turn "
                                 "before store.close(); to go on, create a new TieredStore(path, ...) and open the "
                                 "next turn's cache with it: cache = store.open(model, input_ids)")
            raise ValueError("this TieredStore is closed; create a new TieredStore(path, ...) to use it again")
        self._check_owner()

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            # After a fork the child has no writer thread, shares the parent's LMDB handle and lock:
            # using them would hang or corrupt the store (py-lmdb: never use an environment across fork).
            raise ValueError("this TieredStore belongs to the process that created it (this one was forked "
                             "from it); create a TieredStore in this process, on its own directory")

    def flush(self) -> None:
        """Block until every move and disk write queued before this call is done and durable.

        A delete or session reference that a disk error fails does not raise: it stays owed
        (``stats()['owed_deletes']``), tried again at later flushes (while the disk has failed,
        ``OWED_RETRY_PROBE`` of them first, a forget's deletes counted a block each: one
        transaction; and the rest once one lands) and at ``close``.

        If the disk tier's final sync fails, raises ``DiskSyncFailed`` (an ``OSError``) after
        counting it in ``stats()['disk_errors']`` and marking the disk failed, as ``close`` does."""
        with self._lock, defer_interrupts():
            self._check_open()
            self._finish_deletes()  # before any write again: a noted delete lands ahead of it
            self._write_stamps()
            probing = self._disk_failed
            probes = self._retry_deletes(OWED_RETRY_PROBE if probing else None)
            self._retry_writes()
            writes = list(self._pending_writes)
            copies = [job for tier in (self._device, self._host) for job in tier.jobs()]
        self._drain_writer()
        for job in copies:
            job.wait()
        with self._lock, defer_interrupts():
            if self._closed:
                return  # closed meanwhile by another thread: close drained everything
            # Only this call's snapshot: its writes are applied now, so nothing here waits on
            # writes that other threads queued since.
            queued = self._deletes_queued
            self._reap(keys=writes)
            self._reap_deletes()
            if probing and self._owed and any([_landed(job) for job in probes]):
                self._retry_deletes()  # the disk takes writes again: the rest lands by this flush too
            again = self._deletes_queued != queued
        if again:
            # Writes of this call that found the map at its cap evicted blocks from disk for the
            # room the next ones need: those deletes land (and zero) before flush returns too.
            self._drain_writer()
        with self._lock, defer_interrupts():
            if self._closed:
                return
            if again:
                self._reap_deletes()
            if self._disk is not None:
                try:
                    self._disk.sync()
                except (lmdb.Error, OSError) as exc:
                    if raised_by_signal_handler(exc):
                        raise  # a SIGALRM timeout's TimeoutError: the disk did nothing wrong
                    # flush promises durability: the caller must learn it was not reached, and the
                    # store stops trusting the disk as close() does for the same failure.
                    self._disk_fault(exc)
                    raise DiskSyncFailed(f"tierkv: could not make the writes to {self._disk.path} durable "
                                         f"({exc}); check the disk, then close the store and reopen it") from exc

    def _drain_writer(self) -> None:
        """Wait (off the lock) for every disk write queued so far, deferred zeroing included."""
        if self._writer is not None:
            self._writer.flush()
            if self._disk is not None and self._disk.owes_zeros:
                # Evictions are zeroed a transaction after their delete (DiskTier._defer_scrub): a
                # transaction without block writes zeroes them before its commit.
                try:
                    self._writer.submit(Touch({}))
                except RuntimeError:
                    pass  # closed meanwhile by another thread, whose close zeroes them
                else:
                    self._writer.flush()

    def close(self, timeout: float | None = None) -> int:
        """Flush, then release every tier; returns how many queued block writes were dropped.

        Without a ``timeout`` every queued write is drained first (nothing is dropped). With one,
        writes still queued when it expires are dropped and logged: those blocks are simply not
        on disk after a restart and will be recomputed; deletes and session references are still
        applied, so nothing forgotten comes back. A write the disk refused or failed as close
        drained it is counted as any reap counts it (``disk_full``, ``disk_errors``), not as
        dropped. ``timeout`` is seconds >= 0 or None (``ValueError``
        for a negative one, which would drop every queued write at once). Closing twice is
        harmless, and a close cut short (an interrupt, a disk error) is finished by the next one.
        """
        return self._close(seconds_or_none(timeout, "close(timeout)"))

    def _close(self, timeout: float | None, grace: float | None = None) -> int:
        """``close``; ``grace``: how long to wait for a write transaction in flight once the
        timeout expired (None: until it ends). A writer still in one then keeps the LMDB map
        open: unmapping it under the transaction would crash the process (exit releases it)."""
        if self._released:
            return 0
        if os.getpid() != self._pid:
            # A forked child: the writer, the LMDB handle and the lock are the parent's to release.
            self._closed = self._released = True
            return 0
        if timeout is None and not self._closed:
            try:
                self.flush()
            except ValueError:
                pass  # closed by another thread meanwhile: finished below, or already
            except (lmdb.Error, OSError) as exc:
                if raised_by_signal_handler(exc):
                    raise  # a SIGALRM timeout's TimeoutError: no disk fault (a close again finishes it)
                self._disk_fault(exc)  # a sync that fails must not keep the store from closing
        if not self._lock.acquire(timeout=-1 if grace is None else grace):
            logger.error("tierkv: the store at %s stayed busy in another thread; it is left to the process's "
                         "exit", self._disk.path if self._disk is not None else None)
            return 0
        try:
            if self._released:
                return 0
            if not self._closed:
                self._write_stamps()
                self._closed = True
            try:
                return self._stop_writer(timeout, grace)
            finally:
                self._release(grace)
        finally:
            self._lock.release()

    def _stop_writer(self, timeout: float | None, grace: float | None) -> int:
        """Drain (or, past ``timeout``, drop) the queued writes; how many block writes were dropped."""
        if self._writer is None:
            return 0
        dropped = 0
        if self._writer.closed:
            # A close called again: the writes its writer settled are settled as close settles
            # them, before the reap below takes them for a running store's (which made room on
            # disk for a refused one, its deletes owed to a writer that is gone, and left an
            # abandoned one's block PENDING).
            dropped += self._close_writes(final=False)
        # Also after flush() retried them: a close cut short and called again skips flush(). Its
        # reap also finishes what another signal's handler cut short (a noted delete, a forget).
        self._retry_deletes()
        abandoned = self._writer.close(timeout, grace)
        stuck = self._writer.alive()
        dropped += self._close_writes(final=True)
        if abandoned or stuck:
            logger.warning("tierkv: close(timeout=%s) dropped %d queued block writes; those blocks "
                           "will be recomputed after a restart", timeout, dropped)
        for op, job in self._deletes:
            if isinstance(op, DeleteBlocks) and job.done() and isinstance(job._error, WriteAbandoned):
                # Replaced tails kept with the writes that replaced them: still on disk, and in a
                # last stats() (a metrics scrape) as in a reopened store's.
                self._left_on_disk[0] += len(op.keys)
                self._left_on_disk[1] += op.footprint
        if not stuck:
            with defer_interrupts():
                self._reap_deletes()
        path = self._disk.path if self._disk is not None else None
        if self._owed_keys() and self._disk_damaged:
            logger.error("tierkv: %d deletes could not be written to %s: its LMDB file is damaged; blocks that "
                         "were forgotten or evicted may still be on disk. Run `tierkv check %s --repair` and "
                         "forget them again, or delete the directory (it is only a cache)", self._owed_keys(), path,
                         shell_path(path) if path is not None else path)
        elif self._owed_keys():
            logger.error("tierkv: %d deletes could not be written to %s (disk errors); blocks that were "
                         "forgotten or evicted may still be on disk. Delete the directory (it is only a "
                         "cache) or reopen the store and forget them again", self._owed_keys(), path)
        # As _retry_deletes would send them: a session forgotten meanwhile owes none.
        refs = sum(len(self._owed_refs(op)) for op in self._owed if isinstance(op, PutRefs))
        if refs:
            logger.error("tierkv: %d session references could not be written to %s (disk errors); after a "
                         "restart forget(session=...) may not find those blocks. Delete the directory (it is "
                         "only a cache), or reopen the store and forget(tenant=...) them", refs, path)
        return dropped

    def _close_writes(self, final: bool) -> int:
        """``_stop_writer``'s reap of the block writes once its writer is closed: each done one
        settled and its outcome counted as ``_reap_write`` counts it (a refusal in ``disk_full``,
        an I/O error in ``disk_errors``, the disk marked failed; those let go of too), but with no
        room made on disk and nothing written again; with ``final``, those not done (abandoned,
        or behind a transaction that did not end) dropped too. Returns how many writes it dropped:
        given up on, not failed by the disk.

        Each write leaves ``_pending_writes`` (or ``_let_go_writes``) by the statement after its
        counts', with no call between (where no signal's handler runs), its work before that
        idempotent: a close cut short and called again counts each once. Before, the writes that
        failed during the close's drain were counted as dropped, neither ``disk_full`` nor
        ``disk_errors``, the disk never marked failed, and the let-go ones not at all."""
        dropped = 0
        for key in list(self._pending_writes):
            job, _ = self._pending_writes[key]
            # Job.error, not wait() in a try: its except took a signal handler's exception there for
            # the write's failure, and a landed block for one dropped. Not done: in the transaction
            # that never ended, or behind it.
            done = job.done()
            if not done and not final:
                continue
            error = job.error()
            refused, faulted = self._write_failed(error)
            landed = done and error is None
            lost = not landed and not refused and not faulted
            meta = self._index.blocks.get(key)
            self._pop_inflight(key)  # its host buffer: a closed store a cache still refers to kept it
            if meta is not None and landed:
                if meta.disk is DiskState.PENDING:
                    self._index.set_disk(meta, DiskState.DURABLE)
            elif meta is not None:
                # Not on disk: stats() after the close must not count it there (a last metrics scrape).
                self._index.set_disk(meta, DiskState.NONE)
                if meta.resident is None:
                    self._index.remove(key)
            noted = job in self._let_go_writes  # Job's hash is object's: no call
            # No call from here to the write's leaving.
            del self._pending_writes[key]
            if noted:
                del self._let_go_writes[job]
            self._disk_full += refused
            self._disk_errors += faulted
            dropped += lost and meta is not None
        for job in list(self._let_go_writes):
            if not job.done():
                continue  # none of the disk's doing: never counted, as a write given up on
            refused, faulted = self._write_failed(job.error())
            del self._let_go_writes[job]
            self._disk_full += refused
            self._disk_errors += faulted
        if final:
            self._let_go_writes.clear()
            self._write_order.clear()  # every write it names was let go of above
        return dropped

    def _write_failed(self, error: BaseException | None) -> tuple[bool, bool]:
        """(refused, faulted) for a done block write that failed with ``error`` (None: landed),
        acted on (the first refusal by the filesystem logged; a fault marks the disk failed) but
        not counted: the caller counts them as the write leaves its record."""
        # WriteAbandoned: close(timeout) gave up on it; WriteNotQueued: its submit was cut short.
        # Neither is the disk's doing.
        refused = isinstance(error, DiskFull)
        faulted = error is not None and not refused and not isinstance(error, (WriteAbandoned, WriteNotQueued))
        if refused:
            # LMDB's free pages did not fit it under the map's cap, or the filesystem has no
            # room for it: not a fault.
            self._refused(str(error) if isinstance(error, FilesystemFull) else None, counted=False)
        elif faulted:
            self._disk_fault(error, counted=False)  # type: ignore[arg-type]
        return refused, faulted

    def _release(self, grace: float | None = None) -> None:
        """Close the disk tier (unless its writer is still in a transaction, or a read outlasts
        ``grace``) and empty the memory tiers. Runs whatever happened before it, so that the
        directory's lock is let go."""
        if self._disk is not None:
            if self._writer is not None and self._writer.alive():
                logger.error("tierkv: the disk writer of %s is still running (a close cut short, or a write "
                             "transaction that does not end); its LMDB map stays open until close() is called "
                             "again or the process exits (LMDB transactions are atomic)", self._disk.path)
                return
            if self._writer is not None:
                # Where this runs in the finally of a _stop_writer cut short (another signal's
                # handler) once its writer ended: the writes it settled are counted here, or the
                # store was released with them uncounted and their blocks PENDING.
                self._close_writes(final=True)
            try:
                # Not where an earlier close got as far as the disk tier's (which raised: a disk
                # error as it let go of its files): its environment is closed, and this sync's
                # refusal was logged and counted as the disk's I/O error.
                if not self._disk.closed:
                    if self._disk.owes_zeros:
                        # The writer is gone: this thread is the only writer now. Evicted records
                        # are zeroed a transaction after their delete; none is left in the file at
                        # rest.
                        self._disk.apply([])
                    self._disk.sync()
            except (lmdb.Error, OSError) as exc:
                if raised_by_signal_handler(exc):
                    raise  # after the disk tier's close below: a timeout, no disk fault
                self._disk_fault(exc)
            finally:
                closed = self._disk.close(timeout=grace)
            if not closed:
                logger.error("tierkv: a read of %s did not end within %s s; its LMDB map is left to the process's "
                             "exit", self._disk.path, grace)
                return
        self._readers.close()
        self._device.clear()
        self._host.clear()
        self._unwritten.clear()
        for key in list(self._inflight):
            self._pop_inflight(key)
        # The pool's arenas (pinned, host budget + POOL_IN_FLIGHT) go with the store object, which
        # a TieredCache the user kept refers to long after close().
        self._host.pool = None
        self._released = True
        _open_stores.discard(self)  # as DiskTier.close does

    # -- the public turn ------------------------------------------------------------------------
    def open(self, model: Any, input_ids: Any, session: str | None = None, tenant: str | None = None) -> TieredCache:
        """A cache for one conversation turn, holding the longest stored prefix of ``input_ids``.

        ``model``: a decoder-only transformers model of full-attention or sliding-window layers on
        this store's device (it gets tierkv's forward hook). ``input_ids``: the whole conversation
        so far, an integer
        tensor of shape ``(1, L)``. ``session``/``tenant``: names (str) or None; blocks are shared
        within a tenant, never across tenants, and ``forget`` finds a session's blocks by name.

        Restores whole blocks while their keys and stored ids agree, then the stored continuation
        (the session's partial tail, or a block that diverges later) sharing the most leading ids,
        never more than ``L - 1`` tokens (``generate`` needs one to compute logits from), nothing
        from the model's masked pad id on, and nothing past a dynamic RoPE's base length. Disk
        blocks are read and verified before this returns; a bad one ends the restore there (counted
        in ``stats()['corrupt']``). Blocks no layer's window reaches (a model whose every layer
        slides) are neither read nor verified: their tokens count as restored from the tier they
        rest in, and damage to them is found by a turn whose window reaches them. The cache's
        ``restored_tokens`` and ``restored_from`` (tokens per tier) say what came back; its
        ``diverged_at``, where the ids first differ from the conversation the session committed
        last (None where they agree, where the restore reaches past that point along another
        stored conversation, or where the store cannot tell).
        Pass it to ``model.generate(input_ids, cache=cache)``, then call ``cache.commit(output)``.

        Raises ``TypeError``/``ValueError`` (saying what to pass instead) for ids that are not one
        ``(1, L)`` row of the model's token ids, names that are not str, a model the store cannot
        serve exactly (see README: linear attention, DeepSeek Sparse Attention, encoder-decoder...) or on
        another device than the store's, and a closed store.
        """
        started = time.perf_counter()
        self._check_open()
        check_name(session, "session")
        check_name(tenant, "tenant")
        info = describe_model(model)
        if info.device != self.device:
            raise ValueError(f"the model is on {info.device} but this store's device tier is {self.device}; "
                             f"move the model with model.to({str(self.device)!r}) or create the store with "
                             f"device={str(info.device)!r}")
        ids = token_ids_of(input_ids, vocab=info.vocab)
        root = _root_key(info.fingerprint, tenant)
        # Ctrl-C is held off to the end of the open: an interrupt between a block's move and its
        # index update, or in the unpinning, left the store inconsistent (``interrupts.py``). It
        # still cuts short the wait for the lock before anything is done, and the disk reads.
        with defer_interrupts():
            pins: list[bytes] = []
            # The pool buffers this open reads from (none is reused before its copy), each hold
            # made with its record (``Lease.hold_in``): a hold and its append apart, another
            # signal's handler raising as the hold returned left a buffer held for good.
            held: dict[Any, Any] = {}
            try:
                with self._lock:  # inside the section: a Ctrl-C during the wait is raised at once (_StoreLock)
                    self._check_open()
                    self._reap()
                    # Before the plan: a forget while this open reads its blocks from disk must
                    # still keep its commit from writing them back.
                    forgets_seen = self._forget_clock
                    limit = info.position_limit
                    # Past the limit the prefill's RoPE frequencies differ from those the blocks were
                    # computed with (``ModelInfo.position_limit``): nothing is restored.
                    plan = self._match(root, ids, info.masked_token) if limit is None or len(ids) <= limit else []
                    self._pin(pins, [meta.key for meta, _ in plan])
                    matched = plan
                    # Blocks no layer's window reaches are neither read nor copied (a Mistral's
                    # window of 4,096 over a 32k-token conversation: its last blocks alone).
                    unread = unread_blocks(info.windows, [n for _, n in plan])
                    gone = [i for i in range(unread) if not self._rests_as_named(plan[i][0])]
                    if gone:
                        # A restore is a prefix: it ends before a block that rests nowhere (whose
                        # KV the cut layers could not store again), and the shorter restore's
                        # window may reach blocks before it, which are then read.
                        plan = plan[:gone[0]]
                        unread = unread_blocks(info.windows, [n for _, n in plan])
                    found: list[tuple[Tier, Job[Any]] | None] = \
                        [(meta.resident or Tier.DISK, UNREAD) for meta, _ in plan[:unread]]
                    found += [self._source(meta) for meta, _ in plan[unread:]]
                    for i, where in enumerate(found):
                        if where is not None and where[1].lease is not None:
                            where[1].lease.hold_in(held, ("memory", i), where[1].lease)
                # Disk blocks are read and verified outside the store lock, so other sessions' turns
                # go on meanwhile; the planned blocks are pinned against eviction.
                reads, read_seconds, buffer = self._read_disk_blocks(plan, found, info, held, len(ids))
                while (miss := _first_miss(found, reads)) is not None and \
                        _reaches_further(info.windows, [n for _, n in plan], miss, unread, buffer):
                    # Cut short by a block that failed its read, the restore's windows reach
                    # tokens left unread or out of the buffer: they are read now, and the disk
                    # blocks before the miss read into the buffer again (a rare path: damage, or a
                    # forget meanwhile).
                    with self._lock:
                        self._check_open()
                        plan, found, unread, kept = self._plan_again(plan, found, reads, miss, info.windows, held)
                    # A Ctrl-C that cut the reads short is delivered now, with nothing to undo (the
                    # pins and holds go in the finally): each pass after it read nothing, so the loop
                    # planned again block by block down to a restore of nothing (4 passes for 60
                    # tokens), which a program whose handler returns was handed. Once delivered,
                    # the next pass reads.
                    raise_pending()
                    reads, seconds, buffer = self._read_disk_blocks(plan, found, info, held, len(ids), kept)
                    read_seconds += seconds
                # A Ctrl-C that cut the reads short with no re-plan is delivered here too, before
                # anything is counted: held to the section's end, an open that raised counted its
                # restore's hits and misses (its promotions done) where the re-planned one counted
                # none, and a program opening the turn again counted it twice.
                raise_pending()
                with self._lock:
                    self._check_open()
                    if reads:  # the disk's time only where this open read from it (the chat trace's GB/s)
                        self._read_seconds += read_seconds
                    cache = self._finish_open(info, ids, root, session, tenant, plan, found, reads, read_seconds,
                                               model, buffer, matched)
                    cache._forgets_seen = forgets_seen
                    # No point between the swap and the hand-over where a signal's handler runs:
                    # the finally hands over exactly what this did not.
                    pins, handed = [], pins
                    self._orphaned_pins.extend(handed)
                    self._unpin_orphans()
            finally:
                # The holds handed over first, in one C call: a handler raising as their let-go
                # started (or at an unhold) left the buffers held for good, lost to the pool.
                if held:
                    self._held_leases.append(held)
                try:
                    if pins:
                        # Handed over first, in one C call: a handler raising at any later point
                        # (``_let_go``'s start among them) leaves them to the next call's _reap,
                        # not pinned for good.
                        self._orphaned_pins.extend(pins)
                        self._let_go()
                finally:
                    # The pool's own lock guards a lease: no wait for the store's.
                    self._let_go_leases()
        if self._events.active:
            self._events.emit(OpenEvent(time.perf_counter() - started, dict(cache.restored_from),
                                        len(ids) - cache.restored_tokens))
        return cache

    def _let_go(self) -> None:
        """Let go of the pins handed over (``_orphaned_pins``), or, while another thread holds the
        lock, leave them to whoever takes it next (``_reap``): an open that raises never waits for
        the lock to clean up after itself, and a pin left a moment longer only keeps a block from
        eviction that moment."""
        lock = self._lock
        held = lock._recursion_count()  # re-entrant: this thread may hold it already
        try:
            if lock.acquire(blocking=False):
                try:
                    self._unpin_orphans()
                finally:
                    lock.release()
        except BaseException:
            # Another signal's handler raising as the acquire returned left the lock held for
            # good, every later call of another thread waiting for it.
            if lock._recursion_count() > held:
                lock.release()
            raise

    def _read_disk_blocks(self, plan: list[tuple[BlockMeta, int]], found: list[tuple[Tier, Job[Any]] | None],
                          info: Any, held: dict[Any, Any], length: int, kept: dict[int, Any] | None = None
                          ) -> tuple[dict[int, Any], float, Any]:
        """Plan index -> verified host tensor (or ``IN_PLACE``), or the exception that made it a
        miss; stops at the first miss, since a restore is a prefix. With them, the restore's
        buffer (see ``_in_place``), or None. Several records are read side by side
        (``readers.ReadPool``). ``kept``: reads an earlier pass made into tensors of their own
        (``_plan_again``), taken as they are, their pool buffers held as this pass's; let go of
        with the rest past a miss."""
        reads: dict[int, Any] = dict(kept) if kept else {}
        start = time.perf_counter()
        wanted = [i for i, where in enumerate(found) if where is None]
        todo = [i for i in wanted if i not in reads]
        if self._disk is None or not todo:
            return reads, time.perf_counter() - start, None
        # Every record this open reads is asked of the disk at once, not page by page.
        self._disk.prefetch([plan[i][0].key for i in todo])
        buffer: list[Any] = []  # made by the first block read into it (restore_slots)
        fingerprint = info.fingerprint
        at = list(itertools.accumulate((n for _, n in plan), initial=0))
        in_place = {i: self._in_place(plan[i][0]) for i in todo}
        # Where each layer's part of the buffer starts; none where no block is read into one.
        skips = layer_skips(info.windows, [n for _, n in plan]) if True in in_place.values() else None
        # The other reads write into the buffer the first one makes: they wait for it. Mixed
        # destinations (never met: only a tail is smaller than the others) are read one at a time.
        ready = Latch() if in_place[todo[0]] else None
        parallel = len(set(in_place.values())) == 1 and \
            sum(plan[i][0].nbytes for i in todo) >= PARALLEL_READ_BYTES
        disk = self._disk
        interrupted = pending_check()  # this thread's Ctrl-C, asked by the helpers too
        leases: dict[int, Any] = {}  # plan index -> the pool buffer its read took

        def read(i: int) -> bool:
            meta, n = plan[i]
            if interrupted():
                return False  # after a Ctrl-C, a shorter restore: the open ends (and raises) soon
            made: list[Any] = []  # the block's host tensor and its pool lease

            def into(header: RecordHeader) -> Any:
                self._check_header(header, meta, fingerprint)  # before its shape sizes an allocation
                # Held by this open until its copies to the device are registered, the hold made
                # with the taking (a handler raising between the two lost the buffer); the open
                # lets go of it whatever happens, a failed read included.
                tensor, lease = self._host.alloc(header.shape, torch_dtype(header.dtype), held, ("read", i))
                if lease is not None:
                    leases[i] = lease
                made[:] = tensor, lease
                return block_bytes(tensor)

            def slots(header: RecordHeader) -> list[tuple[int, np.ndarray]]:
                slots = self._slots(buffer, meta, fingerprint, length, at[i], n, header, skips, info.layout)
                if ready is not None:
                    ready.set()  # the buffer exists: the other reads may go on beside this one
                return slots

            try:
                disk.read_into(meta.key, slots if in_place[i] else into)
            except (CorruptRecord, KeyError, lmdb.Error, OSError) as exc:
                if raised_by_signal_handler(exc):
                    # A timeout's TimeoutError (an OSError) is no disk fault: taken for one, the
                    # program's timeout vanished and the disk tier was given up for good.
                    raise
                reads[i] = exc
                return False
            if in_place[i]:
                reads[i] = IN_PLACE
                return True
            job = Job.completed(made[0])
            job.lease = made[1]
            reads[i] = job
            return True

        if parallel:
            self._readers.run(todo, read, ready)
        else:
            runs: list[list[int]] = [[]]  # READ_TXN_BYTES of records a transaction
            size = 0
            for i in todo:
                if runs[-1] and size + plan[i][0].nbytes > READ_TXN_BYTES:
                    runs.append([])
                    size = 0
                runs[-1].append(i)
                size += plan[i][0].nbytes
            try:
                for run in runs:
                    with disk.reading():
                        if not all(map(read, run)):
                            break
            except (lmdb.Error, OSError) as exc:
                if raised_by_signal_handler(exc):
                    raise  # a read's: see read()
                # The transaction did not begin (a closed tier), or did not end: a miss at the
                # first record it did not read, as a read of its own would have been.
                unread = [i for i in todo if i not in reads]
                if unread:
                    reads[unread[0]] = exc
        # Only the reads before the first miss are of use (others may have run beside it).
        for n, i in enumerate(wanted):
            if not isinstance(reads.get(i), Job):
                for later in wanted[n + 1:]:
                    reads.pop(later, None)
                # Their buffers, and the miss's own (a record that failed its checksum), go back to
                # the pool now: on CUDA pinned ones, up to one a helper, else held to the open's end.
                # Nothing else uses them yet (no copy from them was issued).
                for j in wanted[n:]:
                    lease = leases.get(j)
                    if lease is None and kept:
                        lease = getattr(kept.get(j), "lease", None)  # an earlier pass's read
                    if lease is not None:
                        lease.unhold_from(held, ("read", j))  # the open's end: not again
                if isinstance(reads.get(i), (lmdb.Error, OSError)) and self._closed:
                    raise ValueError("this TieredStore was closed during open(); create a new "
                                     "TieredStore(path, ...) to use it again") from reads[i]
                break
        if not any([result is IN_PLACE for result in reads.values()]):
            buffer.clear()  # shaped by a header that failed its checks, or by none
        return reads, time.perf_counter() - start, buffer[0] if buffer else None

    def _slots(self, buffer: list[Any], meta: BlockMeta, fingerprint: bytes, length: int, at: int, n: int,
               header: RecordHeader, skips: list[int] | None, layout: Any = None) -> list[tuple[int, np.ndarray]]:
        """``restore_slots`` for a header that agrees with the block's index entry: the first
        block read sizes the buffer from its header, whose checksum is known only after the copy,
        and a header damaged in agreement with the record's length (fewer tokens, more heads)
        asked for a buffer ``length`` times the record's size (100 GiB for a 1 MiB block in a
        100k-token conversation: an allocation error out of ``open``, not a miss)."""
        self._check_header(header, meta, fingerprint)
        return restore_slots(buffer, length, at, n, header, skips, layout)

    def _in_place(self, meta: BlockMeta) -> bool:
        """Whether a block read from disk goes straight into the restore's buffer: on a CPU device
        tier (a GPU takes its copies from the pinned pool's buffers), where neither memory tier can
        take the block, so no tier keeps a copy of it (``_promote``). One copy out of the memory map,
        not two: none into a host buffer, and the first forward writes its new tokens into the
        buffer's room for them instead of concatenating the layer afresh (``TieredLayer.update``)."""
        return self.device.type == "cpu" and self._host.pool is None and meta.nbytes > self._device.budget \
            and meta.nbytes > self._host.budget

    def _finish_open(self, info: Any, ids: np.ndarray, root: bytes, session: str | None, tenant: str | None,
                     plan: list[tuple[BlockMeta, int]], found: list[tuple[Tier, Job[Any]] | None],
                     reads: dict[int, Any], read_seconds: float, model: Any = None, buffer: Any = None,
                     matched: list[tuple[BlockMeta, int]] | None = None) -> TieredCache:
        """The cache of a restore of ``plan`` from ``found`` and ``reads``, ending at the first block
        whose read failed. ``matched``: the plan as ``_match`` made it (``plan`` where None), which
        ``diverged_at`` is told from: the conversation the ids follow, not how much of it the disk
        gave back. Called with the lock held."""
        sources: list[tuple[BlockMeta, int, Tier, Job[Any]]] = []
        read_bytes = 0
        for i, ((meta, n), where) in enumerate(zip(plan, found)):
            if where is None:
                result = reads.get(i)
                if result is None or isinstance(result, BaseException):
                    self._missed(meta, result)
                    break
                where = (Tier.DISK, result)
                read_bytes += meta.nbytes
            sources.append((meta, n, *where))
        if read_bytes:
            self._count_move("disk_to_host", read_bytes, seconds=read_seconds)
        # Every copy to the device starts at once, layer by layer across blocks, so that layer i
        # can be used as soon as its own copies landed.
        moving = [i for i, (_, _, tier, src) in enumerate(sources)
                  if tier is not Tier.DEVICE and src is not IN_PLACE and src is not UNREAD]
        copies = self._engine.to_device_many([sources[i][3] for i in moving])
        for i, copy in zip(moving, copies):
            lease = sources[i][3].lease
            if lease is not None:
                lease.after(copy.fence())  # the buffer is not reused before this copy from it is done
        if copies:
            # One batch of copies, issued together: one move for metrics.
            self._count_move("host_to_device", sum(sources[i][0].nbytes for i in moving), copies[0])
        moved = iter(copies)
        blocks: list[tuple[Job[Any], int]] = []
        restored_from = dict(_NO_TOKENS)
        used: list[BlockMeta] = []
        for meta, n, tier, src in sources:
            job = src if tier is Tier.DEVICE or src is IN_PLACE or src is UNREAD else next(moved)
            # Promote unless another thread moved or dropped the block since it was found.
            was = Tier.HOST if tier is Tier.HOST else None
            if tier is not Tier.DEVICE and src is not IN_PLACE and src is not UNREAD and \
                    self._index.blocks.get(meta.key) is meta and \
                    meta.resident is was:
                self._promote(meta, job, src)
            blocks.append((job, n))
            restored_from[tier.value] += n
            used.append(meta)
        self._touch_chain([m for m in used if self._index.blocks.get(m.key) is m])
        restored = sum(restored_from.values())
        for tier_name, n in restored_from.items():
            self._hits[tier_name] += n
        self._misses += len(ids) - restored
        sid = _session_id(tenant, session) if session is not None else None
        # From the plan as matched, as a restore cut short by a failed read without planning again
        # is: a re-plan's shorter one (``_plan_again``) reported an all-sliding model's turn back on
        # an older branch as a difference from the latest where the read failed before it.
        matched = plan if matched is None else matched
        diverged = self._diverged(sid, root, ids, matched) if sid is not None else None
        cache = TieredCache(store=self, info=info, input_ids=ids, root=root, session=session, tenant=tenant,
                            blocks=blocks, restored_from=restored_from, model=model, buffer=buffer)
        cache._sid = sid  # its commit's too: a hash, cold right after a forward
        if diverged is not None:
            at, lost, stored_id = diverged
            cache.diverged_at = at
            self._diverged_turns += 1
            self._diverged_tokens += lost
            # Once per store at INFO: an edited message is an ordinary turn, and a store whose every
            # turn diverges must not flood the log; stats() counts them all.
            log = logger.info if self._diverged_turns == 1 else logger.debug
            log("tierkv: a returning session's ids differ from the conversation it committed last at token %d "
                "(id %d given, %d stored), so %d stored tokens past it are computed again. An edited message "
                "does this; if most turns do, the ids of earlier turns are not those generate() returned: "
                "a chat template that renders past replies differently (one that drops a reasoning "
                "model's thinking, a date in the system prompt) or a reply decoded to text and tokenized "
                "again; keep the ids generate() returned and append the new message's ids to them, rather "
                "than rendering and tokenizing the whole conversation each turn. "
                "stats()['diverged_turns'] counts these turns%s", at, int(ids[at]),
                stored_id, lost, "; further ones are logged at DEBUG" if self._diverged_turns == 1 else "")
        # Block j of the restore starts at token j * block_size: a forget of a partial tail it
        # restored drops a key its commit's chain never holds (the commit extends that tail).
        cache._restored_keys = [meta.key for meta in used]
        return cache

    def _plan_again(self, plan: list[tuple[BlockMeta, int]], found: list[tuple[Tier, Job[Any]] | None],
                    reads: dict[int, Any], miss: int, windows: tuple[int | None, ...], held: dict[Any, Any]
                    ) -> tuple[list[tuple[BlockMeta, int]], list[tuple[Tier, Job[Any]] | None], int, dict[int, Any]]:
        """The plan, sources and unread count of a restore that ends before the block at ``miss``,
        whose read failed (accounted for here, as ``_finish_open`` would): the blocks its window
        now reaches that were left unread are taken from the tier they rest in. With them, the
        disk reads before the miss into tensors of their own, kept for the next pass
        (``_read_disk_blocks``'s ``kept``), their pool buffers still held; those read into the
        restore's buffer, laid out for the whole restore, are read again. Called with the lock held."""
        self._missed(plan[miss][0], reads.get(miss))
        kept: dict[int, Any] = {}
        for i, result in list(reads.items()):
            if i < miss and isinstance(result, Job) and result is not IN_PLACE:
                # Read again, a block cost a second read of its record, and on CUDA a second
                # pinned buffer while the first went back to the pool.
                kept[i] = result
                continue
            lease = getattr(result, "lease", None)
            if lease is not None:
                lease.unhold_from(held, ("read", i))
        plan = plan[:miss]
        unread = unread_blocks(windows, [n for _, n in plan])
        again: list[tuple[Tier, Job[Any]] | None] = []
        for i, ((meta, _), where) in enumerate(zip(plan, found)):
            if i >= unread and where is not None and where[1] is UNREAD:
                where = self._source(meta)
                if where is not None and where[1].lease is not None:
                    where[1].lease.hold_in(held, ("memory", i), where[1].lease)
            again.append(where)
        return plan, again, unread, kept

    def _missed(self, meta: BlockMeta, result: BaseException | None) -> None:
        """Account for a planned disk block whose read failed with ``result`` (None: not read, an
        interrupt or a disk tier gone): a restore ends before it. A KeyError is a plain miss
        (evicted or forgotten meanwhile); damage is counted and the block dropped; an I/O error
        is the disk's fault."""
        if isinstance(result, CorruptRecord) and self._index.blocks.get(meta.key) is not meta:
            pass  # forgotten or evicted meanwhile: its delete zeroed it, a plain miss
        elif isinstance(result, Scrubbed):
            # A delete a crash cut short left the record zeroed under a surviving head.
            logger.debug("tierkv: finished a delete that a crash cut short (%s)", meta.key.hex())
            self._drop(meta)
        elif isinstance(result, CorruptRecord) or (
                isinstance(result, KeyError) and self._index.blocks.get(meta.key) is meta
                and meta.disk is DiskState.DURABLE):
            # A KeyError here: a record gone under its head (damage; evictions and
            # forgets take the block off disk in the index first). Left indexed, each
            # open read it again, and no commit stored it again.
            self._corrupt += 1
            # Once per store, then counted: a damaged disk must not flood the log.
            log = logger.warning if self._corrupt == 1 else logger.debug
            log("tierkv: dropped an unreadable block from disk (%s); it will be recomputed. "
                "stats()['corrupt'] counts further ones",
                "its record is missing" if isinstance(result, KeyError) else result)
            if self._index.blocks.get(meta.key) is meta:
                self._drop(meta)
        elif isinstance(result, (lmdb.Error, OSError)):
            self._disk_fault(result)

    def _diverged(self, sid: bytes, root: bytes, ids: np.ndarray,
                  plan: list[tuple[BlockMeta, int]]) -> tuple[int, int, int] | None:
        """Where ``ids`` first differ from the conversation the session committed last, how many
        of its stored tokens past there (up to ``L - 1``) the turn computes again, and the stored id
        there; None where they agree (the ids extend it, or it extends them), where ``plan``
        restores past the difference (from another stored conversation), or where the store
        cannot tell: no such session tracked, a block of that conversation gone, one committed
        by another model (a chain under another root), or a session read back from disk that has
        not committed since."""
        info = self._index.sessions.get(sid)
        if info is None:
            return None
        # Read back from disk, a session has no ``last`` until it commits: which of its
        # conversations is the latest is not on disk, and guessing it from the blocks it holds
        # (one with no continuation among them) took an older one for it where the latest ended
        # inside it (a reply regenerated shorter, a beam search's commit of its prompt alone).
        last = info.last
        if last is None or (plan and plan[-1][0].key == last and plan[-1][1] == plan[-1][0].n_tokens):
            return None  # the usual returning turn: its restore ends with that conversation's tail, whole
        chain: list[np.ndarray] = []
        key = last
        while key != root:
            meta = self._index.blocks.get(key)
            if meta is None:
                return None
            chain.append(meta.token_ids)
            key = meta.parent
        stored = np.concatenate(chain[::-1])
        at = _common_prefix(stored, ids)
        end = min(len(stored), len(ids) - 1)
        if at >= end or sum([n for _, n in plan]) > at:
            # Restored past the difference: the ids follow another stored conversation there (an
            # older branch of this session, one the user went back to, or another session's), and
            # nothing of the latest was computed again. Reported, such a turn counted as lost every
            # stored token of the latest branch, and the log said they were computed again.
            return None
        return at, end - at, int(stored[at])

    def _match(self, root: bytes, ids: np.ndarray, masked: int | None = None) -> list[tuple[BlockMeta, int]]:
        """(block, tokens used) along the longest stored prefix of ``ids``, at most ``L - 1`` tokens
        and none from the first ``masked`` id on (``ModelInfo.masked_token``)."""
        limit = len(ids) - 1
        plan: list[tuple[BlockMeta, int]] = []
        pos, parent, B = 0, root, self.block_size
        # Compared as bytes: np.array_equal, cold in an open right after a forward, took 90 us.
        data = token_bytes(ids)
        if masked is not None:
            # generate() masks that id: KV stored from it on (computed where it was not masked,
            # before the pad id was set or by another worker) would be refused at the prefill.
            at = _first_item(data, masked)
            if at is not None:
                limit = min(limit, at)
        while pos < limit:
            if len(ids) - pos >= B:
                span = data[pos * 8:(pos + B) * 8]
                meta = self._index.blocks.get(key_of_bytes(parent, span))
                if meta is not None and meta.n_tokens == B and token_bytes(meta.token_ids) == span:
                    plan.append((meta, B))
                    parent, pos = meta.key, pos + B
                    continue
            best, best_n = None, 0
            for child in self._index.nearest(parent, data[pos * 8:(pos + B) * 8]):
                n = _common_prefix(child.token_ids, ids[pos:])
                if n > best_n:
                    best, best_n = child, n
            if best is not None:
                plan.append((best, best_n))
                pos += best_n
            break
        if pos > limit:
            meta, n = plan.pop()
            if n - (pos - limit) > 0:
                plan.append((meta, n - (pos - limit)))
        return plan

    def _rests_as_named(self, meta: BlockMeta) -> bool:
        """Whether a planned block left unread (``UNREAD``: its tier is credited, never asked)
        still rests somewhere, its index entry first made to follow the tiers (``_settle``) where
        it names a memory tier that no longer holds it, or no tier and no disk record. Another
        signal's handler raising between a tier's pop and the index's update leaves such an
        entry: credited as it stood, its tokens counted as that tier's hits where the disk held
        the block (or as the disk's in a store without one), and, resting nowhere, as restored,
        its commit keeping a chain through it."""
        if meta.resident is None:
            if meta.disk is not DiskState.NONE:
                return True
        elif meta.key in (self._device if meta.resident is Tier.DEVICE else self._host):
            return True
        logger.debug("tierkv: block %s rests in no tier its index entry names", meta.key.hex())
        return self._settle(meta)

    def _source(self, meta: BlockMeta) -> tuple[Tier, Job[Any]] | None:
        """Where a planned block is read from in memory, and its tensor there (a job); None when
        it must be read from disk."""
        if meta.resident is not None:
            job = (self._device if meta.resident is Tier.DEVICE else self._host).get(meta.key)
            if job is not None:
                return meta.resident, job
            # An interrupt (Ctrl-C) between a block's leaving its tier and the index's update.
            logger.debug("tierkv: block %s was not in the %s tier the index named", meta.key.hex(), meta.resident.value)
            return self._source(meta) if self._settle(meta) else None
        if meta.disk is DiskState.PENDING:
            # On its way to disk: served from the write's own buffer, not read back half-written.
            return Tier.DISK, self._inflight[meta.key]
        return None

    def _footprint(self, header: RecordHeader) -> int:
        if self._disk is None:
            return record_size(header)
        return self._disk.footprint_of(header, record_size(header, self._disk.min_record_bytes))

    @staticmethod
    def _check_header(header: RecordHeader, meta: BlockMeta, fingerprint: bytes) -> None:
        if header.fingerprint != fingerprint:
            raise CorruptRecord("record belongs to another model fingerprint")
        if header.tenant != meta.tenant or header.token_ids != meta.token_ids.astype("<i8").tobytes() or \
                header.parent != meta.parent or header.payload_nbytes != meta.nbytes or \
                len(header.shape) != 5 or header.shape[3] != meta.n_tokens:
            raise CorruptRecord("record's tenant, token ids, parent, size or token count differ from its index entry")

    def _promote(self, meta: BlockMeta, device_job: Job[Any], host_job: Job[Any]) -> None:
        """Rest a hit block on the device if it fits there, else in the host tier. Never waits:
        the tiers hold the copies' jobs.

        ``host_job`` is the block's host copy: from the host tier, in flight to disk, or just read.
        """
        if meta.resident is Tier.HOST and meta.nbytes > self._device.budget:
            # It cannot rest on the device: it stays where it is (out and back in, a restore from
            # the host tier paid for it block by block), and the open's touch makes it the most
            # recently used there. Budgets never change, so it still fits.
            return
        try:
            if meta.resident is Tier.HOST:
                # Out of the host tier first, so that making room on the device cannot evict it.
                # Inside the try: another signal's handler raising between the pop and the index's
                # update left the block in no tier with its entry naming the host tier (with no
                # disk tier, lost: the next open's read of it settled it out of the index).
                self._host.pop(meta.key)
                self._index.set_resident(meta, None)
            if meta.nbytes <= self._device.budget and self._make_room(Tier.DEVICE, meta.nbytes):
                self._device.put(meta.key, device_job, meta.nbytes)
                self._index.set_resident(meta, Tier.DEVICE)
            elif meta.nbytes <= self._host.budget and self._make_room(Tier.HOST, meta.nbytes):
                self._host.put(meta.key, host_job, meta.nbytes)
                self._index.set_resident(meta, Tier.HOST)
            elif meta.disk is DiskState.NONE:
                self._evictions += 1
                self._remove(meta)  # the restore in progress holds its own reference
        except BaseException:
            # Making room raised (out of memory for a victim's host copy), or an interrupt came
            # between a put and the index's update. A block in no tier goes back to the host tier
            # it was just taken from, if it fits; one just read from disk (or served by its write)
            # rests there as a promotion finding the device full would rest it (put refuses past
            # the budget: it then rests on disk alone).
            if self._index.blocks.get(meta.key) is meta and meta.key not in self._device and meta.key not in self._host:
                self._host.put(meta.key, host_job, meta.nbytes)
            self._settle(meta)
            raise

    # -- commit -----------------------------------------------------------------------------------
    def _commit(self, cache: TieredCache, sequences: Any) -> int:
        started = time.perf_counter()
        tokens = self._commit_turn(cache, sequences)
        writer = self._writer
        if writer is not None and (writer.backlog() > self._backlog_limit or writer.queued() > self._backlog_ops):
            if not self._warned_backlog:
                self._warned_backlog = True
                logger.warning("tierkv: the disk writer of %s is %d writes (%s of blocks) behind the commits; "
                               "commits wait for it (stats()['commit_wait_seconds'] counts how long): the disk "
                               "is slower than the KV this store is given to keep",
                               self._disk.path if self._disk else None, writer.queued(), format_bytes(writer.backlog()))
            waited = time.perf_counter()
            settled = writer.settled_items()
            while not writer.wait_below(self._backlog_limit, timeout=WRITE_STALL_S, items=self._backlog_ops):
                if self._closed or writer.closed or writer.settled_items() == settled:
                    # No write landed for WRITE_STALL_S (a hung disk), or the store is closing: the
                    # commit goes on, as before the bound; a thread waiting here for ever kept the
                    # process from exiting (non-daemon threads are joined before atexit).
                    logger.warning("tierkv: the disk writer of %s made no progress in %s s; this commit "
                                   "stops waiting for it", self._disk.path if self._disk else None, WRITE_STALL_S)
                    break
                settled = writer.settled_items()
            self._commit_wait += time.perf_counter() - waited
        if self._events.active:
            self._events.emit(CommitEvent(time.perf_counter() - started, tokens))
        return tokens

    def _commit_turn(self, cache: TieredCache, sequences: Any) -> int:
        self._check_open(committing=True)
        if cache._store is not self:
            raise ValueError("this cache was opened by another TieredStore; commit it through its own store")
        # KV computed after the model was switched (adapters, attention, weights) would be kept
        # under the fingerprint of what it was at open: nothing is kept.
        cache.check_computed_as_opened(weights=True)
        seq = sequence_ids_of(sequences)
        opened = cache.input_ids
        if not _same_ids(seq[:len(opened)], opened[:len(seq)]):
            raise ValueError("commit() got ids that do not start with the conversation this cache was opened with; "
                             "pass the sequences that generate() returned for this cache")
        if len(seq) < len(opened):
            raise ValueError(f"commit() got the first {len(seq)} ids of the conversation this cache was opened "
                             f"with, not ids that start with all {len(opened)} of it: pass the sequences that "
                             "generate() returned for this cache")
        n = cache.held_tokens()
        # A forward raised part-way through the layers (out of memory, Ctrl-C), or generate()
        # stopped between two of them (an exception from a stopping criterion, a logits processor
        # or a streamer; Ctrl-C), returning nothing: what every layer holds is kept, up to the ids
        # given (the prompt, or what a streamer showed), which the ids fed are checked against.
        # Any layer's: a reset or crop cut short left layer 0 with fewer tokens than the others,
        # and this commit refused them, as the forward hook sent it here (helper-90).
        unfinished = n < cache.most_tokens()
        if n > len(seq) and cache.batch_rows() == 1 and not cache._rows_diverged:
            # (Beams that ended on eos before the search did return fewer ids than they fed; their
            # commit keeps the conversation only, whatever it is given.)
            logger.info("tierkv: commit() got %d ids, and the cache holds KV for %d: the KV up to the ids given "
                        "is kept (pass the sequences generate() returned to keep its reply too)", len(seq), n)
        n = min(n, len(seq))
        limit = cache.model_info.position_limit
        # Past a RoPE limit, Phi-3's generate() drops the cache and goes on without it.
        crossed = limit is not None and len(seq) - 1 > limit
        # Ids no longer than the cache held before a generate() dropped KV it could not vouch
        # for, and then raised: the ids the caller had (helper-90: refused, saying to run generate()).
        dropped = cache._dropped_from
        if n < len(seq) - 1 and not crossed and not unfinished and (dropped is None or len(seq) - 1 > dropped):
            raise ValueError(f"the cache holds KV for {n} tokens, fewer than the {len(seq) - 1} that {len(seq)} ids "
                             "imply; run generate() (or the model) with this cache before committing")
        kv_dtype = cache.model_info.kv_dtype
        others = cache.kv_dtypes() - {kv_dtype}
        if others:
            # Blocks are keyed by the model's dtype: KV of another dtype (autocast) would be served
            # to the model without it, and the restore would not equal recomputation.
            raise ValueError(f"the cache holds KV in {' and '.join(sorted(map(str, others)))} but the model's weights are "
                             f"{kv_dtype} (autocast?); run generate() without autocast, or cast the "
                             "model to the dtype it computes in (model.to(torch.bfloat16))")
        if cache.batch_rows() > 1 or cache._rows_diverged:
            # Beams and extra return sequences share only the prompt's KV; generated rows are
            # not aligned with the returned sequences.
            n = min(n, len(opened))
        if cache._masked_from is not None:
            n = min(n, cache._masked_from)  # KV from there on depends on the mask, not the ids alone
        if n > len(opened):
            # The ids generated with this cache, as the model was fed them: a reply edited before
            # commit (or fed as embeddings) would be keyed on ids that did not compute its KV.
            fed, known = cache._fed_ids(len(opened), n)
            n = known
            if not _same_ids(fed[:n - len(opened)], seq[len(opened):n]):
                raise ValueError("commit() got ids that differ from the ones the model generated with this cache; "
                                 "pass the sequences that generate() returned, unedited (with generate() in a "
                                 "thread feeding a streamer, keep what it returns: the streamed text tokenized "
                                 "again need not give the same ids)")
        token = cache.model_info.masked_token
        if token is not None:
            # generate() masks this id wherever it appears in a later turn's ids, and KV computed
            # while it was not masked (it was generated, or the mask was given) would not match.
            where = np.flatnonzero(seq[:n] == token)
            if len(where):
                n = int(where[0])
        if limit is not None:
            # Tokens before the limit were computed with the base frequencies only if the prompt's
            # prefill was within it; each later token's own forward reached just past it.
            n = min(n, limit) if len(opened) <= limit else 0
        ids = seq[:n]
        B = self.block_size
        with self._lock, defer_interrupts():
            self._check_open(committing=True)
            self._reap()
            if self._forgotten_since(cache):
                # Its KV (restored, or computed from the conversation) is what the forget took away.
                logger.debug("tierkv: a turn opened before a forget of its session or tenant keeps nothing")
                return 0
            keys = chain_keys(cache.root, ids, B)
            spans = [(i * B, (i + 1) * B, k) for i, k in enumerate(keys)]
            if n % B:
                start = len(keys) * B
                spans.append((start, n, block_key(keys[-1] if keys else cache.root, ids[start:])))
            cut = self._first_forgotten(cache)
            if cut is not None:
                # Its KV from there on is a forgotten conversation's, or was computed over it.
                logger.debug("tierkv: a turn opened before a forget of blocks it holds keeps the blocks before them")
                spans = spans[:cut]
            sid = cache._sid
            parent = cache.root
            pins: list[bytes] = []
            ref = (sid, cache.tenant) if sid is not None else None
            ending = _CommitEnd(sid, cache.tenant, cache.session, cache.root, ids, spans)
            referenced = ending.referenced  # new blocks whose write went out after the session's reference
            try:
                # Noted first, inside the try: the cleanup runs, or is left to the next _reap,
                # whatever a signal's handler cuts short from here on.
                self._ending.append(ending)
                if sid is not None:
                    self._committing.add(sid)
                # Pinned: a later block of this commit never evicts an earlier one; what does not
                # fit goes down a tier or, past the last, ends the chain.
                for start, end, key in spans:
                    self._pin(pins, [key])
                    meta = self._index.blocks.get(key)
                    if meta is None or not _same_ids(meta.token_ids, ids[start:end]) or \
                            (meta.resident is None and meta.disk is DiskState.NONE):
                        if start < cache.held_from():
                            # Evicted since the open (or another conversation's since): the
                            # cache's sliding layers no longer hold the KV to store it again, and
                            # the chain ends before it.
                            logger.debug("tierkv: a block restored at open is gone; the commit keeps the blocks before it")
                            if meta is not None and _same_ids(meta.token_ids, ids[start:end]):
                                # Its entry rests in no tier (an exception's leftover): left in the
                                # index, the chain's end counted it and the blocks after it kept.
                                self._drop(meta)
                            break
                        if meta is not None:
                            # A 128-bit collision (the newer block wins), or an entry an exception
                            # left in no tier: stored again.
                            self._drop(meta)
                        meta = self._store_block(key, parent, cache, ids[start:end], start, end, ref)
                        if meta is None:
                            break
                        if ref is not None and meta.disk is not DiskState.NONE:
                            referenced.add(key)
                    # The index's own bytes: the next block's ``parent`` then shares them (this
                    # turn's chain is a copy of every key it already held).
                    parent = meta.key
            finally:
                # Handed over first, in one C call: a handler raising at a later point of this
                # cleanup left the commit's blocks pinned for good (never evicted again).
                self._orphaned_pins.extend(pins)
                self._unpin_orphans()
                # Also when a block's copy raised (out of memory): the blocks stored before it are
                # the session's, so that forget(session=...) finds them.
                kept = self._end_commit(ending)
            return sum(m.n_tokens for m in kept)

    def _end_commit(self, end: _CommitEnd) -> list[BlockMeta]:
        """A commit's cleanup: the session no longer committing, its chain touched and referenced
        (or, without a session, the tails it replaced let go), the stamps written; the chain's
        blocks still in the index. Each step can run again; the note leaves ``_ending`` last.
        Before, a handler raising at a step's start (the discard's return, ``_touch_chain``'s,
        ``_reference``'s) left the rest undone for good: the blocks stored but not the session's
        in the index (its forget did not find them; their references on disk, made ahead of
        their writes, then pointed at blocks no session held), and the session committing for
        good (never untracked when hollow)."""
        self._committing.discard(end.sid)  # type: ignore[arg-type]
        # A failed disk write reaped meanwhile can still have removed a block of the chain.
        kept: list[BlockMeta] = []
        for start, stop, key in end.spans:
            meta = self._index.blocks.get(key)
            if meta is None or not _same_ids(meta.token_ids, end.ids[start:stop]):
                break
            kept.append(meta)
        self._touch_chain(kept)
        # The ids the kept chain covers: an older tail past them is not superseded.
        covered = end.ids[:sum(m.n_tokens for m in kept)]
        if end.sid is not None:
            if end.new is None:
                info = self._index.sessions.get(end.sid)
                held = info.keys if info is not None else frozenset()
                end.new = [m.key for m in kept if m.key not in held and m.disk is not DiskState.NONE
                           and m.key not in end.referenced]
            self._reference(end.sid, end.tenant, end.session, end.root, covered, kept, end.new)  # type: ignore[arg-type]
        else:
            self._release_unheld_tails(end.tenant, end.root, covered, kept)
        self._write_stamps()
        self._ending.remove(end)
        return kept

    def _store_block(self, key: bytes, parent: bytes, cache: TieredCache, ids: np.ndarray, start: int,
                     end: int, ref: tuple[bytes, str | None] | None = None) -> BlockMeta | None:
        tensor = cache.block_tensor(start, end)
        header = RecordHeader(key=key, parent=parent, tenant=cache.tenant, fingerprint=cache.model_info.fingerprint,
                              dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
                              token_ids=ids.astype("<i8").tobytes(), seq=self._tick())
        meta = BlockMeta(key=key, parent=parent, tenant=cache.tenant, token_ids=narrow_ids(ids),
                         nbytes=tensor.numel() * tensor.element_size(), record_bytes=self._footprint(header))
        try:
            # Inside the try: another signal's handler raising part-way through the add left the
            # block in the index in no tier.
            self._index.add(meta)
            return self._place_block(meta, header, tensor, ref)
        except BaseException:
            # A copy that raised (out of memory for a host buffer, Ctrl-C): the block is dropped
            # whole, from wherever it got, not left unreferenced where forget() cannot find it.
            if self._settle(meta):
                self._drop(meta)
            raise

    def _place_block(self, meta: BlockMeta, header: RecordHeader, tensor: Any,
                     ref: tuple[bytes, str | None] | None = None) -> BlockMeta | None:
        """Rest a new block in the highest tier with room, and queue its disk write (after the
        reference ``ref``, (sid, tenant), of the session committing it)."""
        key = meta.key
        host_job: Job[Any] | None = None
        if meta.nbytes <= self._device.budget and self._make_room(Tier.DEVICE, meta.nbytes):
            self._device.put(key, self._engine.ready(tensor), meta.nbytes)
            self._index.set_resident(meta, Tier.DEVICE)
        elif meta.nbytes <= self._host.budget and self._make_room(Tier.HOST, meta.nbytes):
            host_job = self._engine.to_host(tensor)
            self._count_move("device_to_host", meta.nbytes, host_job)
            self._host.put(key, host_job, meta.nbytes)
            self._index.set_resident(meta, Tier.HOST)
        if (self._writer is not None and self._disk is not None and not self._disk_failed
                and meta.record_bytes <= self._disk.budget):
            if not self._disk_room(meta.record_bytes):
                self._unwritten[key] = header
            else:
                if host_job is not None:
                    source = host_job
                else:
                    source = self._engine.to_host(tensor)
                    self._count_move("device_to_host", meta.nbytes, source)
                self._queue_write(meta, header, source, [ref] if ref is not None else [])
        if meta.resident is None and meta.disk is DiskState.NONE:
            self._remove(meta)
            self._evictions += 1
            return None
        return meta

    def _forgotten_since(self, cache: TieredCache) -> bool:
        """Whether a forget of the cache's session or tenant ran after its ``open``."""
        seen = getattr(cache, "_forgets_seen", self._forget_clock)
        if seen == self._forget_clock:
            return False
        if seen < self._forgotten_floor:
            return True  # which forgets ran since is no longer known
        keys: list[tuple[str, Any]] = [("tenant", cache.tenant)]
        if cache.session is not None:
            keys += [("session", cache.session), ("sid", _session_id(cache.tenant, cache.session))]
        return any([self._forgotten.get(key, -1) > seen for key in keys])

    def _note_forget(self, key: tuple[str, Any]) -> None:
        self._forget_clock += 1
        # Turns run for seconds, while this many forgets take far longer: only a turn left open
        # that long loses its commit when the older half goes.
        self._forgotten_floor = _remember(self._forgotten, [key], self._forget_clock, _FORGETS_KEPT,
                                          self._forgotten_floor)

    def _queue_write(self, meta: BlockMeta, header: RecordHeader, source: Job[Any],
                     refs: list[tuple[bytes, str | None]]) -> None:
        """Queue a block's disk write from ``source`` (a host copy), after the references
        ``refs`` (sid, tenant) of sessions that hold it."""
        # The references go ahead of the block's write, in its transaction or an earlier one: a
        # crash between two of a commit's transactions must not leave on disk a block of the session
        # that forget(session=...) cannot find after the restart (a reference to a block whose
        # write then fails is dropped at reopen, or with its session's row).
        for sid, tenant in refs:
            self._submit(PutRefs(sid, tenant, [meta.key]))
        self._submit_gathered()  # a delete gathered before it (of this key, even) lands first
        key, write = meta.key, Job()
        # Tracked, its buffer held and its block PENDING before it is queued, as _submit's deletes:
        # another signal's handler raising as submit returned left a queued write untracked, its
        # block unknown to the index until a reopen (outside the disk's budget, kept by a forget)
        # and its host buffer held for good. Cut short unqueued, it fails as WriteNotQueued, not
        # taken for a disk fault, and a block kept is written again (_unwritten).
        displaced = self._pending_writes.get(key)
        if displaced is not None:
            # Left tracked by a reap another signal's handler cut short once it had put the block
            # back to be written again: its outcome is counted as the let-go writes' are (a cut
            # here leaves it in both, which the reap of either counts once).
            self._let_go_writes[displaced[0]] = displaced[1]
        # In _submitting first, then in the queue's order: a cut before either is tracked leaves
        # an entry that names no tracked job, passed over.
        self._submitting[write] = key
        self._write_order.append((key, write))
        self._pending_writes[key] = (write, header)
        try:
            self._unwritten.pop(key, None)  # a write again (_write_again): tracked now
            self._set_inflight(key, source)
            if source.lease is not None:
                source.lease.after(write.fence())  # the writer encodes from the buffer
            self._index.set_disk(meta, DiskState.PENDING)
            self._writer.submit(PutBlock(header, source, meta.record_bytes), write)  # type: ignore[union-attr]
        except BaseException as exc:
            self._unless_queued(write, exc)
            raise
        del self._submitting[write]

    def _disk_room(self, nbytes: int) -> bool:
        """Make room on disk for a block write of ``nbytes`` (``_make_room``). Not by eviction where
        the filesystem has no room for the write (``DiskTier.filesystem_short``), which the writer
        would then refuse: every commit under a full filesystem evicted durable blocks for nothing,
        until the disk tier was empty."""
        assert self._disk is not None
        if self._index.bytes[Tier.DISK] + nbytes > self._disk.budget:
            short = self._disk.filesystem_short(nbytes)
            if short is not None:
                self._refused(short)
                return False
        return self._make_room(Tier.DISK, nbytes)

    def _refused(self, filesystem: str | None, counted: bool = True) -> None:
        """Count a block write that found no room (``disk_full``; not ``counted``: the caller
        does); the first for want of room on the filesystem (``filesystem``: why) is logged, once
        per store."""
        if counted:
            self._disk_full += 1
        if filesystem is not None and not self._warned_filesystem:
            self._warned_filesystem = True
            logger.warning("tierkv: %s", filesystem)

    def _write_again(self, meta: BlockMeta, block: Job[Any], tier: Tier) -> None:
        """Queue the write of a block resting in memory only (``_unwritten``) from ``block``, its
        tensor in ``tier``. A block whose write found no room is written when it leaves memory,
        and at every flush: without it, write-through's promise (a restart finds every flushed
        block) broke for good on a disk that was full a moment, and the block was lost for good
        once evicted. Where the disk still has no room it stays in memory, as before."""
        # Left in _unwritten until _queue_write tracks its write: taken out first, another
        # signal's handler raising before then lost it, and the block was never written.
        header = self._unwritten.get(meta.key)
        if header is None:
            return
        if meta.disk is not DiskState.NONE or self._writer is None or self._disk is None or self._disk_failed:
            self._unwritten.pop(meta.key, None)
            return
        if not self._disk_room(meta.record_bytes):
            return
        source = block
        if tier is Tier.DEVICE:
            source = self._engine.to_host(block)
            self._count_move("device_to_host", meta.nbytes, source)
        refs = [(sid, self._index.sessions[sid].tenant) for sid in meta.sessions if sid in self._index.sessions]
        self._queue_write(meta, header, source, refs)

    def _retry_writes(self) -> None:
        """Queue again the writes of the blocks in memory only whose write found no room."""
        for key in list(self._unwritten):
            meta = self._index.blocks.get(key)
            tier = meta.resident if meta is not None else None
            block = self._device.get(key) if tier is Tier.DEVICE else self._host.get(key) if tier is Tier.HOST else None
            if meta is None or block is None:
                self._unwritten.pop(key, None)
            else:
                self._write_again(meta, block, tier)  # type: ignore[arg-type]

    def _reference(self, sid: bytes, tenant: str | None, name: str, root: bytes, ids: np.ndarray,
                   chain: list[BlockMeta], new: list[bytes]) -> None:
        """Reference ``chain``'s blocks for the session, those of ``new`` on disk too (the others
        are referenced there already: ahead of their writes, or by an earlier turn), and let go
        of the partial tails it supersedes. Run again after a cut, it does no more than once,
        but for the disk references of ``new``, queued again (the same rows)."""
        for meta in chain:
            self._index.ref(sid, tenant, name, meta)
        info = self._index.sessions.get(sid)
        if info is None:
            return
        if chain:
            info.last = chain[-1].key
        # A partial tail of this session is superseded when the new chain covers all its tokens
        # after the same parent; tails of other branches or other models stay.
        B = self.block_size
        in_chain = {m.key for m in chain}
        offsets = {root: 0, **{m.key: (i + 1) * B for i, m in enumerate(chain)}}
        if len(info.keys) <= SCAN_SESSION_KEYS * len(offsets):
            found: Iterable[BlockMeta] = map(self._index.blocks.__getitem__, info.keys)
        else:
            # A session of many conversations (one name for all a user's chats): reading each of
            # its blocks at every commit cost 23 ms at 15,000. Its tails that the chain can cover
            # are continuations of the chain's blocks with the ids that follow them.
            data = token_bytes(ids)
            found = [meta for parent, start in offsets.items() if start < len(ids)
                     for meta in self._index.prefixes_of(parent, data[start * 8:(start + B) * 8])
                     if sid in meta.sessions]
        stale = []
        for meta in found:
            start = offsets.get(meta.parent)
            if (meta.key not in in_chain and meta.n_tokens < B and start is not None
                    and _same_ids(ids[start:start + meta.n_tokens], meta.token_ids)):
                stale.append(meta)
        if self._writer is not None and new:
            self._submit(PutRefs(sid, tenant, new))
        self._release_tails(sid, stale)
        # A block that was one other session's alone is now shared: that session may have nothing
        # of its own left (this one continued its conversation, or repeated it). Those sessions
        # go first, so that of two with the same blocks the one that committed last stays.
        sharers = {other for m in chain if len(m.sessions) == 2 for other in m.sessions if other != sid}
        for other in sharers:
            self._untrack_if_hollow(other)
        self._untrack_if_hollow(sid)

    # -- eviction -----------------------------------------------------------------------------------
    def _victim(self, tier: Tier) -> BlockMeta | None:
        """The least recently used block of ``tier`` that the call in progress has not pinned."""
        for key in self._index.lru[tier]:
            if not self._pinned[key]:
                return self._index.blocks[key]
        return None

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        """Evict least-recently-used blocks from ``tier`` until ``nbytes`` more fit its budget.

        False when the blocks pinned by the open or commit in progress leave too little room.
        """
        if tier is Tier.DISK:
            assert self._disk is not None
            with self._gathering_deletes():  # a large block, or a reopen under a smaller budget: many
                while self._index.bytes[Tier.DISK] + nbytes > self._disk.budget:
                    if self._evict_from_disk() == 0:
                        return False
            return True
        space = self._device if tier is Tier.DEVICE else self._host
        while not space.fits(nbytes):
            meta = self._victim(tier)
            if meta is None:
                return False
            # Pinned while it moves: the room its write or its host copy makes on disk or in the
            # host tier must not evict it from the disk meanwhile.
            moving: list[bytes] = []
            try:
                # Inside the try: another signal's handler raising as the pin's append returned
                # left the block pinned for good (never evicted again).
                self._pin(moving, [meta.key])
                self._evict(tier, meta)
            finally:
                # Handed over in one C call before any point where a handler runs: one raising
                # as _unpin started left the block pinned for good.
                self._orphaned_pins.extend(moving)
                self._unpin_orphans()
        return True

    def _evict(self, tier: Tier, meta: BlockMeta) -> None:
        """Move ``meta`` out of the device tier (to the host tier if it has room) or out of the host
        tier, writing it to disk first if its write found no room before (``_unwritten``)."""
        space = self._device if tier is Tier.DEVICE else self._host
        # Noted first, settled by the next _reap if a cut leaves it: another signal's handler
        # raising between the tier's pop and the index's update left the index naming a block the
        # tier no longer held (the index's bytes and the tier's apart for good).
        self._unsettled.add(meta.key)
        if tier is Tier.HOST and meta.key in self._unwritten:
            # Queued while the tier still holds its buffer, which the write then holds too.
            self._write_again(meta, space.get(meta.key), tier)  # type: ignore[arg-type]
        # A block whose disk write is still queued leaves at once: until the write commits it
        # stays readable from the write's own buffer (self._inflight), so eviction never waits.
        block = space.pop(meta.key)
        self._index.set_resident(meta, None)
        self._evictions += 1
        try:
            if tier is Tier.DEVICE and meta.nbytes <= self._host.budget and \
                    self._make_room(Tier.HOST, meta.nbytes):
                # A block on its way to disk already has a host copy: no second one.
                host_job = self._inflight.get(meta.key)
                if host_job is None:
                    host_job = self._engine.to_host(block)
                    self._count_move("device_to_host", meta.nbytes, host_job)
                self._host.put(meta.key, host_job, meta.nbytes)
                self._index.set_resident(meta, Tier.HOST)
            elif tier is Tier.DEVICE and meta.key in self._unwritten:
                self._write_again(meta, block, tier)  # type: ignore[arg-type]
        finally:
            # Also when its host copy raised (out of memory for a pinned buffer): a block in
            # no tier leaves the index, or later commits would take it as stored.
            self._settle(meta)
            self._unsettled.discard(meta.key)

    def _settle(self, meta: BlockMeta) -> bool:
        """Make a block's index entry follow the tiers, after a move that ended or that an
        exception cut short (out of memory, Ctrl-C): resident where a tier holds its key, and out
        of the index where it rests nowhere. Whether it is still in the index."""
        if self._index.blocks.get(meta.key) is not meta:
            return False
        where = Tier.DEVICE if meta.key in self._device else Tier.HOST if meta.key in self._host else None
        self._index.set_resident(meta, where)
        if where is None and meta.disk is DiskState.NONE:
            self._remove(meta)
            return False
        return True

    def _set_inflight(self, key: bytes, job: Job[Any]) -> None:
        # The entry and its buffer's hold together (Lease.hold_in): another signal's handler
        # raising between them left a hold that no pop let go, or an entry whose pop let go of
        # the host tier's hold.
        # One recorded for the key already (a write queued again over one still tracked: a reap
        # cut short once it put the block back) is let go of first: recorded over, its hold was
        # never let go, its buffer lost to the pool for good.
        self._pop_inflight(key)
        if job.lease is None:
            self._inflight[key] = job
        else:
            job.lease.hold_in(self._inflight, key, job)

    def _pop_inflight(self, key: bytes) -> None:
        job = self._inflight.get(key)
        if job is None:
            return
        if job.lease is None:
            self._inflight.pop(key, None)
        else:
            job.lease.unhold_from(self._inflight, key)  # as _set_inflight's

    def _evict_from_disk(self) -> int:
        """Evict the least recently used unpinned disk block; its bytes, or 0 if there is none."""
        meta = self._victim(Tier.DISK)
        if meta is None:
            return 0
        # Counted by the delete (_delete_on_disk, or _finish_deletes for one cut short), as its
        # note goes: counted here first, one a cut left undone was counted again when evicted.
        # Noted first: a cut between the delete and the removal of a block resting nowhere else
        # left it in the index in no tier, never evicted again, its session holding it.
        self._unsettled.add(meta.key)
        self._delete_on_disk([meta], evicted=True)
        self._settle(meta)
        self._unsettled.discard(meta.key)
        return meta.record_bytes

    def _free_disk(self) -> None:
        """Evict least-recently-used disk blocks down to ``_disk_goal``, below what the budget asks.

        A goal in bytes, not bytes to free: an eviction that another signal's handler cuts short
        once the block's bytes left the disk tier is not evicted again by the next call. Bytes
        counted as freed ran the evictions of a reap that such an exception cut short again."""
        while self._disk_goal is not None and self._index.bytes[Tier.DISK] > self._disk_goal:
            if self._evict_from_disk() == 0:
                break
        self._disk_goal = None

    def _delete_on_disk(self, metas: Iterable[BlockMeta], evicted: bool = False,
                        superseded: tuple[bytes, str | None] | None = None) -> None:
        """Delete blocks on disk, their records zeroed (``evicted``: by the budget, zeroed a
        transaction later; ``superseded``: the session (sid, tenant) whose longer chain replaced them;
        ``DeleteBlocks``)."""
        keys: list[bytes] = []
        refs: list[bytes] = []
        footprint = 0
        gone: list[BlockMeta] = []
        for meta in metas:
            if meta.disk is not DiskState.NONE:
                keys.append(meta.key)
                footprint += meta.record_bytes
                refs.extend([sid + meta.key for sid in meta.sessions])
                gone.append(meta)
        if not gone:
            return
        # Noted until the delete is queued (or gathered), the index letting go of the records
        # first (an open that finds a durable block's record gone takes it for damage): another
        # signal's handler raising in between left records that the index no longer knew and no
        # delete reached (a forget of their session left them and its references in the file:
        # the forgotten KV back after a restart). The next _reap does a noted delete again
        # (_finish_deletes), at worst queueing it twice.
        note = (gone, keys, refs, footprint, evicted, superseded)
        place = id(note)
        self._deleting[place] = note
        self._let_go_of_records(gone)
        self._queue_deletes(keys, refs, footprint, evicted, superseded)
        if evicted:
            self._evictions += len(keys)
        del self._deleting[place]  # no call since the count: a signal's handler cannot run between

    def _let_go_of_records(self, gone: list[BlockMeta]) -> None:
        for meta in gone:
            self._index.set_disk(meta, DiskState.NONE)
            # The write's host copy first, while the write is still tracked: let go of after it,
            # another signal's handler raising between them left it recorded for a write no
            # longer tracked, where the next reap finished the forget first (the block out of
            # the index, which _finish_deletes then passes over): the buffer held until close,
            # and lost to the pool for good once the same KV was written again. Cut before it,
            # the write is still tracked, and its reap lets go of it (a host copy held only while
            # a tracked write records it: _set_inflight, _reap_write).
            self._pop_inflight(meta.key)
            entry = self._pending_writes.get(meta.key)
            if entry is not None:
                # No call between the two: no signal's handler leaves it in both, or in neither.
                self._let_go_writes[entry[0]] = entry[1]
                del self._pending_writes[meta.key]

    def _finish_deletes(self) -> None:
        """Do again the deletes on disk that an exception cut short (``_delete_on_disk``)."""
        for place, (gone, keys, refs, footprint, evicted, superseded) in list(self._deleting.items()):
            # Only blocks still the index's: one stored again since is not let go of.
            self._let_go_of_records([m for m in gone if self._index.blocks.get(m.key) is m])
            self._queue_deletes(keys, refs, footprint, evicted, superseded)
            if evicted:
                self._evictions += len(keys)
            del self._deleting[place]

    def _queue_deletes(self, keys: list[bytes], refs: list[bytes], footprint: int, evicted: bool,
                       superseded: tuple[bytes, str | None] | None) -> None:
        """``_delete_on_disk``'s ``DeleteBlocks``, gathered or queued."""
        if not keys or self._writer is None:
            return
        if self._gathering and superseded is None:
            if self._gathered is not None and self._gathered.evicted != evicted:
                # A forget's records are zeroed in their transaction, evictions' later.
                self._submit_gathered(deletes_only=True)
            if self._gathered is None:
                self._gathered = DeleteBlocks([], [], evicted)
            self._gathered.keys += keys
            self._gathered.refs += refs
            self._gathered.footprint += footprint
            if len(self._gathered.keys) >= FORGET_DELETE_KEYS:
                self._submit_gathered(deletes_only=True)
            return
        self._submit(DeleteBlocks(keys, refs, evicted, superseded is not None, superseded, footprint=footprint))

    def _gathering_deletes(self) -> "_GatheringDeletes":
        """Within it (a forget, the evictions that make room on disk), block deletes (not
        superseded tails, each its session's) go in ``DeleteBlocks`` of up to
        ``FORGET_DELETE_KEYS`` blocks, a forget's and the evictions' apart. Every other write,
        block writes too, is queued after the deletes gathered before it (``_submit``,
        ``_queue_write``), so the writes land in the order they did one delete an op; what is
        gathered at the end of the outermost one is queued then, also when an exception ends it
        (the blocks are out of the index: only this delete finds them)."""
        return _GatheringDeletes(self)

    def _submit_gathered(self, deletes_only: bool = False) -> None:
        """Queue the deletes gathered, then (unless ``deletes_only``) the sessions' references,
        after the deletes of their blocks as when each session's went alone; ``holders`` as they
        are now, at the end of the forget (a keeping session forgotten later in it keeps nothing)."""
        # Each taken out once queued (_submit tracks it): another signal's handler raising before
        # then lost it (forgotten records, or a forgotten session's references, left in the
        # file). Cut after, it is queued twice, by the gathering's exit: deletes are idempotent.
        op = self._gathered
        if op is not None:
            self._submit(op, gathered=True)
            self._gathered = None
        while self._gathered_drops and not deletes_only:
            drops = [DropRefs(sid, keys, drop_session=True, holders=self._holders(keys))
                     for sid, keys in self._gathered_drops[:FORGET_DELETE_KEYS]]
            self._submit(drops[0] if len(drops) == 1 else DropSessions(drops), gathered=True)
            del self._gathered_drops[:FORGET_DELETE_KEYS]

    def _remove(self, meta: BlockMeta) -> None:
        """Take a block out of the index; a session left with no block of its own goes too (in
        LMDB as well), so a long-running store does not keep every session it ever saw."""
        sids = list(meta.sessions)
        # Noted before the block goes: another signal's handler raising between its removal and
        # the untracking left a hollow session tracked for good (_reap looks at it now).
        self._hollow.update(sids)
        self._index.remove(meta.key)
        self._unwritten.pop(meta.key, None)
        for sid in sids:
            self._untrack_if_hollow(sid)

    def _untrack_if_hollow(self, sid: bytes) -> None:
        """Stop tracking a session none of whose blocks is its alone, in the index and in LMDB.

        Every block it references is then referenced by another session, which keeps it: nothing
        that ``forget`` would have dropped is lost to it, as each block still has a session to be
        forgotten with. Without this, a session whose own blocks were evicted, or one that only
        repeated another's conversation, stayed for as long as the shared prefix (a system
        prompt) lived, and their number grew with every session ever seen.

        On disk its rows go with a ``DropRefs`` that also writes a keeping session's reference to
        each block (``_holders``), as every ``DropRefs`` does.

        Noted in ``_hollow`` until done, the session leaving the index last, so that one another
        signal's handler cut short is finished by the next look (``_reap``), its ``DropRefs``
        queued at least once (twice where the cut fell between it and the session's leaving);
        a block that no longer names it is not its own. Before, a cut after the session left
        lost its ``DropRefs`` (its rows kept in LMDB), and one part-way through its blocks left it
        naming blocks that did not name it, which a look again took for its own."""
        info = self._index.sessions.get(sid)
        if sid in self._committing:
            # A session part-way through its commit is not hollow: the blocks it has placed so far
            # are referenced on disk ahead of their writes, but in the index only at its end, and
            # its DropRefs would delete those references (forget would not find the blocks).
            return
        blocks = self._index.blocks
        own = info is None
        for key in () if info is None else info.keys:
            holders = blocks[key].sessions
            if len(holders) == 1 and sid in holders:
                own = True
                break
        if own:
            self._hollow.discard(sid)
            return
        self._hollow.add(sid)
        keys = list(info.keys)
        for key in keys:
            self._index.unname(blocks[key], sid)
        self._owed.drop_refs(sid)  # a retry would write none of them
        if self._writer is not None:
            self._submit(DropRefs(sid, keys, drop_session=True, holders=self._holders(keys)))
        self._index.drop_session(sid)
        self._hollow.discard(sid)

    def _holders(self, keys: Iterable[bytes]) -> list[tuple[bytes, str | None, bytes]]:
        """For each of ``keys`` still on disk and referenced, one session that references it:
        a ``DropRefs`` writes that session's reference again with its own deletes. Its ``PutRefs``
        may never have landed (a failed batch is not retried; after a disk fault none is sent),
        and the reference that kept the block findable on disk may be the one being deleted
        (found by review: after a restart no ``forget`` found such blocks, which restored in full)."""
        holders = []
        for key in keys:
            meta = self._index.blocks.get(key)
            if meta is not None and meta.sessions and meta.disk is not DiskState.NONE:
                holder = next(iter(meta.sessions))
                holders.append((holder, self._index.sessions[holder].tenant, key))
        return holders

    def _drop(self, meta: BlockMeta, superseded: tuple[bytes, str | None] | None = None) -> None:
        """Remove a block from every tier and the index (``superseded``: see ``DeleteBlocks``)."""
        self._unsettled.add(meta.key)  # as _evict_from_disk's
        if meta.resident is Tier.DEVICE:
            self._device.pop(meta.key)
        elif meta.resident is Tier.HOST:
            self._host.pop(meta.key)
        self._delete_on_disk([meta], superseded=superseded)
        self._remove(meta)
        self._unsettled.discard(meta.key)

    def _reap(self, keys: Iterable[bytes] | None = None) -> None:
        """Record finished disk writes (of ``keys``, or all): DURABLE on success; on failure the
        block stays in memory only. Never waits."""
        if keys is None:
            if self._gathering or self._gathered is not None or self._gathered_drops:
                # Every _reap() runs outside the gathering sections: one here is left by an exit
                # another signal's handler cut short as it began (the store gathering for good,
                # what it gathered queued by no one until another write came).
                self._gathering = False
                self._submit_gathered()
            for end in list(self._ending):  # a commit's cleanup cut short
                self._end_commit(end)
            for sid in list(self._forgetting):  # a forget cut short
                self._forget_session(sid)
            for what in list(self._forgets_owed):  # after those: the sessions it had not reached
                self._forget(what)
            self._finish_deletes()
            for key in list(self._unsettled):  # left by an exception (another signal's handler)
                meta = self._index.blocks.get(key)
                if meta is not None:
                    self._settle(meta)
                self._unsettled.discard(key)
            for sid in list(self._hollow):  # as those
                self._untrack_if_hollow(sid)
            self._unpin_orphans()
            self._let_go_leases()
            self._reap_deletes()
            self._host.reclaim()
        with self._gathering_deletes():  # the evictions that writes refused at the map's cap ask for
            self._reap_writes(keys)

    def _reap_writes(self, keys: Iterable[bytes] | None = None) -> None:
        """``_reap``'s work for the block writes of ``keys``, or for those done, in the order they
        were queued (``_write_order``: up to the first not done) and those whose submit was cut
        short (``_submitting``).

        A write leaves ``_pending_writes`` last, its work before that idempotent, and what it
        counts counted by the statement that takes it out, with no call between them (where no
        signal's handler runs), the room a refusal at the map's cap makes too (``_disk_goal``,
        made by ``_free_disk`` after; a reap run again made it again): another
        signal's handler raising part-way (Ctrl-C alone is held off) leaves it to the next reap,
        which neither loses nor doubles that work. Taken out
        first, a failed write cut short left its block PENDING for good, its host buffer let go
        (the next open planning it failed on a KeyError)."""
        if self._disk_goal is not None:
            self._free_disk()  # the room a reap cut short still owes, before another write's
        if keys is not None:
            for key in keys:
                entry = self._pending_writes.get(key)
                if entry is not None and self._done_or_not_queued(entry[0]):
                    self._reap_write(key, *entry)
            return
        for job, key in list(self._submitting.items()):
            if key is not None:
                entry = self._pending_writes.get(key)
                if self._unqueued(job) and entry is not None and entry[0] is job:
                    self._reap_write(key, *entry)
                del self._submitting[job]
        order = self._write_order
        while order:
            key, job = order[0]
            entry = self._pending_writes.get(key)
            if entry is not None and entry[0] is job:
                if not self._done_or_not_queued(job):
                    break  # nor is any queued after it
                self._reap_write(key, *entry)
            elif job in self._let_go_writes:
                if not self._done_or_not_queued(job):
                    break
                self._reap_write(key, job, self._let_go_writes[job], tracked=False)
            del order[0]  # after its work: an entry cut short is reaped, or passed over, again

    def _reap_write(self, key: bytes, job: Job[None], header: RecordHeader, tracked: bool = True) -> None:
        """``_reap_writes``' work for the done write ``job`` of ``key``, which it takes out of
        ``_pending_writes`` (or, not ``tracked``, ``_let_go_writes``: its outcome counted, the
        index and the host copies, another write's now, left alone) last."""
        meta = self._index.blocks.get(key) if tracked else None
        error = job.error()  # outside any try: a signal handler's exception is not the disk's
        noted = job in self._let_go_writes  # Job's hash is object's: no call
        if error is None:
            if meta is not None and meta.disk is DiskState.PENDING:
                self._index.set_disk(meta, DiskState.DURABLE)
            if tracked:
                self._pop_inflight(key)
                del self._pending_writes[key]
            if noted:
                del self._let_go_writes[job]
            return
        # A refused block stays in memory if it rests there, and its write is tried again when
        # it leaves memory and at each flush (so is one that was never queued); any fault
        # degrades the store to memory-only.
        refused, faulted = self._write_failed(error)
        if isinstance(error, WriteAbandoned):
            meta = None
        if meta is not None and meta.disk is not DiskState.DURABLE:
            self._index.set_disk(meta, DiskState.NONE)
            if meta.resident is None:
                self._remove(meta)
            elif not faulted:
                self._unwritten[key] = header
        # At the cap as much again leaves the disk, so the free list has room for the next
        # writes; a full filesystem gains nothing by it (freed pages stay in the file). From
        # the header: a block that left the index before a cut asked for it too.
        room = self._footprint(header) if refused and not isinstance(error, FilesystemFull) and \
            (meta is None or meta.disk is not DiskState.DURABLE) else 0
        if tracked:
            self._pop_inflight(key)
        disk_bytes = self._index.bytes[Tier.DISK] if room else 0  # Tier's hash is a call: before the span
        # No call from here to the write's leaving: no signal's handler runs in between.
        if room:
            self._disk_goal = disk_bytes - room
        if tracked:
            del self._pending_writes[key]
        if noted:
            del self._let_go_writes[job]
        self._disk_full += refused
        self._disk_errors += faulted
        if room:
            self._free_disk()

    def _apply_writes(self, ops: list[DiskOp]) -> list[BaseException | None]:
        """The writer thread's batch: one LMDB transaction, then its bytes counted as one move."""
        assert self._disk is not None
        started, waited = time.perf_counter(), cpu_wait_seconds()
        try:
            results = self._disk.apply(ops)
        finally:
            # Read by stats() from other threads: float stores, atomic under the GIL.
            seconds = time.perf_counter() - started
            self._write_seconds += seconds
            if waited is not None:
                self._write_cpu_wait += (cpu_wait_seconds() or waited) - waited
        # KV bytes, as every other direction counts them; the records' footprints are the disk tier's bytes.
        written = sum(op.header.payload_nbytes for op, error in zip(ops, results)
                      if isinstance(op, PutBlock) and error is None)
        if written:
            self._count_move("host_to_disk", written, seconds=seconds)
        return results

    def _count_move(self, direction: str, nbytes: int, job: Job[Any] | None = None,
                    seconds: float | None = None) -> None:
        # host_to_disk is only added to by the writer thread, the others under the store lock.
        self._moved[direction] += nbytes
        if self._events.active:
            timer = copy_timer(job) if job is not None else None
            # Without a timer the move was a hand-over that copied nothing (CPU device tier).
            self._events.emit(MoveEvent(direction, nbytes, None if timer is not None else (seconds or 0.0), timer))

    def _disk_fault(self, exc: BaseException, counted: bool = True) -> None:
        """A disk I/O error, or LMDB's damaged pages: count it (unless not ``counted``: the
        caller does), and from the first one on, run on the device and host tiers only (no more
        writes through), with one warning rather than one per block. Damage (``UNREADABLE``,
        ``DamagedTables``) is named as such, not as a failing disk: writes into a damaged B-tree
        fail every time, and only a repair or a new store ends it."""
        if counted:
            self._disk_errors += 1
        damage = isinstance(exc, UNREADABLE)
        if damage and not self._disk_damaged:
            self._disk_damaged = True
            self._disk_failed = True
            logger.warning("tierkv: %s. Continuing with the device and host tiers only, blocks not yet written "
                           "stay in memory", exc if isinstance(exc, DamagedTables) else
                           DamagedTables(self._disk.path if self._disk is not None else "?", exc))
        elif not self._disk_failed:
            self._disk_failed = True
            # What to do was left unsaid: the store never writes through again (_disk_failed), a
            # new one on a sound disk does.
            logger.warning("tierkv: disk tier I/O error (%s); continuing with the device and host tiers only, "
                           "blocks not yet written stay in memory. stats()['disk_errors'] counts further errors. "
                           "Check the disk, then close the store and reopen it to write through to disk again",
                           exc)
        else:
            logger.debug("tierkv: disk tier %s (%s)", "damaged" if damage else "I/O error", exc)

    def _submit(self, op: DiskOp, gathered: bool = False) -> Job[None] | None:
        """Queue a bookkeeping write (refs, deletes, stamps); ``gathered``: one of those
        ``_submit_gathered`` queues. Once the disk has failed only deletes and references are
        still tried: they are what keeps forgotten KV from coming back after a restart
        (references to blocks already on disk; no new block is written then)."""
        if not gathered:
            self._submit_gathered()  # the writes gathered so far go first, as they were made
        must_land = isinstance(op, (DeleteBlocks, DropRefs, DropSessions, PutRefs))
        if self._writer is None or (self._disk_failed and not must_land):
            return None
        if self._writer.closed:
            # A close cut short and called again: a delete that cannot be queued stays owed (and
            # is logged as such), it is not lost.
            if must_land:
                for part in op.drops if isinstance(op, DropSessions) else [op]:  # type: ignore[union-attr]
                    self._owed.append(part)  # type: ignore[arg-type]
            return None
        if not must_land:
            return self._writer.submit(op)
        # Tracked before it is queued: another signal's handler raising as submit returned left a
        # queued delete untracked, and a failure of it owed by no one (forgotten KV kept).
        job: Job[None] = Job()
        self._submitting[job] = None  # as _queue_write's
        self._deletes.append((op, job))  # type: ignore[arg-type]
        self._deletes_queued += 1
        try:
            self._writer.submit(op, job)
        except BaseException as exc:
            self._unless_queued(job, exc)  # owed by the next reap, not a disk fault
            raise
        del self._submitting[job]
        return job

    def _done_or_not_queued(self, job: Job[None]) -> bool:
        """A tracked write's job is done, or failed now as ``WriteNotQueued`` where the writer
        does not hold it: ``_unless_queued`` cut short in its turn (a second signal's handler
        raising in the first one's cleanup) left it tracked, never queued and never done, passed
        by every reap after it (a delete owed by no one, a block PENDING for good). Only under the
        store's lock, where no ``submit`` of it is under way."""
        if job.done():
            return True
        if self._writer is None or self._writer.holds(job):
            return False
        job.set_error(WriteNotQueued("not queued: its submit was cut short"))
        return job.done()

    def _unless_queued(self, job: Job[None], exc: BaseException) -> None:
        """Fail a tracked write whose ``submit`` ``exc`` cut short with ``WriteNotQueued``, unless
        the writer queued it all the same (``BackgroundWriter.holds``): then it lands, or fails, as
        any other."""
        assert self._writer is not None
        if not self._writer.holds(job):
            job.set_error(WriteNotQueued(f"not queued: {exc!r}"))

    def _reap_deletes(self) -> None:
        """Move failed deletes to the owed list (and count the fault). Never waits.

        Asks the ops in the order they were queued, up to the first not done (the writer is one
        FIFO thread: none queued after it is done), and those whose submit was cut short
        (``_submitting``), wherever they lie: its cost is the ops that finished since the last
        reap, not the writer's backlog.

        Each op leaves ``_deletes`` only once its work is done, and that work is idempotent, so
        that an exception part-way (another signal's handler: Ctrl-C alone is held off), with the
        next reap doing the op's work again, neither loses nor doubles it: owing an op owed
        already keeps its one entry (``OwedOps``), and the fault is counted by the statement that
        takes the op out, with no call between them, where no handler runs. Before, the list was
        reassigned at the end: the ops reaped before such an exception were owed again by the
        next reap, ``owed_deletes`` counting them twice."""
        deletes = self._deletes
        for job, key in list(self._submitting.items()):
            if key is None:
                if self._unqueued(job):
                    # Rare (a cut submit): a walk of the list to find it.
                    at = [i for i, (_, queued) in enumerate(deletes) if queued is job]
                    if at:
                        self._reap_delete(at[0])
                del self._submitting[job]
        while deletes and self._reap_delete(0):
            pass

    def _reap_delete(self, i: int) -> bool:
        """``_reap_deletes``' work for the op at ``i`` in ``_deletes``: False if it is not done."""
        deletes = self._deletes
        op, job = deletes[i]
        if not self._done_or_not_queued(job):
            return False
        error = job.error()  # not wait() in a try: its except took a signal handler's exception for the op's
        if isinstance(error, WriteAbandoned):  # a superseded tail's delete a close gave up: not owed
            del deletes[i]
            return True
        parts = op.drops if isinstance(op, DropSessions) else [op]
        for part in parts:
            self._reaped(part, error)
        faulted = error is not None and not isinstance(error, WriteNotQueued)
        failed = len(parts) if faulted else 0  # a fault each, as one op each was
        del deletes[i]
        self._disk_errors += failed
        return True

    def _unqueued(self, job: Job[None]) -> bool:
        """A tracked job failed as never queued (``_done_or_not_queued`` fails it so now where the
        writer does not hold it). Under the store's lock."""
        return self._done_or_not_queued(job) and isinstance(job.error(), WriteNotQueued)

    def _reaped(self, op: DeleteBlocks | DropRefs | PutRefs, error: BaseException | None) -> None:
        """``_reap_deletes``' work for one op that landed, or failed with ``error``."""
        if error is not None:
            if not isinstance(error, WriteNotQueued):
                self._disk_fault(error, counted=False)  # counted as its op leaves _deletes
            if isinstance(op, DropRefs) and op.sid not in self._sessions_on_disk:
                # No reference of this session ever reached the disk (one made after the disk
                # failed): owing its delete grew the owed list by a session at a time, each
                # retried at every flush. Owed: the references it was to write for others.
                self._owe_holders(op)
            elif isinstance(op, PutRefs):
                self._owe_refs(op.sid, op.tenant, op.keys)
            else:
                self._owed.append(op)
        elif isinstance(op, PutRefs):
            self._sessions_on_disk.add(op.sid)
        elif isinstance(op, DropRefs):
            self._sessions_on_disk.update(holder for holder, _, _ in op.holders)
            if op.drop_session:
                self._sessions_on_disk.discard(op.sid)

    def _owe_holders(self, op: DropRefs) -> None:
        held: dict[tuple[bytes, str | None], list[bytes]] = {}
        for holder, tenant, key in op.holders:
            held.setdefault((holder, tenant), []).append(key)
        for (holder, tenant), keys in held.items():
            self._owe_refs(holder, tenant, keys)

    def _owe_refs(self, sid: bytes, tenant: str | None, keys: list[bytes]) -> None:
        """Owe the session's references to ``keys`` in the one ``PutRefs`` it owes (a retry writes
        those still held, ``_owed_refs``); nothing for a session gone since, whose retry would
        write none (a commit of it again references its blocks anew). Appended, a failed disk
        owed one more for each commit of a session to blocks on disk and for each session that
        went while another kept its blocks: the list grew with every session that came and went
        between flushes (2 a session: 400 after 200 without a flush), and a flush merged only
        those it retried (``OWED_RETRY_PROBE``). Its entry is found by sid (``OwedOps``), not by
        scanning the list."""
        if sid not in self._index.sessions and sid not in self._committing:
            return
        self._owed.owe_refs(sid, tenant, keys)

    def _retry_deletes(self, limit: int | None = None) -> list[Job[None]]:
        """Queue the owed deletes again, less what was stored again since: a block written again
        (same key, so the same KV) stays, a block whose new write is still queued stays owed until
        that write is settled, and references and sessions that are live again stay. With a
        ``limit`` (``OWED_RETRY_PROBE``), only the first owed ops worth ``limit`` of the writer's
        items (``op_count``: one transaction), or the next ones while those queue nothing; the
        others stay owed, ahead of those that fail again. Returns the queued writes' jobs."""
        with defer_interrupts():  # Ctrl-C held off: the owed list is taken whole, and put back
            self._reap()
            owed = self._owed.take()
            try:
                return self._retry_owed(owed, limit)
            finally:
                # Also when another signal's handler raises in it (Ctrl-C alone is held off):
                # what it did not queue stays owed (_retry_owed leaves it in ``owed``).
                self._owed.put_back(owed)

    def _retry_owed(self, owed: list[DeleteBlocks | DropRefs | PutRefs], limit: int | None) -> list[Job[None]]:
        """``_retry_deletes``' loop over the taken ``owed``, which it leaves holding what it did not
        queue, in order (the op an exception cut short among them), also when it raises."""
        jobs: list[Job[None]] = []
        while owed and not jobs:
            if limit is None:
                chunk, owed[:] = owed[:], []
            else:
                # ``limit`` of the writer's items, as it counts them (``op_count``: a forget's
                # DeleteBlocks, a block each), so a probe is one transaction; at least one op.
                n = count = 0
                while n < len(owed) and (n == 0 or count + op_count(owed[n]) <= limit):
                    count += op_count(owed[n])
                    n += 1
                chunk, owed[:] = owed[:n], owed[n:]
            try:
                jobs += self._queue_owed(chunk)
            finally:
                owed[:0] = chunk  # what _queue_owed did not get to: nothing once it returned
        return jobs

    def _queue_owed(self, owed: list[DeleteBlocks | DropRefs | PutRefs]) -> list[Job[None]]:
        """``_retry_deletes``' work for ``owed``; the jobs of what it queued. ``owed`` is left
        holding what it did not get to: nothing once it returns; where an exception cut it short,
        what was left of the op it landed in and the ops after it.

        Each op is replaced in ``owed`` by what is left to do of it (``_owed_parts``, the op itself
        where nothing of it is left out) in one statement, and each part leaves ``owed`` in the
        statement after the call that owes or queues it: another signal's handler raising between
        (Ctrl-C alone is held off) leaves that part both owed and put back, or queued and put
        back, one object either way, owed once (``OwedOps`` is keyed by the op; a queued one that
        fails is owed as itself), and at worst written twice. Before, the op stayed in ``owed``
        until its narrowed copy was queued, or its blocks still PENDING owed as a new op: one
        raising between left the op put back and its copy owed as well, the same blocks owed
        twice (``owed_deletes`` counting them twice, each retried at every probe)."""
        jobs: list[Job[None]] = []
        # Ops a retry cut short queued and put back, still queued: owed as they are (a failure
        # owes them as themselves), not queued again as copies that could fail too.
        queued = {id(part) for op, job in self._deletes if not job.done()
                  for part in (op.drops if isinstance(op, DropSessions) else [op])}
        while owed:
            if id(owed[0]) in queued:
                self._owed.append(owed[0])
                del owed[0]
                continue
            later, now = self._owed_parts(owed[0])
            owed[0:1] = later + now  # no call: the op, or its parts
            for op in later:
                self._owed.append(op)
                del owed[0]
            for op in now:
                job = self._submit(op)
                del owed[0]
                if job is not None:
                    jobs.append(job)
        return jobs

    def _owed_parts(self, op: DeleteBlocks | DropRefs | PutRefs) -> tuple[list[DeleteBlocks | DropRefs | PutRefs],
                                                                            list[DeleteBlocks | DropRefs | PutRefs]]:
        """What is left to do of an owed op: (the ops to owe again, the ops to queue), filtered as
        ``_retry_deletes`` says. Reads only."""
        if isinstance(op, PutRefs):  # one a session (OwedOps), all it owes
            keys = self._owed_refs(op)
            return [], [PutRefs(op.sid, self._index.sessions[op.sid].tenant, keys)] if keys else []
        if isinstance(op, DeleteBlocks):
            state = {k: (self._index.blocks[k].disk if k in self._index.blocks else DiskState.NONE)
                     for k in op.keys}
            owe: list[DeleteBlocks | DropRefs | PutRefs] = []
            queue: list[DeleteBlocks | DropRefs | PutRefs] = []
            later = [k for k in op.keys if state[k] is DiskState.PENDING]
            if len(later) == len(op.keys):
                owe.append(op)
            elif later:
                wait = set(later)  # a forget's op holds dozens of blocks: sets, not list scans
                owe.append(_narrowed(op, later, [r for r in op.refs if r[KEY_BYTES:] in wait]))
            now = [k for k in op.keys if state[k] is DiskState.NONE]
            gone = set(now)
            refs = [r for r in op.refs
                    if r[KEY_BYTES:] in gone and not self._live_ref(r[:KEY_BYTES], r[KEY_BYTES:])]
            if len(now) == len(op.keys) and len(refs) == len(op.refs):
                queue.append(op)
            elif now:
                queue.append(_narrowed(op, now, refs))
            return owe, queue
        keys = [k for k in op.keys if not self._live_ref(op.sid, k)]
        drop_session = op.drop_session and op.sid not in self._index.sessions
        if not keys and not drop_session:
            return [], []
        # As _narrowed: a superseded tail's references, retried, are still a close's to give up.
        return [], [dataclasses.replace(op, keys=keys, drop_session=drop_session, holders=self._holders(keys))]

    def _owed_refs(self, op: PutRefs) -> list[bytes]:
        """The references of an owed ``PutRefs`` still to write: held, to blocks still on disk."""
        return [k for k in op.keys if self._live_ref(op.sid, k) and self._index.blocks[k].disk is not DiskState.NONE]

    def _live_ref(self, sid: bytes, key: bytes) -> bool:
        info = self._index.sessions.get(sid)
        return info is not None and key in info.keys

    def _owed_keys(self) -> int:
        """Entries whose delete is owed (``stats()["owed_deletes"]``); owed references are not deletes."""
        return sum(len(op.keys) + (isinstance(op, DropRefs) and op.drop_session) for op in self._owed
                   if not isinstance(op, PutRefs))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, meta: BlockMeta) -> None:
        self._index.touch(meta)
        if self._writer is not None and meta.disk is not DiskState.NONE:
            self._stamps[meta.key] = self._tick()

    def _pin(self, pins: list[bytes], keys: Iterable[bytes]) -> None:
        for key in keys:
            self._pinned[key] += 1
            pins.append(key)

    def _let_go_leases(self) -> None:
        """Let go of the pool buffers that ended opens held (``_held_leases``: each open's holds,
        ``Lease.hold_in``), from any thread, with or without the store's lock (the pool's own
        guards a lease). ``unhold_from`` lets go of a hold once, with its record, so a let-go cut
        short is finished by the next call's ``_reap``, none let go twice; an open's holds leave
        the list once none is left (an empty one taken for another by ``remove`` holds none)."""
        for holders in list(self._held_leases):
            for key, lease in list(holders.items()):
                lease.unhold_from(holders, key)
            if not holders:
                try:
                    self._held_leases.remove(holders)
                except ValueError:
                    pass  # another thread's let-go took it out

    def _unpin_orphans(self) -> None:
        """Let go of the pins handed over to ``_orphaned_pins`` (under the lock: other threads
        only append). Each leaves the queue once its count is down, with no point between where
        another signal's handler runs (``del`` is no call), so a let-go cut short is finished by
        the next, none lost and none let go twice (another turn's pin of the same block kept)."""
        orphans, pinned = self._orphaned_pins, self._pinned
        while orphans:
            key = orphans[0]
            left = pinned.get(key, 0) - 1
            if left > 0:
                pinned[key] = left
            elif key in pinned:
                del pinned[key]
            orphans.popleft()

    def _touch_chain(self, chain: list[BlockMeta]) -> None:
        # Tail first, head last: a conversation's head becomes the most recently used, so eviction
        # takes tails before the prefixes they depend on (a block without its parent is useless).
        for meta in reversed(chain):
            self._touch(meta)

    def _write_stamps(self) -> None:
        """Queue last-use stamps for the LRU order a reopen rebuilds; one small write per turn."""
        if self._stamps and self._writer is not None:
            stamps = {k: v for k, v in self._stamps.items()
                      if k in self._index.blocks and self._index.blocks[k].disk is not DiskState.NONE}
            self._stamps = {}
            if stamps:
                self._submit(Touch(stamps))

    def _drop_replaced_tails(self, sid: bytes) -> None:
        """Let go of a session's partial tails that another of its blocks after the same parent
        covers: a crash between a commit's block writes and the later transaction that deletes
        the tails they replace (``DiskTier.apply``) leaves both, and the tail would take room
        under the disk budget that the reopen then freed by evicting other blocks. A tail of a
        session's later, shorter conversation (a shorter regenerated reply) goes the same way: the
        longer block restores its tokens."""
        info = self._index.sessions[sid]
        metas = [self._index.blocks[key] for key in info.keys]
        self._release_tails(sid, [tail for tail in metas if tail.n_tokens < self.block_size and any([
            other is not tail and other.parent == tail.parent and other.n_tokens > tail.n_tokens
            and _same_ids(other.token_ids[:tail.n_tokens], tail.token_ids) for other in metas])])

    def _release_unheld_tails(self, tenant: str | None, root: bytes, ids: np.ndarray, chain: list[BlockMeta]) -> None:
        """A turn of no session lets go of the partial tails no session holds that its chain
        replaced (a longer one after the same parent covers their tokens), as a session lets go
        of its own: kept, each turn's tail stayed at rest in every tier until the LRU order reached
        it, a dead block per turn of every conversation run without a session."""
        B = self.block_size
        in_chain = {m.key for m in chain}
        stale = []
        data = token_bytes(ids)  # once, not a block's ids at a time (0.5 us a block more at 16 tokens)
        for i, parent in enumerate([root, *(m.key for m in chain)]):
            start = i * B
            if start >= len(ids):
                break
            for meta in self._index.prefixes_of(parent, data[start * 8:(start + B) * 8]):
                n = meta.n_tokens
                if n < B and not meta.sessions and meta.key not in in_chain and start + n <= len(ids) \
                        and _same_ids(ids[start:start + n], meta.token_ids):
                    stale.append(meta)
        for tail in stale:
            # After the chain's writes, as a session's (superseded); no session's to forget: a tenant's.
            self._drop(tail, superseded=(b"", tenant))

    def _release_tails(self, sid: bytes, tails: list[BlockMeta]) -> None:
        """The session lets go of partial tails a longer chain of its own replaced: a tail no
        other session holds is deleted, after the writes queued before it (``superseded``)."""
        owner = (sid, self._index.sessions[sid].tenant)
        for tail in tails:
            self._index.unref(sid, tail)
            if not tail.sessions:
                self._drop(tail, superseded=owner)
        # A tail never queued for the disk (every turn's, after a disk failure) has no reference
        # there: owed at each failure, its DropRefs grew the owed list by one a turn of every
        # session on disk, each retried at every flush.
        keys = [tail.key for tail in tails if tail.ever_on_disk]
        if keys and self._writer is not None:
            self._submit(DropRefs(sid, keys, holders=self._holders(keys), superseded=True, owner=owner))

    def _discard_restore(self, cache: TieredCache) -> None:
        """The cache threw its restored prefix away (assisted decoding, ``cache.reset()``): those
        tokens are computed after all, counted as missed and discarded, and the cache counts none
        restored. Hits stay as they were (counters only grow: metrics export them as such)."""
        zeros = dict.fromkeys(cache.restored_from, 0)
        with self._lock:
            # Those still held: a crop below the restore counted the ones it gave back (_give_back).
            n = cache._restored_held
            # One statement, the cache's counts with the store's: a reset cut between them by
            # another signal's handler, and made again, counted the tokens twice; cut between the
            # cache's own, ``restored_from`` kept summing to tokens ``restored_tokens`` no longer
            # counted, for good (h128).
            self._discarded, self._misses, cache.restored_tokens, cache._restored_held, cache.restored_from = \
                self._discarded + n, self._misses + n, 0, 0, zeros

    def _give_back(self, cache: TieredCache, length: int) -> None:
        """A crop of ``cache`` to ``length`` tokens gave back the restored ones past it: computed
        again, they are counted as missed and discarded, as a reset's are (a crop to nothing
        counted none). ``restored_tokens`` stays what the open restored."""
        with self._lock:
            held = cache._restored_held
            n = max(held - max(length, 0), 0)
            # One statement, as _discard_restore's: a crop cut part-way and made again counts once.
            self._discarded, self._misses, cache._restored_held = self._discarded + n, self._misses + n, held - n

    # -- reopen -------------------------------------------------------------------------------------
    def _load_index(self) -> None:
        assert self._disk is not None
        scan = self._disk.scan()
        if scan.corrupt:
            self._corrupt += len(scan.corrupt)
            logger.warning("tierkv: %d unreadable records in %s were dropped", len(scan.corrupt), self._disk.path)
        # Stamps and sequence numbers come from one clock: a block never used since its commit
        # ranks by its commit.
        order = sorted(scan.headers, key=lambda hs: (scan.atime.get(hs[0].key, hs[0].seq), hs[0].seq))
        # Each header decoded a parent key and a tenant of its own: a block's parent shares its
        # parent's key, and a tenant's blocks one name (98 B a block).
        own_key = {header.key: header.key for header, _ in scan.headers}
        tenant_of: dict[str | None, str | None] = {}
        for header, size in order:
            meta = BlockMeta(key=header.key, parent=own_key.get(header.parent, header.parent),
                             tenant=tenant_of.setdefault(header.tenant, header.tenant),
                             token_ids=narrow_ids(np.frombuffer(header.token_ids, dtype="<i8")),
                             nbytes=header.payload_nbytes, record_bytes=self._disk.footprint_of(header, size))
            if meta.n_tokens == 0:
                continue
            self._index.add(meta, ordered=False)
            self._index.set_disk(meta, DiskState.DURABLE)
        self._index.order()
        self._sessions_on_disk.update(scan.sessions)
        self._sessions_on_disk.update(scan.bad_sessions)
        damaged = dict(scan.bad_sessions)
        for sid, (tenant, name, keys) in scan.sessions.items():
            if name is not None and _session_id(tenant, name) != sid:
                damaged[sid] = keys  # a name that is not the one this row was written under
                continue
            if any([meta.tenant != tenant for meta in map(self._index.blocks.get, keys) if meta is not None]):
                # Rows hold no name to check their sid against, but a session only ever references
                # its own tenant's blocks: a row naming another tenant would hide the session
                # from forget(tenant=...) and forget(session=..., tenant=...).
                damaged[sid] = keys
                continue
            dangling = []
            for key in keys:
                meta = self._index.blocks.get(key)
                if meta is not None:
                    self._index.ref(sid, tenant, name, meta)
                else:
                    dangling.append(key)
            alive = sid in self._index.sessions
            if dangling or not alive:
                # A session with no block left is removed, as _remove does while the store runs.
                assert self._writer is not None
                self._submit(DropRefs(sid, dangling, drop_session=not alive))
        if damaged:
            self._drop_damaged_sessions(damaged)
        for sid in list(self._index.sessions):
            self._drop_replaced_tails(sid)
        for sid in list(self._index.sessions):
            self._untrack_if_hollow(sid)  # rows that earlier builds kept
        # Damaged records, deletes a crash cut short, heads and last-use stamps of blocks whose
        # write never landed: gone in one write.
        known = {h.key for h, _ in scan.headers} | set(scan.corrupt) | set(scan.scrubbed)
        gone = known | set(scan.orphans)
        doomed = [*scan.corrupt, *scan.scrubbed, *scan.orphans, *(k for k in scan.atime if k not in gone)]
        if doomed:
            self._submit(DeleteBlocks(doomed))
        elif self._disk.owes_zeros:
            self._submit(Touch({}))  # evicted records a crash left unzeroed: zeroed by the next write
        self._clock = max([*scan.atime.values(), *(h.seq for h, _ in scan.headers), 0])
        found, found_bytes = self._index.count(Tier.DISK), self._index.bytes[Tier.DISK]
        self._make_room(Tier.DISK, 0)
        if self._index.count(Tier.DISK) < found:
            # A budget smaller than what the store holds: most often a unit left off ("1.5").
            logger.warning("tierkv: %s holds %d blocks (%s), over disk_budget=%s: the least recently used %d "
                           "were evicted. Pass a larger disk_budget to keep them", self._disk.path, found,
                           format_bytes(found_bytes), format_bytes(self._disk.budget),
                           found - self._index.count(Tier.DISK))
        heads = {k: head for k, head in scan.unindexed.items() if k in self._index.blocks}
        if heads:
            # Records without a sound head were read in full by this scan; with one, the next is not.
            self._submit(PutHeads(heads))

    def _drop_damaged_sessions(self, damaged: dict[bytes, list[bytes]]) -> None:
        """Session rows that cannot be read, or whose name does not hash to their key: the
        session is forgotten, as ``forget`` would (its name may be the one a later forget asks
        for, and must not leave its blocks behind), and counted as corrupt."""
        self._corrupt += len(damaged)
        logger.warning("tierkv: %d damaged session rows in %s were dropped, and the blocks only they referenced",
                       len(damaged), self._disk.path if self._disk is not None else None)
        with self._gathering_deletes():
            for sid, keys in damaged.items():
                self._forget_session(sid, keys)

    def _keep_superseded(self, forgotten: Callable[[bytes, str | None], bool]) -> None:
        """The queued and owed deletes of tails that a forgotten session's (``forgotten(sid,
        tenant)``) longer chains replaced are no longer a close's to give up: those tails are out
        of the index, and only these deletes find them. (A queued one that fails is owed as it is,
        and a retry keeps its nature: ``_narrowed``.)"""
        for op in itertools.chain((op for op, _ in self._deletes), self._owed):
            owner = getattr(op, "owner", None)
            if owner is not None and forgotten(*owner):
                op.forgotten = True  # type: ignore[union-attr]

    def _forget_session(self, sid: bytes, keys: list[bytes] | None = None) -> int:
        """Drop a session's references to its blocks (``keys``: those of a forget cut short) and
        the blocks no other session references, from every tier and the disk; returns how many
        blocks were dropped.

        Noted (``_forgetting``) until done, the session leaving the index last: another signal's
        handler raising part-way (before, as the session's pop returned) left blocks naming a
        session the index no longer had (a KeyError at a later forget or commit), and forgotten
        blocks kept; the next ``_reap`` finishes it (its ``DropRefs`` at worst queued twice).
        Each block it drops (and each partial tail) is in the note before it goes: the redo drops
        the unreferenced continuations below and beside those too, which it no longer finds in the
        index. Before, it started from the blocks it dropped itself: a turn without a session that
        continued the conversation stayed in the index and on disk (below a parent no lookup
        reaches), and the blocks dropped before the cut were never noted in ``_forgotten_blocks``."""
        note = self._forgetting.get(sid)
        if note is None:
            if keys is None:
                info = self._index.sessions.get(sid)
                keys = [] if info is None else list(info.keys)
            note = self._forgetting[sid] = (keys, [], [])
        keys, dropped, tails = note
        self._owed.drop_refs(sid)  # out of the index: a retry would write none of them
        for key in keys:
            meta = self._index.blocks.get(key)
            if meta is None:
                continue
            self._index.unname(meta, sid)
            if not meta.sessions:
                dropped.append(key)  # twice where a cut fell before its drop: harmless
                if meta.n_tokens < self.block_size:
                    tails.append(meta)
                self._drop(meta)
        self._drop_extensions(tails, dropped)
        self._drop_below(list(dropped), dropped)
        self._note_forgotten_blocks(dropped)
        if self._writer is not None and self._gathering:
            # Queued with the other sessions' of this forget (_submit_gathered): a tenant of
            # thousands of one-block sessions queued a DropRefs and a one-block delete each.
            self._gathered_drops.append((sid, keys))
        elif self._writer is not None:
            self._submit(DropRefs(sid, keys, drop_session=True, holders=self._holders(keys)))
        self._index.drop_session(sid)
        del self._forgetting[sid]
        return len(dropped)

    def _drop_extensions(self, tails: list[BlockMeta], dropped: list[bytes]) -> None:
        """Drop the blocks beside dropped partial tails that extend them and that no session
        references: a turn without a session that continued the conversation stored its block
        (the tail's tokens and more) under the tail's parent, not below the tail (found by
        helper-36: the forgotten tail's ids and KV stayed, and a returning session restored them).
        Noted in ``dropped`` before each drop."""
        for tail in tails:
            head = token_bytes(tail.token_ids)  # canonical: a block keeps int32 or int64 ids
            # Only those extending the tail, and shorter ones it or they extend, can matter here.
            siblings = self._index.related(tail.parent, head)
            # A session's tail that the block extends too may be what it continued (helper-41:
            # another conversation's turn, stored before this session existed): kept.
            held = [token_bytes(m.token_ids) for m in siblings if m.sessions]
            for meta in siblings:
                ids = token_bytes(meta.token_ids)
                if not meta.sessions and meta.n_tokens > tail.n_tokens and ids.startswith(head) and \
                        not any([len(other) < len(ids) and ids.startswith(other) for other in held]):
                    dropped.append(meta.key)
                    self._drop(meta)

    def _drop_below(self, parents: list[bytes], dropped: list[bytes]) -> None:
        """Drop the blocks below dropped ones that no session references: turns without a session
        that continued a forgotten conversation. Their KV was computed over it, and no lookup
        reaches them once their parent is gone (found by helper-33: they stayed at rest, on disk
        and after a restart, until evicted). Noted in ``dropped`` before each drop."""
        while parents:
            for meta in self._index.all_children(parents.pop()):
                if not meta.sessions:
                    dropped.append(meta.key)
                    parents.append(meta.key)
                    self._drop(meta)

    def _note_forgotten_blocks(self, keys: list[bytes]) -> None:
        self._forgotten_blocks_floor = _remember(self._forgotten_blocks, keys, self._forget_clock,
                                                 _FORGOTTEN_BLOCKS_KEPT, self._forgotten_blocks_floor)

    def _first_forgotten(self, cache: TieredCache) -> int | None:
        """The index of the first block ``cache`` restored that a forget dropped since it was
        opened (helper-34: a turn without a session that restored a conversation just forgotten
        wrote it back at its commit, on disk and past a restart), or None. Blocks the turn
        computed itself are its own conversation's, whatever key a forgotten block had: matched
        on the commit's chain too, a turn of another session that computed the shared system
        prompt kept nothing once a forget dropped that prompt's block (found by helper-69)."""
        seen = getattr(cache, "_forgets_seen", self._forget_clock)
        if seen == self._forget_clock:
            return None
        if seen < self._forgotten_blocks_floor:
            return 0  # which blocks went since is no longer known
        for i, key in enumerate(cache._restored_keys):
            if self._forgotten_blocks.get(key, -1) > seen:
                return i
        return None

    # -- forget and stats ---------------------------------------------------------------------------
    def forget(self, session: str | None = None, tenant: str | None = _UNSET) -> int:
        """Drop a session's (or a whole tenant's) blocks from every tier; returns blocks removed.

        ``forget(session=s)`` forgets session ``s`` under every tenant, ``forget(session=s,
        tenant=t)`` only under ``t``; blocks another live session still references stay, and the
        blocks below those removed that no session references (turns without a session that
        continued the conversation) go with them.
        ``forget(tenant=t)`` removes every block of tenant ``t`` (``None`` is the default tenant).
        A session is found by the key its tenant and name hash to (names are not kept on disk):
        without a tenant, sessions read back at a reopen and not committed since cost one hash
        per tenant they have. The deletes are queued (``FORGET_DELETE_KEYS`` blocks a write, then
        the sessions' references as many sessions a write), and written without waiting for more
        writes (but after those queued before them); ``flush()`` returns when they are on disk
        (until then a crash can leave the forgotten KV in the file), or when a disk error failed
        them: those stay owed (``stats()["owed_deletes"]``), retried at later flushes and at ``close``. A turn
        of the session (or tenant) opened before this call keeps nothing at its ``commit``.
        A forget cut short (another signal's handler raising in it: a ``SIGALRM`` timeout) raises,
        and is finished by the store's next call (``open``, ``stats``, ``flush``, ``forget``...) or
        by ``close``, which queues its deletes before the writer drains; calling it again is not
        needed. A crash before either leaves it undone, as it leaves deletes not yet on disk.
        """
        self._check_open()
        if session is None and tenant is _UNSET:
            # A variable holding None (forget(session=sid)) was told only to give session=...
            raise ValueError("forget() got no session and no tenant (session=None names none): pass "
                             "session='name' to forget a session, tenant='name' to forget a tenant's blocks "
                             "(tenant=None: the default tenant's), or both")
        check_name(session, "session")
        if tenant is not _UNSET:
            check_name(tenant, "tenant")
        with self._lock, defer_interrupts():
            self._check_open()
            self._reap()
            what: tuple[str, Any] = (("tenant", tenant) if session is None else ("session", session)
                                     if tenant is _UNSET else ("sid", _session_id(tenant, session)))
            self._note_forget(what)  # here, not in _forget: its redo keeps the forget's clock
            # Before anything goes: cut short past here (another signal's handler), the next reap
            # does it again. Before, only the session being dropped was noted: a tenant's other
            # sessions and its blocks without one stayed, served to its next turn and on disk.
            self._forgets_owed[what] = None
            removed, sessions = self._forget(what)
            if self._writer is not None and (sessions or removed):
                # The deletes zero the forgotten KV in the file: not held back by the linger.
                self._writer.nudge()
        return removed

    def _forget(self, what: tuple[str, Any]) -> tuple[int, bool]:
        """``forget``'s work for ``what`` (its ``_note_forget`` key), noted in ``_forgets_owed`` by
        the caller, and let go here last: the next ``_reap`` does again one another signal's
        handler cut short, from its start (each step is idempotent, the sessions already dropped
        are no longer found, and a session cut short is the ``_forgetting`` note's, done first).
        Returns the blocks removed and whether it found any session."""
        kind, name = what
        sessions = self._index.sessions
        if kind == "tenant":
            sids = [sid for sid, info in sessions.items() if info.tenant == name]
        elif kind == "sid":
            sids = [name] if name in sessions else []
        else:
            # Names never reach the disk: a session read back at a reopen, and not committed
            # since, is known by its key alone, hashed once per tenant of such sessions.
            sids = self._index.named(name, lambda tenant: _session_id(tenant, name))
        # Also of sessions no longer tracked (another session now holds all they had).
        self._keep_superseded((lambda sid, t: t == name) if kind == "tenant"
                              else (lambda sid, t: sid == name) if kind == "sid"
                              else (lambda sid, t: sid == _session_id(t, name)))
        removed = 0
        with self._gathering_deletes():
            for sid in sids:
                removed += self._forget_session(sid)
            if kind == "tenant":
                for meta in self._index.of_tenant(name):
                    self._drop(meta)
                    removed += 1
        del self._forgets_owed[what]
        return removed, bool(sids)

    def stats(self) -> dict[str, Any]:
        """The in-process view of the store (``tierkv.metrics`` exports it).

        ``device``/``host``/``disk``: bytes, budget and blocks at rest (disk bytes are footprints in
        the file); ``peak_bytes`` (per tier, the most bytes at rest at any moment since the store
        opened); ``hits`` (tokens per tier), ``misses`` (tokens), ``discarded`` (restored
        tokens thrown away and recomputed, by assisted decoding, ``cache.reset()`` or a crop below
        the restore: in ``hits`` and in ``misses`` too), ``evictions``, ``diverged_turns`` and ``diverged_tokens`` (turns whose
        ids differed from their session's last stored conversation, ``cache.diverged_at``, and the
        stored tokens past the difference they computed again), ``corrupt``;
        ``disk_errors`` (disk operations that failed: each block write, delete or reference of a
        failed transaction counts), ``disk_failed``, ``disk_damaged`` (that failure was the LMDB file's
        damaged pages, not the disk: ``tierkv check --repair``), ``disk_full`` (block writes that found the map at its
        cap, or the filesystem without room for them), ``owed_deletes`` (deletes not yet on disk
        because of errors); ``moved_bytes`` (KV
        bytes of whole blocks, without the records' headers and padding: a restore that uses part of
        a block reads the whole record and checksums it, and moves the whole block to the device
        tier, while ``hits`` count the tokens used) and ``move_seconds`` per direction (wall
        time), ``write_cpu_wait_seconds`` (the part of the writes' time spent waiting for a CPU);
        ``pending_writes`` (block writes queued and not yet landed or failed, those of blocks
        deleted since included: the writer still holds them); ``commit_wait_seconds`` (time
        commits waited for a disk writer
        ``WRITE_BACKLOG_BYTES`` or ``WRITE_BACKLOG_OPS`` behind); ``host_pool`` (CUDA's pinned
        pool, or None); ``sessions`` (sessions tracked).

        Answers on a closed store too; in a process forked from the store's, raises ``ValueError``
        as every other call does.
        """
        # Before the lock: a thread of the parent that held it at the fork never lets go of it here.
        self._check_owner()
        with self._lock, defer_interrupts():
            if not self._closed:
                self._reap()
            disk_budget = self._disk.budget if self._disk is not None else 0
            disk_bytes = self._index.bytes[Tier.DISK] + self._left_on_disk[1]
            return {
                "device": {"bytes": self._device.used, "budget": self._device.budget, "blocks": len(self._device)},
                "host": {"bytes": self._host.used, "budget": self._host.budget, "blocks": len(self._host)},
                "disk": {"bytes": disk_bytes, "budget": disk_budget,
                         "blocks": self._index.count(Tier.DISK) + self._left_on_disk[0]},
                # High-water marks of the tiers' bytes: within a commit too, which stores a
                # conversation's new chain before it lets go of the partial tail the chain replaces.
                "peak_bytes": {"device": self._device.peak, "host": self._host.peak,
                               "disk": max(self._index.disk_peak, disk_bytes)},
                "hits": dict(self._hits),
                "misses": self._misses,
                "discarded": self._discarded,
                "diverged_turns": self._diverged_turns,
                "diverged_tokens": self._diverged_tokens,
                "evictions": self._evictions,
                "corrupt": self._corrupt,
                "disk_errors": self._disk_errors,
                "disk_failed": self._disk_failed,
                # The failure was the LMDB file's damaged pages (`tierkv check --repair` mends what
                # it can), not the disk.
                "disk_damaged": self._disk_damaged,
                "disk_full": self._disk_full,
                # Deleted entries (blocks, references, sessions) not yet removed from disk because of
                # disk errors; retried at flush() (OWED_RETRY_PROBE first) and at close().
                "owed_deletes": self._owed_keys(),
                "moved_bytes": dict(self._moved),
                # Wall time of the disk paths (writer transactions, the reads of opens that read from disk); memory-tier
                # copies are asynchronous jobs and are not timed here.
                "move_seconds": {"host_to_disk": self._write_seconds,
                                 "disk_to_host": self._read_seconds},
                # The part of move_seconds["host_to_disk"] the writer spent runnable but waiting for
                # a CPU (Linux; 0.0 elsewhere): it runs at a lower priority than the turns.
                "write_cpu_wait_seconds": self._write_cpu_wait,
                # The writer's backlog of block writes: also those whose block a delete let go of
                # while they were queued (each once: one queued again over it is in both).
                "pending_writes": len(self._pending_writes) + len(
                    [job for job, header in self._let_go_writes.items()
                     if self._pending_writes.get(header.key, (None,))[0] is not job]),
                # Time commits waited for the disk writer to come back under WRITE_BACKLOG_BYTES of
                # queued block writes and WRITE_BACKLOG_OPS queued writes (a block delete each):
                # how far the disk falls behind the turns.
                "commit_wait_seconds": self._commit_wait,
                # The pinned host buffer pool (CUDA only): bytes in arenas, in use, free runs, and
                # allocations that found no run and fell back to a fresh buffer.
                "host_pool": self._host.stats(),
                "sessions": len(self._index.sessions),
            }

