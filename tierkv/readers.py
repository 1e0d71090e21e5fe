"""One open's disk reads spread over the calling thread and a few helper threads.

Protocol: ``ReadPool(threads)`` once per store; ``run(items, read, ready)`` calls ``read(i)`` for
the ascending ``items`` and returns once every read it started has ended. A read returns False for
a miss: a restore is a prefix, so no read is started past the first miss (reads past it that ran
already are the caller's to discard, in order of ``items``). The calling thread reads ``items[0]``;
helpers take the others from the front, once ``ready`` is set: by the first read, as soon as what
the others write into exists (a restore's buffer, sized by the first record), or when it ends. An
exception out of a read is raised by ``run`` after every read ended, where it came from the first
miss (one past it would not have run one at a time). ``close`` lets the helpers go.

Why: a read is a copy out of LMDB's map and a checksum (numpy and xxhash, both without the GIL),
bound by one core's memory bandwidth; a restore of several records reads them side by side.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

READ_THREADS = 3  # helpers at most: past about four readers the memory bus, not the cores, bounds a copy


def helper_threads(limit: int = READ_THREADS) -> int:
    """Helpers worth starting: one fewer than the CPUs this process may run on, at most ``limit``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(0, min(limit, cpus - 1))


class ReadPool:
    """Helper threads for ``run`` (made at the first run that uses them); see the module's protocol."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _submit(self, count: int, task: Callable[[], None]) -> list[Future[None]]:
        with self._lock:
            if self._closed or count <= 0:
                return []
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="tierkv-disk-read")
            try:
                return [self._executor.submit(task) for _ in range(count)]
            except RuntimeError:
                return []  # the interpreter shutting down: the calling thread reads alone

    def run(self, items: Sequence[int], read: Callable[[int], bool], ready: threading.Event | None = None) -> None:
        if not items:
            return
        queue = deque(items[1:])
        misses: list[int] = []
        errors: dict[int, BaseException] = {}
        gate = ready if ready is not None else threading.Event()
        if ready is None:
            gate.set()

        def drain() -> None:
            while True:
                try:
                    i = queue.popleft()  # atomic: threads never take one item twice
                except IndexError:
                    return
                if misses and i > min(misses):
                    return  # ascending: every item left is past the miss too
                try:
                    hit = read(i)
                except BaseException as exc:  # noqa: BLE001 - raised by run, in order
                    errors[i] = exc
                    hit = False
                if not hit:
                    misses.append(i)

        def helper() -> None:
            gate.wait()
            drain()

        futures = self._submit(min(self.threads, len(items) - 1), helper)
        try:
            hit = False
            try:
                hit = read(items[0])
            finally:
                if not hit:
                    misses.append(items[0])
                gate.set()
            if hit:
                drain()
        finally:
            gate.set()
            for future in futures:
                # One still queued (the helpers busy with another open's reads) has nothing left to do.
                if not future.cancel():
                    future.result()  # drain keeps every read's error: only the pool's own could come out
        if errors:
            first = min(misses)
            if first in errors:
                raise errors[first]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
