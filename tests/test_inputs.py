"""What a turn's KV is keyed on, and the inputs that would make it wrong: weights that differ
where the sample does not look, forwards fed other ids, embeddings or a mask, models whose KV
is not a function of their ids, and RoPE recomputed from the sequence length. Each case once
gave output that differed from plain transformers without an error."""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from collections.abc import Iterator

import pytest
import torch
from conftest import VOCAB, make_model, random_ids
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from tierkv import TieredStore
from tierkv.cache import TieredCache, TieredLayer
from tierkv.weights import sample_index

NEW = 5


def greedy(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def one_turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, session: str = "s",
             **kwargs: object) -> torch.Tensor:
    cache = store.open(model, ids, session=session)
    out = greedy(model, ids, past_key_values=cache, **kwargs)
    cache.commit(out)
    return out


def assert_next_turn_exact(store: TieredStore, model: torch.nn.Module, out: torch.Tensor, restored: int) -> None:
    """The conversation's next turn restores ``restored`` tokens and equals plain generate."""
    later = torch.cat([out, random_ids(3, 2)], dim=1)
    cache = store.open(model, later, session="s")
    assert cache.restored_tokens == restored
    assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


def assert_as_plain(got: object, plain: object) -> None:
    """Two generate() outputs (return_dict_in_generate, output_logits): the same tokens, and
    logits to float rounding."""
    assert torch.equal(got.sequences, plain.sequences)  # type: ignore[attr-defined]
    for a, b in zip(got.logits, plain.logits):  # type: ignore[attr-defined]
        torch.testing.assert_close(a, b)


def unsampled_row(weight: torch.Tensor) -> int:
    """A row of ``weight`` that holds none of the fingerprint's sample points."""
    sampled = {int(i) // weight.shape[1] for i in sample_index(weight.numel())}
    return next(r for r in range(3, weight.shape[0]) if r not in sampled)


# -- weights ------------------------------------------------------------------------------------
def test_models_whose_weights_differ_only_off_the_sample_never_share_kv() -> None:
    a = make_model("llama")
    b = copy.deepcopy(a)
    row = unsampled_row(b.model.embed_tokens.weight)
    with torch.no_grad():
        b.model.embed_tokens.weight[row] += 1.0  # a fine-tune of one new token's embedding
    ids = torch.cat([random_ids(20, 1), torch.full((1, 4), row)], dim=1)
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, a, ids)
        assert_next_turn_exact(store, b, out, restored=0)


def test_an_in_place_write_off_the_sample_changes_the_fingerprint() -> None:
    model = make_model("llama")
    weight = model.model.embed_tokens.weight
    row = unsampled_row(weight)
    ids = torch.cat([random_ids(20, 1), torch.full((1, 4), row)], dim=1)
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, model, ids)
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        assert store.open(model, later, session="s").restored_tokens == out.shape[1] - 1
        with torch.no_grad():
            weight[row] += 1.0  # in place, under no_grad: the version counter moves, the sample does not
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 0
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


def test_rope_scaled_on_a_loaded_model_restores_nothing_computed_before() -> None:
    # The rotary module has no parameter and its inv_freq is not saved by state_dict: swapping it
    # (or editing inv_freq) left the fingerprint as it was, and the old KV was restored.
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        rotary = model.model.rotary_emb
        config = copy.deepcopy(model.config)
        config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
        model.model.rotary_emb = type(rotary)(config)
        assert_next_turn_exact(store, model, out, restored=0)
        model.model.rotary_emb = rotary
        assert_next_turn_exact(store, model, out, restored=out.shape[1] - 1)


_ROTARY_TABLES = {
    # A sin/cos table (GPT-J's and CodeGen's embed_positions), and RoPE's frequencies under a layer
    # type's prefix (full_attention_inv_freq): non-persistent buffers, like inv_freq.
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256),
    "mellum": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16),
}


@pytest.mark.parametrize("arch", sorted(_ROTARY_TABLES))
def test_a_model_loaded_in_bf16_and_one_cast_to_it_never_share_blocks(arch: str) -> None:
    # from_pretrained(dtype=torch.bfloat16) keeps the rotary table in float32; the same weights
    # loaded in float32 and cast with .to(torch.bfloat16) cast it too, and compute other keys. Their
    # fingerprints were equal (the table is a non-persistent buffer not named inv_freq): a restart
    # served one's KV to the other, and CodeGen and Mellum generated other tokens than plain.
    config = AutoConfig.for_model(arch, vocab_size=VOCAB, **_ROTARY_TABLES[arch])
    torch.manual_seed(0)
    cast = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval().to(torch.bfloat16)
    loaded = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16).eval()
    loaded.load_state_dict(cast.state_dict())
    ids = random_ids(40, 1)
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, loaded, ids)
        assert_next_turn_exact(store, cast, out, restored=0)
        assert_next_turn_exact(store, loaded, out, restored=out.shape[1] - 1)
        # The table edited in place (a rotary module rescaled by hand) restores nothing either.
        rotary = next(m for m in loaded.modules() if "Rotary" in type(m).__name__)
        table = next(b for n, b in rotary.named_buffers(recurse=False) if not n.endswith("original_inv_freq"))
        with torch.no_grad():
            table.mul_(0.5)
        assert_next_turn_exact(store, loaded, out, restored=0)


@pytest.mark.parametrize("arch", ["ctrl-bf16", "xglm"])
def test_forwards_that_rewrite_their_position_tables_restore_the_next_turn(arch: str) -> None:
    # CTRL built in bf16 casts its float32 sinusoid table in its first forward; XGLM grows its own
    # past the sequence length. Both are non-persistent buffers: digested into the fingerprint,
    # they made commit refuse an ordinary turn, and the next open restore nothing.
    torch.manual_seed(0)
    if arch == "ctrl-bf16":
        config = AutoConfig.for_model("ctrl", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, dff=128,
                                      n_positions=256)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    else:
        config = AutoConfig.for_model("xglm", vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4,
                                      ffn_dim=128, max_position_embeddings=32)
        model = AutoModelForCausalLM.from_config(config).eval()
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, ids)  # commit raised here
        for turn in range(2):
            later = torch.cat([out, random_ids(3, 5 + turn)], dim=1)
            cache = store.open(model, later, session="s")
            assert cache.restored_tokens == out.shape[1] - 1
            out = greedy(model, later, past_key_values=cache)
            assert torch.equal(out, greedy(model, later))
            assert cache.commit(out) == out.shape[1] - 1


def test_a_cache_run_on_another_model_of_the_same_shapes_is_refused() -> None:
    a, b = make_model("llama", seed=0), make_model("llama", seed=1)  # same shapes, other weights
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        store.open(b, ids, session="other")  # b is known to tierkv (its forwards are checked)
        cache = store.open(a, ids, session="s")
        with pytest.raises(ValueError, match="opened with another LlamaForCausalLM"):
            greedy(b, ids, past_key_values=cache)
        out = one_turn(store, a, ids)
        assert_next_turn_exact(store, a, out, restored=out.shape[1] - 1)


def test_a_forward_on_a_model_tierkv_never_saw_is_refused() -> None:
    """A model never passed to store.open has no hook: its forward would meet blocks another
    model computed (and generate output that silently differs), so the cache refuses it."""
    a, b = make_model("llama", seed=0), make_model("llama", seed=2)  # b has no tierkv hook
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        for restored in (0, 19):
            cache = store.open(a, ids, session="s")
            assert cache.restored_tokens == restored
            with pytest.raises(ValueError, match="fed by a model tierkv never checked .* store.open\\(that_model"):
                greedy(b, ids, past_key_values=cache)
            # Nothing was fed: the same cache still runs on its own model, exactly.
            out = greedy(a, ids, past_key_values=cache)
            assert torch.equal(out, greedy(a, ids))
            assert cache.commit(out) == out.shape[1] - 1


def test_a_cache_cannot_be_copied_or_pickled_and_says_what_to_do_instead() -> None:
    import pickle

    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, random_ids(20, 1), session="s")
        for copier in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled.*store.open a new cache for each turn"):
                copier(cache)
        out = greedy(model, random_ids(20, 1), past_key_values=cache)  # the cache itself is untouched
        assert cache.commit(out) == out.shape[1] - 1


@pytest.mark.parametrize("how", ["crop", "reset"])
def test_a_check_lets_one_forward_through_whatever_its_length(how: str) -> None:
    """After a crop or a reset the cache is back at a length a checked forward started from: an
    unchecked forward there is refused all the same, and commit keeps what was checked."""
    a, b = make_model("llama", seed=0), make_model("llama", seed=2)  # b has no tierkv hook
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(a, ids, session="s")
        with torch.no_grad():
            a(input_ids=ids, past_key_values=cache)  # checked: all 20
            if how == "crop":
                cache.crop(-16)  # back to 4 tokens
            else:
                cache.reset()
            with pytest.raises(ValueError, match="never checked"):
                b(input_ids=ids[:, cache.get_seq_length():], past_key_values=cache)
            a(input_ids=ids[:, cache.get_seq_length():], past_key_values=cache)
        assert cache.get_seq_length() == 20
        assert cache.commit(ids) == 20
        assert_next_turn_exact(store, a, ids, restored=20)


class _Wrapper(torch.nn.Module):
    """A wrapper as peft builds one: generate() hands off to the inner model's, and forward calls
    the inner forward directly, so the wrapper's own hooks never run."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.inner.forward(*args, **kwargs)

    def generate(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.inner.generate(*args, **kwargs)


def test_an_inner_models_hook_does_not_check_its_wrappers_forward_again(monkeypatch) -> None:
    model = make_model("llama")  # LlamaForCausalLM's forward runs LlamaModel's: both are hooked
    checks = []
    monkeypatch.setattr(TieredCache, "_check_inputs",
                        lambda self, *args, _real=TieredCache._check_inputs: checks.append(1) or _real(self, *args))
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, random_ids(20, 1), session="s")
        greedy(model, random_ids(20, 1), past_key_values=cache)
    # One per forward (NEW of them): the inner model's hook, given the inputs its wrapper's hook has
    # just checked, checks only that it computes the opened model's KV.
    assert len(checks) == NEW


def test_a_copy_a_wrapper_and_the_parts_of_the_model_may_run_its_cache() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    expected = greedy(model, ids)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        twin = copy.deepcopy(model)  # the same weights, so the same KV; and tierkv's hook, copied
        out = greedy(twin, ids, past_key_values=cache)
        assert torch.equal(out, expected)
        assert cache.commit(out) == out.shape[1] - 1
        # Opened with its inner model, run by the whole: the inner hook checks its forwards.
        cache = store.open(model.model, ids, session="inner")
        out = greedy(model, ids, past_key_values=cache)
        assert torch.equal(out, expected)
        assert cache.commit(out) == out.shape[1] - 1
        # Opened with the whole, the inner model called directly.
        other = random_ids(20, 7)
        cache = store.open(model, other, session="direct")
        with torch.no_grad():
            model.model(input_ids=other, past_key_values=cache)
        assert cache.commit(other) == 20
    with TieredStore(None, block_size=8) as store:
        wrapper = _Wrapper(make_model("llama"))  # never opened before: only the wrapper is
        cache = store.open(wrapper, ids, session="s")
        out = greedy(wrapper, ids, past_key_values=cache)
        assert torch.equal(out, expected)
        assert cache.commit(out) == out.shape[1] - 1
        assert_next_turn_exact(store, wrapper, out, restored=out.shape[1] - 1)


# -- what a forward is fed ----------------------------------------------------------------------
def restored_cache(store: TieredStore, model: torch.nn.Module, extra: int = 3) -> tuple[object, torch.Tensor]:
    out = one_turn(store, model, random_ids(20, 1))
    later = torch.cat([out, random_ids(extra, 2)], dim=1)
    cache = store.open(model, later, session="s")
    assert cache.restored_tokens > 0
    return cache, later


def test_a_batch_of_other_conversations_is_refused() -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model)
        other = random_ids(later.shape[1], 7)
        with pytest.raises(ValueError, match="holds one conversation, but generate.. got a batch of 2 rows"):
            greedy(model, torch.cat([later, other]), past_key_values=cache)
        with pytest.raises(ValueError, match="batch of 2 different rows"):  # model() is fed the new ids only
            model(torch.cat([later, other])[:, cache.get_seq_length():], past_key_values=cache)


def test_generate_given_only_the_new_message_is_refused() -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model, extra=30)
        with pytest.raises(ValueError, match="not only the new message"):
            greedy(model, later[:, -30:], past_key_values=cache)


def test_beams_of_the_same_conversation_pass_the_check() -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model)
        got = model.generate(later, past_key_values=cache, max_new_tokens=NEW, num_beams=3, do_sample=False)
        assert torch.equal(got, model.generate(later, max_new_tokens=NEW, num_beams=3, do_sample=False))


def test_inputs_embeds_are_refused() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    embeds = model.get_input_embeddings()(ids).detach()
    embeds[:, :4] += 0.5  # a soft prompt: KV that the ids alone do not give
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="tuned")
        with pytest.raises(ValueError, match="inputs_embeds"):
            model.generate(input_ids=ids, inputs_embeds=embeds, past_key_values=cache, max_new_tokens=NEW,
                           do_sample=False)
        assert store.stats()["device"]["blocks"] == 0


def test_generate_given_inputs_embeds_alone_is_refused_as_embeddings_or_runs_past_the_conversation() -> None:
    # generate(inputs_embeds=...) hands over no ids: on a restored cache it was refused as "0 ids
    # with an attention_mask over N tokens" (only the new ids), naming neither the embeddings nor
    # what to do, and past the conversation, where embeddings are run and kept nothing of, too.
    model = make_model("llama")
    embed = model.get_input_embeddings()
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        one_turn(store, model, ids, session="a")
        cache = store.open(model, ids, session="a")
        assert cache.restored_tokens > 0
        with pytest.raises(ValueError, match="given inputs_embeds.*Pass input_ids"):
            model.generate(inputs_embeds=embed(ids).detach(), past_key_values=cache, max_new_tokens=NEW,
                           do_sample=False)
        cache = store.open(model, ids, session="b")
        out = greedy(model, ids, past_key_values=cache)
        later = torch.cat([out, random_ids(4, 2)], dim=1)
        with torch.no_grad():
            got = model.generate(inputs_embeds=embed(later), past_key_values=cache, max_new_tokens=NEW,
                                 do_sample=False)
            plain = DynamicCache()
            greedy(model, ids, past_key_values=plain)
            want = model.generate(inputs_embeds=embed(later), past_key_values=plain, max_new_tokens=NEW,
                                  do_sample=False)
        assert torch.equal(got, want)
        assert cache.commit(out) == out.shape[1] - 1


def test_a_padded_turn_is_exact_and_its_masked_kv_is_not_kept() -> None:
    model = make_model("llama")
    pad = 0
    ids = torch.cat([torch.full((1, 4), pad), random_ids(18, 1)], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 18, dtype=torch.long)], dim=1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="a")
        out = greedy(model, ids, attention_mask=mask, past_key_values=cache, pad_token_id=pad)
        assert torch.equal(out, greedy(model, ids, attention_mask=mask, pad_token_id=pad))
        assert cache.commit(out) == 0  # every token's KV depended on the hidden pads
        later = torch.cat([ids, random_ids(3, 9)], dim=1)
        cache = store.open(model, later, session="b")
        assert cache.restored_tokens == 0
        ones = torch.ones_like(later)
        assert torch.equal(greedy(model, later, attention_mask=ones, past_key_values=cache, pad_token_id=pad),
                           greedy(model, later, attention_mask=ones, pad_token_id=pad))


def with_pad_at_10(pad: int) -> torch.Tensor:
    """23 ids with ``pad`` at index 10."""
    return torch.cat([random_ids(10, 1), torch.full((1, 1), pad), random_ids(12, 2)], dim=1)


def test_a_mask_hiding_restored_tokens_is_refused() -> None:
    model, pad = make_model("llama"), 5
    ids = with_pad_at_10(pad)
    with TieredStore(None, block_size=8) as store:
        # Stored unmasked (generate masks no pad it was not told of), then asked with the pad masked.
        out = one_turn(store, model, ids)
        later = torch.cat([out, random_ids(3, 3)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens > 10
        with pytest.raises(ValueError, match="hides token 10"):
            greedy(model, later, past_key_values=cache, pad_token_id=pad)
        # A conversation that ends before the pad still restores all but its last token.
        cache = store.open(model, later[:, :10], session="other")
        assert cache.restored_tokens == 9


# -- models whose KV is not a function of their ids ---------------------------------------------
def test_a_vision_language_model_is_refused() -> None:
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_index=500,
                                  image_seq_length=4, vision_feature_layer=-1)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config).eval()
    with TieredStore(None, block_size=8) as store, pytest.raises(ValueError, match="embeds images"):
        store.open(model, random_ids(12, 1))
    # No vision config, but its forward takes image patches.
    from transformers import FuyuConfig, FuyuForCausalLM

    fuyu = FuyuForCausalLM(FuyuConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, patch_size=4, num_channels=3,
                                      text_config=dict(model_type="persimmon", vocab_size=VOCAB, hidden_size=64,
                                                       intermediate_size=128, num_hidden_layers=2,
                                                       num_attention_heads=4))).eval()
    with TieredStore(None, block_size=8) as store, pytest.raises(ValueError, match="image_patches"):
        store.open(fuyu, random_ids(12, 1))


def _latent_model(model_type: str, **widths: int) -> torch.nn.Module:
    """A tiny MoE model with multi-head latent attention of the given widths."""
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=None, **widths)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type, widths", [
    # Latent of 16 as keys, rotary keys of 8 as values (layout.py lays them apart in a block).
    ("deepseek_v3", dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8)),
    # Heads whose keys and values have one head_dim still cache the latent (24) and the rotary keys (8).
    ("glm4_moe_lite", dict(kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # Latent and rotary keys of one width: a slot a layer, as any model of one KV shape.
    ("deepseek_v2", dict(kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
])
def test_multi_head_latent_attention_is_served(tmp_path, model_type: str, widths: dict[str, int]) -> None:
    """Refused at open before (its cache holds keys and values of other widths)."""
    model = _latent_model(model_type, head_dim=widths["qk_rope_head_dim"], **widths)
    ids = random_ids(19, 1)
    with TieredStore(tmp_path / "kv", block_size=8, device_budget=0, host_budget=0) as store:
        out = one_turn(store, model, ids)
    with TieredStore(tmp_path / "kv", block_size=8) as store:
        ids = torch.cat([out, random_ids(5, 2)], dim=1)
        cache = store.open(model, ids)
        assert cache.restored_from["disk"] == out.shape[1] - 1
        got = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False))
        layer = cache.layers[1]
        assert (layer.keys.shape[-1], layer.values.shape[-1]) == (widths["kv_lora_rank"], widths["qk_rope_head_dim"])


def test_latent_attention_of_widths_the_config_does_not_say_is_refused() -> None:
    model = _latent_model("deepseek_v3", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                          head_dim=8)
    model.config.qk_rope_head_dim = 0  # a strict config takes no None
    with TieredStore(None, block_size=8) as store, pytest.raises(
            ValueError, match=r"latent attention, whose cache holds a compressed latent of width kv_lora_rank \(16\) "
                              r"as its keys and rotary keys of width qk_rope_head_dim \(0\).*positive integers"):
        store.open(model, random_ids(12, 1))


def test_latent_attention_computing_other_widths_than_its_config_sets_is_refused_naming_them() -> None:
    """A latent-attention model whose config says other widths than its modules compute (edited
    after it was built) is refused at the forward naming the fields that set its layout: the
    message named "per_layer_config, kv_lora_rank..." whatever the model."""
    model = _latent_model("deepseek_v3", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                          head_dim=8)
    model.config.kv_lora_rank = 24
    ids = random_ids(12, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids)
        with pytest.raises(ValueError) as caught:
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    message = str(caught.value)
    assert "keys of 1 KV heads x head_dim 16 and values of 1 x 8 in layer 0, where its config sets keys of 1 x 24 " \
           "and values of 1 x 8 (kv_lora_rank=24, qk_rope_head_dim=8)" in message, message
    assert "per_layer_config" not in message and "plain DynamicCache" in message


def test_the_fields_named_for_a_layers_kv_shape_are_those_that_set_it() -> None:
    """``_kv_shape_fields``: a Gemma 4's sliding layer by its global fields, its full-attention
    layer's head_dim by ``per_layer_config``; a config without head_dim by hidden_size over the
    attention heads."""
    from types import SimpleNamespace

    from tierkv.cache import _kv_shape_fields

    config = AutoConfig.for_model("gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  layer_types=["sliding_attention", "full_attention"], global_head_dim=32)
    assert _kv_shape_fields(config, 0) == "num_key_value_heads=2, head_dim=16"
    assert _kv_shape_fields(config, 1) == "num_key_value_heads=2, per_layer_config[1].head_dim=32"
    plain = SimpleNamespace(num_attention_heads=4, hidden_size=64)
    assert _kv_shape_fields(plain, 0) == "num_attention_heads=4, hidden_size=64 / num_attention_heads=4"

    class Ambiguous(SimpleNamespace):  # no record of each layer's own: a field told from the global one
        @property
        def head_dim(self) -> int:
            raise RuntimeError("'head_dim' is a per-layer attribute")

    layers = [SimpleNamespace(num_key_value_heads=2, head_dim=16), SimpleNamespace(num_key_value_heads=1, head_dim=32)]
    for config in (SimpleNamespace(is_heterogeneous=True, num_key_value_heads=2, head_dim=16, per_layer_config=layers),
                   Ambiguous(is_heterogeneous=True, num_key_value_heads=2, per_layer_config=layers)):
        assert _kv_shape_fields(config, 1) == "per_layer_config[1].num_key_value_heads=1, per_layer_config[1].head_dim=32"
    assert _kv_shape_fields(config, 0) == "num_key_value_heads=2, per_layer_config[0].head_dim=16"


def test_deepseek_sparse_attention_is_refused_naming_its_indexer() -> None:
    config = AutoConfig.for_model("deepseek_v32", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=8, head_dim=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with TieredStore(None, block_size=8) as store, pytest.raises(
            ValueError, match=r"\['indexed_attention'\] layers.*indexer's keys in the cache"):
        store.open(model, random_ids(12, 1))


# -- RoPE recomputed from the sequence length ---------------------------------------------------
def longrope_model() -> torch.nn.Module:
    return make_model("phi3", initializer_range=0.2, max_position_embeddings=64, original_max_position_embeddings=24,
                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                           long_factor=[4.0] * 8, original_max_position_embeddings=24))


def test_longrope_restores_within_its_original_length_only() -> None:
    model = longrope_model()
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, model, random_ids(14, 1))  # 19 ids: within the 24 of short factors
        within = torch.cat([out, random_ids(4, 2)], dim=1)
        cache = store.open(model, within, session="s")
        assert cache.restored_tokens == out.shape[1] - 1
        assert torch.equal(greedy(model, within, past_key_values=cache), greedy(model, within))
        past = torch.cat([out, random_ids(20, 3)], dim=1)  # 39 ids: its prefill uses the long factors
        cache = store.open(model, past, session="s")
        assert cache.restored_tokens == 0
        with torch.no_grad():
            restored = model(past, past_key_values=cache).logits[0, -1]
            assert torch.equal(restored, model(past).logits[0, -1])
        # A turn past the limit keeps nothing: its KV was computed with the long factors.
        assert cache.commit(past) == 0


def test_dynamic_ntk_keeps_kv_below_its_limit_only() -> None:
    model = make_model("llama", max_position_embeddings=24,
                       rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0))
    with TieredStore(None, block_size=8) as store:
        ids = random_ids(16, 1)
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        # 27 ids: the forwards up to position 22 ran below max_position_embeddings, unscaled.
        assert cache.commit(out) == 23
        later = torch.cat([out[:, :20], random_ids(2, 2)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 20
        assert torch.equal(greedy(model, later, past_key_values=cache)[:, :23],
                           greedy(model, later)[:, :23])


def test_a_generated_pad_token_ends_what_commit_keeps() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    plain = greedy(model, ids)
    pad = int(plain[0, 22])  # a token this model generates: a real pad id can be one too
    assert pad not in ids[0].tolist()
    model.generation_config.pad_token_id = pad
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = greedy(model, ids, past_key_values=cache)
        assert torch.equal(out, plain)
        # generate() masks the pad in the next turn's ids, but it was computed unmasked here.
        assert cache.commit(out) == 22
        assert_next_turn_exact(store, model, out, restored=22)


def test_open_restores_nothing_from_a_pad_the_model_masks_on() -> None:
    # KV stored before generation_config.pad_token_id was set (or by a worker with another config)
    # holds the pad computed unmasked: restored, the prefill under generate's mask was refused.
    model, pad = make_model("llama"), 5
    ids = with_pad_at_10(pad)
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, ids)
        model.generation_config.pad_token_id = pad
        try:
            later = torch.cat([out, random_ids(3, 3)], dim=1)
            cache = store.open(model, later, session="s")
            assert cache.restored_tokens == 10  # the tokens before the pad
            got = greedy(model, later, past_key_values=cache)
            assert torch.equal(got, greedy(model, later))
            assert cache.commit(got) == 10
            # Ids 256, 256 hold the int64 bytes of 1 one byte off their start: not a pad 1.
            model.generation_config.pad_token_id = 1
            shifted = torch.cat([random_ids(6, 4), torch.full((1, 2), 256), random_ids(9, 5)], dim=1)
            shifted[shifted == 1] = 2
            one_turn(store, model, shifted, session="t")
            assert store.open(model, shifted, session="t").restored_tokens == shifted.shape[1] - 1
        finally:
            model.generation_config.pad_token_id = None


@pytest.mark.parametrize("chunk", [None, 4])
def test_ids_edited_in_place_after_open_are_refused_at_commit(chunk: int | None) -> None:
    # The cache kept a view of the caller's int64 tensor: the edit reached its copy of the ids too,
    # and commit stored KV computed from the old ids under the edited ones. A chunked prefill
    # (helper-23) fed only the chunks past the cache, and the edit went unchecked: wrong output.
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens > 3
        later[0, 3] = (later[0, 3] + 1) % VOCAB
        assert int(cache.input_ids[3]) != int(later[0, 3])
        # generate() feeds the model only the ids past the cache: its whole ids are checked first.
        with pytest.raises(ValueError, match="differ from those store.open got at token 3"):
            greedy(model, later, past_key_values=cache, prefill_chunk_size=chunk)
        # model() is given only those: commit compares the rest.
        with torch.no_grad():
            model(later[:, cache.get_seq_length():], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="do not start with the conversation"):
            cache.commit(later)
        assert store.open(model, torch.cat([later, random_ids(2, 3)], dim=1), session="s").restored_tokens == 3


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_batch_whose_rows_differ_inside_the_restored_prefix_is_refused(chunk: int | None) -> None:
    # generate() feeds only the ids past the cache, and the restored batch-1 prefix went to every
    # row: a row of another conversation with the same last ids got this one's KV, silently.
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, model, random_ids(32, 1), session="a")
        other = out.clone()
        other[0, :30] = random_ids(30, 2)[0]
        cache = store.open(model, out, session="a")
        assert cache.restored_tokens > 30
        with pytest.raises(ValueError, match="batch of 2 rows that differ within"):
            greedy(model, torch.cat([out, other]), past_key_values=cache, prefill_chunk_size=chunk)
        # Rows that generate() itself made from one (beams, several samples) are the conversation.
        cache = store.open(model, out, session="a")
        beams = model.generate(out, past_key_values=cache, max_new_tokens=4, num_beams=3, do_sample=False)
        assert torch.equal(beams, model.generate(out, max_new_tokens=4, num_beams=3, do_sample=False))
        cache = store.open(model, out, session="a")
        same = torch.cat([out, out])  # a batch of the same conversation twice
        assert torch.equal(greedy(model, same, past_key_values=cache), greedy(model, same))


@pytest.mark.parametrize("chunk", [4, 16])
def test_a_chunked_prefill_and_only_the_new_ids_with_a_whole_mask_pass_the_prefix_check(chunk: int) -> None:
    # Each chunk reaches prepare_inputs_for_generation alone, after the restored tokens: a chunk
    # as long as the prefix was taken for the whole conversation and refused.
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(11, 1))
        later = torch.cat([out, random_ids(20, 2)], dim=1)
        cache = store.open(model, later, session="s")
        restored = cache.restored_tokens
        assert restored == 15
        got = greedy(model, later, past_key_values=cache, prefill_chunk_size=chunk)
        assert torch.equal(got, greedy(model, later))
        cache = store.open(model, later, session="s")
        new = later[:, restored:]
        got = greedy(model, new, past_key_values=cache, attention_mask=torch.ones_like(later))
        assert torch.equal(got[:, -NEW:], greedy(model, later)[:, -NEW:])


def test_the_check_on_generates_ids_lets_its_model_go() -> None:
    import gc
    import weakref

    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        one_turn(store, model, random_ids(20, 1))
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None  # freed with its last reference, not at the next collection
    finally:
        gc.enable()


def test_the_check_on_generates_ids_goes_with_the_model_when_copied_or_pickled() -> None:
    import inspect
    import pickle

    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        assert "prepare_inputs_for_generation" not in vars(model)  # on its class: nothing per model object
        plain = type(model).prepare_inputs_for_generation.__get__(model)
        assert inspect.signature(model.prepare_inputs_for_generation) == inspect.signature(plain)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert "prepare_inputs_for_generation" not in vars(twin)
            edited = out.clone()
            edited[0, 2] = (edited[0, 2] + 1) % VOCAB
            cache = store.open(twin, out, session="s")
            with pytest.raises(ValueError, match="at token 2"):
                greedy(twin, edited, past_key_values=cache)
            cache = store.open(twin, out, session="s")
            assert torch.equal(greedy(twin, out, past_key_values=cache), greedy(model, out))


@pytest.mark.parametrize("change", ["load_state_dict", "cast", "replaced"])
def test_a_model_changed_during_a_turn_keeps_nothing_at_commit(change: str) -> None:
    # A weight sync between open and commit: the KV was computed by weights the opened
    # fingerprint does not describe, and would be restored to the old model later.
    model, other = make_model("llama", 0), make_model("llama", 1)
    original = copy.deepcopy(model.state_dict())
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=4) as store:
        cache = store.open(model, ids, session="s")
        if change == "load_state_dict":
            model.load_state_dict(other.state_dict())
        elif change == "cast":
            model.to(torch.float64)
        else:
            model.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())
        got = greedy(model, ids, past_key_values=cache)
        with pytest.raises(ValueError, match="changed since store.open"):
            cache.commit(got)
        model.to(torch.float32)
        model.load_state_dict(original, assign=change == "replaced")
        later = torch.cat([got, random_ids(3, 2)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 0
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


@pytest.mark.parametrize("same", [False, True])
def test_weights_loaded_between_open_and_generate_are_refused_where_the_cache_holds_kv(same: bool) -> None:
    # A weight sync in another thread between store.open and generate(): the restored KV of the
    # old weights was given to the new ones, and only commit refused, after a wrong reply.
    model, other = make_model("llama", 0), make_model("llama", 1)
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model)
        weights = model.state_dict() if same else other.state_dict()
        thread = threading.Thread(target=model.load_state_dict, args=({k: v.clone() for k, v in weights.items()},))
        thread.start()
        thread.join()
        if same:  # the counters moved, the weights did not: the turn goes on, exact
            assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))
        else:
            with pytest.raises(ValueError, match="weights changed since store.open"):
                greedy(model, later, past_key_values=cache)


def test_forwards_with_token_types_positions_or_custom_masks_are_refused() -> None:
    model = make_model("llama")
    ids = random_ids(20, 4)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match="position_ids"):
            model(ids, past_key_values=cache, position_ids=torch.arange(20)[None] + 7)
        with pytest.raises(ValueError, match="position_ids"):  # RoPE takes fractions: not truncated
            model(ids, past_key_values=cache, position_ids=torch.arange(20)[None] + 0.5)
        with pytest.raises(ValueError, match="2-D attention_mask.*pass a 2-D mask .* or use a plain DynamicCache"):
            model(ids, past_key_values=cache, attention_mask=torch.ones(1, 1, 20, 20))
        with pytest.raises(ValueError, match="as a positional argument, where tierkv cannot check"):
            model(ids, None, None, cache)
        model(ids, past_key_values=cache, position_ids=torch.arange(20)[None])  # its own positions pass
        assert cache.get_seq_length() == 20
        gpt2 = make_model("gpt2")
        cache = store.open(gpt2, ids, session="g")
        with pytest.raises(ValueError, match="token_type_ids"):
            gpt2(ids, past_key_values=cache, token_type_ids=torch.full_like(ids, 3))


def _bert_like(model_type: str, **extra: object) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, is_decoder=True, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("case", ["cross-attention", "shape and pronunciation ids", "task types", "head mask"])
def test_inputs_besides_the_ids_that_change_their_kv_are_refused(case: str) -> None:
    """Blocks are keyed on the ids alone: KV computed with an encoder's output (a decoder's
    cross-attention), per-token inputs other than the ids, or a head mask would be restored
    for the same ids without them. Found restored silently by helper-9's hunt."""
    ids = random_ids(20, 1)
    if case == "cross-attention":
        model = make_model("gpt2", add_cross_attention=True)
        extra = {"encoder_hidden_states": torch.randn(1, 5, model.config.n_embd)}
    elif case == "shape and pronunciation ids":
        model = _bert_like("roc_bert", shape_vocab_size=50, pronunciation_vocab_size=50)
        extra = {"input_shape_ids": torch.full_like(ids, 7), "input_pronunciation_ids": torch.full_like(ids, 9)}
    elif case == "task types":
        model = _bert_like("ernie", use_task_id=True, task_type_vocab_size=3)
        extra = {"task_type_ids": torch.full_like(ids, 2)}
    else:
        model = make_model("gpt2")
        extra = {"head_mask": torch.ones(model.config.n_layer, model.config.n_head)}
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match=f"given {next(iter(extra))}, which change the KV of the ids"):
            model(ids, past_key_values=cache, **extra)
        model(ids, past_key_values=cache)  # the ids alone: their KV is what the blocks are keyed on
        assert cache.commit(ids) == 20


def test_a_model_that_counts_positions_from_its_pad_id_is_given_them_as_generate_gives_them() -> None:
    """RoBERTa's family counts a forward's positions from pad_token_id + 1 when given none, and
    generate() passes them from 0: a turn by model() then one by generate() met at two sets of
    positions and generated other tokens (found by helper-9). Without position_ids it is refused."""
    model = _bert_like("roberta")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match="counts positions from its pad id .* pass position_ids="):
            model(ids, past_key_values=cache)
        model(ids, past_key_values=cache, position_ids=torch.arange(20)[None])
        assert cache.commit(ids) == 20
        later = torch.cat([ids, random_ids(5, 2)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == 20
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


def test_commit_refuses_an_edited_reply_and_keeps_no_kv_fed_as_embeddings() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = greedy(model, ids, past_key_values=cache)
        edited = out.clone()
        edited[0, -2] = (edited[0, -2] + 1) % VOCAB  # same length, one generated id changed
        # Also what a streamer's text tokenized again gives; the remedy says to keep generate()'s return.
        with pytest.raises(ValueError, match="differ from the ones the model generated.*keep what it returns"):
            cache.commit(edited)
        assert cache.commit(out) == out.shape[1] - 1
        cache = store.open(model, ids, session="e")
        with torch.no_grad():
            model(ids[:, cache.get_seq_length():], past_key_values=cache)
            nxt = torch.tensor([[7, 8]])
            model(inputs_embeds=model.get_input_embeddings()(nxt), past_key_values=cache)
        assert cache.commit(torch.cat([ids, nxt, nxt[:, :1]], dim=1)) == ids.shape[1]


def test_longrope_generation_past_its_original_length_commits_within_it() -> None:
    model = longrope_model()
    ids = random_ids(14, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        # Phi-3's generate() drops the cache once the ids pass 24 and goes on without it.
        out = model.generate(ids, past_key_values=cache, max_new_tokens=15, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=15, do_sample=False))
        assert cache.commit(out) == 24


# -- a forward that raised part-way ---------------------------------------------------------------
@contextlib.contextmanager
def out_of_memory_at(modules: list[torch.nn.Module], call: int) -> Iterator[None]:
    """The ``call``-th forward of any of ``modules`` (counted from now) raises out of memory."""
    calls = [0]

    def hook(module: torch.nn.Module, args: object, kwargs: object) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_a_prefill_that_failed_part_way_is_refused_and_commit_keeps_what_every_layer_holds() -> None:
    model = make_model("llama", num_hidden_layers=3)
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model, extra=6)
        restored = cache.restored_tokens
        with out_of_memory_at(list(model.model.layers), 2), pytest.raises(torch.OutOfMemoryError):
            greedy(model, later, past_key_values=cache)  # layer 0 took the new ids, layers 1-2 did not
        with pytest.raises(ValueError, match="stopped after 1 of its 3 layers"):
            greedy(model, later, past_key_values=cache)
        assert cache.commit(later) == restored
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == restored
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


@pytest.mark.parametrize("stopped", ["prefill", "reset"])
def test_a_cache_left_apart_is_started_over_by_reset_as_the_refusal_says(stopped: str) -> None:
    """The refusal after a forward (or a ``reset``) that stopped part-way offers ``reset()`` too:
    a reset stopped after its first layer is called again, as its caller would. After it the
    cache computes the conversation again, exact, and commits it."""
    model = make_model("llama", num_hidden_layers=3)
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model, extra=6)
        if stopped == "prefill":
            with out_of_memory_at(list(model.model.layers), 2), pytest.raises(torch.OutOfMemoryError):
                greedy(model, later, past_key_values=cache)
        else:
            second = type(cache.layers[1])
            original = second.reset

            def stop(layer: object) -> None:
                if layer is cache.layers[1]:
                    raise KeyboardInterrupt
                original(layer)

            with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
                patch.setattr(second, "reset", stop)
                cache.reset()
        with pytest.raises(ValueError, match=r"did not finish.*call cache\.reset\(\) to empty this one"):
            greedy(model, later, past_key_values=cache)
        cache.reset()
        out = greedy(model, later, past_key_values=cache)
        assert torch.equal(out, greedy(model, later))
        assert cache.restored_tokens == 0 and cache.commit(out) == out.shape[1] - 1
        assert_next_turn_exact(store, model, out, restored=out.shape[1] - 1)


def test_a_decode_step_that_failed_keeps_the_tokens_every_layer_holds() -> None:
    model = make_model("llama", num_hidden_layers=3)
    ids = random_ids(20, 1)
    plain = greedy(model, ids)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        # Three layer calls per forward: the prefill, two decode steps, then layer 1 of the third,
        # which was fed token 22. Layer 0 holds 23 tokens, layers 1-2 hold 22.
        with out_of_memory_at(list(model.model.layers), 3 + 2 * 3 + 2), pytest.raises(torch.OutOfMemoryError):
            greedy(model, ids, past_key_values=cache)
        # One more token fed: layers 1-2 would miss position 22's KV, with no error (it did).
        with pytest.raises(ValueError, match="last forward did not finish"):
            model(plain[:, 23:24], past_key_values=cache)
        shown = plain[:, :23]  # what a streamer showed: the three tokens generated
        assert cache.commit(shown) == 22
        assert_next_turn_exact(store, model, shown, restored=22)


def test_a_generate_that_raised_after_dropping_unverified_kv_commits_the_ids_the_caller_has() -> None:
    """A second generate() on a cache whose rows diverged (beams) drops the KV past the
    conversation first (``_drop_unverified``); one that raises after that (out of memory in its
    first layer; a handler's timeout, in the drop's crop too) leaves the caller the ids the first
    returned. Their commit kept the conversation before the second generate() began; after it,
    it was refused: "the cache holds KV for 28 tokens, fewer than the 32 ... run generate()"
    (helper-90, cutting a second generate at each of tierkv's points). It keeps what it held."""
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model)
        first = greedy(model, later, past_key_values=cache, num_beams=2)
        with out_of_memory_at(list(model.model.layers), 1), pytest.raises(torch.OutOfMemoryError):
            greedy(model, torch.cat([first, random_ids(1, 3)], dim=1), past_key_values=cache)
        assert cache.get_seq_length() == later.shape[1]  # the beams' KV dropped
        with pytest.raises(ValueError, match="run generate"):  # ids past what it held: still refused
            cache.commit(torch.cat([first, random_ids(2, 3)], dim=1))
        assert cache.commit(first) == later.shape[1]
        assert_next_turn_exact(store, model, first, restored=later.shape[1])


@pytest.mark.parametrize("stop", ["criterion", "streamer"])
def test_a_generate_stopped_between_steps_commits_up_to_the_ids_the_caller_has(stop: str, caplog) -> None:
    """An exception between two forwards (a stopping criterion or a streamer that raises, Ctrl-C)
    ends generate() with nothing returned, the cache holding the prompt and the tokens generated
    so far. commit() of the prompt was refused ("pass the full sequences"), and the turn's new
    KV was lost: it keeps the KV up to the ids given now, checked against the ids fed."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Abort(StoppingCriteria, BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.shown: list[int] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 4:  # the prompt, then two tokens shown
                raise RuntimeError("the client went away")
            if self.calls > 1:
                self.shown += value.reshape(-1).tolist()

        def end(self) -> None:
            pass

    model = make_model("llama")
    ids = random_ids(22, 4)
    plain = greedy(model, ids)
    with TieredStore(None, block_size=4) as store:
        one_turn(store, model, ids[:, :13])
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 13
        abort = Abort()
        kw: dict = (dict(stopping_criteria=StoppingCriteriaList([abort])) if stop == "criterion"
                    else dict(streamer=abort))
        with pytest.raises(KeyboardInterrupt if stop == "criterion" else RuntimeError):
            greedy(model, ids, past_key_values=cache, **kw)
        assert cache.get_seq_length() == 24  # the prompt and two tokens fed
        with pytest.raises(ValueError, match="after a generate.. that raised, commit the cache with the ids you have"):
            greedy(model, ids, past_key_values=cache)
        edited = torch.cat([ids, (plain[:, 22:23] + 1) % VOCAB], 1)
        with pytest.raises(ValueError, match="differ from the ones the model generated"):
            cache.commit(edited)
        # The prompt; or the prompt and the first of the two tokens the streamer showed (the
        # second one's put raised before the client got it).
        assert len(abort.shown) == (0 if stop == "criterion" else 2)
        shown = torch.cat([ids, torch.tensor([abort.shown[:1]], dtype=ids.dtype)], 1)
        assert shown.shape[1] == (22 if stop == "criterion" else 23)
        assert torch.equal(shown, plain[:, :shown.shape[1]])
        with caplog.at_level("INFO", logger="tierkv"):
            assert cache.commit(shown) == shown.shape[1]
        assert "the KV up to the ids given is kept" in caplog.text
        assert_next_turn_exact(store, model, shown, restored=shown.shape[1])


def test_beams_that_end_on_eos_before_the_search_commit_the_conversation(caplog) -> None:
    """A beam that finished on eos wins while the others decode on: generate() returns fewer ids
    than the cache holds, and commit() of exactly what it returned was refused with advice to
    pass what it returned (helper-32), keeping nothing of the turn."""
    model = make_model("llama")
    ids = random_ids(12, 4)
    beams = model.generate(ids, max_new_tokens=6, num_beams=2, do_sample=False)
    with TieredStore(None, block_size=4) as store:
        cache = store.open(model, ids, session="s")
        eos = int(beams[0, 12])
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, num_beams=2, do_sample=False,
                             eos_token_id=eos)
        assert torch.equal(out, model.generate(ids, max_new_tokens=6, num_beams=2, do_sample=False, eos_token_id=eos))
        assert out.shape[1] == 13 and cache.get_seq_length() > 13
        with caplog.at_level("INFO", logger="tierkv"):
            assert cache.commit(out) == 12
        assert "the KV up to the ids given is kept" not in caplog.text  # beams keep the conversation anyway
        assert_next_turn_exact(store, model, out, restored=12)


@pytest.mark.parametrize("where", ["keys", "values"])
def test_a_fresh_cache_whose_first_update_failed_is_refused_and_commits_nothing(where: str) -> None:
    # transformers' lazy initialization leaves 1-D empty placeholders in a layer whose first
    # update raised before its concatenations: counting their tokens raised IndexError.
    model = make_model("llama", num_hidden_layers=3)
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        layer = cache.layers[1]

        def fail(layer: TieredLayer, keys: torch.Tensor, values: torch.Tensor, *args: object,
                 **kwargs: object) -> None:
            layer.lazy_initialization(keys, values)
            if where == "values":
                layer.keys = torch.cat([layer.keys, keys], dim=-2)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        layer.update = types.MethodType(fail, layer)
        with pytest.raises(torch.OutOfMemoryError):
            greedy(model, ids, past_key_values=cache)
        del layer.update
        assert cache.held_tokens() == 0
        with pytest.raises(ValueError, match="stopped after 1 of its 3 layers"):
            greedy(model, ids, past_key_values=cache)
        assert cache.commit(ids) == 0
        assert store.open(model, ids).restored_tokens == 0


def test_a_restored_layer_whose_assembly_failed_keeps_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, later = restored_cache(store, model)
        assemble = TieredLayer._assemble

        def fail_once(layer: TieredLayer, kv: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
            monkeypatch.setattr(TieredLayer, "_assemble", assemble)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        monkeypatch.setattr(TieredLayer, "_assemble", fail_once)
        with pytest.raises(torch.OutOfMemoryError):
            greedy(model, later, past_key_values=cache)
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_a_last_layer_whose_values_missed_a_token_is_refused(arch: str) -> None:
    model = make_model(arch, num_hidden_layers=3)
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(model, ids, session="s")
        model(ids[:, :19], past_key_values=cache)
        model(ids[:, 19:], past_key_values=cache)  # a sliding layer's room made (a step after the first)
        last = cache.layers[-1]

        def keys_only(layer: TieredLayer, keys: torch.Tensor, values: torch.Tensor, *args: object,
                      **kwargs: object) -> None:
            layer.keys = torch.cat([layer.keys, keys], dim=-2)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, at the values' concatenation)")

        last.update = types.MethodType(keys_only, last)
        with pytest.raises(torch.OutOfMemoryError):
            model(random_ids(1, 5), past_key_values=cache)
        del last.update
        # Every layer's keys hold 21 tokens; the last one's values 20, which attention takes silently.
        with pytest.raises(ValueError, match="stopped after 2 of its 3 layers"):
            model(random_ids(1, 6), past_key_values=cache)
        assert cache.held_tokens() == 20


def bloom() -> torch.nn.Module:
    """A model whose forward takes no position_ids (ALiBi)."""
    config = AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_model_whose_generate_feeds_every_id_at_every_step_is_refused_as_such() -> None:
    """A generate() that re-feeds the whole sequence at each decode step (as any does with
    use_cache=False: a DynamicCache then ends up holding 110 tokens for a 20-token prompt and 5
    new ones): the error names the model's generate(), not the caller. Played with forwards."""
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        with torch.no_grad():
            step = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
            with pytest.raises(ValueError, match="feeds every id at every step"):
                model(torch.cat([ids, step], dim=1), past_key_values=cache)


@pytest.mark.parametrize("arch", ["llama", "bloom"])
def test_generate_on_a_cache_that_holds_every_id_is_refused(arch: str) -> None:
    model = make_model("llama") if arch == "llama" else bloom()
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        # Out of memory in the head, after every layer took the prompt: the cache holds all of it,
        # and generate() would feed the whole prompt again on top.
        head = model.get_output_embeddings()
        with out_of_memory_at([head], 1), pytest.raises(torch.OutOfMemoryError):
            greedy(model, ids, past_key_values=cache)
        with pytest.raises(ValueError, match="holds all 20 ids"):
            greedy(model, ids, past_key_values=cache)
        assert cache.commit(ids) == 20
        assert_next_turn_exact(store, model, ids, restored=20)


def test_a_forward_after_a_generate_that_raised_before_its_forward_is_checked_as_its_own() -> None:
    """generate() prepared a decode step (ids past the cache), and its forward raised before any
    layer (out of memory in the embedding; Ctrl-C alike): the cache, which holds the whole
    conversation, kept taking the next forward at that length for the prepared one, so the whole
    conversation fed again by hand passed unrefused (its KV held twice, at positions past it)."""
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        with out_of_memory_at([model.get_input_embeddings()], 2), pytest.raises(torch.OutOfMemoryError):
            greedy(model, ids, past_key_values=cache)  # the prefill's forward, then a decode step's
        assert cache.get_seq_length() == 20
        with torch.no_grad(), pytest.raises(ValueError, match="holds all 20 ids"):
            model(ids, past_key_values=cache)
        assert cache.get_seq_length() == 20
        assert cache.commit(ids) == 20
        assert_next_turn_exact(store, model, ids, restored=20)


def a_conversation_its_reply_begins_again(model: torch.nn.Module) -> torch.Tensor:
    """Two ids ``[x, 7]`` after which ``model`` greedily generates ``x``: its reply begins the
    conversation again."""
    with torch.no_grad():
        firsts = torch.arange(3, VOCAB)
        ids = torch.stack([firsts, torch.full_like(firsts, 7)], dim=1)
        begins = torch.nonzero(model(ids).logits[:, -1].argmax(-1) == firsts)
    assert len(begins), "no conversation of this model's replies begins again"
    return ids[int(begins[0, 0])].unsqueeze(0)


@pytest.mark.parametrize("decoding", ["prompt_lookup", "second generate", "chunked", "only the new ids"])
@pytest.mark.parametrize("arch", ["llama", "bloom"])
def test_ids_past_the_conversation_that_repeat_it_are_not_taken_for_it_fed_again(arch: str, decoding: str) -> None:
    """generate() feeding ids past the cache that start with the whole conversation: a reply that
    began it again, after which prompt lookup proposes the rest (its candidates' forward), or a
    second generate() whose new message repeats it. Each was refused as generate() feeding every
    id again (found by helper-73's fuzzing of generation modes: the first turn of a short
    conversation with prompt lookup failed), where plain generate() runs; generate() given only
    the ids the cache holds still is (test_generate_on_a_cache_that_holds_every_id_is_refused)."""
    model = make_model("llama") if arch == "llama" else bloom()
    ids = a_conversation_its_reply_begins_again(model)
    modes = dict(return_dict_in_generate=True, output_logits=True)
    with TieredStore(None, block_size=4) as store:
        cache = store.open(model, ids, session="s")
        if decoding == "prompt_lookup":
            got = greedy(model, ids, past_key_values=cache, prompt_lookup_num_tokens=3, **modes)
            assert_as_plain(got, greedy(model, ids, prompt_lookup_num_tokens=3, **modes))
            assert got.sequences[0, 2] == ids[0, 0]  # the reply began the conversation again
            assert cache.commit(got.sequences) == got.sequences.shape[1] - 1
            assert_next_turn_exact(store, model, got.sequences, restored=got.sequences.shape[1] - 1)
            return
        out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
        assert out[0, 2] == ids[0, 0] and cache.get_seq_length() == 2
        # Past the two ids the cache holds, generate() feeds [x, 7, ...]: the conversation again.
        later = torch.cat([out, ids[:, 1:], random_ids(2, 5)], dim=1)
        plain = greedy(model, later, **modes)
        if decoding == "only the new ids":
            got = greedy(model, later[:, 2:], past_key_values=cache, attention_mask=torch.ones_like(later), **modes)
            assert torch.equal(got.sequences[:, -NEW:], plain.sequences[:, -NEW:])
            for a, b in zip(got.logits, plain.logits):
                torch.testing.assert_close(a, b)
            return
        got = greedy(model, later, past_key_values=cache, **modes,
                     **(dict(prefill_chunk_size=2) if decoding == "chunked" else {}))
        assert_as_plain(got, plain)
        assert cache.commit(got.sequences) == got.sequences.shape[1] - 1
        assert_next_turn_exact(store, model, got.sequences, restored=got.sequences.shape[1] - 1)


@pytest.mark.parametrize("decoding", ["assistant", "prompt_lookup", "second generate"])
def test_forwards_past_the_conversation_pass_with_a_masked_pad_in_the_prompt(decoding: str) -> None:
    # generate() counts positions over the mask: past a masked pad they stay below the cache's length.
    model = make_model("llama", pad_token_id=0)
    model.generation_config.pad_token_id = 0
    pattern = random_ids(4, 3)
    ids = torch.cat([random_ids(6, 1), torch.zeros(1, 1, dtype=torch.long), pattern, pattern, pattern], dim=1)
    extra: dict[str, object] = {"assistant": dict(assistant_model=copy.deepcopy(model)),
                                "prompt_lookup": dict(prompt_lookup_num_tokens=3)}.get(decoding, {})
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = greedy(model, ids, past_key_values=cache, **extra)
        assert torch.equal(out, greedy(model, ids, **extra))
        if decoding == "second generate":
            later = torch.cat([out, random_ids(5, 9)], dim=1)
            assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))
        else:
            assert cache.commit(out) == 6  # up to the pad


# -- forwards past the conversation, and the model's modes -------------------------------------------
def decode_past(model: torch.nn.Module, cache: TieredCache, ids: torch.Tensor, steps: int,
                **step_kwargs: object) -> torch.Tensor:
    """The conversation's prefill, then ``steps`` greedy single-token forwards past it, each
    given ``step_kwargs`` (callables of the step's position); the ids they make."""
    out = ids
    with torch.no_grad():
        logits = model(ids[:, cache.get_seq_length():], past_key_values=cache).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            at = out.shape[1]
            logits = model(token, past_key_values=cache, **{k: f(at) for k, f in step_kwargs.items()}).logits
            out = torch.cat([out, token], dim=1)
    return out


@pytest.mark.parametrize("given", ["mask hiding a token", "positions off"])
def test_kv_computed_past_the_conversation_under_a_mask_or_at_other_positions_is_not_kept(given: str) -> None:
    model = make_model("llama")
    ids = random_ids(20, 4)

    def hiding(at: int) -> torch.Tensor:
        mask = torch.ones(1, at + 1, dtype=torch.long)
        mask[0, 3] = 0
        return mask

    step = {"attention_mask": hiding} if given == "mask hiding a token" else \
        {"position_ids": lambda at: torch.tensor([[at + 10]])}
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = decode_past(model, cache, ids, 4, **step)
        assert cache.commit(out) == 20  # the conversation's own KV only
        assert_next_turn_exact(store, model, out, restored=20)
        cache = store.open(model, ids, session="t")  # the control: the same steps without them
        out = decode_past(model, cache, ids, 4)
        assert cache.commit(out) == 24


def test_a_second_generate_whose_mask_hides_a_generated_token_keeps_what_came_before() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        first = greedy(model, ids, past_key_values=cache)  # the cache holds 24
        later = torch.cat([first, random_ids(4, 2)], dim=1)
        mask = torch.ones_like(later)
        mask[0, 22] = 0  # a token the first generate() made, hidden from the second's
        kw: dict = dict(attention_mask=mask, return_dict_in_generate=True, output_logits=True)
        second = greedy(model, later, past_key_values=cache, **kw)
        # The KV of token 23 was computed at its own position, seeing token 22: under this mask
        # generate() puts it a position lower, without it. It is computed again, from 22 on.
        plain = greedy(model, later, **kw)
        assert_as_plain(second, plain)
        assert cache.commit(second.sequences) == 22
        assert_next_turn_exact(store, model, second.sequences, restored=22)


def test_a_second_generate_whose_mask_hides_the_last_restored_token_is_refused() -> None:
    """As at a first generate: a later generate on the cache whose mask hides a restored token, the
    last one too, is refused (an off-by-one there cropped that token and computed it again,
    while the cache still counted it restored)."""
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        out = one_turn(store, model, ids)
        later = torch.cat([out, random_ids(2, 7)], dim=1)
        cache = store.open(model, later, session="s")
        restored = cache.restored_tokens
        assert restored == out.shape[1] - 1
        first = greedy(model, later, past_key_values=cache)
        again = torch.cat([first, random_ids(2, 8)], dim=1)
        mask = torch.ones_like(again)
        mask[0, restored - 1] = 0
        with pytest.raises(ValueError, match=f"hides token {restored - 1}, which this cache restored"):
            greedy(model, again, past_key_values=cache, attention_mask=mask)


@pytest.mark.parametrize("edit", ["reply", "prompt", "restored"])
def test_a_second_generate_on_one_cache_refuses_ids_edited_where_the_cache_holds_kv(edit: str) -> None:
    # generate() feeds the model only the ids past the cache: an id edited before them (a reply
    # trimmed and sent back on the same cache) was given the KV of the one it replaced.
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        cache, ids = restored_cache(store, model)
        first = greedy(model, ids, past_key_values=cache)
        later = torch.cat([first, random_ids(3, 4)], dim=1)
        at = {"reply": ids.shape[1] + 1, "prompt": ids.shape[1] - 1, "restored": 5}[edit]
        assert at < cache.get_seq_length() and (at < cache.restored_tokens) == (edit == "restored")
        edited = later.clone()
        edited[0, at] = (edited[0, at] + 1) % VOCAB
        with pytest.raises(ValueError, match=f"differ.* at token {at}"):
            greedy(model, edited, past_key_values=cache)
        # The same ids unedited go on exactly.
        assert torch.equal(greedy(model, later, past_key_values=cache), greedy(model, later))


def test_ids_fed_past_the_conversation_are_copied_when_fed() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        # A decode loop feeding views of one buffer, the reply edited in it before commit.
        cache = store.open(model, ids, session="s")
        buf = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
        logits = model(ids, past_key_values=cache).logits
        for at in range(20, 24):
            buf[0, at] = logits[0, -1].argmax()
            logits = model(buf[:, at:at + 1], past_key_values=cache).logits
        buf[0, 24] = logits[0, -1].argmax()
        buf[0, 21:23] = torch.tensor([7, 8])
        with pytest.raises(ValueError, match="differ from the ones the model generated"):
            cache.commit(buf)
        # One step tensor written again each step: the ids it held when fed are the ones kept.
        cache = store.open(model, ids, session="t")
        step, made = torch.zeros(1, 1, dtype=torch.long), []
        logits = model(ids, past_key_values=cache).logits
        for _ in range(4):
            step[0, 0] = logits[0, -1].argmax()
            made.append(int(step))
            logits = model(step, past_key_values=cache).logits
        assert cache.commit(torch.cat([ids, torch.tensor([made])], dim=1)) == 24


def test_ids_fed_again_after_a_crop_are_the_ones_kept() -> None:
    a = make_model("llama", seed=0)
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(a, ids, session="s")
        out = greedy(a, ids, past_key_values=cache)  # 24 held: 4 past the conversation
        cache.crop(-3)
        other = (out[:, 21:24] + 1) % VOCAB
        with torch.no_grad():
            a(other, past_key_values=cache)  # other ids' KV where out's were noted
        assert cache.get_seq_length() == 24
        edited = torch.cat([out[:, :21], other], dim=1)
        assert cache.commit(edited) == 24
        assert_next_turn_exact(store, a, edited, restored=24)


def test_a_sample_selected_from_several_keeps_only_the_conversation() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        torch.manual_seed(0)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=True, num_return_sequences=3)
        assert not torch.equal(out[0], out[2])
        cache.batch_select_indices(torch.tensor([2]))  # row 2's KV, while row 0's ids were noted
        assert cache.commit(out[2:3]) == 20
        assert_next_turn_exact(store, model, out[2:3], restored=20)


def test_a_model_in_training_mode_or_under_autocast_is_refused() -> None:
    model = make_model("gpt2")  # with dropout
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        one_turn(store, model, ids)
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 19
        model.train()
        try:
            with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)"):
                greedy(model, ids, past_key_values=cache)
        finally:
            model.eval()
        for restored in (True, False):
            cache = store.open(model, ids if restored else random_ids(20, 5), session="s")
            with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
                greedy(model, ids, past_key_values=cache)
        assert store.stats()["device"]["blocks"] == 3  # the first turn's only


def test_kv_in_another_dtype_than_the_restored_blocks_is_refused() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        one_turn(store, model, ids)
        cache = store.open(model, ids, session="s")
        keys = torch.zeros(1, 2, 1, 8)  # (batch, kv heads, tokens, head dim) of the llama shape
        for rows in (1, 3):  # one conversation, or beams meeting the restored prefix
            with pytest.raises(ValueError, match="computed keys in torch.float32 and values in torch.bfloat16"):
                cache.layers[0].update(keys.expand(rows, -1, -1, -1), keys.bfloat16().expand(rows, -1, -1, -1), 0)
            assert cache.layers[0].get_seq_length() == 19  # still the restore, untouched
        cache = store.open(model, random_ids(20, 5), session="t")
        out = greedy(model, random_ids(20, 5), past_key_values=cache)
        for layer in cache.layers:  # values alone in another dtype
            layer.values = layer.values.bfloat16()
        with pytest.raises(ValueError, match="KV in torch.bfloat16 but"):
            cache.commit(out)


def test_generate_misused_on_a_cache_past_its_conversation_is_refused_clearly() -> None:
    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = greedy(model, ids, past_key_values=cache)
        with pytest.raises(ValueError, match="given 20 ids, fewer than the 24 this TieredCache holds"):
            greedy(model, ids, past_key_values=cache)  # the first prompt again: a slice of it is fed
        with torch.no_grad(), pytest.raises(ValueError, match="attention_mask over 1 tokens rather than 25"):
            model(out[:, -1:], past_key_values=cache, attention_mask=torch.ones(1, 1, dtype=torch.long))
        cache = store.open(model, ids, session="b")
        out = greedy(model, ids, past_key_values=cache, num_beams=3)
        with torch.no_grad(), pytest.raises(ValueError, match="holds 3 rows"):
            model(random_ids(2, 3), past_key_values=cache)  # by hand: one row on three beams' KV
        cache = store.open(model, ids, session="c")
        with torch.no_grad():
            model(ids, past_key_values=cache)  # a cache that holds every id, then a chunked prefill on it
        with pytest.raises(ValueError, match="prefill_chunk_size was given 20 ids on a TieredCache that holds 20"):
            greedy(model, ids, past_key_values=cache, prefill_chunk_size=4)
        cache = store.open(model, ids, session="d")
        out = greedy(model, ids, past_key_values=cache)
        for beams in (3, 1):  # fewer ids than the cache holds, with a message of their own
            with pytest.raises(ValueError, match="given 6 ids, fewer than the 24 this TieredCache holds"):
                model.generate(torch.cat([out[:, :4], random_ids(2, 8)], 1), past_key_values=cache,
                               num_beams=beams, max_new_tokens=2, do_sample=False)
        # Fewer ids where generate() feeds one of them, past the cache, with no check tripping
        # (2L - held = 1): it ran on another context's KV (helper-35). And a first generate()
        # given fewer ids than the cache restored, chunked or not.
        cache = store.open(model, ids[:, :17], session="e")
        with torch.no_grad():
            model(ids[:, :17], past_key_values=cache)
        for chunk in (None, 4):
            with pytest.raises(ValueError, match="given 9 ids, fewer than the 17 this TieredCache holds"):
                greedy(model, ids[:, :9], past_key_values=cache, prefill_chunk_size=chunk)
        cache.commit(ids[:, :17])
        cache = store.open(model, torch.cat([ids[:, :17], random_ids(1, 9)], 1), session="e")
        assert cache.restored_tokens == 17
        for chunk in (None, 4):
            with pytest.raises(ValueError, match="given 5 ids, fewer than the 17 this TieredCache holds"):
                greedy(model, ids[:, :5], past_key_values=cache, prefill_chunk_size=chunk)
        cache = store.open(model, ids, session="c")
        with pytest.raises(ValueError, match="use_cache=False"):
            greedy(model, ids, past_key_values=cache, use_cache=False)
        # Refused before its first forward: the advice then works on the same cache.
        assert cache.get_seq_length() == cache.restored_tokens
        assert torch.equal(greedy(model, ids, past_key_values=cache), greedy(model, ids))


def test_mpt_runs_exact_once_its_generation_config_uses_the_cache(tmp_path) -> None:
    # MPT's config ships use_cache=False: generate() then feeds every id at every step.
    torch.manual_seed(0)
    config = AutoConfig.for_model("mpt", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.generation_config.use_cache is False
    ids = random_ids(20, 1)
    with TieredStore(tmp_path / "kv", block_size=8, device_budget=0, host_budget=0) as store:
        cache = store.open(model, ids, session="s")
        with pytest.raises(ValueError, match="generation_config.use_cache = True"):
            greedy(model, ids, past_key_values=cache)
        model.generation_config.use_cache = True
        out = one_turn(store, model, ids)
        assert torch.equal(out, greedy(model, ids))
        assert_next_turn_exact(store, model, out, restored=out.shape[1] - 1)


def test_a_chunked_prefill_under_a_mask_that_hides_a_token_it_computed_is_exact() -> None:
    # Each chunk after the first is given the mask over the chunks before it, hiding a token the
    # cache computed itself (under that mask): not one it restored.
    model = make_model("llama")
    ids = random_ids(30, 1)
    mask = torch.ones_like(ids)
    mask[0, 13] = 0
    with TieredStore(None, block_size=8) as store:
        one_turn(store, model, ids[:, :12])
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 12
        out = greedy(model, ids, past_key_values=cache, attention_mask=mask, prefill_chunk_size=8)
        assert torch.equal(out, greedy(model, ids, attention_mask=mask, prefill_chunk_size=8))
        assert cache.commit(out) == 13


# -- generate()'s whole-ids check, on the model's class ------------------------------------------
def _edited_prefix_is_refused(store: TieredStore, model: torch.nn.Module, out: torch.Tensor) -> None:
    edited = out.clone()
    edited[0, 2] = (edited[0, 2] + 1) % VOCAB
    cache = store.open(model, out, session="s")
    assert cache.restored_tokens > 2
    with pytest.raises(ValueError, match="differ from those store.open got at token 2"):
        greedy(model, edited, past_key_values=cache)


@pytest.mark.parametrize("how", ["copy", "pickled copy", "deepcopy", "pickle"])
def test_a_copy_of_an_opened_model_generates_after_the_original_is_gone(how: str) -> None:
    # copy.copy(model) (transformers' exporters make one) shared the check tierkv had put on the
    # model object, which held the original weakly: once that was gone, even a plain generate() on
    # the copy raised ReferenceError, and the copy's own store.open did not rebind it; a pickled
    # shallow copy raised at once (the original pickled with it was referenced by nothing).
    import gc
    import pickle

    copies = {"copy": copy.copy, "deepcopy": copy.deepcopy,
              "pickled copy": lambda m: pickle.loads(pickle.dumps(copy.copy(m))),
              "pickle": lambda m: pickle.loads(pickle.dumps(m))}
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        want = greedy(model, later)
        twin = copies[how](model)
        if how == "pickled copy":  # also while the original lives
            assert torch.equal(greedy(twin, later), want)
        del model
        gc.collect()
        assert torch.equal(greedy(twin, later), want)  # without a tierkv cache
        cache = store.open(twin, later, session="s")
        assert cache.restored_tokens > 20
        got = greedy(twin, later, past_key_values=cache)
        assert torch.equal(got, want)
        assert cache.commit(got) > 20
        _edited_prefix_is_refused(store, twin, out)


@pytest.mark.parametrize("calls", ["the saved function", "super()"])
def test_a_class_level_patch_made_after_open_runs_under_the_prefix_check(calls: str) -> None:
    # A patch of prepare_inputs_for_generation on the model's class after its first store.open was
    # ignored for that model (the check on the model object shadowed the class, and called the
    # class's function as it was at that open), while models never opened ran it.
    import inspect

    from transformers import LlamaForCausalLM

    class Patched(LlamaForCausalLM):  # patched here, not the class the other tests use
        pass

    plain = make_model("llama")
    model = Patched(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    ran: list[torch.nn.Module] = []
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        saved = Patched.prepare_inputs_for_generation

        def patched(self: torch.nn.Module, input_ids: torch.Tensor, **kwargs: object) -> dict:
            ran.append(self)
            if calls == "super()":
                return super(Patched, self).prepare_inputs_for_generation(input_ids, **kwargs)
            return saved(self, input_ids, **kwargs)

        Patched.prepare_inputs_for_generation = patched
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        want = greedy(plain, later)
        assert torch.equal(greedy(model, later), want)
        assert any(m is model for m in ran)  # at once, before any open
        ran.clear()
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens > 20
        assert inspect.signature(model.prepare_inputs_for_generation) == inspect.signature(patched.__get__(model))
        got = greedy(model, later, past_key_values=cache)
        assert torch.equal(got, want)
        assert any(m is model for m in ran)
        cache.commit(got)
        _edited_prefix_is_refused(store, model, out)


@pytest.mark.parametrize("kind", ["staticmethod", "classmethod", "a subclass's own, calling super()"])
def test_the_prefix_check_keeps_how_a_class_defines_prepare_inputs_for_generation(kind: str) -> None:
    import inspect

    from transformers import GenerationMixin, LlamaForCausalLM

    ran: list[str] = []
    held: list[torch.nn.Module] = []  # the model a staticmethod or classmethod prepares for

    if kind == "staticmethod":
        class Defined(LlamaForCausalLM):
            @staticmethod
            def prepare_inputs_for_generation(input_ids: torch.Tensor, **kwargs: object) -> dict:
                ran.append("static")
                return GenerationMixin.prepare_inputs_for_generation(held[0], input_ids, **kwargs)
    elif kind == "classmethod":
        class Defined(LlamaForCausalLM):
            @classmethod
            def prepare_inputs_for_generation(cls, input_ids: torch.Tensor, **kwargs: object) -> dict:
                ran.append(cls.__name__)
                return GenerationMixin.prepare_inputs_for_generation(held[0], input_ids, **kwargs)
    else:
        class Defined(LlamaForCausalLM):
            def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: object) -> dict:
                ran.append("own")
                return super().prepare_inputs_for_generation(input_ids, **kwargs)

    plain = make_model("llama")
    model = Defined(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    held.append(model)
    signature = inspect.signature(model.prepare_inputs_for_generation)
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(20, 1))
        assert ran
        assert inspect.signature(model.prepare_inputs_for_generation) == signature
        assert type(inspect.getattr_static(Defined, "prepare_inputs_for_generation")).__name__ == \
            {"staticmethod": "staticmethod", "classmethod": "classmethod"}.get(kind, "function")
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        cache = store.open(model, later, session="s")
        got = greedy(model, later, past_key_values=cache)
        assert torch.equal(got, greedy(plain, later))
        cache.commit(got)
        _edited_prefix_is_refused(store, model, out)


def test_blocks_committed_from_a_forward_with_grad_keep_no_autograd_graph() -> None:
    """A hand-written loop calling ``model()`` without ``torch.no_grad()``: its KV carries the
    forward's graph (every activation it saved). Stored blocks kept it alive outside every
    budget, about 16 MiB a session for a 4-layer, 256-wide model at 512 tokens."""
    model = make_model("llama")
    ids = random_ids(22, 1)
    with TieredStore(None, block_size=4, device_budget="4KiB") as store:  # blocks on device and host
        cache = store.open(model, ids, session="g")
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.layers[0].keys.requires_grad  # what the blocks were cut from
        assert cache.commit(ids) == 22
        tiers = [store._device, store._host]
        blocks = [tier.get(key).wait() for tier in tiers for key in store._index.blocks if key in tier]
        assert len(blocks) == 6
        assert {key in store._host for key in store._index.blocks} == {True, False}
        assert not any(b.requires_grad or b.grad_fn is not None for b in blocks)
        assert_next_turn_exact(store, model, ids, restored=22)


def test_a_model_compiled_whole_runs_forwards_on_a_tiered_cache() -> None:
    """``torch.compile(model)`` traces the module's forward pre-hooks: dynamo failed in tierkv's
    ("... is already tracked for mutation") where a DynamicCache worked."""
    model = make_model("llama")
    compiled = torch.compile(model, backend="eager")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store, torch.no_grad():
        cache = store.open(compiled, ids, session="c")  # either the compiled module or the model
        logits = compiled(input_ids=ids, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(logits, model(input_ids=ids).logits)
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
        step = compiled(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], model(input_ids=ids).logits[:, -1])
        assert cache.commit(ids) == 21
        # Keyed apart from the plain model's KV (its fingerprint is the compiled module's).
        assert store.open(compiled, torch.cat([ids, random_ids(3, 2)], 1), session="c").restored_tokens == 21


def _a_returning_turn(store: TieredStore, model: torch.nn.Module) -> torch.Tensor:
    """The ids of session "a"'s second turn, whose open restores 33 tokens, its first committed."""
    ids = random_ids(30, 1)
    cache = store.open(model, ids, session="a")
    cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False))
    return torch.cat([model.generate(ids, max_new_tokens=4, do_sample=False), random_ids(3, seed=9)], 1)


def test_a_reset_cache_no_longer_counts_or_guards_what_it_restored() -> None:
    """``reset()`` throws the restored prefix away: it is computed again, so a mask over it is the
    caller's to give (it was refused as hiding restored tokens), and it is counted as discarded."""
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        turn = _a_returning_turn(store, model)
        cache = store.open(model, turn, session="a")
        assert cache.restored_tokens == 33
        cache.reset()
        assert (cache.restored_tokens, cache.restored_from) == (0, {"device": 0, "host": 0, "disk": 0})
        mask = torch.ones_like(turn)
        mask[0, 5] = 0
        out = model.generate(turn, past_key_values=cache, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, model.generate(turn, attention_mask=mask, max_new_tokens=3, do_sample=False))
        assert store.stats()["discarded"] == 33


def test_a_crop_below_the_restore_counts_the_tokens_it_gives_back_once() -> None:
    """A crop below the restored prefix gives those tokens back: computed again, they are counted
    as discarded and missed, as a reset's are (they were not), and a reset after it counts only the
    restored tokens still held, so each restored token is counted once however the turn throws it
    away. Crops past the restore (prompt lookup's, each step) count nothing."""
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        turn = _a_returning_turn(store, model)
        for then in ("generate", "reset"):
            cache = store.open(model, turn, session="a")
            assert cache.restored_tokens == 33
            before = store.stats()
            cache.crop(-3)
            cache.crop(-10)  # to 20 of the 33 restored
            after = store.stats()
            assert (after["discarded"] - before["discarded"], after["misses"] - before["misses"]) == (13, 13)
            assert after["hits"] == before["hits"] and cache.restored_tokens == 33
            if then == "reset":
                cache.reset()
                assert store.stats()["discarded"] - before["discarded"] == 33
            out = model.generate(turn, past_key_values=cache, max_new_tokens=3, do_sample=False)
            assert torch.equal(out, model.generate(turn, max_new_tokens=3, do_sample=False))
            cache.crop(-1)  # past the restore: nothing given back
            final = store.stats()
            assert final["discarded"] - before["discarded"] == (13 if then == "generate" else 33)
            assert final["misses"] - before["misses"] == (13 if then == "generate" else 33)


@pytest.mark.parametrize("computed", [False, True])
def test_reset_drops_the_kv_where_transformers_would_zero_it(monkeypatch: pytest.MonkeyPatch, computed: bool) -> None:
    """Before 5.18 transformers reset a ``DynamicLayer`` through its base class, which zeroes the
    tensors in place and keeps their length: a reset cache then held its tokens as zeros (a layer
    still waiting for its blocks raised instead, as assisted decoding's reset of a restored cache
    did on 5.17). Here that base class's reset stands in for 5.17's."""
    from transformers.cache_utils import DynamicLayer

    if "reset" in vars(DynamicLayer):  # 5.18 on: its own, which drops them
        monkeypatch.delattr(DynamicLayer, "reset")
    model = make_model("llama")
    ids = random_ids(30, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="a")
        first = greedy(model, ids, past_key_values=cache)
        restored = cache.commit(first)
        turn = torch.cat([first, random_ids(3, seed=9)], 1)
        cache = store.open(model, turn, session="a")
        assert cache.restored_tokens == restored > 0
        if computed:  # the layers hold tensors of their own, not blocks still to arrive
            with torch.no_grad():
                model(input_ids=turn[:, restored:], past_key_values=cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert all(layer.held_tokens() == 0 for layer in cache.layers)
        # Let go of, not only marked unused (held to the next forward, as much memory as the KV).
        assert all(layer._keys is None and layer._values is None for layer in cache.layers)
        out = greedy(model, turn, past_key_values=cache)
        assert torch.equal(out, greedy(model, turn))
        assert cache.commit(out) == out.shape[1] - 1


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("row", [2, 0])
def test_a_cache_cut_to_one_of_its_samples_serves_only_the_ids_it_can_check(row: int, chunk: int | None) -> None:
    """Samples with num_return_sequences=3, sample 2 kept with ``batch_select_indices``, then a
    second generate() on the same cache: given sample 0's ids (``row`` 0) it was accepted with
    sample 2's KV for them (logits 0.06 off plain generate). The KV past the conversation, of a
    row whose ids were not recorded, is computed again; commit keeps the second turn exactly."""
    model = make_model("llama")
    ids = random_ids(30, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        torch.manual_seed(1)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=True, num_return_sequences=3)
        assert not torch.equal(out[0], out[2])
        cache.batch_select_indices(torch.tensor([2]))
        later = torch.cat([out[row:row + 1], random_ids(3, 5)], 1)
        kw: dict = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
        got = model.generate(later, past_key_values=cache, prefill_chunk_size=chunk, **kw)
        plain = model.generate(later, **kw)
        assert_as_plain(got, plain)
        assert cache.commit(got.sequences) == got.sequences.shape[1] - 1
        assert_next_turn_exact(store, model, got.sequences, restored=got.sequences.shape[1] - 1)


@pytest.mark.parametrize("first, second", [
    (dict(do_sample=True, num_return_sequences=2), dict(do_sample=True, num_return_sequences=2)),
    (dict(do_sample=True, num_return_sequences=2), dict(do_sample=False, num_beams=2)),
    (dict(do_sample=True, num_return_sequences=3), dict(do_sample=False)),
    (dict(num_beams=2, num_return_sequences=2), dict(do_sample=False)),  # both rows continued, in a batch of 2
    (dict(num_beams=3, max_new_tokens=1), dict(do_sample=False)),  # rows alike: beams fed nothing past the prompt
])
@pytest.mark.parametrize("chunk", [None, 4])
def test_a_second_generate_on_a_cache_several_rows_filled_is_plain_generates(first: dict, second: dict,
                                                                             chunk: int | None) -> None:
    """After a generate() of several rows (samples, beams), a second generate() on the same cache
    of as many rows was served each old row's KV under the new rows' ids (samples: logits 0.11-0.63
    off plain generate; beams: the rows follow the last step's beams, not the sequences returned),
    and a batch-1 one was refused. The KV past the conversation, whose ids only row 0's records
    could vouch for, is computed again, from one row of the conversation's."""
    model = make_model("llama")
    ids = random_ids(13, 0)
    with TieredStore(None, block_size=4) as store:
        for c in (store.open(model, ids[:, :9], session="s"),):
            c.commit(greedy(model, ids[:, :9], past_key_values=c))
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens == 9  # the first turn's prompt, whose reply these ids do not hold
        torch.manual_seed(0)
        out = model.generate(ids, past_key_values=cache, **{"max_new_tokens": 4, **first})
        assert out.shape[0] > 1 or first.get("max_new_tokens") == 1
        if "num_return_sequences" in first and first.get("do_sample"):
            assert not torch.equal(out[0], out[1])  # the rows diverged
        x = torch.cat([out if "num_beams" in first and out.shape[0] > 1 else out[:1],
                       random_ids(4, 1).expand(out.shape[0] if "num_beams" in first else 1, -1)], 1)
        kw = dict(max_new_tokens=3, return_dict_in_generate=True, output_logits=True, **second)
        torch.manual_seed(1)
        plain = model.generate(x, **kw)
        torch.manual_seed(1)
        got = model.generate(x, past_key_values=cache, prefill_chunk_size=chunk, **kw)
        assert_as_plain(got, plain)
        if cache.batch_rows() == 1:  # commit keeps the turn, and the next one is exact
            assert cache.commit(got.sequences) == got.sequences.shape[1] - 1
            assert_next_turn_exact(store, model, got.sequences, restored=got.sequences.shape[1] - 1)
        else:  # samples or beams in the cache's rows: the conversation it was opened with
            assert cache.commit(got.sequences[:1]) == ids.shape[1]


@pytest.mark.parametrize("how", ["embeds", "mask"])
def test_a_generate_after_forwards_of_unknown_ids_computes_them_again(how: str) -> None:
    """A forward past the conversation fed as embeddings, or under a mask that hides a token,
    leaves KV whose ids are unknown; a later generate() on the cache was given other ids there
    and served that KV (the prefix check compared known ids only: logits 0.8 off)."""
    model = make_model("llama")
    ids = random_ids(10, 2)
    other, mine = random_ids(3, 5), random_ids(3, 6)
    with TieredStore(None, block_size=4) as store:
        cache = store.open(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            if how == "embeds":
                model(inputs_embeds=model.get_input_embeddings()(other), past_key_values=cache,
                      position_ids=torch.arange(10, 13)[None])
            else:
                model(mine, past_key_values=cache, attention_mask=torch.cat([torch.zeros(1, 1), torch.ones(1, 12)], 1).long())
        assert cache.get_seq_length() == 13
        x = torch.cat([ids, mine, random_ids(2, 7)], 1)
        kw: dict = dict(return_dict_in_generate=True, output_logits=True)
        got = greedy(model, x, past_key_values=cache, **kw)
        plain = greedy(model, x, **kw)
        assert_as_plain(got, plain)
        assert cache.commit(got.sequences) == got.sequences.shape[1] - 1  # the unknown KV was dropped


def test_a_second_generate_whose_mask_hides_a_token_of_the_first_reply_computes_from_it() -> None:
    """generate() masks its pad_token_id wherever it appears: a token of the first reply made the
    pad of the second generate() on the same cache shifted the positions after it, while the cache
    held that reply's KV computed unmasked at the old positions (logits 4e-3 off)."""
    model = make_model("llama")
    ids = random_ids(12, 3)
    with TieredStore(None, block_size=4) as store:
        cache = store.open(model, ids, session="s")
        first = greedy(model, ids, past_key_values=cache, pad_token_id=1)
        pad = int(first[0, 13])
        assert not (ids == pad).any() and not (first[0, 14:] == pad).any()
        x = torch.cat([first, random_ids(3, 4)], 1)
        kw: dict = dict(pad_token_id=pad, return_dict_in_generate=True, output_logits=True)
        got = greedy(model, x, past_key_values=cache, **kw)
        plain = greedy(model, x, **kw)
        assert_as_plain(got, plain)
        assert cache.commit(got.sequences) == 13  # up to the masked token


@pytest.mark.parametrize("case", ["masked, then unmasked", "masked by hand, then generate",
                                  "rows, then token 0 masked", "token 0 masked, then beams", "restored token masked"])
def test_a_later_generate_never_meets_kv_computed_under_another_mask(case: str) -> None:
    """KV after a token an earlier forward's mask hid sits at the positions that mask gave, and
    KV restored or computed unmasked sits at its own: a later generate() on the cache under
    another mask was served either (logits 0.02-0.04 off), and one whose mask hid token 0 after
    several rows raised in torch.cat (helper-35). It computes from the first such token again,
    or, for a restored token, is refused as a first generate() is."""
    model = make_model("llama")
    ids = random_ids(12, 3)
    kw: dict = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with TieredStore(None, block_size=4) as store:
        if case == "restored token masked":
            one_turn(store, model, ids[:, :9])
        cache = store.open(model, ids, session="s")
        if case in ("masked, then unmasked", "token 0 masked, then beams"):
            mask = torch.ones_like(ids)
            mask[0, 10 if case == "masked, then unmasked" else 0] = 0
            first = model.generate(ids, past_key_values=cache, attention_mask=mask, **kw).sequences
            x, mask = torch.cat([first, random_ids(3, 4)], 1), None
            if case == "token 0 masked, then beams":  # all is computed again, in two rows
                kw["num_beams"] = 2
        elif case == "masked by hand, then generate":
            with torch.no_grad():
                model(ids[:, :11], attention_mask=torch.tensor([[1] * 10 + [0]]), past_key_values=cache)
            assert cache.get_seq_length() == 11
            x, mask = ids, None
        elif case == "rows, then token 0 masked":
            torch.manual_seed(0)
            first = model.generate(ids, past_key_values=cache, do_sample=True, num_return_sequences=3,
                                   max_new_tokens=2)
            x = torch.cat([first[:1], random_ids(3, 4)], 1)
            mask = torch.ones_like(x)
            mask[0, 0] = 0
        else:
            assert cache.restored_tokens == 9
            first = greedy(model, ids, past_key_values=cache)
            x = torch.cat([first, random_ids(3, 4)], 1)
            with pytest.raises(ValueError, match="hides token 2, which this cache restored"):
                model.generate(x, past_key_values=cache, pad_token_id=int(x[0, 2]), **kw)
            return
        got = model.generate(x, past_key_values=cache, attention_mask=mask, **kw)
        plain = model.generate(x, attention_mask=mask, **kw)
        assert_as_plain(got, plain)


def test_a_mask_may_hide_restored_tokens_a_crop_gave_back() -> None:
    """Cropped below its restore, the cache computes those tokens again, under the caller's mask:
    a mask over them was refused as hiding restored KV."""
    model = make_model("llama")
    with TieredStore(None, block_size=8) as store:
        turn = _a_returning_turn(store, model)
        mask = torch.ones_like(turn)
        mask[0, 20] = 0
        cache = store.open(model, turn, session="a")
        assert cache.restored_tokens == 33
        with pytest.raises(ValueError, match="hides token 20, which this cache restored"):
            model.generate(turn, past_key_values=cache, attention_mask=mask, max_new_tokens=3, do_sample=False)
        plain = model.generate(turn, attention_mask=mask, max_new_tokens=3, do_sample=False)
        for chunk in (None, 8):  # a chunked prefill: forwards past the hidden token, then more
            cache = store.open(model, turn, session="a")
            cache.crop(-23)  # 10 restored tokens left
            out = model.generate(turn, past_key_values=cache, attention_mask=mask, max_new_tokens=3,
                                 do_sample=False, prefill_chunk_size=chunk)
            assert torch.equal(out, plain)
            assert cache.commit(out) == 20  # up to the hidden token
        cache = store.open(model, turn, session="a")
        cache.crop(-23)
        with torch.no_grad():  # by hand, two forwards inside the conversation
            model(input_ids=turn[:, 10:24], attention_mask=mask[:, :24], past_key_values=cache, use_cache=True)
            model(input_ids=turn[:, 24:36], attention_mask=mask[:, :36], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="hides token 5, which this cache restored"):
            bad = mask.clone()
            bad[0, 5] = 0  # still restored (not cropped): refused all the same
            model(input_ids=turn[:, 36:], attention_mask=bad, past_key_values=cache, use_cache=True)


def test_a_crop_back_to_the_token_a_mask_hid_keeps_what_is_fed_again_from_there() -> None:
    """A crop to exactly the hidden token leaves no KV that the mask touched: the tokens fed again
    from it on, unmasked, are kept by commit (a crop that kept the mark at exactly its new length
    made commit keep only the tokens before it)."""
    model = make_model("llama")
    ids = random_ids(20, 1)
    mask = torch.ones_like(ids)
    mask[0, 12] = 0
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        with torch.no_grad():
            model(input_ids=ids[:, :16], attention_mask=mask[:, :16], past_key_values=cache, use_cache=True)
        cache.crop(-4)
        assert cache.get_seq_length() == 12
        with torch.no_grad():
            model(input_ids=ids[:, 12:19], past_key_values=cache, use_cache=True)
        assert cache.commit(ids) == 19
        assert_next_turn_exact(store, model, ids, restored=19)


def test_a_tiered_cache_iterates_as_a_dynamic_cache_does() -> None:
    """``for keys, values, _ in cache`` and ``DynamicCache(cache)`` raised TypeError."""
    from transformers import DynamicCache

    model = make_model("llama")
    ids = random_ids(20, 1)
    with TieredStore(None, block_size=8) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        cache.commit(out)
        later = torch.cat([out, random_ids(2, 3)], 1)
        cache = store.open(model, later, session="s")
        copied = DynamicCache(cache)  # the restored KV, copied out
        assert copied.get_seq_length() == cache.get_seq_length() == 22
        assert len(list(cache)) == len(cache.layers) == 2
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=later[:, :22], past_key_values=plain)
        for (k, v, _), layer in zip(cache, plain.layers):
            torch.testing.assert_close((k, v), (layer.keys, layer.values))
        assert torch.equal(model.generate(later, past_key_values=copied, max_new_tokens=3, do_sample=False),
                           model.generate(later, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("chunk", [None, 2])
def test_only_a_short_new_message_with_a_whole_mask_runs_on_a_longer_restore(chunk: int | None) -> None:
    # The usual chat turn in that form: fewer new ids than the cache restored (helper-38). They
    # were refused as "fewer ids than the cache holds" (and, chunked, as edited ids).
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        out = one_turn(store, model, random_ids(11, 1))
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        cache = store.open(model, later, session="s")
        restored = cache.restored_tokens
        assert later.shape[1] - restored < restored
        got = greedy(model, later[:, restored:], past_key_values=cache, attention_mask=torch.ones_like(later),
                     prefill_chunk_size=chunk)
        assert torch.equal(got[:, -NEW:], greedy(model, later)[:, -NEW:])
        # Fewer ids than the cache holds with a mask as long as them are still refused.
        cache = store.open(model, later, session="s")
        with pytest.raises(ValueError, match="fewer than"):
            greedy(model, later[:, :restored - 1], past_key_values=cache)


def test_a_chunked_prefill_on_a_cache_holding_every_id_is_refused_without_position_ids() -> None:
    # Bloom's forward takes no position_ids, which the forward hook's refusal read: the chunks
    # (every id again) ran on top of the cache and the output was not plain generate's.
    model = make_model("bloom")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(12, 1)
        cache = store.open(model, ids, session="s")
        with torch.no_grad():
            model(ids[:, cache.get_seq_length():], past_key_values=cache)
        assert cache.get_seq_length() == ids.shape[1]
        with pytest.raises(ValueError, match="prefill_chunk_size was given 12 ids"):
            greedy(model, ids, past_key_values=cache, prefill_chunk_size=4)
        assert cache.get_seq_length() == ids.shape[1]  # refused before any forward


@pytest.mark.parametrize("kwargs", [dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)])
def test_a_cache_cropped_to_nothing_takes_several_rows(kwargs: dict[str, object]) -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(12, 1)
        one_turn(store, model, ids)
        cache = store.open(model, ids, session="s")
        cache.crop(-cache.get_seq_length())
        torch.manual_seed(5)
        got = model.generate(ids, past_key_values=cache, max_new_tokens=4, **kwargs)
        torch.manual_seed(5)
        assert torch.equal(got, model.generate(ids, max_new_tokens=4, **kwargs))


def test_one_row_on_several_cropped_inside_the_conversation_is_refused() -> None:
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(12, 1)
        one_turn(store, model, ids)
        cache = store.open(model, ids, session="s")
        model.generate(ids, past_key_values=cache, max_new_tokens=3, num_beams=2, num_return_sequences=2,
                       do_sample=False)
        assert cache.batch_rows() == 2
        cache.crop(-(cache.get_seq_length() - 8))
        with torch.no_grad(), pytest.raises(ValueError, match="holds 2 rows"):
            model(ids[:, 8:], past_key_values=cache)


def test_the_checks_before_a_prefill_do_not_assemble_the_restore_early(monkeypatch: pytest.MonkeyPatch) -> None:
    # The forward hook's row count read layer 0's keys, which assembled its restore in a copy of
    # its own before the update's concatenation with the new tokens (0.03-0.05 of the TTFT floor).
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(20, 1)
        one_turn(store, model, ids)
        later = torch.cat([ids, random_ids(5, 2)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens
        early: list[int] = []
        monkeypatch.setattr(TieredLayer, "_materialize", lambda self: early.append(1))
        greedy(model, later, past_key_values=cache)
        assert not early


def test_the_whole_conversation_under_a_short_mask_is_told_to_give_a_mask_over_its_ids() -> None:
    # Before: "given only the new ids, the mask covers the cache and them. Pass the whole
    # conversation and its new ids", to a caller who had passed the whole conversation; its mask
    # was what did not fit, which the message never said.
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(12, 1)
        out = one_turn(store, model, ids)
        later = torch.cat([out, random_ids(3, 2)], dim=1)
        cache = store.open(model, later, session="s")
        held = cache.get_seq_length()
        assert held and held < later.shape[1]
        with pytest.raises(ValueError, match="whole conversation .* with a mask over all its ids, or none"):
            greedy(model, later, past_key_values=cache, attention_mask=torch.ones(1, 5, dtype=torch.long))
        assert cache.get_seq_length() == held
        for mask in (torch.ones_like(later), None):  # the advice, followed: exact
            cache = store.open(model, later, session="s")
            assert torch.equal(greedy(model, later, past_key_values=cache, attention_mask=mask), greedy(model, later))


@pytest.mark.parametrize("chunk", [None, 2])
def test_only_new_ids_whose_mask_does_not_cover_the_cache_and_them_are_refused(chunk: int | None) -> None:
    # After beams the prefill drops the rows' KV past the conversation: the new ids' mask no longer
    # covers the cache and them, and chunked, they ran on the shorter cache (logits 0.08 off;
    # helper-41). Also a mask over more tokens than the cache and the ids.
    model = make_model("llama")
    with TieredStore(None, block_size=4) as store:
        ids = random_ids(12, 1)
        one_turn(store, model, ids[:, :8])
        cache = store.open(model, ids, session="s")
        assert cache.restored_tokens
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, num_beams=2, do_sample=False)
        later = torch.cat([out, random_ids(4, 2)], dim=1)
        held = cache.get_seq_length()
        with pytest.raises(ValueError, match="attention_mask over"):
            greedy(model, later[:, held:], past_key_values=cache, attention_mask=torch.ones_like(later),
                   prefill_chunk_size=chunk)
        cache = store.open(model, ids, session="t")
        held = cache.get_seq_length()
        assert held
        more = torch.cat([ids, random_ids(3, 3)], dim=1)
        with pytest.raises(ValueError, match="attention_mask over"):
            greedy(model, more[:, held:], past_key_values=cache,
                   attention_mask=torch.ones(1, more.shape[1] + 1, dtype=torch.long), prefill_chunk_size=chunk)
