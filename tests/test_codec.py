"""tierkv.codec: a record round-trips exactly and without copying its payload; every damaged,
foreign or malformed record is rejected with ``CorruptRecord``, never served and never crashing
with another exception type."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import struct

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import tierkv.codec
import tierkv.tiers.disk
from tierkv.codec import (
    FORMAT_VERSION,
    ITEMSIZE,
    MAGIC,
    CorruptRecord,
    RecordHeader,
    decode,
    decode_head,
    decode_header,
    encode,
    encode_array,
    head_end,
    head_size,
    record_size,
)
from tierkv.hashing import token_bytes

NP_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int8": np.int8,
             "uint8": np.uint8}


def make_header(**changes: object) -> RecordHeader:
    fields: dict[str, object] = dict(
        key=bytes(range(16)), parent=bytes(range(16, 32)), tenant="acme", fingerprint=b"fp" * 8,
        dtype="float32", shape=(2, 2, 1, 3, 4), token_ids=token_bytes([11, 12, 13]), seq=42,
    )
    fields.update(changes)
    return RecordHeader(**fields)  # type: ignore[arg-type]


def make_payload(header: RecordHeader) -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(header.payload_nbytes))


def make_record(**changes: object) -> tuple[RecordHeader, bytes, bytes]:
    header = make_header(**changes)
    payload = make_payload(header)
    return header, payload, encode(header, payload)


def craft(raw_header: object, payload: bytes = b"", magic: bytes = MAGIC) -> bytes:
    """A record with any msgpack header and a VALID checksum, to reach the field checks."""
    head = msgpack.packb(raw_header, use_bin_type=True)
    body = struct.pack("<4sI", magic, len(head)) + head + payload
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def raw_fields(header: RecordHeader) -> dict[str, object]:
    return {"v": header.version, "key": header.key, "parent": header.parent, "tenant": header.tenant,
            "fp": header.fingerprint, "dtype": header.dtype, "shape": list(header.shape),
            "ids": header.token_ids, "seq": header.seq}


def reseal(record: bytes | bytearray) -> bytes:
    """Recompute the trailing checksum, so that only the deliberate damage remains."""
    body = bytes(record[:-8])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


# -- round trip ------------------------------------------------------------------------------------
headers = st.builds(
    RecordHeader,
    key=st.binary(min_size=16, max_size=16),
    parent=st.binary(min_size=16, max_size=16),
    tenant=st.none() | st.text(max_size=20),
    fingerprint=st.binary(max_size=40),
    dtype=st.sampled_from(sorted(ITEMSIZE)),
    shape=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=5).map(tuple),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=8).map(token_bytes),
    seq=st.integers(min_value=0, max_value=2**63),
)


@given(headers, st.data())
def test_round_trip(header: RecordHeader, data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=header.payload_nbytes, max_size=header.payload_nbytes))
    record = encode(header, payload)
    assert type(record) is bytes
    assert record_size(header) == len(record)
    decoded, view = decode(record)
    assert decoded == header
    assert isinstance(view, memoryview)
    assert view.format == "B" and view.nbytes == len(payload)
    assert bytes(view) == payload
    assert decode_header(record) == header


@given(headers, st.data())
def test_a_head_is_the_record_up_to_its_payload(header: RecordHeader, data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=header.payload_nbytes, max_size=header.payload_nbytes))
    record = encode(header, payload)
    end = head_end(record)
    assert end == head_size(header) == len(record) - len(payload) - 8
    assert decode_head(record[:end]) == (header, len(record))


def test_a_head_is_rejected_like_a_header() -> None:
    header, _, record = make_record()
    head = record[:head_end(record)]
    for damaged in (head[:-1], head + b"\x00", b"XXXX" + head[4:], head[:6], b""):
        with pytest.raises(CorruptRecord):
            decode_head(damaged)
    with pytest.raises(CorruptRecord, match="bad magic"):
        head_end(b"XXXX" + record[4:])
    with pytest.raises(CorruptRecord, match="truncated"):
        head_end(record[:3])
    other = craft({**raw_fields(header), "v": FORMAT_VERSION + 1})
    with pytest.raises(CorruptRecord, match="format version"):
        decode_head(other[:head_end(other)])


def test_header_fields_survive_exactly() -> None:
    header, payload, record = make_record(tenant=None, seq=0, fingerprint=b"")
    decoded, view = decode(record)
    assert decoded.key == bytes(range(16))
    assert decoded.parent == bytes(range(16, 32))
    assert decoded.tenant is None
    assert decoded.fingerprint == b""
    assert decoded.dtype == "float32"
    assert decoded.shape == (2, 2, 1, 3, 4)
    assert type(decoded.shape) is tuple
    assert decoded.token_ids == token_bytes([11, 12, 13])
    assert decoded.n_tokens == 3
    assert decoded.seq == 0
    assert decoded.version == FORMAT_VERSION == 1
    assert decoded.payload_nbytes == 2 * 2 * 1 * 3 * 4 * 4
    assert bytes(view) == payload


def test_layout_is_the_documented_one() -> None:
    header, payload, record = make_record()
    assert record[:4] == MAGIC == b"TKVB"
    (head_len,) = struct.unpack_from("<I", record, 4)
    head = msgpack.unpackb(record[8:8 + head_len], raw=False)
    assert head == raw_fields(header)
    assert record[8 + head_len:-8] == payload
    (checksum,) = struct.unpack("<Q", record[-8:])
    assert checksum == xxhash.xxh3_64_intdigest(record[:-8])


@pytest.mark.parametrize("dtype", sorted(NP_DTYPES))
def test_payload_maps_straight_into_an_array(dtype: str) -> None:
    array = (np.arange(2 * 2 * 3 * 4) % 100).astype(NP_DTYPES[dtype]).reshape(1, 2, 2, 3, 4)
    header = make_header(dtype=dtype, shape=array.shape)
    _, view = decode(encode(header, array.tobytes()))
    restored = np.frombuffer(view, dtype=NP_DTYPES[dtype]).reshape(header.shape)
    np.testing.assert_array_equal(restored, array)


def test_encode_accepts_bytearray_memoryview_and_multibyte_views() -> None:
    header = make_header()
    payload = make_payload(header)
    expected = encode(header, payload)
    assert encode(header, bytearray(payload)) == expected
    assert encode(header, memoryview(payload)) == expected
    as_floats = np.frombuffer(payload, dtype=np.float32)
    assert encode(header, memoryview(as_floats)) == expected  # cast to bytes, not rejected


def test_decode_does_not_copy_the_payload_bytes_input() -> None:
    header, payload, record = make_record()
    _, view = decode(record)
    assert view.obj is record
    arr = np.frombuffer(view, dtype=np.uint8)
    assert np.shares_memory(arr, np.frombuffer(record, dtype=np.uint8))


def test_decode_does_not_copy_the_payload_mutable_buffer() -> None:
    header, payload, record = make_record()
    buf = bytearray(record)
    _, view = decode(buf)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), np.frombuffer(buf, dtype=np.uint8))
    start = len(record) - 8 - len(payload)
    buf[start] ^= 0xFF
    assert view[0] == payload[0] ^ 0xFF  # the view sees the buffer change: no copy was made
    buf[-9] = 0x5A
    assert view[-1] == 0x5A


def test_decode_accepts_a_memoryview_into_a_larger_buffer() -> None:
    header, payload, record = make_record()
    big = bytearray(b"\xee" * 5 + record + b"\xee" * 7)
    window = memoryview(big)[5:5 + len(record)]
    decoded, view = decode(window)
    assert decoded == header and bytes(view) == payload
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), np.frombuffer(big, dtype=np.uint8))


@given(headers)
def test_record_size_equals_encoded_length(header: RecordHeader) -> None:
    assert record_size(header) == len(encode(header, bytes(header.payload_nbytes)))


# -- encode rejects misuse ---------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, 1, -16])
def test_encode_rejects_wrong_payload_length(delta: int) -> None:
    header = make_header()
    with pytest.raises(ValueError, match=f"needs {header.payload_nbytes}"):
        encode(header, bytes(header.payload_nbytes + delta))


@pytest.mark.parametrize("dtype", ["complex64", "int64", "torch.float32", "", "float"])
def test_encode_rejects_unknown_dtype(dtype: str) -> None:
    header = make_header(dtype=dtype)
    with pytest.raises(ValueError, match="supported") as info:
        encode(header, bytes(96))
    assert not isinstance(info.value, CorruptRecord)
    assert "float32" in str(info.value)


# -- decode rejects damage ---------------------------------------------------------------------------
SMALL_HEADER, SMALL_PAYLOAD, SMALL_RECORD = make_record(shape=(1, 2, 1, 2, 2), dtype="float16")


@given(st.integers(min_value=0, max_value=len(SMALL_RECORD) - 1), st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_is_corrupt(position: int, mask: int) -> None:
    damaged = bytearray(SMALL_RECORD)
    damaged[position] ^= mask
    with pytest.raises(CorruptRecord):
        decode(bytes(damaged))


def test_every_single_bit_flip_is_corrupt() -> None:
    for position in range(len(SMALL_RECORD)):
        for bit in range(8):
            damaged = bytearray(SMALL_RECORD)
            damaged[position] ^= 1 << bit
            with pytest.raises(CorruptRecord):
                decode(damaged)


@given(st.integers(min_value=0, max_value=len(SMALL_RECORD) - 1), st.integers(min_value=1, max_value=255))
def test_decode_header_never_raises_another_type(position: int, mask: int) -> None:
    damaged = bytearray(SMALL_RECORD)
    damaged[position] ^= mask
    try:
        header = decode_header(bytes(damaged))
    except CorruptRecord:
        return
    # Without a checksum, a flip inside a header value or in the payload or checksum passes;
    # what comes back is still a well-typed header of the same length.
    assert isinstance(header, RecordHeader)
    assert header.payload_nbytes == SMALL_HEADER.payload_nbytes
    if position >= len(SMALL_RECORD) - 8 - len(SMALL_PAYLOAD):
        assert header == SMALL_HEADER


def test_decode_header_skips_the_checksum() -> None:
    header, payload, record = make_record()
    damaged = bytearray(record)
    damaged[-1] ^= 0xFF  # checksum
    damaged[-9] ^= 0xFF  # last payload byte
    assert decode_header(bytes(damaged)) == header
    with pytest.raises(CorruptRecord, match="checksum"):
        decode(bytes(damaged))


def test_truncated_at_every_length_is_corrupt() -> None:
    for length in range(len(SMALL_RECORD)):
        with pytest.raises(CorruptRecord):
            decode(SMALL_RECORD[:length])
        with pytest.raises(CorruptRecord):
            decode_header(SMALL_RECORD[:length])


def test_extra_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(CorruptRecord):
        decode(SMALL_RECORD + b"\x00")
    with pytest.raises(CorruptRecord, match="length"):
        decode_header(SMALL_RECORD + b"\x00")


@pytest.mark.parametrize("magic", [b"TKVA", b"tkvb", b"\x00\x00\x00\x00", b"BVKT"])
def test_wrong_magic_is_corrupt_even_with_a_valid_checksum(magic: bytes) -> None:
    record = reseal(magic + SMALL_RECORD[4:])
    with pytest.raises(CorruptRecord, match="magic"):
        decode(record)
    with pytest.raises(CorruptRecord, match="magic"):
        decode_header(record)


@pytest.mark.parametrize("version", [0, 2, 99, -1])
def test_other_format_version_is_corrupt(version: int) -> None:
    header = make_header(version=version)
    record = encode(header, make_payload(header))  # a well-formed record of another version
    with pytest.raises(CorruptRecord, match="format version"):
        decode(record)
    with pytest.raises(CorruptRecord, match="format version"):
        decode_header(record)


@pytest.mark.parametrize("version", [None, "1", 1.5, b"\x01"])
def test_malformed_version_is_corrupt(version: object) -> None:
    fields = raw_fields(SMALL_HEADER)
    fields["v"] = version
    with pytest.raises(CorruptRecord, match="format version"):
        decode(craft(fields, SMALL_PAYLOAD))


@pytest.mark.parametrize("delta", [-1, 1, 8])
def test_payload_length_mismatch_is_corrupt(delta: int) -> None:
    # Header says N payload bytes, the record holds N + delta, and the checksum is valid.
    payload = SMALL_PAYLOAD + b"\x07" * delta if delta > 0 else SMALL_PAYLOAD[:delta]
    record = craft(raw_fields(SMALL_HEADER), payload)
    with pytest.raises(CorruptRecord, match="header says"):
        decode(record)
    with pytest.raises(CorruptRecord, match="length does not match"):
        decode_header(record)


def test_header_length_field_pointing_past_the_end_is_corrupt() -> None:
    damaged = bytearray(SMALL_RECORD)
    struct.pack_into("<I", damaged, 4, 2**32 - 1)
    with pytest.raises(CorruptRecord, match="truncated"):
        decode(reseal(damaged))


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x00", b"TKVB", b"TKVB\x00\x00\x00\x00", bytes(64), b"\xff" * 64, b"TKVB\x05\x00\x00\x00\xc1\xc1\xc1\xc1\xc1"
     + bytes(8), b"not a record at all, just text"],
)
def test_garbage_is_corrupt(garbage: bytes) -> None:
    with pytest.raises(CorruptRecord):
        decode(garbage)
    with pytest.raises(CorruptRecord):
        decode_header(garbage)


@pytest.mark.parametrize("raw_header", [[1, 2, 3], "a string", 7, None, b"bytes", {"v": 1}, {}])
def test_header_that_is_not_a_complete_map_is_corrupt(raw_header: object) -> None:
    record = craft(raw_header, SMALL_PAYLOAD)
    with pytest.raises(CorruptRecord):
        decode(record)
    with pytest.raises(CorruptRecord):
        decode_header(record)


def test_unreadable_msgpack_header_is_corrupt() -> None:
    head = b"\xc1" * 6  # 0xc1 is never used in msgpack
    body = struct.pack("<4sI", MAGIC, len(head)) + head
    record = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises(CorruptRecord, match="unreadable header"):
        decode(record)


def test_header_with_trailing_msgpack_data_is_corrupt() -> None:
    head = msgpack.packb(raw_fields(SMALL_HEADER), use_bin_type=True) + b"\x01"
    body = struct.pack("<4sI", MAGIC, len(head)) + head + SMALL_PAYLOAD
    record = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises(CorruptRecord):
        decode(record)


@pytest.mark.parametrize("field", ["key", "parent", "tenant", "fp", "dtype", "shape", "ids", "seq"])
def test_missing_field_is_corrupt(field: str) -> None:
    fields = raw_fields(SMALL_HEADER)
    del fields[field]
    with pytest.raises(CorruptRecord, match="missing or malformed"):
        decode(craft(fields, SMALL_PAYLOAD))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "complex64"),
        ("dtype", 5),
        ("ids", b"\x00" * 7),  # ragged token ids
        ("tenant", 5),
        ("tenant", b"acme"),
        ("shape", "ab"),
        ("shape", 4),
        ("shape", [None]),
        ("key", "a str, not bytes"),
        ("key", -1),
        ("seq", "x"),
        ("seq", None),
        ("seq", -1),  # commit sequence numbers count up from 0
    ],
)
def test_malformed_field_is_corrupt(field: str, value: object) -> None:
    fields = raw_fields(SMALL_HEADER)
    fields[field] = value
    record = craft(fields, SMALL_PAYLOAD)
    with pytest.raises(CorruptRecord):
        decode(record)
    with pytest.raises(CorruptRecord):
        decode_header(record)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", 2**64 - 1),  # bytes(int) -> OverflowError
        ("parent", 2**63),
        ("fp", 2**64 - 1),
        ("ids", 2**63),
        ("seq", float("inf")),  # int(inf) -> OverflowError
        ("shape", [float("inf")]),
        ("shape", [1, float("-inf")]),
    ],
)
def test_hostile_numeric_field_is_corrupt_not_a_crash(field: str, value: object) -> None:
    # A record written by anything else must be rejected safely, with the one exception type the
    # disk tier catches (scan() catches only CorruptRecord while rebuilding the index).
    fields = raw_fields(SMALL_HEADER)
    fields[field] = value
    record = craft(fields, SMALL_PAYLOAD)
    with pytest.raises(CorruptRecord):
        decode(record)
    with pytest.raises(CorruptRecord):
        decode_header(record)


@pytest.mark.parametrize("field", ["key", "parent", "fp", "ids"])
def test_integer_in_a_bytes_field_is_corrupt(field: str) -> None:
    # bytes(16) is sixteen zero bytes: an int must not silently become a key or token ids.
    fields = raw_fields(SMALL_HEADER)
    fields[field] = 16
    with pytest.raises(CorruptRecord):
        decode(craft(fields, SMALL_PAYLOAD))


@pytest.mark.parametrize("shape", [[-2, -2], [-1, -4]])
def test_negative_dimension_is_corrupt(shape: list[int]) -> None:
    # Shapes whose product matches the payload length but which no tensor can have.
    fields = raw_fields(SMALL_HEADER)
    fields["dtype"] = "uint8"
    fields["shape"] = shape
    record = craft(fields, b"\x01\x02\x03\x04")
    with pytest.raises(CorruptRecord):
        decode(record)
    with pytest.raises(CorruptRecord):
        decode_header(record)


def test_corrupt_record_is_a_value_error() -> None:
    assert issubclass(CorruptRecord, ValueError)


def test_record_header_is_frozen() -> None:
    header = make_header()
    with pytest.raises(dataclasses.FrozenInstanceError):
        header.seq = 1  # type: ignore[misc]


# -- no pickle ----------------------------------------------------------------------------------------
def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(pathlib.Path(path).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", [tierkv.codec, tierkv.tiers.disk])
def test_no_pickle_in_the_record_path(module: object) -> None:
    path = module.__file__  # type: ignore[attr-defined]
    imported = _imported_modules(path)
    assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    source = pathlib.Path(path).read_text()
    assert "torch.save" not in source and "torch.load" not in source
    assert "pickle" not in source.replace("No pickle", "").replace("no pickle", "")


def test_codec_is_pure() -> None:
    imported = _imported_modules(tierkv.codec.__file__)
    assert imported <= {"__future__", "collections", "math", "struct", "dataclasses", "msgpack", "numpy", "xxhash"}


def test_a_pickle_payload_is_not_a_record() -> None:
    import pickle

    with pytest.raises(CorruptRecord):
        decode(pickle.dumps({"v": 1, "key": b"k" * 16}))


def test_encode_array_equals_encode_and_decodes() -> None:
    array = encode_array(SMALL_HEADER, SMALL_PAYLOAD)
    assert array.dtype == np.uint8 and array.tobytes() == encode(SMALL_HEADER, SMALL_PAYLOAD)
    header, payload = decode(array)
    assert header == SMALL_HEADER and bytes(payload) == bytes(SMALL_PAYLOAD)


def whole(header: RecordHeader) -> np.ndarray:
    """A destination for a record's whole payload: (layers * 2 * heads, tokens, head_dim bytes)."""
    layers, two, heads, tokens, dim = header.shape
    return np.zeros((layers * two * heads, tokens, dim * ITEMSIZE[header.dtype]), dtype=np.uint8)


def test_decode_into_copies_and_verifies() -> None:
    from tierkv.codec import decode_into

    record = encode(SMALL_HEADER, SMALL_PAYLOAD)
    dst = whole(SMALL_HEADER)
    assert decode_into(record, lambda header: dst) == SMALL_HEADER
    assert dst.tobytes() == bytes(SMALL_PAYLOAD)
    big_header, big_payload, big_record = make_record(shape=(2, 2, 2, 300, 64), dtype="float32")
    out = whole(big_header)
    decode_into(big_record, lambda header: out)
    assert out.tobytes() == bytes(big_payload)
    for position in (0, len(big_record) // 2, len(big_record) - 9):  # header, payload, last payload byte
        broken = bytearray(big_record)
        broken[position] ^= 0x01
        with pytest.raises(CorruptRecord):
            decode_into(bytes(broken), whole)


@pytest.mark.parametrize("spread", [False, True])
def test_decode_into_verifies_every_slice_of_a_record_larger_than_one(spread: bool) -> None:
    from tierkv.codec import decode_into

    # Copied and checksummed in runs of rows: CHECKSUM_RUN (1 MiB) into a tensor of the record's
    # own, SPREAD_CHECKSUM_RUN (256 KiB) into a token range of a larger buffer (``spread``): a
    # payload of several runs, the last one partial, and rows of more than a run each.
    for shape in ((1, 2, 1, 3, (5 << 20) // 6 + 7), (3, 2, 5, 64, 1000)):
        header = make_header(dtype="uint8", shape=shape)
        payload = ((np.arange(header.payload_nbytes, dtype=np.int64) * 7 + 3) % 251).astype(np.uint8).tobytes()
        record = encode(header, payload)
        rows, tokens, width = shape[0] * shape[1] * shape[2], shape[3], shape[4]

        def into(h: RecordHeader) -> np.ndarray:
            if not spread:
                return whole(h)
            buffer = np.zeros((rows, tokens + 2, width), dtype=np.uint8)  # room past the block, as a restore's
            return buffer[:, :tokens]

        got: list[np.ndarray] = []
        assert decode_into(record, lambda h: got.append(into(h)) or got[0]) == header
        assert got[0].tobytes() == payload
        start = head_size(header)
        for position in (start + 5, start + (256 << 10) + 1, start + (1 << 20) + 3, start + (3 << 20) + 11,
                         len(record) - 9):
            if position >= len(record) - 8:
                continue
            broken = bytearray(record)
            broken[position] ^= 0x10
            with pytest.raises(CorruptRecord):
                decode_into(bytes(broken), into)


def test_decode_into_a_token_range_of_a_larger_buffer_copies_those_tokens_and_verifies_them_all() -> None:
    from tierkv.codec import decode_into

    # A restore reads a block's first n tokens straight into its place in the layers' buffer
    # (layers, 2, heads, length, head_dim): the bytes around that range stay untouched, and a
    # flip in the tokens not copied still fails the read.
    header, payload, record = make_record(shape=(3, 2, 2, 8, 4), dtype="float32")
    block = np.frombuffer(payload, dtype=np.float32).reshape(header.shape)
    for n in (8, 5, 0):
        buffer = np.full((3, 2, 2, 20, 4), -1.0, dtype=np.float32)
        into = lambda h: buffer.view(np.uint8).reshape(12, 20, 16)[:, 7:7 + n]  # noqa: E731
        assert decode_into(record, into) == header
        assert np.array_equal(buffer[:, :, :, 7:7 + n], block[:, :, :, :n])
        assert (buffer[:, :, :, :7] == -1).all() and (buffer[:, :, :, 7 + n:] == -1).all()
    for position in (len(record) - 9, len(record) - 9 - 4 * 4):  # the last token, past any n < 8
        broken = bytearray(record)
        broken[position] ^= 0x01
        with pytest.raises(CorruptRecord, match="checksum"):
            decode_into(bytes(broken), lambda h: np.zeros((12, 5, 16), dtype=np.uint8))


def test_decode_into_pieces_copies_the_rows_each_takes_and_verifies_those_none_takes() -> None:
    from tierkv.codec import SPREAD_CHECKSUM_RUN, decode_into

    # A restore whose layers are cut to their windows: rows 0-3 (layer 0) and 8-11 (layer 2) land
    # in arrays of their own, rows 4-7 (layer 1, whose window no longer reaches the block) in none.
    # A payload of rows larger than a checksum run too, so that runs split inside each piece.
    for shape in ((3, 2, 2, 8, 4), (3, 2, 2, 2, (SPREAD_CHECKSUM_RUN // 4) + 3)):
        header, payload, record = make_record(shape=shape, dtype="float32")
        rows, tokens, width = 12, shape[3], shape[4] * 4
        src = np.frombuffer(payload, dtype=np.uint8).reshape(rows, tokens, width)
        for n in (tokens, 1):
            a = np.full((4, n + 3, width), 7, dtype=np.uint8)
            b = np.full((4, n + 3, width), 7, dtype=np.uint8)
            assert decode_into(record, lambda h: [(0, a[:, 1:1 + n]), (8, b[:, 1:1 + n])]) == header
            assert np.array_equal(a[:, 1:1 + n], src[0:4, :n]) and np.array_equal(b[:, 1:1 + n], src[8:12, :n])
            assert (a[:, 0] == 7).all() and (a[:, 1 + n:] == 7).all() and (b[:, 1 + n:] == 7).all()
        per_row = tokens * width
        for row in (0, 5, 11):  # in a piece, between them, in the last
            broken = bytearray(record)
            broken[len(record) - 8 - (rows - row) * per_row + per_row - 1] ^= 0x01
            with pytest.raises(CorruptRecord, match="checksum"):
                decode_into(bytes(broken), lambda h: [(0, np.zeros((4, 1, width), np.uint8)),
                                                      (8, np.zeros((4, 1, width), np.uint8))])
        assert decode_into(record, lambda h: []) == header  # no layer takes it: verified alone
    # Pieces out of order, overlapping, past the payload's rows, or of another width: refused.
    _, _, record = make_record(shape=(3, 2, 2, 8, 4), dtype="float32")
    for pieces in ([(8, np.zeros((4, 8, 16), np.uint8)), (0, np.zeros((4, 8, 16), np.uint8))],
                   [(0, np.zeros((4, 8, 16), np.uint8)), (2, np.zeros((4, 8, 16), np.uint8))],
                   [(10, np.zeros((4, 8, 16), np.uint8))], [(0, np.zeros((4, 8, 8), np.uint8))],
                   [(0, np.zeros((4, 9, 16), np.uint8))], [(0, np.zeros((4, 8, 4), np.float32))]):
        with pytest.raises(CorruptRecord, match="does not fill"):
            decode_into(record, lambda h: pieces)


@pytest.mark.parametrize("shape, dtype", [((12, 9, 16), np.uint8), ((12, 5, 8), np.uint8), ((6, 5, 16), np.uint8),
                                          ((12, 5), np.uint8), ((12, 8, 16), np.float32)])
def test_decode_into_a_destination_the_record_does_not_fit_is_corrupt(shape: tuple[int, ...], dtype: type) -> None:
    from tierkv.codec import decode_into

    # More tokens than the record holds, another head_dim or head count, another rank, another
    # dtype than bytes (np.copyto cast each byte to a float: 4 bytes each): never a partial,
    # broadcast or cast copy.
    _, _, record = make_record(shape=(3, 2, 2, 8, 4), dtype="float32")
    with pytest.raises(CorruptRecord, match="does not fill"):
        decode_into(record, lambda h: np.zeros(shape, dtype=dtype))


# One byte over the record: the shortest pad (a boundary the round sizes above never met).
@pytest.mark.parametrize("min_bytes", [0, 100, len(SMALL_RECORD) + 1, 2048, 2049, 70000])
def test_a_record_given_a_minimum_length_is_padded_inside_its_header(min_bytes: int) -> None:
    # The disk tier writes every record at least half an LMDB page long, so that none sits inside
    # a B-tree leaf (whose stale copies a delete cannot zero); readers see the same record.
    record = encode_array(SMALL_HEADER, SMALL_PAYLOAD, min_bytes=min_bytes).tobytes()
    assert len(record) == record_size(SMALL_HEADER, min_bytes) >= min_bytes
    assert len(record) - head_size(SMALL_HEADER, min_bytes) == SMALL_HEADER.payload_nbytes + 8
    if min_bytes <= len(SMALL_RECORD):
        assert record == SMALL_RECORD  # long enough already: not padded
    else:
        assert len(record) <= min_bytes + 9  # the pad's own framing, no more
    header, payload = decode(record)
    assert header == SMALL_HEADER and bytes(payload) == bytes(SMALL_PAYLOAD)
    assert decode_header(record) == SMALL_HEADER
    assert decode_head(record[:head_end(record)]) == (SMALL_HEADER, len(record))
