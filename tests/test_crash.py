"""Crash safety: SIGKILL a process while it spills, at random moments, then reopen.

Every conversation committed before the child's last completed flush must restore whole and
exact; anything later may be missing but is never served half-written; LMDB opens cleanly.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from _crash_child import CHURN_DISK_BUDGET, conversation, forgotten
from conftest import make_model, random_ids
import tierkv.store
from tierkv import TieredStore, cli
from tierkv.codec import MAGIC
from tierkv.tiers.disk import _INTENT_AT, DiskTier, StoreInUse, Touch
from tierkv.store import _session_id

CHILD = Path(__file__).with_name("_crash_child.py")


def run_until_killed(path: Path, seed: int, flushes: int, extra_s: float, churn: bool = False,
                     linger: bool = True) -> int:
    """Start the child, let it complete ``flushes`` flushes, kill it ``extra_s`` later; returns the
    last conversation index it reported durable. Without ``linger`` the child's writer takes each
    turn's writes at once, so that a kill lands in its transactions between flushes too."""
    flags = (["churn"] if churn else []) + ([] if linger else ["nolinger"])
    child = subprocess.Popen([sys.executable, str(CHILD), str(path), str(seed), *flags],
                             stdout=subprocess.PIPE, text=True)
    last = -1
    try:
        seen = 0
        for line in child.stdout:  # type: ignore[union-attr]
            if line.startswith("FLUSHED"):
                last = int(line.split()[1])
                seen += 1
                if seen == flushes:
                    break
        # Not synchronisation: a random moment inside the commits and writes that follow.
        time.sleep(extra_s)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    return last


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_while_spilling_loses_nothing_flushed_and_serves_nothing_half_written(tmp_path, trial):
    rng = random.Random(trial)
    path = tmp_path / "kv"
    seed = 100 + trial
    last = run_until_killed(path, seed, flushes=rng.randint(1, 3), extra_s=rng.uniform(0.0, 0.3), linger=trial % 2 == 0)
    model = make_model("llama")
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        assert store.stats()["corrupt"] == 0
        for i in range(last + 8):  # the durable ones, and some that may or may not have landed
            ids = conversation(seed, i)
            out = model.generate(ids, max_new_tokens=2, do_sample=False)
            nxt = torch.cat([out, torch.tensor([[5, 6]])], dim=1)
            cache = store.open(model, nxt, session=f"s{i}")
            if i <= last:
                assert cache.restored_from["disk"] == out.shape[1] - 1, (i, last)
            assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False),
                               model.generate(nxt, max_new_tokens=2, do_sample=False))
        assert store.stats()["corrupt"] == 0


def test_a_crash_while_a_longer_chain_replaces_a_flushed_tail_keeps_one_of_them(tmp_path):
    """A turn's partial tail, flushed, is deleted when the next turn's chain covers its tokens.
    The delete zeroes the tail in the file before its transaction commits: in the transaction of
    the chain's own writes, a kill there lost both, and the flushed tokens were recomputed."""
    path = tmp_path / "kv"
    child = subprocess.run([sys.executable, str(CHILD), str(path), "tail"], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 9, child.stderr  # killed inside the tail's delete
    flushed = int(child.stdout.split()[1])
    model = make_model("llama")
    ids = random_ids(9, 7)
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    nxt = model.generate(torch.cat([out, torch.tensor([[5, 6]])], dim=1), max_new_tokens=4, do_sample=False)
    nxt = torch.cat([nxt, torch.tensor([[7]])], dim=1)
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        # The chain landed, and the tail it replaced, left by the kill, is let go at the reopen: it
        # took room under the budget, where the reopen evicted other blocks instead.
        assert store.stats()["disk"]["blocks"] == 4
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens >= flushed == 10
        assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=3, do_sample=False),
                           model.generate(nxt, max_new_tokens=3, do_sample=False))
        assert store.stats()["corrupt"] == 0


def test_a_forget_in_the_batch_of_a_turn_that_replaced_a_tail_finds_that_tail_after_a_crash(tmp_path):
    """The replaced tail's delete waits for a later transaction; a forget of its session queued
    behind it must wait too. Applied first, it dropped every reference of the session, the tail's
    among them, and a crash before the tail's delete left the tail on disk where no forget found
    it again, served through the prefix another session shares."""
    path = tmp_path / "kv"
    child = subprocess.run([sys.executable, str(CHILD), str(path), "tail_then_forget"], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 9, child.stderr
    model = make_model("llama")
    ids = random_ids(9, 7)
    first = torch.cat([model.generate(ids, max_new_tokens=2, do_sample=False), torch.tensor([[7]])], dim=1)
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        assert all(meta.sessions for meta in store._index.blocks.values())
        assert store.open(model, first, session="A").restored_tokens == 10  # the forget never landed
        store.forget(session="A")
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        cache = store.open(model, first, session="A")
        assert cache.restored_tokens == 8  # B's two blocks
        assert torch.equal(model.generate(first, past_key_values=cache, max_new_tokens=3, do_sample=False),
                           model.generate(first, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("where, check", [("copied", False), ("record", False), ("head", False), ("record", True)])
def test_a_kill_inside_a_write_transaction_leaves_none_of_its_records_in_the_file(tmp_path, where, check):
    """With writemap LMDB puts a record in its final pages, free ones, before the commit: a kill
    before it left the record (KV, and the token ids of its head) in the file, where no forget
    found it. The next open's first write zeroes what the lock file's intent names, and no live
    record. ``copied``: killed just after LMDB's copy of the first value into the map, which came
    before its place could be named; values are now put as zeros first, and written once named.
    ``check``: `tierkv check --repair` run in between (it finds nothing to repair) keeps the
    lock file's intent for the open."""
    path = tmp_path / "kv"
    child = subprocess.run([sys.executable, str(CHILD), str(path), "uncommitted", where], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 9, child.stderr
    magics = lambda: (path / "data.mdb").read_bytes().count(MAGIC)  # noqa: E731
    assert magics() == (1 if where == "record" else 0)  # the killed transaction's first record, named
    if check:
        assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_OK
        assert magics() == 1
    model = make_model("llama")
    ids = random_ids(17, 7)
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        assert store._disk.record_count() == 0  # the old sessions forgotten, alice's write never committed
        store.flush()  # the open's first write zeroes them
        assert magics() == 0
        cache = store.open(model, ids, session="alice")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
        store.flush()
        assert magics() == 2 * store._disk.record_count() > 0  # a record and its head each
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
        nxt = torch.cat([out, torch.tensor([[5]])], dim=1)
        cache = store.open(model, nxt, session="alice")
        assert cache.restored_tokens == out.shape[1] - 1  # the reopen after a clean close zeroed nothing live
        assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False),
                           model.generate(nxt, max_new_tokens=2, do_sample=False))


def test_a_kill_inside_a_transaction_writing_heads_leaves_none_of_them_in_the_file(tmp_path):
    """Heads written for blocks that lacked one (``PutHeads``) hold the blocks' token ids: a
    kill before their commit left them in free pages, named nowhere, where a later forget of
    those blocks did not reach them. The next write zeroes them with the records' (the open's
    own scan would write the heads again, over the same pages: the tier is opened bare)."""
    path = tmp_path / "kv"
    child = subprocess.run([sys.executable, str(CHILD), str(path), "unindexed_heads"], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 9, child.stderr
    magics = lambda: (path / "data.mdb").read_bytes().count(MAGIC)  # noqa: E731
    tier = DiskTier(path, 1 << 30, 4)
    try:
        scan = tier.scan()
        blocks = len(scan.headers)
        assert blocks > 0 and len(scan.unindexed) == blocks  # the heads never committed
        assert magics() == 2 * blocks  # the records, and the killed transaction's heads
        lock, env, seen = path / "tierkv.lock", tier.env, []

        class Watched:  # the lock file as the write that zeroes them begins
            def __getattr__(self, name: str) -> object:
                return getattr(env, name)

            def begin(self, **kw: object) -> object:
                seen.append(lock.read_bytes())
                return env.begin(**kw)

        noted = lock.read_bytes()[_INTENT_AT:]
        tier.env = Watched()  # type: ignore[assignment]
        try:
            tier.apply([])
        finally:
            tier.env = env
        assert magics() == blocks
        # The note is dropped with that write's commit, which syncs the zeros: dropped before,
        # a power loss could keep the drop and lose the zeros.
        assert seen[0][_INTENT_AT:] == noted and len(lock.read_bytes()) < _INTENT_AT
    finally:
        tier.close()
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        store.flush()
        assert magics() == 2 * blocks == 2 * store._disk.record_count()


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_during_evictions_and_forgets_brings_nothing_forgotten_back(tmp_path, trial):
    rng = random.Random(50 + trial)
    path = tmp_path / "kv"
    seed = 200 + trial
    # Killed soon after a flush, so the conversations the budget keeps reach back before it.
    last = run_until_killed(path, seed, flushes=rng.randint(2, 4), extra_s=rng.uniform(0.0, 0.05), churn=True,
                            linger=trial % 2 == 0)
    model = make_model("llama")

    def restore(store: TieredStore, i: int) -> int:
        ids = conversation(seed, i)
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
        nxt = torch.cat([out, torch.tensor([[5, 6]])], dim=1)
        cache = store.open(model, nxt)
        assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False),
                           model.generate(nxt, max_new_tokens=2, do_sample=False))
        return cache.restored_tokens

    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0,
                     disk_budget=CHURN_DISK_BUDGET) as store:
        assert store.stats()["corrupt"] == 0
        assert store.stats()["disk"]["bytes"] <= CHURN_DISK_BUDGET
        # Rows keep no names: a session is known by its key.
        numbers = {_session_id(None, f"s{i}"): i for i in range(10_000)}
        kept = sorted(numbers[sid] for sid in store._index.sessions)
        assert kept
        for i in kept:  # every session the store kept restores, exactly
            assert restore(store, i) > 0, i
        # Forgotten within what the budget would otherwise have kept: gone for good, not brought
        # back by the crash. Past the last flush too, up to the last conversation that landed: the
        # one writer applies a forget's deletes before any later conversation's writes. (Up to the
        # last flush only, a kill that came late left no forgotten conversation in the window.)
        window = [i for i in range(kept[0], kept[-1]) if forgotten(i)]
        assert window, (kept, last)
        for i in window:
            # At most the tokens it starts with in common with a kept conversation (a first
            # token drawn alike, one in 512): those blocks are the kept one's.
            ids = conversation(seed, i)[0]
            shared = max(shared_prefix(ids, conversation(seed, j)[0]) for j in kept)
            assert restore(store, i) <= shared, (i, shared, kept, last)
        assert store.stats()["corrupt"] == 0


def test_a_store_directory_serves_one_process_at_a_time(tmp_path):
    path = tmp_path / "kv"
    first = TieredStore(path, device="cpu", block_size=4)
    with pytest.raises(ValueError, match="in use by another TieredStore") as info:
        TieredStore(path, device="cpu", block_size=4)
    assert f"pid {os.getpid()}, this process" in str(info.value) and "call close() on it" in str(info.value)
    # Also while the holder's writer is busy past the wait for its batch in flight: refused as in
    # use, not with that wait's TimeoutError.
    gate = threading.Event()
    apply = first._disk.apply
    first._disk.apply = lambda ops: (gate.wait(30), apply(ops))[1]
    first._writer.submit(Touch({}))
    first._writer.nudge()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tierkv.store, "BUSY_WRITER_WAIT_S", 0.5)
        with pytest.raises(StoreInUse, match="in use by another TieredStore"):
            TieredStore(path, device="cpu", block_size=4)
    gate.set()
    first.close()
    TieredStore(path, device="cpu", block_size=4).close()  # free again once closed

    child = subprocess.Popen([sys.executable, str(CHILD), str(path), "7"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "READY"  # type: ignore[union-attr]
        with pytest.raises(ValueError, match=f"pid {child.pid}"):
            TieredStore(path, device="cpu", block_size=4)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    # The kernel drops a killed process's lock: the directory opens, and what it flushed is there.
    with TieredStore(path, device="cpu", block_size=4) as store:
        assert store.stats()["corrupt"] == 0


@pytest.mark.parametrize("how", ["dropped", "in a reference cycle", "last held by its writer thread"])
def test_a_store_dropped_without_close_is_closed_its_writes_landing_and_its_directory_free(
        tmp_path, caplog, monkeypatch, how):
    """An exception between a store's construction and its close, in code without ``with``: the
    store was kept alive by its own writer thread, its directory locked until the process exited,
    and the advice "call close() on it" could not be followed (nothing referred to it)."""
    import gc
    import threading

    path = tmp_path / "kv"
    model = make_model("llama")
    ids = random_ids(41, seed=3)
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0)
    finalised_on: list[str] = []
    finalise = TieredStore.__del__
    monkeypatch.setattr(TieredStore, "__del__",
                        lambda self: (finalised_on.append(threading.current_thread().name), finalise(self)))
    in_apply, release = threading.Event(), threading.Event()
    if how == "last held by its writer thread":
        applying = store._disk.apply

        def held_apply(ops):
            in_apply.set()
            assert release.wait(30)
            return applying(ops)

        store._disk.apply = held_apply
    cache = store.open(model, ids, session="a")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    cache.commit(out)
    del cache
    enabled = gc.isenabled()
    try:
        if how == "in a reference cycle":
            gc.disable()  # only the next store's constructor collects it
            box: dict = {"store": store}
            box["box"] = box
            del box
        elif how == "last held by its writer thread":
            store._writer.nudge()
            assert in_apply.wait(30)
        import weakref

        gone = weakref.ref(store)
        del store
        assert finalised_on == ([] if how != "dropped" else ["MainThread"])
        release.set()
        with caplog.at_level("WARNING", logger="tierkv"):
            with TieredStore(path, device="cpu", block_size=4) as again:
                cache = again.open(model, out, session="a")
                kept = out.shape[1] - 1  # all the first turn's KV: nothing queued was lost
                assert cache.restored_from["disk"] == kept and cache.restored_tokens == kept
                assert again.stats()["corrupt"] == 0
        if how != "in a reference cycle":
            # Once closed, freed with no collection of cycles (gc is off here): its index and
            # buffers (on CUDA the pinned pool) were kept until one, hours away in a server.
            gc.disable()
            tierkv.store._wait_for_dropped(30)
            assert gone() is None
    finally:
        if enabled:
            gc.enable()
    assert finalised_on[:1] == [{"dropped": "MainThread", "in a reference cycle": "MainThread",
                                 "last held by its writer thread": "tierkv-disk-writer"}[how]]
    dropped = [r for r in caplog.records if "dropped without close()" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelname == "WARNING"


def test_a_dropped_stores_close_thread_takes_its_device_first(tmp_path, monkeypatch):
    """The close of a store dropped without close() runs on a thread of its own, whose flush
    waits for the memory tiers' copies: on CUDA their events, from a thread on GPU 0, where the
    wait made GPU 0's context in a process whose store is on another GPU. The thread takes the
    store's device first, as the store's writer and read helpers do."""
    import gc

    bound: list[tuple[str, object]] = []
    monkeypatch.setattr(tierkv.store, "thread_binding",
                        lambda device: lambda: bound.append((threading.current_thread().name, device)))
    model = make_model("llama")
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=4)
    device = store.device
    ids = random_ids(9, 70)
    cache = store.open(model, ids)
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    bound.clear()  # the writer's and the read helpers' own
    del store, cache
    gc.collect()
    tierkv.store._wait_for_dropped(30)
    assert ("tierkv-close-dropped", device) in bound


def test_a_dropped_stores_close_run_on_the_dropping_thread_leaves_its_device(tmp_path, monkeypatch):
    """Where no thread can be started for the close (the process at its thread limit), it runs on
    the thread that dropped the store: the program's own, whose current CUDA device (the one its
    ``device="cuda"`` tensors go to) the close took for the store's for good, as ``close()`` on
    that thread never does. Only the close's own thread takes the store's device."""
    import gc

    bound: list[str] = []
    monkeypatch.setattr(tierkv.store, "thread_binding",
                        lambda device: lambda: bound.append(threading.current_thread().name))
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "tierkv-close-dropped":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    store = TieredStore(tmp_path / "kv", device="cpu", block_size=4)
    ref = weakref.ref(store)
    bound.clear()  # the writer's and the read helpers' own
    monkeypatch.setattr(threading.Thread, "start", start)
    del store
    gc.collect()
    assert ref() is None  # closed, here
    assert threading.current_thread().name not in bound


def test_a_store_collected_with_garbage_that_lets_its_writer_run_still_writes(tmp_path):
    """A store dropped in a reference cycle whose garbage holds a finaliser that sleeps (or does
    I/O): gc cleared the store's weak references first, its writer ran before the store's own
    finaliser held it, found no store and failed its batch as a disk fault: the writes were lost."""
    import gc
    import time

    class SlowFinaliser:
        def __del__(self) -> None:
            time.sleep(0.5)  # past the writer's linger

    path = tmp_path / "kv"
    model = make_model("llama")
    ids = random_ids(41, seed=3)
    enabled = gc.isenabled()
    gc.disable()
    try:
        slow = SlowFinaliser()  # made before the store: finalised first in the same collection
        store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0)
        cache = store.open(model, ids, session="a")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
        del cache
        box: dict = {"store": store, "slow": slow}
        box["box"] = box
        del box, store, slow
        gc.collect()
        tierkv.store._wait_for_dropped(30)
    finally:
        if enabled:
            gc.enable()
    with TieredStore(path, device="cpu", block_size=4) as again:
        assert again.open(model, out, session="a").restored_from["disk"] == out.shape[1] - 1
        assert again.stats()["disk_errors"] == 0


def test_a_refusal_waits_for_no_dropped_store_of_another_directory(tmp_path):
    """A dropped store's close that a slow disk holds up, on one directory: refusing a store on
    another one (in use in this process) waited for it, up to a minute."""
    import gc

    gate = threading.Event()
    dropped = TieredStore(tmp_path / "a", device="cpu", block_size=4)
    apply = dropped._disk.apply
    dropped._disk.apply = lambda ops: (gate.wait(30), apply(ops))[1]
    dropped._writer.submit(Touch({}))
    del dropped
    gc.collect()
    (closing, where), = tierkv.store._dropped.items()
    assert where.endswith(os.sep + "a")
    joined = []
    closing.join = lambda timeout=None: joined.append(timeout)  # type: ignore[method-assign]
    try:
        with TieredStore(tmp_path / "b", device="cpu", block_size=4):
            with pytest.raises(StoreInUse, match="in use by another TieredStore"):
                TieredStore(tmp_path / "b", device="cpu", block_size=4)
        assert joined == []
    finally:
        gate.set()
        del closing.join
        tierkv.store._wait_for_dropped(30)
    TieredStore(tmp_path / "a", device="cpu", block_size=4).close()



def test_a_timeout_as_a_refused_open_waits_for_its_directorys_writer_is_raised(tmp_path):
    """A signal handler's ``TimeoutError`` at any point of ``_open_disk_tier``'s second try (the
    directory locked by a store of this process: its writer flushed, dropped stores waited for)
    reaches the caller. Before, the ``except TimeoutError`` around the writer's flush took it for
    a slow disk: the open went on to its refusal, ``StoreInUse``, and the timeout was lost."""
    import gc

    from conftest import raised_on_the_way_in

    with TieredStore(tmp_path / "a", device="cpu", block_size=4):
        def refused() -> contextlib.nullcontext:
            # Earlier tests' garbage collected here, not by the open's own gc.collect(): a weakref
            # callback that runs there is a point whose exception CPython reports and drops.
            gc.collect()
            with pytest.raises(StoreInUse, match="in use by another TieredStore"):
                TieredStore(tmp_path / "a", device="cpu", block_size=4)
            return contextlib.nullcontext()

        # Likewise the gc callbacks that collection runs (hypothesis registers one once its tests
        # ran in this process): points whose exceptions CPython drops, whoever collects.
        callbacks = gc.callbacks[:]
        gc.callbacks.clear()
        try:
            assert raised_on_the_way_in(refused, lambda sent: None, within={"_open_disk_tier"}, timeout=True) > 5
        finally:
            gc.callbacks.extend(callbacks)
    TieredStore(tmp_path / "a", device="cpu", block_size=4).close()


def closing_in_a_walk(walker: str, depth: int, other: TieredStore, closed: list[int]):
    """A profile function that closes ``other`` (once, noting it in ``closed``) as a generator
    returns within ``depth`` frames below ``walker`` (not below a constructor first): the first
    step of a walk of a ``WeakSet``, where a thread switch would let another thread's close in."""
    import inspect

    def in_the_walk(frame) -> bool:
        for _ in range(depth):
            frame = frame.f_back
            if frame is None or frame.f_code.co_name == "__init__":
                return False
            if frame.f_code.co_name == walker:
                return True
        return False

    def close_other(frame, event, _arg) -> None:
        if event == "return" and frame.f_code.co_flags & inspect.CO_GENERATOR and not closed and \
                in_the_walk(frame):
            closed.append(other.close())

    return close_other


def test_a_store_closed_in_another_thread_while_an_open_looks_for_its_directorys_writer_is_no_error(tmp_path):
    """A store refused by one of this process's walks the open stores for a writer on its
    directory. A close in another thread takes its store out of that set (``_release``): at a
    thread switch inside the walk, the open raised ``RuntimeError`` ("Set changed size during
    iteration") instead of ``StoreInUse``. The close runs at the walk's first step (a generator's
    first yield, below ``_open_disk_tier`` and not in the open it retries), from a profile
    function, as a switch there would run it."""
    held = TieredStore(tmp_path / "a", device="cpu", block_size=4)
    other = TieredStore(tmp_path / "b", device="cpu", block_size=4)
    closed: list[int] = []
    sys.setprofile(closing_in_a_walk("_open_disk_tier", 4, other, closed))
    try:
        with pytest.raises(StoreInUse, match="in use by another TieredStore"):
            TieredStore(tmp_path / "a", device="cpu", block_size=4)
    finally:
        sys.setprofile(None)
        held.close()
        other.close()
    assert closed == [0]  # the walk stepped while the other store was open, and closed it
    TieredStore(tmp_path / "b", device="cpu", block_size=4).close()

def test_a_tier_closed_in_another_thread_while_stored_meta_looks_for_it_is_no_error(tmp_path):
    """``stored_meta`` walks this process's open disk tiers for one holding its data file. A close
    in another thread takes its tier out of that set: at a thread switch inside the walk, it
    raised ``RuntimeError`` ("Set changed size during iteration") instead of answering. The
    close runs at the walk's first step, from a profile function, as the test above does."""
    from tierkv.tiers.disk import DiskTier

    TieredStore(tmp_path / "a", device="cpu", block_size=4).close()
    others = [TieredStore(tmp_path / name, device="cpu", block_size=4) for name in ("b", "c")]
    closed: list[int] = []
    sys.setprofile(closing_in_a_walk("_open_here", 3, others[0], closed))
    try:
        assert DiskTier.stored_meta(tmp_path / "a")["block_size"] == 4
    finally:
        sys.setprofile(None)
        for other in others:
            other.close()
    assert closed == [0]  # the walk stepped while the other tier was open, and closed it


FINALISED_AT_EXIT = """
import sys, tempfile
from tierkv import TieredStore

store = TieredStore(sys.argv[1], device="cpu", block_size=8)
real_close = store._disk.close

def failing_close(timeout=None):
    real_close(timeout)
    raise OSError(5, "Input/output error")  # its close at exit raises: still unreleased after it

store._disk.close = failing_close
print("exiting", flush=True)
"""


def test_a_store_still_open_when_the_interpreter_finalises_does_not_hang_the_exit(tmp_path):
    """Python 3.11 starts no thread while it finalises, and Thread.start() then waits forever: a
    store its exit could not close, finalised with the modules, hung the process."""
    child = subprocess.run([sys.executable, "-c", FINALISED_AT_EXIT, str(tmp_path / "kv")], capture_output=True,
                           text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert child.returncode == 0 and "exiting" in child.stdout, child.stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_forked_child_is_refused_the_parents_store(tmp_path):
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=4)
    model = make_model("llama")
    ids = conversation(1, 0)
    pid = os.fork()
    if pid == 0:  # the child: every entry point must refuse, nothing may hang or write
        code = 1
        try:
            store.open(model, ids)
        except ValueError as exc:
            code = 0 if "forked" in str(exc) else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    cache = store.open(model, ids)  # the parent goes on as before
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_forked_childs_stats_is_refused_even_while_a_parent_thread_held_the_lock(tmp_path):
    """stats() answered in a forked child: the parent's numbers as of the fork, after a reap that
    queues work for a writer the child does not have; and it hung where another thread of the
    parent held the store's lock at the fork (a metrics scrape in a worker process)."""
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=4)
    model = make_model("llama")
    ids = conversation(1, 0)
    cache = store.open(model, ids)
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)  # a child stuck on the lock is killed, and its exit status says so
                store.stats()
            except ValueError as exc:
                code = 0 if "forked" in str(exc) else 2
            except BaseException:  # noqa: BLE001 - any other failure is the child's exit code
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0  # -SIGALRM: it hung on the lock; 1: it answered
    assert store.stats()["disk"]["blocks"] > 0  # the parent's own view is untouched
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_forked_childs_close_leaves_the_parents_lock_and_store_alone(tmp_path):
    path = tmp_path / "kv"
    store = TieredStore(path, device="cpu", block_size=4)
    model = make_model("llama")
    ids = conversation(2, 0)
    pid = os.fork()
    if pid == 0:  # as a `with TieredStore(...)` block left in a worker would
        try:
            store.close()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(StoreInUse):
        TieredStore(path, device="cpu", block_size=4)  # the parent still holds the directory
    cache = store.open(model, ids)
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    store.close()


_OWNER_WITH_A_WORKER = """
import os, sys, time
from tierkv import TieredStore
store = TieredStore({path!r}, device="cpu", block_size=4)
worker = os.fork()
if worker == 0:  # a worker process (multiprocessing, DataLoader) that never touches the store
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # lets go of the pipes the test reads to their end
    os.dup2(quiet, 2)
    time.sleep(60)
    os._exit(0)
print(worker, flush=True)
os._exit(0)  # the owner dies without closing (a crash, an OOM kill)
"""


def test_a_worker_forked_by_a_dead_owner_does_not_keep_the_store_locked(tmp_path):
    path = tmp_path / "kv"
    owner = subprocess.run([sys.executable, "-c", _OWNER_WITH_A_WORKER.format(path=str(path))],
                           capture_output=True, text=True, timeout=120)
    assert owner.returncode == 0, owner.stderr[-2000:]
    worker = int(owner.stdout.split()[0])
    try:
        TieredStore(path, device="cpu", block_size=4).close()  # the restarted owner opens it
    finally:
        os.kill(worker, signal.SIGKILL)


def run_exiting_child(template: str, path: Path, ids: list[int], **fields: str) -> subprocess.CompletedProcess:
    """Run ``template`` (a script exiting with a store in some state) in a fresh interpreter."""
    script = template.format(tests=str(Path(__file__).parent), path=str(path), ids=ids, **fields)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


_EXIT_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch
import tierkv.store
import tierkv.tiers.disk
from conftest import make_model
from tierkv import TieredStore

tierkv.store.WRITE_LINGER_S = 30.0  # the writer would hold this turn's writes past the exit
store = TieredStore({path!r}, device="cpu", block_size=8)
model = make_model("llama")
ids = torch.tensor([{ids!r}])
cache = store.open(model, ids, session="s")
out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
print("COMMITTED", cache.commit(out), flush=True)
{ending}
"""


@pytest.mark.parametrize("ending", ["", "raise RuntimeError('the server crashed')"])
def test_a_store_left_open_at_exit_is_closed_and_its_writes_drained(tmp_path, ending):
    path = tmp_path / "kv"
    ids = random_ids(40, 7)[0].tolist()
    child = run_exiting_child(_EXIT_CHILD, path, ids, ending=ending)
    assert "COMMITTED 42" in child.stdout, child.stderr
    with TieredStore(path, device="cpu", block_size=8, device_budget=0, host_budget=0) as store:
        model = make_model("llama")
        nxt = torch.tensor([ids + [5, 6, 7, 8, 9]])
        cache = store.open(model, nxt, session="s")
        assert cache.restored_from["disk"] >= 40, "the writes queued at exit were lost"


_HUNG_DISK_CHILD = """
import sys, threading
sys.path.insert(0, {tests!r})
import torch
import tierkv.store
import tierkv.tiers.disk
from conftest import make_model
from tierkv import TieredStore

tierkv.store.EXIT_CLOSE_TIMEOUT_S = 1.0
store = TieredStore({path!r}, device="cpu", block_size=8)
store._disk.apply = lambda ops: threading.Event().wait()  # a disk that never answers
model = make_model("llama")
ids = torch.tensor([{ids!r}])
cache = store.open(model, ids, session="s")
cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False))
store._writer.nudge()
print("EXITING", flush=True)
"""


def test_a_hung_disk_does_not_hang_the_exit(tmp_path):
    # The close at exit gives up after its timeout and the grace for the transaction in flight.
    child = run_exiting_child(_HUNG_DISK_CHILD, tmp_path / "kv", random_ids(40, 8)[0].tolist())
    assert child.returncode == 0 and "EXITING" in child.stdout, child.stderr[-2000:]
    assert "still running" in child.stderr  # said why the map was left to the exit


_STUCK_READ_CHILD = """
import sys, threading
sys.path.insert(0, {tests!r})
import torch
import tierkv.store
import tierkv.tiers.disk
from conftest import make_model
from tierkv import TieredStore

tierkv.store.EXIT_CLOSE_TIMEOUT_S = 1.0
{side_by_side}
model = make_model("llama")
ids = torch.tensor([{ids!r}])
with TieredStore({path!r}, device="cpu", block_size=8) as store:
    cache = store.open(model, ids)
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False))
store = TieredStore({path!r}, device="cpu", block_size=8, device_budget=0, host_budget=0)
reading = threading.Event()

def stuck_decode(buf, into):  # inside the read transaction: a page fault on a disk that hangs
    reading.set()
    threading.Event().wait()

tierkv.tiers.disk.decode_into = stuck_decode
threading.Thread(target=store.open, args=(model, ids), daemon=True).start()
assert reading.wait(60)
print("EXITING", flush=True)
"""


@pytest.mark.parametrize("side_by_side", [False, True])
def test_a_read_stuck_on_a_hung_disk_does_not_hang_the_exit(tmp_path, side_by_side):
    """Side by side too: the open's helper threads, one stuck in a read and the others waiting
    for the first read's buffer, are not joined at the exit (a ThreadPoolExecutor's were)."""
    setup = "tierkv.store.PARALLEL_READ_BYTES = 0; tierkv.store.helper_threads = lambda: 2" if side_by_side else ""
    child = run_exiting_child(_STUCK_READ_CHILD, tmp_path / "kv", random_ids(40, 9)[0].tolist(),
                              side_by_side=setup)
    assert child.returncode == 0 and "EXITING" in child.stdout, child.stderr[-2000:]
    assert "did not end within" in child.stderr
