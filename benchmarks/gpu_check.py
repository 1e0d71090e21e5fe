"""The CUDA checks, in one command that finishes in a few minutes on one GPU.

1. Exactness on CUDA: greedy output through tierkv equals a reused DynamicCache and plain
   generate, token for token, with the blocks resting on the device, in pinned host memory, and
   on disk (and after reopening the store), for float32 and bfloat16 tiny models.
2. Copy bandwidth: device->host and host->device GB/s through tierkv's copy engine (side streams,
   events) against a raw pinned ``copy_`` of the same bytes.
3. Overlap: restore + prefill of the new tokens, against the sum of a restore alone and a prefill
   on a ready cache alone.
4. Devices: CPU-computed blocks are not restored on CUDA; a store made without ``device=``; the
   caller's current stream and device kept across the engine's copies; a restore's disk records
   read by helper threads on the store's device; a child forked from a process whose store
   holds CUDA blocks drops them and exits cleanly; a reply past a sliding window (Mistral's, and
   Gemma 4's beside layers of another KV shape) held in pinned host memory past the window, exact
   after a restart.
5. The model checks every open pays on CUDA (``benchmarks.micro.checks``: the weight sample is
   read there with one ``take`` per parameter), against a one-token forward.

    python benchmarks/gpu_check.py            # on a GPU machine
    python benchmarks/gpu_check.py --cpu      # a dry run of the same code paths on CPU

Prints a report to stdout; paste it with the date into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tierkv import TieredStore  # noqa: E402
from tierkv.pool import HostPool  # noqa: E402
from tierkv.transfer import CopyEngine, copy_timer  # noqa: E402

from benchmarks.micro import checks  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
hf_logging.set_verbosity_error()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny(model_type: str, dtype: torch.dtype, device: torch.device, **shape) -> torch.nn.Module:
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if model_type == "gpt2":
        fields = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4)
    fields.update(shape)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device(device):  # built where it runs: a multi-GB model initialises in seconds there
        return AutoModelForCausalLM.from_config(config).to(dtype=dtype).eval()


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string ("5.17.0", "5.25.0.dev0")."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def check_exactness(device: torch.device) -> list[str]:
    lines = []
    # Mistral with an 8-token window: its sliding layers hold of each restore only the blocks
    # their window reaches (the later turns restore past it), their parts waited for on CUDA.
    # DeepSeek-V3's latent attention: keys (the latent) and values (the rotary keys) of other
    # widths, a layer of several units whose copy is waited for at its last slot (layout.py); 3
    # layers of 3 units of 8 (a latent of 16, rotary keys of 8): an odd count, so each block
    # carries the zeroed unit no layer holds, as DeepSeek-V3's 61 layers of 9 units do.
    latent = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
    # Gemma 4: KV of other shapes per layer (2 KV heads x 16 sliding, 1 x 32 full) and KV sharing.
    per_layer = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                     attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                     num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512)
    # Llama 4: an 8-token chunk in its first layer (a window to transformers' caches), full
    # attention without RoPE in its second; MoE.
    chunked = dict(head_dim=16, attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=2,
                   intermediate_size_mlp=128)
    for model_type, shape, label in (("llama", {}, "llama"), ("gpt2", {}, "gpt2"),
                                     ("mistral", dict(sliding_window=8), "mistral sliding window 8"),
                                     ("deepseek_v3", latent, "deepseek_v3 latent attention"),
                                     ("gemma4_text", per_layer, "gemma4_text KV of other shapes per layer, shared"),
                                     ("llama4_text", chunked, "llama4_text chunked attention 8")):
        if _release(transformers.__version__) < (5, 24) and model_type in ("deepseek_v3", "gemma4_text",
                                                                           "llama4_text"):
            # Earlier releases cached latent attention's heads' keys and values, not the latent (the
            # first forward refuses), and knew no Gemma 4: the check carries a transformers wheel.
            lines.append(f"| {model_type} | - | skipped: transformers {transformers.__version__} "
                         "(tierkv serves it from 5.24) | - | - |")
            continue
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny(model_type, dtype, device, **shape)
            for tier, budgets in (("device", dict(device_budget="1GiB")),
                                  ("host", dict(device_budget=0, host_budget="1GiB")),
                                  ("disk", dict(device_budget=0, host_budget=0))):
                path = tempfile.mkdtemp(prefix="tierkv-gpu-")
                store = TieredStore(path, device=device, block_size=8, **budgets)
                gen = torch.Generator().manual_seed(1)
                ids = torch.randint(3, 512, (1, 21), generator=gen).to(device)
                reuse = DynamicCache(config=model.config)
                ok, drift, restored = True, False, []
                for turn in range(3):
                    cache = store.open(model, ids, session="s")
                    restored.append(cache.restored_from[tier])
                    out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
                    plain = model.generate(ids, max_new_tokens=5, do_sample=False)
                    with_reuse = model.generate(ids, past_key_values=reuse, max_new_tokens=5, do_sample=False)
                    # In reduced precision transformers' own reused cache may part from recomputation
                    # (Llama 4's bf16 MoE at its second turn): tierkv must then equal that cache.
                    ok &= torch.equal(out, with_reuse)
                    drift |= not torch.equal(out, plain)
                    if ("sliding_window" in shape or "attention_chunk_size" in shape) and turn:
                        ok &= cache.held_from() > 0  # cut to the window
                    cache.commit(out)
                    ids = torch.cat([out, torch.randint(3, 512, (1, 5), generator=gen).to(device)], dim=1)
                store.close()
                store = TieredStore(path, device=device, block_size=8, **budgets)  # a restart
                cache = store.open(model, ids, session="s")
                after = cache.restored_from["disk"]
                out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
                ok &= torch.equal(out, model.generate(ids, past_key_values=reuse, max_new_tokens=5, do_sample=False))
                drift |= not torch.equal(out, model.generate(ids, max_new_tokens=5, do_sample=False))
                pool = store.stats()["host_pool"]
                store.close()
                shutil.rmtree(path, ignore_errors=True)
                pool_note = f" (pool fallbacks {pool['fallbacks']})" if pool else ""
                drifted = "drift (a reused DynamicCache parts from plain generate alike: transformers' own)"
                verdict = "MISMATCH" if not ok else drifted if drift else "exact"
                lines.append(f"| {label} {str(dtype).removeprefix('torch.')} | {tier} | "
                             f"{verdict}{pool_note} | {restored} | {after} |")
    return lines


def check_long_reply(device: torch.device) -> list[str]:
    """A reply of 60 tokens on models sliding over 8 (Mistral's window; Gemma 4's beside layers of
    another KV shape, with KV sharing): their sliding layers' tokens past the window and two
    margins go to pinned host memory as it goes (``tierkv/staged.py``: copies on the current
    stream, read back after their events), the device holds a window and two margins, and the
    commit stores every token from there: the next turn, restored from disk after a restart, and
    one parting inside the reply, are exact."""
    from tierkv.cache import TieredSlidingLayer  # noqa: PLC0415

    per_layer = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                     attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                     num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512)
    lines = []
    for model_type, shape in (("mistral", dict(sliding_window=8)), ("gemma4_text", per_layer)):
        if _release(transformers.__version__) < (5, 24) and model_type == "gemma4_text":
            lines.append(f"| a reply of 60 tokens past a window of 8, {model_type} | skipped: transformers "
                         f"{transformers.__version__} (tierkv serves it from 5.24) |")
            continue
        model = tiny(model_type, torch.float32, device, **shape)
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(3, 512, (1, 20), generator=gen).to(device)
        path = tempfile.mkdtemp(prefix="tierkv-gpu-")
        budgets = dict(device=device, block_size=8, device_budget=0, host_budget=0)
        store = TieredStore(path, **budgets)
        cache = store.open(model, ids, session="s")
        # min_new_tokens: a random model's eos would end the reply before the window.
        run = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False)
        out = model.generate(ids, past_key_values=cache, **run)
        ok = torch.equal(out, model.generate(ids, **run))
        sliding = [layer for layer in cache.layers if isinstance(layer, TieredSlidingLayer)]
        held = max([layer.keys.shape[-2] for layer in sliding])
        pinned = all([layer._staged and layer._staged._chunks[0][2].is_pinned() == (device.type == "cuda")
                      for layer in sliding])
        cache.commit(out)
        store.close()
        store = TieredStore(path, **budgets)  # a restart
        for later in (torch.cat([out, torch.randint(3, 512, (1, 4), generator=gen).to(device)], dim=1),
                      torch.cat([out[:, :45], torch.randint(3, 512, (1, 3), generator=gen).to(device)], dim=1)):
            cache = store.open(model, later, session="s")
            ok &= cache.restored_tokens >= 45
            ok &= torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                              model.generate(later, max_new_tokens=4, do_sample=False))
        store.close()
        shutil.rmtree(path, ignore_errors=True)
        verdict = "ok" if ok and pinned and held <= 8 - 1 + 2 * 8 + 1 else "WRONG"
        lines.append(f"| a reply of 60 tokens past a window of 8, {model_type} | {verdict}: exact {ok}, the device "
                     f"holds {held} tokens of {out.shape[1] - 1} per sliding layer, the rest in "
                     f"{('pinned ' if device.type == 'cuda' else '') if pinned else 'NOT PINNED '}host memory |")
    return lines


def check_device_kind(device: torch.device) -> list[str]:
    """Blocks a CPU computed are not restored into the same weights on the GPU (other kernels,
    other last bits): the fingerprint covers the device kind and the GPU model."""
    if device.type != "cuda":
        return ["| CPU blocks reopened on CUDA | n/a (dry run on CPU) |"]
    path = tempfile.mkdtemp(prefix="tierkv-gpu-")
    cpu_model = tiny("llama", torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 512, (1, 33), generator=torch.Generator().manual_seed(2))
    with TieredStore(path, device="cpu", block_size=8) as store:
        cache = store.open(cpu_model, ids, session="s")
        stored = cache.commit(cpu_model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False))
    gpu_model = copy.deepcopy(cpu_model).to(device)  # the same weights (CUDA's generator draws others)
    with TieredStore(path, device=device, block_size=8) as store:
        cache = store.open(gpu_model, ids.to(device), session="s")
        restored = cache.restored_tokens
        exact = torch.equal(gpu_model.generate(ids.to(device), past_key_values=cache, max_new_tokens=5, do_sample=False),
                            gpu_model.generate(ids.to(device), max_new_tokens=5, do_sample=False))
    shutil.rmtree(path, ignore_errors=True)
    verdict = "ok" if restored == 0 and exact else "WRONG"
    return [f"| CPU blocks reopened on CUDA | {verdict}: {stored} stored on CPU, {restored} restored on CUDA, "
            f"{'exact' if exact else 'MISMATCH'} |"]


def check_default_device(device: torch.device) -> list[str]:
    """A store made without ``device=`` (the README's quick start) takes the GPU: a model there is
    served, its writer runs, and flush and close return."""
    if device.type != "cuda":
        return ["| a store without device= | n/a (dry run on CPU) |"]
    path = tempfile.mkdtemp(prefix="tierkv-gpu-")
    model = tiny("llama", torch.float32, device)
    ids = torch.randint(3, 512, (1, 21), generator=torch.Generator().manual_seed(3)).to(device)
    with TieredStore(path, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False))
        store.flush()
        where, written = store.device, store.stats()["disk"]["blocks"]
    with TieredStore(path, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        exact = torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False),
                            model.generate(ids, max_new_tokens=5, do_sample=False))
        restored = cache.restored_tokens
    shutil.rmtree(path, ignore_errors=True)
    verdict = "ok" if exact and written and restored else "WRONG"
    return [f"| a store without device= | {verdict}: on {where}, {written} blocks written, {restored} restored after "
            f"a restart, {'exact' if exact else 'MISMATCH'} |"]


def check_reads_side_by_side(device: torch.device) -> list[str]:
    """A restore's disk records read by helper threads beside the opening one (as a large
    restore's are, ``PARALLEL_READ_BYTES``), into pinned pool buffers: exact, and every helper
    that read on the store's device (``transfer.thread_binding``: a thread on GPU 0 asking the
    copies' events made GPU 0's context in a process on another GPU)."""
    import threading

    import tierkv.store as store_module
    from tierkv.tiers.disk import DiskTier

    path = tempfile.mkdtemp(prefix="tierkv-gpu-reads-")
    model = tiny("llama", torch.float32, device)
    ids = torch.randint(3, 512, (1, 8 * 8 + 1), generator=torch.Generator().manual_seed(4)).to(device)
    disk_only = dict(device=device, block_size=8, device_budget=0, host_budget=0)
    with TieredStore(path, **disk_only) as store:
        cache = store.open(model, ids)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
    read_on: dict[str, object] = {}
    real = DiskTier.read_into

    def read_into(self, key, into):
        read_on[threading.current_thread().name] = torch.cuda.current_device() if device.type == "cuda" else "cpu"
        time.sleep(0.005)  # slow enough for the helpers to take some of the records
        return real(self, key, into)

    saved = store_module.PARALLEL_READ_BYTES, store_module.helper_threads, DiskTier.read_into
    store_module.PARALLEL_READ_BYTES, store_module.helper_threads, DiskTier.read_into = 0, lambda: 2, read_into
    try:
        with TieredStore(path, **disk_only) as store:
            cache = store.open(model, out)
            restored = cache.restored_from["disk"]
            exact = torch.equal(model.generate(out, past_key_values=cache, max_new_tokens=5, do_sample=False),
                                model.generate(out, max_new_tokens=5, do_sample=False))
    finally:
        store_module.PARALLEL_READ_BYTES, store_module.helper_threads, DiskTier.read_into = saved
    shutil.rmtree(path, ignore_errors=True)
    helpers = {name: on for name, on in read_on.items() if name.startswith("tierkv-disk-read")}
    want = device.index if device.type == "cuda" else "cpu"
    verdict = "ok" if exact and restored and helpers and set(helpers.values()) == {want} else "WRONG"
    return [f"| disk records read side by side | {verdict}: {restored} tokens restored, "
            f"{'exact' if exact else 'MISMATCH'}, helpers read on {sorted(set(helpers.values()), key=str)} |"]


def check_streams_put_back(device: torch.device) -> list[str]:
    """The copy engine's copies run on its own streams and put the caller's back (a try/finally
    of ``torch._C._cuda_setStream`` calls, not ``with torch.cuda.stream``): inside a stream of
    the program's own, after copies each way, that stream and device are still current, and
    the copies landed."""
    if device.type != "cuda":
        return ["| the caller's stream after copies | n/a (dry run on CPU) |"]
    engine = CopyEngine(device)
    mine = torch.cuda.Stream(device)
    src = torch.arange(4 * 2 * 2 * 8 * 4, dtype=torch.float32).reshape(4, 2, 2, 8, 4)
    with torch.cuda.stream(mine):
        before = (torch.cuda.current_device(), torch.cuda.current_stream(device))
        jobs = engine.to_device_many([src.pin_memory(), src + 1])
        back = engine.to_host(jobs[0])
        after = (torch.cuda.current_device(), torch.cuda.current_stream(device))
        landed = torch.equal(back.wait(), src) and torch.equal(jobs[1].wait().cpu(), src + 1)
        # A copy's timer (metrics) asks its events under the copy's device, put back by
        # torch._C._cuda_exchangeDevice and _cuda_maybeExchangeDevice.
        timer = copy_timer(back)
        seconds = timer() if timer is not None else None
        timed = seconds is not None and seconds >= 0 and torch.cuda.current_device() == before[0]
    default = torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    verdict = "ok" if before == after and before[1] == mine and landed and default and timed else "WRONG"
    return [f"| the caller's stream after copies | {verdict}: {'kept' if before == after else 'CHANGED'}, "
            f"copies {'landed' if landed else 'MISMATCH'}, the default stream current after the with: {default}, "
            f"a copy's timer read {'with the device kept' if timed else f'WRONG ({seconds})'} |"]


def check_forked_child(device: torch.device) -> list[str]:
    """A process forked from one whose store holds blocks on CUDA (a server's workers forked
    after a warm-up): the child is refused every call, drops the store (its copies' device
    tensors told of the copy streams, its events, the pinned pool) and exits cleanly, and the
    parent's store goes on exact. A forked child cannot use CUDA: were tearing those down to
    call it there, the child would die in the tensors' deleters (SIGABRT), not exit 0."""
    import gc
    import os
    import signal
    import weakref

    if not hasattr(os, "fork"):
        return ["| a forked child drops the store | n/a (no fork here) |"]
    path = tempfile.mkdtemp(prefix="tierkv-gpu-fork-")
    model = tiny("llama", torch.float32, device)
    block = 2 * 2 * 2 * 8 * 16 * 4  # layers x (K, V) x kv heads x tokens x head dim x fp32
    store = TieredStore(path, device=device, block_size=8, device_budget=3 * block, host_budget=3 * block)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 512, (1, 6 * 8 + 1), generator=gen).to(device)
    for _ in range(2):  # the second turn restores: device copies from pinned buffers, evictions back
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
        ids = torch.cat([out, torch.randint(3, 512, (1, 3), generator=gen).to(device)], dim=1)
    cache = store.open(model, ids, session="s")  # a restore in flight at the fork
    kept = weakref.ref(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "this process is multi-threaded": the writer, the readers
        pid = os.fork()
    if pid == 0:
        code = 0
        try:
            try:
                store.stats()
                code = 3  # served: the child would have used the parent's store
            except ValueError:
                pass
            cache = store = out = None
            gc.collect()
            if kept() is not None:
                code = 4  # nothing torn down: this check would tell nothing
        except BaseException:  # noqa: BLE001 - any failure is this check's verdict, told by the code
            code = 2
        os._exit(code)
    deadline = time.monotonic() + 30  # the child's work takes well under a second
    status = None
    while status is None and time.monotonic() < deadline:
        done, raw = os.waitpid(pid, os.WNOHANG)
        status = raw if done else None
        time.sleep(0.05)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        child = "hung (killed after 30 s)"
    elif os.WIFSIGNALED(status):
        child = f"died of {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        code = os.WEXITSTATUS(status)
        child = {0: "exited 0", 2: "raised as it dropped the store", 3: "was served stats()",
                 4: "kept the store alive (nothing torn down)"}.get(code, f"exited {code}")
    exact = torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False),
                        model.generate(ids, max_new_tokens=5, do_sample=False))
    restored = cache.restored_tokens
    cache.commit(ids)
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    verdict = "ok" if child == "exited 0" and exact and restored else "WRONG"
    return [f"| a forked child drops the store | {verdict}: the child {child}; the parent's turn after the fork "
            f"{'exact' if exact else 'MISMATCH'}, {restored} tokens restored |"]


def check_pool_churn(device: torch.device) -> list[str]:
    """Several sessions interleaved through a host tier of a few blocks: pool buffers are handed
    back and out again while copies from them may still run; every turn must stay exact."""
    model = tiny("llama", torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    block = 2 * 2 * 2 * 8 * 16 * model.dtype.itemsize  # layers x (K, V) x kv heads x tokens x head dim
    path = tempfile.mkdtemp(prefix="tierkv-gpu-pool-")
    store = TieredStore(path, device=device, block_size=8, device_budget=4 * block, host_budget=8 * block)
    gen = torch.Generator().manual_seed(3)
    convs = [torch.randint(3, 512, (1, 13 + 5 * i), generator=gen).to(device) for i in range(4)]
    ok, restored = True, {"device": 0, "host": 0, "disk": 0}
    for turn in range(16):
        i = turn % len(convs)
        cache = store.open(model, convs[i], session=f"s{i}")
        for tier, n in cache.restored_from.items():
            restored[tier] += n
        out = model.generate(convs[i], past_key_values=cache, max_new_tokens=4, do_sample=False)
        ok &= torch.equal(out, model.generate(convs[i], max_new_tokens=4, do_sample=False))
        cache.commit(out)
        convs[i] = torch.cat([out, torch.randint(3, 512, (1, 3), generator=gen).to(device)], dim=1)
    store.flush()
    pool = store.stats()["host_pool"]
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    return [f"| 4 sessions x 4 turns, device 4 blocks, host 8 blocks | {'exact' if ok else 'MISMATCH'} | "
            f"{restored} | {pool} |"]


def timed(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_bandwidth(device: torch.device, blocks: int, block_mib: int) -> list[str]:
    engine = CopyEngine(device)
    numel = block_mib * 2**20 // 2
    src = [torch.randn(numel, device=device, dtype=torch.bfloat16) for _ in range(blocks)]
    pinned = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=device.type == "cuda") for _ in range(blocks)]
    total = blocks * numel * 2

    def raw_d2h():
        for s, d in zip(src, pinned):
            d.copy_(s, non_blocking=True)

    def raw_h2d():
        for s, d in zip(pinned, src):
            d.copy_(s, non_blocking=True)

    def engine_d2h():
        for job in [engine.to_host(s) for s in src]:
            job.wait()

    def engine_h2d():
        for job in [engine.to_device(p) for p in pinned]:
            job.wait()

    # The store's path: destinations from the host pool, allocated once and reused.
    pool = HostPool(total + (64 << 20), pinned=device.type == "cuda")
    pooled = CopyEngine(device, host_alloc=pool.alloc)

    def pooled_d2h():
        jobs = [pooled.to_host(s) for s in src]
        for job in jobs:
            job.wait()
            if job.lease is not None:  # back to the pool, as the host tier does on eviction
                job.lease.hold()
                job.lease.unhold()

    rows = []
    for name, raw, ours in (("device -> host (fresh pinned buffers)", raw_d2h, engine_d2h),
                            ("device -> host (host pool)", raw_d2h, pooled_d2h),
                            ("host -> device", raw_h2d, engine_h2d)):
        t_raw, t_ours = timed(raw, device), timed(ours, device)
        rows.append(f"| {name} | {total / t_ours / 1e9:.1f} | {total / t_raw / 1e9:.1f} | {t_raw / t_ours:.2f} |")
    return rows


def check_overlap(device: torch.device, context: int, new: int, layers: int, hidden: int, kv_heads: int,
                  intermediate: int) -> list[str]:
    model = tiny("llama", torch.bfloat16 if device.type == "cuda" else torch.float32, device,
                 hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=max(1, hidden // 128), num_key_value_heads=kv_heads,
                 max_position_embeddings=context + new + 8, vocab_size=4096)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 4096, (1, context), generator=gen).to(device)
    ids = torch.cat([prefix, torch.randint(3, 4096, (1, new), generator=gen).to(device)], dim=1)
    store = TieredStore(None, device=device, device_budget=0, host_budget="64GiB", block_size=256)
    cache = store.open(model, prefix)
    with torch.no_grad():
        model(prefix, past_key_values=cache)
    cache.commit(prefix)

    def restore_alone():
        c = store.open(model, ids)
        for layer in c.layers:
            layer.keys  # noqa: B018 - waits for every copy
        return c

    def restore_and_prefill():
        c = store.open(model, ids)
        with torch.no_grad():
            model(ids[:, c.restored_tokens:], past_key_values=c)

    ready = DynamicCache()
    with torch.no_grad():
        model(ids[:, :context], past_key_values=ready)

    def prefill_alone():
        c = DynamicCache()
        for i, layer in enumerate(ready.layers):
            c.update(layer.keys, layer.values, i)
        with torch.no_grad():
            model(ids[:, context:], past_key_values=c)

    t_restore = timed(restore_alone, device)
    t_prefill = timed(prefill_alone, device)
    t_both = timed(restore_and_prefill, device)
    store.close()
    del model, store, cache, ready
    torch.cuda.empty_cache() if device.type == "cuda" else None
    kv = layers * 2 * kv_heads * 128 * context * (2 if device.type == "cuda" else 4)
    return [f"| model: {layers} layers, hidden {hidden}, {kv_heads} KV heads; KV restored {kv >> 20} MiB | |",
            f"| restore alone ({context} tokens from host) | {t_restore * 1e3:.1f} ms |",
            f"| prefill alone ({new} new tokens on a ready cache) | {t_prefill * 1e3:.1f} ms |",
            f"| restore + prefill | {t_both * 1e3:.1f} ms |",
            f"| (restore + prefill) / (restore alone + prefill alone) | {t_both / (t_restore + t_prefill):.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU (small sizes)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; pass --cpu for a dry run of the same code paths")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"tierkv gpu_check on {name}; torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}\n")
    print("Exactness (3 turns, then a restart), tierkv vs DynamicCache and plain generate:\n")
    print("| model | blocks rest in | result | restored per turn | restored after restart |\n|---|---|---|---|---|")
    failed = 0
    for line in check_exactness(device):
        print(line)
        failed += failure(line)
    print("\nDevices: the fingerprint's device kind, a store's default device, the caller's stream, its read "
          "helpers' device, a forked child, a reply past a sliding window:\n")
    print("| case | result |\n|---|---|")
    for line in check_device_kind(device) + check_default_device(device) + check_streams_put_back(device) + \
            check_reads_side_by_side(device) + check_forked_child(device) + check_long_reply(device):
        print(line)
        failed += failure(line)
    print("\nHost pool under churn (buffers reused while copies may still run):\n")
    print("| case | result | restored tokens per tier | host pool after flush |\n|---|---|---|---|")
    for line in check_pool_churn(device):
        print(line)
        failed += failure(line)
    print("\nCopy bandwidth through the copy engine vs raw pinned copy_ of the same bytes:\n")
    print("| direction | tierkv GB/s | raw copy_ GB/s | tierkv / raw |\n|---|---|---|---|")
    blocks, mib = (8, 1) if args.cpu else (64, 4)
    for line in check_bandwidth(device, blocks, mib):
        print(line)
    print("\nRestore overlapping prefill:\n")
    print("| figure | value |\n|---|---|")
    # A small model, whose prefill is bound by kernel launches (the host), and a 5B-class one,
    # whose prefill is bound by the GPU: overlap can only show where the GPU is the bottleneck.
    shapes = ([dict(context=512, new=64, layers=2, hidden=256, kv_heads=1, intermediate=512)] if args.cpu else
              [dict(context=8192, new=512, layers=16, hidden=2048, kv_heads=4, intermediate=4096),
               dict(context=8192, new=1024, layers=24, hidden=4096, kv_heads=8, intermediate=11008)])
    for sizes in shapes:
        for line in check_overlap(device, **sizes):
            print(line)
    print("\nModel checks per open (describe_model), against a one-token forward:\n")
    print("| figure | value |\n|---|---|")
    for layers in (4, 32) if device.type == "cuda" else (2,):
        for name, value in checks(layers, 9, device):
            print(f"| {name} | {value} |")
    print(f"\nfinished in {time.perf_counter() - start:.0f} s")
    if failed:
        raise SystemExit(f"{failed} check(s) failed (MISMATCH or WRONG above): please report this as a bug")


def failure(row: str) -> bool:
    """A correctness row that failed: its verdict cell says so (the figures' rows have none)."""
    return any(cell.strip().startswith(("MISMATCH", "WRONG")) for cell in row.split("|"))


if __name__ == "__main__":
    main()
