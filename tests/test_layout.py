"""Blocks of layers holding KV of other shapes (tierkv/layout.py): each layer's keys and values go
into its slots and come back as the contiguous tensor a DynamicCache holds, from whole blocks,
blocks cut short and several blocks with the new tokens after them. Exactness of such models
(Gemma 4, Gemma 3n's KV sharing) through every tier is in test_store.py, and in test_exactness.py,
test_sliding.py and test_in_place.py (``conftest``'s ``gemma4_text`` and ``gemma3n_text``)."""

from __future__ import annotations

import random

import pytest
import torch

from tierkv.layout import KVLayout, LayerSlots


def test_layers_of_one_shape_need_no_layout() -> None:
    assert KVLayout.of([(2, 16)] * 5) is None
    assert KVLayout.of([(8, 128)]) is None


def test_layers_holding_no_kv_hold_no_slot() -> None:
    # KV sharing (Gemma 3n's, Gemma 4 E2B's last layers): a layout even where the others are of one shape.
    layout = KVLayout.of([(2, 16), (2, 16), None, None])
    assert layout is not None and layout.slots == 2 and (layout.heads, layout.dim) == (2, 16)
    assert [layout.holds(i) for i in range(4)] == [True, True, False, False]
    block = torch.randn(layout.slots, 2, 2, 8, 16)
    assert torch.equal(layout.join([layout.part(block, 1)], 1), block[1])
    with pytest.raises(ValueError, match="no layer holds KV"):
        KVLayout.of([None, None])


def test_slots_are_the_shapes_common_divisors_in_layer_order() -> None:
    # Gemma-4-like: sliding layers of 16 KV heads x 256, full-attention ones of 4 x 512 (keys as values).
    layout = KVLayout.of([(16, 256), (16, 256), (4, 512), (16, 256)])
    assert layout is not None and (layout.heads, layout.dim) == (4, 256)
    assert layout.layers == (LayerSlots(0, 4, 1), LayerSlots(4, 4, 1), LayerSlots(8, 1, 2), LayerSlots(10, 4, 1))
    assert layout.slots == 14
    assert [layout.shape(i) for i in range(4)] == [(16, 256), (16, 256), (4, 512), (16, 256)]
    odd = KVLayout.of([(2, 16), (1, 24)])
    assert odd is not None and (odd.heads, odd.dim, odd.slots) == (1, 8, 4 + 3)


def _layers(shapes: list[tuple[int, int] | None], tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(0) if shape is None else torch.randn(2, shape[0], tokens, shape[1], generator=g)
            for shape in shapes]


@pytest.mark.parametrize("shapes", [
    [(2, 16), (1, 32)], [(2, 16), (4, 16), (2, 16)], [(2, 16), (1, 24), (3, 8)], [(4, 256), (2, 512), (4, 256)],
    [(2, 16), (1, 32), None],
])
def test_a_block_gives_back_each_layers_keys_and_values(shapes: list[tuple[int, int]]) -> None:
    layout = KVLayout.of(shapes)
    assert layout is not None
    layers = _layers(shapes, 24, seed=1)
    # Three blocks of 8 tokens, each filled from a slice of the layers (a view with the layer's strides).
    blocks = []
    for start in range(0, 24, 8):
        block = torch.full((layout.slots, 2, layout.heads, 8, layout.dim), float("nan"))
        for i, kv in enumerate(layers):
            if layout.holds(i):
                layout.fill(block, i, kv[0, :, start:start + 8], kv[1, :, start:start + 8])
        assert not block.isnan().any()  # every slot written
        blocks.append(block)
    new = _layers(shapes, 3, seed=2)
    for i, kv in enumerate(layers):
        if not layout.holds(i):
            continue
        whole = layout.join([layout.part(b, i) for b in blocks], i)
        assert whole.is_contiguous() and torch.equal(whole, kv)
        # The last block restored in part, then the first forward's tokens.
        parts = [layout.part(blocks[0], i), layout.part(blocks[1], i), layout.part(blocks[2][:, :, :, :5], i)]
        joined = layout.join([*parts, layout.split(new[i], i)], i)
        assert joined.is_contiguous() and torch.equal(joined, torch.cat([kv[:, :, :21], new[i]], dim=2))


def test_random_shapes_round_trip() -> None:
    rng = random.Random(7)
    for case in range(50):
        shapes = [(rng.choice([1, 2, 3, 4, 6]), rng.choice([8, 16, 24, 32, 48])) for _ in range(rng.randint(2, 6))]
        layout = KVLayout.of(shapes)
        if layout is None:
            assert len(set(shapes)) == 1
            continue
        tokens = rng.randint(1, 9)
        layers = _layers(shapes, tokens, seed=case)
        block = torch.empty((layout.slots, 2, layout.heads, tokens, layout.dim))
        for i, kv in enumerate(layers):
            layout.fill(block, i, kv[0], kv[1])
        for i, kv in enumerate(layers):
            assert torch.equal(layout.join([layout.part(block, i)], i), kv), (shapes, i)


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
    shapes = [(2, 16), (1, 32), None, (2, 16)]
    layout = KVLayout.of(shapes)
    assert layout is not None and [s.first + s.count - 1 for s in layout.layers] == [1, 3, 3, 5]
    layers = _layers(shapes, 13, seed=3)
    blocks = [torch.empty((layout.slots, 2, layout.heads, 8, layout.dim)) for _ in range(2)]
    for j, block in enumerate(blocks):
        for i, kv in enumerate(layers):
            if layout.holds(i):
                layout.fill(block[:, :, :, :min(8, 13 - 8 * j)], i, kv[0, :, 8 * j:8 * j + 8], kv[1, :, 8 * j:8 * j + 8])
    restore = _Restore([(Landed(blocks[0]), 8), (Landed(blocks[1]), 5)], None, layout)
    for i in (3, 1, 0):
        waited.clear()
        joined = restore.join(i, restore.layer_parts(i))
        assert torch.equal(joined, layers[i]) and joined.is_contiguous()
        assert waited == [layout.layers[i].first + layout.layers[i].count - 1] * 2


def test_a_disk_restore_lays_each_layer_out_in_its_own_shape() -> None:
    """``restore_slots`` with a layout: a tensor per layer of its own KV heads and head_dim (none
    for a layer holding no KV), from its window's cut, and each slot's keys and values one piece
    of the payload's rows, in their order; a block of another layout refused."""
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
    assert [tuple(part.shape) for part in made.layers[:2]] == [(2, 2, 10, 8), (2, 1, 6, 16)]
    assert [row for row, _ in pieces] == list(range(8)) and all(part.shape == (1, 4, 32) for _, part in pieces)
    for row, part in pieces:
        part[...] = row
    # The payload's rows: slot s's keys at 2s, its values at 2s + 1; layer 0's heads are slots 0 and
    # 1, layer 1's two halves of head_dim slots 2 and 3.
    k0, v0 = made.layers[0][:, :, 4:8].contiguous().view(torch.uint8)[..., 0]
    assert (k0 == torch.tensor([0, 2])[:, None]).all() and (v0 == torch.tensor([1, 3])[:, None]).all()
    k1 = made.layers[1][0, 0, 0:4].contiguous().view(torch.uint8).reshape(4, 2, 32)[..., 0]
    v1 = made.layers[1][1, 0, 0:4].contiguous().view(torch.uint8).reshape(4, 2, 32)[..., 0]
    assert (k1 == torch.tensor([4, 6])).all() and (v1 == torch.tensor([5, 7])).all()
    # A block before layer 1's cut lands in layer 0's slots alone.
    assert [row for row, _ in restore_slots(buffer, 10, 0, 4, Header(), [0, 4, 0], layout)] == [0, 1, 2, 3]
    with pytest.raises(CorruptRecord, match="restored for a model whose blocks hold 4 slots of 1 KV heads x head_dim 8"):
        class Other:
            shape, dtype = (4, 2, 2, 4, 4), "float32"

        restore_slots([], 10, 0, 4, Other(), [0, 4, 0], layout)


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
