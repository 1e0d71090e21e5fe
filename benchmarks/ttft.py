"""Time to first token of a returning session: tierkv (restored from each tier) against
recomputation and against the floor, a ready DynamicCache that already holds the prefix.

All policies run interleaved in one process, repeated, each round in a new (seeded) order, and
are reported as median ratios to the floor and to recomputation measured side by side (absolute
times on shared machines are noise), and as the median of the per-round ratio to the floor (each
policy's time over the floor's in the same round).

    python -m benchmarks.ttft                  # 1k-token session, two model shapes
    python -m benchmarks.ttft --tokens 256 --repeats 3 --shapes small   # a quick look
    python -m benchmarks.ttft --cpu            # on CPU where CUDA is present
    python -m benchmarks.ttft --model DIR --dtype bfloat16   # a checkpoint of yours instead of the shapes
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

from tierkv import TieredStore, trace_model
from tierkv.store import MAX_BLOCK_SIZE

from .micro import at_least, drop_cached, pick_device, sync

warnings.filterwarnings("ignore", category=FutureWarning)
hf_logging.set_verbosity_error()

SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    "larger": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=4),
}


def build(shape: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = AutoConfig.for_model("llama", vocab_size=4096, max_position_embeddings=8192, **SHAPES[shape])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def first_token_seconds(model: torch.nn.Module, ids: torch.Tensor, make_cache) -> tuple[float, float]:
    """The time to the first token, and the part of it spent making the cache (``store.open``:
    its checks, lookups and disk reads; copies to a GPU it only starts)."""
    sync(ids.device)
    start = time.perf_counter()
    cache = make_cache()
    made = time.perf_counter()
    # past_key_values=, not cache=: transformers 5.17 (the GPU machine's) has no cache= in generate.
    model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
    sync(ids.device)
    return time.perf_counter() - start, made - start


def kv_bytes(cache: Any) -> int:
    """The bytes of the tensors a cache's layers hold (each storage once: a disk restore's layers
    are views of one buffer; a sliding layer's room ahead is counted)."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values, *(getattr(layer, "_room", None) or ())):
            if tensor is not None and tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_shape(model: torch.nn.Module, tokens: int, repeats: int, block_size: int, device: torch.device
              ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    """Each policy's TTFT per round, in seconds, and the part of it its cache took to make, the
    warm-up round dropped; and the KV bytes its cache holds once the first token is out."""
    vocab = trace_model.vocab_of(model)
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    # Of the model's own layer types, as generate() makes it: a sliding layer keeps its window
    # alone (a DynamicCache() of plain layers holds, and copies, every token in each).
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=prefix)

    tmp = tempfile.mkdtemp(prefix="tierkv-ttft-")
    cold = os.path.join(tmp, "cold")

    def disk_store(path: str) -> TieredStore:
        return TieredStore(path, device=device, device_budget=0, host_budget=0, disk_budget="8GiB",
                           block_size=block_size)

    stores = {
        "device": TieredStore(None, device=device, device_budget="8GiB", host_budget="8GiB", block_size=block_size),
        "host": TieredStore(None, device=device, device_budget=0, host_budget="8GiB", block_size=block_size),
        "disk": disk_store(os.path.join(tmp, "warm")),
        "cold": disk_store(cold),
    }
    for store in stores.values():
        cache = store.open(model, ids)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        cache.commit(out)
    stores["disk"].close()
    # A restart: a new store on the same directory. Its budgets keep nothing in memory, so every
    # open below reads the blocks from LMDB (through the OS page cache, as a warm restart would).
    stores["disk"] = disk_store(os.path.join(tmp, "warm"))

    def reboot() -> None:
        # As after a reboot: the store reopened (outside the timing, as a server opens it when it
        # starts) on a file none of whose pages the OS still caches.
        stores["cold"].close()
        drop_cached(os.path.join(cold, "data.mdb"))
        stores["cold"] = disk_store(cold)

    policies = {
        "recompute": lambda: None,
        "floor (ready DynamicCache)": None,
        "tierkv device": lambda: stores["device"].open(model, ids),
        "tierkv host": lambda: stores["host"].open(model, ids),
        "tierkv disk (after restart)": lambda: stores["disk"].open(model, ids),
        "tierkv disk (after reboot: cold page cache)": lambda: stores["cold"].open(model, ids),
    }
    times: dict[str, list[float]] = {name: [] for name in policies}
    opens: dict[str, list[float]] = {name: [] for name in policies}
    # The floor's caches are made before the rounds, as tierkv's blocks were: a server holds a
    # returning session's cache since its last turn, not one copied a moment before it.
    held = [copy.deepcopy(prefix) for _ in range(repeats + 1)]
    for names in round_orders(list(policies), repeats + 1):  # the first round warms up and is dropped
        for name in names:
            make = policies[name]
            if make is None:
                ready = held.pop()
                t, o = first_token_seconds(model, ids, lambda: ready)
                del ready
            elif "cold" in name:
                reboot()
                t, o = first_token_seconds(model, ids, make)
            else:
                t, o = first_token_seconds(model, ids, make)
            times[name].append(t)
            opens[name].append(o)
    held = {}
    for name, make in policies.items():
        if name == "recompute":
            continue  # generate's own DynamicCache: the floor's
        cache = copy.deepcopy(prefix) if make is None else make()
        model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        held[name] = kv_bytes(cache)
        del cache
    for store in stores.values():
        store.close()
    shutil.rmtree(tmp, ignore_errors=True)  # scratch: the stores' files
    return {name: ts[1:] for name, ts in times.items()}, {name: ts[1:] for name, ts in opens.items()}, held


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The policies' order in each round, shuffled anew each round (seeded). What ran just before
    a turn changes its time: a small-shape turn right after a recomputation took 0.3-0.45 ms longer
    (of 3.7 ms; no page faults: the CPU's caches). In one fixed order the floor always came right
    after recomputation, and every ratio to the floor read 0.1-0.2 too low."""
    shuffle = random.Random(seed).shuffle
    orders = []
    for _ in range(rounds):
        names = list(names)
        shuffle(names)
        orders.append(names)
    return orders


def paired(times: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of one policy's TTFT over ``base``'s in the same round: the machine's
    drift between rounds cancels out of each quotient."""
    return statistics.median(t / b for t, b in zip(times[name], times[base]))


def spread(times: dict[str, list[float]], name: str, base: str) -> str:
    """The quartiles of those per-round quotients, as ``low-high``: how far one run's median can
    be trusted (a single round gives its one quotient twice)."""
    quotients = [t / b for t, b in zip(times[name], times[base])]
    if len(quotients) < 2:
        return f"{quotients[0]:.2f}-{quotients[0]:.2f}"
    low, _, high = statistics.quantiles(quotients, n=4, method="inclusive")
    return f"{low:.2f}-{high:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=at_least(2), default=1024, help="the returning session's length")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--block-size", type=at_least(1, MAX_BLOCK_SIZE), default=256)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even where CUDA is present")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a checkpoint instead of the shapes: a directory written by save_pretrained (or a Hub "
                             "id, where the network allows)")
    parser.add_argument("--dtype", default="float32", choices=list(trace_model.DTYPES),
                        help="the models' dtype (default: %(default)s)")
    args = parser.parse_args()
    device = pick_device(args.cpu)
    if args.model is not None:
        try:
            models = {"model": trace_model.build_model(argparse.Namespace(model=args.model, dtype=args.dtype), device,
                                                       args.tokens, flag="--tokens", generated=1)}
        except trace_model.ModelFlagError as exc:
            parser.error(str(exc))
    else:
        models = {shape: build(shape, device, trace_model.DTYPES[args.dtype]) for shape in args.shapes}
    for shape, model in models.items():
        try:
            times, opens, held = run_shape(model, args.tokens, args.repeats, args.block_size, device)
        except ValueError as exc:  # store.open's refusal of a model tierkv cannot serve
            parser.error(f"tierkv cannot serve this model: {exc}")
        med = {name: statistics.median(ts) for name, ts in times.items()}
        floor_name = "floor (ready DynamicCache)"
        floor, recompute = med[floor_name], med["recompute"]
        name = trace_model.describe(model, args.model) if args.model else (
            f"{shape} llama ({SHAPES[shape]['num_hidden_layers']} layers, hidden {SHAPES[shape]['hidden_size']}, "
            f"{args.dtype})")
        print(f"\n{name} on {device.type}, returning session of {args.tokens} tokens, median of {args.repeats}")
        print("| policy | TTFT / floor | paired per round | its quartiles | TTFT / recompute "
              "| of which store.open / floor, paired | KV held / floor's |")
        print("|---|---|---|---|---|---|---|")
        for name, t in med.items():
            made = f"{paired({**times, name: opens[name]}, name, floor_name):.3f}" if name.startswith("tierkv") else "-"
            kv = f"{held[name] / held[floor_name]:.2f}" if name in held else "-"
            print(f"| {name} | {t / floor:.2f} | {paired(times, name, floor_name):.2f} | "
                  f"{spread(times, name, floor_name)} | {t / recompute:.3f} | {made} | {kv} |")


if __name__ == "__main__":
    main()
