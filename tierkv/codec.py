"""The on-disk record of one block. Pure: bytes in, bytes out, no I/O.

Layout (little-endian)::

    b"TKVB" | u32 header_len | msgpack header | payload | u64 xxh3_64(all bytes before it)

The header carries the format version, the block's key and parent, tenant, model fingerprint,
dtype, shape, token ids and a commit sequence number, and, in a record that was given a minimum
length (``encode_array``'s ``min_bytes``), a ``pad`` of zeros that readers ignore. The payload
is the raw KV tensor bytes, shape ``(layers, 2, kv_heads, tokens, head_dim)`` with head_dim
innermost, so a reader maps it straight into a tensor (``decode`` returns a memoryview into the
caller's buffer, no copy).

``decode`` verifies everything and raises ``CorruptRecord`` (a ``ValueError``) with a reason (an
exception of another kind that lands in it, a signal handler's timeout, is raised as it is: never
damage);
``decode_header`` reads only the header. A record's *head* is its bytes up to the payload (magic,
length, header): the disk tier also stores it apart, and ``decode_head`` reads it there, so that
rebuilding an index never touches a payload.
No pickle, no torch: a record written by any version of tierkv can be rejected safely.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

#: A destination of several arrays: (the payload's first row each takes, the array), in row order.
Pieces = list[tuple[int, np.ndarray]]

FORMAT_VERSION = 1
MAGIC = b"TKVB"
_PREFIX = struct.Struct("<4sI")
_CHECKSUM = struct.Struct("<Q")

#: Bytes ``decode_into`` copies before it checksums them (see ``decode_into``): into a block's
#: own tensor, checksummed there; into a restore's buffer, spread over its layers' rows, checksummed
#: at the source.
CHECKSUM_RUN = 1 << 20
SPREAD_CHECKSUM_RUN = 256 << 10

#: Element sizes of the dtypes a KV cache may have; names are torch's without the prefix.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class CorruptRecord(ValueError):
    """A record that must not be served: bad magic, length, checksum, version or fields."""


@dataclass(slots=True, frozen=True)
class RecordHeader:
    key: bytes
    parent: bytes
    tenant: str | None
    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]
    token_ids: bytes  # little-endian int64, as hashing.token_bytes
    seq: int
    version: int = FORMAT_VERSION

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) // 8

    @property
    def payload_nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _pack_header(h: RecordHeader, pad: int = 0) -> bytes:
    fields = {
        "v": h.version,
        "key": h.key,
        "parent": h.parent,
        "tenant": h.tenant,
        "fp": h.fingerprint,
        "dtype": h.dtype,
        "shape": list(h.shape),
        "ids": h.token_ids,
        "seq": h.seq,
    }
    if pad:
        fields["pad"] = bytes(pad)
    return msgpack.packb(fields, use_bin_type=True)


def _packed_header(header: RecordHeader, min_bytes: int) -> bytes:
    """The msgpack header of a record of at least ``min_bytes``."""
    head = _pack_header(header)
    short = min_bytes - (_PREFIX.size + len(head) + header.payload_nbytes + _CHECKSUM.size)
    # The pad's own framing comes on top of its zeros: the record ends up a few bytes longer.
    return _pack_header(header, pad=short) if short > 0 else head


def encode_array(header: RecordHeader, payload: bytes | bytearray | memoryview,
                 out: np.ndarray | None = None, min_bytes: int = 0) -> np.ndarray:
    """Serialize one record into a uint8 array: ``out`` (a reused scratch buffer, returned sliced
    to the record) when it is large enough, else a new one. ``payload`` must be
    ``header.payload_nbytes`` long. A record shorter than ``min_bytes`` is padded to at least
    that inside its header.

    The payload copy and the checksum run without holding the GIL (numpy and xxhash release it),
    so a background writer encoding megabytes does not stall the thread that decodes; reusing
    ``out`` spares the page faults of fresh multi-MiB allocations.
    """
    view = payload_view(header, payload)
    head = record_head(header, min_bytes)
    start = len(head)
    total = start + view.nbytes + _CHECKSUM.size
    out = out[:total] if out is not None and out.nbytes >= total else np.empty(total, dtype=np.uint8)
    out[:start] = np.frombuffer(head, dtype=np.uint8)
    np.copyto(out[start : start + view.nbytes], np.frombuffer(view, dtype=np.uint8))
    stop = start + view.nbytes
    out[stop:] = np.frombuffer(_CHECKSUM.pack(xxhash.xxh3_64_intdigest(out[:stop])), dtype=np.uint8)
    return out


def payload_view(header: RecordHeader, payload: bytes | bytearray | memoryview) -> memoryview:
    """``payload`` as the bytes ``encode_array`` copies; ``ValueError`` where ``header`` cannot
    frame it (a dtype not stored, a length its shape does not give)."""
    if header.dtype not in ITEMSIZE:
        raise ValueError(f"dtype {header.dtype!r} cannot be stored; supported: {sorted(ITEMSIZE)}")
    view = memoryview(payload).cast("B")
    if view.nbytes != header.payload_nbytes:
        raise ValueError(f"payload is {view.nbytes} bytes but shape {header.shape} of {header.dtype} needs {header.payload_nbytes}")
    return view


def record_head(header: RecordHeader, min_bytes: int = 0) -> bytes:
    """The first bytes ``encode_array`` writes (magic, length and header: the record's head),
    without the payload."""
    head = _packed_header(header, min_bytes)
    return _PREFIX.pack(MAGIC, len(head)) + head


def encode(header: RecordHeader, payload: bytes | bytearray | memoryview) -> bytes:
    """Serialize one record. ``payload`` must be ``header.payload_nbytes`` long."""
    return encode_array(header, payload).tobytes()


def head_size(header: RecordHeader, min_bytes: int = 0) -> int:
    """The exact length of a record's head (magic, length and header: everything before the payload)."""
    return _PREFIX.size + len(_packed_header(header, min_bytes))


def record_size(header: RecordHeader, min_bytes: int = 0) -> int:
    """The exact length ``encode_array`` produces for ``header`` and ``min_bytes``, without
    building the record."""
    return head_size(header, min_bytes) + header.payload_nbytes + _CHECKSUM.size


def head_end(record: bytes | memoryview | np.ndarray) -> int:
    """Where the head of an encoded record ends (its payload starts); checks only the framing."""
    view = memoryview(record).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptRecord(f"record truncated: {view.nbytes} bytes")
    magic, head_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptRecord("not a tierkv block record (bad magic)")
    return _PREFIX.size + head_len


def decode_head(buf: bytes | memoryview) -> tuple[RecordHeader, int]:
    """A record's head stored apart from it (the first ``head_end`` bytes of the record, as the
    disk tier indexes blocks): the header, and the length of the whole record it heads. Structural
    checks only (the disk tier's index entry adds a checksum of its own, ``tiers/heads.py``); the
    record's checksum, verified when the block is read, is what makes a block servable."""
    view = memoryview(buf).cast("B")
    header, end = _parse_header(view, trailer=0)
    if end != view.nbytes:
        raise CorruptRecord(f"head is {view.nbytes} bytes, its length field says {end}")
    return header, end + header.payload_nbytes + _CHECKSUM.size


def _parse_header(buf: memoryview, trailer: int = _CHECKSUM.size) -> tuple[RecordHeader, int]:
    if buf.nbytes < _PREFIX.size + trailer:
        raise CorruptRecord(f"record truncated: {buf.nbytes} bytes")
    magic, head_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord("not a tierkv block record (bad magic)")
    end = _PREFIX.size + head_len
    if end + trailer > buf.nbytes:
        raise CorruptRecord("record truncated inside its header")
    try:
        raw = msgpack.unpackb(buf[_PREFIX.size : end], raw=False)
    except (ValueError, TypeError) as exc:
        # msgpack's answers to garbage are ValueErrors (its own ExtraData, FormatError and
        # StackError, UnicodeDecodeError, bare ones for a length past the input or a bad key or
        # timestamp); TypeError for a key it cannot hash. Anything else is a signal handler's
        # (a SIGALRM timeout's TimeoutError, a program's own Exception subclass), told by its
        # type as this module imports nothing of tierkv's: taken for garbage, a sound block was
        # counted corrupt and dropped, and the handler's exception was lost. (A handler raising a
        # ValueError is still taken for garbage.)
        raise CorruptRecord(f"unreadable header: {exc}") from None
    if not isinstance(raw, dict):
        raise CorruptRecord("header is not a map")
    version = raw.get("v")
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"format version {version!r}, this tierkv reads {FORMAT_VERSION}")
    names = ("key", "parent", "fp", "ids", "dtype", "shape", "seq", "tenant")
    missing = [n for n in names if n not in raw]
    if missing:
        raise CorruptRecord(f"header fields missing or malformed: {missing} absent")
    fields = {n: raw[n] for n in names}
    if not all([isinstance(fields[n], bytes) for n in ("key", "parent", "fp", "ids")]):
        raise CorruptRecord("header fields missing or malformed: key, parent, fp and ids must be bytes")
    shape, seq = fields["shape"], fields["seq"]
    if not isinstance(shape, list) or not all([type(d) is int and 0 <= d < 2**40 for d in shape]):
        raise CorruptRecord("header fields missing or malformed: shape must list non-negative ints")
    if type(seq) is not int or seq < 0:
        raise CorruptRecord("header fields missing or malformed: seq must be a non-negative int")
    if fields["dtype"] not in ITEMSIZE or len(fields["ids"]) % 8:
        raise CorruptRecord("header has an unknown dtype or ragged token ids")
    if fields["tenant"] is not None and not isinstance(fields["tenant"], str):
        raise CorruptRecord("header tenant is not a string")
    header = RecordHeader(key=fields["key"], parent=fields["parent"], tenant=fields["tenant"],
                          fingerprint=fields["fp"], dtype=fields["dtype"], shape=tuple(shape),
                          token_ids=fields["ids"], seq=seq, version=version)
    return header, end


def decode_header(buf: bytes | memoryview) -> RecordHeader:
    """The header alone, with structural checks but no checksum (cheap; payload untouched)."""
    header, end = _parse_header(memoryview(buf).cast("B"))
    if end + header.payload_nbytes + _CHECKSUM.size != memoryview(buf).nbytes:
        raise CorruptRecord("record length does not match its header")
    return header


def _frame(view: memoryview) -> tuple[RecordHeader, int, int, int]:
    """Header, payload start and end, and the stored checksum of a record whose length checks out."""
    header, end = _parse_header(view)
    stop = end + header.payload_nbytes
    if stop + _CHECKSUM.size != view.nbytes:
        raise CorruptRecord(f"record is {view.nbytes} bytes, its header says {stop + _CHECKSUM.size}")
    (stored,) = _CHECKSUM.unpack_from(view, stop)
    return header, end, stop, stored


def decode_into(buf: bytes | memoryview, out: Callable[[RecordHeader], np.ndarray | Pieces]) -> RecordHeader:
    """Copy a record's payload, or its first ``n`` tokens, into the array ``out(header)``
    returns, verifying the whole payload on the way.

    The payload is ``(layers, 2, kv_heads, tokens, head_dim)``; the destination is a uint8 array
    ``(layers * 2 * kv_heads, n, head_dim * itemsize)``, ``n <= tokens``, of any strides: a
    tensor of the block's own, or a token range of a larger buffer (a restore's, laid out as the
    layers' keys and values are). One pass over the source: in runs of rows, each checksummed
    right after its copy read it into the CPU's cache. Into a block's own tensor, runs of
    ``CHECKSUM_RUN``, checksummed at the destination (on a 2-core EPYC, 1 MiB runs at 0.87 of a
    plain copy, 256 KiB ones at 0.76: the calls per run cost more than the cache misses; on a Xeon
    with 2 MiB of L2 a core, both 7.1-7.3 GB/s). Into a restore's buffer, runs of
    ``SPREAD_CHECKSUM_RUN``, checksummed at the source, which the copy's writes to rows spread
    over the buffer evict sooner: on that Xeon 1 MiB runs read 5.5-5.8 GB/s, 256 KiB ones
    6.3-6.9. Raises ``CorruptRecord`` like ``decode``, and for a record that does not fit the
    destination; then the destination holds garbage and must not be used.

    ``out`` may instead return ``Pieces``: (first row, array) pairs, in row order and apart, each
    array ``(rows, n, head_dim * itemsize)`` taking the payload's rows from its first on (a
    restore's layers, each cut to its window: ``cache.restore_slots``). Rows no piece takes are
    only checksummed.
    """
    view = memoryview(buf).cast("B")
    header, end, stop, stored = _frame(view)
    if len(header.shape) != 5:
        raise CorruptRecord(f"a block's payload has 5 axes, this one {len(header.shape)}")
    dst = out(header)
    layers, two, heads, tokens, dim = header.shape
    rows, width = layers * two * heads, dim * ITEMSIZE[header.dtype]
    if not isinstance(dst, np.ndarray):
        _decode_pieces(view, header, end, stop, stored, dst, rows, tokens, width)
        return header
    # A destination of another dtype would take the bytes as values (np.copyto casts them).
    if dst.dtype != np.uint8 or dst.ndim != 3 or dst.shape[0] != rows or dst.shape[1] > tokens or \
            dst.shape[2] != width:
        raise CorruptRecord(f"record shaped {tuple(header.shape)} in {header.dtype} does not fill a destination "
                            f"of {dst.shape} {dst.dtype}")
    n = dst.shape[1]
    src = np.frombuffer(view[end:stop], dtype=np.uint8).reshape(rows, tokens, width)
    h = xxhash.xxh3_64()
    h.update(view[:end])
    at_destination = n == tokens and dst.flags.c_contiguous
    step = max(1, (CHECKSUM_RUN if at_destination else SPREAD_CHECKSUM_RUN) // max(1, tokens * width))
    for row in range(0, rows, step):
        part = dst[row:row + step]
        np.copyto(part, src[row:row + step, :n])
        # A contiguous copy of the whole source is checksummed where the copy left it in the
        # CPU's cache: reads into a block's own tensor that read the map's pages a second time
        # ran at 0.66 of a raw read, against 0.79. Rows spread over a larger buffer (or a part of
        # the source) are checksummed at the source: row by row, a restore's open took 0.42-0.45
        # of the floor's turn against 0.40.
        h.update(part if at_destination else src[row:row + step])
    if h.intdigest() != stored:
        raise CorruptRecord("checksum mismatch")
    return header


def _decode_pieces(view: memoryview, header: RecordHeader, end: int, stop: int, stored: int, pieces: Pieces,
                   rows: int, tokens: int, width: int) -> None:
    """``decode_into`` into ``pieces``: each run of rows copied and then checksummed at the source,
    the rows between pieces checksummed alone, all in the payload's order."""
    at = 0
    for first, part in pieces:
        if not isinstance(part, np.ndarray) or part.dtype != np.uint8 or part.ndim != 3 or first < at or \
                first + part.shape[0] > rows or part.shape[1] > tokens or part.shape[2] != width:
            raise CorruptRecord(f"record shaped {tuple(header.shape)} in {header.dtype} does not fill a "
                                f"destination of {getattr(part, 'shape', None)} from row {first}")
        at = first + part.shape[0]
    src = np.frombuffer(view[end:stop], dtype=np.uint8).reshape(rows, tokens, width)
    h = xxhash.xxh3_64()
    h.update(view[:end])
    step = max(1, SPREAD_CHECKSUM_RUN // max(1, tokens * width))
    at = 0
    for first, part in [*pieces, (rows, None)]:
        for row in range(at, first, step):  # rows no piece takes
            h.update(src[row:min(row + step, first)])
        if part is None:
            break
        n = part.shape[1]
        for row in range(0, part.shape[0], step):
            last = min(row + step, part.shape[0])
            np.copyto(part[row:last], src[first + row:first + last, :n])
            h.update(src[first + row:first + last])
        at = first + part.shape[0]
    if h.intdigest() != stored:
        raise CorruptRecord("checksum mismatch")


def decode(buf: bytes | memoryview) -> tuple[RecordHeader, memoryview]:
    """Header and a zero-copy view of the payload, after verifying length and checksum."""
    view = memoryview(buf).cast("B")
    header, end, stop, stored = _frame(view)
    if xxhash.xxh3_64_intdigest(view[:stop]) != stored:
        raise CorruptRecord("checksum mismatch")
    return header, view[end:stop]
