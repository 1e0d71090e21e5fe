"""Ctrl-C held off while the store moves blocks between its tiers and its index.

A ``KeyboardInterrupt`` lands between any two bytecodes of the main thread. Inside the store's
bookkeeping (a block popped from one tier and not yet put in the next, an index entry half
updated, a pin not yet dropped) it left the store inconsistent: blocks resting in no tier, tier
bytes that disagree with the index, a later turn raising ``KeyError``. Cleanup code cannot close
that gap, since the interrupt can land in the cleanup too.

Protocol: ``with defer_interrupts():`` around a section that must run whole. In the main thread,
when SIGINT's handler is a Python function (``signal.default_int_handler``, or the program's
own), a SIGINT arriving inside the outermost section is recorded, and that handler is called with
it as the section exits: the ``KeyboardInterrupt`` is raised there, with the store consistent.
Sections nest; only the outermost one swaps the handler. Elsewhere it does nothing: other threads
never receive ``KeyboardInterrupt``, and ``SIG_IGN``/``SIG_DFL`` never raise one.

A section must not keep Ctrl-C waiting long. Take a lock before entering one (``with lock,
defer_interrupts():``), so that the wait for it stays interruptible; inside a section, a long
wait polls ``interrupt_pending()`` and stops short (the store's disk reads), or, with nothing
done yet to undo, ``raise_pending()`` delivers the interrupt at once. ``close`` draining the
writer is not held off at all, only its bookkeeping.

It costs two ``sigaction`` calls per outermost section, about 2 us here with ``_signal``'s own
functions (``signal``'s wrappers convert each handler to an enum through a raised ``ValueError``:
14 us). While a section runs, ``signal.getsignal(SIGINT)`` returns its recording handler; a
handler the program installs meanwhile is left in place; a child forked by another thread
meanwhile gets the program's handler back. If an exception (another signal's handler raising)
cuts the swap back short, the recording handler delivers each SIGINT at once until the next
section puts the program's handler back. Each open section is kept by a weak reference to its
``defer_interrupts`` object, with the frame whose ``with`` entered it, and counts only while the
object lives and that frame is on the main thread's stack: one whose exit such an exception cut
short before it took itself out counts no more once the exception is dropped, or has left the
``with``'s function if it is kept alive (as a REPL's ``sys.last_value`` or a server's error log
keeps one, with the cut ``__exit__``'s frame and its ``self``). A count of them stayed up for
good, and so did weak references alone while the exception was kept: every later Ctrl-C was
recorded and never raised. So a section is entered by a ``with`` in a plain function, never in
a generator that suspends inside it.

Other signals are not held off: ``raised_by_signal_handler`` tells their handlers' exceptions
from errors of the code they interrupted, for code that drops some errors (reads past a miss);
``stat_or_none`` is ``os.path.exists`` that raises them.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import weakref
from types import FrameType, TracebackType
from collections.abc import Callable
from typing import Any

try:
    import _signal as _sig  # CPython's C functions, under signal's Python wrappers
except ImportError:  # pragma: no cover - another interpreter
    import signal as _sig  # type: ignore[no-redef]

_SIGINT = int(_sig.SIGINT)
_MAIN = threading.main_thread().ident


class _State:
    # The main thread's open sections, outermost first, each by a weak reference and with the
    # frame running its ``with``: a section whose ``__exit__`` an exception cut short as it began
    # (another signal's handler raising there) never took itself out, and counted by a depth it
    # stayed open for good, holding every later Ctrl-C of the process off, never delivered. Its
    # object is freed with the exception, or its frame leaves the stack as the exception leaves
    # the ``with``'s function, whatever still holds the exception: then it counts for nothing.
    sections: list[tuple[weakref.ref[Any], FrameType]] = []
    # The handler the outermost section replaced: set before the swap, cleared only once it is
    # back, so that an exception between the two (another signal's handler raising) never
    # leaves the recording handler in place with nothing to restore.
    previous: Any = None
    pending: tuple[int, FrameType | None] | None = None


def _handler() -> Any:
    return _State.previous if _State.previous is not None else _sig.default_int_handler


def _live(sections: list[tuple[weakref.ref[Any], FrameType]],
          top: FrameType | None) -> list[tuple[weakref.ref[Any], FrameType]]:
    """Those of ``sections`` still open: whose object lives and whose frame is ``top`` or one of
    its callers. The walk up stops once every one is found: a section's frame is a few calls
    above the check, as a rule."""
    if not sections:
        return sections
    # As a rule every one is open, and met innermost first on the way up.
    i, frame = len(sections) - 1, top
    while frame is not None:
        ref, entered = sections[i]
        if entered is frame:
            if ref() is None:
                break
            i -= 1
            if i < 0:
                return sections
            continue  # an outer one of the same frame's
        frame = frame.f_back
    alive = [entry for entry in sections if entry[0]() is not None]
    wanted = {id(frame) for _, frame in alive}
    found = set()
    while top is not None and len(found) < len(wanted):
        if id(top) in wanted:
            found.add(id(top))
        top = top.f_back
    if len(found) == len(wanted) and len(alive) == len(sections):
        return sections
    return [entry for entry in alive if id(entry[1]) in found]


def _open_sections() -> int:
    """The main thread's sections still open (called in it); those left by an exit cut short
    are dropped. Only the main thread changes the list: another thread reads it whole."""
    sections = _State.sections
    live = _live(sections, sys._getframe(1))
    if live is not sections:
        _State.sections = live  # one statement: no signal's handler runs inside it
    return len(live)


def _any_open() -> bool:
    """Whether a main thread's section is open, from any thread."""
    sections = _State.sections
    if not sections:
        return False
    top = sys._getframe(1) if threading.get_ident() == _MAIN else sys._current_frames().get(_MAIN)
    return bool(_live(sections, top))


def _record(signum: int, frame: FrameType | None) -> None:
    if not _any_open():
        # Outside every section (a swap back that an exception cut short): as if never swapped.
        _handler()(signum, frame)
        return
    _State.pending = (signum, frame)


def _in_section() -> bool:
    # The record is the main thread's: another thread seeing it would take the user's Ctrl-C.
    return threading.get_ident() == _MAIN and _any_open()


def interrupt_pending() -> bool:
    """A Ctrl-C came during the main thread's section in progress: a long wait in it may stop
    short. Always False in other threads."""
    return _State.pending is not None and _in_section()


def pending_check() -> Callable[[], bool]:
    """For work done in other threads on behalf of this thread's section (an open's disk reads
    in helper threads): a function, callable from any thread, that is true once a Ctrl-C is held
    off in that section, so that the work stops short as this thread's own would. Always false
    where ``interrupt_pending`` would be (outside a section, or outside the main thread)."""
    if not _in_section():
        return _never
    return _held_off


def _never() -> bool:
    return False


def _held_off() -> bool:
    return _State.pending is not None and _any_open()


def raise_pending() -> None:
    """Deliver a Ctrl-C that came during the main thread's section now, where the caller has
    nothing to undo. Does nothing in other threads."""
    if not _in_section():
        return
    pending, _State.pending = _State.pending, None
    if pending is not None:
        _handler()(*pending)


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether a Python signal handler raised ``exc`` (a ``SIGALRM`` timeout, say), as against
    the code it interrupted: its traceback runs through a frame that was passed its own caller,
    as CPython calls a handler (``handler(signum, frame)``, ``frame`` the one it interrupted; a
    trace function is called alike, and counts too), named or among its ``*args``. Only the main
    thread runs handlers. One that rebinds its ``frame`` argument before raising goes unseen."""
    # The frames still running, in any thread (the one that caught ``exc``; a loop of the thread
    # it was raised in: a disk writer's, a read helper's), are never the handler, which ended as
    # it raised, and their ``f_locals`` are not read: before Python 3.13 that stores a snapshot
    # of the locals on the frame. Of the catching frame, it held ``exc``: a cycle (frame, locals,
    # exception, traceback, frame) that kept every caller's frame and locals (a store's
    # constructor and its ``self``, an open's restore buffer) until the garbage collector ran.
    # Of another thread's loop, it kept what that loop had let go of (its batch, its reads) for
    # as long as the thread lived.
    me = threading.get_ident()
    running: set[int] = set()
    # This thread's from the caller on: its own frame, as ``_current_frames`` gives it, held in
    # ``top`` would be a cycle of its own.
    for top in [sys._getframe(1), *[f for ident, f in sys._current_frames().items() if ident != me]]:
        at: FrameType | None = top
        while at is not None and id(at) not in running:
            running.add(id(at))
            at = at.f_back
    tb = exc.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        caller = frame.f_back
        if caller is None or id(frame) in running:
            continue
        code, values = frame.f_code, frame.f_locals
        if any([values.get(name) is caller for name in code.co_varnames[:code.co_argcount]]):
            return True
        if code.co_flags & inspect.CO_VARARGS:
            # ``def handler(*_)``, a lambda's ``*a``, a decorator's wrapper: as common for a
            # handler that needs neither argument, and its timeout was taken for a disk fault.
            rest = values.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount])
            if isinstance(rest, tuple) and any([value is caller for value in rest]):
                return True
    return False


def stat_or_none(path: str, follow: bool = True) -> os.stat_result | None:
    """``os.stat`` (``os.lstat``: ``follow`` False), or None where nothing can be looked at there,
    as ``os.path.exists`` answers. But a signal handler's exception (a ``SIGALRM`` timeout's
    ``TimeoutError``, an ``OSError`` too) is raised: ``os.path``'s helpers answer False to it, and
    an existing store was taken for none (its data file for an empty one, made anew; the CLI's
    store for a missing directory)."""
    try:
        return os.stat(path) if follow else os.lstat(path)
    except (OSError, ValueError) as exc:
        if raised_by_signal_handler(exc):
            raise
        return None


def _after_fork_in_child() -> None:
    global _MAIN
    if threading.get_ident() == _MAIN:
        return  # forked by the main thread: its section, if any, goes on in the child
    # Forked by another thread, which is the child's main thread now. A section the parent's
    # main thread was in does not go on here: left in place, its recording handler would swallow
    # every Ctrl-C of the child.
    _MAIN = threading.get_ident()
    if _State.previous is not None and _sig.getsignal(_SIGINT) is _record:
        _sig.signal(_SIGINT, _State.previous)
    _State.sections, _State.previous, _State.pending = [], None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class defer_interrupts:
    """Hold SIGINT off for the duration of a ``with`` block (main thread; see the module)."""

    __slots__ = ("__weakref__",)

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN:
            return
        if _open_sections() == 0:
            # A record left by a section whose exit an interrupt or an exception cut short is
            # stale: dropped.
            _State.pending = None
            current = _sig.getsignal(_SIGINT)
            if current is not _record and callable(current):
                # An interrupt before the swap is raised here, before this section counts:
                # nothing to undo. One after it is recorded.
                _State.previous = current
                _sig.signal(_SIGINT, _record)
            # Already _record: a swap back that an exception cut short; _State.previous holds
            # the program's handler still.
        # Last: an __enter__ that raises is never exited.
        _State.sections = [*_State.sections, (weakref.ref(self), sys._getframe(1))]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if threading.get_ident() != _MAIN:
            return  # entered by another thread: a no-op
        live = _live(_State.sections, sys._getframe(1))
        at = len(live)
        while at and live[at - 1][0]() is not self:
            at -= 1
        if not at:
            _State.sections = live
            return  # entered before a fork the child is past
        # Those entered after this one ran inside its ``with`` (one left there is an inner exit
        # cut short, in the same function): ended with it.
        rest = live[:at - 1]
        if rest:
            _State.sections = rest  # one statement: no signal's handler runs inside it
            return
        previous = _State.previous
        if previous is None:
            _State.sections = []
            return
        try:
            # Swapped back while this section still counts: a SIGINT that the swap's own check
            # for pending signals runs is recorded, not raised from inside it with the earlier
            # record left behind.
            if _sig.getsignal(_SIGINT) is _record:  # else the program installed a handler meanwhile
                _sig.signal(_SIGINT, previous)
            _State.previous = None
        finally:
            _State.sections = []
        pending, _State.pending = _State.pending, None
        if pending is not None:
            previous(*pending)  # default_int_handler raises KeyboardInterrupt here
