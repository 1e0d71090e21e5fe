"""tierkv.hashing: chained block keys are deterministic across processes, separate tenants and
models, and do not depend on how the token ids are held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv.hashing
from tierkv.hashing import HASH_SEED, HASH_VERSION, KEY_BYTES, block_key, chain_keys, key_of_bytes, root_key, token_bytes

FP = b"golden-fingerprint"
token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40)


# -- golden values: a change of seed, version, layout or root encoding must be deliberate -------
GOLDEN_ROOT = "33695881041bc7f5b009274ead6aae3f"
GOLDEN_ROOT_ACME = "b1c92978c62e294290a582a4503869e2"
GOLDEN_CHAIN = ["48d0d93742fe8be556d11ff70d20bfb5", "f94dc4e4b51589d4ebd3ec7ac4a75f95"]
GOLDEN_TAIL = "31b0e400ddd49e665bc900bd35a3373b"


def test_constants_are_pinned() -> None:
    assert HASH_VERSION == 1
    assert HASH_SEED == 0x7469_6572_6B76_0001
    assert KEY_BYTES == 16


def test_golden_values() -> None:
    root = root_key(FP, None)
    assert root.hex() == GOLDEN_ROOT
    assert root_key(FP, "acme").hex() == GOLDEN_ROOT_ACME
    keys = chain_keys(root, list(range(1, 9)), 4)
    assert [k.hex() for k in keys] == GOLDEN_CHAIN
    assert block_key(keys[-1], [9, 10]).hex() == GOLDEN_TAIL


def test_block_key_is_the_documented_formula() -> None:
    # block_key(parent, ids) = xxh3_128(parent || ids as little-endian int64, seed=HASH_SEED)
    parent = bytes(range(16))
    ids = [1, 2, 300, 2**40]
    data = parent + b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
    assert block_key(parent, ids) == xxhash.xxh3_128_digest(data, seed=HASH_SEED)
    assert key_of_bytes(parent, token_bytes(ids)) == block_key(parent, ids)


def test_root_key_is_the_documented_formula() -> None:
    payload = msgpack.packb(["tierkv-root", HASH_VERSION, FP, "t"], use_bin_type=True)
    assert root_key(FP, "t") == xxhash.xxh3_128_digest(payload, seed=HASH_SEED)


def test_token_bytes_is_little_endian_int64() -> None:
    assert token_bytes([1, 256, -1]) == (
        b"\x01\x00\x00\x00\x00\x00\x00\x00" + b"\x00\x01\x00\x00\x00\x00\x00\x00" + b"\xff" * 8
    )
    assert token_bytes([]) == b""


# -- determinism ----------------------------------------------------------------------------------
def test_keys_are_sixteen_bytes() -> None:
    root = root_key(FP, None)
    assert type(root) is bytes and len(root) == KEY_BYTES
    key = block_key(root, [1, 2, 3])
    assert type(key) is bytes and len(key) == KEY_BYTES
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in chain_keys(root, range(10), 3))


@given(token_lists, st.integers(min_value=1, max_value=8), st.text(max_size=8) | st.none())
def test_deterministic_in_process(ids: list[int], block_size: int, tenant: str | None) -> None:
    assert root_key(FP, tenant) == root_key(bytes(FP), tenant)
    root = root_key(FP, tenant)
    assert chain_keys(root, ids, block_size) == chain_keys(root, list(ids), block_size)
    assert block_key(root, ids) == block_key(root, list(ids))


# The child loads hashing.py by its path: importing the tierkv package would pull in torch and
# transformers (seconds per process) for a module that needs neither.
_CHILD = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("child_hashing", sys.argv[1])
hashing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hashing)
block_key, chain_keys, root_key = hashing.block_key, hashing.chain_keys, hashing.root_key
out = []
for fp, tenant, ids, bs in json.loads(sys.stdin.read()):
    root = root_key(bytes.fromhex(fp), tenant)
    keys = chain_keys(root, ids, bs)
    tail = block_key(keys[-1] if keys else root, ids[len(keys) * bs:])
    out.append([root.hex(), [k.hex() for k in keys], tail.hex()])
print(json.dumps(out))
"""


def _in_process(cases: list[list[object]]) -> list[list[object]]:
    out = []
    for fp, tenant, ids, bs in cases:
        root = root_key(bytes.fromhex(fp), tenant)
        keys = chain_keys(root, ids, bs)
        tail = block_key(keys[-1] if keys else root, ids[len(keys) * bs:])
        out.append([root.hex(), [k.hex() for k in keys], tail.hex()])
    return out


def test_stable_across_processes() -> None:
    cases: list[list[object]] = [
        [FP.hex(), None, list(range(1, 11)), 4],
        [FP.hex(), "acme", list(range(1, 11)), 4],
        [b"other".hex(), "acme", [5, 6, 7], 2],
        [b"".hex(), "", [], 1],
        [FP.hex(), "a\x00b", [2**31 - 1, 0, 7, 7, 7], 3],
        [FP.hex(), "t\u00e9n\u00e4nt-\U0001f600", list(range(100, 140)), 16],
    ]
    expected = _in_process(cases)
    # Python's own hash randomisation differs per process and must not matter.
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, tierkv.hashing.__file__], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed})
        for seed in ("0", "12345")
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(json.dumps(cases), timeout=60)
        assert proc.returncode == 0, stderr
        assert json.loads(stdout) == expected
    # and the golden values hold in the other process too
    assert expected[0][0] == GOLDEN_ROOT


# -- separation -----------------------------------------------------------------------------------
def test_root_differs_by_tenant_and_fingerprint() -> None:
    roots = {
        root_key(FP, None),
        root_key(FP, ""),
        root_key(FP, "acme"),
        root_key(FP, "ACME"),
        root_key(b"other", None),
        root_key(b"other", "acme"),
        root_key(b"", None),
        root_key(b"", ""),
    }
    assert len(roots) == 8


HOSTILE_TENANTS: list[str | None] = [
    None, "", "a", "b", "ab", "a\x00b", "a\x00", "\x00a", "\x00", "a b", "a/b", "a:b", "a|b", "a,b", "a\nb",
    "None", "null", "tierkv-root", "\x00" * 16, "a" * 10_000, "a" * 10_001, "é", "e\u0301", "\U0001f600",
    "\ufeffa", "a\u200bb", "\x00" * 3 + "a",
]


def test_hostile_tenant_names_never_collide() -> None:
    roots = [root_key(FP, t) for t in HOSTILE_TENANTS]
    assert len(set(roots)) == len(HOSTILE_TENANTS)


def test_tenant_cannot_be_shaped_into_fingerprint_plus_tenant() -> None:
    # Concatenated text would make (fp="ab", tenant="c") equal (fp="a", tenant="bc").
    pairs = [(b"ab", "c"), (b"a", "bc"), (b"abc", ""), (b"abc", None), (b"", "abc"), (b"a\x00b", "c"),
             (b"a", "\x00bc")]
    roots = [root_key(fp, t) for fp, t in pairs]
    assert len(set(roots)) == len(pairs)


@given(st.lists(st.text(max_size=6) | st.none(), min_size=2, max_size=6, unique=True))
def test_distinct_tenants_distinct_roots(tenants: list[str | None]) -> None:
    roots = [root_key(FP, t) for t in tenants]
    assert len(set(roots)) == len(tenants)


def test_same_tokens_different_tenants_share_no_key() -> None:
    ids = list(range(1, 17))
    a = chain_keys(root_key(FP, "a"), ids, 4)
    b = chain_keys(root_key(FP, "b"), ids, 4)
    assert len(a) == len(b) == 4
    assert not set(a) & set(b)


def test_tenant_must_be_str_or_none() -> None:
    with pytest.raises(TypeError, match="tenant must be a str or None"):
        root_key(FP, b"acme")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        root_key(FP, 5)  # type: ignore[arg-type]


# -- chaining -------------------------------------------------------------------------------------
@given(token_lists, st.integers(min_value=1, max_value=9))
def test_chain_keys_equals_iterated_block_key(ids: list[int], block_size: int) -> None:
    root = root_key(FP, "t")
    expected = []
    parent = root
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_key(parent, ids[start:start + block_size])
        expected.append(parent)
    assert chain_keys(root, ids, block_size) == expected
    assert len(expected) == len(ids) // block_size


def test_chain_keys_of_short_input_is_empty() -> None:
    root = root_key(FP, None)
    assert chain_keys(root, [], 4) == []
    assert chain_keys(root, [1, 2, 3], 4) == []
    assert len(chain_keys(root, [1, 2, 3, 4], 4)) == 1


def test_chain_is_a_prefix_chain() -> None:
    root = root_key(FP, None)
    short = chain_keys(root, list(range(12)), 4)
    long = chain_keys(root, list(range(12)) + [99, 98, 97, 96, 95], 4)
    assert long[:3] == short
    assert len(long) == 4


def test_divergence_changes_every_later_key() -> None:
    root = root_key(FP, None)
    a = chain_keys(root, list(range(16)), 4)
    ids = list(range(16))
    ids[5] = 1000
    b = chain_keys(root, ids, 4)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_partial_tail_differs_from_full_blocks() -> None:
    root = root_key(FP, None)
    ids = list(range(1, 9))
    full = chain_keys(root, ids, 4)
    tails = [block_key(full[0], ids[4:4 + n]) for n in range(0, 4)]
    assert len(set(tails)) == 4
    assert not set(tails) & set(full)
    # the tail of length block_size is exactly the full block's key
    assert block_key(full[0], ids[4:8]) == full[1]
    # a tail keyed under the root differs from the first full block
    assert block_key(root, ids[:3]) != full[0]


def test_block_size_one_gives_one_key_per_token() -> None:
    root = root_key(FP, None)
    keys = chain_keys(root, [7, 8, 9], 1)
    assert keys == [block_key(root, [7]), block_key(block_key(root, [7]), [8]),
                    block_key(block_key(block_key(root, [7]), [8]), [9])]


@pytest.mark.parametrize("block_size", [0, -1, -256])
def test_chain_keys_rejects_block_size_below_one(block_size: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        chain_keys(root_key(FP, None), [1, 2, 3], block_size)


def test_block_size_changes_keys() -> None:
    root = root_key(FP, None)
    ids = list(range(8))
    assert not set(chain_keys(root, ids, 2)) & set(chain_keys(root, ids, 4))


# -- token id containers --------------------------------------------------------------------------
@settings(deadline=None)
@given(token_lists)
def test_token_id_containers_give_the_same_key(ids: list[int]) -> None:
    root = root_key(FP, None)
    expected = block_key(root, ids)
    expected_chain = chain_keys(root, ids, 3)
    for form in (
        ids,
        tuple(ids),
        np.array(ids, dtype=np.int32),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=">i8"),  # big-endian input is converted, not reinterpreted
        np.repeat(np.array(ids, dtype=np.int64), 2)[::2],  # non-contiguous view
        torch.tensor(ids, dtype=torch.long).numpy(),
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(ids, dtype=torch.int32),
    ):
        assert block_key(root, form) == expected
        assert chain_keys(root, form, 3) == expected_chain


def test_range_input() -> None:
    root = root_key(FP, None)
    assert block_key(root, range(5)) == block_key(root, [0, 1, 2, 3, 4])
    assert chain_keys(root, range(8), 4) == chain_keys(root, np.arange(8, dtype=np.int32), 4)


def test_token_values_matter_beyond_low_byte() -> None:
    root = root_key(FP, None)
    keys = {block_key(root, [v]) for v in (1, 257, 65537, 2**32 + 1, 2**40 + 1)}
    assert len(keys) == 5


def test_parent_matters() -> None:
    a = block_key(bytes(16), [1, 2])
    b = block_key(bytes(15) + b"\x01", [1, 2])
    assert a != b


def test_all_pairs_of_small_blocks_distinct() -> None:
    root = root_key(FP, None)
    blocks = [[a, b] for a in range(6) for b in range(6)] + [[a] for a in range(6)] + [[]]
    keys = [block_key(root, blk) for blk in blocks]
    assert len(set(keys)) == len(blocks)
    for (i, x), (j, y) in combinations(enumerate(keys), 2):
        assert (x == y) == (blocks[i] == blocks[j])
