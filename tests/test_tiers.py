"""tierkv.tiers: byte-budgeted memory tiers, and the LMDB disk tier (writes through ``apply``,
verified reads, scans for rebuilding the index, map growth, and refusal of foreign directories)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import mmap
import os
import pathlib
import random
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import lmdb
import msgpack
import numpy as np
import pytest
import torch
import xxhash

import tierkv.tiers.disk as disk_module
from conftest import damage_in_place, flipped
from benchmarks.micro import drop_cached
from tierkv.codec import CorruptRecord, RecordHeader, encode, head_size, record_size
from tierkv.hashing import token_bytes
from tierkv.tiers import DeviceTier, DiskTier, HostTier
from tierkv.tiers.disk import (
    DeleteBlocks,
    DiskFull,
    DropRefs,
    PutBlock,
    PutHeads,
    PutRefs,
    ScanResult,
    Touch,
    dtype_name,
    op_size,
    tensor_bytes,
)
from tierkv.tiers.heads import OFFSET_UNKNOWN
from tierkv.tiers.memory import MemoryTier
from tierkv.transfer import Job

BLOCK = 4  # tokens per block in these tests
SHAPE = (2, 2, 1, BLOCK, 8)  # layers, k/v, kv_heads, tokens, head_dim
CPU = torch.device("cpu")


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def sid(n: int) -> bytes:
    return b"S" + n.to_bytes(15, "big")


def block_tensor(n: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """Distinct, exactly representable values per block (also in float16 and bfloat16)."""
    numel = 1
    for d in shape:
        numel *= d
    return ((torch.arange(numel, dtype=torch.float32) % 64) * 0.5 + n).reshape(shape).to(dtype)


def header_for(n: int, tensor: torch.Tensor, *, parent: bytes | None = None, tenant: str | None = "acme",
               ids: list[int] | None = None) -> RecordHeader:
    return RecordHeader(
        key=key(n), parent=parent if parent is not None else key(n - 1), tenant=tenant, fingerprint=b"fp",
        dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
        token_ids=token_bytes(ids if ids is not None else list(range(n * BLOCK, n * BLOCK + BLOCK))), seq=n,
    )


MIN_RECORD = mmap.PAGESIZE // 2  # DiskTier.min_record_bytes with LMDB's page size


def put_op(n: int, tensor: torch.Tensor | None = None, **kw: object) -> PutBlock:
    tensor = block_tensor(n) if tensor is None else tensor
    header = header_for(n, tensor, **kw)  # type: ignore[arg-type]
    return PutBlock(header, Job.completed(tensor), record_size(header, MIN_RECORD))


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def craft_record(raw_header: dict[str, object], payload: bytes) -> bytes:
    """A record with any header and a valid checksum: only the header's content is wrong."""
    head = msgpack.packb(raw_header, use_bin_type=True)
    body = struct.pack("<4sI", b"TKVB", len(head)) + head + payload
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def raw_put(tier: DiskTier, db_name: bytes, k: bytes, value: bytes) -> None:
    db = tier.env.open_db(db_name)
    with tier.env.begin(write=True) as txn:
        txn.put(k, value, db=db)


def raw_get(tier: DiskTier, db_name: bytes, k: bytes) -> bytes | None:
    db = tier.env.open_db(db_name)
    with tier.env.begin() as txn:
        return txn.get(k, db=db)


@pytest.fixture
def disk(tmp_path: pathlib.Path) -> Iterator[DiskTier]:
    tier = DiskTier(tmp_path / "store", budget=1 << 30, block_size=BLOCK)
    yield tier
    tier.close()


# -- memory tiers ----------------------------------------------------------------------------------
def put(tier: MemoryTier, k: bytes, t: torch.Tensor) -> bool:
    return tier.put(k, Job.completed(t), t.numel() * t.element_size())


@pytest.mark.parametrize("make", [lambda b: MemoryTier(b, CPU), lambda b: DeviceTier(b, CPU),
                                  lambda b: HostTier(b, pinned=False)])
def test_memory_tier_budget_is_a_hard_cap(make) -> None:  # type: ignore[no-untyped-def]
    t = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    tier = make(100)
    assert tier.used == 0 and len(tier) == 0 and tier.budget == 100
    assert tier.fits(100) and not tier.fits(101)
    assert put(tier, key(1), t) is True
    assert put(tier, key(2), t) is True
    assert tier.used == 80
    assert tier.fits(20) and not tier.fits(21)
    assert put(tier, key(3), t) is False  # would be 120 > 100: refused, not an error
    assert tier.used == 80 and len(tier) == 2 and key(3) not in tier
    assert tier.get(key(3)) is None
    assert put(tier, key(3), torch.zeros(5, dtype=torch.float32)) is True  # exactly 100 fits
    assert tier.used == 100
    assert put(tier, key(4), torch.zeros(1, dtype=torch.uint8)) is False
    assert tier.used == 100


def test_memory_tier_put_pop_get_exact_bytes() -> None:
    tier = MemoryTier(10_000, CPU)
    a = torch.zeros((3, 5), dtype=torch.float16)  # 30 bytes
    b = torch.zeros(7, dtype=torch.float64)  # 56 bytes
    c = torch.zeros((2, 3), dtype=torch.bfloat16)  # 12 bytes
    for n, t in ((1, a), (2, b), (3, c)):
        assert put(tier, key(n), t)
    assert tier.used == 98
    assert len(tier) == 3
    assert key(2) in tier and key(9) not in tier
    assert tier.get(key(1)).wait() is a  # the same immutable tensor, no copy
    assert tier.pop(key(2)).wait() is b
    assert tier.used == 42 and len(tier) == 2 and key(2) not in tier
    assert tier.pop(key(2)) is None
    assert tier.used == 42
    tier.clear()
    assert tier.used == 0 and len(tier) == 0 and tier.get(key(1)) is None


def test_memory_tier_refuses_duplicate_key_without_double_counting() -> None:
    tier = MemoryTier(1000, CPU)
    first = torch.zeros(4)
    assert put(tier, key(1), first)
    assert put(tier, key(1), torch.ones(4)) is False
    assert tier.used == 16
    assert tier.get(key(1)).wait() is first


def test_memory_tier_budget_zero_keeps_nothing() -> None:
    tier = MemoryTier(0, CPU)
    assert put(tier, key(1), torch.zeros(1)) is False
    assert tier.used == 0 and len(tier) == 0


def test_tier_names_and_devices() -> None:
    assert DeviceTier(1, CPU).name == "device"
    assert DeviceTier(1, CPU).device == CPU
    host = HostTier(1, pinned=False)
    assert host.name == "host" and host.device == CPU and host.pinned is False
    assert DiskTier.name == "disk"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_tier_alloc_makes_a_destination(dtype: torch.dtype) -> None:
    t, lease = HostTier(1, pinned=False).alloc((2, 3, 4), dtype)
    assert t.shape == (2, 3, 4) and t.dtype == dtype and t.device == CPU and lease is None
    assert t.is_contiguous() and not t.is_pinned()


def test_host_tier_with_a_pool_holds_the_buffers_of_its_blocks() -> None:
    from tierkv.pool import HostPool

    host = HostTier(1 << 20, pinned=False, pool=HostPool(1 << 20, pinned=False))
    t, lease = host.alloc((4, 8), torch.float32)
    assert lease is not None and t.shape == (4, 8)
    job = Job.completed(t)
    job.lease = lease
    assert host.put(b"k" * 16, job, 128) and lease.holders == 1
    assert host.stats()["in_use"] == 4096
    host.pop(b"k" * 16)
    assert lease.holders == 0 and lease.retired and host.stats()["in_use"] == 0  # back in the pool


def test_a_cleared_host_tier_keeps_no_pool_alive() -> None:
    # The store's close clears the tier and drops its pool, whose arenas (pinned, the host budget
    # and more) must go with it while the user still holds a cache referring to the closed store:
    # nothing checked that the hold records of the blocks resting at close went too (each lease
    # refers to its pool, arenas and all).
    import gc
    import weakref

    from tierkv.pool import HostPool

    pool = HostPool(1 << 20, pinned=False)
    host = HostTier(1 << 20, pinned=False, pool=pool)
    for i in range(2):
        t, lease = host.alloc((4, 8), torch.float32)
        job = Job.completed(t)
        job.lease = lease
        assert host.put(bytes([i]) * 16, job, 128)
    del t, lease, job
    gone = weakref.ref(pool)
    host.clear()
    host.pool = pool = None  # as TieredStore.close
    gc.collect()
    assert gone() is None and len(host) == 0 and host.used == 0


def test_a_host_tier_put_or_pop_another_signals_handler_cuts_short_holds_each_buffer_exactly_while_it_rests() -> None:
    # Before: put made the entry, then held the block's buffer, and pop dropped the entry, then
    # let go of the hold: another signal's handler (a SIGALRM timeout) raising between them left
    # a resting block with no hold, whose pop let go of another holder's (a queued write's), the
    # buffer retired under it, or a hold no one let go, the buffer lost to the pool.
    from tierkv.pool import HostPool

    from conftest import raised_on_the_way_in

    host = HostTier(1 << 20, pinned=False, pool=HostPool(1 << 20, pinned=False))
    jobs = {}
    for i in range(3):
        t, lease = host.alloc((1024,), torch.float32)
        assert lease is not None
        lease.hold()  # another holder's (a queued write's): never let go by the tier
        job = Job.completed(t)
        job.lease = lease
        jobs[bytes([i]) * 16] = job

    def one_hold_left(key: bytes, sent: list) -> None:
        host.pop(key)  # where the cut left it resting, or half popped: its hold let go once
        lease = jobs[key].lease
        assert lease.holders == 1 and not lease.retired and key not in host and host.used == 0, sent

    for key, job in jobs.items():
        assert raised_on_the_way_in(lambda: (host.put(key, job, 4096), contextlib.nullcontext())[1],
                                    lambda sent: one_hold_left(key, sent)) >= 2
        assert key in host and job.lease.holders == 2 and host.used == 4096
        assert raised_on_the_way_in(lambda: (host.pop(key), contextlib.nullcontext())[1],
                                    lambda sent: (one_hold_left(key, sent), host.put(key, job, 4096))) >= 2
        one_hold_left(key, [])
    assert host.stats()["in_use"] == 3 * 4096  # the other holders' still


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_host_tier_pinned_alloc() -> None:
    from tierkv.pool import HostPool

    assert HostTier(1, pinned=True).alloc((4,), torch.float16)[0].is_pinned()
    t, lease = HostTier(1 << 20, pinned=True, pool=HostPool(1 << 20, pinned=True)).alloc((4,), torch.float16)
    assert t.is_pinned() and lease is not None


# -- disk tier: helpers -----------------------------------------------------------------------------
def test_dtype_name_and_tensor_bytes() -> None:
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    assert bytes(tensor_bytes(t)) == struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    assert bytes(tensor_bytes(t.T)) == struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)  # row-major of the view
    assert op_size(put_op(1)) == record_size(header_for(1, block_tensor(1)), MIN_RECORD)
    assert op_size(DeleteBlocks([key(1)])) == 0
    assert op_size(Touch({})) == 0


# -- disk tier: writes and reads -------------------------------------------------------------------
def test_fresh_directory(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "new", "nested")
    tier = DiskTier(path, budget=123, block_size=BLOCK)
    try:
        assert os.path.isfile(os.path.join(path, "data.mdb"))
        assert tier.budget == 123
        scan = tier.scan()
        assert isinstance(scan, ScanResult)
        assert (scan.headers, scan.corrupt, scan.sessions, scan.atime) == ([], [], {}, {})
        with pytest.raises(KeyError):
            tier.load(key(1), empty)
    finally:
        tier.close()


def test_existing_empty_directory_is_accepted(tmp_path: pathlib.Path) -> None:
    tier = DiskTier(tmp_path, budget=1, block_size=BLOCK)
    tier.close()
    assert os.path.isfile(os.path.join(tmp_path, "data.mdb"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_put_then_load_is_exact(disk: DiskTier, dtype: torch.dtype) -> None:
    tensor = block_tensor(3, dtype)
    op = put_op(3, tensor)
    assert disk.apply([op]) == [None]
    header, loaded = disk.load(key(3), empty)
    assert header == op.header
    assert loaded.dtype == dtype and loaded.shape == SHAPE
    assert torch.equal(loaded, tensor)
    assert loaded.data_ptr() != tensor.data_ptr()


def test_load_fills_the_callers_buffer(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    made: list[torch.Tensor] = []

    def tracking_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.full(shape, -1.0, dtype=dtype))
        return made[-1]

    _, loaded = disk.load(key(1), tracking_empty)
    assert len(made) == 1 and loaded is made[0]
    assert made[0].shape == SHAPE and made[0].dtype == torch.float32
    assert torch.equal(loaded, block_tensor(1))


def test_non_contiguous_tensor_is_stored_row_major(disk: DiskTier) -> None:
    base = block_tensor(5, shape=(2, 2, 1, 8, BLOCK))
    view = base.transpose(-1, -2)  # shape SHAPE, not contiguous
    assert not view.is_contiguous()
    disk.apply([put_op(5, view)])
    _, loaded = disk.load(key(5), empty)
    assert torch.equal(loaded, view)


def test_many_blocks_in_one_batch(disk: DiskTier) -> None:
    ops = [put_op(n) for n in range(1, 11)]
    assert disk.apply(ops) == [None] * 10
    for n in range(1, 11):
        header, loaded = disk.load(key(n), empty)
        assert header.seq == n
        assert torch.equal(loaded, block_tensor(n))


def test_load_missing_key_is_a_key_error(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    with pytest.raises(KeyError):
        disk.load(key(2), empty)


def test_reopen_finds_everything(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "store")
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    tier.apply([put_op(1), put_op(2, block_tensor(2, torch.bfloat16)), PutRefs(sid(1), "acme", [key(1)]),
                Touch({key(1): 7, key(2): 9})])
    tier.sync()
    tier.close()
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        assert torch.equal(tier.load(key(2), empty)[1], block_tensor(2, torch.bfloat16))
        scan = tier.scan()
        assert sorted(h.key for h, _ in scan.headers) == [key(1), key(2)]
        assert scan.sessions == {sid(1): ("acme", None, [key(1)])}
        assert scan.atime == {key(1): 7, key(2): 9}
    finally:
        tier.close()


# -- per-op results and atomicity ------------------------------------------------------------------
def test_failed_tensor_job_fails_only_its_op(disk: DiskTier) -> None:
    boom = RuntimeError("copy failed")
    failed: Job[torch.Tensor] = Job()
    failed.set_error(boom)
    bad = PutBlock(header_for(2, block_tensor(2)), failed, 0)
    results = disk.apply([put_op(1), bad, put_op(3)])
    assert results[0] is None and results[2] is None
    assert results[1] is boom
    assert torch.equal(disk.load(key(1), empty)[1], block_tensor(1))
    assert torch.equal(disk.load(key(3), empty)[1], block_tensor(3))
    with pytest.raises(KeyError):
        disk.load(key(2), empty)


def test_header_that_does_not_match_its_tensor_fails_only_its_op(disk: DiskTier) -> None:
    wrong = PutBlock(header_for(2, block_tensor(2)), Job.completed(torch.zeros(3)), 0)
    results = disk.apply([wrong, put_op(1)])
    assert isinstance(results[0], ValueError)
    assert results[1] is None
    with pytest.raises(KeyError):
        disk.load(key(2), empty)


def test_a_failing_batch_commits_nothing(disk: DiskTier) -> None:
    with pytest.raises(TypeError, match="unknown disk operation"):
        disk.apply([put_op(1), Touch({key(1): 3}), "not an op"])  # type: ignore[list-item]
    with pytest.raises(KeyError):
        disk.load(key(1), empty)
    assert disk.scan().atime == {}


# -- corruption --------------------------------------------------------------------------------------
def test_garbage_value_is_corrupt(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    raw_put(disk, b"blocks", key(1), b"garbage bytes, not a record")
    with pytest.raises(CorruptRecord):
        disk.load(key(1), empty)


@pytest.mark.parametrize("where", ["header", "payload", "checksum"])
def test_flipped_byte_in_stored_record_is_corrupt(disk: DiskTier, where: str) -> None:
    disk.apply([put_op(1)])
    damage_in_place(disk.env, disk._blocks, key(1), lambda value: flipped(
        value, {"header": 20, "payload": len(value) - 100, "checksum": len(value) - 1}[where], 0x10))
    with pytest.raises(CorruptRecord):
        disk.load(key(1), empty)


def test_truncated_stored_record_is_corrupt(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    value = raw_get(disk, b"blocks", key(1))
    assert value is not None
    raw_put(disk, b"blocks", key(1), value[:-9])
    with pytest.raises(CorruptRecord):
        disk.load(key(1), empty)


def test_record_under_another_key_is_corrupt(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    value = raw_get(disk, b"blocks", key(1))
    assert value is not None
    raw_put(disk, b"blocks", key(2), value)  # a valid record, but of block 1
    with pytest.raises(CorruptRecord, match="another key"):
        disk.load(key(2), empty)
    scan = disk.scan()
    assert [h.key for h, _ in scan.headers] == [key(1)]
    assert scan.corrupt == [key(2)]


def test_other_format_version_on_disk_is_corrupt(disk: DiskTier) -> None:
    tensor = block_tensor(1)
    header = header_for(1, tensor)
    v2 = dataclasses.replace(header, version=2)
    raw_put(disk, b"blocks", key(1), encode(v2, tensor_bytes(tensor)))
    with pytest.raises(CorruptRecord, match="format version"):
        disk.load(key(1), empty)
    assert disk.scan().corrupt == [key(1)]


def _raw_header(n: int, **changes: object) -> dict[str, object]:
    fields: dict[str, object] = {"v": 1, "key": key(n), "parent": key(0), "tenant": None, "fp": b"fp",
                                 "dtype": "uint8", "shape": [4], "ids": token_bytes([1]), "seq": 1}
    fields.update(changes)
    return fields


def test_negative_dimensions_on_disk_are_corrupt(disk: DiskTier) -> None:
    # A checksummed record whose shape no tensor can have must be a miss, not a RuntimeError
    # from the destination allocation.
    raw_put(disk, b"blocks", key(1), craft_record(_raw_header(1, shape=[-2, -2]), b"\x01\x02\x03\x04"))
    with pytest.raises(CorruptRecord):
        disk.load(key(1), empty)


def test_scan_survives_a_hostile_header(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    raw_put(disk, b"blocks", key(2), craft_record(_raw_header(2, seq=float("inf")), b"\x00" * 4))
    raw_put(disk, b"blocks", key(3), craft_record(_raw_header(3, parent=2**64 - 1), b"\x00" * 4))
    scan = disk.scan()  # rebuilding the index must not crash on records it cannot read
    assert [h.key for h, _ in scan.headers] == [key(1)]
    assert scan.corrupt == [key(2), key(3)]


# -- scan ----------------------------------------------------------------------------------------------
def test_scan_lists_headers_sessions_refs_and_atime(disk: DiskTier) -> None:
    ops = [put_op(n) for n in (1, 2, 3)]
    disk.apply(ops)
    disk.apply([
        PutRefs(sid(1), "acme", [key(1), key(2)]),
        PutRefs(sid(2), None, [key(1)]),
        Touch({key(1): 10, key(3): 30}),
    ])
    raw_put(disk, b"blocks", key(9), b"junk")
    scan = disk.scan()
    assert [(h, size) for h, size in scan.headers] == [(op.header, op.record_bytes) for op in ops]
    assert scan.corrupt == [key(9)]
    assert scan.sessions == {sid(1): ("acme", None, [key(1), key(2)]), sid(2): (None, None, [key(1)])}
    assert scan.atime == {key(1): 10, key(3): 30}


def test_a_dropped_session_takes_every_reference_of_its_own_with_it(disk: DiskTier) -> None:
    # References the store no longer listed for a session (a block write that found the disk
    # full, a commit's references written ahead of blocks never written) outlived its row, and
    # the next reopen called them a damaged session row.
    disk.apply([put_op(1), PutRefs(sid(1), "acme", [key(1), key(2), key(3)]), PutRefs(sid(2), "acme", [key(1)])])
    disk.apply([DropRefs(sid(1), [key(1)], drop_session=True)])
    scan = disk.scan()
    assert scan.bad_sessions == {}
    assert scan.sessions == {sid(2): ("acme", None, [key(1)])}


def test_a_superseded_delete_waits_for_a_transaction_after_the_writes_queued_before_it(
        disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    # A delete zeroes its record in the file before its transaction commits. In the transaction
    # of the blocks that replaced it, a crash before that commit lost both (tests/test_crash.py
    # kills a process there): here the superseded ops fail in their own transaction instead.
    disk.apply([put_op(1), PutRefs(sid(1), "acme", [key(1)])])
    apply_one = DiskTier._apply_one

    def failing(self: DiskTier, txn: object, op: object, batch: object) -> None:
        if isinstance(op, (DeleteBlocks, DropRefs)) and op.superseded:
            raise lmdb.DiskError("the process died here")
        apply_one(self, txn, op, batch)

    monkeypatch.setattr(DiskTier, "_apply_one", failing)
    ops = [put_op(2), PutRefs(sid(1), "acme", [key(2)]), DeleteBlocks([key(1)], [sid(1) + key(1)], superseded=True),
           DropRefs(sid(1), [key(1)], superseded=True), Touch({key(1): 5}), put_op(3)]
    results = disk.apply(ops)
    assert [type(r).__name__ for r in results] == ["NoneType", "NoneType", "DiskError", "DiskError", "NoneType",
                                                   "NoneType"]
    monkeypatch.undo()
    for n in (1, 2, 3):
        assert torch.equal(disk.load(key(n), empty)[1], block_tensor(n))
    assert disk.scan().sessions == {sid(1): ("acme", None, [key(1), key(2)])}
    # One transaction more, and only where a superseded delete follows block writes.
    txns = disk.env.info()["last_txnid"]
    assert disk.apply(ops) == [None] * 6 and disk.env.info()["last_txnid"] == txns + 2
    assert disk.apply([DeleteBlocks([key(3)], superseded=True), put_op(4)]) == [None] * 2
    assert disk.env.info()["last_txnid"] == txns + 3
    with pytest.raises(KeyError):
        disk.load(key(1), empty)


def test_a_timeout_in_a_main_threads_apply_of_superseded_deletes_is_raised_not_their_error(
        disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` at any point of the transaction of superseded deletes
    that follows block writes, in an ``apply`` run by the main thread: raised, what committed
    kept whole. Before, ``apply`` handed it back as those deletes' errors, the timeout lost (no
    main-thread caller sends such a batch today: the CLI's repair writes no blocks)."""
    from conftest import raised_on_the_way_in

    from tierkv.tiers.disk import Scrubbed

    apply, cut_in = DiskTier._apply, []

    def noting(self: DiskTier, ops: list, trailing: bool = False) -> list:
        try:
            return apply(self, ops, trailing)
        except BaseException:
            cut_in.append(trailing)
            raise

    monkeypatch.setattr(DiskTier, "_apply", noting)
    stored = [1]
    assert disk.apply([put_op(1)]) == [None]

    def write() -> contextlib.nullcontext:
        n = stored[-1] + 1
        stored.append(n)
        assert disk.apply([put_op(n), DeleteBlocks([key(n - 1)], superseded=True)]) == [None, None]
        return contextlib.nullcontext()

    scrubbed: set[int] = set()

    def whole(sent: list) -> None:
        if cut_in[-1]:
            # Zeroed by the cut transaction's delete before it aborted (as after a crash): a plain
            # miss from now on. Never the block the write before it committed.
            scrubbed.add(stored[-2])
        disk.apply([])  # what the cut left owed, done
        for n in stored:
            if raw_get(disk, b"blocks", key(n)) is not None:
                try:
                    assert torch.equal(disk.load(key(n), empty)[1], block_tensor(n)), (n, sent)
                except Scrubbed:
                    assert n in scrubbed, (n, sent)
        assert raw_get(disk, b"blocks", key(stored[-1])) is not None or not cut_in[-1], sent

    assert raised_on_the_way_in(write, whole, within={"_apply"}, timeout=True) > 10
    assert True in cut_in and False in cut_in  # both transactions were cut


def test_an_op_on_a_superseded_block_keeps_its_place_after_the_delete(disk: DiskTier) -> None:
    # The same tail written again after its superseded delete (another session committed it),
    # or referenced again: moved past those, the delete would take the block the store holds.
    disk.apply([put_op(1), put_op(2)])
    assert disk.apply([put_op(3), DeleteBlocks([key(1)], superseded=True), put_op(1),
                       DeleteBlocks([key(2)], [sid(1) + key(2)], superseded=True),
                       PutRefs(sid(1), "acme", [key(2)])]) == [None] * 5
    for n in (1, 3):
        assert torch.equal(disk.load(key(n), empty)[1], block_tensor(n))
    with pytest.raises(KeyError):
        disk.load(key(2), empty)
    assert raw_get(disk, b"refs", sid(1) + key(2)) is not None


def test_superseded_ops_wait_behind_nothing_that_names_their_blocks_or_sessions() -> None:
    # A forget queued behind a replaced tail's delete drops all its session's references, the
    # tail's among them (and one of a session that keeps the tail, the reference that the tail's
    # DropRefs writes for it): applied first, a crash before the tail's delete left the tail where
    # no forget finds it (tests/test_crash.py).
    from tierkv.tiers.disk import _transactions

    replaced = [DeleteBlocks([key(1)], [sid(1) + key(1)], superseded=True),
                DropRefs(sid(1), [key(1)], holders=[(sid(2), "acme", key(5))], superseded=True)]
    for forget in (DropRefs(sid(1), [key(3)], drop_session=True), DropRefs(sid(2), [key(4)], drop_session=True),
                   DeleteBlocks([key(3)], [sid(1) + key(3)]), PutRefs(sid(2), "acme", [key(4)]), put_op(1)):
        assert _transactions([put_op(2), *replaced, forget]) == [([0], False), ([1, 2], True), ([3], False)]
    unrelated = DropRefs(sid(3), [key(6)], drop_session=True)
    assert _transactions([put_op(2), *replaced, unrelated, Touch({key(1): 1})]) == [([0, 3, 4], False),
                                                                                   ([1, 2], True)]
    assert _transactions([*replaced, put_op(2)]) == [([0, 1, 2], False)]  # no write before them
    assert _transactions([]) == [([], False)]


def test_scan_record_bytes_are_the_stored_length(disk: DiskTier) -> None:
    op = put_op(1)
    disk.apply([op])
    ((header, size),) = disk.scan().headers
    assert size == len(raw_get(disk, b"blocks", key(1)))  # type: ignore[arg-type]
    assert size == record_size(header, disk.min_record_bytes) == op.record_bytes


def resident_pages(path: str) -> list[bool]:
    """Which pages of ``path`` are in the OS page cache (mincore over a fresh read-only mapping,
    which faults nothing in)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        address = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
        assert libc.mincore(ctypes.c_void_p(address), size, vec) == 0, ctypes.get_errno()
        return [bool(v & 1) for v in vec]


def resident_bytes(path: str) -> int:
    return sum(resident_pages(path)) * mmap.PAGESIZE


def resident_share(path: str, offset: int, length: int) -> float:
    """The share of the pages of ``path`` holding bytes [offset, offset + length) that are cached."""
    pages = resident_pages(path)[offset // mmap.PAGESIZE:-(-(offset + length) // mmap.PAGESIZE)]
    return sum(pages) / len(pages)


BIG = (2, 2, 4, BLOCK, 1024)  # 256 KiB of float32: a record on LMDB overflow pages of its own


def big_op(n: int) -> PutBlock:
    return put_op(n, block_tensor(n, shape=BIG))


def cold_store(path: pathlib.Path, blocks: Iterable[int], zeroing: bool = False) -> str:
    """A closed store of ``big_op`` blocks, its file evicted from the page cache; the data file's
    path. Skips where the filesystem keeps its pages whatever is advised (tmpfs), or, with
    ``zeroing``, cannot zero a range without writing it."""
    ops = [big_op(n) for n in blocks]
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        assert tier.apply(ops) == [None] * len(ops)
        tier.sync()
    finally:
        tier.close()
    data = str(path / "data.mdb")
    drop_cached(data)
    if resident_bytes(data) > 0:
        pytest.skip("this filesystem keeps the file's pages cached whatever is advised (tmpfs?)")
    if zeroing:
        with open(data, "r+b") as f:
            if not disk_module.vm.zero_range(f.fileno(), 1 << 40, 4096):
                pytest.skip("this filesystem cannot zero a range without writing it")
    return data


@contextlib.contextmanager
def opened(path: pathlib.Path) -> Iterator[DiskTier]:
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        yield tier
    finally:
        tier.close()


def test_scan_reads_the_heads_not_the_records(tmp_path: pathlib.Path) -> None:
    # py-lmdb touches every page of a value it returns, so a scan that read each record's header
    # from its record read the whole store: 1 GiB in 20 s at a reopen from a cold page cache.
    path = tmp_path / "store"
    data = cold_store(path, range(1, 33))  # 8 MiB of records
    ops = [big_op(n) for n in range(1, 33)]
    with opened(path) as tier:
        scan = tier.scan()
        assert [(h, size) for h, size in scan.headers] == [(op.header, op.record_bytes) for op in ops]
        assert not scan.unindexed
        records = sum(op.record_bytes for op in ops)
        assert resident_bytes(data) < records // 8  # the heads and the B-trees, not the records
        _, loaded = tier.load(key(7), empty)  # a record itself is still read whole
        assert torch.equal(loaded, block_tensor(7, shape=BIG))


def places(tier: DiskTier) -> dict[bytes, tuple[int, int]]:
    """Where the tier knows each record lies: key -> (offset, length)."""
    return {k: tier._place(k) for k in tier._where}


def records_where_heads_say(tier: DiskTier, path: pathlib.Path) -> dict[bytes, bytes]:
    """Each block's bytes read from the file at the offset its head keeps, by plain file I/O."""
    data = (path / "data.mdb").read_bytes()
    return {k: data[offset:offset + length] for k, (offset, length) in places(tier).items()}


def test_heads_know_where_each_record_lies_in_the_file(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_module, "_INITIAL_MAP", 1 << 20)  # so that the map moves as it grows
    path = tmp_path / "store"
    shape = (2, 2, 4, BLOCK, 256)
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        for n in range(1, 25):  # one at a time: the map grows (and moves) between some of them
            assert tier.apply([put_op(n, block_tensor(n, shape=shape))]) == [None]
        tier.apply([DeleteBlocks([key(3)])])
        tier.sync()
        records = {key(n): raw_get(tier, b"blocks", key(n)) for n in range(1, 25) if n != 3}
        assert tier.env.info()["map_size"] > 1 << 20
        assert records_where_heads_say(tier, path) == records
    finally:
        tier.close()
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        assert tier._where == {}
        tier.scan()  # after a reopen, from the heads
        assert records_where_heads_say(tier, path) == records
    finally:
        tier.close()


def test_a_records_place_is_kept_as_one_int_and_read_back_whole(disk: DiskTier) -> None:
    # Memory (h110): a tuple of two ints took 112 B a block, one int 36; a place past 4 GiB and a
    # length past 4 GiB (none is; LMDB's values are below it) read back as they were.
    assert disk.apply([put_op(1, block_tensor(1)), put_op(2, block_tensor(2))]) == [None, None]
    assert [type(place) for place in disk._where.values()] == [int, int]
    offset, length = disk._place(key(1))
    assert disk._where[key(1)] == offset << disk_module._LENGTH_BITS | length and 0 < length < 1 << 20
    assert disk._place(key(3)) is None
    disk._where[key(3)] = (5 << 40) + 7 << disk_module._LENGTH_BITS | (1 << 39) + 3
    assert disk._place(key(3)) == ((5 << 40) + 7, (1 << 39) + 3)


def test_prefetch_reads_the_records_before_load(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store"
    data = cold_store(path, range(1, 17))
    with opened(path) as tier:
        tier.scan()
        where = places(tier)
        wanted, others = [key(n) for n in range(1, 17, 2)], [key(n) for n in range(2, 17, 2)]
        assert all(resident_share(data, *where[k]) < 0.5 for k in wanted)  # opening read little of them
        tier.prefetch([*wanted, key(99)])  # an unknown block is skipped
        deadline = time.monotonic() + 10
        while not all(resident_share(data, *where[k]) == 1 for k in wanted) and time.monotonic() < deadline:
            time.sleep(0.01)  # the reads run in the kernel, asynchronously
        assert all(resident_share(data, *where[k]) == 1 for k in wanted)
        assert sum(resident_share(data, *where[k]) for k in others) < len(others) / 2  # not the others
        for n in range(1, 17, 2):
            assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG))


def readahead_asked(monkeypatch: pytest.MonkeyPatch, tier: DiskTier) -> Callable[[], list[tuple[int, int]]]:
    """From now on, the readahead requests (``MADV_WILLNEED``) made of the OS, passed on to it:
    read as (start, end) offsets into ``tier``'s map."""
    advised: list[tuple[int, int]] = []
    real = disk_module.vm.madvise

    def madvise(start: int, length: int, advice: int) -> bool:
        if advice == disk_module.vm.MADV_WILLNEED:
            advised.append((start, length))
        return real(start, length, advice)

    monkeypatch.setattr(disk_module.vm, "madvise", madvise)
    return lambda: [(start - tier._map_start, start - tier._map_start + length) for start, length in advised]


def test_prefetch_asks_no_readahead_of_records_the_page_cache_holds(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A readahead request walks every page of its range even where all are cached: it was 15% of a
    # read of 256 MiB from the page cache. Records with a page missing still get one.
    path = tmp_path / "store"
    data = cold_store(path, range(1, 4))
    with opened(path) as tier:
        tier.scan()
        where = places(tier)
        assert tier.load(key(1), empty)[1].equal(block_tensor(1, shape=BIG))  # now cached, every page
        assert resident_share(data, *where[key(1)]) == 1
        assert ctypes.string_at(tier._map_start + where[key(2)][0], 1)  # one page of key 2 (MADV_RANDOM)
        assert 0 < resident_share(data, *where[key(2)]) < 1
        asked = readahead_asked(monkeypatch, tier)
        tier.prefetch([key(1), key(2), key(3)])
        page = disk_module.vm.PAGE
        covered = asked()
        wanted = [((where[k][0]) // page * page, where[k][0] + where[k][1]) for k in (key(2), key(3))]
        assert covered == wanted
        for n in (1, 2, 3):
            assert tier.load(key(n), empty)[1].equal(block_tensor(n, shape=BIG))


def test_the_advice_for_writes_starts_on_the_oss_pages(tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # On a kernel of 64 KiB pages LMDB's are at most 32 KiB: the advice at the end of the pages in
    # use started inside an OS page, and the kernel refused it (no readahead for fresh writes).
    advised: list[tuple[int, int, int]] = []
    with opened(tmp_path / "store") as tier:
        monkeypatch.setattr(disk_module.vm, "PAGE", 16 * tier.page_size)
        monkeypatch.setattr(disk_module.vm, "madvise",
                            lambda start, length, advice: advised.append((start, length, advice)) or True)
        assert tier.apply([big_op(1)]) == [None]
        assert tier.file_bytes() % disk_module.vm.PAGE  # its end inside an OS page
        assert advised and all((start - tier._map_start) % disk_module.vm.PAGE == 0 for start, _, _ in advised)
        assert sum(length for _, length, advice in advised[:2]) == tier.env.info()["map_size"]
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))


def test_prefetch_asks_the_page_cache_once_a_run_of_records_lying_together(tmp_path: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Once a record, the question was most of a short restore's prefetch, right after a forward.
    path = tmp_path / "store"
    ops = [big_op(n) for n in range(1, 9)]
    asked: list[tuple[int, int]] = []
    real = disk_module.vm.residency

    def residency(start: int, length: int) -> bytearray | None:
        asked.append((start, length))
        return real(start, length)

    with opened(path) as tier:
        assert tier.apply(ops) == [None] * len(ops)  # one transaction: its records lie in a row
        monkeypatch.setattr(disk_module.vm, "residency", residency)
        tier.prefetch([key(n) for n in (7, 2, 3)])  # 2 and 3: one run; 7 after a gap of records
        assert len(asked) == 2
        asked.clear()
        tier.prefetch([key(n) for n in range(1, 9)])
        assert len(asked) == 1
        first = min(tier._place(key(n))[0] for n in range(1, 9)) // tier.page_size * tier.page_size
        assert asked[0][0] == tier._map_start + first
        for n in range(1, 9):
            assert tier.load(key(n), empty)[1].equal(block_tensor(n, shape=BIG))


@pytest.mark.parametrize("ratio", [0.5, 2])
def test_prefetch_counts_the_oss_pages_where_lmdbs_differ(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                          ratio: float) -> None:
    # LMDB's page is 32 KiB at most, half a page of a 64 KiB-page kernel, and a store keeps the
    # page size it was made with: mincore's answer (one byte an OS page) sliced in LMDB's pages
    # judged the records past a run's first ones cached, and asked no readahead of them.
    path = tmp_path / "store"
    cold_store(path, range(1, 9))  # one transaction: its records lie in a row, one run
    with opened(path) as tier:
        tier.scan()
        where = places(tier)
        assert tier.load(key(1), empty)[1].equal(block_tensor(1, shape=BIG))  # now cached, every page
        asked = readahead_asked(monkeypatch, tier)
        monkeypatch.setattr(tier, "page_size", int(disk_module.vm.PAGE * ratio))
        tier.prefetch([key(n) for n in range(1, 9)])
        page = disk_module.vm.PAGE
        assert asked() == [(where[key(n)][0] // page * page, sum(where[key(n)])) for n in range(2, 9)]


@contextlib.contextmanager
def mapped(path: pathlib.Path) -> Iterator[tuple[int, mmap.mmap]]:
    """A file's read-only map without readahead, and its address."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_RANDOM)
        view = np.frombuffer(m, dtype=np.uint8)
        start = view.__array_interface__["data"][0]
        del view  # no export left open: the map must close even after a failed assertion
        yield start, m


def test_all_resident_answers_from_the_page_cache(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * 64 * 1024)  # 16 MiB
    size = path.stat().st_size
    if resident_share(str(path), 0, size) < 1:
        pytest.skip("this filesystem does not keep the pages just written in the page cache")
    with mapped(path) as (start, m):
        assert disk_module.vm.all_resident(start, len(m))
    drop_cached(str(path))
    if resident_share(str(path), 0, size) == 1:
        pytest.skip("this filesystem keeps its pages whatever is advised (tmpfs)")
    with mapped(path) as (start, m):
        assert not disk_module.vm.all_resident(start, len(m))
        assert m[(5 << 20) + 7] == 7  # one page read in
        assert not disk_module.vm.all_resident(start, len(m))
        assert disk_module.vm.all_resident(start + (5 << 20), 1)


def test_blocks_without_heads_are_read_once_and_given_heads(tmp_path: pathlib.Path) -> None:
    # A store written before heads existed: no heads table at all.
    path = tmp_path / "store"
    ops = [put_op(n) for n in (1, 2, 3)]
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    tier.apply(ops)
    with tier.env.begin(write=True) as txn:
        txn.drop(tier.env.open_db(b"heads", txn=txn), delete=True)
    tier.close()
    before = (path / "data.mdb").read_bytes()
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    try:
        scan = tier.scan()
        assert (path / "data.mdb").read_bytes() == before  # opening and scanning wrote nothing
        assert [(h, size) for h, size in scan.headers] == [(op.header, op.record_bytes) for op in ops]
        records = {n: raw_get(tier, b"blocks", key(n)) for n in (1, 2, 3)}
        assert {k: head for k, (head, _) in scan.unindexed.items()} == {
            key(n): records[n][:head_size(op.header, MIN_RECORD)] for n, op in zip((1, 2, 3), ops)}
        assert tier.apply([PutHeads(scan.unindexed), put_op(4)]) == [None, None]
        again = tier.scan()
        assert [h.key for h, _ in again.headers] == [key(n) for n in (1, 2, 3, 4)]
        assert not again.unindexed and not again.orphans and not again.corrupt
        assert tier.verify().bad == [] and tier.verify().stale == {}
    finally:
        tier.close()


def test_a_damaged_head_falls_back_to_its_record(disk: DiskTier) -> None:
    op = put_op(1)
    disk.apply([op, put_op(2)])
    damage_in_place(disk.env, disk._heads, key(1), lambda head: flipped(head, 10, 0xFF))
    scan = disk.scan()
    assert [h.key for h, _ in scan.headers] == [key(1), key(2)] and scan.headers[0] == (op.header, op.record_bytes)
    assert list(scan.unindexed) == [key(1)] and not scan.corrupt  # indexed from the record, to be re-headed
    checked = disk.verify()
    assert checked.bad == [] and list(checked.stale) == [key(1)] and checked.stale == scan.unindexed
    disk.apply([PutHeads(scan.unindexed)])
    assert not disk.scan().unindexed and disk.verify().stale == {}


def test_heads_for_older_blocks_give_way_at_the_map_s_cap(tmp_path: pathlib.Path) -> None:
    # Rewriting heads is optional: at the cap it is skipped like a block write, never let grow the
    # file past it as a delete may.
    path = tmp_path / "store"
    shape = (2, 2, 4, BLOCK, 32)  # records of 8 KiB, smaller than the heads to write
    tier = DiskTier(path, budget=64 << 10, block_size=BLOCK)
    try:
        tier.apply([put_op(n, block_tensor(n, shape=shape)) for n in range(1, 9)])
        with tier.env.begin(write=True) as txn:
            txn.drop(tier._heads, delete=False)  # as if written before heads existed
        n = 9
        while not isinstance(tier.apply([put_op(n, block_tensor(n, shape=shape))])[0], DiskFull):
            n += 1
        cap, scan = tier.map_cap, tier.scan()
        assert len(scan.unindexed) == 8
        assert tier.apply([PutHeads(scan.unindexed)]) == [None]
        assert tier.map_cap == cap and tier.file_bytes() <= cap
        assert len(tier.scan().unindexed) == 8  # still to do, once there is room
    finally:
        tier.close()



def test_batches_at_the_map_s_cap_take_the_readers_lock_only_where_the_map_changes(tmp_path: pathlib.Path) -> None:
    """At the cap every batch of block writes asked to grow the map (before it, and at its
    MapFullError) and to set it back below the deletes' room after it, each time taking the
    readers' lock exclusively (waiting for every read in progress and holding back new ones)
    though the map stayed as it was: three waits a batch, for nothing."""
    from tierkv.locks import SharedLock

    taken: list[int] = []

    class Counted(SharedLock):
        __slots__ = ()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            taken.append(tier.env.info()["map_size"])
            return super().acquire(blocking, timeout)

    tier = DiskTier(tmp_path / "store", budget=3 << 20, block_size=BLOCK)
    try:
        n = 1
        while not isinstance(tier.apply([big_op(n)])[0], DiskFull):
            n += 1
        tier._resize_lock = Counted(tier._resize_lock.limit)
        size = tier.env.info()["map_size"]
        for m in range(n + 1, n + 5):
            assert isinstance(tier.apply([big_op(m)])[0], DiskFull)
            assert tier.env.info()["map_size"] == size
        assert taken == []
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))  # the readers' side still works
    finally:
        tier.close()


def test_a_head_that_names_another_block_is_not_trusted(disk: DiskTier) -> None:
    disk.apply([put_op(1), put_op(2)])
    other = raw_get(disk, b"heads", key(1))
    assert other is not None
    damage_in_place(disk.env, disk._heads, key(2), lambda _: other)
    scan = disk.scan()
    assert [h.key for h, _ in scan.headers] == [key(1), key(2)] and list(scan.unindexed) == [key(2)]


def test_a_head_without_its_record_is_an_orphan(disk: DiskTier) -> None:
    disk.apply([put_op(1), put_op(2)])
    with disk.env.begin(write=True) as txn:
        txn.delete(key(2), db=disk._blocks)
    scan = disk.scan()
    assert [h.key for h, _ in scan.headers] == [key(1)] and scan.orphans == [key(2)]
    assert disk.verify().bad == [(key(2), "an index entry (head) without its record")]
    disk.apply([DeleteBlocks(scan.orphans)])
    assert raw_get(disk, b"heads", key(2)) is None and disk.verify().bad == []


def test_put_heads_skips_blocks_deleted_meanwhile(disk: DiskTier) -> None:
    disk.apply([put_op(1)])
    head = (raw_get(disk, b"blocks", key(1))[:head_size(put_op(1).header)], 2**64 - 1)  # type: ignore[index]
    disk.apply([DeleteBlocks([key(1)])])
    disk.apply([PutHeads({key(1): head})])
    assert raw_get(disk, b"heads", key(1)) is None and disk.scan().orphans == []


def test_a_zeroed_head_is_a_delete_cut_short(disk: DiskTier) -> None:
    disk.apply([put_op(1), put_op(2)])
    damage_in_place(disk.env, disk._heads, key(1), lambda head: bytes(len(head)))
    scan = disk.scan()
    assert scan.scrubbed == [key(1)] and [h.key for h, _ in scan.headers] == [key(2)] and not scan.corrupt


def test_delete_zeroes_the_head_and_the_record_in_place(disk: DiskTier) -> None:
    op = put_op(1, ids=[7_000_001, 7_000_002, 7_000_003, 7_000_004])
    disk.apply([op])
    disk.sync()
    with disk.env.begin(buffers=True) as txn:
        head = txn.get(key(1), db=disk._heads)
        record = txn.get(key(1), db=disk._blocks)
        head_at = np.frombuffer(head, dtype=np.uint8).__array_interface__["data"][0]
        record_at = np.frombuffer(record, dtype=np.uint8).__array_interface__["data"][0]
        lengths = len(head), len(record)
    disk.apply([DeleteBlocks([key(1)])])
    # The pages where they were, now on LMDB's free list, hold zeros (the map is the file).
    assert ctypes.string_at(head_at, lengths[0]) == bytes(lengths[0])
    assert ctypes.string_at(record_at, lengths[1]) == bytes(lengths[1])


def test_sync_forces_the_map_and_its_zeros_to_disk(disk: DiskTier) -> None:
    """``sync`` (a flush's promise of durability) forces LMDB's sync of the map: the zeros a delete
    writes into the map after its transaction commits reach the disk through it alone. A test
    reading the file cannot tell (the page cache shows the zeros either way): the call is watched."""
    real = disk.env
    forced: list[bool] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def sync(self, force: bool = False) -> None:
            forced.append(force)
            real.sync(force)

    disk.apply([put_op(1)])
    disk.env = Spy()  # type: ignore[assignment]
    try:
        disk.sync()
    finally:
        disk.env = real
    assert forced == [True]


def check_only_block_2_went(tier: DiskTier, data: str | pathlib.Path, offset: int, length: int) -> None:
    """Blocks 1 and 3 load as written; the file holds zeros where block 2's record was."""
    for n in (1, 3):
        assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG))
    with open(data, "rb") as f:
        assert os.pread(f.fileno(), length, offset) == bytes(length)


def test_a_deleted_cold_record_is_zeroed_in_the_file_without_being_read(tmp_path: pathlib.Path) -> None:
    # Zeroing a record through the map read it first, page by page when it was cold (evictions'
    # victims are), and wrote its size in zeros.
    path = tmp_path / "store"
    data = cold_store(path, (1, 2, 3), zeroing=True)
    with opened(path) as tier:
        tier.scan()
        offset, length = tier._place(key(2))
        allocated = os.stat(data).st_blocks * 512
        tier.apply([DeleteBlocks([key(2)])])
        tier.sync()
        page = tier.page_size
        assert resident_share(data, offset + page, length - 2 * page) == 0  # its pages were never read
        assert os.stat(data).st_blocks * 512 >= allocated - 2 * page  # and stay allocated for reuse
        assert key(2) not in tier._where
        check_only_block_2_went(tier, data, offset, length)


def test_a_deleted_record_is_zeroed_in_place_where_cached_and_in_the_file_elsewhere(tmp_path: pathlib.Path) -> None:
    # Zeroing cached pages in the file (FALLOC_FL_ZERO_RANGE) dropped them from the page cache, and
    # the writes that reuse them at the disk budget faulted each one in again: a spill at the
    # budget ran at 0.37 of a raw write. Cached pages are zeroed in place; the rest, unread.
    path = tmp_path / "store"
    data = cold_store(path, (1, 2, 3), zeroing=True)
    with opened(path) as tier:
        tier.scan()
        offset, length = tier._place(key(2))
        page = tier.page_size
        first, last = -(-offset // page) * page, (offset + length) // page * page
        middle = (first + last) // 2 // page * page
        with open(data, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
            os.pread(f.fileno(), middle - first, first)
        assert resident_share(data, first, middle - first) == 1
        assert resident_share(data, middle, last - middle) == 0
        tier.apply([DeleteBlocks([key(2)])])
        tier.sync()
        assert resident_share(data, first, middle - first) == 1  # zeroed in place, still cached
        assert resident_share(data, middle, last - middle) == 0  # zeroed in the file, never read
        check_only_block_2_went(tier, data, offset, length)


@pytest.mark.parametrize("os_says", ["mincore fails", "zero_range fails", "pages alternate"])
def test_a_deleted_record_is_zeroed_whatever_the_os_can_tell_or_do(tmp_path: pathlib.Path, os_says: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2), big_op(3)]) == [None] * 3
        offset, length = tier._place(key(2))
        if os_says == "mincore fails":
            monkeypatch.setattr(disk_module.vm, "resident", lambda start, length: None)
        elif os_says == "zero_range fails":  # on pages it says are not cached (tmpfs, say)
            monkeypatch.setattr(disk_module.vm, "resident",
                                lambda start, length: np.zeros(-(-length // mmap.PAGESIZE), dtype=bool))
            monkeypatch.setattr(disk_module.vm, "zero_range", lambda fd, offset, length: False)
        else:  # runs of one page each, cached and not, alternating
            monkeypatch.setattr(disk_module.vm, "resident",
                                lambda start, length: np.arange(-(-length // mmap.PAGESIZE)) % 2 == 0)
        tier.apply([DeleteBlocks([key(2)])])
        tier.sync()
        check_only_block_2_went(tier, path / "data.mdb", offset, length)


def test_a_retried_batch_does_not_zero_a_record_again(tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A MapFullError aborts the transaction after its deletes zeroed their records in the file;
    # the retry must not read and zero them once more through the map.
    path = tmp_path / "store"
    # Blocks 10.. keep block 1 far from the file's end, where the writes' readahead reads.
    data = cold_store(path, (1, 2, *range(10, 60)), zeroing=True)
    with opened(path) as tier:
        tier.scan()
        offset, length = tier._place(key(1))
        put_records, failed = DiskTier._put_records, []

        def full_once(self, txn, run, batch):
            if run and not failed:
                failed.append(next(iter(run))[0].header.key)
                raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
            return put_records(self, txn, run, batch)

        monkeypatch.setattr(DiskTier, "_put_records", full_once)
        page = tier.page_size
        # LMDB's open reads the file's first pages ahead, a few of them this record's: those are
        # zeroed in place.
        cached = resident_share(data, offset + page, length - 2 * page)
        assert cached < 0.5
        assert tier.apply([DeleteBlocks([key(1)]), big_op(3)]) == [None, None]
        assert failed == [key(3)]
        assert resident_share(data, offset + page, length - 2 * page) == cached
        assert torch.equal(tier.load(key(3), empty)[1], block_tensor(3, shape=BIG))
        with pytest.raises(KeyError):
            tier.load(key(1), empty)


def test_a_record_written_again_leaves_no_copy_of_the_old_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store"
    with opened(path) as tier:
        tier.apply([big_op(1)])
        old = tier._place(key(1))
        tier.apply([put_op(1, block_tensor(5, shape=BIG))])  # the same key, other bytes
        assert tier._place(key(1)) != old
        tier.sync()
        with open(path / "data.mdb", "rb") as f:
            f.seek(old[0])
            assert f.read(old[1]) == bytes(old[1])
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(5, shape=BIG))
        assert tier.verify().bad == [] and tier.verify().stale == {}


def test_a_record_written_twice_in_one_batch_lands_as_the_later_write(tmp_path: pathlib.Path) -> None:
    # Records are put as zeros and filled once their places are noted (_put_records), the
    # batch's block writes gathered by key: a key written again in the batch must land as its
    # later write, the records around it intact.
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2), put_op(1, block_tensor(5, shape=BIG)), big_op(3)]) == [None] * 4
        for n, want in ((1, 5), (2, 2), (3, 3)):
            assert torch.equal(tier.load(key(n), empty)[1], block_tensor(want, shape=BIG))
        assert tier.verify().bad == [] and tier.verify().stale == {}


def record_bytes_at(path: str | pathlib.Path, where: tuple[int, int]) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), where[1], where[0])


def ledger(tier: DiskTier) -> dict | None:
    row = raw_get(tier, b"meta", b"unzeroed")
    return None if row is None else msgpack.unpackb(row)


def test_an_evicted_record_is_zeroed_once_the_next_transaction_commits(tmp_path: pathlib.Path) -> None:
    # Zeroed in the deleting transaction, an evicted record's pages reached the disk twice: as
    # zeros with its commit, and as the blocks that reuse them (LMDB reuses pages a transaction
    # freed from the second one after it on). Zeroed when the next commits, the zeros are still in
    # the page cache when those blocks overwrite them.
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2), big_op(3)]) == [None] * 3
        where = tier._place(key(2))
        written = record_bytes_at(path / "data.mdb", where)
        assert tier.apply([DeleteBlocks([key(2)], evicted=True), big_op(4)]) == [None, None]
        assert raw_get(tier, b"blocks", key(2)) is None and raw_get(tier, b"heads", key(2)) is None
        assert record_bytes_at(path / "data.mdb", where) == written  # free pages, not zeroed yet
        assert tier.owes_zeros and ledger(tier)["ranges"] == [list(where)]
        assert tier.apply([big_op(5)]) == [None]
        assert record_bytes_at(path / "data.mdb", where) == bytes(where[1])
        # Zeroed after that commit, which the row it wrote covers; the next transaction drops it.
        assert ledger(tier)["ranges"] == [list(where)]
        assert tier.apply([]) == [] and ledger(tier) is None and not tier.owes_zeros
        for n in (1, 3, 4, 5):
            assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG))


@pytest.mark.parametrize("then", ["a forget", "no block write"])
@pytest.mark.parametrize("evicted_in", ["an earlier transaction", "the same transaction"])
def test_a_transaction_that_reuses_no_page_zeroes_every_eviction_before_it_commits(
        tmp_path: pathlib.Path, then: str, evicted_in: str) -> None:
    # A forget's flush returns once every delete queued before it has its zeros on disk: they are
    # zeroed before its transaction commits, which syncs them. So does a batch with nothing to
    # reuse their pages (the store's flush ends with one).
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2), big_op(3)]) == [None] * 3
        evicted, forgotten = tier._place(key(2)), tier._place(key(3))
        eviction = DeleteBlocks([key(2)], evicted=True)
        if evicted_in == "an earlier transaction":
            tier.apply([eviction, big_op(4)])
            assert record_bytes_at(path / "data.mdb", evicted) != bytes(evicted[1])
            ops: list = []
        else:
            ops = [eviction]
        ops += [DeleteBlocks([key(3)]), big_op(5)] if then == "a forget" else [Touch({key(1): 7})]
        assert tier.apply(ops) == [None] * len(ops)
        assert record_bytes_at(path / "data.mdb", evicted) == bytes(evicted[1])
        if then == "a forget":
            assert record_bytes_at(path / "data.mdb", forgotten) == bytes(forgotten[1])
        assert ledger(tier) is None and not tier.owes_zeros
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))


def test_pages_of_evicted_records_reused_by_later_blocks_keep_those_blocks(tmp_path: pathlib.Path) -> None:
    # Zeroed one transaction too late, a record's pages would already hold the blocks that reused
    # them: every block is read back after every batch, as batches evict what they write.
    rng = random.Random(0)
    live: dict[int, torch.Tensor] = {}
    n = 0
    with opened(tmp_path / "store") as tier:
        for _ in range(60):
            old = sorted(live)[:rng.randint(0, 3)]
            ops: list = [DeleteBlocks([key(k) for k in old], evicted=True)] if old else []
            for k in old:
                del live[k]
            for _ in range(rng.randint(1, 3)):
                n += 1
                live[n] = block_tensor(n, shape=(2, 2, 4, BLOCK, rng.choice([256, 1024, 2048])))
                ops.append(put_op(n, live[n]))
            assert tier.apply(ops) == [None] * len(ops)
            for k, tensor in live.items():
                assert torch.equal(tier.load(key(k), empty)[1], tensor), k
        assert tier.file_bytes() < n * (256 << 10)  # pages were reused


def test_a_failure_after_a_commit_leaves_no_stale_eviction_to_zero(tmp_path: pathlib.Path) -> None:
    # A remap that raised after a committed batch (at the map's cap) left the previous batch's
    # evictions pending, and the next commit zeroed their pages, which a block had reused since
    # (helper-2). Pending records are swapped as soon as the batch commits.
    rng = random.Random(0)
    tier = DiskTier(tmp_path / "store", budget=3 << 20, block_size=BLOCK)
    fired: list[int] = []
    real = tier._set_map

    def remap_fails_once(size: int) -> None:
        if not fired:
            fired.append(size)
            raise lmdb.Error("remap failed")
        real(size)

    tier._set_map = remap_fails_once  # type: ignore[method-assign]
    live: list[int] = []
    n = 0
    try:
        for _ in range(40):
            m = rng.randint(1, 4)
            old = live[:m] if len(live) > 6 else []
            live = live[len(old):]
            ops: list = [DeleteBlocks([key(k) for k in old], evicted=True)] if old else []
            new = list(range(n + 1, n + 1 + rng.randint(1, 5)))
            n = new[-1]
            ops += [big_op(k) for k in new]
            try:
                results = tier.apply(ops)
            except lmdb.Error:
                results = [None] * len(ops)  # it committed before the remap
            live += [k for k, r in zip(new, results[-len(new):]) if r is None and key(k) in tier._where]
            for k in live:
                assert torch.equal(tier.load(key(k), empty)[1], block_tensor(k, shape=BIG)), k
        assert fired
    finally:
        tier.close()


def test_a_record_written_and_evicted_in_one_transaction_is_zeroed_in_it(disk: DiskTier) -> None:
    # LMDB may reuse, before the commit, the pages of a record written in the same transaction.
    assert disk.apply([big_op(1), DeleteBlocks([key(1)], evicted=True), big_op(2)]) == [None] * 3
    assert not disk.owes_zeros and ledger(disk) is None
    assert torch.equal(disk.load(key(2), empty)[1], block_tensor(2, shape=BIG))


_EVICT_AND_DIE = """
import os, sys
sys.path[:0] = {paths!r}
from tests.test_tiers import big_op, key
from tierkv.tiers.disk import DeleteBlocks, DiskTier
tier = DiskTier({path!r}, budget=1 << 30, block_size=4)
assert tier.apply([big_op(1), big_op(2), big_op(3)]) == [None] * 3
print(*tier._place(key(2)), flush=True)
tier.apply([DeleteBlocks([key(2)], evicted=True), big_op(4)])
os._exit(0)  # a crash before the next transaction
"""


def test_evicted_records_a_crash_left_unzeroed_are_zeroed_at_reopen(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    tests = str(pathlib.Path(__file__).resolve().parent)  # test_tiers imports conftest's helpers
    child = subprocess.run([sys.executable, "-c", _EVICT_AND_DIE.format(paths=[root, tests], path=str(path))],
                           capture_output=True, text=True, timeout=120, cwd=root)
    assert child.returncode == 0, child.stderr
    where = tuple(int(x) for x in child.stdout.split())
    assert record_bytes_at(path / "data.mdb", where) != bytes(where[1])  # the crash left its KV
    with opened(path) as tier:
        tier.scan()
        assert tier.owes_zeros
        tier.apply([])
        assert record_bytes_at(path / "data.mdb", where) == bytes(where[1])
        assert ledger(tier) is None and not tier.owes_zeros
        for n in (1, 3, 4):
            assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG))


@pytest.mark.parametrize("row", ["over a stored block", "damaged"])
def test_a_ledger_that_cannot_be_trusted_zeroes_nothing(tmp_path: pathlib.Path, row: str) -> None:
    # Its records were never where it says, or it cannot be read: zeroing there would destroy
    # what is stored now.
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2)]) == [None, None]
        where = tier._place(key(1))
        with tier.env.begin(write=True) as txn:
            value = b"\xc1" if row == "damaged" else msgpack.packb({"txn": txn.id(), "ranges": [list(where)]})
            txn.put(b"unzeroed", value, db=tier._meta)
    with opened(path) as tier:
        tier.scan()
        tier.apply([])
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))
        assert ledger(tier) is None


@pytest.mark.parametrize("since", ["nothing", "a transaction committed", "one committed after the scan"])
def test_a_ledger_row_is_finished_at_reopen_only_if_no_transaction_committed_after_it(
        tmp_path: pathlib.Path, since: str) -> None:
    # After it, a transaction (an earlier build's, which keeps no ledger) may have reused the pages.
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([big_op(1), big_op(2)]) == [None, None]
        where = tier._place(key(2))
        with tier.env.begin(write=True) as txn:  # deleted without zeroing, the ledger naming it
            txn.delete(key(2), db=tier._blocks)
            txn.delete(key(2), db=tier._heads)
            txn.put(b"unzeroed", msgpack.packb({"txn": txn.id(), "ranges": [list(where)]}), db=tier._meta)
        if since == "a transaction committed":
            raw_put(tier, b"atime", key(1), struct.pack("<Q", 9))
    written = record_bytes_at(path / "data.mdb", where)
    assert written != bytes(where[1])
    with opened(path) as tier:
        tier.scan()
        assert tier.owes_zeros
        if since == "one committed after the scan":
            raw_put(tier, b"atime", key(1), struct.pack("<Q", 9))
        tier.apply([])
        assert record_bytes_at(path / "data.mdb", where) == (bytes(where[1]) if since == "nothing" else written)
        assert ledger(tier) is None
        assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1, shape=BIG))


def test_a_timeout_in_a_main_threads_apply_leaves_what_it_committed_whole(tmp_path: pathlib.Path) -> None:
    """A signal handler's ``TimeoutError`` at any point of ``apply``'s transaction, run by the
    main thread (the CLI's repair, a close after the writer ended): raised, and each block that
    the cut transaction committed reads back whole, as does every earlier one. Before, a cut
    after the commit (the lock file's note dropped, the places learnt, the previous deletes
    zeroed) went to the ``except`` for a failed attempt, which zeroed the records the
    transaction had just committed: blocks read as damaged from then on."""
    from conftest import raised_on_the_way_in

    with opened(tmp_path / "store") as tier:
        written = [0]

        def write() -> contextlib.nullcontext:
            written[0] += 1
            n = written[0]
            assert tier.apply([put_op(n), DeleteBlocks([key(n - 1)], evicted=True)]) == [None, None]
            return contextlib.nullcontext()

        def whole(sent: list) -> None:
            for n in range(1, written[0] + 1):
                if raw_get(tier, b"blocks", key(n)) is not None:
                    assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n)), (n, sent)

        assert raised_on_the_way_in(write, whole, within={"_apply"}, timeout=True) > 20
        whole([])


def test_a_timeout_as_a_main_threads_apply_notes_its_writes_or_zeroes_evictions_is_raised(
        tmp_path: pathlib.Path) -> None:
    """A signal handler's ``TimeoutError`` at any point of the lock file's note of a write
    (``_intend``), its drop after the commit, and the zeroing of evicted records, in an ``apply``
    run by the main thread (the CLI's, a close's): raised, each evicted record zeroed all the
    same (those after a cut one too), each stored block whole. Before, each ``except`` took it
    for the lock file's or the zeroing's failure: logged, or passed over, and the timeout lost."""
    from conftest import raised_on_the_way_in

    path = tmp_path / "store"
    with opened(path) as tier:
        stored: list[int] = []
        evicted: list[tuple[bytes, tuple[int, int]]] = []

        def write() -> contextlib.nullcontext:
            a, b, c = (len(stored) + n for n in (1, 2, 3))
            stored.extend([a, b, c])
            assert tier.apply([big_op(a), big_op(b)]) == [None, None]
            evicted[:] = [(key(a), tier._place(key(a))), (key(b), tier._place(key(b)))]
            assert tier.apply([DeleteBlocks([key(a), key(b)], evicted=True), big_op(c)]) == [None, None]
            assert tier.apply([]) == []  # no block write: the evicted records are zeroed now
            return contextlib.nullcontext()

        def whole(sent: list) -> None:
            tier.apply([])  # what the cut left owed, done
            for k, where in evicted:
                if raw_get(tier, b"blocks", k) is None:
                    assert record_bytes_at(path / "data.mdb", where) == bytes(where[1]), sent
            for n in stored:
                if raw_get(tier, b"blocks", key(n)) is not None:
                    assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG)), (n, sent)

        # Apart: a cut leaves a note to drop, so later runs take other paths, and the zeroing's
        # points, last, were never reached in one run over all three.
        assert raised_on_the_way_in(write, whole, within={"_intend", "_intent_done"}, timeout=True) > 10
        assert raised_on_the_way_in(write, whole, within={"_zero"}, timeout=True) >= 2


def test_a_timeout_as_an_aborted_attempts_records_are_zeroed_is_raised_not_retried_past(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` as a main thread's ``apply`` (the CLI's, a close's)
    zeroes what an attempt that hit ``MapFullError`` wrote (``_zero_written``): raised, every
    place that attempt wrote zeroed all the same. Before, its ``except Exception`` logged it as a
    failed zeroing: the places after the cut one kept their KV, and the retry went on as if the
    call had never been cut, the timeout lost."""
    from conftest import raised_on_the_way_in

    path = tmp_path / "store"
    put_records = DiskTier._put_records
    written: list[tuple[int, int]] = []

    def full_after_writing(self, txn, run, batch):
        put_records(self, txn, run, batch)
        if run and not written:
            written.extend(batch.written)
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")

    monkeypatch.setattr(DiskTier, "_put_records", full_after_writing)
    # ctypes calls are not seen by the profiler, where CPython runs a pending handler as they
    # return: through a Python function the cut lands there too.
    memset = ctypes.memset
    monkeypatch.setattr(ctypes, "memset", lambda *args: memset(*args))
    with opened(path) as tier:
        stored: list[int] = []

        def write() -> contextlib.nullcontext:
            written.clear()
            a, b = len(stored) + 1, len(stored) + 2
            stored.extend([a, b])
            assert tier.apply([big_op(a), big_op(b)]) == [None, None]
            return contextlib.nullcontext()

        def zeroed(sent: list) -> None:
            assert len(written) == 4, sent  # two records and their heads
            for where in written:
                assert record_bytes_at(path / "data.mdb", where) == bytes(where[1]), (where, sent)
            for n in stored:
                if raw_get(tier, b"blocks", key(n)) is not None:
                    assert torch.equal(tier.load(key(n), empty)[1], block_tensor(n, shape=BIG)), (n, sent)

        assert raised_on_the_way_in(write, zeroed, within={"_zero_written"}, timeout=True) >= 4


def test_a_timeout_as_a_scan_reads_a_session_row_or_the_ledger_is_raised(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` at any point of ``scan``'s reads of a session row and
    of the ledger of evicted records (a store's opening) reaches the caller. Before, each
    ``except Exception`` took it for a damaged row: the store dropped the session and its KV as
    damage, or zeroed nothing the ledger named (evicted KV left readable in free pages)."""
    from conftest import raised_on_the_way_in

    original = tmp_path / "original"
    with opened(original) as tier:
        assert tier.apply([big_op(1), big_op(2), PutRefs(sid(1), "acme", [key(1)])]) == [None] * 3
        where = tier._place(key(2))
        with tier.env.begin(write=True) as txn:  # deleted without zeroing, the ledger naming it
            txn.delete(key(2), db=tier._blocks)
            txn.delete(key(2), db=tier._heads)
            txn.put(b"unzeroed", msgpack.packb({"txn": txn.id(), "ranges": [list(where)]}), db=tier._meta)
    path = tmp_path / "store"
    tiers: list[DiskTier] = []
    # msgpack's unpackb is a Cython function: the profiler sees no return of it, where CPython
    # runs a pending handler. Through a Python function the cut lands there too.
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *args, **kwargs: unpackb(*args, **kwargs))

    def scan() -> contextlib.nullcontext:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(original, path)  # a close zeroes what the ledger names
        tiers.append(DiskTier(path, budget=1 << 30, block_size=BLOCK))
        result = tiers[-1].scan()
        # Uncut: the row and the ledger read as written.
        assert result.sessions == {sid(1): ("acme", None, [key(1)])} and not result.bad_sessions
        assert tiers[-1]._unzeroed == [where]
        return contextlib.nullcontext()

    def closed(sent: list) -> None:
        tiers.pop().close()

    assert raised_on_the_way_in(scan, closed, within={"_session_row", "_ledger_ranges"}, timeout=True) >= 2
    tiers.pop().close()


def test_a_ledger_row_holds_only_while_no_transaction_committed_after_it() -> None:
    # A later transaction (an earlier build's, which keeps no ledger) may have reused the pages.
    row = msgpack.packb({"txn": 41, "ranges": [[4112, 8192], [16400, 4096]]})
    assert disk_module._ledger_ranges(row, 41) == [(4112, 8192), (16400, 4096)]
    assert disk_module._ledger_ranges(row, 42) == []
    assert disk_module._ledger_ranges(msgpack.packb({"txn": 41, "ranges": [[-1, 5], ["x", 5]]}), 41) == []
    assert disk_module._ledger_ranges(msgpack.packb([1, 2]), 41) == []


def test_a_wrong_place_never_zeroes_another_record(tmp_path: pathlib.Path) -> None:
    with opened(tmp_path / "store") as tier:
        tier.apply([big_op(1), big_op(2)])
        tier._where[key(1)] = tier._where[key(2)]  # as if the bookkeeping had gone stale
        tier.apply([DeleteBlocks([key(1)])])
        assert torch.equal(tier.load(key(2), empty)[1], block_tensor(2, shape=BIG))
        offset, length = tier._place(key(2))  # a place off by a page: LMDB's page header disagrees
        tier.apply([big_op(3)])
        tier._where[key(3)] = (offset + tier.page_size) << disk_module._LENGTH_BITS | length
        tier.apply([DeleteBlocks([key(3)])])
        assert torch.equal(tier.load(key(2), empty)[1], block_tensor(2, shape=BIG))
        with pytest.raises(KeyError):
            tier.load(key(1), empty)
        assert tier.verify().bad == [] and tier.verify().stale == {}


def test_records_inside_b_tree_leaves_have_no_place(disk: DiskTier) -> None:
    # A small value lives in a leaf page, which moves with every change to the leaf: a kept
    # offset would soon point at whatever replaced it. This tierkv writes none (an older one did).
    tensor = block_tensor(1)
    raw_put(disk, b"blocks", key(1), encode(header_for(1, tensor), tensor_bytes(tensor)))
    disk.apply([big_op(2)])
    scan = disk.scan()
    assert scan.unindexed[key(1)][1] == OFFSET_UNKNOWN
    disk.apply([PutHeads(scan.unindexed)])
    assert key(1) not in disk._where and key(2) in disk._where
    assert torch.equal(disk.load(key(1), empty)[1], tensor)


def test_small_records_get_pages_of_their_own_and_deletes_zero_them(disk: DiskTier) -> None:
    # A small record inside a B-tree leaf was copied with every change to the leaf, and a delete
    # zeroed only the last copy: of two small records deleted together, the second's KV stayed in
    # the first copy of their leaf, on the free list.
    ops = [put_op(1), put_op(2)]
    assert all(op.header.payload_nbytes < disk.page_size // 4 for op in ops)
    disk.apply(ops)
    with disk.env.begin(buffers=True) as txn:  # where each record lies in the file, as LMDB says
        where = {}
        for n in (1, 2):
            value = txn.get(key(n), db=disk._blocks)
            where[key(n)] = (disk_module.vm.address(value) - disk._map_start, len(value))
    assert places(disk) == where
    assert all(length >= disk.min_record_bytes for _, length in where.values())
    disk.apply([DeleteBlocks([key(1), key(2)])])
    disk.sync()
    with open(pathlib.Path(disk.path) / "data.mdb", "rb") as f:
        for offset, length in where.values():
            assert os.pread(f.fileno(), length, offset) == bytes(length)


def test_touch_overwrites_stamps(disk: DiskTier) -> None:
    disk.apply([put_op(1), Touch({key(1): 5})])
    disk.apply([Touch({key(1): 6, key(2): 1})])
    assert disk.scan().atime == {key(1): 6, key(2): 1}
    assert raw_get(disk, b"atime", key(1)) == struct.pack("<Q", 6)


def test_delete_blocks_removes_records_and_stamps(disk: DiskTier) -> None:
    disk.apply([put_op(1), put_op(2), put_op(3), Touch({key(1): 1, key(2): 2, key(3): 3})])
    assert disk.apply([DeleteBlocks([key(1), key(3), key(7)])]) == [None]  # an absent key is harmless
    scan = disk.scan()
    assert [h.key for h, _ in scan.headers] == [key(2)]
    assert scan.atime == {key(2): 2}
    for n in (1, 3):
        with pytest.raises(KeyError):
            disk.load(key(n), empty)
    assert torch.equal(disk.load(key(2), empty)[1], block_tensor(2))


def test_put_refs_accumulate(disk: DiskTier) -> None:
    disk.apply([PutRefs(sid(1), "t", [key(1)])])
    disk.apply([PutRefs(sid(1), "t", [key(2), key(1)])])
    assert disk.scan().sessions == {sid(1): ("t", None, [key(1), key(2)])}


def test_session_rows_hold_no_name_and_rows_of_earlier_builds_still_read(disk: DiskTier) -> None:
    disk.apply([PutRefs(sid(1), "acme", [key(1)])])
    assert msgpack.unpackb(raw_get(disk, b"sessions", sid(1))) == ["acme"]
    raw_put(disk, b"sessions", sid(2), msgpack.packb([None, "bob"]))  # an earlier build's row
    bad = {3: b"\xc1", 4: msgpack.packb([]), 5: msgpack.packb([7]), 6: msgpack.packb(["t", 5]),
           7: msgpack.packb(["t", "s", "x"]), 8: msgpack.packb("t")}
    for n, value in bad.items():
        raw_put(disk, b"sessions", sid(n), value)
    scan = disk.scan()
    assert scan.sessions == {sid(1): ("acme", None, [key(1)]), sid(2): (None, "bob", [])}
    assert scan.bad_sessions == {sid(n): [] for n in bad}


def test_drop_refs_writes_the_refs_of_the_sessions_keeping_the_blocks(disk: DiskTier) -> None:
    disk.apply([PutRefs(sid(1), "t", [key(1), key(2)])])
    # sid(2)'s own PutRefs never landed: the DropRefs writes the reference that keeps key(1).
    disk.apply([DropRefs(sid(1), [key(1), key(2)], drop_session=True, holders=[(sid(2), "t", key(1))])])
    assert disk.scan().sessions == {sid(2): ("t", None, [key(1)])}
    assert raw_get(disk, b"sessions", sid(1)) is None


def test_drop_refs(disk: DiskTier) -> None:
    disk.apply([PutRefs(sid(1), "t", [key(1), key(2), key(3)]), PutRefs(sid(2), "t", [key(1)])])
    disk.apply([DropRefs(sid(1), [key(1), key(3)])])
    assert disk.scan().sessions == {sid(1): ("t", None, [key(2)]), sid(2): ("t", None, [key(1)])}
    disk.apply([DropRefs(sid(1), [key(2)], drop_session=True)])
    assert disk.scan().sessions == {sid(2): ("t", None, [key(1)])}
    assert raw_get(disk, b"sessions", sid(1)) is None
    disk.apply([DropRefs(sid(9), [key(1)], drop_session=True)])  # unknown session is harmless
    assert disk.scan().sessions == {sid(2): ("t", None, [key(1)])}


def test_ops_apply_in_order_within_a_batch(disk: DiskTier) -> None:
    results = disk.apply([put_op(1), DeleteBlocks([key(1)]), put_op(2), Touch({key(2): 4}), DeleteBlocks([key(2)]),
                          put_op(2, block_tensor(20))])
    assert results == [None] * 6
    with pytest.raises(KeyError):
        disk.load(key(1), empty)
    assert torch.equal(disk.load(key(2), empty)[1], block_tensor(20))
    assert disk.scan().atime == {}


# -- map growth ----------------------------------------------------------------------------------------
def test_map_grows_past_the_initial_size(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "store")
    tier = DiskTier(path, budget=1 << 40, block_size=BLOCK)
    shape = (1, 2, 1, 512, 1024)  # 4 MiB of float32
    n_blocks = 40  # 160 MiB: far more than the initial map
    try:
        initial = tier.env.info()["map_size"]
        assert initial == disk_module._INITIAL_MAP
        ops = []
        for n in range(1, n_blocks + 1):
            tensor = torch.full(shape, float(n))
            tensor[0, 0, 0, 0, :4] = torch.tensor([n, -n, n * 2, n * 3], dtype=torch.float32)
            ops.append(put_op(n, tensor))
        # one batch beyond the map, then single blocks on a full map
        assert tier.apply(ops[:30]) == [None] * 30
        for op in ops[30:]:
            assert tier.apply([op]) == [None]
        assert tier.env.info()["map_size"] > initial
        for n in range(1, n_blocks + 1):
            _, loaded = tier.load(key(n), empty)
            assert loaded.shape == shape
            assert loaded[0, 0, 0, 0, :4].tolist() == [n, -n, n * 2, n * 3]
            assert loaded[0, 1, 0, 511, 1023].item() == n
        assert len(tier.scan().headers) == n_blocks
        tier.sync()
    finally:
        tier.close()
    tier = DiskTier(path, budget=1 << 40, block_size=BLOCK)  # reopened with the small initial map
    try:
        _, loaded = tier.load(key(n_blocks), empty)
        assert loaded[0, 0, 0, 0, :4].tolist() == [n_blocks, -n_blocks, n_blocks * 2, n_blocks * 3]
        assert tier.apply([put_op(99)]) == [None]
        assert torch.equal(tier.load(key(99), empty)[1], block_tensor(99))
    finally:
        tier.close()


# -- refusing foreign or mismatched directories ------------------------------------------------------
def test_reopen_with_other_block_size_raises_with_remedy(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "store")
    DiskTier(path, budget=1, block_size=BLOCK).close()
    with pytest.raises(ValueError) as info:
        DiskTier(path, budget=1, block_size=BLOCK * 2)
    assert f"block_size={BLOCK}" in str(info.value)
    assert "new directory" in str(info.value)
    DiskTier(path, budget=1, block_size=BLOCK).close()  # the env was released; same size still opens


def test_other_store_format_raises_with_remedy(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "store")
    tier = DiskTier(path, budget=1, block_size=BLOCK)
    raw_put(tier, b"meta", b"tierkv", msgpack.packb({"format": 99, "hash": 1, "block_size": BLOCK}))
    tier.close()
    with pytest.raises(ValueError) as info:
        DiskTier(path, budget=1, block_size=BLOCK)
    assert "format 99" in str(info.value)
    assert "new directory" in str(info.value)


def test_non_empty_non_store_directory_raises(tmp_path: pathlib.Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as info:
        DiskTier(tmp_path, budget=1, block_size=BLOCK)
    assert "not a tierkv store" in str(info.value)
    assert "empty directory" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # nothing was created there


def test_a_directory_holding_only_lmdbs_lock_file_opens_as_a_new_store(tmp_path: pathlib.Path) -> None:
    # Another process creating the store there makes lock.mdb before data.mdb: a second process
    # that looked in between was told "not a tierkv store" rather than that the store is in use.
    (tmp_path / "lock.mdb").write_bytes(bytes(8192))
    tier = DiskTier(tmp_path, budget=1 << 20, block_size=BLOCK)
    try:
        assert (tmp_path / "data.mdb").is_file()
    finally:
        tier.close()


def test_file_path_raises(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "a_file"
    path.write_bytes(b"x")
    with pytest.raises(ValueError) as info:
        DiskTier(path, budget=1, block_size=BLOCK)
    assert "is a file" in str(info.value)
    assert "directory" in str(info.value)
    assert path.read_bytes() == b"x"


def _plain_env(path: str, items: dict[bytes, bytes]) -> None:
    env = lmdb.open(path)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()


def _plain_items(path: str) -> dict[bytes, bytes]:
    env = lmdb.open(path, readonly=True)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def test_plain_lmdb_env_raises(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "other")
    _plain_env(path, {b"hello": b"world"})
    with pytest.raises(ValueError) as info:
        DiskTier(path, budget=1, block_size=BLOCK)
    assert "not a tierkv store" in str(info.value)
    assert "new or empty directory" in str(info.value)


def test_plain_lmdb_env_is_left_untouched(tmp_path: pathlib.Path) -> None:
    # Refusing someone else's environment must not first create tierkv's sub-databases in it, nor
    # any file: before, tierkv.lock (with this pid) was left there and LMDB's lock.mdb grown.
    path = os.path.join(tmp_path, "other")
    _plain_env(path, {b"hello": b"world"})
    before = {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)}
    with pytest.raises(ValueError, match="not a tierkv store"):
        DiskTier(path, budget=1, block_size=BLOCK)
    assert {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)} == before
    assert _plain_items(path) == {b"hello": b"world"}


def test_stored_meta_of_a_store_open_in_this_process_says_so(tmp_path: pathlib.Path) -> None:
    """``stored_meta`` of a store this process has open (LMDB refuses a second environment of one
    file in a process) says so and when to call it. Before, LMDB's refusal was answered as "is not
    a tierkv store", of a sound store."""
    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([put_op(1)]) == [None]
        with pytest.raises(ValueError, match="open in this process.*before opening it, or after closing it"):
            DiskTier.stored_meta(path)
    assert DiskTier.stored_meta(path)["block_size"] == BLOCK


@pytest.mark.parametrize("with_lmdb_lock", [True, False], ids=["with lock.mdb", "copied without lock.mdb"])
def test_stored_meta_refuses_a_plain_lmdb_env_writing_nothing_there(tmp_path: pathlib.Path,
                                                                      with_lmdb_lock: bool) -> None:
    # Before: lock.mdb was allocated (made, where missing) and LMDB's read-only environment wrote
    # its reader table there before the missing meta record refused the directory; the server's
    # and the demo's block-size checks call this on whatever directory they are given.
    path = os.path.join(tmp_path, "other")
    _plain_env(path, {b"hello": b"world"})
    if not with_lmdb_lock:
        os.unlink(os.path.join(path, "lock.mdb"))
    before = {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)}
    with pytest.raises(ValueError, match="not a tierkv store"):
        DiskTier.stored_meta(path)
    assert {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)} == before


@pytest.mark.parametrize("keys", [1, 3000], ids=["its main table a leaf", "a branch"])
@pytest.mark.parametrize("writemap", [False, True])
def test_a_plain_lmdb_env_where_an_earlier_build_left_tierkv_lock_is_left_untouched(
        tmp_path: pathlib.Path, keys: int, writemap: bool) -> None:
    # Earlier builds locked a directory before refusing it, so such environments hold a tierkv.lock.
    # An open there took it for a store's: it grew lock.mdb, wrote its pid, and cut a writemap
    # environment's file (sized to its map) to tierkv's map, then refused the missing meta table.
    path = os.path.join(tmp_path, "other")
    env = lmdb.open(path, map_size=64 << 20, writemap=writemap)
    with env.begin(write=True) as txn:
        for i in range(keys):
            txn.put(b"k%06d" % i, b"v")
    env.close()
    pathlib.Path(path, "tierkv.lock").write_text("12345")
    before = {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)}
    for opening in (lambda: DiskTier(path, budget=1 << 20, block_size=BLOCK), lambda: DiskTier.stored_meta(path)):
        with pytest.raises(ValueError, match="holds an LMDB environment that is not a tierkv store"):
            opening()
        assert {name: pathlib.Path(path, name).read_bytes() for name in os.listdir(path)} == before


def test_the_foreign_check_of_a_cold_store_caches_only_the_pages_it_reads(tmp_path: pathlib.Path) -> None:
    # It runs at every open. Read through a buffered file, with the kernel's readahead, it brought
    # 20 to 80 pages of records after the meta pages into the page cache (a 20 MiB store, this VM).
    data = cold_store(tmp_path / "store", range(1, 41))
    disk_module._refuse_foreign(str(tmp_path / "store"))
    # The two meta pages and the main table's root, and a page the kernel may read with the first.
    assert sum(resident_pages(data)) <= 4


@pytest.mark.parametrize("meta_pages", ["sound", "both damaged"])
def test_a_kernel_that_refuses_the_foreign_check_s_read_advice_still_opens_the_store(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, meta_pages: str) -> None:
    # The check, at every open, asks the kernel for random (or, scanning, sequential) reads of
    # data.mdb: a hint, but one that raised (ENOSYS, EINVAL) refused every store there, before its
    # lock, as an OSError out of the constructor, stored_meta and remove_store.
    path = tmp_path / "store"
    tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
    assert tier.apply([put_op(1)]) == [None]
    tier.close()
    asked = []

    advise = os.posix_fadvise

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append(advice)
        if meta_pages == "sound" or advice == os.POSIX_FADV_SEQUENTIAL:  # the scan's own, alone
            raise OSError(errno.ENOSYS, "Function not implemented")
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    if meta_pages == "sound":
        assert DiskTier.stored_meta(path)["block_size"] == BLOCK
        tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
        try:
            assert [header.key for header, _ in tier.scan().headers] == [put_op(1).header.key]
        finally:
            tier.close()
    else:
        with open(path / "data.mdb", "r+b") as f:
            f.write(bytes(2 * os.sysconf("SC_PAGE_SIZE")))
        assert disk_module._holds_store_tables(str(path / "data.mdb")) is True  # the page-by-page scan
        assert os.POSIX_FADV_SEQUENTIAL in asked
    assert asked


def test_an_open_of_a_store_whose_meta_pages_are_both_damaged_reads_few_of_its_pages(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The foreign check looked for a page listing the store's tables page by page (all but the
    # records' later pages), at every open, where the lock file there already let it open: here,
    # with no page left listing them, to the file's end (5000 reads of a 20 MiB store).
    path = tmp_path / "store"
    tier = DiskTier(path, budget=1 << 30, block_size=BLOCK)
    assert tier.apply([big_op(n) for n in range(1, 41)]) == [None] * 40
    tier.close()
    psize = os.sysconf("SC_PAGE_SIZE")
    with open(path / "data.mdb", "r+b") as f:
        f.write(bytes(2 * psize))
        for at in range(2 * psize, os.path.getsize(path / "data.mdb"), psize):
            f.seek(at)
            if b"sessions" in f.read(psize):  # the main table's leaf, and its earlier copies
                f.seek(at)
                f.write(bytes(psize))
    reads = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(offset) or pread(fd, n, offset))
    with pytest.raises(disk_module.DamagedStore):
        DiskTier(path, budget=1 << 30, block_size=BLOCK)
    assert 0 < len(reads) <= 6, len(reads)  # where the meta pages may lie


def test_a_store_without_its_lock_file_opens_and_gets_one(tmp_path: pathlib.Path) -> None:
    # A store copied without tierkv.lock: the lock file is made only where data.mdb lists tierkv's
    # tables, and this one does.
    path = tmp_path / "store"
    tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
    assert tier.apply([put_op(1)]) == [None]
    tier.close()
    (path / "tierkv.lock").unlink()
    tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
    try:
        assert (path / "tierkv.lock").read_text() == str(os.getpid())
        assert len(tier.scan().headers) == 1
    finally:
        tier.close()


@pytest.mark.parametrize("target", ["a file", "nothing"])
def test_a_lock_file_that_is_a_symbolic_link_is_refused(tmp_path: pathlib.Path, target: str) -> None:
    # The lock file is truncated and the pid written into it: through a link, into any file the
    # link names (one this process can write, planted in a shared directory).
    path = tmp_path / "store"
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()
    victim = tmp_path / "victim"
    if target == "a file":
        victim.write_text("not tierkv's")
    (path / "tierkv.lock").unlink()
    (path / "tierkv.lock").symlink_to(victim)
    with pytest.raises(ValueError, match=r"tierkv\.lock' is a symbolic link .*remove the link"):
        DiskTier(path, budget=1 << 20, block_size=BLOCK)
    assert victim.read_text() == "not tierkv's" if target == "a file" else not victim.exists()
    (path / "tierkv.lock").unlink()
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()  # the remedy given


@pytest.mark.parametrize("lock", ["a file", "a link"])
def test_a_timeout_as_the_lock_file_is_looked_at_for_a_link_is_raised(tmp_path: pathlib.Path, lock: str) -> None:
    """A signal handler's ``TimeoutError`` as ``lstat`` returns where ``check_openable`` and an
    open whose lock file is a link ask whether it is one: it reaches the caller. Before,
    ``os.path.islink`` answered False to it: ``check_openable`` said the store could be opened,
    and the open raised ELOOP's ``OSError`` instead of the refusal or the timeout."""
    from conftest import raised_on_the_way_in

    path = tmp_path / "store"
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()
    if lock == "a link":
        (path / "tierkv.lock").unlink()
        (path / "tierkv.lock").symlink_to(tmp_path / "victim")
    looks = {"islink", "_is_link", "stat_or_none"}

    def refused_if_linked(call: Callable[[], object]) -> Callable[[], contextlib.nullcontext]:
        def enter() -> contextlib.nullcontext:
            try:
                call()
            except ValueError as exc:
                assert lock == "a link" and "is a symbolic link" in str(exc)
            else:
                assert lock == "a file"
            return contextlib.nullcontext()
        return enter

    assert raised_on_the_way_in(refused_if_linked(lambda: DiskTier.check_openable(path)),
                                lambda sent: None, looks, timeout=True) >= 1
    if lock == "a link":
        assert raised_on_the_way_in(refused_if_linked(lambda: DiskTier(path, budget=1 << 20, block_size=BLOCK)),
                                    lambda sent: None, looks, timeout=True) >= 1


@pytest.mark.parametrize("handler", ["a timeout", "its own exception"])
def test_a_handlers_exception_as_a_records_header_is_decoded_is_raised_not_taken_for_a_corrupt_record(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, handler: str) -> None:
    """A signal handler's exception as a read decodes a record's header (a restore from disk, in
    the caller's thread) reaches the caller: a ``TimeoutError``, or an ``Exception`` of the
    program's own. Before, the codec's ``except Exception`` took it for garbage: ``CorruptRecord``,
    whose traceback no longer shows the handler, so the store counted a sound block as corrupt and
    dropped it, and the exception was lost (then, re-raising only ``OSError``s, the program's own
    still was)."""
    from conftest import raised_on_the_way_in

    # A Cython function, whose return the profiler does not see (see the scan's test).
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *args, **kwargs: unpackb(*args, **kwargs))
    with opened(tmp_path / "store") as tier:
        assert tier.apply([put_op(1)]) == [None]

        def loaded() -> contextlib.nullcontext:
            assert torch.equal(tier.load(key(1), empty)[1], block_tensor(1))
            return contextlib.nullcontext()

        assert raised_on_the_way_in(loaded, lambda sent: None, within={"_parse_header"},
                                    timeout=handler == "a timeout") > 3


def test_msgpacks_answers_to_a_garbage_header_are_a_corrupt_record() -> None:
    from tierkv.codec import decode_header

    # msgpack's answers to garbage are still a corrupt record, never its own error.
    for garbage in (b"\xc1", b"\x81\x91\x01\x01", b"\xdd\xff\xff\xff\xff", b"\xa2\xff\xfe", b"\x01\x02",
                    b"\x91" * 2000, b"\xc7\x0d\xff" + b"\xff" * 13):
        record = struct.pack("<4sI", b"TKVB", len(garbage)) + garbage + bytes(8)
        with pytest.raises(CorruptRecord, match="unreadable header"):
            decode_header(record)


def test_a_handlers_own_exception_as_the_file_is_verified_is_raised_not_taken_for_damage(
        tmp_path: pathlib.Path) -> None:
    """A signal handler raising an ``Exception`` of the program's own (not an ``OSError``) at any
    point of ``file_damage``'s walk of a sound file (``check``, ``repair`` and every open after a
    crash): raised. Before, it was taken for the verifier's own failure: the file called unsafe,
    damage the store does not have, and the handler's exception lost."""
    from conftest import raised_on_the_way_in
    from tierkv.tiers.disk import file_damage

    path = tmp_path / "store"
    with opened(path) as tier:
        assert tier.apply([put_op(1), PutRefs(sid(1), "acme", [key(1)])]) == [None, None]

    def verified() -> contextlib.nullcontext:
        assert file_damage(path) == disk_module.FileDamage()
        return contextlib.nullcontext()

    assert raised_on_the_way_in(verified, lambda sent: None, within={"file_damage", "verify"}) >= 3


def test_a_timeout_as_an_open_decodes_the_meta_record_is_raised_not_taken_for_damage(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` as ``DiskTier`` (every store's open) decodes the
    store's meta record reaches the caller. Before, its ``except Exception`` took it for a
    damaged record: ``DamagedStore``, saying to delete the directory or repair it."""
    from conftest import raised_on_the_way_in

    path = tmp_path / "store"
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()
    # A Cython function, whose return the profiler does not see (see the scan's test).
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *args, **kwargs: unpackb(*args, **kwargs))
    tiers: list[DiskTier] = []

    def opened() -> contextlib.nullcontext:
        tiers.append(DiskTier(path, budget=1 << 20, block_size=BLOCK))
        return contextlib.nullcontext()

    def closed(sent: list) -> None:
        while tiers:
            tiers.pop().close()

    assert raised_on_the_way_in(opened, closed, within={"_check_meta"}, timeout=True) > 5
    closed([])


def test_a_timeout_as_filesystem_short_looks_at_the_filesystem_is_raised(tmp_path: pathlib.Path) -> None:
    """A signal handler's ``TimeoutError`` as ``filesystem_short`` (a commit's forecast of a disk
    write, in the caller's thread) asks the OS about the data file reaches the caller. Before, its
    ``except OSError`` answered "room enough" to it: the commit went on, evicting durable blocks
    for a write a full filesystem would refuse, and the timeout was lost."""
    from conftest import raised_on_the_way_in

    with opened(tmp_path / "store") as tier:
        def forecast() -> contextlib.nullcontext:
            assert tier.filesystem_short(4096) is None
            return contextlib.nullcontext()

        assert raised_on_the_way_in(forecast, lambda sent: None, within={"_filesystem_short"}, timeout=True) >= 3


def test_a_timeout_as_stored_meta_decodes_the_meta_record_is_raised(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` as ``stored_meta`` (the CLI's and the demo's look at a
    store) decodes the meta record reaches the caller. Before, its ``except Exception`` took it
    for garbage: the store was called damaged (``DamagedStore``) and the timeout lost."""
    from conftest import raised_on_the_way_in

    path = tmp_path / "store"
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()
    # A Cython function, whose return the profiler does not see (see the scan's test).
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *args, **kwargs: unpackb(*args, **kwargs))

    def meta() -> contextlib.nullcontext:
        assert DiskTier.stored_meta(path)["block_size"] == BLOCK
        return contextlib.nullcontext()

    assert raised_on_the_way_in(meta, lambda sent: None, within={"stored_meta"}, timeout=True) > 10


@pytest.mark.parametrize("linked", ["every file", "the lock file alone"])
def test_a_store_whose_files_are_hard_linked_to_another_directory_is_refused(tmp_path: pathlib.Path,
                                                                              linked: str) -> None:
    # `cp -al` (every file linked) made a "copy" that changed with the original, both written in
    # place, and whose lock was the original's: the process holding either store locked the other
    # out. A lock file alone linked to another store's (its data.mdb replaced by a rebuild, say)
    # locked two separate stores as one.
    original, copy = tmp_path / "original", tmp_path / "copy"
    tier = DiskTier(original, budget=1 << 20, block_size=BLOCK)
    assert tier.apply([put_op(1)]) == [None]
    tier.close()
    if linked == "every file":
        shutil.copytree(original, copy, copy_function=os.link)  # what `cp -al` makes
    else:
        tier = DiskTier(copy, budget=1 << 20, block_size=BLOCK)
        assert tier.apply([put_op(2)]) == [None]  # a store of its own
        tier.close()
        (copy / "tierkv.lock").unlink()
        os.link(original / "tierkv.lock", copy / "tierkv.lock")
    files = {p: p.read_bytes() for p in [*original.iterdir(), *copy.iterdir()]}
    # A lock file alone linked: two separate stores, whose remedy must not be `rm -r` of either
    # (it named the `cp -al` copy's, which deleted a store of its own).
    remedy = r"data.mdb' has 2 hard links: .*delete the linked copy .*`cp -a`" if linked == "every file" else \
        r"tierkv.lock' has 2 hard links: this store's data.mdb is its own.* remove this one's \(`rm .*tierkv.lock`"
    for path in (original, copy):
        with pytest.raises(ValueError, match=remedy):
            DiskTier(path, budget=1 << 20, block_size=BLOCK)
        with pytest.raises(ValueError, match=remedy):
            DiskTier.stored_meta(path)
    assert {p: p.read_bytes() for p in [*original.iterdir(), *copy.iterdir()]} == files
    if linked == "every file":
        shutil.rmtree(copy)  # the remedy given
        shutil.copytree(original, copy)
    else:
        (copy / "tierkv.lock").unlink()  # the remedy given: the copy keeps its own store
    for path, key in ((original, 1), (copy, 1 if linked == "every file" else 2)):
        tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
        try:
            assert [header.key for header, _ in tier.scan().headers] == [put_op(key).header.key]
        finally:
            tier.close()


@pytest.mark.parametrize("target", ["a file", "nothing"])
@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_lmdb_s_files_that_are_symbolic_links_are_refused(tmp_path: pathlib.Path, name: str, target: str) -> None:
    # LMDB follows them, and so did tierkv's own opens: lock.mdb's target was extended to tierkv's
    # reader table and rewritten by LMDB; a missing target (either file's) was made outside the
    # directory. data.mdb's target is the store's own file moved to another disk, as a user keeping
    # it there would.
    path = tmp_path / "store"
    tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
    assert tier.apply([put_op(1)]) == [None]
    tier.close()
    elsewhere = tmp_path / "elsewhere"
    if name == "data.mdb" and target == "a file":
        os.replace(path / name, elsewhere)
    else:
        (path / name).unlink()
        if target == "a file":
            elsewhere.write_text("not tierkv's")
    (path / name).symlink_to(elsewhere)
    held = elsewhere.read_bytes() if target == "a file" else None
    files = {p.name: p.read_bytes() for p in path.iterdir() if not p.is_symlink()}
    for opening in (lambda: DiskTier(path, budget=1 << 20, block_size=BLOCK), lambda: DiskTier.stored_meta(path)):
        with pytest.raises(ValueError, match=rf"{name}' is a symbolic link .*(Remove|remove|Replace) the link"):
            opening()
        assert (elsewhere.read_bytes() if elsewhere.exists() else None) == held
        assert {p.name: p.read_bytes() for p in path.iterdir() if not p.is_symlink()} == files
    if name == "data.mdb" and target == "a file":
        os.replace(elsewhere, path / name)  # the remedy given: `mv TARGET LINK`
    else:
        (path / name).unlink()
    tier = DiskTier(path, budget=1 << 20, block_size=BLOCK)
    try:
        assert len(tier.scan().headers) == (0 if name == "data.mdb" and target == "nothing" else 1)
    finally:
        tier.close()


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_a_link_made_after_the_check_is_not_written_through_by_tierkv(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # The check reads the directory before LMDB opens it; a link made in between is refused by
    # tierkv's own opens of the file (O_NOFOLLOW), and the store is released for the next open.
    path = tmp_path / "store"
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()
    elsewhere = tmp_path / "elsewhere"
    if name == "data.mdb":
        os.replace(path / name, elsewhere)
    else:
        (path / name).unlink()
        elsewhere.write_text("not tierkv's")
    (path / name).symlink_to(elsewhere)
    held = elsewhere.read_bytes()
    monkeypatch.setattr(disk_module, "_refuse_links", lambda path: None)
    with pytest.raises(ValueError, match=rf"{name}' is a symbolic link"):
        DiskTier(path, budget=1 << 20, block_size=BLOCK)
    assert elsewhere.read_bytes() == held
    monkeypatch.undo()
    (path / name).unlink()
    if name == "data.mdb":
        os.replace(elsewhere, path / name)
    DiskTier(path, budget=1 << 20, block_size=BLOCK).close()  # neither the lock nor LMDB's environment kept


def test_plain_lmdb_env_with_a_key_named_like_a_sub_database_raises_value_error(tmp_path: pathlib.Path) -> None:
    path = os.path.join(tmp_path, "other")
    _plain_env(path, {b"meta": b"some application's own value"})
    with pytest.raises(ValueError) as info:
        DiskTier(path, budget=1, block_size=BLOCK)
    assert "not a tierkv store" in str(info.value)


def test_a_store_in_use_refused_again_and_again_leaves_no_descriptor_open(tmp_path: pathlib.Path) -> None:
    """Each refusal of a store another holder locks (here another open of it in this process: a
    flock is held per open file description) closes the lock file it opened to ask: a program
    retrying until the holder leaves kept one descriptor more per try."""
    from tierkv.tiers.disk import StoreInUse

    path = str(tmp_path / "kv")
    held = DiskTier(path, 1 << 30, 16)
    try:
        def descriptors() -> int:
            return len(os.listdir("/proc/self/fd"))

        before = descriptors()
        for _ in range(5):
            with pytest.raises(StoreInUse):
                DiskTier(path, 1 << 30, 16)
        assert descriptors() == before
    finally:
        held.close()
