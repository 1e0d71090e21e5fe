"""The host tier: block tensors in host memory, pinned when the device is CUDA so that copies
back to the device run asynchronously.

With a pool (CUDA), buffers come from ``tierkv.pool.HostPool``: ``alloc`` hands one out with its
lease, and the tier holds the lease of every block at rest in it (``put`` holds, ``pop`` lets go),
so a buffer returns to the pool only once no tier keeps it and no copy or write still uses it.
"""

from __future__ import annotations

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

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Lease | None]:
        """A host buffer for a block (a copy from the device, a read from disk), and its lease."""
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None
        return self.pool.alloc(shape, dtype)

    def put(self, key: bytes, block: Job[torch.Tensor], nbytes: int) -> bool:
        if not super().put(key, block, nbytes):
            return False
        if block.lease is not None:
            block.lease.hold()
        return True

    def pop(self, key: bytes) -> Job[torch.Tensor] | None:
        block = super().pop(key)
        if block is not None and block.lease is not None:
            block.lease.unhold()
        return block

    def reclaim(self) -> None:
        if self.pool is not None:
            self.pool.reclaim()

    def stats(self) -> dict[str, int] | None:
        return self.pool.stats() if self.pool is not None else None
