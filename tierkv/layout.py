"""Where each layer's keys and values lie in a block, for models whose layers hold KV of other
shapes: per layer (Gemma 4: head_dim 512 in its full-attention layers, 256 in its sliding ones),
or keys and values of other shapes (multi-head latent attention: DeepSeek-V2/V3, Kimi K2, GLM-4.7-
Flash..., whose cache holds a compressed latent of ``kv_lora_rank`` as its keys and rotary keys
of ``qk_rope_head_dim`` as its values, one head each).

A block is one tensor ``(slots, 2, heads, tokens, dim)`` whatever the model: the codec, the tiers
and the moves never look inside it. Where every layer's keys and values are ``(H, T, D)``, a slot
is a layer (``KVLayout.of`` returns None, and nothing here runs). Otherwise a block is a row of
``2 * slots`` units (a slot's two halves) of ``(H0, T, D0)``, the greatest common divisors of the
layers' KV heads and of their head dims, keys' and values' alike. Keys of ``H = h * H0`` heads and
``D = d * D0`` dims take ``h * d`` units (``Units``): unit ``first + step * (g * d + p)`` holds
heads ``[g * H0, (g + 1) * H0)`` and dims ``[p * D0, (p + 1) * D0)``; so do values. Layers hold
consecutive units in layer order. A layer whose keys and values are of one shape interleaves them
(``step`` 2: a keys' unit, then a values' one, so that a slot holds its keys' half and its values',
as a layer of one slot does, where the units before it are even); otherwise its keys' units come
first, then its values' (``step`` 1), and an odd count of units in all leaves the last slot's values
half unused (zeroed: ``empty``). A layer that holds no KV (one reading an earlier
layer's: Gemma 3n's and Gemma 4's KV sharing, a "dummy" layer in transformers' caches) holds no
unit.

Protocol: ``part(block, i)`` is layer ``i``'s part of a block (or of its first ``n`` tokens), a
pair of views ``(h, H0, T, d, D0)``, keys then values; ``join(parts, i)`` concatenates such pairs
(and the layer's new keys and values, viewed so by ``split``) along the tokens into the layer's
contiguous ``(1, H, N, D)`` keys and values, those a ``DynamicCache`` would hold; ``fill(block, i,
keys, values)`` writes a layer's ``(H, T, D)`` keys and values into a block made by ``empty``.
Pure: views and copies of tensors, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: A layer's keys' and values' (KV heads, head_dim), or one pair for both.
Shape = tuple[int, int] | tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Units:
    """A layer's keys' (or values') units of a block: ``heads * parts`` of them, ``step`` apart from
    ``first`` on."""

    first: int
    step: int
    heads: int
    parts: int

    @property
    def count(self) -> int:
        return self.heads * self.parts

    @property
    def last(self) -> int:
        return self.first + self.step * (self.count - 1)


@dataclass(frozen=True, slots=True)
class LayerUnits:
    """Layer ``i``'s keys' and values' units."""

    keys: Units
    values: Units

    @property
    def last_slot(self) -> int:
        """The slot holding the layer's last unit: a block's slots are copied in order."""
        return max(self.keys.last, self.values.last) // 2


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The unit shape ``(heads, dim)``, each layer's units (None: a layer holding no KV), and the
    ``units`` the layers hold in all."""

    heads: int
    dim: int
    layers: tuple[LayerUnits | None, ...]
    units: int

    @property
    def slots(self) -> int:
        """A block's slots: two units each."""
        return (self.units + 1) // 2

    @classmethod
    def of(cls, shapes: list[Shape | None]) -> KVLayout | None:
        """The layout of layers whose keys and values are ``(heads, head_dim)`` each, or ``(key heads,
        key head_dim, value heads, value head_dim)`` (None: a layer holding no KV), or None where
        they all hold keys and values of one shape (one slot a layer: a block as tierkv always laid
        it out)."""
        full = [None if shape is None else (*shape, *shape) if len(shape) == 2 else tuple(shape) for shape in shapes]
        held = [shape for shape in full if shape is not None]
        if not held:
            raise ValueError("no layer holds KV")
        if len(set(held)) < 2 and len(held) == len(full) and held[0][:2] == held[0][2:]:
            return None
        heads = math.gcd(*[shape[0] for shape in held], *[shape[2] for shape in held])
        dim = math.gcd(*[shape[1] for shape in held], *[shape[3] for shape in held])
        layers: list[LayerUnits | None] = []
        unit = 0
        for shape in full:
            if shape is None:
                layers.append(None)
                continue
            kh, kd, vh, vd = shape[0] // heads, shape[1] // dim, shape[2] // heads, shape[3] // dim
            if (kh, kd) == (vh, vd):
                layers.append(LayerUnits(Units(unit, 2, kh, kd), Units(unit + 1, 2, vh, vd)))
                unit += 2 * kh * kd
            else:
                layers.append(LayerUnits(Units(unit, 1, kh, kd), Units(unit + kh * kd, 1, vh, vd)))
                unit += kh * kd + vh * vd
        return cls(heads, dim, tuple(layers), unit)

    def holds(self, i: int) -> bool:
        """Whether layer ``i`` holds KV."""
        return self.layers[i] is not None

    def shape(self, i: int) -> tuple[int, int, int, int]:
        """Layer ``i``'s keys' (KV heads, head_dim), then its values'."""
        layer = self.layers[i]
        assert layer is not None, f"layer {i} holds no KV"
        keys, values = layer.keys, layer.values
        return keys.heads * self.heads, keys.parts * self.dim, values.heads * self.heads, values.parts * self.dim

    def empty(self, tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A block for ``tokens`` tokens, to ``fill``; the unit no layer holds (an odd count of
        units) zeroed, so that no stored record carries stale memory."""
        block = torch.empty((self.slots, 2, self.heads, tokens, self.dim), dtype=dtype, device=device)
        if self.units % 2:
            block[-1, 1].zero_()
        return block

    def _units(self, block: torch.Tensor, units: Units) -> torch.Tensor:
        # One as_strided, not a view, a stepped slice, a view and a permute: a restore takes each
        # layer's part of each block, and those eight dispatches a layer made a Gemma-4-like
        # restore's parts 17-26 us a block and layer, 7 before keys and values lay apart (h122).
        # Units lie ``stride(1)`` apart in a block ``empty`` made, or one cut to its first tokens.
        slot, half, head, token, dim = block.stride()
        if slot != 2 * half and block.shape[0] > 1:
            raise ValueError(f"a block of strides {block.stride()}: its slots' halves do not lie one after another")
        return block.as_strided((units.heads, self.heads, block.shape[3], units.parts, self.dim),
                                (units.step * units.parts * half, head, token, units.step * half, dim),
                                block.storage_offset() + units.first * half)

    def part(self, block: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values in ``block`` ``(slots, 2, H0, T, D0)``, views ``(h, H0, T, d, D0)``."""
        layer = self.layers[i]
        assert layer is not None, f"layer {i} holds no KV"
        return self._units(block, layer.keys), self._units(block, layer.values)

    def split(self, kv: torch.Tensor, i: int, values: bool, view: bool = False) -> torch.Tensor:
        """A layer's ``(..., H, T, D)`` keys (or ``values``) as ``(..., h, H0, T, d, D0)``: a view of
        a layer's tokens (of any slice of them). A copy where the strides allow no view, unless
        ``view`` (a destination: an error rather than writes into a copy)."""
        layer = self.layers[i]
        assert layer is not None, f"layer {i} holds no KV"
        units = layer.values if values else layer.keys
        *lead, _, tokens, _ = kv.shape
        shape = (*lead, units.heads, self.heads, tokens, units.parts, self.dim)
        return kv.view(shape) if view else kv.reshape(shape)

    def join(self, parts: list[tuple[torch.Tensor, torch.Tensor]], i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s parts (``part`` or ``split`` views), concatenated along the tokens into
        contiguous ``(1, H, N, D)`` keys and values."""
        kh, kd, vh, vd = self.shape(i)
        keys = torch.cat([part[0] for part in parts], dim=2)
        values = torch.cat([part[1] for part in parts], dim=2)
        return keys.view(1, kh, keys.shape[2], kd), values.view(1, vh, values.shape[2], vd)

    def fill(self, block: torch.Tensor, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write layer ``i``'s keys and values ``(H, T, D)`` into its units of ``block``."""
        into_keys, into_values = self.part(block, i)
        into_keys.copy_(self.split(keys, i, False))
        into_values.copy_(self.split(values, i, True))
