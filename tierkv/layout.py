"""Where each layer's keys and values lie in a block, for models whose layers hold KV of other
shapes (Gemma 4: head_dim 512 in its full-attention layers, 256 in its sliding ones).

A block is one tensor ``(slots, 2, heads, tokens, dim)`` whatever the model: the codec, the tiers
and the moves never look inside it. Where every layer's keys and values are ``(H, T, D)``, a slot
is a layer (``KVLayout.of`` returns None, and nothing here runs). Otherwise a slot is
``(H0, D0)``, the greatest common divisor of the layers' KV heads and of their head dims, and a
layer of ``H = h * H0`` heads and ``D = d * D0`` holds ``h * d`` consecutive slots: slot
``first + g * d + p`` holds heads ``[g * H0, (g + 1) * H0)`` and dims ``[p * D0, (p + 1) * D0)``.
Keys and values keep their own halves of every slot, as in a layer of one slot. A layer that holds
no KV (one reading an earlier layer's: Gemma 3n's and Gemma 4's KV sharing, a "dummy" layer in
transformers' caches) holds no slot.

Protocol: ``part(block, i)`` is layer ``i``'s part of a block (or of its first ``n`` tokens),
a view of shape ``(2, h, H0, T, d, D0)``; ``join(parts, i)`` concatenates such parts (and the
layer's new keys and values, viewed so by ``split``) along the tokens into the layer's contiguous
``(2, H, N, D)``, the keys and values a ``DynamicCache`` would hold; ``fill(block, i, keys,
values)`` writes a layer's ``(H, T, D)`` keys and values into a new block. Pure: views and
copies of tensors, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerSlots:
    """Layer ``i``'s slots in a block: ``heads * parts`` of them from ``first`` on (none for a
    layer that holds no KV)."""

    first: int
    heads: int
    parts: int

    @property
    def count(self) -> int:
        return self.heads * self.parts


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The slot shape ``(heads, dim)`` and each layer's slots, ``slots`` in all."""

    heads: int
    dim: int
    layers: tuple[LayerSlots, ...]
    slots: int

    @classmethod
    def of(cls, shapes: list[tuple[int, int] | None]) -> KVLayout | None:
        """The layout of layers whose keys and values are ``(heads, head_dim)`` each (None: a layer
        holding no KV), or None where they all hold KV of one shape (one slot a layer: a block as
        tierkv always laid it out)."""
        held = [shape for shape in shapes if shape is not None]
        if not held:
            raise ValueError("no layer holds KV")
        if len(set(held)) < 2 and len(held) == len(shapes):
            return None
        heads = math.gcd(*[h for h, _ in held])
        dim = math.gcd(*[d for _, d in held])
        layers, first = [], 0
        for shape in shapes:
            layers.append(LayerSlots(first, 0, 0) if shape is None else LayerSlots(first, shape[0] // heads,
                                                                                  shape[1] // dim))
            first += layers[-1].count
        return cls(heads, dim, tuple(layers), first)

    def holds(self, i: int) -> bool:
        """Whether layer ``i`` holds KV."""
        return self.layers[i].count > 0

    def shape(self, i: int) -> tuple[int, int]:
        """Layer ``i``'s (KV heads, head_dim)."""
        layer = self.layers[i]
        return layer.heads * self.heads, layer.parts * self.dim

    def part(self, block: torch.Tensor, i: int) -> torch.Tensor:
        """Layer ``i``'s part of ``block`` ``(slots, 2, H0, T, D0)``, a view ``(2, h, H0, T, d, D0)``."""
        layer = self.layers[i]
        slots = block[layer.first:layer.first + layer.count]
        return slots.view(layer.heads, layer.parts, *slots.shape[1:]).permute(2, 0, 3, 4, 1, 5)

    def split(self, kv: torch.Tensor, i: int, view: bool = False) -> torch.Tensor:
        """A layer's ``(2, H, T, D)`` (or ``(H, T, D)``) keys and values as ``(2, h, H0, T, d, D0)``
        (or without the leading 2): a view of a layer's tokens (of any slice of them). A copy
        where the strides allow no view, unless ``view`` (a destination: an error rather than
        writes into a copy)."""
        layer = self.layers[i]
        *lead, _, tokens, _ = kv.shape
        shape = (*lead, layer.heads, self.heads, tokens, layer.parts, self.dim)
        return kv.view(shape) if view else kv.reshape(shape)

    def join(self, parts: list[torch.Tensor], i: int) -> torch.Tensor:
        """Layer ``i``'s parts (``part`` or ``split`` views), concatenated along the tokens into one
        contiguous ``(2, H, N, D)`` tensor."""
        joined = torch.cat(parts, dim=3)
        heads, dim = self.shape(i)
        return joined.view(joined.shape[0], heads, joined.shape[3], dim)

    def fill(self, block: torch.Tensor, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write layer ``i``'s keys and values ``(H, T, D)`` into its slots of ``block``."""
        part = self.part(block, i)
        part[0].copy_(self.split(keys, i))
        part[1].copy_(self.split(values, i))
