"""A lock held by many readers at once or by one exclusive holder.

Protocol: ``with lock.shared():`` around a read; ``with lock:`` (or ``acquire(timeout)`` and
``release()``) around what must run with no reader inside, such as remapping a file that readers
copy out of. An exclusive holder that waits holds back readers that come after it, so a stream of
overlapping reads cannot starve it; in exchange a thread must never take the shared side twice
(the second would wait behind a waiting exclusive holder that waits for the first). Neither side
is reentrant, as with ``threading.Lock``. ``limit``: readers at most inside at once (one that
comes past it waits for one of them to leave), as where each holds one of a fixed number of slots
(LMDB's reader table).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class SharedLock:
    """Shared (``shared()``) or exclusive (the lock itself) holding; see the module's protocol."""

    __slots__ = ("_cond", "_readers", "_writer", "_waiting", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0  # exclusive holders waiting: readers wait behind them
        self.limit = limit

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting or (self.limit is not None and self._readers >= self.limit):
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers or self.limit is not None:
                    self._cond.notify_all()  # an exclusive holder, or a reader waiting for a slot

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Exclusive holding, as ``threading.Lock.acquire``: False when it was not had in time."""
        with self._cond:
            if not self._writer and not self._readers:
                self._writer = True
                return True
            if not blocking:
                return False
            self._waiting += 1
            got = False
            try:
                got = self._cond.wait_for(lambda: not self._writer and not self._readers,
                                          None if timeout < 0 else timeout)
                if got:
                    self._writer = True
                return got
            finally:
                self._waiting -= 1
                if not got:
                    self._cond.notify_all()  # the readers this wait held back

    def release(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release of a SharedLock not held exclusively")
            self._writer = False
            self._cond.notify_all()

    def __enter__(self) -> "SharedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def locked(self) -> bool:
        """Held exclusively."""
        return self._writer
