"""Sliding-window attention (Mistral's window, Gemma 2/3's and Cohere 2's local layers, GPT-OSS's,
Qwen2's upper layers; Llama 4's chunked attention, a window to transformers' caches): the layers of a ``TieredCache`` answer attention as transformers'
``DynamicSlidingWindowLayer`` does, whatever tier their prefix came from, while holding every
token for ``commit``. Exactness through every tier, a restart and every generation mode is in
test_exactness.py (``conftest.SLIDING`` is among its architectures)."""

from __future__ import annotations

import gc
import signal
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from conftest import SLIDING, VOCAB, kept_whole_and_next_turn_exact, make_model, random_ids
import tierkv.cache as cache_module
from tierkv import TieredStore

BLOCK = 8
BUDGETS = {
    "device": dict(device_budget="1GiB", host_budget="1GiB"),
    "host": dict(device_budget=0, host_budget="1GiB"),
    "disk": dict(device_budget=0, host_budget=0),
}


def _windows_of(model: torch.nn.Module) -> list[int]:
    return [layer.sliding_window for layer in DynamicCache(config=model.config).layers
            if isinstance(layer, DynamicSlidingWindowLayer)]


@pytest.mark.parametrize("arch", SLIDING)
def test_the_windows_change_these_models_outputs(tiny_model, arch: str) -> None:
    """Guard: at the tests' sizes the window changes what the model computes, so that exactness
    against plain generate shows the window kept, not merely a full attention that agrees."""
    model = tiny_model(arch)
    assert _windows_of(model) and set(_windows_of(model)) == {12}
    ids = random_ids(40, seed=5)
    text = model.config.get_text_config(decoder=True)
    field = "attention_chunk_size" if getattr(text, "attention_chunk_size", None) else "sliding_window"
    with torch.no_grad():
        windowed = model(ids, use_cache=False).logits
        setattr(text, field, 1000)
        try:
            unwindowed = model(ids, use_cache=False).logits
        finally:
            setattr(text, field, 12)
    assert torch.equal(windowed[:, :12], unwindowed[:, :12])  # within the window: the same attention
    assert (windowed[:, 20:] - unwindowed[:, 20:]).abs().max() > 1e-4


def _recording(cache: Any) -> list[list[tuple[int, ...]]]:
    """The shapes of the keys and values each layer's update hands attention, per call."""
    seen: list[list[tuple[int, ...]]] = [[] for _ in cache.layers]
    for i, layer in enumerate(cache.layers):
        update = layer.update

        def recorded(*args: Any, _update: Any = update, _i: int = i, **kwargs: Any) -> Any:
            keys, values = _update(*args, **kwargs)
            seen[_i].append((tuple(keys.shape), tuple(values.shape)))
            return keys, values

        layer.update = recorded
    return seen


@pytest.mark.parametrize("tier", list(BUDGETS))
@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_layers_answer_attention_as_transformers_own_do(tiny_model, tmp_path: Path, arch: str,
                                                                tier: str) -> None:
    model = tiny_model(arch)
    first = random_ids(29, seed=6)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS[tier]) as store:
        cache = store.open(model, first, session="s")
        out = model.generate(first, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
        ids = torch.cat([out, random_ids(6, seed=7)], dim=1)
        cache = store.open(model, ids, session="s")
        r = cache.restored_tokens
        assert r == out.shape[1] - 1 and cache.restored_from[tier] == r
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :r], past_key_values=plain)
        assert cache.is_sliding == plain.is_sliding and True in cache.is_sliding
        seen, seen_plain = _recording(cache), _recording(plain)
        # The turn's new tokens, decode steps past the window's edge, then a chunk longer than it.
        feeds = [ids[:, r:], *[random_ids(1, seed=20 + k) for k in range(3)], random_ids(15, seed=30)]
        for feed in feeds:
            q = feed.shape[1]
            assert cache.is_dummy == plain.is_dummy  # layers reading another's KV (KV sharing) alike
            kv = [i for i, dummy in enumerate(plain.is_dummy) if not dummy]
            sizes = [cache.get_mask_sizes(q, i) for i in kv]
            assert sizes == [plain.get_mask_sizes(q, i) for i in kv]
            with torch.no_grad():
                logits = model(feed, past_key_values=cache).logits
                expected = model(feed, past_key_values=plain).logits
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
            assert cache.get_seq_length() == plain.get_seq_length()
        assert seen == seen_plain  # the same keys and values, window for window
        # A full layer holds the whole conversation; a sliding one holds it from the first
        # restored block its window reached, the window its tail.
        held = cache.get_seq_length()
        cuts = []
        for layer, plain_layer in zip(cache.layers, plain.layers):
            if plain_layer.keys is None:
                assert layer.keys is None  # a layer reading another's KV holds none, as the DummyLayer it is
                continue
            cut = (r - plain_layer.sliding_window + 1) // BLOCK * BLOCK if plain_layer.is_sliding else 0
            cuts.append(cut)
            assert cut >= 0 and layer.keys.shape[-2] == held - cut
            n = plain_layer.keys.shape[-2]
            assert n == (min(held, plain_layer.sliding_window - 1) if plain_layer.is_sliding else held)
            torch.testing.assert_close(layer.keys[:, :, -n:], plain_layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(layer.values[:, :, -n:], plain_layer.values, rtol=0, atol=1e-5)
        assert max(cuts) > 0  # the restore reached past a window, so it was cut


def test_dynamic_cache_of_a_tiered_cache_keeps_the_windows(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("gemma3_text")
    ids = random_ids(30, seed=8)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget=0) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        cache.commit(out)
        nxt = torch.cat([out, random_ids(4, seed=9)], dim=1)
        cache = store.open(model, nxt, session="s")
        with torch.no_grad():
            model(nxt[:, cache.restored_tokens:-1], past_key_values=cache)
        copy = DynamicCache(cache)
        assert [type(layer) for layer in copy.layers] == [DynamicSlidingWindowLayer, type(copy.layers[1])]
        assert copy.layers[0].sliding_window == 12 and copy.layers[0].keys.shape[-2] == 11
        assert copy.get_seq_length() == cache.get_seq_length() == nxt.shape[1] - 1
        torch.testing.assert_close(copy.layers[0].keys, cache.layers[0].keys[:, :, -11:], rtol=0, atol=0)
        # Generation goes on from the copy exactly.
        got = model.generate(nxt, past_key_values=copy, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma3n_text"])
def test_dynamic_cache_of_a_tiered_cache_sharing_kv_keeps_the_layers_holding_none(tiny_model, tmp_path: Path,
                                                                                   arch: str) -> None:
    # Layers reading an earlier layer's KV (KV sharing) yield none, as a DynamicCache's own do: a
    # DynamicCache made of the cache with the model's config has its DummyLayers where they were.
    model = tiny_model(arch)
    ids = random_ids(30, seed=8)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget=0) as store:
        cache = store.open(model, ids, session="s")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False))
        nxt = torch.cat([ids, random_ids(4, seed=9)], dim=1)
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens > 12 and cache.is_dummy == [False, False, True, True]
        with torch.no_grad():
            model(nxt[:, cache.restored_tokens:-1], past_key_values=cache)
        assert [keys is None for keys, _, _ in cache] == cache.is_dummy
        copy = DynamicCache(cache, config=model.config)
        assert copy.is_dummy == cache.is_dummy and copy.get_seq_length() == nxt.shape[1] - 1
        got = model.generate(nxt, past_key_values=copy, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
        # KV fed for a layer that reads another's: refused, not taken into a block of no slot.
        with pytest.raises(ValueError, match=r"KV for layer 2, which its config says reads an earlier layer's"):
            cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 2)


@pytest.mark.parametrize("window", [2, 5, 8, 9, 64])
def test_windows_shorter_than_a_block_or_longer_than_the_conversation_are_exact(tmp_path: Path, window: int) -> None:
    model = make_model("mistral_window", sliding_window=window)
    ids = random_ids(21, seed=10)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        for turn in range(3):
            cache = store.open(model, ids, session="w")
            out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
            assert torch.equal(out, model.generate(ids, max_new_tokens=5, do_sample=False)), (window, turn)
            assert cache.restored_tokens == (0 if turn == 0 else ids.shape[1] - 5)
            cache.commit(out)
            ids = torch.cat([out, random_ids(4, seed=11 + turn)], dim=1)


def _llama4(chunk: int, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model("llama4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  intermediate_size_mlp=128, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, attention_chunk_size=chunk, num_local_experts=2,
                                  no_rope_layers=[1] * (layers - 1) + [0])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("tier", list(BUDGETS))
def test_chunked_attention_restored_at_every_offset_from_a_chunk_edge_is_exact(tmp_path: Path, tier: str) -> None:
    """Llama 4's chunked attention: to transformers' caches a window of the chunk's length (its
    mask alone restarts at each chunk). Restores ending a token before a chunk's edge, on it and
    after it, and a reply crossing the next edge, equal plain generate, token for token and in
    the first step's logits, from every tier, and the layer holds only the blocks its chunk reaches."""
    chunk = 12  # not a multiple of the block size: the chunks' edges fall inside blocks
    model = _llama4(chunk)
    assert [type(layer).__name__ for layer in DynamicCache(config=model.config).layers] == \
        ["DynamicSlidingWindowLayer", "DynamicLayer"]
    with TieredStore(tmp_path if tier == "disk" else None, device="cpu", block_size=BLOCK, **BUDGETS[tier]) as store:
        for length in (11, 12, 13, 23, 24, 25):
            ids = random_ids(length + 1, seed=length)
            cache = store.open(model, ids)
            cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
            cache = store.open(model, ids)
            assert cache.restored_tokens == length, length  # a partial block too
            out = model.generate(ids, past_key_values=cache, max_new_tokens=chunk + 4, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            plain = model.generate(ids, max_new_tokens=chunk + 4, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True)
            assert torch.equal(out.sequences, plain.sequences), length
            torch.testing.assert_close(out.scores[0], plain.scores[0], rtol=1e-5, atol=1e-5)
            # The chunked layer's restore: the blocks its last chunk - 1 tokens reach.
            assert cache.layers[0].held_from() == (cache.restored_tokens - chunk + 1) // BLOCK * BLOCK
            assert cache.layers[1].held_from() == 0
            assert cache.commit(out.sequences) == out.sequences.shape[1] - 1


@pytest.mark.parametrize("chunk, block", [(5, 8), (8, 8), (7, 3), (4, 16)])
def test_chunks_shorter_than_equal_to_or_across_blocks_are_exact_through_replies_past_several_edges(
        tmp_path: Path, chunk: int, block: int) -> None:
    """Chunks of other lengths than the block size (shorter, equal, not dividing it, a quarter of
    it): restores from disk ending a token before, on and after the first two chunk edges, a reply
    crossing three more edges (handed off the device on the way), its commit kept whole, and the
    next turn, with more new ids than a chunk, restoring it all, each equal to plain generate
    (checked, no fault found: h129)."""
    model = _llama4(chunk, layers=3)
    with TieredStore(tmp_path, device="cpu", block_size=block, **BUDGETS["disk"]) as store:
        for length in (chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, 2 * chunk + 1):
            ids = random_ids(length + 1, seed=length)
            session = f"s{length}"
            cache = store.open(model, ids, session=session)
            cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
            cache = store.open(model, ids, session=session)
            assert cache.restored_tokens == length
            new = 3 * chunk + 1
            out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            assert torch.equal(out, model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))
            assert cache.commit(out) == out.shape[1] - 1
            later = torch.cat([out, random_ids(chunk + 2, seed=99)], dim=1)
            cache = store.open(model, later, session=session)
            assert cache.restored_tokens == out.shape[1] - 1
            assert torch.equal(
                model.generate(later, past_key_values=cache, max_new_tokens=chunk + 2, do_sample=False),
                model.generate(later, max_new_tokens=chunk + 2, do_sample=False)), (length, chunk, block)


def test_a_model_naming_chunked_layers_its_masks_do_not_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a window its masks ignore (Moshi's): chunked layers whose modeling code builds no chunked
    mask are refused at open, naming the field to set."""
    monkeypatch.setitem(cache_module._MASK_MAKERS, "chunked_attention", ("no_such_mask_function", "chunked"))
    with TieredStore(None, device="cpu", block_size=BLOCK) as store:
        with pytest.raises(ValueError, match=r"Llama4ForCausalLM's config names chunked_attention layers "
                                             r"\(attention_chunk_size=8\), but its modeling code builds no chunked "
                                             r"mask for them \(transformers' no_such_mask_function;") as info:
            store.open(_llama4(8), random_ids(20))
        assert "Set attention_chunk_size=None" in str(info.value)
        assert store.stats()["misses"] == 0


def test_a_signal_handlers_exception_as_a_config_is_tried_with_no_window_is_raised() -> None:
    """The trial of a window of None (``_takes_none``, for the refusal's remedy) cut by a SIGALRM
    handler's timeout: raised, not taken for a config that refuses None (h129)."""
    import signal
    import sys

    from conftest import HandlerTimeout, _raise_handler_timeout

    class Config:
        sliding_window = 16

        def __setattr__(self, name: str, value: object) -> None:
            _raise_handler_timeout(signal.SIGALRM, sys._getframe())

    with pytest.raises(HandlerTimeout):
        cache_module._takes_none(Config(), "sliding_window")


@pytest.mark.parametrize("chunk", [0, 1])
def test_chunks_under_two_tokens_are_refused_naming_the_field(chunk: int) -> None:
    with TieredStore(None, device="cpu", block_size=BLOCK) as store:
        model = _llama4(8)
        model.config.attention_chunk_size = chunk
        with pytest.raises(ValueError, match=f"chunked_attention layers with attention_chunk_size={chunk}; tierkv "
                                             "needs a chunk of at least 2 tokens .an int.: give the chunk"):
            store.open(model, random_ids(20))


@pytest.mark.parametrize("family", ["t5", "mamba", "nemotron_h"])
def test_refusals_name_sliding_window_models_among_those_served(family: str) -> None:
    """A refused model's remedy named "a decoder-only full-attention model" alone (an encoder-decoder,
    a recurrent model, layers without attention): a Gemma 3 or Mistral user read that tierkv did not
    serve their sliding-window checkpoint, which it does. The refusal names both."""
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    config = {
        "t5": lambda: AutoConfig.for_model("t5", vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                           d_kv=16),
        "mamba": lambda: AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                              state_size=4),
        "nemotron_h": lambda: AutoConfig.for_model(
            "nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
            layer_types=["full_attention", "mlp"], **heads),
    }[family]()
    auto = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with TieredStore(None, device="cpu", block_size=BLOCK) as store:
        with pytest.raises(ValueError) as info:
            store.open(model, random_ids(20))
    message = str(info.value)
    assert "sliding-window" in message and "Generate with it without a TieredCache" in message, message
    assert message.endswith("or serve a decoder-only model of full-attention or sliding-window layers "
                            "(Llama, Mistral, Gemma 3...) through tierkv"), message


def _turn_two(model: torch.nn.Module, tmp_path: Path, store: TieredStore) -> tuple[Any, torch.Tensor]:
    """A second turn's cache (its prefix restored from the host tier) and its ids."""
    ids = random_ids(30, seed=12)
    cache = store.open(model, ids, session="r")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    cache.commit(out)
    nxt = torch.cat([out, random_ids(5, seed=13)], dim=1)
    return store.open(model, nxt, session="r"), nxt


def test_decode_steps_write_into_room_kept_ahead_not_a_copy_of_the_conversation(tiny_model, tmp_path: Path) -> None:
    """A sliding layer holds the whole conversation (for commit): concatenated at each step as a
    DynamicLayer does, a decode step copied all of it, where the window's own cache copies a
    window (decode 1.3-1.5x DynamicCache's at 2,048 tokens and a 256-token window)."""
    model = tiny_model("gemma3_text")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt = _turn_two(model, tmp_path, store)
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :cache.restored_tokens], past_key_values=plain)
            # Five steps: a sixth holds the window and two margins, and hands tokens off the device into
            # a room of its own (test_staged.py).
            feeds = [nxt[:, cache.restored_tokens:], *[random_ids(1, seed=40 + k) for k in range(5)]]
            places = []
            for feed in feeds:
                torch.testing.assert_close(model(feed, past_key_values=cache).logits,
                                           model(feed, past_key_values=plain).logits, rtol=0, atol=1e-5)
                places.append(cache.layers[0].keys.data_ptr())
        # The first step after the turn's forward makes the room; every later one writes into it.
        assert len(set(places[1:])) == 1 and cache.layers[0]._room is not None
        assert cache.layers[0].keys.data_ptr() == cache.layers[0]._room[0].data_ptr()
        assert cache.layers[1]._keys.data_ptr() != places[-1]  # the full-attention layer: DynamicLayer's own
        cache.reset()
        assert cache.layers[0]._room is None  # let go of with the KV


@pytest.mark.parametrize("modes", [("grad", "no_grad", "grad"), ("inference", "no_grad", "inference", "no_grad")])
def test_room_kept_ahead_under_autograd_and_inference_mode_as_dynamic_cache(tiny_model, tmp_path: Path,
                                                                             modes: tuple[str, ...]) -> None:
    """Autograd recording takes DynamicLayer's concatenation (an in-place write into a tensor its
    graph saved fails backward), and room made under inference_mode is made again outside it
    (torch refuses in-place writes into inference tensors there)."""
    model = tiny_model("mistral_window")
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt = _turn_two(model, tmp_path, store)
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :cache.restored_tokens], past_key_values=plain)
            model(nxt[:, cache.restored_tokens:], past_key_values=plain)
            model(nxt[:, cache.restored_tokens:], past_key_values=cache)
        for k, mode in enumerate([m for m in modes for _ in range(2)]):
            feed = random_ids(1 + k % 2, seed=50 + k)
            with contexts[mode]():
                logits = model(feed, past_key_values=cache).logits
                if mode == "grad":
                    logits.sum().backward(retain_graph=True)  # through the window's keys and values
            with torch.no_grad():
                expected = model(feed, past_key_values=plain).logits
            torch.testing.assert_close(logits.detach(), expected, rtol=0, atol=1e-5)
        assert cache.get_seq_length() == plain.get_seq_length()


def test_room_let_go_of_when_a_forward_concatenates(tiny_model, tmp_path: Path) -> None:
    """A forward under autograd recording concatenates as a DynamicLayer does: the room, no longer
    the keys' base, was held on (a quarter more than the conversation, per sliding layer) until a
    later forward without autograd replaced it."""
    model = tiny_model("mistral_window")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt = _turn_two(model, tmp_path, store)
        with torch.no_grad():
            model(nxt[:, cache.restored_tokens:], past_key_values=cache)
            model(random_ids(1, seed=70), past_key_values=cache)
        rooms = [weakref.ref(layer._room[0]) for layer in cache.layers]
        model(random_ids(1, seed=71), past_key_values=cache)
        gc.collect()
        assert [room() for room in rooms] == [None, None]
        with torch.no_grad():
            model(random_ids(1, seed=72), past_key_values=cache)
        assert cache.layers[0]._room is not None  # made again without autograd


def test_a_model_whose_masks_ignore_its_window_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Moshi's config names a window (every layer sliding for transformers' caches) while its
    forward builds a causal mask alone: its prefill attends past the window, its decode steps
    within it, so plain generate's own output depends on how a conversation is fed (the
    architecture sweep found tierkv's turn 1 differing from plain's). Refused at open, as is a
    model whose modeling source cannot be read to tell."""
    from benchmarks.arch_sweep import build

    moshi = build("moshi")
    with TieredStore(None, device="cpu", block_size=BLOCK) as store:
        with pytest.raises(ValueError, match="MoshiForCausalLM's config names sliding_attention layers "
                                             r"\(sliding_window=16\), but its modeling code builds no sliding-window "
                                             "mask") as info:
            store.open(moshi, random_ids(20))
        # Not told to set the window to None, which its config refuses (huggingface_hub's
        # validation: an int alone); told so instead (h129). A config that takes None is told to
        # (Llama 4's chunk: test_a_model_naming_chunked_layers_its_masks_do_not_chunk_is_refused).
        assert "Set sliding_window=None" not in str(info.value)
        assert "MoshiConfig takes no sliding_window=None, so no setting of it has tierkv serve this model" \
            in str(info.value)
        assert moshi.config.sliding_window == 16  # the trial left the live config alone
        monkeypatch.setattr("inspect.getsource", lambda _: (_ for _ in ()).throw(OSError("no source")))
        with pytest.raises(ValueError, match="or could not be read"):
            store.open(make_model("mistral_window", seed=3), random_ids(20))
        monkeypatch.undo()
        store.open(make_model("mistral_window", seed=3), random_ids(20))
        assert store.stats()["misses"] == 20


@pytest.mark.parametrize("window", [20, 6, None])
def test_a_window_edited_after_open_is_refused_at_the_forward(tmp_path: Path, window: int | None) -> None:
    """The masks read the live config's window, the cache's layers keep the one of open: a window
    widened between open and generate had attention given the old window's keys, its tokens
    differing from plain generate's (commit then refused them, too late). The edit between turns
    is served, the fingerprint covering the window."""
    model = make_model("mistral_window", seed=2)
    ids = random_ids(30, seed=14)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, host_budget="1GiB") as store:
        cache = store.open(model, ids, session="e")
        model.config.sliding_window = window
        with pytest.raises(ValueError, match=r"MistralForCausalLM's config changed since store.open \(a field its "
                                             "KV depends on, such as sliding_window"):
            model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache = store.open(model, ids, session="e")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
        assert cache.commit(out) == out.shape[1] - 1
        # A cache opened before the edit, still refused after another open took the new config in.
        stale = store.open(model, ids, session="e3")
        model.config.sliding_window = 12 if window != 12 else 20
        store.open(model, ids, session="e4")
        with pytest.raises(ValueError, match="config changed since store.open"):
            model.generate(ids, past_key_values=stale, max_new_tokens=4, do_sample=False)
        # Edited after the generate, before its commit: nothing kept, and the refusal names the config
        # (it named the weights, dtype or device alone).
        cache = store.open(model, ids, session="e2")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        model.config.sliding_window = 9
        with pytest.raises(ValueError, match=r"weights, config, dtype or device changed since store.open \(its "
                                             "config: a field its KV depends on, such as sliding_window"):
            cache.commit(out)


def test_keys_a_caller_kept_are_not_written_over_by_an_append_after_a_crop(tiny_model, tmp_path: Path) -> None:
    """A crop (assisted decoding's) leaves the layer's keys a view of its room's head: the next
    append wrote the new tokens over the cut ones in place, changing keys and values a caller
    had read before the crop, which a DynamicCache's concatenation leaves be. Room is made again
    after a crop (torch's count of a storage's users, which could tell whether anyone kept them, is
    private)."""
    model = tiny_model("mistral_window")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt = _turn_two(model, tmp_path, store)
        seq = nxt
        with torch.no_grad():
            model(nxt[:, cache.restored_tokens:], past_key_values=cache)
            for feed in (random_ids(3, seed=60), random_ids(1, seed=61)):
                model(feed, past_key_values=cache)
                seq = torch.cat([seq, feed], dim=1)
            room = cache.layers[0]._room[0].data_ptr()
            for crop_and_feed in range(2):
                kept = [(layer.keys, layer.keys.clone(), layer.values, layer.values.clone())
                        for layer in cache.layers] if crop_and_feed else []
                cache.crop(-2)
                feed = random_ids(3, seed=62 + crop_and_feed)
                seq = torch.cat([seq[:, :-2], feed], dim=1)
                torch.testing.assert_close(model(feed, past_key_values=cache).logits,
                                           model(seq, use_cache=False).logits[:, -3:], rtol=0, atol=1e-5)
                assert cache.layers[0]._room[0].data_ptr() != room
                room = cache.layers[0]._room[0].data_ptr()
            for keys, keys_then, values, values_then in kept:
                assert torch.equal(keys, keys_then) and torch.equal(values, values_then)


def _past_the_window(store: TieredStore, model: torch.nn.Module, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A second turn's cache, its restore (32 tokens, blocks of 8) reaching past the 12-token
    window, its ids, and the first turn's sequences."""
    ids = random_ids(29, seed=seed)
    cache = store.open(model, ids, session="s")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    cache.commit(out)
    nxt = torch.cat([out, random_ids(5, seed=seed + 1)], dim=1)
    return store.open(model, nxt, session="s"), nxt, out


@pytest.mark.parametrize("tier", list(BUDGETS))
def test_a_restore_past_the_window_holds_the_window_not_the_conversation(tiny_model, tmp_path: Path,
                                                                         tier: str) -> None:
    """A sliding layer held every restored token through the turn (a Gemma 3 there held about
    five times a DynamicCache's KV): it holds the restored blocks its window reaches, and the
    turn is exact, its commit and the next turn's restore too."""
    model = tiny_model("gemma3_text")
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS[tier]) as store:
        cache, nxt, _ = _past_the_window(store, model, seed=50)
        r = cache.restored_tokens
        assert r == 32
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=6, do_sample=False))
        held = got.shape[1] - 1
        # 32 restored, window 12: the blocks at 16 and 24 reach the window's 11 tokens.
        assert [layer.keys.shape[-2] for layer in cache.layers] == [held - 16, held]
        assert cache.held_from() == 16 and cache.get_seq_length() == held
        # Iterated (DynamicCache(cache) copies it), a cut layer is as long as the conversation, with
        # NaN where it holds nothing, not numbers that look like KV.
        keys, values, window = next(iter(cache))
        assert keys.shape[-2] == values.shape[-2] == held and int(window) == 12
        assert keys[:, :, :16].isnan().all() and not keys[:, :, 16:].isnan().any()
        copied = DynamicCache(cache)
        assert copied.get_seq_length() == held
        torch.testing.assert_close(copied.layers[0].keys, cache.layers[0].keys[:, :, -11:], rtol=0, atol=0)
        assert cache.commit(got) == held
        later = torch.cat([got, random_ids(3, seed=52)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == held
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))


# The sliding layer first, and last; Llama 4's chunked layer first, named as such in the refusal.
@pytest.mark.parametrize("arch", ["gemma3_text", "qwen2_window", "llama4_text"])
def test_a_crop_below_a_cut_window_is_refused_leaving_every_layer_as_it_was(tiny_model, tmp_path: Path,
                                                                          arch: str) -> None:
    model = tiny_model(arch)
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt, _ = _past_the_window(store, model, seed=53)
        assert cache.crop_floor() == 16 + 11  # still pending: the floor the cut will have
        layers = "chunked-attention" if arch == "llama4_text" else "sliding-window"
        with pytest.raises(ValueError, match=f"its {layers} layers hold the restored conversation .* below 27 tokens"):
            cache.crop(27 - 32 - 1)
        assert cache.get_seq_length() == 32 and cache.layers[0]._pending is not None
        with torch.no_grad():
            model(nxt[:, 32:], past_key_values=cache)
        with pytest.raises(ValueError, match="cache.reset"):
            cache.crop(26 - 38)
        assert [layer.get_seq_length() for layer in cache.layers] == [38, 38]
        assert [layer.keys.shape[-2] for layer in cache.layers] == [22 if s else 38 for s in cache.is_sliding]
        cache.crop(27 - 38)  # to the floor: the window is still held
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :27], past_key_values=plain)
            torch.testing.assert_close(model(nxt[:, 27:], past_key_values=cache).logits,
                                       model(nxt[:, 27:], past_key_values=plain).logits, rtol=0, atol=1e-5)
        cache.crop(-cache.get_seq_length())  # to nothing: as a fresh cache
        assert cache.get_seq_length() == 0 and cache.crop_floor() == 0
        torch.testing.assert_close(model(nxt, past_key_values=cache).logits, model(nxt).logits, rtol=0, atol=1e-5)


def test_a_restored_block_gone_before_commit_ends_the_chain_before_it(tiny_model, tmp_path: Path) -> None:
    """Evicted between the open and the commit (another session's turn in a server), a block
    before the cut sliding layers' KV can no longer be stored again from the cache: the commit
    keeps the blocks before it, and the next turn is exact."""
    model = tiny_model("gemma3_text")
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt, _ = _past_the_window(store, model, seed=55)
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.held_from() == 16
        with store._lock:
            store._drop(store._index.blocks[cache._restored_keys[1]])  # tokens 8-16
        assert cache.commit(got) == 8
        later = torch.cat([got, random_ids(3, seed=57)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 8
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("dropped", [0, 1])
def test_a_commit_before_any_forward_of_a_restore_missing_a_block_keeps_the_blocks_before_it(
        tiny_model, tmp_path: Path, dropped: int) -> None:
    """A commit of the ids a cache was opened with, before any forward (its layers still pending),
    whose restored block before the sliding layers' cut was evicted since the open: the cut was
    only known once the layers were assembled, so the commit took every token as held, and the
    block's KV was read at a negative index of the cut layer (block 1: none, and the stack of
    layers raised; block 0: another block's KV stored under its key, served to a later turn).
    The chain ends before the block, as after a forward, and a later turn sharing it is exact."""
    model = tiny_model("gemma3_text")
    ids = random_ids(33, seed=58)
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache = store.open(model, ids, session="s")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 32 and cache.layers[0]._pending is not None
        with store._lock:
            store._drop(store._index.blocks[cache._restored_keys[dropped]])
        assert cache.commit(ids) == dropped * BLOCK
        assert cache.held_from() == 16
        # A conversation sharing the first blocks only: its sliding layers read them.
        other = torch.cat([ids[:, :17], random_ids(6, seed=59)], dim=1)
        cache = store.open(model, other, session="t")
        assert cache.restored_tokens == dropped * BLOCK
        assert torch.equal(model.generate(other, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(other, max_new_tokens=4, do_sample=False))


# Counts a DynamicLayer's crop takes (its slicing indexes by them), each a kind of its own.
_COUNTS = {
    "numpy": np.int64,
    "tensor": torch.tensor,
    "numpy_0d": np.array,  # an array of no dimension, not a numpy scalar (h118)
    "tensor_1d": lambda n: torch.tensor([n]),  # one element (h118)
}


@pytest.mark.parametrize("count", list(_COUNTS))
def test_a_crop_below_a_cut_window_given_as_numpy_or_a_tensor_is_refused_before_any_layer_is_cut(
        tiny_model, tmp_path: Path, count: str) -> None:
    """The cache's check before any layer is cut took Python ints alone: a count of numpy's
    (arithmetic on a numpy array's length) or a 0-d integer tensor went on to the layers' own
    checks, and Qwen2's full lower layer was cut before its sliding upper layer refused (the
    layers then held 26 and 38 tokens). So too, after that fix, a 0-d numpy array and a
    one-element integer tensor (h118). Refused before any layer is cut; a crop to the floor
    given so is exact."""
    model = tiny_model("qwen2_window")
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt, _ = _past_the_window(store, model, seed=53)
        with torch.no_grad():
            model(nxt[:, 32:], past_key_values=cache)
        assert cache.crop_floor() == 27
        with pytest.raises(ValueError, match="to 26 tokens: .* below 27 tokens"):
            cache.crop(_COUNTS[count](26 - 38))
        assert [layer.get_seq_length() for layer in cache.layers] == [38, 38]
        cache.crop(_COUNTS[count](27 - 38))  # to the floor
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :27], past_key_values=plain)
            torch.testing.assert_close(model(nxt[:, 27:], past_key_values=cache).logits,
                                       model(nxt[:, 27:], past_key_values=plain).logits, rtol=0, atol=1e-5)


def test_a_restored_block_left_in_no_tier_before_the_cut_is_dropped_by_the_commit(tiny_model) -> None:
    """An index entry an exception left in no tier is dropped and stored again by a commit; one
    before a cut layer's window ended the chain and stayed: the commit counted it and the blocks
    after it (32 tokens kept, 0 restored by the next turn) and the entry was never let go."""
    model = tiny_model("gemma3_text")
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache, nxt, _ = _past_the_window(store, model, seed=55)
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        key = cache._restored_keys[0]  # tokens 0-8, before the sliding layer's 16
        with store._lock:
            meta = store._index.blocks[key]
            store._host.pop(key)
            store._index.set_resident(meta, None)
        assert cache.commit(got) == 0 and key not in store._index.blocks
        later = torch.cat([got, random_ids(3, seed=57)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 0
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("tier", list(BUDGETS))
def test_blocks_no_layers_window_reaches_are_neither_read_nor_copied(tiny_model, tmp_path: Path, tier: str) -> None:
    """A model whose every layer slides (Mistral's window) needs of a restore its last blocks
    alone: the store read from disk, or copied, every block of the conversation. The turn is
    exact, and its restored tokens count as hits of the tier they rest in."""
    model = tiny_model("mistral_window")
    ids = random_ids(29, seed=60)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS[tier]) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
        store.flush()
        nxt = torch.cat([out, random_ids(5, seed=61)], dim=1)
        if tier == "disk":
            store.close()
            store = TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS[tier])
        read = []
        read_into = store._disk.read_into if store._disk is not None else None
        if read_into is not None:
            def recording(key: bytes, *args: Any, **kwargs: Any) -> Any:
                read.append(key)
                return read_into(key, *args, **kwargs)

            store._disk.read_into = recording
        moved = dict(store.stats()["moved_bytes"])
        cache = store.open(model, nxt, session="s")
        # 32 restored, window 12: blocks 0 and 1 (tokens 0-16) are reached by no layer.
        assert cache.restored_tokens == 32 and cache.restored_from[tier] == 32
        assert cache.held_from() == 16
        kept = cache._restored_keys[2:]
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
        block_bytes = store._index.blocks[kept[0]].nbytes
        after = store.stats()["moved_bytes"]
        if tier == "disk":
            assert read == kept
            assert after["disk_to_host"] - moved["disk_to_host"] == 2 * block_bytes
        elif tier == "host":
            assert after["host_to_device"] - moved["host_to_device"] == 2 * block_bytes
        assert cache.commit(got) == got.shape[1] - 1
        later = torch.cat([got, random_ids(3, seed=62)], dim=1)
        cache = store.open(model, later, session="s")
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))
        store.close()


def _exact_and_kept_whole(store: TieredStore, model: Any, ids: torch.Tensor, cache: Any, seed: int) -> None:
    """The turn ``cache`` was opened for (``ids``) equals plain generate, its commit keeps all but
    the last token, and the next turn (3 ids more, from ``seed``) restores them all, exact."""
    got = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False))
    kept_whole_and_next_turn_exact(store, model, cache, got, seed, extra=3)


# An entry naming no tier with the disk holding the block is a block at rest on disk alone.
@pytest.mark.parametrize(("entry", "disk"), [("host", True), ("host", False), ("none", False)])
@pytest.mark.parametrize("lost", [0, 1])
def test_an_unread_block_no_longer_in_the_tier_its_entry_names_is_settled_before_it_is_counted(
        tiny_model, tmp_path: Path, disk: bool, lost: int, entry: str) -> None:
    """A block no window reaches (``UNREAD``) was credited to the tier its index entry named,
    unasked: an entry another signal's handler left naming the host tier after the block left it
    (``_promote`` took it out of the host tier before the index's update) counted its tokens as
    host hits where the disk held it, the index's host bytes apart from the tier's for good; with
    no disk tier, a block resting nowhere was counted as restored (an entry naming no tier: as
    the disk's, in a store without one) and kept by the commit in the chain, every later turn
    restoring it again. It is settled (``_settle``) as a block read is: counted as the disk's,
    or, gone, the restore ends before it, the window then reaching the blocks before it (read
    from the tier they rest in)."""
    from tierkv.store import Tier

    model = tiny_model("mistral_window")
    ids = random_ids(29, seed=81)
    with TieredStore(tmp_path / "kv" if disk else None, device="cpu", block_size=BLOCK,
                     **BUDGETS["host"]) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.commit(out) == 32
        store.flush()
        nxt = torch.cat([out, random_ids(5, seed=82)], dim=1)
        chain = store.open(model, nxt, session="s")._restored_keys
        key = chain[lost]  # blocks 0 and 1 (tokens 0-16) are reached by no window of a restore of 32
        with store._lock:
            meta = store._index.blocks[key]
            assert meta.resident is Tier.HOST
            store._host.pop(key)  # as a handler raising after _promote's pop left it
            if entry == "none":  # as one raising before _settle's removal of a block in no tier
                store._index.set_resident(meta, None)
        hits = dict(store.stats()["hits"])
        cache = store.open(model, nxt, session="s")
        if disk:
            assert cache.restored_tokens == 32
            assert cache.restored_from == {"device": 0, "host": 24, "disk": 8}
            assert meta.resident is None and store._index.blocks[key] is meta
            assert store._index.bytes[Tier.HOST] == store.stats()["host"]["bytes"]
        else:
            # Block 0 gone: nothing; block 1 gone: block 0, which the window of 8 tokens reaches.
            assert cache.restored_tokens == 8 * lost and cache.restored_from["host"] == 8 * lost
            assert key not in store._index.blocks
        after = store.stats()["hits"]
        assert {tier: after[tier] - hits[tier] for tier in hits} == cache.restored_from
        _exact_and_kept_whole(store, model, nxt, cache, seed=83)


def test_an_unread_block_whose_record_is_damaged_is_counted_once_a_window_reaches_it(
        tiny_model, tmp_path: Path) -> None:
    """A block no window reaches is never read (``UNREAD``), so damage to its record stays
    unseen: its tokens count as restored (their KV is needed by no layer, the turn exact) and
    the commit keeps the chain through it. A turn whose window reaches it (a shorter
    conversation of the same prefix) reads it: counted corrupt once, dropped, recomputed, and
    its commit stores the block again, so the longer conversation restores whole again. Checking
    every record at open would read the blocks the window spares."""
    from conftest import damage_in_place, flipped

    model = tiny_model("mistral_window")
    out, chain = _sixty_tokens_stored(model, tmp_path / "kv", 84, BUDGETS["disk"])
    nxt = torch.cat([out, random_ids(5, seed=85)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS["disk"]) as store:
        damage_in_place(store._disk.env, store._disk._blocks, chain[0], lambda record: flipped(record, -20))
        cache = store.open(model, nxt, session="s")
        assert cache.restored_from["disk"] == 60 and store.stats()["corrupt"] == 0
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
        assert cache.commit(got) == got.shape[1] - 1
        later = torch.cat([got, random_ids(3, seed=86)], dim=1)
        assert store.open(model, later, session="s").restored_tokens == got.shape[1] - 1
        short = out[:, :14]  # 13 restored: the window reaches block 0
        cache = store.open(model, short, session="t")
        assert cache.restored_tokens == 0 and store.stats()["corrupt"] == 1 and chain[0] not in store._index.blocks
        got_short = model.generate(short, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got_short, model.generate(short, max_new_tokens=4, do_sample=False))
        assert cache.commit(got_short) == got_short.shape[1] - 1
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == got.shape[1] - 1 and store.stats()["corrupt"] == 1
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("rest", ["disk", "host"])
@pytest.mark.parametrize("arch", ["mistral_window", "gemma3_text"])
def test_a_restore_cut_short_past_the_unread_blocks_reads_those_its_window_then_reaches(
        tiny_model, tmp_path: Path, rest: str, arch: str) -> None:
    """A model whose every layer slides leaves unread the blocks its window no longer reaches
    (``UNREAD``). A later block that fails its read (damage, a forget meanwhile) cuts the restore
    short, and the shorter restore's window reaches blocks left unread: the first forward waited
    for a block no one read and raised. They are read (or copied from the host tier they rest
    in) and the turn is exact, the damaged block counted and dropped. So too where a full layer
    reads every block: a restore read from disk in place lays each sliding layer's part of its
    buffer out from its window's cut, which the shorter restore's window reaches before."""
    from conftest import damage_in_place, flipped
    from tierkv.store import Tier

    model = tiny_model(arch)
    ids = random_ids(57, seed=63)
    budgets = BUDGETS[rest]
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets)
    cache = store.open(model, ids, session="s")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.commit(out) == 60  # 7 blocks of 8 and a tail of 4
    store.flush()
    if rest == "disk":  # a restart: every block is read from disk
        store.close()
        store = TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets)
    with store:
        nxt = torch.cat([out, random_ids(5, seed=64)], dim=1)
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens == 60
        chain = cache._restored_keys
        del cache
        if rest == "host":
            # Blocks 0-5 (those left unread) rest in the host tier, block 6 and the tail on disk alone.
            with store._lock:
                for key in chain[6:]:
                    store._evict(Tier.HOST, store._index.blocks[key])
            assert [store._index.blocks[k].resident is Tier.HOST for k in chain] == [True] * 6 + [False] * 2
        disk = store._disk
        damage_in_place(disk.env, disk._blocks, chain[6], lambda record: flipped(record, -20))
        cache = store.open(model, nxt, session="s")
        # 48 tokens: the window of 12 reaches blocks 4 and 5, unread by a restore of 60.
        assert cache.restored_tokens == 48 and cache.restored_from[rest] == 48
        assert store.stats()["corrupt"] == 1
        _exact_and_kept_whole(store, model, nxt, cache, seed=65)


def test_blocks_left_unread_by_both_passes_of_a_restore_planned_again_are_counted_where_they_rest(
        tiny_model, tmp_path: Path) -> None:
    """A restore planned again (``_plan_again``) takes anew only the blocks its shorter window
    now reaches; those no window reaches in either pass keep the tier the first plan settled
    (``_rests_as_named``) and credited. Nothing between the passes moves them: every planned
    block is pinned, so the promotions of the blocks the passes read (to a device tier full of
    blocks left unread) find no room there rather than evicting one. Each is counted as a hit
    of the tier it rests in before and after the open, the tiers in step with the index, and
    the turn and the next exact."""
    from conftest import damage_in_place, flipped
    from tierkv.store import Tier

    model = tiny_model("mistral_window")
    ids = random_ids(57, seed=92)
    with TieredStore(None, device="cpu", block_size=BLOCK) as sizing:
        cache = sizing.open(model, ids)
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
        block_bytes = max([meta.nbytes for meta in sizing._index.blocks.values()])
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, device_budget=3 * block_bytes,
                     host_budget="1GiB") as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.commit(out) == 60  # 7 blocks of 8 and a tail of 4
        store.flush()
        chain = store.open(model, out, session="s")._restored_keys
        nxt = torch.cat([out, random_ids(5, seed=93)], dim=1)
        with store._lock:
            # Blocks 0-2 on the device (full), 3-5 in the host tier, block 6 and the tail on disk alone.
            for key in chain:
                meta = store._index.blocks[key]
                if meta.resident is Tier.DEVICE:
                    store._evict(Tier.DEVICE, meta)
            for key in chain[:3]:
                job = store._host.get(key)
                store._promote(store._index.blocks[key], job, job)
            for key in chain[6:]:
                store._evict(Tier.HOST, store._index.blocks[key])
        where = [store._index.blocks[key].resident for key in chain]
        assert where == [Tier.DEVICE] * 3 + [Tier.HOST] * 3 + [None] * 2 and not store._device.fits(block_bytes)
        damage_in_place(store._disk.env, store._disk._blocks, chain[7], lambda record: flipped(record, -20))
        plan_again, passes = store._plan_again, []

        def counting(plan: Any, found: Any, got: Any, miss: int, *args: Any) -> Any:
            passes.append(miss)
            return plan_again(plan, found, got, miss, *args)

        store._plan_again = counting
        hits = dict(store.stats()["hits"])
        cache = store.open(model, nxt, session="s")
        # The tail fails its read after block 6 was read: 56 tokens, whose window reaches block 5,
        # left unread by a restore of 60 with blocks 0-4, which both passes leave unread.
        assert passes == [7] and store.stats()["corrupt"] == 1
        assert cache.restored_tokens == 56
        assert cache.restored_from == {"device": 24, "host": 24, "disk": 8}
        after = store.stats()["hits"]
        assert {tier: after[tier] - hits[tier] for tier in hits} == cache.restored_from
        # Blocks 5 and 6 promoted to the host tier (the device tier's blocks pinned): 0-4 as they were.
        assert [store._index.blocks[key].resident for key in chain[:7]] == [Tier.DEVICE] * 3 + [Tier.HOST] * 4
        for tier, space in ((Tier.DEVICE, store._device), (Tier.HOST, store._host)):
            assert space.used == store._index.bytes[tier] and set(space._blocks) == set(store._index.lru[tier])
        _exact_and_kept_whole(store, model, nxt, cache, seed=94)


def test_a_restore_read_from_disk_in_place_holds_no_tokens_before_a_sliding_layers_window(
        tiny_model, tmp_path: Path) -> None:
    """On CPU a restore read from disk lands in a buffer the layers' keys and values then are
    (``cache.RestoreBuffer``). It was one tensor of every layer's whole length, held whole until
    the first decode step: the sliding layers' tokens before their window were held for nothing
    (a Gemma-3-like model's KV 3.7 times a DynamicCache's once the first token was out). Each
    layer's part now starts at its window's cut: the storages hold what the layers hold."""
    model = tiny_model("gemma3_text")
    ids = random_ids(29, seed=66)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS["disk"]) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.commit(out)
    nxt = torch.cat([out, random_ids(5, seed=67)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS["disk"]) as store:
        cache = store.open(model, nxt, session="s")
        r = cache.restored_tokens
        assert r == 32 and cache.layers[0]._pending.buffer is not None
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(nxt[:, :r], past_key_values=plain)
            torch.testing.assert_close(model(nxt[:, r:], past_key_values=cache).logits,
                                       model(nxt[:, r:], past_key_values=plain).logits, rtol=0, atol=1e-5)
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        assert [layer.keys.shape[-2] for layer in cache.layers] == [nxt.shape[1] - 16, nxt.shape[1]]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        assert sum(storages.values()) == sum([t.numel() * t.element_size() for t in tensors])
        got = model.generate(nxt, past_key_values=store.open(model, nxt, session="s"), max_new_tokens=4,
                             do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))


def _sixty_tokens_stored(model: torch.nn.Module, path: Path, seed: int, budgets: dict[str, Any]
                         ) -> tuple[torch.Tensor, list[bytes]]:
    """An all-sliding model's turn committed at ``path`` as 60 tokens (7 blocks of 8 and a tail of
    4), and its blocks' keys in order."""
    ids = random_ids(57, seed=seed)
    with TieredStore(path, device="cpu", block_size=BLOCK, **budgets) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.commit(out) == 60
        chain = store.open(model, out, session="s")._restored_keys
    return out, chain


def _reading_into_a_pool(store: TieredStore) -> Any:
    """CUDA's semantics on CPU: disk reads into a poisoning pool's buffers, copied to the device by
    an engine that lands its copies when told (tests/test_pool_store.py's). Returns the engine."""
    from test_pool_store import CopyingEngine
    from tierkv.pool import HostPool

    store._host.pool = HostPool(1 << 20, pinned=False, poison=True, arena_bytes=1 << 20)
    engine = store._engine = CopyingEngine(store._host.alloc)
    return engine


def test_a_restore_cut_short_past_the_unread_blocks_lets_go_of_the_pool_buffers_it_reads_again(
        tiny_model, tmp_path: Path) -> None:
    """A restore cut short by a failed read past blocks no window reached is planned again
    (``_plan_again``): every pool buffer its passes took goes back to the pool, none held for
    good (the disk blocks before the miss were read again, each first read's buffer let go of
    there; they are kept now: test_a_restore_planned_again_reads_no_record_twice). CUDA's
    semantics on CPU, through a poisoning pool, as tests/test_pool_store.py's."""
    from conftest import damage_in_place, flipped

    model = tiny_model("mistral_window")
    budgets = BUDGETS["disk"]  # nothing rests in memory: every pool buffer is an open's alone
    out, chain = _sixty_tokens_stored(model, tmp_path / "kv", 68, budgets)
    nxt = torch.cat([out, random_ids(5, seed=69)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:
        engine = _reading_into_a_pool(store)
        # The tail fails its read after block 6 was read into a pool buffer: 56 tokens, whose
        # window reaches block 5, unread by a restore of 60, so block 5 is read on a second pass.
        damage_in_place(store._disk.env, store._disk._blocks, chain[7], lambda record: flipped(record, -20))
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens == 56 and cache.restored_from["disk"] == 56
        assert store.stats()["corrupt"] == 1
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
        engine.land()
        store._host.reclaim()
        pool = store.stats()["host_pool"]
        assert (pool["in_use"], pool["retiring"]) == (0, 0), pool


def test_a_restore_planned_again_tells_diverged_at_from_the_conversation_the_ids_follow(
        tiny_model, tmp_path: Path) -> None:
    """``diverged_at`` is where the ids differ from the session's latest conversation, None where
    the restore follows another stored one past there (an older branch the user went back to).
    A restore cut short by a failed read and planned again (``_plan_again``) told it from the
    shorter plan: a turn back on the older branch, whose block past the difference failed its
    read, was reported diverged (and counted) where the same store without the damage, or a
    model whose restore is not planned again, reports nothing."""
    from conftest import damage_in_place, flipped

    model = tiny_model("mistral_window")
    ids = random_ids(57, seed=73)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS["disk"]) as store:
        cache = store.open(model, ids, session="s")
        older = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.commit(older) == 60  # 7 blocks of 8 and a tail of 4
        # The user edits a message at token 52: the latest conversation differs from the older
        # one inside block 6.
        edit = torch.cat([older[:, :52], random_ids(9, seed=74)], dim=1)
        cache = store.open(model, edit, session="s")
        assert cache.diverged_at == 52
        cache.commit(model.generate(edit, past_key_values=cache, max_new_tokens=4, do_sample=False))
        store.flush()
        turns = store.stats()["diverged_turns"]
        back = torch.cat([older, random_ids(5, seed=75)], dim=1)  # and goes back to the older one
        cache = store.open(model, back, session="s")
        assert cache.restored_tokens == 60 and cache.diverged_at is None
        chain = cache._restored_keys
        del cache
        # Block 6 (tokens 48-55) fails its read: 48 tokens, whose window reaches blocks 4 and 5,
        # unread by a restore of 60.
        damage_in_place(store._disk.env, store._disk._blocks, chain[6], lambda record: flipped(record, -20))
        cache = store.open(model, back, session="s")
        assert cache.restored_tokens == 48 and store.stats()["corrupt"] == 1
        assert cache.diverged_at is None and store.stats()["diverged_turns"] == turns
        got = model.generate(back, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(back, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("damaged", [(7,), (5, 7)])
@pytest.mark.parametrize("into", ["pool", "host"])
def test_a_restore_planned_again_reads_no_record_twice(tiny_model, tmp_path: Path, into: str,
                                                       damaged: tuple[int, ...]) -> None:
    """A restore cut short by a failed read past blocks no window reached is planned again
    (``_plan_again``): the disk blocks its first pass read into tensors of their own (CUDA's pool
    buffers, through a poisoning pool and a copying engine as tests/test_pool_store.py's; a CPU
    store's host tensors, promoted to its host tier) were read again, a second read of each
    record (and a second pool buffer) for the same bytes. They are kept: each record is read
    once, every pool buffer goes back once, and the turn and the next are exact; so too where a
    block the second pass reads fails in turn, and the kept read past it is let go of."""
    from conftest import damage_in_place, flipped
    from tierkv.store import Tier

    model = tiny_model("mistral_window")
    budgets = BUDGETS["disk"] if into == "pool" else BUDGETS["host"]
    out, chain = _sixty_tokens_stored(model, tmp_path / "kv", 76, budgets)
    nxt = torch.cat([out, random_ids(5, seed=77)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:  # all on disk
        if into == "pool":
            engine = _reading_into_a_pool(store)
        # The tail fails its read after block 6 was read: 56 tokens, whose window reaches
        # block 5, unread by a restore of 60. Where block 5 fails too: 40 tokens, blocks 3 and 4.
        for block in damaged:
            damage_in_place(store._disk.env, store._disk._blocks, chain[block], lambda record: flipped(record, -20))
        read_into, reads, in_use = store._disk.read_into, [], []

        def recording(key: bytes, *args: Any, **kwargs: Any) -> Any:
            reads.append(chain.index(key))
            if store._host.pool is not None:
                in_use.append(store._host.pool.stats()["in_use"])
            return read_into(key, *args, **kwargs)

        store._disk.read_into = recording
        moved = store.stats()["moved_bytes"]["disk_to_host"]
        cache = store.open(model, nxt, session="s")
        restored, read = (56, [5, 6]) if damaged == (7,) else (40, [3, 4])
        assert cache.restored_tokens == restored and cache.restored_from["disk"] == restored
        assert sorted(reads) == sorted(read + list(damaged) + [6] * (damaged != (7,)))
        assert store.stats()["corrupt"] == len(damaged)
        block_bytes = store._index.blocks[chain[0]].nbytes
        assert store.stats()["moved_bytes"]["disk_to_host"] - moved == 2 * block_bytes
        got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
        if into == "pool":
            # The kept read of block 6 held as block 5's read starts, and let go of once that failed,
            # before the third pass's reads (side by side: either may start first).
            held_at = dict(zip(reads, in_use))
            assert held_at[5] > 0
            if damaged == (5, 7):
                assert min(held_at[3], held_at[4]) == 0, in_use
            engine.land()
            store._host.reclaim()
            pool = store.stats()["host_pool"]
            assert (pool["in_use"], pool["retiring"]) == (0, 0), pool
        else:
            assert [store._index.blocks[key].resident for key in chain[read[0]:read[1] + 1]] == [Tier.HOST] * 2
        assert cache.commit(got) == got.shape[1] - 1
        later = torch.cat([got, random_ids(3, seed=78)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == got.shape[1] - 1
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))


def _pool_let_go(store: TieredStore, engine: Any) -> None:
    """Once ``engine``'s copies land, no buffer of the store's host pool is in use or retiring."""
    engine.land()
    store._host.reclaim()
    pool = store.stats()["host_pool"]
    assert (pool["in_use"], pool["retiring"]) == (0, 0), pool


@pytest.mark.parametrize("host", ["room", "none"])
def test_a_promotion_an_exception_cuts_short_rests_a_block_read_from_disk_in_the_host_tier_only_within_its_budget(
        tiny_model, tmp_path: Path, host: str) -> None:
    """``_promote``'s cleanup puts a block in no tier in the host tier: for a block just read from
    disk, one that was never there. An exception as the device tier makes room for it (out of
    memory for a victim's host copy) rests it there only where the host tier's budget has room,
    as the promotion would have had the device no room (the put refuses past the budget), else
    on disk alone: the tiers in step with the index, no pin kept, each pool buffer held exactly
    by the host tier's blocks, no hit counted for the open that raised, and the next turn exact,
    the block then a host hit. CUDA's semantics on CPU, through a poisoning pool."""
    from tierkv.store import Tier

    model = tiny_model("mistral_window")
    out, chain = _sixty_tokens_stored(model, tmp_path / "kv", 89, BUDGETS["disk"])
    nxt = torch.cat([out, random_ids(5, seed=90)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **BUDGETS["disk"]) as store:
        block_bytes = store._index.blocks[chain[0]].nbytes
    budgets = dict(device_budget=block_bytes, host_budget=3 * block_bytes if host == "room" else block_bytes // 2)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:  # all on disk
        engine = _reading_into_a_pool(store)
        make_room = store._make_room

        def short_of_memory(tier: Any, nbytes: int) -> bool:
            if tier is Tier.DEVICE:
                raise MemoryError("a victim's host copy")
            return make_room(tier, nbytes)

        store._make_room = short_of_memory
        before = store.stats()
        with pytest.raises(MemoryError):
            store.open(model, nxt, session="s")  # reads block 6 and the tail: the first promotion raises
        store._make_room = make_room
        _counted_no_turn(before, store.stats())
        meta = store._index.blocks[chain[6]]
        assert meta.resident is (Tier.HOST if host == "room" else None)
        assert list(store._host._blocks) == ([chain[6]] if host == "room" else [])
        assert store._host.used <= store._host.budget and not store._pinned
        for tier, space in ((Tier.DEVICE, store._device), (Tier.HOST, store._host)):
            assert space.used == store._index.bytes[tier] and set(space._blocks) == set(store._index.lru[tier])
        engine.land()
        store._host.reclaim()
        from tierkv.pool import GRANULE

        pool, held = store.stats()["host_pool"], store._host._held
        assert set(held) == set(store._host._blocks) and [lease.holders for lease in held.values()] == [1] * len(held)
        assert (pool["in_use"], pool["retiring"]) == (sum([lease.granules for lease in held.values()]) * GRANULE, 0)
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens == 60
        assert cache.restored_from == {"device": 0, "host": 8 * (host == "room"), "disk": 60 - 8 * (host == "room")}
        _exact_and_kept_whole(store, model, nxt, cache, seed=91)


def _interrupting_reads(store: TieredStore, chain: list[bytes], at: int) -> tuple[list[int], list[int]]:
    """Make ``store``'s disk reads note each block's place in ``chain`` and raise SIGINT as the
    ``at``-th starts, and its re-plans note the block each missed: (reads, passes)."""
    read_into, reads = store._disk.read_into, []

    def interrupted(key: bytes, *args: Any, **kwargs: Any) -> Any:
        reads.append(chain.index(key))
        if len(reads) == at:
            signal.raise_signal(signal.SIGINT)
        return read_into(key, *args, **kwargs)

    plan_again, passes = store._plan_again, []

    def counting(plan: Any, found: Any, got: Any, miss: int, *args: Any) -> Any:
        passes.append(miss)
        return plan_again(plan, found, got, miss, *args)

    store._disk.read_into, store._plan_again = interrupted, counting
    return reads, passes


def _counted_no_turn(before: dict[str, Any], after: dict[str, Any]) -> None:
    """``stats()`` ``after`` an open that raised counts no hit and no miss more than ``before``:
    no cache came back, and a program that opens the turn again counts it then."""
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def _open_under_ctrl_c(store: TieredStore, model: Any, ids: torch.Tensor, handler: str) -> tuple[Any, list[int]]:
    """``store.open`` with a SIGINT handler that ``"raises"`` (Python's: the open raises
    KeyboardInterrupt, and no cache comes back) or ``"returns"``: (the cache or None, the signals
    the handler was called for)."""
    calls: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if handler == "returns":
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        if handler == "raises":
            with pytest.raises(KeyboardInterrupt):
                store.open(model, ids, session="s")
            return None, calls
        return store.open(model, ids, session="s"), calls
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("handler", ["raises", "returns"])
@pytest.mark.parametrize("into", ["buffer", "pool"])
def test_a_ctrl_c_during_a_restores_reads_that_must_be_planned_again_is_delivered_before_the_next_pass(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: str, handler: str) -> None:
    """A Ctrl-C during an open's disk reads stops them (``defer_interrupts``): the block after is a
    miss. Where the shorter restore's window reaches blocks left unread, the open planned again,
    and each later pass, reading nothing, planned again down to a restore of nothing before the
    ``KeyboardInterrupt`` came (a program whose SIGINT handler returns was handed that empty
    restore). The interrupt is delivered before the next pass: raised at once, every pin and pool
    buffer let go; or, where the program's handler returns, called once and the restore read on
    (of the blocks before the interrupted read). Either way the turns are exact. The reads are one
    thread's, so that the tail's starts after the Ctrl-C."""

    import tierkv.store

    monkeypatch.setattr(tierkv.store, "PARALLEL_READ_BYTES", 1 << 62)

    model = tiny_model("mistral_window")
    budgets = BUDGETS["disk"]
    out, chain = _sixty_tokens_stored(model, tmp_path / "kv", 79, budgets)
    nxt = torch.cat([out, random_ids(5, seed=80)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:  # all on disk
        if into == "pool":
            engine = _reading_into_a_pool(store)
        read_into = store._disk.read_into
        reads, passes = _interrupting_reads(store, chain, 1)
        before = store.stats()
        cache, calls = _open_under_ctrl_c(store, model, nxt, handler)
        # Blocks 0-5 left unread; block 6 read as the Ctrl-C came, the tail not: 56 tokens, whose
        # window reaches block 5.
        assert passes == [7]
        if handler == "raises":
            assert reads == [6]
            _counted_no_turn(before, store.stats())
        else:
            assert calls == [signal.SIGINT] and sorted(reads) == [5, 6] + [6] * (into == "buffer")
            assert cache.restored_tokens == 56 and cache.restored_from["disk"] == 56
            got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
            del cache
        assert not store._pinned and store.stats()["corrupt"] == 0
        if into == "pool":
            _pool_let_go(store, engine)
        store._disk.read_into = read_into
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens == 60
        assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(nxt, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("handler", ["raises", "returns"])
def test_a_ctrl_c_during_a_restores_reads_needing_no_new_plan_ends_the_restore_at_the_interrupted_read(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str) -> None:
    """A Ctrl-C during an all-sliding model's disk reads whose shorter restore's window reaches
    no block left unread (a tail of one token past it) is not planned again: the restore ends
    at the interrupted read, as a full-attention model's does. The interrupted block is a plain
    miss, kept (neither corrupt nor dropped), every pin and pool buffer let go of; where the
    program's handler returns, the figures are those of the shorter restore and the turn is
    exact. While it reads, the open cannot tell a program that wants out from one whose handler
    returns, and it stops at once for the first (the second computes the rest again)."""

    import tierkv.store

    monkeypatch.setattr(tierkv.store, "PARALLEL_READ_BYTES", 1 << 62)  # the tail's read starts after the Ctrl-C
    model = tiny_model("mistral_window")
    budgets = BUDGETS["disk"]
    ids = random_ids(54, seed=87)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.commit(out) == 57  # 7 blocks of 8 and a tail of 1
        chain = store.open(model, out, session="s")._restored_keys
    nxt = torch.cat([out, random_ids(5, seed=88)], dim=1)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK, **budgets) as store:
        engine = _reading_into_a_pool(store)
        read_into = store._disk.read_into
        reads, passes = _interrupting_reads(store, chain, 2)
        before = store.stats()
        cache, calls = _open_under_ctrl_c(store, model, nxt, handler)
        # A restore of 57 reads blocks 5 and 6 and the tail (its window from token 45); block 6
        # was read as the Ctrl-C came, the tail not: 56 tokens, whose window from 44 reaches
        # block 5 alone.
        assert reads == [5, 6] and passes == []
        after = store.stats()
        if handler == "raises":
            _counted_no_turn(before, after)
        else:
            assert calls == [signal.SIGINT]
            assert cache.restored_tokens == 56 and cache.restored_from["disk"] == 56
            assert {tier: after["hits"][tier] - before["hits"][tier] for tier in before["hits"]} == \
                cache.restored_from
            assert after["misses"] - before["misses"] == nxt.shape[1] - 56
            got = model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, model.generate(nxt, max_new_tokens=4, do_sample=False))
            del cache
        assert after["corrupt"] == 0 and [key in store._index.blocks for key in chain] == [True] * 8
        assert not store._pinned
        _pool_let_go(store, engine)
        store._disk.read_into = read_into
        cache = store.open(model, nxt, session="s")
        assert cache.restored_tokens == 57
        assert torch.equal(model.generate(nxt, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(nxt, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("dropped", [2, 3])
def test_a_commit_before_any_forward_stores_again_a_block_past_the_cut_of_layers_of_other_kv_shapes(
        tiny_model, tmp_path: Path, dropped: int) -> None:
    """A commit before any forward, whose restored block past the sliding layers' cut was evicted
    since the open, stores that block again from the cache's KV. Where the layers hold KV of other
    shapes (Gemma 4: ``layout.py``), ``block_tensor`` read a layer's offset before the layer's
    keys, whose first read assembles the pending restore and sets that offset: a sliding layer
    other than the first was sliced at offset 0, its 12 tokens held from token 16 read at 16 to
    24, none, and the commit raised a shape error (h121)."""
    model = tiny_model("gemma4_text", num_kv_shared_layers=0)  # sliding layers 0 and 2, both holding KV
    ids = random_ids(33, seed=58)
    with TieredStore(None, device="cpu", block_size=BLOCK, device_budget=0, host_budget="1GiB") as store:
        cache = store.open(model, ids, session="s")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False))
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 32 and cache.layers[2]._pending is not None
        with store._lock:
            store._drop(store._index.blocks[cache._restored_keys[dropped]])
        assert cache.commit(ids) == 32
        assert cache.held_from() == 16
        later = torch.cat([ids, random_ids(5, seed=59)], dim=1)
        cache = store.open(model, later, session="t")
        assert cache.restored_tokens == 33  # the first turn's, its last block stored again by the commit
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))
