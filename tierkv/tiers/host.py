"""The host tier: block tensors in host memory, pinned when the device is CUDA so that copies
back to the device run asynchronously.

With a pool (CUDA), buffers come from ``tierkv.pool.HostPool``: ``alloc`` hands one out with its
lease, and the tier holds the lease of every block at rest in it (``put`` holds, ``pop`` lets go,
each with its entry: see ``put``), so a buffer returns to the pool only once no tier keeps it and
no copy or write still uses it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..pool import HostPool, Lease
from ..transfer import Job
from .memory import MemoryTier


class HostTier(MemoryTier):
    name = "host"

    def __init__(self, budget: int, *, pinned: bool, pool: HostPool | None = None) -> None:
        super().__init__(budget, torch.device("cpu"))
        self.pinned = pinned
        self.pool = pool
        # key -> the lease held for its block at rest here (Lease.hold_in/unhold_from).
        self._held: dict[bytes, Lease] = {}
        # The key of the put or pop in progress: one that another signal's handler cut short
        # leaves it set, for _settle.
        self._unsettled: bytes | None = None

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, holders: dict[Any, Any] | None = None,
              key: Any = None) -> tuple[torch.Tensor, Lease | None]:
        """A host buffer for a block (a copy from the device, a read from disk), and its lease;
        with ``holders``, held and recorded as ``holders[key]`` (``HostPool.alloc``)."""
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None
        return self.pool.alloc(shape, dtype, holders, key)

    def put(self, key: bytes, block: Job[torch.Tensor], nbytes: int) -> bool:
        if self._unsettled is not None:
            self._settle()
        lease = block.lease
        if lease is None or key in self._blocks or not self.fits(nbytes):
            return super().put(key, block, nbytes)
        # The hold first, then the entry, each made whole (Lease.hold_in records it in _held): a
        # handler raising between them leaves a hold with no entry, which the next put, pop or
        # reclaim lets go (_unsettled). Made the other way round (the entry, then hold()), one
        # raising between them left a resting block its buffer had no hold for: its pop let go
        # of another holder's hold (a queued write's), the buffer reused under that holder.
        self._unsettled = key
        lease.hold_in(self._held, key, lease)
        if not super().put(key, block, nbytes):
            self._settle()  # refused after all (not by the checks above): no hold for no entry
            return False
        self._unsettled = None
        return True

    def pop(self, key: bytes) -> Job[torch.Tensor] | None:
        if self._unsettled is not None:
            self._settle()
        # As put's: a handler raising between the entry's pop and the hold's let-go left a hold
        # no one let go, the buffer lost to the pool; the next put, pop or reclaim lets it go.
        self._unsettled = key
        block = super().pop(key)
        lease = self._held.get(key)
        if lease is not None:
            lease.unhold_from(self._held, key)
        self._unsettled = None
        return block

    def _settle(self) -> None:
        """Let go of the hold of a put or pop that another signal's handler cut short, where its
        entry is gone (or is another block's); nothing where it is whole."""
        key = self._unsettled
        if key is None:
            return
        lease = self._held.get(key)
        entry = self._blocks.get(key)
        if lease is not None and (entry is None or entry[0].lease is not lease):
            lease.unhold_from(self._held, key)
        self._unsettled = None

    def clear(self) -> None:
        super().clear()
        # The store's close: its pool goes with it, the holds' records with their entries.
        self._held.clear()
        self._unsettled = None

    def reclaim(self) -> None:
        self._settle()
        if self.pool is not None:
            self.pool.reclaim()

    def stats(self) -> dict[str, int] | None:
        return self.pool.stats() if self.pool is not None else None
