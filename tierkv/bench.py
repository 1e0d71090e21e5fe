"""A multi-session chat trace with every policy side by side in one run.

Sessions share a system prompt, come back with Zipf popularity, and send turns of long-tailed
lengths; each turn re-sends the whole conversation. The trace (seeded) is replayed under:

  (a) recompute       no reuse across turns
      resident        a DynamicCache per session, kept on the device from turn to turn: the floor, with
                      no store (what (b) would cost without tierkv's own work per turn)
  (b) unbounded       tierkv with an unbounded device tier: the ideal that scarce VRAM cannot afford
  (c) tierkv          device budget 10% of the working set, host 30%, disk unlimited (--device-budget,
                      --host-budget, --disk-budget)
  (d) tierkv-no-disk  the same budgets without a disk tier
  (e) offloaded       transformers' DynamicCache(offloading=True), one per session (CUDA only)

The policies take turns, a round of ``--round-turns`` turns each in an order that rotates every
round, so that a shared machine's drift in speed falls on all of them alike; each keeps its own
conversations and store throughout, and a store's background disk writes are waited for at the
end of its part of a round, never run into another policy's turns.

Reported per policy: TTFT p50/p95/p99 (and each turn's, in the JSON), decode tokens/s, hit tokens
per tier, KV bytes moved per direction and the GB/s achieved (disk transactions timed on the
host, less the disk writer's waits for a CPU; CUDA copies by their events), peak bytes at rest per
tier against its budget, and commit() time, which follows each reply and is in no TTFT (each store's
first, which stores the shared system prompt too, apart from the percentiles); every
policy's replies are checked equal to recomputation's, token for token, and the logits of each
reply's first token within ``LOGIT_TOLERANCE``. Writes results.json, results.md and PNG plots (TTFT distribution per policy, hit
tokens per tier over time) to --out.

    tierkv bench --quick                   # under 3 minutes on 2 CPU cores
    tierkv bench                           # the full trace
    python -m benchmarks.chat_trace ...    # the same, from a checkout (writes benchmarks/out/chat_trace)

The model is a random Llama sized by ``--layers`` and ``--hidden``, another family's (``--arch``), or
a checkpoint of the user's (``--model``), in ``--dtype`` (``trace_model``).

A program, like the demo: it prints, and imports transformers directly. The progress bar (tqdm)
and the plots (matplotlib) are used when installed (the `bench` extra) and skipped otherwise, with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from . import trace_model
from .demo import FirstTokenTimer
from .events import MoveEvent
from .interrupts import raised_by_signal_handler
from .layout import KVLayout
from .store import MAX_BLOCK_SIZE, TieredStore
from .units import parse_bytes


@dataclass(slots=True)
class Turn:
    session: int
    user_tokens: np.ndarray
    reply_tokens: int
    reset: bool  # the conversation outgrew the context: start over from the system prompt


@dataclass
class PolicyResult:
    name: str
    ttft: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    hits_over_time: list[dict[str, int]] = field(default_factory=list)
    commit_seconds: list[float] = field(default_factory=list)  # each turn's commit(), after its reply
    # The same commits' CPU time in the calling thread: on a shared machine a 2 ms commit's wall
    # time is mostly the scheduler's (10-20 ms preemptions with 8 runnable processes on 2 cores).
    commit_cpu_seconds: list[float] = field(default_factory=list)
    # Seconds of the copies the store timed on the GPU, per direction (device_to_host,
    # host_to_device); on CPU those moves are hand-overs that copy nothing and take no time.
    copy_seconds: dict[str, float] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    final_stats: dict | None = None
    # Each turn's logits of its first reply token: greedy replies of a random model hide small KV
    # errors (5% noise in the prefix's KV changed 4 replies in 10), its logits do not.
    first_logits: list[torch.Tensor] = field(default_factory=list)
    exact: bool = True
    logit_error: float = 0.0  # max over turns of max |logits - recompute's| / std(recompute's)
    parted_at: int | None = None  # the first turn whose reply differs from recompute's
    skipped: str | None = None


def make_trace(args: argparse.Namespace, vocab: int) -> tuple[np.ndarray, list[Turn]]:
    rng = np.random.default_rng(args.seed)
    system = rng.integers(3, vocab, args.system_tokens)
    weights = 1.0 / np.arange(1, args.sessions + 1) ** args.zipf
    weights /= weights.sum()
    lengths = {s: args.system_tokens for s in range(args.sessions)}
    turns = []
    for _ in range(args.turns):
        s = int(rng.choice(args.sessions, p=weights))
        user = int(np.clip(rng.lognormal(math.log(args.user_median), 0.8), 4, args.user_max))
        reply = int(np.clip(rng.lognormal(math.log(args.reply_median), 0.6), 2, args.reply_max))
        reset = lengths[s] + user + reply > args.context
        lengths[s] = (args.system_tokens if reset else lengths[s]) + user + reply
        turns.append(Turn(s, rng.integers(3, vocab, user), reply, reset))
    return system, turns


def returning_turns(turns: list[Turn]) -> list[bool]:
    """Per turn, whether it continues a conversation the trace played before: its session came back,
    and its conversation did not start over (a reset). Only these can reuse a prefix beyond the
    shared system prompt: the returning-session TTFT users ask about, which the percentiles over
    every turn dilute with first turns, where every policy computes the whole prompt."""
    seen: set[int] = set()
    returning = []
    for t in turns:
        returning.append(t.session in seen and not t.reset)
        seen.add(t.session)
    return returning


def stored_bytes_per_token(kv_per_token: int, layout: KVLayout | None) -> int:
    """A token's bytes in the store's blocks, from its KV in the model's own cache: the same,
    but where layers of other KV shapes hold an odd count of units (``layout.py``), whose blocks
    carry one zeroed unit more, which every budget counts (DeepSeek-V3's 9 units a layer, at 3
    layers: 28 where the model's cache holds 27, and a working set 3.7% short of what a store
    holds)."""
    if layout is None:
        return kv_per_token
    return kv_per_token * 2 * layout.slots // layout.units


def working_set_bytes(system_tokens: int, turns: list[Turn], sessions: int, kv_per_token: int,
                      block_size: int) -> int:
    """KV bytes of everything the trace ever holds, as a store that evicts nothing holds it: the
    system prompt's whole blocks once, shared; each conversation (a session between resets) at its
    longest, with its own copy of the block the system prompt ends inside (that block holds the
    conversation's first tokens too), less its last token, whose KV no turn computes (the reply's
    last token is never fed)."""
    current = {s: 0 for s in range(sessions)}
    conversations = []
    for t in turns:
        if t.reset and current[t.session]:
            conversations.append(current[t.session])
            current[t.session] = 0
        current[t.session] += len(t.user_tokens) + t.reply_tokens
    conversations += [n for n in current.values() if n]
    shared = system_tokens // block_size * block_size
    own = system_tokens - shared
    return (shared + sum(own + n - 1 for n in conversations)) * kv_per_token


@dataclass
class Policy:
    """One policy's replay: how a turn's cache is made, what follows the turn (a commit), and how
    the policy settles its background work (a store's disk writes) at the end of a round."""
    result: PolicyResult
    make_cache: Callable[[int, torch.Tensor], Any]
    after_turn: Callable[[int, Any, torch.Tensor], None]
    settle: Callable[[], None] = lambda: None
    history: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)


def extends(previous: torch.Tensor | None, ids: torch.Tensor) -> bool:
    """Whether a turn's ``ids`` continue the conversation whose output was ``previous`` (the ids
    a session's cache was built from), with at least one new token to compute. A reset starts
    over from the system prompt: its ids may be longer than the old cache, yet differ from it."""
    if previous is None or ids.shape[1] <= previous.shape[1]:
        return False
    return torch.equal(ids[:, :previous.shape[1]], previous)


class SessionCaches:
    """One transformers cache per session (policies resident and (e)), reused for a turn only where the turn's
    ids extend the output that cache last saw; otherwise (a reset, a first turn) a new one."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.caches: dict[int, Any] = {}
        self.last: dict[int, torch.Tensor] = {}

    def cache_for(self, session: int, ids: torch.Tensor) -> Any:
        if session not in self.caches or not extends(self.last.get(session), ids):
            self.caches[session] = self.make()
        return self.caches[session]

    def after_turn(self, session: int, cache: Any, out: torch.Tensor) -> None:
        self.last[session] = out


def play_turn(policy: Policy, model, sys_ids: torch.Tensor, turn: Turn) -> None:
    base = sys_ids if turn.reset or turn.session not in policy.history else policy.history[turn.session]
    ids = torch.cat([base, torch.tensor(turn.user_tokens).unsqueeze(0).to(base.device)], dim=1)
    timer = FirstTokenTimer()
    start = time.perf_counter()
    cache = policy.make_cache(turn.session, ids)
    generated = model.generate(ids, past_key_values=cache, max_new_tokens=turn.reply_tokens,
                               min_new_tokens=turn.reply_tokens, do_sample=False, streamer=timer, use_cache=True,
                               return_dict_in_generate=True, output_logits=True)
    end = time.perf_counter()
    out = generated.sequences
    policy.after_turn(turn.session, cache, out)
    result = policy.result
    result.ttft.append(timer.first_token_at - start)
    if turn.reply_tokens > 1:
        result.decode_tps.append((turn.reply_tokens - 1) / max(end - timer.first_token_at, 1e-9))
    policy.history[turn.session] = out
    policy.outputs.append(out)
    result.first_logits.append(generated.logits[0][0].float().cpu())


def interleave(policies: list[Policy], model, system: np.ndarray, turns: list[Turn], round_turns: int,
               progress) -> None:
    """Every policy replays the whole trace, a round of ``round_turns`` turns at a time, in an
    order that rotates every round (``round_turns`` 0: one round). A shared machine's speed drifts
    over seconds; played one after the other, the policies would compare the machine's moods, not
    themselves. At the end of its part of a round a policy settles (a store waits for its writer),
    so that no policy's background work runs into another's turns."""
    # Where the model is: generate does not move its inputs there.
    sys_ids = torch.tensor(system).unsqueeze(0).to(getattr(model, "device", "cpu"))
    if turns:
        # Untimed: a process's first generate pays one-off costs (allocator, lazy initialisation:
        # 55-78 ms against 18-20 ms after, here) that would otherwise fall on whichever policy plays first.
        warm = torch.cat([sys_ids, torch.tensor(turns[0].user_tokens).unsqueeze(0).to(sys_ids.device)], dim=1)
        model.generate(warm, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    step = round_turns if round_turns > 0 else max(1, len(turns))
    for r, first in enumerate(range(0, len(turns), step)):
        k = r % len(policies)
        for policy in policies[k:] + policies[:k]:
            for turn in turns[first:first + step]:
                play_turn(policy, model, sys_ids, turn)
                if progress is not None:
                    progress.update(1)
            policy.settle()


#: The largest logit difference from recomputation, in standard deviations of recomputation's
#: logits, that float rounding explains: a restored prefix is the same KV computed by other kernel
#: calls (a prefill's against a decode step's), 1e-6 of a std here. 1% noise in a prefix's KV is
#: about 1e-2; a reply changes from about 5%.
LOGIT_TOLERANCE = 1e-3


def mark_exact(policies: list[Policy], reduced_precision: bool = False) -> float:
    """Each policy's replies against the first policy's (recomputation), turn by turn: the same
    tokens, and the first reply token's logits within the returned tolerance, ``LOGIT_TOLERANCE``.

    In reduced precision (bf16, fp16) plain transformers' own two ways of computing a turn differ
    by more than that: the resident policy's ``DynamicCache`` kept from turn to turn against
    recomputation, 2e-2 of a std in bf16 on a random model. So does a restore that leaves another
    part of the prompt to compute than the resident cache did (another chunk, other rounding). The
    tolerance is then twice resident's difference, measured in the same run, and replies may part
    at a near tie (a random model's greedy choice is often one, and parted there, as float32 never
    did): the logits are compared up to the first turn whose reply parted (``parted_at``), as the
    conversations differ after it. A KV error of that size no longer shows: the float32 trace is
    the check."""
    reference = policies[0]
    for policy in policies:
        res = policy.result
        same = [torch.equal(mine, theirs) for mine, theirs in zip(policy.outputs, reference.outputs)]
        res.parted_at = same.index(False) if False in same else None
        compared = len(same) if res.parted_at is None or not reduced_precision else res.parted_at + 1
        res.logit_error = max((float((mine - theirs).abs().max() / theirs.std()) for mine, theirs in
                               zip(res.first_logits[:compared], reference.result.first_logits[:compared])),
                              default=0.0)
        res.exact = len(policy.outputs) == len(reference.outputs) and (reduced_precision or res.parted_at is None)
    tolerance = LOGIT_TOLERANCE
    if reduced_precision:
        noise = max((p.result.logit_error for p in policies if p.result.name == "resident"), default=0.0)
        tolerance = max(tolerance, 2 * noise)
    for policy in policies:
        policy.result.exact = policy.result.exact and policy.result.logit_error <= tolerance
    return tolerance


def budget_notes(device_budget: int, disk_budget: int, working_set: int) -> list[str]:
    """What budgets that are no error, yet leave (c) or (d) measuring another policy, make of them:
    the run goes on (a user may mean it), and its table says so."""
    notes = []
    if device_budget >= working_set:
        notes.append(f"the device budget ({device_budget} bytes) holds the whole working set ({working_set} bytes): "
                     "(c) and (d) evict nothing and measure what (b) does; give one below 100% to compare tiers")
    if disk_budget == 0:
        notes.append("the disk budget is 0: (c) keeps nothing on disk and measures what (d) does; give more, or "
                     "leave --disk-budget out (unlimited)")
    return notes


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


#: A budget's largest percentage of the working set: more is no limit, which a byte size says.
MAX_PERCENT = 100_000


def budget_bytes(text: str, working_set: int, flag: str) -> int:
    """A budget flag's bytes: ``"10%"`` of the working set (rounded down), or a byte size such as
    ``"64MiB"`` or ``"65536"``. Raises ValueError saying what to give instead."""
    text = text.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = float("nan")
        if not (math.isfinite(percent) and 0 <= percent <= MAX_PERCENT):
            raise ValueError(f"{flag} {text!r}: give a percentage of the working set from 0 to {MAX_PERCENT:g}, "
                             f"like \"10%\", or a byte size like \"64MiB\" (\"1TiB\": no limit)")
        return int(percent / 100 * working_set)
    try:
        return parse_bytes(text, flag)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e}; or a percentage of the working set, like \"10%\"") from None


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    model = trace_model.build_model(args, device, args.context)
    system, turns = make_trace(args, trace_model.vocab_of(model))
    with TieredStore(None, device=device, block_size=args.block_size) as warm:
        # Untimed: a model's first open reads its static facts and all its weights once
        # (memoised per model), which would fall on the first store policy's first turn. A model
        # tierkv cannot serve is refused here, with the reason, before the trace starts.
        # (With the first user message: the system prompt may be empty.)
        first = np.concatenate([system, turns[0].user_tokens])
        try:
            layout = warm.open(model, torch.tensor(first).unsqueeze(0).to(device)).model_info.layout
        except ValueError as exc:
            instead = ("give --model a decoder-only checkpoint of full-attention or sliding-window layers"
                       if args.model is not None else trace_model.OTHER_ARCH)
            raise trace_model.cannot_serve(exc, instead) from None
    # After the refusal: the probe reads keys from every layer, which a recurrent layer lacks
    # (`--arch mamba` died in it with an AttributeError).
    kv_per_token = trace_model.kv_bytes_per_token(model)
    stored_per_token = stored_bytes_per_token(kv_per_token, layout)
    ws = working_set_bytes(args.system_tokens, turns, args.sessions, stored_per_token, args.block_size)
    try:
        from tqdm import tqdm
        progress = tqdm(total=len(turns) * 6, desc="chat trace", unit="turn")
    except ImportError:  # the progress bar is a nicety of the `bench` extra
        progress = None

    policies = [Policy(PolicyResult("recompute"), lambda s, ids: None, lambda *a: None)]  # (a): the reference
    # The floor: every session's KV kept in a cache of its own on the device, no store in between
    # (the TTFT benchmark's ready DynamicCache, turn after turn).
    resident = SessionCaches(lambda: DynamicCache(config=model.config))
    policies.append(Policy(PolicyResult("resident"), resident.cache_for, resident.after_turn))
    dev_budget = budget_bytes(args.device_budget, ws, "--device-budget")
    host_budget = budget_bytes(args.host_budget, ws, "--host-budget")
    disk_budget = budget_bytes(args.disk_budget, ws, "--disk-budget")
    notes = budget_notes(dev_budget, disk_budget, ws)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)  # before the minutes of the run: a mistyped budget can be fixed
    budgets = {"unbounded": (1 << 50, 0, None), "tierkv": (dev_budget, host_budget, "disk"),
               "tierkv-no-disk": (dev_budget, host_budget, None)}
    stores: dict[str, TieredStore] = {}
    # The stores' files are scratch: removed whatever happens, so that repeated runs (the tests run
    # this at every test run) do not fill the temporary directory.
    with tempfile.TemporaryDirectory(prefix="tierkv-trace-", ignore_cleanup_errors=True) as scratch:
        tmp = Path(scratch)
        try:
            for name, (dev_b, host_b, disk) in budgets.items():
                store = stores[name] = TieredStore(tmp / name if disk else None, device=device, device_budget=dev_b,
                                                   host_budget=host_b, disk_budget=disk_budget,
                                                   block_size=args.block_size)
                res = PolicyResult(name)

                moves = store.subscribe()

                def commit(session, cache, out, store=store, res=res):
                    started, cpu = time.perf_counter(), time.thread_time()
                    cache.commit(out)
                    res.commit_seconds.append(time.perf_counter() - started)
                    res.commit_cpu_seconds.append(time.thread_time() - cpu)
                    res.hits_over_time.append(dict(store.stats()["hits"]))

                def settle(store=store, moves=moves, res=res):
                    store.flush()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # every copy's timer can be read
                    for event in moves.drain():
                        if isinstance(event, MoveEvent) and event.direction in ("device_to_host", "host_to_device"):
                            res.copy_seconds[event.direction] = res.copy_seconds.get(event.direction, 0.0) + \
                                (event.seconds or 0.0)

                policies.append(Policy(res, lambda s, ids, store=store: store.open(model, ids, session=f"s{s}"), commit,
                                       settle=settle))
            if device.type == "cuda":
                offloaded = SessionCaches(lambda: DynamicCache(config=model.config, offloading=True))
                # Its settle waits for the copies it offloads, which would otherwise run into the next policy's turns.
                policies.append(Policy(PolicyResult("offloaded"), offloaded.cache_for, offloaded.after_turn,
                                       settle=torch.cuda.synchronize))
            interleave(policies, model, system, turns, args.round_turns, progress)

            tolerance = mark_exact(policies, reduced_precision=args.dtype != "float32")
            results: dict[str, PolicyResult] = {}
            for policy in policies:
                res = policy.result
                store = stores.get(res.name)
                if store is not None:
                    policy.settle()
                    stats = store.stats()
                    res.final_stats = stats
                    res.budgets = {tier: stats[tier]["budget"] for tier in ("device", "host", "disk")}
                    # The store's own high-water marks: sampled after each commit, they missed the
                    # moments within one when a new chain and the tail it replaces both rest.
                    res.peak = dict(stats["peak_bytes"])
                    store.close()
                results[res.name] = res
        finally:
            for store in stores.values():
                store.close()
    if "offloaded" not in results:
        results["offloaded"] = PolicyResult("offloaded", skipped=offloaded_skipped())
        if progress is not None:
            progress.update(len(turns))
    if progress is not None:
        progress.close()
    return {"args": vars(args), "device": str(device), "model": trace_model.describe(model, args.model),
            "budget_notes": notes, "working_set_bytes": ws, "kv_bytes_per_token": kv_per_token,
            "stored_bytes_per_token": stored_per_token, "turns": len(turns), "logit_tolerance": tolerance,
            "returning": returning_turns(turns), "results": results}


DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")


def offloaded_skipped() -> str:
    """Why policy (e) did not run in a CPU trace: on a machine with CUDA, "needs CUDA" read as if
    it had none, when --cpu kept the trace off it."""
    if torch.cuda.is_available():
        return "--cpu given (it offloads a CUDA device's KV to the host)"
    return "needs CUDA (it offloads a CUDA device's KV to the host)"


def disk_write_seconds(stats: dict) -> float:
    """The writer's time in transactions less its waits for a CPU: it runs at a lower priority
    than the turns, and beside a busy ``generate`` those waits were 97% of its wall time."""
    return stats["move_seconds"]["host_to_disk"] - stats.get("write_cpu_wait_seconds", 0.0)


def achieved_gb_per_s(moved: dict[str, int], seconds: dict[str, float]) -> dict[str, float | None]:
    """GB/s per direction, None where it would mean nothing: no bytes moved, or no time taken or
    recorded (the store times its disk paths, reads only in the opens that read from disk, and its
    CUDA copies by their events; a CPU device tier's moves to and from the host are hand-overs that
    copy nothing)."""
    return {d: moved[d] / seconds[d] / 1e9 if moved.get(d, 0) > 0 and seconds.get(d, 0) > 0 else None
            for d in DIRECTIONS if d in moved}


def summarise(run_: dict) -> dict:
    rows = {}
    base = run_["results"]
    returning = run_["returning"]
    for name, r in base.items():
        if r.skipped:
            rows[name] = {"skipped": r.skipped}
            continue
        row = {"ttft_ms": [t * 1e3 for t in r.ttft],  # per turn, in the trace's order
               "ttft_p50_ms": percentile(r.ttft, 50) * 1e3, "ttft_p95_ms": percentile(r.ttft, 95) * 1e3,
               "ttft_p99_ms": percentile(r.ttft, 99) * 1e3,
               "ttft_returning_p50_ms": percentile([t for t, back in zip(r.ttft, returning) if back], 50) * 1e3,
               "decode_tokens_per_s": statistics.median(r.decode_tps) if r.decode_tps else float("nan"),
               "exact": r.exact, "logit_error": r.logit_error, "replies_parted_at_turn": r.parted_at}
        if r.final_stats is not None:
            row["hit_tokens"] = r.final_stats["hits"]
            row["miss_tokens"] = r.final_stats["misses"]
            row["moved_bytes"] = r.final_stats["moved_bytes"]
            seconds = {**r.final_stats["move_seconds"], **r.copy_seconds}
            row["gb_per_s"] = achieved_gb_per_s(r.final_stats["moved_bytes"],
                                                {**seconds, "host_to_disk": disk_write_seconds(r.final_stats)})
            # The same bytes over the writer's wall time, its waits for a CPU included.
            row["to_disk_wall_gb_per_s"] = achieved_gb_per_s(r.final_stats["moved_bytes"], seconds)["host_to_disk"]
            # Each store's first commit also stores the system prompt's blocks, which every later
            # conversation shares: 2.0 ms of CPU against 1.2-1.3 for the next sessions' at --quick's
            # shape, while commits of equal work cost the same first or later (1.9 against 1.9-2.2):
            # no first use (LMDB, allocator) to warm. A server stores its system prompt once; a
            # 40-turn trace does on one turn in 40, its p99. Shown apart; percentiles of the rest.
            row["commit_ms"] = [t * 1e3 for t in r.commit_seconds]  # per turn, in the trace's order
            row["commit_cpu_ms"] = [t * 1e3 for t in r.commit_cpu_seconds]
            row["commit_first_ms"] = row["commit_ms"][0] if row["commit_ms"] else float("nan")
            later = r.commit_seconds[1:] or r.commit_seconds
            row["commit_p50_ms"] = percentile(later, 50) * 1e3
            row["commit_p99_ms"] = percentile(later, 99) * 1e3
            row["commit_cpu_p50_ms"] = percentile(r.commit_cpu_seconds[1:] or r.commit_cpu_seconds, 50) * 1e3
            row["peak_bytes"] = r.peak
            # The hits plot's data: the store's hit tokens per tier, cumulative, after each turn's commit.
            row["hit_tokens_after_each_turn"] = r.hits_over_time
            row["budgets"] = r.budgets
        rows[name] = row
    p50 = {name: rows[name].get("ttft_p50_ms") for name in rows}
    ratios = {}
    if p50.get("tierkv") and p50.get("unbounded"):
        ratios["ttft_p50 tierkv / unbounded"] = p50["tierkv"] / p50["unbounded"]
    for a in ("unbounded", "tierkv"):
        if p50.get(a) and p50.get("resident"):
            ratios[f"ttft_p50 {a} / resident"] = p50[a] / p50["resident"]
    if p50.get("tierkv") and p50.get("recompute"):
        ratios["ttft_p50 tierkv / recompute"] = p50["tierkv"] / p50["recompute"]
    if p50.get("tierkv-no-disk") and p50.get("recompute"):
        ratios["ttft_p50 tierkv-no-disk / recompute"] = p50["tierkv-no-disk"] / p50["recompute"]
    back = {name: rows[name].get("ttft_returning_p50_ms") for name in rows}
    for a, b in (("tierkv", "recompute"), ("tierkv", "unbounded")):
        if back.get(a) and back.get(b) and math.isfinite(back[a]) and math.isfinite(back[b]):
            ratios[f"ttft_p50 returning turns {a} / {b}"] = back[a] / back[b]
    # Paired: the same turn under both policies, so that turns' spread of lengths cancels out.
    for a, b in (("tierkv", "unbounded"), ("tierkv", "recompute"), ("tierkv", "resident")):
        if a in rows and b in rows and "skipped" not in rows[a] and "skipped" not in rows[b]:
            ratios[f"ttft per turn {a} / {b}, median"] = statistics.median(
                x / y for x, y in zip(base[a].ttft, base[b].ttft))
    return {"policies": rows, "ratios": ratios}


def parted_s(row: dict) -> str:
    """``; replies parted at turn 33``: where a reply first differed from recompute's (bf16, fp16)."""
    turn = row.get("replies_parted_at_turn")
    return "" if turn is None else f"; replies parted at turn {turn + 1}"


def markdown(run_: dict, summary: dict) -> str:
    a = run_["args"]
    lines = [f"{run_['turns']} turns over {a['sessions']} sessions (Zipf {a['zipf']}), system prompt "
             f"{a['system_tokens']} tokens, context {a['context']}, {run_['model']} "
             f"on {run_['device']}; working set {run_['working_set_bytes'] / 2**20:.1f} MiB of KV; "
             f"budgets of (c) and (d) device {a['device_budget']}, host {a['host_budget']}, (c) disk {a['disk_budget']}; "
             f"policies taking turns in rounds of {a['round_turns'] or run_['turns']} turns.",
             *(f"**Note:** {note}." for note in run_.get("budget_notes", [])), "",
             "| policy | TTFT p50 ms | p95 | p99 | decode tok/s | hit tokens dev/host/disk | miss tokens | "
             "moved MiB d2h/h2d/to disk/from disk [1] | GB/s d2h/h2d/to disk/from disk [2] | "
             "peak MiB at rest dev/host/disk (budget) [3] | commit ms p50/p99 (first) [5] | exact [4] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for name, row in summary["policies"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | | | | | | | |")
            continue
        hits = row.get("hit_tokens")
        hit_s = f"{hits['device']}/{hits['host']}/{hits['disk']}" if hits else "-"
        moved = row.get("moved_bytes")
        moved_s = "/".join(f"{moved[k] / mib:.1f}" for k in DIRECTIONS) if moved else "-"
        peak = row.get("peak_bytes")
        budgets = row.get("budgets", {})
        peak_s = ", ".join(f"{peak[t] / mib:.1f} ({budgets[t] / mib:.1f})" if budgets.get(t, 0) < 1 << 40
                           else f"{peak[t] / mib:.1f} (unbounded)" for t in ("device", "host", "disk")) if peak else "-"
        gbs = row.get("gb_per_s")
        gbs_s = "/".join("-" if gbs is None or gbs.get(k) is None else f"{gbs[k]:.3g}" for k in DIRECTIONS)
        commit_s = f"{row['commit_p50_ms']:.2f}/{row['commit_p99_ms']:.2f} ({row['commit_first_ms']:.2f})" \
            if "commit_p50_ms" in row else "-"
        lines.append(f"| {name} | {row['ttft_p50_ms']:.1f} | {row['ttft_p95_ms']:.1f} | {row['ttft_p99_ms']:.1f} | "
                     f"{row['decode_tokens_per_s']:.0f} | {hit_s} | {row.get('miss_tokens', '-')} | {moved_s} | "
                     f"{gbs_s} | {peak_s} | {commit_s} | {'yes' if row['exact'] else 'NO'} "
                     f"({row['logit_error']:.1e}{parted_s(row)}) |")
    cpu = run_["device"] == "cpu"
    lines += ["", f"TTFT percentiles interpolate linearly between the nearest of each policy's {run_['turns']} turns "
              f"(numpy's default); the ratios' \"returning turns\" are the {sum(run_['returning'])} that continue a "
              "conversation played before (not a session's first turn, not one that starts over), whose p50 is in "
              "the JSON (ttft_returning_p50_ms). Decode tok/s: the median over turns of a turn's reply tokens after "
              "the first over the time from its first token to generate's return.",
              "[1] " + ("On a CPU device tier the moves between device and host are hand-overs that copy nothing "
                        "(no GB/s). " if cpu else "") + "KV bytes, without the records' headers and padding, "
              "of whole blocks: a restore that uses only part of a block reads (and checksums) the whole record from "
              "disk, and a block restored through the host moves whole to the device tier, which then holds all of "
              "it; hit tokens count only the tokens used, so the moved bytes may exceed the hits' KV bytes "
              "(kv_bytes_per_token in the JSON; stored_bytes_per_token, a block's, counts the zeroed unit that "
              "blocks of layers of other KV shapes may carry).",
              "[2] To disk: bytes over the writer's time in its transactions less its waits for a CPU (it runs at a "
              "lower priority than the turns; the JSON's to_disk_wall_gb_per_s counts them). From disk: records "
              "written earlier in this run, mostly read from the page cache; a disk hit whose write was still queued is "
              "served from the write's own buffer and reads nothing.",
              "[3] The most bytes of blocks at rest in each tier at any moment (within a commit too); the cache of the "
              "turn in progress is not counted. "
              "On disk, the records' footprints in the file (their headers and padding too), as its budget counts them.",
              "[4] The same tokens as recompute on every turn, and each turn's first logits within "
              f"{run_['logit_tolerance']:.2g} of a standard deviation of recompute's; in brackets the largest difference "
              "seen." + ("" if run_["logit_tolerance"] <= LOGIT_TOLERANCE else
                         f" In {run_['args']['dtype']} the tolerance is twice the difference between resident (plain "
                         "transformers) and recompute, and replies may part at a near tie (logits compared up to that "
                         "turn): an error in the KV that small would not show; --dtype float32 checks to "
                         f"{LOGIT_TOLERANCE:g}, every reply equal."),
              "[5] Wall time of cache.commit(), after the reply: p50 and p99 over each store's turns after its first; "
              "in brackets the first, which also stores the system prompt's blocks that every later conversation "
              "shares (a server does that once). The JSON has every turn's (commit_ms) and their CPU time in the "
              "committing thread (commit_cpu_ms): on a busy machine the wall time is mostly waits for a CPU.",
              "", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in summary["ratios"].items()]
    return "\n".join(lines) + "\n"


def plots(run_: dict, out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no PNG plots: they need matplotlib, the `bench` extra (pip install -e ".[bench]" in a checkout, '
              'pip install "tierkv[bench]" otherwise)')
        return []
    written = []
    results = {n: r for n, r in run_["results"].items() if not r.skipped}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ordered = np.sort(np.asarray(r.ttft) * 1e3)
        ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of turns")
    ax.set_title("TTFT distribution per policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=100)
    written.append("ttft_cdf.png")
    plt.close(fig)
    tiered = results.get("tierkv")
    if tiered is not None and tiered.hits_over_time:
        fig, ax = plt.subplots(figsize=(7, 4))
        # Turns numbered as the table counts them: plotted by index, the first turn's hits read turn 0.
        turns = np.arange(1, len(tiered.hits_over_time) + 1)
        for tier in ("device", "host", "disk"):
            ax.plot(turns, [h[tier] for h in tiered.hits_over_time], label=tier)
        ax.set_xlabel("turn")
        ax.set_ylabel("hit tokens up to that turn")
        ax.set_title("tierkv (c): hit tokens per tier over time")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "hits_over_time.png", dpi=100)
        written.append("hits_over_time.png")
        plt.close(fig)
    return written


BUDGET_FLAGS = ("--device-budget", "--host-budget", "--disk-budget")

# --quick's trace: defaults only, so that a flag given beside it still wins.
QUICK = dict(sessions=8, turns=40, layers=2, hidden=256, context=1024)
# The random model's size without --quick.
RANDOM_MODEL = dict(layers=4, hidden=512)


def parse_args(argv: list[str] | None = None, prog: str | None = None,
               default_out: str = "tierkv-bench") -> argparse.Namespace:
    """The trace's flags, checked: a bad value exits through ``parser.error`` saying what to give."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16, help="sessions (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=120, help="turns in all, over every session (default: %(default)s)")
    parser.add_argument("--zipf", type=float, default=1.1,
                        help="session popularity exponent, 0: uniform (default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=256,
                        help="the system prompt every session starts with (default: %(default)s)")
    parser.add_argument("--user-median", type=int, default=48,
                        help="a user message's median tokens, lengths log-normal (default: %(default)s)")
    parser.add_argument("--user-max", type=int, default=512,
                        help="a user message's most tokens (default: %(default)s)")
    parser.add_argument("--reply-median", type=int, default=16,
                        help="a reply's median tokens, lengths log-normal (default: %(default)s)")
    parser.add_argument("--reply-max", type=int, default=64, help="a reply's most tokens (default: %(default)s)")
    parser.add_argument("--context", type=int, default=2048,
                        help="a conversation longer than this starts over from the system prompt (default: "
                             "%(default)s)")
    trace_model.add_model_flags(parser, layers=RANDOM_MODEL["layers"], hidden=RANDOM_MODEL["hidden"])
    parser.add_argument("--block-size", type=int, default=64, help="the stores' tokens per block (default: %(default)s)")
    budget_help = "budget of (c) and (d): a percentage of the working set or a byte size like 64MiB (default: %(default)s)"
    parser.add_argument("--device-budget", default="10%", help="device " + budget_help)
    parser.add_argument("--host-budget", default="30%", help="host " + budget_help)
    parser.add_argument("--disk-budget", default="1TiB",
                        help="disk budget of (c), a percentage or byte size as above (default: %(default)s, unlimited)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's and the random model's (default: %(default)s)")
    # 8: the default trace's 120 turns and --quick's 40 make 15 and 5 rounds, so that each of the five
    # policies a CPU runs plays first, second, ... equally often.
    parser.add_argument("--round-turns", type=int, default=8,
                        help="turns each policy plays before the next takes over, the order rotating every round; "
                             "0: each policy plays the whole trace in turn (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even where CUDA is present")
    parser.add_argument("--out", default=default_out, help="directory for the reports (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a small trace, under 3 minutes on 2 CPU cores: "
                             + ", ".join(f"--{k} {v}" for k, v in QUICK.items()) + " unless given")
    given = sys.argv[1:] if argv is None else list(argv)
    for flag, value in zip(given, given[1:]):
        # argparse takes "-5%" or "-1MiB" for an option and answers "expected one argument".
        if flag in BUDGET_FLAGS and value.startswith("-") and not value.startswith("--") and value != "-h":
            parser.error(f"{flag} {value}: a budget is 0 or more; give a percentage of the working set like "
                         "\"10%\", or a byte size like \"64MiB\"")
    args = parser.parse_args(argv)
    if args.quick:
        # A checkpoint keeps its own size: --quick shortens only its trace.
        parser.set_defaults(**{k: v for k, v in QUICK.items() if args.model is None or k not in RANDOM_MODEL})
        args = parser.parse_args(argv)
    trace_model.check_model_flags(parser, args, **RANDOM_MODEL)

    for flag in ("sessions", "turns", "block_size", "user_median", "reply_median"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be 1 or more, got {getattr(args, flag)}")
    if args.block_size > MAX_BLOCK_SIZE:
        parser.error(f"--block-size must be {MAX_BLOCK_SIZE} or less, got {args.block_size}")
    if args.system_tokens < 0:
        parser.error(f"--system-tokens must be 0 or more, got {args.system_tokens}")
    for kind in ("user", "reply"):
        median, top = getattr(args, f"{kind}_median"), getattr(args, f"{kind}_max")
        if top < median:
            parser.error(f"--{kind}-max ({top}) must be at least --{kind}-median ({median}): raise it or lower the median")
    if args.reply_max < 2:
        parser.error(f"--reply-max must be 2 or more (decode tokens/s needs a second token), got {args.reply_max}")
    longest_turn = args.system_tokens + args.user_max + args.reply_max
    if args.context <= longest_turn:
        parser.error(f"--context ({args.context}) must be more than --system-tokens + --user-max + --reply-max "
                     f"({longest_turn}), or every long turn starts the conversation over: give --context "
                     f"{longest_turn + 1} or more")
    if not (math.isfinite(args.zipf) and args.zipf >= 0):
        parser.error(f"--zipf must be a finite number of 0 or more (0: sessions equally popular), got {args.zipf}")
    if args.round_turns < 0:
        parser.error(f"--round-turns must be 0 or more, got {args.round_turns}")
    if not 0 <= args.seed < 2**64:  # torch's seeds are 64-bit
        parser.error(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out!r} is a file; give a directory for the reports (made if missing)")
    try:
        # Before the run, which takes minutes: a directory that cannot be made or written to fails at once.
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's: not an unwritable directory
        parser.error(f"--out {args.out!r}: cannot write there ({exc.strerror}); give a directory you can write to")
    for flag in ("device_budget", "host_budget", "disk_budget"):
        try:
            budget_bytes(getattr(args, flag), 1, f"--{flag.replace('_', '-')}")
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv: list[str] | None = None, prog: str | None = None, default_out: str = "tierkv-bench") -> dict:
    """Run the trace and write its reports; returns the summary. ``argv`` defaults to
    ``sys.argv[1:]``, ``prog`` names it in ``--help``, ``default_out`` is ``--out``'s default."""
    args = parse_args(argv, prog, default_out)
    # Set here, not at import: `tierkv` imports this module only to run it, and importers keep theirs.
    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    out = Path(args.out)
    try:
        run_ = run(args)
    except trace_model.ModelFlagError as exc:
        print(f"{prog or 'chat_trace'}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    summary = summarise(run_)
    table = markdown(run_, summary)
    print(table)  # first: the figures of a long run are not lost with the files
    try:
        (out / "results.md").write_text(table)
        (out / "results.json").write_text(json.dumps({"args": run_["args"], "device": run_["device"],
                                                      "model": run_["model"],
                                                      "logit_tolerance": run_["logit_tolerance"], "working_set_bytes": run_["working_set_bytes"],
                                                      "budget_notes": run_["budget_notes"],
                                                      "kv_bytes_per_token": run_["kv_bytes_per_token"],
                                                      "stored_bytes_per_token": run_["stored_bytes_per_token"],
                                                      **summary}, indent=2, default=str))
        written = plots(run_, out)
    except OSError as exc:
        if raised_by_signal_handler(exc):
            raise
        print(f"error: could not write the reports to {out} ({exc}); the table above is the run's", file=sys.stderr)
        raise SystemExit(4) from None
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {out / w}" for w in written))
    if not all([r.exact for r in run_["results"].values() if not r.skipped]):
        raise SystemExit("a policy's replies differ from recomputation: please report this as a bug"
                         + ("" if args.dtype == "float32" else f" (after a rerun with --dtype float32: {args.dtype} "
                                                               "checks only to its own rounding)"))
    return summary


if __name__ == "__main__":
    main()
