"""One open's disk reads spread over the calling thread and a few helper threads.

Protocol: ``ReadPool(threads)`` once per store; ``run(items, read, ready)`` calls ``read(i)`` for
the ascending ``items`` and returns once every read it started has ended. A read returns False for
a miss: a restore is a prefix, so no read is started past the first miss (reads past it that ran
already are the caller's to discard, in order of ``items``). The calling thread reads ``items[0]``;
helpers take the others from the front, once ``ready`` is set: by the first read, as soon as what
the others write into exists (a restore's buffer, sized by the first record), or when it ends. An
exception out of a read is raised by ``run`` after every read ended, where it came from the first
miss (one past it would not have run one at a time); a signal handler's (``SystemExit``, or a
timeout's ``Exception``: ``interrupts.raised_by_signal_handler``) or any other that is no
``Exception`` wherever it came from. ``close`` lets the helpers go. ``ReadPool(threads, start)``:
each helper runs ``start`` first (the store's: its CUDA device made the helper's own, as the disk
writer's is, for the pool buffers a read takes, whose reclaim asks the copies' events).

Why: a read is a copy out of LMDB's map and a checksum (numpy and xxhash, both without the GIL),
bound by one core's memory bandwidth; a restore of several records reads them side by side.
"""

from __future__ import annotations

import math
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .interrupts import raised_by_signal_handler, stat_or_none

READ_THREADS = 3  # helpers at most: past about four readers the memory bus, not the cores, bounds a copy


CGROUP_ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"


def cgroup_cpus(root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> float | None:
    """CPUs' worth of time this process's cgroups give it (quota over period, the least along
    its cgroup and their ancestors: cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us``), or None where none sets one or none can be read. ``membership``
    (``/proc/self/cgroup``) names the process's cgroups below ``root``; inside a container
    ``root`` is often the container's own cgroup, where that path does not exist: the ancestors
    that do are read."""
    try:
        with open(membership, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        if raised_by_signal_handler(exc):  # a timeout's, taken for no cgroup: the program's timeout lost
            raise
        lines = []
    places: list[tuple[str, str]] = []  # (a hierarchy's directory, the process's path in it)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            places.append((root, path))
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, controllers)  # "cpu,cpuacct", or "cpu" where mounted apart
            # stat_or_none, not os.path.isdir: it answers False to a signal handler's timeout.
            found = stat_or_none(base)
            places.append((base if found is not None and stat.S_ISDIR(found.st_mode) else os.path.join(root, "cpu"),
                           path))
    if not places:
        places = [(root, "/"), (os.path.join(root, "cpu"), "/")]
    least: float | None = None
    for base, path in places:
        parts = [part for part in path.split("/") if part and part not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            cpus = _quota(os.path.join(base, *parts[:depth]))
            if cpus is not None and (least is None or cpus < least):
                least = cpus
    return least


def _quota(directory: str) -> float | None:
    """One cgroup directory's CPU quota in CPUs, or None (unlimited, or nothing there to read)."""
    try:
        with open(os.path.join(directory, "cpu.max"), encoding="ascii") as f:
            quota, period = f.read().split()[:2]  # "max 100000" where unlimited
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        if raised_by_signal_handler(exc):
            raise
        try:
            with open(os.path.join(directory, "cpu.cfs_quota_us"), encoding="ascii") as f:
                quota = f.read().strip()  # -1 where unlimited
            with open(os.path.join(directory, "cpu.cfs_period_us"), encoding="ascii") as f:
                period = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            if raised_by_signal_handler(exc):
                raise
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def helper_threads(limit: int = READ_THREADS, cgroup_root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> int:
    """Helpers worth starting: one fewer than the CPUs this process may run on (its affinity, and
    its cgroups' CPU quota rounded up: a container given 1.5 CPUs gets more read with two
    threads than with one), at most ``limit``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:
        if raised_by_signal_handler(exc):
            raise
        cpus = os.cpu_count() or 1
    quota = cgroup_cpus(cgroup_root, membership)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(0, min(limit, cpus - 1))


class Latch:
    """Set once (by any thread, as often as it likes), waited for by any number of threads. A
    ``threading.Event`` runs Python code (``Condition.__exit__``, ``notify_all``) while it holds
    its lock: a signal handler raising as one of those starts (the main thread's, where CPython
    runs handlers) left the lock held, and the next ``set`` waited for itself for good. Here a
    C lock, held until set, is a baton: each waiter takes it and passes it on, and a release
    that finds it free (a second ``set``, or a waiter's after a ``set`` let it go) is ignored."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            pass  # set already

    def wait(self) -> None:
        self._lock.acquire()
        self.set()


class _Task:
    """One helper's share of a run, claimed by the helper that takes it or by the caller (that
    cancels it) through ``_claim``: the first claim appended wins (a list's append is one C
    call, so a claim a handler's exception cut short is seen by the claim retried after it).
    ``done`` is released once a claimed task ended, ``finished`` set before it: no Future, whose
    Condition runs Python code in the caller's thread while holding its lock."""

    __slots__ = ("claims", "done", "finished", "error")

    def __init__(self) -> None:
        self.claims: list[bool] = []  # True: a helper's claim, False: the caller's
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False
        self.error: BaseException | None = None


def _claim(task: _Task, helper: bool) -> bool:
    """Whether the claim of ``helper`` (or of the caller) is the one that counts."""
    task.claims.append(helper)
    return task.claims[0] is helper


def _work(tasks: "queue.SimpleQueue[Any]", start: Callable[[], None] | None = None) -> None:
    """A helper thread: runs ``start``, then the tasks put on ``tasks`` until a None."""
    if start is not None:
        try:
            start()
        except Exception:  # noqa: BLE001 - the reads need none of it: they go on without
            pass
    while True:
        item = tasks.get()
        if item is None:
            return
        task, run = item
        del item
        if _claim(task, True):
            try:
                run()
            except BaseException as exc:  # noqa: BLE001 - the caller's, raised by its wait
                task.error = exc
            finally:
                task.finished = True
                task.done.release()
        # Nothing of the task kept while waiting for the next: a store its reads referred to is
        # collected (and closed) when its last holder drops it.
        del task, run


def _settle(task: _Task) -> None:
    """Until ``task`` ended, or at once when the caller's claim cancels it (never started)."""
    if _claim(task, False):
        return
    while not task.finished:
        task.done.acquire()  # released once ended: ``finished`` was set before


def _wait(tasks: list[_Task], queue: deque[int]) -> BaseException | None:
    """Until every helper task that started ended; one still queued (the helpers busy with
    another run's reads) is cancelled. Also when another signal's handler raises in the wait
    (Ctrl-C is held off there): the helpers' reads write into what the caller lets go of once
    ``run`` ends, so that exception is returned for the caller to raise after them (the helpers
    starting no other), as is an error out of a task."""
    raised: BaseException | None = None
    for task in tasks:
        while True:
            try:
                _settle(task)
            except BaseException as exc:  # noqa: BLE001 - raised once the helpers ended
                raised = raised or exc
                queue.clear()
                continue  # each of its steps is safe to take again
            break
        if task.error is not None:
            raised = raised or task.error
    return raised


class ReadPool:
    """Helper threads for ``run`` (started at the first run that uses them); see the module's
    protocol. Daemon threads, not a ``ThreadPoolExecutor``'s: the interpreter's exit joins
    those, and a helper stuck in a read of a hung disk (or waiting for the first read's buffer,
    stuck there) would hang it; a store's close at exit gives up on such a read instead."""

    def __init__(self, threads: int, start: Callable[[], None] | None = None) -> None:
        self.threads = threads
        self._start = start
        self._tasks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def _submit(self, count: int, run: Callable[[], None], tasks: list[_Task]) -> None:
        """Queue ``run`` for up to ``count`` helpers, each task put in ``tasks`` before it is
        queued: a handler's exception between the two leaves one the caller cancels."""
        with self._lock:
            if self._closed or count <= 0 or os.getpid() != self._pid:
                return  # a forked child has none of the parent's threads
            while len(self._workers) < self.threads:
                thread = threading.Thread(target=_work, args=(self._tasks, self._start), daemon=True,
                                          name=f"tierkv-disk-read-{len(self._workers)}")
                try:
                    thread.start()
                except RuntimeError:
                    break  # no thread to be had (the interpreter shutting down): those started read
                self._workers.append(thread)
            for _ in range(min(count, len(self._workers))):
                task = _Task()
                tasks.append(task)
                self._tasks.put((task, run))

    def run(self, items: Sequence[int], read: Callable[[int], bool], ready: Latch | None = None) -> None:
        if not items:
            return
        queue = deque(items[1:])
        misses: list[int] = []
        errors: dict[int, BaseException] = {}
        gate = ready if ready is not None else Latch()
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
                except Exception as exc:  # noqa: BLE001 - raised by run, in order
                    if raised_by_signal_handler(exc):
                        # Not the read's (a SIGALRM timeout in the calling thread, the main
                        # one): it came wherever the read was, so it must not go with a read
                        # past the miss. Raised as the ones below are.
                        queue.clear()
                        raise
                    errors[i] = exc
                    hit = False
                except BaseException:
                    # Never a read's error (a signal handler's sys.exit() in the calling thread):
                    # raised by run wherever it came, once the helpers ended, and none starts.
                    queue.clear()
                    raise
                if not hit:
                    misses.append(i)

        # Emptied once every helper that started ended: a task still queued, or one a helper has
        # just run, then holds nothing of the reads (nor of the store they read for).
        work = [drain]

        def helper() -> None:
            gate.wait()
            for run_reads in work:
                run_reads()

        tasks: list[_Task] = []
        try:
            self._submit(min(self.threads, len(items) - 1), helper, tasks)
            hit = False
            try:
                hit = read(items[0])
            finally:
                if not hit:
                    misses.append(items[0])
                gate.set()
            if hit:
                drain()
        except BaseException:
            queue.clear()  # raising: the helpers start no further read
            raise
        finally:
            # Each step taken again after a signal handler's exception cut it short as it
            # started (the first set above went through, or this one will): no helper is left
            # waiting for the gate, or reading into what the caller lets go of, once run ends.
            try:
                gate.set()
                failed = _wait(tasks, queue)
            except BaseException:
                gate.set()
                _wait(tasks, queue)  # what it finds beside this exception goes unraised
                raise
            finally:
                work.clear()
            if failed is not None:
                raise failed
        if errors:
            first = min(misses)
            if first in errors:
                raise errors[first]

    def close(self) -> None:
        """Let the helpers go once the tasks queued end (without waiting for them)."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for _ in workers:
            self._tasks.put(None)

    def __del__(self) -> None:
        # A pool collected unclosed (its store's close gave up on a read): its idle helpers go.
        for _ in getattr(self, "_workers", ()):
            self._tasks.put(None)
