"""Decode-path cost of tierkv, measured side by side in one run.

1. Decode time per token with a TieredCache against a plain DynamicCache holding the same prefix,
   on a model whose KV is large against its compute (many KV heads, few small layers).
2. Decode step latency p50/p99 while the store spills 100 MiB to LMDB in the background, against
   the same decode with no spill. Decoding goes on until the spill has landed; only the steps
   that ended with block writes still queued count as during the spill. Every step of both
   decodes runs at the same context (the cache is cut back to it after each step): a step's
   time grows with the context (each one copies the whole cache), and a spill that outlasts
   the quiet decode's steps would otherwise be charged for its longer context.

3. A reply past a sliding window (a Mistral-like model attending over ``--window`` tokens): decode
   time per token from ``--context`` tokens on through ``--reply`` more, TieredCache against a
   ``DynamicCache`` of the model's layer types (which keeps the window alone), paired per step, and
   the KV each holds on the device at the end: tierkv keeps the window and two margins of its
   ``block_size`` there, the rest of the reply in host memory until the commit.

    python -m benchmarks.decode
    python -m benchmarks.decode --context 512 --steps 16 --spill-mb 20    # a quick look
    python -m benchmarks.decode --cpu          # on CPU where CUDA is present
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

from tierkv import TieredStore

from .micro import at_least, pick_device, sync
from .ttft import kv_bytes

warnings.filterwarnings("ignore", category=FutureWarning)
hf_logging.set_verbosity_error()


def kv_heavy_model(device: torch.device) -> torch.nn.Module:
    # 16 KV heads of 64 dims on 4 layers: 32 KiB of KV per token against a small MLP.
    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=1024, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                                  max_position_embeddings=16384)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).eval()


def sliding_model(device: torch.device, window: int) -> torch.nn.Module:
    # Every layer sliding over ``window`` tokens: 8 KV heads of 64 dims on 4 layers, 16 KiB a token.
    config = AutoConfig.for_model("mistral", vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                  sliding_window=window, max_position_embeddings=32768)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).eval()


def reply_past_the_window(device: torch.device, context: int, reply: int, window: int,
                          block_size: int) -> list[str]:
    """Section 3's rows: per-token decode through a long reply, and the KV held on the device."""
    model = sliding_model(device, window)
    ids = torch.randint(3, 1024, (1, context), generator=torch.Generator().manual_seed(2)).to(device)
    store = TieredStore(None, device=device, block_size=block_size)
    caches = {"DynamicCache": DynamicCache(config=model.config), "TieredCache": store.open(model, ids)}
    with torch.no_grad():
        firsts = {name: model(ids, past_key_values=cache).logits[:, -1:].argmax(-1) for name, cache in caches.items()}
    assert torch.equal(firsts["DynamicCache"], firsts["TieredCache"])
    times = paired_steps(model, caches, firsts["DynamicCache"], reply)
    paired = [t / d for t, d in zip(times["TieredCache"], times["DynamicCache"])]
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    held = {name: kv_bytes(cache) for name, cache in caches.items()}  # the room kept ahead counted
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * ids.new_empty(
        0, dtype=model.dtype).element_size()
    store.close()
    return [f"| decode time per token through the reply, TieredCache / DynamicCache, paired per step (median) | "
            f"{statistics.median(paired):.3f} (quartiles {quartiles[0]:.3f} - {quartiles[2]:.3f}) |",
            f"| KV on the device after the reply, TieredCache / DynamicCache | {held['TieredCache'] / held['DynamicCache']:.2f} "
            f"({held['TieredCache'] / 2**20:.1f} / {held['DynamicCache'] / 2**20:.1f} MiB) |",
            f"| the same, had the sliding layers held the whole conversation | "
            f"{per_token * (context + reply) / held['DynamicCache']:.2f} |"]


def context_of(cache) -> int | None:
    """The tokens ``cache`` holds, which every step of the spill figures decodes at (None: no cache)."""
    return None if cache is None else cache.get_seq_length()


def cut_back(cache, context: int | None) -> None:
    """Untimed, after a step: the cache back to ``context`` tokens, so that the next step decodes at
    the same context as every other (a step's time grows with the context it attends to and copies)."""
    if context is not None and cache.get_seq_length() > context:
        cache.crop(context - cache.get_seq_length())  # negative: transformers 5.25 refuses a length


@torch.no_grad()
def decode_steps(model: torch.nn.Module, cache, first: torch.Tensor, steps: int) -> list[float]:
    """Greedy single-token forwards, each at the context the cache held at the start; seconds per step."""
    token = first
    times = []
    context = context_of(cache)
    sync(first.device)
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, past_key_values=cache).logits
        token = logits[:, -1:].argmax(-1)
        sync(first.device)
        times.append(time.perf_counter() - start)
        cut_back(cache, context)
    return times


@torch.no_grad()
def steps_while_spilling(model: torch.nn.Module, cache, first: torch.Tensor, store: TieredStore,
                         limit: int) -> tuple[list[float], int, float]:
    """Greedy single-token forwards, each at the context the cache held at the start, until
    ``store`` has no block write queued (asked between steps, untimed), at most ``limit``: the
    seconds of the steps that ended with writes still queued, how many steps that took, and the
    seconds from the first step to the spill's end as seen between steps (inf if it outlasted
    ``limit``)."""
    token = first
    times = []
    context = context_of(cache)
    sync(first.device)
    began = time.perf_counter()
    for step in range(limit):
        start = time.perf_counter()
        logits = model(token, past_key_values=cache).logits
        token = logits[:, -1:].argmax(-1)
        sync(first.device)
        seconds = time.perf_counter() - start
        cut_back(cache, context)
        if store.stats()["pending_writes"] == 0:
            return times, step + 1, time.perf_counter() - began
        times.append(seconds)
    return times, limit, float("inf")


@torch.no_grad()
def paired_steps(model: torch.nn.Module, caches: dict[str, object], first: torch.Tensor,
                 steps: int) -> dict[str, list[float]]:
    """Greedy single-token forwards on every cache in turn, step by step, the order alternating:
    each step's times are taken within milliseconds of each other, so a shared machine's drift
    in speed (runs of one cache after the other spread 0.91-1.06 here) falls on both alike."""
    tokens = dict.fromkeys(caches, first)
    times: dict[str, list[float]] = {name: [] for name in caches}
    names = list(caches)
    sync(first.device)
    for step in range(steps):
        for name in names if step % 2 else names[::-1]:
            start = time.perf_counter()
            logits = model(tokens[name], past_key_values=caches[name]).logits
            tokens[name] = logits[:, -1:].argmax(-1)
            sync(first.device)
            times[name].append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    """Linear between the two nearest ranks, as the chat trace's (numpy's default)."""
    return float(np.percentile(np.asarray(values), q * 100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=at_least(2), default=2048)
    parser.add_argument("--steps", type=at_least(1), default=64)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--spill-mb", type=at_least(1), default=100,
                        help="MiB of KV spilled per round (at least --context tokens' worth)")
    parser.add_argument("--spill-steps", type=at_least(1), default=2000,
                        help="decode steps at most while a spill lands (default 2000)")
    parser.add_argument("--window", type=at_least(2), default=256, help="section 3's sliding window")
    parser.add_argument("--reply", type=at_least(1), default=1024, help="section 3's reply, in tokens")
    parser.add_argument("--block-size", type=at_least(1), default=256, help="section 3's store block size")
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even where CUDA is present")
    args = parser.parse_args()
    device = pick_device(args.cpu)
    model = kv_heavy_model(device)
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (1, args.context), generator=gen).to(device)
    with torch.no_grad():
        first = model(ids).logits[:, -1:].argmax(-1)

    # -- 1. per-token decode: TieredCache vs DynamicCache ------------------------------------------
    store = TieredStore(None, device=device, device_budget="4GiB", host_budget=0, block_size=256)
    warm = store.open(model, ids)
    with torch.no_grad():
        model(ids[:, warm.restored_tokens:], past_key_values=warm)
    warm.commit(ids)
    per_token: dict[str, list[float]] = {"DynamicCache": [], "TieredCache": []}
    paired: list[float] = []
    for repeat in range(args.repeats + 1):
        dyn = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=dyn)
        tiered = store.open(model, ids)
        with torch.no_grad():
            model(ids[:, tiered.restored_tokens:], past_key_values=tiered)
        assert tiered.get_seq_length() == dyn.get_seq_length() == args.context
        times = paired_steps(model, {"DynamicCache": dyn, "TieredCache": tiered}, first, args.steps)
        if repeat == 0:
            continue  # warm-up: first-touch allocations and the hook's first checks
        for name, steps in times.items():
            per_token[name].append(statistics.median(steps))
        paired.extend(t / d for t, d in zip(times["TieredCache"], times["DynamicCache"]))
    store.close()
    dyn_t = statistics.median(per_token["DynamicCache"])
    tier_t = statistics.median(per_token["TieredCache"])
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    print(f"model: 4 layers, 16 KV heads x 64, {kv_per_token // 1024} KiB KV/token, on {device.type}; "
          f"context {args.context}, {args.steps} decode steps per cache, interleaved step by step, "
          f"{args.repeats} repeats after a warm-up")
    print("| figure | value |\n|---|---|")
    print(f"| decode time per token, TieredCache / DynamicCache, paired per step (median) | {statistics.median(paired):.3f} |")
    print(f"| the same, quartiles of the paired ratios | {quartiles[0]:.3f} - {quartiles[2]:.3f} |")
    print(f"| the same, median step of each / median step of the other | {tier_t / dyn_t:.3f} |")

    # -- 2. decode latency while 100 MiB spill to LMDB -------------------------------------------------
    spill_tokens = max(args.context, args.spill_mb * 2**20 // kv_per_token)
    spill_ids = torch.randint(3, cfg.vocab_size, (1, spill_tokens), generator=gen).to(device)
    path = tempfile.mkdtemp(prefix="tierkv-decode-")
    quiet, busy = [], []
    timing: dict[str, float | int] = {}

    def decode_fresh() -> list[float]:
        dyn = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=dyn)
        sync(device)
        return decode_steps(model, dyn, first, args.steps)

    for round_ in range(args.repeats):
        store = TieredStore(f"{path}/{round_}", device=device, device_budget="4GiB", host_budget=0,
                            disk_budget="8GiB", block_size=256)
        spill = store.open(model, spill_ids)
        with torch.no_grad():
            model(spill_ids, past_key_values=spill)  # the spilled conversation's KV, computed before timing

        def during_spill() -> None:
            dyn = DynamicCache()
            with torch.no_grad():
                model(ids, past_key_values=dyn)
            sync(device)
            start = time.perf_counter()
            spill.commit(spill_ids)  # write-through: the writer thread now spills to LMDB
            committed = time.perf_counter()
            steps, taken, landed = steps_while_spilling(model, dyn, first, store, args.spill_steps)
            busy.extend(steps)
            store.flush()
            sync(device)
            timing.update(commit=committed - start, steps=len(steps), taken=taken, landed=landed)

        # Which goes first alternates, so that the machine's drift over a round favours neither.
        for part in (lambda: quiet.extend(decode_fresh()), during_spill)[::1 if round_ % 2 else -1]:
            part()
        spill_bytes = store.stats()["disk"]["bytes"]
        store.close()
    shutil.rmtree(path, ignore_errors=True)  # scratch: the spilled stores
    print(f"| spill size per round | {spill_bytes / 2**20:.0f} MiB ({spill_tokens} tokens) |")
    print(f"| every decode step of the spill figures, with and without the spill, at context | {args.context} tokens |")
    if busy:
        print(f"| decode p50 during spill / no spill | {percentile(busy, 0.5) / percentile(quiet, 0.5):.3f} |")
        print(f"| decode p99 during spill / no spill | {percentile(busy, 0.99) / percentile(quiet, 0.99):.3f} |")
    else:
        print("| decode during spill / no spill | - (every spill landed within one decode step) |")
    print(f"| decode steps during the spill, all rounds (no spill: {len(quiet)}) | {len(busy)} |")
    print(f"| commit() call (last round) | {timing['commit'] * 1e3:.1f} ms |")
    if math.isinf(timing["landed"]):
        print(f"| the spill landed (last round) | after more than {timing['taken']} decode steps "
              f"(--spill-steps) |")
    else:
        print(f"| the spill landed (last round) | {timing['landed'] * 1e3:.0f} ms after decoding began, "
              f"in step {timing['taken']} |")

    # -- 3. a reply past a sliding window ----------------------------------------------------------------
    print(f"\nA reply past a sliding window: every layer sliding over {args.window} tokens, 16 KiB KV/token, "
          f"{args.context} tokens then {args.reply} decode steps, interleaved step by step; block_size "
          f"{args.block_size}\n")
    print("| figure | value |\n|---|---|")
    for row in reply_past_the_window(device, args.context, args.reply, args.window, args.block_size):
        print(row)


if __name__ == "__main__":
    main()
