"""Storage tiers. Each owns its space and knows nothing of the others; only the store moves
blocks between them (store.py)."""

from .device import DeviceTier
from .disk import DiskTier
from .host import HostTier

__all__ = ["DeviceTier", "HostTier", "DiskTier"]
