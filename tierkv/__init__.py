"""tierkv: a hierarchical KV-cache store (device, pinned host, LMDB disk) behind a
transformers ``Cache``.

The contract is in the docstrings: ``help(tierkv.TieredStore)`` (its arguments, ``open``,
``forget``, ``flush``, ``stats``, ``close``) and ``help(tierkv.TieredCache)`` (``commit``). The
README, installed as the package's description (``importlib.metadata.metadata("tierkv")``, or
the project's page), has the tour: its sections "Quick start", "Guarantees" and "Status and
limits"."""

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
