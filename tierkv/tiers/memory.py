"""A byte-budgeted map from block key to an immutable tensor, the base of device and host tiers.

Protocol: ``fits(n)`` says whether ``n`` more bytes stay within the budget; ``put`` refuses (returns
False) rather than exceed it, since capacity is the caller's decision, not an error; ``pop``
frees. Tensors are never written after ``put``, so a reader may hold one while it is moved.
"""

from __future__ import annotations

import torch


class MemoryTier:
    name = "memory"

    def __init__(self, budget: int, device: torch.device) -> None:
        self.budget = budget
        self.device = device
        self.used = 0
        self._blocks: dict[bytes, torch.Tensor] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def put(self, key: bytes, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        if key in self._blocks or not self.fits(nbytes):
            return False
        self._blocks[key] = tensor
        self.used += nbytes
        return True

    def get(self, key: bytes) -> torch.Tensor | None:
        return self._blocks.get(key)

    def pop(self, key: bytes) -> torch.Tensor | None:
        tensor = self._blocks.pop(key, None)
        if tensor is not None:
            self.used -= tensor.numel() * tensor.element_size()
        return tensor

    def clear(self) -> None:
        self._blocks.clear()
        self.used = 0
