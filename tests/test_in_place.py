"""Restores read from disk straight into the cache's own buffer (``TieredStore._in_place``).

On a CPU device tier where neither memory tier can take a block, ``open`` copies each block
read from disk into its token range of one (layers, 2, kv_heads, L, head_dim) buffer, and the
first forward writes its new tokens into the room left past the restore: no host copy of the
block and no concatenation of the layer. Output stays equal to plain ``generate``, whatever the
restore mixes (blocks in memory, a corrupt block that cuts it short) and whatever the first
forward feeds (fewer tokens, several rows, a crop first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from conftest import ARCHITECTURES, damage_in_place, flipped, random_ids, reencoded
from tierkv import TieredCache, TieredStore
from tierkv.cache import IN_PLACE, UNREAD, describe_model, restore_slots
from tierkv.codec import CorruptRecord

B = 8


def disk_only(path, **budgets) -> TieredStore:
    kw = {"device_budget": 0, "host_budget": 0, **budgets}
    return TieredStore(path, device="cpu", block_size=B, **kw)


def generate(model, ids, cache=None, **kw):
    kwargs = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, **kwargs, **kw)


def stored_conversation(model, path, ids) -> torch.Tensor:
    """One turn through a disk-only store, closed after it: the next store reads it from disk."""
    with disk_only(path) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, cache)
        cache.commit(out)
    return out


@contextlib.contextmanager
def returning(model, tmp_path, seed: int, new: int) -> Iterator[tuple[TieredStore, torch.Tensor]]:
    """A turn of 3 blocks and 3 tokens stored through a disk-only store, that store reopened on it,
    and the next turn's ids (the conversation and ``new`` user tokens)."""
    out = stored_conversation(model, tmp_path / "kv", random_ids(3 * B + 3, seed))
    with disk_only(tmp_path / "kv") as store:
        yield store, torch.cat([out, random_ids(new, seed + 1)], dim=1)


@contextlib.contextmanager
def host_tail(model, tmp_path, seed: int) -> Iterator[tuple[TieredStore, torch.Tensor]]:
    """A disk-only store whose host tier holds a turn's tail of 4 tokens and no full block, after
    one turn of 2 full blocks and that tail, flushed (read back from disk, not from the writes'
    own buffers): the next restore mixes disk blocks read into its buffer with the tail from
    memory. Yields the store and the next turn's ids."""
    ids = random_ids(2 * B + 1, seed)  # + 4 generated
    config = model.config
    layout = describe_model(model).layout  # Gemma 4's layers hold KV of other shapes (layout.py)
    per_token = layout.slots * 2 * layout.heads * layout.dim * 4 if layout else \
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    tail_bytes = 4 * per_token
    with disk_only(tmp_path / "kv", host_budget=tail_bytes) as store:
        cache = store.open(model, ids)
        out = generate(model, ids, cache)
        assert cache.commit(out) == 2 * B + 4
        store.flush()
        yield store, torch.cat([out, random_ids(3, seed + 1)], dim=1)


def restore_of(cache: TieredCache):
    restore = cache.layers[0]._pending
    assert restore is not None and all(layer._pending is restore for layer in cache._kv)
    return restore


def shares_buffer(cache: TieredCache, buffer) -> bool:
    """Every layer's keys and values are its part of the restore's buffer (with a layout, its keys'
    part and its values')."""
    return all(layer._keys.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr() and
               layer._values.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
               for layer, (keys, values) in zip(cache.layers, [part if isinstance(part, tuple) else (part, part)
                                                               for part in buffer.layers]) if keys is not None)


def storage_bytes(tensors) -> int:
    """The bytes of the storages under ``tensors``, each once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_restore_from_disk_lands_in_one_buffer_and_the_first_forward_writes_into_it(tiny_model, tmp_path, arch):
    model = tiny_model(arch)
    with returning(model, tmp_path, 10, 3) as (store, nxt):
        cache = store.open(model, nxt)
        r = cache.restored_tokens
        assert r == nxt.shape[1] - 4 and cache.restored_from["disk"] == r
        restore = restore_of(cache)
        buffer = restore.buffer
        assert buffer is not None and buffer.length == nxt.shape[1]
        # Each layer's part from the first token its window reaches: none of the buffer is a
        # sliding layer's tokens before it (one buffer of every layer's whole length was).
        # None: a layer reading another's KV; a pair, keys and values, with a layout (layout.py).
        layout = cache.model_info.layout
        parts = [t for part in buffer.layers if part is not None for t in (part if layout else (part,))]
        itemsize = parts[0].element_size()
        assert storage_bytes(parts) == sum(part.numel() for part in parts) * itemsize
        # Each layer's own KV heads and head_dim (Gemma 4's differ per layer, DeepSeek-V3's keys and
        # values: layout.py).
        windows = [getattr(layer, "sliding_window", None) for layer in cache.layers]
        lengths = [nxt.shape[1] - (max(0, r - w + 1) // B * B if w else 0) for w in windows]
        if layout:
            assert [None if part is None else tuple(tuple(t.shape) for t in part) for part in buffer.layers] == [
                ((1, layout.shape(i)[0], n, layout.shape(i)[1]), (1, layout.shape(i)[2], n, layout.shape(i)[3]))
                if layout.holds(i) else None for i, n in enumerate(lengths)]
        else:
            assert [tuple(part.shape) for part in buffer.layers] == [
                (2, parts[0].shape[1], n, parts[0].shape[3]) for n in lengths]
        jobs = [job for job, _ in restore.blocks]
        # A model whose every layer slides reads the blocks its window reaches alone.
        unread = len([job for job in jobs if job is UNREAD])
        assert (unread > 0) == all(cache.is_sliding)
        assert jobs[:unread] == [UNREAD] * unread and all(job is IN_PLACE for job in jobs[unread:])
        # The first forward: the layers are the buffer itself, its room filled with the new tokens.
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :r], past_key_values=plain)
            expected = model(nxt[:, r:], past_key_values=plain).logits
            logits = model(nxt[:, r:], past_key_values=cache).logits
        assert shares_buffer(cache, restore.buffer)
        assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
        for layer, plain_layer in zip(cache.layers, plain.layers):
            keys, values = plain_layer.keys, plain_layer.values
            if keys is None:
                assert layer.keys is None  # reads another layer's KV (KV sharing)
                continue
            # A sliding layer holds the restored blocks its window reaches and the new tokens (commit
            # stores them), DynamicCache's its window alone.
            n = keys.shape[-2]
            assert layer.is_sliding == plain_layer.is_sliding
            cut = (r - plain_layer.sliding_window + 1) // B * B if layer.is_sliding else 0
            assert layer.keys.shape[-2] == (nxt.shape[1] - cut if layer.is_sliding else n)
            assert torch.allclose(layer.keys[:, :, -n:], keys, atol=1e-5, rtol=0)
            assert torch.allclose(layer.values[:, :, -n:], values, atol=1e-5, rtol=0)
        # And a whole turn, token for token.
        cache = store.open(model, nxt)
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


@pytest.mark.parametrize("arch", ["llama", "gemma4_text"])
def test_a_restore_mixing_memory_and_disk_blocks_copies_those_in_memory_into_the_buffer(tiny_model, tmp_path, arch):
    model = tiny_model(arch)
    with host_tail(model, tmp_path, 20) as (store, nxt):
        assert store.stats()["host"]["blocks"] == 1  # the tail fits the host tier, full blocks do not
        cache = store.open(model, nxt)
        assert cache.restored_from == {"device": 0, "host": 4, "disk": 2 * B}
        restore = restore_of(cache)
        assert [job is IN_PLACE for job, _ in restore.blocks] == [True, True, False]
        got = generate(model, nxt, cache)
        assert torch.equal(got, generate(model, nxt))
        assert cache.get_seq_length() == got.shape[1] - 1


def test_blocks_the_host_tier_can_take_are_read_into_it_not_into_the_buffer(tiny_model, tmp_path):
    """Only a block that no memory tier can take is read in place: one the host tier can take is
    read into a host buffer and rests there, so the next turn restores it from memory (read in
    place whenever the device tier could not take it, it stayed on disk only)."""
    model = tiny_model("llama")
    out = stored_conversation(model, tmp_path / "kv", random_ids(3 * B + 3, 50))
    held = out.shape[1] - 1
    with disk_only(tmp_path / "kv", host_budget="1MiB") as store:
        nxt = torch.cat([out, random_ids(2, 51)], dim=1)
        cache = store.open(model, nxt)
        assert cache.restored_from == {"device": 0, "host": 0, "disk": held}
        assert not any(job is IN_PLACE for job, _ in restore_of(cache).blocks)
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))
        assert store.stats()["host"]["blocks"] == 4
        cache = store.open(model, nxt)
        assert cache.restored_from == {"device": 0, "host": held, "disk": 0}


def test_a_corrupt_block_cuts_the_restore_short_and_the_buffer_past_it_is_never_used(tiny_model, tmp_path):
    model = tiny_model("llama")
    with returning(model, tmp_path, 30, 2) as (store, nxt):
        cache = store.open(model, nxt)
        second = cache._restored_keys[1]
        del cache
        disk = store._disk
        damage_in_place(disk.env, disk._blocks, second, lambda record: flipped(record, -20))  # the payload's last bytes
        cache = store.open(model, nxt)
        assert cache.restored_tokens == B and store.stats()["corrupt"] == 1
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_corrupt_disk_block_ends_the_restore_before_a_tail_in_memory(tiny_model, tmp_path):
    """A restore is a prefix: the tail the host tier holds past a corrupt disk block is not
    restored (a restore that went on past the miss put the tail's KV at the miss's tokens, and
    the test above, all on disk, cannot tell: the reads past a miss are dropped before)."""
    model = tiny_model("llama")
    with host_tail(model, tmp_path, 40) as (store, nxt):
        cache = store.open(model, nxt)
        assert cache.restored_from == {"device": 0, "host": 4, "disk": 2 * B}
        second = cache._restored_keys[1]
        del cache
        disk = store._disk
        damage_in_place(disk.env, disk._blocks, second, lambda record: flipped(record, -20))
        cache = store.open(model, nxt)
        assert cache.restored_from == {"device": 0, "host": 0, "disk": B} and store.stats()["corrupt"] == 1
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


# The sliding shapes lay a layer's part of the buffer out from its window's cut, which the old
# path's slice of it must take off (no other test takes that path with a cut layer).
CUT = ["llama", "gemma3_text", "mistral_window"]


def buffer_of(cache: TieredCache, arch: str):
    """The restore's buffer, a sliding layer's part of it starting at its window's cut."""
    buffer = restore_of(cache).buffer
    assert buffer is not None and (max(buffer.skips) > 0) == (arch != "llama")
    return buffer


@pytest.mark.parametrize("arch", CUT)
@pytest.mark.parametrize("first", ["fewer tokens", "crop first", "beams", "chunked prefill"])
def test_a_first_forward_other_than_the_new_tokens_in_one_row_assembles_the_layer_as_before(tiny_model, tmp_path,
                                                                                          first, arch):
    model = tiny_model(arch)
    with returning(model, tmp_path, 40, 5) as (store, nxt):
        cache = store.open(model, nxt)
        r = cache.restored_tokens
        buffer_of(cache, arch)
        if first == "fewer tokens":
            plain = DynamicCache(config=model.config)
            with torch.no_grad():
                model(nxt[:, :r], past_key_values=plain)
                for cut in (r + 2, nxt.shape[1]):
                    start = cache.get_seq_length()
                    got = model(nxt[:, start:cut], past_key_values=cache).logits
                    expected = model(nxt[:, start:cut], past_key_values=plain).logits
                    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
            assert cache.get_seq_length() == nxt.shape[1]
            return
        if first == "crop first":
            cache.crop(-3)
            got = generate(model, nxt, cache)
        elif first == "beams":
            got = generate(model, nxt, cache, num_beams=3)
            assert torch.equal(got, generate(model, nxt, num_beams=3))
            return
        else:
            got = generate(model, nxt, cache, prefill_chunk_size=2)
        assert torch.equal(got, generate(model, nxt))


@pytest.mark.parametrize("arch", CUT)
def test_a_first_forward_with_grad_enabled_assembles_the_layer_as_before(tiny_model, tmp_path, arch):
    # Before: the layers were views of one buffer that each layer's write changed in place, under
    # autograd: the next forward's concatenation raised ("Output 0 of Split is a view and its base
    # or another view of its base has been modified inplace"), and so did a backward.
    model = tiny_model(arch)
    with returning(model, tmp_path, 50, 3) as (store, nxt):
        cache = store.open(model, nxt)
        r = cache.restored_tokens
        buffer_of(cache, arch)
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :r], past_key_values=plain)
        logits = model(nxt[:, r:], past_key_values=cache).logits  # grad enabled, as outside generate()
        expected = model(nxt[:, r:], past_key_values=plain).logits
        assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
        step = logits[:, -1:].argmax(-1)
        logits = model(step, past_key_values=cache).logits
        assert torch.allclose(logits, model(step, past_key_values=plain).logits, atol=1e-5, rtol=0)
        logits.sum().backward()


def test_a_forward_with_grad_whose_keys_need_none_leaves_the_buffer_alone_for_backward(tmp_path):
    # A model whose first layer's query needs grad while its keys and values do not (an adapter
    # on q_proj alone), with as many KV heads as query heads (attention saves the keys it is
    # given, not a copy repeated per head). Before: layer 0 took the fast path, its attention
    # saved views of the shared buffer for backward, and layer 1, whose keys need grad, copied
    # the block from the host tier into that buffer: backward raised ("modified by an inplace
    # operation") where a DynamicCache's did not.
    from conftest import make_model

    model = make_model("llama", seed=5, num_key_value_heads=4)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("model.layers.0.self_attn.q_proj."))
    with host_tail(model, tmp_path, 80) as (store, nxt):
        cache = store.open(model, nxt)
        assert [job is IN_PLACE for job, _ in restore_of(cache).blocks] == [True, True, False]
        r = cache.restored_tokens
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :r], past_key_values=plain)
        expected = model(nxt[:, r:], past_key_values=plain).logits
        expected.sum().backward()
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        grad, q_proj.grad = q_proj.grad, None
        logits = model(nxt[:, r:], past_key_values=cache).logits
        assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
        logits.sum().backward()
        assert torch.allclose(q_proj.grad, grad, atol=1e-5, rtol=0)


def test_a_corrupt_first_disk_block_after_blocks_in_memory_does_not_shape_the_buffer(tiny_model, tmp_path):
    # The buffer is made by the first block read into it, from that record's header, before its
    # checksum is known. Before: when that record failed, the buffer it shaped (here with heads
    # and head_dim swapped) still took the blocks before it, which came from memory (a write in
    # flight, as a prefix committed again after its eviction from disk is), and generate() raised.
    from tierkv.codec import decode_header
    from tierkv.store import Tier
    from tierkv.transfer import Job

    model = tiny_model("llama")
    with returning(model, tmp_path, 60, 2) as (store, nxt):
        cache = store.open(model, nxt)
        first, second = cache._restored_keys[:2]
        del cache
        disk = store._disk
        _, block = disk.load(first, lambda shape, dtype: torch.empty(shape, dtype=dtype))

        def swapped(record: bytes) -> bytes:
            layers, two, heads, tokens, dim = decode_header(record).shape
            # A payload byte flipped too: the checksum fails, after the buffer was made.
            return flipped(reencoded(record, shape=(layers, two, dim, tokens, heads)), -20)

        damage_in_place(disk.env, disk._blocks, second, swapped)
        source = store._source

        def first_in_memory(meta):
            return (Tier.DISK, Job.completed(block)) if meta.key == first else source(meta)

        store._source = first_in_memory
        cache = store.open(model, nxt)
        assert cache.restored_tokens == B and store.stats()["corrupt"] == 1
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_header_whose_token_count_disagrees_with_the_index_never_sizes_the_buffer(tiny_model, tmp_path, monkeypatch):
    # The first block read sizes the buffer, from its header, before its checksum is known. A
    # header claiming 1 token of 8 times the heads (its record's length still agreeing, its
    # checksum recomputed) asked for a buffer 8 times the conversation's KV; a 1 MiB block in a
    # 100k-token conversation asked for 100 GiB: an allocation error out of open(), not a miss.
    import tierkv.store as store_module
    from tierkv.codec import decode_header

    model = tiny_model("llama")
    with returning(model, tmp_path, 90, 2) as (store, nxt):
        cache = store.open(model, nxt)
        first = cache._restored_keys[0]
        del cache
        disk = store._disk

        def one_token(record: bytes) -> bytes:
            layers, two, heads, tokens, dim = decode_header(record).shape
            return reencoded(record, shape=(layers, two, heads * tokens, 1, dim))

        damage_in_place(disk.env, disk._blocks, first, one_token)
        sized = []
        slots = store_module.restore_slots

        def spy(buffer, length, at, n, header, skips=None):
            sized.append(header.shape)
            return slots(buffer, length, at, n, header, skips)

        monkeypatch.setattr(store_module, "restore_slots", spy)
        cache = store.open(model, nxt)
        assert sized == [] and cache.restored_tokens == 0 and store.stats()["corrupt"] == 1
        assert torch.equal(generate(model, nxt, cache), generate(model, nxt))


def test_a_record_gone_under_its_index_entry_is_dropped_counted_and_stored_again(tiny_model, tmp_path):
    # A reopened store indexes a record, not a head without one (``DiskTier.scan``). Before: a
    # record gone while the store ran (damage, another program) stayed indexed as on disk; each
    # open read it, missed from there on, and no commit stored it again (the store "had" it), so
    # every turn of that conversation recomputed it until a restart.
    model = tiny_model("llama")
    out = stored_conversation(model, tmp_path / "kv", random_ids(3 * B + 3, 95))
    nxt = torch.cat([out, random_ids(2, 96)], dim=1)
    with disk_only(tmp_path / "kv") as store:
        second = store.open(model, nxt)._restored_keys[1]
        disk = store._disk
        with disk.env.begin(write=True) as txn:
            assert txn.delete(second, db=disk._blocks)
        disk._where.pop(second)  # its freed pages are LMDB's now: the store must not zero them later
        blocks = store.stats()["disk"]["blocks"]
        cache = store.open(model, nxt)
        assert cache.restored_tokens == B and store.stats()["corrupt"] == 1
        assert store.stats()["disk"]["blocks"] == blocks - 1
        got = generate(model, nxt, cache)
        assert torch.equal(got, generate(model, nxt))
        cache.commit(got)
        store.flush()
        cache = store.open(model, got)
        assert cache.restored_tokens == got.shape[1] - 1 and store.stats()["corrupt"] == 1
        assert torch.equal(generate(model, got, cache), generate(model, got))
        stats = store.stats()  # the delete of a record already gone is no disk fault
        assert (stats["disk_errors"], stats["disk_failed"], stats["owed_deletes"]) == (0, False, 0)


@pytest.mark.parametrize("generate_in", ["inference_mode", "no_grad"])
def test_a_restore_opened_under_inference_mode_generates_in_or_out_of_it(tiny_model, tmp_path, generate_in):
    # Before: the buffer made under torch.inference_mode was an inference tensor, and the first
    # forward outside that mode (generate() runs under no_grad) raised writing into it ("Inplace
    # update to inference tensor outside InferenceMode is not allowed"); the restore into block
    # tensors of their own, only read, never did.
    model = tiny_model("llama")
    with returning(model, tmp_path, 70, 3) as (store, nxt):
        with torch.inference_mode():
            cache = store.open(model, nxt)
        assert restore_of(cache).buffer is not None
        with torch.inference_mode(generate_in == "inference_mode"):
            got = generate(model, nxt, cache)
        assert torch.equal(got, generate(model, nxt))
        cache.commit(got)


def test_restore_slots_are_views_of_the_buffer_and_refuse_a_block_of_another_shape() -> None:
    class Header:
        def __init__(self, shape: tuple[int, ...], dtype: str = "float32") -> None:
            self.shape, self.dtype = shape, dtype

    buffer: list = []
    (row, first), = restore_slots(buffer, 10, 0, 4, Header((2, 2, 3, 4, 8)))
    made = buffer[0]
    assert row == 0 and [tuple(part.shape) for part in made.layers] == [(2, 3, 10, 8)] * 2
    assert made.dtype == torch.float32 and made.length == 10
    (_, later), = restore_slots(buffer, 10, 4, 4, Header((2, 2, 3, 4, 8)))
    first[...] = 1
    later[...] = 2
    for kv in made.layers:
        assert (kv[:, :, :4].view(torch.uint8) == 1).all() and (kv[:, :, 4:8].view(torch.uint8) == 2).all()
    assert buffer[0] is made
    for shape, dtype in [((2, 2, 2, 4, 8), "float32"), ((2, 2, 3, 4, 4), "float32"), ((3, 2, 3, 4, 8), "float32"),
                         ((2, 2, 3, 4, 8), "bfloat16")]:
        with pytest.raises(CorruptRecord, match="among blocks shaped"):
            restore_slots(buffer, 10, 8, 2, Header(shape, dtype))


def test_restore_slots_lay_each_layer_out_from_its_windows_first_block() -> None:
    """Layers 0 and 2 attend to every token, layers 1 and 3 hold from token 4 on (their window's
    cut): each run of layers of one skip is one tensor, a block before a layer's skip lands in
    the others alone, and the rows of a block are the payload's rows of the layers that take it."""
    class Header:
        shape, dtype = (4, 2, 3, 4, 8), "float32"

    buffer: list = []
    skips = [0, 4, 4, 0]
    pieces = restore_slots(buffer, 10, 0, 4, Header(), skips)
    made = buffer[0]
    assert [tuple(part.shape) for part in made.layers] == [(2, 3, 10, 8), (2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 10, 8)]
    assert made.layers[1].untyped_storage().data_ptr() == made.layers[2].untyped_storage().data_ptr()
    assert sum(part.untyped_storage().nbytes() for part in (made.layers[0], made.layers[1], made.layers[3])) == \
        (10 + 6 + 6 + 10) * 2 * 3 * 8 * 4
    assert [(row, part.shape) for row, part in pieces] == [(0, (6, 4, 32)), (18, (6, 4, 32))]
    pieces = restore_slots(buffer, 10, 4, 4, Header(), skips)
    assert [(row, part.shape) for row, part in pieces] == [(0, (6, 4, 32)), (6, (12, 4, 32)), (18, (6, 4, 32))]
    for row, part in pieces:
        part[...] = np.arange(row, row + part.shape[0], dtype=np.uint8)[:, None, None]
    for i, kv in enumerate(made.layers):
        at = 4 - skips[i]
        assert (kv[:, :, at:at + 4].contiguous().view(torch.uint8).reshape(6, 4, 32)[..., 0]
                == torch.arange(6 * i, 6 * i + 6, dtype=torch.uint8)[:, None]).all()
    with pytest.raises(CorruptRecord, match="a block of 4 layers restored for a model of 3"):
        restore_slots([], 10, 0, 4, Header(), [0, 4, 4])


_GUARDS_LEFT: list = []  # a failing run's inference-mode guards, kept from switching the mode back on


def test_the_buffer_made_under_inference_mode_cut_short_leaves_the_mode_as_it_was() -> None:
    # Before: restore_slots made the buffer inside ``with torch.inference_mode(False)``, whose
    # enter and exit are Python calls: another signal's handler raising as the exit started (or
    # as the guard's own enter returned inside the enter) left the guard entered. The caller's
    # ``torch.inference_mode()`` block then ran on with the mode off, and once the exception was
    # let go (the guard collected, after that block ended) the mode came back on in the caller's
    # thread for good.
    from contextlib import nullcontext

    from conftest import raised_on_the_way_in

    class Header:
        shape, dtype = (2, 2, 3, 4, 8), "float32"

    modes: list[bool] = []

    def enter():
        # The caller's block: torch's C guard, so that the cuts fall in restore_slots' calls only.
        with torch._C._InferenceMode(True):
            try:
                restore_slots([], 10, 0, 4, Header())
            finally:
                modes.append(torch.is_inference_mode_enabled())
        return nullcontext()

    def as_it_was(sent):
        assert modes[-1] and not torch.is_inference_mode_enabled(), sent

    try:
        assert raised_on_the_way_in(enter, as_it_was, within={"restore_slots", "__init__", "__enter__", "__exit__"}) >= 3
        assert not torch.is_inference_mode_enabled()  # every exception let go: no guard switches it on
    finally:
        while torch.is_inference_mode_enabled():
            guard = torch._C._InferenceMode(False)
            guard.__enter__()
            _GUARDS_LEFT.append(guard)
