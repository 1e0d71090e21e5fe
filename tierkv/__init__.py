"""tierkv: a hierarchical KV-cache store (device, pinned host, LMDB disk) behind a
transformers ``Cache``. See README.md for the tour and ../shared/API.md for the contract."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["TieredStore", "TieredCache", "__version__"]

if TYPE_CHECKING:
    from .cache import TieredCache
    from .store import TieredStore


def __getattr__(name: str) -> Any:
    # Imported on first use: torch and transformers take seconds to load, and `tierkv --version`
    # or `tierkv stats` should not pay for them.
    if name == "TieredStore":
        from .store import TieredStore

        return TieredStore
    if name == "TieredCache":
        from .cache import TieredCache

        return TieredCache
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
