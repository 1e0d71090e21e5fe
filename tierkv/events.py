"""Store events for observers such as the Prometheus collector.

Protocol: ``EventLog.subscribe()`` returns a ``Subscription``; the store calls ``emit`` on its hot
paths, which only appends the event to each subscriber's bounded deque (no lock, no I/O, never
blocks; with no subscriber it costs one empty loop). The observer calls ``Subscription.drain()``
when it collects. A subscriber that does not drain loses its oldest events beyond ``maxlen``
(counted in ``Subscription.dropped``), so a forgotten observer never grows memory.

A move's duration may not be known when it is queued (a CUDA copy still in flight): such a
``MoveEvent`` carries a ``timer`` that returns the seconds once the copy finished, else ``None``.
``drain`` resolves timers and holds unfinished moves back until a later drain.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Union

from .units import whole_number

DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")


@dataclass(frozen=True, slots=True)
class OpenEvent:
    """One ``store.open``: its wall time, restored tokens per tier, and tokens left to compute."""

    seconds: float
    restored: dict[str, int]
    missed: int


@dataclass(frozen=True, slots=True)
class CommitEvent:
    """One ``cache.commit``: its wall time (the copies it starts run on after it) and tokens stored."""

    seconds: float
    tokens: int


@dataclass(frozen=True, slots=True)
class MoveEvent:
    """Bytes moved in one direction (see ``DIRECTIONS``) by one copy or one disk transaction."""

    direction: str
    nbytes: int
    seconds: float | None = None
    timer: Callable[[], float | None] | None = None


Event = Union[OpenEvent, CommitEvent, MoveEvent]


class Subscription:
    """One observer's queue of events."""

    def __init__(self, log: "EventLog", maxlen: int) -> None:
        self._log = log
        self._queue: deque[Event] = deque(maxlen=maxlen)
        self._waiting: list[MoveEvent] = []  # moves whose duration is not known yet
        self._maxlen = maxlen
        self.dropped = 0

    def _put(self, event: Event) -> None:
        if len(self._queue) == self._maxlen:
            self.dropped += 1  # approximate under races; it only reports that drains are too rare
        self._queue.append(event)

    def drain(self) -> list[Event]:
        """Events queued since the last drain, oldest first; moves still in flight wait for a later one."""
        events: list[Event] = []
        waiting, self._waiting = self._waiting, []
        pending = list(waiting)
        while True:
            try:
                pending.append(self._queue.popleft())
            except IndexError:
                break
        for event in pending:
            if isinstance(event, MoveEvent) and event.seconds is None and event.timer is not None:
                seconds = event.timer()
                if seconds is None:
                    if len(self._waiting) < self._maxlen:
                        self._waiting.append(event)
                    else:
                        self.dropped += 1
                    continue
                event = replace(event, seconds=seconds, timer=None)
            events.append(event)
        return events

    def close(self) -> None:
        """Stop receiving events."""
        self._log._unsubscribe(self)


class EventLog:
    """Fan-out of events to subscribers. ``emit`` is safe from any thread."""

    def __init__(self) -> None:
        # Replaced, never mutated: emit iterates a snapshot without a lock; the lock only orders
        # subscribers' comings and goings, so none is lost to a race between two of them.
        self._subscribers: tuple[Subscription, ...] = ()
        self._lock = threading.Lock()

    def subscribe(self, maxlen: int = 100_000) -> Subscription:
        sub = Subscription(self, whole_number(maxlen, "maxlen (events kept for a slow reader)", 1))
        with self._lock:
            self._subscribers = (*self._subscribers, sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not sub)

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    def emit(self, event: Event) -> None:
        for sub in self._subscribers:
            sub._put(event)
