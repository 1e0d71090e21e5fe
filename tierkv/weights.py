"""The weights behind a model's fingerprint: a digest of every byte (``digest_weights``), and the
cheap sample, read on every ``store.open``, that says when to compute it again.

Two model objects whose weights differ anywhere have different digests; a sample of 16 values
per parameter alone let a fine-tune of a few embedding rows share its base model's KV. The
digest reads every weight once per model object (a host copy, slice by slice, for weights on a
device), and again when the sample's values or the parameters' version counters (``versions``)
moved. A write through ``p.data`` bumps no counter and is seen only where it changes a sampled
value.

Protocol: ``WeightSample(model)`` fixes, once per model object, which parameters (and persistent
buffers, ``persistent_buffers``) there are and which elements of each are read (16 evenly spread
ones). ``sample.current(model, volatile)`` says whether that still holds: the same tensors in the
same places of the module tree, each with the same storage address, dtype, shape and strides; it
hands the RoPE frequency buffers it walked past (``is_frequency_buffer``) to ``volatile``, whose
values ``BufferDigests`` digests (they are not weights, and dynamic RoPE reassigns them). ``sample.read()`` returns the
sampled elements' bits (see below), read afresh on every call, so that in-place writes
(``load_state_dict``, ``p.data`` writes, training steps) change the fingerprint at once. A caller
rebuilds the sample when ``current`` is False, and never reads one that is not.

Reading is the cost that matters, as it is paid on every open: one ``torch.take`` per parameter
is a few microseconds of dispatch each, hundreds of microseconds for a real model against a turn
of a few milliseconds. When every parameter is a plain strided CPU tensor with its sampled
elements inside its own storage, the sample points are read by address, all of them with one
numpy gather per element size. The addresses are those of the storages ``current`` checked.
Elsewhere (CUDA, quantised dtypes, 16-byte elements, unaligned or negative views, tensor
subclasses, freed storages) one ``take`` per parameter reads them. Both read the elements' bits
as they are (no conversion, so a NaN's payload is kept), grouped by element size and in
parameter order within a group, and give the same bytes: a sample rebuilt on the other path does
not look like a change.

A caller holds ``sample.hold()`` (the parameters' storages) from before ``current`` until after
``read``: a parameter whose storage another thread replaces (``p.data = ...``) in between is then
read at its old address, still mapped (it was freed there, and the read crashed the process). Its
fingerprint is then the old weights', as with any weight change racing a forward pass; the
caller must not change weights while a turn is being opened. A storage replaced before ``hold``
or during ``current`` fails ``current``. Nothing is held between calls, so a model cast or moved
(``model.half()``, ``model.to(...)``) frees its old weights at once.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any

import numpy as np
import torch
import xxhash

SAMPLES_PER_PARAM = 16

# Unsigned integers of each element size: the views the sampled elements' bits are read through.
_UINT: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def sample_index(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Evenly spread positions in ``[0, numel)``, in integers: a float32 linspace rounds the last
    position of a parameter over 2**24 elements (any real embedding) past its end."""
    count = min(SAMPLES_PER_PARAM, numel)
    if count == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return torch.arange(count, dtype=torch.int64, device=device) * (numel - 1) // (count - 1)


#: The non-persistent buffers whose values the fingerprint covers: RoPE's frequencies, which every
#: rotary module (transformers' and remote code's) keeps under these names, or under a layer
#: type's prefix (``full_attention_inv_freq``: Mellum, Laguna, Olmo3, Gemma3; any name ending in
#: ``inv_freq``, ``FREQUENCY_SUFFIX``); GPT-J's and CodeGen's sin/cos table (``embed_positions``)
#: and Gemma's embedding scale (``embed_scale``). They compute the KV, yet ``state_dict`` does not
#: save them, and their dtype follows how the model was made: a model loaded in bf16 keeps them in
#: float32, the same weights cast with ``.to(torch.bfloat16)`` cast them too, and the two compute
#: other keys (CodeGen and Mellum then generate other tokens from a restore of the other's KV).
#: Not the others: some forwards rewrite theirs (CTRL casts its position table to the embeddings'
#: dtype, XGLM grows its own past the sequence length), and digesting those changed the
#: fingerprint between open and commit of an ordinary turn.
FREQUENCY_BUFFERS = frozenset({"inv_freq", "original_inv_freq", "embed_positions", "embed_scale"})
FREQUENCY_SUFFIX = "inv_freq"


def is_frequency_buffer(name: str) -> bool:
    """Whether a non-persistent buffer of this name is one the fingerprint digests (``FREQUENCY_BUFFERS``)."""
    return name in FREQUENCY_BUFFERS or name.endswith(FREQUENCY_SUFFIX)


def _tree(model: torch.nn.Module, volatile: list[torch.Tensor] | None = None) -> list[Any]:
    """Every module's parameter and persistent buffer slots, depth first: the same list means the
    same tensors in the same places. Holds tensors only, never modules, so no reference cycle keeps
    a model. The non-persistent ``FREQUENCY_BUFFERS`` met on the way go to ``volatile``, in order."""
    slots: list[Any] = []
    stack: list[Any] = [model]
    pop, descend, add = stack.pop, stack.extend, slots.extend
    while stack:
        module = pop()
        if module is not None:  # a submodule slot set to None
            add(module._parameters.values())
            buffers = module._buffers
            if buffers:
                skip = module._non_persistent_buffers_set
                add([b for name, b in buffers.items() if name not in skip])
                if skip and volatile is not None:
                    volatile.extend(b for name, b in buffers.items()
                                    if name in skip and b is not None and is_frequency_buffer(name))
            descend(module._modules.values())
    return slots


class BufferDigests:
    """Digests of a model's RoPE frequencies (``FREQUENCY_BUFFERS``), taken from their values.

    They follow from the config, yet they compute the KV: a rotary module swapped for one of
    another scaling, or ``inv_freq`` edited in place, changes every key while no weight moved.
    Dynamic RoPE reassigns them in its forwards (callers leave those models out), so they are not
    part of the sample's tree, whose change would digest every weight again: their values are
    digested instead, once per tensor object and version counter (a write through ``.data`` is
    seen at the next reassignment only; a tensor without a counter, made under inference mode, on
    every call: a few floats)."""

    def __init__(self) -> None:
        self._memo: tuple[tuple[torch.Tensor, ...], tuple[int, ...] | None, bytes] | None = None

    def digest(self, buffers: list[torch.Tensor]) -> bytes:
        memo = self._memo  # replaced whole, never changed in place: threads describing one model share it
        counters = versions(tuple(buffers))
        # Without counters (inference tensors) the buffers are digested on every call.
        if memo is not None and counters is not None and memo[1] == counters \
                and all(map(operator.is_, memo[0], buffers)):
            return memo[2]
        digest = digest_weights(tuple(buffers))
        self._memo = (tuple(buffers), counters, digest)
        return digest


def persistent_buffers(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The buffers a ``state_dict`` saves: weights some layers keep outside their parameters
    (GPTQ's and AWQ's packed ``qweight``, BitNet's ternary weights, VeRA's shared projections).
    Non-persistent ones (RoPE's ``inv_freq``) follow from the config, and some forwards reassign
    them (dynamic RoPE): they are not weights, and a sample that followed them would be rebuilt."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    for module in model.modules():
        if module._buffers:
            skip = module._non_persistent_buffers_set
            for name, b in module._buffers.items():
                if b is not None and name not in skip and id(b) not in seen:
                    seen.add(id(b))
                    found.append(b)
    return tuple(found)


def _storage_key(params: tuple[torch.nn.Parameter, ...]) -> list[tuple[Any, ...]]:
    # Strides too: a square weight transposed in place (p.data = p.data.t()) keeps its address,
    # dtype and shape, and the same bytes then hold other logical elements.
    return [(p.data_ptr(), p.dtype, p.shape, p.stride()) for p in params]


def _readable_by_address(p: torch.nn.Parameter) -> bool:
    """A plain strided CPU tensor with storage of its own, whose sampled elements all lie inside
    it: anything else (tensor subclasses, storages freed to 0 bytes, negative views, meta or
    CUDA tensors, quantised dtypes, elements of 16 bytes or at unaligned addresses) is read by
    ``take``, which raises where it must."""
    data = p.data
    if type(data) is not torch.Tensor or data.layout is not torch.strided or data.device.type != "cpu" \
            or data.is_quantized or data.element_size() not in _UINT or data.is_neg() or data.is_conj():
        return False
    if data.numel() == 0:
        return True
    if data.data_ptr() == 0 or data.data_ptr() % data.element_size():
        return False
    last = sum((n - 1) * st for n, st in zip(data.shape, data.stride()))
    end = (data.storage_offset() + last + 1) * data.element_size()
    return min(data.stride(), default=0) >= 0 and end <= data.untyped_storage().nbytes()


class _HostGather:
    """The sample points of CPU parameters as element indices into views, one per element size, of
    the address space their storages span; reading them is one numpy gather per element size."""

    def __init__(self, params: tuple[torch.nn.Parameter, ...], index: tuple[torch.Tensor, ...]) -> None:
        by_size: dict[int, list[np.ndarray]] = {}
        for p, idx in zip(params, index):
            flat = idx.numpy()
            # Element offsets of the logical (row-major) positions ``take`` reads, under any strides.
            elements = np.zeros_like(flat)
            for coord, stride in zip(np.unravel_index(flat, tuple(p.shape)) if p.dim() else (), p.stride()):
                elements += coord * stride
            by_size.setdefault(p.element_size(), []).append(p.data_ptr() + elements * p.element_size())
        used = [a for starts in by_size.values() for a in starts if len(a)]
        lo = min(int(a.min()) for a in used) // 8 * 8 if used else 0
        hi = max(int(a.max()) for a in used) + 8 if used else 8  # 8: the widest element read
        # Only the sampled elements of these views are ever touched; the span between storages is not.
        span = (ctypes.c_uint8 * (hi - lo)).from_address(lo) if used else bytearray(8)
        self._groups = [(np.frombuffer(span, dtype=_UINT[size], count=(hi - lo) // size),
                         (np.concatenate(by_size[size]) - lo) // size) for size in sorted(by_size)]

    def read(self) -> bytes:
        return b"".join(memory[where].tobytes() for memory, where in self._groups)


def versions(params: tuple[torch.nn.Parameter, ...]) -> tuple[int, ...] | None:
    """The parameters' version counters, which every in-place torch write bumps (optimizer steps,
    ``load_state_dict``, ``copy_`` under ``no_grad``); None where one has none (inference tensors)."""
    try:
        return tuple(p._version for p in params)
    except RuntimeError:
        return None


# Host copies of device weights are hashed in slices of this many bytes, so a large embedding
# never needs a second full copy in host memory.
_DIGEST_SLICE = 64 << 20


def digest_weights(params: tuple[torch.nn.Parameter, ...]) -> bytes:
    """xxh3-128 over every byte of every parameter, in order, with its shape and dtype: two
    models whose weights differ anywhere differ here (the sample alone misses a change that
    avoids its points, such as a fine-tune of a few embedding rows). Weights on a device are
    copied to the host slice by slice; a tensor subclass that cannot be viewed as bytes (some
    quantised formats) is hashed through its sampled values instead."""
    h = xxhash.xxh3_128()
    # Every tensor detached, not read under torch.no_grad(): another signal's handler raising as
    # that block's exit began left autograd off in the caller's thread for good.
    for p in params:
        h.update(f"{tuple(p.shape)}:{p.dtype}:".encode())
        data = p.detach()
        try:
            flat = data.contiguous().reshape(-1).view(torch.uint8)
        except (RuntimeError, TypeError, NotImplementedError):
            h.update(torch.take(data, sample_index(data.numel(), data.device)).to(torch.float64).cpu()
                     .numpy().tobytes())
            continue
        if flat.device.type == "cpu":
            h.update(flat.numpy())
            continue
        for start in range(0, flat.numel(), _DIGEST_SLICE):
            h.update(flat[start:start + _DIGEST_SLICE].cpu().numpy())
    return h.digest()


class WeightSample:
    """Which weights of one model the fingerprint reads, and their current values."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Persistent buffers after the parameters: they are weights too (persistent_buffers).
        self.params = tuple(model.parameters()) + persistent_buffers(model)
        self._tree = _tree(model)
        self._key = _storage_key(self.params)
        self.index = tuple(sample_index(p.numel(), p.device) for p in self.params)
        host = bool(self.params) and all(map(_readable_by_address, self.params))
        self._host = _HostGather(self.params, self.index) if host else None

    def hold(self) -> list[Any] | None:
        """The storages ``read`` reads by address, to keep alive from before ``current`` until
        after ``read`` (None where ``read`` reads through torch, which holds them itself)."""
        return None if self._host is None else [p.untyped_storage() for p in self.params]

    def current(self, model: torch.nn.Module, volatile: list[torch.Tensor] | None = None) -> bool:
        """The model still has these parameters, in these places, at these addresses. Its RoPE
        frequency buffers, met on the same walk, go to ``volatile``."""
        tree = _tree(model, volatile)
        return (len(tree) == len(self._tree) and all(map(operator.is_, tree, self._tree))
                and _storage_key(self.params) == self._key)

    def read(self) -> bytes:
        """The sampled elements' bits: grouped by element size, in parameter order in each group."""
        if self._host is not None:
            return self._host.read()
        return self.read_with_torch()

    def read_with_torch(self) -> bytes:
        """The same bytes, one ``take`` per parameter on its own device."""
        device = self.params[0].device
        by_size: dict[int, list[torch.Tensor]] = {}
        for p, idx in zip(self.params, self.index):  # _taken_bits detaches: no grad mode switched
            by_size.setdefault(p.element_size(), []).append(_taken_bits(p, idx).to(device=device))
        return torch.cat([bits for size in sorted(by_size) for bits in by_size[size]]).cpu().numpy().tobytes()


# Integer dtypes of each element size, which ``take`` implements everywhere.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _taken_bits(p: torch.nn.Parameter, index: torch.Tensor) -> torch.Tensor:
    """The elements of ``p`` at ``index`` as their bytes. A plain tensor is read as integers of
    its element size: its bits as they lie in memory, as the CPU gather reads them, and in dtypes
    ``take`` lacks (float8, unsigned integers). A negative or conjugate view is read as its values,
    a tensor that cannot be viewed as bytes (a quantised or subclass dtype) as float64."""
    data = p.detach()
    same = _SAME_SIZE_INT.get(data.element_size())
    if same is not None and type(data) is torch.Tensor and not (data.is_quantized or data.is_neg() or data.is_conj()):
        data = data.view(same)
    taken = torch.take(data, index)
    try:
        return taken.view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError):
        return taken.to(torch.float64).view(torch.uint8)
