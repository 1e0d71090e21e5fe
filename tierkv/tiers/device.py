"""The hot tier: block tensors in the model's device memory (CPU memory when there is no GPU)."""

from __future__ import annotations

from .memory import MemoryTier


class DeviceTier(MemoryTier):
    name = "device"
