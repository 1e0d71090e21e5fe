"""The host buffer pool inside the store, on CPU, with a copy engine that behaves like CUDA's.

On CUDA the host tier's buffers come from a pool and are reused; the store must never hand a
buffer out again while a copy to the device still reads it or the disk writer still encodes it.
On CPU the store hands tensors over without copies, so these tests give it an engine that really
copies (device and host memory apart, as on a GPU) and completes each copy only when it is waited
for or landed, and a pool that poisons every buffer it takes back: a read after reuse then feeds
NaNs into the model, and the exactness checks fail.
"""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
import torch

from conftest import random_ids
from tierkv import TieredStore
from tierkv.pool import HostPool
from tierkv.transfer import CopyEngine, Job

B = 8
BLOCK_BYTES = 2 * 2 * 2 * B * 16 * 4  # tiny llama: layers x (K, V) x kv heads x tokens x head dim x fp32


class LazyCopy(Job[torch.Tensor]):
    """A copy into a destination chosen when it was issued, done only once landed or waited for."""

    def __init__(self, src: "torch.Tensor | Job[torch.Tensor]", dst: torch.Tensor) -> None:
        super().__init__()
        self.src = src
        self.dst = dst
        self._mutex = threading.Lock()

    def land(self) -> None:
        with self._mutex:
            if self.done():
                return
            src = self.src.wait() if isinstance(self.src, Job) else self.src
            self.dst.copy_(src)
            self.set_result(self.dst)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        self.land()
        return super().wait(timeout)


class CopyingEngine(CopyEngine):
    """CUDA's semantics on CPU: separate destinations, from the host pool for device -> host."""

    def __init__(self, host_alloc) -> None:
        super().__init__(torch.device("cpu"), host_alloc=host_alloc)
        self.pending: list[LazyCopy] = []

    @staticmethod
    def _like(src) -> torch.Tensor:
        if isinstance(src, LazyCopy):
            return src.dst
        return src.wait() if isinstance(src, Job) else src

    def _issue(self, src, dst, lease=None) -> LazyCopy:
        job = LazyCopy(src, dst)
        if lease is not None:
            job.lease = lease
            lease.after(job.fence())
        self.pending.append(job)
        return job

    def to_host(self, src):
        like = self._like(src)
        dst, lease = self._host_alloc(tuple(like.shape), like.dtype)
        return self._issue(src, dst, lease)

    def to_device(self, src):
        return self._issue(src, torch.empty_like(self._like(src)))

    def to_device_many(self, srcs):
        return [self.to_device(src) for src in srcs]

    def land(self, rng: random.Random | None = None, share: float = 1.0) -> None:
        keep = []
        for job in self.pending:
            if rng is None or rng.random() < share:
                job.land()
            elif not job.done():
                keep.append(job)
        self.pending = keep


def generate(model, ids, cache=None, new=2):
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False)


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def pooled_store(path, pool_blocks: int, **kw) -> tuple[TieredStore, CopyingEngine]:
    store = TieredStore(path, device="cpu", block_size=B, **kw)
    store._host.pool = HostPool(pool_blocks * BLOCK_BYTES, pinned=False, poison=True,
                                arena_bytes=2 * BLOCK_BYTES)  # several arenas, allocated as needed
    engine = store._engine = CopyingEngine(store._host.alloc)
    return store, engine


def test_a_buffer_is_not_reused_while_a_copy_to_the_device_still_reads_it(model, tmp_path):
    store, engine = pooled_store(None, pool_blocks=1, device_budget=0, host_budget=BLOCK_BYTES)
    a = random_ids(B - 1, 800)  # + 2 generated: one full block, committed into the host tier (the pool's only buffer)
    cache = store.open(model, a)
    out_a = generate(model, a, cache)
    cache.commit(out_a)
    engine.land()
    nxt = torch.cat([out_a[:, :B], random_ids(3, 801)], dim=1)
    restore = store.open(model, nxt)  # its copy from the pool buffer stays in flight
    assert restore.restored_from["host"] == B and engine.pending
    b = random_ids(B - 1, 802)  # evicts a's block from the host tier while the copy is pending
    cache = store.open(model, b)
    cache.commit(generate(model, b, cache))
    stats = store.stats()["host_pool"]
    assert stats["retiring"] == 1 and stats["fallbacks"] == 1  # b could not take a's buffer
    engine.land()
    assert torch.equal(generate(model, nxt, restore), generate(model, nxt))  # a's KV, not b's, not poison
    store._host.reclaim()
    assert store.stats()["host_pool"]["retiring"] == 0
    store.close()


def test_a_restores_device_copies_go_with_its_cache(model):
    # Before: each copy to the device stayed registered on the host buffer it was made from, job
    # and tensor, until that buffer's next use: blocks that stayed in the host tier (no room on
    # the device) kept a device-sized copy each alive after the turn, outside every budget.
    store, engine = pooled_store(None, pool_blocks=64, device_budget=0, host_budget=32 * BLOCK_BYTES)
    a = random_ids(4 * B - 1, 820)
    cache = store.open(model, a)
    out = generate(model, a, cache)
    cache.commit(out)
    engine.land()
    cache = store.open(model, torch.cat([out, random_ids(3, 821)], dim=1))
    assert cache.restored_from["host"] == 4 * B
    copies = [job for job in engine.pending if job.lease is None]  # to the device: no host buffer
    assert len(copies) == 4
    engine.land()
    gone = [weakref.ref(job.dst) for job in copies]
    del cache, copies
    gc.collect()
    assert [ref() for ref in gone] == [None] * 4
    assert store.stats()["host"]["blocks"] == 4  # the blocks themselves stay where they were
    store.close()


def test_a_buffer_is_not_reused_while_the_disk_writer_still_encodes_it(model, tmp_path):
    store, engine = pooled_store(tmp_path / "kv", pool_blocks=1, device_budget=0, host_budget=0)
    gate = threading.Event()
    apply = store._disk.apply
    store._writer._apply = lambda ops: (gate.wait(30), apply(ops))[1]  # the writer is held back
    a = random_ids(B - 1, 810)
    cache = store.open(model, a)
    out_a = generate(model, a, cache)
    cache.commit(out_a)  # host budget 0: the block's only host copy is the pending write's buffer
    engine.land()
    b = random_ids(B - 1, 811)
    cache = store.open(model, b)
    cache.commit(generate(model, b, cache))
    assert store.stats()["host_pool"]["fallbacks"] == 1  # a's buffer is still held by its queued write
    gate.set()
    store.flush()
    store.close()
    store, engine = pooled_store(tmp_path / "kv", pool_blocks=1, device_budget=0, host_budget=0)
    nxt = torch.cat([out_a, random_ids(2, 812)], dim=1)
    cache = store.open(model, nxt)
    assert cache.restored_from["disk"] == out_a.shape[1] - 1
    assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
    store.close()


@pytest.mark.parametrize("seed", range(3))
def test_many_turns_through_a_small_pool_stay_exact_and_leak_nothing(model, tmp_path, seed):
    rng = random.Random(seed)
    store, engine = pooled_store(tmp_path / "kv", pool_blocks=6, device_budget=2 * BLOCK_BYTES,
                                 host_budget=4 * BLOCK_BYTES, disk_budget="64MiB")
    convs = {s: random_ids(5 + rng.randrange(20), 900 + 10 * seed + s) for s in range(5)}
    for turn in range(14):
        s = rng.randrange(len(convs))
        ids = convs[s]
        cache = store.open(model, ids, session=f"s{s}")
        engine.land(rng, 0.3)  # some copies land now, the rest stay in flight for a while
        out = generate(model, ids, cache)
        assert torch.equal(out, generate(model, ids)), (turn, s)
        cache.commit(out)
        engine.land(rng, 0.5)
        convs[s] = torch.cat([out, random_ids(1 + rng.randrange(9), 1000 + turn)], dim=1)
        if turn == 9:
            engine.land()
            store.flush()
            store.close()  # a restart: the pool starts empty, blocks come back from disk
            store, engine = pooled_store(tmp_path / "kv", pool_blocks=6, device_budget=2 * BLOCK_BYTES,
                                         host_budget=4 * BLOCK_BYTES, disk_budget="64MiB")
    stats = store.stats()
    assert sum(stats["hits"].values()) > 0
    for s in range(len(convs)):
        store.forget(session=f"s{s}")
    engine.land()
    store.flush()
    pool = store.stats()["host_pool"]
    assert pool["in_use"] == 0 and pool["retiring"] == 0, pool  # every buffer came back
    assert pool["free_runs"] == pool["allocated"] // (2 * BLOCK_BYTES)  # one whole run per arena
    store.close()


def test_reads_past_a_miss_give_their_buffers_back_before_the_open_ends(model, tmp_path, monkeypatch):
    """Reads side by side past the first miss (a record failing its checksum) took pool buffers
    (pinned, on CUDA) that the restore never uses, and held them, the miss's own too, until the
    open ended: up to one a helper, at every open that met a damaged or vanished record."""
    from conftest import damage_in_place, flipped
    from tierkv.tiers.disk import DiskTier

    store, engine = pooled_store(tmp_path / "kv", pool_blocks=16, device_budget=0, host_budget=0)
    ids = random_ids(5 * B + 1, 820)
    cache = store.open(model, ids)
    out = generate(model, ids, cache)
    cache.commit(out)  # five blocks and a tail, on disk only
    engine.land()
    store.flush()
    nxt = torch.cat([out, random_ids(2, 821)], dim=1)
    keys = store.open(model, nxt)._restored_keys
    engine.land()
    gc.collect()  # that open's cache
    store._host.pool.reclaim()  # and its buffers, once their copies landed
    assert len(keys) == 6 and store.stats()["host_pool"]["in_use"] == 0
    damage_in_place(store._disk.env, store._disk._blocks, keys[2], lambda record: flipped(record, len(record) - 9))

    real, past = DiskTier.read_into, {keys[3]: threading.Event(), keys[4]: threading.Event()}

    def read_into(self, key, into):
        if key == keys[2]:  # the miss is known only once the reads past it ended
            for event in past.values():
                assert event.wait(5)
        try:
            return real(self, key, into)
        finally:
            if key in past:
                past[key].set()

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    in_use = []
    finish = store._finish_open

    def finish_open(*args, **kwargs):
        store._host.pool.reclaim()
        in_use.append(store.stats()["host_pool"]["in_use"])
        return finish(*args, **kwargs)

    monkeypatch.setattr(store, "_finish_open", finish_open)
    cache = store.open(model, nxt)
    assert cache.restored_tokens == 2 * B and store.stats()["corrupt"] == 1
    assert in_use == [2 * BLOCK_BYTES]  # the two blocks restored, nothing of the reads past them
    engine.land()
    assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
    del cache
    gc.collect()
    store._host.pool.reclaim()
    assert store.stats()["host_pool"]["in_use"] == 0  # no buffer let go twice, none kept
    store.close()


def test_an_opens_holds_another_signals_handler_cuts_short_are_all_let_go(model, tmp_path, monkeypatch):
    # Before: an open held each pool buffer it read from (a host-tier block's, a disk read's),
    # then recorded it in a list, and let go of the list's in its finally, one by one; another
    # signal's handler raising as a hold returned, as an unhold started, or as the finally's
    # loop started left buffers held for good: never back in the pool (in_use above 0 after
    # every block was forgotten and every copy landed). So did one raising on the way back from
    # the pool's alloc of a disk read's buffer, before the hold.
    from contextlib import nullcontext

    import tierkv.store
    from conftest import raised_on_the_way_in

    # The reads in this thread: the same points at every run (helpers would take some of them).
    monkeypatch.setattr(tierkv.store, "PARALLEL_READ_BYTES", 1 << 60)
    made: list[TieredStore] = []

    def setup() -> tuple[TieredStore, CopyingEngine, torch.Tensor]:
        store, engine = pooled_store(tmp_path / f"kv{len(made)}", pool_blocks=16, device_budget=0,
                                     host_budget=2 * BLOCK_BYTES)
        made.append(store)
        ids = random_ids(4 * B + 1, 830)
        cache = store.open(model, ids, session="a")
        out = generate(model, ids, cache)
        cache.commit(out)  # four blocks and a tail on disk, the last two blocks in the host tier too
        engine.land()
        store.flush()
        return store, engine, torch.cat([out, random_ids(2, 831)], dim=1)

    current = [setup()]
    store, engine, nxt = current[0]
    cache = store.open(model, nxt, session="a")
    assert cache.restored_from["host"] > 0 and cache.restored_from["disk"] > 0  # both kinds of holds
    del cache
    cuts: list[object] = []

    def all_back(sent):
        cuts.append([point[:2] for point in sent])
        store, engine, _ = current[0]
        engine.land()
        store._reap()  # the next call's
        store.forget(session="a")
        engine.land()
        store.flush()
        store._host.pool.reclaim()
        pool = store.stats()["host_pool"]
        assert pool["in_use"] == 0 and pool["retiring"] == 0, (sent, pool)
        store.close()
        current[0] = setup()

    def open_cut():
        store, _, nxt = current[0]
        store.open(model, nxt, session="a")
        return nullcontext()

    within = {"open", "_let_go_leases", "into", "alloc", "_read_disk_blocks"}
    assert raised_on_the_way_in(open_cut, all_back, within=within) > 20
    assert {("call", "_let_go_leases"), ("call", "hold_in"), ("call", "unhold_from"),
            ("c_return", "alloc")} <= {c[0] for c in cuts}
    for store in made:
        store.close()
