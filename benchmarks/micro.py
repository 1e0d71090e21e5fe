"""Microbenchmarks of tierkv's parts against the machine's own limits, measured side by side.

* prefix hashing, ns per token;
* codec encode / decode (checksum verified) GB/s, against a plain memcpy of the same bytes;
* LMDB spill (the disk tier's write path: encode + put + commit + sync) GB/s against a raw file
  write + fsync of the same bytes, and LMDB read (load + verify into a tensor) against a raw file
  read, from the page cache and from a cold one (the files' pages evicted, as after a reboot);
* restore (open + every layer assembled from host-tier blocks) GB/s against a raw copy_ (on CUDA, a raw
  pinned host->device copy_ of the same bytes; ``--cpu`` stays on CPU where CUDA is present);
* the model checks every ``open`` pays (``describe_model``), from cold caches, against a one-token
  forward of the same model: the fixed cost a turn pays for a model with as many tensors as a 7B
  Llama (``--check-layers 32``), at a width this machine holds.

    python -m benchmarks.micro
    python -m benchmarks.micro --mib 16 --repeats 1     # a quick look
"""

from __future__ import annotations

import argparse
import os
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
from tierkv.cache import describe_model
from tierkv.codec import RecordHeader, decode, decode_into, encode_array, record_size
from tierkv.hashing import chain_keys, root_key, token_bytes
from tierkv.tiers.disk import DeleteBlocks, DiskTier, PutBlock, dtype_name, op_size, tensor_bytes
from tierkv.transfer import Job

warnings.filterwarnings("ignore", category=FutureWarning)
hf_logging.set_verbosity_error()


def pick_device(cpu: bool) -> torch.device:
    """CUDA where present unless ``--cpu``. The model goes there too: a store refuses a model that
    is not on its device tier's device."""
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an int of at least ``minimum`` (and at most ``maximum``), or a clear error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: give {minimum} or more")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is too large: give {maximum} or less")
        return value
    return parse


def sync(device: torch.device) -> None:
    # CUDA work is asynchronous: a timing that does not wait for it times the launches only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best(fn, repeats: int, device: torch.device | None = None) -> float:
    """Fastest of ``repeats`` timed runs after one warm-up: the machine's capability, not its noise.
    ``device``: a CUDA device whose queued work each run waits for."""
    fn()
    if device is not None:
        sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device is not None:
            sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def hashing(repeats: int) -> list[tuple[str, str]]:
    ids = np.random.default_rng(0).integers(0, 128_000, 1 << 20)
    root = root_key(b"\0" * 16, None)
    t = best(lambda: chain_keys(root, ids, 256), repeats)
    return [("prefix hashing (chain_keys, block 256)", f"{t / len(ids) * 1e9:.1f} ns/token")]


def block(mib: int, seed: int = 0) -> torch.Tensor:
    # (layers, 2, heads, tokens, head_dim) of bf16: `mib` MiB.
    tokens = mib * 2**20 // (4 * 2 * 8 * 128 * 2)
    g = torch.Generator().manual_seed(seed)
    return torch.randn((4, 2, 8, tokens, 128), generator=g).to(torch.bfloat16)


def header_for(t: torch.Tensor, i: int) -> RecordHeader:
    key = i.to_bytes(16, "little")
    return RecordHeader(key=key, parent=b"\0" * 16, tenant=None, fingerprint=b"\1" * 16, dtype=dtype_name(t.dtype),
                        shape=tuple(t.shape), token_ids=token_bytes(range(t.shape[3])), seq=i)


def codec(repeats: int) -> list[tuple[str, str]]:
    t = block(4)
    payload = tensor_bytes(t)
    header = header_for(t, 1)
    record = encode_array(header, payload)
    n = payload.nbytes
    dst = np.empty(n, dtype=np.uint8)
    t_copy = best(lambda: np.copyto(dst, np.frombuffer(payload, dtype=np.uint8)), repeats)
    t_enc = best(lambda: encode_array(header, payload), repeats)
    # As a disk read decodes: the payload copied out, checksummed on the way; into the buffer the
    # memcpy writes, so that both pay the same for their destination's pages.
    rows = dst.reshape(t.shape[0] * t.shape[1] * t.shape[2], t.shape[3], -1)
    t_dec = best(lambda: decode_into(record, lambda h: rows), repeats)
    t_verify = best(lambda: decode(record), repeats)
    return [("codec encode (4 MiB record)", f"{n / t_enc / 1e9:.2f} GB/s = {t_copy / t_enc:.2f} x memcpy"),
            ("codec decode: copy + checksum, as a disk read does (4 MiB record)",
             f"{n / t_dec / 1e9:.2f} GB/s = {t_copy / t_dec:.2f} x memcpy"),
            ("codec checksum of a record in place, no copy (4 MiB record)",
             f"{n / t_verify / 1e9:.2f} GB/s = {t_copy / t_verify:.2f} x memcpy")]


def put(tier: DiskTier, header: RecordHeader, tensor: torch.Tensor) -> PutBlock:
    """The write the store queues for a committed block, counted at its footprint as the store does."""
    return PutBlock(header, Job.completed(tensor), tier.footprint_of(header, record_size(header)))


def writer_batches(count: int, ops: list[PutBlock], max_bytes: int = 64 << 20) -> list[slice]:
    """The store's disk writer's batches of ``ops`` (``BackgroundWriter``, ``max_batch_bytes`` of
    a large disk budget, ``write_batch_bytes``): items up to ``count`` and ``max_bytes`` of
    records, an item that would pass either left for the next batch unless it is its first.
    Slices of ``ops``."""
    cuts, start, nbytes = [], 0, 0
    for i, op in enumerate(ops):
        if i > start and (i - start == count or nbytes + op_size(op) > max_bytes):
            cuts.append(slice(start, i))
            start, nbytes = i, 0
        nbytes += op_size(op)
    return [*cuts, slice(start, len(ops))]


def drop_cached(path: str) -> None:
    """Evict a file's clean pages from the OS page cache (no root needed), as after a reboot.
    Pages still mapped by an open LMDB environment stay, so close it first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def disk(mib: int, repeats: int) -> list[tuple[str, str]]:
    blocks = [block(4, seed=i) for i in range(max(1, mib // 4))]
    nbytes = sum(b.numel() * b.element_size() for b in blocks)
    tmp = tempfile.mkdtemp(prefix="tierkv-micro-")
    keys = [i.to_bytes(16, "little") for i in range(len(blocks))]
    latest: dict[str, str] = {}
    count = {"n": 0}

    def fresh(kind: str) -> str:
        # A new file (or environment) in a new place each round: rewriting one file in place
        # reuses its just-freed blocks and flatters the raw figure several times over here. The
        # previous round's output of the same kind is deleted first, outside the timing, so both
        # sides write into memory and disk the machine has just freed: on this VM, page-cache
        # pages never touched before cost the guest a host fault each, and a series that keeps
        # every round's files drifts into that state part-way, whichever side runs then.
        if kind in latest:
            remove(latest[kind])
        count["n"] += 1
        latest[kind] = os.path.join(tmp, f"{kind}{count['n']}")
        return latest[kind]

    def raw_write() -> float:
        start = time.perf_counter()
        with open(fresh("raw"), "wb") as f:
            for b in blocks:
                f.write(tensor_bytes(b))
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start

    def raw_read() -> None:
        with open(latest["raw"], "rb", buffering=0) as f:
            for b in blocks:
                out = torch.empty_like(b)
                f.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B"))

    def lmdb_write() -> float:
        # Into a store just created: its creation (one small transaction, synced, at open) is
        # paid once per store, not per spill, and is left out.
        tier = DiskTier(fresh("lmdb"), 1 << 40, 256)
        ops = [put(tier, header_for(b, i), b) for i, b in enumerate(blocks)]
        start = time.perf_counter()
        for batch in writer_batches(64, ops):  # 64 MiB of records a transaction at most
            assert not any(tier.apply(ops[batch]))
        tier.sync()
        seconds = time.perf_counter() - start
        tier.close()
        return seconds

    stores = {"steady": DiskTier(os.path.join(tmp, "steady"), 1 << 40, 256),
              "cold": DiskTier(os.path.join(tmp, "cold"), 1 << 40, 256)}
    generation = {"steady": 0, "cold": 0}

    def lmdb_write_steady(name: str = "steady") -> float:
        # A store at its disk budget: each spill evicts as much (deletes that zero what they
        # remove) and lands in the pages freed. As the store does, each batch evicts what its
        # blocks need: the writer's transaction holds the evictions and the block writes. "cold":
        # the evicted records are no longer in the page cache (they are the least recently used),
        # as in a store larger than memory.
        if name == "cold" and generation[name]:
            stores[name].close()
            drop_cached(os.path.join(tmp, name, "data.mdb"))
            stores[name] = DiskTier(os.path.join(tmp, name), 1 << 40, 256)
            stores[name].scan()
        tier = stores[name]
        start = time.perf_counter()
        base = generation[name] * len(blocks)
        generation[name] += 1
        old = [(base - len(blocks) + i).to_bytes(16, "little") for i in range(len(blocks))] if base else []
        ops = [put(tier, header_for(b, base + i), b) for i, b in enumerate(blocks)]
        for batch in writer_batches(64, ops):
            evicted = [DeleteBlocks(old[batch], evicted=True)] if old else []
            assert not any(tier.apply([*evicted, *ops[batch]]))
        tier.sync()
        return time.perf_counter() - start

    # Alternated and compared by median: this machine's disk throughput drifts between bursts,
    # so two back-to-back series would compare the disk's moods, not the two paths.
    raw_w, lmdb_w, steady_w, cold_w = [], [], [], []
    raw_write()
    lmdb_write()
    lmdb_write_steady()
    lmdb_write_steady("cold")
    for _ in range(max(3, repeats)):
        for fn, out in ((raw_write, raw_w), (lmdb_write, lmdb_w), (lmdb_write_steady, steady_w),
                        (lambda: lmdb_write_steady("cold"), cold_w)):
            out.append(fn())
    for tier in stores.values():
        tier.close()
    t_raw_w, t_lmdb_w, t_steady_w, t_cold_w = (statistics.median(x) for x in (raw_w, lmdb_w, steady_w, cold_w))

    def lmdb_read(tier: DiskTier) -> None:
        tier.prefetch(keys)  # as an open does for the blocks it restores from disk
        for key in keys:
            tier.load(key, lambda shape, dtype: torch.empty(shape, dtype=dtype))

    tier = DiskTier(latest["lmdb"], 1 << 40, 256)
    tier.scan()
    t_raw_r = best(raw_read, repeats)
    t_lmdb_r = best(lambda: lmdb_read(tier), repeats)
    tier.close()

    # From a cold page cache, as after a reboot: every byte comes from the disk. Alternated, each
    # round after evicting both files' pages. The store reopens first (its scan reads the heads,
    # timed apart), then reads its blocks.
    cold_raw, cold_lmdb, reopen = [], [], []
    data = os.path.join(latest["lmdb"], "data.mdb")
    for _ in range(max(3, repeats)):
        drop_cached(latest["raw"])
        start = time.perf_counter()
        raw_read()
        cold_raw.append(time.perf_counter() - start)
        drop_cached(data)
        start = time.perf_counter()
        tier = DiskTier(latest["lmdb"], 1 << 40, 256)
        tier.scan()
        reopen.append(time.perf_counter() - start)
        start = time.perf_counter()
        lmdb_read(tier)
        cold_lmdb.append(time.perf_counter() - start)
        tier.close()
    t_cold_raw, t_cold_lmdb, t_reopen = (statistics.median(x) for x in (cold_raw, cold_lmdb, reopen))
    shutil.rmtree(tmp, ignore_errors=True)
    gb = nbytes / 1e9
    return [(f"LMDB spill into a new store, {nbytes >> 20} MiB in 4 MiB records", f"{gb / t_lmdb_w:.2f} GB/s = "
             f"{t_raw_w / t_lmdb_w:.2f} x raw write+fsync to a new file ({gb / t_raw_w:.2f} GB/s)"),
            (f"LMDB spill at the disk budget (freed pages reused), {nbytes >> 20} MiB",
             f"{gb / t_steady_w:.2f} GB/s = {t_raw_w / t_steady_w:.2f} x raw write+fsync to a new file"),
            (f"the same, the evicted records out of the page cache, {nbytes >> 20} MiB",
             f"{gb / t_cold_w:.2f} GB/s = {t_raw_w / t_cold_w:.2f} x raw write+fsync to a new file"),
            (f"LMDB read + verify, {nbytes >> 20} MiB (page cache)", f"{gb / t_lmdb_r:.2f} GB/s = "
             f"{t_raw_r / t_lmdb_r:.2f} x raw read ({gb / t_raw_r:.2f} GB/s)"),
            (f"LMDB read + verify, {nbytes >> 20} MiB (cold page cache)", f"{gb / t_cold_lmdb:.2f} GB/s = "
             f"{t_cold_raw / t_cold_lmdb:.2f} x raw read ({gb / t_cold_raw:.2f} GB/s)"),
            (f"reopen of that store (open + scan of {len(keys)} blocks' heads, cold page cache)",
             f"{t_reopen * 1e3:.1f} ms = {t_reopen / t_cold_raw:.3f} x the raw read of its records")]


def restore(mib: int, repeats: int, device: torch.device) -> list[tuple[str, str]]:
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=1024, intermediate_size=256,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                  max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    kv_per_token = 2 * 4 * 8 * 128 * 4
    tokens = max(512, mib * 2**20 // kv_per_token)
    ids = torch.randint(3, 512, (1, tokens + 1)).to(device)
    store = TieredStore(None, device=device, device_budget=0, host_budget="8GiB", block_size=256)
    cache = store.open(model, ids)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    cache.commit(ids)
    nbytes = store.open(model, ids).restored_tokens * kv_per_token  # what a restore moves

    def restore_all() -> None:
        c = store.open(model, ids)
        for layer in c.layers:
            layer.keys  # noqa: B018 - assembles the layer from its blocks

    if device.type == "cuda":
        # The restore's own work: pinned host blocks copied to the device. Its limit is one raw
        # pinned host->device copy_ of the same bytes.
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        raw_name = "raw pinned host->device copy_"
        t_copy = best(lambda: dst.copy_(src, non_blocking=True), repeats, device)
    else:
        # On CPU the host tier's blocks are assembled into new tensors: a copy into fresh memory.
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        raw_name = "raw copy_"
        t_copy = best(lambda: torch.empty_like(src).copy_(src), repeats)
    t_restore = best(restore_all, repeats, device)
    store.close()
    return [(f"restore from host, {nbytes >> 20} MiB, {device.type}", f"{nbytes / t_restore / 1e9:.2f} GB/s = "
             f"{t_copy / t_restore:.2f} x {raw_name} ({nbytes / t_copy / 1e9:.2f} GB/s)")]


def checks(layers: int, repeats: int, device: torch.device) -> list[tuple[str, str]]:
    """``describe_model`` (the module tree, the storages, the weight sample and the version
    counters every open reads) against a one-token forward on a ready 256-token DynamicCache, both
    after a 64 MiB sweep of the CPU's caches, as between two turns of a server. Alternated, medians.
    The cost grows with the model's tensors, not its width: 32 layers have a 7B Llama's 291."""
    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs
        model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 32000, (1, 257)).to(device)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache)
    describe_model(model)  # the first call digests every weight, once per model
    sweep = torch.empty(64 << 20, dtype=torch.uint8)

    def step() -> None:
        with torch.no_grad():
            model(ids[:, -1:], past_key_values=cache)
        cache.crop(-1)

    described, stepped = [], []
    step()
    for _ in range(max(5, repeats)):
        for fn, out in ((lambda: describe_model(model), described), (step, stepped)):
            sweep.add_(1)
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - start)
    t_check, t_step = statistics.median(described), statistics.median(stepped)
    tensors, modules = len(list(model.parameters())), len(list(model.modules()))
    return [(f"model checks per open ({layers} layers: {tensors} tensors, {modules} modules; {device.type}, "
             "cold caches)", f"{t_check * 1e3:.2f} ms = {t_check / t_step:.3f} x a one-token forward on a ready "
             f"256-token DynamicCache ({t_step * 1e3:.1f} ms)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=at_least(1), default=256, help="bytes moved by the disk and restore figures")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--cpu", action="store_true", help="restore onto CPU even where CUDA is present")
    parser.add_argument("--check-layers", type=at_least(1), default=32,
                        help="layers of the model whose per-open checks are timed (32: a 7B Llama's tensor count)")
    args = parser.parse_args()
    device = pick_device(args.cpu)
    rows = (hashing(args.repeats) + codec(args.repeats) + disk(args.mib, args.repeats)
            + restore(args.mib, args.repeats, device) + checks(args.check_layers, args.repeats, device))
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
