"""The benchmark scripts run at a toy size, so that they cannot rot unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_ttft_benchmark_reports_every_policy() -> None:
    out = run("-m", "benchmarks.ttft", "--tokens", "64", "--repeats", "1", "--block-size", "16", "--shapes", "small")
    for policy in ("recompute", "floor", "tierkv device", "tierkv host", "tierkv disk (after restart)",
                   "tierkv disk (after reboot: cold page cache)"):
        assert f"| {policy}" in out


def test_decode_benchmark_reports_its_figures() -> None:
    out = run("-m", "benchmarks.decode", "--context", "64", "--steps", "4", "--repeats", "1", "--spill-mb", "2")
    assert "TieredCache / DynamicCache" in out and "p99 during spill" in out


def test_gpu_check_dry_run_is_exact_on_cpu() -> None:
    out = run("benchmarks/gpu_check.py", "--cpu")
    # 2 models x 2 dtypes x 3 tiers, and the host-pool churn case.
    assert out.count("| exact |") == 13 and "MISMATCH" not in out
    assert "| 4 sessions x 4 turns" in out
    assert "(restore + prefill) / (restore alone + prefill alone)" in out


@pytest.mark.parametrize("args", [["--quick"]])
def test_chatbot_example_runs_exact(args: list[str], tmp_path: Path) -> None:
    out = run("examples/chatbot.py", *args, "--store", str(tmp_path / "kv"))
    assert "restart" in out and " NO" not in out


def test_micro_benchmark_reports_every_figure() -> None:
    out = run("-m", "benchmarks.micro", "--mib", "8", "--repeats", "1")
    for figure in ("prefix hashing", "codec encode", "codec decode", "LMDB spill into a new store",
                   "LMDB spill at the disk budget", "LMDB read + verify, 8 MiB (page cache)",
                   "LMDB read + verify, 8 MiB (cold page cache)", "reopen of that store", "restore from host"):
        assert f"| {figure}" in out


def test_chat_trace_runs_every_policy_exactly_and_writes_its_reports(tmp_path: Path) -> None:
    from benchmarks import chat_trace

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
