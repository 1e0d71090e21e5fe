"""The host tier: block tensors in host memory, pinned when the device is CUDA so that copies
back to the device run asynchronously."""

from __future__ import annotations

import torch

from .memory import MemoryTier


class HostTier(MemoryTier):
    name = "host"

    def __init__(self, budget: int, *, pinned: bool) -> None:
        super().__init__(budget, torch.device("cpu"))
        self.pinned = pinned

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A destination buffer for a block read from disk."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
