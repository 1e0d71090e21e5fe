"""Disk reads side by side: the disk tier's shared lock, ``readers.ReadPool``, and restores whose
records several threads read (``TieredStore._read_disk_blocks``): exact against plain
``generate``, cut short at the first miss as one thread's reads were, Ctrl-C included."""

from __future__ import annotations

import sys
import threading
import time

import lmdb
import numpy as np
import pytest
import torch

import tierkv.locks
import tierkv.store as store_module
from conftest import ARCHITECTURES, damage_in_place, flipped, raised_on_the_way_in, random_ids
from tierkv import TieredStore
from tierkv.cache import IN_PLACE, UNREAD
from tierkv.locks import SharedLock
from tierkv.readers import Latch, ReadPool, helper_threads
from tierkv.tiers.disk import DiskTier

B = 4


# -- SharedLock ------------------------------------------------------------------------------------
def test_readers_share_the_lock_and_an_exclusive_holder_waits_for_them():
    lock = SharedLock()
    both = threading.Barrier(2, timeout=5)

    def reader():
        with lock.shared():
            both.wait()  # breaks (BrokenBarrierError) unless both readers are inside at once

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not both.broken
    with lock.shared():
        assert not lock.acquire(timeout=0.05)  # a reader inside
        assert not lock.acquire(blocking=False)
    assert lock.acquire(timeout=1)
    assert lock.locked()
    lock.release()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()


def behind_a_waiting_writer(lock: SharedLock, writer, reader) -> tuple[threading.Thread, threading.Thread]:
    """``writer`` started in a thread, and once it waits for exclusive holding, ``reader``."""
    first = threading.Thread(target=writer)
    first.start()
    while not lock._waiting:
        time.sleep(0.001)
    second = threading.Thread(target=reader)
    second.start()
    return first, second


def test_an_exclusive_holder_waiting_holds_back_later_readers_and_lets_them_go_when_it_gives_up():
    lock = SharedLock()
    inside, order = threading.Event(), []
    release_first = threading.Event()

    def first_reader():
        with lock.shared():
            inside.set()
            release_first.wait(5)
        order.append("first out")

    def writer():
        with lock:
            order.append("writer")

    def late_reader():
        with lock.shared():
            order.append("late reader")

    t1 = threading.Thread(target=first_reader)
    t1.start()
    inside.wait(5)
    t2, t3 = behind_a_waiting_writer(lock, writer, late_reader)
    time.sleep(0.05)
    assert order == []  # the late reader waits behind the waiting writer
    release_first.set()
    for t in (t1, t2, t3):
        t.join(5)
    assert order == ["first out", "writer", "late reader"]

    # A wait for exclusive holding that times out lets the readers it held back in.
    with lock.shared():
        got = []
        t, late = behind_a_waiting_writer(lock, lambda: got.append(lock.acquire(timeout=0.2)), late_reader)
        t.join(5)
        late.join(5)
        assert got == [False] and order[-1] == "late reader" and not late.is_alive()


def test_readers_past_the_limit_wait_for_one_to_leave():
    lock = SharedLock(limit=2)
    inside, leave = threading.Barrier(3, timeout=5), threading.Event()
    order = []

    def reader(name):
        with lock.shared():
            order.append(name)
            if name != "third":
                inside.wait()
                leave.wait(5)

    first, second = (threading.Thread(target=reader, args=(n,)) for n in ("first", "second"))
    first.start()
    second.start()
    inside.wait()  # both inside
    third = threading.Thread(target=reader, args=("third",))
    third.start()
    time.sleep(0.05)
    assert sorted(order) == ["first", "second"]  # the third waits for a slot
    leave.set()
    for t in (first, second, third):
        t.join(5)
    assert order[-1] == "third" and lock._readers == 0


def test_a_reader_leaving_lets_one_waiting_for_a_slot_in_at_once(monkeypatch):
    # Nothing checked that a reader leaving while others stay wakes a reader waiting for its slot:
    # without the wake, the waiter came in only at its next look (_RECHECK_S), a stall in every
    # open of many threads past LMDB's reader slots. Its looks are put off here, so only the wake
    # lets it in while the second reader stays.
    monkeypatch.setattr(tierkv.locks, "_RECHECK_S", 600.0)
    lock = SharedLock(limit=2)
    inside, first_out, done = threading.Barrier(3, timeout=5), threading.Event(), threading.Event()
    entered = threading.Event()

    def reader(leave):
        with lock.shared():
            inside.wait()
            leave.wait(5)

    def third():
        with lock.shared():
            entered.set()

    first = threading.Thread(target=reader, args=(first_out,))
    second = threading.Thread(target=reader, args=(done,))
    first.start()
    second.start()
    inside.wait()
    late = threading.Thread(target=third, daemon=True)
    late.start()
    while not lock._cond._waiters:  # the third waits for a slot
        time.sleep(0.001)
    first_out.set()
    first.join(5)
    try:
        assert entered.wait(5) and lock._readers == 1  # in beside the second, which has not left
    finally:
        done.set()
        second.join(5)


class Timeout(Exception):
    """A SIGALRM-style timeout a signal handler raises."""


def _raise_timeout(signum, frame):
    raise Timeout


def test_a_signal_handlers_exception_as_the_lock_state_is_let_go_leaves_the_lock_free(monkeypatch):
    """A real signal's handler raising just after the lock's state mutex was let go (where
    CPython runs it: as a C call returns), at each of its releases in turn: in ``shared()``'s
    generator it landed between the reader count's increment and its ``try``, and the count
    stayed up (the exclusive side after it, a close or a remap, waited forever); the exclusive
    side's ``_writer`` likewise."""
    import signal

    main, real_lock = threading.get_ident(), threading.Lock

    class InterruptedLock:
        """A ``threading.Lock`` whose ``armed``-th release has a signal land as it returns."""

        def __init__(self):
            self._lock = real_lock()
            self.releases = 0
            self.armed = -1

        def acquire(self, blocking=True, timeout=-1):
            return self._lock.acquire(blocking, timeout)

        def release(self):
            self._lock.release()
            self.releases += 1
            if self.releases == self.armed:
                signal.pthread_kill(main, signal.SIGUSR1)  # its handler runs before this returns

        __enter__ = acquire

        def __exit__(self, *exc):
            self.release()

        def locked(self):
            return self._lock.locked()

    previous = signal.signal(signal.SIGUSR1, _raise_timeout)
    try:
        landed = 0
        for armed in range(1, 5):  # a shared holding's way in and out, then an exclusive one's
            with monkeypatch.context() as patch:
                patch.setattr(threading, "Lock", InterruptedLock)
                lock = SharedLock()
            mutex = lock._cond._lock  # the state's lock, whichever way the lock reaches it
            mutex.armed = armed
            for step in ("shared", "exclusive"):
                try:
                    with (lock.shared() if step == "shared" else lock):
                        pass
                except Timeout:
                    landed += 1
                assert lock._readers == 0 and not lock.locked(), (armed, step)
            mutex.armed = -1
            assert lock.acquire(timeout=1), armed
            lock.release()
        assert landed == 4
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_waiting_exclusive_holder_gets_in_when_a_leaving_readers_wake_up_is_cut_short(monkeypatch):
    """``Condition.notify_all`` is Python code, where a signal handler can raise: a reader leaving
    with its wake-up cut short left an exclusive holder already waiting asleep for good."""
    lock = SharedLock()
    got = []
    with pytest.raises(KeyboardInterrupt):
        with lock.shared():
            def cut_short():
                monkeypatch.undo()
                raise KeyboardInterrupt

            writer = threading.Thread(target=lambda: got.append(lock.acquire()), daemon=True)
            writer.start()
            while not lock._waiting:
                time.sleep(0.001)
            monkeypatch.setattr(lock._cond, "notify_all", cut_short)
    writer.join(5)
    assert got == [True] and lock.locked()
    lock.release()


def _cut_as_it_starts(name: str, body) -> int:
    """Run ``body()`` with a real signal sent as each Python function called ``name`` starts (where
    CPython runs a pending handler: before the function's first line), its handler raising
    ``Timeout``; returns how many times it raised."""
    import signal

    main, cut = threading.get_ident(), []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name and threading.get_ident() == main:
            cut.append(name)
            signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, _raise_timeout)
    try:
        sys.setprofile(profile)
        try:
            body()
        finally:
            sys.setprofile(None)
    except Timeout:
        pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return len(cut)


def test_a_timeout_as_a_stale_reader_is_let_go_is_raised_and_its_transaction_let_go_all_the_same():
    """A signal handler's ``TimeoutError`` at any point of ``_drop_stale`` (the main thread taking
    the lock again after a reader's exit was cut short) reaches the caller, and the reader's
    ``on_stale`` (the disk tier's abort of the read transaction it left) is called once. Before,
    the ``except Exception`` around ``on_stale`` took it for that call's failure: the timeout was
    lost, and, cut as ``on_stale`` started, the transaction was never aborted."""
    import contextlib

    from conftest import raised_on_the_way_in

    lock = SharedLock()
    stale: list[str] = []
    made = [0]

    def held_and_left() -> None:
        lock.enter_shared(sys._getframe(), lambda: stale.append("aborted"))
        made[0] += 1

    def taken() -> contextlib.nullcontext:
        assert lock.acquire(blocking=False)
        lock.release()
        return contextlib.nullcontext()

    def let_go_once(sent: list) -> None:
        taken()  # what the cut left stale, let go now
        assert lock._readers == 0 and stale == ["aborted"] * made[0], sent
        held_and_left()

    held_and_left()
    assert raised_on_the_way_in(taken, let_go_once, within={"_drop_stale"}, timeout=True) > 5
    taken()


def test_a_reader_whose_exit_a_handler_cut_short_is_let_go_once_its_with_is_gone():
    """A handler raising as a shared ``with``'s ``__exit__`` starts (Python code, so CPython runs
    one there) left the reader counted for good: every exclusive holder after it, a close or a
    remap, waited forever. Its ``with`` is gone from the stack: an exclusive holder in another
    thread lets it go at its next look, the reader's own thread at once, and a nested holding
    whose ``with`` is still running stays held."""
    lock = SharedLock()
    stale: list[str] = []

    def read_and_leave():
        with lock.shared():
            pass

    assert _cut_as_it_starts("exit_shared", read_and_leave) == 1
    assert lock._readers == 1  # the cut left it
    got: list[bool] = []
    writer = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5)))
    writer.start()
    writer.join(10)
    assert got == [True] and lock._readers == 0
    lock.release()

    # Let go of by the thread's next holding, at once; what ``enter_shared``'s caller gave to
    # let go of with it is called (the disk tier's read transaction).
    def held_and_left():
        lock.enter_shared(sys._getframe(), lambda: stale.append("aborted"))

    held_and_left()
    assert lock._readers == 1 and not stale
    assert lock.acquire(blocking=False) and stale == ["aborted"] and lock._readers == 0
    lock.release()
    held_and_left()
    with lock.shared():
        assert lock._readers == 1 and stale == ["aborted"] * 2
    assert lock._readers == 0

    # Held twice by one thread (the protocol says never; were it so): the outer ``with`` still
    # runs, so its holding stays while an exclusive holder waits.
    with lock.shared():
        with lock.shared():
            assert lock._readers == 2
        assert lock._readers == 1
        assert not lock.acquire(timeout=0.6)  # past two looks: nothing let go
        assert lock._readers == 1


def test_a_reader_waiting_for_a_slot_lets_go_of_a_stale_reader_of_another_thread():
    """The module's protocol: a reader waiting for a slot looks for stale readers after
    ``_RECHECK_S``, not only an exclusive holder. A thread whose shared ``with`` was cut short in
    its exit (here: entered, never exited) and that never takes the lock again: with
    every slot held so, a later reader waited forever (no exclusive holder to sweep)."""
    lock = SharedLock(limit=1)
    stale: list[str] = []

    def held_and_left():
        lock.enter_shared(sys._getframe(), lambda: stale.append("aborted"))

    entered, done = threading.Event(), threading.Event()

    def hold_then_idle():
        held_and_left()
        entered.set()
        done.wait()  # alive and never taking the lock again (its ident not reused by the reader)

    idle = threading.Thread(target=hold_then_idle, daemon=True)
    idle.start()
    entered.wait()
    assert lock._readers == 1 and not stale  # the one slot, held for a frame that left

    got: list[int] = []

    def read():
        with lock.shared():
            got.append(lock._readers)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)  # a guard against a hang, never a timing: it gets in at its first look
    done.set()
    assert got == [1] and stale == ["aborted"] and lock._readers == 0


def test_a_stale_holding_of_a_thread_that_ended_is_let_go_and_readers_leave_no_entry_behind():
    """A thread that ended has no stack: every reader it left (an exit cut short, then the
    thread's end) is stale, and an exclusive holder's look lets it go (before, such a reader was
    kept for good: a close or a remap waited forever); so is an exclusive holding it left. And
    each reader's thread leaves the lock's books as it leaves: a server's many short-lived
    threads kept an entry each."""
    lock = SharedLock()
    stale: list[str] = []

    def held_and_left():
        lock.enter_shared(sys._getframe(), lambda: stale.append("aborted"))

    ended = threading.Thread(target=held_and_left)
    ended.start()
    ended.join()
    assert lock._readers == 1 and not stale
    assert lock.acquire(timeout=10)  # let go at the first look, past _RECHECK_S: no timing here
    assert stale == ["aborted"] and lock._readers == 0
    lock.release()

    def read():
        with lock.shared():
            pass

    readers = [threading.Thread(target=read) for _ in range(4)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join()
    assert lock._holders == {}

    # The exclusive side alike: held by a thread that ended without letting go (a release cut
    # short as it started), let go at a waiting reader's look, and at an exclusive holder's.
    def acquire_and_end():
        assert lock.acquire()

    ended = threading.Thread(target=acquire_and_end)
    ended.start()
    ended.join()
    assert lock.locked()
    got: list[bool] = []
    reader = threading.Thread(target=lambda: (read(), got.append(True)), daemon=True)
    reader.start()
    reader.join(10)  # a guard against a hang: it gets in at its first look
    assert got == [True] and not lock.locked()
    ended = threading.Thread(target=acquire_and_end)
    ended.start()
    ended.join()
    assert lock.acquire(timeout=10) and lock.locked()
    lock.release()


def test_an_exclusive_holding_whose_release_a_handler_cut_short_is_let_go_once_its_frame_is_gone():
    """A handler raising as ``release`` starts (in a ``with``'s exit, or a ``finally`` after
    ``acquire``, as the disk tier's close has) left the lock held exclusively for good: a second
    close, every read after it, waited forever. The frame that took it is gone from the stack: a
    reader or an exclusive holder in another thread lets it go at its next look, the holder's own
    thread at once, and a holding whose frame still runs stays held."""
    lock = SharedLock()

    def hold_and_leave():
        with lock:
            pass

    def acquire_and_leave():
        assert lock.acquire()
        try:
            pass
        finally:
            lock.release()

    for leave in (hold_and_leave, acquire_and_leave):
        assert _cut_as_it_starts("release", leave) == 1
        assert lock.locked()  # the cut left it
        got: list[bool] = []
        reader = threading.Thread(target=lambda: (lock.enter_shared(sys._getframe()), lock.exit_shared(),
                                                  got.append(True)))
        reader.start()
        reader.join(10)
        assert got == [True] and not lock.locked()
        assert _cut_as_it_starts("release", leave) == 1
        other = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5) and not lock.release()))
        other.start()
        other.join(10)
        assert got == [True, True] and not lock.locked()
        assert _cut_as_it_starts("release", leave) == 1
        with lock.shared():  # this thread's own next holding: at once
            assert not lock.locked()

    # Still held by a frame that runs: kept through two looks of another thread's waiting, taken
    # by a ``with`` or by ``acquire`` (held by its caller's frame, not by ``acquire``'s own,
    # which has returned).
    with lock:
        seen: list[bool] = []
        waiting = threading.Thread(target=lambda: seen.append(lock.acquire(timeout=0.6)))
        waiting.start()
        waiting.join(10)
        assert seen == [False] and lock.locked()
    assert not lock.locked()
    assert lock.acquire()
    try:
        waiting = threading.Thread(target=lambda: seen.append(lock.acquire(timeout=0.6)))
        waiting.start()
        waiting.join(10)
        assert seen == [False, False] and lock.locked()
    finally:
        lock.release()
    assert not lock.locked()


def test_a_read_transaction_whose_exit_a_handler_cut_short_holds_nothing_for_good(tiny_model, tmp_path):
    """A handler raising as ``reading()``'s or a read's ``__exit__`` starts: the lock's shared
    side and the read transaction stayed held, and the thread's later reads went through the
    stale transaction. Now the next open reads through a transaction of its own (a record
    written since is seen), and a close gets the lock instead of waiting forever."""
    model = tiny_model("llama")
    store = TieredStore(tmp_path / "kv", device="cpu", device_budget=0, host_budget=0, block_size=B)
    try:
        ids = random_ids(13, 1601)
        cache = store.open(model, ids)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        cache.commit(out)
        store.flush()
        plain = model.generate(out, max_new_tokens=2, do_sample=False)
        for name in ("__exit__", "exit_shared"):
            lock = store._disk._resize_lock

            def one_thread_read():
                with store._disk.reading():
                    store._disk.read_into(next(iter(store._index.blocks)), lambda h: np.empty(
                        (h.shape[0] * h.shape[1] * h.shape[2], h.shape[3], h.shape[4] * 4), np.uint8))

            assert _cut_as_it_starts(name, one_thread_read) >= 1, name
            assert lock._readers == 1, name  # left held by the cut
            cache = store.open(model, out)  # the thread's next read lets go of it
            assert lock._readers == 0 and store._disk._reading.txn is None, name
            assert cache.restored_tokens == out.shape[1] - 1
            assert torch.equal(model.generate(out, past_key_values=cache, max_new_tokens=2, do_sample=False),
                               plain), name
            del cache
        # Cut again, then a close from another thread (a server's shutdown): it gets the lock.
        assert _cut_as_it_starts("exit_shared", one_thread_read) == 1
        closed: list[int] = []
        closer = threading.Thread(target=lambda: closed.append(store.close(timeout=20)))
        closer.start()
        closer.join(30)
        assert not closer.is_alive() and closed, "close waited for a reader that had left"
    finally:
        store.close(timeout=1)


# -- ReadPool --------------------------------------------------------------------------------------
def test_a_read_pool_reads_side_by_side_and_starts_none_past_the_first_miss():
    pool = ReadPool(2)
    try:
        side_by_side = threading.Barrier(3, timeout=5)
        threads: dict[int, str] = {}

        def read(i):
            threads[i] = threading.current_thread().name
            if i in (1, 2, 3):
                side_by_side.wait()  # three readers at once, or BrokenBarrierError
            return True

        pool.run(list(range(6)), read)
        assert sorted(threads) == list(range(6)) and threads[0] == threading.current_thread().name
        assert any(name.startswith("tierkv-disk-read") for name in threads.values())

        started = []

        def missing_at_2(i):
            started.append(i)
            time.sleep(0.01 if i == 2 else 0.05)
            return i != 2

        pool.run(list(range(40)), missing_at_2)
        # Reads in flight beside the miss may end; none starts once it is known.
        assert 2 in started and max(started) <= 2 + pool.threads

        def raising(i):
            if i == 5:
                raise MemoryError("read 5")
            return i != 3

        pool.run(list(range(8)), raising)  # an error past the first miss is not raised

        def raising_first_miss(i):
            if i == 3:
                raise MemoryError("read 3")
            return True

        with pytest.raises(MemoryError, match="read 3"):
            pool.run(list(range(8)), raising_first_miss)
    finally:
        pool.close()


def test_a_read_pools_helpers_run_its_start_before_their_first_read():
    # The store's start makes its CUDA device the helper's own: a helper's read takes a pool
    # buffer, whose reclaim asks the copies' CUDA events, and a thread on GPU 0 (every new
    # thread) made GPU 0's context for that, in a process whose store is on another GPU.
    started: set[str] = set()
    pool = ReadPool(2, start=lambda: started.add(threading.current_thread().name))
    try:
        both = threading.Barrier(2, timeout=5)
        unstarted: list[str] = []

        def read(i):
            name = threading.current_thread().name
            if name.startswith("tierkv-disk-read") and name not in started:
                unstarted.append(name)
            if i in (1, 2):
                both.wait()  # two helpers at once
            return True

        pool.run(list(range(4)), read)
        assert len(started) == 2 and all(name.startswith("tierkv-disk-read") for name in started)
        assert not unstarted
    finally:
        pool.close()


def test_a_stores_read_helpers_start_bound_to_its_device(tiny_model, tmp_path, side_by_side, monkeypatch):
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(6 * B + 1, 5))
    nxt = torch.cat([out, random_ids(2, 6)], dim=1)
    bound: dict[str, object] = {}
    devices: list[object] = []

    def binding(device):
        devices.append(device)
        return lambda: bound.setdefault(threading.current_thread().name, device)

    monkeypatch.setattr(store_module, "thread_binding", binding)
    seen = reads_by_thread(monkeypatch)
    with disk_only(tmp_path / "kv") as store:
        cache = store.open(model, nxt)
        assert cache.restored_from["disk"] == cache.restored_tokens
    helpers = {name for name in seen.values() if name.startswith("tierkv-disk-read")}
    assert devices == [store.device] and helpers and helpers <= set(bound)
    assert set(bound.values()) == {store.device}


def test_a_read_pool_helper_waits_for_the_first_read_to_make_what_it_writes_into():
    pool = ReadPool(1)
    ready = Latch()
    made: list[str] = []
    seen = []

    def read(i):
        if i == 0:
            time.sleep(0.05)  # a helper that did not wait would read meanwhile
            made.append("buffer")
            ready.set()
            time.sleep(0.05)
            return True
        seen.append(bool(made))
        return True

    try:
        pool.run([0, 1, 2], read, ready)
    finally:
        pool.close()
    assert seen == [True, True]


def test_a_closed_pool_reads_in_the_calling_thread():
    pool = ReadPool(2)
    pool.close()
    names = []
    pool.run([0, 1, 2], lambda i: names.append(threading.current_thread().name) or True)
    assert names == [threading.current_thread().name] * 3
    assert helper_threads(0) == 0 and helper_threads() >= 0



def cgroups(tmp_path, membership: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake cgroup root holding ``files`` (path under it -> text), and a fake
    ``/proc/self/cgroup`` holding ``membership``: ``helper_threads``'s paths."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return str(root), str(tmp_path / "membership")


@pytest.mark.parametrize("membership, files, quota", [
    # cgroup v2, in a container's own cgroup namespace
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v2 on a host: the least quota along the process's cgroup and its ancestors
    ("0::/a/b\n", {"cpu.max": "max 100000\n", "a/cpu.max": "100000 100000\n", "a/b/cpu.max": "300000 100000\n"},
     1.0),
    # a container whose root is its own cgroup, /proc/self/cgroup naming a path only the host has
    ("0::/docker/0123\n", {"cpu.max": "250000 100000\n"}, 2.5),
    # cgroup v1, the cpu controller mounted with cpuacct, beside a v2 line without it
    ("4:memory:/x\n3:cpu,cpuacct:/x\n0::/\n",
     {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
      "cpu,cpuacct/x/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}, 0.5),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    # v1 with the controllers named together but mounted as "cpu" alone: no such directory, or
    # something else of that name (not a hierarchy to read)
    ("3:cpu,cpuacct:/x\n", {"cpu/x/cpu.cfs_quota_us": "50000\n", "cpu/x/cpu.cfs_period_us": "100000\n"}, 0.5),
    ("3:cpu,cpuacct:/x\n", {"cpu,cpuacct": "", "cpu/x/cpu.cfs_quota_us": "50000\n",
                             "cpu/x/cpu.cfs_period_us": "100000\n"}, 0.5),
    ("", {}, None),  # no cgroups to read
])
def test_helper_threads_count_a_containers_cpu_quota(tmp_path, monkeypatch, membership, files, quota):
    """Counted from the CPU affinity alone, a container given 1.5 CPUs of a 64-core host started
    three helpers, every open's reads then throttled by the quota."""
    from tierkv.readers import cgroup_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    root, member = cgroups(tmp_path, membership, files)
    assert cgroup_cpus(root, member) == quota
    expected = 3 if quota is None else {0.5: 0, 1.0: 0, 1.5: 1, 2.5: 2}[quota]
    assert helper_threads(3, root, member) == expected


def test_a_timeout_while_the_cpu_quota_is_read_is_raised_not_taken_for_no_cgroup(tmp_path):
    """A signal handler's ``TimeoutError`` at any point of ``helper_threads`` (a store's
    construction) reaches the caller. Before, each ``except OSError`` there (no membership file, no
    ``cpu.max``, v1's files, the affinity) and ``os.path.isdir`` took it for a missing file: the
    store was made and the program's timeout lost."""
    import contextlib

    from conftest import raised_on_the_way_in

    # v1 beside v2: the v2 root has no cpu.max (its OSError taken, v1's files read instead).
    root, member = cgroups(tmp_path, "3:cpu,cpuacct:/x\n0::/\n",
                           {"cpu,cpuacct/x/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    assert helper_threads(3, root, member) == 0
    points = raised_on_the_way_in(lambda: (helper_threads(3, root, member), contextlib.nullcontext())[1],
                                  lambda sent: None, timeout=True)
    assert points > 20


def test_a_read_pools_helpers_are_daemon_threads_that_end_with_the_pool():
    """Not joined at the interpreter's exit (one stuck in a hung disk's read would hang it:
    ``test_crash``), and gone when the pool is closed or collected unclosed."""
    import gc

    def helpers():
        return [t for t in threading.enumerate() if t.name.startswith("tierkv-disk-read")]

    before = set(helpers())
    for close in (True, False):
        pool = ReadPool(2)
        pool.run([0, 1, 2, 3], lambda i: time.sleep(0.01) or True)
        mine = [t for t in helpers() if t not in before]
        assert len(mine) == 2 and all(t.daemon for t in mine)
        if close:
            pool.close()
        del pool
        gc.collect()
        for t in mine:
            t.join(5)
            assert not t.is_alive()


def test_a_read_pool_holds_nothing_of_a_run_once_it_returned():
    """A helper task still queued when its run ended (the helpers busy with another run's
    reads, or not awake yet), or one a helper has just finished, referred to the run's reads,
    and through them to the store: one dropped right after an open outlived its last
    reference, finalised later on a helper thread."""
    import gc
    import weakref

    pool = ReadPool(2)
    release, other_reading = threading.Event(), threading.Event()

    def held_first(i):
        if i == 0:
            other_reading.set()
            release.wait(5)
        return True

    other = threading.Thread(target=pool.run, args=([0, 1, 2], held_first, Latch()))
    other.start()
    try:
        assert other_reading.wait(5)
        deadline = time.monotonic() + 5
        while not pool._tasks.empty() and time.monotonic() < deadline:  # both helpers on the other run
            time.sleep(0.001)

        class Store:
            pass

        store = Store()
        gone = weakref.ref(store)
        pool.run([0, 1, 2, 3], lambda i, store=store: True)  # read by this thread alone
        del store
        gc.collect()
        assert gone() is None
    finally:
        release.set()
        other.join(5)
        pool.close()


def test_a_run_a_signal_handler_cuts_short_returns_once_its_reads_ended():
    """Another signal's handler raising in the calling thread while it waits for the helpers (a
    SIGALRM timeout: Ctrl-C is held off there) raised out of ``run`` with a helper still reading:
    it went on writing into what the caller then let go of (the restore's buffer, pool buffers it
    held only until the open ended: a lease held after that was never let go)."""
    import signal
    import sys

    class Timeout(Exception):
        pass

    def on_signal(signum, frame):
        raise Timeout

    pool = ReadPool(1)
    caller = threading.get_ident()
    helper_reading, ended = threading.Event(), []

    def waits_for_a_helper():
        frame = sys._current_frames().get(caller)
        while frame is not None and frame.f_code.co_name != "_settle":
            frame = frame.f_back
        return frame is not None

    def read(i):
        if i == 0:
            assert helper_reading.wait(5)
        else:
            helper_reading.set()
            deadline = time.monotonic() + 5
            while not waits_for_a_helper() and time.monotonic() < deadline:
                time.sleep(0.001)
            signal.pthread_kill(caller, signal.SIGUSR1)
            time.sleep(0.2)
        ended.append(i)
        return True

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(Timeout):
            pool.run([0, 1], read)
        assert sorted(ended) == [0, 1]  # the helper's read ended before run raised
    finally:
        signal.signal(signal.SIGUSR1, previous)
        pool.close()


def test_a_run_whose_gate_opening_is_cut_short_twice_lets_its_waiting_helper_go():
    """``run`` opens the gate its helpers wait at (``ready``) after its own read, and again as it
    ends, and once more if that second opening is cut short: a signal's handler raising as each
    of the first two began (a ``SIGALRM`` timeout, then another) left a helper waiting at the
    gate, and ``run`` waiting for that helper, for good."""
    pool = ReadPool(1)
    main = threading.get_ident()

    class CutGate(Latch):
        __slots__ = ("cuts",)

        def set(self) -> None:
            if threading.get_ident() == main and len(self.cuts) < 2:
                self.cuts.append(1)
                raise Timeout  # as a handler's, before the release
            super().set()

    gate = CutGate()
    gate.cuts = []

    def at_the_gate() -> bool:
        return any(f.f_code is Latch.wait.__code__ for ident, top in sys._current_frames().items()
                   if ident != main for f in _stack(top))

    def read(i):
        deadline = time.monotonic() + 10  # a guard: the helper is at the gate at once
        while not at_the_gate() and time.monotonic() < deadline:
            time.sleep(0.001)
        return True

    hung: list[bool] = []
    finished = threading.Event()

    def watchdog():  # a guard against a hang, never a timing: run returns at once
        if not finished.wait(10):
            hung.append(True)
            Latch.set(gate)

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        with pytest.raises(Timeout):
            pool.run([0, 1], read, gate)
    finally:
        finished.set()
        pool.close()
    guard.join()
    assert len(gate.cuts) == 2 and not hung


def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def read_past_a_helpers_miss(then):
    """A read for ``pool.run([0, 1, 2], read)`` on a pool of one helper: the calling thread reads
    0, the helper misses 1, and the calling thread's read of 2, past that miss (one that one
    thread would not have started), ends in ``then()``."""
    helper_in_1, helper_missed, main_in_2 = threading.Event(), threading.Event(), threading.Event()

    def read(i):
        if i == 0:
            assert helper_in_1.wait(5)
            return True
        if i == 1:
            helper_in_1.set()
            assert main_in_2.wait(5)
            helper_missed.set()
            return False
        main_in_2.set()
        assert helper_missed.wait(5)
        time.sleep(0.05)  # the helper records its miss
        return then()

    return read


def test_an_exit_raised_in_a_read_past_the_first_miss_is_not_swallowed():
    """Only an error (an ``Exception``) is raised from the first miss alone: a SIGTERM handler's
    ``sys.exit()`` landing in the calling thread's read of an item past a miss a helper found
    (a read that one thread would not have started) was swallowed with that read's result, and
    the program did not exit."""
    pool = ReadPool(1)

    def exit_():
        raise SystemExit(0)

    try:
        with pytest.raises(SystemExit):
            pool.run([0, 1, 2], read_past_a_helpers_miss(exit_))
    finally:
        pool.close()



def test_an_exit_raised_in_a_helpers_read_is_raised_by_run():
    """What a helper's read raises that is no ``Exception`` (a ``sys.exit()`` in it) is raised by
    ``run``, as in the calling thread: a helper's task that set its future's result instead
    swallowed it, and ``run`` returned as if that read had missed."""
    pool = ReadPool(1)
    caller = threading.get_ident()
    helper_read = threading.Event()

    def read(i: int) -> bool:
        if threading.get_ident() != caller:
            helper_read.set()
            raise SystemExit(3)
        # The calling thread's first read waits for the helper's (started at once: ``ready`` is set).
        assert helper_read.wait(60)
        return True

    ready = threading.Event()
    ready.set()
    try:
        with pytest.raises(SystemExit):
            pool.run([0, 1, 2], read, ready)
    finally:
        pool.close()


@pytest.mark.parametrize("from_a_handler", [True, False])
def test_a_signal_handlers_error_in_a_read_past_the_first_miss_is_raised(from_a_handler):
    """A handler's ``Exception`` (a SIGALRM timeout) landing in the calling thread's read of an
    item past a miss a helper found was discarded with that read's result, as the read's own
    error is: the program's timeout vanished. Only the main thread runs handlers, so only the
    calling thread's reads can meet one."""
    import signal

    pool = ReadPool(1)
    main = threading.get_ident()

    def timeout():
        if from_a_handler:
            signal.pthread_kill(main, signal.SIGUSR1)  # the handler raises before this returns
        raise Timeout  # the read's own error

    read = read_past_a_helpers_miss(timeout)

    previous = signal.signal(signal.SIGUSR1, _raise_timeout)
    try:
        if from_a_handler:
            with pytest.raises(Timeout):
                pool.run([0, 1, 2], read)
        else:
            pool.run([0, 1, 2], read)  # past the miss: dropped
    finally:
        signal.signal(signal.SIGUSR1, previous)
        pool.close()


# -- restores read side by side ---------------------------------------------------------------------
@pytest.fixture
def side_by_side(monkeypatch):
    """Every restore of two records or more read side by side, by two helpers and the caller."""
    monkeypatch.setattr(store_module, "PARALLEL_READ_BYTES", 0)
    monkeypatch.setattr(store_module, "helper_threads", lambda: 2)


def reads_in(monkeypatch, parallel: bool) -> None:
    """Restores of two records or more read side by side (two helpers and the caller), or all
    in the calling thread."""
    monkeypatch.setattr(store_module, "PARALLEL_READ_BYTES", 0 if parallel else 1 << 62)
    if parallel:
        monkeypatch.setattr(store_module, "helper_threads", lambda: 2)


def disk_only(path) -> TieredStore:
    return TieredStore(path, device="cpu", block_size=B, device_budget=0, host_budget=0)


def generate(model, ids, cache=None):
    kwargs = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, **kwargs)


def stored(model, path, ids) -> torch.Tensor:
    with disk_only(path) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, cache)
        cache.commit(out)
    return out


def reads_by_thread(monkeypatch) -> dict[bytes, str]:
    seen: dict[bytes, str] = {}
    real = DiskTier.read_into

    def read_into(self, key, into):
        seen[key] = threading.current_thread().name
        time.sleep(0.01)  # slow enough for a helper to wake before the calling thread read them all
        return real(self, key, into)

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    return seen


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_restore_read_by_several_threads_is_exact(tiny_model, tmp_path, arch, side_by_side, monkeypatch):
    model = tiny_model(arch)
    out = stored(model, tmp_path / "kv", random_ids(10 * B + 1, 3))
    nxt = torch.cat([out, random_ids(2, 4)], dim=1)
    seen = reads_by_thread(monkeypatch)
    with disk_only(tmp_path / "kv") as store:
        cache = store.open(model, nxt)
        assert cache.restored_from["disk"] == cache.restored_tokens == 10 * B + 3
        jobs = [job for job, _ in cache.layers[0]._pending.blocks]
        # A model whose every layer slides reads the blocks its window reaches alone.
        unread = len([job for job in jobs if job is UNREAD])
        assert (unread > 0) == all(cache.is_sliding)
        assert jobs[:unread] == [UNREAD] * unread and all(job is IN_PLACE for job in jobs[unread:])
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
    assert len(seen) == 11 - unread and any(name.startswith("tierkv-disk-read") for name in seen.values())


def test_one_thread_reads_an_opens_records_in_one_transaction(tiny_model, tmp_path, monkeypatch):
    """A transaction and the shared lock a record cost more than a small record's copy."""
    monkeypatch.setattr(store_module, "PARALLEL_READ_BYTES", 1 << 62)
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(6 * B + 1, 13))
    nxt = torch.cat([out, random_ids(2, 14)], dim=1)
    begun: list[str] = []
    real = DiskTier._read_txn

    def read_txn(self):
        begun.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(DiskTier, "_read_txn", read_txn)
    seen = reads_by_thread(monkeypatch)
    with disk_only(tmp_path / "kv") as store:
        begun.clear()
        cache = store.open(model, nxt)
        assert cache.restored_from["disk"] == cache.restored_tokens == 6 * B + 3
        assert len(seen) == 7 and begun == [threading.current_thread().name]
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
        # A remap or a close waits for a transaction: one holds READ_TXN_BYTES of records at most.
        full = store._index.blocks[cache._restored_keys[0]].nbytes
        monkeypatch.setattr(store_module, "READ_TXN_BYTES", 2 * full)
        begun.clear()
        seen.clear()
        cache = store.open(model, nxt)
        assert cache.restored_tokens == 6 * B + 3 and len(seen) == 7 and len(begun) == 4  # 2, 2, 2 and the tail
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_read_transaction_that_cannot_begin_is_a_miss(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "PARALLEL_READ_BYTES", 1 << 62)
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(3 * B + 1, 15))
    nxt = torch.cat([out, random_ids(2, 16)], dim=1)
    real = DiskTier._read_txn
    failing = [True]

    def read_txn(self):
        if failing and failing.pop():
            raise lmdb.ReadersFullError("no reader slot")
        return real(self)

    with disk_only(tmp_path / "kv") as store:
        monkeypatch.setattr(DiskTier, "_read_txn", read_txn)
        assert store.open(model, nxt).restored_tokens == 0
        cache = store.open(model, nxt)  # and the next open reads them
        assert cache.restored_from["disk"] == 3 * B + 3
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_signal_handlers_exception_on_the_way_into_one_read_transaction_leaves_nothing_held(tmp_path):
    """A real signal's handler raising at each point on the way into ``DiskTier.reading()`` where
    CPython runs one (a Python function's start, a C call's return), the exception kept alive (as
    ``sys.last_value`` keeps one): as a generator's context manager, the one landing as its
    ``next()`` returned left the read transaction, the lock's shared side and the thread's
    transaction held (a remap or a close after it waited for good; the thread's later reads went
    through that stale transaction)."""
    from test_tiers import BIG, BLOCK, big_op, block_tensor, empty, key

    tier = DiskTier(tmp_path / "store", budget=1 << 30, block_size=BLOCK)
    try:
        assert tier.apply([big_op(1)]) == [None]

        def nothing_held(sent):
            lock = tier._resize_lock
            assert tier._reading.txn is None and lock._readers == 0 and not lock.locked(), sent

        assert raised_on_the_way_in(tier.reading, nothing_held) > 3
        assert tier.apply([big_op(2)]) == [None]  # and reads see it: no stale transaction
        assert torch.equal(tier.load(key(2), empty)[1], block_tensor(2, shape=BIG))
        with tier.reading():
            assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))
    finally:
        tier.close(timeout=1)


def test_two_opens_in_two_threads_read_the_disk_at_once(tiny_model, tmp_path, monkeypatch):
    """The disk tier's reads share its lock: each open's first read waits inside ``read_into``
    for the other's (with the lock exclusive, as before, the second never got in)."""
    monkeypatch.setattr(store_module, "PARALLEL_READ_BYTES", 1 << 62)  # each open reads in its own thread
    model = tiny_model("llama")
    convs = [stored(model, tmp_path / "kv", random_ids(3 * B + 1, seed)) for seed in (5, 6)]
    both = threading.Barrier(2, timeout=5)
    real = DiskTier.read_into
    first: set[str] = set()

    def read_into(self, key, into):
        def destination(header):
            name = threading.current_thread().name
            if name not in first:
                first.add(name)
                both.wait()
            return into(header)
        return real(self, key, destination)

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    results = {}
    with disk_only(tmp_path / "kv") as store:
        def turn(n):
            results[n] = store.open(model, convs[n]).restored_tokens

        threads = [threading.Thread(target=turn, args=(n,), name=f"turn-{n}") for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert not both.broken and results == {0: 4 * B - 1, 1: 4 * B - 1}


def damage(store: TieredStore, key: bytes) -> None:
    """One payload byte of a record flipped where it lies."""
    damage_in_place(store._disk.env, store._disk._blocks, key, lambda record: flipped(record, len(record) - 9))



@pytest.mark.parametrize("starred", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_signal_handlers_timeout_error_in_a_disk_read_is_raised_not_taken_for_a_failing_disk(
        tiny_model, tmp_path, monkeypatch, parallel, starred):
    """``TimeoutError`` is an ``OSError``: a SIGALRM handler's landing in a disk read of an open
    was taken for the disk failing (the open cut short and returned, the timeout gone, and no
    block written to disk again for the store's life). ``starred``: a handler ``def h(*_)``."""
    import signal

    reads_in(monkeypatch, parallel)
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(4 * B + 1, 13))
    nxt = torch.cat([out, random_ids(2, 14)], dim=1)
    real, main, fired = DiskTier.read_into, threading.get_ident(), []

    def read_into(self, key, into):
        if threading.get_ident() == main and not fired:
            fired.append(key)
            signal.pthread_kill(main, signal.SIGUSR1)  # the handler raises before this returns
        return real(self, key, into)

    def on_alarm(signum, frame):
        raise TimeoutError("the program's own timeout")

    def on_alarm_starred(*_):
        raise TimeoutError("the program's own timeout")

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    previous = signal.signal(signal.SIGUSR1, on_alarm_starred if starred else on_alarm)
    try:
        with disk_only(tmp_path / "kv") as store:
            with pytest.raises(TimeoutError, match="own timeout"):
                store.open(model, nxt)
            assert fired and store.stats()["disk_errors"] == 0
            assert store.open(model, nxt).restored_tokens == 5 * B - 1
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("miss", ["corrupt", "gone"])
def test_a_miss_in_the_middle_cuts_the_restore_there_whoever_read_past_it(tiny_model, tmp_path, monkeypatch,
                                                                        parallel, miss):
    reads_in(monkeypatch, parallel)
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(10 * B + 1, 7))
    nxt = torch.cat([out, random_ids(2, 8)], dim=1)
    with disk_only(tmp_path / "kv") as store:
        keys = store.open(model, nxt)._restored_keys
        assert len(keys) == 11
        if miss == "corrupt":
            damage(store, keys[5])
        else:
            # Evicted while this open reads: off disk in the index first, as an eviction does (a
            # plain miss, not damage).
            real = DiskTier.read_into

            def gone(self, key, into):
                if key == keys[5]:
                    store._index.blocks.pop(key)
                    raise KeyError(key)
                return real(self, key, into)

            monkeypatch.setattr(DiskTier, "read_into", gone)
        seen = reads_by_thread(monkeypatch)
        cache = store.open(model, nxt)
        assert cache.restored_tokens == 5 * B and cache._restored_keys == keys[:5]
        assert store.stats()["corrupt"] == (1 if miss == "corrupt" else 0)
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
        if parallel:
            assert any(name.startswith("tierkv-disk-read") for name in seen.values())
        else:
            assert set(seen.values()) == {threading.current_thread().name} and len(seen) == 6


def test_a_damaged_first_record_makes_no_buffer_and_the_helpers_read_nothing_into_one(
        tiny_model, tmp_path, monkeypatch, side_by_side):
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(8 * B + 1, 9))
    nxt = torch.cat([out, random_ids(2, 10)], dim=1)
    with disk_only(tmp_path / "kv") as store:
        keys = store.open(model, nxt)._restored_keys
        damage(store, keys[0])
        cache = store.open(model, nxt)
        assert cache.restored_tokens == 0 and store.stats()["corrupt"] == 1
        assert cache.layers[0]._pending is None
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_store_closed_during_reads_side_by_side_says_so(tiny_model, tmp_path, monkeypatch, side_by_side):
    model = tiny_model("llama")
    out = stored(model, tmp_path / "kv", random_ids(6 * B + 1, 11))
    nxt = torch.cat([out, random_ids(2, 12)], dim=1)
    store = disk_only(tmp_path / "kv")
    real = DiskTier.read_into
    closing = threading.Event()

    calling_reads = []

    def read_into(self, key, into):
        if not threading.current_thread().name.startswith("tierkv-disk-read"):
            calling_reads.append(key)
            if len(calling_reads) > 1:
                assert closing.wait(5)  # after its first (the buffer's), once a helper took a record
        elif not closing.is_set():
            closing.set()
            threading.Thread(target=store.close).start()
            while not self._closed and not self._resize_lock._waiting:
                time.sleep(0.001)
        return real(self, key, into)

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    try:
        with pytest.raises(ValueError, match="closed during open"):
            store.open(model, nxt)
    finally:
        store.close()


def test_reads_in_more_threads_than_lmdb_has_reader_slots_wait_for_one(tiny_model, tmp_path, monkeypatch,
                                                                        side_by_side):
    """Each read transaction takes one of LMDB's reader slots (126, or 32 where the filesystem
    had no room for the lock file's table) for as long as it lasts. Reads of one thread at a
    time never ran short of them; side by side, in opens of many threads with their helpers,
    a read past them failed with ``ReadersFullError``, taken for a failing disk: the restore
    cut short and no block written to disk again for the store's life. (A lock file of 16 KiB
    holds 254.)"""
    import tierkv.tiers.disk as disk_module

    model = tiny_model("llama")
    convs = [stored(model, tmp_path / "kv", random_ids(4 * B + 1, seed)) for seed in (21, 22, 23, 24)]
    # A reader table of 4 slots: LMDB sizes it from the lock file, made anew (a store copied
    # without it opens), one LMDB sizes itself.
    (tmp_path / "kv" / "lock.mdb").unlink()
    monkeypatch.setattr(disk_module, "_LOCK_BYTES", 1)
    monkeypatch.setattr(disk_module, "_MAX_READERS", 4)
    real = disk_module.decode_into
    inside, most, counting = [0], [0], threading.Lock()

    def slow_decode(buf, into):  # a cold disk: every read transaction lasts a while
        with counting:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.02)
            return real(buf, into)
        finally:
            with counting:
                inside[0] -= 1

    monkeypatch.setattr(disk_module, "decode_into", slow_decode)
    with disk_only(tmp_path / "kv") as store:
        assert store._disk.env.max_readers() == 4
        results = {}

        def turn(n):
            results[n] = store.open(model, convs[n]).restored_tokens

        threads = [threading.Thread(target=turn, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert store.stats()["disk_errors"] == 0
        assert results == {n: 5 * B - 1 for n in range(4)} and 1 < most[0] <= 4
