"""The weights behind a model's fingerprint: a digest of every byte (``digest_weights``), and the
cheap sample, read on every ``store.open``, that says when to compute it again.

Two model objects whose weights differ anywhere have different digests; a sample of 16 values
per parameter alone let a fine-tune of a few embedding rows share its base model's KV. The
digest reads every weight once per model object (a host copy, slice by slice, for weights on a
device), and again when the sample's values or the parameters' version counters (``versions``)
moved. A write through ``p.data`` bumps no counter and is seen only where it changes a sampled
value.

Protocol: ``WeightSample(model)`` fixes, once per model object, which parameters there are and
which elements of each are read (16 evenly spread ones). ``sample.current(model)`` says whether
that still holds: the same ``Parameter`` objects in the same places of the module tree, each with
the same storage address, dtype, shape and strides. ``sample.read()`` returns the sampled values, as
float64 bytes in ``model.parameters()`` order, and reads them afresh on every call, so that
in-place writes (``load_state_dict``, ``p.data`` writes, training steps) change the fingerprint at
once. A caller rebuilds the sample when ``current`` is False, and never reads one that is not.

Reading is the cost that matters, as it is paid on every open: one ``torch.take`` per parameter
is a few microseconds of dispatch each, hundreds of microseconds for a real model against a turn
of a few milliseconds. When every parameter is a plain strided CPU tensor in a float dtype numpy
can read, with its sampled elements inside its own storage, the sample points are read by
address, all of them with one numpy gather per dtype. The addresses are those of the storages
``current`` checked. Elsewhere (CUDA, quantised dtypes, tensor subclasses, freed storages,
negative views) one ``take`` per parameter reads them, as it does when a sampled value is NaN
(numpy and torch widen a float16 NaN to different bits). Both give the same bytes, so a store's
blocks keep their fingerprint whichever path read it.

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

# numpy reads these as they are; bfloat16 is read as its 16 bits, the top half of a float32.
_NUMPY_DTYPES: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float64: np.float64,
                                         torch.float16: np.float16, torch.bfloat16: np.uint16}


def sample_index(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Evenly spread positions in ``[0, numel)``, in integers: a float32 linspace rounds the last
    position of a parameter over 2**24 elements (any real embedding) past its end."""
    count = min(SAMPLES_PER_PARAM, numel)
    if count == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return torch.arange(count, dtype=torch.int64, device=device) * (numel - 1) // (count - 1)


def _tree(model: torch.nn.Module) -> list[Any]:
    """Every module's parameter slots, depth first: the same list means the same parameters in
    the same places. Holds parameters only, never modules, so no reference cycle keeps a model."""
    slots: list[Any] = []
    stack: list[Any] = [model]
    pop, descend, add = stack.pop, stack.extend, slots.extend
    while stack:
        module = pop()
        if module is not None:  # a submodule slot set to None
            add(module._parameters.values())
            descend(module._modules.values())
    return slots


def _storage_key(params: tuple[torch.nn.Parameter, ...]) -> list[tuple[Any, ...]]:
    # Strides too: a square weight transposed in place (p.data = p.data.t()) keeps its address,
    # dtype and shape, and the same bytes then hold other logical elements.
    return [(p.data_ptr(), p.dtype, p.shape, p.stride()) for p in params]


def _readable_by_address(p: torch.nn.Parameter) -> bool:
    """A plain strided CPU tensor with storage of its own, whose sampled elements all lie inside
    it: anything else (tensor subclasses, storages freed to 0 bytes, negative views, meta or
    CUDA tensors, dtypes numpy cannot read) is read by ``take``, which raises where it must."""
    data = p.data
    if type(data) is not torch.Tensor or data.layout is not torch.strided or data.device.type != "cpu" \
            or data.dtype not in _NUMPY_DTYPES or data.is_neg() or data.is_conj():
        return False
    if data.numel() == 0:
        return True
    if data.data_ptr() == 0:
        return False
    last = sum((n - 1) * st for n, st in zip(data.shape, data.stride()))
    end = (data.storage_offset() + last + 1) * data.element_size()
    return min(data.stride(), default=0) >= 0 and end <= data.untyped_storage().nbytes()


class _HostGather:
    """The sample points of CPU parameters as byte offsets into one view of the address space
    their storages span; reading them is one numpy gather per dtype."""

    def __init__(self, params: tuple[torch.nn.Parameter, ...], index: tuple[torch.Tensor, ...]) -> None:
        starts: list[np.ndarray] = []
        for p, idx in zip(params, index):
            flat = idx.numpy()
            # Element offsets of the logical (row-major) positions ``take`` reads, under any strides.
            elements = np.zeros_like(flat)
            for coord, stride in zip(np.unravel_index(flat, tuple(p.shape)) if p.dim() else (), p.stride()):
                elements += coord * stride
            starts.append(p.data_ptr() + elements * p.element_size())
        self.count = sum(len(s) for s in starts)
        used = [s for s in starts if len(s)]
        lo = min(int(s.min()) for s in used) if used else 0
        hi = max(int(s.max()) for s in used) + 8 if used else 1  # 8: the widest item read
        # Only the sampled bytes of this view are ever touched; the span between storages is not.
        self._memory = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
        self._groups: list[tuple[np.ndarray, np.ndarray, torch.dtype]] = []
        position = 0
        by_dtype: dict[torch.dtype, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for s, p in zip(starts, params):
            where, at = by_dtype.setdefault(p.dtype, ([], []))
            where.append((s - lo)[:, None] + np.arange(p.dtype.itemsize))
            at.append(np.arange(position, position + len(s)))
            position += len(s)
        for dtype, (where, at) in by_dtype.items():
            self._groups.append((np.concatenate(where), np.concatenate(at), dtype))

    def read(self) -> np.ndarray:
        out = np.empty(self.count, dtype=np.float64)
        for where, at, dtype in self._groups:
            raw = self._memory[where]  # (n, itemsize) bytes
            if dtype is torch.bfloat16:
                values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                values = raw.view(_NUMPY_DTYPES[dtype])
            out[at] = values.reshape(-1)
        return out


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
    with torch.no_grad():
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
        self.params = tuple(model.parameters())
        self._tree = _tree(model)
        self._key = _storage_key(self.params)
        self.index = tuple(sample_index(p.numel(), p.device) for p in self.params)
        host = bool(self.params) and all(map(_readable_by_address, self.params))
        self._host = _HostGather(self.params, self.index) if host else None

    def hold(self) -> list[Any] | None:
        """The storages ``read`` reads by address, to keep alive from before ``current`` until
        after ``read`` (None where ``read`` reads through torch, which holds them itself)."""
        return None if self._host is None else [p.untyped_storage() for p in self.params]

    def current(self, model: torch.nn.Module) -> bool:
        """The model still has these parameters, in these places, at these addresses."""
        tree = _tree(model)
        return (len(tree) == len(self._tree) and all(map(operator.is_, tree, self._tree))
                and _storage_key(self.params) == self._key)

    def read(self) -> bytes:
        """The sampled values, as float64 bytes in parameter order."""
        if self._host is not None:
            values = self._host.read()
            # numpy widens a float16 NaN keeping its payload bits, torch quietens it: bytes
            # would differ from the ones stores were keyed with. A NaN weight is rare: let torch.
            if not np.isnan(values).any():
                return values.tobytes()
        return self.read_with_torch()

    def read_with_torch(self) -> bytes:
        """The same bytes, one ``take`` per parameter on its own device."""
        device = self.params[0].device
        with torch.no_grad():
            samples = torch.cat([torch.take(p.detach(), idx).to(device=device)
                                 for p, idx in zip(self.params, self.index)])
        return samples.to(dtype=torch.float64).cpu().numpy().tobytes()
