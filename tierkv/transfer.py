"""Moves between tiers, as jobs: submit, then ``done()`` to poll or ``wait()`` to block.

``Job`` is the one handle every move returns (vLLM's ``transfer_async``/``get_finished`` shape).
A job completes exactly once, with a value or an exception; ``wait`` re-raises the exception.

``CopyEngine`` copies block tensors between the device and host:
  * CUDA: each copy runs on a dedicated stream that first waits on the compute stream (a copy
    that skips this reads half-written KV), into pinned host memory for D2H; the job is an event
    that ``done()`` queries without blocking. A copy's device tensors are made known to the
    caching allocator before it is issued, and the caller's current stream is put back by C
    calls alone, so that another signal's handler raising anywhere in between frees no memory a
    queued copy still uses and leaves no copy stream current.
  * CPU: device and host are the same memory, so a move hands the immutable tensor over and the
    job is complete at once. The interface does not change between the two.

``BackgroundWriter`` owns one thread that drains a queue in batches and hands each batch to a
function (the disk tier's write transaction); each submitted item gets a job that completes when
its batch did. ``flush()`` waits for everything submitted before it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from .interrupts import raised_by_signal_handler
from .units import parse_bytes

logger = logging.getLogger("tierkv")

T = TypeVar("T")
_PENDING = object()
# A blocked wait looks at the flag again this often (seconds): see ``_Flag.wait``.
_RECHECK = 1.0


class _Flag:
    """A job's completion: ``threading.Event``'s ``is_set``/``set``/``wait``, made of plain locks
    taken in C only, so that another signal's handler raising in a waiting thread (a SIGALRM
    timeout around ``flush``) leaves no lock held behind it.

    Event.wait is Python (its Condition's ``__enter__``, ``Condition.wait``): a handler raising
    as the Condition's lock was taken left it held for good, and the completing thread (the disk
    writer, at a flush marker's ``set_result``) blocked in ``set`` for ever, and every ``flush``
    and ``close`` after it; one raising in ``Condition.wait`` once the lock was let go raised
    ``RuntimeError: release unlocked lock`` in place of the handler's exception.

    Here each waiter blocks on a lock of its own, taken before it is listed, that ``set`` lets
    go; ``set`` never waits for a waiter, only for the list's lock, held by ``with`` alone
    (no handler runs between a C lock's acquire and its ``with``). A waiter a handler cut short
    may stay listed, and is let go for no one. A ``set`` a handler cut short between raising the
    flag and letting its waiters go (a main-thread completion: a CUDA copy's ``done``) leaves
    them to see the flag when their wait next looks (``_RECHECK``)."""

    __slots__ = ("_flag", "_lock", "_waiters")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._waiters: list[Any] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._lock:
            # Raised under the lock: a waiter listed after this never is, it sees the flag.
            self._flag = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        waiter = threading.Lock()
        waiter.acquire()
        with self._lock:
            if self._flag:
                return True
            self._waiters.append(waiter)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            left = _RECHECK if deadline is None else min(_RECHECK, deadline - time.monotonic())
            if left <= 0:
                with self._lock:  # timed out: not kept listed by a job polled with timeouts
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                break
            if waiter.acquire(timeout=left):
                break
        return self._flag


# Shared by every job made complete: a block read or handed over makes one per block per turn,
# and a flag (two locks) of its own cost more than the rest of the job.
_DONE = _Flag()
_DONE.set()
_DONE_LOCK = threading.Lock()


class Job(Generic[T]):
    """A move in flight. Thread-safe; completes once."""

    __slots__ = ("_event", "_value", "_error", "_poll", "_lock", "lease")

    def __init__(self, poll: Callable[[], bool] | None = None) -> None:
        self._event = _Flag()
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        # A poll function turns an external completion signal (a CUDA event) into done().
        self._poll = poll
        self._lock = threading.Lock()
        self.lease: Any = None  # the pool buffer (tierkv.pool.Lease) the result lives in, if any

    @classmethod
    def completed(cls, value: T) -> "Job[T]":
        if cls is not Job:
            job: Job[T] = cls()
            job.set_result(value)
            return job
        job = object.__new__(cls)
        job._event, job._lock = _DONE, _DONE_LOCK
        job._value, job._error, job._poll, job.lease = value, None, None, None
        return job

    def set_result(self, value: T) -> None:
        with self._lock:
            if not self._event.is_set():
                self._value = value
                self._event.set()

    def set_error(self, error: BaseException) -> None:
        with self._lock:
            if not self._event.is_set():
                self._error = error
                self._event.set()

    def done(self) -> bool:
        if self._event.is_set():
            return True
        return self._poll is not None and self._poll()

    def fence(self) -> Any:
        """What tells when this job is done (``done()``) without holding its result: registered on
        a pool buffer (``Lease.after``), which keeps it until the buffer's next use, a job would
        keep its tensor alive, on the GPU outside every budget."""
        return self if self._poll is not None else _Fence(self._event)

    def error(self) -> BaseException | None:
        """The exception a done job failed with; None if it succeeded (or is not done). Raises
        nothing: an ``except`` around ``wait`` also catches what a signal's handler raises in
        that call, and took it for the job's failure."""
        # Only once done: a main-thread set_error that another signal's handler cut short between
        # the error and the flag (an _unless_queued in a first handler's cleanup) left a job not
        # done naming a failure (the next set_error, a reap's, still completes it).
        return self._error if self._event.is_set() else None

    def wait(self, timeout: float | None = None) -> T:
        # is_set() first: a restore waits on every block once per layer, mostly done long since.
        if not self._event.is_set() and not self._event.wait(timeout):
            raise TimeoutError("move did not complete in time")
        if self._error is not None:
            raise self._error
        return self._value


class _Fence:
    """A job's completion alone (``Job.fence``)."""

    __slots__ = ("_event", "_cuda_event")

    def __init__(self, event: _Flag, cuda_event: Any = None) -> None:
        self._event = event
        self._cuda_event = cuda_event

    def done(self) -> bool:
        return self._event.is_set() or (self._cuda_event is not None and self._cuda_event.query())


class _CudaCopyJob(Job[torch.Tensor]):
    """A copy whose completion is a CUDA event recorded after it on its stream."""

    __slots__ = ("_cuda_event", "_tensor", "_start", "_recorded")

    def __init__(self, cuda_event: torch.cuda.Event, tensor: torch.Tensor,
                 start: torch.cuda.Event | None = None) -> None:
        # No poll callback: a bound method stored on the job would make a reference cycle that
        # keeps the tensor (GPU or pinned memory) alive until a full garbage collection.
        super().__init__()
        self._cuda_event = cuda_event
        self._tensor = tensor
        self._start = start  # a timing event recorded before the copy, for metrics
        self._recorded: set[int] = set()  # streams the allocator was told use the tensor

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    def _used_on(self, stream: torch.cuda.Stream) -> None:
        # Once per stream, not once per layer: a restore reads each block on every layer. Noted
        # once told: noted first, another signal's handler raising as the note's add returned
        # left a stream noted that the allocator never heard of: the block, evicted and freed
        # while a forward there still read it, went to the next tensor made on its own stream,
        # whose writes that forward then read.
        if stream.cuda_stream not in self._recorded:
            self._tensor.record_stream(stream)
            self._recorded.add(stream.cuda_stream)

    def stream_wait_layer(self, layer: int, seen: set[int], stream: torch.cuda.Stream | None = None
                          ) -> torch.Tensor:
        """Order ``stream`` (default: the current one) after this copy (all layers at once),
        without a host sync, and tell the allocator the tensor is used there."""
        stream = stream if stream is not None else torch.cuda.current_stream(self._tensor.device)
        if id(self._cuda_event) not in seen:
            seen.add(id(self._cuda_event))
            stream.wait_event(self._cuda_event)
        self._used_on(stream)
        return self._tensor

    def done(self) -> bool:
        if self._event.is_set():
            return True
        if self._cuda_event.query():
            self.set_result(self._tensor)
            return True
        return False

    def fence(self) -> _Fence:
        return _Fence(self._event, self._cuda_event)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if not self._event.is_set():
            if timeout is not None:
                deadline = time.monotonic() + timeout
                while not self.done():
                    if time.monotonic() > deadline:
                        raise TimeoutError("copy did not complete in time")
                    time.sleep(0.0002)  # polling a CUDA event: there is no blocking wait with a timeout
            self._cuda_event.synchronize()
            self.set_result(self._tensor)
        return super().wait(timeout)


def layer_groups(blocks: int, layers: int) -> int:
    """How many layer groups a restore of ``blocks`` blocks is copied in. Each copy call costs the
    host ~20 us whatever its size, and a restore's calls are all issued before ``open`` returns:
    about 128 calls in all keeps that to a few ms, while at least 4 groups (or one per layer for
    small restores) keep the first layers' compute overlapping the later layers' copies."""
    return max(1, min(layers, max(4, -(-128 // max(1, blocks)))))


def copy_timer(job: Job[Any]) -> Callable[[], float | None] | None:
    """For metrics: a function giving a copy's GPU-measured seconds once it finished (``None``
    before), or ``None`` when the job is no timed copy (a CPU hand-over copies nothing).

    The function holds only the two CUDA events, never the tensor: a metrics queue must not keep
    device or pinned memory alive.
    """
    if not isinstance(job, _CudaCopyJob) or job._start is None:
        return None
    start, end, index = job._start, job._cuda_event, job.device.index

    def seconds() -> float | None:
        # Under the copy's device: asked in a thread of the program's (a metrics scrape, one
        # thread per request), the query made GPU 0's context there (see ``thread_binding``).
        # The thread's device put back by a C call in a finally, as torch.cuda.device's
        # __exit__ does but with no Python call in between: a drain in the main thread that
        # another signal's handler cut there left the store's device its current one for good.
        before = torch.cuda.current_device()
        try:
            torch._C._cuda_exchangeDevice(index)
            return start.elapsed_time(end) / 1000.0 if end.query() else None
        finally:
            torch._C._cuda_maybeExchangeDevice(before)

    return seconds


def _reads_as_bytes(device: object) -> bool:
    """A byte count: a string with its unit ("2GiB"; "0" alone may mean a device's number), or a
    number (numpy's too, and a float, which ``device_budget`` then refuses saying what to write)
    past any machine's count of devices."""
    if isinstance(device, (bool, np.bool_)):
        return False
    if isinstance(device, (int, float, np.integer, np.floating)):
        return bool(device >= 1024)
    try:
        parse_bytes(device)
    except (TypeError, ValueError):
        return False
    return isinstance(device, str) and any([c.isalpha() for c in device])


def resolve_device(device: object) -> torch.device:
    """The hot tier's device: ``None`` means CUDA when available, else CPU."""
    if device is None:
        # Resolved as "cuda" would be, to an index: a model's parameters report cuda:N, and a
        # device without one never equals it (every open refused), nor can a thread set it.
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)  # type: ignore[arg-type]
    except (TypeError, RuntimeError, ValueError) as exc:
        # ValueError: an int past a C long (device=2**70). TieredStore("kv", "2GiB"): a budget
        # given where the device goes, second.
        budget = _reads_as_bytes(device)
        raise ValueError(f"device={device!r} is not a device; pass None, 'cpu', 'cuda' or 'cuda:N'"
                         + (f" (a byte count: pass it by name, device_budget={device!r})" if budget else "")) from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device type {resolved.type!r} is not supported; pass None, 'cpu', 'cuda' or 'cuda:N'")
    if resolved.type == "cpu":
        # One host memory: torch puts tensors for "cpu:1" on "cpu", so a model's device never
        # equals torch.device("cpu:1"), and every open would refuse the model.
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(resolved)!r} was asked for but CUDA is not available; pass device=None or 'cpu'")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"numbered from 0; pass one of them or None"
                         + (f" (a byte count: pass it by name, device_budget={device!r})"
                            if _reads_as_bytes(device) else ""))
    return resolved


class _LayeredCudaJob(_CudaCopyJob):
    """Host -> device copies of several blocks, issued layer group by layer group: each layer
    maps to the event of its group."""

    __slots__ = ("_layer_events",)

    def __init__(self, layer_events: list[torch.cuda.Event], tensor: torch.Tensor,
                 start: torch.cuda.Event | None = None) -> None:
        super().__init__(layer_events[-1], tensor, start)
        self._layer_events = layer_events

    def stream_wait_layer(self, layer: int, seen: set[int], stream: torch.cuda.Stream | None = None
                          ) -> torch.Tensor:
        """Order ``stream`` (default: the current one) after layer ``layer``'s copy, without a host
        sync. Blocks of one restore share their events: ``seen`` (event ids) makes each wait once."""
        stream = stream if stream is not None else torch.cuda.current_stream(self._tensor.device)
        event = self._layer_events[layer]
        if id(event) not in seen:
            seen.add(id(event))
            stream.wait_event(event)
        self._used_on(stream)
        return self._tensor


def _record_on(stream: "torch.cuda.Stream", *tensors: torch.Tensor) -> None:
    """Tell the caching allocator that a copy on ``stream`` uses the CUDA ones of ``tensors``:
    freed, their memory is reused only once the work queued there by then is done. Host
    buffers need no telling (the pinned allocator records each copy itself; the pool fences)."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(stream)


def _streams_to_swap(stream: "torch.cuda.Stream") -> tuple[dict[str, int], dict[str, int], int | None]:
    """``torch._C._cuda_setStream``'s arguments that make ``stream`` the current one (and its
    device the current device), then those that put back the current stream of its device as it
    was, and the calling thread's current device where that is another one (None where not),
    for ``torch._C._cuda_maybeExchangeDevice``.

    What ``with torch.cuda.stream(stream)`` does, but its put-back is in a Python ``__exit__``,
    three Python calls deep: another signal's handler raising at any of them (a SIGALRM timeout
    around a turn) left the copy stream the thread's current one for good, the program's own
    work (its forwards) queued behind tierkv's copies from then on. A ``finally`` of C calls
    alone has no point where a handler runs before its first call returns: only where the
    thread's current device is not the stream's can one raise between the two, leaving the
    stream's device current (its stream as it was). That device is put back as
    ``torch.cuda.device`` puts one back, not by setting the stream there (as ``torch.cuda.stream``
    does): a device not yet used in this thread is then not made current, which made its CUDA
    context (hundreds of MiB on GPU 0, for a thread that never set its device and a store on
    another GPU)."""
    def args(s: "torch.cuda.Stream") -> dict[str, int]:
        return {"stream_id": s.stream_id, "device_index": s.device_index, "device_type": s.device_type}

    mine = torch.cuda.current_stream(stream.device)
    current = torch.cuda.current_device()
    return args(stream), args(mine), current if current != stream.device_index else None


class CopyEngine:
    """Device <-> host copies of block tensors, asynchronous on CUDA."""

    def __init__(self, device: torch.device,
                 host_alloc: Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, Any]] | None = None
                 ) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Destinations of device -> host copies: (tensor, lease) from the host tier's pool.
        self._host_alloc = host_alloc
        if self.is_cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)

    def _copy(self, src: "torch.Tensor | Job[torch.Tensor]", dst: torch.Tensor,
              stream: "torch.cuda.Stream") -> Job[torch.Tensor]:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if isinstance(src, _CudaCopyJob) and not src.done():
            # Chain on the copy that produces src, on the GPU, without a host sync.
            stream.wait_event(src._cuda_event)
            src = src._tensor
        elif isinstance(src, Job):
            src = src.wait()
        # The caching allocator must not hand src's or dst's memory to another tensor before the
        # copy on this side stream has finished: told before the copy is issued. Told after it,
        # another signal's handler raising as the copy returned left a device tensor freed with
        # the copy still queued (the job never made): a late write into memory a tensor made
        # on the compute stream already held.
        _record_on(stream, src, dst)
        side, mine, other = _streams_to_swap(stream)
        try:
            torch._C._cuda_setStream(**side)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        finally:
            # The caller's stream and device put back by C calls alone (see _streams_to_swap).
            torch._C._cuda_setStream(**mine)
            if other is not None:
                torch._C._cuda_maybeExchangeDevice(other)
        return _CudaCopyJob(event, dst, start)

    def ready(self, tensor: torch.Tensor) -> Job[torch.Tensor]:
        """A tensor just written on the current stream, as a job: on CUDA an event recorded there,
        so that readers on other streams (another thread's turn, a copy stream) order after it."""
        if not tensor.is_cuda:
            return Job.completed(tensor)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return _CudaCopyJob(event, tensor)

    @staticmethod
    def _meta(src: "torch.Tensor | Job[torch.Tensor]") -> torch.Tensor:
        if isinstance(src, _CudaCopyJob):
            return src._tensor
        return src.wait() if isinstance(src, Job) else src

    def to_host(self, src: "torch.Tensor | Job[torch.Tensor]") -> Job[torch.Tensor]:
        """A host copy of ``src`` (a tensor, or the job producing one)."""
        if not self.is_cuda:
            return src if isinstance(src, Job) else Job.completed(src)
        like = self._meta(src)
        if not like.is_cuda:
            return src if isinstance(src, Job) else Job.completed(src)
        if self._host_alloc is not None:
            dst, lease = self._host_alloc(tuple(like.shape), like.dtype)
        else:
            dst, lease = torch.empty(like.shape, dtype=like.dtype, pin_memory=True), None
        job = self._copy(src, dst, self._d2h)
        if lease is not None:
            job.lease = lease
            lease.after(job.fence())  # the copy writes the buffer: it is not reused before the copy is done
        return job

    def to_device_many(self, srcs: "Sequence[torch.Tensor | Job[torch.Tensor]]") -> list[Job[torch.Tensor]]:
        """Device copies of block tensors shaped (layers, ...), issued layer-major across blocks
        on CUDA, so that layer i's copies complete before layer i+1's and a reader can wait for
        one layer (``stream_wait_layer``) while the rest are still in flight."""
        if not self.is_cuda or not srcs:
            return [self.to_device(src) for src in srcs]
        stream = self._h2d
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pairs = []
        for src in srcs:
            if isinstance(src, _CudaCopyJob) and not src.done():
                stream.wait_event(src._cuda_event)
                src = src._tensor
            elif isinstance(src, Job):
                src = src.wait()
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            # Before any copy is issued, as _copy's: a handler raising past the first copy
            # dropped every destination still queued for a write.
            _record_on(stream, src, dst)
            pairs.append((src, dst))
        layers = max(src.shape[0] for src, _ in pairs)
        per_group = -(-layers // layer_groups(len(pairs), layers))
        events: list[torch.cuda.Event] = []  # per layer: its group's event
        side, mine, other = _streams_to_swap(stream)
        try:
            torch._C._cuda_setStream(**side)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for first in range(0, layers, per_group):
                last = min(first + per_group, layers)
                for src, dst in pairs:
                    end = min(last, src.shape[0])
                    if first < end:
                        dst[first:end].copy_(src[first:end], non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                events.extend([event] * (last - first))
        finally:
            torch._C._cuda_setStream(**mine)  # as _copy's
            if other is not None:
                torch._C._cuda_maybeExchangeDevice(other)
        return [_LayeredCudaJob(events[: src.shape[0]], dst, start) for src, dst in pairs]

    def to_device(self, src: "torch.Tensor | Job[torch.Tensor]") -> Job[torch.Tensor]:
        """A device copy of ``src`` (a tensor, or the job producing one)."""
        if not self.is_cuda:
            if isinstance(src, Job):
                return src
            return Job.completed(src if src.device == self.device else src.to(self.device))
        like = self._meta(src)
        if like.device == self.device:
            return src if isinstance(src, Job) else Job.completed(src)
        dst = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return self._copy(src, dst, self._h2d)


def thread_binding(device: torch.device | None) -> Callable[[], None] | None:
    """What a thread of the store's own runs first where it may call CUDA (a copy event's query
    or wait, a pinned allocation): ``device`` made its current device; None off CUDA. A thread
    starts on GPU 0, whose primary context CUDA's runtime makes, hundreds of MiB on that GPU, at
    the first such call there, in a process whose store and model are on another one."""
    if device is None or device.type != "cuda":
        return None
    return lambda: torch.cuda.set_device(device)


def cpu_wait_seconds() -> float | None:
    """How long the calling thread has waited, runnable, for a CPU since it started (Linux's
    schedstat), or None where the OS does not tell. The disk writer runs at a lower priority than
    the turns: beside a busy ``generate`` most of its wall time is this wait, not the disk's."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _lower_priority() -> None:
    """Nice the calling thread (Linux): a spill must yield the CPU to the decode step's threads,
    whose parallel regions stall behind any one of them that loses its core."""
    try:
        me = threading.get_native_id()
        # Never raised: a thread made by one niced past 10 (`nice -n 19`) stays there, which
        # only root's setpriority would otherwise have undone.
        os.setpriority(os.PRIO_PROCESS, me, max(10, os.getpriority(os.PRIO_PROCESS, me)))
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class WriteNotQueued(RuntimeError):
    """A job its caller tracked before ``BackgroundWriter.submit``, which an exception (another
    signal's handler) cut short before its item was queued (``BackgroundWriter.holds``): its
    item is written again, not taken for the disk's failure."""


class WriteAbandoned(RuntimeError):
    """A queued write that ``BackgroundWriter.close(timeout)`` gave up on."""


class BackgroundWriter(Generic[T]):
    """One thread applying queued items in batches; each item's job completes with its batch.

    ``apply(batch)`` returns one entry per item: ``None`` for success or the exception that item
    failed with. An exception raised by ``apply`` itself fails the whole batch.

    With a ``linger`` (seconds), a batch is taken that long after its first item arrived, or at
    once when it holds ``linger_bytes`` (default: a quarter of ``max_batch_bytes``; the items'
    buffers stay held meanwhile), when it is full, or when ``flush``, ``nudge`` or ``close`` was
    called: a light load's items (a turn's few blocks at a time) then go in one batch rather than
    one batch each.

    A batch is full at ``max_batch`` items, each counting ``count_of(item)`` of them (at least
    one), or at ``max_batch_bytes`` of ``size_of``. An item is never split: one that would take
    the batch past either waits for the next batch, unless it is the batch's first (a forget's
    64-block delete behind 63 items made a transaction of 127). So a batch passes
    ``max_batch_bytes`` only by an item larger than that alone: the store's bound is what a
    transaction may take at its disk budget (``write_batch_bytes``), where the last block taken
    had carried one up to a block's bytes past it.
    """

    def __init__(self, apply: Callable[[Sequence[T]], Sequence[BaseException | None]], *, name: str,
                 max_batch: int = 64, max_batch_bytes: int = 64 << 20,
                 size_of: Callable[[T], int] = lambda item: 0,
                 count_of: Callable[[T], int] = lambda item: 1,
                 abandonable: Callable[[T], bool] = lambda item: True,
                 device: torch.device | None = None, linger: float = 0.0,
                 linger_bytes: int | None = None) -> None:
        if linger < 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger}")
        self._apply = apply
        self._linger = linger
        self._max_batch = max_batch
        self._max_batch_bytes = max_batch_bytes
        self._linger_bytes = max_batch_bytes // 4 if linger_bytes is None else linger_bytes
        self._size_of = size_of
        self._count_of = count_of
        self._abandonable = abandonable
        self._device = device
        # A SimpleQueue: its put is one C call, where no signal's handler runs (Queue.put is Python,
        # and one raising in it could leave an item queued or not): ``submit`` counts an item and
        # queues it with no point between where one could.
        self._queue: queue.SimpleQueue[tuple[T, Job[None]] | None] = queue.SimpleQueue()
        self._closed = False
        # Orders submissions against close(): nothing is queued behind the stop signal.
        self._gate = threading.Lock()
        # A _Flag, not an Event: Event.set is Python, and another signal's handler raising in a
        # close as its Condition's lock was taken left it held (a close called again hung in set).
        self._abandon = _Flag()
        self._abandoned = 0
        self._stopping = False  # the writer took close's signal from the queue
        # Bytes (``size_of``) submitted and not yet applied or failed: ``wait_below``.
        self._backlog = 0
        self._settled_items = 0  # ever settled: progress, for a waiter to tell a stalled writer
        # id(job) -> its item's size and count (``count_of``), until it is settled; items of no
        # size too: a byte bound alone let references, deletes and stamps pile up without end
        # behind a slow disk.
        self._sizes: dict[int, tuple[int, int]] = {}
        self._queued = 0  # the counts of the items in ``_sizes``: ``queued``
        # The counters' lock, entered as a plain lock (C) by the main thread too. Not a Condition:
        # its __enter__ and wait are Python, and another signal's handler raising as its lock's
        # acquire returned left the lock taken for good (the writer's next _settled hung), or
        # raising in wait once it had let the lock go made the ``with`` let go of it again (a
        # RuntimeError in place of the handler's, or the writer's own hold let go under it).
        self._counts = threading.Lock()
        # ``wait_below``'s waiters, a lock each, held until ``_wake`` lets it go.
        self._waiters: list[Any] = []
        # Set by the thread as it ends; read, not Thread.is_alive(): another signal's handler
        # raising inside is_alive (its tstate lock's acquire returning) makes CPython's except
        # there let go of the live thread's lock and mark it stopped for good (wait_below then
        # returned at once, and close took a writer inside a transaction for one that ended).
        self._exited = False
        # Set last as the thread ends: waited for, not Thread.join, whose acquire of the live
        # thread's lock is is_alive's own (a close cut short there marked the thread stopped, and
        # a close called again to finish it returned before the batch in flight was done).
        self._ended = _Flag()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T, job: Job[None] | None = None) -> Job[None]:
        """Queue ``item``; its job (``job``, made and tracked by the caller before this call, so
        that an exception raised as this returns leaves no queued item untracked, or a new one).
        Where an exception (another signal's handler) cut it short, ``holds(job)`` tells whether
        the item was queued: it was counted and queued together, or neither."""
        if job is None:
            job = Job()
        try:
            size = self._size_of(item)
        except Exception as exc:  # noqa: BLE001 - the writer's thread meets it again, and fails the item
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's, say: the caller's, not the item's
            size = 0
        count = self._count(item)
        place, sizes, entry = id(job), (size, count), (item, job)
        with self._gate:
            if self._closed:
                raise RuntimeError("the background writer is closed")
            with self._counts:
                # No call from the first change to the put's own (C, atomic): no signal's handler
                # runs between them, so an item is counted (backlog, ``holds``) only if queued.
                self._backlog += size
                self._queued += count
                self._sizes[place] = sizes
                self._queue.put(entry)
        return job

    def holds(self, job: Job[None]) -> bool:
        """Whether ``submit`` queued ``job``'s item (settled since, or not yet): for a caller whose
        ``submit`` an exception cut short, which cannot tell from where it was raised."""
        # In this order: the writer completes a job before it lets go of its entry.
        return id(job) in self._sizes or job.done()

    def backlog(self) -> int:
        """Bytes (``size_of``) of the items submitted and not yet applied (or failed)."""
        return self._backlog

    def queued(self) -> int:
        """Items submitted and not yet applied (or failed), of any size, each counted as a batch
        counts it (``count_of``): a 64-block delete is a transaction's worth of work, not one
        item's."""
        return self._queued

    def wait_below(self, limit: int, timeout: float | None = None, items: int | None = None) -> bool:
        """Block until the backlog is at most ``limit`` bytes, and at most ``items`` items are
        queued (``queued``; None: any number), or the thread is gone; whether they are. Called from the
        writer's own thread it does not wait."""
        def under() -> bool:
            return self._backlog <= limit and (items is None or self._queued <= items)

        def done() -> bool:
            return under() or self._exited or self._abandon.is_set()

        if self.on_thread():
            return under()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # A lock of its own, held, that _wake lets go: waited for in one C call, which a
            # signal's handler raising leaves with nothing held. One left in _waiters by such an
            # exception is let go by the next _wake, for no one.
            waiter = threading.Lock()
            waiter.acquire()
            with self._counts:
                if done():
                    return True
                self._waiters.append(waiter)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return done()
            # Looked at again every _RECHECK, as _Flag.wait: a _wake cut short in the main thread
            # (close's) between taking the list and letting its waiters go wakes them for no one.
            if not waiter.acquire(timeout=_RECHECK if left is None else min(left, _RECHECK)):
                with self._counts:  # timed out: not left for a _wake that may never come
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)

    def settled_items(self) -> int:
        """Items ever applied or failed."""
        return self._settled_items

    def _settled(self, batch: Sequence[tuple[T, Job[None]]]) -> None:
        with self._counts:
            settled = [self._sizes.pop(id(job)) for _, job in batch if id(job) in self._sizes]
            if settled:
                self._backlog -= sum(size for size, _ in settled)
                self._queued -= sum(count for _, count in settled)
                self._settled_items += len(settled)
        if settled:
            self._wake()

    def _wake(self) -> None:
        """Let every ``wait_below`` look again."""
        with self._counts:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every item submitted before this call has been applied (or the writer
        has been closed, which drains everything queued before it)."""
        job: Job[None] = Job()
        with self._gate:
            closed = self._closed
            if not closed:
                self._queue.put((_MARKER, job))
        # Decided under the gate: a marker the writer already took is done by now too, and
        # joining a writer that is not closing waited forever.
        if closed:
            self._wait_ended(timeout)
        else:
            job.wait(timeout)

    def nudge(self) -> None:
        """Apply what is queued now without lingering, and without waiting for it."""
        with self._gate:
            if not self._closed:
                self._queue.put((_MARKER, Job()))

    def close(self, timeout: float | None = None, grace: float | None = None) -> int:
        """Stop once everything queued is applied. With a ``timeout``, the abandonable items still
        queued when it expires are abandoned (their jobs fail with ``WriteAbandoned``) after the
        batch in flight, and the others are still applied; returns how many were abandoned.

        The batch in flight is waited for up to ``grace`` seconds more (None: until it is done):
        ``alive()`` then says whether the thread still runs, in an ``apply`` that does not return
        (a hung disk). Calling close again waits again: a close cut short (an interrupt, another
        signal's handler) can be finished."""
        with self._gate:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._wait_ended(timeout)
        if not self._exited:
            self._abandon.set()
            self._wake()  # waiters stop waiting for writes that may never land
            self._wait_ended(grace)
        if self._exited:
            # Ending, a few bytecodes from gone: joined so that close leaves no thread behind.
            # A join cut short here marks stopped a thread that is ending anyway.
            self._thread.join()
        return self._abandoned

    def _wait_ended(self, timeout: float | None) -> None:
        if self.on_thread():
            # As Thread.join did: the thread would wait for its own end for ever.
            raise RuntimeError("the background writer cannot be closed from its own thread")
        self._ended.wait(timeout)

    @property
    def closed(self) -> bool:
        """``close`` was called: ``submit`` raises from then on."""
        return self._closed

    def on_thread(self) -> bool:
        """The caller is the writer's own thread (which a ``close`` would join)."""
        return threading.current_thread() is self._thread

    def alive(self) -> bool:
        """The thread still runs (before ``close``, or in a batch that ``close`` stopped waiting for)."""
        return not self._exited

    def _run(self) -> None:
        batch: list[tuple[T, Job[None]]] = []
        try:
            _lower_priority()
            bind = thread_binding(self._device)
            if bind is not None:
                bind()  # event waits here must not open a context on GPU 0
            self._loop(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to every job, queued or to come
            self._fail(batch, exc)
        finally:
            self._exited = True
            self._wake()  # waiters see the thread gone
            self._ended.set()

    def _fail(self, batch: list[tuple[T, Job[None]]], exc: BaseException) -> None:
        """The thread cannot go on (an error outside ``apply``): every item, those of the batch it
        was gathering and all submitted until ``close``, fails with ``exc``; a flush returns. A
        thread that just died left them queued, and every flush and close waiting forever."""
        logger.error("tierkv: the background writer %r failed (%r); its writes fail from now on",
                     self._thread.name, exc)
        while True:
            for item, job in batch:
                if job.done():
                    continue
                if item is _MARKER:
                    job.set_result(None)
                else:
                    job.set_error(exc)
                    self._settled([(item, job)])
            if self._stopping:
                self._wake()  # waiters see the thread gone
                return  # close's signal was taken already: nothing is queued behind it
            entry = self._queue.get()
            if entry is None:
                return
            batch = [entry]

    def _loop(self, batch: list[tuple[T, Job[None]]]) -> None:
        while True:
            # An entry left in ``batch`` is one that did not fit the last batch: this one's first.
            # It came from a full batch, so the load is not light and lingering would only delay it.
            # (Kept in ``batch``, not aside: a thread that cannot go on fails it with the rest.)
            held = bool(batch)
            if not held:
                entry = self._queue.get()
                if entry is None:
                    self._stopping = True
                    return
                batch.append(entry)
            entry = batch[0]
            nbytes = self._size_of(entry[0]) if entry[0] is not _MARKER else 0
            count = self._count(entry[0])
            stop = False
            taken = 1
            flushing = held or entry[0] is _MARKER or nbytes >= self._linger_bytes
            deadline = time.monotonic() + self._linger
            while count < self._max_batch and nbytes < self._max_batch_bytes:
                wait = 0.0 if flushing else deadline - time.monotonic()
                try:
                    nxt = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = self._stopping = True
                    break
                batch.append(nxt)
                size = self._size_of(nxt[0]) if nxt[0] is not _MARKER else 0
                if count + self._count(nxt[0]) > self._max_batch or nbytes + size > self._max_batch_bytes:
                    break  # left for the next batch
                taken += 1
                count += self._count(nxt[0])
                if nxt[0] is _MARKER:
                    flushing = True  # a flush or nudge: take what is queued now, linger no more
                else:
                    nbytes += size
                    flushing = flushing or nbytes >= self._linger_bytes
            self._run_batch(batch[:taken])
            del batch[:taken]
            # Not held while the thread waits for the next item: the first and last items of the
            # batch (a PutBlock holds its block's host tensor) stayed alive until then, outside
            # every budget, for as long as the store was idle.
            entry = nxt = None
            if stop:
                return

    def _count(self, item: T) -> int:
        """How many of ``max_batch`` an item (or a flush's marker: one) takes."""
        if item is _MARKER:
            return 1
        try:
            return max(1, self._count_of(item))
        except Exception as exc:  # noqa: BLE001 - the item fails where it is applied, not here
            if raised_by_signal_handler(exc):
                raise  # as submit's size_of
            return 1

    def _run_batch(self, batch: list[tuple[T, Job[None]]]) -> None:
        try:
            self._apply_batch(batch)
        finally:
            self._settled(batch)

    def _apply_batch(self, batch: list[tuple[T, Job[None]]]) -> None:
        if self._abandon.is_set():
            kept = []
            for item, job in batch:
                if item is not _MARKER and self._abandonable(item):
                    self._abandoned += 1
                    job.set_error(WriteAbandoned("abandoned when the store closed with a timeout"))
                else:
                    kept.append((item, job))
            batch = kept
        items = [item for item, _ in batch if item is not _MARKER]
        try:
            results: Sequence[BaseException | None] = self._apply(items) if items else []
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting job
            results = [exc] * len(items)
        it = iter(results)
        for item, job in batch:
            if item is _MARKER:
                job.set_result(None)
                continue
            error = next(it)
            if error is None:
                job.set_result(None)
            else:
                job.set_error(error)


_MARKER: Any = object()
