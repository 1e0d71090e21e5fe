"""Blocks of layers holding KV of other shapes (tierkv/layout.py): each layer's keys and values go
into its units and come back as the contiguous tensors a DynamicCache holds, from whole blocks,
blocks cut short and several blocks with the new tokens after them; so too keys and values of
other shapes (multi-head latent attention). Exactness of such models (Gemma 4, Gemma 3n's KV
sharing, DeepSeek-V3's latent attention) through every tier is in test_store.py, and in
test_exactness.py, test_sliding.py and test_in_place.py (``conftest``'s ``gemma4_text``,
``gemma3n_text`` and ``deepseek_v3``)."""

from __future__ import annotations

import random

import pytest
import torch

from tierkv.layout import KVLayout, LayerUnits, Units


def test_layers_of_one_shape_need_no_layout() -> None:
    assert KVLayout.of([(2, 16)] * 5) is None
    assert KVLayout.of([(8, 128)]) is None


def test_layers_holding_no_kv_hold_no_slot() -> None:
    # KV sharing (Gemma 3n's, Gemma 4 E2B's last layers): a layout even where the others are of one shape.
    layout = KVLayout.of([(2, 16), (2, 16), None, None])
    assert layout is not None and layout.slots == 2 and (layout.heads, layout.dim) == (2, 16)
    assert [layout.holds(i) for i in range(4)] == [True, True, False, False]
    block = torch.randn(layout.slots, 2, 2, 8, 16)
    keys, values = layout.join([layout.part(block, 1)], 1)
    assert torch.equal(keys[0], block[1, 0]) and torch.equal(values[0], block[1, 1])
    with pytest.raises(ValueError, match="no layer holds KV"):
        KVLayout.of([None, None])


def test_slots_are_the_shapes_common_divisors_in_layer_order() -> None:
    # Gemma-4-like: sliding layers of 16 KV heads x 256, full-attention ones of 4 x 512 (keys as values).
    layout = KVLayout.of([(16, 256), (16, 256), (4, 512), (16, 256)])
    assert layout is not None and (layout.heads, layout.dim) == (4, 256)
    # Each layer's slots as laid out before keys and values of other shapes were served (records
    # stored then restore the same): a slot's keys half, then its values', slot after slot.
    assert layout.layers == tuple(LayerUnits(Units(2 * first, 2, h, d), Units(2 * first + 1, 2, h, d))
                                  for first, h, d in ((0, 4, 1), (4, 4, 1), (8, 1, 2), (10, 4, 1)))
    assert layout.slots == 14
    assert [layout.shape(i) for i in range(4)] == [(16, 256, 16, 256), (16, 256, 16, 256), (4, 512, 4, 512),
                                                   (16, 256, 16, 256)]
    odd = KVLayout.of([(2, 16), (1, 24)])
    assert odd is not None and (odd.heads, odd.dim, odd.slots) == (1, 8, 4 + 3)


def test_keys_and_values_of_other_shapes_lie_apart() -> None:
    # DeepSeek-V3's latent attention: a latent of 512 as keys, rotary keys of 64 as values, one head.
    layout = KVLayout.of([(1, 512, 1, 64)] * 3)
    assert layout is not None and (layout.heads, layout.dim) == (1, 64)
    assert layout.layers[1] == LayerUnits(Units(9, 1, 1, 8), Units(17, 1, 1, 1))
    assert (layout.units, layout.slots) == (27, 14)  # the last slot's values half held by no layer
    assert [layout.shape(i) for i in range(3)] == [(1, 512, 1, 64)] * 3
    # Keys and values of one shape written as a pair are one shape.
    assert KVLayout.of([(2, 16, 2, 16), (2, 16)]) is None
    mixed = KVLayout.of([(2, 16), (1, 32, 1, 8), (2, 16)])
    assert mixed is not None and (mixed.heads, mixed.dim) == (1, 8)
    assert mixed.layers == (LayerUnits(Units(0, 2, 2, 2), Units(1, 2, 2, 2)), LayerUnits(Units(8, 1, 1, 4),
                            Units(12, 1, 1, 1)), LayerUnits(Units(13, 2, 2, 2), Units(14, 2, 2, 2)))
    assert (mixed.units, mixed.slots, [layer.last_slot for layer in mixed.layers]) == (21, 11, [3, 6, 10])


def test_a_new_block_holds_no_stale_memory_where_no_layer_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVLayout.of([(1, 32, 1, 8)] * 3)
    assert layout is not None and layout.units % 2 == 1
    empty = torch.empty
    # Memory as torch.empty may hand it out: whatever was there before.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    block = layout.empty(5, torch.float32, torch.device("cpu"))
    assert block.shape == (layout.slots, 2, 1, 5, 8)
    assert torch.equal(block[-1, 1], torch.zeros(1, 5, 8)) and block.view(-1)[:layout.units * 40].isnan().all()


def _layers(shapes: list[tuple[int, ...] | None], tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values (1, H, tokens, D)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for shape in shapes:
        if shape is None:
            layers.append((torch.empty(0), torch.empty(0)))
            continue
        kh, kd, vh, vd = (*shape, *shape) if len(shape) == 2 else shape
        layers.append((torch.randn(1, kh, tokens, kd, generator=g), torch.randn(1, vh, tokens, vd, generator=g)))
    return layers


def _equal(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all([g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want)])


@pytest.mark.parametrize("shapes", [
    [(2, 16), (1, 32)], [(2, 16), (4, 16), (2, 16)], [(2, 16), (1, 24), (3, 8)], [(4, 256), (2, 512), (4, 256)],
    [(2, 16), (1, 32), None], [(1, 32, 1, 8)] * 3, [(2, 24, 2, 16), (4, 24, 4, 16)], [(2, 16), (1, 32, 1, 8), None],
])
def test_a_block_gives_back_each_layers_keys_and_values(shapes: list[tuple[int, ...] | None]) -> None:
    layout = KVLayout.of(shapes)
    assert layout is not None
    layers = _layers(shapes, 24, seed=1)
    # Three blocks of 8 tokens, each filled from a slice of the layers (a view with the layer's strides).
    blocks = []
    for start in range(0, 24, 8):
        block = layout.empty(8, torch.float32, torch.device("cpu"))
        block.view(-1)[:layout.units * 8 * layout.heads * layout.dim] = float("nan")
        for i, (keys, values) in enumerate(layers):
            if layout.holds(i):
                layout.fill(block, i, keys[0, :, start:start + 8], values[0, :, start:start + 8])
        assert not block.isnan().any()  # every unit written
        blocks.append(block)
    new = _layers(shapes, 3, seed=2)
    for i, (keys, values) in enumerate(layers):
        if not layout.holds(i):
            continue
        assert _equal(layout.join([layout.part(b, i) for b in blocks], i), (keys, values))
        # The last block restored in part, then the first forward's tokens.
        parts = [layout.part(blocks[0], i), layout.part(blocks[1], i), layout.part(blocks[2][:, :, :, :5], i)]
        parts.append((layout.split(new[i][0][0], i, False), layout.split(new[i][1][0], i, True)))
        assert _equal(layout.join(parts, i), (torch.cat([keys[:, :, :21], new[i][0]], dim=2),
                                              torch.cat([values[:, :, :21], new[i][1]], dim=2)))


def test_random_shapes_round_trip() -> None:
    rng = random.Random(7)
    for case in range(50):
        shapes: list[tuple[int, ...]] = []
        for _ in range(rng.randint(1, 6)):
            shape = (rng.choice([1, 2, 3, 4, 6]), rng.choice([8, 16, 24, 32, 48]))
            shapes.append(shape if rng.random() < 0.5 else (*shape, rng.choice([1, 2, 3, 4, 6]),
                                                             rng.choice([8, 16, 24, 32, 48])))
        layout = KVLayout.of(shapes)
        if layout is None:
            assert len({(*s, *s) if len(s) == 2 else s for s in shapes}) == 1
            continue
        tokens = rng.randint(1, 9)
        layers = _layers(shapes, tokens, seed=case)
        block = layout.empty(tokens, torch.float32, torch.device("cpu"))
        for i, (keys, values) in enumerate(layers):
            layout.fill(block, i, keys[0], values[0])
        for i, kv in enumerate(layers):
            assert _equal(layout.join([layout.part(block, i)], i), kv), (shapes, i)


def test_a_restore_copied_to_cuda_waits_for_each_layers_last_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layered CUDA copy (``transfer._LayeredCudaJob``) lands a block's slots in order; a layer of
    several slots is ordered after its last. Faked here: the jobs hand back their block at once and
    note which slot was waited for (the copies themselves run in benchmarks/gpu_check.py)."""
    from tierkv.cache import _Restore
    from tierkv.transfer import _LayeredCudaJob

    waited: list[int] = []

    class Landed(_LayeredCudaJob):
        def __init__(self, tensor: torch.Tensor) -> None:
            self._tensor = tensor

        def stream_wait_layer(self, layer: int, seen: set[int], stream: object = None) -> torch.Tensor:
            waited.append(layer)
            return self._tensor

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    shapes = [(2, 16), (1, 32), None, (2, 16), (1, 40, 1, 8)]
    layout = KVLayout.of(shapes)
    assert layout is not None and [s and s.last_slot for s in layout.layers] == [3, 7, None, 11, 14]
    layers = _layers(shapes, 13, seed=3)
    blocks = [layout.empty(8, torch.float32, torch.device("cpu")) for _ in range(2)]
    for j, block in enumerate(blocks):
        for i, (keys, values) in enumerate(layers):
            if layout.holds(i):
                layout.fill(block[:, :, :, :min(8, 13 - 8 * j)], i, keys[0, :, 8 * j:8 * j + 8],
                            values[0, :, 8 * j:8 * j + 8])
    restore = _Restore([(Landed(blocks[0]), 8), (Landed(blocks[1]), 5)], None, layout)
    for i in (4, 3, 1, 0):
        waited.clear()
        assert _equal(restore.join(i, restore.layer_parts(i)), layers[i])
        assert waited == [layout.layers[i].last_slot] * 2


def test_a_disk_restore_lays_each_layer_out_in_its_own_shape() -> None:
    """``restore_slots`` with a layout: keys and values per layer of its own KV heads and head_dim
    (none for a layer holding no KV), from its window's cut, and each unit one piece of the
    payload's rows, in their order; a block of another layout refused."""
    from tierkv.cache import restore_slots
    from tierkv.codec import CorruptRecord

    layout = KVLayout.of([(2, 8), (1, 16), None])
    assert layout is not None and layout.slots == 4 and (layout.heads, layout.dim) == (1, 8)

    class Header:
        shape, dtype = (4, 2, 1, 4, 8), "float32"

    buffer: list = []
    pieces = restore_slots(buffer, 10, 4, 4, Header(), [0, 4, 0], layout)
    made = buffer[0]
    assert made.layers[2] is None
    assert [tuple(part.shape) for kv in made.layers[:2] for part in kv] == [(1, 2, 10, 8), (1, 2, 10, 8),
                                                                          (1, 1, 6, 16), (1, 1, 6, 16)]
    assert [row for row, _ in pieces] == list(range(8)) and all(part.shape == (1, 4, 32) for _, part in pieces)
    for row, part in pieces:
        part[...] = row
    # The payload's rows: slot s's keys at 2s, its values at 2s + 1; layer 0's heads are slots 0 and
    # 1, layer 1's two halves of head_dim slots 2 and 3.
    k0, v0 = [part[0, :, 4:8].contiguous().view(torch.uint8)[..., 0] for part in made.layers[0]]
    assert (k0 == torch.tensor([0, 2])[:, None]).all() and (v0 == torch.tensor([1, 3])[:, None]).all()
    k1 = made.layers[1][0][0, 0, 0:4].contiguous().view(torch.uint8).reshape(4, 2, 32)[..., 0]
    v1 = made.layers[1][1][0, 0, 0:4].contiguous().view(torch.uint8).reshape(4, 2, 32)[..., 0]
    assert (k1 == torch.tensor([4, 6])).all() and (v1 == torch.tensor([5, 7])).all()
    # A block before layer 1's cut lands in layer 0's slots alone.
    assert [row for row, _ in restore_slots(buffer, 10, 0, 4, Header(), [0, 4, 0], layout)] == [0, 1, 2, 3]
    with pytest.raises(CorruptRecord, match="restored for a model whose blocks hold 4 slots of 1 KV heads x head_dim 8"):
        class Other:
            shape, dtype = (4, 2, 2, 4, 4), "float32"

        restore_slots([], 10, 0, 4, Other(), [0, 4, 0], layout)


def test_a_disk_restore_of_keys_and_values_of_other_shapes_lays_them_out_apart() -> None:
    """Latent attention's keys and values (one head; widths 32 and 8): the layer's keys' units
    come first in the payload's rows, then its values', each one piece (a head's units, a row
    each), and the last slot's values half, no layer's, is left to the checksum (no piece)."""
    from tierkv.cache import restore_slots

    layout = KVLayout.of([(1, 32, 1, 8)] * 3)
    assert layout is not None and (layout.units, layout.slots, layout.heads, layout.dim) == (15, 8, 1, 8)

    class Header:
        shape, dtype = (8, 2, 1, 4, 8), "float32"

    buffer: list = []
    pieces = restore_slots(buffer, 6, 0, 4, Header(), None, layout)
    assert [(row, part.shape) for row, part in pieces] == [(5 * i + 4 * j, (4 - 3 * j, 4, 32)) for i in range(3)
                                                          for j in (0, 1)]
    for row, part in pieces:
        for r in range(part.shape[0]):
            part[r] = row + r
    for i in range(3):
        keys, values = buffer[0].layers[i]
        assert (keys.shape, values.shape) == ((1, 1, 6, 32), (1, 1, 6, 8))
        got = keys[0, 0, :4].contiguous().view(torch.uint8).reshape(4, 4, 32)[..., 0]
        assert (got == torch.arange(5 * i, 5 * i + 4)).all()
        assert (values[0, 0, :4].contiguous().view(torch.uint8) == 5 * i + 4).all()


def test_a_restore_of_layers_of_one_shape_makes_no_call_per_block_but_its_views() -> None:
    """Layers of one KV shape (no layout: ``info.layout`` None) take their parts of each block as
    before layouts were added: ``layer_parts`` calls ``_block_views`` per block and nothing else.
    A helper called per block per layer (``_layer_part``, added with layouts) made ``layer_parts``
    over 256 blocks of 32 layers 1.5 ms where it was 1.15 (h121). Calls counted, not timed."""
    import sys

    from tierkv.cache import _Restore
    from tierkv.transfer import Job

    blocks = [(Job.completed(torch.randn(3, 2, 2, 4, 8)), 4 if j < 4 else 2) for j in range(5)]
    restore = _Restore(blocks)
    calls: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code.co_filename.endswith("cache.py"):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        parts = restore.layer_parts(1)
    finally:
        sys.setprofile(None)
    assert calls == ["layer_parts"] + ["_block_views"] * 5
    assert torch.equal(torch.cat(parts, dim=-2), torch.cat([t.wait()[1, :, :, :n] for t, n in blocks], dim=-2))


def test_a_layers_part_of_a_block_is_one_dispatch_for_its_keys_and_one_for_its_values() -> None:
    """``part`` runs per block per layer in every restore of a layout. Its keys and values were
    each a view of the units' row, a stepped slice, a view and a permute: eight dispatches a
    layer, which made a Gemma-4-like restore's parts 17-26 us a block and layer where they had
    been 7 before keys and values lay apart (h122). Dispatches counted, not timed; the views equal
    a reference made by indexing the units one by one, from a whole block and one cut short."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    shapes: list[tuple[int, ...] | None] = [(4, 16), (2, 32), None, (1, 32, 1, 8), (4, 16)]
    layout = KVLayout.of(shapes)
    assert layout is not None
    block = torch.arange(layout.slots * 2 * layout.heads * 6 * layout.dim, dtype=torch.float32).view(
        layout.slots, 2, layout.heads, 6, layout.dim)
    for cut in (block, block[:, :, :, :4]):
        units = cut.reshape(-1, *cut.shape[2:])  # unit u: cut[u // 2, u % 2]
        for i, layer in enumerate(layout.layers):
            if layer is None:
                continue
            with Count() as count:
                keys, values = layout.part(cut, i)
            assert len(count.ops) == 2, count.ops
            for got, run in ((keys, layer.keys), (values, layer.values)):
                want = torch.stack([torch.stack([units[run.first + run.step * (g * run.parts + p)]
                                                 for p in range(run.parts)], dim=2) for g in range(run.heads)])
                assert torch.equal(got, want)
    # A block whose slots' halves do not lie one after another is refused, not misread.
    apart = torch.zeros(2, layout.slots, layout.heads, 6, layout.dim).transpose(0, 1)
    with pytest.raises(ValueError, match="halves do not lie one after another"):
        layout.part(apart, 0)
