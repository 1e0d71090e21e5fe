"""The ``tierkv`` console script, run for real in subprocesses against stores built here.

One store is built per module with a tiny random llama (``block_size=8``): four conversations,
three tenants, a shared system prompt. Commands that change a store get their own copy. Every
expectation is exact: block, session and tenant counts worked out by hand below, the tokens each
conversation restores when the store is reopened with ``TieredStore``, exit codes, and the bytes
of ``data.mdb`` where a command must not write. Subprocesses start torch (seconds each), so the
independent ones run side by side (``run_all``); the table layout and the argument checks of
``clear`` are exercised in this process through ``tierkv.cli.main``, the same entry point.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import lmdb.verify
import msgpack
import pytest
import torch

import tierkv
from conftest import damage_in_place, damage_table, flipped, make_model, random_ids
from tierkv import TieredStore, cli
from tierkv.tiers import disk
from tierkv.codec import FORMAT_VERSION, decode_header

B = 8
SYSTEM = random_ids(16, seed=1)
# (tenant, session) -> the conversation. Blocks of 8 tokens, a partial tail stored too:
#   acme/alice 36 tokens: 4 whole blocks + a tail of 4          5 blocks
#   acme/bob   30 tokens: shares alice's first 2 blocks (system),
#              + 1 whole block + a tail of 6                    2 more
#   zeta/carol 28 tokens: same system prompt, another tenant:
#              nothing shared; 3 whole blocks + a tail of 4     4 blocks
#   dave (default tenant) 20 tokens: 2 whole + a tail of 4      3 blocks
CONVERSATIONS: dict[tuple[str | None, str], torch.Tensor] = {
    ("acme", "alice"): torch.cat([SYSTEM, random_ids(20, seed=2)], dim=1),
    ("acme", "bob"): torch.cat([SYSTEM, random_ids(14, seed=3)], dim=1),
    ("zeta", "carol"): torch.cat([SYSTEM, random_ids(12, seed=4)], dim=1),
    (None, "dave"): random_ids(20, seed=5),
}
BLOCKS = 5 + 2 + 4 + 3
FULL = {"alice": 36, "bob": 30, "carol": 28, "dave": 20}  # tokens each conversation restores


# -- running the script ----------------------------------------------------------------------------
def tierkv_command() -> list[str]:
    """The installed console script of this interpreter (then any on PATH); ``-m`` only without one."""
    script = shutil.which("tierkv", path=os.path.dirname(sys.executable)) or shutil.which("tierkv")
    return [script] if script else [sys.executable, "-m", "tierkv.cli"]


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_all(*commands: list[str], cwd: Path | None = None) -> list[Result]:
    """Run ``tierkv`` with each argument list, all at once, and wait for every one."""
    procs = [subprocess.Popen([*tierkv_command(), *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(Result(proc.returncode, out, err))
    return results


def run(*args: str) -> Result:
    return run_all(list(args))[0]


def verify_refused(result: Result, code: int, *phrases: str) -> None:
    """A refusal: the exit code, one line on stderr saying why, no traceback, nothing on stdout."""
    assert result.code == code, result
    assert result.out == "" and "Traceback" not in result.err, result
    assert result.err.startswith("tierkv: error: ") and result.err.count("\n") == 1, result.err
    for phrase in phrases:
        assert phrase in result.err, result.err


# -- the store -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model("llama")


@dataclass
class Built:
    path: Path
    outputs: dict[tuple[str | None, str], torch.Tensor]  # what each conversation committed
    disk_bytes: int


@pytest.fixture(scope="module")
def built(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Built:
    path = tmp_path_factory.mktemp("cli") / "kv"
    outputs = {}
    with TieredStore(path, device="cpu", block_size=B) as store:
        for (tenant, session), ids in CONVERSATIONS.items():
            cache = store.open(model, ids, session=session, tenant=tenant)
            out = model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
            cache.commit(out)  # the KV of ids itself: out's last token is never computed
            outputs[(tenant, session)] = out
        store.flush()
        stats = store.stats()
    assert (stats["disk"]["blocks"], stats["sessions"]) == (BLOCKS, 4)
    return Built(path, outputs, stats["disk"]["bytes"])


def test_python_dash_m_tierkv_is_the_console_script(built: Built) -> None:
    via_m = subprocess.run([sys.executable, "-m", "tierkv", "stats", "--json", str(built.path)],
                           capture_output=True, text=True)
    assert via_m.returncode == 0, via_m.stderr
    script = run("stats", "--json", str(built.path))
    assert json.loads(via_m.stdout) == json.loads(script.out)


@pytest.mark.parametrize("args", [["stats"], ["stats", "--json"], ["check"]])
def test_a_reader_that_closed_the_pipe_ends_the_command_without_a_traceback(built: Built, args: list[str]) -> None:
    """`tierkv stats PATH | head`: the reader gone, the command ends as one killed by SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*tierkv_command(), *args, str(built.path)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_PIPE == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_clear_whose_deletes_hit_disk_errors_fails_with_exit_4(copy, monkeypatch, capsys) -> None:
    import lmdb

    from tierkv.tiers.disk import DeleteBlocks, DiskTier, DropRefs

    apply = DiskTier.apply

    def failing(self, ops):
        if any(isinstance(op, (DeleteBlocks, DropRefs)) for op in ops):
            raise lmdb.DiskError("Input/output error")
        return apply(self, ops)

    monkeypatch.setattr(DiskTier, "apply", failing)
    path = copy()
    assert cli.main(["clear", str(path), "--tenant", "acme"]) == cli.EXIT_IO
    assert "may still be on disk" in capsys.readouterr().err


def test_clear_whose_final_sync_fails_exits_4_without_a_traceback(copy, monkeypatch, capsys) -> None:
    import lmdb

    from tierkv.tiers.disk import DiskTier

    def failing(self) -> None:
        raise lmdb.DiskError("Input/output error")

    monkeypatch.setattr(DiskTier, "sync", failing)
    assert cli.main(["clear", str(copy()), "--tenant", "acme"]) == cli.EXIT_IO
    err = capsys.readouterr().err
    assert "a disk error stopped clear" in err and "Traceback" not in err


@pytest.fixture
def copy(built: Built, tmp_path: Path) -> Callable[..., Path]:
    """``copy(name)``: a fresh copy of the built store, for a command that changes it."""
    def make(name: str = "copy") -> Path:
        return Path(shutil.copytree(built.path, tmp_path / name))

    return make


def reopened(path: Path, model: torch.nn.Module, built: Built) -> tuple[dict[str, int], dict]:
    """Tokens each conversation restores from the store at ``path``, and its stats at reopening."""
    with TieredStore(path, device="cpu", block_size=B) as store:
        stats = store.stats()
        restored = {session: store.open(model, out, session=session, tenant=tenant).restored_tokens
                    for (tenant, session), out in built.outputs.items()}
    return restored, stats


def file_digest(path: Path) -> str:
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


def first_head(path: Path) -> tuple[bytes, bytes]:
    """Key and head (its index entry) of the first block of a closed store."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    try:
        with env.begin() as txn:
            key, value = next(iter(txn.cursor(db=env.open_db(b"heads", txn=txn))))
            return bytes(key), bytes(value)
    finally:
        env.close()


def put_head(path: Path, key: bytes, value: bytes) -> None:
    """Write ``value`` (as long as the head) over ``key``'s head where it lies, as a disk would."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        damage_in_place(env, b"heads", key, lambda _: value)
    finally:
        env.close()


def records(path: Path) -> dict[bytes, bytes]:
    """The raw block records, read through LMDB directly (the store must be closed)."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    try:
        with env.begin() as txn:
            return dict(txn.cursor(db=env.open_db(b"blocks", txn=txn)))
    finally:
        env.close()


# -- tests -----------------------------------------------------------------------------------------
def test_version_demo_and_bench_run_from_the_installed_package(tmp_path: Path) -> None:
    """From outside the checkout (cwd elsewhere): `bench` runs the trace with its flags passed
    through, the table on stdout, the progress bar on stderr, reports in `tierkv-bench/`."""
    version, demo_help, bench = run_all(
        ["--version"], ["demo", "--help"],
        ["bench", "--sessions", "1", "--turns", "2", "--layers", "1", "--hidden", "64", "--system-tokens", "16",
         "--user-median", "4", "--user-max", "8", "--reply-median", "2", "--reply-max", "2", "--context", "64",
         "--block-size", "8", "--cpu"], cwd=tmp_path)
    assert (version.code, version.out) == (0, f"tierkv {tierkv.__version__}\n")
    assert demo_help.code == 0 and demo_help.out.startswith("usage: tierkv demo") and "--quick" in demo_help.out
    assert bench.code == 0, bench.err[-3000:]
    assert "| tierkv |" in bench.out and "chat trace" not in bench.out and "chat trace" in bench.err
    report = json.loads((tmp_path / "tierkv-bench" / "results.json").read_text())
    assert report["args"]["turns"] == 2
    assert all(row["exact"] for row in report["policies"].values() if "skipped" not in row)


def test_stats_reports_what_was_stored(built: Built, copy: Callable[..., Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    as_json = run("stats", str(built.path), "--json")
    assert as_json.code == 0, as_json
    report = json.loads(as_json.out)
    assert {k: report[k] for k in ("format", "block_size", "blocks", "sessions", "bytes", "tokens", "unreadable")} == {
        "format": FORMAT_VERSION, "block_size": B, "blocks": BLOCKS, "sessions": 4, "bytes": built.disk_bytes,
        "tokens": 36 + 14 + 28 + 20, "unreadable": 0}
    assert [(t["tenant"], t["sessions"], t["blocks"], t["tokens"]) for t in report["tenants"]] == [
        (None, 1, 3, 20), ("acme", 2, 7, 50), ("zeta", 1, 4, 28)]
    assert sum(t["bytes"] for t in report["tenants"]) == report["bytes"] > report["record_bytes"] > 0

    assert cli.main(["stats", str(copy())]) == 0
    table = capsys.readouterr()
    assert re.search(rf"^blocks\s+{BLOCKS} \(98 tokens\)", table.out, re.M), table.out
    for row in (r"\(default\)\s+1\s+3\s+20", r"acme\s+2\s+7\s+50", r"zeta\s+1\s+4\s+28"):
        assert re.search(rf"^{row}\s", table.out, re.M), table.out
    assert table.err == ""


def test_reports_tell_the_default_tenant_from_tenants_named_like_it(
        model: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A tenant named "(default)" showed as the default tenant's row twice in `stats`, and `clear`
    # said "tenant (default)" for either; a name with a space at an end read as another's.
    path = tmp_path / "kv"
    ids = random_ids(12, seed=9)
    with TieredStore(path, device="cpu", block_size=B) as store:
        for tenant in (None, "(default)", "acme "):
            cache = store.open(model, ids, session="s", tenant=tenant)
            cache.commit(model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False))
    assert cli.main(["stats", str(path)]) == 0
    table = capsys.readouterr().out
    labels = [line.split("  ")[0] for line in table.splitlines()[table.splitlines().index("") + 2:]]
    assert sorted(labels) == sorted(["(default)", "'(default)'", "'acme '"]), table
    assert cli.main(["clear", str(path), "--tenant", "(default)"]) == 0
    assert "removed 2 blocks (tenant '(default)')" in capsys.readouterr().out
    assert cli.main(["clear", str(path), "--default-tenant"]) == 0
    assert "removed 2 blocks (tenant (default))" in capsys.readouterr().out


def test_store_commands_read_a_path_under_home_as_tieredstore_does(
        built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # TieredStore("~/kv") is the store in the home directory; `tierkv stats "~/kv"` (no shell to
    # expand it: quoted, or run by a program) said "no such directory".
    shutil.copytree(built.path, tmp_path / "kv")
    monkeypatch.setenv("HOME", str(tmp_path))
    for args in (["stats", "~/kv", "--json"], ["check", "~/kv"], ["clear", "~/kv", "--session", "dave"]):
        assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f'"path": "{tmp_path / "kv"}"' in out and "removed 3 blocks" in out
    with TieredStore("~/kv", device="cpu", block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == BLOCKS - 3


def test_check_reports_bad_records_then_repair_drops_exactly_them(built: Built, copy: Callable[..., Path],
                                                                   model: torch.nn.Module) -> None:
    path = copy()
    found = {}
    for key, value in records(path).items():
        header = decode_header(value)
        found[(header.tenant, bytes(header.token_ids))] = key, value
    ids = {session: CONVERSATIONS[(tenant, session)][0].numpy().astype("<i8") for tenant, session in CONVERSATIONS}
    carol_2, carol_value = found[("zeta", ids["carol"][16:24].tobytes())]
    dave_0, dave_0_value = found[(None, ids["dave"][0:8].tobytes())]
    dave_1, _ = found[(None, ids["dave"][8:16].tobytes())]
    env = lmdb.open(str(path), max_dbs=8)
    # The payload's last byte: the header still reads, only the checksum fails.
    damage_in_place(env, b"blocks", carol_2, lambda record: flipped(record, -9, 0xFF))
    damage_in_place(env, b"blocks", dave_1, lambda _: dave_0_value)  # a sound record, under another key
    with env.begin() as txn:
        stamped = {k for k, _ in txn.cursor(db=env.open_db(b"atime", txn=txn))}
    env.close()
    assert {carol_2, dave_1} <= stamped
    before = file_digest(path)

    report = run("check", str(path), "--json")
    assert report.code == 1, report
    result = json.loads(report.out)  # stdout is the JSON alone; the progress bar went to stderr
    assert "checking" in report.err
    assert (result["records"], result["repaired"], result["dropped"]) == (BLOCKS, False, None)
    assert sorted((b["key"], b["reason"]) for b in result["bad"]) == sorted(
        [(carol_2.hex(), "checksum mismatch"), (dave_1.hex(), "record stored under another key")])
    assert file_digest(path) == before, "check without --repair wrote to the store"

    repaired = run("check", str(path), "--repair")
    assert repaired.code == 0, repaired
    assert f"{BLOCKS} records" in repaired.out and ": 2 bad" in repaired.out
    assert "dropped 2 records, 2 session references, 2 last-use stamps and 0 sessions left empty" in repaired.out
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin() as txn:
        rows = {name: [bytes(k) for k, _ in txn.cursor(db=env.open_db(name, txn=txn))]
                for name in (b"blocks", b"refs", b"atime", b"sessions")}
    env.close()
    assert len(rows[b"blocks"]) == BLOCKS - 2 and len(rows[b"sessions"]) == 4
    for bad in (carol_2, dave_1):
        assert bad not in rows[b"blocks"] and bad not in rows[b"atime"]
        assert not [ref for ref in rows[b"refs"] if ref.endswith(bad)]
    assert dave_0 in rows[b"blocks"]

    clean = run("check", str(path), "--json")
    assert clean.code == 0 and json.loads(clean.out)["bad"] == [] and json.loads(clean.out)["records"] == BLOCKS - 2
    restored, stats = reopened(path, model, built)
    assert (stats["corrupt"], stats["disk"]["blocks"], stats["sessions"]) == (0, BLOCKS - 2, 4)
    # Carol keeps her blocks before the bad one, Dave his first block; the others are untouched.
    assert restored == {**FULL, "carol": 16, "dave": 8}


def test_check_rewrites_a_damaged_head_from_its_sound_record(built: Built, copy: Callable[..., Path],
                                                             model: torch.nn.Module,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = copy()
    key, head = first_head(path)
    damaged = bytearray(head)
    damaged[30] ^= 0xFF  # inside the header it copies: the head no longer agrees with its record
    put_head(path, key, bytes(damaged))
    before = file_digest(path)
    assert cli.main(["check", str(path)]) == cli.EXIT_BAD_RECORDS
    # It said `tierkv check PATH --repair`: the command to run has the store's path, as the other advice does.
    assert f"run `tierkv check {cli.absolute_path(str(path))} --repair` to drop" in capsys.readouterr().out

    report = run("check", str(path), "--json")
    assert report.code == 1, report
    result = json.loads(report.out)
    assert (result["bad"], result["stale_heads"], result["records"]) == ([], [key.hex()], BLOCKS)
    assert file_digest(path) == before, "check without --repair wrote to the store"

    repaired = run("check", str(path), "--repair")
    assert repaired.code == 0 and "rewrote 1 heads from their records" in repaired.out, repaired
    clean = run("check", str(path), "--json")
    assert clean.code == 0 and json.loads(clean.out)["stale_heads"] == [], clean
    restored, stats = reopened(path, model, built)
    assert stats["corrupt"] == 0 and restored == FULL  # no block was lost to its head


@pytest.mark.parametrize("head", [True, False], ids=["head and record zeroed", "record zeroed under its head"])
def test_check_names_a_delete_a_crash_cut_short_which_the_store_finishes(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module, head: bool,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A delete zeroes a block's head, then its record (magic first), before its transaction
    # commits: a crash in between leaves zeroes under live rows. Before: reported as "not a tierkv
    # block record (bad magic)", as if something had written garbage there.
    path = copy()
    first = CONVERSATIONS[(None, "dave")][0, :B].numpy().astype("<i8").tobytes()
    key, value = next((k, v) for k, v in records(path).items()
                      if (decode_header(v).tenant, bytes(decode_header(v).token_ids)) == (None, first))  # dave's first
    env = lmdb.open(str(path), max_dbs=8)
    if head:
        damage_in_place(env, b"heads", key, lambda head: bytes(len(head)))
    damage_in_place(env, b"blocks", key, lambda record: bytes(len(record)))
    env.close()
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_BAD_RECORDS
    assert json.loads(capsys.readouterr().out)["bad"] == [{"key": key.hex(), "reason": disk.DELETE_CUT_SHORT}]
    assert cli.main(["check", str(path)]) == cli.EXIT_BAD_RECORDS
    out = capsys.readouterr().out
    assert "a delete that a crash cut short" in out and "bad magic" not in out, out
    # What the reason says: the store finishes the delete (at its open, or at the block's read).
    with TieredStore(path, device="cpu", block_size=B) as store:
        ids = built.outputs[(None, "dave")]
        assert store.open(model, ids, session="dave").restored_tokens == 0 and store.stats()["corrupt"] == 0
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["records"] == BLOCKS - 1  # its record went, the others stay


def test_a_verifier_that_falls_over_is_a_refusal_that_names_it_not_a_traceback(
        copy: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # lmdb.verify raises VerifyError where it cannot begin; anything else it raises (on a shape
    # of damage it does not expect) was a traceback out of every store command.
    offline = lmdb.verify
    path = copy()

    def falls_over(*args: object, **kwargs: object) -> list[str]:
        raise IndexError("list index out of range")

    monkeypatch.setattr(offline, "verify", falls_over)
    for command in (["check", str(path)], ["stats", str(path)], ["clear", str(path), "--tenant", "acme"]):
        assert cli.main(command) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert "offline verifier failed on the file (IndexError: list index out of range)" in err, err
        assert f"tierkv clear {path} --all" in err and "Traceback" not in err, err
    assert cli.main(["clear", str(path), "--all"]) == cli.EXIT_OK  # the remedy given works
    assert sorted(os.listdir(path)) == ["tierkv.lock"]


def test_a_repair_that_meets_damaged_lmdb_pages_says_to_delete_the_store(
        built: Built, copy: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Before: exit 4, "could not write the repair", as if the disk had failed, and no advice.
    from tierkv.tiers.disk import DiskTier
    path = copy()
    key, head = first_head(path)
    put_head(path, key, bytes(len(head)))

    def damaged(self, ops):
        raise lmdb.CorruptedError("mdb_del: MDB_CORRUPTED: Located page was wrong type")

    monkeypatch.setattr(DiskTier, "apply", damaged)
    assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "is damaged (CorruptedError" in err and "delete the directory" in err and "nothing was dropped" in err


@pytest.mark.parametrize("table", ["refs", "sessions", "atime", "heads"])
def test_check_finds_a_damaged_table_and_repair_rebuilds_a_store_that_forgets(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module, table: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # One flipped bit in a table's B-tree. Before: check walked the records alone and found the
    # store sound, and `clear --session` exited 4 (a "disk error") on every run.
    path = copy()
    damage_table(path, table.encode())
    # Whether the longer key still fits its page depends on where the node lies in it (the keys,
    # which the fingerprint changes, place it): where it overruns the page, LMDB's reads there are
    # not safe, and the rebuild reads none of that table.
    unreadable = table in disk.file_damage(path).unsafe
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_BAD_RECORDS
    report = json.loads(capsys.readouterr().out)
    assert list(report["damaged"]) == [table] and report["bad"] == [] and report["rebuilt"] is None
    assert cli.main(["check", str(path)]) == cli.EXIT_BAD_RECORDS
    assert f"tierkv check {path} --repair" in capsys.readouterr().out
    assert cli.main(["check", str(path), "--repair", "--json"]) == cli.EXIT_OK
    rebuilt = json.loads(capsys.readouterr().out)["rebuilt"]
    # The refs table's first row was lost (its key reads 34 bytes long): the block it named may
    # be one a forget of its session could no longer find, and goes. Sessions are rebuilt from
    # their references (a session only references its own tenant's blocks); stamps and heads
    # are only an index.
    lost = 1 if table == "refs" else 0
    stamps = 0 if table == "atime" and unreadable else BLOCKS - 1 if table in ("atime", "refs") else BLOCKS
    assert rebuilt == {"records": BLOCKS - lost, "dropped": lost, "unreferenced": lost, "sessions": 4,
                       "sessions_dropped": 0, "stamps": stamps}
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_OK
    after = json.loads(capsys.readouterr().out)
    assert (after["damaged"], after["bad"], after["stale_heads"], after["records"]) == ({}, [], [], BLOCKS - lost)
    assert cli.main(["clear", str(path), "--session", "dave"]) == cli.EXIT_OK
    assert "removed" in capsys.readouterr().out
    restored, stats = reopened(path, model, built)
    assert stats["corrupt"] == 0 and restored["dave"] == 0
    expected = {**FULL, "dave": 0}
    assert sum(expected[s] - restored[s] for s in FULL) <= lost * 8 * 4 and all(
        restored[s] <= expected[s] for s in FULL)
    if not lost:
        assert restored == expected


@pytest.mark.parametrize("table", ["refs", "meta"])
def test_clear_of_a_damaged_store_says_what_to_do_and_clear_all_always_clears(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module, table: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a damaged refs table made `clear` exit 4 ("disk errors ... run the same command
    # again") on every run, --all included; a damaged meta table read as "not a tierkv store".
    path = copy()
    damage_table(path, table.encode())
    assert cli.main(["clear", str(path), "--session", "dave"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "is damaged" in err and f"tierkv clear {path} --all" in err, err
    assert (f"tierkv check {path} --repair" in err) == (table == "refs"), err  # a meta table is not rebuilt
    if table == "meta":
        assert cli.main(["check", str(path)]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "is damaged" in err and "not a tierkv store" not in err and f"tierkv clear {path} --all" in err
    digest = file_digest(path)
    assert cli.main(["clear", str(path), "--tenant", "acme"]) == cli.EXIT_USAGE
    assert file_digest(path) == digest  # refused before anything was written
    with open(path / "tierkv.lock", "r+b") as lock:  # the intent of a write a kill cut short
        lock.seek(disk._INTENT_AT)
        lock.write(struct.pack("<QQQQ", os.stat(path / "data.mdb").st_ino, 2, 1 << 16, 4096))
    assert cli.main(["clear", str(path), "--all"]) == cli.EXIT_OK
    assert f"removed the store's files (data.mdb, lock.mdb in {path};" in capsys.readouterr().out
    assert sorted(os.listdir(path)) == ["tierkv.lock"]
    # Dropped: it named data.mdb by its inode, which the new store's data.mdb may be given.
    assert (path / "tierkv.lock").stat().st_size < disk._INTENT_AT
    restored, stats = reopened(path, model, built)  # a new store
    assert stats["disk"]["blocks"] == 0 and set(restored.values()) == {0}


def test_clear_all_removes_only_a_store_s_own_files(built: Built, copy: Callable[..., Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = copy()
    damage_table(path, b"refs")
    (path / "notes.txt").write_text("mine")
    assert cli.main(["clear", str(path), "--all"]) == cli.EXIT_USAGE
    assert "holds files a tierkv store does not" in capsys.readouterr().err
    assert sorted(os.listdir(path)) == ["data.mdb", "lock.mdb", "notes.txt", "tierkv.lock"]


def test_clear_all_never_removes_another_program_s_damaged_lmdb_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `tierkv clear --all` deleted it. tierkv.lock was taken for evidence of a store, and
    # the command had just created it itself (the lock of the damage check before the delete).
    path = tmp_path / "theirs"
    env = lmdb.open(str(path), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"mydata")
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"k%06d" % i, bytes(100), db=db)
    env.close()
    with open(path / "data.mdb", "r+b") as f:  # a page flag LMDB's verifier reports
        f.seek(5 * 4096 + 10)
        f.write(b"\xff\xff")
    digest = file_digest(path)
    assert cli.main(["clear", str(path), "--all"]) == cli.EXIT_USAGE
    assert "does not list a tierkv store's tables" in capsys.readouterr().err
    assert file_digest(path) == digest and {"data.mdb", "lock.mdb"} <= set(os.listdir(path))


def test_store_commands_refuse_another_program_s_lmdb_environment_writing_nothing_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: each command locked the directory first, leaving tierkv.lock (its pid) among the
    # other program's files, then refused it as "not a tierkv store".
    path = tmp_path / "theirs"
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"mydata", txn=txn))
    env.close()
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for command in (["stats", str(path)], ["check", str(path), "--repair"], ["clear", str(path), "--all"]):
        assert cli.main(command) == cli.EXIT_USAGE, command
        assert "holds an LMDB environment that is not a tierkv store" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_a_lock_file_that_is_a_symbolic_link_is_refused_by_the_store_commands(
        copy: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = copy()
    victim = tmp_path / "victim"
    victim.write_text("not tierkv's")
    (path / "tierkv.lock").unlink()
    (path / "tierkv.lock").symlink_to(victim)
    digest = file_digest(path)
    for command in (["stats", str(path)], ["check", str(path), "--repair"], ["clear", str(path), "--all"]):
        assert cli.main(command) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert f"{str(path / 'tierkv.lock')!r} is a symbolic link" in err and "remove the link" in err, err
    assert victim.read_text() == "not tierkv's" and file_digest(path) == digest


def test_a_data_file_that_is_a_symbolic_link_is_refused_by_the_store_commands(
        copy: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A store kept on another disk by linking its data.mdb there. Before: `check --repair` of
    # its damaged table put the rebuilt file in the link's place, on this disk, and left the
    # old file on the other; `clear --all` refused it without a remedy.
    path = copy()
    damage_table(path, b"refs")
    elsewhere = tmp_path / "other-disk" / "kv.mdb"
    elsewhere.parent.mkdir()
    os.replace(path / "data.mdb", elsewhere)
    (path / "data.mdb").symlink_to(elsewhere)
    digest = hashlib.sha256(elsewhere.read_bytes()).hexdigest()
    for command in (["stats", str(path)], ["check", str(path), "--repair"], ["clear", str(path), "--all"]):
        assert cli.main(command) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert f"{str(path / 'data.mdb')!r} is a symbolic link" in err and f"`mv {elsewhere} {path / 'data.mdb'}`" \
            in err, err
    assert (path / "data.mdb").is_symlink() and hashlib.sha256(elsewhere.read_bytes()).hexdigest() == digest


def test_a_store_hard_linked_to_another_directory_is_refused_by_the_store_commands(
        copy: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `clear --all` of a `cp -al` copy zeroed the original's records, its data.mdb being the same file.
    path = copy()
    linked = Path(shutil.copytree(path, tmp_path / "linked", copy_function=os.link))  # what `cp -al` makes
    digest = file_digest(path)
    for command in (["stats", str(linked)], ["check", str(linked), "--repair"], ["clear", str(linked), "--all"]):
        assert cli.main(command) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert "data.mdb' has 2 hard links" in err and "`cp -a` instead" in err, err
    assert file_digest(path) == digest and sorted(os.listdir(linked)) == sorted(os.listdir(path))


@pytest.mark.parametrize("metas", [1, 2])
def test_clear_all_removes_a_store_whose_meta_pages_are_damaged(
        built: Built, copy: Callable[..., Path], capsys: pytest.CaptureFixture[str], metas: int) -> None:
    # The store's tables are found through the other meta page (each names the main table's
    # root); with both damaged, by the page that lists them. Before: with both, clear --all (the
    # remedy check gave) refused the file as "not an LMDB file".
    path = copy()
    with open(path / "data.mdb", "r+b") as f:
        f.write(bytes(metas * 4096))
    assert cli.main(["clear", str(path), "--all"]) == cli.EXIT_OK
    assert "removed the store's files" in capsys.readouterr().out
    assert sorted(os.listdir(path)) == ["tierkv.lock"]


def test_a_repair_killed_before_its_swap_leaves_the_store_and_its_leftover_goes_at_the_next_open(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module) -> None:
    # Killed (os._exit, as kill -9) where the rebuilt file is complete and not yet in place: the
    # store is as it was, and its next open removes the leftover. Before: repair.tmp, as large as
    # the records copied, stayed in the store's directory until the next `check --repair`.
    path = copy()
    damage_table(path, b"refs")
    digest = file_digest(path)
    script = ("import os, sys; from tierkv import cli; os.replace = lambda *a: os._exit(9); "
              "sys.exit(cli.main(['check', sys.argv[1], '--repair']))")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 9, proc.stderr
    assert file_digest(path) == digest and (path / "repair.tmp" / "data.mdb").stat().st_size > 0
    from tierkv.tiers.disk import DiskTier
    DiskTier(path, 1 << 40, B).close()
    assert not (path / "repair.tmp").exists()
    assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_OK  # the same repair again, to its end
    restored, stats = reopened(path, model, built)
    assert stats["disk"]["blocks"] == BLOCKS - 1 and sum(FULL.values()) - sum(restored.values()) <= 8 * 4


@pytest.mark.parametrize("problem", ["refs: bad page 5 (keys out of order)", "DB main/refs: walked 0, record says 1",
                                     "main/theirs DB: page 3 stores mp_pgno 4", "a problem of another kind"])
def test_a_verifier_problem_of_another_wording_is_never_read_as_safe(
        built: Built, monkeypatch: pytest.MonkeyPatch, problem: str) -> None:
    # Before: another py-lmdb's wording that held a phrase of damage LMDB's reads survive ("keys
    # out of order", "record says"), whatever its table, was taken for such damage: the store
    # was opened and read through LMDB, where the damage may abort the process.
    verify = lmdb.verify
    from tierkv.tiers.disk import file_damage
    monkeypatch.setattr(verify, "verify", lambda *_args, **_kwargs: [problem])
    found = file_damage(built.path)
    assert found.tables == {"file": problem} and found.unsafe == {"file"}


def test_a_rebuild_writes_its_new_file_without_a_hole(built: Built, copy: Callable[..., Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: written through a map (writemap), the new file was its map's size at once, a hole
    # its pages filled as LMDB wrote them: on a filesystem that filled meanwhile, SIGBUS.
    path = copy()
    damage_table(path, b"refs")
    sizes = []
    replace = os.replace

    def swap(src, dst):
        st = os.stat(src)
        sizes.append((st.st_size, st.st_blocks * 512))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", swap)
    assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_OK
    [(size, allocated)] = sizes
    assert size <= allocated, (size, allocated)


def test_check_finds_a_page_that_names_another_and_repair_rebuilds_the_file(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A refs page whose header names another page number: no read of LMDB's checks it, and its
    # next write frees that other page while in use. Before: check found the store sound. Found
    # by reading the file itself (py-lmdb's offline verifier), as is damage LMDB's own reads
    # abort the process on (a branch page without children, a damaged free list: fuzzing).
    path = copy()
    damage_table(path, b"refs", page_number=True)
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_BAD_RECORDS
    report = json.loads(capsys.readouterr().out)
    assert list(report["damaged"]) == ["refs"] and "stores mp_pgno" in report["damaged"]["refs"]
    assert cli.main(["check", str(path), "--repair", "--json"]) == cli.EXIT_OK
    rebuilt = json.loads(capsys.readouterr().out)["rebuilt"]
    # LMDB's reads do not trip over a page number: every row of the page is read and kept.
    assert rebuilt == {"records": BLOCKS, "dropped": 0, "unreferenced": 0, "sessions": 4,
                       "sessions_dropped": 0, "stamps": BLOCKS}
    assert cli.main(["check", str(path)]) == cli.EXIT_OK
    capsys.readouterr()
    restored, stats = reopened(path, model, built)
    assert restored == FULL and stats["corrupt"] == 0 and not stats["disk_failed"]


def test_check_repair_finishes_a_forget_that_a_crash_cut_short(built: Built, copy: Callable[..., Path],
                                                               model: torch.nn.Module) -> None:
    # A SIGKILL between zeroing a block's head and its record: the record is sound, the head gone.
    # Rewriting the head from the record would bring a forgotten block back; it must be dropped.
    path = copy()
    key, head = first_head(path)
    put_head(path, key, bytes(len(head)))
    report = run("check", str(path), "--json")
    assert report.code == 1, report
    result = json.loads(report.out)
    assert result["stale_heads"] == [] and [b["key"] for b in result["bad"]] == [key.hex()]
    assert run("check", str(path), "--repair").code == 0
    assert key not in records(path)


def test_clear_removes_exactly_the_entries_asked_for(built: Built, copy: Callable[..., Path],
                                                     model: torch.nn.Module,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    paths = {case: copy(case) for case in ("tenant", "session", "sessions", "default", "all")}
    results = dict(zip(("tenant", "session", "sessions", "all"), run_all(
        ["clear", str(paths["tenant"]), "--tenant", "acme"],
        ["clear", str(paths["session"]), "--session", "alice"],
        # Before: the last --session given was the only one cleared.
        ["clear", str(paths["sessions"]), "--session", "alice", "--session", "bob"],
        ["clear", str(paths["all"]), "--all"])))
    assert cli.main(["clear", str(paths["default"]), "--session", "dave", "--default-tenant"]) == 0
    results["default"] = Result(0, capsys.readouterr().out, "")
    expected = {  # blocks removed, then tokens each conversation restores afterwards
        "tenant": (7, {**FULL, "alice": 0, "bob": 0}),
        "session": (3, {**FULL, "alice": 16}),  # the system prompt stays: bob still uses it
        "sessions": (7, {**FULL, "alice": 0, "bob": 0}),
        "default": (3, {**FULL, "dave": 0}),
        "all": (BLOCKS, dict.fromkeys(FULL, 0)),
    }
    sessions = {"tenant": 2, "session": 3, "sessions": 2, "default": 3, "all": 0}
    for case, (removed, restores) in expected.items():
        result = results[case]
        assert result.code == 0 and result.out.startswith(f"removed {removed} blocks"), (case, result)
        restored, stats = reopened(paths[case], model, built)
        assert restored == restores, case
        assert (stats["disk"]["blocks"], stats["sessions"]) == (BLOCKS - removed, sessions[case]), case
    assert "(sessions 'alice', 'bob' of every tenant)" in results["sessions"].out


def test_clear_of_a_session_of_one_tenant_leaves_that_name_in_every_other_tenant(
        built: Built, copy: Callable[..., Path], model: torch.nn.Module, capsys: pytest.CaptureFixture[str]) -> None:
    # Every session name above is one tenant's alone, so a clear that forgot the name in every
    # tenant, --tenant ignored, passed: it removed another tenant's conversation.
    path = copy("tenant-session")
    assert cli.main(["clear", str(path), "--session", "alice", "--tenant", "zeta"]) == 0
    assert capsys.readouterr().out.startswith("removed 0 blocks (session 'alice' of tenant zeta)")
    restored, stats = reopened(path, model, built)
    assert restored == FULL and (stats["disk"]["blocks"], stats["sessions"]) == (BLOCKS, 4)


def test_clear_refuses_names_that_are_not_utf8(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    # A terminal in another encoding hands Python undecodable bytes as lone surrogates.
    for flags in (["--session", "caf\udce9"], ["--tenant", "caf\udce9"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["clear", str(built.path), *flags])
        assert exc.value.code == 2 and "'caf\\udce9' is not valid text" in capsys.readouterr().err


def test_version_and_help_load_no_torch() -> None:
    probe = ("import sys\nfrom tierkv import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "False", result.stderr


@pytest.mark.parametrize("args", [[], ["--all", "--tenant", "acme"], ["--all", "--session", "alice"],
                                  ["--tenant", "acme", "--default-tenant"]])
def test_clear_without_one_clear_filter_is_refused_and_changes_nothing(
        built: Built, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    before = file_digest(built.path)
    with pytest.raises(SystemExit) as refused:
        cli.main(["clear", str(built.path), *args])
    assert refused.value.code == 2 and "usage: tierkv clear" in capsys.readouterr().err
    assert file_digest(built.path) == before


def of_another_release(path: Path, format: int = 99, hash: int = 1) -> Path:
    """``path``'s store, its meta record rewritten as another tierkv release's (format 99 unless told)."""
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"tierkv", msgpack.packb({"format": format, "hash": hash, "block_size": B}),
                db=env.open_db(b"meta", txn=txn))
    env.close()
    return path


def test_missing_path_non_store_incompatible_and_in_use_are_refused(copy: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    missing, empty, a_file, hollow = tmp_path / "nope", tmp_path / "empty", tmp_path / "file", tmp_path / "hollow"
    empty.mkdir()
    a_file.write_bytes(b"")
    hollow.mkdir()
    (hollow / "data.mdb").write_bytes(b"")  # a TieredStore opened there starts a new store
    incompatible = copy("incompatible")
    of_another_release(incompatible)
    held = copy("held")
    # The lock is per open file description: this process holding it refuses the subprocess.
    with TieredStore(held, device="cpu", block_size=B):
        results = run_all(["stats", str(missing)], ["check", str(empty), "--repair"],
                          ["stats", str(incompatible), "--json"], ["clear", str(held), "--all"],
                          ["stats", str(a_file)], ["check", str(a_file)], ["check", str(hollow)])
    verify_refused(results[0], 2, "no such directory")
    verify_refused(results[1], 2, "not a tierkv store")
    verify_refused(results[2], 2, "format 99")
    verify_refused(results[3], 3, f"pid {os.getpid()}")
    verify_refused(results[4], 2, "is a file, not a tierkv store directory")
    verify_refused(results[5], 2, "is a file, not a tierkv store directory")
    verify_refused(results[6], 2, "its data.mdb is empty")
    assert not missing.exists() and list(empty.iterdir()) == []  # nothing created where nothing was
    assert sorted(p.name for p in hollow.iterdir()) == ["data.mdb"] and not (hollow / "data.mdb").stat().st_size
    assert len(records(held)) == BLOCKS


@pytest.mark.parametrize("release", ["format", "hash"])
def test_clear_all_deletes_a_store_of_another_format(copy: Callable[..., Path], model: torch.nn.Module,
                                                     capsys: pytest.CaptureFixture[str], release: str) -> None:
    # Its refusal (open, stats) says to delete the directory; `clear --all`, the command that
    # deletes a store, refused it as well, with the same words. Another release's hash alone is
    # another format too (hand mutation, helper-102: a check of the format alone passed).
    from tierkv.codec import FORMAT_VERSION
    from tierkv.hashing import HASH_VERSION

    old = copy("old")
    of_another_release(old, *((99, HASH_VERSION) if release == "format" else (FORMAT_VERSION, HASH_VERSION + 98)))
    named = "format 99" if release == "format" else f"hash {HASH_VERSION + 98})"
    assert cli.main(["clear", str(old), "--session", "s0"]) == cli.EXIT_USAGE  # no forget can be written there
    err = capsys.readouterr().err
    assert named in err and f"`tierkv clear {old} --all` deletes the whole store" in err
    assert cli.main(["clear", str(old), "--all"]) == cli.EXIT_OK
    assert named in capsys.readouterr().out and not (old / "data.mdb").exists()
    with TieredStore(old, device="cpu", block_size=B) as store:  # a new store there
        assert store.stats()["disk"]["blocks"] == 0
        assert store.open(model, torch.arange(3 * B)[None], session="s0").restored_tokens == 0


@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_a_store_the_command_cannot_write_names_the_way_out(tmp_path, monkeypatch, capsys, code):
    """A store on a read-only mount (a snapshot) or in another user's directory: every command
    takes the store's lock files there, even `stats`; the refusal says so and what to do."""
    import errno

    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=8):
        pass

    def refuse(*args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(path / "tierkv.lock"))

    monkeypatch.setattr(disk.DiskTier, "_lock_directory", staticmethod(refuse))
    assert cli.main(["stats", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "tierkv.lock" in err and "copy it to a writable place" in err


def test_the_package_docstring_points_only_to_what_an_installed_package_has() -> None:
    """It sent users to ``../shared/API.md``, a file of the project's workspace that no checkout
    or installed package holds. It names docstrings, and README sections (the package's
    description, in its metadata) that exist."""
    import importlib.metadata

    doc = tierkv.__doc__
    assert "../" not in doc and ".md" not in doc
    for name in re.findall(r"help\(tierkv\.(\w+)\)", doc):
        assert getattr(tierkv, name).__doc__
    description = importlib.metadata.metadata("tierkv").get_payload() or ""
    headings = re.findall(r"^## (.+)$", description, re.M) or re.findall(
        r"^## (.+)$", (Path(__file__).parents[1] / "README.md").read_text(), re.M)
    sections = [" ".join(found.split()) for found in re.findall(r'"([A-Z][^"]+)"', doc)]
    assert sections and set(sections) <= set(headings), (sections, headings)


def test_the_exit_codes_of_help_are_the_readmes() -> None:
    """``tierkv --help`` left out that a damaged store a command cannot go on with exits 2 (a
    ``clear`` of one session there, a ``check --repair`` of a file LMDB cannot open), which the
    README's table says."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = dict(re.findall(r"^\| (\d+) \| (.+) \|$", readme.split("| exit code | meaning |")[1], re.M))
    helped = dict(re.findall(r"^  (\d+)  (.+(?:\n     .+)*)", cli.EXIT_CODES, re.M))
    assert set(table) == set(helped) == {str(code) for code in (cli.EXIT_OK, cli.EXIT_BAD_RECORDS, cli.EXIT_USAGE,
                                                                 cli.EXIT_IN_USE, cli.EXIT_IO, cli.EXIT_PIPE)}
    for words in ("damaged", "demo --store"):
        assert words in table["2"] and words in " ".join(helped["2"].split()), words
    assert "demo --store" in table["3"] and "demo --store" in helped["3"]


def test_a_rebuild_cut_short_anywhere_leaves_the_store_as_it_was_or_rebuilt_and_its_directory_free(
        copy: Callable[..., Path]) -> None:
    """``DiskTier.rebuild`` (``check --repair`` of a damaged table) cut short at every point of
    its own steps by a signal handler's ``TimeoutError`` (``raised_on_the_way_in``): each time
    the exception reaches the caller, the tier's ``close`` (the command's ``finally``) finishes,
    the directory opens again, and the store is either the damaged one as it was or the rebuilt
    one, whole."""
    from conftest import raised_on_the_way_in
    from tierkv.tiers.disk import DiskTier

    original = copy("original")
    damage_table(original, b"refs")
    damaged = file_digest(original)
    fds = [len(os.listdir("/proc/self/fd"))]
    path = Path(shutil.copytree(original, original.parent / "kv"))
    tiers: list[DiskTier] = []

    def repair():
        tiers.clear()
        tiers.append(DiskTier(path, 1 << 40, B))
        tiers[0].rebuild(["refs"], B)
        return contextlib.nullcontext()

    def check(sent) -> None:
        for tier in tiers:
            tier.close()
        DiskTier(path, 1 << 40, B).close()  # not locked, and a rebuild's leftover removed
        assert not (path / "repair.tmp").exists(), sent
        if file_digest(path) != damaged:
            assert not disk.file_damage(path).tables, sent
            assert cli.main(["check", str(path), "--json"]) == cli.EXIT_OK, sent
        # Cut as os.open returned, the descriptor is lost before any code can hold it: Python's
        # own limit (a handler runs there whatever this thread's signal mask: others take it).
        # That one descriptor, no more: a baseline taken anew there let any other leak of the
        # same cut pass.
        if sent[0][2] == "open" and len(os.listdir("/proc/self/fd")) == fds[0] + 1:
            fds[0] += 1
        assert len(os.listdir("/proc/self/fd")) == fds[0], f"a file left open by the cut at {sent}"
        shutil.rmtree(path)  # the damaged store again, for the next cut
        shutil.copytree(original, path)

    # Not shutil.rmtree's own steps: it answers an OSError of is_dir() (a timeout too) as "no directory".
    steps = {"rebuild", "salvage", "record", "_sound_tenant", "_salvage", "_unlock", "_allocate_file",
             "_raise_handlers"}
    assert raised_on_the_way_in(repair, check, within=steps, timeout=True) > 300
    repair()  # uncut, to its end
    assert file_digest(path) != damaged
    check([("none", None, None)])


def test_a_store_rebuilt_is_rebuilt_again_when_damaged_again(built: Built, copy: Callable[..., Path],
                                                            model: torch.nn.Module) -> None:
    # A rebuilt file holds no free page until a store writes to it (the heads `check --repair`
    # writes after the rebuild: not where that step failed or a cut ended the command first), and
    # it opens at its own size. Before: a rebuild of it made the copy with a map of that size, and
    # the copy's second transaction (its sessions and stamps) failed with MapFullError.
    from tierkv.tiers.disk import DiskTier

    path = copy()
    kept = []
    for table in ("refs", "atime"):
        damage_table(path, table.encode())
        tier = DiskTier(path, 1 << 40, B)
        try:
            kept.append(tier.rebuild([table], B).records)
        finally:
            tier.close()
    assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_OK  # its heads written
    assert cli.main(["check", str(path)]) == cli.EXIT_OK
    _restored, stats = reopened(path, model, built)
    assert kept == [BLOCKS - 1, BLOCKS - 1] and stats["corrupt"] == 0 and stats["disk"]["blocks"] == BLOCKS - 1


def cut_command_everywhere(copy: Callable[..., Path], command: list[str], within: set[str], damaged: bool,
                           linked: bool = False) -> int:
    """``cli.main([command[0], path, *command[1:]])`` on a copy of the built store (its refs table
    damaged: ``damaged``; its data file a link to one beside it: ``linked``), cut at every point of
    the functions named ``within`` by a handler's ``TimeoutError`` (``raised_on_the_way_in``).
    After each cut: no descriptor left open (bar the one a cut at ``os.open``'s return loses:
    Python's own limit), and the store as it was or as the command left it, its directory free
    (a linked one still refused). Returns the number of points."""
    from conftest import raised_on_the_way_in

    from tierkv.tiers.disk import DiskTier

    original = copy("original")
    if damaged:
        damage_table(original, b"refs")
    if linked:
        os.replace(original / "data.mdb", original.parent / "elsewhere.mdb")
        os.symlink(original.parent / "elsewhere.mdb", original / "data.mdb")
    path = Path(shutil.copytree(original, original.parent / "kv", symlinks=True))
    fds = [len(os.listdir("/proc/self/fd"))]

    def run_command():
        cli.main([command[0], str(path), *command[1:]])
        return contextlib.nullcontext()

    def check(sent) -> None:
        if sent[0][2] == "open" and len(os.listdir("/proc/self/fd")) == fds[0] + 1:
            fds[0] += 1  # see test_a_rebuild_cut_short_anywhere_...
        assert len(os.listdir("/proc/self/fd")) == fds[0], f"a file left open by the cut at {sent}"
        if linked:  # refused, its message saying whether the link's target exists
            assert cli.main(["stats", str(path)]) == cli.EXIT_USAGE, sent
        elif (path / "data.mdb").exists():
            assert cli.main(["check", str(path)]) in (cli.EXIT_OK, cli.EXIT_BAD_RECORDS), sent
        else:  # removed by clear --all: a new store opens there
            DiskTier(path, 1 << 40, B).close()
        shutil.rmtree(path)
        shutil.copytree(original, path, symlinks=True)

    return raised_on_the_way_in(run_command, check, within=within, timeout=True)


@pytest.mark.parametrize("command", [["check", "--repair"], ["clear", "--session", "dave"], ["stats"],
                                     ["clear", "--all"]])
def test_a_command_cut_short_anywhere_raises_and_leaves_the_store_whole_and_free(
        built: Built, copy: Callable[..., Path], command: list[str]) -> None:
    """``tierkv check --repair`` of a damaged table, ``clear`` of a session, ``stats``, and
    ``clear --all`` of a damaged store (its files removed), run through
    ``cli.main`` and cut short at every point of the command's own steps by a signal handler's
    ``TimeoutError`` (a program that embeds the CLI under ``signal.alarm``): each time the
    exception reaches the caller (not an exit code for a disk error), nothing is left open, and
    the next command finds the store as it was or as the command left it. Before: the commands
    answered the timeout with exit 4 ("could not rebuild ...: the store is as it was", "a disk
    error stopped clear"), or went on past it (the rebuild's optional heads)."""
    damaged = command[0] == "check" or command == ["clear", "--all"]
    # Not main's: its frame is where the command's progress bar is freed, whose tqdm.__del__ loses
    # a handler's exception as every finaliser does (main itself only maps exceptions to codes).
    steps = {"cmd_check", "cmd_clear", "cmd_stats", "summarise", "_scan", "_file_damage", "_refusals", "_open_tier",
             "_new_tier", "_open_store", "repair", "rebuild", "_read_for_clear", "_refuse_unopenable", "_emit",
             "_check_text", "_progress", "_remove_damaged", "remove_store", "stat_or_none", "_raise_handlers",
             "_is_directory", "_stored_meta", "stored_meta", "exists", "isdir", "isfile"}
    assert cut_command_everywhere(copy, command, steps, damaged) > 50


def test_a_repair_whose_directory_sync_fails_says_the_rebuilt_file_is_in_place(
        built: Built, copy: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The rebuilt file is put in place, then the sync of the store's directory fails. Before: exit
    # 4 with "the store is as it was", while the store was the rebuilt one.
    path = copy()
    damage_table(path, b"refs")
    damaged = file_digest(path)

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_fsync)
        assert cli.main(["check", str(path), "--repair"]) == cli.EXIT_IO
    err = capsys.readouterr().err
    assert "the rebuilt file is in place" in err and "as it was" not in err, err
    assert file_digest(path) != damaged and not (path / "repair.tmp").exists()
    assert cli.main(["check", str(path)]) == cli.EXIT_OK


@pytest.mark.parametrize("command", [["stats"], ["check"], ["clear", "--session", "dave"], ["clear", "--all"],
                                     ["stats", "linked"]])
def test_a_timeout_as_a_command_looks_at_the_stores_files_is_raised_not_read_as_a_missing_file(
        built: Built, copy: Callable[..., Path], command: list[str]) -> None:
    """A signal handler's ``TimeoutError`` as ``os.stat`` returns inside ``os.path.exists``,
    ``isdir``, ``isfile`` or ``getsize`` (the first three answer False to any ``OSError``), where
    the commands look at the store's directory and its data file before opening it: it reaches
    the caller, and the store is left whole and free. Before: "no such directory" or "not a
    tierkv store (no data.mdb)" (exit 2) for a store that is there, ``clear --all`` of a damaged
    store refused as "not a plain file", a data file linked elsewhere refused as a link to
    nothing; and cut as ``stored_meta`` sized the data file, LMDB's read-only environment stayed
    open while the exception lived: every later command in the process was refused as "not a
    tierkv store (... already open in this process)"; the lock file's allocation before it took
    the timeout for a directory it cannot write, and the command went on."""
    # The looks themselves (os.path's helpers are where the OSError is taken for an answer), the
    # functions that make them, and the refusals' reads of the files before any open.
    looks = {"exists", "isdir", "isfile", "getsize", "stat_or_none", "_is_directory",
             "_stored_meta", "stored_meta", "_file_damage", "file_damage", "remove_store", "_link_refusal",
             "_refuse_links", "_refuse_foreign", "_refuse_shared", "_holds_store_tables", "_allocate_lock_file_of",
             "_truncated", "_lock_directory", "_lock_file", "islink", "_is_link"}
    linked = command[-1] == "linked"
    assert cut_command_everywhere(copy, command[:-1] if linked else command, looks, command == ["clear", "--all"],
                                  linked) > 10


def run_as_printed(message: str, path: Path, deleting: bool = False) -> list[Result]:
    """Each `tierkv ...` command on ``path`` quoted in ``message`` (those deleting the store only
    if ``deleting``), split as a shell splits it and run."""
    commands = [shlex.split(command) for command in re.findall(r"`(tierkv [^`]*)`", message)]
    commands = [args[1:] for args in commands if str(path) in args and (deleting or "--all" not in args)]
    assert commands, message
    return [run(*args) for args in commands]


def test_commands_in_messages_run_as_printed_for_a_path_with_spaces(built: Built, tmp_path: Path,
                                                                    model: torch.nn.Module) -> None:
    # Before: the path went into the command unquoted, and `tierkv check /x/my kv --repair` run as
    # printed was "unrecognized arguments"; `stats` told to run `tierkv check --repair`, no path.
    path = Path(shutil.copytree(built.path, tmp_path / "my kv"))
    damage_table(path, b"refs")
    with pytest.raises(disk.DamagedStore) as info:
        TieredStore(path, device="cpu", block_size=B)
    assert f"`tierkv check '{path}' --repair`" in str(info.value)
    assert [result.code for result in run_as_printed(str(info.value), path)] == [cli.EXIT_OK]
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == BLOCKS - 1
    key, head = first_head(path)  # a record whose head and header are both damaged: unreadable
    put_head(path, key, b"\x01" * len(head))
    env = lmdb.open(str(path), max_dbs=8)
    damage_in_place(env, b"blocks", key, lambda record: flipped(record, 0, 0xFF))
    env.close()
    stats = run("stats", str(path))
    assert stats.code == cli.EXIT_OK and f"unreadable  1 records (run `tierkv check '{path}' --repair`)" in stats.out
    assert [result.code for result in run_as_printed(stats.out, path)] == [cli.EXIT_OK]
    assert json.loads(run("stats", "--json", str(path)).out)["unreadable"] == 0
    report = run("check", str(path))
    assert report.code == cli.EXIT_OK and "0 bad" in report.out


def _zero_meta_pages(path: Path) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.write(bytes(2 * 4096))


@pytest.mark.parametrize(("damage", "repairable"), [
    (lambda path: damage_table(path, b"refs"), True),  # a table's rows, found by the scan at open
    (lambda path: damage_table(path, b"meta"), False),  # the meta record, which the CLI reads first
    (_zero_meta_pages, False),  # LMDB's meta pages: not an LMDB file to LMDB
], ids=["refs table", "meta record", "meta pages"])
def test_a_damaged_store_s_advice_at_open_works_when_followed(built: Built, copy: Callable[..., Path],
                                                             damage: Callable[[Path], None], repairable: bool) -> None:
    # Before: every DamagedStore said to run `tierkv check PATH --repair`; where LMDB cannot open
    # the file or the meta record cannot be read, that repair refused, repeating the same advice.
    path = copy()
    damage(path)
    with pytest.raises(disk.DamagedStore) as info:
        TieredStore(path, device="cpu", block_size=B)
    message = str(info.value)
    assert info.value.repairable is repairable
    assert (f"`tierkv check {path} --repair`" in message) is repairable, message
    if not repairable:
        assert "`tierkv check --repair` cannot rebuild it there: delete the directory" in message, message
        refused = run("check", str(path), "--repair")
        verify_refused(refused, cli.EXIT_USAGE, "cannot rebuild it there")
        assert f"tierkv check {path} --repair" not in refused.err  # not told to run itself again
    assert [result.code for result in run_as_printed(message, path, deleting=not repairable)] == [cli.EXIT_OK]
    with TieredStore(path, device="cpu", block_size=B) as store:
        assert store.stats()["disk"]["blocks"] == (BLOCKS - 1 if repairable else 0)


@pytest.mark.parametrize("command", [["stats"], ["check"], ["clear", "--all"]])
def test_an_empty_path_is_named_as_such(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Before: ": no such directory" (`tierkv stats "$STORE"` with STORE unset), naming nothing.
    assert cli.main([command[0], "", *command[1:]]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "tierkv: error: PATH is empty (an unset variable?); give the store's directory\n"
