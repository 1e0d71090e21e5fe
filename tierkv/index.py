"""The store's index: where each block rests, who references it, and LRU order per tier.

Pure bookkeeping over keys and sizes (no torch, no I/O), so the policy is testable on its own.

* ``BlockMeta`` is one block: its key, parent key, tenant, token ids, sizes, where it rests in
  memory (``resident``: DEVICE, HOST or None; the two memory tiers are exclusive) and its disk
  state (NONE, PENDING while a write is queued, DURABLE once its transaction committed).
* ``Index.lru[tier]`` orders the blocks resting in each tier, least recently used first.
* ``Index.children(parent, first_token)`` finds stored continuations of a prefix, so a
  conversation that diverges inside a block, or ends in a partial tail, restores as far as its
  token ids agree.
* Sessions reference blocks; a block referenced by no session stays until it is evicted, unless
  its last session was forgotten. The store keeps a session only while one of its blocks is
  referenced by it alone (``TieredStore._untrack_if_hollow``), so sessions are bounded by blocks.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    # The key of ``lru`` and ``bytes``: Enum's own __hash__ is Python, a point where another
    # signal's handler runs, and one raising at a look-up in the middle of ``set_disk`` or
    # ``set_resident`` left a block in a tier's LRU order and out of its bytes (the budget off
    # for good). The members are singletons: identity's hash (C) is theirs.
    __hash__ = object.__hash__


class DiskState(enum.Enum):
    NONE = 0
    PENDING = 1
    DURABLE = 2

    __hash__ = object.__hash__  # as Tier's


@dataclass(slots=True, eq=False)
class BlockMeta:
    key: bytes
    parent: bytes
    tenant: str | None
    token_ids: np.ndarray  # int64, 1-D
    nbytes: int  # tensor bytes in a memory tier
    record_bytes: int  # bytes it takes on disk: the record in whole LMDB pages
    resident: Tier | None = None
    disk: DiskState = DiskState.NONE
    sessions: set[bytes] = field(default_factory=set)
    # Its disk state was PENDING or DURABLE once: only then were references to it ever queued, so
    # only then can the disk hold one to delete.
    ever_on_disk: bool = False

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(slots=True, eq=False)
class SessionInfo:
    tenant: str | None
    name: str | None  # None for a session read back from disk, where names are never written
    keys: set[bytes] = field(default_factory=set)
    # The last block of the chain its latest commit kept: the conversation it last stored, against
    # which a returning turn's ids are compared (``TieredStore._diverged``). None until it commits
    # in this process (a session read back from disk).
    last: bytes | None = None


class Index:
    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockMeta] = {}
        self.sessions: dict[bytes, SessionInfo] = {}
        self.lru: dict[Tier, OrderedDict[bytes, None]] = {t: OrderedDict() for t in Tier}
        self.bytes: dict[Tier, int] = {t: 0 for t in Tier}
        self.disk_peak = 0  # the most of ``bytes[Tier.DISK]`` at any moment
        self._children: dict[bytes, dict[int, set[bytes]]] = {}

    # -- blocks -------------------------------------------------------------------------------
    def add(self, meta: BlockMeta) -> None:
        self.blocks[meta.key] = meta
        first = int(meta.token_ids[0])
        self._children.setdefault(meta.parent, {}).setdefault(first, set()).add(meta.key)

    def remove(self, key: bytes) -> BlockMeta | None:
        # Out of ``blocks`` last, each step before it idempotent: another signal's handler raising
        # part-way (Ctrl-C alone is held off) leaves an entry in no tier, which the store drops
        # or stores again, never a key in an LRU order, a continuation or a session that
        # ``blocks`` lacks (a KeyError at the next eviction, match or retry). Taken out first, one
        # raising as the pop returned left all three.
        meta = self.blocks.get(key)
        if meta is None:
            return None
        self.set_resident(meta, None)
        self.set_disk(meta, DiskState.NONE)
        by_first = self._children.get(meta.parent)
        if by_first is not None:
            first = int(meta.token_ids[0])
            keys = by_first.get(first)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del by_first[first]
            if not by_first:
                del self._children[meta.parent]
        for sid in meta.sessions:
            info = self.sessions.get(sid)
            if info is not None:
                info.keys.discard(key)
        del self.blocks[key]
        return meta

    def children(self, parent: bytes, first_token: int) -> Iterator[BlockMeta]:
        for key in self._children.get(parent, {}).get(first_token, ()):
            yield self.blocks[key]

    def all_children(self, parent: bytes) -> list[BlockMeta]:
        """Every stored continuation of ``parent``, whatever its first token."""
        return [self.blocks[key] for keys in self._children.get(parent, {}).values() for key in keys]

    # -- placement ----------------------------------------------------------------------------
    def set_resident(self, meta: BlockMeta, tier: Tier | None) -> None:
        if meta.resident is tier:
            return
        if meta.resident is not None:
            del self.lru[meta.resident][meta.key]
            self.bytes[meta.resident] -= meta.nbytes
        meta.resident = tier
        if tier is not None:
            self.lru[tier][meta.key] = None
            self.bytes[tier] += meta.nbytes

    def set_disk(self, meta: BlockMeta, state: DiskState) -> None:
        on_disk_before = meta.disk is not DiskState.NONE
        on_disk_after = state is not DiskState.NONE
        meta.disk = state
        meta.ever_on_disk = meta.ever_on_disk or on_disk_after
        if on_disk_before and not on_disk_after:
            del self.lru[Tier.DISK][meta.key]
            self.bytes[Tier.DISK] -= meta.record_bytes
        elif on_disk_after and not on_disk_before:
            self.lru[Tier.DISK][meta.key] = None
            self.bytes[Tier.DISK] += meta.record_bytes
            if self.bytes[Tier.DISK] > self.disk_peak:
                self.disk_peak = self.bytes[Tier.DISK]

    def touch(self, meta: BlockMeta) -> None:
        if meta.resident is not None:
            self.lru[meta.resident].move_to_end(meta.key)
        if meta.disk is not DiskState.NONE:
            self.lru[Tier.DISK].move_to_end(meta.key)

    def count(self, tier: Tier) -> int:
        return len(self.lru[tier])

    # -- sessions -----------------------------------------------------------------------------
    def ref(self, sid: bytes, tenant: str | None, name: str | None, meta: BlockMeta) -> bool:
        """Reference ``meta`` from a session; True if the reference is new."""
        info = self.sessions.get(sid)
        if info is None:
            info = self.sessions[sid] = SessionInfo(tenant, name)
        elif info.name is None:
            info.name = name  # read back from disk, where names are not kept; known again
        if meta.key in info.keys:
            return False
        # Both sides with no call between (in-place set operators, not methods), where no signal's
        # handler runs: one raising between two add()s left the session naming a block that did
        # not name it, whose removal then left the key behind (a KeyError at its next commit).
        info.keys |= {meta.key}
        meta.sessions |= {sid}
        return True

    def unref(self, sid: bytes, meta: BlockMeta) -> None:
        info = self.sessions.get(sid)
        # As ref's: both sides together.
        meta.sessions -= {sid}
        if info is not None:
            info.keys -= {meta.key}
