"""Behaviour of ``TieredStore`` by scenario: sharing, edits, partial tails, the ``L - 1`` cap,
``forget``, fingerprints, budgets, exact LRU orders, reopening, stats, misuse and threads.

Every scenario runs a tiny random llama with ``block_size=8`` and compares each greedy output with
plain ``model.generate`` without a cache. Expectations are exact: restored token counts, block
counts, bytes, and eviction orders, checked through small ``verify_*`` helpers (vLLM's style).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import re
import threading
import uuid
from collections.abc import Iterable

import lmdb
import msgpack
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, DynamicCache

from conftest import VOCAB, make_model, random_ids
from tierkv import TieredCache, TieredStore
from tierkv.cache import _static_cache, describe_model
from tierkv.weights import WeightSample
from tierkv.codec import head_end
from tierkv.hashing import block_key, chain_keys
from tierkv.index import DiskState, Tier
from tierkv.store import _session_id
from tierkv.tiers.disk import footprint

B = 8  # tokens per block in every scenario


# -- helpers -----------------------------------------------------------------------------------
def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def diverging(ids: torch.Tensor, p: int, length: int, seed: int) -> torch.Tensor:
    """``ids[:, :p]`` followed by ``length`` new tokens whose first differs from ``ids[0, p]``."""
    tail = random_ids(length, seed)
    if p < ids.shape[1] and int(tail[0, 0]) == int(ids[0, p]):
        tail[0, 0] = int(ids[0, p]) + 1 if int(ids[0, p]) + 1 < VOCAB else 3
    return cat(ids[:, :p], tail)


def distinct_block(i: int) -> torch.Tensor:
    """Eight ids that form one full block; first tokens differ across ``i`` so that no block is a
    stored continuation of another one's prefix."""
    ids = random_ids(B, 500 + i)
    ids[0, 0] = 10 + i
    return ids


def full_block_bytes(model: torch.nn.Module, n_tokens: int = B) -> int:
    c = model.config
    item = next(model.parameters()).element_size()
    return c.num_hidden_layers * 2 * c.num_key_value_heads * n_tokens * c.head_dim * item


def generate(model: torch.nn.Module, ids: torch.Tensor, new: int, cache: TieredCache | None = None) -> torch.Tensor:
    kwargs = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)


def verify_open(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, *, session: str | None = None,
                tenant: str | None = None, expect: int | None = None,
                expect_from: dict[str, int] | None = None) -> TieredCache:
    cache = store.open(model, ids, session=session, tenant=tenant)
    assert isinstance(cache, TieredCache)
    assert set(cache.restored_from) == {"device", "host", "disk"}
    assert sum(cache.restored_from.values()) == cache.restored_tokens
    assert 0 <= cache.restored_tokens <= ids.shape[1] - 1
    assert cache.get_seq_length() == cache.restored_tokens
    if expect is not None:
        assert cache.restored_tokens == expect
    if expect_from is not None:
        assert cache.restored_from == expect_from
    return cache


def verify_generate(model: torch.nn.Module, ids: torch.Tensor, cache: TieredCache, new: int) -> torch.Tensor:
    out = generate(model, ids, new, cache)
    assert torch.equal(out, generate(model, ids, new))
    assert cache.get_seq_length() == out.shape[1] - 1
    return out


def turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, *, session: str | None = None,
         tenant: str | None = None, new: int = 4, expect: int | None = None,
         expect_stored: int | None = None) -> tuple[TieredCache, torch.Tensor]:
    """One conversation turn: open, generate (checked against no cache), commit."""
    cache = verify_open(store, model, ids, session=session, tenant=tenant, expect=expect)
    out = verify_generate(model, ids, cache, new)
    stored = cache.commit(out)
    if expect_stored is not None:
        assert stored == expect_stored
    return cache, out


def verify_budgets(store: TieredStore) -> dict:
    with store._lock:  # one consistent view while other threads use the store
        return _verify_budgets(store)


def _verify_budgets(store: TieredStore) -> dict:
    stats = store.stats()
    for tier in ("device", "host", "disk"):
        assert 0 <= stats[tier]["bytes"] <= stats[tier]["budget"], (tier, stats)
    assert stats["device"]["bytes"] == store._device.used == store._index.bytes[Tier.DEVICE]
    assert stats["host"]["bytes"] == store._host.used == store._index.bytes[Tier.HOST]
    assert stats["device"]["blocks"] == len(store._index.lru[Tier.DEVICE])
    assert stats["host"]["blocks"] == len(store._index.lru[Tier.HOST])
    return stats


def disk_records(path) -> dict[bytes, tuple[int, int]]:
    """Key -> (record length, head length) of every block in a closed store's LMDB environment."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False, subdir=True)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): (len(v), head_end(v)) for k, v in txn.cursor()}
    finally:
        env.close()


def keys_of(root: bytes, ids: torch.Tensor) -> list[bytes]:
    """Keys of the blocks a commit of exactly ``ids`` stores: full blocks, then a partial tail."""
    flat = ids[0].numpy()
    keys = chain_keys(root, flat, B)
    if len(flat) % B:
        keys.append(block_key(keys[-1] if keys else root, flat[len(keys) * B:]))
    return keys


def names(order: Iterable[bytes], named: dict[bytes, str]) -> list[str]:
    return [named[k] for k in order]


# -- 1. sharing ------------------------------------------------------------------------------------
def test_sessions_of_a_tenant_share_a_system_prompt_stored_once(tiny_model, tmp_path):
    model = tiny_model("llama")
    system = random_ids(24, 100)
    user_a, user_b = random_ids(13, 101), random_ids(11, 102)
    assert int(user_a[0, 0]) != int(user_b[0, 0])
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache_a, out_a = turn(store, model, cat(system, user_a), session="A", expect=0, expect_stored=40)
        # B restores exactly the three system-prompt blocks, nothing of A's user turn.
        cache_b = verify_open(store, model, cat(system, user_b), session="B", expect=24,
                              expect_from={"device": 24, "host": 0, "disk": 0})
        out_b = verify_generate(model, cat(system, user_b), cache_b, 4)
        assert cache_b.commit(out_b) == 38
        store.flush()
        stats = store.stats()
        # A: 5 full blocks; B: 4 full + a 6-token tail, 3 of them shared with A.
        assert stats["device"]["blocks"] == 7
        assert stats["device"]["bytes"] == 6 * full_block_bytes(model) + full_block_bytes(model, 6)
        assert stats["disk"]["blocks"] == 7
        assert len(store._index.blocks) == 7
        shared = chain_keys(cache_a.root, system[0].numpy(), B)
        assert cache_b.root == cache_a.root
        assert [len(store._index.blocks[k].sessions) for k in shared] == [2, 2, 2]
        assert set(keys_of(cache_a.root, out_a[:, :40])) | set(keys_of(cache_b.root, out_b[:, :38])) == set(
            store._index.blocks)

        # Another tenant sees nothing, not even with identical ids, and shares nothing.
        for tenant in ("acme", ""):
            cache = verify_open(store, model, cat(system, user_b), session="B", tenant=tenant, expect=0)
            verify_generate(model, cat(system, user_b), cache, 4)
        _, out_acme = turn(store, model, cat(system, user_b), session="B", tenant="acme", expect=0, expect_stored=38)
        assert store.stats()["device"]["blocks"] == 7 + 5
        # ... while within that tenant its own system prompt is shared again.
        turn(store, model, cat(system, user_a), session="C", tenant="acme", expect=24)
        # The default tenant still restores its own conversation in full.
        verify_open(store, model, out_b, session="B", expect=38)


# -- 2. edited conversations -----------------------------------------------------------------------
@pytest.mark.parametrize("p", [0, 5, 16, 19, 31, 32, 35, 39])
def test_an_edited_conversation_restores_exactly_the_common_prefix(tiny_model, tmp_path, p):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, random_ids(36, 7), session="s", expect_stored=39)  # 4 blocks + 7-token tail
        edited = diverging(out, p, 12, seed=1000 + p)
        assert int(edited[0, p]) != int(out[0, p])
        cache = verify_open(store, model, edited, session="s2", expect=p)
        verify_generate(model, edited, cache, 4)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 20, 24, 39, 40])
def test_a_prefix_of_the_stored_conversation_restores_all_but_its_last_token(tiny_model, tmp_path, length):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, random_ids(36, 8), session="s", expect_stored=39)
        extended = cat(out, random_ids(3, 9))  # past everything stored: all 39 stored tokens
        cache = verify_open(store, model, extended, expect=39)
        verify_generate(model, extended, cache, 2)
        prefix = out[:, :length]
        cache = verify_open(store, model, prefix, expect=length - 1)
        verify_generate(model, prefix, cache, 3)


# -- 3. partial tails --------------------------------------------------------------------------------
def test_a_session_evicted_hollow_part_way_through_its_commit_keeps_its_references(tiny_model, tmp_path):
    # Before (helper-25): Z's commit placed a new block (its reference queued ahead of its write),
    # and the next block's room evicted Z's only block of its own: Z looked hollow, was untracked,
    # and its DropRefs deleted that reference too; after a restart, forget(session="Z") did not find
    # the block, and Z's forgotten conversation was restored.
    model = tiny_model("llama")
    z_ids = random_ids(4 * 2 + 1, 41)  # two blocks shared with y, and a 1-token tail of z's own
    y_ids = cat(z_ids[:, :8], torch.tensor([[77]]))
    z2_ids = cat(z_ids[:, :8], random_ids(8, 42))  # z edits its last message: two new blocks

    def first_two(store):
        turn(store, model, z_ids, session="z", new=1)
        turn(store, model, y_ids, session="y", new=1)
        store.flush()

    budgets = dict(device="cpu", block_size=4, device_budget=0, host_budget=0)
    with TieredStore(tmp_path / "measure", **budgets) as store:
        first_two(store)
        used = store.stats()["disk"]["bytes"]
        footprint = max(m.record_bytes for m in store._index.blocks.values())
    path = tmp_path / "kv"
    with TieredStore(path, disk_budget=used + footprint, **budgets) as store:  # room for one block more
        first_two(store)
        turn(store, model, z2_ids, session="z", new=1)
    with TieredStore(path, disk_budget=used + footprint, **budgets) as store:
        store.forget(session="z")
        assert store.open(model, cat(z2_ids, random_ids(1, 43))).restored_tokens == 8  # y's blocks alone


def test_turns_of_no_session_let_go_of_the_tails_their_chains_replace(tiny_model, tmp_path):
    # Before: only a session let go of its replaced tails; a conversation run without one (open's
    # default, the server's requests without a session id) left a dead tail per turn at rest in
    # every tier, and on disk, until the LRU order reached it.
    model = tiny_model("llama")
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        ids = random_ids(9, 21)
        for t in range(4):
            _, out = turn(store, model, ids, new=2)
            root = store.open(model, out).root
            assert set(store._index.blocks) == set(keys_of(root, out[:, :-1])), t
            ids = cat(out, random_ids(3, 22 + t))
        # A tail another conversation holds stays: it is that session's to let go of.
        _, held = turn(store, model, random_ids(5, 30), session="s", new=2)
        tail = keys_of(root, held[:, :-1])[-1]
        turn(store, model, cat(held, random_ids(3, 31)), new=2)
        assert tail in store._index.blocks
        store.flush()
        kept = set(store._index.blocks)
    assert set(disk_records(path)) == kept


def test_a_returning_session_restores_its_partial_tail_and_a_longer_tail_supersedes_it(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, out1 = turn(store, model, random_ids(19, 11), session="s", new=2, expect=0, expect_stored=20)
        root = store.open(model, out1, session="probe").root
        k0, k1, tail1 = keys_of(root, out1[:, :20])
        assert store._index.blocks[tail1].n_tokens == 4
        assert set(store._index.blocks) == {k0, k1, tail1}

        # The same tail, in the same block: 4 tokens are superseded by 7.
        ids2 = cat(out1, random_ids(2, 12))
        _, out2 = turn(store, model, ids2, session="s", new=1, expect=20, expect_stored=23)
        *_, tail2 = keys_of(root, out2[:, :23])
        assert store._index.blocks[tail2].n_tokens == 7
        assert set(store._index.blocks) == {k0, k1, tail2}
        assert store.stats()["device"]["blocks"] == 3

        # The tail fills its block and spills into the next: the 7-token tail goes as well.
        ids3 = cat(out2, random_ids(6, 13))
        _, out3 = turn(store, model, ids3, session="s", new=4, expect=23, expect_stored=33)
        keys3 = keys_of(root, out3[:, :33])
        assert len(keys3) == 5 and store._index.blocks[keys3[-1]].n_tokens == 1
        assert set(store._index.blocks) == set(keys3)
        store.flush()
        assert store.stats()["disk"]["blocks"] == 5
    # Superseded tails are gone from disk too, and a reopened store restores the newest tail.
    assert set(disk_records(path)) == set(keys3)
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert set(store._index.blocks) == set(keys3)
        ids4 = cat(out3, random_ids(3, 14))
        cache = verify_open(store, model, ids4, session="s", expect=33,
                            expect_from={"device": 0, "host": 0, "disk": 33})
        verify_generate(model, ids4, cache, 2)


def test_a_partial_tail_another_session_references_outlives_its_supersession(tiny_model, tmp_path):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        # s and t also have other conversations, whose blocks are their own alone: both stay
        # tracked when t repeats s's.
        _, own = turn(store, model, random_ids(B, 20), session="s", new=1, expect_stored=B)
        _, own_t = turn(store, model, random_ids(B, 24), session="t", new=1, expect_stored=B)
        ids1 = random_ids(19, 21)
        _, out1 = turn(store, model, ids1, session="s", new=2, expect=0, expect_stored=20)
        _, out1t = turn(store, model, ids1, session="t", new=2, expect=18, expect_stored=20)
        assert torch.equal(out1, out1t)
        root = store.open(model, out1, session="probe").root
        k0, k1, tail1 = keys_of(root, out1[:, :20])
        edit = {*keys_of(root, own[:, :B]), *keys_of(root, own_t[:, :B])}
        assert len(store._index.blocks[tail1].sessions) == 2

        _, out2 = turn(store, model, cat(out1, random_ids(2, 22)), session="s", new=1, expect=20, expect_stored=23)
        tail2 = keys_of(root, out2[:, :23])[-1]
        assert set(store._index.blocks) == {*edit, k0, k1, tail1, tail2}
        assert len(store._index.blocks[tail1].sessions) == 1  # t's alone now

        # t diverges after out1's 21st token, which s's newer tail holds: 21 restore.
        other = diverging(cat(out1, random_ids(2, 22)), 21, 1, seed=23)
        _, out3 = turn(store, model, other, session="t", new=1, expect=21, expect_stored=22)
        tail3 = keys_of(root, out3[:, :22])[-1]
        assert tail3 != tail2
        assert set(store._index.blocks) == {*edit, k0, k1, tail2, tail3}


@pytest.mark.parametrize("first_touch", ["update", "keys"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_restored_layers_are_the_tensors_dynamic_cache_builds(tiny_model, tmp_path, arch, first_touch):
    # Whole blocks and a partial tail, assembled on the first update (keys and values in one
    # concatenation) or on a first read of .keys: the same values, shape and strides as a
    # DynamicCache prefilled with the whole prompt, so attention runs the same kernels on them.
    model = tiny_model(arch)
    ids = random_ids(3 * B + 5, 61)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, new=2)
        cache = store.open(model, out)
        assert cache.restored_tokens == out.shape[1] - 1 and cache.restored_tokens % B != 0
        if first_touch == "keys":
            assert cache.layers[0].keys.shape[-2] == cache.restored_tokens
        with torch.no_grad():
            model(out[:, -1:], past_key_values=cache, cache_position=torch.tensor([out.shape[1] - 1]))
            ref = DynamicCache()
            model(out, past_key_values=ref)
        for layer, expected in zip(cache.layers, ref.layers):
            for got, want in ((layer.keys, expected.keys), (layer.values, expected.values)):
                assert got.shape == want.shape and got.stride() == want.stride() and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        verify_generate(model, out, store.open(model, out), 3)


# -- 4. the L - 1 cap -------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 5, 8, 16, 20])
def test_opening_exactly_the_committed_ids_restores_all_but_the_last(tiny_model, tmp_path, length):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        ids = random_ids(length, 30 + length)
        _, out = turn(store, model, ids, session="s", new=1, expect=0, expect_stored=length)
        for _ in range(2):  # a hit does not change what the next open sees
            cache = verify_open(store, model, ids, session="s", expect=length - 1,
                                expect_from={"device": length - 1, "host": 0, "disk": 0})
            verify_generate(model, ids, cache, 3)
        cache = verify_open(store, model, out, session="s", expect=length)
        verify_generate(model, out, cache, 3)


# -- 5. forget ---------------------------------------------------------------------------------------
def test_forget_drops_a_session_or_a_tenant_from_every_tier_and_keeps_shared_blocks(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    full = full_block_bytes(model)
    system = random_ids(24, 40)
    conv_a, conv_b = cat(system, random_ids(28, 41)), cat(system, random_ids(20, 42))  # 52 and 44 tokens
    assert int(conv_a[0, 24]) != int(conv_b[0, 24])
    with TieredStore(path, device="cpu", device_budget=4 * full, host_budget=3 * full, block_size=B) as store:
        _, out_b = turn(store, model, conv_b, session="B", new=1, expect_stored=44)  # 5 blocks + 4-token tail
        turn(store, model, conv_a, session="C", tenant="acme", new=1, expect_stored=52)  # 6 blocks + tail
        cache_a, out_a = turn(store, model, conv_a, session="A", new=1, expect=24, expect_stored=52)
        store.flush()
        root = cache_a.root
        keys_a, keys_b = keys_of(root, conv_a), keys_of(root, conv_b)
        only_a = [k for k in keys_a if k not in keys_b]
        assert len(only_a) == 4 and len(keys_b) == 6
        assert len(store._index.blocks) == 4 + 6 + 7
        # A's own blocks rest in both memory tiers and on disk before they are forgotten.
        assert {store._index.blocks[k].resident for k in only_a} == {Tier.DEVICE, Tier.HOST}
        assert all(k in store._index.lru[Tier.DISK] for k in only_a)
        before = verify_budgets(store)

        assert store.forget(session="nobody") == 0
        assert store.forget(session="B", tenant="acme") == 0  # B lives in the default tenant
        assert store.forget(session="A") == 4
        for k in only_a:
            assert k not in store._index.blocks
            assert k not in store._device and k not in store._host
            assert k not in store._index.lru[Tier.DISK]
        assert all(len(store._index.blocks[k].sessions) == 1 for k in keys_b)
        assert store.forget(session="A") == 0
        assert store.forget(tenant="acme") == 7
        after = verify_budgets(store)
        assert after["disk"]["blocks"] == before["disk"]["blocks"] - 11 == 6
        assert after["device"]["blocks"] + after["host"]["blocks"] <= 6
        store.flush()
    assert set(disk_records(path)) == set(keys_b)

    with TieredStore(path, device="cpu", device_budget=2 * full, host_budget=3 * full, block_size=B) as store:
        assert set(store._index.blocks) == set(keys_b)
        cache = verify_open(store, model, out_a, session="A", expect=24)  # the shared system prompt only
        verify_generate(model, out_a, cache, 2)
        cache = verify_open(store, model, out_b, session="B", expect=44)
        verify_generate(model, out_b, cache, 2)
        cache = verify_open(store, model, out_a, session="C", tenant="acme", expect=0)
        verify_generate(model, out_a, cache, 2)
        # Session references survive the reopen: B's blocks are now its alone.
        assert store.forget(session="B") == 6
        stats = store.stats()
        assert [stats[t]["blocks"] for t in ("device", "host", "disk")] == [0, 0, 0]
        assert [stats[t]["bytes"] for t in ("device", "host", "disk")] == [0, 0, 0]
    assert disk_records(path) == {}


def commit_failing_at(cache: TieredCache, out: torch.Tensor, monkeypatch: pytest.MonkeyPatch, owner: object,
                      name: str, call: int) -> None:
    """``cache.commit(out)``, with the ``call``-th call of ``owner.name`` raising out of memory."""
    real = getattr(owner, name)
    calls = [0]

    def failing(*args: object) -> object:
        calls[0] += 1
        if calls[0] == call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(torch.OutOfMemoryError):
        cache.commit(out)
    monkeypatch.setattr(owner, name, real)


def test_forget_of_nothing_names_both_ways_and_the_default_tenant_s_is_forgotten_as_told(tiny_model):
    # Before: "forget() needs session=... and/or tenant=...", to forget(session=sid) with sid None,
    # not saying that None names no session, nor how to forget the default tenant's blocks.
    model = tiny_model("llama")
    with TieredStore(None, device="cpu", block_size=B) as store:
        turn(store, model, random_ids(2 * B + 1, 41))  # no session, the default tenant
        for call in (store.forget, lambda: store.forget(session=None)):
            with pytest.raises(ValueError, match=re.escape("(session=None names none): pass session='name' to forget "
                                                           "a session, tenant='name' to forget a tenant's blocks "
                                                           "(tenant=None: the default tenant's)")):
                call()
        assert store.stats()["device"]["blocks"] == 3
        assert store.forget(tenant=None) == 3 and store.stats()["device"]["blocks"] == 0


def test_a_commit_that_raised_part_way_leaves_its_stored_blocks_to_forget(tiny_model, monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(40, 47)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        commit_failing_at(cache, out, monkeypatch, cache, "block_tensor", 3)  # the third block's copy
        assert len(store._index.blocks) == 2
        assert store.forget(session="s") == 2  # they were the session's, though its commit raised
        assert store._index.blocks == {} and store.stats()["device"]["blocks"] == 0


def test_a_commit_that_raised_part_way_keeps_the_sessions_older_tail(tiny_model, monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(20, 49)
    with TieredStore(None, device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", new=1, expect_stored=20)  # two blocks and a 4-token tail
        later = cat(out, random_ids(19, 50))
        cache = verify_open(store, model, later, session="s", expect=20)
        out2 = verify_generate(model, later, cache, 1)
        commit_failing_at(cache, out2, monkeypatch, cache, "block_tensor", 1)  # its first new block's copy
        # Nothing the failed commit stored covers the old tail's tokens: it is still the session's.
        verify_open(store, model, later, session="s", expect=20)


def test_a_block_whose_disk_copy_raised_is_dropped_from_every_tier(tiny_model, tmp_path, monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(40, 51)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        # The first block rests on the device, then the host copy for its disk write raises.
        commit_failing_at(cache, out, monkeypatch, store._engine, "to_host", 1)
        assert store._index.blocks == {} and len(store._device) == 0
        verify_open(store, model, out, session="other", expect=0)


def test_a_victim_whose_host_copy_raised_leaves_no_entry_a_commit_would_reuse(tiny_model, monkeypatch):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    a, b = random_ids(17, 52), random_ids(17, 53)
    with TieredStore(None, device="cpu", device_budget=2 * full, host_budget=8 * full, block_size=B) as store:
        turn(store, model, a, session="A", new=1, expect_stored=17)
        cache = store.open(model, b, session="B")
        out = model.generate(b, past_key_values=cache, max_new_tokens=1, do_sample=False)
        # B's blocks evict A's from the device; the host copy of the first victim raises.
        commit_failing_at(cache, out, monkeypatch, store._engine, "to_host", 1)
        assert all(m.resident is not None for m in store._index.blocks.values())
        later = cat(a, random_ids(3, 54))
        _, out = turn(store, model, later, session="A", new=1, expect=8, expect_stored=20)  # stored again
        verify_open(store, model, out, session="A", expect=20)


def test_a_commit_stores_again_a_block_an_interrupt_left_in_no_tier(tiny_model):
    model = tiny_model("llama")
    ids = random_ids(17, 55)
    with TieredStore(None, device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", new=1, expect_stored=17)
        # As a Ctrl-C between taking a block out of its tier and settling where it goes leaves it.
        second = store._index.blocks[keys_of(store.open(model, out).root, out)[1]]
        store._device.pop(second.key)
        store._index.set_resident(second, None)
        _, out = turn(store, model, out, session="s", new=1, expect=8, expect_stored=18)
        verify_open(store, model, out, session="s", expect=18)


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_an_open_finds_a_block_gone_from_the_tier_its_index_entry_names(tiny_model, tier):
    model = tiny_model("llama")
    ids = random_ids(17, 56)
    budgets = dict(device_budget=0) if tier is Tier.HOST else {}
    with TieredStore(None, device="cpu", block_size=B, **budgets) as store:
        _, out = turn(store, model, ids, session="s", new=1, expect_stored=17)
        # As a Ctrl-C between taking a block out of its tier and updating the index leaves it.
        second = store._index.blocks[keys_of(store.open(model, out).root, out)[1]]
        assert second.resident is tier
        (store._device if tier is Tier.DEVICE else store._host).pop(second.key)
        cache = verify_open(store, model, out, session="s", expect=8)
        verify_generate(model, out, cache, 2)
        assert second.key not in store._index.blocks


def test_an_open_interrupted_between_a_promotions_put_and_the_index_keeps_them_agreeing(tiny_model, monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(30, 57)
    with TieredStore(None, device="cpu", device_budget=full_block_bytes(model), block_size=B) as store:
        _, out = turn(store, model, ids, session="s", new=1, expect_stored=30)  # one block on the device
        put = store._host.put

        def put_then_interrupt(*args: object) -> bool:
            put(*args)
            raise KeyboardInterrupt  # a Ctrl-C before the index records where the block went

        monkeypatch.setattr(store._host, "put", put_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            store.open(model, out, session="s")
        monkeypatch.setattr(store._host, "put", put)
        assert store._host.used == store._index.bytes[Tier.HOST]
        assert set(store._host._blocks) <= set(store._index.blocks)
        cache = verify_open(store, model, out, session="s", expect=30)
        verify_generate(model, out, cache, 2)


def test_a_block_whose_host_copy_raised_leaves_no_index_entry(tiny_model, monkeypatch):
    model = tiny_model("llama")
    ids = random_ids(40, 48)
    with TieredStore(None, device="cpu", device_budget=0, block_size=B) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        commit_failing_at(cache, out, monkeypatch, store._engine, "to_host", 2)
        assert [m.resident for m in store._index.blocks.values()] == [Tier.HOST]
        cache = verify_open(store, model, out, session="s", expect=B)
        verify_generate(model, out, cache, 2)


@pytest.mark.parametrize("how", ["session", "session and tenant", "tenant"])
def test_a_turn_opened_before_a_forget_of_its_session_keeps_nothing_at_commit(tiny_model, tmp_path, how):
    # A turn in flight when its user asked to be forgotten: its commit wrote the whole
    # conversation back (KV and token ids), tracked the session again, and a restart restored it.
    model = tiny_model("llama")
    path = tmp_path / "kv"
    ids = random_ids(30, 60)
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="alice", tenant="acme")
        _, other = turn(store, model, random_ids(30, 61), session="bob", tenant="zeta")
        later = cat(out, random_ids(3, 62))
        cache = store.open(model, later, session="alice", tenant="acme")
        unrelated = store.open(model, cat(other, random_ids(3, 63)), session="bob", tenant="zeta")
        assert cache.restored_tokens == out.shape[1] - 1
        kw = {"session": dict(session="alice"), "session and tenant": dict(session="alice", tenant="acme"),
              "tenant": dict(tenant="acme")}[how]
        assert store.forget(**kw) > 0
        got = verify_generate(model, later, cache, 3)
        assert cache.commit(got) == 0
        assert unrelated.commit(verify_generate(model, cat(other, random_ids(3, 63)), unrelated, 3)) > 0
        store.flush()
        assert store.stats()["sessions"] == 1
        # A turn opened after the forget is kept as usual.
        _, kept = turn(store, model, later, session="alice", tenant="acme", expect=0)
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert store.open(model, cat(kept, random_ids(2, 64)), tenant="acme").restored_tokens == kept.shape[1] - 1


def test_a_turn_opened_before_forgets_no_longer_remembered_keeps_nothing(tiny_model, monkeypatch):
    from tierkv import store as store_module
    monkeypatch.setattr(store_module, "_FORGETS_KEPT", 4)
    model = tiny_model("llama")
    ids = random_ids(20, 65)
    with TieredStore(None, device="cpu", block_size=B) as store:
        old = store.open(model, ids, session="carol")
        for i in range(6):  # others' forgets: the oldest are let go
            store.forget(session=f"nobody{i}")
        assert len(store._forgotten) <= 4
        recent = store.open(model, ids, session="dave")
        store.forget(session="nobody-else")
        assert old.commit(verify_generate(model, ids, old, 2)) == 0  # which forgets it missed is not known
        assert recent.commit(verify_generate(model, ids, recent, 2)) > 0


def test_a_turn_opened_after_a_forget_keeps_the_blocks_stored_again_since(tiny_model):
    """What a forget took before a turn opened is not taken from it at its commit: a later turn
    stored the conversation again, this one restored it from there, and a forget of another
    session since (so that the commit looks at the blocks forgotten) leaves all it holds."""
    model = tiny_model("llama")
    ids = random_ids(2 * B + 3, 97)
    with TieredStore(None, device="cpu", block_size=B) as store:
        turn(store, model, ids, session="A", new=2)
        assert store.forget(session="A") > 0
        _, out = turn(store, model, ids, new=2, expect=0)  # no session: stores it again
        later = cat(out, random_ids(2, 98))
        cache = verify_open(store, model, later, expect=out.shape[1] - 1)
        reply = verify_generate(model, later, cache, 2)
        turn(store, model, random_ids(B + 1, 99), session="Z", new=2)
        assert store.forget(session="Z") > 0
        assert cache.commit(reply) == reply.shape[1] - 1


def test_a_turn_opened_before_forgotten_blocks_no_longer_remembered_keeps_none_it_restored(tiny_model, monkeypatch):
    """Past ``_FORGOTTEN_BLOCKS_KEPT`` blocks the older forgotten ones are let go: a turn opened
    before them cannot tell whether what it restored was taken, and keeps none of it (before, a
    turn that restored a forgotten conversation wrote it back at its commit)."""
    from tierkv import store as store_module
    monkeypatch.setattr(store_module, "_FORGOTTEN_BLOCKS_KEPT", 4)
    model = tiny_model("llama")
    ids = random_ids(2 * B + 3, 101)
    with TieredStore(None, device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="A", new=2)
        later = cat(out, random_ids(2, 102))
        cache = verify_open(store, model, later, expect=out.shape[1] - 1)  # no session
        reply = verify_generate(model, later, cache, 2)
        assert store.forget(session="A") > 0
        for i in range(3):  # others' forgets: A's blocks are let go from what is remembered
            turn(store, model, random_ids(2 * B + 1, 103 + i), session=f"other{i}", new=2)
            assert store.forget(session=f"other{i}") > 0
        assert not set(cache._restored_keys) & set(store._forgotten_blocks)
        assert cache.commit(reply) == 0
        assert store.open(model, later).restored_tokens == 0


def test_forget_a_tenant_counts_blocks_no_session_references(tiny_model, tmp_path):
    model = tiny_model("llama")
    with TieredStore(None, device="cpu", block_size=B) as store:
        turn(store, model, random_ids(20, 45), tenant="t", new=1, expect_stored=20)  # no session: 3 blocks
        turn(store, model, random_ids(9, 46), session="x", tenant="t", new=1, expect_stored=9)  # 2 blocks
        turn(store, model, random_ids(9, 46), session="x", new=1, expect_stored=9)  # default tenant: 2 blocks
        assert store.forget(session="x", tenant="t") == 2
        assert store.forget(tenant="t") == 3
        assert store.forget(tenant="t") == 0
        assert store.stats()["device"]["blocks"] == 2
        assert store.forget(tenant=None) == 2
        assert store.stats()["device"]["blocks"] == 0


# -- 6. fingerprints ---------------------------------------------------------------------------------
def test_a_parameter_over_2_24_elements_is_fingerprinted(tmp_path):
    # A float32 linspace put the last sample of such a parameter (every real embedding) one past
    # its end: an IndexError on CPU, a device-side assert on CUDA (found on the H200).
    model = make_model("llama", seed=8, vocab_size=70_000, hidden_size=256, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2)
    assert model.model.embed_tokens.weight.numel() > 2**24
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, model, random_ids(9, 8), new=2)
        nxt = cat(out, random_ids(2, 9))
        turn(store, model, nxt, new=2, expect=out.shape[1] - 1)  # checked against no cache
        with torch.no_grad():
            model.model.embed_tokens.weight.view(-1)[-1] += 1.0  # the last element is sampled too
        assert store.open(model, nxt).restored_tokens == 0


def test_a_model_spread_over_devices_is_refused(tmp_path):
    model = make_model("llama", seed=5)
    model.lm_head.to("meta")  # as device_map="auto" leaves a model: layers on several devices
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        with pytest.raises(ValueError, match=r"spread over \['cpu', 'meta'\].*one device"):
            store.open(model, random_ids(9, 5))


def test_a_model_without_weights_is_refused_saying_how_to_load_them(tmp_path):
    model = make_model("llama", seed=5).to("meta")  # as init_empty_weights leaves a model
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        with pytest.raises(ValueError, match=r"on the meta device and hold no weights.*load its weights"):
            store.open(model, random_ids(9, 5))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_a_model_whose_weights_are_not_its_parameters_is_refused(tmp_path):
    # torch's dynamic quantization packs each linear layer's weights in an opaque object: a base
    # model and a fine-tune of its linear layers, both quantized, fingerprinted alike.
    model = torch.ao.quantization.quantize_dynamic(make_model("llama", seed=5), {torch.nn.Linear}, dtype=torch.qint8)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        with pytest.raises(ValueError, match=r"q_proj \(torch\.ao\.nn\.quantized\.dynamic\..*Linear\) holds its "
                                             r"weights outside"):
            store.open(model, random_ids(9, 5))


def test_another_attention_implementation_never_reuses_blocks(tmp_path):
    # eager and sdpa round differently: from the second layer on their KV differs in the last bits.
    ids = random_ids(40, 3)
    sdpa, eager = make_model("llama", seed=3), make_model("llama", seed=3)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        kv = {}
        for name, m in (("sdpa", sdpa), ("eager", eager)):
            kv[name] = DynamicCache()
            m(ids, past_key_values=kv[name])
    assert not torch.equal(kv["sdpa"].layers[1].keys, kv["eager"].layers[1].keys)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, sdpa, ids, new=2)
        nxt = cat(out, random_ids(3, 4))
        turn(store, eager, nxt, new=2, expect=0)  # checked against no cache, in eager
        turn(store, eager, cat(nxt, random_ids(3, 5)), new=2, expect=nxt.shape[1])
        sdpa.set_attn_implementation("eager")  # the same model object, switched
        assert store.open(sdpa, nxt).restored_tokens == nxt.shape[1] - 1
        sdpa.set_attn_implementation("sdpa")
        assert store.open(sdpa, nxt).restored_tokens == out.shape[1] - 1
        assert_switch_after_open_refused(store, sdpa, nxt, lambda: sdpa.set_attn_implementation("eager"),
                                         lambda: sdpa.set_attn_implementation("sdpa"),
                                         "attention implementation changed since store.open")


def test_other_sdpa_kernels_never_reuse_blocks(tmp_path):
    # torch.nn.attention.sdpa_kernel(SDPBackend.MATH) around a generate, as benchmarks and
    # debugging do: the CPU's math kernel rounds unlike its flash one, from the second layer on.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model("llama", seed=3)
    ids = random_ids(40, 3)
    with torch.no_grad():
        kv = {}
        for name in ("default", "math"):
            kv[name] = DynamicCache()
            with sdpa_kernel(SDPBackend.MATH) if name == "math" else contextlib.nullcontext():
                model(ids, past_key_values=kv[name])
    assert not torch.equal(kv["default"].layers[1].keys, kv["math"].layers[1].keys)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, model, ids, new=2)
        nxt = cat(out, random_ids(3, 4))
        with sdpa_kernel(SDPBackend.MATH):
            # A CPU has no memory-efficient or cuDNN kernel.
            assert describe_model(model).switches == f"sdpa-off:flash,threads:{torch.get_num_threads()}"
            turn(store, model, nxt, new=2, expect=0)  # checked against no cache, under the math kernel
            assert store.open(model, nxt).restored_tokens == nxt.shape[1] - 1
            cache = store.open(model, nxt)
            later = generate(model, nxt, 2, cache)
        assert cache.commit(later) == later.shape[1] - 1  # after the with block: its forwards ran inside
        with sdpa_kernel(SDPBackend.MATH):
            assert store.open(model, later).restored_tokens == later.shape[1] - 1
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # math off: the flash kernel, where it runs
            assert describe_model(model).switches == f"sdpa-off:math,threads:{torch.get_num_threads()}"
            assert store.open(model, nxt).restored_tokens == 0
        assert describe_model(model).switches == f"threads:{torch.get_num_threads()}"
        cache = store.open(model, nxt)
        assert cache.restored_tokens == out.shape[1] - 1
        # Opened outside, generated inside: refused at the first forward.
        with sdpa_kernel(SDPBackend.MATH), pytest.raises(ValueError, match=r"kernel switches changed since store."
                                                                             r"open \(from 'threads:\d+' to "
                                                                             r"'sdpa-off:flash"):
            model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
        # And the other way round.
        with sdpa_kernel(SDPBackend.MATH):
            cache = store.open(model, nxt)
        with pytest.raises(ValueError, match="kernel switches changed since store.open"):
            model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
        # An eager model ignores them.
        eager = make_model("llama", seed=3)
        eager.set_attn_implementation("eager")
        with sdpa_kernel(SDPBackend.MATH):
            assert describe_model(eager).switches == f"threads:{torch.get_num_threads()}"
            cache = store.open(eager, nxt)
        assert torch.equal(generate(eager, nxt, 2, cache), generate(eager, nxt, 2))


def test_sdpa_switches_a_cpu_ignores_change_nothing(tmp_path):
    # A CPU runs SDPA's flash kernel, else its math one, whatever the priority order says, and has
    # no memory-efficient or cuDNN kernel: code written for CUDA that turns cuDNN off
    # (sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH])) or reorders the kernels computes
    # the default's KV, bit for bit. It was refused at a forward of a cache opened outside the
    # block, and restored nothing inside it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model("llama", seed=3).to(torch.bfloat16)
    ids = random_ids(40, 3)
    settings = {"default": contextlib.nullcontext,
                "no cudnn": lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                 SDPBackend.MATH]),
                "math first": lambda: sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True)}
    with torch.no_grad():
        kv = {}
        for name, setting in settings.items():
            kv[name] = DynamicCache()
            with setting():
                model(ids, past_key_values=kv[name])
    assert all(torch.equal(kv["default"].layers[1].keys, kv[name].layers[1].keys) for name in settings)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, model, ids, new=2)
        nxt = cat(out, random_ids(3, 4))
        for name, setting in settings.items():
            cache = store.open(model, nxt)
            assert cache.restored_tokens == out.shape[1] - 1
            with setting():
                assert describe_model(model).switches == cache.model_info.switches
                assert torch.equal(generate(model, nxt, 2, cache), generate(model, nxt, 2)), name


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_onednn_switched_off_never_reuses_blocks(tmp_path):
    # bf16 matmuls on a CPU without oneDNN (torch.backends.mkldnn.flags(enabled=False)) round
    # otherwise: keys 1e-2 apart on an AVX-512 Xeon. (On an AMD EPYC without AVX-512 both took the
    # same kernel, keys equal: the switch is in the fingerprint whatever this CPU does with it, as
    # the store cannot know which CPU computed a block's KV.)
    model = make_model("llama", seed=3).to(torch.bfloat16)
    ids = random_ids(40, 3)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, model, ids, new=2)
        nxt = cat(out, random_ids(3, 4))
        with torch.backends.mkldnn.flags(enabled=False):
            assert describe_model(model).switches == f"threads:{torch.get_num_threads()},onednn:off"
            turn(store, model, nxt, new=2, expect=0)
        cache = store.open(model, nxt)
        assert cache.restored_tokens == out.shape[1] - 1
        with torch.backends.mkldnn.flags(enabled=False), pytest.raises(ValueError, match="to 'threads:[0-9]+,onednn:off'"):
            model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)


def test_other_cpu_thread_counts_never_reuse_blocks(tmp_path):
    # oneDNN and MKL split a matmul's reduction between the intra-op threads: a bf16 Llama (hidden
    # 512, 300 tokens) on 2 threads puts its keys 1e-2 from those on 1, float32 matmuls of 4096 by
    # 4096 1e-4. A store written by a process on 8 threads was restored by one on 4 (another VM
    # size of the same CPU, OMP_NUM_THREADS, torch.set_num_threads), its KV not what 4 threads
    # compute.
    model = make_model("llama", seed=3, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                       num_key_value_heads=4).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            kv = {}
            for n in (1, 2):
                torch.set_num_threads(n)
                kv[n] = DynamicCache()
                model(random_ids(300, 3), past_key_values=kv[n])
        # (Measured here: which shapes split differs between machines.)
        print("1 against 2 threads:", (kv[1].layers[1].keys.float() - kv[2].layers[1].keys.float()).abs().max().item())
        ids = random_ids(40, 3)
        with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
            torch.set_num_threads(2)
            _, out = turn(store, model, ids, new=2)
            nxt = cat(out, random_ids(3, 4))
            torch.set_num_threads(1)
            assert describe_model(model).switches == "threads:1"
            assert store.open(model, nxt).restored_tokens == 0
            torch.set_num_threads(2)
            cache = store.open(model, nxt)
            assert cache.restored_tokens == out.shape[1] - 1
            torch.set_num_threads(1)  # between open and the forwards: refused at the first
            with pytest.raises(ValueError, match=r"from 'threads:2' to 'threads:1'; differing: threads:1, "
                                                 r"threads:2: .*torch.set_num_threads"):
                model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
            # A forward in another thread runs on that thread's count, and is read there.
            torch.set_num_threads(2)
            cache = store.open(model, nxt)
            result: list[object] = []

            def other_thread() -> None:
                torch.set_num_threads(1)
                try:
                    model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
                except ValueError as exc:
                    result.append(exc)

            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
            assert "'threads:1'" in str(result[0]) and torch.get_num_threads() == 2
            cache = store.open(model, nxt)
            assert torch.equal(generate(model, nxt, 2, cache), generate(model, nxt, 2))
    finally:
        torch.set_num_threads(threads)


def test_kernel_switches_on_cuda_name_the_blas_library_and_the_flash_kernel(monkeypatch):
    # Read on CUDA models only; monkeypatched, as no GPU runs the suite.
    from tierkv.cache import _kernel_switches

    blas = torch.backends.cuda.preferred_blas_library()
    assert blas.name == "Cublas" and _kernel_switches(torch.device("cuda"), "sdpa") is None
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda: type(blas).Cublaslt)
    assert _kernel_switches(torch.device("cuda"), "sdpa") == "blas:Cublaslt"
    assert _kernel_switches(torch.device("cpu"), "sdpa") == f"threads:{torch.get_num_threads()}"
    # Another flash kernel activated (torch.nn.attention.activate_flash_attention_impl("FA3")).
    from torch.nn import attention

    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: "FA3")
    assert _kernel_switches(torch.device("cuda"), "sdpa") == "sdpa-flash:FA3,blas:Cublaslt"
    assert _kernel_switches(torch.device("cuda"), "eager") == "blas:Cublaslt"
    assert _kernel_switches(torch.device("cpu"), "sdpa") == f"threads:{torch.get_num_threads()}"


def sdpa_settled_at_first_call(monkeypatch) -> list[int]:
    """CUDA's SDPA kernel order, monkeypatched (no GPU runs the suite): [1, 2, 0, 3, 4] until the
    process's first SDPA call (``torch._fused_sdp_choice``) sets it to [3, 1, 2, 0, 4], as
    sdp_utils.cpp's priority_order() does; the order list is returned for a test to reset."""
    import tierkv.cache as cache_module

    order = [1, 2, 0, 3, 4]

    def first_sdpa(*tensors):
        order[:] = [3, 1, 2, 0, 4]
        return 1

    empty = torch.empty
    monkeypatch.setattr(torch._C, "_get_sdp_priority_order", lambda: list(order))
    monkeypatch.setattr(torch, "_fused_sdp_choice", first_sdpa)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty", lambda *shape, device=None, **kw: empty(*shape, **kw))
    monkeypatch.setattr(cache_module, "_sdpa_order_settled", False)
    return order


def test_kernel_switches_on_cuda_read_sdpas_order_as_torch_settles_it(monkeypatch):
    # torch sets SDPA's kernel order on CUDA once per process, at its first SDPA call: cuDNN first
    # on sm90 and sm100. On an H200 (torch 2.11) a cache opened before the process's first forward
    # read [1, 2, 0, 3, 4], the prefill made it [3, 1, 2, 0, 4], and the first decode step raised
    # "kernel switches changed since store.open". Monkeypatched, as no GPU runs the suite.
    import tierkv.cache as cache_module

    order = sdpa_settled_at_first_call(monkeypatch)
    cuda = torch.device("cuda")
    at_open = cache_module._kernel_switches(cuda, "sdpa")
    torch._fused_sdp_choice()  # the prefill's SDPA
    assert cache_module._kernel_switches(cuda, "sdpa") == at_open == "sdpa-order:[3, 1, 2, 0, 4]"
    # Torch sets no order while every kernel is off (a forward fails then): settled at a later read.
    order[:] = [1, 2, 0, 3, 4]
    monkeypatch.setattr(cache_module, "_sdpa_order_settled", False)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([]):
        assert cache_module._kernel_switches(cuda, "sdpa") == "sdpa-off:flash+mem_efficient+math+cudnn"
    assert cache_module._kernel_switches(cuda, "sdpa") == "sdpa-order:[3, 1, 2, 0, 4]"


def test_a_timeout_as_sdpas_order_is_settled_is_raised_and_it_is_settled_at_the_next_read(monkeypatch):
    """A signal handler's ``TimeoutError`` at any point of ``_settle_sdpa_order`` (an open's read
    of the kernel switches on CUDA) reaches the caller, and the next read settles the order.
    Before, its ``except Exception`` took it for torch's refusal, with the order marked settled
    for the process's life: the open read torch's unsettled order, and the first decode step
    after the prefill (which settles it) was refused for kernel switches changed. Monkeypatched,
    as the test above."""
    import tierkv.cache as cache_module
    from conftest import raised_on_the_way_in

    order = sdpa_settled_at_first_call(monkeypatch)
    cuda = torch.device("cuda")

    def read() -> contextlib.nullcontext:
        order[:] = [1, 2, 0, 3, 4]  # a process before its first SDPA call
        cache_module._sdpa_order_settled = False
        assert cache_module._kernel_switches(cuda, "sdpa") == "sdpa-order:[3, 1, 2, 0, 4]"
        return contextlib.nullcontext()

    def settled_next(sent: list) -> None:
        assert cache_module._kernel_switches(cuda, "sdpa") == "sdpa-order:[3, 1, 2, 0, 4]", sent

    assert raised_on_the_way_in(read, settled_next, within={"_settle_sdpa_order"}, timeout=True) > 5


def test_another_matmul_precision_never_reuses_blocks(tmp_path):
    # torch.set_float32_matmul_precision("medium") runs float32 matmuls through bf16 on a CPU
    # with oneDNN's bf16 kernels (TF32 on CUDA at "high"): fp32 logits 2e-3 apart, against 1e-7.
    # KV written at one precision was restored by a process at the other, the output then not
    # plain's there.
    model = make_model("llama", seed=3)
    ids = random_ids(40, 3)
    saved = torch.get_float32_matmul_precision()
    try:
        with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
            torch.set_float32_matmul_precision("medium")
            _, out = turn(store, model, ids, new=2)
            nxt = cat(out, random_ids(3, 4))
            torch.set_float32_matmul_precision("highest")
            turn(store, model, nxt, new=2, expect=0)  # checked against no cache
            assert describe_model(model).precision is None
            torch.set_float32_matmul_precision("medium")
            assert describe_model(model).precision == "fp32:bf16"
            assert store.open(model, nxt).restored_tokens == out.shape[1] - 1
            # Switched between open and a forward: refused there, before the restored KV meets it.
            cache = store.open(model, nxt)
            torch.set_float32_matmul_precision("highest")
            with pytest.raises(ValueError, match=r"matmul precision changed since store.open \(from 'fp32:bf16' to "
                                                 r"'the default'"):
                model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
            # Switched after the turn's forwards: they all ran at the opened precision, kept under it.
            torch.set_float32_matmul_precision("medium")
            cache = store.open(model, nxt)
            later = model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
            torch.set_float32_matmul_precision("highest")
            assert cache.commit(later) == later.shape[1] - 1
            torch.set_float32_matmul_precision("medium")
            assert store.open(model, later).restored_tokens == later.shape[1] - 1
    finally:
        torch.set_float32_matmul_precision(saved)


def assert_switch_after_open_refused(store, model, ids, switch, back, message):
    """A kernel switched between ``open`` and a forward, or between the turn and ``commit``: refused."""
    cache = store.open(model, ids)
    switch()
    with pytest.raises(ValueError, match=message):
        model(ids[:, cache.get_seq_length():], past_key_values=cache)
    back()
    later = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    switch()
    with pytest.raises(ValueError, match=message):
        cache.commit(later)


def test_matmul_precision_on_a_cpu_names_fp16_reductions_in_fp16(monkeypatch):
    # torch._C._set_cpu_allow_fp16_reduced_precision_reduction(True), which a CPU with fp16
    # arithmetic (AVX512-FP16) honours, reduces fp16 matmuls in fp16. Monkeypatched: this CPU
    # refuses to set it.
    from tierkv.cache import _matmul_precision

    cpu = torch.device("cpu")
    assert _matmul_precision(cpu, torch.float16) is None
    monkeypatch.setattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: True)
    assert _matmul_precision(cpu, torch.float16) == "fp16-reduction:on"
    assert _matmul_precision(cpu, torch.bfloat16) is None


def test_matmul_precision_on_a_cpu_without_onednns_own_setting(monkeypatch, tmp_path):
    # torch before 2.9 has no torch.backends.mkldnn.matmul (its fp32_precision): every open of
    # a float32 model on a CPU raised AttributeError there. The process's precision is read instead.
    from tierkv.cache import _matmul_precision

    monkeypatch.delattr(type(torch.backends.mkldnn), "matmul")
    cpu = torch.device("cpu")
    model = make_model("llama", seed=3)
    ids = random_ids(20, 3)
    saved = torch.get_float32_matmul_precision()
    try:
        with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
            _, out = turn(store, model, ids, new=2)
            turn(store, model, cat(out, random_ids(3, 4)), new=2, expect=out.shape[1] - 1)
        torch.set_float32_matmul_precision("medium")
        assert _matmul_precision(cpu, torch.float32) == "fp32:bf16"
        torch.set_float32_matmul_precision("high")
        assert _matmul_precision(cpu, torch.float32) == "fp32:tf32"
        torch.set_float32_matmul_precision("highest")
        assert _matmul_precision(cpu, torch.float32) is None
    finally:
        torch.set_float32_matmul_precision(saved)


def test_another_moe_experts_implementation_never_reuses_blocks(tmp_path):
    # batched_mm and eager route tokens through the experts in other orders and round differently:
    # from the second layer on the KV differs in the last bits. Whether a shape's sums round apart
    # depends on the CPU's kernels (64 wide did on one VM, not on the next): the first shape here
    # whose KV differs is used.
    ids = random_ids(40, 3)

    def differing_model(hidden: int, inner: int) -> torch.nn.Module | None:
        fields = dict(vocab_size=512, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, initializer_range=0.2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **fields)).eval()
        kv = {}
        with torch.no_grad():
            for impl in ("eager", "batched_mm"):
                model.set_experts_implementation(impl)
                kv[impl] = DynamicCache()
                model(ids, past_key_values=kv[impl])
        return None if torch.equal(kv["eager"].layers[1].keys, kv["batched_mm"].layers[1].keys) else model

    model = next((m for m in (differing_model(*shape) for shape in ((64, 128), (128, 512), (256, 1024)))
                  if m is not None), None)
    assert model is not None, "no shape whose experts implementations round apart: the test proves nothing here"
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        model.set_experts_implementation("eager")
        _, out = turn(store, model, ids, new=2)
        nxt = cat(out, random_ids(3, 4))
        model.set_experts_implementation("batched_mm")
        turn(store, model, nxt, new=2, expect=0)  # checked against no cache, under batched_mm
        model.set_experts_implementation("eager")
        assert store.open(model, nxt).restored_tokens == out.shape[1] - 1
        assert_switch_after_open_refused(store, model, nxt, lambda: model.set_experts_implementation("batched_mm"),
                                         lambda: model.set_experts_implementation("eager"),
                                         "experts implementation changed since store.open .from 'eager' to "
                                         "'batched_mm'")
    # A dense model has no experts: switching their implementation changes nothing.
    dense = make_model("llama", seed=3)
    with TieredStore(tmp_path / "dense", device="cpu", block_size=4) as store:
        _, out = turn(store, dense, ids, new=2)
        dense.set_experts_implementation("batched_mm")
        assert store.open(dense, cat(out, random_ids(3, 4))).restored_tokens == out.shape[1] - 1


def test_generates_switch_of_moe_experts_for_decoding_on_a_gpu_is_let_through(tmp_path, monkeypatch):
    # Before: on a GPU, generate() runs the steps after its prefill with grouped_mm experts on
    # batched_mm (transformers' _optimize_model_for_decode), and the hook refused the first one:
    # every MoE generate on CUDA with a TieredCache raised. Here that switch is made on CPU too.
    import contextlib

    from transformers import GenerationMixin

    @contextlib.contextmanager
    def as_on_a_gpu(self):
        original = self.get_experts_implementation()
        self.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
        try:
            yield
        finally:
            self.set_experts_implementation(original)

    monkeypatch.setattr(GenerationMixin, "_optimize_model_for_decode", as_on_a_gpu)
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **fields)).eval()
    assert set(model.get_experts_implementation().values()) == {"grouped_mm"}
    ids = random_ids(20, 7)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        # Only the prefill's KV is kept: the steps after it ran on the other kernel.
        _, out = turn(store, model, ids, new=4, expect_stored=ids.shape[1])
        nxt = cat(out, random_ids(3, 8))
        _, out = turn(store, model, nxt, new=4, expect=ids.shape[1], expect_stored=nxt.shape[1])  # exact
        # Still refused where generate() does not switch: a prefill, or a forward of the caller's.
        assert_switch_after_open_refused(store, model, cat(out, random_ids(3, 9)),
                                         lambda: model.set_experts_implementation("batched_mm"),
                                         lambda: model.set_experts_implementation("grouped_mm"),
                                         "experts implementation changed since store.open .from 'grouped_mm' to "
                                         "'batched_mm'")


class _BufferLinear(torch.nn.Module):
    """A linear layer whose weight is a persistent buffer, as GPTQ's and BitNet's layers keep theirs."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.register_buffer("packed", linear.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.packed)


def _with_buffer_weights(seed: int, scale: float) -> torch.nn.Module:
    model = make_model("llama", seed=seed)
    for layer in model.model.layers:
        layer.self_attn.k_proj = _BufferLinear(layer.self_attn.k_proj)
        layer.self_attn.k_proj.packed.mul_(scale)
    return model


def test_weights_kept_in_persistent_buffers_are_fingerprinted(tmp_path):
    # Same parameters, other buffer weights: other keys in every layer.
    one, two = _with_buffer_weights(5, 1.0), _with_buffer_weights(5, 2.0)
    ids = random_ids(20, 6)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, one, ids, new=2)
        turn(store, two, out, new=2, expect=0)  # checked against no cache
        assert store.open(one, out).restored_tokens == out.shape[1] - 1
        with torch.no_grad():
            one.model.layers[1].self_attn.k_proj.packed.mul_(3.0)  # written in place
        assert store.open(one, out).restored_tokens == 0
        one.model.layers[1].self_attn.k_proj.packed = two.model.layers[1].self_attn.k_proj.packed.clone()  # replaced
        assert store.open(one, out).restored_tokens == 0
        assert len(WeightSample(one).params) == len(list(one.parameters())) + len(one.model.layers)
    # A non-persistent buffer follows from the config, and some forwards reassign it (GPT-J's
    # table, moved to the device; inv_freq under dynamic RoPE): not a weight, so neither the sample
    # is rebuilt nor the weights digested again. Its values are in the fingerprint.
    before, static = describe_model(one).fingerprint, _static_cache[one]
    weights = static.weights
    rotary = one.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.clone()
    assert describe_model(one).fingerprint == before and _static_cache[one] is static
    with torch.no_grad():
        rotary.inv_freq.mul_(0.5)  # RoPE scaled in place: every key changes
    halved = describe_model(one).fingerprint
    assert halved != before and _static_cache[one] is static and static.weights is weights
    rotary.inv_freq = rotary.inv_freq * 2
    assert describe_model(one).fingerprint == before
    config = copy.deepcopy(one.config)
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    one.model.rotary_emb = type(rotary)(config)  # a module with no parameters
    assert describe_model(one).fingerprint not in (before, halved) and static.weights is weights


def test_other_weights_or_dtypes_never_reuse_blocks(tiny_model, tmp_path):
    model = tiny_model("llama")
    others = {
        "seed 1": tiny_model("llama", 1),
        "float64": make_model("llama", 0).to(torch.float64),
        "bfloat16": make_model("llama", 0).to(torch.bfloat16),
    }
    ids = random_ids(30, 50)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", expect_stored=33)
        blocks = 5
        for name, other in others.items():
            cache = verify_open(store, other, out, session=name, expect=0)
            out_other = verify_generate(other, out, cache, 3)
            assert cache.commit(out_other) == 36, name
            blocks += 5
            assert store.stats()["device"]["blocks"] == blocks, name
            verify_open(store, other, out_other, session=name, expect=36)
        # Nothing the others stored is served to the first model, nor replaced its blocks.
        cache = verify_open(store, model, out, session="s", expect=33)
        verify_generate(model, out, cache, 3)


def test_one_session_name_used_with_two_models_keeps_each_models_tail(tiny_model, tmp_path):
    # A partial tail is superseded only by a longer chain under the same prefix (store.py's
    # docstring); another model's chain shares no prefix with it.
    model, other = tiny_model("llama"), tiny_model("llama", 1)
    ids = random_ids(30, 52)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", expect_stored=33)  # 4 blocks + a 1-token tail
        _, out_other = turn(store, other, ids, session="s", expect=0, expect_stored=33)
        assert store.stats()["device"]["blocks"] == 10
        verify_open(store, model, out, session="s", expect=33)
        verify_open(store, other, out_other, session="s", expect=33)


def test_weights_changed_in_place_never_reuse_blocks(tiny_model, tmp_path):
    model = make_model("llama", 0)
    ids = random_ids(20, 51)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", expect_stored=23)
        verify_open(store, model, out, session="s", expect=23)
        model.load_state_dict(tiny_model("llama", 2).state_dict())
        cache = verify_open(store, model, out, session="s", expect=0)
        verify_generate(model, out, cache, 3)


def test_weights_written_through_data_change_the_fingerprint(tiny_model, tmp_path):
    # `p.data` writes bypass autograd's version counter: the fingerprint must still see them.
    model = make_model("llama", 0)
    ids = random_ids(24, 38)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", expect_stored=27)
        verify_open(store, model, out, session="s", expect=27)
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(1.5)
        cache = verify_open(store, model, out, session="s", expect=0)
        verify_generate(model, out, cache, 3)


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_a_store_written_by_another_release_restores_nothing_after_a_restart(tmp_path, monkeypatch, module):
    # Another torch picks other kernels, another transformers may change the model's code: KV
    # they computed can differ in the last bits from what this process computes.
    import transformers
    ids = random_ids(24, 39)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, make_model("llama", 0), ids, session="s", expect_stored=27)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:  # a restart, the same releases
        verify_open(store, make_model("llama", 0), out, session="s", expect=27, expect_from={"device": 0, "host": 0, "disk": 27})
    released = {"torch": torch, "transformers": transformers}[module]
    monkeypatch.setattr(released, "__version__", f"{released.__version__}.post1")
    model = make_model("llama", 0)  # a fresh object: the first one's fingerprint facts are cached
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = verify_open(store, model, out, session="s", expect=0)
        out = verify_generate(model, out, cache, 3)
        assert cache.commit(out) == 30
        verify_open(store, model, out, session="s", expect=30)


def test_a_config_field_edited_on_the_live_model_restores_nothing_then_its_own_kv_again(tmp_path, monkeypatch):
    """OLMo reads clip_qkv at every forward (X-MOD's set_default_language edits its config the same
    way): the config's digest, cached per model object, is taken again when a field changed, and
    the weights' digest is reused rather than read again."""
    import tierkv.cache as cache_module

    config = AutoConfig.for_model("olmo", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    digests = []
    monkeypatch.setattr(cache_module, "digest_weights",
                        lambda params, _real=cache_module.digest_weights: digests.append(1) or _real(params))
    ids = random_ids(3 * B + 2)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, 2, cache)
        cache.commit(out)
        later = torch.cat([out, random_ids(3, seed=9)], dim=1)
        for clip, restored in ((0.05, 0), (None, out.shape[1] - 1)):
            model.config.clip_qkv = clip
            cache = verify_open(store, model, later, expect=restored)
            assert torch.equal(generate(model, later, 3, cache), generate(model, later, 3))
    assert len(digests) == 1


def test_the_fingerprint_covers_the_device_kind_and_gpu_model(monkeypatch):
    from tierkv.cache import _kernels_tag
    gpus = {0: ("NVIDIA H200", (9, 0)), 1: ("NVIDIA A100-SXM4-80GB", (8, 0)), 2: ("NVIDIA H200", (9, 0))}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: gpus[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: gpus[i][1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    tags = {name: _kernels_tag(torch.device(name)) for name in ("cpu", "cuda:0", "cuda:1", "cuda:2", "cuda", "mps")}
    assert len({tags["cpu"], tags["cuda:0"], tags["cuda:1"], tags["mps"]}) == 4
    assert tags["cuda:0"] == tags["cuda:2"]  # two GPUs of one model compute alike
    assert tags["cuda"] == tags["cuda:1"]  # the current device
    assert b"NVIDIA H200" in tags["cuda:0"] and b"sm_90" in tags["cuda:0"]


def test_the_fingerprint_covers_the_cpus_vector_code(monkeypatch):
    """ATen's dispatch level, the CPU's vendor, model and vector features, and the settings that
    override them: not the other flags (mitigations come and go with microcode)."""
    import tierkv.cache as cache_module

    x86 = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
           "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse sse2 ssse3 fma avx avx2 avx512f smep{extra}\n"
           "\nprocessor\t: 1\nflags\t\t: fpu\n")
    base = cache_module._cpu_identity(x86.format(extra=""))
    assert base == ["vendor_id:GenuineIntel", "cpu family:6", "model:143",
                    "features:avx avx2 avx512f fma sse sse2 ssse3"]
    assert cache_module._cpu_identity(x86.format(extra=" md_clear flush_l1d")) == base
    # AMD's Secure Memory Encryption (x86's "sme"), on or off in the BIOS: the same vector units.
    assert cache_module._cpu_identity(x86.format(extra=" sme sev sev_es sme_coherent")) == base
    assert cache_module._cpu_identity(x86.format(extra=" amx_tile avx512_bf16")) != base
    assert cache_module._cpu_identity(x86.replace("model\t\t: 143", "model\t\t: 85").format(extra="")) != base
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"
    assert "sme" in cache_module._cpu_identity(arm.replace("i8mm", "i8mm sme"))[-1]  # Arm's matrix extension
    assert cache_module._cpu_identity(arm) == ["cpu implementer:0x41", "cpu part:0xd4f",
                                               "features:asimd bf16 i8mm sve"]
    assert cache_module._cpu_identity(None)  # no /proc/cpuinfo: what platform says

    def tag(capability: str, **env: str) -> bytes:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        for name in (*cache_module._KERNEL_ENV, "ATEN_CPU_CAPABILITY"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cache_module._cpu_tag.cache_clear()
        try:
            return cache_module._kernels_tag(torch.device("cpu"))
        finally:
            cache_module._cpu_tag.cache_clear()

    tags = [tag("AVX512"), tag("AVX2"), tag("AVX512", MKL_ENABLE_INSTRUCTIONS="AVX2"),
            tag("AVX512", ONEDNN_MAX_CPU_ISA="AVX2")]
    assert len(set(tags)) == len(tags)
    assert tag("AVX512") == tags[0]
    # ATEN_CPU_CAPABILITY by its effect alone: set to the level the CPU runs anyway, the same tag.
    assert tag("AVX512", ATEN_CPU_CAPABILITY="avx512") == tags[0]
    assert tag("AVX2", ATEN_CPU_CAPABILITY="avx2") == tags[1]


def test_a_timeout_as_the_config_is_snapshot_is_raised_not_taken_for_a_field_deepcopy_cannot_copy():
    """A signal handler's ``TimeoutError`` as ``_snapshot`` deep-copies the config's fields (an
    open's first look at a model) reaches the caller. Before, its ``except Exception`` for a field
    ``deepcopy`` cannot copy took it for one: the snapshot was shallow, so a nested field edited
    in place later (``rope_parameters``) went unseen, and the timeout was lost."""
    from conftest import raised_on_the_way_in

    model = make_model("llama")

    def described() -> contextlib.nullcontext:
        _static_cache.pop(model, None)  # its facts taken anew
        describe_model(model)
        return contextlib.nullcontext()

    assert raised_on_the_way_in(described, lambda sent: None, within={"_snapshot"}, timeout=True) >= 2


def test_a_timeout_as_a_forwards_source_is_read_is_raised_not_taken_for_no_source():
    """A signal handler's ``TimeoutError`` at any point of ``_cache_handed_by_position`` (an
    open's check of a model's forwards) reaches the caller. Before, the ``except OSError`` for a
    forward whose source cannot be read took it for one: that forward went unjudged, a model
    handing its inner model the cache by position (CPM-Ant) was accepted, and the timeout lost."""
    from conftest import raised_on_the_way_in

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "cpmant", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128,
        num_hidden_layers=2, prompt_length=4, position_bias_num_buckets=32, position_bias_max_distance=64)).eval()

    def refused() -> contextlib.nullcontext:
        with pytest.raises(ValueError, match="hands CpmAntModel.forward its cache as positional argument"):
            describe_model(model)
        return contextlib.nullcontext()

    assert raised_on_the_way_in(refused, lambda sent: None, within={"_cache_handed_by_position"}, timeout=True) > 10


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="no /proc/cpuinfo to read")
def test_a_timeout_as_the_cpus_identity_is_read_is_raised_not_taken_for_another_cpu():
    """A signal handler's ``TimeoutError`` at any point of ``_cpu_tag`` (an open's fingerprint on
    a CPU) reaches the caller, and the tag read after it is the CPU's. Before, the ``except
    OSError`` around the read of /proc/cpuinfo took it for no such file: the tag named what
    ``platform`` says instead, cached for the process's life, so the store restored none of the
    KV it had written before and wrote what a run without the timeout would not restore."""
    import tierkv.cache as cache_module
    from conftest import raised_on_the_way_in

    cpu = torch.device("cpu")
    cache_module._cpu_tag.cache_clear()
    try:
        tag = cache_module._kernels_tag(cpu)

        def enter() -> contextlib.nullcontext:
            cache_module._cpu_tag.cache_clear()
            cache_module._kernels_tag(cpu)
            return contextlib.nullcontext()

        def same(sent: list) -> None:
            assert cache_module._kernels_tag(cpu) == tag, sent

        assert raised_on_the_way_in(enter, same, within={"_cpu_tag"}, timeout=True) > 4
    finally:
        cache_module._cpu_tag.cache_clear()


_CAPABILITY_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from conftest import make_model, random_ids
from tierkv import TieredStore
model = make_model("gpt2")
model.load_state_dict(torch.load(sys.argv[3]))  # random init draws other weights under other vector code
ids = random_ids(4 * 8 + 3, seed=21)
with TieredStore(sys.argv[1], device="cpu", block_size=8) as store:
    cache = store.open(model, ids)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    plain = model.generate(ids, max_new_tokens=3, do_sample=False)
    print("RESULT", cache.restored_tokens, torch.equal(out, plain), torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="this CPU has no vector code above ATen's DEFAULT to compare with")
def test_a_store_read_under_other_vector_code_restores_nothing(tmp_path):
    """KV written with ATen's AVX2/AVX512 kernels is not restored by a process that runs its
    DEFAULT ones (``ATEN_CPU_CAPABILITY``, as on a machine without those units): its keys differ
    from the second layer on. A process like the writer restores it (the control). GPT-2: no RoPE
    frequencies, whose digest (their values computed by those kernels) would tell them apart anyway."""
    import subprocess
    import sys

    model = make_model("gpt2")
    ids = random_ids(4 * B + 3, seed=21)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids[:, :-4])
        cache.commit(model.generate(ids[:, :-4], past_key_values=cache, max_new_tokens=1, do_sample=False))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    tests = os.path.dirname(os.path.abspath(__file__))
    results = {}
    # And one under ATEN_CPU_CAPABILITY set to the level it runs anyway: the same kernels, restored
    # (a fleet pinned to avx2 restored nothing of its AVX2 machines' own KV written unpinned).
    own = torch.backends.cpu.get_cpu_capability().lower()
    for capability in ("default", None, *([own] if own in ("avx2", "avx512") else [])):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        proc = subprocess.run([sys.executable, "-c", _CAPABILITY_CHILD, str(tmp_path / "kv"), tests,
                               str(tmp_path / "weights.pt")],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        results[capability] = line.split()[1:]
    assert results["default"][0] == "0" and results["default"][1:] == ["True", "DEFAULT"]
    assert results[None][0] == str(4 * B - 1) and results[None][1] == "True"
    assert results.get(own, results[None])[0] == str(4 * B - 1)


# -- 7. budgets --------------------------------------------------------------------------------------
def _many_conversations(store: TieredStore, model: torch.nn.Module, seed: int) -> list[tuple[int, int]]:
    """30 turns over 10 sessions of random lengths; budgets checked after every open and commit.
    Returns, per returning turn, (restored, tokens the session stored last time)."""
    rng = random.Random(seed)
    last: dict[str, tuple[torch.Tensor, int]] = {}
    returning = []
    for i in range(30):
        session = f"s{rng.randrange(10)}"
        if session in last:
            out, stored = last[session]
            ids = cat(out, random_ids(rng.randint(2, 12), 10_000 + i))
        else:
            ids, stored = random_ids(rng.randint(3, 40), 10_000 + i), 0
        cache = verify_open(store, model, ids, session=session)
        verify_budgets(store)
        if session in last:
            assert cache.restored_tokens <= stored
            returning.append((cache.restored_tokens, stored))
        out = verify_generate(model, ids, cache, rng.randint(1, 4))
        stored = cache.commit(out)
        assert 0 <= stored <= out.shape[1] - 1
        last[session] = (out, stored)
        verify_budgets(store)
    assert len(returning) >= 10
    return returning


@pytest.mark.parametrize(("timeout", "error"), [(-1, ValueError), (float("nan"), ValueError), ("5", TypeError),
                                              (True, TypeError)])
def test_a_bad_close_timeout_is_refused_before_anything_is_dropped(tiny_model, tmp_path, timeout, error):
    """-1 means "no timeout" to many APIs; here it would have dropped every queued write."""
    model = tiny_model()
    ids = random_ids(4 * B + 1)
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=B)
    cache = store.open(model, ids)
    cache.commit(generate(model, ids, 1, cache))
    with pytest.raises(error, match=r"close\(timeout\) must be None"):
        store.close(timeout)
    assert store.close(float("inf")) == 0  # inf: as long as it takes, like None
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == 5



def test_a_close_again_after_the_disk_tiers_close_raised_finishes_it_without_a_disk_error(tiny_model, tmp_path,
                                                                                        caplog):
    """``close()`` again, as its docstring says, after the first one's disk tier close raised a
    disk error as it let go of its files (the `tierkv clear` command retries it so): the second
    finished the close, and first synced the closed environment, whose "Attempt to operate on
    closed/deleted/dropped object" was logged as the disk's I/O error and counted as one."""
    model = tiny_model()
    ids = random_ids(4 * B + 1)
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=B)
    cache = store.open(model, ids)
    cache.commit(generate(model, ids, 1, cache))
    real_close = store._disk.close
    calls: list[float | None] = []

    def failing_close(timeout: float | None = None) -> bool:
        calls.append(timeout)
        closed = real_close(timeout)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")  # as os.close of its data file may
        return closed

    store._disk.close = failing_close  # type: ignore[method-assign]
    with pytest.raises(OSError, match="Input/output error"):
        store.close()
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        assert store.close() == 0
    assert len(calls) == 2 and store._released
    assert store.stats()["disk_errors"] == 0 and not store._disk_failed
    assert not [r for r in caplog.records if "closed/deleted/dropped" in r.getMessage()], caplog.text
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:  # its directory free, its blocks there
        assert store.stats()["disk"]["blocks"] == 5

def test_a_reopen_whose_disk_budget_evicts_blocks_it_found_says_so(tiny_model, tmp_path, caplog):
    model = tiny_model()
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        for seed in range(3):
            ids = random_ids(4 * B + 1, seed=seed)
            cache = store.open(model, ids)
            cache.commit(generate(model, ids, 1, cache))
        store.flush()
        held = store.stats()["disk"]
    one_block = held["bytes"] // held["blocks"]
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        with TieredStore(tmp_path / "kv", device="cpu", block_size=B, disk_budget=held["bytes"]) as store:
            assert store.stats()["disk"]["blocks"] == held["blocks"]
        assert not caplog.records  # a budget that holds them all: nothing to say
        with TieredStore(tmp_path / "kv", device="cpu", block_size=B, disk_budget=4 * one_block) as store:
            kept = store.stats()["disk"]["blocks"]
    assert 0 < kept <= 4
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"holds {held['blocks']} blocks" in record.getMessage()
    assert f"the least recently used {held['blocks'] - kept} were evicted. Pass a larger disk_budget" in \
        record.getMessage()


def test_budgets_hold_in_every_tier_through_many_conversations(tiny_model, tmp_path):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", device_budget=3 * full, host_budget=5 * full, disk_budget=12 * 4400,
                     block_size=B) as store:
        _many_conversations(store, model, seed=1)
        store.flush()
        stats = verify_budgets(store)
        assert stats["pending_writes"] == 0  # flush waited for every write
        assert stats["evictions"] > 0
        assert stats["disk"]["blocks"] > 0
    # The disk tier's accounting is what LMDB holds.
    records = disk_records(path)
    assert len(records) == stats["disk"]["blocks"]
    with lmdb.open(str(path), readonly=True, lock=False, max_dbs=8) as env:
        page = env.stat()["psize"]
    assert sum(footprint(n, page, head) for n, head in records.values()) == stats["disk"]["bytes"] <= 12 * 4400


def test_zero_memory_budgets_pass_every_block_to_disk(tiny_model, tmp_path):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", device_budget=0, host_budget="0MiB", block_size=B) as store:
        returning = _many_conversations(store, model, seed=2)
        assert returning == [(stored, stored) for _, stored in returning]  # nothing lost: disk is big
        stats = store.stats()
        assert stats["device"] == {"bytes": 0, "budget": 0, "blocks": 0}
        assert stats["host"] == {"bytes": 0, "budget": 0, "blocks": 0}
        assert stats["hits"]["device"] == stats["hits"]["host"] == 0
        assert stats["hits"]["disk"] == sum(r for r, _ in returning) > 0


def test_without_a_disk_tier_evicted_blocks_are_dropped_and_restores_shrink(tiny_model):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    with TieredStore(None, device="cpu", device_budget=3 * full, host_budget=5 * full, block_size=B) as store:
        returning = _many_conversations(store, model, seed=3)
        stats = store.stats()
        assert stats["disk"] == {"bytes": 0, "budget": 0, "blocks": 0}
        assert stats["device"]["bytes"] + stats["host"]["bytes"] <= 8 * full
        assert len(store._index.blocks) == stats["device"]["blocks"] + stats["host"]["blocks"]
        assert stats["evictions"] > 0
        assert any(restored < stored for restored, stored in returning)


def test_without_a_disk_tier_a_long_conversation_beyond_memory_keeps_its_prefix(tiny_model):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    with TieredStore(None, device="cpu", device_budget=1 * full, host_budget=2 * full, block_size=B) as store:
        ids = random_ids(48, 60)
        # A commit never evicts its own earlier blocks: the prefix that fits is kept, and the
        # chain stops at the first block that can rest nowhere (a block without its parent is useless).
        cache, out = turn(store, model, ids, session="s", new=1, expect_stored=24)
        keys = keys_of(cache.root, ids)
        assert list(store._index.lru[Tier.DEVICE]) == keys[:1]
        # Touched tail first, head last: the tail is the first to leave.
        assert list(store._index.lru[Tier.HOST]) == [keys[2], keys[1]]
        assert set(store._index.blocks) == set(keys[:3])
        assert store.stats()["evictions"] == 1  # block 3, which could rest nowhere
        assert store.stats()["sessions"] == 1
        cache = verify_open(store, model, out, session="s", expect=24,
                            expect_from={"device": 8, "host": 16, "disk": 0})
        verify_generate(model, out, cache, 2)


def test_zero_budgets_without_a_disk_tier_keep_nothing(tiny_model):
    model = tiny_model("llama")
    with TieredStore(None, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        ids = random_ids(20, 61)
        cache, out = turn(store, model, ids, session="s", expect=0, expect_stored=0)
        stats = store.stats()
        for tier in ("device", "host", "disk"):
            assert stats[tier] == {"bytes": 0, "budget": 0, "blocks": 0}
        assert stats["evictions"] == 1  # the first block could rest nowhere; the chain stops there
        assert store._index.blocks == {}
        turn(store, model, cat(out, random_ids(3, 62)), session="s", expect=0, expect_stored=0)


# -- 8, 9. exact LRU order, and its rebuild on reopen -------------------------------------------
def _lru_scenario(store: TieredStore, model: torch.nn.Module) -> tuple[dict[bytes, str], list[torch.Tensor]]:
    blocks = [distinct_block(i) for i in range(6)]
    named: dict[bytes, str] = {}
    root = None

    def commit(i: int) -> None:
        nonlocal root
        cache, _ = turn(store, model, blocks[i], session=f"s{i}", new=1, expect=0, expect_stored=B)
        root = cache.root
        named[keys_of(root, blocks[i])[0]] = f"c{i}"

    def reopen(i: int, tier: str) -> None:
        ids = cat(blocks[i], random_ids(2, 600 + i))
        expect_from = {"device": 0, "host": 0, "disk": 0} | {tier: B}
        cache = verify_open(store, model, ids, session=f"s{i}", expect=B, expect_from=expect_from)
        verify_generate(model, ids, cache, 1)

    def verify(device: list[str], host: list[str], evictions: int) -> None:
        assert names(store._index.lru[Tier.DEVICE], named) == device
        assert names(store._index.lru[Tier.HOST], named) == host
        stats = verify_budgets(store)
        assert stats["evictions"] == evictions

    for i in range(3):
        commit(i)
    verify(["c0", "c1", "c2"], [], 0)
    commit(3)
    verify(["c1", "c2", "c3"], ["c0"], 1)
    commit(4)
    verify(["c2", "c3", "c4"], ["c0", "c1"], 2)
    reopen(1, "host")  # promoted: pushes c2, the device's least recently used, down
    verify(["c3", "c4", "c1"], ["c0", "c2"], 3)
    reopen(3, "device")  # touched in place
    verify(["c4", "c1", "c3"], ["c0", "c2"], 3)
    commit(5)  # c4 goes down and c0, the host's oldest, leaves memory
    verify(["c1", "c3", "c5"], ["c2", "c4"], 5)
    reopen(0, "disk")
    verify(["c3", "c5", "c0"], ["c4", "c1"], 7)
    reopen(2, "disk")
    verify(["c5", "c0", "c2"], ["c1", "c3"], 9)
    # The disk tier is inclusive: every block, in last-use order.
    assert names(store._index.lru[Tier.DISK], named) == ["c4", "c1", "c3", "c5", "c0", "c2"]
    return named, blocks


def test_lru_eviction_order_is_exact(tiny_model, tmp_path):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    with TieredStore(tmp_path / "kv", device="cpu", device_budget=3 * full, host_budget=2 * full,
                     block_size=B) as store:
        _lru_scenario(store, model)


def test_a_restore_from_the_host_tier_leaves_blocks_the_device_cannot_take_where_they_are(tiny_model, tmp_path):
    """No block taken out of the host tier and put back (its pool lease let go of and held again)
    for each restore: only touched, most recent last, tails before their heads."""
    model = tiny_model("llama")
    full = full_block_bytes(model)
    with TieredStore(None, device="cpu", device_budget=0, host_budget=8 * full, block_size=B) as store:
        convs = [random_ids(2 * B + 1, 900 + i) for i in range(2)]
        outs = [turn(store, model, ids)[1] for ids in convs]
        before = list(store._index.lru[Tier.HOST])
        moved: list[str] = []
        for name in ("pop", "put"):
            real = getattr(store._host, name)
            setattr(store._host, name, lambda *a, real=real, name=name: (moved.append(name), real(*a))[1])
        ids = cat(outs[0], random_ids(2, 910))
        cache = verify_open(store, model, ids, expect=2 * B + 4, expect_from={"device": 0, "host": 2 * B + 4, "disk": 0})
        assert moved == []
        restored = cache._restored_keys
        assert len(restored) == 3
        assert list(store._index.lru[Tier.HOST]) == [k for k in before if k not in restored] + restored[::-1]
        verify_generate(model, ids, cache, 1)
        verify_budgets(store)


def test_reopen_rebuilds_the_index_in_last_use_order(tiny_model, tmp_path):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", device_budget=3 * full, host_budget=2 * full, block_size=B) as store:
        named, blocks = _lru_scenario(store, model)
        before = list(store._index.lru[Tier.DISK])
        sizes = {k: store._index.blocks[k].record_bytes for k in before}
    with TieredStore(path, device="cpu", device_budget=3 * full, host_budget=2 * full, block_size=B) as store:
        assert names(store._index.lru[Tier.DISK], named) == names(before, named)
        assert list(store._index.lru[Tier.DEVICE]) == list(store._index.lru[Tier.HOST]) == []
        assert store.stats()["disk"]["bytes"] == sum(sizes.values())
    # A smaller disk budget on reopen evicts the least recently used first.
    budget = sum(sizes[k] for k in before[2:])
    with TieredStore(path, device="cpu", disk_budget=budget, block_size=B) as store:
        assert names(store._index.lru[Tier.DISK], named) == names(before[2:], named)
        assert store.stats()["evictions"] == 2
        for i, block in enumerate(blocks):
            ids = cat(block, random_ids(2, 700 + i))
            expect = 0 if f"c{i}" in names(before[:2], named) else B
            cache = verify_open(store, model, ids, expect=expect)
            verify_generate(model, ids, cache, 1)


def test_the_index_holds_each_key_and_tenant_once_live_and_after_a_reopen(tiny_model, tmp_path):
    # Memory (h110): a turn's chain of keys is a copy of every key the index held, and a reopen
    # decoded each block's parent key, tenant and key (the disk tier's place of it) once more: a
    # block's parent, its tenant and the disk tier's map share the index's own objects.
    model = tiny_model("llama")
    path = tmp_path / "kv"

    def shared(store: TieredStore) -> None:
        blocks = store._index.blocks
        with_parents = [m for m in blocks.values() if m.parent in blocks]
        assert len(with_parents) >= 4
        assert all([m.parent is blocks[m.parent].key for m in with_parents])
        assert len({id(m.tenant) for m in blocks.values()}) == 1
        assert len(store._disk._where) == len(blocks)
        assert all([k is blocks[k].key for k in store._disk._where])

    ids = cat(random_ids(2 * B + 3, 40))
    with TieredStore(path, device="cpu", block_size=B) as store:
        for t in range(3):
            _, out = turn(store, model, ids, session="s", tenant="acme", new=2)
            ids = cat(out, random_ids(B, 41 + t))
        store.flush()
        shared(store)
    with TieredStore(path, device="cpu", block_size=B) as store:
        shared(store)


def test_blocks_keep_their_ids_as_int32_live_and_after_a_reopen_and_restore_as_before(tiny_model, tmp_path):
    # Memory (h110): half the bytes of a block's ids (most of its memory at block_size 256).
    model = tiny_model("llama")
    path = tmp_path / "kv"
    ids = random_ids(3 * B + 2, 50)
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", new=3)
        metas = list(store._index.blocks.values())
        assert len(metas) == 4 and [m.token_ids.dtype for m in metas] == [np.int32] * 4
        assert np.concatenate([m.token_ids for m in metas]).tolist() == out[0, :-1].tolist()
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert {m.token_ids.dtype for m in store._index.blocks.values()} == {np.dtype(np.int32)}
        more = cat(out, random_ids(B, 51))
        turn(store, model, more, session="s", expect=out.shape[1] - 1)
        forgotten = store.forget(session="s")
        assert forgotten >= 5 and store._index.blocks == {}


def test_a_store_written_without_heads_reopens_whole_and_gains_them(tiny_model, tmp_path):
    # Stores written before heads existed: every block is found from its record, restores
    # exactly, and is given a head, so that the next reopen reads no record.
    model = tiny_model("llama")
    path = tmp_path / "kv"
    convs = [random_ids(2 * B + 3, 800 + i) for i in range(3)]
    outs = []
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        for ids in convs:
            outs.append(turn(store, model, ids, new=2)[1])
        keys = set(store._index.blocks)
        store.flush()
        env = store._disk.env
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(b"heads", txn=txn), delete=True)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        assert set(store._index.blocks) == keys
        for i, out in enumerate(outs):
            ids = cat(out, random_ids(2, 810 + i))
            cache = verify_open(store, model, ids, expect=out.shape[1] - 1)
            verify_generate(model, ids, cache, 2)
        store.flush()
        assert store._disk.scan().unindexed == {}  # every block has its head now
    assert store.stats()["corrupt"] == 0


def test_open_asks_the_disk_for_every_block_it_reads_before_reading_one(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    ids = random_ids(3 * B + 2, 820)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        _, out = turn(store, model, ids, new=2)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        calls: list[tuple[str, object]] = []
        prefetch, load = store._disk.prefetch, store._disk.read_into
        store._disk.prefetch = lambda keys: (calls.append(("prefetch", list(keys))), prefetch(keys))[1]
        store._disk.read_into = lambda key, into: (calls.append(("load", key)), load(key, into))[1]
        nxt = cat(out, random_ids(2, 821))
        cache = verify_open(store, model, nxt, expect=out.shape[1] - 1, expect_from={"device": 0, "host": 0,
                                                                                     "disk": out.shape[1] - 1})
        verify_generate(model, nxt, cache, 2)
    root = cache.root
    planned = [k for k in keys_of(root, out[:, :out.shape[1] - 1])]
    assert calls == [("prefetch", planned), *(("load", k) for k in planned)]


# -- 10. stats ---------------------------------------------------------------------------------------
def test_hits_never_go_down_when_assisted_decoding_discards_a_restore(tmp_path):
    # Metrics export hits as Prometheus counters: a counter that goes down reads as a reset.
    model = make_model("llama", seed=7)
    ids = random_ids(12, 7)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        _, out = turn(store, model, ids, new=2)
        nxt = cat(out, ids[:, 2:6])
        cache = store.open(model, nxt)
        restored = cache.restored_tokens
        before = store.stats()
        assert restored > 0 and before["discarded"] == 0
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=3, do_sample=False,
                             prompt_lookup_num_tokens=2)
        assert torch.equal(got, generate(model, nxt, 3))
        after = store.stats()
        assert after["hits"] == before["hits"]  # unchanged, not taken back
        assert after["discarded"] == restored and after["misses"] == before["misses"] + restored


def _verify_stats_shape(stats: dict) -> None:
    assert {"device", "host", "disk", "hits", "misses", "evictions", "corrupt"} <= set(stats)
    for tier in ("device", "host", "disk"):
        assert set(stats[tier]) == {"bytes", "budget", "blocks"}
    assert set(stats["hits"]) == {"device", "host", "disk"}
    values = [*(stats[t][f] for t in ("device", "host", "disk") for f in ("bytes", "budget", "blocks")),
              *stats["hits"].values(), stats["misses"], stats["evictions"], stats["corrupt"]]
    assert all(type(v) is int for v in values), stats


def test_stats_count_hits_per_tier_in_tokens_misses_and_evictions(tiny_model, tmp_path):
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", device_budget="4KiB", host_budget=4096, disk_budget="1MB",
                     block_size=B) as store:
        stats = store.stats()
        _verify_stats_shape(stats)
        expected = {
            "device": {"bytes": 0, "budget": 4096, "blocks": 0},
            "host": {"bytes": 0, "budget": 4096, "blocks": 0},
            "disk": {"bytes": 0, "budget": 10**6, "blocks": 0},
            "hits": {"device": 0, "host": 0, "disk": 0}, "misses": 0, "evictions": 0, "corrupt": 0}
        assert {key: stats[key] for key in expected} == expected
        assert full_block_bytes(model) == 4096
        blocks = [distinct_block(i) for i in range(3)]
        for block in blocks:
            turn(store, model, block, new=1, expect=0, expect_stored=B)
        # c2 on the device, c1 in the host tier, c0 on disk only.
        stats = store.stats()
        assert stats["evictions"] == 3 and stats["misses"] == 24
        assert [stats[t]["blocks"] for t in ("device", "host", "disk")] == [1, 1, 3]
        for i, tier, evictions in ((2, "device", 3), (1, "host", 4), (0, "disk", 6)):
            ids = cat(blocks[i], random_ids(3, 800 + i))
            cache = verify_open(store, model, ids, expect=B, expect_from={"device": 0, "host": 0, "disk": 0} | {tier: B})
            verify_generate(model, ids, cache, 2)
            assert store.stats()["evictions"] == evictions
        store.flush()
        stats = store.stats()
        _verify_stats_shape(stats)
        assert stats["hits"] == {"device": 8, "host": 8, "disk": 8}
        assert stats["misses"] == 24 + 3 * 3
        assert stats["corrupt"] == 0
        assert stats["device"] == {"bytes": 4096, "budget": 4096, "blocks": 1}
        assert stats["host"] == {"bytes": 4096, "budget": 4096, "blocks": 1}
        assert stats["disk"]["blocks"] == 3 and 3 * 4096 < stats["disk"]["bytes"] <= 10**6


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_stats_peak_bytes_count_a_commits_new_chain_beside_the_tail_it_replaces(where, tiny_model, tmp_path):
    """A commit stores a conversation's new chain, then lets go of the partial tail the chain
    replaces: for that moment the tier holds both, and its peak is above what it holds before
    and after (the chat trace's peaks, sampled after each commit, missed it)."""
    model = tiny_model("llama")
    budgets = {"device": ("1MiB", 0), "host": (0, "1MiB"), "disk": (0, 0)}[where]
    with TieredStore(tmp_path / "kv" if where == "disk" else None, device="cpu", device_budget=budgets[0],
                     host_budget=budgets[1], block_size=B) as store:
        ids = random_ids(B + 5, 40)
        for length in (B + 5, 2 * B + 3):  # a 5-token tail, then a chain through it to a 3-token one
            ids = cat(ids, random_ids(length - ids.shape[1], length))
            cache = store.open(model, ids, session="s")
            with torch.no_grad():
                model(ids[:, cache.restored_tokens:], past_key_values=cache)
            cache.commit(ids)
            store.flush()
            if length == B + 5:
                before = store.stats()[where]["bytes"]
        stats = store.stats()
        assert stats[where]["blocks"] == 3  # the 5-token tail is gone
        if where == "disk":  # footprints: whole pages of the file
            assert stats["peak_bytes"]["disk"] > stats["disk"]["bytes"] > before
        else:
            assert stats["peak_bytes"][where] == stats[where]["bytes"] + full_block_bytes(model, 5)
        assert stats["peak_bytes"] == {t: stats["peak_bytes"][where] if t == where else 0 for t in ("device", "host", "disk")}


def test_stats_without_a_disk_tier_report_zeros_for_disk(tiny_model):
    with TieredStore(None, device="cpu", device_budget="1.5GB", host_budget="512MiB", block_size=B) as store:
        stats = store.stats()
        _verify_stats_shape(stats)
        assert stats["device"]["budget"] == 1_500_000_000
        assert stats["host"]["budget"] == 512 * 1024**2
        assert stats["disk"] == {"bytes": 0, "budget": 0, "blocks": 0}


# -- 11. misuse ------------------------------------------------------------------------------------
def test_commit_refuses_kv_of_another_dtype_than_the_model(tmp_path):
    model = make_model("llama", seed=6)
    ids = random_ids(9, 6)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, 2, cache)
        for layer in cache.layers:  # what autocast leaves: KV in bfloat16 from a float32 model
            layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
        with pytest.raises(ValueError, match=r"KV in torch.bfloat16 but the model's weights are torch.float32"):
            cache.commit(out)
        assert store.stats()["device"]["blocks"] == 0  # nothing stored


@pytest.mark.parametrize(("kwargs", "error", "word"), [
    ({"device_budget": "2GX"}, ValueError, "MiB"),
    ({"host_budget": "lots"}, ValueError, "MiB"),
    ({"disk_budget": -1}, ValueError, "Use 0"),
    ({"device_budget": "-5MiB"}, ValueError, "Use 0"),
    ({"host_budget": [1]}, TypeError, "MiB"),
    ({"block_size": 0}, ValueError, ">= 1"),
    ({"block_size": -1}, ValueError, ">= 1"),
    ({"block_size": 2.5}, TypeError, "int"),
    ({"block_size": True}, TypeError, "int"),
    ({"block_size": "8"}, TypeError, "int"),
    ({"block_size": 2**64}, ValueError, "<= 1048576"),
    ({"path": ""}, ValueError, "path is empty; pass a directory"),
    ({"path": 5}, TypeError, "pass None for no disk tier"),
    ({"path": "kv\0x"}, ValueError, "holds a NUL character"),
])
def test_bad_store_arguments_raise_with_a_remedy(tmp_path, kwargs, error, word):
    with pytest.raises(error) as info:
        TieredStore(**{"path": tmp_path / "kv", "device": "cpu", "block_size": B, **kwargs})
    assert word in str(info.value)
    # Refused before the directory was made: a store can be created there with good arguments.
    assert not (tmp_path / "kv").exists()
    TieredStore(tmp_path / "kv", device="cpu", block_size=B).close()


@pytest.mark.parametrize("budget", ["2GiB", 2**31, np.int64(2**31), float(2**31), np.float64(2**31)])
def test_a_budget_given_where_the_device_goes_is_told_to_pass_it_by_name(budget):
    # TieredStore("kv", "2GiB"): before, "device='2GiB' is not a device", not what was meant.
    with pytest.raises(ValueError, match=re.escape(f"(a byte count: pass it by name, device_budget={budget!r})")):
        TieredStore(None, budget)
    with TieredStore(None, device_budget=budget) as store:  # the advice, followed
        assert store.stats()["device"]["budget"] == 2**31


def test_a_device_number_past_a_c_long_is_told_what_a_device_is():
    # Before: torch's bare "Overflow when unpacking long long".
    with pytest.raises(ValueError, match=re.escape("pass None, 'cpu', 'cuda' or 'cuda:N' (a byte count: pass it by "
                                                   f"name, device_budget={2**70!r})")):
        TieredStore(None, 2**70)


def test_a_directory_that_cannot_be_made_is_refused_saying_what_to_give(tmp_path):
    # Before: a bare NotADirectoryError / PermissionError / EROFS, saying nothing of what to do.
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotADirectoryError, match="a tierkv store needs a directory this process can create and write"):
        TieredStore(tmp_path / "afile" / "kv", device="cpu", block_size=B)


def test_a_store_opened_by_a_relative_path_keeps_its_map_after_a_chdir(tiny_model, tmp_path, monkeypatch):
    # Before: the map, found again after each remap by its file's path, was looked up by the
    # relative path, which named nothing once the working directory changed; the records' places
    # were lost from then on (their heads, prefetch, the zeroing of an aborted transaction's writes).
    monkeypatch.chdir(tmp_path)
    with TieredStore("kv", device="cpu", block_size=B, device_budget=0, host_budget=0) as store:
        monkeypatch.chdir(tmp_path.parent)
        size = store._disk.env.info()["map_size"]
        assert store._disk._grow(size * 4, size * 2)
        assert store._disk._map_start is not None
        model = tiny_model()
        turn(store, model, random_ids(3 * B + 2))


def test_arguments_computed_with_numpy_and_a_numbered_cpu_are_taken(tiny_model, tmp_path):
    """Budgets and block sizes computed with numpy are numpy integers; "cpu:1" is the one host
    memory. Both used to be refused: the first at construction, the second at every open."""
    model = tiny_model()
    ids = random_ids(3 * B + 2)
    budget = np.int64(1) << np.int64(30)
    with TieredStore(tmp_path / "kv", device="cpu:1", device_budget=budget, host_budget=np.float32(2**20),
                     disk_budget=np.uint64(2**32), block_size=np.int64(B)) as store:
        assert store.device == torch.device("cpu") and type(store.block_size) is int
        assert (store.stats()["device"]["budget"], store.stats()["host"]["budget"]) == (2**30, 2**20)
        cache = store.open(model, ids)
        out = generate(model, ids, 3, cache)
        cache.commit(out)
        cache = verify_open(store, model, out, expect=out.shape[1] - 1)
        assert torch.equal(generate(model, out, 4, cache), generate(model, out, 4))


def test_a_store_path_may_be_bytes_or_start_at_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with TieredStore("~/kv", device="cpu", block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == 0
    assert (tmp_path / "home" / "kv" / "data.mdb").is_file() and not (tmp_path / "~").exists()
    with TieredStore(os.fsencode(tmp_path / "home" / "kv"), device="cpu", block_size=B):
        pass


def test_a_store_path_through_a_linked_directory_and_up_is_the_directory_the_kernel_names(tiny_model, tmp_path,
                                                                                          monkeypatch):
    # current -> releases/v2: current/../kv is releases/kv to the kernel (and to os.path.exists);
    # os.path.abspath made it tmp_path/kv, a new store there restoring nothing, and remove_store
    # (tierkv clear --all) deleted that directory's store rather than the one named.
    from tierkv.tiers.disk import remove_store
    model = tiny_model()
    (tmp_path / "releases" / "v2").mkdir(parents=True)
    (tmp_path / "current").symlink_to(os.path.join("releases", "v2"))
    ids = random_ids(4 * B + 3, seed=5)
    with TieredStore(tmp_path / "releases" / "kv", device="cpu", device_budget=0, host_budget=0,
                     block_size=B) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, 3, cache)
        cache.commit(out)
    monkeypatch.chdir(tmp_path / "current")
    for path in (os.path.join(tmp_path, "current", "..", "kv"), os.path.join("..", "kv"), "../kv/"):
        with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
            cache = verify_open(store, model, out, expect=out.shape[1] - 1, expect_from={
                "device": 0, "host": 0, "disk": out.shape[1] - 1})
            assert torch.equal(generate(model, out, 4, cache), generate(model, out, 4))
    assert not (tmp_path / "kv").exists()
    (tmp_path / "kv").mkdir()  # another store where abspath looked
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids)
        cache.commit(generate(model, ids, 3, cache))
    assert "data.mdb" in remove_store(os.path.join(tmp_path, "current", "..", "kv"))
    assert not (tmp_path / "releases" / "kv" / "data.mdb").exists()
    assert (tmp_path / "kv" / "data.mdb").is_file()


@pytest.mark.parametrize(("make_ids", "error", "word"), [
    (lambda: [[5, 6, 7]], TypeError, "list of rows of token ids; convert it: torch.tensor(input_ids)"),
    (lambda: (5, 6, 7), TypeError, "tuple of token ids; convert it, as one row: torch.tensor([input_ids])"),
    (lambda: [5, 6.0], TypeError, "got list; use tokenizer("),
    # Not ids to convert: bools, nothing, an empty row (torch.tensor of those is no LongTensor).
    (lambda: [True, False], TypeError, "got list; use tokenizer("),
    (lambda: [], TypeError, "got list; use tokenizer("),
    (lambda: [[]], TypeError, "got list; use tokenizer("),
    # Not told to tokenize again (helper-96).
    (lambda: random_ids(6).numpy(), TypeError, "got a numpy array; convert it: torch.from_numpy(input_ids)"),
    (lambda: random_ids(6).float(), TypeError, "convert them with .long()"),
    (lambda: random_ids(6).bool(), TypeError, "integer token ids"),
    (lambda: torch.cat([random_ids(6), random_ids(6, 1)]), ValueError, "(1, L)"),
    (lambda: random_ids(6)[0], ValueError, "(1, L)"),
    (lambda: random_ids(6)[:, :0], ValueError, "at least one token"),
    (lambda: random_ids(6) * -1, ValueError, "tokenizer"),
    # An id past int64's range: refused, not wrapped into a negative one and matched as such.
    (lambda: torch.tensor([[5, 2**63 + 6]], dtype=torch.uint64), ValueError, "tokenizer"),
    (lambda: random_ids(6).to("meta"), ValueError, "meta device"),
    (lambda: random_ids(6).to_sparse(), TypeError, "to_dense()"),
    (lambda: torch.tensor([[5, VOCAB]]), ValueError, f"token id {VOCAB}, past the model's {VOCAB} embeddings"),
])
def test_bad_input_ids_raise_with_a_remedy(tiny_model, make_ids, error, word):
    with TieredStore(None, device="cpu", block_size=B) as store:
        with pytest.raises(error) as info:
            store.open(tiny_model("llama"), make_ids(), session="s")
        assert word in str(info.value)
        assert store.stats()["misses"] == 0


def test_ids_of_one_conversation_in_another_shape_are_told_how_to_reshape_them(tiny_model):
    # Before: a row without its batch dimension (a tokenizer's list made a tensor, out[0]) was told
    # to "call store.open once per conversation", which it did; commit() of out[0] said nothing.
    model = tiny_model("llama")
    ids = random_ids(3 * B + 2)
    with TieredStore(None, device="cpu", block_size=B) as store:
        for given, remedy, reshape in ((ids[0], r"add the batch dimension: input_ids\[None\]", lambda x: x[None]),
                                       (ids[None], r"as one row: input_ids\.reshape\(1, -1\)",
                                        lambda x: x.reshape(1, -1))):
            with pytest.raises(ValueError, match=remedy) as info:
                store.open(model, given)
            assert "once per conversation" not in str(info.value)
            cache = store.open(model, reshape(given))  # the advice, followed
            out = generate(model, ids, 3, cache)
            assert torch.equal(out, generate(model, ids, 3))
        with pytest.raises(ValueError, match="once per conversation"):
            store.open(model, torch.stack([ids, ids]))
        # A list (tokenizer(text)["input_ids"]) was told to tokenize again (helper-99).
        with pytest.raises(TypeError, match=re.escape("as one row: torch.tensor([input_ids])")):
            store.open(model, ids[0].tolist())
        assert torch.equal(generate(model, ids, 3, store.open(model, torch.tensor([ids[0].tolist()]))), out)
        with pytest.raises(ValueError, match=r"\(out, not out\[0\]\), or add the batch dimension to a row: row\[None\]"):
            cache.commit(out[0])
        assert cache.commit(out) == out.shape[1] - 1
        assert store.open(model, out).restored_tokens == out.shape[1] - 1


@pytest.mark.parametrize(("convert", "remedy", "follow"), [
    # A text-generation pipeline's generated_token_ids (return_tensors=True), a history kept as a list.
    (lambda out: out[0].tolist(), "list of token ids; convert it, as one row: torch.tensor([sequences])",
     lambda ids: torch.tensor([ids])),
    (lambda out: out.tolist(), "list of rows of token ids; convert it: torch.tensor(sequences)", torch.tensor),
    (lambda out: out.numpy(), "got a numpy array; convert it: torch.from_numpy(sequences)", torch.from_numpy),
])
def test_a_commit_of_ids_held_outside_a_tensor_is_told_how_to_convert_them_and_that_keeps_the_turn(
        tiny_model, convert, remedy, follow):
    # Before: "commit() takes the LongTensor that generate() returned, got list", which a caller
    # holding a pipeline's ids (it returns no tensor from generate()) could not follow.
    model = tiny_model("llama")
    ids = random_ids(3 * B + 2)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, 3, cache)
        with pytest.raises(TypeError, match=re.escape(remedy)):
            cache.commit(convert(out))
        assert cache.commit(follow(convert(out))) == out.shape[1] - 1  # the advice, followed
        assert store.open(model, torch.cat([out, random_ids(2, 9)], dim=1)).restored_tokens == out.shape[1] - 1


@pytest.mark.parametrize(("name", "remedy"), [
    (5, "pass its text, session='5'"), (np.int64(5), "pass its text, session='5'"),
    (uuid.UUID(int=5), f"pass its text, session='{uuid.UUID(int=5)}'"), (b"5", "decode it: session=name.decode()"),
])
def test_a_session_id_that_is_not_a_str_is_told_to_pass_its_text_and_that_works(tiny_model, name, remedy):
    # Before: "session must be a str or None, got int", naming no way to pass a database's ids.
    model = tiny_model("llama")
    ids = random_ids(2 * B + 1)
    text = str(name) if not isinstance(name, bytes) else name.decode()
    with TieredStore(None, device="cpu", block_size=B) as store:
        for call in (lambda: store.open(model, ids, session=name), lambda: store.forget(session=name)):
            with pytest.raises(TypeError, match=re.escape(remedy)):
                call()
        cache = store.open(model, ids, session=text)
        cache.commit(generate(model, ids, 2, cache))
        assert store.forget(session=text) == 3 and store.stats()["device"]["blocks"] == 0


def test_a_tokenizer_s_whole_output_is_told_to_pass_its_input_ids_and_they_generate_exactly(tiny_model):
    # apply_chat_template returns a BatchEncoding by default in transformers 5; open(model, it)
    # was told to "use tokenizer(..., return_tensors='pt').input_ids", not to take its ids.
    from transformers import BatchEncoding

    model = tiny_model("llama")
    ids = random_ids(3 * B + 2)
    encoding = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with TieredStore(None, device="cpu", block_size=B) as store:
        with pytest.raises(TypeError, match=re.escape("a tokenizer's output: pass the ids under its 'input_ids' key "
                                                      "(encoding['input_ids'])")):
            store.open(model, encoding)
        with pytest.raises(TypeError, match=re.escape("(encoding['input_ids'], made with return_tensors='pt')")):
            store.open(model, BatchEncoding({"input_ids": ids.tolist()}))
        cache = store.open(model, encoding["input_ids"])
        out = model.generate(**encoding, cache=cache, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, generate(model, ids, 3))


def test_ids_of_any_integer_dtype_restore_the_same_blocks(tiny_model):
    model = tiny_model("llama")
    ids = random_ids(3 * B + 2)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, ids)
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
        for dtype in (torch.int32, torch.int64):
            again = store.open(model, ids.to(dtype))
            assert again.restored_tokens == 3 * B + 1 and again.input_ids.dtype == np.int64
            # The forward's check compares the ids fed with the conversation's, whatever their dtype.
            with torch.no_grad():
                model(ids.to(dtype)[:, again.get_seq_length():], past_key_values=again)
            assert again.get_seq_length() == 3 * B + 2


def test_a_key_collision_restores_nothing(tiny_model, monkeypatch):
    # Keys are 128-bit hashes, not a proof: a lookup that finds a block of other ids under its
    # key must be a miss. Simulated: every key asked for is the stored conversation's own.
    import tierkv.store as store_module

    model = tiny_model("llama")
    stored, other = random_ids(2 * B + 1, seed=0), random_ids(2 * B + 1, seed=1)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, stored)
        cache.commit(model.generate(stored, past_key_values=cache, max_new_tokens=1, do_sample=False))
        chain = chain_keys(cache.root, stored[0].numpy(), B)
        child_of = dict(zip([cache.root, *chain[:-1]], chain))
        real = store_module.key_of_bytes
        monkeypatch.setattr(store_module, "key_of_bytes", lambda parent, data: child_of.get(parent, real(parent, data)))
        assert store.open(model, stored).restored_tokens == 2 * B  # the stand-in finds the stored blocks
        again = store.open(model, other)
        assert again.restored_tokens == 0
        out = model.generate(other, past_key_values=again, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, model.generate(other, max_new_tokens=3, do_sample=False))


def test_models_attending_in_both_directions_are_refused(tiny_model):
    # A prefix's KV then depends on the tokens after it: turn 2's restored KV differed from its
    # prefill (gemma bidirectional: logits 0.18 off; roberta without is_decoder: other tokens).
    ids = random_ids(6)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with TieredStore(None, device="cpu", block_size=B) as store:
        for model_type, extra, remedy in (("gemma", {"use_bidirectional_attention": True, "num_key_value_heads": 1,
                                                     "head_dim": 16}, "use_bidirectional_attention=True"),
                                          ("roberta", {}, "is_decoder=True"), ("bert", {}, "is_decoder=True"),
                                          # Their attention says is_decoder=False, not is_causal (helper-23:
                                          # restored 25 then 36 tokens, logits 0.05-0.77 off).
                                          ("rembert", {"input_embedding_size": 32, "output_embedding_size": 32},
                                           "is_decoder=True"),
                                          ("roformer", {"embedding_size": 32}, "is_decoder=True"),
                                          ("big_bird", {"attention_type": "original_full"}, "is_decoder=True"),
                                          # Block-sparse attention says neither until a forward swaps in
                                          # full attention (helper-31: accepted before any forward, then
                                          # logits 1.3 off).
                                          ("big_bird", {}, "is_decoder=True"),
                                          ("megatron-bert", {}, "is_decoder=True")):
            config = AutoConfig.for_model(model_type, **small, **extra)
            model = AutoModelForCausalLM.from_config(config).eval()
            with pytest.raises(ValueError, match=f"attends in both directions .*{remedy}"):
                store.open(model, ids)
        # A decoder whose self-attention says is_causal=False is not told to set is_decoder=True,
        # which it has (BigBirdPegasusForCausalLM; the advice was that).
        config = AutoConfig.for_model("bigbird_pegasus", vocab_size=VOCAB, d_model=32, encoder_layers=1,
                                      decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                                      encoder_ffn_dim=64, decoder_ffn_dim=64)
        pegasus = AutoModelForCausalLM.from_config(config).eval()
        assert pegasus.config.is_decoder
        with pytest.raises(ValueError, match="is built as a decoder .*is_causal=False.* without a TieredCache") as caught:
            store.open(pegasus, ids)
        assert "build it with is_decoder=True" not in str(caught.value)
        for model_type in ("bert", "big_bird"):
            decoder = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **small, is_decoder=True)).eval()
            cache = store.open(decoder, ids)
            assert torch.equal(decoder.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False),
                               decoder.generate(ids, max_new_tokens=3, do_sample=False))


def test_models_whose_kv_a_cache_cannot_give_back_are_refused_at_open(tiny_model):
    """Each was accepted at open (helper-31's sweep of transformers' causal LMs), then failed in
    its first or second generate() with another error, or kept nothing."""
    from transformers import MllamaForCausalLM
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig

    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    cases = {
        "predicts 2 n-gram streams": AutoConfig.for_model(
            "prophetnet", vocab_size=VOCAB, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
            num_encoder_layers=3, num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4),
        "runs its recurrent layers 2 times": AutoConfig.for_model(
            "dory", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=16,
            n_input_layers=2, n_recurrent_layers=2, n_output_layers=2, n_recurrent_loops=2,
            layer_types=["full_attention", "mlp"] * 3, sliding_window=1024, **heads),
        "adds language embeddings": AutoConfig.for_model("xlm", vocab_size=VOCAB, emb_dim=64, n_layers=2, n_heads=4),
        r"cross-attention layers \(\[1\]\)": MllamaTextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, cross_attention_layers=[1],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **heads),
        # Layers without attention, 'dummy' in transformers' caches as KV-sharing layers are:
        # refused as sharing KV (num_kv_shared_layers=None), which Nemotron-H does not (helper-51).
        r"has \['mlp'\] layers.*no attention and hold no KV": AutoConfig.for_model(
            "nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
            layer_types=["full_attention", "mlp"], **heads),
        # Its forward hands the inner model the cache by position: refused at the first forward,
        # after open had accepted it (helper-80's sweep).
        r"CpmAntForCausalLM.forward hands CpmAntModel.forward its cache as positional argument 4": AutoConfig.for_model(
            "cpmant", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128,
            num_hidden_layers=2, prompt_length=4, position_bias_num_buckets=32, position_bias_max_distance=64),
    }
    ids = random_ids(21)
    with TieredStore(None, device="cpu", block_size=B) as store:
        for message, config in cases.items():
            torch.manual_seed(0)
            build = MllamaForCausalLM if isinstance(config, MllamaTextConfig) else AutoModelForCausalLM.from_config
            model = build(config).eval()
            with pytest.raises(ValueError, match=message):
                store.open(model, ids)
        # Cross-attention layers past the model's depth (Mllama's defaults, cut to 3 layers): none.
        torch.manual_seed(0)
        model = MllamaForCausalLM(MllamaTextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, cross_attention_layers=[3, 8],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **heads)).eval()
        cache = store.open(model, ids, session="m")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))
        assert cache.commit(out) == out.shape[1] - 1
        # MusicGen's decoders (not built by AutoModelForCausalLM from their config): generate()
        # rewrites the ids into a delay pattern over the codebooks; with one codebook, a row of ids
        # passed open and was refused at the first forward as not the conversation's (helper-51).
        from transformers import MusicgenMelodyForCausalLM
        from transformers.models.musicgen_melody.configuration_musicgen_melody import MusicgenMelodyDecoderConfig
        torch.manual_seed(0)
        model = MusicgenMelodyForCausalLM(MusicgenMelodyDecoderConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            num_codebooks=1, pad_token_id=1, bos_token_id=1)).eval()
        with pytest.raises(ValueError, match="generates audio codebooks: its generate.. rewrites the ids"):
            store.open(model, ids)


def test_a_model_whose_layers_hold_kv_of_other_shapes_is_refused_at_its_first_forward():
    # KV heads per layer (DeciLM's and OpenELM's remote code): generate() ran, and commit failed on
    # torch.stack ("stack expects each tensor to be equal size") with no word of what to do.
    from transformers.models.llama.modeling_llama import LlamaAttention

    model = make_model("llama")
    config = copy.deepcopy(model.config)
    config.num_key_value_heads = 1
    model.model.layers[1].self_attn = LlamaAttention(config, 1)
    ids = random_ids(21)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match=r"keys of 1 KV heads x head_dim 16 .* in layer 1, and keys and values "
                                             r"of 2 x 16 in an earlier layer: .* use a plain DynamicCache"):
            model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert store.stats()["device"]["blocks"] == 0
        # Keys and values of one shape in every layer, but not the same as each other (values of
        # another head_dim, as multi-head latent attention computes them): refused at the first layer.
        cache = store.open(make_model("llama"), ids)
        with pytest.raises(ValueError, match=r"keys of 2 KV heads x head_dim 16 and values of 2 x 8 in layer 1:"):
            cache.update(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 8), 1)


def test_models_whose_values_have_another_head_dim_are_refused_at_open():
    # MiMo-V2-Flash's full-attention layers (values of head_dim 128, keys of 192, no latent
    # attention) were accepted, then failed in commit on torch.stack; dots.llm3's latent attention,
    # set per layer (per_layer_config), raised transformers' AmbiguousGlobalPerLayerAttributeError.
    # (MiMo's sliding layers compute twice the KV heads its config names, so no layout from the
    # config would hold them.)
    mimo = AutoConfig.for_model("mimo_v2_flash", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                v_head_dim=16, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    with TieredStore(None, device="cpu", block_size=B) as store:
        with pytest.raises(ValueError, match=r"keys of head_dim 24 and values of head_dim 16 \(v_head_dim\)"):
            store.open(AutoModelForCausalLM.from_config(mimo).eval(), random_ids(6))
        with torch.device("meta"):  # its default size, without its weights: refused before they are read
            dots = AutoModelForCausalLM.from_config(AutoConfig.for_model("dots3_note_text"))
        # Its latent attention is served; its DeepSeek Sparse Attention layers are not.
        with pytest.raises(ValueError, match=r"\['indexed_attention'\] layers.*indexer's keys"):
            store.open(dots, random_ids(6))


@pytest.mark.parametrize("shapes", [
    dict(global_head_dim=32),  # Gemma 4's: a wider head_dim in the full-attention layers
    dict(global_head_dim=16, num_global_key_value_heads=4, attention_k_eq_v=True),  # more KV heads there
    dict(global_head_dim=48, num_global_key_value_heads=4, attention_k_eq_v=True),  # both, 2 x 3 slots
    dict(global_head_dim=24, num_global_key_value_heads=1, attention_k_eq_v=True),  # slots narrower than both
    dict(global_head_dim=16),  # one shape, set per layer: a layer a slot, as for any model
])
def test_a_model_whose_config_sets_other_kv_shapes_per_layer_is_exact_through_every_tier(tmp_path, shapes):
    # Gemma 4 sets its full-attention layers' head_dim (and KV heads) per layer (per_layer_config):
    # refused before, at open (and before that at layer 5's first forward, after the prefill of the
    # layers before it). Its blocks hold each layer in slots of the shapes' common divisors.
    config = AutoConfig.for_model("gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  sliding_window=12, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                                  layer_types=["sliding_attention", "full_attention"] * 2, **shapes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    layout = describe_model(model).layout
    assert (layout is None) == (shapes == dict(global_head_dim=16))
    assert layout is None or len(layout.layers) == 4
    budgets = {"device": dict(device_budget="1GiB"), "host": dict(device_budget=0, host_budget="1GiB"),
               "disk": dict(device_budget=0, host_budget=0)}
    for tier, budget in budgets.items():
        ids = random_ids(21, seed=3)
        with TieredStore(tmp_path / tier, device="cpu", block_size=B, **budget) as store:
            for turn in range(3):
                cache = store.open(model, ids, session="s")
                assert cache.restored_from[tier] == (0 if turn == 0 else ids.shape[1] - 4)
                out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
                assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False)), (tier, turn)
                cache.commit(out)
                for layer, plain in zip(cache.layers, model.generate(ids, max_new_tokens=3, do_sample=False,
                                                                    return_dict_in_generate=True).past_key_values.layers):
                    n = plain.keys.shape[-2]
                    assert layer.keys.shape[1::2] == plain.keys.shape[1::2]
                    torch.testing.assert_close(layer.keys[:, :, -n:], plain.keys, rtol=0, atol=1e-5)
                    torch.testing.assert_close(layer.values[:, :, -n:], plain.values, rtol=0, atol=1e-5)
                ids = torch.cat([out, random_ids(3, seed=10 + turn)], dim=1)
    # After a restart, from disk.
    with TieredStore(tmp_path / "disk", device="cpu", block_size=B, device_budget=0, host_budget=0) as store:
        cache = store.open(model, ids, session="s")
        assert cache.restored_from["disk"] == ids.shape[1] - 4
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))


def test_kv_sharing_whose_layers_shapes_the_config_does_not_say_is_refused():
    from types import SimpleNamespace

    from tierkv.cache import _kv_layout
    config = SimpleNamespace(num_kv_shared_layers=1)
    with pytest.raises(ValueError, match=r"shares KV between layers \(num_kv_shared_layers=1\).*KV heads and head_dim"):
        _kv_layout(config, ["full_attention", "dummy"])
    config = SimpleNamespace(num_kv_shared_layers=1, num_attention_heads=4, hidden_size=64)
    layout = _kv_layout(config, ["full_attention", "full_attention", "dummy"])
    assert layout is not None and layout.slots == 2 and (layout.heads, layout.dim) == (4, 16)
    assert [layout.holds(i) for i in range(3)] == [True, True, False]


def test_a_model_computing_other_kv_shapes_than_its_config_sets_per_layer_is_refused(tmp_path):
    config = AutoConfig.for_model("gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  sliding_window=12, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                                  layer_types=["sliding_attention", "full_attention"], global_head_dim=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = random_ids(21)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids)
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False))
        # The config edited after the model was built: its modules still compute head_dim 32.
        model.config.per_layer_config = {"01": {"head_dim": 64}}
        cache = store.open(model, ids)
        assert cache.restored_tokens == 0  # another config digest: another fingerprint
        with pytest.raises(ValueError, match=r"keys of 2 KV heads x head_dim 32 and values of 2 x 32 in layer 1, "
                                             r"where its config sets keys of 2 x 64 and values of 2 x 64 "
                                             r"\(num_key_value_heads=2, per_layer_config\[1\]\.head_dim=64\): "
                                             r".*plain DynamicCache"):
            model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)


def test_a_model_without_a_kv_cache_is_refused(tiny_model):
    config = AutoConfig.for_model("openai-gpt", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    with TieredStore(None, device="cpu", block_size=B) as store:
        with pytest.raises(ValueError, match="takes no KV cache"):
            store.open(AutoModelForCausalLM.from_config(config).eval(), random_ids(6))

        class Wrapped(type(tiny_model("llama"))):  # a forward that names none of its arguments
            def forward(self, *args, **kwargs):
                return super().forward(*args, **kwargs)

        llama = tiny_model("llama")
        wrapped = Wrapped(llama.config).eval()
        wrapped.load_state_dict(llama.state_dict())
        ids = random_ids(6)
        cache = store.open(wrapped, ids)
        assert torch.equal(wrapped.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False),
                           llama.generate(ids, max_new_tokens=3, do_sample=False))


def test_sliding_attention_layers_without_a_window_are_refused_saying_what_to_give(tiny_model):
    # Gemma 2's layer_types name sliding layers whatever sliding_window says: None (or 0) there
    # is no window to keep, for transformers' own caches either; a window of 1 they mishandle.
    for window in (None, 0, 1):
        config = AutoConfig.for_model("gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      sliding_window=window)
        with TieredStore(None, device="cpu", block_size=B) as store:
            with pytest.raises(ValueError, match=f"sliding_attention layers with sliding_window={window!r}; tierkv "
                                                 "needs a window of at least 2 tokens"):
                store.open(AutoModelForCausalLM.from_config(config).eval(), random_ids(6))
            assert store.stats()["misses"] == 0


def test_bad_names_and_bad_models_raise_with_a_remedy(tiny_model):
    model = tiny_model("llama")
    ids = random_ids(6)
    with TieredStore(None, device="cpu", block_size=B) as store:
        for kwargs in ({"session": 5}, {"session": b"s"}, {"tenant": 7}, {"tenant": ("a",)}):
            with pytest.raises(TypeError, match="must be a str"):
                store.open(model, ids, **kwargs)
        with pytest.raises(ValueError, match="session="):
            store.forget()
        with pytest.raises(TypeError, match="must be a str"):
            store.forget(session=3)
        with pytest.raises(TypeError, match="must be a str"):
            store.forget(tenant=3)
        config = AutoConfig.for_model("t5", d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=128)
        t5 = AutoModelForSeq2SeqLM.from_config(config).eval()
        with pytest.raises(ValueError, match="decoder-only") as info:
            store.open(t5, ids)
        assert "encoder-decoder" in str(info.value) and "Generate with it without a TieredCache" in str(info.value)
        with pytest.raises(TypeError, match="transformers model"):
            store.open(torch.nn.Linear(2, 2), ids)
        for not_a_model in (None, object(), 5):
            with pytest.raises(TypeError, match=f"transformers model .*, got {type(not_a_model).__name__}; pass the "
                                                "model object itself"):
                store.open(not_a_model, ids)
        with pytest.raises(TypeError, match=r"got str; load it first: AutoModelForCausalLM.from_pretrained\('org/m'\)"):
            store.open("org/m", ids)
        for kwargs in ({"session": "a\udcff"}, {"tenant": "\udcff"}):
            with pytest.raises(ValueError, match="encodes as UTF-8"):
                store.open(model, ids, **kwargs)
        with pytest.raises(ValueError, match="no decoder layers"):
            store.open(tiny_model("llama", num_hidden_layers=0), ids)
        mamba_config = AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                            state_size=4)
        mamba = AutoModelForCausalLM.from_config(mamba_config).eval()
        with pytest.raises(ValueError, match="linear_attention") as info:
            store.open(mamba, ids)
        assert "full-attention" in str(info.value) and "sliding_window" not in str(info.value)
        assert "Generate with it without a TieredCache" in str(info.value)  # the remedy, not only the refusal
        assert store.stats()["sessions"] == 0 and store.stats()["misses"] == 0


def test_bad_commits_raise_with_a_remedy(tiny_model):
    model = tiny_model("llama")
    ids = random_ids(12, 70)
    with TieredStore(None, device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match="run generate"):
            cache.commit(ids)  # nothing computed yet
        out = verify_generate(model, ids, cache, 3)
        with pytest.raises(ValueError, match="start with"):
            cache.commit(diverging(out, 4, 11, seed=71))
        with pytest.raises(ValueError, match="the first 8 ids of the conversation .* not ids that start with all 12"):
            cache.commit(out[:, :8])  # a part of it: said so (it read "do not start with the conversation")
        for extra in (1, 2):  # ids past the sequences: the cache never computed the KV of the last of them
            with pytest.raises(ValueError, match="run generate"):
                cache.commit(cat(out, random_ids(extra, 72)))
        with pytest.raises(TypeError, match="LongTensor"):
            cache.commit(out[0].tolist())
        assert store.stats()["device"]["blocks"] == 0  # no failed commit stored anything
        assert cache.commit(out) == 14
        assert store.stats()["device"]["blocks"] == 2
        with TieredStore(None, device="cpu", block_size=B) as other:
            with pytest.raises(ValueError, match="own store"):
                other._commit(cache, out)


def test_a_closed_store_refuses_every_operation(tiny_model, tmp_path):
    model = tiny_model("llama")
    ids = random_ids(10, 73)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        out = verify_generate(model, ids, cache, 2)
    # Leaving the `with` block closed the store.
    for call in (lambda: store.open(model, ids, session="s"), lambda: cache.commit(out),
                 lambda: store.forget(session="s"), store.flush, store.__enter__):
        with pytest.raises(ValueError, match="closed") as info:
            call()
        assert "new TieredStore" in str(info.value)
    store.close()  # closing twice is harmless
    # A `with` block of a closed store is refused as it starts, as a closed file's is (h130: it ran
    # on to its first call).
    with pytest.raises(ValueError, match="closed"):
        with store:
            pass
    # A commit is not told to use a new store "again": no other store takes this cache, and the
    # advice led back to this error (helper-96). What it says to do instead works.
    with pytest.raises(ValueError, match=r"closed before its commit.*Commit each turn before store\.close\(\)"):
        cache.commit(out)
    # The disk tier was released: the directory reopens, holding nothing since nothing was committed.
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as again:
        assert again.stats()["disk"]["blocks"] == 0
        with pytest.raises(ValueError, match="closed before its commit"):
            cache.commit(out)
        cache = again.open(model, out, session="s")
        nxt = verify_generate(model, out, cache, 2)
        assert cache.commit(nxt) == nxt.shape[1] - 1


# -- 12. threads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks_in_memory", [None, (3, 5)])
def test_threads_share_one_store(tiny_model, tmp_path, blocks_in_memory):
    model = tiny_model("llama")
    full = full_block_bytes(model)
    budgets = {} if blocks_in_memory is None else {
        "device_budget": blocks_in_memory[0] * full, "host_budget": blocks_in_memory[1] * full}
    start = threading.Barrier(4)
    errors: list[BaseException] = []
    restored: dict[int, list[tuple[int, int]]] = {}

    def run(worker: int) -> None:
        try:
            start.wait(timeout=60)
            ids, stored, seen = random_ids(13 + worker, 900 + worker), 0, []
            for t in range(3):
                cache = verify_open(store, model, ids, session=f"w{worker}")
                seen.append((cache.restored_tokens, stored))
                verify_budgets(store)
                out = verify_generate(model, ids, cache, 3)
                stored = cache.commit(out)
                verify_budgets(store)
                ids = cat(out, random_ids(5, 950 + 10 * worker + t))
            restored[worker] = seen
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    with TieredStore(tmp_path / "kv", device="cpu", block_size=B, **budgets) as store:
        threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        if errors:
            raise errors[0]
        assert sorted(restored) == [0, 1, 2, 3]
        for seen in restored.values():
            assert seen[0] == (0, 0)
            assert all(r <= s for r, s in seen)
        if blocks_in_memory is None:  # nothing evicted: each turn restores all its last commit
            assert restored == {w: [(0, 0), (15 + w, 15 + w), (23 + w, 23 + w)] for w in range(4)}
        store.flush()
        verify_budgets(store)


def test_layer_types_without_transformers_per_layer_api(monkeypatch, tiny_model):
    # transformers releases before get_layer_types_and_kwargs: the fallback reads the config.
    import tierkv.cache as cache_module

    monkeypatch.setattr(cache_module, "get_layer_types_and_kwargs", None)
    assert cache_module._layer_types(tiny_model("llama").config) == ["full_attention"] * 2
    assert cache_module._layer_types(tiny_model("gpt2").config) == ["full_attention"] * 2
    sliding = tiny_model("mistral", sliding_window=16).config
    assert cache_module._layer_types(sliding) == ["sliding_attention"] * 2


def test_a_replaced_parameter_changes_the_fingerprint(tmp_path):
    # load_state_dict(assign=True) swaps Parameter objects: the cached sample points must follow.
    model = make_model("llama", 0)
    ids = random_ids(20, 39)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, out = turn(store, model, ids, session="s", expect_stored=23)
        verify_open(store, model, out, session="s", expect=23)
        model.load_state_dict(make_model("llama", 3).state_dict(), assign=True)
        cache = verify_open(store, model, out, session="s", expect=0)
        verify_generate(model, out, cache, 3)


def test_a_session_whose_blocks_are_all_evicted_is_gone_from_index_and_disk(tmp_path):
    model = make_model("llama", 0)
    full = full_block_bytes(model)
    path = tmp_path / "kv"
    # The disk holds about two conversations' blocks: older sessions are evicted whole.
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, disk_budget=6 * full + 4096,
                     block_size=B) as store:
        for i in range(4):
            turn(store, model, random_ids(16, 100 + i), session=f"s{i}", new=1)
        store.flush()
        names = {info.name for info in store._index.sessions.values()}
        assert "s0" not in names and "s3" in names
        sids = set(store._index.sessions)
        env = store._disk.env
        with env.begin() as txn:
            rows = txn.stat(env.open_db(b"sessions"))["entries"]
        assert rows == len(store._index.sessions)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, disk_budget=6 * full + 4096,
                     block_size=B) as store:
        assert set(store._index.sessions) == sids


@pytest.mark.parametrize("then", ["flush", "forget", "close", "close with a timeout"])
def test_blocks_the_disk_budget_evicted_leave_no_kv_in_the_file(tmp_path, then):
    # Evicted records are zeroed a transaction after their delete (``DiskTier._defer_scrub``):
    # flush() and close() zero those the writer's last transaction left, whatever is still queued.
    model = make_model("llama", 0)
    full = full_block_bytes(model)
    path = tmp_path / "kv"
    store = TieredStore(path, device="cpu", device_budget=0, host_budget=0, disk_budget=6 * full + 4096,
                        block_size=B)
    try:
        turn(store, model, random_ids(16, 100), session="s0", new=1)
        store.flush()
        with open(path / "data.mdb", "rb") as f:  # the last KV bytes of each record, before its checksum
            kv = {k: os.pread(f.fileno(), 64, offset + length - 72)
                  for k in store._disk._where for offset, length in [store._disk._place(k)]}
        for i in range(1, 4):
            turn(store, model, random_ids(16, 100 + i), session=f"s{i}", new=1)
        if then == "flush":
            store._writer.flush()  # the writes applied, as a turn's own would be
            assert store._disk.owes_zeros  # evictions left to the next transaction
            store.flush()
        elif then == "forget":
            store.forget(session="s1")
            store.flush()
        evicted = [k for k in kv if k not in store._index.blocks]
        if then.startswith("close"):
            store.close(timeout=60 if then.endswith("timeout") else None)
        else:
            assert evicted and not store._disk.owes_zeros
    finally:
        store.close()
    data = (path / "data.mdb").read_bytes()
    assert evicted and all(kv[k] != bytes(64) for k in kv) and not any(kv[k] in data for k in evicted)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, disk_budget=6 * full + 4096,
                     block_size=B) as store:
        assert not store._disk.owes_zeros


def verify_sessions_hold_blocks_of_their_own(store: TieredStore) -> None:
    """Every session the store tracks references a block no other session does, and its row and
    references on disk are the index's (after a flush)."""
    index = store._index
    for sid, info in index.sessions.items():
        assert any(index.blocks[k].sessions == {sid} for k in info.keys), info
    if store._disk is not None:
        store.flush()
        env = store._disk.env
        with env.begin() as txn:
            rows = {bytes(k) for k, _ in txn.cursor(db=env.open_db(b"sessions"))}
            refs = {bytes(k) for k, _ in txn.cursor(db=env.open_db(b"refs"))}
        assert rows == set(index.sessions)
        assert refs == {sid + key for sid, info in index.sessions.items() for key in info.keys
                        if index.blocks[key].disk is not DiskState.NONE}


@pytest.mark.parametrize("disk", [False, True])
def test_sessions_sharing_a_system_prompt_stay_as_many_as_their_own_blocks(tmp_path, disk):
    # A long deployment: every session starts with the same system prompt, which stays hot, while
    # the sessions' own blocks are evicted. A session with nothing of its own left is no longer
    # tracked; it used to stay (row and references on disk too) for as long as the prompt lived.
    model = make_model("llama", 0)
    full = full_block_bytes(model)
    prompt = random_ids(2 * B, 70)
    budgets = dict(device_budget=0, host_budget=0, disk_budget=12 * full + 4096) if disk else \
        dict(device_budget=8 * full, host_budget=0)
    with TieredStore(tmp_path / "kv" if disk else None, device="cpu", block_size=B, **budgets) as store:
        for i in range(30):
            turn(store, model, cat(prompt, random_ids(B, 700 + i)), session=f"s{i}", new=1)
            verify_sessions_hold_blocks_of_their_own(store)
        blocks = len(store._index.blocks)
        assert store.stats()["sessions"] <= blocks - 2 < 12
        tracked = {info.name for info in store._index.sessions.values()}
        assert "s29" in tracked and "s0" not in tracked
        # A session that is no longer tracked still restores the prompt, and is tracked again.
        cache, _ = turn(store, model, cat(prompt, random_ids(B, 700)), session="s0", new=1, expect=2 * B)
        assert "s0" in {info.name for info in store._index.sessions.values()}
        tracked = set(store._index.sessions)
        verify_sessions_hold_blocks_of_their_own(store)
    if disk:
        with TieredStore(tmp_path / "kv", device="cpu", block_size=B, **budgets) as store:
            assert set(store._index.sessions) == tracked
            verify_sessions_hold_blocks_of_their_own(store)


def test_sessions_that_repeat_or_continue_another_leave_its_blocks_to_the_last(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    ids = random_ids(2 * B, 71)  # with its reply, two whole blocks and no tail of its own
    with TieredStore(path, device="cpu", block_size=B) as store:
        # Ten sessions with the same first turn ("hi"): one row, not ten.
        for i in range(10):
            _, out = turn(store, model, ids, session=f"hi{i}", new=1)
        assert {info.name for info in store._index.sessions.values()} == {"hi9"}
        verify_sessions_hold_blocks_of_their_own(store)
        # A session that continues another's conversation holds all of it: the other goes.
        _, longer = turn(store, model, cat(out, random_ids(B, 72)), session="fork", new=1)
        assert {info.name for info in store._index.sessions.values()} == {"fork"}
        verify_sessions_hold_blocks_of_their_own(store)
        # forget() of an untracked session drops nothing the tracked one holds ...
        assert store.forget(session="hi9") == 0
        verify_open(store, model, cat(longer, random_ids(1, 73)), expect=longer.shape[1] - 1)
        # ... and forgetting the one that holds them leaves nothing of any of them.
        assert store.forget(session="fork") == 4  # three whole blocks and a tail
        assert store.stats()["device"]["blocks"] == 0 and store.stats()["sessions"] == 0
        verify_open(store, model, cat(longer, random_ids(1, 73)), expect=0)
        verify_sessions_hold_blocks_of_their_own(store)


def test_forget_takes_the_blocks_beside_its_partial_tail_that_extend_it(tiny_model, tmp_path):
    """A session whose own part is a partial tail after a shared prompt: a turn without a session
    that continued it stored a block beside the tail (same parent, the tail's ids and more), not
    below it. forget(session=...) left that block, the forgotten ids and KV, at rest, on disk and
    after a restart, and a returning session restored the forgotten conversation (helper-36)."""
    model = tiny_model("llama")
    path = tmp_path / "kv"
    prompt = random_ids(2 * B, 91)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        turn(store, model, cat(prompt, random_ids(3, 92)), session="C", new=2)
        _, mine = turn(store, model, cat(prompt, random_ids(2, 93)), session="A", new=2, expect=2 * B)
        assert mine.shape[1] - 1 - 2 * B < B  # A holds only a partial tail of its own
        turn(store, model, cat(mine, random_ids(B, 94)), new=3, expect=mine.shape[1] - 1)  # no session
        store.forget(session="A")
        assert all(m.sessions for m in store._index.blocks.values())
        verify_open(store, model, cat(mine, random_ids(1, 95)), session="A", expect=2 * B)
        store.flush()
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        verify_open(store, model, cat(mine, random_ids(1, 95)), session="A", expect=2 * B)
    tail = mine[0, 2 * B:].numpy().astype("<i8").tobytes()
    assert tail not in (path / "data.mdb").read_bytes()


def test_a_turn_that_restored_a_partial_tail_a_forget_took_keeps_only_the_blocks_before_it(tiny_model, tmp_path):
    """A turn without a session, opened before forget(session=A), that restored A's partial tail:
    its commit extends the tail into a block of another key, which the forgotten keys never
    matched, and wrote A's forgotten ids and KV back (helper-36: 29 tokens kept, 16 expected)."""
    model = tiny_model("llama")
    prompt = random_ids(2 * B, 96)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        turn(store, model, cat(prompt, random_ids(3, 97)), session="C", new=2)
        _, mine = turn(store, model, cat(prompt, random_ids(2, 98)), session="A", new=2, expect=2 * B)
        later = cat(mine, random_ids(B, 99))
        cache = verify_open(store, model, later, expect=mine.shape[1] - 1)
        store.forget(session="A")
        out = verify_generate(model, later, cache, 3)
        assert cache.commit(out) == 2 * B
        verify_open(store, model, cat(mine, random_ids(1, 100)), session="A", expect=2 * B)


def test_forget_keeps_a_block_beside_its_tail_that_another_sessions_tail_explains(tiny_model):
    """A block without a session beside the forgotten partial tail that also extends another
    session's tail may be that conversation's continuation, stored before the forgotten session
    existed: kept, and turns in flight through it keep their blocks (helper-41)."""
    model = tiny_model("llama")

    def put(store: TieredStore, ids: torch.Tensor, session: str | None = None) -> TieredCache:
        cache = store.open(model, ids, session=session)
        with torch.no_grad():
            model(ids[:, cache.get_seq_length():], past_key_values=cache)
        return cache

    prompt = random_ids(2 * 4, 101)
    a, b, c, d, e, f = 100, 101, 102, 103, 104, 105
    with TieredStore(None, block_size=4) as store:
        ids = cat(prompt, torch.tensor([[a]]))
        put(store, ids, "C").commit(ids)
        ids = cat(prompt, torch.tensor([[a, b, c, d, e]]))
        put(store, ids).commit(ids)  # no session: a block [a b c d] beside C's tail
        later = cat(prompt, torch.tensor([[a, b, c, d, e, f]]))
        assert store.open(model, later).restored_tokens == 13
        live = store.open(model, later, session="D")
        ids = cat(prompt, torch.tensor([[a, b]]))
        put(store, ids, "A").commit(ids)
        assert store.forget(session="A") == 1
        assert store.open(model, later).restored_tokens == 13
        with torch.no_grad():
            model(later[:, live.get_seq_length():], past_key_values=live)
        assert live.commit(later) == later.shape[1]


def test_forget_takes_the_blocks_below_its_own_that_no_session_holds(tiny_model, tmp_path):
    """A turn without a session that continued a session's conversation stored blocks below that
    session's; forget(session=...) removed the session's blocks and left those (KV computed over
    the forgotten conversation) at rest, on disk and after a restart, where no lookup reaches
    them. They go with it now; the blocks another session shares (a system prompt) stay."""
    model = tiny_model("llama")
    path = tmp_path / "kv"
    prompt = random_ids(B, 81)
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        _, other = turn(store, model, cat(prompt, random_ids(B + 2, 82)), session="C", new=2)
        _, mine = turn(store, model, cat(prompt, random_ids(B + 3, 83)), session="B", new=2, expect=B)
        later = cat(mine, random_ids(2 * B, 84))
        _, out = turn(store, model, later, new=3, expect=mine.shape[1] - 1)  # no session
        below = {m.key for m in store._index.blocks.values() if not m.sessions}
        assert len(below) >= 2  # the untracked turn's own blocks
        before = store.stats()["disk"]["blocks"]
        removed = store.forget(session="B")
        assert removed == before - store.stats()["disk"]["blocks"]
        assert not below & set(store._index.blocks)
        assert all(m.sessions for m in store._index.blocks.values())  # nothing at rest that no one holds
        verify_open(store, model, cat(out, random_ids(1, 85)), expect=B)  # the shared prompt only
        verify_open(store, model, cat(other, random_ids(1, 86)), session="C", expect=other.shape[1] - 1)
        store.flush()
        kept = store.stats()["disk"]["blocks"]
    with TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == kept
        assert not below & set(store._index.blocks)
        verify_open(store, model, cat(out, random_ids(1, 85)), expect=B)
        verify_open(store, model, cat(other, random_ids(1, 86)), session="C", expect=other.shape[1] - 1)


def test_a_turn_opened_before_a_forget_of_blocks_it_restored_keeps_none_of_them(tiny_model, tmp_path):
    """A turn without a session that restored a session's conversation, open while that session
    was forgotten, wrote the forgotten blocks back at its commit, on disk and past a restart
    (helper-34). It keeps the blocks before the first forgotten one (shared with a live session)."""
    model = tiny_model("llama")
    path = tmp_path / "kv"
    prompt = random_ids(2 * B, 91)
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, mine = turn(store, model, cat(prompt, random_ids(B + 1, 92)), session="A", new=2)
        _, other = turn(store, model, cat(prompt, random_ids(B + 2, 93)), session="B", new=2, expect=2 * B)
        later = cat(mine, random_ids(3, 94))
        cache = verify_open(store, model, later, expect=mine.shape[1] - 1)  # no session
        out = verify_generate(model, later, cache, 2)
        assert store.forget(session="A") > 0
        assert store.open(model, cat(mine, random_ids(1, 95))).restored_tokens == 2 * B
        assert cache.commit(out) == 2 * B  # the blocks B holds, not A's
        verify_open(store, model, cat(mine, random_ids(1, 95)), expect=2 * B)
        verify_sessions_hold_blocks_of_their_own(store)
    with TieredStore(path, device="cpu", block_size=B) as store:
        verify_open(store, model, cat(mine, random_ids(1, 95)), expect=2 * B)
        verify_open(store, model, cat(other, random_ids(1, 96)), session="B", expect=other.shape[1] - 1)


def test_a_turn_that_computed_the_blocks_a_forget_took_keeps_them(tiny_model, tmp_path):
    """Session B's first turn restores nothing; before its commit, A commits the same system
    prompt and is forgotten, taking the prompt's blocks. B computed them itself, so its commit
    keeps them all (found by helper-69: it kept nothing, matched on its chain's keys)."""
    model = tiny_model("llama")
    prompt = random_ids(2 * B, 101)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        ids = cat(prompt, random_ids(3, 102))
        cache = verify_open(store, model, ids, session="B", expect=0)
        out = verify_generate(model, ids, cache, 2)
        turn(store, model, cat(prompt, random_ids(4, 103)), session="A", new=2, expect=0)
        assert store.forget(session="A") > 0
        assert cache.commit(out) == out.shape[1] - 1
        verify_open(store, model, cat(out, random_ids(1, 104)), session="B", expect=out.shape[1] - 1)
        verify_sessions_hold_blocks_of_their_own(store)


def test_a_reopened_store_stops_tracking_sessions_with_no_block_of_their_own(tiny_model, tmp_path):
    # Rows an earlier build kept: a session whose only block another session also references.
    model = tiny_model("llama")
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, out = turn(store, model, random_ids(2 * B + 3, 74), session="kept", new=1)
        keys = list(store._index.sessions[_session_id(None, "kept")].keys)
        store.flush()
        hollow = _session_id(None, "old")
        with store._disk.env.begin(write=True) as txn:
            txn.put(hollow, msgpack.packb([None, "old"]), db=store._disk._sessions)
            txn.put(hollow + keys[0], b"", db=store._disk._refs)
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert set(store._index.sessions) == {_session_id(None, "kept")}
        assert all(m.sessions == {_session_id(None, "kept")} for m in store._index.blocks.values())
        verify_sessions_hold_blocks_of_their_own(store)  # the rows are gone from the file too
        verify_open(store, model, cat(out, random_ids(1, 75)), expect=out.shape[1] - 1)


def test_commit_accepts_a_generate_output_object(tiny_model, tmp_path):
    model = tiny_model("llama")
    ids = random_ids(20, 120)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
        assert cache.commit(out) == out.sequences.shape[1] - 1
        nxt = torch.cat([out.sequences, random_ids(2, 121)], dim=1)
        cache = verify_open(store, model, nxt, session="s", expect=out.sequences.shape[1] - 1)
        verify_generate(model, nxt, cache, 3)


def test_hostile_session_and_tenant_names_are_data(tiny_model, tmp_path):
    model = tiny_model("llama")
    names = ["a\x00b", "a", "../../etc/passwd", "x" * 10_000, "имя-😀", "", "s/../t"]
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        outs = {}
        for i, name in enumerate(names):
            ids = random_ids(12, 200 + i)
            cache = store.open(model, ids, session=name, tenant=name)
            outs[name] = generate(model, ids, 2, cache)
            cache.commit(outs[name])
        # Each tenant sees only its own conversation.
        for name in names:
            for other in names:
                nxt = torch.cat([outs[other], random_ids(2, 300)], dim=1)
                expect = outs[other].shape[1] - 1 if other == name else 0
                assert store.open(model, nxt, tenant=name).restored_tokens == expect
        assert store.forget(session="a\x00b") == 2  # its block and tail; "a" and "b" untouched
        assert store.forget(tenant="a") == 2
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert set(store._index.sessions) == {_session_id(n, n) for n in set(names) - {"a\x00b", "a"}}
    assert {p.name for p in path.iterdir()} == {"data.mdb", "lock.mdb", "tierkv.lock"}  # names never touch paths
    assert {p.name for p in tmp_path.iterdir()} == {"kv"}


def test_session_names_never_reach_the_file_and_forget_finds_sessions_after_a_reopen(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    names = [f"user-{i}@example.com" for i in range(4)]
    outs = {}
    with TieredStore(path, device="cpu", block_size=B) as store:
        for i, name in enumerate(names):
            for tenant in (None, "acme"):
                _, outs[name, tenant] = turn(store, model, random_ids(2 * B + 2, 80 + i), session=name,
                                             tenant=tenant, new=1)  # two whole blocks and a tail
        assert store.forget(session=names[0]) == 6
    data = (path / "data.mdb").read_bytes()
    assert not [name for name in names if name.encode() in data]  # live and forgotten alike

    def restored(store: TieredStore, name: str, tenant: str | None) -> int:
        out = outs[name, tenant]
        return verify_open(store, model, cat(out, random_ids(1, 90)), tenant=tenant).restored_tokens

    with TieredStore(path, device="cpu", block_size=B) as store:
        assert store.stats()["sessions"] == 6
        assert store.forget(session=names[1], tenant="acme") == 3
        assert store.forget(session=names[2]) == 6  # under every tenant
        assert store.forget(tenant="acme") == 3
        assert store.forget(session="user-9@example.com") == 0
        full = 2 * B + 2
        assert {(n, t): restored(store, n, t) for n in names[1:] for t in (None, "acme")} == {
            (names[1], None): full, (names[1], "acme"): 0, (names[2], None): 0, (names[2], "acme"): 0,
            (names[3], None): full, (names[3], "acme"): 0}


def test_session_rows_an_earlier_build_wrote_with_names_are_read_and_forgotten(tiny_model, tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        _, out = turn(store, model, random_ids(2 * B + 2, 91), session="old", tenant="acme", new=1)
        store.flush()
        with store._disk.env.begin(write=True) as txn:
            txn.put(_session_id("acme", "old"), msgpack.packb(["acme", "old"]), db=store._disk._sessions)
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert [(i.tenant, i.name) for i in store._index.sessions.values()] == [("acme", "old")]
        assert store.stats()["corrupt"] == 0
        assert store.forget(session="old") == 3
        assert verify_open(store, model, cat(out, random_ids(1, 92)), tenant="acme").restored_tokens == 0


# -- the decode path ---------------------------------------------------------------------------------
@pytest.mark.parametrize("restored", [True, False])
def test_a_decode_step_lets_go_of_the_old_keys_before_concatenating_the_values(restored: bool,
                                                                              monkeypatch) -> None:
    # DynamicLayer's own order: held through the values' concatenation, the old keys made every
    # decode step of a large cache several per cent slower than a DynamicCache's.
    import weakref

    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, device="cpu", block_size=B) as store:
        if restored:
            first = store.open(model, ids)
            first.commit(generate(model, ids, 1, first))
        cache = store.open(model, ids)
        assert (cache.restored_tokens > 0) == restored
        with torch.no_grad():
            model(ids[:, cache.restored_tokens:], past_key_values=cache)
        layer = cache.layers[0]
        old = weakref.ref(layer.keys)
        alive: list[bool] = []
        cat = torch.cat

        def watching(*args, **kwargs):
            alive.append(old() is not None)
            return cat(*args, **kwargs)

        monkeypatch.setattr(torch, "cat", watching)
        states = torch.zeros(1, *layer.keys.shape[1:2], 1, layer.keys.shape[3])
        layer.update(states, states.clone())
        assert alive == [True, False]  # the keys' concatenation reads them; the values' finds them gone


def test_turns_after_a_shared_prompt_read_few_of_the_conversations_stored_beside_theirs(tiny_model, tmp_path,
                                                                                       monkeypatch):
    """Every conversation after a shared system prompt begins with the chat template's id: its
    blocks past the prompt are continuations of the prompt's last block with one first id. An
    open of a new conversation compared its ids with each of them, a commit without a session
    and a forget of a session's tail read each of them, all growing with every conversation the
    store held (an open: 0.5 ms at 130 conversations, 16 ms at 4,000); now a few, in token order."""
    import tierkv.index
    import tierkv.store
    model = tiny_model("llama")
    prompt, template = random_ids(2 * B, 500), torch.tensor([[7]])

    def commit(store: TieredStore, ids: torch.Tensor, session: str | None) -> TieredCache:
        cache = store.open(model, ids, session=session)
        with torch.no_grad():
            model(ids[:, cache.restored_tokens:], past_key_values=cache)
        cache.commit(ids)
        return cache

    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        convs = {i: cat(prompt, template, random_ids(2, 600 + i)) for i in range(60)}
        for i, ids in convs.items():
            commit(store, ids, f"s{i}" if i % 2 else None)
        reads, compared = [], []
        children, all_children = tierkv.index.Index.children, tierkv.index.Index.all_children

        def read(found: list) -> list:
            reads.extend(found)
            return found

        monkeypatch.setattr(tierkv.index.Index, "children", lambda self, *a: iter(read(list(children(self, *a)))))
        monkeypatch.setattr(tierkv.index.Index, "all_children", lambda self, *a: read(all_children(self, *a)))
        common_prefix = tierkv.store._common_prefix
        monkeypatch.setattr(tierkv.store, "_common_prefix", lambda a, b: compared.append(a) or common_prefix(a, b))
        mine = cat(prompt, template, random_ids(5, 700))
        cache = commit(store, mine, None)
        assert cache.restored_tokens >= 2 * B
        assert len(compared) <= 2
        tail = keys_of(cache.root, convs[3])[-1]
        assert tail in store._index.blocks
        assert store.forget(session="s3") == 1
        assert tail not in store._index.blocks
        assert len(reads) <= 4
        # The conversations all still restore, but the one forgotten.
        for i, ids in convs.items():
            verify_open(store, model, cat(ids, random_ids(1, 800)), expect=ids.shape[1] if i != 3 else None)


def test_forget_of_a_tenant_reads_its_own_blocks_not_every_tenant_s(tiny_model, tmp_path):
    """forget(tenant=...) read every block of every tenant to find one tenant's: a forget of a
    tenant of a few blocks cost as much as of one of thousands (10 ms at 100,000 blocks)."""
    model = tiny_model("llama")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        for i in range(6):
            turn(store, model, random_ids(3 * B, 900 + i), session=f"b{i}", tenant="big", new=2)
        _, out = turn(store, model, random_ids(B + 2, 910), session="s", tenant="small", new=2)
        turn(store, model, random_ids(2 * B, 911), tenant="small", new=2)  # no session's
        small = {k for k, m in store._index.blocks.items() if m.tenant == "small"}
        big = {k for k, m in store._index.blocks.items() if m.tenant == "big"}
        assert len(small) == 5 and len(big) > 6 * 3

        class Unread(dict):
            def values(self):
                raise AssertionError("forget read every block")

            items = values

            def __iter__(self):
                raise AssertionError("forget read every block")

        store._index.blocks = Unread(store._index.blocks)
        assert store.forget(tenant="small") == len(small)
        store._index.blocks = dict(store._index.blocks)
        assert set(store._index.blocks) == big
        verify_open(store, model, cat(out, random_ids(1, 912)), session="s", tenant="small", expect=0)


def test_forget_of_a_session_without_a_tenant_reads_its_own_sessions_not_every_one(tiny_model, tmp_path):
    """forget(session=...) without a tenant read every session to find those of its name (0.27 ms
    at 10,000 sessions): it now finds them by name, and those read back from disk, whose names are
    never written, by their key under each tenant of such sessions."""
    model = tiny_model("llama")
    path = tmp_path / "kv"
    others = {_session_id(f"t{i % 2}", f"o{i}") for i in range(6)}
    with TieredStore(path, device="cpu", block_size=B) as store:
        for i in range(6):
            turn(store, model, random_ids(B + 2, 950 + i), session=f"o{i}", tenant=f"t{i % 2}", new=1)
        for j, tenant in enumerate((None, "acme", "t0")):
            turn(store, model, random_ids(B + 2, 960 + j), session="u", tenant=tenant, new=1)
    with TieredStore(path, device="cpu", block_size=B) as store:
        # Read back without names; one named again by a turn, and one new under another tenant.
        turn(store, model, random_ids(B + 2, 970), session="u", tenant="acme", new=1)
        turn(store, model, random_ids(B + 2, 971), session="u", tenant="new", new=1)
        us = {_session_id(t, "u") for t in (None, "acme", "t0", "new")}
        assert set(store._index.sessions) == others | us
        assert [store._index.sessions[_session_id(t, "u")].name for t in (None, "acme", "t0", "new")] == \
            [None, "u", None, "u"]

        class Unread(dict):
            def values(self):
                raise AssertionError("forget read every session")

            items = values

            def __iter__(self):
                raise AssertionError("forget read every session")

        store._index.sessions = Unread(store._index.sessions)
        assert store.forget(session="u") > 0
        store._index.sessions = dict(store._index.sessions)
        assert set(store._index.sessions) == others
        assert store.forget(session="o1") > 0 and set(store._index.sessions) == others - {_session_id("t1", "o1")}


def test_a_commit_of_a_session_of_many_conversations_reads_few_of_its_blocks(tiny_model, tmp_path):
    """One session name for all a user's conversations: a commit read every block the session
    held, looking for the partial tails its chain supersedes (23 ms at 15,000); now it looks up
    the continuations of its chain's blocks, and still lets go of the tail it supersedes."""
    model = tiny_model("llama")

    def commit(store: TieredStore, ids: torch.Tensor) -> TieredCache:
        cache = store.open(model, ids, session="u")
        with torch.no_grad():
            model(ids[:, cache.restored_tokens:], past_key_values=cache)
        cache.commit(ids)
        return cache

    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        convs = [random_ids(2 * B + 3, 1000 + i) for i in range(40)]
        for ids in convs:
            root = commit(store, ids).root
        info = store._index.sessions[_session_id(None, "u")]
        assert len(info.keys) == 40 * 3
        read = []

        class Counted(set):
            def __iter__(self):
                for k in set.__iter__(self):
                    read.append(k)
                    yield k

        info.keys = Counted(info.keys)
        tail = keys_of(root, convs[5])[-1]
        longer = cat(convs[5], random_ids(B, 1100))
        commit(store, longer)
        assert len(read) <= 8
        assert tail not in store._index.blocks
        assert set(keys_of(root, longer)) <= info.keys
        verify_open(store, model, cat(longer, random_ids(1, 1101)), session="u", expect=longer.shape[1])


def test_a_reopen_orders_the_continuations_of_a_block_once_not_an_insertion_each(tiny_model, tmp_path,
                                                                                 monkeypatch):
    """A reopen adds its blocks in last-use order: each inserted into the token order of its
    prompt's continuations moved all those before it (52 us an add at 300,000 continuations of
    one block, 6.8 us at 10,000: a reopen quadratic in the conversations after one prompt). One
    sort a bucket now; the order found is whole, and a new conversation reads few of them."""
    import bisect

    import tierkv.index
    import tierkv.store
    model = tiny_model("llama")
    prompt, template = random_ids(2 * B, 500), torch.tensor([[7]])
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        for i in range(40):
            ids = cat(prompt, template, random_ids(2, 1200 + i))
            cache = store.open(model, ids, session=f"s{i}")
            with torch.no_grad():
                model(ids[:, cache.restored_tokens:], past_key_values=cache)
            cache.commit(ids)
        parent = keys_of(cache.root, prompt)[-1]
    inserted, insort = [], bisect.insort
    monkeypatch.setattr(tierkv.index.bisect, "insort", lambda a, x, **kw: inserted.append(x) or insort(a, x, **kw))
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert inserted == []
        index = store._index
        keys = index._children[parent][7]
        assert len(keys) == 40 and sorted(index._ordered[(parent, 7)]) == sorted(keys)
        tokens = [index._tokens_of(k) for k in index._ordered[(parent, 7)]]
        assert tokens == sorted(tokens)
        compared = []
        common_prefix = tierkv.store._common_prefix
        monkeypatch.setattr(tierkv.store, "_common_prefix", lambda a, b: compared.append(a) or common_prefix(a, b))
        verify_open(store, model, cat(prompt, template, random_ids(5, 1300)), expect=2 * B + 1)
        assert len(compared) <= 2
