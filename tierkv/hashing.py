"""Chained prefix hashes over token ids. Pure: no I/O, no global state.

Protocol:
    root = root_key(model_fingerprint, tenant)          # one per (model, tenant)
    keys = chain_keys(root, token_ids, block_size)       # one key per full block
    tail = block_key(keys[-1] if keys else root, ids)    # a partial tail is keyed the same way

``block_key(parent, ids) = xxh3_128(parent || ids as little-endian int64, seed=HASH_SEED)``. The
root covers ``HASH_VERSION``, the model fingerprint and the tenant, msgpack-encoded so that no
tenant name can be shaped into another's (names are data, never concatenated text). Keys are 16
raw bytes; Python's ``hash()`` is never used since it changes per process.

A 128-bit key only names a block: callers compare the stored token ids on every hit, so a
collision degrades to a miss, never to wrong output.
"""

from __future__ import annotations

import numbers
import uuid
from collections.abc import Sequence

import msgpack
import numpy as np
import xxhash

HASH_VERSION = 1
# Fixed forever for HASH_VERSION 1; a new seed comes with a new version.
HASH_SEED = 0x7469_6572_6B76_0001
KEY_BYTES = 16

TokenIds = np.ndarray | Sequence[int]


def token_bytes(token_ids: TokenIds) -> bytes:
    """The canonical byte form of token ids: little-endian int64."""
    return np.ascontiguousarray(token_ids, dtype="<i8").tobytes()


def root_key(model_fingerprint: bytes, tenant: str | None) -> bytes:
    """The chain's root: version, model fingerprint and tenant."""
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, not {type(tenant).__name__}")
    payload = msgpack.packb(["tierkv-root", HASH_VERSION, bytes(model_fingerprint), tenant], use_bin_type=True)
    return xxhash.xxh3_128_digest(payload, seed=HASH_SEED)


def block_key(parent: bytes, token_ids: TokenIds) -> bytes:
    """The key of the block holding ``token_ids`` whose prefix is keyed ``parent``."""
    return key_of_bytes(parent, token_bytes(token_ids))


def key_of_bytes(parent: bytes, data: bytes | memoryview) -> bytes:
    """``block_key`` of ids given in their canonical bytes (``token_bytes``)."""
    h = xxhash.xxh3_128(seed=HASH_SEED)
    h.update(parent)
    h.update(data)
    return h.digest()


def chain_keys(root: bytes, token_ids: TokenIds, block_size: int) -> list[bytes]:
    """Keys of every full block of ``token_ids``, each chained on the one before."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = token_bytes(token_ids)
    step = block_size * 8
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(data) - step + 1, step):
        parent = key_of_bytes(parent, data[start : start + step])
        keys.append(parent)
    return keys


def check_name(value: object, what: str) -> None:
    """A session or tenant name: a str (or None) that encodes as UTF-8, as names are hashed."""
    if value is not None and not isinstance(value, str):
        # A user's id from a database is an int or a UUID, a header's value bytes: each named
        # the type and not what to pass.
        if isinstance(value, (bytes, bytearray)):
            remedy = f"; decode it: {what}=name.decode()"
        elif isinstance(value, (numbers.Integral, uuid.UUID)) and not isinstance(value, bool):
            remedy = f"; pass its text, {what}={str(value)!r} (str(...), the same at every turn and in forget())"
        else:
            remedy = (f"; pass a name as a str, or None for "
                      f"{'no session' if what == 'session' else 'the default tenant'}")
        raise TypeError(f"{what} must be a str or None, got {type(value).__name__}{remedy}")
    if value:
        try:
            value.encode()
        except UnicodeEncodeError:
            # Refused where a name is given rather than at commit, with the turn lost.
            raise ValueError(f"{what}={value!r} is not valid text (a lone surrogate: bytes decoded with "
                             "errors='surrogateescape'?); pass a name that encodes as UTF-8") from None
