"""A block's index entry in the disk tier (its *head*), as stored in the ``heads`` table. Pure.

Layout of the value (little-endian)::

    the record's head (magic, length, header) | zeros | u64 offset | u64 xxh3_64(all before it)

``offset`` is where the record's value lies in the LMDB file, or ``OFFSET_UNKNOWN``. The zeros pad
the value to at least half a page: LMDB then stores it on an overflow page of its own, never inside
a B-tree leaf, whose copies (one per change to the leaf) would keep a forgotten conversation's
token ids on the free list where zeroing the entry cannot reach them.

A head is an index, not the data: the store serves a block only when the record's own verified
header agrees with it. Its checksum keeps a damaged head from steering that index (a budget
inflated by a flipped dimension, a block filed under the wrong parent).
"""

from __future__ import annotations

import struct

import xxhash

from ..codec import CorruptRecord, RecordHeader, decode_head, head_end

OFFSET_UNKNOWN = 2**64 - 1
_TRAILER = struct.Struct("<QQ")  # offset, checksum


def value_bytes(head_bytes: int, page_size: int) -> int:
    """Length of the stored value of a head of ``head_bytes``."""
    return max(head_bytes + _TRAILER.size, page_size // 2)


def encode(head: bytes, offset: int, page_size: int) -> bytes:
    """The value stored for a record's ``head`` (its first ``head_end`` bytes) lying at ``offset``."""
    body = head + bytes(value_bytes(len(head), page_size) - len(head) - _TRAILER.size) + offset.to_bytes(8, "little")
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def decode(value: bytes | memoryview) -> tuple[RecordHeader, int, int]:
    """Header, record length and offset of a stored head; ``CorruptRecord`` if it is damaged."""
    view = memoryview(value).cast("B")
    if view.nbytes < _TRAILER.size:
        raise CorruptRecord(f"head truncated: {view.nbytes} bytes")
    offset, stored = _TRAILER.unpack_from(view, view.nbytes - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(view[:view.nbytes - 8]) != stored:
        raise CorruptRecord("head checksum mismatch")
    end = head_end(view)
    if end + _TRAILER.size > view.nbytes or any(view[end:view.nbytes - _TRAILER.size]):
        raise CorruptRecord("head length does not match its value")
    header, size = decode_head(view[:end])
    return header, size, offset


def head_of(record: bytes | memoryview) -> bytes:
    """A record's head: its bytes up to the payload."""
    view = memoryview(record).cast("B")
    return bytes(view[:head_end(view)])
