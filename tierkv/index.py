"""The store's index: where each block rests, who references it, and LRU order per tier.

Pure bookkeeping over keys and sizes (no torch, no I/O), so the policy is testable on its own.

* ``BlockMeta`` is one block: its key, parent key, tenant, token ids, sizes, where it rests in
  memory (``resident``: DEVICE, HOST or None; the two memory tiers are exclusive) and its disk
  state (NONE, PENDING while a write is queued, DURABLE once its transaction committed).
* ``Index.lru[tier]`` orders the blocks resting in each tier, least recently used first.
* ``Index.children(parent, first_token)`` finds stored continuations of a prefix, so a
  conversation that diverges inside a block, or ends in a partial tail, restores as far as its
  token ids agree. Past ``ORDERED_FROM`` of them (every conversation's first message after a
  shared system prompt and chat template), they are also kept in token order, and
  ``nearest``, ``prefixes_of`` and ``related`` answer from a few of them, not all (a reopen
  adds its blocks unordered, then sorts each such bucket once: ``order``).
* Sessions reference blocks; a block referenced by no session stays until it is evicted, unless
  its last session was forgotten. The store keeps a session only while one of its blocks is
  referenced by it alone (``TieredStore._untrack_if_hollow``), so sessions are bounded by blocks.
"""

from __future__ import annotations

import bisect
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .hashing import token_bytes

#: Continuations of one prefix with one first token from which they are also kept in token order
#: (``Index._ordered``). Below it a look-up reads each of them; past it, a chat deployment's
#: shared system prompt, whose continuations are every conversation's first message, made each
#: new conversation's ``open`` read every conversation stored (16 ms at 4,000 conversations,
#: growing with every one; 0.5 ms at 130).
ORDERED_FROM = 16


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids two 1-d arrays of ids share."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _shared_tokens(a: bytes, b: bytes) -> int:
    """``common_prefix`` of two ``token_bytes``."""
    return common_prefix(np.frombuffer(a, "<i8", len(a) // 8), np.frombuffer(b, "<i8", len(b) // 8))


def narrow_ids(ids: np.ndarray) -> np.ndarray:
    """A block's ids as its ``BlockMeta`` keeps them, a copy: int32 where every id fits (every
    vocabulary there is), else int64. Half the bytes: a block's ids were most of its memory in the
    index at larger block sizes (2 KiB of 2.2 at 256 tokens). Compare them as arrays or through
    ``token_bytes``, never by their own bytes."""
    small = ids.astype(np.int32)
    return small if bool((small == ids).all()) else np.array(ids, dtype=np.int64)


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


#: ``BlockMeta.sessions`` of a block no session references.
NO_SESSIONS: frozenset[bytes] = frozenset()


@dataclass(slots=True, eq=False)
class BlockMeta:
    key: bytes
    parent: bytes
    tenant: str | None
    token_ids: np.ndarray  # 1-D: int32 where every id fits, else int64 (``narrow_ids``)
    nbytes: int  # tensor bytes in a memory tier
    record_bytes: int  # bytes it takes on disk: the record in whole LMDB pages
    resident: Tier | None = None
    disk: DiskState = DiskState.NONE
    # The sessions referencing it, changed through ``Index`` only: none, the one ``SessionInfo.alone``
    # of the session referencing it alone (shared by that session's blocks), or a set of its own
    # for several. A set each took 216 B a block (14% of the index's memory at 10^5 blocks), and
    # nearly every block is one session's.
    sessions: set[bytes] | frozenset[bytes] = NO_SESSIONS
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
    # ``frozenset({sid})``: the ``sessions`` of each block that this session alone references.
    alone: frozenset[bytes] = NO_SESSIONS


class Index:
    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockMeta] = {}
        self.sessions: dict[bytes, SessionInfo] = {}
        self.lru: dict[Tier, OrderedDict[bytes, None]] = {t: OrderedDict() for t in Tier}
        self.bytes: dict[Tier, int] = {t: 0 for t in Tier}
        self.disk_peak = 0  # the most of ``bytes[Tier.DISK]`` at any moment
        # parent -> its continuations by first token; a parent of one continuation holds that
        # block's key alone (``meta.key`` itself, not a copy): nearly every block is its parent's
        # only continuation, and a dict and a set for it took 400-500 B a block (a third of the
        # index's memory at 10^5 blocks).
        self._children: dict[bytes, bytes | dict[int, set[bytes]]] = {}
        # The buckets of ``_children`` that reached ``ORDERED_FROM`` keys, by (parent, first
        # token): their keys (and, where another signal's handler cut an add or a removal short,
        # that one too) sorted by their blocks' token bytes, until none is left. In a list sorted
        # so, the stored continuation sharing the most leading tokens with any ids lies beside
        # where those ids would go.
        self._ordered: dict[tuple[bytes, int], list[bytes]] = {}
        # Each tenant's blocks, in the order ``blocks`` holds them: ``forget(tenant=...)`` read
        # every block of every tenant to find one tenant's (10 ms at 100,000 blocks, a forget of
        # a tenant of a few blocks as of one of thousands).
        self._tenants: dict[str | None, dict[bytes, None]] = {}
        # One int object for each size blocks have (a full block's, a tail's of each length):
        # each block computed its own two, 56 B a block.
        self._sizes: dict[int, int] = {}
        # Sessions by name, and those read back from disk (names are never written there) by
        # tenant: ``forget(session=...)`` without a tenant read every session to find its own
        # (0.27 ms at 10,000 sessions). Noted before a session is tracked or named, let go of after
        # it is untracked (``drop_session``): an entry another signal's handler leaves behind names
        # no session of that name, and ``named`` passes it over.
        # (Dicts as ordered sets: a forget drops the sessions of one name in the order they came.)
        self._by_name: dict[str, dict[bytes, None]] = {}
        self._nameless: dict[str | None, dict[bytes, None]] = {}

    def _tokens_of(self, key: bytes) -> bytes:
        return token_bytes(self.blocks[key].token_ids)

    # -- blocks -------------------------------------------------------------------------------
    def add(self, meta: BlockMeta, ordered: bool = True) -> None:
        """Index a block; ``ordered=False``: its bucket's order is left to ``order()`` (a reopen's
        adds, in last-use order: inserted one at a time, the keys a bucket held were moved with each,
        6.8 us an add at 10,000 continuations of one block, 52 us at 300,000)."""
        meta.nbytes = self._sizes.setdefault(meta.nbytes, meta.nbytes)
        meta.record_bytes = self._sizes.setdefault(meta.record_bytes, meta.record_bytes)
        self.blocks[meta.key] = meta
        self._tenants.setdefault(meta.tenant, {})[meta.key] = None
        first = int(meta.token_ids[0])
        held = self._children.get(meta.parent)
        if held is None and ORDERED_FROM > 1:
            self._children[meta.parent] = meta.key
            return
        if isinstance(held, bytes):
            if held == meta.key:
                return
            # One assignment: a cut before it leaves the lone key, after it the same key in a bucket.
            self._children[meta.parent] = held = {self._first_of(held): {held}}
        keys = (held if held is not None else self._children.setdefault(meta.parent, {})).setdefault(first, set())
        if meta.key not in keys and ordered:
            # Ordered before the bucket takes it: a cut between the two leaves a key in the order
            # that the bucket lacks, which ``remove`` still finds there, never one in the bucket
            # that a look-up in the order misses for good.
            order = self._ordered.get((meta.parent, first))
            if order is not None:
                bisect.insort(order, meta.key, key=self._tokens_of)
            elif len(keys) + 1 >= ORDERED_FROM:
                self._ordered[(meta.parent, first)] = sorted([*keys, meta.key], key=self._tokens_of)
        keys.add(meta.key)

    def order(self) -> None:
        """Order the buckets that reached ``ORDERED_FROM`` keys whose adds left it (``add(...,
        ordered=False)``), one sort each."""
        for parent, entry in self._children.items():
            for first, keys in self._by_first(entry).items():
                held = self._ordered.get((parent, first), [])
                if len(keys) >= ORDERED_FROM and not keys <= set(held):
                    self._ordered[(parent, first)] = sorted({*keys, *held}, key=self._tokens_of)

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
        first = int(meta.token_ids[0])
        if isinstance(by_first, bytes):
            if by_first == key:
                del self._children[meta.parent]
        elif by_first is not None:
            keys = by_first.get(first)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del by_first[first]
            if not by_first:
                del self._children[meta.parent]
            elif len(by_first) == 1 and ORDERED_FROM > 1:
                # Back to the lone key once one is left (a session's tail replaced by a longer one
                # left every such parent with a dict and a set for good).
                (left,) = by_first.values()
                if len(left) == 1:
                    (only,) = left
                    self._children[meta.parent] = only
        # After the bucket, as ``add`` orders a key before it: the order holds every key its
        # bucket does (a cut leaves it one more, found by the removal done again).
        ordered = self._ordered.get((meta.parent, first))
        if ordered is not None:
            self._unorder(ordered, meta)
            if not ordered:
                del self._ordered[(meta.parent, first)]
        for sid in meta.sessions:
            info = self.sessions.get(sid)
            if info is not None:
                info.keys.discard(key)
        mine = self._tenants.get(meta.tenant)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._tenants[meta.tenant]
        del self.blocks[key]
        return meta

    def children(self, parent: bytes, first_token: int) -> Iterator[BlockMeta]:
        for key in self._by_first(self._children.get(parent)).get(first_token, ()):
            yield self.blocks[key]

    def _first_of(self, key: bytes) -> int:
        return int(self.blocks[key].token_ids[0])

    def _by_first(self, entry: bytes | dict[int, set[bytes]] | None) -> dict[int, set[bytes]]:
        """A parent's ``_children`` entry as continuations by first token (a lone key as one)."""
        if entry is None:
            return {}
        if isinstance(entry, bytes):
            return {self._first_of(entry): {entry}}
        return entry

    def _unorder(self, ordered: list[bytes], meta: BlockMeta) -> None:
        tokens = token_bytes(meta.token_ids)
        at = bisect.bisect_left(ordered, tokens, key=self._tokens_of)
        # Blocks of one parent and the same ids have one key; a collision's, replaced, did not.
        while at < len(ordered) and self._tokens_of(ordered[at]) == tokens:
            if ordered[at] == meta.key:
                del ordered[at]
                return
            at += 1

    def nearest(self, parent: bytes, tokens: bytes) -> list[BlockMeta]:
        """Stored continuations of ``parent`` that begin with the first of ``tokens``
        (``token_bytes``, at most a block's) among which is one sharing the most leading tokens
        with them: all of them, or past ``ORDERED_FROM`` the two beside those ids in token order
        (in a sorted list the longest common prefix with any string lies beside its place)."""
        first = int.from_bytes(tokens[:8], "little", signed=True)
        ordered = self._ordered.get((parent, first))
        if ordered is None:
            return list(self.children(parent, first))
        at = bisect.bisect_left(ordered, tokens, key=self._tokens_of)
        return [self.blocks[key] for key in ordered[max(at - 1, 0):at + 1]]

    def prefixes_of(self, parent: bytes, tokens: bytes) -> list[BlockMeta]:
        """Stored continuations of ``parent`` whose ids are a prefix of ``tokens`` (``token_bytes``):
        exactly those past ``ORDERED_FROM``, all that begin with the same id below it."""
        first = int.from_bytes(tokens[:8], "little", signed=True)
        ordered = self._ordered.get((parent, first))
        if ordered is None:
            return list(self.children(parent, first))
        found = []
        # Every prefix at or past ``end`` is found. A block before it that is no prefix shares
        # ``n`` whole ids with ``tokens`` and sorts below them at the next: each prefix longer
        # than ``n`` sorts above it, so the prefixes left are those of the first ``n`` ids, which
        # sort at or below them (``n`` smaller each time: at most a block's ids of searches).
        end = bisect.bisect_right(ordered, tokens, key=self._tokens_of)
        while end > 0:
            key = ordered[end - 1]
            have = self._tokens_of(key)
            if tokens.startswith(have):
                found.append(self.blocks[key])
                end -= 1
            else:
                end = bisect.bisect_right(ordered, tokens[:8 * _shared_tokens(have, tokens)], hi=end - 1,
                                          key=self._tokens_of)
        return found

    def related(self, parent: bytes, tokens: bytes) -> list[BlockMeta]:
        """Stored continuations of ``parent`` whose ids are a prefix of ``tokens`` or begin with
        them: exactly those past ``ORDERED_FROM``, all that begin with the same id below it."""
        first = int.from_bytes(tokens[:8], "little", signed=True)
        ordered = self._ordered.get((parent, first))
        if ordered is None:
            return list(self.children(parent, first))
        found = [meta for meta in self.prefixes_of(parent, tokens) if meta.n_tokens * 8 < len(tokens)]
        # Those beginning with ``tokens`` sort together, from ``tokens`` on.
        at = bisect.bisect_left(ordered, tokens, key=self._tokens_of)
        while at < len(ordered) and self._tokens_of(ordered[at]).startswith(tokens):
            found.append(self.blocks[ordered[at]])
            at += 1
        return found

    def of_tenant(self, tenant: str | None) -> list[BlockMeta]:
        """The tenant's blocks, in the order ``blocks`` holds them."""
        return [self.blocks[key] for key in self._tenants.get(tenant, ())]

    def all_children(self, parent: bytes) -> list[BlockMeta]:
        """Every stored continuation of ``parent``, whatever its first token."""
        return [self.blocks[key] for keys in self._by_first(self._children.get(parent)).values() for key in keys]

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
            self._note_name(sid, tenant, name)
            info = self.sessions[sid] = SessionInfo(tenant, name)
        elif info.name is None and name is not None:
            self._note_name(sid, info.tenant, name)
            info.name = name  # read back from disk, where names are not kept; known again
            self._drop_name(sid, info.tenant, None)
        if meta.key in info.keys:
            return False
        if sid not in info.alone:
            info.alone = frozenset((sid,))
        held = meta.sessions
        # The block's new sessions made first (calls); None: its own set, grown in place.
        grown = info.alone if not held else (set(held) | {sid} if isinstance(held, frozenset) else None)
        # Both sides with no call between (in-place set operators and stores, not methods), where
        # no signal's handler runs: one raising between two add()s left the session naming a block
        # that did not name it, whose removal then left the key behind (a KeyError at its next
        # commit).
        info.keys |= {meta.key}
        if grown is None:
            meta.sessions |= {sid}
        else:
            meta.sessions = grown
        return True

    def drop_session(self, sid: bytes) -> None:
        """Untrack a session (its blocks no longer name it)."""
        info = self.sessions.pop(sid, None)
        if info is not None:
            self._drop_name(sid, info.tenant, info.name)

    def named(self, name: str, key_of: Callable[[str | None], bytes]) -> list[bytes]:
        """The sessions named ``name``, and those without a name (read back from disk) whose key
        is ``key_of(tenant)``: one call per tenant of such sessions."""
        sessions = self.sessions
        found = [sid for sid in self._by_name.get(name, ()) if sid in sessions and sessions[sid].name == name]
        for tenant, sids in self._nameless.items():
            sid = key_of(tenant)
            if sid in sids and sid in sessions and sessions[sid].name is None:
                found.append(sid)
        return found

    def _note_name(self, sid: bytes, tenant: str | None, name: str | None) -> None:
        if name is None:
            self._nameless.setdefault(tenant, {})[sid] = None
        else:
            self._by_name.setdefault(name, {})[sid] = None

    def _drop_name(self, sid: bytes, tenant: str | None, name: str | None) -> None:
        table, at = (self._nameless, tenant) if name is None else (self._by_name, name)
        sids = table.get(at)  # type: ignore[call-overload]
        if sids is not None:
            sids.pop(sid, None)
            if not sids:
                del table[at]  # type: ignore[arg-type]

    def unref(self, sid: bytes, meta: BlockMeta) -> None:
        info = self.sessions.get(sid)
        left = self._without(meta, sid)
        # As ref's: both sides together.
        if left is None:
            meta.sessions -= {sid}
        else:
            meta.sessions = left
        if info is not None:
            info.keys -= {meta.key}

    def unname(self, meta: BlockMeta, sid: bytes) -> None:
        """``meta`` no longer names ``sid`` among its sessions (the session's side is the caller's:
        a session leaving the index)."""
        left = self._without(meta, sid)
        if left is None:
            meta.sessions -= {sid}
        else:
            meta.sessions = left

    @staticmethod
    def _without(meta: BlockMeta, sid: bytes) -> frozenset[bytes] | set[bytes] | None:
        """What ``meta.sessions`` becomes without ``sid``: ``NO_SESSIONS`` where none is left, the
        same object where it lacks ``sid``, or None: its own set, which shrinks in place (a
        frozenset is one session's ``alone``, which ``-=`` would copy)."""
        held = meta.sessions
        if sid not in held:
            return held
        if isinstance(held, frozenset) or len(held) == 1:
            return NO_SESSIONS
        return None
