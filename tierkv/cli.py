"""The ``tierkv`` command: the demo, the benchmark, and tools for a store on disk.

    tierkv demo [ARGS ...]            the README's chat simulation (``tierkv.demo``)
    tierkv bench [ARGS ...]           the multi-session chat-trace benchmark (``tierkv.bench``)
    tierkv stats PATH [--json]        blocks, bytes, tenants, sessions and format of a store
    tierkv check PATH [--repair] [--json]
                                      verify every record in full; --repair drops the bad ones
    tierkv clear PATH (--tenant T | --default-tenant | --session S [--session S2 ...] | --all)
    tierkv --version

``demo`` and ``bench`` hand every argument after their name to those programs (``tierkv demo
--help`` shows theirs). Results go to stdout; progress bars (tqdm, when installed) and errors go
to stderr, so ``--json`` output can be piped.

Protocol of the store commands: PATH must be an existing directory holding a tierkv store (these
commands never create one). Its meta record is read first (``DiskTier.stored_meta``) for the
block size the store was created with; then the store is opened with it, which checks the format
version and takes the directory's lock, so a store that another process holds is refused rather
than read or changed under it. ``stats`` and ``check`` open the disk tier alone; ``check``
without ``--repair`` writes nothing to the store; ``check --repair`` drops the bad records, their
session references, last-use stamps and the sessions left empty, and rewrites the damaged heads of
sound records from the records, in one write transaction. ``check`` also walks every table of the
LMDB file (sessions, references, stamps, heads, meta), not the records alone: where one's B-tree
is damaged, LMDB's writes there fail every time (a forget, a clear), and ``check --repair``
rebuilds the file from what is sound instead (``DiskTier.rebuild``; it says what was dropped).
``clear`` opens a ``TieredStore`` and calls ``forget``, so sessions, references and the zeroing of
forgotten records stay exactly as the library keeps them. A store whose LMDB file is damaged (it
does not open, or a table's B-tree is damaged: no forget can be written there) is refused with
what to do, except by ``clear --all``, which then deletes the store's files (``remove_store``: a
directory holding a store's files and nothing else, under its lock).

Exit codes (also in ``tierkv --help``): see ``EXIT_CODES``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lmdb

from . import __version__
from .interrupts import raised_by_signal_handler, stat_or_none
from .units import absolute_path, format_bytes, shell_path

if TYPE_CHECKING:
    from .codec import RecordHeader
    from .store import TieredStore
    from .tiers.disk import DiskTier, FileDamage, ScanResult

EXIT_OK = 0
EXIT_BAD_RECORDS = 1
EXIT_USAGE = 2
EXIT_IN_USE = 3
EXIT_IO = 4
EXIT_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command whose reader closed the pipe
EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}  success (check: every record is sound, or --repair dropped the bad ones)
  {EXIT_BAD_RECORDS}  check found bad records, damaged heads or damaged tables and did not repair them (demo, bench: a
     reply differed from recomputation)
  {EXIT_USAGE}  usage error; PATH is missing, is not a tierkv store, has an incompatible format version, or is
     damaged where the command cannot go on (the message says what to do); demo --store: a directory that
     cannot hold the store
  {EXIT_IN_USE}  the store is in use by another process (a store serves one process at a time; demo --store too)
  {EXIT_IO}  a disk error stopped check --repair or clear: what was to be removed may still be there
     (bench: its reports could not be written)
  {EXIT_PIPE}  the program reading the output closed the pipe (as `| head` does)
"""
# A budget no store reaches: a smaller one would make the store evict blocks as it opens.
_NO_LIMIT = 2**62


class CliError(Exception):
    """A failure the user can act on: one line on stderr and an exit code, no traceback."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- opening a store ---------------------------------------------------------------------------
def _is_directory(path: str) -> None:
    """Refuse a missing path or a file, looked at with ``stat_or_none``: ``os.path``'s helpers
    answer False to a signal handler's exception, and a timeout came out as "no such directory"."""
    if not path:  # printed as ": no such directory", naming nothing
        raise CliError(EXIT_USAGE, "PATH is empty (an unset variable?); give the store's directory")
    found = stat_or_none(path)
    if found is None:
        raise CliError(EXIT_USAGE, f"{path}: no such directory")
    if not stat.S_ISDIR(found.st_mode):
        raise CliError(EXIT_USAGE, f"{path}: is a file, not a tierkv store directory")


def _stored_meta(path: str) -> dict[str, int]:
    _is_directory(path)
    from .tiers.disk import DamagedStore, DiskTier  # imported when used: torch takes seconds, `--version` none

    try:
        return DiskTier.stored_meta(path)
    except DamagedStore as exc:  # its advice: no repair reads a store without its meta record
        raise CliError(EXIT_USAGE, str(exc)) from None
    except ValueError as exc:
        raise CliError(EXIT_USAGE, str(exc)) from None


def _file_damage(path: str) -> FileDamage:
    """``file_damage`` of the store at ``path`` (LMDB's structure, read without LMDB: some damage
    aborts LMDB's own reads), under the directory's lock; refused as every store command refuses
    a path that is not a store, or a store in use."""
    _is_directory(path)
    from .tiers.disk import DiskTier, FileDamage, file_damage

    data = os.path.join(path, "data.mdb")
    found = stat_or_none(data)
    if found is None or not stat.S_ISREG(found.st_mode) or found.st_size == 0:
        return FileDamage()  # not a store: stored_meta says so
    lock = None
    try:
        # Inside the try: a signal handler's exception cutting the with's exit short (after the
        # lock was taken) left the directory locked for the process's life.
        with _refusals():
            lock = DiskTier._lock_directory(absolute_path(path))
        return file_damage(path)
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's TimeoutError, say: the caller's, never an exit code
        raise CliError(EXIT_USAGE, f"cannot read {data}: {exc}") from None
    finally:
        if lock is not None:
            import fcntl  # POSIX: a lock was taken

            try:
                fcntl.flock(lock, fcntl.LOCK_UN)
            finally:
                os.close(lock)


@contextmanager
def _refusals() -> Iterator[None]:
    """Opening errors as exit codes: the lock (3); the format, permissions or LMDB itself (2)."""
    from .tiers.disk import StoreInUse

    try:
        yield
    except StoreInUse as exc:
        raise CliError(EXIT_IN_USE, str(exc)) from None
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            # Every command takes the store's lock and LMDB's reader table, both files in the
            # store's directory, even to read it.
            raise CliError(EXIT_USAGE, f"{exc}: tierkv commands write the store's lock files, even to read "
                                       "it; run as a user who can write the directory, or copy it to a writable "
                                       "place (cp -r) and run the command there") from None
        raise CliError(EXIT_USAGE, str(exc)) from None
    except ValueError as exc:
        raise CliError(EXIT_USAGE, str(exc)) from None
    except lmdb.Error as exc:
        raise CliError(EXIT_USAGE, f"cannot open the store: {exc}") from None


def _new_tier(path: str, block_size: int, damaged: Callable[[Any], None] | None = None) -> Any:
    """``DiskTier(path)`` under ``_refusals``; None for a store that raises ``DamagedStore``, handed
    to ``damaged`` (without it, refused as any). A tier made and then cut short by a signal
    handler's exception in the with's exit is closed, not kept by the exception's frames with the
    directory's lock held for the process's life."""
    from .tiers.disk import DamagedStore, DiskTier

    made: list[DiskTier] = []
    try:
        with _refusals():
            try:
                made.append(DiskTier(path, _NO_LIMIT, block_size))
            except DamagedStore as exc:
                if damaged is None:
                    raise
                damaged(exc)
                return None
    except BaseException:
        for tier in made:
            tier.close()
        raise
    return made[0]


def _open_tier(path: str) -> tuple[DiskTier, dict[str, int]]:
    meta = _stored_meta(path)
    return _new_tier(path, meta["block_size"]), meta


def _scan(tier: DiskTier) -> ScanResult:
    """``tier.scan()``, a store damaged where LMDB reads it refused like one that will not open."""
    with _refusals():
        return tier.scan()


def _open_store(path: str) -> "TieredStore":
    from .store import TieredStore  # transformers loads in seconds: only the commands that need it
    meta = _stored_meta(path)
    made: list[TieredStore] = []
    try:
        with _refusals():
            made.append(TieredStore(path, device="cpu", device_budget=0, host_budget=0, disk_budget=_NO_LIMIT,
                                    block_size=meta["block_size"]))
    except BaseException:
        for store in made:  # as in _open_tier
            store.close()
        raise
    return made[0]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, or nothing when tqdm is not installed (it is the `cli` extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def _tenant_label(tenant: str | None) -> str:
    """How a report names ``tenant``: ``(default)`` for the default tenant (None), a name as it is,
    quoted where it would read as another (empty, unprintable, spaces at an end, or the default
    tenant's own label: a tenant named "(default)" showed as the default tenant's row twice)."""
    if tenant is None:
        return "(default)"
    plain = tenant and tenant.isprintable() and tenant == tenant.strip() and tenant != "(default)"
    return tenant if plain else repr(tenant)


def _emit(args: argparse.Namespace, report: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
    print(json.dumps(report, indent=2) if args.json else text(report))


# -- stats -------------------------------------------------------------------------------------
def summarise(path: str, meta: dict[str, int], scan: ScanResult,
              footprint: Callable[[RecordHeader, int], int], file_bytes: int) -> dict[str, Any]:
    """The ``stats`` report of one scanned store (JSON-ready). ``bytes`` are counted as the disk
    budget counts them (``footprint``: records and heads in whole pages), ``record_bytes`` as
    records alone."""
    tenants: dict[str | None, dict[str, Any]] = {}

    def row(tenant: str | None) -> dict[str, Any]:
        return tenants.setdefault(tenant, {"tenant": tenant, "sessions": 0, "blocks": 0, "tokens": 0, "bytes": 0,
                                           "record_bytes": 0})

    for header, size in scan.headers:
        entry = row(header.tenant)
        entry["blocks"] += 1
        entry["tokens"] += header.n_tokens
        entry["bytes"] += footprint(header, size)
        entry["record_bytes"] += size
    for tenant, _name, _keys in scan.sessions.values():
        row(tenant)["sessions"] += 1
    ordered = sorted(tenants.values(), key=lambda t: (t["tenant"] is not None, t["tenant"] or ""))
    return {
        "path": absolute_path(path),
        "format": meta["format"],
        "hash": meta["hash"],
        "block_size": meta["block_size"],
        "blocks": len(scan.headers),
        "tokens": sum(t["tokens"] for t in ordered),
        "bytes": sum(t["bytes"] for t in ordered),
        "record_bytes": sum(t["record_bytes"] for t in ordered),
        "file_bytes": file_bytes,
        "sessions": len(scan.sessions),
        # Header checks only; `check` verifies checksums too.
        "unreadable": len(scan.corrupt),
        "tenants": ordered,
    }


def _stats_text(r: dict[str, Any]) -> str:
    lines = [
        f"store       {r['path']}",
        f"format      {r['format']} (hash {r['hash']}), block size {r['block_size']} tokens",
        f"blocks      {r['blocks']} ({r['tokens']} tokens), {format_bytes(r['bytes'])} against the disk budget "
        f"({format_bytes(r['record_bytes'])} of records; the file uses {format_bytes(r['file_bytes'])})",
        f"sessions    {r['sessions']}",
        f"tenants     {len(r['tenants'])}",
    ]
    if r["unreadable"]:
        lines.append(f"unreadable  {r['unreadable']} records (run `tierkv check {shell_path(r['path'])} --repair`)")
    if r["tenants"]:
        width = max(len("tenant"), *(len(_tenant_label(t["tenant"])) for t in r["tenants"]))
        lines += ["", f"{'tenant':<{width}}  {'sessions':>8}  {'blocks':>8}  {'tokens':>9}  {'bytes':>10}"]
        lines += [f"{_tenant_label(t['tenant']):<{width}}  {t['sessions']:>8}  {t['blocks']:>8}  {t['tokens']:>9}  "
                  f"{format_bytes(t['bytes']):>10}" for t in r["tenants"]]
    return "\n".join(lines)


def _refuse_unopenable(path: str, found: FileDamage) -> None:
    """Refuse a store whose file LMDB cannot be trusted to open (``UNOPENABLE``), with LMDB's own
    reason where it refuses the file itself (its meta pages, a file cut short)."""
    from .tiers.disk import UNOPENABLE

    if "file" in found.unsafe:
        _stored_meta(path)  # reads LMDB's meta pages alone
    unopenable = [name for name in UNOPENABLE if name in found.unsafe]
    if unopenable:
        raise CliError(EXIT_USAGE, f"the tierkv store at {absolute_path(path)!r} is damaged where LMDB opens it "
                                   f"({'; '.join(found.tables[name] for name in unopenable)}): it cannot be read "
                                   f"or rebuilt; `tierkv clear {shell_path(path)} --all` deletes it (its blocks are "
                                   "only a cache)")


def cmd_stats(args: argparse.Namespace) -> int:
    found = _file_damage(args.path)
    _refuse_unopenable(args.path, found)
    if found.unsafe:  # LMDB's reads there may abort the process
        tables = ", ".join(f"{name} ({found.tables[name]})" for name in sorted(found.unsafe))
        raise CliError(EXIT_USAGE, f"the tierkv store at {absolute_path(args.path)!r} is damaged in its LMDB "
                                   f"structure: {tables}; run `tierkv check {shell_path(args.path)}` for what can be "
                                   "done")
    tier, meta = _open_tier(args.path)
    try:
        report = summarise(args.path, meta, _scan(tier), tier.footprint_of, tier.file_bytes())
    finally:
        try:
            tier.close()
        except BaseException:
            tier.close()  # cut at its start by a signal handler's exception: no other close follows
            # (inline in each finally, not a helper: a cut at a helper's start would skip both)
            raise
    _emit(args, report, _stats_text)
    return EXIT_OK


# -- check -------------------------------------------------------------------------------------
def repair(tier: DiskTier, scan: ScanResult, bad: Sequence[bytes],
           stale: dict[bytes, tuple[bytes, int]] | None = None) -> dict[str, int]:
    """Drop ``bad`` records with their session references and last-use stamps, and the sessions
    they leave empty, and rewrite the ``stale`` heads of sound records, in one write transaction;
    returns what was done."""
    from .tiers.disk import UNREADABLE, DamagedStore, DeleteBlocks, DropRefs, PutHeads

    doomed = set(bad)
    refs: list[bytes] = []
    emptied: list[bytes] = []
    for sid, (_tenant, _name, keys) in scan.sessions.items():
        held = [key for key in keys if key in doomed]
        refs += [sid + key for key in held]
        if held and len(held) == len(keys):
            emptied.append(sid)
    # DeleteBlocks also zeroes the records' bytes, as forget does: a bad record may still hold KV.
    ops = [DeleteBlocks(list(doomed), refs), *(DropRefs(sid, [], drop_session=True) for sid in emptied),
           *([PutHeads(dict(stale))] if stale else [])]
    try:
        errors = [e for e in tier.apply(ops) if e is not None]
        tier.sync()
    except (lmdb.Error, OSError) as exc:
        if raised_by_signal_handler(exc):
            raise
        errors = [exc]
    if errors:
        if isinstance(errors[0], UNREADABLE):
            # LMDB's own pages (its B-tree) are damaged where the repair's deletes walk: no record
            # repair mends that.
            raise CliError(EXIT_USAGE, f"{DamagedStore(tier.path, errors[0])}; nothing was dropped")
        raise CliError(EXIT_IO, f"could not write the repair to {tier.path}: {errors[0]}; nothing was dropped")
    # Heads are optional writes, skipped when the map is at its cap: count those that landed.
    unindexed = tier.scan().unindexed if stale else {}
    return {"records": len(doomed), "refs": len(refs), "stamps": sum(k in scan.atime for k in doomed),
            "sessions": len(emptied), "heads": sum(k not in unindexed for k in stale or {})}


def _damage_text(r: dict[str, Any]) -> list[str]:
    if not r["damaged"]:
        return []
    names = {"main": "main (the list of tables)", "scan": "read at open", "free": "free (LMDB's free pages)",
             "file": "file (LMDB's meta pages)"}
    tables = ", ".join(f"{names.get(name, name)} ({why})" for name, why in r["damaged"].items())
    lines = [f"the store's LMDB file is damaged in its B-tree, in the table{'s' if len(r['damaged']) > 1 else ''} "
             f"{tables}: writes there fail (forget, clear), whatever the records"]
    rebuilt = r["rebuilt"]
    if rebuilt is None:
        lines.append(f"run `tierkv check {shell_path(r['path'])} --repair` to rebuild the file from what is "
                     "sound (damaged records, and blocks whose session references were lost, are dropped: "
                     "blocks are a cache, recomputed), "
                     f"or `tierkv clear {shell_path(r['path'])} --all` to delete the store")
    else:
        lines.append(f"rebuilt the file from what was sound: kept {rebuilt['records']} records, {rebuilt['sessions']} "
                     f"sessions and {rebuilt['stamps']} last-use stamps; dropped {rebuilt['dropped']} records"
                     + (f" ({rebuilt['unreferenced']} of them sound, whose session references may have been in the "
                        "damaged refs table: a forget of their session could no longer find them)"
                        if rebuilt["unreferenced"] else "")
                     + f" and {rebuilt['sessions_dropped']} sessions that could not be read whole")
    return lines


def _check_text(r: dict[str, Any]) -> str:
    lines = [f"checked {r['records']} records ({format_bytes(r['bytes'])}) in {r['path']}: {len(r['bad'])} bad"]
    if r["damaged"]:
        return "\n".join(lines + [f"  {b['key']}  {b['reason']}" for b in r["bad"]] + _damage_text(r))
    lines += [f"  {b['key']}  {b['reason']}" for b in r["bad"]]
    if r["stale_heads"]:
        lines.append(f"{len(r['stale_heads'])} sound records with a damaged index entry (head)")
        lines += [f"  {key}" for key in r["stale_heads"]]
    if r["dropped"] is not None:
        d = r["dropped"]
        lines.append(f"dropped {d['records']} records, {d['refs']} session references, {d['stamps']} last-use "
                     f"stamps and {d['sessions']} sessions left empty")
        if d["heads"]:
            lines.append(f"rewrote {d['heads']} heads from their records")
    elif r["bad"] or r["stale_heads"]:
        lines.append(f"run `tierkv check {shell_path(r['path'])} --repair` to drop the bad records (blocks "
                     "are a cache: they are recomputed) and rewrite damaged heads from their records")
    return "\n".join(lines)


def rebuild(tier: DiskTier, damaged: Sequence[str], block_size: int, unsafe: Sequence[str] = ()) -> dict[str, int]:
    """``tier.rebuild`` (which closes ``tier``), then heads for the new file's records, as a
    store's scan would write them; returns what was kept and dropped."""
    from dataclasses import asdict

    from .tiers.disk import PutHeads, RebuiltUnsynced

    try:
        rebuilt = tier.rebuild(damaged, block_size, unsafe)
    except RebuiltUnsynced as exc:
        raise CliError(EXIT_IO, f"{exc}: the store holds what was sound, but a crash before its next sync may "
                                f"bring the damaged file back; run `tierkv check {shell_path(tier.path)}` "
                                "again once the disk is healthy") from None
    except (lmdb.Error, OSError) as exc:
        if raised_by_signal_handler(exc):
            raise
        raise CliError(EXIT_IO, f"could not rebuild {tier.path}: {exc}; the store is as it was") from None
    new = _new_tier(tier.path, block_size)
    try:
        heads = new.scan().unindexed
        if heads:
            new.apply([PutHeads(heads)])
        new.sync()
    except (lmdb.Error, OSError, ValueError) as exc:
        if raised_by_signal_handler(exc):
            raise
        # optional: the store's next scan writes them (or finds what is still wrong)
    finally:
        try:
            new.close()
        except BaseException:
            new.close()  # as in cmd_stats
            raise
    return asdict(rebuilt)


def cmd_check(args: argparse.Namespace) -> int:
    from .tiers.disk import DamagedStore

    found = _file_damage(args.path)
    _refuse_unopenable(args.path, found)  # not even opened: LMDB reads its table of tables at open
    unsafe = {name: found.tables[name] for name in found.unsafe}
    tier, meta = _open_tier(args.path)
    rebuilt = dropped = None
    try:
        # Records are verified first, the tables they index among them (LMDB's B-tree): a scan of a
        # damaged table may trip over it.
        bar = _progress(tier.record_count() if "blocks" not in unsafe else 0, "checking", "record")
        try:
            checked = tier.verify(lambda _nbytes: bar.update(1), unsafe)
        finally:
            bar.close()
        for name, why in found.tables.items():
            checked.damaged.setdefault(name, why)
        bad = checked.bad
        scan = None
        if not checked.damaged:
            try:
                scan = tier.scan()  # what a store reads at open
            except DamagedStore as exc:
                checked.damaged["scan"] = exc.reason
        faulty = bool(bad or checked.stale or checked.damaged)
        if checked.damaged:
            if args.repair:
                rebuilt = rebuild(tier, list(checked.damaged), meta["block_size"], list(unsafe))
        elif faulty and args.repair:
            assert scan is not None
            dropped = repair(tier, scan, [key for key, _ in bad], checked.stale)
    finally:
        try:
            tier.close()
        except BaseException:
            tier.close()  # as in cmd_stats
            raise
    report = {"path": absolute_path(args.path), "records": checked.records, "bytes": checked.record_bytes,
              "bad": [{"key": key.hex(), "reason": reason} for key, reason in bad],
              "stale_heads": [key.hex() for key in checked.stale],
              "damaged": dict(checked.damaged),
              "repaired": dropped is not None or rebuilt is not None, "dropped": dropped, "rebuilt": rebuilt}
    _emit(args, report, _check_text)
    return EXIT_BAD_RECORDS if faulty and not report["repaired"] else EXIT_OK


# -- clear -------------------------------------------------------------------------------------
def _read_for_clear(path: str) -> tuple[str | None, bool, set[str | None]]:
    """Why the store cannot be cleared entry by entry (its LMDB file is damaged: no forget can
    be written there; or it is of another format version), or None; whether `check --repair` can mend that (a damaged table: yes;
    a store that does not open: no); and every tenant with a block or a session, the default one
    included. Read before the store opens (one environment per process at a time)."""
    from .codec import FORMAT_VERSION
    from .hashing import HASH_VERSION
    from .tiers.disk import UNOPENABLE, DamagedStore, DiskTier

    found = _file_damage(path)
    if found.tables:
        tables = ", ".join(f"{name} ({why})" for name, why in found.tables.items())
        return (f"the tierkv store at {absolute_path(path)!r} is damaged in its LMDB structure: {tables}",
                not any([name in UNOPENABLE for name in found.unsafe]), set())
    reasons: list[str] = []
    with _refusals():
        try:
            meta = DiskTier.stored_meta(path)
        except DamagedStore as exc:
            reasons.append(exc.reason)
    if not reasons and (meta["format"], meta["hash"]) != (FORMAT_VERSION, HASH_VERSION):
        # A store of another release: no forget can be written there, but its files can go (its
        # open's refusal said to delete the directory, and `clear --all` refused it as well).
        return (f"the tierkv store at {absolute_path(path)!r} was written in tierkv format {meta['format']} (hash "
                f"{meta['hash']}), which this version ({__version__}: format {FORMAT_VERSION}, hash {HASH_VERSION}) "
                "cannot read", False, set())
    tier = None if reasons else _new_tier(path, meta["block_size"], lambda exc: reasons.append(exc.reason))
    if tier is None:  # no call between the making and the try: no point a handler runs at
        return f"the tierkv store at {absolute_path(path)!r} is damaged ({reasons[0]})", False, set()
    try:
        damaged = tier.damaged_tables()
        if damaged:
            tables = ", ".join(f"{name} ({why})" for name, why in damaged.items())
            return f"the tierkv store at {absolute_path(path)!r} is damaged in its LMDB B-tree: {tables}", True, set()
        try:
            scan = tier.scan()
        except DamagedStore as exc:
            return f"the tierkv store at {absolute_path(path)!r} is damaged ({exc.reason})", True, set()
    finally:
        try:
            tier.close()
        except BaseException:
            tier.close()  # as in cmd_stats
            raise
    return None, False, {h.tenant for h, _ in scan.headers} | {t for t, _, _ in scan.sessions.values()}


def _remove_damaged(path: str, damage: str) -> int:
    """``clear --all`` of a store too damaged to clear entry by entry, or of another format: its files go."""
    from .tiers.disk import StoreInUse, remove_store

    try:
        removed = remove_store(path)
    except StoreInUse as exc:
        raise CliError(EXIT_IN_USE, str(exc)) from None
    except ValueError as exc:
        raise CliError(EXIT_USAGE, f"{damage}; and {exc}") from None
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise
        raise CliError(EXIT_IO, f"{damage}; removing its files failed: {exc}") from None
    print(f"removed the store's files ({', '.join(removed)} in {absolute_path(path)}; {damage}: it cannot be "
          f"cleared entry by entry); a TieredStore opened at {absolute_path(path)} starts a new store")
    return EXIT_OK


def _refuse_damaged(path: str, damage: str, repairable: bool) -> CliError:
    if not repairable:
        return CliError(EXIT_USAGE, f"{damage}: nothing can be forgotten there; `tierkv clear "
                                    f"{shell_path(path)} --all` deletes the whole store (its blocks are only a "
                                    "cache)")
    return CliError(EXIT_USAGE, f"{damage}: a forget cannot be written there. Run `tierkv check "
                                f"{shell_path(path)} --repair` (it rebuilds the store from what is sound), then "
                                f"this command again; or `tierkv clear {shell_path(path)} --all` to delete the "
                                "whole store")


def cmd_clear(args: argparse.Namespace) -> int:
    path = args.path
    damage, repairable, tenants = _read_for_clear(path)
    if damage is not None:
        if args.all:
            return _remove_damaged(path, damage)
        raise _refuse_damaged(path, damage, repairable)
    store = _open_store(path)
    try:
        if args.all:
            removed = sum(store.forget(tenant=t) for t in tenants)
            what = "every tenant"
        elif args.session is None:
            removed = store.forget(tenant=args.tenant)
            what = f"tenant {_tenant_label(args.tenant)}"
        else:
            sessions = list(dict.fromkeys(args.session))
            if args.tenant_given:
                removed = sum(store.forget(session=name, tenant=args.tenant) for name in sessions)
            else:
                removed = sum(store.forget(session=name) for name in sessions)
            what = (f"session{'s' if len(sessions) > 1 else ''} {', '.join(map(repr, sessions))} of "
                    f"{'tenant ' + _tenant_label(args.tenant) if args.tenant_given else 'every tenant'}")
        try:
            store.flush()
        except OSError as exc:
            if raised_by_signal_handler(exc):
                raise
            # The deletes may not have reached the disk: the documented disk-error exit, not a traceback.
            raise CliError(EXIT_IO, f"a disk error stopped clear of {absolute_path(path)}: {exc}; the removed "
                                    f"entries may still be on disk; run the same command again") from exc
        stats = store.stats()
        left, owed = stats["disk"]["blocks"], stats["owed_deletes"]
    finally:
        try:
            store.close()
        except BaseException:
            store.close()  # as in cmd_stats
            raise
    if owed and stats["disk_damaged"]:
        # Damage the walk of the tables did not show (LMDB's free list, say): its writes failed.
        damage = f"the tierkv store at {absolute_path(path)!r} is damaged where LMDB writes"
        if args.all:
            return _remove_damaged(path, damage)
        raise _refuse_damaged(path, damage, True)
    if owed:
        raise CliError(EXIT_IO, f"disk errors kept {owed} deletes from reaching {absolute_path(path)}: the "
                                f"removed entries may still be on disk; run the same command again")
    print(f"removed {removed} blocks ({what}); {left} blocks left in {absolute_path(path)}")
    return EXIT_OK


# -- demo and bench ------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo  # imported to run: it sets transformers' logging and warning filters

    demo.main(args.passthrough, prog="tierkv demo")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    bench.main(args.passthrough, prog="tierkv bench")
    return EXIT_OK


# -- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierkv", description="tierkv: a hierarchical KV-cache store.\nRun the demo and the benchmark; "
        "inspect, check and clear a store on disk.", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tierkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str, run: Callable[[argparse.Namespace], int], **kwargs: Any
                ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=EXIT_CODES,
                           formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        p.set_defaults(run=run, passthrough=None, usage_error=p.error)
        return p

    # No options of their own, not even -h: every argument goes to the program (`tierkv demo -h`).
    command("demo", "the chat simulation on a tiny random model (`tierkv demo --help` for its options)",
            cmd_demo, add_help=False).set_defaults(passthrough=[])
    command("bench", "the multi-session chat-trace benchmark (`tierkv bench --help` for its options)",
            cmd_bench, add_help=False).set_defaults(passthrough=[])

    p = command("stats", "blocks, bytes, tenants, sessions and format version of a store", cmd_stats)
    p.add_argument("path", metavar="PATH", help="the store's directory")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of a table")

    p = command("check", "verify every record's header and checksum; report or drop the bad ones", cmd_check)
    p.add_argument("path", metavar="PATH", help="the store's directory")
    p.add_argument("--repair", action="store_true",
                   help="drop bad records, their session references and stamps (default: change nothing)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of text")

    p = command("clear", "remove a tenant's or a session's entries (or, with --all, every entry)", cmd_clear)
    p.add_argument("path", metavar="PATH", help="the store's directory")
    p.add_argument("--session", metavar="S", action="append",
                   help="forget session S (of every tenant, or of the one given); repeat it for several")
    tenant = p.add_mutually_exclusive_group()
    tenant.add_argument("--tenant", metavar="T", help="forget tenant T's entries (with --session: only T's session)")
    tenant.add_argument("--default-tenant", action="store_true",
                        help="as --tenant, for the default tenant (tenant=None)")
    p.add_argument("--all", action="store_true", help="remove every entry; required when no filter is given")
    return parser


def _check_clear_filters(args: argparse.Namespace) -> None:
    """With no filter, `clear` is refused unless --all is given: a typo must not wipe the store."""
    args.tenant_given = args.tenant is not None or args.default_tenant
    if args.default_tenant:
        args.tenant = None
    if args.all and (args.session is not None or args.tenant_given):
        args.usage_error("--all removes every entry: give it alone, or --tenant/--session without it")
    if not args.all and args.session is None and not args.tenant_given:
        args.usage_error("give --tenant T, --default-tenant or --session S; or --all to remove every entry")
    from .hashing import check_name  # as forget checks them: bytes the terminal could not decode

    for what, names in (("session", args.session or []), ("tenant", [args.tenant])):
        for name in names:
            try:
                check_name(name, what)
            except ValueError as exc:
                args.usage_error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_known_args: what follows `demo`/`bench` belongs to their own parsers.
    args, rest = parser.parse_known_args(argv)
    if args.passthrough is not None:
        args.passthrough = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "clear":
        _check_clear_filters(args)
    if getattr(args, "path", None) is not None:
        # As TieredStore reads a store's path (the commands open it as a store does): a "~" that no
        # shell expanded (quoted, or passed by a program or a config file) is the home directory.
        args.path = os.path.expanduser(args.path)
    try:
        return args.run(args)
    except CliError as exc:
        print(f"tierkv: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`tierkv stats PATH | head`): as a command killed by SIGPIPE, with
        # no traceback. Python's own flush of stdout at exit would raise again: it goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE


if __name__ == "__main__":
    sys.exit(main())
