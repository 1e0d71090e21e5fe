"""A reusable pool of host buffers for blocks (pinned when the device is CUDA).

Pinned allocation costs milliseconds per call and fragments the host's page-locked memory, so
the store carves its host buffers from arenas allocated once and reused for the store's life.

Protocol:
  * ``alloc(shape, dtype)`` returns ``(tensor, lease)``: a contiguous buffer from the pool, or,
    when no free run fits, a freshly allocated one with ``lease`` None (slower, never wrong;
    counted in ``stats()['fallbacks']``). ``alloc(shape, dtype, holders, key)`` takes it held,
    as ``hold_in(holders, key, lease)`` would, the hold recorded with the taking.
  * A lease is held by whoever keeps the buffer at rest (the host tier, a queued disk write):
    ``hold()`` / ``unhold()`` (or ``hold_in`` / ``unhold_from``, for a holder that records its
    holds in a dict: the record and the hold in one step, where no signal's handler runs). Jobs that read or write the buffer asynchronously (the copy that
    fills it, copies to the device from it, the disk write that encodes it) are registered with
    ``after(job)``.
  * When the last holder lets go, the buffer retires, and returns to the free space only once
    every registered job is done (``reclaim()``, run by ``alloc`` and the store's bookkeeping).
    So no copy ever reads a buffer that was handed out again.

Space is counted in granules; free runs coalesce with their neighbours when a buffer returns,
and a request takes the smallest run that fits (best fit), so blocks of one size (every full
block of a model) reuse each other's runs exactly and tails do not strand space between them.
Arenas are allocated on first need, up to ``capacity`` bytes, and never freed before the pool.

Another signal's handler (a SIGALRM timeout; Ctrl-C is held off by the store) may raise at any
call inside these: each change to the books is made with no call between its parts, and a
retired buffer is freed once (``Lease.freed``). A lease that ``alloc`` took without
``holders`` but whose caller never got it, or never held it, stays counted in use: nothing tells
that it is abandoned; taken with ``holders``, it is in the caller's record before any point
where a handler runs, for the caller's ``unhold_from`` to let go.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import torch

GRANULE = 4096  # bytes; aligns every buffer for any dtype and for DMA
ARENA_BYTES = 256 << 20


class Lease:
    """One buffer of the pool: its place, its holders, and the jobs that must finish before reuse."""

    __slots__ = ("_pool", "arena", "start", "granules", "holders", "jobs", "retired", "freed")

    def __init__(self, pool: "HostPool", arena: int, start: int, granules: int) -> None:
        self._pool = pool
        self.arena = arena
        self.start = start
        self.granules = granules
        self.holders = 0
        self.jobs: list[Any] = []
        self.retired = False
        self.freed = False  # back in the free space (``HostPool._free``)

    def hold(self) -> None:
        with self._pool._lock:
            if self.retired:
                raise RuntimeError("a retired pool buffer was held again")
            self.holders += 1

    def unhold(self) -> None:
        with self._pool._lock:
            if self.holders <= 0:
                raise RuntimeError("a pool buffer was let go more often than it was held")
            self.holders -= 1
            if self.holders == 0:
                self.retired = True
                self._pool._retiring.append(self)
        self._pool.reclaim()

    def hold_in(self, holders: dict[Any, Any], key: Any, value: Any) -> None:
        """``hold()`` for the holder that records it as ``holders[key] = value``: the record and
        the hold made together, with no call between where another signal's handler could raise
        (Ctrl-C alone is held off), so that ``unhold_from`` lets go of exactly the holds made.
        Made apart, one raising between them left a hold no one would let go (the buffer lost
        to the pool), or a record whose let-go retired a buffer another holder still used."""
        with self._pool._lock:
            if self.retired:
                raise RuntimeError("a retired pool buffer was held again")
            holders[key] = value
            self.holders += 1

    def unhold_from(self, holders: dict[Any, Any], key: Any) -> None:
        """``unhold()`` for a hold made by ``hold_in``, its record ``holders[key]`` removed with it
        (as there); nothing where it is gone, so a let-go cut short can be run again."""
        with self._pool._lock:
            if key not in holders:
                return
            if self.holders <= 0:
                raise RuntimeError("a pool buffer was let go more often than it was held")
            del holders[key]
            self.holders -= 1
            if self.holders == 0:
                self.retired = True
                self._pool._retiring.append(self)
        self._pool.reclaim()

    def after(self, job: Any) -> None:
        """``job`` (anything with ``done()``) uses the buffer: it is reused only once the job is done.
        Kept until then, and on a held buffer until its next ``after``: give a job's ``fence()``."""
        with self._pool._lock:
            if self.retired:
                # Registered too late: the buffer may already be someone else's.
                raise RuntimeError("a job was registered on a pool buffer that no one holds any more")
            self.jobs = [j for j in self.jobs if not j.done()]
            self.jobs.append(job)


class HostPool:
    """Host buffers carved from arenas; see the module docstring for the protocol."""

    def __init__(self, capacity: int, *, pinned: bool, arena_bytes: int = ARENA_BYTES,
                 allocate: Callable[[int, bool], torch.Tensor] | None = None, poison: bool = False) -> None:
        self.capacity = capacity - capacity % GRANULE
        self.pinned = pinned
        self._arena_granules = max(1, min(arena_bytes, self.capacity) // GRANULE) if self.capacity else 0
        self._allocate = allocate or (lambda n, pin: torch.empty(n, dtype=torch.uint8, pin_memory=pin))
        self._poison = poison  # tests: fill returned buffers, so that a read after reuse shows
        self._arenas: list[torch.Tensor] = []
        # Per arena: sorted run starts, and start -> length (granules) of each free run.
        self._starts: list[list[int]] = []
        self._runs: list[dict[int, int]] = []
        self._retiring: list[Lease] = []
        self._lock = threading.Lock()
        self._allocated = 0  # granules in arenas
        self.in_use = 0  # granules handed out (and retiring)
        self.fallbacks = 0
        self._grow_refused = False

    # -- allocation ---------------------------------------------------------------------------------
    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, holders: dict[Any, Any] | None = None,
              key: Any = None) -> tuple[torch.Tensor, Lease | None]:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        need = max(1, -(-nbytes // GRANULE))
        self.reclaim()
        with self._lock:
            lease = self._take(need, holders, key)
            if lease is None and need <= self._arena_granules and self._grow():
                lease = self._take(need, holders, key)
            if lease is None:
                self.fallbacks += 1
        if lease is None:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None
            except RuntimeError:
                # Page-locked memory ran out: pageable memory still holds the block, only its
                # copies are slower (and synchronous). Never a reason to fail a turn.
                return torch.empty(shape, dtype=dtype), None
        offset = lease.start * GRANULE
        flat = self._arenas[lease.arena][offset:offset + nbytes]
        return flat.view(dtype).view(shape), lease

    def _take(self, need: int, holders: dict[Any, Any] | None = None, key: Any = None) -> Lease | None:
        best: tuple[int, int, int] | None = None  # (length, arena, start)
        for arena, runs in enumerate(self._runs):
            for start, length in runs.items():
                if length >= need and (best is None or length < best[0]):
                    best = (length, arena, start)
                    if length == need:
                        break
            if best is not None and best[0] == need:
                break
        if best is None:
            return None
        length, arena, start = best
        runs, starts = self._runs[arena], self._starts[arena]
        i = bisect.bisect_left(starts, start)
        lease = Lease(self, arena, start, need)
        # No call from here on, where another signal's handler could raise (CPython runs them at
        # a call's start or a C call's return): the run taken, its rest left and the space
        # counted together. A cut between them left a start without its run (a KeyError at a
        # later free), a run's rest out of the free space, or a run taken and counted by no one.
        # The hold asked for is made with them: a handler raising anywhere on the way back to the
        # caller left a buffer taken that no one held or knew of, lost to the pool for good.
        del runs[start]
        if length > need:
            runs[start + need] = length - need
            starts[i] = start + need  # still in order: below the next run's start
        else:
            del starts[i]
        self.in_use += need
        if holders is not None:
            holders[key] = lease
            lease.holders = 1
        return lease

    def _grow(self) -> bool:
        granules = min(self._arena_granules, self.capacity // GRANULE - self._allocated)
        if granules <= 0 or self._grow_refused:
            return False
        try:
            arena = self._allocate(granules * GRANULE, self.pinned)
        except RuntimeError:
            # Page-locked memory ran out: the blocks fall back to buffers of their own (alloc),
            # and no later request pays for another refused arena.
            self._grow_refused = True
            return False
        # In place, with no call between (``append`` is one, where a signal's handler runs as it
        # returns): an arena without its runs, or runs without their starts, made every later
        # request of that arena fail on an IndexError, or hand out another arena's memory.
        self._arenas += [arena]
        self._runs += [{0: granules}]
        self._starts += [[0]]
        self._allocated += granules
        return True

    # -- return ----------------------------------------------------------------------------------
    def reclaim(self) -> None:
        """Return retired buffers whose jobs are all done to the free space. Never waits."""
        with self._lock:
            if not self._retiring:
                return
            waiting = []
            for lease in self._retiring:
                if lease.freed:
                    continue  # by a reclaim another signal's handler cut short before its end
                lease.jobs = [j for j in lease.jobs if not j.done()]
                if lease.jobs:
                    waiting.append(lease)
                else:
                    self._free(lease)
            self._retiring = waiting

    def _free(self, lease: Lease) -> None:
        """Return a lease's run to the free space, once (``Lease.freed``): a reclaim another
        signal's handler cut short after this kept the lease retiring, and the next freed it
        again (two leases then shared a buffer). Its changes are made with no call between them,
        where no handler runs; before, one raising as ``pop`` returned left a start without its
        run, or a run out of the free space."""
        if self._poison:
            offset = lease.start * GRANULE
            self._arenas[lease.arena][offset:offset + lease.granules * GRANULE].fill_(0xFF)
        runs, starts = self._runs[lease.arena], self._starts[lease.arena]
        start, length = lease.start, lease.granules
        i = bisect.bisect_left(starts, start)
        end = starts[i] if i < len(starts) and starts[i] == start + length else None  # the run after
        before = starts[i - 1] if i > 0 and starts[i - 1] + runs[starts[i - 1]] == start else None
        # No call from here on.
        if end is not None:
            length += runs[end]
            del runs[end]
            if before is not None:
                del starts[i]
            else:
                starts[i] = start
        elif before is None:
            starts[i:i] = [start]
        if before is not None:
            runs[before] += length
        else:
            runs[start] = length
        self.in_use -= lease.granules
        lease.freed = True

    def stats(self) -> dict[str, int]:
        with self._lock:
            free = [length for runs in self._runs for length in runs.values()]
            return {"capacity": self.capacity, "allocated": self._allocated * GRANULE,
                    "in_use": self.in_use * GRANULE, "retiring": len(self._retiring),
                    "largest_free": max(free, default=0) * GRANULE, "free_runs": len(free),
                    "fallbacks": self.fallbacks}
