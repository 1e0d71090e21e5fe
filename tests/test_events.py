"""The event queue the store fills for observers (``tierkv.events``), alone and behind a real store.

Alone: drain order, the bounded queue dropping its oldest events (counted), unsubscribing, moves
whose duration is not known yet held back until it is, and emits from many threads. Behind a store:
one event per open and per commit carrying what the caller saw, move bytes per direction adding up
to ``stats()["moved_bytes"]``, and nothing built or queued when nobody listens.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import tierkv.store as store_module
from conftest import random_ids
from tierkv import TieredStore
from tierkv.events import DIRECTIONS, CommitEvent, EventLog, MoveEvent, OpenEvent

B = 8
WAIT = 30.0


def generate(model: torch.nn.Module, ids: torch.Tensor, cache=None, new: int = 4) -> torch.Tensor:
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)


@pytest.fixture
def model(tiny_model) -> torch.nn.Module:
    return tiny_model("llama")


def block_bytes(model: torch.nn.Module, n_tokens: int = B) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * n_tokens * c.head_dim * 4


# -- the queue alone ---------------------------------------------------------------------------------
def test_drain_returns_events_oldest_first_and_empties_the_queue() -> None:
    log = EventLog()
    sub = log.subscribe()
    sent = [OpenEvent(0.1, {"device": 8, "host": 0, "disk": 0}, 3), MoveEvent("host_to_disk", 4096, 0.002),
            CommitEvent(0.2, 16), MoveEvent("device_to_host", 4096, 0.0)]
    for event in sent:
        log.emit(event)
    assert sub.drain() == sent
    assert sub.drain() == []
    assert sub.dropped == 0


def test_a_full_queue_drops_its_oldest_events_and_counts_them() -> None:
    log = EventLog()
    sub = log.subscribe(maxlen=3)
    for tokens in range(5):
        log.emit(CommitEvent(0.0, tokens))
    assert [e.tokens for e in sub.drain()] == [2, 3, 4]
    assert sub.dropped == 2
    log.emit(CommitEvent(0.0, 5))
    assert [e.tokens for e in sub.drain()] == [5]
    assert sub.dropped == 2


@pytest.mark.parametrize(("maxlen", "error", "word"), [
    (0, ValueError, ">= 1"), (-1, ValueError, ">= 1"), (np.int64(0), ValueError, ">= 1"),
    (True, TypeError, "must be an int"), (2.5, TypeError, "must be an int"), ("10", TypeError, "must be an int"),
])
def test_a_bad_maxlen_raises_with_a_remedy(maxlen: object, error: type[Exception], word: str) -> None:
    with pytest.raises(error, match=word):
        EventLog().subscribe(maxlen)  # type: ignore[arg-type]


def test_a_maxlen_computed_with_numpy_is_taken() -> None:
    log = EventLog()
    sub = log.subscribe(np.int64(2))  # type: ignore[arg-type]
    for tokens in (1, 2, 3):
        log.emit(CommitEvent(0.0, tokens))
    assert [e.tokens for e in sub.drain()] == [2, 3] and sub.dropped == 1


def test_unsubscribing_stops_delivery_to_that_subscriber_only() -> None:
    log = EventLog()
    first, second = log.subscribe(), log.subscribe()
    log.emit(CommitEvent(0.0, 1))
    first.close()
    log.emit(CommitEvent(0.0, 2))
    assert [e.tokens for e in first.drain()] == [1]
    assert [e.tokens for e in second.drain()] == [1, 2]
    assert log.active
    second.close()
    second.close()  # twice is harmless
    assert not log.active
    log.emit(CommitEvent(0.0, 3))
    assert first.drain() == [] and second.drain() == []


def test_a_move_still_in_flight_is_held_back_until_its_timer_has_a_value() -> None:
    log = EventLog()
    sub = log.subscribe()
    finished: list[float] = []
    log.emit(MoveEvent("host_to_device", 8192, None, lambda: finished[0] if finished else None))
    log.emit(OpenEvent(0.01, {"device": 0, "host": 8, "disk": 0}, 1))
    assert [type(e) for e in sub.drain()] == [OpenEvent]
    assert sub.drain() == []  # still in flight
    finished.append(0.004)
    log.emit(CommitEvent(0.02, 8))
    events = sub.drain()
    assert events[0] == MoveEvent("host_to_device", 8192, 0.004, None)  # resolved; the timer is let go
    assert events[1] == CommitEvent(0.02, 8)
    assert sub.drain() == [] and sub.dropped == 0


def test_emits_from_many_threads_lose_nothing_below_maxlen_while_draining() -> None:
    log = EventLog()
    sub = log.subscribe(maxlen=100_000)
    threads, per_thread = 8, 2_000
    start = threading.Barrier(threads + 1)
    received: list = []
    stop = threading.Event()

    def emitter(t: int) -> None:
        start.wait(WAIT)
        for i in range(per_thread):
            log.emit(MoveEvent(DIRECTIONS[t % 4], t * per_thread + i, 0.0))

    def drainer() -> None:
        start.wait(WAIT)
        while not stop.is_set():
            received.extend(sub.drain())

    workers = [threading.Thread(target=emitter, args=(t,)) for t in range(threads)]
    reader = threading.Thread(target=drainer)
    for w in (*workers, reader):
        w.start()
    for w in workers:
        w.join(WAIT)
    stop.set()
    reader.join(WAIT)
    received.extend(sub.drain())
    assert sub.dropped == 0
    assert len(received) == threads * per_thread
    for t in range(threads):  # each thread's events arrive complete and in its order
        mine = [e.nbytes for e in received if t * per_thread <= e.nbytes < (t + 1) * per_thread]
        assert mine == list(range(t * per_thread, (t + 1) * per_thread))


# -- behind a real store -----------------------------------------------------------------------------
def verify_moves(events: list, stats: dict) -> dict[str, int]:
    moved = {d: 0 for d in DIRECTIONS}
    for event in events:
        if isinstance(event, MoveEvent):
            assert event.seconds is not None and event.seconds >= 0 and event.timer is None
            moved[event.direction] += event.nbytes
    assert moved == stats["moved_bytes"]
    return moved


def test_moved_bytes_count_kv_bytes_to_and_from_disk_alike(model, tmp_path) -> None:
    # A record's footprint holds its header and padding too; the moves count the KV it carries.
    ids = random_ids(20, 1)
    kw = dict(device="cpu", device_budget=0, host_budget=0, block_size=B)
    with TieredStore(tmp_path / "kv", **kw) as store:
        cache = store.open(model, ids, session="a")
        out = generate(model, ids, cache)
        kept = cache.commit(out)
        store.flush()
        assert store.stats()["moved_bytes"]["host_to_disk"] == block_bytes(model, kept)
        assert store.stats()["disk"]["bytes"] > block_bytes(model, kept)
    with TieredStore(tmp_path / "kv", **kw) as store:
        restored = store.open(model, torch.cat([out, random_ids(2, 2)], dim=1), session="a").restored_tokens
        assert restored == kept and store.stats()["moved_bytes"]["disk_to_host"] == block_bytes(model, kept)


@pytest.mark.parametrize("held_in", ["disk", "host"])
def test_a_restore_using_part_of_a_block_moves_the_whole_block_and_hits_count_the_tokens_used(
        model, tmp_path, held_in: str) -> None:
    # What stats() says moved_bytes counts: the disk read reads and checksums the whole record,
    # and a block restored through the host goes whole to the device tier (which keeps all of it).
    ids = random_ids(3 * B, 1)
    host_budget = 0 if held_in == "disk" else "1MiB"
    with TieredStore(tmp_path / "kv", device="cpu", device_budget=0, host_budget=host_budget, block_size=B) as store:
        first = store.open(model, ids, session="a")
        out = generate(model, ids, first)
        first.commit(out)
        store.flush()
        before = store.stats()["moved_bytes"]
        # The same first block and a half, then other ids: the second block is used for half its tokens.
        asked = torch.cat([out[:, :B + B // 2], random_ids(B, 2)], dim=1)
        assert not torch.equal(asked[:, B + B // 2:2 * B], out[:, B + B // 2:2 * B])
        cache = store.open(model, asked, session="b")
        after = store.stats()
    assert cache.restored_tokens == B + B // 2 and after["hits"][held_in] == B + B // 2
    moved = {d: after["moved_bytes"][d] - before[d] for d in DIRECTIONS}
    if held_in == "disk":
        assert moved["disk_to_host"] == block_bytes(model, 2 * B)
    else:
        assert moved["disk_to_host"] == 0 and moved["host_to_device"] == block_bytes(model, 2 * B)


def test_a_store_emits_one_event_per_open_and_commit_and_moves_that_add_up_to_stats(model, tmp_path) -> None:
    path = tmp_path / "kv"
    # Three blocks fit the device: the second session demotes the first to the host tier.
    kw = dict(device="cpu", device_budget=3 * block_bytes(model), host_budget="1MiB", block_size=B)
    store = TieredStore(path, **kw)
    sub = store.subscribe()
    seen: list[tuple[str, object]] = []
    outs = {}
    for session, ids in (("a", random_ids(20, 1)), ("b", random_ids(20, 2)), ("a", None)):
        ids = torch.cat([outs[session], random_ids(3, 3)], dim=1) if ids is None else ids
        cache = store.open(model, ids, session=session)
        seen.append(("open", (dict(cache.restored_from), ids.shape[1] - cache.restored_tokens)))
        outs[session] = generate(model, ids, cache)
        seen.append(("commit", cache.commit(outs[session])))
    store.flush()
    events = sub.drain()
    turns = [("open", (e.restored, e.missed)) if isinstance(e, OpenEvent) else ("commit", e.tokens)
             for e in events if not isinstance(e, MoveEvent)]
    assert turns == seen
    assert seen[4][1][0]["host"] == 23  # the last open restored session a from the host tier
    moved = verify_moves(events, store.stats())
    assert moved["device_to_host"] > 0 and moved["host_to_device"] > 0 and moved["host_to_disk"] > 0
    store.close()

    # Restart: the blocks come back from disk, read (timed) and handed to the device.
    store = TieredStore(path, **kw)
    sub = store.subscribe()
    ids = torch.cat([outs["b"], random_ids(3, 4)], dim=1)
    cache = store.open(model, ids, session="b")
    assert cache.restored_from == {"device": 0, "host": 0, "disk": 23}
    cache.commit(generate(model, ids, cache))
    store.flush()
    events = sub.drain()
    opens = [e for e in events if isinstance(e, OpenEvent)]
    assert [(e.restored, e.missed) for e in opens] == [(cache.restored_from, 4)]
    moved = verify_moves(events, store.stats())
    assert moved["disk_to_host"] == moved["host_to_device"] == 2 * block_bytes(model) + block_bytes(model, 7)
    store.close()
    sub.close()


def test_without_a_subscriber_the_store_builds_and_queues_no_event(model, tmp_path, monkeypatch) -> None:
    emitted: list = []
    timers: list = []
    real_timer = store_module.copy_timer
    monkeypatch.setattr(EventLog, "emit", lambda self, event: emitted.append(event))
    monkeypatch.setattr(store_module, "copy_timer", lambda job: timers.append(job) or real_timer(job))
    store = TieredStore(tmp_path / "kv", device="cpu", device_budget=0, host_budget="1MiB", block_size=B)

    def turn(seed: int) -> None:
        ids = random_ids(20, seed)
        cache = store.open(model, ids)
        cache.commit(generate(model, ids, cache))
        store.flush()

    turn(10)  # every block passes device -> host -> disk: moves happen, nobody listens
    assert store.stats()["moved_bytes"]["device_to_host"] > 0
    assert emitted == [] and timers == []
    sub = store.subscribe()
    turn(11)
    assert emitted and timers  # the same turn with a listener does emit: the check above can fail
    sub.close()
    emitted.clear()
    timers.clear()
    turn(12)
    assert emitted == [] and timers == []
    store.close()


def test_subscribing_and_leaving_from_many_threads_loses_no_subscriber() -> None:
    log = EventLog()
    kept: list = []
    barrier = threading.Barrier(8)

    def churn() -> None:
        barrier.wait(30)
        for _ in range(300):
            log.subscribe(4).close()  # comes and goes
        kept.append(log.subscribe(4))  # stays

    threads = [threading.Thread(target=churn) for _ in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two bytecodes: races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert len(kept) == 8 and set(log._subscribers) == set(kept)
    log.emit(CommitEvent(0.0, 1))
    assert all(len(sub.drain()) == 1 for sub in kept)
