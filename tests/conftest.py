"""Shared fixtures: tiny random decoder-only models of several architectures, built offline; and
helpers that damage a store's file as a disk would (``damage_in_place``, ``damage_table``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")

VOCAB = 512


@pytest.fixture(autouse=True)
def _stores_on_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' models are on CPU, and a store's default device is CUDA where there is one,
    which refuses them: on a GPU machine, ``TieredStore(...)`` without ``device=`` is on CPU here.
    (Tests of CUDA pass their device.)"""
    if torch.cuda.is_available():
        import tierkv.store
        from tierkv.transfer import resolve_device
        monkeypatch.setattr(tierkv.store, "resolve_device", lambda device: resolve_device("cpu" if device is None else device))

@pytest.fixture(autouse=True)
def _disk_reads_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore of two disk records or more is read by helper threads beside the calling
    one, as a large one is (``PARALLEL_READ_BYTES``): the tests' records are far smaller, and the
    whole suite then runs that path, with at least one helper even on one CPU. Tests of the
    one-thread path set them back."""
    import tierkv.store
    monkeypatch.setattr(tierkv.store, "PARALLEL_READ_BYTES", 0)
    monkeypatch.setattr(tierkv.store, "helper_threads", lambda: 2)


class HandlerRaised(Exception):
    """What the signal handler of ``raised_on_the_way_in`` raises (as a SIGALRM timeout's would)."""


class HandlerTimeout(HandlerRaised, TimeoutError):
    """``raised_on_the_way_in(..., timeout=True)``'s: a ``TimeoutError``, as a ``SIGALRM``
    handler's often is, so an ``OSError`` too: code that takes it for the OS's answer swallows it."""


def _raise_handler_raised(signum: int, frame: object) -> None:
    raise HandlerRaised


def _raise_handler_timeout(signum: int, frame: object) -> None:
    raise HandlerTimeout("timed out")


def raised_on_the_way_in(enter: Callable[[], object], check: Callable[[list], None],
                         within: Collection[str] = (), timeout: bool = False) -> int:
    """``with enter():`` again and again, a real SIGUSR1 sent each time at the next point on the
    way in where CPython runs a signal handler (a Python function's start, a C call's return,
    found with ``sys.setprofile``), its handler raising ``HandlerRaised``; every exception kept
    alive (as ``sys.last_value`` keeps one) to the end; each must reach this caller (one the code
    swallowed fails: so must the standard library's on the way, as ``logging``'s ``LogRecord``
    does). ``check(sent)`` after each, ``sent`` naming the point: (event, the frame's function, the
    C function returning, or None). ``within``: only the points in
    the frames of functions of those names (the calls they make, their C calls' returns), for a
    test of their steps whose callees' own points other tests cut at. ``timeout``: the handler
    raises ``HandlerTimeout``, an ``OSError``. Returns how many points there were."""
    import signal
    import sys
    import threading

    import gc

    main = threading.get_ident()
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    kept: list[BaseException] = []
    previous = signal.signal(signal.SIGUSR1, _raise_handler_timeout if timeout else _raise_handler_raised)
    # No collection on the way in: the callbacks it runs (hypothesis registers one once its tests
    # ran) are points too, and CPython reports an exception raised in them rather than raise it.
    collecting = gc.isenabled()
    gc.disable()
    try:
        point = 0
        while True:
            point += 1
            seen: list[int] = [0]
            sent: list[tuple[str, str, str | None]] = []

            def profile(frame, event, arg, point=point):
                if event in ("call", "c_return") and (
                        not within or (frame.f_back if event == "call" else frame).f_code.co_name in within):
                    seen[0] += 1
                    if seen[0] == point:
                        # The C function too, at a C call's return: a test may tell the return
                        # of os.open (whose descriptor no Python code can take first) from others.
                        sent.append((event, frame.f_code.co_name, getattr(arg, "__name__", None)
                                     if event == "c_return" else None))
                        signal.pthread_kill(main, signal.SIGUSR1)  # its handler runs before this returns

            raised = False
            try:
                sys.setprofile(profile)
                try:
                    with enter():
                        sys.setprofile(None)
                finally:
                    sys.setprofile(None)
            except HandlerRaised as exc:
                kept.append(exc)
                raised = True
            if not sent:
                return point - 1  # past the way in
            # This point's exception, not an earlier one's: code under test that swallows it (an
            # ``except Exception`` around the call it landed in) fails here.
            assert raised, f"the handler's exception at {sent} was swallowed"
            # A grad mode switched by the code on the way (a ``with torch.no_grad():`` whose exit
            # the exception cut short) stays switched in the caller's thread for good.
            assert torch.is_grad_enabled() == grad, f"autograd left {'on' if grad else 'off'} by the cut at {sent}"
            # Alike a ``with torch.inference_mode(...)`` (``restore_slots``'s): a Python exit.
            assert torch.is_inference_mode_enabled() == inference, \
                f"inference mode left {'on' if inference else 'off'} by the cut at {sent}"
            check(sent)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        torch.set_grad_enabled(grad)  # for the tests after this one, whatever failed here
        kept.clear()
        if collecting:
            gc.enable()


# Per architecture, the config fields that make a 2-layer model with small heads.
_SHAPES: dict[str, dict[str, object]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=None),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    # Normalised queries and keys (qwen3, olmo2), scaled embeddings (gemma), partial rotary (gptj,
    # phi), ALiBi (bloom), parallel blocks (cohere, gptj), multipliers (granite), biases (starcoder2).
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "olmo2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "granite": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
    "cohere": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2),
    "starcoder2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, sliding_window=None),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.05),  # at 0.02 the prefix barely moves its logits
    "phi": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    # Sliding windows (12 tokens: shorter than every conversation the tests hold, and not a
    # multiple of their block size) in every layer, or beside full-attention layers.
    "mistral_window": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=12),
    "qwen2_window": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=12),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_window=12,
                        layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=12, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=12, num_local_experts=4),
    # KV of another shape per layer (as Gemma 4's larger checkpoints): its full-attention layers hold one KV head of
    # head_dim 32 (values computed as keys, attention_k_eq_v), its sliding ones 2 of 16; its last two
    # layers read the KV of the last two before them (KV sharing, Gemma 4 E2B's); per-layer input
    # embeddings too.
    "gemma4_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, sliding_window=12, layer_types=["sliding_attention", "full_attention"] * 2,
                        num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB),
    # KV sharing with KV of one shape (the last two layers read the KV of the two before them), AltUp
    # and LAuReL blocks, per-layer input embeddings.
    "gemma3n_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, sliding_window=12,
                         layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                         laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB),
    # Chunked attention (Llama 4's): a 12-token chunk in its first layer, whose mask restarts at each
    # chunk, a window to transformers' caches; full attention without RoPE in its second; MoE.
    "llama4_text": dict(hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=12,
                        no_rope_layers=[1, 0], num_local_experts=2),
    # Multi-head latent attention: the cache holds a compressed latent (kv_lora_rank 32) as its keys
    # and rotary keys (qk_rope_head_dim 8) as its values, one head each; MoE layers after the first.
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1),
}
ARCHITECTURES = list(_SHAPES)
# The model type of a shape named otherwise.
_MODEL_TYPE = {"mistral_window": "mistral", "qwen2_window": "qwen2"}
# The shapes whose layers (some or all) attend over a sliding window.
SLIDING = ["mistral_window", "qwen2_window", "gemma2", "gemma3_text", "cohere2", "gpt_oss", "gemma4_text",
           "gemma3n_text", "llama4_text"]


def make_model(model_type: str = "llama", seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type``, eval mode, float32, CPU."""
    fields = {"vocab_size": VOCAB, **_SHAPES[model_type], **overrides}
    config = AutoConfig.for_model(_MODEL_TYPE.get(model_type, model_type), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory ``tiny_model(model_type="llama", seed=0, **config_overrides)``, memoised per arguments."""
    built: dict[tuple, torch.nn.Module] = {}

    def get(model_type: str = "llama", seed: int = 0, **overrides: object) -> torch.nn.Module:
        key = (model_type, seed, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_model(model_type, seed, **overrides)
        return built[key]

    return get


def random_ids(length: int, seed: int = 0, low: int = 3) -> torch.Tensor:
    """``(1, length)`` token ids, reproducible, avoiding the low special ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (1, length), generator=g)


def kept_whole_and_next_turn_exact(store: Any, model: torch.nn.Module, cache: Any, sequences: torch.Tensor,
                                   seed: int, extra: int = 2) -> None:
    """``cache``'s commit of ``sequences`` keeps all but the last token, and the next turn of session
    "s" (``extra`` ids more, from ``seed``) restores them all and generates as plain generate does."""
    assert cache.commit(sequences) == sequences.shape[1] - 1
    later = torch.cat([sequences, random_ids(extra, seed=seed)], dim=1)
    cache = store.open(model, later, session="s")
    assert cache.restored_tokens == sequences.shape[1] - 1
    assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                       model.generate(later, max_new_tokens=4, do_sample=False))


def damage_table(path: object, table: bytes, page_number: bool = False) -> None:
    """Flip one bit in the B-tree of the LMDB sub-database ``table`` of a store: the key size of
    the first node of its root page, a leaf (32 -> 34 for ``refs``). LMDB still walks the table;
    a write that deletes there fails, with ``MDB_BAD_TXN`` on the next call rather than an error
    of its own. ``page_number``: the page's own number instead (in its header), which no read of
    LMDB's checks, and its next write frees that other page while still in use. Reads the file
    itself, not through LMDB: the store may be open in this process (it maps the file shared,
    and sees the damage). The table must fit one leaf page, and the file use 4 KiB pages (a
    small store's do, on x86-64)."""
    import struct

    page = 4096
    with open(f"{path}/data.mdb", "r+b") as f:
        data = bytearray(f.read())

        def db_root(at: int) -> int:  # an MDB_db record: pad, flags, depth, pages (3), entries, root
            return struct.unpack_from("<IHHQQQQQ", data, at)[7]

        def nodes(pgno: int) -> list[int]:
            lower = struct.unpack_from("<H", data, pgno * page + 12)[0]
            return [pgno * page + struct.unpack_from("<H", data, pgno * page + 16 + 2 * i)[0]
                    for i in range((lower - 16) // 2)]

        # The meta page of the last transaction (page header 16 bytes, then magic, version,
        # address, map size, the free and main tables' records, last page, transaction id).
        meta = max((0, page), key=lambda at: struct.unpack_from("<Q", data, at + 16 + 128)[0])
        main = db_root(meta + 16 + 24 + 48)
        node = next(n for n in nodes(main) if data[n + 8:n + 8 + struct.unpack_from("<H", data, n + 6)[0]] == table)
        root = db_root(node + 8 + len(table))
        assert struct.unpack_from("<H", data, root * page + 10)[0] == 0x02, "the table is not one leaf"  # P_LEAF
        at = root * page if page_number else nodes(root)[0] + 6  # a node: data size (u32), flags, key size, key
        data[at] ^= 0x02
        f.seek(at)
        f.write(data[at:at + 1])


def _file_offset(address: int, path: str) -> int:
    """Where the mapped byte at ``address`` lies in the file ``path`` (this process's maps)."""
    inode = os.stat(path).st_ino
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                assert int(fields[4]) == inode, f"{address:#x} is not in a map of {path}: {line}"
                return address - start + int(fields[2], 16)
    raise AssertionError(f"{address:#x} is in no map of this process")


def damage_in_place(env: lmdb.Environment, db: bytes | lmdb._Database, key: bytes,
                    damage: Callable[[bytes], bytes]) -> bytes:
    """Write ``damage(value)`` (as long as the value) over ``key``'s value in table ``db`` (a
    name or a handle) where it lies in the file, as a disk's damage is; returns the damaged value,
    read back through LMDB.

    Why not ``txn.put`` of the altered bytes: LMDB writes a new value to other pages and frees
    the old ones, so a store that has the record open keeps a place for it that is no longer the
    record's (its zeroing of a deleted record trusts the places it wrote), and its head in
    ``heads`` names the old place after a reopen too; the record was not damaged where it lay.
    The state machine (tests/test_properties.py) showed that pattern can damage the file. Written
    with ``pwrite`` at the file offset this process's map of the value has, so the environment
    need not be opened with ``writemap`` (a store's is; one a test opens read-only is mapped
    read-only) and a store open in this process sees it (it maps the file shared). In a write
    transaction that writes nothing: no other writer runs meanwhile. Linux (``/proc/self/maps``)."""
    with env.begin(write=True, buffers=True) as txn:  # buffers: views of the map, not copies
        handle = env.open_db(db, txn=txn, create=False) if isinstance(db, bytes) else db
        value = txn.get(key, db=handle)
        assert value is not None, f"no value under {key.hex()}"
        view = memoryview(value)
        before = bytes(view)
        damaged = bytes(damage(before))
        assert len(damaged) == len(before), "damage in place keeps the value's length"
        path = os.path.join(env.path(), "data.mdb")
        at = _file_offset(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0], path)
        fd = os.open(path, os.O_WRONLY)
        try:
            assert os.pwrite(fd, damaged, at) == len(damaged)
        finally:
            os.close(fd)
    with env.begin() as txn:
        handle = env.open_db(db, txn=txn, create=False) if isinstance(db, bytes) else db
        assert bytes(txn.get(key, db=handle)) == damaged, "the damage did not land where LMDB reads the value"
    return damaged


def flipped(value: bytes, at: int, mask: int = 0x01) -> bytes:
    """``value`` with the bits of ``mask`` flipped in its byte ``at``."""
    damaged = bytearray(value)
    damaged[at] ^= mask
    return bytes(damaged)


def reencoded(record: bytes, **changes: object) -> bytes:
    """``record`` with its header's fields changed (``dataclasses.replace``) and its checksum
    recomputed, as long as it was (its header's pad made to fit), for ``damage_in_place``."""
    from dataclasses import replace

    from tierkv.codec import decode_header, encode_array

    header = decode_header(record)
    payload = record[len(record) - 8 - header.payload_nbytes:len(record) - 8]
    changed = replace(header, **changes)
    # The pad's msgpack framing grows with it: the length asked for and the length made differ
    # by a few bytes, so the one that makes the record's own length is looked for.
    for asked in range(len(record), len(record) - 16, -1):
        out = encode_array(changed, payload, min_bytes=asked).tobytes()
        if len(out) == len(record):
            return out
    raise AssertionError(f"no pad makes the changed record {len(record)} bytes")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run the long soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long soak: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
