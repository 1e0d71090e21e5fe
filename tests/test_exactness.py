"""Integration exactness: a conversation through tierkv equals plain transformers, token for token.

Scenarios (every expectation exact):
* every architecture x every tier: three turns through ``store.open`` / ``generate`` /
  ``commit`` equal the same turns with a reused ``DynamicCache`` and with no cache, while the
  budgets force the restored blocks to rest on the device, in the host tier or on disk; the
  restored token counts and their tier are asserted exactly;
* restart: a store committed, flushed and closed is reopened in a new Python process, which
  restores from disk and generates exactly; its commits are then restored again here;
* both keyword forms ``past_key_values=cache`` and ``cache=cache``;
* generation modes through a restored cache (greedy, sampling, beam search, beams with several
  return sequences, prompt lookup, an assistant model): same sequences and same logits as the
  plain run, then ``commit`` and a following exact turn;
* logits of a forward through a restored cache equal a full forward (also for models with
  sharper attention, where a slightly wrong restored key would show).

Arithmetic the expectations rest on: after ``commit(out)`` with ``out`` of length ``L'`` the
store holds ``L' - 1`` tokens of that conversation (for beams: the ``L`` prompt tokens, the only
KV the beams share), so the next ``open`` of a longer input of length ``L`` restores
``min(L' - 1, L - 1)`` tokens. ``BLOCK`` is small so that every turn has full blocks and a
partial tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, RepetitionPenaltyLogitsProcessor

from conftest import ARCHITECTURES, make_model, random_ids
from tierkv import TieredCache, TieredStore

BLOCK = 8
NEW = 5
PROMPT = 21  # 2 full blocks + a partial tail of 5
USER = (6, 7, 5)  # "user" tokens appended before turns 2, 3, 4

# Budgets that force where restored blocks rest. (device has no disk tier; host and disk do.)
TIERS: dict[str, dict[str, Any]] = {
    "device": dict(device_budget="1GiB", host_budget="1GiB", disk=False),
    "host": dict(device_budget=0, host_budget="1GiB", disk=True),
    "disk": dict(device_budget=0, host_budget=0, disk=True),
}


# -- helpers ----------------------------------------------------------------------------------------
def new_store(tmp_path: Path, tier: str, name: str = "kv") -> TieredStore:
    spec = TIERS[tier]
    path = tmp_path / name if spec["disk"] else None
    return TieredStore(path, device="cpu", device_budget=spec["device_budget"], host_budget=spec["host_budget"],
                       block_size=BLOCK)


def only(tier: str, n: int) -> dict[str, int]:
    """``restored_from`` with all ``n`` tokens from ``tier``."""
    return {"device": 0, "host": 0, "disk": 0, tier: n}


def user_tokens(turn: int, seed: int = 100) -> torch.Tensor:
    return random_ids(USER[turn], seed + turn)


def greedy(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def greedy_turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, session: str) -> torch.Tensor:
    """One greedy turn of ``session`` through ``store``, committed whole; its ids."""
    cache = store.open(model, ids, session=session)
    out = greedy(model, ids, past_key_values=cache)
    assert cache.commit(out) == out.shape[1] - 1
    return out


def kept_by_commit(model: torch.nn.Module, ids: torch.Tensor, out: torch.Tensor) -> int:
    """The tokens a commit keeps: all but the last id, up to the first one that generate() masked
    in the prompt (its pad_token_id, where that is not an eos id): KV from there on depends on
    the mask, not on the ids alone."""
    config = model.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    n = out.shape[1] - 1
    if config.pad_token_id is not None and config.pad_token_id not in eos:
        where = torch.nonzero(ids[0] == config.pad_token_id)
        if len(where):
            n = min(n, int(where[0, 0]))
    return n


def assert_tokens_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}:\n tierkv {actual.tolist()}\n plain  {expected.tolist()}"


def assert_opened(cache: TieredCache, tier: str, n: int) -> None:
    assert isinstance(cache, TieredCache)
    assert cache.restored_tokens == n
    assert cache.restored_from == only(tier, n)


def assert_holds(cache: TieredCache, out: torch.Tensor) -> None:
    """After generate the cache holds KV for every id but the last one."""
    assert cache.get_seq_length() == out.shape[1] - 1


# -- 1. three turns, every architecture, every tier -------------------------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_three_turns_equal_plain_generate(tiny_model, tmp_path: Path, arch: str, tier: str) -> None:
    model = tiny_model(arch)
    reused = DynamicCache(config=model.config)
    ids = random_ids(PROMPT, seed=1)
    expected_restored = 0
    hits = misses = 0
    masked = False  # a turn whose prompt held the pad id: the tiny phi3 generates its pad, 0
    with new_store(tmp_path, tier) as store:
        for turn in range(3):
            no_cache = greedy(model, ids)
            with_reused = greedy(model, ids, past_key_values=reused)
            assert_tokens_equal(with_reused, no_cache, f"{arch} turn {turn}: reused DynamicCache vs no cache")

            cache = store.open(model, ids, session="alice")
            assert_opened(cache, tier, expected_restored)
            out = greedy(model, ids, past_key_values=cache)
            assert_tokens_equal(out, no_cache, f"{arch}/{tier} turn {turn}")
            assert_holds(cache, out)
            kept = kept_by_commit(model, ids, out)
            assert cache.commit(out) == kept

            hits += expected_restored
            misses += ids.shape[1] - expected_restored
            stats = store.stats()
            assert stats["hits"] == only(tier, hits)
            assert stats["misses"] == misses
            # The conversation's KV rests, whole, in the tier the budgets force: ceil(n / BLOCK)
            # blocks (a longer tail replaced the previous turn's), and nothing where the budget is 0.
            blocks = -(-kept // BLOCK)
            at_rest = {"device": stats["device"]["blocks"], "host": stats["host"]["blocks"],
                       "disk": stats["disk"]["blocks"]}
            expected = only(tier, blocks)
            if TIERS[tier]["disk"]:
                expected["disk"] = blocks  # write-through: every block is on disk too
            assert at_rest == expected
            for name in ("device", "host"):
                if at_rest[name] == 0:
                    assert stats[name]["bytes"] == 0
            # The next turn: the whole conversation so far, plus a few new user tokens.
            next_ids = torch.cat([out, user_tokens(turn)], dim=1)
            expected_restored = min(kept, next_ids.shape[1] - 1)
            masked |= kept < out.shape[1] - 1
            ids = next_ids
    if not masked:
        # Turns 2 and 3 restored all but the last token of the output of the turn before.
        assert hits == (PROMPT + NEW - 1) + (PROMPT + 2 * NEW + USER[0] - 1)


# -- 2. restart in a new process ------------------------------------------------------------------
RESTART_SCRIPT = Path(__file__).with_name("_restart_child.py")


def test_restart_in_new_process_restores_from_disk(tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "kv"
    budgets = dict(device="cpu", device_budget="1GiB", host_budget="1GiB", block_size=BLOCK)
    conversations: dict[str, torch.Tensor] = {}
    # Two turns per architecture in this process, then flush and close.
    store = TieredStore(path, **budgets)
    for arch in ARCHITECTURES:
        model = tiny_model(arch)
        ids = random_ids(PROMPT, seed=2)
        for turn in range(2):
            cache = store.open(model, ids, session=f"s-{arch}")
            out = greedy(model, ids, past_key_values=cache)
            assert_tokens_equal(out, greedy(model, ids), f"{arch} turn {turn} before restart")
            assert cache.commit(out) == out.shape[1] - 1
            ids = torch.cat([out, user_tokens(turn, seed=200)], dim=1)
        conversations[arch] = ids
    store.flush()
    store.close()

    spec = {"path": str(path), "block_size": BLOCK, "new_tokens": NEW, "session_prefix": "s-",
            "conversations": {arch: ids[0].tolist() for arch, ids in conversations.items()}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different hash() than ours must not matter
    proc = subprocess.run([sys.executable, str(RESTART_SCRIPT), str(spec_file)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(lines[0].removeprefix("RESULT "))
    assert report["corrupt"] == 0

    total = 0
    outs: dict[str, torch.Tensor] = {}
    for arch in ARCHITECTURES:
        got = report["results"][arch]
        ids = conversations[arch]
        n = ids.shape[1] - USER[1] - 1  # the turn-2 output, less its last token
        total += n
        assert (arch, got["restored_tokens"], got["restored_from"]) == (arch, n, only("disk", n))
        plain_here = greedy(tiny_model(arch), ids)
        assert got["plain"] == plain_here[0].tolist(), f"{arch}: the child rebuilt another model"
        assert got["tierkv"] == got["plain"], f"{arch}: output after restart differs from plain generate"
        assert got["seq_length"] == len(got["tierkv"]) - 1
        assert got["committed"] == len(got["tierkv"]) - 1
        outs[arch] = torch.tensor([got["tierkv"]])
    assert report["hits"] == only("disk", total)

    # What the child committed survives its close: restore it once more here, from disk.
    with TieredStore(path, **budgets) as store:
        for arch in ARCHITECTURES:
            model = tiny_model(arch)
            ids = torch.cat([outs[arch], user_tokens(2, seed=200)], dim=1)
            cache = store.open(model, ids, session=f"s-{arch}")
            assert_opened(cache, "disk", outs[arch].shape[1] - 1)
            out = greedy(model, ids, past_key_values=cache)
            assert_tokens_equal(out, greedy(model, ids), f"{arch} after the second reopen")
            assert_holds(cache, out)


# -- 3. keyword forms -----------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["past_key_values", "cache"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cache_keyword_forms(tiny_model, tmp_path: Path, arch: str, form: str) -> None:
    model = tiny_model(arch)
    ids = random_ids(PROMPT, seed=3)
    with new_store(tmp_path, "host") as store:
        expected_restored = 0
        for turn in range(3):
            cache = store.open(model, ids, session="kw")
            assert_opened(cache, "host", expected_restored)
            out = greedy(model, ids, **{form: cache})
            assert_tokens_equal(out, greedy(model, ids), f"{arch} {form}= turn {turn}")
            # The cache was the one generate used: it grew to the whole output.
            assert_holds(cache, out)
            assert cache.commit(out) == out.shape[1] - 1
            expected_restored = out.shape[1] - 1
            ids = torch.cat([out, user_tokens(turn, seed=300)], dim=1)


# -- 4. generation modes through a restored cache ------------------------------------------------
MODES: dict[str, dict[str, Any]] = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, top_p=1.0),
    "beam": dict(do_sample=False, num_beams=3),
    "beam_2_sequences": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
    "assistant": dict(do_sample=False),  # assistant_model added per run
}
SEED = 1234


def run_mode(model: torch.nn.Module, arch: str, mode: str, ids: torch.Tensor, **cache_kw: Any) -> Any:
    kwargs = dict(MODES[mode])
    if mode == "assistant":
        # A fresh assistant per run: assisted generation adapts its assistant's settings.
        kwargs["assistant_model"] = make_model(arch, seed=1)
    torch.manual_seed(SEED)
    return model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True,
                          **kwargs, **cache_kw)


# Every mode for three position schemes (RoPE, learned absolute, Falcon's rotary) from disk, and
# llama's from the device and host tiers too.
# Sliding windows too: in every layer (from the host tier), beside full attention (from disk).
MODE_CASES = [(arch, "disk") for arch in ("llama", "gpt2", "falcon")] + [("llama", "device"), ("llama", "host")]
MODE_CASES += [("gemma3_text", "disk"), ("mistral_window", "host"), ("gemma4_text", "disk"), ("gemma4_text", "device")]
# Latent attention's keys and values of other widths (a pair per layer, not one tensor): beams and
# several sequences repeating a restored row, prompt lookup and an assistant cropping it, read in
# place from disk (the first forward of several rows joins the buffer instead) and from the host tier.
MODE_CASES += [("deepseek_v3", "disk"), ("deepseek_v3", "host")]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("arch", "tier"), MODE_CASES, ids=["-".join(case) for case in MODE_CASES])
def test_generation_modes_with_restored_cache(tiny_model, tmp_path: Path, arch: str, tier: str, mode: str) -> None:
    model = tiny_model(arch)
    with new_store(tmp_path, tier) as store:
        ids = random_ids(PROMPT, seed=4)
        out = greedy_turn(store, model, ids, "modes")

        # The user quotes an earlier span: its last bigram occurs earlier, so prompt lookup has
        # candidates to propose.
        ids = torch.cat([out, ids[:, 3:9]], dim=1)
        plain = run_mode(model, arch, mode, ids)
        cache = store.open(model, ids, session="modes")
        assert_opened(cache, tier, out.shape[1] - 1)
        got = run_mode(model, arch, mode, ids, past_key_values=cache)
        assert_tokens_equal(got.sequences, plain.sequences, f"{arch} {mode}")
        rows = MODES[mode].get("num_return_sequences", 1)
        assert got.sequences.shape[0] == rows
        assert len(got.logits) == len(plain.logits) > 0
        for step, (a, b) in enumerate(zip(got.logits, plain.logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{arch} {mode} step {step}: {m}")
        assert_holds(cache, got.sequences)
        if mode == "sample":
            # Guard: the sample is not simply the greedy answer, so equal seeds were needed.
            assert not torch.equal(got.sequences, greedy(model, ids))

        # Beams share only the prompt's KV; every other mode leaves the whole output's.
        stored = ids.shape[1] if "num_beams" in MODES[mode] else got.sequences.shape[1] - 1
        assert cache.commit(got.sequences) == stored

        ids = torch.cat([got.sequences[:1], user_tokens(1, seed=400)], dim=1)
        cache = store.open(model, ids, session="modes")
        assert_opened(cache, tier, stored)
        out = greedy(model, ids, past_key_values=cache)
        assert_tokens_equal(out, greedy(model, ids), f"{arch} turn after {mode}")
        assert_holds(cache, out)
        assert cache.commit(out) == out.shape[1] - 1


# -- 5. logits ------------------------------------------------------------------------------------
# The default tiny models attend almost uniformly, so a small error in restored keys moves their
# logits by only ~1e-5; "sharp" models (10x the init scale) move by 2e-4..1.5e-3 for a 1e-3 key
# error while restored and recomputed logits still agree to ~2e-6.
_INIT_FIELD = {"opt": "init_std"}
LOGIT_CASES = [(arch, tier, "default") for arch in ARCHITECTURES for tier in TIERS]
LOGIT_CASES += [(arch, "disk", "sharp") for arch in ARCHITECTURES]


@pytest.mark.parametrize(("arch", "tier", "init"), LOGIT_CASES, ids=["-".join(case) for case in LOGIT_CASES])
def test_logits_through_restored_cache_equal_full_forward(tiny_model, tmp_path: Path, arch: str, tier: str,
                                                          init: str) -> None:
    overrides = {_INIT_FIELD.get(arch, "initializer_range"): 0.1} if init == "sharp" else {}
    model = tiny_model(arch, **overrides)
    with new_store(tmp_path, tier) as store:
        ids = random_ids(PROMPT, seed=5)
        cache = store.open(model, ids)
        out = greedy(model, ids, past_key_values=cache)
        assert cache.commit(out) == out.shape[1] - 1

        ids = torch.cat([out, user_tokens(0, seed=500)], dim=1)
        L = ids.shape[1]
        cache = store.open(model, ids)
        n = cache.restored_tokens
        assert_opened(cache, tier, out.shape[1] - 1)
        with torch.no_grad():
            full = model(ids).logits
            part = model(ids[:, n:], past_key_values=cache).logits
            alone = model(ids[:, n:]).logits
        assert part.shape == (1, L - n, full.shape[-1])
        torch.testing.assert_close(part[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part, full[:, n:], rtol=1e-5, atol=1e-5)
        # Guard: the restored prefix matters, so the comparison above can fail.
        assert (alone[:, -1] - full[:, -1]).abs().max() > 1e-2
        assert cache.get_seq_length() == L

        # A cache filled by a plain forward holds all L tokens; the next turn restores them all.
        assert cache.commit(ids) == L
        longer = torch.cat([ids, user_tokens(1, seed=500)], dim=1)
        cache = store.open(model, longer)
        assert_opened(cache, tier, L)
        got = greedy(model, longer, past_key_values=cache)
        assert_tokens_equal(got, greedy(model, longer), f"{arch}/{tier} after a forward-filled commit")


# -- 5b. generate() options that read the whole conversation ---------------------------------------
# Logits processors and stopping criteria read all of generate()'s ids, while the model computes
# only those past the restored prefix: each option through a restored cache equals plain generate,
# scores included, and the first step's scores show the option saw the restored tokens.
def _options(ids: torch.Tensor, eos: int) -> dict[str, dict[str, Any]]:
    return {
        "repetition_penalty": dict(repetition_penalty=0.2),
        "no_repeat_ngram_size": dict(repetition_penalty=0.2, no_repeat_ngram_size=1),
        "sampled_penalties": dict(do_sample=True, repetition_penalty=0.2, no_repeat_ngram_size=2),
        # max_length counts the whole conversation; min_new_tokens holds back an eos greedy emits first.
        "min_new_tokens_max_length": dict(max_length=ids.shape[1] + NEW, min_new_tokens=NEW - 1, eos_token_id=eos),
    }


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_options_reading_the_whole_conversation_equal_plain_generate(tiny_model, tmp_path: Path, arch: str,
                                                                      tier: str) -> None:
    model = tiny_model(arch)
    with new_store(tmp_path, tier) as store:
        ids = random_ids(PROMPT, seed=11)
        out = greedy_turn(store, model, ids, "opts")
        ids = torch.cat([out, random_ids(6, seed=102)], dim=1)
        restored = out.shape[1] - 1
        only_restored = set(ids[0, :restored].tolist()) - set(ids[0, restored:].tolist())
        eos = int(greedy(model, ids)[0, ids.shape[1]])
        for name, options in _options(ids, eos).items():
            kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
            kwargs.update(options)
            if "max_length" not in kwargs:
                kwargs["max_new_tokens"] = NEW
            torch.manual_seed(SEED)
            plain = model.generate(ids, **kwargs)
            cache = store.open(model, ids, session=name)
            assert_opened(cache, tier, restored)
            torch.manual_seed(SEED)
            got = model.generate(ids, past_key_values=cache, **kwargs)
            assert_tokens_equal(got.sequences, plain.sequences, f"{arch}/{tier} {name}")
            assert len(got.scores) == len(plain.scores) == got.sequences.shape[1] - ids.shape[1]
            for step, (a, b, c, d) in enumerate(zip(got.scores, plain.scores, got.logits, plain.logits)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} scores {step}: {m}")
                torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} logits {step}: {m}")
            reply = got.sequences[0, ids.shape[1]:].tolist()
            first = got.scores[0][0]
            if name == "repetition_penalty":
                # Guard: the penalty reached the restored prefix (its tokens' scores), not only
                # the ids past it.
                penalty = RepetitionPenaltyLogitsProcessor(0.2)
                torch.testing.assert_close(first, penalty(ids, got.logits[0].clone())[0])
                assert not torch.allclose(first, penalty(ids[:, restored:], got.logits[0].clone())[0])
            elif name == "no_repeat_ngram_size":
                assert torch.isinf(first[sorted(only_restored)]).all()
                assert not set(reply) & set(ids[0].tolist()), "a token of the conversation repeated"
            elif name == "min_new_tokens_max_length":
                # Greedy's first token is that eos: held back for NEW - 1 tokens, to max_length.
                assert len(reply) == NEW and eos not in reply[:NEW - 1]
            # The whole output object is what a chatbot hands back. (Forgotten after: the next
            # option restores the first turn only.)
            assert cache.commit(got) == got.sequences.shape[1] - 1
            assert store.forget(session=name) > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_in_a_thread_streaming_as_chat_servers_do_equals_plain_generate(tiny_model, tmp_path: Path,
                                                                                 arch: str) -> None:
    """transformers' chat recipe: ``generate`` in a ``Thread`` feeding a ``TextIteratorStreamer``,
    the caller reading the reply as it comes; the cache opened in the caller's thread. The hook's
    checks (kernel switches read in the forward's thread) run in the other; every turn restores
    from disk, streams plain's tokens and commits the ids the thread returned."""
    import threading

    from transformers import TextIteratorStreamer

    class Ids:  # the streamer's tokenizer: a token per word
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            return "".join(f" {i}" for i in ids)

    model = tiny_model(arch)
    ids = random_ids(PROMPT, seed=12)
    expected_restored = 0
    with new_store(tmp_path, "disk") as store:
        for turn in range(3):
            cache = store.open(model, ids, session="streamed")
            assert_opened(cache, "disk", expected_restored)
            streamer = TextIteratorStreamer(Ids(), skip_prompt=True, timeout=60)
            returned: list[Any] = []

            def run(ids: torch.Tensor = ids, cache: TieredCache = cache, streamer: Any = streamer) -> None:
                try:
                    returned.append(greedy(model, ids, past_key_values=cache, streamer=streamer))
                except Exception as exc:  # raised here, in the test's thread, rather than a hang
                    returned.append(exc)
                    streamer.end()

            thread = threading.Thread(target=run)
            thread.start()
            shown = "".join(streamer)
            thread.join()
            if isinstance(returned[0], Exception):
                raise returned[0]
            plain = greedy(model, ids)
            assert_tokens_equal(returned[0], plain, f"{arch} streamed turn {turn}")
            assert shown.split() == [str(i) for i in plain[0, ids.shape[1]:].tolist()]
            assert cache.commit(returned[0]) == plain.shape[1] - 1
            expected_restored = plain.shape[1] - 1
            ids = torch.cat([plain, user_tokens(turn, seed=1200)], dim=1)



# -- 6. decoders taken from encoder-decoder families, and decoders built with cross-attention --------
# BartForCausalLM and its kin map num_hidden_layers to encoder_layers, which the decoder-only model
# does not build: the cache must have decoder_layers layers. GPT-2 and BERT built with
# add_cross_attention (used without encoder states, as a plain LM) wrap the cache in an
# EncoderDecoderCache, which generate() then feeds back at every later step.
DECODER_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "bart-1enc-3dec": ("bart", dict(d_model=64, encoder_layers=1, decoder_layers=3, encoder_attention_heads=4,
                                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128), 3),
    "blenderbot-3enc-2dec": ("blenderbot", dict(d_model=64, encoder_layers=3, decoder_layers=2,
                                                encoder_attention_heads=4, decoder_attention_heads=4,
                                                encoder_ffn_dim=128, decoder_ffn_dim=128), 2),
    "gpt2-cross-attention": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, add_cross_attention=True), 2),
    "bert-cross-attention": ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, is_decoder=True, add_cross_attention=True), 2),
}


@pytest.mark.parametrize("case", list(DECODER_CASES))
def test_decoders_of_other_families_equal_plain_generate(tmp_path: Path, case: str) -> None:
    model_type, fields, layers = DECODER_CASES[case]
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=512, **fields)).eval()
    ids = random_ids(PROMPT, seed=7)
    expected_restored = 0
    with new_store(tmp_path, "disk") as store:
        for turn in range(3):
            cache = store.open(model, ids, session="dec")
            assert len(cache.layers) == layers
            assert_opened(cache, "disk", expected_restored)
            out = greedy(model, ids, past_key_values=cache)
            # A DynamicCache without a config grows a layer per layer the model feeds (the one
            # generate() would build from this config has the encoder's count of layers).
            assert_tokens_equal(out, greedy(model, ids, past_key_values=DynamicCache()), f"{case} turn {turn}")
            assert_holds(cache, out)
            assert cache.commit(out) == out.shape[1] - 1
            expected_restored = out.shape[1] - 1
            ids = torch.cat([out, user_tokens(turn, seed=700)], dim=1)


@pytest.mark.parametrize("decoding", ["prompt_lookup", "assistant"])
def test_assisted_decoding_through_the_cross_attention_wrapper_gpt2_puts_round_the_cache(tmp_path: Path,
                                                                                        decoding: str) -> None:
    """GPT-2 built with add_cross_attention wraps the cache it is given in an EncoderDecoderCache,
    which assisted decoding crops: transformers' wrapper refused to crop anything but a
    DynamicCache (a TypeError where a DynamicCache runs). Exact through disk, turn after turn."""
    model_type, fields, _ = DECODER_CASES["gpt2-cross-attention"]
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=512, **fields)).eval()
    ids = random_ids(PROMPT, seed=7)
    # The user quotes an earlier span: prompt lookup has candidates to propose, and crops the rejected.
    ids = torch.cat([ids, ids[:, 3:9]], dim=1)
    expected_restored = 0
    with new_store(tmp_path, "disk") as store:
        for turn in range(2):
            kwargs: dict[str, Any] = dict(prompt_lookup_num_tokens=3) if decoding == "prompt_lookup" else \
                dict(assistant_model=make_model("gpt2", seed=1))
            cache = store.open(model, ids, session="wrapped")
            assert_opened(cache, "disk", expected_restored)
            got = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True, **kwargs)
            plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                                   output_logits=True, **kwargs)
            assert_tokens_equal(got.sequences, plain.sequences, f"{decoding} turn {turn}")
            for a, b in zip(got.logits, plain.logits):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert cache.commit(got.sequences) == got.sequences.shape[1] - 1
            expected_restored = got.sequences.shape[1] - 1
            ids = torch.cat([got.sequences, user_tokens(turn, seed=700)], dim=1)


def test_a_model_feeding_more_layers_than_its_config_declares_is_refused(tmp_path: Path) -> None:
    model = make_model("gpt2")
    model.config.n_layer = 1  # GPT-2 still runs its 2 layers (Llama would run the first only)
    with TieredStore(None, device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, random_ids(PROMPT, seed=8))
        assert len(cache.layers) == 1
        with pytest.raises(ValueError, match="KV for layer 1, but its config declares 1 layers.*DynamicCache"):
            greedy(model, random_ids(PROMPT, seed=8), past_key_values=cache)


# -- 7. a model that keeps some of its weights in float32 -----------------------------------------
def test_a_model_keeping_weights_in_float32_is_exact_in_bf16(tmp_path: Path) -> None:
    """Loaded in bf16, Ergo keeps its embeddings and norms in float32 (``_keep_in_fp32_modules_strict``),
    and computes its KV in bf16: commit refused it as autocast's, its first parameter being float32
    (found by helper-51's sweep). Exact through disk and a reopened store."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "ergo" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Ergo (5.25 on)")
    config = AutoConfig.for_model("ergo", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, first_dense_intermediate_size=128, moe_intermediate_size=32,
                                  shared_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                  layer_types=["full_attention"] * 2, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    dtypes = [p.dtype for p in model.parameters()]
    assert dtypes[0] == torch.float32 and dtypes.count(torch.bfloat16) > len(dtypes) // 3  # the mix in question
    ids = random_ids(PROMPT, seed=9)
    expected_restored = 0
    for turn in range(3):
        with new_store(tmp_path, "disk") as store:  # closed and reopened each turn: restored from the file
            cache = store.open(model, ids, session="mixed")
            assert_opened(cache, "disk", expected_restored)
            out = greedy(model, ids, past_key_values=cache)
            assert_tokens_equal(out, greedy(model, ids), f"ergo bf16 turn {turn}")
            assert cache.commit(out) == out.shape[1] - 1
        expected_restored = out.shape[1] - 1
        ids = torch.cat([out, user_tokens(turn, seed=900)], dim=1)
    # Its KV comes from bf16 matmuls: float32's matmul precision is not its fingerprint's.
    from tierkv.cache import describe_model

    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert describe_model(model).precision is None
    finally:
        torch.set_float32_matmul_precision(saved)
