"""The writes a failed disk owes: deletes and session references, kept for the store to retry.

Protocol (``TieredStore`` calls all of it under its lock):

* ``append(op)`` owes a ``DeleteBlocks`` or ``DropRefs`` at the back; a ``PutRefs`` goes through
  ``owe_refs``.
* ``owe_refs(sid, tenant, keys)`` owes a session's references in the one ``PutRefs`` it owes,
  where that entry already is, or at the back as a new one: one ``PutRefs`` a session.
* ``take()`` hands the whole list over for a retry, which leaves in it what it did not queue;
  ``put_back(ops)`` puts that back at the front, ahead of what was owed meanwhile (a session
  owing references in both keeps one entry, the earlier). Until then the ops taken still count
  as owed, in front: a retry that never reached ``put_back`` lost none of them.
* ``drop_refs(sid)`` lets go of what a session owes, once it is no longer tracked (forgotten,
  or untracked): a retry would write none of it, and kept until a retry reached it (a flush's
  probe, 64 a flush; without flushes, never), a disk that stays failed owed one more entry for
  each session that came and went whose failed references were reaped while it lived.
* Iteration, ``len`` and truth read the list in retry order.

Why an index: a failed ``PutRefs`` looked for its session's entry by scanning the list, under the
store's lock: 50,000 owed ops and 64 failed PutRefs a flush made 3.2 million checks (about 2 ms a
failed write). ``_puts`` finds it in one look-up, and is rebuilt with the list (``put_back``).

An exception part-way (another signal's handler: Ctrl-C alone is held off) may come at any call
or loop; the store's reaping runs again what it cut short. So owing is idempotent: the list is
keyed by the op itself (``id``; an op in it is alive), and owing an op already owed leaves the one
entry where it is; a key of a ``PutRefs`` is noted as held only after it is in its keys (noted
first, one an exception cut short there was never written, nor owed again), and a merge first
notes the one an exception left unnoted. ``put_back`` builds the new list aside and swaps it in
with no call between, and ``take`` keeps what it handed over until then (``_taken``): an
exception in ``put_back``'s loop, or at its call, lost every op taken.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Union

from .tiers.disk import DeleteBlocks, DropRefs, PutRefs

OwedOp = Union[DeleteBlocks, DropRefs, PutRefs]


class OwedOps:
    """The owed ops in retry order, and each session's ``PutRefs`` among them by its sid."""

    __slots__ = ("_ops", "_puts", "_taken")

    def __init__(self) -> None:
        # In retry order, by the order they were owed in, keyed by id(op): owing an op again
        # (a reap an exception cut short, run again) keeps its one entry where it is. A dict: a
        # session's entry leaves in one step (drop_refs).
        self._ops: dict[int, OwedOp] = {}
        # sid -> (its PutRefs in _ops, that entry's keys as a set, its key in _ops): a merge adds
        # only new keys, without reading the keys already owed.
        self._puts: dict[bytes, tuple[PutRefs, set[bytes], int]] = {}
        # What ``take`` handed over, still owed (ahead of ``_ops``) until ``put_back``.
        self._taken: list[OwedOp] = []

    def __len__(self) -> int:
        return len(self._taken) + len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._taken or self._ops)

    def __iter__(self) -> Iterator[OwedOp]:
        return itertools.chain(self._taken, self._ops.values())

    def append(self, op: OwedOp) -> None:
        """Owe ``op`` after everything owed so far (a ``PutRefs``: in its session's entry); an op
        owed already keeps its one entry."""
        if isinstance(op, PutRefs):
            self.owe_refs(op.sid, op.tenant, op.keys)
        else:
            place = id(op)
            self._ops[place] = op

    def owe_refs(self, sid: bytes, tenant: str | None, keys: Iterable[bytes]) -> None:
        """Owe ``sid``'s references to ``keys`` in its one ``PutRefs``, which keeps its place."""
        entry = self._puts.get(sid)
        if entry is None:
            op = PutRefs(sid, tenant, list(dict.fromkeys(keys)))
            place, held = id(op), set(op.keys)
            self._ops[place] = op
            self._puts[sid] = (op, held, place)
            return
        op, held, _ = entry
        op.tenant = tenant
        if len(held) != len(op.keys):
            held.update(op.keys)  # the key an exception left between its append and its note here
        for key in keys:
            if key not in held:
                # In this order: a key noted held and not yet in the keys was never written.
                op.keys.append(key)
                held.add(key)

    def put_for(self, sid: bytes) -> PutRefs | None:
        """The ``PutRefs`` that ``sid`` owes, or None."""
        entry = self._puts.get(sid)
        return entry[0] if entry is not None else None

    def drop_refs(self, sid: bytes) -> None:
        """Owe none of ``sid``'s references (a session no longer tracked)."""
        entry = self._puts.get(sid)
        if entry is not None:
            # Statements without a call between them, where no signal's handler runs: index
            # first, as the entry's keys merge only through it.
            del self._puts[sid]
            del self._ops[entry[2]]

    def take(self) -> list[OwedOp]:
        """Every owed op, in retry order, for a retry that leaves in the list it returns what it
        did not queue; they count as owed until ``put_back``."""
        ops = [*self._taken, *self._ops.values()]
        self._taken, self._ops, self._puts = ops, {}, {}
        return ops

    def put_back(self, ops: list[OwedOp]) -> None:
        """Owe ``ops`` (the untried rest of a ``take``) ahead of what was owed since, and nothing
        else ``take`` handed over. Rebuilds the index: once a retry, as long as the list, where
        the retry's slicing already is."""
        if not ops:
            self._taken = []
            return
        merged = OwedOps()
        for op in [*ops, *self._ops.values()]:
            merged.append(op)
        self._taken, self._ops, self._puts = [], merged._ops, merged._puts
