"""The benchmark scripts run at a toy size, so that they cannot rot unnoticed."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import VOCAB, random_ids
from tierkv import TieredStore

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_a_scratch_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs from its own directory: the trace's flags are checked by making --out,
    whose default (``tierkv-bench``) is relative, and tests of other flags left it in the checkout."""
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    monkeypatch.chdir(scratch)


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
    # Three rounds: with one, a single preemption of the floor's turn on a busy machine printed
    # store.open's share as 0.000 (helper-96 saw it once); a median of three takes one such outlier.
    out = run(tmp_path, "-m", "benchmarks.ttft", "--tokens", "64", "--repeats", "3", "--block-size", "16", "--shapes", "small")
    for policy in ("recompute", "floor", "tierkv device", "tierkv host", "tierkv disk (after restart)",
                   "tierkv disk (after reboot: cold page cache)"):
        assert f"| {policy}" in out
    assert ("| policy | TTFT / floor | paired per round | its quartiles | TTFT / recompute "
            "| of which store.open / floor, paired | KV held / floor's |") in out
    assert "| floor (ready DynamicCache) | 1.00 | 1.00 | 1.00-1.00 | " in out  # the floor over itself, paired too
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in out.splitlines() if line.startswith("| tierkv")}
    assert len(rows) == 4
    for name, cells in rows.items():
        low, high = map(float, cells[3].split("-"))
        assert low <= float(cells[2]) <= high, (name, cells)  # the median lies between the quartiles
        # store.open is a part of the turn: more than nothing, less than the whole of it
        assert 0 < float(cells[5]) < float(cells[2]), (name, cells)
        # A Llama's layers hold the conversation as the floor's do, keys and values in one tensor.
        assert cells[6].rstrip(" |") == "1.00", (name, cells)


def test_reads_benchmark_compares_disk_reads_side_by_side_with_one_thread(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.reads", "--shape", "small", "--tokens", "64", "80", "--repeats", "1",
              "--block-size", "16")
    assert "| tokens | MiB read | open, side by side / one thread | TTFT / floor, one thread " in out
    rows = [line.split(" | ") for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row[0].lstrip("| ") for row in rows] == ["64", "80"]
    for row in rows:
        assert float(row[1]) > 0  # the restore was read from disk
        for cell in row[2:]:
            median, quartiles = cell.rstrip(" |").split(" (")
            low, high = map(float, quartiles.rstrip(")").split("-"))
            assert low <= float(median) <= high and float(median) > 0


def test_decode_benchmark_reports_its_figures(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.decode", "--context", "64", "--steps", "4", "--repeats", "1", "--spill-mb", "2",
              "--window", "16", "--reply", "80", "--block-size", "8")
    assert "| decode time per token, TieredCache / DynamicCache, paired per step (median) |" in out
    # A reply past a window of 16 in blocks of 8: the device holds room for the window (15 tokens),
    # two margins and the new token, 32 tokens, against the 16 of DynamicCache's last concatenation;
    # the whole conversation, 144 tokens, would be 9.00 of it.
    assert "| KV on the device after the reply, TieredCache / DynamicCache | 2.00 " in out
    assert "| the same, had the sliding layers held the whole conversation | 9.00 |" in out
    assert "| decode time per token through the reply, TieredCache / DynamicCache, paired per step (median) |" in out
    during = int(re.search(r"\| decode steps during the spill, all rounds \(no spill: 4\) \| (\d+) \|", out).group(1))
    # The p50/p99 during the spill are of those steps alone, and only where there were some.
    assert ("p99 during spill" in out) == (during > 0)
    assert re.search(r"\| the spill landed \(last round\) \| \d+ ms after decoding began, in step \d+ \|", out)


class _Pending:
    """A store whose writes land after ``left`` more questions."""

    def __init__(self, left: int) -> None:
        self.left = left

    def stats(self) -> dict:
        self.left -= 1
        return {"pending_writes": max(self.left, 0)}


def test_decode_steps_count_as_during_the_spill_only_while_writes_are_queued() -> None:
    from benchmarks.decode import steps_while_spilling

    model = _EchoForward()
    times, taken, landed = steps_while_spilling(model, None, torch.tensor([[1]]), _Pending(3), limit=10)
    assert (len(times), taken, model.calls) == (2, 3, 3) and 0 <= landed < float("inf")
    times, taken, landed = steps_while_spilling(model, None, torch.tensor([[1]]), _Pending(50), limit=5)
    assert (len(times), taken, landed) == (5, 5, float("inf"))


class _GrowingCache:
    """Stands in for a DynamicCache: each forward appends its tokens; ``crop`` cuts back."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        assert n < 0  # as transformers 5.25's: tokens to remove
        self.length += n


class _RecordingForward:
    """A model whose forwards note the context each one decoded at."""

    def __init__(self) -> None:
        self.contexts: list[int] = []

    def __call__(self, token, past_key_values=None):
        self.contexts.append(past_key_values.get_seq_length())
        past_key_values.length += token.shape[1]
        return SimpleNamespace(logits=torch.zeros(1, 1, 4))


def test_decode_spill_figures_compare_steps_at_one_context() -> None:
    """A step's time grows with its context: a spill that outlasts the quiet decode's steps must not
    be timed at longer contexts than the quiet steps it is compared with."""
    from benchmarks.decode import decode_steps, steps_while_spilling

    quiet, busy = _RecordingForward(), _RecordingForward()
    decode_steps(quiet, _GrowingCache(100), torch.tensor([[1]]), 4)
    times, taken, _ = steps_while_spilling(busy, _GrowingCache(100), torch.tensor([[1]]), _Pending(50), limit=9)
    assert (len(times), taken) == (9, 9)
    assert quiet.contexts == [100] * 4 and busy.contexts == [100] * 9


class _EchoForward:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, token, past_key_values=None):
        self.calls += 1
        return SimpleNamespace(logits=torch.zeros(1, 1, 4))


def test_gpu_check_fails_where_a_row_says_mismatch_or_wrong() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import failure
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert failure("| llama float16 | disk | MISMATCH (pool fallbacks 0) | 8 | 16 |")
    assert failure("| CPU blocks reopened on CUDA | WRONG: 32 stored on CPU, 32 restored on CUDA, exact |")
    assert not failure("| llama float16 | disk | exact | 8 | 16 |")
    assert not failure("| llama4_text bfloat16 | disk | drift (a reused DynamicCache parts from plain generate alike: "
                       "transformers' own) | [0, 25, 35] | 45 |")
    assert not failure("| host -> device | 20.1 | 21.0 | 0.96 |")


def test_gpu_check_dry_run_is_exact_on_cpu(tmp_path: Path) -> None:
    out = run(tmp_path, "benchmarks/gpu_check.py", "--cpu")
    # 6 models (Llama, GPT-2, Mistral's window, DeepSeek-V3's latent attention, Gemma 4's KV of other
    # shapes per layer, Llama 4's chunks) x 2 dtypes x 3 tiers, and the host-pool churn case; Llama 4
    # in bf16 equal to a reused DynamicCache, which parts from plain generate at its second turn.
    assert out.count("| exact |") == 34 and "MISMATCH" not in out
    assert out.count("| drift (a reused DynamicCache parts from plain generate alike") == 3
    assert out.count("| mistral sliding window 8 ") == 6
    assert out.count("| deepseek_v3 latent attention ") == out.count("| gemma4_text KV of other shapes per layer") == \
        out.count("| llama4_text chunked attention 8 ") == 6
    assert "| 4 sessions x 4 turns" in out
    assert "| disk records read side by side | ok: " in out and "helpers read on ['cpu']" in out
    assert "| a forked child drops the store | ok: the child exited 0; the parent's turn after the fork exact" in out
    # The window (7 tokens) and a margin (8) at least, two margins and the new token at most.
    for model_type in ("mistral", "gemma4_text"):
        held = re.search(rf"\| a reply of 60 tokens past a window of 8, {model_type} \| ok: exact True, the device holds "
                         r"(\d+) tokens of 79 per sliding layer, the rest in host memory \|", out)
        assert held and 15 <= int(held.group(1)) <= 24
    assert "(restore + prefill) / (restore alone + prefill alone)" in out
    assert "| model checks per open (2 layers: 21 tensors" in out and "x a one-token forward" in out


@pytest.mark.parametrize("kept", [True, False], ids=["store-given", "temporary-store"])
def test_chatbot_example_runs_exact(kept: bool, tmp_path: Path) -> None:
    store = ["--store", str(tmp_path / "kv")] if kept else []
    out = run(tmp_path, "examples/chatbot.py", "--quick", *store)
    assert "restart" in out and " NO" not in out
    # A store it was given is the user's, and stays; its own temporary one is removed (run checks).
    assert (tmp_path / "kv" / "data.mdb").is_file() == kept


def test_micro_benchmark_reports_every_figure(tmp_path: Path) -> None:
    out = run(tmp_path, "-m", "benchmarks.micro", "--mib", "8", "--repeats", "1", "--check-layers", "2")
    for figure in ("prefix hashing", "codec encode", "codec decode: copy + checksum", "codec checksum of a record",
                   "LMDB spill into a new store",
                   "LMDB spill at the disk budget", "LMDB read + verify, 8 MiB (page cache)",
                   "LMDB read + verify, 8 MiB (cold page cache)", "reopen of that store", "restore from host",
                   "model checks per open (2 layers: 21 tensors, 33 modules; cpu, cold caches)"):
        assert f"| {figure}" in out


TOY_TRACE = ["--sessions", "3", "--turns", "8", "--layers", "1", "--hidden", "64", "--system-tokens", "32",
             "--user-median", "8", "--user-max", "24", "--reply-median", "3", "--reply-max", "4", "--context", "96",
             "--block-size", "8", "--cpu"]


def prompt_lengths(args: dict) -> list[int]:
    """Each turn's prompt length in the trace these args make: the session's history (or the system
    prompt, at a reset or a first turn) plus the user's tokens."""
    import argparse

    from tierkv.bench import make_trace

    _, turns = make_trace(argparse.Namespace(**args), 4096)
    history: dict[int, int] = {}
    prompts = []
    for t in turns:
        prompt = (args["system_tokens"] if t.reset or t.session not in history else history[t.session]) + len(t.user_tokens)
        prompts.append(prompt)
        history[t.session] = prompt + t.reply_tokens
    return prompts


def check_trace_report(report: dict, device_budget: int, host_budget: int) -> None:
    """What every chat-trace report must hold, against figures computed here from its own args."""
    policies = report["policies"]
    assert set(policies) == {"recompute", "resident", "unbounded", "tierkv", "tierkv-no-disk", "offloaded"}
    prompt_tokens = sum(prompt_lengths(report["args"]))
    for name, row in policies.items():
        if "skipped" in row:
            continue
        assert row["exact"] and 0 <= row["logit_error"] <= 1e-3, name
        assert row["ttft_p50_ms"] <= row["ttft_p95_ms"] <= row["ttft_p99_ms"], name
        if name not in ("recompute", "resident"):  # the policies without a store
            # Every prompt token of every turn is either restored from a tier or recomputed.
            assert sum(row["hit_tokens"].values()) + row["miss_tokens"] == prompt_tokens, name
    tiered, no_disk = policies["tierkv"], policies["tierkv-no-disk"]
    for row in (tiered, no_disk):
        assert (row["budgets"]["device"], row["budgets"]["host"]) == (device_budget, host_budget)
        for tier in ("device", "host"):
            assert row["peak_bytes"][tier] <= row["budgets"][tier]
    assert tiered["hit_tokens"]["disk"] > 0 and tiered["budgets"]["disk"] > 0
    assert no_disk["hit_tokens"]["disk"] == 0 and no_disk["budgets"]["disk"] == 0
    # GB/s only where bytes moved: (d) moved none to or from a disk it lacks. To disk it leaves out
    # the writer's waits for a CPU, which its wall time counts.
    assert 0 < tiered["to_disk_wall_gb_per_s"] <= tiered["gb_per_s"]["host_to_disk"]
    assert no_disk["gb_per_s"]["host_to_disk"] is None and no_disk["gb_per_s"]["disk_to_host"] is None
    if report["device"] == "cpu":
        # A CPU device tier hands its blocks to the host tier and back without a timed copy.
        assert tiered["moved_bytes"]["device_to_host"] > 0 and tiered["gb_per_s"]["device_to_host"] is None
    else:
        assert tiered["gb_per_s"]["device_to_host"] > 0 and tiered["gb_per_s"]["host_to_device"] > 0
    # KV bytes read back, whole records: at most a block's for each disk hit token (a restore may use
    # one token of a block it reads whole; a block still on its way to disk is a disk hit served from
    # the write's own buffer, with no read).
    kv_per_token, block = report["kv_bytes_per_token"], report["args"]["block_size"]
    assert tiered["moved_bytes"]["disk_to_host"] % kv_per_token == 0
    assert tiered["moved_bytes"]["disk_to_host"] <= tiered["hit_tokens"]["disk"] * block * kv_per_token
    assert "hit_tokens" not in policies["resident"]  # no store: nothing it could count
    for name in ("resident", "unbounded", "tierkv", "tierkv-no-disk"):
        row = policies[name]
        assert len(row["ttft_ms"]) == len(prompt_lengths(report["args"]))
        assert row["ttft_p50_ms"] == pytest.approx(float(np.percentile(row["ttft_ms"], 50)))
        if name != "resident":
            # The first commit (which stores the shared system prompt too) apart, the percentiles the
            # later turns'.
            commits = row["commit_ms"]
            assert len(commits) == len(row["commit_cpu_ms"]) == len(row["ttft_ms"])
            assert row["commit_first_ms"] == commits[0]
            assert row["commit_p99_ms"] == pytest.approx(float(np.percentile(commits[1:], 99)))
            assert 0 < row["commit_p50_ms"] <= row["commit_p99_ms"]
            # The hits plot's data, in the JSON: cumulative per turn, ending at the row's totals.
            after = row["hit_tokens_after_each_turn"]
            assert len(after) == len(row["ttft_ms"]) and after[-1] == row["hit_tokens"]
            assert all(a[t] <= b[t] for a, b in zip(after, after[1:]) for t in ("device", "host", "disk"))


def test_chat_trace_runs_every_policy_exactly_and_writes_its_reports(tmp_path: Path) -> None:
    import json

    out = tmp_path / "trace"
    # As a newcomer runs it: the module entry, in a process of its own.
    table = run(tmp_path, "-m", "benchmarks.chat_trace", *TOY_TRACE, "--out", str(out))
    report = json.loads((out / "results.json").read_text())
    ws = report["working_set_bytes"]
    check_trace_report(report, int(0.10 * ws), int(0.30 * ws))
    assert {report["args"][k] for k in ("device_budget", "host_budget", "disk_budget")} == {"10%", "30%", "1TiB"}
    assert "budgets of (c) and (d) device 10%, host 30%, (c) disk 1TiB" in table
    assert {p.name for p in out.iterdir()} >= {"results.md", "results.json", "ttft_cdf.png", "hits_over_time.png"}
    # The table reports "-" for the GB/s of directions that moved nothing, not 0.00.
    no_disk_line = next(line for line in table.splitlines() if line.startswith("| tierkv-no-disk |"))
    assert no_disk_line.split(" | ")[8] == "-/-/-/-"
    # What the moves count: whole blocks, against hits of the tokens used.
    assert "of whole blocks: a restore that uses only part of a block reads" in table
    # Each store's first commit (it stores the shared system prompt too) apart from the percentiles.
    first = report["policies"]["tierkv"]["commit_first_ms"]
    tiered_line = next(line for line in table.splitlines() if line.startswith("| tierkv |"))
    assert tiered_line.split(" | ")[10].endswith(f"({first:.2f})") and "[5] Wall time of cache.commit()" in table


class _EchoModel:
    """Stands in for a model in the trace's replay: generate() appends the tokens it was asked for,
    and counts the calls that were timed (those given a streamer) and those that were not."""

    def __init__(self) -> None:
        self.untimed: list[int] = []  # the call numbers of generates without a streamer
        self.calls = 0

    def generate(self, ids, past_key_values=None, max_new_tokens=0, streamer=None, return_dict_in_generate=False,
                 **kwargs):
        self.calls += 1
        out = torch.cat([ids, torch.full((1, max_new_tokens), 7)], dim=1)
        if streamer is None:
            self.untimed.append(self.calls)
        else:
            streamer.put(ids)
            streamer.put(out[:, -max_new_tokens:])
        if not return_dict_in_generate:
            return out
        logits = tuple(torch.arange(8.0).unsqueeze(0) for _ in range(max_new_tokens))
        return SimpleNamespace(sequences=out, logits=logits)


def test_chat_trace_interleaves_policies_in_rotating_rounds() -> None:
    import numpy as np

    from tierkv.bench import Policy, PolicyResult, Turn, interleave, mark_exact

    turns = [Turn(s, np.array([3 + i]), 2, False) for i, s in enumerate([0, 1, 0, 0, 1, 1, 0])]
    log: list[tuple[str, int]] = []

    def policy(name: str) -> Policy:
        return Policy(PolicyResult(name), lambda s, ids: log.append((name, ids.shape[1])),
                      lambda *a: None, settle=lambda: log.append((name, -1)))

    policies = [policy("a"), policy("b"), policy("c")]
    model = _EchoModel()
    interleave(policies, model, np.array([1, 2]), turns, 3, None)
    # One untimed warm-up generate, first: a process's first one costs several times the next.
    assert model.untimed == [1] and model.calls == 3 * len(turns) + 1
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
    assert [p.result.logit_error for p in policies] == [0.0, 0.0, 0.0]
    # The same tokens, but logits off by more than float rounding: a restore a little wrong.
    policies[1].result.first_logits[3] = policies[1].result.first_logits[3] + 0.01
    policies[2].result.first_logits[3] = policies[2].result.first_logits[3] + 1e-5  # rounding
    mark_exact(policies)
    assert [p.result.exact for p in policies] == [True, False, True]
    std = float(torch.arange(8.0).std())
    assert policies[1].result.logit_error == pytest.approx(0.01 / std, rel=1e-3)
    policies[1].result.first_logits[3] = policies[0].result.first_logits[3]
    policies[2].outputs[4] = policies[2].outputs[4].clone()
    policies[2].outputs[4][0, -1] += 1
    policies[1].outputs.pop()
    mark_exact(policies)
    assert [p.result.exact for p in policies] == [True, False, False]


def test_chat_trace_in_several_rounds_with_budgets_given_as_flags(tmp_path: Path) -> None:
    import json

    from benchmarks import chat_trace

    summary = chat_trace.main([*TOY_TRACE, "--round-turns", "3", "--device-budget", "4KiB", "--host-budget", "20%",
                               "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["policies"] == json.loads(json.dumps(summary["policies"]))
    check_trace_report(report, 4096, int(0.20 * report["working_set_bytes"]))
    assert {"ttft per turn tierkv / unbounded, median", "ttft per turn tierkv / resident, median",
            "ttft_p50 unbounded / resident", "ttft_p50 tierkv / resident"} <= set(summary["ratios"])
    md = (tmp_path / "results.md").read_text()
    assert "policies taking turns in rounds of 3 turns" in md and "device 4KiB, host 20%" in md


@pytest.mark.parametrize("flags", [[], ["--system-tokens", "30", "--block-size", "16"], ["--system-tokens", "0"]],
                         ids=["prompt-in-whole-blocks", "prompt-ending-inside-a-block", "no-prompt"])
def test_chat_trace_working_set_is_what_an_unbounded_store_holds(flags: list[str], tmp_path: Path) -> None:
    """(c)'s budgets are percentages of the working set: it must be the KV the store needs to hold
    everything, which the unbounded device tier, evicting nothing, holds at the end. A system prompt
    ending inside a block is kept in each conversation's copy of that block."""
    from tierkv.bench import parse_args, run

    result = run(parse_args([*TOY_TRACE, *flags, "--out", str(tmp_path)]))
    assert result["results"]["unbounded"].final_stats["device"]["bytes"] == result["working_set_bytes"]


def test_chat_trace_peaks_are_the_tiers_high_water_marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak per tier is the most a tier held at any moment, counted here at every put into a
    memory tier. Sampled after each commit, it missed the moment within a commit when a
    conversation's new chain rests beside the partial tail it replaces: the unbounded store's
    device peak read 57856 bytes (the working set) for 59904 held."""
    from tierkv import bench
    from tierkv.tiers.memory import MemoryTier

    held: dict[int, int] = {}
    put = MemoryTier.put

    def counted(self: MemoryTier, key: bytes, block: object, nbytes: int) -> bool:
        stored = put(self, key, block, nbytes)
        held[id(self)] = max(held.get(id(self), 0), self.used)
        return stored

    monkeypatch.setattr(MemoryTier, "put", counted)
    stores: list[TieredStore] = []

    class Kept(bench.TieredStore):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            stores.append(self)

    monkeypatch.setattr(bench, "TieredStore", Kept)
    result = bench.run(bench.parse_args([*TOY_TRACE, "--out", str(tmp_path)]))
    by_budget = {(s.stats()["device"]["budget"], s.stats()["host"]["budget"], s.stats()["disk"]["budget"]): s
                 for s in stores[1:]}  # the first: the model's untimed warm-up
    for name in ("unbounded", "tierkv", "tierkv-no-disk"):
        res = result["results"][name]
        store = by_budget[tuple(res.budgets[t] for t in ("device", "host", "disk"))]
        for tier, space in (("device", store._device), ("host", store._host)):
            assert res.peak[tier] == held.get(id(space), 0) <= res.budgets[tier], (name, tier)
    # The trace has such moments (the unbounded device tier, which only grows, peaked above its end).
    assert result["results"]["unbounded"].peak["device"] > result["working_set_bytes"]


def test_chat_trace_disk_budget_flag_reaches_the_store(tmp_path: Path) -> None:
    import json

    from benchmarks import chat_trace

    # No system prompt at all (its warm-up open had nothing to open).
    chat_trace.main([*TOY_TRACE, "--turns", "2", "--disk-budget", "3MiB", "--system-tokens", "0", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    policies = report["policies"]
    assert report["args"]["system_tokens"] == 0
    assert policies["tierkv"]["budgets"]["disk"] == 3 * 2**20 and policies["tierkv-no-disk"]["budgets"]["disk"] == 0


def test_chat_trace_says_when_budgets_make_one_policy_measure_another(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A device budget holding the whole working set, or a disk budget of 0, ran without a word:
    (c) and (d) then measured (b), or (c) measured (d), under their own names."""
    import json

    from benchmarks import chat_trace
    from tierkv.bench import budget_notes

    assert budget_notes(99, 1, 100) == [] and len(budget_notes(100, 0, 100)) == 2
    chat_trace.main([*TOY_TRACE, "--turns", "2", "--device-budget", "100%", "--disk-budget", "0",
                     "--out", str(tmp_path)])
    captured = capsys.readouterr()
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["budget_notes"]) == 2
    for note in report["budget_notes"]:
        assert f"note: {note}" in captured.err and f"**Note:** {note}." in captured.out
    assert "measure what (b) does" in report["budget_notes"][0] and "measures what (d) does" in report["budget_notes"][1]
    assert report["policies"]["tierkv"]["hit_tokens"]["disk"] == 0


def test_chat_trace_prints_its_table_before_the_reports_and_says_when_they_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tierkv.bench as bench

    monkeypatch.setattr(bench, "run", lambda args: {"results": {}})
    monkeypatch.setattr(bench, "summarise", lambda run_: {})
    monkeypatch.setattr(bench, "markdown", lambda run_, summary: "| the table |")

    def full(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert exc.value.code == 4 and "| the table |" in out
    assert "could not write the reports" in err and "No space left on device" in err


def test_chat_trace_quick_sets_defaults_that_explicit_flags_override() -> None:
    from tierkv.bench import QUICK, parse_args

    quick = parse_args(["--quick"])
    assert {k: getattr(quick, k) for k in QUICK} == QUICK
    given = parse_args(["--quick", "--sessions", "32", "--context", "4096"])
    assert (given.sessions, given.context, given.turns) == (32, 4096, QUICK["turns"])
    assert parse_args([]).sessions == 16  # without --quick, the full trace's defaults
    # The rotation gives every policy every place in a round equally often only over a multiple of
    # their number of rounds: five on a CPU (recompute, resident, unbounded, tierkv, tierkv-no-disk).
    for args in (quick, parse_args([])):
        assert -(-args.turns // args.round_turns) % 5 == 0, (args.turns, args.round_turns)


@pytest.mark.parametrize("flags, message", [
    (["--sessions", "0"], "--sessions must be 1 or more"),
    (["--turns", "-1"], "--turns must be 1 or more"),
    (["--layers", "0"], "--layers must be 1 or more"),
    (["--block-size", "0"], "--block-size must be 1 or more"),
    (["--block-size", str(2**20 + 1)], "--block-size must be 1048576 or less"),
    (["--user-median", "0"], "--user-median must be 1 or more"),
    (["--user-median", "64", "--user-max", "32"], "--user-max (32) must be at least --user-median (64)"),
    (["--reply-median", "1", "--reply-max", "1"], "--reply-max must be 2 or more"),
    (["--reply-median", "8", "--reply-max", "4"], "--reply-max (4) must be at least --reply-median (8)"),
    (["--hidden", "96"], "--hidden must be 64 or a positive multiple of 128"),
    (["--hidden", "0"], "--hidden must be 64 or a positive multiple of 128"),
    (["--context", "832"], "give --context 833 or more"),
    (["--zipf", "-0.5"], "--zipf must be a finite number of 0 or more"),
    (["--zipf", "nan"], "--zipf must be a finite number of 0 or more"),
    (["--round-turns", "-1"], "--round-turns must be 0 or more"),
    (["--device-budget", "ten%"], "give a percentage of the working set"),
    (["--host-budget=-5%"], "give a percentage of the working set"),
    (["--host-budget", "-5%"], "--host-budget -5%: a budget is 0 or more"),  # argparse: "expected one argument"
    (["--disk-budget", "-1MiB", "--quick"], "--disk-budget -1MiB: a budget is 0 or more"),
    (["--disk-budget", "3 parsecs"], "or a percentage of the working set"),
    (["--device-budget", "12XB"], "unknown byte unit"),
    (["--seed", "-1"], "--seed must be from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "--seed must be from 0 to 2**64 - 1"),
    (["--out", __file__], "is a file; give a directory"),
    (["--out", "/proc/tierkv-out"], "cannot write there"),
    (["--out", "/proc"], "cannot write there"),  # there, but not writable (also by root)
    (["--device-budget", "1e300%"], "from 0 to 100000"),
    (["--host-budget", "100001%"], "from 0 to 100000"),
])
def test_chat_trace_refuses_bad_flags_saying_what_to_give(flags: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.bench import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_chat_trace_accepts_the_edges_of_each_flag() -> None:
    from tierkv.bench import parse_args

    args = parse_args(["--context", "833", "--zipf", "0", "--reply-median", "2", "--reply-max", "2", "--hidden", "128",
                       "--device-budget", "0", "--host-budget", "150%", "--disk-budget", "1.5GB"])
    assert (args.context, args.hidden, args.host_budget) == (833, 128, "150%")


def test_budget_flags_read_percentages_of_the_working_set_and_byte_sizes() -> None:
    from tierkv.bench import budget_bytes

    assert budget_bytes("10%", 12345, "--device-budget") == int(0.10 * 12345)
    assert budget_bytes(" 12.5% ", 1000, "--device-budget") == 125
    assert budget_bytes("64MiB", 1, "--host-budget") == 64 * 2**20
    assert budget_bytes("1000", 1, "--host-budget") == 1000
    with pytest.raises(ValueError, match="--host-budget"):
        budget_bytes("lots", 1, "--host-budget")


def test_disk_write_gb_per_s_leaves_out_the_writers_waits_for_a_cpu() -> None:
    from tierkv.bench import disk_write_seconds

    stats = {"move_seconds": {"host_to_disk": 2.0, "disk_to_host": 0.5}, "write_cpu_wait_seconds": 1.5}
    assert disk_write_seconds(stats) == 0.5


def test_a_store_counts_its_writers_waits_for_a_cpu(tiny_model, tmp_path: Path) -> None:
    """Beside processes that keep every CPU busy, the writer (at a lower priority) waits for one."""
    model = tiny_model()
    # Each spins until its parent is gone: a pytest killed in here (a CI run stopped) left them
    # spinning for good, every CPU taken from the next run.
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as store:
            for seed in range(6):
                ids = random_ids(64, seed=seed)
                cache = store.open(model, ids)
                cache.commit(model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False))
                store.flush()
            stats = store.stats()
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    wall, waited = stats["move_seconds"]["host_to_disk"], stats["write_cpu_wait_seconds"]
    assert stats["moved_bytes"]["host_to_disk"] > 0
    assert 0 < waited < wall, (waited, wall)


def test_disk_read_seconds_count_only_opens_that_read_from_disk(tiny_model, tmp_path: Path) -> None:
    """The chat trace's GB/s from disk divides the bytes read by this time: opens served from memory
    (most of a trace's) must not add theirs."""
    model = tiny_model()
    ids = random_ids(64, seed=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=16) as store:
        cache = store.open(model, ids)
        cache.commit(model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False))
        for _ in range(20):
            assert store.open(model, ids).restored_from["device"] == 63
        stats = store.stats()
    assert stats["moved_bytes"]["disk_to_host"] == 0 and stats["move_seconds"]["disk_to_host"] == 0.0
    with TieredStore(tmp_path / "kv", device="cpu", block_size=16) as store:  # a restart: from disk
        assert store.open(model, ids).restored_from["disk"] == 63
        stats = store.stats()
    assert stats["moved_bytes"]["disk_to_host"] > 0 and stats["move_seconds"]["disk_to_host"] > 0


def test_gb_per_s_only_where_bytes_moved_and_time_was_taken() -> None:
    from tierkv.bench import achieved_gb_per_s

    moved = {"device_to_host": 4096, "host_to_device": 0, "host_to_disk": 2_000_000_000, "disk_to_host": 0}
    seconds = {"host_to_disk": 2.0, "disk_to_host": 0.25}  # a store times only its disk paths
    assert achieved_gb_per_s(moved, seconds) == {"device_to_host": None, "host_to_device": None,
                                                 "host_to_disk": 1.0, "disk_to_host": None}


def test_chat_trace_without_matplotlib_says_how_to_get_the_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.bench import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises
    assert plots({"results": {}}, tmp_path) == []
    assert 'pip install -e ".[bench]"' in capsys.readouterr().out


def test_offloaded_policy_reuses_a_session_cache_only_for_the_conversation_it_holds() -> None:
    """At a context that resets conversations often, with the new prompt often longer than the old
    cache, a cache per session (policy (e)'s rule, with a plain DynamicCache) must give exactly the
    replies of recomputation."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from tierkv.bench import Policy, PolicyResult, SessionCaches, extends, interleave, make_trace, mark_exact

    args = dict(seed=0, sessions=2, turns=20, zipf=0.0, system_tokens=32, user_median=12, user_max=24,
                reply_median=3, reply_max=4, context=70)
    system, turns = make_trace(argparse.Namespace(**args), 512)
    prompts = prompt_lengths(args)
    # The case the rule exists for: a reset whose prompt is longer than the session's last output.
    last: dict[int, int] = {}
    longer_resets = 0
    for t, prompt in zip(turns, prompts, strict=True):
        longer_resets += t.reset and prompt > last.get(t.session, prompt)
        last[t.session] = prompt + t.reply_tokens
    assert longer_resets >= 2

    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    made: list[DynamicCache] = []
    caches = SessionCaches(lambda: made.append(DynamicCache()) or made[-1])
    policies = [Policy(PolicyResult("recompute"), lambda s, ids: None, lambda *a: None),
                Policy(PolicyResult("per-session cache"), caches.cache_for, caches.after_turn)]
    interleave(policies, model, system, turns, 5, None)
    mark_exact(policies)
    assert policies[1].result.exact
    assert len(made) <= len(turns) - 5  # and it did reuse: a rule that never reuses is not the rule

    a = torch.tensor([[1, 2, 3]])
    assert extends(a, torch.tensor([[1, 2, 3, 4]])) and not extends(None, a)
    assert not extends(a, torch.tensor([[1, 2, 9, 4]])) and not extends(a, a)


@pytest.mark.parametrize("flags, message", [
    (["--sessions", "0"], "--sessions must be 1 or more"),
    (["--turns", "0"], "--turns must be 1 or more"),
    (["--layers", "0"], "--layers must be 1 or more"),
    (["--system-tokens", "0"], "--system-tokens must be 1 or more"),
    (["--reply-tokens", "0"], "--reply-tokens must be 1 or more"),
    (["--block-size", "0"], "--block-size must be 1 or more"),
    (["--block-size", str(2**20 + 1)], "--block-size must be 1048576 or less"),
    (["--store", ""], "--store was given an empty path"),
    (["--hidden", "0"], "--hidden must be 64, 128, 192 or a multiple of 128"),
    (["--hidden", "320"], "--hidden must be 64, 128, 192 or a multiple of 128"),
    (["--seed", "-1"], "--seed must be from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "--seed must be from 0 to 2**64 - 1"),
    (["--store", __file__], "is a file; give a directory"),
])
def test_the_demo_refuses_bad_flags_saying_what_to_give(flags: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.demo import main

    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_demo_reads_a_store_under_home_as_the_store_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import tierkv.demo as demo

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "file").write_text("not a store")
    monkeypatch.setattr(demo, "build_model", lambda *a: pytest.fail("the model was built before the flags were checked"))
    with pytest.raises(SystemExit) as exc:
        demo.main(["--quick", "--store", "~/file"])
    assert exc.value.code == 2 and f"--store {str(tmp_path / 'file')!r} is a file" in capsys.readouterr().err


def test_the_demo_refuses_a_store_it_cannot_open_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from tierkv.demo import main

    with TieredStore(tmp_path / "kv", block_size=16):
        pass
    with pytest.raises(SystemExit) as exc:  # before the model is built
        main(["--quick", "--store", str(tmp_path / "kv")])
    assert exc.value.code == 2
    assert "holds a store of --block-size 16: give --block-size 16, or another directory" in capsys.readouterr().err
    with TieredStore(tmp_path / "kv", block_size=16):  # held by another process: refused as the store commands do
        held = subprocess.run([sys.executable, "-m", "tierkv", "demo", "--quick", "--store", str(tmp_path / "kv"),
                               "--block-size", "16", "--layers", "1", "--hidden", "64"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert held.returncode == 3 and "in use" in held.stderr and "Traceback" not in held.stderr


def test_the_tools_raise_a_handlers_timeout_rather_than_answer_with_a_usage_error(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's ``TimeoutError`` at any point of the demo's store opening, the trace's
    check of ``--out`` and its loading of a checkpoint reaches the caller. Before, each ``except
    OSError`` took it for the store's, the directory's or the checkpoint's fault: exit 2, saying
    to give another ``--store``, that ``--out`` cannot be written, or that ``--model`` cannot be
    loaded."""
    import contextlib

    from conftest import raised_on_the_way_in
    from tierkv import bench, demo, trace_model

    def opened() -> contextlib.nullcontext:
        demo.open_store(str(tmp_path / "kv"), 16, {}, torch.device("cpu")).close()
        return contextlib.nullcontext()

    def checked() -> contextlib.nullcontext:
        bench.parse_args([*TOY_TRACE, "--out", str(tmp_path / "out")])
        return contextlib.nullcontext()

    def loaded() -> contextlib.nullcontext:
        trace_model._load_checkpoint(str(checkpoint), torch.float32, 64, "--context", 0)
        return contextlib.nullcontext()

    def reported() -> contextlib.nullcontext:
        bench.main([*TOY_TRACE, "--out", str(tmp_path / "out")])
        return contextlib.nullcontext()

    for enter, steps in ((opened, {"open_store"}), (checked, {"parse_args"}), (loaded, {"_load_checkpoint"})):
        assert raised_on_the_way_in(enter, lambda sent: None, within=steps, timeout=True) >= 1
    # The reports' writing after a run, the run itself left out.
    fields = ("args", "device", "model", "logit_tolerance", "working_set_bytes", "budget_notes", "kv_bytes_per_token",
              "stored_bytes_per_token")
    monkeypatch.setattr(bench, "run", lambda args: {**dict.fromkeys(fields), "results": {}})
    monkeypatch.setattr(bench, "summarise", lambda run: {})
    monkeypatch.setattr(bench, "markdown", lambda run, summary: "table")
    monkeypatch.setattr(bench, "plots", lambda run, out: [])
    assert raised_on_the_way_in(reported, lambda sent: None, within={"main"}, timeout=True) >= 1


def test_the_demo_runs_the_turns_asked_for_and_removes_its_store_whatever_ends_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tierkv.demo as demo

    small = ["--quick", "--layers", "1", "--hidden", "64", "--system-tokens", "16", "--reply-tokens", "2"]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    demo.main([*small, "--sessions", "5", "--turns", "2"])
    turns = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+\s+user", line)]
    assert [line.split()[1] for line in turns] == ["user0", "user1", "user0", "user1"]  # 2, then 2 after the restart
    assert not left_behind(tmp_path)
    # --help said "turns in all, round robin over popular users": the restart's two turns come on top.
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "turns before the restart, two more after it" in " ".join(capsys.readouterr().out.split())

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "simulate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.main(small)
    assert not left_behind(tmp_path)


def test_the_demo_fails_when_a_reply_differs_from_recomputation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Its exactness column is what the demo shows; nothing checked that a reply differing from
    # plain transformers' ends it with exit 1 (as `tierkv --help` says) rather than a "NO" scrolling by.
    import tierkv.demo as demo

    generate = demo.timed_generate

    def off_by_one_token(model, ids, reply_tokens, store=None, session=None):
        out, ttft, cache = generate(model, ids, reply_tokens, store, session)
        if store is not None:
            out = out.clone()
            out[:, -1] = (out[:, -1] + 1) % model.config.vocab_size  # never fed: commit takes it
        return out, ttft, cache

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(demo.tempfile, "tempdir", None)
    monkeypatch.setattr(demo, "timed_generate", off_by_one_token)
    with pytest.raises(SystemExit) as exc:
        demo.main(["--quick", "--layers", "1", "--hidden", "64", "--system-tokens", "16", "--reply-tokens", "2",
                   "--sessions", "1", "--turns", "1"])
    assert "differs from recomputation" in str(exc.value.code)  # a message: exit status 1
    assert capsys.readouterr().out.rstrip().endswith("NO") and not left_behind(tmp_path)


def test_the_demos_quick_sets_defaults_that_flags_given_with_it_override(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierkv.demo as demo

    built = []

    def stop(layers: int, hidden: int, seed: int) -> None:
        built.append((layers, hidden))
        raise SystemExit(0)

    monkeypatch.setattr(demo, "build_model", stop)
    for flags, expected in ((["--quick"], (2, 128)), (["--quick", "--layers", "1", "--hidden", "64"], (1, 64))):
        with pytest.raises(SystemExit):
            demo.main(flags)
        assert built.pop() == expected


@pytest.mark.parametrize("program, flags, message", [
    ("benchmarks.micro", ["--repeats", "0"], "--repeats: 0 is too small: give 1 or more"),
    ("benchmarks.micro", ["--mib", "-4"], "--mib: -4 is too small: give 1 or more"),
    ("benchmarks.micro", ["--check-layers", "0"], "--check-layers: 0 is too small: give 1 or more"),
    ("benchmarks.ttft", ["--tokens", "1"], "--tokens: 1 is too small: give 2 or more"),
    ("benchmarks.ttft", ["--block-size", str(2**20 + 1)], "--block-size: 1048577 is too large: give 1048576 or less"),
    ("benchmarks.decode", ["--steps", "zero"], "--steps: 'zero' is not an integer"),
    ("benchmarks.reads", ["--tokens", "1"], "--tokens: 1 is too small: give 2 or more"),
])
def test_the_other_benchmarks_refuse_bad_flags_saying_what_to_give(program: str, flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", program, *flags], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_ttft_rounds_give_no_policy_a_fixed_neighbour() -> None:
    from benchmarks.ttft import round_orders

    names = ["recompute", "floor", "device", "host", "disk", "cold"]
    orders = round_orders(names, 8)
    assert all(sorted(order) == sorted(names) for order in orders)
    for name in names:
        before = {order[order.index(name) - 1] if order.index(name) else None for order in orders}
        assert len(before) >= 3, (name, before)  # what runs just before it changes from round to round
    assert round_orders(names, 8) == orders  # seeded: a rerun plays the same rounds
    assert names == ["recompute", "floor", "device", "host", "disk", "cold"]  # the caller's list is left alone


# TOY_TRACE without the random model's size flags, for a checkpoint of its own.
TOY_TRACE_ANY_MODEL = [flag for i, flag in enumerate(TOY_TRACE)
                       if flag not in ("--layers", "--hidden") and TOY_TRACE[i - 1] not in ("--layers", "--hidden")]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe", "glm4_moe_lite"])
def test_a_random_moe_model_of_the_trace_has_few_experts(arch: str) -> None:
    """``--arch`` of a MoE family built its default experts (DeepSeek-V3's 256 of 2,048 wide):
    840M parameters at 4 layers of 512, most of them experts no token reaches, where a Llama of
    those flags has 14M. At most 8 experts as wide as the dense MLP, 2 a token; the attention
    (and so the KV a turn stores) as the family makes it."""
    from tierkv.trace_model import _random_model

    with torch.device("meta"):
        model = _random_model(arch, 4, 512, 2048, 0, torch.float32)
        llama = _random_model("llama", 4, 512, 2048, 0, torch.float32)
    config = model.config
    experts = [getattr(config, key) for key in ("n_routed_experts", "num_experts", "num_local_experts")
               if isinstance(getattr(config, key, None), int)]
    assert experts and set(experts) == {8} and config.num_experts_per_tok == 2
    assert sum(p.numel() for p in model.parameters()) < 8 * sum(p.numel() for p in llama.parameters())
    if arch == "deepseek_v3":
        assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    from tierkv.trace_model import _shrink_experts

    dense = AutoConfig.for_model("llama")
    before = dense.to_dict()
    _shrink_experts(dense, 512)
    assert dense.to_dict() == before


def test_a_random_model_setting_head_dim_per_layer_keeps_its_kv_of_other_shapes() -> None:
    """``--arch gemma4_text``: its config sets head_dim per layer (512 in its full-attention layers),
    which it refuses to read as one value, and the trace died there with transformers' traceback
    (h125). Its layers' head_dims are scaled as the others' (64, and 128 where the family has twice
    theirs), and its per-layer input embeddings take the trace's vocabulary, not 262,144 ids
    (268M parameters at 4 layers of 128)."""
    from tierkv.trace_model import _random_model

    with torch.device("meta"):
        model = _random_model("gemma4_text", 4, 512, 2048, 0, torch.float32)
        llama = _random_model("llama", 4, 512, 2048, 0, torch.float32)
    config = model.config
    assert [(layer.head_dim, layer.num_key_value_heads) for layer in config.per_layer_config] == \
        [(64, 4), (64, 4), (64, 4), (128, 4)]
    assert sum(p.numel() for p in model.parameters()) < 2 * sum(p.numel() for p in llama.parameters())


@pytest.mark.parametrize("arch", ["llama4", "qwen3_5", "mllama"])
def test_a_random_model_whose_config_nests_its_text_config_is_sized_by_the_flags(monkeypatch: pytest.MonkeyPatch,
                                                                                arch: str) -> None:
    """``--arch llama4`` (``qwen3_5``, ``mllama``): the causal LM reads a text config nested in the
    family's, which the flags did not reach: 48 layers 5120 wide (Llama 4's 202,048-id embedding,
    or Qwen 3.5's 248,320 of 4096), minutes to build before the trace could start or be refused.
    Its text config takes the flags as a plain family's config does."""
    import tierkv.trace_model as trace_model
    from tierkv.trace_model import RANDOM_VOCAB, _random_model

    monkeypatch.setattr(trace_model, "_refuse_unsupported", lambda *args: None)  # mllama's images: the sizes here
    with torch.device("meta"):
        model = _random_model(arch, 4, 512, 2048, 0, torch.float32)
        llama = _random_model("llama", 4, 512, 2048, 0, torch.float32)
    text = model.config.get_text_config(decoder=True)
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (512, 4, RANDOM_VOCAB)
    assert getattr(text, "head_dim", 64) == 64
    assert sum(p.numel() for p in model.parameters()) < 8 * sum(p.numel() for p in llama.parameters())


@pytest.mark.parametrize("arch, hidden", [("qwen3_5", 4096), ("mllama", 4096), ("llama4", 5120), ("gemma3", 2304)])
def test_a_nested_text_config_is_sized_by_the_flags_where_its_width_is_theirs(monkeypatch: pytest.MonkeyPatch, arch: str,
                                                                             hidden: int) -> None:
    """``--hidden`` equal to the family's own text width: its text config was left as the family's
    checkpoints have it (the flags reached it only where the widths differed): ``--arch qwen3_5
    --layers 4 --hidden 4096`` built 32 layers and a 248,320-id embedding, 9 billion parameters,
    and ``--arch llama4 --hidden 5120`` 48 layers, refused as out of scale (h129)."""
    import tierkv.trace_model as trace_model
    from tierkv.trace_model import RANDOM_VOCAB, _random_model

    # Built past the refusal of images (mllama's, gemma3's: test_a_family_embedding_images_...):
    # the sizes are what this checks.
    monkeypatch.setattr(trace_model, "_refuse_unsupported", lambda *args: None)
    with torch.device("meta"):
        model = _random_model(arch, 4, hidden, 2048, 0, torch.float32)
    text = model.config.get_text_config(decoder=True)
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (hidden, 4, RANDOM_VOCAB)


@pytest.mark.parametrize("arch, name", [("gemma3", "Gemma3ForConditionalGeneration"),
                                        ("phi4_multimodal", "Phi4MultimodalForCausalLM")])
def test_a_family_embedding_images_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch, arch: str,
                                                                 name: str) -> None:
    """``--arch`` of a family store.open refuses for its images: refused from its model on the meta
    device, as store.open words it, before the real build. Its towers are not sized by the flags:
    Gemma 3's vision tower built 94M parameters, Phi-4's multimodal model took 20 s, before the
    refusal."""
    import tierkv.trace_model as trace_model

    built: list[str] = []

    def from_config(config: object, **kwargs: object) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        if next(model.parameters()).device.type != "meta":
            built.append(type(model).__name__)
        return model

    monkeypatch.setattr(trace_model, "AutoModelForCausalLM", SimpleNamespace(from_config=from_config))
    with pytest.raises(trace_model.ModelFlagError, match=f"tierkv cannot serve this model: {name} embeds images or "
                                                         r"audio \(vision_config\).*; give another --arch"):
        trace_model._random_model(arch, 1, 64, 128, 0, torch.float32)
    assert built == []


@pytest.mark.parametrize("call", [0, 1, 2, 3, 4])
def test_a_signal_handlers_exception_as_a_random_model_is_built_is_raised_not_taken_for_its_family(
        monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """A ``SIGALRM`` handler's timeout as ``--arch``'s model is made (its config, the count on the
    meta device of it and of a llama of the flags, the build) reaches the caller, not told to give
    another ``--arch`` as a family that cannot be built (h129)."""
    import signal

    import tierkv.trace_model as trace_model
    from conftest import HandlerTimeout, _raise_handler_timeout

    calls = [0]

    def cut(real):
        def make(*args, **kwargs):
            calls[0] += 1
            if calls[0] == call + 1:
                _raise_handler_timeout(signal.SIGALRM, sys._getframe())
            return real(*args, **kwargs)
        return make

    # The calls in order: the family's config, its model on the meta device, a llama's config and
    # model there, then the build.
    monkeypatch.setattr(trace_model, "AutoConfig", SimpleNamespace(for_model=cut(AutoConfig.for_model)))
    monkeypatch.setattr(trace_model, "AutoModelForCausalLM",
                        SimpleNamespace(from_config=cut(AutoModelForCausalLM.from_config)))
    with pytest.raises(HandlerTimeout):
        trace_model._random_model("llama", 1, 64, 128, 0, torch.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 written by save_pretrained: a user's own model, as --model loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("qwen2-tiny")
    config = AutoConfig.for_model("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("model_flags, family, kv_per_token", [
    ([], "llama", 2 * 1 * 1 * 64 * 4),  # the default: 1 layer, 1 KV head of 64, float32
    (["--arch", "gpt2", "--layers", "2"], "gpt2", 2 * 2 * 1 * 64 * 4),  # no GQA: hidden 64 is 1 head
    (["--arch", "gpt_neox", "--hidden", "128"], "gpt_neox", 2 * 1 * 2 * 64 * 4),
    (["--dtype", "bfloat16"], "llama", 2 * 1 * 1 * 64 * 2),
    ("checkpoint", "qwen2", 2 * 3 * 2 * 16 * 4),
    # Latent attention: a layer caches its latent (512) and rotary keys (64), whatever its heads;
    # the fourth layer is MoE (first_k_dense_replace 3), of 8 experts.
    # At --hidden 256 (4 query heads), as a random model's GQA of 2 KV heads had it fail in attention.
    (["--arch", "deepseek_v3", "--layers", "4", "--hidden", "256"], "deepseek_v3", 4 * (512 + 64) * 4),
    # 9 units of 64 a layer: at 3 layers a block holds 28, one zeroed (layout.py), which the working
    # set counts as the store does (it counted the model's 27, 3.7% short: h125).
    (["--arch", "deepseek_v3", "--layers", "3", "--hidden", "256"], "deepseek_v3", 3 * (512 + 64) * 4),
    # KV of other shapes per layer: three sliding layers of 1 KV head x 64, a full-attention one of
    # 1 x 128 (the family's twice theirs: h125).
    (["--arch", "gemma4_text", "--layers", "4", "--hidden", "128"], "gemma4_text", 2 * (3 * 64 + 128) * 4),
    # KV sharing: the last 2 of 4 layers read the KV of the 2 before them (the family's 15 of 35 left
    # none to make it at 4 layers, and the trace refused it: h125).
    (["--arch", "gemma3n_text", "--layers", "4", "--hidden", "128"], "gemma3n_text", 2 * 2 * 64 * 4),
], ids=["llama", "gpt2", "gpt-neox", "bf16", "checkpoint", "deepseek-v3", "deepseek-v3-odd-units", "gemma4",
        "gemma3n"])
def test_chat_trace_runs_other_models_exactly_with_their_own_kv_sizes(
        model_flags: list[str] | str, family: str, kv_per_token: int, checkpoint: Path, tmp_path: Path) -> None:
    """A serving engineer replays the trace on the model they serve (``--model``, a directory
    save_pretrained wrote), or on a random model of its family (``--arch``) and dtype: the KV per
    token and the working set (the budgets' percentages) follow that model, whose family and dtype
    the reports name, and every policy's replies are still checked against recomputation."""
    import json

    from tierkv.bench import LOGIT_TOLERANCE, parse_args, run

    flags = [*TOY_TRACE_ANY_MODEL, "--model", str(checkpoint)] if model_flags == "checkpoint" \
        else [*TOY_TRACE, *model_flags]
    result = run(parse_args([*flags, "--out", str(tmp_path)]))
    assert result["kv_bytes_per_token"] == kv_per_token
    assert result["results"]["unbounded"].final_stats["device"]["bytes"] == result["working_set_bytes"]
    odd_units = model_flags[-4:-2] == ["--layers", "3"]
    assert result["stored_bytes_per_token"] == (kv_per_token * 28 // 27 if odd_units else kv_per_token)
    assert result["model"].startswith(f"{family} {checkpoint if model_flags == 'checkpoint' else '(random)'} ")
    assert ("bfloat16" if "bfloat16" in model_flags else "float32") in result["model"]
    assert all(r.exact for r in result["results"].values() if not r.skipped)
    assert result["results"]["tierkv"].final_stats["hits"]["disk"] > 0
    # In bf16 plain transformers' own two ways of computing a turn differ, and may set the tolerance.
    noise = result["results"]["resident"].logit_error if "bfloat16" in model_flags else 0.0
    assert result["logit_tolerance"] == max(LOGIT_TOLERANCE, 2 * noise)
    if model_flags == "checkpoint":
        from benchmarks import chat_trace

        chat_trace.main([*flags, "--turns", "2", "--out", str(tmp_path)])
        report = json.loads((tmp_path / "results.json").read_text())
        assert report["model"].startswith(f"qwen2 {checkpoint} 3 layers hidden 64, float32")
        assert f"qwen2 {checkpoint} 3 layers" in (tmp_path / "results.md").read_text()


def test_chat_trace_quick_keeps_a_checkpoints_own_size(checkpoint: Path) -> None:
    from tierkv.bench import QUICK, parse_args

    args = parse_args(["--quick", "--model", str(checkpoint)])
    assert args.layers is None and args.hidden is None and args.arch is None
    assert (args.sessions, args.turns, args.context) == (QUICK["sessions"], QUICK["turns"], QUICK["context"])
    assert (parse_args(["--quick"]).layers, parse_args([]).layers, parse_args([]).arch) == (QUICK["layers"], 4, "llama")


@pytest.mark.parametrize("flags, message", [
    (["--model", "m", "--layers", "2"], "--layers describes the random model, and --model 'm' has its own"),
    (["--model", "m", "--arch", "gpt2", "--hidden", "128"], "--arch, --hidden describe the random model"),
    (["--model", " "], "--model was given an empty name"),
    (["--arch", "no_such_family"], "--arch 'no_such_family' is not a transformers model type"),
    (["--layers", "0"], "--layers must be 1 or more"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
])
def test_chat_trace_refuses_bad_model_flags_saying_what_to_give(flags: list[str], message: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.bench import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--model", "{empty}"], "holds no config.json: give a directory written by save_pretrained"),
    (["--model", "{file}"], "is a file: give the directory save_pretrained wrote"),
    (["--model", "{empty}/gone"], "no such directory; give a directory written by save_pretrained"),
    (["--model", "{broken}"], "could not be loaded as a causal language model"),
    (["--model", "{checkpoint}", "--context", "200"], "--context 200 is past the 128 positions the model takes"),
    (["--arch", "t5"], "--arch 't5' has no causal language model to build"),
    # Families whose build fails otherwise than a ValueError (transformers' own defaults, a field
    # the flags cannot set): a traceback before (h129).
    (["--arch", "dbrx"], "--arch 'dbrx' could not be built at --layers 1 --hidden 64 (AttributeError: "),
    (["--arch", "musicgen"], "--arch 'musicgen' could not be built at --layers 1 --hidden 64 (AttributeError: "),
    # A config whose window cannot be switched off keeps it: refused by store.open, for its mask
    # (a traceback of huggingface_hub's field validation before; h129).
    (["--arch", "moshi"], "tierkv cannot serve this model: MoshiForCausalLM's config names sliding_attention "
                          "layers"),
    # Sub-configs the flags do not reach (BLT's byte encoder, decoder, global transformer and
    # patcher): 4.6 billion parameters, minutes and 18 GiB to build before anything could be
    # refused, now refused from a build on the meta device (h129).
    (["--arch", "blt"], "parameters at --layers 1 --hidden 64, "),
    (["--arch", "blt"], "its patcher_config, encoder_config, decoder_config, global_config are not sized by --layers"),
    # Families tierkv refuses at store.open, with the reason, before the trace starts.
    (["--arch", "bert"], "tierkv cannot serve this model: "),
    # Told to give another model, not to "generate without a TieredCache", which no flag does.
    (["--arch", "deepseek_v32", "--hidden", "128"],
     "sliding-window layers only, for now ('indexed_attention' layers, DeepSeek Sparse Attention's, keep their "
     "indexer's keys in the cache beside the KV, which tierkv does not store); give another --arch, such as llama"),
    # A recurrent family: before, an AttributeError from the KV probe, before the refusal.
    (["--arch", "mamba", "--hidden", "128"], "['linear_attention'] layers"),
    (["--model", "{recurrent}"], "sliding-window layers only, for now; give --model a decoder-only checkpoint of "
                                 "full-attention or sliding-window layers"),
])
def test_chat_trace_refuses_models_it_cannot_run_before_the_trace(
        flags: list[str], message: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.bench import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a model")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama"')
    if "{recurrent}" in flags:
        config = AutoConfig.for_model("mamba", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "recurrent")
    flags = [f.format(empty=tmp_path / "empty", file=tmp_path / "file", broken=tmp_path / "broken",
                      checkpoint=checkpoint, recurrent=tmp_path / "recurrent") for f in flags]
    base = TOY_TRACE_ANY_MODEL if "--model" in flags or "--arch" in flags else TOY_TRACE
    if "--arch" in flags:
        base = [*base, "--layers", "1"] + ([] if "--hidden" in flags else ["--hidden", "64"])
    with pytest.raises(SystemExit) as exc:
        main([*base, *flags, "--out", str(tmp_path / "out")], prog="tierkv bench")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("tierkv bench: error: ")
    assert not (tmp_path / "out" / "results.json").exists()


def test_mark_exact_in_reduced_precision_allows_plain_transformers_own_difference() -> None:
    """bf16: the resident DynamicCache against recomputation sets the tolerance (twice its
    difference); float32 keeps LOGIT_TOLERANCE whatever resident shows."""
    from tierkv.bench import LOGIT_TOLERANCE, Policy, PolicyResult, mark_exact

    logits = torch.arange(8.0)
    std = float(logits.std())
    out = torch.tensor([[1, 2, 3]])

    def policy(name: str, off: float) -> Policy:
        p = Policy(PolicyResult(name), lambda *a: None, lambda *a: None)
        p.outputs.append(out)
        p.result.first_logits.append(logits + off * std)
        return p

    policies = [policy("recompute", 0), policy("resident", 0.01), policy("tierkv", 0.015), policy("broken", 0.03)]
    assert mark_exact(policies, reduced_precision=True) == pytest.approx(0.02, rel=1e-4)
    assert [p.result.exact for p in policies] == [True, True, True, False]
    assert mark_exact(policies) == LOGIT_TOLERANCE
    assert [p.result.exact for p in policies] == [True, False, False, False]
    # Replies parting at a near tie (turn 2 of 3): compared up to it, not after, in bf16 only.
    for p in policies:
        p.outputs += [out, out]
        p.result.first_logits += [logits, logits]
    parted, wrong_before = policy("parted", 0), policy("wrong before", 0)
    for p, second_off in ((parted, 0.015), (wrong_before, 0.5)):
        p.outputs += [out + 1, out + 2]  # the second turn's reply differs, and the third's prompt with it
        p.result.first_logits += [logits + second_off * std, logits + 9 * std]
    policies += [parted, wrong_before]
    assert mark_exact(policies, reduced_precision=True) == pytest.approx(0.02, rel=1e-4)
    assert [p.result.exact for p in policies] == [True, True, True, False, True, False]
    assert parted.result.parted_at == 1 and policies[2].result.parted_at is None
    assert parted.result.logit_error == pytest.approx(0.015, rel=1e-4)  # not the third turn's 9
    mark_exact(policies)
    assert not parted.result.exact and parted.result.logit_error == pytest.approx(9, rel=1e-4)


def test_ttft_benchmark_on_a_checkpoint_in_bf16(checkpoint: Path, tmp_path: Path) -> None:
    """``--model`` replaces the shapes with the user's checkpoint, named in the report's header."""
    out = run(tmp_path, "-m", "benchmarks.ttft", "--tokens", "40", "--repeats", "1", "--block-size", "16",
              "--model", str(checkpoint), "--dtype", "bfloat16")
    assert f"qwen2 {checkpoint} 3 layers hidden 64, bfloat16" in out
    assert out.count("| floor (ready DynamicCache) | 1.00 |") == 1  # one model: no shapes besides it
    assert len([line for line in out.splitlines() if line.startswith("| tierkv")]) == 4


def test_ttft_benchmark_reports_a_sliding_models_kv_held_as_the_floors(tmp_path: Path) -> None:
    """A Gemma 3's sliding layer, restored, held the whole conversation through the turn (1.54x
    the floor's KV here); it holds the blocks its window reaches. A disk restore landed in one
    buffer of every layer's whole length, held until the first decode step (above 1.5); each
    layer's part of it now starts at its window's cut."""
    from conftest import make_model

    path = tmp_path / "gemma3-tiny"
    make_model("gemma3_text").save_pretrained(path)
    out = run(tmp_path, "-m", "benchmarks.ttft", "--tokens", "40", "--repeats", "1", "--block-size", "4",
              "--model", str(path))
    held = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[6].rstrip(" |")
            for line in out.splitlines() if line.startswith("| tierkv") or line.startswith("| floor")}
    assert held["floor (ready DynamicCache)"] == held["tierkv device"] == held["tierkv host"] == \
        held["tierkv disk (after restart)"] == "1.00", held


@pytest.mark.parametrize("flags, message", [
    (["--model", "{checkpoint}", "--tokens", "200"], "--tokens 200 is past the 128 positions the model takes (max_position_embeddings, with the 1 generated): "
                                                     "give --tokens 127 or less"),
    (["--model", "{missing}"], "no such directory"),
])
def test_ttft_benchmark_refuses_a_checkpoint_it_cannot_run(flags: list[str], message: str, checkpoint: Path,
                                                           tmp_path: Path) -> None:
    flags = [f.format(checkpoint=checkpoint, missing=tmp_path / "missing") for f in flags]
    result = subprocess.run([sys.executable, "-m", "benchmarks.ttft", "--repeats", "1", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_chat_trace_hits_plot_numbers_turns_from_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hits plot's x axis counts turns as the table does (1 to --turns): plotted by index, the
    first turn's hits stood at turn 0 and the last turn at 39 of 40."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from tierkv.bench import PolicyResult, plots

    lines: dict[str, list] = {}
    plot = matplotlib.axes.Axes.plot

    def recorded(self, *args, label=None, **kwargs):
        lines[label] = [list(np.asarray(a)) for a in args]
        return plot(self, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    hits = [{"device": 0, "host": 0, "disk": 0}, {"device": 8, "host": 0, "disk": 0},
            {"device": 8, "host": 4, "disk": 2}]
    result = PolicyResult("tierkv", ttft=[0.1, 0.2, 0.3], hits_over_time=hits)
    assert "hits_over_time.png" in plots({"results": {"tierkv": result}}, tmp_path)
    assert lines["disk"] == [[1, 2, 3], [0, 0, 2]]


def test_chat_trace_says_why_the_offloaded_policy_did_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.bench import offloaded_skipped

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert offloaded_skipped().startswith("needs CUDA")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, the trace run with --cpu
    assert offloaded_skipped().startswith("--cpu given")


def test_chat_trace_help_gives_every_flags_default() -> None:
    """Most trace flags had no help: --help named neither their meaning nor their default."""
    from tierkv import bench

    parser_of: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def kept(self, *args, **kwargs):
        parser_of.append(self)
        return parse(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", kept)
        bench.parse_args(["--out", tempfile.gettempdir()])
    for action in parser_of[0]._actions:
        if action.default not in (None, False, argparse.SUPPRESS):
            assert action.help and "default" in action.help, action.option_strings


def test_arch_sweep_classes_an_exact_model_and_a_refused_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The developers' architecture sweep runs: GPT-2 through its three turns (mixed tiers, then a
    restart) equals plain generate, and Mamba's recurrent layers are refused at open."""
    from benchmarks import arch_sweep

    monkeypatch.setattr(arch_sweep, "SCRATCH", tmp_path)
    exact = arch_sweep.one("gpt2")
    assert exact["cls"] == "exact", exact
    refused = arch_sweep.one("mamba")
    assert refused["cls"] == "refused" and "linear_attention" in refused["why"], refused


def test_chat_trace_reports_returning_turns_apart_from_first_ones() -> None:
    import numpy as np

    from tierkv.bench import PolicyResult, Turn, returning_turns, summarise

    # Session 0 comes back twice, then starts over (a reset: nothing of its conversation to reuse),
    # then comes back once more; session 1 comes once.
    sessions_resets = [(0, False), (1, False), (0, False), (0, False), (0, True), (0, False)]
    turns = [Turn(s, np.array([3]), 2, reset) for s, reset in sessions_resets]
    returning = returning_turns(turns)
    assert returning == [False, False, True, True, False, True]
    # First turns slow for every policy, returning ones fast for the store: the p50 over every
    # turn hides what the returning ones gain.
    results = {"recompute": PolicyResult("recompute", ttft=[1.0, 1.0, 1.1, 1.2, 1.0, 1.3]),
               "unbounded": PolicyResult("unbounded", ttft=[1.0, 1.0, 0.02, 0.03, 1.0, 0.04]),
               "tierkv": PolicyResult("tierkv", ttft=[1.0, 1.0, 0.03, 0.06, 1.0, 0.05])}
    summary = summarise({"results": results, "returning": returning})
    assert summary["policies"]["tierkv"]["ttft_returning_p50_ms"] == pytest.approx(50.0)
    assert summary["policies"]["recompute"]["ttft_returning_p50_ms"] == pytest.approx(1200.0)
    assert summary["ratios"]["ttft_p50 returning turns tierkv / recompute"] == pytest.approx(50 / 1200)
    assert summary["ratios"]["ttft_p50 returning turns tierkv / unbounded"] == pytest.approx(50 / 30)
    assert summary["ratios"]["ttft_p50 tierkv / recompute"] == pytest.approx(0.53 / 1.05)
    # A trace without a returning turn has no such ratio, rather than a NaN one.
    none_back = summarise({"results": results, "returning": [False] * 6})
    assert not any("returning" in k for k in none_back["ratios"])


def test_arch_sweep_in_bfloat16_against_plain_and_the_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SWEEP_DTYPE=bfloat16 builds the model in bf16; each turn's tokens and logits equal plain generate's
    and, bit for bit, the control's (the previous turn's DynamicCache cropped to what tierkv restored). A
    difference from plain that the control shares is drift (transformers'), one it does not is WRONG."""
    from benchmarks import arch_sweep

    monkeypatch.setattr(arch_sweep, "SCRATCH", tmp_path)
    monkeypatch.setattr(arch_sweep, "DTYPE", "bfloat16")
    exact = arch_sweep.one("gpt2")
    assert exact["cls"] == "exact" and exact["dtype"] == "bfloat16", exact
    assert [sum(t["restored"].values()) > 0 for t in exact["turns"]] == [False, True, True], exact
    assert all(t["control_same"] and t["control_rel"] == 0.0 for t in exact["turns"]), exact
    # Any difference from plain counts (a tolerance below 0): tierkv still equals the control.
    monkeypatch.setitem(arch_sweep.LOGIT_TOL, "bfloat16", -1.0)
    drift = arch_sweep.one("gpt2")
    assert drift["cls"] == "drift" and "the control (no tierkv) gives tierkv's tokens" in drift["why"], drift
    # And no agreement with the control either.
    monkeypatch.setattr(arch_sweep, "CONTROL_TOL", -1.0)
    wrong = arch_sweep.one("gpt2")
    assert wrong["cls"] == "WRONG" and "turn 0" in wrong["why"] and "control: tokens" in wrong["why"], wrong


def test_arch_sweep_modes_controls_are_plain_generate_from_earlier_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modes' controls (turn 1: turn 0's DynamicCache cropped, repeated for the beams, then generate;
    turn 2: turn 0's whole blocks and turn 1's KV after them, spliced) run in every mode and give plain
    generate's tokens where the model has no drift (GPT-2, float32)."""
    import torch
    from benchmarks import arch_sweep

    monkeypatch.setattr(arch_sweep, "DTYPE", "float32")
    model = arch_sweep.build("gpt2")
    got, _ = arch_sweep.greedy(model, arch_sweep.ids_of(21, 1))
    ids = torch.cat([got, arch_sweep.ids_of(6, 100)], dim=1)
    for mode, kw in arch_sweep.MODES.items():
        torch.manual_seed(7)
        with torch.no_grad():
            plain = model.generate(ids, max_new_tokens=arch_sweep.NEW, **kw)
        ctl = arch_sweep.modes_control(model, ids, 16, kw)
        assert ctl is not None and torch.equal(ctl[0], plain), mode
        ids2 = torch.cat([plain[:1], arch_sweep.ids_of(5, 101)], dim=1)
        second = arch_sweep.turn2_control(model, ids, ids2, 16, 25, ids.shape[1], kw)
        tokens, logits = arch_sweep.greedy(model, ids2)
        assert second is not None and torch.equal(second[0], tokens), mode
        assert arch_sweep.logit_rel(second[1], logits) < 1e-5, mode
