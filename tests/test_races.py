"""Races between generation and moves in flight, on CPU with the same job machinery.

The disk writer is held at a gate (its apply function blocks on an Event) and copies are made
asynchronous by a delayed copy engine, so each interleaving below is forced, not hoped for. No
sleep is used as synchronisation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import lmdb
import pytest
import torch

from conftest import damage_in_place, flipped, random_ids
import tierkv.store
from tierkv import TieredStore
from tierkv.index import DiskState
from tierkv.transfer import CopyEngine, Job

B = 8
WAIT = 30.0


def generate(model, ids, cache=None, new=3):
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False)


def lmdb_rows(store: TieredStore, db: bytes) -> int:
    env = store._disk.env
    with env.begin() as txn:
        return txn.stat(env.open_db(db))["entries"]


class Gate:
    """Holds the store's disk writer inside its apply function until released."""

    def __init__(self, store: TieredStore) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        writer = store._writer
        inner = writer._apply

        def held(items):
            self.entered.set()
            if not self.release.wait(WAIT):
                raise RuntimeError("the test never opened the gate")
            return inner(items)

        writer._apply = held


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def stores(tmp_path) -> Iterator[list[TieredStore]]:
    made: list[TieredStore] = []
    yield made
    for store in made:
        if not store._closed:
            for gate_release in getattr(store, "_test_gates", []):
                gate_release.set()
            store.close()


def make_store(stores, path, **kw) -> TieredStore:
    store = TieredStore(path, device="cpu", block_size=B, **kw)
    stores.append(store)
    return store


def gated(store: TieredStore) -> Gate:
    gate = Gate(store)
    store._test_gates = [gate.release]  # type: ignore[attr-defined]
    return gate


def close_past_the_gate(store: TieredStore, gate: Gate) -> int:
    """``close(timeout=0.01)`` while the writer is held at the gate, which opens once the timeout
    has expired; what close returned."""
    result: list[int] = []
    closer = threading.Thread(target=lambda: result.append(store.close(timeout=0.01)))
    closer.start()
    assert store._writer._abandon.wait(WAIT)  # the timeout expired with a batch held in flight
    gate.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    return result[0]


@pytest.mark.parametrize("budgets, tier", [
    (dict(device_budget=0, host_budget="1MiB"), "host"),
    (dict(device_budget=0, host_budget=0), "disk"),
])
def test_open_during_a_spill_serves_the_block_from_where_it_is(model, stores, tmp_path, budgets, tier):
    store = make_store(stores, tmp_path / "kv", **budgets)
    gate = gated(store)
    ids = random_ids(20, 1)
    cache = store.open(model, ids, session="s")
    out = generate(model, ids, cache)
    assert cache.commit(out) == 22
    assert gate.entered.wait(WAIT)  # the first write batch is held inside the writer
    assert {m.disk for m in store._index.blocks.values()} == {DiskState.PENDING}
    assert lmdb_rows(store, b"blocks") == 0  # nothing is visible on disk before its commit

    nxt = torch.cat([out, random_ids(4, 2)], dim=1)
    cache = store.open(model, nxt, session="s")
    assert cache.restored_tokens == 22 and cache.restored_from[tier] == 22
    assert torch.equal(generate(model, nxt, cache), generate(model, nxt))

    gate.release.set()
    store.flush()
    assert store.stats()["pending_writes"] == 0
    assert lmdb_rows(store, b"blocks") == 3
    assert {m.disk for m in store._index.blocks.values()} == {DiskState.DURABLE}


def test_forget_during_a_spill_leaves_nothing_on_disk(model, stores, tmp_path):
    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget="1MiB", host_budget="1MiB")
    gate = gated(store)
    keep, secret = random_ids(12, 3), random_ids(20, 4)
    for session, ids in (("keep", keep), ("secret", secret)):
        cache = store.open(model, ids, session=session)
        cache.commit(generate(model, ids, cache))
    assert gate.entered.wait(WAIT)
    assert store.forget(session="secret") == 3  # while its writes are queued, or held by the writer
    gate.release.set()
    store.flush()
    assert lmdb_rows(store, b"blocks") == 2  # keep's block and tail only
    assert lmdb_rows(store, b"refs") == 2
    assert lmdb_rows(store, b"sessions") == 1
    store.close()
    store = make_store(stores, path)
    assert store.open(model, torch.cat([secret, random_ids(2, 5)], dim=1), session="secret").restored_tokens == 0
    assert store.open(model, torch.cat([keep, random_ids(2, 6)], dim=1), session="keep").restored_tokens == 12


def test_forget_reaches_the_file_without_waiting_for_the_writers_linger(model, stores, tmp_path, monkeypatch):
    monkeypatch.setattr(tierkv.store, "WRITE_LINGER_S", WAIT * 10)  # far longer than any wait below
    store = make_store(stores, tmp_path / "kv", device_budget="1MiB", host_budget="1MiB")
    ids = random_ids(20, 7)
    cache = store.open(model, ids, session="secret")
    cache.commit(generate(model, ids, cache))
    store.flush()  # cuts the linger short
    assert lmdb_rows(store, b"blocks") == 3
    assert store.forget(session="secret") == 3
    deadline = time.monotonic() + WAIT
    while lmdb_rows(store, b"blocks") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lmdb_rows(store, b"blocks") == 0 and lmdb_rows(store, b"sessions") == 0


def test_close_without_timeout_drains_every_queued_write(model, stores, tmp_path):
    path = tmp_path / "kv"
    store = make_store(stores, path)
    gate = gated(store)
    ids = random_ids(30, 7)
    cache = store.open(model, ids, session="s")
    out = generate(model, ids, cache)
    cache.commit(out)
    assert gate.entered.wait(WAIT)
    result: list[int] = []
    closer = threading.Thread(target=lambda: result.append(store.close()))
    closer.start()
    gate.release.set()
    closer.join(WAIT)
    assert result == [0]
    store = make_store(stores, path)
    nxt = torch.cat([out, random_ids(3, 8)], dim=1)
    cache = store.open(model, nxt)
    assert cache.restored_from["disk"] == out.shape[1] - 1 == 32
    assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_close_with_a_timeout_drops_queued_writes_and_says_how_many(model, stores, tmp_path):
    path = tmp_path / "kv"
    store = make_store(stores, path)
    gate = gated(store)
    conversations = [random_ids(16, 10 + i) for i in range(3)]
    outs = []
    for i, ids in enumerate(conversations):
        cache = store.open(model, ids, session=f"s{i}")
        outs.append(generate(model, ids, cache))
        cache.commit(outs[-1])  # 2 full blocks and a 2-token tail each: 9 block writes
        if i == 0:
            # The writer holds the first conversation's batch (its linger over): the others queue.
            assert gate.entered.wait(WAIT)
    dropped = close_past_the_gate(store, gate)
    assert 1 <= dropped <= 9
    store = make_store(stores, path)
    assert store.stats()["disk"]["blocks"] == 9 - dropped
    for ids, out in zip(conversations, outs):
        nxt = torch.cat([out, random_ids(2, 20)], dim=1)
        cache = store.open(model, nxt)
        assert cache.restored_tokens in (0, 8, 16, 18)  # whatever survived, always a whole prefix
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_two_threads_committing_the_same_prefix_store_it_once(model, stores, tmp_path):
    store = make_store(stores, tmp_path / "kv")
    ids = random_ids(24, 30)
    out = generate(model, ids)
    caches = []
    for session in ("a", "b"):
        cache = store.open(model, ids, session=session)
        assert torch.equal(generate(model, ids, cache), out)
        caches.append(cache)
    barrier = threading.Barrier(2)
    stored: list[int] = []

    def commit(cache):
        barrier.wait(WAIT)
        stored.append(cache.commit(out))

    threads = [threading.Thread(target=commit, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert stored == [26, 26]
    store.flush()
    assert len(store._index.blocks) == 4  # 3 full blocks and a 2-token tail, once
    # The same conversation twice: the session that committed last holds the blocks, the other
    # has nothing of its own and is no longer tracked.
    (sid,) = store._index.sessions
    assert all(m.sessions == {sid} for m in store._index.blocks.values())
    assert lmdb_rows(store, b"blocks") == 4
    assert lmdb_rows(store, b"refs") == 4
    assert lmdb_rows(store, b"sessions") == 1


class DelayedJob(Job):
    """A copy that completes only when the test says so; records that someone waited for it."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.source = source
        self.target = torch.full_like(source, float("nan"))  # garbage until the copy "lands"
        self.waited = threading.Event()

    def land(self) -> None:
        self.target.copy_(self.source)
        self.set_result(self.target)

    def wait(self, timeout=None):
        self.waited.set()
        return super().wait(timeout)


class DelayedEngine(CopyEngine):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.jobs: list[DelayedJob] = []

    def to_device(self, src):
        tensor = src.wait() if isinstance(src, Job) else src
        job = DelayedJob(tensor)
        self.jobs.append(job)
        return job


def test_a_restored_block_is_never_read_before_its_copy_completed(model, stores, tmp_path):
    store = make_store(stores, None, device_budget=0, host_budget="1MiB")
    ids = random_ids(20, 40)
    cache = store.open(model, ids)
    out = generate(model, ids, cache)
    cache.commit(out)
    engine = store._engine = DelayedEngine()
    nxt = torch.cat([out, random_ids(3, 41)], dim=1)
    cache = store.open(model, nxt)  # returns with every host -> device copy still in flight
    assert cache.restored_from["host"] == 22 and len(engine.jobs) == 3
    assert not any(job.done() for job in engine.jobs)
    result: list[torch.Tensor] = []
    runner = threading.Thread(target=lambda: result.append(generate(model, nxt, cache)))
    runner.start()
    assert engine.jobs[0].waited.wait(WAIT)  # the first layer's first touch waits for the copy
    assert runner.is_alive()
    for job in engine.jobs:
        job.land()
    runner.join(WAIT)
    assert torch.equal(result[0], generate(model, nxt))


def test_forget_changes_the_index_under_the_stores_lock(model, stores, tmp_path):
    """A forget takes blocks out of the index holding the store's lock, as every open and commit
    does: one that left it out passed the tests of forgets and threads (none met the race it
    opens). Watched at each removal from the index."""
    store = make_store(stores, tmp_path / "kv")
    ids = random_ids(2 * B + 3, 95)
    cache = store.open(model, ids, session="s")
    cache.commit(generate(model, ids, cache))
    remove = store._index.remove
    held: list[bool] = []

    def watched(key: bytes):
        held.append(store._lock._is_owned())
        return remove(key)

    store._index.remove = watched  # type: ignore[method-assign]
    assert store.forget(session="s") > 0
    assert held and all(held)


def test_forget_then_close_with_a_timeout_stays_forgotten(model, stores, tmp_path):
    # Only block writes may be abandoned at close(timeout): the forget's deletes still land.
    path = tmp_path / "kv"
    store = make_store(stores, path)
    gate = gated(store)
    secret = random_ids(20, 50)
    cache = store.open(model, secret, session="secret")
    cache.commit(generate(model, secret, cache))
    assert gate.entered.wait(WAIT)
    for i in range(3):  # more block writes queued behind the held batch, to be abandoned
        ids = random_ids(12, 51 + i)
        c = store.open(model, ids, session=f"other{i}")
        c.commit(generate(model, ids, c))
    assert store.forget(session="secret") == 3
    close_past_the_gate(store, gate)
    store = make_store(stores, path)
    assert store.open(model, torch.cat([secret, random_ids(2, 60)], dim=1)).restored_tokens == 0
    assert "secret" not in {info.name for info in store._index.sessions.values()}
    store.flush()  # the reopen queued the removal of references to blocks that never landed
    assert lmdb_rows(store, b"refs") == sum(len(m.sessions) for m in store._index.blocks.values())


@pytest.mark.parametrize("forget", ["session", "untracked session", "tenant"])
def test_a_forgotten_sessions_replaced_tail_is_deleted_by_a_close_with_a_timeout(model, stores, tmp_path, forget):
    # Before: a replaced partial tail's delete may be given up at close(timeout) (with the writes
    # of the chain that replaced it), but a forget of its session had made it forget's to land:
    # the tail, no longer in the index, stayed in the file with no session to find it by, and a
    # reopen served it again. Also where another session ("y") repeated the turn that replaced it:
    # the session that replaced it then held nothing of its own and was no longer tracked, so the
    # forget did not find its queued delete.
    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget=0, host_budget=0)
    ids = random_ids(12, 80)
    cache = store.open(model, ids, session="s", tenant="acme")
    first = generate(model, ids, cache)
    cache.commit(first)
    store.flush()
    sid = tierkv.store._session_id("acme", "s")
    tails = [k for k in store._index.sessions[sid].keys if store._index.blocks[k].n_tokens < B]
    assert tails
    gate = gated(store)
    other = random_ids(20, 81)
    c = store.open(model, other, session="other")
    c.commit(generate(model, other, c))
    assert gate.entered.wait(WAIT)
    longer = torch.cat([first, random_ids(10, 82)], 1)
    for name in ("s", "y") if forget != "session" else ("s",):
        c = store.open(model, longer, session=name, tenant="acme")
        c.commit(generate(model, longer, c))  # queued behind the held batch: the tail is replaced
    assert all(k not in store._index.blocks for k in tails)
    assert (sid in store._index.sessions) == (forget == "session")
    if forget == "tenant":
        store.forget(tenant="acme")
    else:
        store.forget(session="s")
        store.forget(session="y", tenant="acme")
    close_past_the_gate(store, gate)
    assert store._writer._abandoned > 0  # the new chain's writes were given up
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8, subdir=True)
    try:
        with env.begin() as txn:
            blocks = env.open_db(b"blocks", txn=txn, create=False)
            refs = env.open_db(b"refs", txn=txn, create=False)
            assert not any(txn.get(k, db=blocks) for k in tails)
            assert not any(key.startswith(sid) for key, _ in txn.cursor(db=refs))
    finally:
        env.close()
    store = make_store(stores, path, device_budget=0, host_budget=0)
    assert store.open(model, torch.cat([first, random_ids(2, 93)], 1), tenant="acme").restored_tokens == 0


def test_concurrent_close_and_flush_are_harmless(model, stores, tmp_path):
    store = make_store(stores, tmp_path / "kv")
    gate = gated(store)
    ids = random_ids(20, 70)
    cache = store.open(model, ids, session="s")
    cache.commit(generate(model, ids, cache))
    assert gate.entered.wait(WAIT)
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except ValueError as exc:  # a flush that starts after the close may say "closed"
            if "closed" not in str(exc):
                errors.append(exc)
        except BaseException as exc:  # noqa: BLE001 - anything else is the bug
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in (store.close, store.close, store.flush)]
    for t in threads:
        t.start()
    gate.release.set()
    for t in threads:
        t.join(WAIT)
    assert errors == [] and store._closed


def test_a_disk_read_does_not_hold_up_other_sessions(model, stores, tmp_path):
    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget=0, host_budget=0)
    cold = random_ids(20, 80)
    cache = store.open(model, cold, session="cold")
    out_cold = generate(model, cold, cache)
    cache.commit(out_cold)
    store.close()
    store = make_store(stores, path, device_budget="1MiB")
    hot = random_ids(20, 81)
    cache = store.open(model, hot, session="hot")
    out_hot = generate(model, hot, cache)
    cache.commit(out_hot)  # rests on the device
    reading, release = threading.Event(), threading.Event()
    load = store._disk.read_into

    def slow_load(*args, **kwargs):
        reading.set()
        assert release.wait(WAIT)
        return load(*args, **kwargs)

    store._disk.read_into = slow_load
    result: list = []
    nxt_cold = torch.cat([out_cold, random_ids(2, 82)], dim=1)
    reader = threading.Thread(target=lambda: result.append(store.open(model, nxt_cold, session="cold")))
    reader.start()
    assert reading.wait(WAIT)  # the cold open is inside its disk read
    nxt_hot = torch.cat([out_hot, random_ids(2, 83)], dim=1)
    cache = store.open(model, nxt_hot, session="hot")  # would deadlock if the read held the lock
    assert cache.restored_from["device"] == 22
    assert torch.equal(generate(model, nxt_hot, cache), generate(model, nxt_hot))
    release.set()
    reader.join(WAIT)
    cold_cache = result[0]
    assert cold_cache.restored_from["disk"] == 22
    assert torch.equal(generate(model, nxt_cold, cold_cache), generate(model, nxt_cold))


@pytest.mark.parametrize("host_budget", [0, "1MiB"], ids=["into the restore's buffer", "into a host tensor"])
def test_close_waits_for_a_disk_read_in_progress_then_the_open_says_closed(model, stores, tmp_path, host_budget):
    """Close unmaps LMDB's map: an open still copying out of it crashed the process (SIGSEGV)."""
    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget=0, host_budget=0)
    ids = random_ids(40, 95)
    cache = store.open(model, ids)
    out = generate(model, ids, cache)
    cache.commit(out)
    store.close()
    store = make_store(stores, path, device_budget=0, host_budget=host_budget)
    reading, release, closing = threading.Event(), threading.Event(), threading.Event()
    abort = False
    read_into = store._disk.read_into

    # The destination is asked for inside the read transaction, before the copy, on either path
    # (host_budget=0: straight into the restore's buffer, TieredStore._in_place, which makes no
    # host tensor: a hook on the host tier's alloc was never called there, and the test failed).
    def held_read_into(key, into):
        def held(header):
            reading.set()
            assert release.wait(WAIT)
            if abort:
                raise RuntimeError("the map was unmapped under this read")
            return into(header)

        return read_into(key, held)

    store._disk.read_into = held_read_into
    disk_close = store._disk.close

    def close_disk(*args, **kwargs):
        closing.set()
        return disk_close(*args, **kwargs)

    store._disk.close = close_disk
    nxt = torch.cat([out, random_ids(2, 96)], dim=1)
    errors: list[BaseException] = []

    def open_turn():
        try:
            store.open(model, nxt)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    reader = threading.Thread(target=open_turn)
    reader.start()
    assert reading.wait(WAIT)
    closer = threading.Thread(target=store.close)
    closer.start()
    assert closing.wait(WAIT)
    closer.join(0.5)
    abort = not closer.is_alive()
    release.set()
    reader.join(WAIT)
    closer.join(WAIT)
    assert not abort, "the disk tier closed while a read was copying out of its map"
    # Closed during its read or right after it, depending on which took the disk's lock first.
    assert len(errors) == 1 and isinstance(errors[0], ValueError) and "closed" in str(errors[0])
    with pytest.raises(ValueError, match="closed"):
        store.open(model, nxt)


@pytest.mark.parametrize("host_budget", [0, "1MiB"], ids=["into the restore's buffer", "into a host tensor"])
def test_a_block_gone_from_disk_during_the_read_is_a_plain_miss(model, stores, tmp_path, host_budget):
    store = make_store(stores, tmp_path / "kv", device_budget=0, host_budget=0)
    ids = random_ids(20, 90)
    cache = store.open(model, ids)
    out = generate(model, ids, cache)
    cache.commit(out)
    store.close()
    store = make_store(stores, tmp_path / "kv", device_budget=0, host_budget=host_budget)

    def gone(key, into):
        # Evicted by another thread meanwhile: the index lets go of it (under the store's lock)
        # before its delete can land; the read then finds no record. (A record gone while its
        # index entry still says durable is damage: dropped and counted, test_in_place.py.)
        with store._lock:
            store._drop(store._index.blocks[key])
        raise KeyError(key)

    store._disk.read_into = gone
    nxt = torch.cat([out, random_ids(2, 91)], dim=1)
    cache = store.open(model, nxt)
    assert cache.restored_tokens == 0 and store.stats()["corrupt"] == 0
    assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_disk_io_error_degrades_to_memory_tiers_without_raising(model, stores, tmp_path, caplog):
    import lmdb

    from tierkv.tiers.disk import DeleteBlocks, DropRefs

    store = make_store(stores, tmp_path / "kv", device_budget="1MiB", host_budget="1MiB")
    calls = {"n": 0}

    def failing(ops):
        # Deletes are still tried after a failure (and retried at each flush): count the rest.
        calls["n"] += any(not isinstance(op, (DeleteBlocks, DropRefs)) for op in ops)
        raise lmdb.DiskError("No space left on device")

    store._disk.apply = failing
    ids = random_ids(20, 130)
    with caplog.at_level("WARNING", logger="tierkv"):
        for turn in range(3):
            cache = store.open(model, ids, session="s")
            out = generate(model, ids, cache)
            assert torch.equal(out, generate(model, ids))
            cache.commit(out)
            store.flush()
            if turn == 0:
                calls_when_failure_known = calls["n"]  # the first commit's writes, in 1 to 3 batches
            ids = torch.cat([out, random_ids(3, 131 + turn)], dim=1)
    stats = store.stats()
    assert stats["disk_failed"] and stats["disk_errors"] >= 1 and stats["pending_writes"] == 0
    assert stats["disk"]["blocks"] == 0 and stats["device"]["blocks"] > 0
    assert 1 <= calls_when_failure_known == calls["n"]  # once the failure is known, only deletes are tried
    # The superseded tails' references never reached the disk: no delete of them is owed (each
    # was, one more per turn, retried at every flush).
    assert stats["owed_deletes"] == 0
    assert sum("I/O error" in r.getMessage() for r in caplog.records) == 1  # one warning, not a flood
    cache = store.open(model, ids, session="s")  # still restores from memory, exactly
    assert cache.restored_tokens == cache.restored_from["device"] == ids.shape[1] - 4  # all but the 3 new + 1
    assert torch.equal(generate(model, ids, cache), generate(model, ids))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "other_version"])
def test_a_damaged_record_is_a_counted_miss_and_generation_stays_exact(model, stores, tmp_path, caplog, damage):
    import msgpack

    from tierkv.codec import MAGIC

    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget=0, host_budget=0)
    conversations = [random_ids(20, 140 + i) for i in range(2)]
    outs = []
    for i, ids in enumerate(conversations):
        cache = store.open(model, ids, session=f"s{i}")
        outs.append(generate(model, ids, cache))
        cache.commit(outs[-1])
    store.flush()
    env = store._disk.env
    blocks_db = env.open_db(b"blocks")
    with env.begin() as txn:
        keys = [bytes(key) for key in txn.cursor(db=blocks_db).iternext(keys=True, values=False)]

    def damaged(record: bytes) -> bytes:
        if damage == "flip_payload":
            return flipped(record, len(record) // 2, 0xFF)
        if damage == "flip_header":
            return flipped(record, 10)
        head_len = int.from_bytes(record[4:8], "little")
        header = msgpack.unpackb(bytes(record[8:8 + head_len]))
        header["v"] = 99
        packed = msgpack.packb(header, use_bin_type=True)
        return MAGIC + len(packed).to_bytes(4, "little") + packed + record[8 + head_len:]

    for key in keys:
        if damage == "truncate":
            # A value shorter than its record: LMDB's own length of it changes, which no damage
            # where the record lies does; put, the record moves (the store's place of it is stale).
            with env.begin(write=True) as txn:
                txn.put(key, bytes(txn.get(key, db=blocks_db))[:-100], db=blocks_db)
        else:
            damage_in_place(env, blocks_db, key, damaged)
    with caplog.at_level("WARNING", logger="tierkv"):
        for ids, out in zip(conversations, outs):
            nxt = torch.cat([out, random_ids(2, 150)], dim=1)
            cache = store.open(model, nxt)
            assert cache.restored_tokens == 0
            assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
    stats = store.stats()
    assert stats["corrupt"] == 2  # the first block of each chain; the rest are never reached
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == 1  # logged once
    store.close()
    # Reopen: bad headers are found by the scan itself, bad payloads on first read; never served.
    store = make_store(stores, path, device_budget=0, host_budget=0)
    for ids, out in zip(conversations, outs):
        nxt = torch.cat([out, random_ids(2, 150)], dim=1)
        cache = store.open(model, nxt)
        assert cache.restored_tokens == 0
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_forgotten_kv_bytes_are_gone_from_the_lmdb_file(model, stores, tmp_path):
    path = tmp_path / "kv"
    store = make_store(stores, path, device_budget=0, host_budget=0)
    keep, secret = random_ids(20, 160), random_ids(20, 161)
    for session, ids in (("keep", keep), ("secret", secret)):
        cache = store.open(model, ids, session=session)
        cache.commit(generate(model, ids, cache))
    store.flush()
    env = store._disk.env
    secret_keys = [k for k, m in store._index.blocks.items() if "secret" in
                   {store._index.sessions[s].name for s in m.sessions}]
    assert len(secret_keys) == 3
    markers = []
    with env.begin() as txn:
        for key in secret_keys:
            record = txn.get(key, db=env.open_db(b"blocks"))
            markers.append(record[len(record) // 2: len(record) // 2 + 64])  # KV bytes from the payload
            # The conversation's token ids, which a block's head (its index entry) holds too.
            assert store._index.blocks[key].token_ids.astype("<i8").tobytes() in txn.get(key, db=env.open_db(b"heads"))
            markers.append(store._index.blocks[key].token_ids.astype("<i8").tobytes())
    keep_marker = None
    with env.begin() as txn:
        for key, value in txn.cursor(db=env.open_db(b"blocks")):
            if key not in secret_keys:
                keep_marker = value[len(value) // 2: len(value) // 2 + 64]
    assert store.forget(session="secret") == 3
    store.close()
    data = (path / "data.mdb").read_bytes()
    assert not any(marker in data for marker in markers)
    assert keep_marker in data  # the check can see KV bytes: the kept session's are still there
    store = make_store(stores, path, device_budget=0, host_budget=0)
    assert store.open(model, torch.cat([generate(model, keep), random_ids(2, 163)], dim=1)).restored_tokens > 0
    assert store.stats()["corrupt"] == 0


def test_two_threads_in_one_session(model, stores, tmp_path):
    store = make_store(stores, tmp_path / "kv", device_budget="64KiB", host_budget="64KiB")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    finals: dict[int, torch.Tensor] = {}

    def talk(seed: int) -> None:
        try:
            ids = random_ids(16, seed)
            for turn in range(3):
                barrier.wait(WAIT)  # both threads open, generate and commit in the same session at once
                cache = store.open(model, ids, session="shared")
                out = generate(model, ids, cache)
                assert torch.equal(out, generate(model, ids))
                cache.commit(out)
                finals[seed] = out
                ids = torch.cat([out, random_ids(3, seed + 10 + turn)], dim=1)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=talk, args=(seed,)) for seed in (170, 171)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert errors == []
    store.flush()
    stats = store.stats()
    for tier in ("device", "host", "disk"):
        assert stats[tier]["bytes"] <= stats[tier]["budget"]
    sid, info = next((s, i) for s, i in store._index.sessions.items() if i.name == "shared")
    assert info.keys <= set(store._index.blocks)
    assert all(sid in store._index.blocks[k].sessions for k in info.keys)
    for out in finals.values():  # neither thread's commits superseded the other's conversation
        nxt = torch.cat([out, random_ids(2, 180)], dim=1)
        cache = store.open(model, nxt, session="shared")
        assert cache.restored_tokens == out.shape[1] - 1
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


@pytest.mark.parametrize("call", ["filesystem_short", "sync"])
def test_a_disk_call_of_another_thread_waits_for_the_writers_remap(stores, tmp_path, call):
    # Threads other than the writer's read LMDB's map: a commit over the disk budget its meta page
    # (``filesystem_short``), a flush the whole map (``sync``). The writer's remaps (the map
    # growing, or cut back at its cap) unmap it, and py-lmdb answered EINVAL: out of
    # ``cache.commit``, or out of ``flush`` as ``DiskSyncFailed``, the disk then given up for
    # good (found by helper-69's stress of threads sharing a store).
    store = make_store(stores, tmp_path / "kv")
    disk = store._disk
    disk._find_map = lambda: None  # no look-up between remaps: they follow each other closely
    sizes = [disk.env.info()["map_size"] * 2, disk.env.info()["map_size"]]
    stop = threading.Event()
    remaps = [0]

    def remap() -> None:  # as the writer's _grow and _set_map do (the writer itself is idle)
        try:
            deadline = time.monotonic() + 2.0
            while not stop.is_set() and time.monotonic() < deadline:
                with disk._resize_lock:
                    disk._map_to(sizes[remaps[0] % 2])
                remaps[0] += 1
        finally:
            stop.set()

    remapper = threading.Thread(target=remap)
    remapper.start()
    try:
        while not stop.is_set():
            disk.filesystem_short(4096) if call == "filesystem_short" else disk.sync()
    finally:
        stop.set()
        remapper.join(WAIT)
    assert remaps[0] > 100


@pytest.mark.parametrize("budgets", [dict(), dict(device_budget=0, host_budget=0)], ids=["memory", "disk only"])
def test_a_forget_while_an_open_reads_leaves_its_unread_blocks_counted_as_planned_and_the_turn_exact(
        tiny_model, stores, tmp_path, budgets):
    """A forget of another thread landing while an open reads its disk blocks (outside the store's
    lock), after the plan that left blocks unread (no window of a model whose every layer slides
    reaches them: ``UNREAD``) and before the open counts them. Asked by h124: are they counted as
    restored though gone, and are their tokens then computed again? Established (h128), by
    reading and here: from memory, the open took its read blocks' tensors under the lock before
    the forget, and the unread ones count as the tier they rested in at the plan, as if the
    forget had come after the open: ``restored_from`` adds up to ``restored_tokens`` and to the
    store's hits, misses are the rest, and the prefill feeds only the tokens after the restore
    (nothing computed again: no layer needs the unread ones). The output is exact; the commit
    keeps nothing (the sliding layers hold no KV of the unread blocks to store them again, and
    they are a forgotten conversation's: ``_first_forgotten``), so nothing forgotten comes back,
    and the next turn computes the conversation. From disk, the reads that come after the
    deletes miss, and the restore is planned again down to nothing: every token computed,
    counted as missed, and that commit keeps them all. The counts tell no lie: no fix."""
    model = tiny_model("mistral_window")
    path = tmp_path / "kv"
    store = make_store(stores, path, **budgets)
    ids = random_ids(40, seed=1)
    cache = store.open(model, ids, session="b")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert cache.commit(out) == 59
    if budgets:
        store.close()
        store = make_store(stores, path, **budgets)  # every block on disk alone
    nxt = torch.cat([out, random_ids(3, seed=2)], dim=1)
    read = store._read_disk_blocks
    planned: list[Any] = []

    def forgotten_meanwhile(plan: list, found: list, *args: Any, **kwargs: Any) -> Any:
        if not planned:
            planned.append((sum([n for _, n in plan]), [tierkv.store.UNREAD in (where or ()) for where in found]))
            forget = threading.Thread(target=lambda: (store.forget(session="b"), store.flush()))
            forget.start()
            forget.join(WAIT)
        return read(plan, found, *args, **kwargs)

    store._read_disk_blocks = forgotten_meanwhile
    before = store.stats()
    cache = store.open(model, nxt, session="a")
    store._read_disk_blocks = read
    after = store.stats()
    tokens, unread = planned[0]
    assert tokens == 59 and unread == [True] * 6 + [False] * 2  # the window (12) reaches the last 11 tokens
    assert not store._index.blocks  # the forget dropped all of b's
    restored = 0 if budgets else 59
    assert cache.restored_tokens == sum(cache.restored_from.values()) == restored
    assert cache.restored_from == {tier: after["hits"][tier] - before["hits"][tier] for tier in after["hits"]}
    assert after["misses"] - before["misses"] == nxt.shape[1] - restored
    assert cache.restored_from["disk" if budgets else "device"] == restored
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, output: fed.append(args[0].shape[1]))
    try:
        got = generate(model, nxt, cache, new=4)
    finally:
        hook.remove()
    assert fed[0] == nxt.shape[1] - restored  # nothing restored is computed again
    assert torch.equal(got, generate(model, nxt, new=4))
    assert cache.commit(got) == (got.shape[1] - 1 if budgets else 0)
    store.flush()
    stats = store.stats()
    assert [stats[tier]["blocks"] for tier in ("device", "host", "disk")] == \
        ([0, 0, 9] if budgets else [0, 0, 0])  # nothing of what was forgotten comes back
    later = torch.cat([got, random_ids(2, seed=5)], dim=1)
    cache = store.open(model, later, session="a")
    assert cache.restored_tokens == (got.shape[1] - 1 if budgets else 0)
    assert torch.equal(generate(model, later, cache), generate(model, later))


@pytest.mark.parametrize("how", ["reset", "assisted", "crop to nothing", "crop into block 0"])
def test_a_turn_reset_after_a_forget_of_the_blocks_it_restored_keeps_what_it_computed_again(model, stores, tmp_path,
                                                                                            how):
    """Another session's conversation restored by this turn, forgotten after the open: the turn's
    commit keeps nothing while it holds KV restored from it (``_first_forgotten``). Reset
    (``cache.reset()``, assisted decoding's) or cropped to nothing, the turn computes the
    conversation again, its own KV, and keeps it all, as a turn that restored nothing does. Before
    (h128), the restored blocks' keys outlived the reset, and the commit kept 0 of 45 tokens; so
    too after a crop to nothing. Cropped into the first block, it still holds KV restored from a
    forgotten block, and keeps none."""
    store = make_store(stores, tmp_path / "kv")
    ids = random_ids(30, seed=1)
    cache = store.open(model, ids, session="b")
    out = generate(model, ids, cache, new=10)
    assert cache.commit(out) == 39
    nxt = torch.cat([out, random_ids(3, seed=2)], dim=1)
    kept = []
    for reset in (False, True):
        cache = store.open(model, nxt, session="a")
        assert cache.restored_tokens == 39
        store.forget(session="b")
        if reset and how.startswith("crop"):
            cache.crop((0 if how == "crop to nothing" else 1) - cache.get_seq_length())  # a count to remove
            assert cache.get_seq_length() == (0 if how == "crop to nothing" else 1)
        elif reset:
            cache.reset() if how == "reset" else cache.activate_past_recording()
            assert cache.get_seq_length() == 0
        got = generate(model, nxt, cache)
        assert torch.equal(got, generate(model, nxt))
        kept.append(cache.commit(got))
        store.forget(session="a")
        cache = store.open(model, ids, session="b")
        assert cache.commit(generate(model, ids, cache, new=10)) == 39
    assert kept == [0, 0 if how == "crop into block 0" else got.shape[1] - 1]
