"""Property test: any sequence of open / generate / commit / forget / flush / reopen, and of
damage to the disk's records, over any budgets, restores KV equal to recomputation and never
exceeds a budget; for full-attention models (``StoreMachine``) and for models with sliding-window
layers (``SlidingStoreMachine``), whose layers hold the tokens from ``held_from()`` on."""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
from collections.abc import Iterator

import pytest

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

from conftest import VOCAB, damage_in_place, flipped, make_model, reencoded
from tierkv import TieredCache, TieredStore
from tierkv.cache import TieredSlidingLayer
from tierkv.index import DiskState, Tier
from tierkv.pool import HostPool
from tierkv.transfer import CopyEngine, Job
from test_pool_store import CopyingEngine

MODEL = make_model("llama", seed=0)
BLOCK = 4
# Conversations overlap through a few shared openings, so sharing, divergence and tails all occur.
OPENINGS = [torch.arange(3, 3 + n).unsqueeze(0) for n in (0, 5, 9)]


class LazyCopy(Job):
    """A copy that happens only when someone waits for it: any reader that skips the wait would
    see the source's absence (the job holds no tensor before), so the protocol is checked on CPU."""

    def __init__(self, source) -> None:
        super().__init__()
        self.source = source

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout=None):
        if not self._event.is_set():
            tensor = self.source.wait() if isinstance(self.source, Job) else self.source
            self.set_result(tensor.clone())
        return super().wait(timeout)


class LazyEngine(CopyEngine):
    """The CPU copy engine with every move left in flight until it is waited for."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def to_host(self, src):
        return LazyCopy(src)

    def to_device(self, src):
        return LazyCopy(src)

    def to_device_many(self, srcs):
        return [LazyCopy(src) for src in srcs]


def recomputed_kv(ids: torch.Tensor, model: torch.nn.Module = MODEL) -> DynamicCache:
    """Every token's KV of ``ids``, in every layer: a ``DynamicCache`` without a config keeps them
    all, a sliding layer's too (the model's masks still slide: its KV is the sliding model's)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def assert_holds(cache: TieredCache, reference: DynamicCache, length: int) -> None:
    """Each layer of ``cache`` holds tokens ``[held_from(), length)`` (a sliding layer's handed off
    its device included) with the KV ``reference`` (a recomputation) has for them."""
    for layer, ref in zip(cache.layers, reference.layers):
        start = layer.held_from()
        if isinstance(layer, TieredSlidingLayer):
            keys, values, at = layer.with_staged()
            assert at == start, (at, start)
        else:
            keys, values = layer.keys, layer.values
            assert start == 0, start
        assert keys is not None and values is not None
        assert keys.shape[-2] == values.shape[-2] == length - start, (keys.shape, values.shape, start, length)
        torch.testing.assert_close(keys, ref.keys[:, :, start:length], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, ref.values[:, :, start:length], rtol=1e-5, atol=1e-5)


class StoreMachine(RuleBasedStateMachine):
    conversations = Bundle("conversations")
    model: torch.nn.Module = MODEL

    @initialize(device_blocks=st.integers(0, 4), host_blocks=st.integers(0, 4),
                disk=st.sampled_from([None, 0, 6, 10**9]), engine=st.sampled_from(["handover", "lazy", "pooled"]))
    def start(self, device_blocks: int, host_blocks: int, disk: int | None, engine: str) -> None:
        # One full block of the model: llama's is 2 layers x (K, V) x 2 heads x BLOCK tokens x 16 dims x 4 bytes.
        block_bytes = BLOCK * sum(layer.keys.nbytes + layer.values.nbytes
                                  for layer in recomputed_kv(torch.tensor([[3]]), self.model).layers)
        self.dir = tempfile.mkdtemp(prefix="tierkv-prop-")
        self.kwargs = dict(device_budget=device_blocks * block_bytes, host_budget=host_blocks * block_bytes,
                           disk_budget=(disk * block_bytes * 2 if disk is not None else 0), block_size=BLOCK)
        self.path = self.dir if disk is not None else None
        self.engine = engine
        self.block_bytes = block_bytes
        self.store = self._new_store()
        self.turns = 0
        self.gone: set[bytes] = set()  # records the machine deleted under a durable index entry

    def _new_store(self) -> TieredStore:
        store = TieredStore(self.path, **self.kwargs)
        if self.engine == "lazy":
            store._engine = LazyEngine()
        elif self.engine == "pooled":
            # CUDA's semantics on CPU: real copies into a small, poisoning pool of host buffers.
            store._host.pool = HostPool(3 * self.block_bytes, pinned=False, poison=True,
                                        arena_bytes=2 * self.block_bytes)
            store._engine = CopyingEngine(store._host.alloc)
        return store

    @rule(share=st.floats(0.0, 1.0))
    def copies_land(self, share: float) -> None:
        if self.engine == "pooled":
            self.store._engine.land(random.Random(self.turns), share)

    def teardown(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    fresh = st.builds(
        lambda opening, tail, session, tenant: (torch.cat([OPENINGS[opening], torch.tensor([tail])], dim=1),
                                                session, tenant),
        st.integers(0, len(OPENINGS) - 1), st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=9),
        st.sampled_from(["a", "b", "c"]), st.sampled_from([None, "t1"]))

    def _turn(self, conv, extra: list[int], new_tokens: int):
        ids, session, tenant = conv
        if self.engine == "pooled":
            # Most moves done by now, some not: buffers retire both with and without readers left.
            self.store._engine.land(random.Random(self.turns), 0.8)
        model = self.model
        cache = self.store.open(model, ids, session=session, tenant=tenant)
        n = cache.restored_tokens
        assert 0 <= n <= ids.shape[1] - 1
        assert sum(cache.restored_from.values()) == n
        if n:
            self._check_restored(cache, n)
            assert_holds(cache, recomputed_kv(ids[:, :n], model), n)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
        plain = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(out, plain)
        self._check_generated(cache, ids, out)
        stored = cache.commit(out)
        assert 0 <= stored <= out.shape[1] - 1
        self.turns += 1
        return (torch.cat([out, torch.tensor([extra])], dim=1), session, tenant)

    def _check_restored(self, cache: TieredCache, n: int) -> None:
        """What an open of a restore of ``n`` tokens holds beyond its KV: nothing to check for
        full-attention layers."""

    def _check_generated(self, cache: TieredCache, ids: torch.Tensor, out: torch.Tensor) -> None:
        """What a turn's cache holds after ``generate`` of ``out`` from ``ids``: nothing checked
        here for full-attention models, whose KV the next turn's restore compares."""

    @contextlib.contextmanager
    def _out_of_memory(self, where: str, call: int) -> Iterator[None]:
        """The ``call``-th call of ``where`` during the block raises out of memory: a copy of the
        engine's, a block's copy at commit, or a decoder layer's forward."""
        calls = [0]

        def fail() -> None:
            calls[0] += 1
            if calls[0] == call:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        if where == "layer":
            handles = [layer.register_forward_pre_hook(lambda *_: fail()) for layer in self.model.model.layers]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
            return
        owner = TieredCache if where == "block_tensor" else self.store._engine
        real = getattr(owner, where)

        def failing(*args):
            fail()
            return real(*args)

        setattr(owner, where, failing)
        try:
            yield
        finally:
            setattr(owner, where, real)

    # Where a turn runs out of memory, and at which call there: open copies to the device once.
    faults = st.one_of(st.tuples(st.just("to_device_many"), st.just(1)),
                       st.tuples(st.sampled_from(["to_host", "block_tensor", "layer"]), st.integers(1, 6)))

    @rule(conv=conversations, fault=faults, new_tokens=st.integers(1, 3))
    def failing_turn(self, conv, fault: tuple[str, int], new_tokens: int) -> None:
        """A turn that runs out of memory somewhere, then commits what it can: the invariants hold
        whatever it left, and every later turn stays exact."""
        where, call = fault
        ids, session, tenant = conv
        cache = out = None
        with self._out_of_memory(where, call):
            try:
                cache = self.store.open(self.model, ids, session=session, tenant=tenant)
                out = self.model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
                cache.commit(out)
                return
            except torch.OutOfMemoryError:
                pass
        if cache is None or cache.get_seq_length() == cache.restored_tokens:
            return  # out of memory in open, or before the first layer took a token
        if out is None:
            # generate() raised: the ids a streamer showed, and the one fed last.
            out = torch.cat([ids[0], *(f.ids.reshape(-1) for f in cache._fed if f.ids is not None)])[None]
        assert 0 <= cache.commit(out) <= out.shape[1]

    @rule(target=conversations, conv=fresh, extra=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6),
          new_tokens=st.integers(1, 3))
    def first_turn(self, conv, extra: list[int], new_tokens: int):
        return self._turn(conv, extra, new_tokens)

    @rule(target=conversations, conv=conversations, extra=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6),
          new_tokens=st.integers(1, 3))
    def next_turn(self, conv, extra: list[int], new_tokens: int):
        return self._turn(conv, extra, new_tokens)

    @rule(target=conversations, conv=conversations, cut=st.integers(1, 12), extra=st.lists(
        st.integers(3, VOCAB - 1), min_size=1, max_size=4))
    def edited_turn(self, conv, cut: int, extra: list[int]):
        ids, session, tenant = conv
        ids = torch.cat([ids[:, :max(1, ids.shape[1] - cut)], torch.tensor([extra])], dim=1)
        return self._turn((ids, session, tenant), [3], 1)

    @rule(session=st.sampled_from([None, "a", "b", "c"]), tenant=st.sampled_from(["unset", None, "t1"]))
    def forget(self, session: str | None, tenant: str | None) -> None:
        if session is None and tenant == "unset":
            return
        kwargs = {} if tenant == "unset" else {"tenant": tenant}
        removed = self.store.forget(session=session, **kwargs)
        assert removed >= 0

    @precondition(lambda self: self.path is not None)
    @rule(kind=st.sampled_from(["flipped", "zeroed", "token count", "gone"]), pick=st.integers(0, 10**6))
    def damage_a_record(self, kind: str, pick: int) -> None:
        """A durable record damaged where it lies, as a disk's damage is (a payload bit, the record
        zeroed as a delete a crash cut short leaves it, or a header claiming another token count with
        its checksum recomputed), or deleted behind the store's back: every later turn stays exact
        and the invariants hold."""
        from tierkv.codec import CorruptRecord, decode_header

        self.store.flush()  # the writer idle: this write transaction is the only one
        durable = sorted(k for k, m in self.store._index.blocks.items() if m.disk is DiskState.DURABLE)
        if not durable:
            return
        key = durable[pick % len(durable)]
        disk = self.store._disk
        with disk.env.begin(write=True) as txn:
            record = txn.get(key, db=disk._blocks)
            if record is None:
                return
            if kind == "gone":
                # Its pages freed, for LMDB to reuse: the store's place of it goes too, as its
                # zeroing of a deleted record trusts the places it wrote, which no other writer
                # changes in a store it holds (the mapped pages it would zero may be reused).
                txn.delete(key, db=disk._blocks)
                disk._where.pop(key, None)
                self.gone.add(key)
                return
            record = bytes(record)
        if kind == "flipped":
            damage_in_place(disk.env, disk._blocks, key, lambda value: flipped(value, -9, 0x10))  # payload's last byte
        elif kind == "zeroed":
            damage_in_place(disk.env, disk._blocks, key, lambda value: bytes(len(value)))
        else:
            try:
                layers, two, heads, tokens, dim = decode_header(record).shape
            except CorruptRecord:
                return  # damaged before
            if tokens < 2:
                return
            # Its checksum recomputed and its pad made to fit: as long as the record, so written
            # where it lies (an encode without the pad was shorter, and this damage was skipped).
            damage_in_place(disk.env, disk._blocks, key,
                            lambda value: reencoded(value, shape=(layers, two, heads * tokens, 1, dim)))

    @rule(reopen=st.booleans())
    def persist(self, reopen: bool) -> None:
        self.store.flush()
        if self.engine == "pooled":
            self.store._engine.land()
            self.store._host.reclaim()
            pool = self.store.stats()["host_pool"]
            held = sum(-(-m.nbytes // 4096) * 4096 for m in self.store._index.blocks.values()
                       if m.resident is Tier.HOST and self.store._host.get(m.key).lease is not None)
            assert pool["retiring"] == 0 and pool["in_use"] == held, (pool, held)  # nothing leaked
        assert self.store.stats()["pending_writes"] == 0
        if self.path is not None:
            disk = self.store._disk
            with disk.env.begin() as txn:
                on_disk = {bytes(k) for k, _ in txn.cursor(db=disk._blocks)}
            durable = {k for k, m in self.store._index.blocks.items() if m.disk is DiskState.DURABLE}
            # A record the machine deleted stays indexed until an open meets its absence.
            assert on_disk <= durable and durable - on_disk <= self.gone
        if reopen and self.path is not None:
            self.store.close()
            self.store = self._new_store()

    @invariant()
    def index_agrees_with_the_tiers(self) -> None:
        if not hasattr(self, "store"):
            return
        index = self.store._index
        for meta in index.blocks.values():
            assert meta.resident is not None or meta.disk is not DiskState.NONE, "a block rests nowhere"
        for tier, space in ((Tier.DEVICE, self.store._device), (Tier.HOST, self.store._host)):
            assert space.used == index.bytes[tier]
            assert set(space._blocks) == set(index.lru[tier])
        for tier in Tier:
            assert set(index.lru[tier]) <= set(index.blocks)
        for sid, info in index.sessions.items():
            assert info.keys <= set(index.blocks)
            # The bound on sessions: each one tracked holds a block no other session references.
            assert any(index.blocks[key].sessions == {sid} for key in info.keys), info
        for meta in index.blocks.values():
            assert all(meta.key in index.sessions[sid].keys for sid in meta.sessions)
        assert not self.store._pinned, "a turn left blocks pinned"

    @invariant()
    def budgets_hold(self) -> None:
        if not hasattr(self, "store"):
            return
        stats = self.store.stats()
        for tier in ("device", "host", "disk"):
            assert stats[tier]["bytes"] <= stats[tier]["budget"], (tier, stats)
        if self.path is None:
            assert stats["disk"] == {"bytes": 0, "budget": 0, "blocks": 0}


def test_a_promotion_whose_victims_host_copy_raised_leaves_no_block_in_no_tier() -> None:
    """Found by the machine: an open promoting a host block to the device, whose victim's host
    copy ran out of memory, left the promoted block in no tier."""
    machine = StoreMachine()
    machine.start(device_blocks=2, host_blocks=1, disk=None, engine="handover")
    try:
        conv = machine.first_turn(conv=(torch.tensor([[3]]), "a", None), extra=[3, 3, 3, 3, 4], new_tokens=1)
        machine.failing_turn(conv=conv, fault=("to_host", 1), new_tokens=1)
        machine.edited_turn(conv=conv, cut=1, extra=[3])
        machine.failing_turn(conv=conv, fault=("to_host", 1), new_tokens=1)
        machine.index_agrees_with_the_tiers()
        # The victim whose host copy failed is gone; the block being promoted went back to the host.
        assert sorted(m.resident.value for m in machine.store._index.blocks.values()) == ["device", "host"]
        machine.next_turn(conv=conv, extra=[5], new_tokens=2)
        machine.index_agrees_with_the_tiers()
    finally:
        machine.teardown()


StoreMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_store_machine = StoreMachine.TestCase


# Windows shorter than the conversations (6 and 7 tokens, neither a multiple of BLOCK, which is
# their hand-offs' margin): in every layer (Mistral's: blocks no window reaches are not even read)
# or beside a full-attention layer (Gemma 3's; Llama 4's chunks of 7, a window to the cache).
SLIDING_MODELS = {"mistral_window": make_model("mistral_window", seed=0, sliding_window=6),
                  "gemma3_text": make_model("gemma3_text", seed=0, sliding_window=7),
                  "llama4_text": make_model("llama4_text", seed=0, attention_chunk_size=7)}


class SlidingStoreMachine(StoreMachine):
    """The machine over models with sliding-window layers. Each layer's KV is compared with
    recomputation from the first token it holds (``held_from``) on, after the open and after
    ``generate``, the tokens a sliding layer handed off its device included; an open holds each
    window from a block's start, and a layer holds at most its window and two margins on its
    device once it decoded. Replies past the window and two margins come, so layers hand tokens
    off, and commits store them."""

    @initialize(kind=st.sampled_from(sorted(SLIDING_MODELS)), device_blocks=st.integers(0, 4),
                host_blocks=st.integers(0, 4), disk=st.sampled_from([None, 0, 6, 10**9]),
                engine=st.sampled_from(["handover", "lazy", "pooled"]))
    def start(self, kind: str, device_blocks: int, host_blocks: int, disk: int | None, engine: str) -> None:
        self.model = SLIDING_MODELS[kind]
        super().start(device_blocks, host_blocks, disk, engine)

    @rule(target=StoreMachine.conversations, conv=StoreMachine.conversations,
          extra=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6), new_tokens=st.integers(8, 20))
    def long_turn(self, conv, extra: list[int], new_tokens: int):
        """A reply past the window and two margins (6 + 2 x 4 tokens): its decode steps hand tokens
        off the device, and its commit stores them."""
        return self._turn(conv, extra, new_tokens)

    @rule(target=StoreMachine.conversations, conv=StoreMachine.conversations, share=st.floats(0.0, 1.0),
          extra=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4))
    def rewound_turn(self, conv, share: float, extra: list[int]):
        """A conversation edited anywhere (``edited_turn`` cuts its last tokens alone): a restore
        whose windows end over tokens an earlier turn's layers handed off their device, and their
        commit stored."""
        ids, session, tenant = conv
        ids = torch.cat([ids[:, :max(1, int(ids.shape[1] * share))], torch.tensor([extra])], dim=1)
        return self._turn((ids, session, tenant), [3], 1)

    @rule(conv=StoreMachine.conversations, fault=st.tuples(st.sampled_from(["block_tensor", "layer"]),
                                                          st.integers(1, 40)), new_tokens=st.integers(8, 20))
    def failing_long_turn(self, conv, fault: tuple[str, int], new_tokens: int) -> None:
        """``failing_turn`` in a long reply: out of memory in a forward after a hand-off, or in the
        commit's reads of tokens handed off."""
        self.failing_turn(conv, fault, new_tokens)

    def _check_restored(self, cache: TieredCache, n: int) -> None:
        for layer in cache.layers:
            if not isinstance(layer, TieredSlidingLayer):
                continue
            start, window = layer.held_from(), layer.sliding_window
            # Whole blocks left out, and no more of them than the window lets: each layer reads
            # its last window - 1 tokens, and holds fewer than a block more.
            assert start % BLOCK == 0, start
            assert min(n, window - 1) <= n - start < window - 1 + BLOCK, (n, start, window)

    def _check_generated(self, cache: TieredCache, ids: torch.Tensor, out: torch.Tensor) -> None:
        held = out.shape[1] - 1
        assert_holds(cache, recomputed_kv(out[:, :-1], self.model), held)
        decoded = out.shape[1] - ids.shape[1] - 1  # forwards after the prefill
        for layer in cache.layers:
            if not isinstance(layer, TieredSlidingLayer):
                continue
            window, on_device = layer.sliding_window, layer.keys.shape[-2]
            assert held - layer.held_from() >= min(held, window - 1)
            if layer._staged:
                event("a sliding layer handed tokens off its device")
            if decoded:  # a prefill alone holds its prompt whole; the first decode step hands it off
                assert on_device <= window - 1 + 2 * layer.margin, (on_device, window, layer.margin)


SlidingStoreMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_sliding_store_machine = SlidingStoreMachine.TestCase


@pytest.mark.slow
@pytest.mark.parametrize("machine", [StoreMachine, SlidingStoreMachine])
def test_store_machine_soak(machine: type[StoreMachine]) -> None:
    """The long soak, thousands of operations: `pytest --run-slow -k soak`."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=settings(max_examples=300, stateful_step_count=100,
                                                         deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))
