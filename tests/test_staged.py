"""A reply longer than a sliding layer's window: the tokens past the window and two margins leave
the device as the reply goes (``tierkv/staged.py``), ``commit`` stores them from there, and a crop
into them takes them back. Exactness against plain generate throughout, through a restart."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from conftest import SLIDING, kept_whole_and_next_turn_exact, raised_on_the_way_in, random_ids
from tierkv import TieredStore
from tierkv.cache import TieredSlidingLayer, _SharedLayer
from tierkv.staged import StagedTokens

BLOCK = 8
WINDOW = 12  # conftest's sliding shapes'
# What a sliding layer holds on the device at most in a decode step: its window, two margins (the
# store's block size) and the new token.
MOST_HELD = WINDOW - 1 + 2 * BLOCK + 1
REPLY = 60


def _most_held(cache: Any) -> list[int]:
    """The most tokens each sliding layer's keys (and the room they are views of) span after any
    update of the cache from now on: a list that grows as the forwards run."""
    most = [0]
    update = cache.update

    def watched(*args: Any, **kwargs: Any) -> Any:
        out = update(*args, **kwargs)
        for layer in cache.layers:
            if isinstance(layer, TieredSlidingLayer) and layer._keys is not None and layer._keys.dim() == 4:
                room = layer._room[0].shape[-2] if layer._room is not None else 0
                most[0] = max(most[0], layer._keys.shape[-2], room)
        return out

    cache.update = watched
    return most


def _sliding(cache: Any) -> list[TieredSlidingLayer]:
    return [layer for layer in cache.layers if isinstance(layer, TieredSlidingLayer)]


@pytest.mark.parametrize("arch", SLIDING)
def test_a_reply_past_the_window_leaves_the_device_and_every_later_turn_is_exact(tiny_model, tmp_path: Path,
                                                                                 arch: str) -> None:
    model = tiny_model(arch)
    ids = random_ids(20, seed=3)
    budgets = dict(device="cpu", block_size=BLOCK, device_budget=0, host_budget=0)
    with TieredStore(tmp_path / "kv", **budgets) as store:
        cache = store.open(model, ids, session="s")
        most = _most_held(cache)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=REPLY, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=REPLY, do_sample=False))
        # The first forward holds its 20 prompt tokens; every decode step after, a window and two
        # margins at most (the reply whole before: 79 tokens).
        assert 0 < most[0] <= max(MOST_HELD, ids.shape[1])
        for layer in _sliding(cache):
            assert layer._staged and layer._staged.start == 0 and layer._staged.end == layer._offset
            assert layer._offset + layer._keys.shape[-2] == out.shape[1] - 1
        assert cache.commit(out) == out.shape[1] - 1
    with TieredStore(tmp_path / "kv", **budgets) as store:  # a restart: every block read from disk
        later = torch.cat([out, random_ids(4, seed=4)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == out.shape[1] - 1
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(later, max_new_tokens=4, do_sample=False))
        # A conversation parting from the reply inside the tokens that left the device: the blocks
        # before the part are restored, their sliding layers' KV as the reply computed it.
        edited = torch.cat([out[:, :45], random_ids(3, seed=5)], dim=1)
        cache = store.open(model, edited)
        assert cache.restored_tokens >= 45  # a block restored in part too (an edit may repeat the next id)
        assert torch.equal(model.generate(edited, past_key_values=cache, max_new_tokens=4, do_sample=False),
                           model.generate(edited, max_new_tokens=4, do_sample=False))


def test_a_crop_into_the_tokens_off_the_device_takes_them_back_and_goes_on_exact(tiny_model, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("mistral_window")
    ids = random_ids(16, seed=6)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False)
        layer = _sliding(cache)[0]
        assert layer._staged and 25 < layer._offset + WINDOW - 1  # no window on the device at 25 tokens
        taken: list[int] = []
        unstage = TieredSlidingLayer._unstage
        monkeypatch.setattr(TieredSlidingLayer, "_unstage", lambda self: (taken.append(1), unstage(self))[1])
        cache.crop(-30)  # to 25 tokens: below what the device holds, above the first token held off it
        assert taken and not layer._staged and layer._offset == 0 and cache.get_seq_length() == 25
        # Room again for the tokens that follow, then off the device again as they pass the margins.
        again = torch.cat([out[:, :25], random_ids(3, seed=7)], dim=1)
        got = model.generate(again, past_key_values=cache, max_new_tokens=40, do_sample=False)
        assert torch.equal(got, model.generate(again, max_new_tokens=40, do_sample=False))
        assert layer._staged
        kept_whole_and_next_turn_exact(store, model, cache, got, seed=8)


def test_prompt_lookup_with_candidates_past_a_margin_is_exact_while_tokens_leave_the_device(
        tiny_model, tmp_path: Path) -> None:
    """Assisted decoding crops the candidates the model rejects, here more than a margin of them:
    never below what the device held before they were fed (a window and a margin), so with no
    tokens taken back."""
    model = tiny_model("mistral_window")
    # A prompt repeating itself: the lookup proposes its continuations, which the model rejects.
    ids = random_ids(30, seed=9).repeat(1, 3)
    options = dict(max_new_tokens=REPLY, do_sample=False, prompt_lookup_num_tokens=3 * BLOCK)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, **options)
        assert torch.equal(out, model.generate(ids, **options))
        assert _sliding(cache)[0]._staged
        kept_whole_and_next_turn_exact(store, model, cache, out, seed=10)


def test_beams_after_tokens_left_the_device_then_a_crop_into_them_in_every_row_are_exact(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("gemma3_text")
    taken: list[int] = []
    unstage = TieredSlidingLayer._unstage
    monkeypatch.setattr(TieredSlidingLayer, "_unstage",
                        lambda self: (taken.append(self._keys.shape[0]), unstage(self))[1])
    ids = random_ids(16, seed=11)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, ids, session="s")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False)
        assert _sliding(cache)[0]._staged
        # Another generate on the same cache, in beams: its rows all follow the one row held off
        # the device.
        more = torch.cat([out, random_ids(3, seed=12)], dim=1)
        beams = dict(max_new_tokens=6, do_sample=False, num_beams=3)
        got = model.generate(more, past_key_values=cache, **beams)
        assert torch.equal(got, model.generate(more, **beams))
        # A third, greedy: the beams' rows past the opened conversation are dropped (a crop to its
        # 16 tokens, in three rows, into the tokens off the device), then computed again.
        last = torch.cat([got, random_ids(2, seed=13)], dim=1)
        again = model.generate(last, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(again, model.generate(last, max_new_tokens=4, do_sample=False))
        assert 3 in taken
        kept_whole_and_next_turn_exact(store, model, cache, again, seed=14)


def test_a_dynamic_cache_made_of_it_holds_the_tokens_off_the_device_not_nan(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("gemma3_text")
    ids = random_ids(16, seed=15)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, ids)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False)
        plain = DynamicCache()  # every layer whole: the sliding layers' KV of every token
        with torch.no_grad():
            model(out[:, :-1], past_key_values=plain)
        for (keys, values, window), layer, whole in zip(cache, cache.layers, plain.layers):
            assert keys.shape[-2] == out.shape[1] - 1
            assert (window is not None) == isinstance(layer, TieredSlidingLayer)
            torch.testing.assert_close(keys, whole.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(values, whole.values, rtol=0, atol=1e-5)
        assert _sliding(cache)[0]._staged  # reading them left them where they were


def test_staged_tokens_keep_order_replace_an_add_made_again_and_refuse_gaps() -> None:
    staged = StagedTokens()
    assert not staged
    keys = torch.arange(2 * 10 * 3, dtype=torch.float32).view(1, 2, 10, 3)
    values = -keys
    staged.add(4, keys[:, :, :3], values[:, :, :3])
    staged.add(7, keys[:, :, 3:7], values[:, :, 3:7])
    assert (staged.start, staged.end) == (4, 11)
    k, v = staged.span(5, 9, torch.device("cpu"))
    assert torch.equal(k, keys[:, :, 1:5]) and torch.equal(v, values[:, :, 1:5])
    # Copies of their own: the room they came from is free to be written over.
    keys.add_(100)
    assert torch.equal(staged.span(4, 5, torch.device("cpu"))[0], keys[:, :, :1] - 100)
    keys.sub_(100)
    # An add made again from an earlier token (its caller cut short before it moved its offset).
    staged.add(6, keys[:, :, 2:8], values[:, :, 2:8])
    assert (staged.start, staged.end) == (4, 12)
    k, v = staged.span(4, 12, torch.device("cpu"))
    assert torch.equal(k, keys[:, :, :8]) and torch.equal(v, values[:, :, :8])
    with pytest.raises(ValueError, match="staged after tokens 4 to 12"):
        staged.add(13, keys[:, :, :1], values[:, :, :1])
    with pytest.raises(ValueError, match="asked of tokens 4 to 12"):
        staged.span(3, 6, torch.device("cpu"))
    staged.clear()
    assert not staged and (staged.start, staged.end) == (0, 0)
    staged.add(20, keys[:, :, :2], values[:, :, :2])  # empty again: any token starts it
    assert (staged.start, staged.end) == (20, 22)


def _layer_fed(upto: int, kv: tuple[torch.Tensor, torch.Tensor]) -> TieredSlidingLayer:
    """A sliding layer (the window of conftest's shapes, margins of ``BLOCK``) fed a prompt of 20
    tokens of ``kv``, then one token a step up to ``upto``."""
    layer = TieredSlidingLayer(WINDOW, BLOCK)
    for a, b in [(0, 20)] + [(t, t + 1) for t in range(20, upto)]:
        _feed(layer, kv, a, b)
    return layer


def _feed(layer: TieredSlidingLayer, kv: tuple[torch.Tensor, torch.Tensor], a: int, b: int) -> None:
    with torch.no_grad():
        layer.update(kv[0][:, :, a:b].clone(), kv[1][:, :, a:b].clone())


def _verify_holds(layer: TieredSlidingLayer, kv: tuple[torch.Tensor, torch.Tensor], upto: int) -> None:
    """The layer's tokens up to ``upto``, off the device and on it, are ``kv``'s, each once."""
    keys, values, at = layer.with_staged()
    assert torch.equal(keys, kv[0][:, :, at:upto]) and torch.equal(values, kv[1][:, :, at:upto])
    keys, values = layer.span(layer.held_from(), upto)
    assert torch.equal(keys, kv[0][0, :, layer.held_from():upto])
    assert torch.equal(values, kv[1][0, :, layer.held_from():upto])


STEPS = {"update", "_append", "add", "_kept_below", "_off_device", "span", "_unstage", "crop", "clear"}


# The step of the first hand-off (the window and two margins held), of a later one.
@pytest.mark.parametrize("upto", [WINDOW - 1 + 2 * BLOCK, WINDOW - 1 + 3 * BLOCK])
@pytest.mark.parametrize("then", ["read", "again"])
def test_a_handler_raising_anywhere_in_a_hand_off_leaves_every_token_held_once(upto: int, then: str) -> None:
    """A signal handler's exception (or out of memory: the new room's allocation) at every point
    of the decode step that hands tokens off the device: the layer holds each token once, read at
    once (``DynamicCache(cache)``, a crop into them) or after the step made again. An add cut short
    at its list's append held its chunk with the end short of it, and the add made again held those
    tokens twice (a crop into them then attended over the wrong tokens); an add whose layer had not
    moved its offset yet left nothing to read below it, and the read raised."""
    kv = torch.randn(1, 2, 120, 4, generator=torch.Generator().manual_seed(16)), \
        torch.randn(1, 2, 120, 4, generator=torch.Generator().manual_seed(17))
    prepared = _layer_fed(upto, kv)
    assert len(prepared._staged._chunks) == (upto > WINDOW - 1 + 2 * BLOCK)
    assert prepared._keys.shape[-2] == WINDOW - 1 + 2 * BLOCK  # the step fed next hands tokens off
    held: list[TieredSlidingLayer] = []

    @contextlib.contextmanager
    def step() -> Any:
        held[:] = [copy.deepcopy(prepared)]
        _feed(held[0], kv, upto, upto + 1)
        yield

    def check(sent: list) -> None:
        layer, n = held[0], upto + 1
        if then == "read":
            n = layer.get_seq_length()
            _verify_holds(layer, kv, n)
        elif layer.get_seq_length() == upto:
            _feed(layer, kv, upto, n)  # generate()'s next forward feeds the token again
        for t in range(n, n + 3 * BLOCK):
            _feed(layer, kv, t, t + 1)
        _verify_holds(layer, kv, n + 3 * BLOCK)
        layer.crop(WINDOW - n - 3 * BLOCK)  # every token back on the device
        assert not layer._staged
        _verify_holds(layer, kv, WINDOW)

    assert raised_on_the_way_in(step, check, within=STEPS) > 20


def test_a_handler_raising_anywhere_in_taking_tokens_back_leaves_every_token_held_once() -> None:
    """Alike in a crop into the tokens off the device: a handler's exception between the keys'
    taking them back and the tokens' clear() held them twice, and the next crop into them raised
    (``torch.cat`` of no tensors)."""
    kv = torch.randn(1, 2, 120, 4, generator=torch.Generator().manual_seed(18)), \
        torch.randn(1, 2, 120, 4, generator=torch.Generator().manual_seed(19))
    prepared = _layer_fed(64, kv)
    assert prepared._staged and prepared._offset > 30
    held: list[TieredSlidingLayer] = []

    @contextlib.contextmanager
    def crop() -> Any:
        held[:] = [copy.deepcopy(prepared)]
        held[0].crop(30 - 64)
        yield

    def check(sent: list) -> None:
        layer = held[0]
        _verify_holds(layer, kv, layer.get_seq_length())
        layer.crop(30 - layer.get_seq_length())
        for t in range(30, 30 + 3 * BLOCK):
            _feed(layer, kv, t, t + 1)
        _verify_holds(layer, kv, 30 + 3 * BLOCK)
        layer.crop(WINDOW - 30 - 3 * BLOCK)
        _verify_holds(layer, kv, WINDOW)

    # Points in the taking back alone: DynamicLayer's crop sets keys and values apart.
    assert raised_on_the_way_in(crop, check, within={"_unstage", "span", "clear", "_on_device"}) > 5


def test_a_decode_step_hands_off_a_margin_of_tokens_not_one_more(tiny_model, tmp_path: Path) -> None:
    """Each decode step that hands tokens off hands a margin (the store's block size) of them, as
    the layer's docstring says: it handed a margin and one more, which CUDA's caching host
    allocator, rounding pinned memory up to a power of two, held in twice the bytes (a block size
    of 256: 257 tokens in the room of 512)."""
    model = tiny_model("mistral_window")
    ids = random_ids(20, seed=20)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, ids)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=REPLY, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=REPLY, do_sample=False))
        for layer in _sliding(cache):
            counts = [(n, k.shape[-2], v.shape[-2]) for _, n, k, v, _ in layer._staged._chunks]
            assert len(counts) >= 5 and counts == [(BLOCK, BLOCK, BLOCK)] * len(counts)
            # What the device holds: from the window's first token, a margin and less ahead of it.
            assert WINDOW - 1 + BLOCK < layer._keys.shape[-2] <= WINDOW - 1 + 2 * BLOCK
        assert cache.commit(out) == out.shape[1] - 1


@pytest.mark.parametrize(("window", "margin"), [(12, BLOCK), (16 * BLOCK, BLOCK), (512, 32)])
def test_the_margin_is_a_block_or_a_sixteenth_of_the_window_where_that_is_more(tiny_model, tmp_path: Path,
                                                                                window: int, margin: int) -> None:
    """A hand-off copies the window and a margin into a new room: a margin of a block alone under a
    window of thousands copied hundreds of tokens a step."""
    model = tiny_model("mistral_window", sliding_window=window)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=BLOCK) as store:
        cache = store.open(model, random_ids(4, seed=16))
        assert [layer.margin for layer in _sliding(cache)] == [margin] * len(cache.layers)


@pytest.mark.parametrize(("arch", "window", "block"), [
    ("mistral_window", 100, 4), ("mistral_window", 120, 4), ("mistral_window", 200, 8),
    ("gemma4_text", 100, 4), ("llama4_text", 100, 4)])
def test_hand_offs_of_a_margin_other_than_the_block_are_exact_through_the_commit_and_a_restart(
        tiny_model, tmp_path: Path, arch: str, window: int, block: int) -> None:
    """A window of 16 blocks or more hands tokens off a sixteenth of it at a time (6, 7 and 12
    tokens here), so the hand-offs' edges fall inside the blocks ``commit`` stores: every hand-off
    is a margin, the reply is plain generate's, the commit keeps every token, and the next turn,
    after a restart, restores them all exactly (the property machine's windows are too short to
    hand off a margin other than the block)."""
    # Llama 4's chunk is the window its chunked layers hold (cache.WINDOWED).
    model = tiny_model(arch, **{"attention_chunk_size" if arch == "llama4_text" else "sliding_window": window})
    margin = window // 16
    assert margin > block and margin % block
    ids = random_ids(20, seed=21)
    reply = window + 4 * margin
    budgets = dict(device="cpu", block_size=block, device_budget=0, host_budget=0)
    with TieredStore(tmp_path / "kv", **budgets) as store:
        cache = store.open(model, ids, session="s")
        # min_new_tokens: the random model's eos would end the reply before the window.
        run = dict(max_new_tokens=reply, min_new_tokens=reply, do_sample=False)
        out = model.generate(ids, past_key_values=cache, **run)
        assert out.shape[1] == ids.shape[1] + reply and torch.equal(out, model.generate(ids, **run))
        for layer in _sliding(cache):
            assert layer.margin == margin
            counts = [(n, k.shape[-2], v.shape[-2]) for _, n, k, v, _ in layer._staged._chunks]
            assert len(counts) >= 2 and counts == [(margin, margin, margin)] * len(counts)
            assert layer._staged.end == layer._offset
            assert [start for start, *_ in layer._staged._chunks if start % block]  # edges inside blocks
            assert window - 1 + margin < layer._keys.shape[-2] <= window - 1 + 2 * margin
        assert cache.commit(out) == out.shape[1] - 1
    with TieredStore(tmp_path / "kv", **budgets) as store:  # every block read from disk
        later = torch.cat([out, random_ids(3, seed=22)], dim=1)
        cache = store.open(model, later, session="s")
        assert cache.restored_tokens == out.shape[1] - 1
        assert torch.equal(model.generate(later, past_key_values=cache, max_new_tokens=6, do_sample=False),
                           model.generate(later, max_new_tokens=6, do_sample=False))
        # The whole conversation again, and one parting from it inside the tokens handed off (the
        # window then reaches them): each layer's keys those plain transformers computes.
        edited = torch.cat([out[:, :4 * margin + 3], random_ids(3, seed=23)], dim=1)
        for conversation in (later, edited):
            reference = DynamicCache()
            with torch.no_grad():
                model(conversation[:, :-1], past_key_values=reference)
            cache = store.open(model, conversation, session="s")
            restored = cache.restored_tokens
            assert restored >= 4 * margin
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, _SharedLayer):
                    continue  # Gemma 4's last layers read another's KV
                start, keys = layer.held_from(), layer.keys
                assert start + keys.shape[-2] == restored and start <= max(0, restored - (window - 1))
                assert torch.allclose(keys, reference.layers[i].keys[:, :, start:restored], atol=1e-5, rtol=1e-4)
            assert torch.equal(model.generate(conversation, past_key_values=cache, max_new_tokens=6, do_sample=False),
                               model.generate(conversation, max_new_tokens=6, do_sample=False))
