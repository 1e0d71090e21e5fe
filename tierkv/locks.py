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
just as a shared ``with`` body ends leaves that reader counted. Such a reader is found and let go:
each is held under its thread with the frame that entered it (the ``with`` statement's), which is
on that thread's stack for as long as the ``with`` runs. A thread's readers whose frames are no
longer on its stack are stale; they go when that thread takes either side again, and when an
exclusive holder, or a reader waiting for a slot, has waited ``_RECHECK_S`` (before, a close or a
remap after such a cut waited forever). Hence one rule more: never suspend a generator or
coroutine inside a shared ``with`` (its frame leaves the stack while the lock is held).
``on_stale``, given by ``enter_shared``'s caller, is called for a reader let go that way (the disk
tier aborts the read transaction that reader left open); a signal handler's exception that cuts it
short is raised once every stale reader's was called, that one's called again first, so it must
bear a second call. The exclusive side alike: held by the
frame that took it (the ``with``'s, or ``acquire``'s caller), and let go as stale once that frame
left its thread's stack, so it is let go before that frame returns (a ``release`` in a ``finally``
of the same function, cut as it started, left a close's holding: the next close waited forever).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from .interrupts import raised_by_signal_handler

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
        self._lock.enter_shared(sys._getframe(1))

    def __exit__(self, *exc: Any) -> None:
        self._lock.exit_shared()


def on_stack(frame: FrameType | None, top: FrameType | None) -> bool:
    """Whether ``frame`` is ``top`` or one of its callers."""
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


#: A reader: the frame whose ``with`` holds it, and what to call if it is let go as stale.
_Reader = tuple[FrameType, Callable[[], object] | None]


class SharedLock:
    """Shared (``shared()``) or exclusive (the lock itself) holding; see the module's protocol."""

    __slots__ = ("_mutex", "_cond", "_holders", "_writer", "_owner", "_waiting", "limit", "_shared")

    def __init__(self, limit: int | None = None) -> None:
        # Taken with ``with`` on the C lock itself, never the Condition's: a C lock's enter and
        # exit run no Python code, whereas ``Condition.__exit__`` is a function whose start runs
        # a pending handler, which then left the state's lock held for good.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # Thread ident -> its readers, innermost last. The readers' count is not kept apart: a
        # handler's exception between a change to it and one to these lists (a C call's return
        # lies between any two) left them disagreeing, where nothing could ever mend the count.
        self._holders: dict[int, list[_Reader]] = {}
        self._writer = False
        self._owner: tuple[int, FrameType] | None = None  # the exclusive holder's thread and frame
        self._waiting = 0  # exclusive holders waiting: readers wait behind them
        self.limit = limit
        self._shared = _Shared(self)

    @property
    def _readers(self) -> int:
        return sum(map(len, self._holders.values()))

    def shared(self) -> _Shared:
        """A context manager holding the lock shared (one per lock: it keeps no state)."""
        return self._shared

    def enter_shared(self, owner: FrameType, on_stale: Callable[[], object] | None = None) -> None:
        """Hold the lock shared for the ``with`` that ``owner`` (a frame) runs, until
        ``exit_shared`` in the same thread; ``on_stale`` as in the module's protocol. For context
        managers of other objects that hold it (``with lock.shared():`` is the plain way)."""
        me = threading.get_ident()
        reader = (owner, on_stale)
        counted = False
        try:
            with self._mutex:
                if me in self._holders:
                    self._drop_stale(me, sys._getframe())
                if self._writer:
                    self._drop_stale_writer(me, sys._getframe())
                while self._writer or self._waiting or (self.limit is not None and self._readers >= self.limit):
                    if not self._cond.wait(_RECHECK_S) and (self.limit is not None or self._writer):
                        self._sweep()
                mine = self._holders.setdefault(me, [])
                counted = True  # first: a handler runs only once the append below has returned
                mine.append(reader)
        except BaseException:
            if counted:
                # Raised as the mutex was let go or the append returned (handlers run after a C
                # call returns): the ``with`` never started, so nothing would call ``__exit__``.
                # Inline, as a function's start would run a handler again. Cut short itself, it
                # leaves a reader whose frame is leaving: a stale one, let go later.
                with self._mutex:
                    mine = self._holders.get(me)
                    if mine and mine[-1] is reader:
                        mine.pop()
                    self._cond.notify_all()
            raise

    def exit_shared(self) -> None:
        """Let go of this thread's innermost shared holding."""
        me = threading.get_ident()
        with self._mutex:
            mine = self._holders.get(me)
            if mine:  # none: let go of already, as stale (a frame that went on after the cut)
                mine.pop()
                if not mine:
                    del self._holders[me]
            if not self._readers or self.limit is not None:
                self._cond.notify_all()  # an exclusive holder, or a reader waiting for a slot

    def _drop_stale(self, ident: int, top: FrameType | None) -> None:
        """(Mutex held.) Let go of the readers of thread ``ident`` whose frames are not on its
        stack, ``top`` its innermost frame (None: the thread has ended)."""
        mine = self._holders.get(ident)
        if not mine:
            self._holders.pop(ident, None)  # an empty list a cut exit left
            return
        live = [reader for reader in mine if top is not None and on_stack(reader[0], top)]
        if len(live) == len(mine):
            return
        kept = {id(reader) for reader in live}
        stale = [reader for reader in mine if id(reader) not in kept]
        if live:
            self._holders[ident] = live
        else:
            del self._holders[ident]
        cut: BaseException | None = None
        try:
            self._cond.notify_all()
        finally:
            # Inline, and whatever the wake-up raised: the readers are out of the count, so
            # nothing else would let go of what they left (a read transaction open for good).
            for _, on_stale in stale:
                for _try in range(2):
                    if on_stale is None:
                        break
                    try:
                        on_stale()
                        break
                    except Exception as exc:  # noqa: BLE001 - it lets go of what a reader left; the reader is gone either way
                        if not raised_by_signal_handler(exc):
                            break
                        # A SIGALRM timeout's, maybe before it let go of anything: called once
                        # more, and raised after the others.
                        cut = cut or exc
        if cut is not None:
            raise cut

    def _drop_stale_writer(self, me: int, top: FrameType | None, frames: dict[int, FrameType] | None = None) -> None:
        """(Mutex held.) Let go of the exclusive holding if its frame is not on its thread's stack:
        ``top`` this thread's (``me``) innermost frame, ``frames`` every thread's."""
        owner = self._owner
        if not self._writer or owner is None:
            return
        ident, frame = owner
        if ident == me:
            at = top
        elif frames is not None:
            at = frames.get(ident)
        else:
            return  # another thread's: its own look, or a waiter's sweep
        if at is None or not on_stack(frame, at):
            self._writer, self._owner = False, None
            self._cond.notify_all()

    def _sweep(self) -> None:
        """(Mutex held.) Let go of every thread's stale readers, and of a stale exclusive holding
        (the module's protocol)."""
        frames = sys._current_frames()
        try:
            for ident in list(self._holders):
                self._drop_stale(ident, frames.get(ident))
            self._drop_stale_writer(threading.get_ident(), sys._getframe(), frames)
        finally:
            del frames  # frames of every thread: none kept past this

    def acquire(self, blocking: bool = True, timeout: float = -1, owner: FrameType | None = None) -> bool:
        """Exclusive holding, as ``threading.Lock.acquire``: False when it was not had in time.
        Held by ``owner``, the frame that lets go of it (default: the caller's)."""
        owner = owner if owner is not None else sys._getframe(1)
        got = False
        try:
            with self._mutex:
                me = threading.get_ident()
                if me in self._holders:
                    # A thread that held the lock shared would wait for itself here: those left.
                    self._drop_stale(me, sys._getframe())
                if self._writer:
                    self._drop_stale_writer(me, sys._getframe())
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
                            if not self._cond.wait(left) and (self._readers or self._writer):
                                self._sweep()
                        free = not self._writer and not self._readers
                    finally:
                        self._waiting -= 1
                        if not free:
                            self._cond.notify_all()  # giving up: the readers this wait held back
                    if not free:
                        return False
                self._owner = (me, owner)
                self._writer = got = True
            return True
        except BaseException:
            if got:  # raised as the mutex was let go: the caller never learns it holds the lock
                with self._mutex:
                    self._writer, self._owner = False, None
                    self._cond.notify_all()
            raise

    def release(self) -> None:
        with self._mutex:
            if not self._writer:
                raise RuntimeError("release of a SharedLock not held exclusively")
            self._writer, self._owner = False, None
            self._cond.notify_all()

    def __enter__(self) -> "SharedLock":
        self.acquire(owner=sys._getframe(1))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def locked(self) -> bool:
        """Held exclusively."""
        return self._writer
