"""Subprocess for tests/test_crash.py: commits conversations forever, flushing now and then.

    python tests/_crash_child.py PATH SEED [churn] [nolinger]
    python tests/_crash_child.py PATH tail|tail_then_forget|unindexed_heads|uncommitted copied|record|head

After every third conversation it calls ``store.flush()`` and prints ``FLUSHED <i>``: every
conversation up to ``i`` is then durable. Between flushes, commits keep spilling through the
background writer, so a SIGKILL lands at a random point of the write path. With ``churn`` the
disk budget holds a few conversations only (evictions delete records while others are written)
and every conversation ``i`` with ``i % 5 == 4`` is forgotten right after its commit, so kills
also land in deletes and scrubs. Not collected by pytest.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from conftest import make_model, random_ids  # noqa: E402
import tierkv.store  # noqa: E402
from tierkv import TieredStore  # noqa: E402


def conversation(seed: int, i: int):
    return random_ids(20 + i % 7, seed * 1000 + i)


CHURN_DISK_BUDGET = 512 << 10  # about 15 conversations


def forgotten(i: int) -> bool:
    return i % 5 == 4


def main(path: str, seed: int, churn: bool, linger: bool = True) -> None:
    if not linger:
        # The writer then takes each turn's blocks at once, so that kills land inside its
        # transactions between flushes too, not only inside flush().
        tierkv.store.WRITE_LINGER_S = 0.0
    model = make_model("llama")
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0,
                        disk_budget=CHURN_DISK_BUDGET if churn else "256GiB")
    print("READY", flush=True)
    for i in range(10_000):
        ids = conversation(seed, i)
        cache = store.open(model, ids, session=f"s{i}")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
        if churn and forgotten(i):
            store.forget(session=f"s{i}")
        if i % 3 == 2:
            store.flush()
            print(f"FLUSHED {i}", flush=True)


def tail(path: str) -> None:
    """Two turns of one session, the first flushed; killed inside the transaction that deletes
    the first turn's partial tail, which the second turn's longer chain replaced (exit 9)."""
    from tierkv.tiers.disk import DeleteBlocks, DiskTier

    model = make_model("llama")
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0, disk_budget="256GiB")
    ids = random_ids(9, 7)
    cache = store.open(model, ids, session="s")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    cache.commit(out)  # 10 tokens: two blocks and a 2-token tail
    store.flush()
    print("FLUSHED", out.shape[1] - 1, flush=True)
    nxt = torch.cat([out, torch.tensor([[5, 6]])], dim=1)
    cache = store.open(model, nxt, session="s")
    out = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
    apply_one = DiskTier._apply_one

    def dying(self: DiskTier, txn: object, op: object, batch: object) -> None:
        apply_one(self, txn, op, batch)
        if isinstance(op, DeleteBlocks) and op.superseded:
            os._exit(9)  # the tail's record is zeroed in the map; its transaction never commits

    DiskTier._apply_one = dying  # type: ignore[method-assign]
    cache.commit(out)  # 16 tokens: four blocks, the first tail's tokens in the third
    store.flush()


def tail_then_forget(path: str) -> None:
    """Session A's flushed tail, which B does not share, replaced by A's next turn, and A forgotten
    in the same writer batch; killed just before the transaction that deletes the tail (exit 9)."""
    from tierkv.tiers.disk import DiskTier

    tierkv.store.WRITE_LINGER_S = 5.0  # the turn's writes wait for the forget's: one batch
    model = make_model("llama")
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0, disk_budget="256GiB")
    ids = random_ids(9, 7)
    cache = store.open(model, ids, session="A")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    cache.commit(out)  # two blocks and a 2-token tail
    other = torch.cat([out[:, :8], torch.tensor([[11, 12, 13]])], dim=1)
    cache = store.open(model, other, session="B")  # shares A's two blocks
    cache.commit(model.generate(other, past_key_values=cache, max_new_tokens=1, do_sample=False))
    store.flush()
    nxt = torch.cat([out, torch.tensor([[5, 6]])], dim=1)
    cache = store.open(model, nxt, session="A")
    cache.commit(model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False))
    apply = DiskTier._apply

    def dying(self: DiskTier, ops: object, trailing: bool = False) -> object:
        if trailing:
            os._exit(9)
        return apply(self, ops, trailing)  # type: ignore[arg-type]

    DiskTier._apply = dying  # type: ignore[method-assign]
    store.forget(session="A")
    store.flush()


def uncommitted(path: str, where: str) -> None:
    """A session's turn killed inside the write transaction of its blocks (exit 9): ``copied``
    at the first look for where LMDB put a value (just after the copy into the map of the first
    one), ``record`` once its first block's record is written, ``head`` as its first head is
    made. Sessions forgotten before it left free pages for LMDB to reuse."""
    from tierkv.tiers import disk, heads
    from tierkv.tiers.disk import DiskTier

    model = make_model("llama")
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0, disk_budget="256GiB")
    for i in range(3):
        ids = random_ids(40, 100 + i)
        cache = store.open(model, ids, session=f"old{i}")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
        store.forget(session=f"old{i}")
        store.flush()
    encode = disk.encode_array

    def dying(*args: object, **kwargs: object) -> object:
        encode(*args, **kwargs)  # type: ignore[arg-type]
        os._exit(9)

    def exit_now(*args: object) -> None:
        os._exit(9)

    if where == "record":
        disk.encode_array = dying  # type: ignore[assignment]
    elif where == "copied":
        DiskTier._offset = exit_now  # type: ignore[method-assign]
    else:
        heads.encode = exit_now  # type: ignore[assignment]
    ids = random_ids(17, 7)
    cache = store.open(model, ids, session="alice")
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    store.flush()


def unindexed_heads(path: str) -> None:
    """A store whose blocks lost their heads (as an earlier build left them) reopened, and killed
    (exit 9) once the transaction writing their new heads has put them, before its commit."""
    import ctypes

    from tierkv.tiers import vm
    from tierkv.tiers.disk import DiskTier

    model = make_model("llama")
    ids = random_ids(17, 7)
    with TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0) as store:
        cache = store.open(model, ids, session="alice")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
    tier = DiskTier(path, 1 << 30, 4)
    with tier.env.begin(write=True, buffers=True) as txn:
        for key, value in list(txn.cursor(db=tier._heads)):
            ctypes.memset(vm.address(value), 0, len(value))  # their token ids must not stay in free pages
            txn.delete(bytes(key), db=tier._heads)
    tier.close()
    put_heads = DiskTier._put_heads

    def dying(self: DiskTier, *args: object) -> None:
        put_heads(self, *args)  # type: ignore[arg-type]
        os._exit(9)

    DiskTier._put_heads = dying  # type: ignore[method-assign]
    TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0).flush()


if __name__ == "__main__":
    if sys.argv[2] == "uncommitted":
        uncommitted(sys.argv[1], sys.argv[3])
    elif sys.argv[2] == "unindexed_heads":
        unindexed_heads(sys.argv[1])
    elif sys.argv[2] == "tail":
        tail(sys.argv[1])
    elif sys.argv[2] == "tail_then_forget":
        tail_then_forget(sys.argv[1])
    else:
        main(sys.argv[1], int(sys.argv[2]), "churn" in sys.argv[3:], "nolinger" not in sys.argv[3:])
