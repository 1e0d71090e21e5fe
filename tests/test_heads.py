"""tierkv.tiers.heads: a block's index entry round-trips; any damage is ``CorruptRecord``; the
value always takes an LMDB overflow page of its own (never a B-tree leaf, whose copies on the
free list would keep token ids that forget must erase)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.codec import CorruptRecord, RecordHeader, encode, head_end
from tierkv.hashing import token_bytes
from tierkv.tiers import heads

PAGE = 4096


def record(n_ids: int = 3, tenant: str | None = "acme") -> tuple[RecordHeader, bytes]:
    header = RecordHeader(key=bytes(range(16)), parent=bytes(16), tenant=tenant, fingerprint=b"fp",
                          dtype="uint8", shape=(2, 3), token_ids=token_bytes(range(n_ids)), seq=5)
    return header, encode(header, bytes(range(6)))


@given(st.integers(0, 600), st.none() | st.text(max_size=3000), st.integers(0, 2**64 - 1))
def test_round_trip_and_always_an_overflow_page(n_ids: int, tenant: str | None, offset: int) -> None:
    header, rec = record(n_ids, tenant)
    head = heads.head_of(rec)
    assert head == rec[:head_end(rec)]
    value = heads.encode(head, offset, PAGE)
    assert len(value) == heads.value_bytes(len(head), PAGE) >= PAGE // 2  # LMDB's largest leaf node is smaller
    assert heads.decode(value) == (header, len(rec), offset)
    assert heads.head_of(value) == head


def test_every_flipped_byte_is_corrupt() -> None:
    _, rec = record()
    value = heads.encode(heads.head_of(rec), 12345, PAGE)
    for position in range(len(value)):
        damaged = bytearray(value)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptRecord):
            heads.decode(bytes(damaged))


@pytest.mark.parametrize("cut", [0, 1, 15, 16, 100])
def test_truncated_is_corrupt(cut: int) -> None:
    _, rec = record()
    value = heads.encode(heads.head_of(rec), 0, PAGE)
    with pytest.raises(CorruptRecord):
        heads.decode(value[:cut])
    with pytest.raises(CorruptRecord):
        heads.decode(value[:-1])


def test_zeroed_is_corrupt() -> None:
    _, rec = record()
    with pytest.raises(CorruptRecord):
        heads.decode(bytes(len(heads.encode(heads.head_of(rec), 0, PAGE))))
