"""tierkv.transfer: jobs complete once with a value or an error; the CPU copy engine completes at
once; the background writer applies items in order, in batches, routes errors to the right jobs,
and flushes and drains. Threads are synchronised with events, never with sleeps."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

import tierkv.transfer
from tierkv.transfer import _MARKER, BackgroundWriter, CopyEngine, Job, WriteAbandoned, resolve_device

WAIT = 10.0  # generous upper bound for anything that should happen promptly


# -- Job ---------------------------------------------------------------------------------------------
def test_completed_job() -> None:
    value = object()
    job = Job.completed(value)
    assert job.done() is True
    assert job.wait() is value
    assert job.wait(timeout=0) is value


def test_completed_jobs_share_nothing_but_stay_complete() -> None:
    first, second = Job.completed(1), Job.completed(2)
    first.set_result(3)
    first.set_error(RuntimeError("late"))
    assert (first.wait(), second.wait()) == (1, 2) and first.lease is None
    pending: Job[int] = Job()
    assert not pending.done()  # a completed job's state never leaks into a new one
    pending.set_result(4)
    assert pending.wait(timeout=0) == 4 and first.wait() == 1


def test_completed_with_none_is_done() -> None:
    job = Job.completed(None)
    assert job.done() is True
    assert job.wait(timeout=0) is None


def test_pending_job_times_out() -> None:
    job: Job[int] = Job()
    assert job.done() is False
    with pytest.raises(TimeoutError, match="did not complete"):
        job.wait(timeout=0.01)
    with pytest.raises(TimeoutError):
        job.wait(timeout=0)
    assert job.done() is False
    assert not job._event._waiters  # a wait that timed out is not kept listed


def test_set_result_completes_once() -> None:
    job: Job[str] = Job()
    job.set_result("first")
    assert job.done() is True
    job.set_result("second")
    job.set_error(RuntimeError("late"))
    assert job.wait() == "first"


def test_error_is_re_raised_as_is() -> None:
    job: Job[int] = Job()
    error = OSError(5, "disk on fire")
    job.set_error(error)
    assert job.done() is True
    with pytest.raises(OSError) as info:
        job.wait(timeout=0)
    assert info.value is error
    job.set_result(3)
    with pytest.raises(OSError):
        job.wait()


def test_completion_from_another_thread_wakes_the_waiter() -> None:
    job: Job[int] = Job()
    go = threading.Event()

    def complete() -> None:
        assert go.wait(WAIT)
        job.set_result(42)

    thread = threading.Thread(target=complete)
    thread.start()
    assert job.done() is False
    go.set()
    assert job.wait(timeout=WAIT) == 42
    thread.join(WAIT)


def test_poll_turns_an_external_signal_into_done() -> None:
    signal = {"ready": False}
    job: Job[int] = Job(poll=lambda: signal["ready"])
    assert job.done() is False
    signal["ready"] = True
    assert job.done() is True


def test_a_fence_tells_when_its_job_is_done_without_holding_its_result() -> None:
    job: Job[torch.Tensor] = Job()
    fence = job.fence()
    assert not fence.done()
    job.set_result(torch.zeros(4))
    assert fence.done()
    assert not any(isinstance(ref, (Job, torch.Tensor)) for ref in gc.get_referents(fence))
    assert Job.completed(torch.zeros(1)).fence().done()


def test_only_the_first_of_racing_completions_wins() -> None:
    for _ in range(20):
        job: Job[int] = Job()
        barrier = threading.Barrier(8)

        def complete(i: int) -> None:
            barrier.wait(WAIT)
            job.set_result(i)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        first = job.wait(WAIT)
        for t in threads:
            t.join(WAIT)
        assert first in range(8)
        assert job.wait(0) == first  # never changes after completion


# -- CopyEngine on CPU -----------------------------------------------------------------------------
@pytest.fixture
def cpu_engine() -> CopyEngine:
    return CopyEngine(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_to_host_completes_at_once(cpu_engine: CopyEngine, dtype: torch.dtype) -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    job = cpu_engine.to_host(tensor)
    assert job.done() is True
    out = job.wait(timeout=0)
    assert out.device.type == "cpu" and out.dtype == dtype
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_to_device_completes_at_once(cpu_engine: CopyEngine, dtype: torch.dtype) -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    job = cpu_engine.to_device(tensor)
    assert job.done() is True
    out = job.wait(timeout=0)
    assert out.device == torch.device("cpu") and out.dtype == dtype
    assert torch.equal(out, tensor)


def test_cpu_engine_is_not_cuda(cpu_engine: CopyEngine) -> None:
    assert cpu_engine.is_cuda is False
    assert cpu_engine.device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip() -> None:
    engine = CopyEngine(resolve_device("cuda"))
    tensor = torch.arange(4096, dtype=torch.float16, device="cuda").reshape(4, 1024)
    host = engine.to_host(tensor).wait(timeout=WAIT)
    assert host.device.type == "cpu" and host.is_pinned()
    back = engine.to_device(host).wait(timeout=WAIT)
    assert back.is_cuda
    assert torch.equal(back, tensor)


# -- resolve_device --------------------------------------------------------------------------------
def test_resolve_none_is_cuda_when_available_else_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected


def test_resolve_none_names_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: None gave torch.device("cuda"), no index. A model on CUDA reports cuda:0, which is
    # not equal to it, so every open on a default store was refused, and the disk writer thread
    # died in torch.cuda.set_device (which needs an index), leaving flush() and close() hung.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device(None) == torch.device("cuda", 1) == resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_resolve_none_is_cpu_here() -> None:
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0", "cpu:1", torch.device("cpu", 3)])
def test_resolve_cpu(device: object) -> None:
    # Exactly torch.device("cpu"), no index: what a CPU model's parameters report.
    assert resolve_device(device) == torch.device("cpu") == torch.zeros(1, device=device).device


def test_resolve_a_cuda_index_past_the_machines_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2': this machine has 2 CUDA device\(s\), numbered from 0"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("device", ["nonsense", "cuda:x", "", "gpu"])
def test_resolve_rejects_non_devices(device: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_device(device)
    message = str(info.value)
    assert "is not a device" in message
    assert "pass None, 'cpu', 'cuda' or 'cuda:N'" in message


@pytest.mark.parametrize("device", [3.5, ["cpu"], object()])
def test_resolve_rejects_wrong_types_as_value_error(device: object) -> None:
    with pytest.raises(ValueError, match="pass None, 'cpu'"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_resolve_rejects_unsupported_device_types(device: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_device(device)
    assert f"device type {device!r} is not supported" in str(info.value)
    assert "pass None, 'cpu', 'cuda' or 'cuda:N'" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_resolve_cuda_without_cuda(device: object) -> None:
    with pytest.raises(ValueError) as info:
        resolve_device(device)
    assert f"device={str(torch.device(device))!r} was asked for but CUDA is not available" in str(info.value)
    assert "pass device=None or 'cpu'" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resolve_cuda_gets_an_index() -> None:
    assert resolve_device("cuda").index == torch.cuda.current_device()


# -- BackgroundWriter -----------------------------------------------------------------------------------
class Recorder:
    """An ``apply`` that records each batch; the first batch can be held until released."""

    def __init__(self, hold_first: bool = False,
                 result: Callable[[object], BaseException | None] = lambda item: None) -> None:
        self.batches: list[list[object]] = []
        self.hold_first = hold_first
        self.started = threading.Event()
        self.release = threading.Event()
        self.result = result
        self.raise_on: dict[int, BaseException] = {}  # batch number -> exception raised by apply
        self.threads: set[str] = set()

    def __call__(self, items: Sequence[object]) -> list[BaseException | None]:
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        number = len(self.batches)
        if number == 1 and self.hold_first:
            self.started.set()
            if not self.release.wait(WAIT):
                raise RuntimeError("test never released the first batch")
        if number in self.raise_on:
            raise self.raise_on[number]
        return [self.result(item) for item in items]

    @property
    def applied(self) -> list[object]:
        return [item for batch in self.batches for item in batch]


@pytest.fixture
def writers() -> Iterator[list[BackgroundWriter]]:
    made: list[BackgroundWriter] = []
    yield made
    for w in made:
        w.close(timeout=WAIT)


def start(writers: list[BackgroundWriter], apply: Recorder, **kw: object) -> BackgroundWriter:
    writer: BackgroundWriter = BackgroundWriter(apply, name=kw.pop("name", "test-writer"), **kw)  # type: ignore[arg-type]
    writers.append(writer)
    return writer


def test_items_applied_in_submission_order(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec)
    jobs = [writer.submit(i) for i in range(200)]
    writer.flush(timeout=WAIT)
    assert rec.applied == list(range(200))
    assert all(job.done() for job in jobs)
    assert [job.wait(0) for job in jobs] == [None] * 200


def test_items_from_many_threads_keep_each_threads_order(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec)
    barrier = threading.Barrier(4)

    def produce(t: int) -> None:
        barrier.wait(WAIT)
        for i in range(50):
            writer.submit((t, i))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    writer.flush(timeout=WAIT)
    assert sorted(rec.applied) == [(t, i) for t in range(4) for i in range(50)]  # type: ignore[type-var]
    for t in range(4):
        assert [i for (tt, i) in rec.applied if tt == t] == list(range(50))  # type: ignore[misc]


def test_apply_runs_on_the_named_writer_thread(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec, name="tierkv-test-writer")
    writer.submit(1)
    writer.flush(timeout=WAIT)
    assert rec.threads == {"tierkv-test-writer"}


def test_items_queued_while_busy_form_one_batch(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    first = writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = [writer.submit(i) for i in range(1, 6)]
    assert first.done() is False and not any(job.done() for job in jobs)
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert rec.batches == [["gate"], [1, 2, 3, 4, 5]]
    assert all(job.done() for job in [first, *jobs])


def test_max_batch_caps_items_per_batch(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec, max_batch=2)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    for i in range(1, 6):
        writer.submit(i)
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert rec.batches == [["gate"], [1, 2], [3, 4], [5]]


def test_max_batch_counts_each_item_as_count_of_says(writers: list[BackgroundWriter]) -> None:
    # A forget's DeleteBlocks holds dozens of blocks: counted as one item each, 64 of them went
    # in one transaction (64 times the deletes one took). An item is never split, and one that
    # would pass the count waits for the next batch (before: a 64-block delete behind 63 items
    # made a transaction of 127), unless it is the first.
    rec = Recorder(hold_first=True)
    writer = start(writers, rec, max_batch=4, count_of=lambda item: item[1] if isinstance(item, tuple) else 1)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    for item in [("a", 3), ("b", 1), ("c", 2), ("d", 9), ("e", 0), "f", ("g", 2), "h", "i"]:
        writer.submit(item)
    rec.release.set()
    writer.flush(timeout=WAIT)
    # 3 + 1 fill one; 9 would pass 2's, and is a batch alone; 0 counts as one, as plain items do.
    assert rec.batches == [["gate"], [("a", 3), ("b", 1)], [("c", 2)], [("d", 9)], [("e", 0), "f", ("g", 2)],
                           ["h", "i"]]
    assert writer.queued() == 0


def test_the_writers_queue_counts_each_item_as_count_of_says() -> None:
    # A forget's 64-block DeleteBlocks is a transaction's worth of work: counted as one queued
    # item, 1024 of them (WRITE_BACKLOG_OPS) were about 65k block deletes behind the commits.
    gate = threading.Event()

    def apply(items: Sequence[int]) -> list[BaseException | None]:
        assert gate.wait(10)
        return [None if item % 2 else ValueError("even") for item in items]

    writer: BackgroundWriter[int] = BackgroundWriter(apply, name="counted", count_of=lambda item: item)
    jobs = [writer.submit(n) for n in (1, 64, 0, 3)]
    assert writer.queued() == 1 + 64 + 1 + 3  # at least one each, as a batch counts them
    assert not writer.wait_below(0, timeout=0.2, items=68)  # the writer is stalled
    gate.set()
    assert writer.wait_below(0, timeout=10, items=0)
    assert writer.queued() == 0 and writer.settled_items() == 4 and all(j.done() for j in jobs)
    writer.close()


def test_linger_gathers_items_submitted_apart_into_one_batch(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec, linger=WAIT * 10)
    writer.submit("a")
    time.sleep(0.1)  # not synchronisation: a gap in which a writer without a linger takes "a" alone
    job = writer.submit("b")
    writer.nudge()
    assert job.wait(WAIT) is None
    assert rec.batches == [["a", "b"]]
    # And a linger ends by itself, without a flush or a nudge.
    expiring = start(writers, Recorder(), linger=0.05)
    assert expiring.submit("c").wait(WAIT) is None


def test_flush_nudge_close_and_a_heavy_or_full_batch_cut_the_linger(writers: list[BackgroundWriter]) -> None:
    long = WAIT * 10  # far past every wait below: an item applied means the linger was cut short
    rec = Recorder()
    writer = start(writers, rec, linger=long)
    writer.flush(timeout=WAIT)  # a flush of an idle writer: its marker is the batch's first entry
    writer.submit(1)
    writer.flush(timeout=WAIT)
    assert rec.batches == [[1]]
    nudged_rec = Recorder()
    nudged = start(writers, nudged_rec, linger=long)
    job = nudged.submit("n")
    nudged.nudge()
    assert job.wait(WAIT) is None and nudged_rec.batches == [["n"]]
    heavy = start(writers, Recorder(), linger=long, max_batch_bytes=400, size_of=lambda item: 100)
    assert heavy.submit("a quarter of the batch's bytes").wait(WAIT) is None
    full = start(writers, Recorder(), linger=long, max_batch=2)
    full.submit("x")
    assert full.submit("y").wait(WAIT) is None
    closing_rec = Recorder()
    closing = start(writers, closing_rec, linger=long)
    job = closing.submit("z")
    assert closing.close(timeout=WAIT) == 0
    assert job.done() and closing_rec.batches == [["z"]]


def test_a_negative_linger_is_refused() -> None:
    with pytest.raises(ValueError, match="linger must be >= 0"):
        BackgroundWriter(Recorder(), name="bad", linger=-1)


def test_max_batch_bytes_caps_bytes_per_batch(writers: list[BackgroundWriter]) -> None:
    # An item that would take the batch past max_batch_bytes waits for the next, as one past
    # max_batch does, unless it is the batch's first. Before: the last item taken passed it (a
    # block's bytes past the store's bound, made for a transaction at the disk budget).
    rec = Recorder(hold_first=True)
    writer = start(writers, rec, max_batch_bytes=10, size_of=lambda item: item[1] if isinstance(item, tuple) else 4)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    for item in [("a", 4), ("b", 4), ("c", 4), ("d", 12), ("e", 2), ("f", 8), ("g", 1)]:
        writer.submit(item)
    rec.release.set()
    writer.flush(timeout=WAIT)
    # 4 + 4 (another 4 would pass 10); 4 (12 would); 12 alone, first; 2 + 8, exactly 10.
    assert rec.batches == [["gate"], [("a", 4), ("b", 4)], [("c", 4)], [("d", 12)], [("e", 2), ("f", 8)], [("g", 1)]]
    assert writer.backlog() == 0


def test_one_items_error_reaches_only_its_job(writers: list[BackgroundWriter]) -> None:
    errors = {"bad": KeyError("bad item"), "worse": ValueError("worse item")}
    rec = Recorder(hold_first=True, result=lambda item: errors.get(item))  # type: ignore[arg-type]
    writer = start(writers, rec)
    gate = writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = {name: writer.submit(name) for name in ("a", "bad", "c", "worse", "e")}
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert rec.batches == [["gate"], ["a", "bad", "c", "worse", "e"]]  # the errors share one batch
    assert gate.wait(0) is None
    for name in ("a", "c", "e"):
        assert jobs[name].wait(0) is None
    with pytest.raises(KeyError) as info:
        jobs["bad"].wait(0)
    assert info.value is errors["bad"]
    with pytest.raises(ValueError) as info2:
        jobs["worse"].wait(0)
    assert info2.value is errors["worse"]


def test_an_exception_from_apply_fails_the_whole_batch(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    boom = OSError("transaction failed")
    rec.raise_on[2] = boom
    writer = start(writers, rec)
    gate = writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = [writer.submit(i) for i in range(3)]
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert rec.batches == [["gate"], [0, 1, 2]]
    assert gate.wait(0) is None
    for job in jobs:
        with pytest.raises(OSError) as info:
            job.wait(0)
        assert info.value is boom
    # the thread survives: later items are applied normally
    later = writer.submit("later")
    writer.flush(timeout=WAIT)
    assert later.wait(0) is None
    assert rec.batches[-1] == ["later"]


def _writer_nice(writers: list[BackgroundWriter]) -> int:
    """The niceness of a writer's thread, read from inside its ``apply``."""
    seen: list[int] = []

    def apply(items: Sequence[object]) -> list[BaseException | None]:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return [None] * len(items)

    writer: BackgroundWriter = BackgroundWriter(apply, name="niced")
    writers.append(writer)
    writer.submit(1).wait(WAIT)
    return seen[0]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread niceness is Linux's")
def test_the_writer_thread_runs_niced_and_never_above_the_thread_that_made_it(writers: list[BackgroundWriter]) -> None:
    # A spill must yield the CPU to the decode step's threads: nothing checked that it did. And
    # set to 10 outright, a writer made by a thread niced past 10 (a batch job under `nice -n 19`,
    # as root) was raised above it, taking the CPU from the work it was to yield to.
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert _writer_nice(writers) == max(10, base)
    found: list[int] = []

    def niced_maker() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, max(15, base))  # lowering one's own priority needs no privilege
        found.append(_writer_nice(writers))

    maker = threading.Thread(target=niced_maker)
    maker.start()
    maker.join(WAIT)
    assert found == [max(15, base)]


def test_a_writer_thread_that_cannot_start_fails_its_jobs_rather_than_hang(
        writers: list[BackgroundWriter], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an error before the loop (torch.cuda.set_device refusing the device) ended the
    # thread; every write stayed queued, and flush() and close() waited forever.
    boom = RuntimeError("Expected a torch.device with a specified index")

    def refuse() -> None:
        raise boom

    monkeypatch.setattr(tierkv.transfer, "_lower_priority", refuse)
    rec = Recorder()
    writer = start(writers, rec)
    job = writer.submit(1)
    writer.flush(timeout=WAIT)
    with pytest.raises(RuntimeError) as info:
        job.wait(WAIT)
    assert info.value is boom and rec.batches == []
    later = writer.submit(2)
    assert writer.close(timeout=WAIT) == 0 and not writer.alive()
    with pytest.raises(RuntimeError):
        later.wait(0)
    assert "background writer 'test-writer' failed" in caplog.text


def test_an_error_outside_apply_fails_the_batch_being_gathered(writers: list[BackgroundWriter]) -> None:
    boom = ValueError("no size for this item")

    def size_of(item: object) -> int:
        if item == "bad":
            raise boom
        return 0

    rec = Recorder(hold_first=True)
    writer = start(writers, rec, size_of=size_of)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    first, bad = writer.submit(1), writer.submit("bad")
    rec.release.set()
    for job in (first, bad):
        with pytest.raises(ValueError):
            job.wait(WAIT)
    assert rec.batches == [["gate"]]
    writer.close()
    assert not writer.alive()


def test_flush_waits_for_earlier_items(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    first = writer.submit(1)
    assert rec.started.wait(WAIT)
    second = writer.submit(2)
    with pytest.raises(TimeoutError):
        writer.flush(timeout=0.05)  # item 1 is still being applied: flush must not return
    assert first.done() is False and second.done() is False
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert first.done() and second.done()
    assert rec.applied == [1, 2]


def test_flush_of_an_idle_writer_applies_nothing(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec)
    writer.flush(timeout=WAIT)
    writer.flush(timeout=WAIT)
    assert rec.batches == []


def test_flush_whose_marker_is_done_before_it_looks_returns(writers: list[BackgroundWriter]) -> None:
    # The writer may take a flush's marker before flush() looks at it again (the main thread
    # preempted right after queueing it): flush took that for a closed writer and joined the
    # thread of one that was not closing, forever. Forced here: the queueing waits for the marker.
    writer = start(writers, Recorder())
    put = writer._queue.put

    class Queue:  # the writer's SimpleQueue, whose put cannot be replaced on it
        get, get_nowait = writer._queue.get, writer._queue.get_nowait

        @staticmethod
        def put(entry, *args, **kwargs):
            put(entry, *args, **kwargs)
            if entry is not None and entry[0] is _MARKER:
                entry[1].wait(WAIT)

    writer._queue = Queue()  # type: ignore[assignment]
    flusher = threading.Thread(target=writer.flush)
    flusher.start()
    flusher.join(WAIT)
    assert not flusher.is_alive(), "flush() waited for a writer that was not closing"


def test_close_drains_queued_items(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec)
    jobs = [writer.submit(i) for i in range(20)]
    writer.close(timeout=WAIT)
    assert rec.applied == list(range(20))
    assert all(job.done() for job in jobs)


def test_close_drains_items_queued_behind_a_busy_batch(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    first = writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = [writer.submit(i) for i in range(3)]
    closer = threading.Thread(target=writer.close)  # no timeout: drains everything
    closer.start()
    while not writer._closed:  # noqa: SLF001 - wait until close() has taken the gate
        threading.Event().wait(0.001)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit("too late")
    rec.release.set()
    closer.join(WAIT)
    for job in [first, *jobs]:
        assert job.wait(timeout=WAIT) is None
    assert rec.applied == ["gate", 0, 1, 2]


def test_close_with_a_timeout_abandons_what_is_still_queued(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    first = writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = [writer.submit(i) for i in range(3)]
    result: list[int] = []
    closer = threading.Thread(target=lambda: result.append(writer.close(timeout=0.01)))
    closer.start()
    assert writer._abandon.wait(WAIT)  # noqa: SLF001 - the timeout expired with the batch in flight
    rec.release.set()  # the batch in flight completes; what is queued behind it is abandoned
    closer.join(WAIT)
    assert result == [3]
    assert first.wait(WAIT) is None
    for job in jobs:
        with pytest.raises(WriteAbandoned):
            job.wait(WAIT)
    assert rec.applied == ["gate"]


def test_close_with_a_timeout_still_applies_what_may_not_be_abandoned(writers: list[BackgroundWriter]) -> None:
    # The store's forgets (their deletes and reference drops) may not be given up: a forgotten
    # conversation would stay on disk. Nothing checked that ``abandonable`` was asked: a close
    # that abandoned every item passed.
    rec = Recorder(hold_first=True)
    writer = start(writers, rec, abandonable=lambda item: item != "forget")
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    jobs = {item: writer.submit(item) for item in ("write", "forget", "write again")}
    result: list[int] = []
    closer = threading.Thread(target=lambda: result.append(writer.close(timeout=0.01)))
    closer.start()
    assert writer._abandon.wait(WAIT)  # noqa: SLF001 - the timeout expired with the batch in flight
    rec.release.set()
    closer.join(WAIT)
    assert result == [2] and rec.applied == ["gate", "forget"]
    assert jobs["forget"].wait(WAIT) is None
    for item in ("write", "write again"):
        with pytest.raises(WriteAbandoned):
            jobs[item].wait(WAIT)


def test_wait_below_on_the_writers_own_thread_says_whether_the_backlog_is_under_without_waiting(
        writers: list[BackgroundWriter]) -> None:
    # Nothing checked its answer there: one saying True at any backlog passed.
    answers: list[tuple[bool, bool]] = []
    writer: BackgroundWriter

    def apply(items: Sequence[int]) -> list[BaseException | None]:
        answers.append((writer.wait_below(0), writer.wait_below(sum(items))))  # the batch is still counted
        return [None] * len(items)

    writer = BackgroundWriter(apply, name="own-thread", size_of=lambda item: item)
    writers.append(writer)
    writer.submit(100).wait(WAIT)
    assert answers == [(False, True)] and writer.wait_below(0, timeout=WAIT)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux's schedstat")
def test_cpu_wait_seconds_is_the_threads_wait_for_a_cpu_not_its_time_on_one() -> None:
    # schedstat holds the time on a CPU, then the time waiting, runnable, for one: a reading of
    # the first passed every test, and the writer's CPU waits the store counts were its run time.
    from tierkv.transfer import cpu_wait_seconds

    def waited() -> float:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9

    before = waited()
    sum(range(200_000))  # some time on a CPU, to tell the two apart
    seconds = cpu_wait_seconds()
    after = waited()
    assert seconds is not None and before <= seconds <= after


def test_submit_after_close_raises(writers: list[BackgroundWriter]) -> None:
    writer = start(writers, Recorder())
    writer.close(timeout=WAIT)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(1)


def test_close_twice_and_flush_after_close_are_harmless(writers: list[BackgroundWriter]) -> None:
    rec = Recorder()
    writer = start(writers, rec)
    writer.submit(1)
    writer.close(timeout=WAIT)
    writer.close(timeout=WAIT)
    writer.flush(timeout=WAIT)  # returns at once: nothing can be pending
    assert rec.applied == [1]


def test_writer_thread_ends_on_close(writers: list[BackgroundWriter]) -> None:
    writer = start(writers, Recorder(), name="tierkv-ending-writer")
    assert any(t.name == "tierkv-ending-writer" for t in threading.enumerate())
    writer.close(timeout=WAIT)
    assert not any(t.name == "tierkv-ending-writer" for t in threading.enumerate())


def test_flush_racing_close_returns_once_the_queue_drained(writers: list[BackgroundWriter]) -> None:
    # close() while a flush() waits behind a busy batch: the flush returns when the writer drained,
    # never blocks forever behind the stop signal.
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    writer.submit(1)
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (writer.flush(timeout=WAIT), flushed.set()))
    flusher.start()
    closer = threading.Thread(target=writer.close, kwargs={"timeout": WAIT})
    closer.start()
    rec.release.set()
    flusher.join(WAIT)
    closer.join(WAIT)
    assert flushed.is_set()
    assert rec.applied == ["gate", 1]


def test_flush_after_close_waits_for_the_drain(writers: list[BackgroundWriter]) -> None:
    rec = Recorder(hold_first=True)
    writer = start(writers, rec)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    writer.submit(1)
    closer = threading.Thread(target=writer.close)
    closer.start()
    while not writer._closed:  # noqa: SLF001 - wait until close() has taken the gate
        threading.Event().wait(0.001)
    done = threading.Event()
    flusher = threading.Thread(target=lambda: (writer.flush(timeout=WAIT), done.set()))
    flusher.start()
    assert not done.wait(0.05)  # still draining: flush has not returned early
    rec.release.set()
    flusher.join(WAIT)
    closer.join(WAIT)
    assert done.is_set() and rec.applied == ["gate", 1]


def test_a_cuda_copy_job_frees_its_tensor_without_a_garbage_collection() -> None:
    # A bound method stored on the job would form a cycle and keep GPU or pinned memory alive.
    import gc
    import weakref

    from tierkv.transfer import _CudaCopyJob, _LayeredCudaJob

    class FakeEvent:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            pass

    gc.disable()
    try:
        for make in (lambda t: _CudaCopyJob(FakeEvent(), t), lambda t: _LayeredCudaJob([FakeEvent()], t)):
            tensor = torch.zeros(4)
            alive = weakref.ref(tensor)
            job = make(tensor)
            assert not job.done()
            del job, tensor
            assert alive() is None
    finally:
        gc.enable()


def test_layer_groups_bound_copy_calls_and_keep_overlap() -> None:
    from tierkv.transfer import layer_groups

    for blocks in (1, 2, 7, 32, 128, 1000):
        for layers in (1, 2, 3, 16, 32, 80):
            groups = layer_groups(blocks, layers)
            assert 1 <= groups <= layers
            assert groups >= min(4, layers)  # later layers' copies still overlap earlier compute
            assert blocks * groups <= max(128 + blocks, 4 * blocks)  # a few ms of copy calls at most
    assert layer_groups(2, 16) == 16  # a small restore: one group per layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("blocks", [2, 40])  # one group per layer; 4 groups of 4 layers
def test_cuda_layered_restore_lands_every_layer_of_every_block(blocks: int) -> None:
    engine = CopyEngine(resolve_device("cuda"))
    srcs = [torch.arange(16 * 2 * 2 * 8 * 4, dtype=torch.float32).reshape(16, 2, 2, 8, 4).add(1000 * b)
            .pin_memory() for b in range(blocks)]
    jobs = engine.to_device_many(srcs)
    stream = torch.cuda.current_stream()
    seen: set[int] = set()
    for layer in (15, 0, 7):
        for job, src in zip(jobs, srcs):
            got = job.stream_wait_layer(layer, seen, stream)[layer]
            assert torch.equal(got.cpu(), src[layer])
    for job, src in zip(jobs, srcs):
        assert torch.equal(job.wait().cpu(), src)


def test_an_idle_writer_holds_no_item_it_applied() -> None:
    """The writer's loop kept its last batch's first item while it waited for the next: a block
    write's host tensor, outside every budget, for as long as the store was idle."""
    import weakref

    class Item:
        pass

    writer: BackgroundWriter[Item] = BackgroundWriter(lambda items: [None] * len(items), name="idle")
    item = Item()
    held = weakref.ref(item)
    writer.submit(item).wait(10)
    del item
    deadline = time.monotonic() + 5
    while held() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held() is None
    writer.close()


def test_the_writers_backlog_counts_submitted_bytes_until_applied_or_failed() -> None:
    gate = threading.Event()

    def apply(items: Sequence[int]) -> list[BaseException | None]:
        assert gate.wait(10)
        return [None if item % 2 else ValueError("odd one out") for item in items]

    writer: BackgroundWriter[int] = BackgroundWriter(apply, name="backlog", size_of=lambda item: item)
    jobs = [writer.submit(n) for n in (10, 21, 30)]
    assert writer.backlog() == 61
    assert not writer.wait_below(20, timeout=0.2)  # the writer is stalled
    waiter = threading.Thread(target=writer.wait_below, args=(0,))
    waiter.start()
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and writer.backlog() == 0
    assert [j.done() for j in jobs] == [True] * 3  # failed items count as settled too
    writer.close()
    assert writer.wait_below(0, timeout=0)


def test_the_writers_queue_counts_items_of_no_size_until_applied_or_failed() -> None:
    # Deletes, references and stamps weigh no bytes: a bound on bytes alone never saw them queue.
    gate = threading.Event()

    def apply(items: Sequence[int]) -> list[BaseException | None]:
        assert gate.wait(10)
        return [None if item % 2 else ValueError("odd one out") for item in items]

    writer: BackgroundWriter[int] = BackgroundWriter(apply, name="queued", size_of=lambda item: 0)
    jobs = [writer.submit(n) for n in range(5)]
    writer.nudge()  # a marker is no item
    assert writer.queued() == 5 and writer.backlog() == 0 and writer.settled_items() == 0
    assert writer.wait_below(0, timeout=0)  # bytes alone: under
    assert not writer.wait_below(0, timeout=0.2, items=4)  # the writer is stalled
    # A daemon: a wait_below that never returns fails the test below, not hangs pytest's exit.
    waiter = threading.Thread(target=writer.wait_below, args=(0,), kwargs={"items": 0}, daemon=True)
    waiter.start()
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and writer.queued() == 0
    assert writer.settled_items() == 5 and [j.done() for j in jobs] == [True] * 5  # failed ones too
    writer.close()
    assert writer.wait_below(0, timeout=0, items=0)


def test_a_wait_below_whose_wake_was_lost_still_sees_the_backlog_drain() -> None:
    # Before: wait_below without a timeout blocked on its lock until a _wake let it go; close's
    # _wake in the main thread, cut short by another signal's handler between taking the waiters'
    # list and letting them go, left them blocked for good. It looks again every _RECHECK now, as
    # _Flag.wait does.
    gate = threading.Event()

    def apply(items: Sequence[int]) -> list[BaseException | None]:
        assert gate.wait(10)
        return [None] * len(items)

    writer: BackgroundWriter[int] = BackgroundWriter(apply, name="lost-wake", size_of=lambda item: item)
    writer.submit(10)
    waiter = threading.Thread(target=writer.wait_below, args=(0,), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while not writer._waiters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer._waiters
    writer._wake = lambda: None  # every wake from now on lost, as a cut-short one is
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and writer.backlog() == 0
    writer.close()


def test_a_submit_another_signals_handler_cuts_short_counts_an_item_only_if_queued(
        writers: list[BackgroundWriter]) -> None:
    # Before: submit entered its counters' Condition, whose __enter__ is Python: a handler (a
    # SIGALRM timeout) raising as its lock's acquire returned left the lock taken for good, and
    # the writer hung at its next batch's end; and Queue.put is Python too: one raising in it,
    # or between the counting and the put, left an item counted and not queued (the backlog that
    # commits wait on never drained), or queued with its caller unable to tell (``holds``).
    from contextlib import nullcontext

    from conftest import raised_on_the_way_in

    rec = Recorder(hold_first=True)
    writer = start(writers, rec, size_of=lambda item: 10)
    writer.submit("gate")
    assert rec.started.wait(WAIT)  # the writer is in the first batch: what follows stays queued
    submitted: list[tuple[object, Job[None]]] = []

    def counted_only_if_queued(sent: list) -> None:
        for lock in (writer._counts, writer._gate):
            assert lock.acquire(blocking=False), sent
            lock.release()
        queued = writer._queue.qsize()
        assert writer.queued() == len(writer._sizes) == queued + 1, sent  # the gate's batch counts till its end
        assert writer.backlog() == 10 * (queued + 1), sent
        assert queued == sum(writer.holds(job) for _, job in submitted), sent
        assert not any(job.done() for _, job in submitted), sent

    def submit() -> object:
        item, job = len(submitted), Job()
        submitted.append((item, job))
        writer.submit(item, job)
        return nullcontext()

    assert raised_on_the_way_in(submit, counted_only_if_queued) > 4
    queued = [item for item, job in submitted if writer.holds(job)]
    assert len(queued) == writer._queue.qsize() and len(queued) >= 2  # cut as the put returned, and unhurt
    rec.release.set()
    writer.flush(timeout=WAIT)
    assert rec.applied == ["gate", *queued] and writer.queued() == 0 and writer.backlog() == 0


def test_a_wait_below_another_signals_handler_cuts_short_leaves_the_writer_unhurt(
        writers: list[BackgroundWriter]) -> None:
    # Before: wait_below waited on a Condition of the counters' lock; a handler (a SIGALRM
    # timeout during a commit's wait for a slow disk) raising in Condition.wait once it had let
    # the lock go made the ``with`` let go of it again: a RuntimeError ("release unlocked lock")
    # raised in place of the handler's, or, had the writer taken the lock meanwhile, its hold let
    # go under it (its own release then failed, and the thread with every write after it). And
    # one raising in the writer thread's is_alive() made CPython mark the live thread stopped:
    # wait_below returned at once from then on, and close took a writer in a transaction for
    # one that had ended.
    from contextlib import nullcontext

    from conftest import raised_on_the_way_in

    rec = Recorder(hold_first=True)
    writer = start(writers, rec, size_of=lambda item: 10)
    writer.submit("gate")
    assert rec.started.wait(WAIT)
    writer.submit("behind")

    def unhurt(sent: list) -> None:
        assert writer._counts.acquire(blocking=False), sent
        writer._counts.release()
        assert writer.alive(), sent  # not taken for gone (CPython's Thread.is_alive cut short)

    # A short timeout: the backlog stays over the bound, each try waits it out or is cut short.
    assert raised_on_the_way_in(lambda: (writer.wait_below(0, timeout=0.01), nullcontext())[1], unhurt) > 4
    waiting = threading.Thread(target=writer.wait_below, args=(0,))
    waiting.start()
    rec.release.set()
    waiting.join(WAIT)
    assert not waiting.is_alive() and writer.wait_below(0, timeout=0)
    assert rec.applied == ["gate", "behind"] and writer.backlog() == 0 and not writer._waiters


def test_a_job_wait_another_signals_handler_cuts_short_leaves_its_completion_free() -> None:
    # Before: Job.wait was threading.Event.wait, Python: a handler (a SIGALRM timeout) raising in
    # its Condition's __enter__ as the lock's acquire returned left the Event's lock taken for
    # good, and the completing thread's set_result (Event.set) blocked on it for ever.
    from conftest import raised_on_the_way_in

    jobs: list[Job[int]] = []

    def wait() -> None:
        jobs.append(Job())
        jobs[-1].wait(timeout=0.01)  # never completed: times out, or is cut short

    def completes(sent: list) -> None:
        if not jobs or jobs[-1].done():
            return  # cut short before this try's job was made
        job = jobs[-1]
        completer = threading.Thread(target=job.set_result, args=(len(jobs),), daemon=True)
        completer.start()
        completer.join(WAIT)
        assert not completer.is_alive(), f"set_result hung after a wait cut short at {sent}"
        assert job.wait(timeout=0) == len(jobs), sent

    with pytest.raises(TimeoutError):  # unless cut short: each try times out
        wait()
    jobs.clear()
    assert raised_on_the_way_in(lambda: _timing_out(wait), completes) > 2


def _timing_out(wait: Callable[[], object]) -> object:
    """``wait()`` with its TimeoutError taken as the end of a try, as a context for the harness."""
    from contextlib import nullcontext

    try:
        wait()
    except TimeoutError:
        pass
    return nullcontext()


def test_a_flush_another_signals_handler_cuts_short_leaves_the_writer_unhurt() -> None:
    # As above, through flush(): its marker's job waited on in the caller's thread; a wait cut
    # short as the Event's lock was taken hung the writer at the marker's set_result, and every
    # flush and close after it; one cut short inside Condition.wait raised "release unlocked
    # lock" in place of the handler's exception.
    from conftest import raised_on_the_way_in

    rec = Recorder(hold_first=True)
    writer: BackgroundWriter = BackgroundWriter(rec, name="test-writer")
    try:
        writer.submit("gate")
        assert rec.started.wait(WAIT)  # the markers stay queued behind the held batch
        flushes = raised_on_the_way_in(lambda: _timing_out(lambda: writer.flush(timeout=0.01)),
                                       lambda sent: None)
        assert flushes > 2
        rec.release.set()
        writer.submit("after")
        writer.flush(timeout=WAIT)  # TimeoutError: the writer hung at a marker's completion
        assert rec.applied == ["gate", "after"]
    finally:
        rec.release.set()
        writer.close(timeout=WAIT, grace=WAIT)


def test_a_set_result_another_signals_handler_cuts_short_still_wakes_every_waiter() -> None:
    # A completion in the main thread (a CUDA copy's done()) cut short as it let its waiters go,
    # after the first: the others, in other threads, see the job done at their wait's next look
    # rather than block for ever on a lock no one lets go.
    from contextlib import nullcontext

    from conftest import raised_on_the_way_in

    tries: list[tuple[Job[int], list[threading.Thread]]] = []
    got: list[int] = []

    def prepare() -> None:
        job: Job[int] = Job()
        waiters = [threading.Thread(target=lambda: got.append(job.wait()), daemon=True) for _ in range(3)]
        for waiter in waiters:
            waiter.start()
        while len(job._event._waiters) < len(waiters):  # every waiter blocked: listed
            time.sleep(0.001)
        tries.append((job, waiters))

    def every_waiter_woken(sent: list) -> None:
        job, waiters = tries[-1]
        if not job.done():
            job.set_result(len(tries))  # cut short before it completed: completed now
        for waiter in waiters:
            waiter.join(WAIT)
            assert not waiter.is_alive(), f"a waiter of a set_result cut short at {sent} was never woken"
        assert got == [len(tries)] * len(waiters), sent
        got.clear()
        prepare()  # the next try's, outside the way in

    prepare()
    assert raised_on_the_way_in(lambda: (tries[-1][0].set_result(len(tries)), nullcontext())[1],
                                every_waiter_woken) >= 2
    every_waiter_woken([])


def test_a_close_another_signals_handler_cuts_short_can_be_finished() -> None:
    # Before: close joined the thread (Thread.join) and set its abandon Event, both Python: a
    # handler (a SIGALRM timeout) raising as join's acquire of the live thread's lock returned
    # made CPython's except there let go of that lock and mark the thread stopped (every later
    # join returned at once: a close called again to finish did not wait for the batch in
    # flight), and one raising as Event.set's Condition lock was taken left it held (a close
    # called again blocked for ever in set).
    from conftest import raised_on_the_way_in

    rec = Recorder(hold_first=True)
    writer: BackgroundWriter = BackgroundWriter(rec, name="test-writer")
    try:
        writer.submit("gate")
        assert rec.started.wait(WAIT)  # in the first batch until released: close times out

        def close() -> object:
            writer.close(timeout=0, grace=0.001)
            return contextlib.nullcontext()

        def finishable(sent: list) -> None:
            assert writer.alive() and writer._thread.is_alive(), f"the writer taken for ended at {sent}"
            abandon = threading.Thread(target=writer._abandon.set, daemon=True)
            abandon.start()
            abandon.join(WAIT)
            assert not abandon.is_alive(), f"the abandon flag's set hung after a close cut short at {sent}"

        assert raised_on_the_way_in(close, finishable) > 2
        rec.release.set()
        closing = threading.Thread(target=writer.close, kwargs=dict(timeout=WAIT, grace=WAIT), daemon=True)
        closing.start()
        closing.join(WAIT * 2)
        assert not closing.is_alive() and not writer.alive()
    finally:
        rec.release.set()


class _FakeCuda:
    """What ``CopyEngine`` calls of ``torch`` on CUDA, on CPU: tensors that log the copies issued
    into and out of them (by their base) and the streams the caching allocator is told of."""

    class Stream:
        """``torch.cuda.Stream``'s members that tierkv reads; id 0 is a device's default stream."""

        made = 0

        def __init__(self, device: object = None, stream_id: int | None = None) -> None:
            self.device = torch.device("cuda", 0) if device is None else torch.device(device)
            self.device_index, self.device_type = self.device.index or 0, 1
            if stream_id is None:
                _FakeCuda.Stream.made += 1
                stream_id = _FakeCuda.Stream.made
            self.stream_id = self.cuda_stream = stream_id

        def wait_stream(self, other: object) -> None:
            pass

        def wait_event(self, event: object) -> None:
            pass

    class StreamContext:
        """``torch.cuda.stream``'s: its put-back is a Python ``__exit__``, calling Python."""

        def __init__(self, fake: "_FakeCuda", stream: "_FakeCuda.Stream") -> None:
            self.fake, self.stream = fake, stream

        def __enter__(self) -> None:
            self.before = self.fake.current_stream()
            if self.before.device != self.stream.device:
                self.there = self.fake.current_stream(self.stream.device)
            self.fake.set_stream(self.stream)

        def __exit__(self, *exc: object) -> None:
            if self.before.device != self.stream.device:
                self.fake.set_stream(self.there)
            self.fake.set_stream(self.before)

    class DeviceContext:
        """``torch.cuda.device``'s: its put-back is a Python ``__exit__`` too."""

        def __init__(self, fake: "_FakeCuda", index: int) -> None:
            self.fake, self.index = fake, index

        def __enter__(self) -> None:
            self.before = self.fake.state["device_index"]
            self.fake.state["device_index"] = self.index

        def __exit__(self, *exc: object) -> None:
            self.fake.state["device_index"] = self.before

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            pass

    class Tensor:
        def __init__(self, log: list, shape: tuple[int, ...], dtype: torch.dtype, is_cuda: bool,
                     base: object = None) -> None:
            self.log, self.shape, self.dtype, self.is_cuda = log, torch.Size(shape), dtype, is_cuda
            self.device = torch.device("cuda", 0) if is_cuda else torch.device("cpu")
            self.base = self if base is None else base

        def __getitem__(self, index: object) -> "_FakeCuda.Tensor":
            return _FakeCuda.Tensor(self.log, self.shape, self.dtype, self.is_cuda, self.base)

        def copy_(self, src: "_FakeCuda.Tensor", non_blocking: bool = False) -> None:
            self.log.append(("copy", self.base, src.base))

        def record_stream(self, stream: object) -> None:
            self.log.append(("record", self.base, stream))

    def __init__(self) -> None:
        self.log: list[tuple[str, object, object]] = []
        # The calling thread's CUDA state as torch._C._cuda_setStream leaves it: "device_index"
        # its current device (the real call makes the stream's device current where it is
        # another), "stream_id" device 0's current stream (a copy stream is only ever on 0).
        # That call is this dict's update, a C callable as the real one is, where no signal's
        # handler runs before it returns; torch._C._cuda_maybeExchangeDevice sets the device
        # here too, so that the order of the two counts, as it does on a GPU.
        self.state: dict[str, int] = {}
        self.enter()
        self.elsewhere = 200  # the thread's current stream on device 1, which no copy may change

    def enter(self, device: int = 0, stream_id: int = 0) -> None:
        """The thread's current device, and its current stream on device 0 (0: the default,
        another: inside a ``with torch.cuda.stream`` of the program's own)."""
        self.state.clear()
        self.state.update(stream_id=stream_id, device_index=device, device_type=1)

    def current_stream(self, device: object = None) -> "_FakeCuda.Stream":
        index = self.state["device_index"] if device is None else torch.device(device).index or 0
        stream_id = self.state["stream_id"] if index == 0 else self.elsewhere
        return self.Stream(torch.device("cuda", index), stream_id=stream_id)

    def set_stream(self, stream: "_FakeCuda.Stream") -> None:
        """``torch.cuda.set_stream``: the stream's device made current too."""
        if stream.device_index == 0:
            self.state.update(stream_id=stream.stream_id, device_index=0, device_type=stream.device_type)
        else:
            self.elsewhere, self.state["device_index"] = stream.stream_id, stream.device_index

    def torch(self) -> object:
        """A stand-in for the ``torch`` module as ``tierkv.transfer`` uses it."""
        from types import SimpleNamespace

        def empty(shape: tuple[int, ...], dtype: torch.dtype, device: object = None,
                  pin_memory: bool = False) -> _FakeCuda.Tensor:
            return self.Tensor(self.log, shape, dtype, device is not None and torch.device(device).type == "cuda")

        cuda = SimpleNamespace(Stream=self.Stream, Event=self.Event, current_stream=self.current_stream,
                               current_device=lambda: self.state["device_index"],
                               stream=lambda stream: self.StreamContext(self, stream),
                               device=lambda index: self.DeviceContext(self, index))
        # The exchange's return has no point of its own (a partial is no traced C call): the
        # next point, or none, sees what it left.
        exchange = functools.partial(self.state.__setitem__, "device_index")
        c = SimpleNamespace(_cuda_setStream=self.state.update, _cuda_exchangeDevice=exchange,
                            _cuda_maybeExchangeDevice=exchange)
        return SimpleNamespace(cuda=cuda, empty=empty, _C=c)

    def unrecorded(self, stream: object) -> list[object]:
        """The CUDA tensors a copy was issued on that the allocator was not told ``stream`` uses."""
        recorded = {id(base) for kind, base, on in self.log if kind == "record" and on is stream}
        return [base for kind, dst, src in self.log if kind == "copy" for base in (dst, src)
                if base.is_cuda and id(base) not in recorded]


def test_a_cuda_copy_cut_short_leaves_no_device_tensor_freed_under_its_queued_copy(monkeypatch) -> None:
    # Before: the caching allocator was told of the copy streams' use of a copy's device
    # tensors after every copy was issued (to_device_many: after every layer group's). Another
    # signal's handler (a SIGALRM timeout) raising as a copy returned lost the job, and its
    # destinations, allocated on the compute stream, went back there at once with copies still
    # queued into them on the side stream: the next tensors made there (a forward's) written
    # over by late KV. An evicted block's D2H copy likewise read memory handed on.
    from conftest import raised_on_the_way_in

    fake = _FakeCuda()
    monkeypatch.setattr(tierkv.transfer, "torch", fake.torch())
    engine = CopyEngine(torch.device("cuda", 0))
    host = [fake.Tensor(fake.log, (4, 2, 1, 8, 2), torch.float32, False) for _ in range(3)]
    calls = {
        "to_device_many": (lambda: engine.to_device_many(host), engine._h2d),
        "to_device": (lambda: engine.to_device(host[0]), engine._h2d),
        "to_host": (lambda: engine.to_host(fake.Tensor(fake.log, (4, 2, 1, 8, 2), torch.float32, True)), engine._d2h),
    }
    for name, (call, stream) in calls.items():
        def enter(call: Callable[[], object] = call) -> object:
            fake.log.clear()
            call()
            return contextlib.nullcontext()

        def told(sent: list, stream: object = stream, name: str = name) -> None:
            assert not fake.unrecorded(stream), f"{name}: a device tensor's queued copy untold at {sent}"

        within = {"to_device_many", "to_device", "to_host", "_copy", "_record_on"}
        assert raised_on_the_way_in(enter, told, within=within) > 5, name
        enter()
        assert any(kind == "copy" for kind, _, _ in fake.log) and not fake.unrecorded(stream), name


def test_a_cuda_copy_cut_short_leaves_no_copy_stream_the_callers_current_one(monkeypatch) -> None:
    # Before: the copies ran inside ``with torch.cuda.stream(stream)``, whose put-back of the
    # caller's stream is a Python __exit__ (set_stream, _set_stream_by_id, then the C call):
    # another signal's handler (a SIGALRM timeout around a turn) raising at any of them left the
    # copy stream the thread's current one for good, its forwards queued behind tierkv's copies.
    from conftest import raised_on_the_way_in

    fake = _FakeCuda()
    monkeypatch.setattr(tierkv.transfer, "torch", fake.torch())
    engine = CopyEngine(torch.device("cuda", 0))
    copy_streams = {engine._h2d.stream_id, engine._d2h.stream_id}
    host = [fake.Tensor(fake.log, (4, 2, 1, 8, 2), torch.float32, False) for _ in range(3)]
    calls = {
        "to_device_many": lambda: engine.to_device_many(host),
        "to_device": lambda: engine.to_device(host[0]),
        "to_host": lambda: engine.to_host(fake.Tensor(fake.log, (4, 2, 1, 8, 2), torch.float32, True)),
    }
    # The thread's current device (the store's, or another) and its stream on the store's
    # device (the default, or one of the program's own inside its ``with torch.cuda.stream``).
    for device, mine in ((0, 0), (0, 100), (1, 0), (1, 100)):
        for name, call in calls.items():
            def enter(call: Callable[[], object] = call, device: int = device, mine: int = mine) -> object:
                fake.enter(device, mine)
                call()
                return contextlib.nullcontext()

            def put_back(sent: list, name: str = name, device: int = device, mine: int = mine) -> None:
                assert fake.state["stream_id"] == mine and fake.elsewhere == 200, \
                    f"{name}: a copy stream left current by the cut at {sent}"
                # Only a cut between the two C calls of the put-back leaves the store's device
                # current (see _streams_to_swap), its stream the caller's.
                assert fake.state["device_index"] in (device, 0), f"{name}: device {fake.state} at {sent}"

            within = {"to_device_many", "to_device", "to_host", "_copy", "__exit__"}
            assert raised_on_the_way_in(enter, put_back, within=within) > 5, name
            enter()
            # What ``with torch.cuda.stream`` leaves: the stream's device's stream put back, the
            # thread's own device (another) as torch.cuda.device puts one back, its stream never
            # changed.
            assert fake.state == {"stream_id": mine, "device_index": device, "device_type": 1}, (name, device, mine)
            assert fake.elsewhere == 200


def test_the_cuda_stand_in_puts_back_as_torch_cuda_stream_does() -> None:
    # The stand-in's own semantics, against torch/cuda/__init__.py's StreamContext: what the
    # test above holds the copies to is what a ``with torch.cuda.stream`` leaves.
    fake = _FakeCuda()
    side = fake.Stream(torch.device("cuda", 0))
    for device, mine in ((0, 0), (0, 100), (1, 0), (1, 100)):
        fake.enter(device, mine)
        with fake.StreamContext(fake, side):
            assert fake.state == {"stream_id": side.stream_id, "device_index": 0, "device_type": 1}
            assert fake.current_stream().stream_id == side.stream_id
        assert fake.state == {"stream_id": mine, "device_index": device, "device_type": 1} and fake.elsewhere == 200


def test_a_read_cut_short_leaves_no_stream_noted_that_the_allocator_was_not_told_of() -> None:
    # Before: _used_on noted the reading stream before telling the allocator: another signal's
    # handler raising as the note returned left it noted for good, so no later read there told
    # it either; the block, evicted and freed while that stream's forward still read it, went
    # to the next tensor made on its own stream.
    from conftest import raised_on_the_way_in

    from tierkv.transfer import _CudaCopyJob, _LayeredCudaJob

    fake = _FakeCuda()
    stream = fake.Stream()
    for make in (lambda t: _CudaCopyJob(fake.Event(), t), lambda t: _LayeredCudaJob([fake.Event()], t)):
        jobs: list[_CudaCopyJob] = []

        def enter(make: Callable[[object], _CudaCopyJob] = make) -> object:
            jobs.append(make(fake.Tensor(fake.log, (1, 2, 1, 8, 2), torch.float32, True)))
            jobs[-1].stream_wait_layer(0, set(), stream)
            return contextlib.nullcontext()

        def told(sent: list) -> None:
            job = jobs[-1]
            if stream.cuda_stream in job._recorded:
                assert ("record", job._tensor, stream) in fake.log, f"a stream noted untold at {sent}"

        assert raised_on_the_way_in(enter, told, within={"stream_wait_layer", "_used_on"}) >= 2
        enter()
        assert ("record", jobs[-1]._tensor, stream) in fake.log and jobs[-1]._recorded == {stream.cuda_stream}


def test_the_stores_threads_take_its_cuda_device_and_none_off_cuda(monkeypatch) -> None:
    # A new thread's current device is GPU 0: the writer's event waits and the read helpers'
    # event queries there made GPU 0's context (hundreds of MiB) in a process on another GPU.
    from tierkv.transfer import thread_binding

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))
    assert thread_binding(None) is None and thread_binding(torch.device("cpu")) is None
    bind = thread_binding(torch.device("cuda", 1))
    assert bind is not None and not calls
    bind()
    assert calls == [(threading.current_thread().name, torch.device("cuda", 1))]
    calls.clear()
    writer: BackgroundWriter[str] = BackgroundWriter(lambda items: [None] * len(items), name="bound-writer",
                                                    device=torch.device("cuda", 1))
    try:
        writer.submit("x").wait(WAIT)
    finally:
        writer.close(timeout=WAIT)
    assert calls == [("bound-writer", torch.device("cuda", 1))]


def test_a_copys_timer_asks_its_events_under_the_copys_device(monkeypatch) -> None:
    # A metrics scrape drains the moves' timers in a thread of its own (one per request), on
    # GPU 0: the end event's query made GPU 0's context there. A drain in the main thread that
    # another signal's handler cut inside ``with torch.cuda.device``'s Python __exit__ left
    # the copy's device the thread's current one for good.
    from conftest import raised_on_the_way_in

    from tierkv.transfer import _CudaCopyJob, copy_timer

    fake = _FakeCuda()
    monkeypatch.setattr(tierkv.transfer, "torch", fake.torch())
    asked: list[int] = []

    class Event:
        def query(self) -> bool:
            asked.append(fake.state["device_index"])
            return True

        def elapsed_time(self, end: object) -> float:
            asked.append(fake.state["device_index"])
            return 2.0

    tensor = fake.Tensor(fake.log, (1,), torch.float32, True)
    tensor.device = torch.device("cuda", 1)
    timer = copy_timer(_CudaCopyJob(Event(), tensor, Event()))
    assert timer is not None and timer() == 0.002
    assert asked == [1, 1] and fake.state["device_index"] == 0

    def enter() -> object:
        timer()
        return contextlib.nullcontext()

    def put_back(sent: list) -> None:
        assert fake.state["device_index"] == 0, f"the copy's device left current by the cut at {sent}"

    assert raised_on_the_way_in(enter, put_back, within={"seconds", "__exit__"}) >= 3
