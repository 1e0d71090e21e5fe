"""peft adapters on one model object (tierkv/cache.py: ``_adapter_layers``, ``_adapter_state``):
switching them changes no weight, yet every layer's KV, so the fingerprint reads which adapters
apply at every open, and a cache's first forward refuses adapters switched since its open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_model, random_ids
from tierkv import TieredStore

NEW = 4


def lora(seed: int) -> LoraConfig:
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


@pytest.fixture
def two_adapters() -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(make_model("llama", seed=1), lora(1), adapter_name="one")
    model.add_adapter("two", lora(2))
    return model.eval()


@pytest.fixture
def store(tmp_path) -> Iterator[TieredStore]:
    with TieredStore(tmp_path / "kv", device="cpu", block_size=4) as opened:
        yield opened


IDS = random_ids(30, 2)


def generate(model: torch.nn.Module, ids: torch.Tensor, cache=None) -> torch.Tensor:
    kwargs = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    cache = store.open(model, ids)
    out = generate(model, ids, cache)
    assert torch.equal(out, generate(model, ids))  # as peft computes it with no cache
    cache.commit(out)
    return cache.restored_tokens, out


def test_each_adapter_restores_its_own_kv_only(two_adapters, store):
    model = two_adapters
    model.set_adapter("one")
    assert turn(store, model, IDS)[0] == 0
    model.set_adapter("two")
    assert turn(store, model, IDS)[0] == 0  # adapter one's blocks are not two's
    assert turn(store, model, IDS)[0] == IDS.shape[1] - 1
    with model.disable_adapter():
        assert turn(store, model, IDS)[0] == 0  # nor the base model's
    model.set_adapter("one")
    assert turn(store, model, IDS)[0] == IDS.shape[1] - 1  # one's own are still there
    for layer in model.base_model.model.model.layers:
        layer.self_attn.q_proj.set_scale("one", 2.0)  # another scale: other KV
    assert turn(store, model, IDS)[0] == 0


def test_adapters_switched_after_open_are_refused_at_the_first_forward(two_adapters, store):
    model = two_adapters
    model.set_adapter("one")
    turn(store, model, IDS)
    cache = store.open(model, IDS)
    assert cache.restored_tokens == IDS.shape[1] - 1
    model.set_adapter("two")
    with pytest.raises(ValueError, match="peft adapters changed since store.open"):
        generate(model, IDS, cache)
    model.set_adapter("one")  # back as it was opened: the same cache runs, and is exact
    assert torch.equal(generate(model, IDS, cache), generate(model, IDS))


def test_a_model_without_adapters_reads_no_adapter_state():
    from tierkv.cache import _static_cache, describe_model

    model = make_model("llama", seed=1)
    assert describe_model(model).adapters == b"" and _static_cache[model].adapters == ()


def test_adapters_picked_per_call_are_refused(two_adapters, store):
    model = two_adapters
    model.set_adapter("one")
    cache = store.open(model, IDS)
    with pytest.raises(ValueError, match="adapter_names= given to generate"):
        model.generate(IDS, past_key_values=cache, max_new_tokens=NEW, do_sample=False, adapter_names=["two"])


def test_adapters_switched_between_forwards_of_one_cache_keep_nothing(two_adapters, store):
    model = two_adapters
    model.set_adapter("one")
    cache = store.open(model, IDS)
    out = generate(model, IDS, cache)
    model.set_adapter("two")
    # Another generate on the same cache: its prefill of the new ids is checked.
    with pytest.raises(ValueError, match="peft adapters changed since store.open"):
        generate(model, torch.cat([out, random_ids(3, 7)], dim=1), cache)
    # A commit after the switch keeps nothing computed under either.
    with pytest.raises(ValueError, match="peft adapters changed since store.open"):
        cache.commit(out)
    model.set_adapter("one")
    assert store.open(model, out).restored_tokens == 0
