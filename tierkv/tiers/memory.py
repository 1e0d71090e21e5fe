"""A byte-budgeted map from block key to a block tensor in flight or at rest, the base of the
device and host tiers.

Protocol: ``fits(n)`` says whether ``n`` more bytes stay within the budget; ``put`` refuses (returns
False) rather than exceed it, since capacity is the caller's decision, not an error; ``pop``
frees, its entry and bytes together (no call between them, where another signal's handler could
raise); ``peak`` is the most bytes it ever held at once. Entries are ``Job``s of tensors: a
block being copied in is already accounted for and readable (a reader waits on the job, or a
copy engine chains on it without a host sync). Tensors are never written after their job
completes, so a reader may hold one while it is moved.
"""

from __future__ import annotations

import torch

from ..transfer import Job


class MemoryTier:
    name = "memory"

    def __init__(self, budget: int, device: torch.device) -> None:
        self.budget = budget
        self.device = device
        self.used = 0
        self.peak = 0
        self._blocks: dict[bytes, tuple[Job[torch.Tensor], int]] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def put(self, key: bytes, block: Job[torch.Tensor], nbytes: int) -> bool:
        if key in self._blocks or not self.fits(nbytes):
            return False
        self._blocks[key] = (block, nbytes)
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used
        return True

    def get(self, key: bytes) -> Job[torch.Tensor] | None:
        entry = self._blocks.get(key)
        return None if entry is None else entry[0]

    def pop(self, key: bytes) -> Job[torch.Tensor] | None:
        entry = self._blocks.get(key)
        if entry is None:
            return None
        # No call between the entry's removal and its bytes' (dict.pop was one): another signal's
        # handler raising there left ``used`` counting a block gone, the budget short for good.
        del self._blocks[key]
        self.used -= entry[1]
        return entry[0]

    def jobs(self) -> list[Job[torch.Tensor]]:
        return [job for job, _ in self._blocks.values()]

    def clear(self) -> None:
        self._blocks.clear()
        self.used = 0
