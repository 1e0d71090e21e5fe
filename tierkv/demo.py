"""A multi-session chat simulation on a tiny random model: tierkv against recomputation.

Several users share a system prompt and come back turn after turn. Each turn re-sends the whole
conversation. With tierkv, the store restores the conversation's KV from whichever tier it
rests in (device, host, disk) and only the new tokens are computed; the baseline recomputes
everything. Budgets are small on purpose, so sessions get demoted and come back from each tier.
At the end the store is closed and reopened, as after a restart: returning sessions hit disk.

Every turn checks that tierkv's greedy reply equals the recomputed one, token for token.

    tierkv demo                  # about a minute on 2 CPU cores
    tierkv demo --quick          # under half a minute
    python examples/chatbot.py   # the same, from a checkout

A program, like the benchmarks: it prints, and imports transformers directly.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
import tempfile
import time
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from .interrupts import raised_by_signal_handler, stat_or_none
from .store import MAX_BLOCK_SIZE, TieredStore
from .tiers.disk import DiskTier, StoreInUse
from .transfer import resolve_device


class FirstTokenTimer(BaseStreamer):
    """Records when generate() emits its first new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def build_model(layers: int, hidden: int, seed: int) -> torch.nn.Module:
    config = AutoConfig.for_model("llama", vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 2,
                                  num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                  num_key_value_heads=max(1, hidden // 128), max_position_embeddings=8192)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, reply_tokens: int, store: TieredStore | None = None,
                   session: str | None = None):
    """(output ids, time to first token in seconds, cache or None); TTFT includes store.open."""
    timer = FirstTokenTimer()
    start = time.perf_counter()
    cache = store.open(model, ids, session=session) if store is not None else None
    out = model.generate(ids, past_key_values=cache, max_new_tokens=reply_tokens, min_new_tokens=reply_tokens,
                         do_sample=False, streamer=timer)
    assert timer.first_token_at is not None
    return out, timer.first_token_at - start, cache


QUICK = {"turns": 6, "layers": 2, "hidden": 128, "system_tokens": 128}


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad flag exits through ``parser.error`` saying what to give, before anything is built."""
    for flag in ("sessions", "turns", "layers", "system_tokens", "reply_tokens", "block_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be 1 or more, got {getattr(args, flag)}")
    if args.block_size > MAX_BLOCK_SIZE:
        parser.error(f"--block-size must be {MAX_BLOCK_SIZE} or less, got {args.block_size}")
    if args.store == "":
        parser.error("--store was given an empty path (an unset variable?); give a directory, or leave --store out "
                     "for a temporary one")
    if args.store is not None:
        # As TieredStore reads it: a quoted "~/kv" checked as given was never found to be a file
        # (or to hold another block size) until the store met it, after the model was built.
        args.store = os.path.expanduser(args.store)
    heads = args.hidden // 64
    if args.hidden < 64 or args.hidden % 64 or heads % max(1, heads // 2):
        parser.error(f"--hidden must be 64, 128, 192 or a multiple of 128 (the model has hidden/64 query heads "
                     f"sharing hidden/128 KV heads), got {args.hidden}")
    if not 0 <= args.seed < 2**64:
        parser.error(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")
    # stat_or_none, not os.path's helpers: a signal handler's exception is raised, never taken for
    # a missing store.
    found = stat_or_none(args.store) if args.store is not None else None
    if found is not None and not stat.S_ISDIR(found.st_mode):
        parser.error(f"--store {args.store!r} is a file; give a directory (made if missing)")
    data = stat_or_none(os.path.join(args.store, "data.mdb")) if found is not None else None
    if data is not None and stat.S_ISREG(data.st_mode):
        try:
            stored = DiskTier.stored_meta(args.store)["block_size"]
        except ValueError as exc:
            parser.error(f"--store: {exc}")
        if stored != args.block_size:
            parser.error(f"--store {args.store!r} holds a store of --block-size {stored}: give --block-size {stored}, "
                         f"or another directory")


def open_store(path: str, block_size: int, budgets: dict, device: torch.device) -> TieredStore:
    """The demo's store; one that cannot be opened exits as the ``tierkv`` store commands do: 3
    when another process holds it, 2 otherwise, with the reason and no traceback."""
    try:
        return TieredStore(path, device=device, block_size=block_size, **budgets)
    except StoreInUse as exc:
        print(f"tierkv demo: error: {exc}", file=sys.stderr)
        raise SystemExit(3) from None
    except (ValueError, OSError) as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's: not the store's fault, nor a usage error
        print(f"tierkv demo: error: --store {path!r}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Run the simulation; ``argv`` defaults to ``sys.argv[1:]``, ``prog`` names it in ``--help``."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=12,
                        help="turns before the restart, two more after it (user0's and user1's): each session "
                             "speaks once, then they return at random, user0 most often")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--store", default=None, help="disk tier directory, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smaller model and fewer turns: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                             for k, v in QUICK.items()) + " unless given")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)  # defaults only: flags given with --quick win
        args = parser.parse_args(argv)
    check_args(parser, args)
    # Set here, not at import: `tierkv` imports this module only to run it, and importers keep theirs.
    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    # On the device a store takes by default (CUDA where there is one), which refuses a model elsewhere.
    device = resolve_device(None)
    model = build_model(args.layers, args.hidden, args.seed).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    system = torch.randint(3, vocab, (1, args.system_tokens), generator=gen).to(device)
    kv_per_token = 2 * args.layers * model.config.num_key_value_heads * (args.hidden // model.config.num_attention_heads) * 4
    # Room for about one conversation on the device and two in the host tier: the rest goes down.
    typical = (args.system_tokens + 200) * kv_per_token
    budgets = dict(device_budget=typical, host_budget=2 * typical, disk_budget="4GiB")
    path = args.store or tempfile.mkdtemp(prefix="tierkv-chatbot-")
    try:
        simulate(args, model, system, gen, budgets, kv_per_token, path)
    finally:
        if not args.store:
            shutil.rmtree(path, ignore_errors=True)


def simulate(args: argparse.Namespace, model: torch.nn.Module, system: torch.Tensor, gen: torch.Generator,
             budgets: dict, kv_per_token: int, path: str) -> None:
    """The turns, the restart and the summary, on the store at ``path``."""
    vocab = model.config.vocab_size
    kept = "" if args.store else " (temporary: removed at the end; --store DIR keeps one)"
    print(f"tiny llama: {args.layers} layers, hidden {args.hidden}, KV {kv_per_token} B/token; store at {path}{kept}")
    print(f"budgets: device {budgets['device_budget'] // 1024} KiB, host {budgets['host_budget'] // 1024} KiB, "
          f"disk 4 GiB; block {args.block_size} tokens\n")

    conversations = {f"user{i}": system.clone() for i in range(args.sessions)}
    # Zipf-like popularity: user0 returns most often.
    weights = torch.tensor([1.0 / (i + 1) for i in range(args.sessions)])
    order = torch.multinomial(weights, args.turns, replacement=True, generator=gen).tolist()
    order = (list(range(args.sessions)) + order[args.sessions:])[:args.turns]  # everyone speaks once first

    header = f"{'turn':>4}  {'session':<7} {'tokens':>6}  {'restored':>8} {'device':>6} {'host':>5} {'disk':>5}  " \
             f"{'TTFT tierkv':>11} {'recompute':>9} {'speedup':>7}  exact"
    print(header)
    print("-" * len(header))
    store = open_store(path, args.block_size, budgets, system.device)
    timed_generate(model, system, args.reply_tokens)  # warm up kernels and allocator before timing

    def run_turn(turn: int, user: str) -> None:
        message = torch.randint(3, vocab, (1, int(torch.randint(30, 80, (1,), generator=gen))), generator=gen
                                ).to(system.device)
        ids = torch.cat([conversations[user], message], dim=1)
        reference, ttft_plain, _ = timed_generate(model, ids, args.reply_tokens)
        out, ttft_tier, cache = timed_generate(model, ids, args.reply_tokens, store, user)
        cache.commit(out)
        exact = torch.equal(out, reference)
        r = cache.restored_from
        print(f"{turn:>4}  {user:<7} {ids.shape[1]:>6}  {cache.restored_tokens:>8} {r['device']:>6} {r['host']:>5} "
              f"{r['disk']:>5}  {ttft_tier * 1e3:>9.1f}ms {ttft_plain * 1e3:>7.1f}ms {ttft_plain / ttft_tier:>6.1f}x  "
              f"{'yes' if exact else 'NO'}")
        if not exact:
            raise SystemExit("tierkv's output differs from recomputation: please report this as a bug")
        conversations[user] = out

    for turn, user_idx in enumerate(order, 1):
        run_turn(turn, f"user{user_idx}")

    store.close()
    print("\n-- restart: the store is closed and reopened from disk --")
    store = open_store(path, args.block_size, budgets, system.device)
    for turn, user_idx in enumerate(range(min(2, args.sessions)), len(order) + 1):
        run_turn(turn, f"user{user_idx}")
    stats = store.stats()
    store.close()
    print(f"\nsince the restart: hit tokens {stats['hits']}, computed tokens {stats['misses']}, evictions {stats['evictions']}")
    for tier in ("device", "host", "disk"):
        s = stats[tier]
        print(f"{tier:>6}: {s['blocks']:>4} blocks, {s['bytes'] / 2**20:8.2f} MiB of {s['budget'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
