"""The tokens a sliding-window layer no longer attends over, kept off its device until ``commit``.

A sliding layer's attention reads its window alone, yet ``commit`` stores every token's KV of every
layer: a later turn may restore any prefix of the conversation, and a prefix's window is its own
last tokens. Held in the layer until the commit, a reply longer than the window stayed whole on
the device in every sliding layer (GPT-OSS's 128-token windows kept a reasoning reply of 10,000
tokens whole in half its layers, where a ``DynamicCache`` of its layer types keeps 128). A
``TieredSlidingLayer`` hands those tokens here as it goes, a margin of them at a time, and keeps
its window and a margin on the device.

Protocol: ``add(at, keys, values)`` takes tokens ``[at, at + n)`` of row 0, as (1, H, n, D) keys and
values (their own shapes), the next after those held (``at == end``) or earlier: the tokens held
from ``at`` on are then dropped first (an add whose caller was cut short before it moved its own
offset, by another signal's handler raising, is made again, never held twice). On CUDA they are
copied into pinned host memory on the current stream, with no host sync, each chunk's copy
marked by an event; on a CPU they are copied into tensors of their own, so that the room they
were views of is freed. ``span(start, stop, device)`` returns tokens ``[start, stop)`` (within
``[start, end)``) as (1, H, n, D) keys and values on ``device``, copied back after their events on
the current stream; ``clear()`` lets go of them all. The held tokens are
one row's: a layer adds only while it holds one row, so rows it is expanded to later (beams) all
share them.
"""

from __future__ import annotations

import torch


class StagedTokens:
    """One layer's tokens ``[start, end)``, in chunks held in host memory."""

    __slots__ = ("_chunks", "start", "end")

    def __init__(self) -> None:
        # (first token, tokens, keys, values, the CUDA event its copy recorded or None), in token
        # order. A chunk's tensors may hold more tokens than it counts (an add made again cut it):
        # never sliced on the host, where a read could come before its copy off the device landed.
        self._chunks: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self.start = self.end = 0

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def add(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self._chunks and not self.start <= at <= self.end:
            raise ValueError(f"tokens from {at} on staged after tokens {self.start} to {self.end}")
        host_keys, host_values, event = _off_device(keys), _off_device(values), None
        if keys.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(keys.device))
        kept = self._kept_below(at)
        chunks = kept + [(at, keys.shape[-2], host_keys, host_values, event)]
        # One statement: a handler's exception between an append and the end's move left the chunk
        # held with the end short of it, and the add made again held its tokens twice.
        self._chunks, self.start, self.end = chunks, self.start if kept else at, at + keys.shape[-2]

    def _kept_below(self, at: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.cuda.Event | None]]:
        """The chunks before token ``at``, cut to end there; ``self`` left as it is."""
        return [(first, min(n, at - first), k, v, event) for first, n, k, v, event in self._chunks if first < at]

    def span(self, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[start, stop)`` on ``device``, one tensor each for keys and values."""
        if not self.start <= start <= stop <= self.end:
            raise ValueError(f"tokens {start} to {stop} asked of tokens {self.start} to {self.end} staged")
        if start == stop and self._chunks:
            # None: asked by a layer whose add ran but whose offset had not moved yet (out of memory
            # for its new room, a handler's exception), which holds those tokens on the device too.
            _, _, k, v, _ = self._chunks[0]
            return (torch.empty((*k.shape[:2], 0, k.shape[3]), dtype=k.dtype, device=device),
                    torch.empty((*v.shape[:2], 0, v.shape[3]), dtype=v.dtype, device=device))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for first, n, k, v, event in self._chunks:
            if first + n <= start or first >= stop:
                continue
            lo, hi = max(start, first) - first, min(stop, first + n) - first
            # Whole chunks copied, then cut on the device (see _chunks).
            keys.append(_on_device(k, device, event)[:, :, lo:hi])
            values.append(_on_device(v, device, event)[:, :, lo:hi])
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def clear(self) -> None:
        self._chunks = []
        self.start = self.end = 0


def _off_device(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cuda":
        # A copy of its own: a view would keep the whole room it came from alive.
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    source = tensor.detach()
    # The room may have been allocated under another stream than this copy's (a turn run inside a
    # `with torch.cuda.stream(...)` of the program's own): freed once the layer lets go of it, it
    # is not handed out again until this stream's work so far, the copy among it, is done.
    source.record_stream(torch.cuda.current_stream(tensor.device))
    host.copy_(source, non_blocking=True)
    return host


def _on_device(tensor: torch.Tensor, device: torch.device, event: torch.cuda.Event | None) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    if event is not None:
        # The copy off the device may have run on another stream than the one reading it back.
        torch.cuda.current_stream(device).wait_event(event)
    # Contiguous pinned memory: copied by the device, after that wait, never read by the host.
    return tensor.to(device, non_blocking=True)
