"""A returning session restored from disk, its records read side by side (the calling thread and
``readers.helper_threads()`` helpers) against one thread, taking turns in one process.

Each round reopens nothing: one disk-only store, the session's records in the page cache (as after
a restart), then one open and one-token ``generate`` per policy, in alternating order, and a ready
``DynamicCache``'s turn as the floor. Reported as median ratios paired per round.

    python -m benchmarks.reads                          # 1k, 2k and 4k tokens of the larger shape
    python -m benchmarks.reads --tokens 4096 --repeats 21
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
import time
import warnings

import torch
from transformers import DynamicCache

import tierkv.store as store_module
from tierkv import TieredStore
from tierkv.readers import helper_threads
from tierkv.store import MAX_BLOCK_SIZE

from .micro import at_least
from .ttft import SHAPES, build, paired, spread

warnings.filterwarnings("ignore", category=FutureWarning)

POLICIES = {"one thread": 1 << 62, "side by side": 0}  # PARALLEL_READ_BYTES for each


def run_length(model: torch.nn.Module, tokens: int, repeats: int, block_size: int
               ) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """Per policy, each round's open and whole turn (seconds, the first round dropped), and the
    bytes each open read from disk."""
    ids = torch.randint(3, 4096, (1, tokens), generator=torch.Generator().manual_seed(1))
    held = DynamicCache()
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=held)
    tmp = tempfile.mkdtemp(prefix="tierkv-reads-")
    kept = store_module.PARALLEL_READ_BYTES
    opens: dict[str, list[float]] = {name: [] for name in (*POLICIES, "floor")}
    turns: dict[str, list[float]] = {name: [] for name in (*POLICIES, "floor")}
    try:
        budgets = dict(device="cpu", device_budget=0, host_budget=0, block_size=block_size)
        with TieredStore(tmp, **budgets) as store:
            cache = store.open(model, ids)
            cache.commit(model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False))
        with TieredStore(tmp, **budgets) as store:
            read = 0
            for r in range(repeats + 1):
                order = list(POLICIES) if r % 2 else list(reversed(POLICIES))
                ready = copy.deepcopy(held)
                start = time.perf_counter()
                model.generate(ids, cache=ready, max_new_tokens=1, do_sample=False)
                floor = time.perf_counter() - start
                del ready
                for name in order:
                    store_module.PARALLEL_READ_BYTES = POLICIES[name]
                    before = store.stats()["moved_bytes"]["disk_to_host"]
                    start = time.perf_counter()
                    cache = store.open(model, ids)
                    made = time.perf_counter()
                    model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
                    end = time.perf_counter()
                    read = store.stats()["moved_bytes"]["disk_to_host"] - before
                    if cache.restored_from["disk"] != tokens - 1:
                        raise RuntimeError(f"restored {cache.restored_from} of {tokens - 1} tokens from disk")
                    del cache
                    if r:
                        opens[name].append(made - start)
                        turns[name].append(end - start)
                if r:
                    opens["floor"].append(floor)
                    turns["floor"].append(floor)
    finally:
        store_module.PARALLEL_READ_BYTES = kept
        shutil.rmtree(tmp, ignore_errors=True)
    return opens, turns, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=at_least(2), nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=at_least(1), default=11)
    parser.add_argument("--block-size", type=at_least(1, MAX_BLOCK_SIZE), default=256)
    parser.add_argument("--shape", default="larger", choices=list(SHAPES))
    args = parser.parse_args()
    model = build(args.shape, torch.device("cpu"))
    print(f"{args.shape} llama on cpu, disk-only store, {helper_threads()} helper thread(s), median of "
          f"{args.repeats} rounds, paired per round (quartiles)")
    print("| tokens | MiB read | open, side by side / one thread | TTFT / floor, one thread "
          "| TTFT / floor, side by side |")
    print("|---|---|---|---|---|")
    for tokens in args.tokens:
        opens, turns, read = run_length(model, tokens, args.repeats, args.block_size)
        one, side = POLICIES
        print(f"| {tokens} | {read / 2**20:.1f} | {paired(opens, side, one):.2f} ({spread(opens, side, one)}) "
              f"| {paired(turns, one, 'floor'):.2f} ({spread(turns, one, 'floor')}) "
              f"| {paired(turns, side, 'floor'):.2f} ({spread(turns, side, 'floor')}) |")


if __name__ == "__main__":
    main()
