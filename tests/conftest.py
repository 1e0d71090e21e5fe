"""Shared fixtures: tiny random decoder-only models of several architectures, built offline."""

from __future__ import annotations

import warnings
from collections.abc import Callable

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
}
ARCHITECTURES = list(_SHAPES)


def make_model(model_type: str = "llama", seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type``, eval mode, float32, CPU."""
    fields = {"vocab_size": VOCAB, **_SHAPES[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **fields)
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


def damage_table(path: object, table: bytes) -> None:
    """Flip one bit in the B-tree of the LMDB sub-database ``table`` of a closed store: the key
    size of the first node of its leaf page (32 -> 34 for ``refs``). LMDB still walks the table;
    a write that deletes there fails, with ``MDB_BAD_TXN`` on the next call rather than an error
    of its own. The table must fit one leaf page (a small store's do)."""
    import struct

    import lmdb

    with lmdb.open(str(path), max_dbs=8, readonly=True, lock=False) as env:
        page_size = env.stat()["psize"]
        with env.begin() as txn:
            rows = [(bytes(k), len(v)) for k, v in txn.cursor(db=env.open_db(table, txn=txn, create=False))]
    data = bytearray(open(f"{path}/data.mdb", "rb").read())

    def first_node(page: int) -> int:
        return page * page_size + struct.unpack_from("<H", data, page * page_size + 16)[0]

    # The leaf page (P_LEAF) holding every key, whose first node (data size, flags, key size,
    # key) is the first row's: other tables (heads, atime) have the same keys as blocks.
    node = next(first_node(p) for p in range(2, len(data) // page_size)
                if struct.unpack_from("<H", data, p * page_size + 10)[0] == 0x02
                and all(data.find(k, p * page_size, (p + 1) * page_size) >= 0 for k, _ in rows)
                and struct.unpack_from("<I", data, first_node(p))[0] == rows[0][1]
                and data[first_node(p) + 8:first_node(p) + 8 + len(rows[0][0])] == rows[0][0])
    assert struct.unpack_from("<H", data, node + 6)[0] == len(rows[0][0])
    data[node + 6] ^= 0x02
    with open(f"{path}/data.mdb", "r+b") as f:
        f.write(bytes(data))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run the long soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long soak: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
