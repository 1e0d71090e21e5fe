"""tierkv: a hierarchical KV-cache store (device, pinned host, LMDB disk) behind a
transformers ``Cache``. See README.md for the tour and ../shared/API.md for the contract."""

from .cache import TieredCache
from .store import TieredStore

__version__ = "0.1.0"
__all__ = ["TieredStore", "TieredCache", "__version__"]
