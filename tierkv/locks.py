"""A lock held by many readers at once or by one exclusive holder.

Protocol: ``with lock.shared():`` around a read; ``with lock:`` (or ``acquire(timeout)`` and
``release()``) around what must run with no reader inside, such as remapping a file that readers
copy out of. An exclusive holder that waits holds back readers that come after it, so a stream of
overlapping reads cannot starve it; in exchange a thread must never take the shared side twice
(the second would wait behind a waiting exclusive holder that waits for the first). Neither side
is reentrant, as with ``threading.Lock``. ``limit``: readers at most inside at once (one that
comes past it waits for one of them to leave), as where each holds one of a fixed number of slots
(LMDB's reader table).

A signal handler's exception (``KeyboardInterrupt``, a ``SIGALRM`` timeout) landing in ``with``
on either side leaves the lock as it found it, but for one point Python leaves open: CPython runs
a pending handler as a Python function starts, and ``__exit__`` is one, so a handler that raises
just as the ``with`` body ends leaves that side held (as it would with any lock written in Python).
"""

from __future__ import annotations

import threading
import time
from typing import Any

# How long a waiter sleeps before it looks at the lock again without being woken: a wake-up a
# signal handler's exception cut short (``Condition.notify_all`` is Python code) then costs a
# waiter this long instead of leaving it waiting forever.
_RECHECK_S = 0.25


class _Shared:
    """``SharedLock.shared()``. A class rather than a generator's context manager: a handler's
    exception landing in a generator between the count's increment and its ``try`` (as the
    state's lock was let go, or as ``next()`` returned) left a reader counted that never left,
    and every exclusive holder after it (a close, a remap) waited forever."""

    __slots__ = ("_lock",)

    def __init__(self, lock: "SharedLock") -> None:
        self._lock = lock

    def __enter__(self) -> None:
        lock = self._lock
        counted = False
        try:
            with lock._mutex:
                while lock._writer or lock._waiting or (lock.limit is not None and lock._readers >= lock.limit):
                    lock._cond.wait(_RECHECK_S)
                lock._readers += 1
                counted = True  # no call between the two: no handler runs there
        except BaseException:
            if counted:
                # Raised as the mutex was let go (handlers run after a C call returns): the
                # ``with`` never started, so nothing would call ``__exit__``. Inline, as a
                # function's start would run a handler again.
                with lock._mutex:
                    lock._readers -= 1
                    lock._cond.notify_all()
            raise

    def __exit__(self, *exc: Any) -> None:
        lock = self._lock
        with lock._mutex:
            lock._readers -= 1
            if not lock._readers or lock.limit is not None:
                lock._cond.notify_all()  # an exclusive holder, or a reader waiting for a slot


class SharedLock:
    """Shared (``shared()``) or exclusive (the lock itself) holding; see the module's protocol."""

    __slots__ = ("_mutex", "_cond", "_readers", "_writer", "_waiting", "limit", "_shared")

    def __init__(self, limit: int | None = None) -> None:
        # Taken with ``with`` on the C lock itself, never the Condition's: a C lock's enter and
        # exit run no Python code, whereas ``Condition.__exit__`` is a function whose start runs
        # a pending handler, which then left the state's lock held for good.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False
        self._waiting = 0  # exclusive holders waiting: readers wait behind them
        self.limit = limit
        self._shared = _Shared(self)

    def shared(self) -> _Shared:
        """A context manager holding the lock shared (one per lock: it keeps no state)."""
        return self._shared

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Exclusive holding, as ``threading.Lock.acquire``: False when it was not had in time."""
        got = False
        try:
            with self._mutex:
                if self._writer or self._readers:
                    if not blocking:
                        return False
                    deadline = None if timeout < 0 else time.monotonic() + timeout
                    self._waiting += 1
                    free = False
                    try:
                        while self._writer or self._readers:
                            left = _RECHECK_S if deadline is None else min(_RECHECK_S, deadline - time.monotonic())
                            if left <= 0:
                                break
                            self._cond.wait(left)
                        free = not self._writer and not self._readers
                    finally:
                        self._waiting -= 1
                        if not free:
                            self._cond.notify_all()  # giving up: the readers this wait held back
                    if not free:
                        return False
                self._writer = got = True
            return True
        except BaseException:
            if got:  # raised as the mutex was let go: the caller never learns it holds the lock
                with self._mutex:
                    self._writer = False
                    self._cond.notify_all()
            raise

    def release(self) -> None:
        with self._mutex:
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
