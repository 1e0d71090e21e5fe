"""The benchmark scripts run at a toy size, so that they cannot rot unnoticed."""

from __future__ import annotations

import os
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, *args: str) -> str:
    """The program's stdout; it must leave no scratch of its own in the temporary directory."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not left_behind(scratch)
    return result.stdout


def left_behind(scratch: Path) -> list[str]:
    return sorted(p.name for p in scratch.iterdir() if p.name.startswith("tierkv-"))


def test_ttft_benchmark_reports_every_policy(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.ttft", "--tokens", "64", "--repeats", "1", "--block-size", "16", "--shapes", "small")
    for policy in ("recompute", "floor", "tierkv device", "tierkv host", "tierkv disk (after restart)",
                   "tierkv disk (after reboot: cold page cache)"):
        assert f"| {policy}" in out
    assert "| policy | TTFT / floor | paired per round | TTFT / recompute |" in out
    assert "| floor (ready DynamicCache) | 1.00 | 1.00 | " in out  # the floor over itself, paired too


def test_decode_benchmark_reports_its_figures(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.decode", "--context", "64", "--steps", "4", "--repeats", "1", "--spill-mb", "2")
    assert "TieredCache / DynamicCache" in out and "p99 during spill" in out


def test_gpu_check_dry_run_is_exact_on_cpu(tmp_path: Path) -> None:
    out = run(tmp_path, "benchmarks/gpu_check.py", "--cpu")
    # 2 models x 2 dtypes x 3 tiers, and the host-pool churn case.
    assert out.count("| exact |") == 13 and "MISMATCH" not in out
    assert "| 4 sessions x 4 turns" in out
    assert "(restore + prefill) / (restore alone + prefill alone)" in out


@pytest.mark.parametrize("kept", [True, False], ids=["store-given", "temporary-store"])
def test_chatbot_example_runs_exact(kept: bool, tmp_path: Path) -> None:
    store = ["--store", str(tmp_path / "kv")] if kept else []
    out = run(tmp_path, "examples/chatbot.py", "--quick", *store)
    assert "restart" in out and " NO" not in out
    # A store it was given is the user's, and stays; its own temporary one is removed (run checks).
    assert (tmp_path / "kv" / "data.mdb").is_file() == kept


def test_micro_benchmark_reports_every_figure(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.micro", "--mib", "8", "--repeats", "1")
    for figure in ("prefix hashing", "codec encode", "codec decode", "LMDB spill into a new store",
                   "LMDB spill at the disk budget", "LMDB read + verify, 8 MiB (page cache)",
                   "LMDB read + verify, 8 MiB (cold page cache)", "reopen of that store", "restore from host"):
        assert f"| {figure}" in out


def test_chat_trace_runs_every_policy_exactly_and_writes_its_reports(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import chat_trace

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    out = tmp_path / "trace"
    summary = chat_trace.main(["--sessions", "3", "--turns", "8", "--layers", "1", "--hidden", "64",
                               "--system-tokens", "32", "--user-median", "8", "--user-max", "24",
                               "--reply-median", "3", "--reply-max", "4", "--context", "96",
                               "--block-size", "8", "--cpu", "--out", str(out)])
    policies = summary["policies"]
    assert set(policies) == {"recompute", "unbounded", "tierkv", "tierkv-no-disk", "offloaded"}
    assert all(row["exact"] for row in policies.values() if "skipped" not in row)
    tiered = policies["tierkv"]
    for tier in ("device", "host"):
        assert tiered["peak_bytes"][tier] <= tiered["budgets"][tier]
    assert sum(tiered["hit_tokens"].values()) > 0
    assert {p.name for p in out.iterdir()} >= {"results.md", "results.json", "ttft_cdf.png", "hits_over_time.png"}
    assert not left_behind(scratch)  # the policies' stores were scratch


class _EchoModel:
    """Stands in for a model in the trace's replay: generate() appends the tokens it was asked for."""

    def generate(self, ids, past_key_values=None, max_new_tokens=0, streamer=None, **kwargs):
        out = torch.cat([ids, torch.full((1, max_new_tokens), 7)], dim=1)
        streamer.put(ids)
        streamer.put(out[:, -max_new_tokens:])
        return out


def test_chat_trace_interleaves_policies_in_rotating_rounds() -> None:
    import numpy as np

    from tierkv.bench import Policy, PolicyResult, Turn, interleave, mark_exact

    turns = [Turn(s, np.array([3 + i]), 2, False) for i, s in enumerate([0, 1, 0, 0, 1, 1, 0])]
    log: list[tuple[str, int]] = []

    def policy(name: str) -> Policy:
        return Policy(PolicyResult(name), lambda s, ids: log.append((name, ids.shape[1])),
                      lambda *a: None, settle=lambda: log.append((name, -1)))

    policies = [policy("a"), policy("b"), policy("c")]
    interleave(policies, _EchoModel(), np.array([1, 2]), turns, 3, None)
    played = [name for name, n in log if n >= 0]
    # Rounds of 3 turns (the last one short), each started by the next policy in turn.
    assert played == ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["b"] * 3 + ["c"] * 3 + ["a"] * 3 + ["c", "a", "b"]
    assert [name for name, n in log if n < 0] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # Every policy saw the same conversation, turn by turn: each turn re-sends its session's history.
    lengths = {name: [n for who, n in log if who == name and n >= 0] for name in "abc"}
    assert lengths["a"] == lengths["b"] == lengths["c"] == [3, 3, 6, 9, 6, 9, 12]
    for p in policies:
        assert len(p.result.ttft) == len(turns) and len(p.outputs) == len(turns)
    mark_exact(policies)
    assert all(p.result.exact for p in policies)
    policies[2].outputs[4] = policies[2].outputs[4].clone()
    policies[2].outputs[4][0, -1] += 1
    policies[1].outputs.pop()
    mark_exact(policies)
    assert [p.result.exact for p in policies] == [True, False, False]


def test_chat_trace_in_several_rounds_is_exact_and_counts_every_turn(tmp_path: Path) -> None:
    from benchmarks import chat_trace

    summary = chat_trace.main(["--sessions", "3", "--turns", "7", "--layers", "1", "--hidden", "64",
                               "--system-tokens", "32", "--user-median", "8", "--user-max", "24",
                               "--reply-median", "3", "--reply-max", "4", "--context", "96",
                               "--block-size", "8", "--cpu", "--round-turns", "3", "--out", str(tmp_path)])
    policies = summary["policies"]
    assert all(row["exact"] for row in policies.values() if "skipped" not in row)
    tiered = policies["tierkv"]
    assert sum(tiered["hit_tokens"].values()) + tiered["miss_tokens"] > 0
    assert "ttft per turn tierkv / unbounded, median" in summary["ratios"]
    assert "policies taking turns in rounds of 3 turns" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit):
        chat_trace.main(["--round-turns", "-1", "--out", str(tmp_path)])
