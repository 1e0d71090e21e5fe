"""Subprocess for the full-filesystem tests of tests/test_disk_faults.py; prints one JSON line of
what happened. A write through LMDB's map into a page the filesystem has no block for kills this
process with SIGBUS, which the test sees as the exit status. Not collected by pytest.

    python tests/_fullfs_child.py MOUNTPOINT new|old|open   a disk tier on a 6 MiB tmpfs mounted
        there, which another program fills; run in a mount namespace of its own (``unshare``), so
        the tmpfs goes with the process
    python tests/_fullfs_child.py DIRECTORY fsize           a disk tier under a file-size limit
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import torch

from tierkv.codec import RecordHeader, record_size
from tierkv.tiers.disk import DeleteBlocks, DiskTier, FilesystemFull, PutBlock, PutRefs, Touch
from tierkv.transfer import Job

RECORD = 16384  # float32s: 64 KiB records


def put(seq: int) -> PutBlock:
    header = RecordHeader(key=seq.to_bytes(16, "little"), parent=bytes(16), tenant=None, fingerprint=b"f",
                          dtype="float32", shape=(RECORD,), token_ids=(1).to_bytes(8, "little"), seq=seq)
    return PutBlock(header, Job.completed(torch.full((RECORD,), float(seq))), record_size(header))


def key(seq: int) -> bytes:
    return seq.to_bytes(16, "little")


def _punch(fd: int, offset: int, length: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, 0x02 | 0x01, offset, length) != 0:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        raise OSError(ctypes.get_errno(), "fallocate")


def fill(directory: str) -> None:
    """Another program takes every block left."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 16, 512):
            try:
                while True:
                    os.write(fd, bytes(chunk))
            except OSError:
                pass
    finally:
        os.close(fd)


def errors(results) -> list[str]:
    return sorted({type(r).__name__ for r in results if r is not None})


def busy(tier: DiskTier, first: int, report: dict) -> None:
    """What a serving store writes on a full disk: blocks, then stamps, references and deletes,
    each batch needing B-tree pages LMDB has not used yet."""
    results: list = []
    try:
        for batch in range(40):  # up to 20 MiB, past what the filesystem has
            results += tier.apply([put(first + 8 * batch + i) for i in range(8)])
            if results[-1] is not None:
                break
    except OSError as exc:
        results.append(exc)
    report["blocks"] = errors(results)
    report["written"] = sum(r is None for r in results)
    for name, ops in (("stamps", [Touch({key(50_000 + i): i for i in range(3000)})]),
                      ("refs", [PutRefs(key(9), None, [key(60_000 + i) for i in range(3000)])]),
                      ("deletes", [DeleteBlocks([key(i) for i in range(1, 10)])])):
        try:
            report[name] = errors(tier.apply(ops))
        except OSError as exc:
            report[name] = [f"{type(exc).__name__}:{exc.errno}"]


def main() -> None:
    mount, case = sys.argv[1], sys.argv[2]
    if case != "fsize":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", mount], check=True)
    path = os.path.join(mount, "kv")
    report: dict = {"case": case}
    if case == "new":
        # A store made on the filesystem, which then fills: its map is allocated, and what does not
        # fit is refused (FilesystemFull), not a crash.
        tier = DiskTier(path, 1 << 30, 8)
        tier.apply([put(i) for i in range(1, 21)])
        fill(mount)
        busy(tier, 100, report)
        tier.close()
    elif case == "old":
        # A store an earlier build left (its file a hole past the pages in use, as its doubling map
        # made it), reopened once the filesystem filled.
        tier = DiskTier(path, 1 << 30, 8)
        tier.apply([put(i) for i in range(1, 21)])
        used = tier.file_bytes()
        tier.close()
        os.truncate(os.path.join(path, "data.mdb"), used)
        os.truncate(os.path.join(path, "data.mdb"), 64 << 20)
        os.truncate(os.path.join(path, "lock.mdb"), 4096)
        os.truncate(os.path.join(path, "lock.mdb"), 8192)
        fill(mount)
        tier = DiskTier(path, 1 << 30, 8)
        busy(tier, 100, report)
        tier.close()
    elif case == "punched":
        # A store a build of the time deleted records in by punching their pages out of the file
        # (FALLOC_FL_PUNCH_HOLE): holes below its pages in use, on LMDB's free list, which LMDB
        # writes through the map when it reuses them. Reopened once the filesystem filled.
        tier = DiskTier(path, 1 << 30, 8)
        tier.apply([put(i) for i in range(1, 41)])
        doomed = [tier._place(key(i)) for i in range(1, 31)]
        tier.apply([DeleteBlocks([key(i) for i in range(1, 31)])])
        tier.apply([Touch({key(40): 1})])  # the transaction after: the delete's pages free for reuse
        tier.close()
        fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR)
        for offset, length in doomed:
            first, last = -(-offset // 4096) * 4096, (offset + length) // 4096 * 4096
            if last > first:
                _punch(fd, first, last - first)
        os.close(fd)
        fill(mount)
        try:
            tier = DiskTier(path, 1 << 30, 8)
        except OSError as exc:
            report["open"] = f"{type(exc).__name__}:{exc.errno}"
        else:
            report["open"] = "opened"
            busy(tier, 100, report)
            refs: list = []
            for n in range(40):  # references enough to reuse the free list's pages, holes and all
                try:
                    refs += tier.apply([PutRefs(key(9), None, [key(100_000 * (n + 1) + i) for i in range(1000)])])
                except OSError as exc:
                    refs.append(exc)
            report["more refs"] = sorted({f"{type(r).__name__}:{r.errno}" for r in refs if r is not None})
            tier.close()
    elif case == "nolock":
        # A store without its lock file (copied without it, say), read by ``stored_meta`` (``tierkv
        # stats``) on a full filesystem: LMDB makes the lock file and writes it through a map.
        tier = DiskTier(path, 1 << 30, 8)
        tier.apply([put(i) for i in range(1, 5)])
        tier.close()
        os.remove(os.path.join(path, "lock.mdb"))
        fill(mount)
        try:
            report["open"] = sorted(DiskTier.stored_meta(path))
        except OSError as exc:
            report["open"] = f"{type(exc).__name__}:{exc.errno}"
    elif case == "open":
        # A new store in a directory made earlier (its lock written), on a full filesystem.
        os.makedirs(path)
        with open(os.path.join(path, "tierkv.lock"), "w") as f:
            f.write("12345")
        fill(mount)
        try:
            DiskTier(path, 1 << 30, 8).close()
            report["open"] = "opened"
        except OSError as exc:
            report["open"] = f"{type(exc).__name__}:{exc.errno}"
    elif case == "fsize":
        # A file-size limit (ulimit -f): the map stops growing at it, as at a full filesystem.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        tier = DiskTier(path, 1 << 30, 8)
        # Past 64 MiB, where an earlier build's map (64 MiB at first, sparse) had to grow.
        resource.setrlimit(resource.RLIMIT_FSIZE, (72 << 20,) * 2)
        results = []
        for i in range(100):  # 1 MiB a batch, until the limit refuses a few
            try:
                results += tier.apply([put(1000 * i + j) for j in range(1, 17)])
            except Exception as exc:  # noqa: BLE001 - reported
                results.append(exc)
            if sum(r is not None for r in results) > 48:
                break
        report["blocks"] = errors(results)
        report["written"] = sum(r is None for r in results)
        report["filesystem_full"] = sum(isinstance(r, FilesystemFull) for r in results)
        tier.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
