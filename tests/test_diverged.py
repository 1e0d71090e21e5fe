"""Why a returning session restored less than it sent: ``cache.diverged_at``, the position where its
ids first differ from the conversation the session committed last, and ``stats()``'s
``diverged_turns``/``diverged_tokens`` (the stored tokens past it computed again)."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import make_model, random_ids
from tierkv import TieredStore

B = 8


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model("llama")


def turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, session: str | None = "alice",
         tenant: str | None = None, max_new_tokens: int = 4):
    cache = store.open(model, ids, session=session, tenant=tenant)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
    cache.commit(out)
    return cache, out


def plain_next_turn(store: TieredStore, model: torch.nn.Module) -> torch.Tensor:
    """Two turns of alice; the ids of a third that follows the second's output."""
    _, out = turn(store, model, random_ids(21))
    _, out = turn(store, model, torch.cat([out, random_ids(6, seed=1)], 1))
    return torch.cat([out, random_ids(5, seed=2)], 1)


def edited(ids: torch.Tensor, at: int) -> torch.Tensor:
    ids = ids.clone()
    ids[0, at] = 3 if int(ids[0, at]) != 3 else 4
    return ids


def counts(store: TieredStore) -> tuple[int, int]:
    stats = store.stats()
    return stats["diverged_turns"], stats["diverged_tokens"]


def test_a_returning_turn_that_extends_its_conversation_has_not_diverged(model):
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        cache, _ = turn(store, model, ids)
        assert cache.restored_tokens == ids.shape[1] - 5 - 1  # the last turn's output but its last id
        assert cache.diverged_at is None
        assert counts(store) == (0, 0)


@pytest.mark.parametrize("at", [0, 5, 8, 17, 30])
def test_an_edit_is_reported_where_it_is_with_the_tokens_it_cost(model, at):
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        stored = ids.shape[1] - 5 - 1  # the second turn's output but its last id
        cache = store.open(model, edited(ids, at), session="alice")
        assert cache.diverged_at == at
        assert cache.restored_tokens == at  # its common prefix, as before
        assert counts(store) == (1, stored - at)
        # Another session, a turn of none, and a new one: nothing of alice's to differ from.
        for session in ("bob", None):
            assert store.open(model, edited(ids, at), session=session).diverged_at is None
        assert counts(store) == (1, stored - at)


def test_ids_shorter_than_the_stored_conversation_have_not_diverged(model):
    # A regenerated reply: the conversation up to the user's last message, a prefix of what is stored.
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        for length in (2, 9, 20, 30):
            cache = store.open(model, ids[:, :length], session="alice")
            assert cache.restored_tokens == length - 1 and cache.diverged_at is None
        # Differing only at the last id, which is computed anyway: nothing lost.
        stored = ids.shape[1] - 5 - 1
        assert store.open(model, edited(ids[:, :stored + 1], stored), session="alice").diverged_at is None
        assert store.open(model, edited(ids[:, :stored], stored - 1), session="alice").diverged_at is None
        assert counts(store) == (0, 0)


def test_the_latest_conversation_counts_not_an_older_branch(model):
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        branch = edited(ids, 12)
        cache, out = turn(store, model, branch)  # the user edited a message: the new branch is stored
        assert cache.diverged_at == 12
        # The next turn follows the new branch: the old one, still held, is no difference.
        cache, _ = turn(store, model, torch.cat([out, random_ids(3, seed=5)], 1))
        assert cache.diverged_at is None
        assert counts(store)[0] == 1


def test_a_turn_back_on_an_older_branch_it_restores_whole_has_not_diverged(model):
    # A chat UI's branch switcher: after an edit, the user goes back to the first version and goes
    # on from it. Its blocks are still stored and restore in full: nothing was computed again, and
    # reporting it counted every token of the newer branch past the edit as lost.
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        stored = ids.shape[1] - 5 - 1
        cache, _ = turn(store, model, edited(ids, 12))
        assert cache.diverged_at == 12 and counts(store) == (1, stored - 12)
        cache = store.open(model, ids, session="alice")
        assert cache.restored_tokens == stored and cache.diverged_at is None
        # Another session's conversation, which alice's ids now follow, is as good as her own.
        _, out = turn(store, model, random_ids(19, seed=7), session="bob")
        cache, _ = turn(store, model, torch.cat([out, random_ids(3, seed=8)], 1))
        assert cache.restored_tokens == out.shape[1] - 1 and cache.diverged_at is None
        assert counts(store) == (1, stored - 12)
        # Going back restores the older branch only as far as it agrees: a difference past there
        # is a difference again, from the conversation alice committed last.
        cache = store.open(model, edited(torch.cat([out, random_ids(3, seed=8)], 1), 20), session="alice")
        assert cache.diverged_at == 20 and cache.restored_tokens == 20


def test_a_conversation_differing_inside_its_last_partial_block(model):
    # The stored tail is a partial block: the difference is found inside it, not at its start.
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        stored = ids.shape[1] - 5 - 1
        assert stored % B, "the second turn must end in a partial block"
        at = stored - 1
        assert at // B == (stored - 1) // B and at % B
        cache = store.open(model, edited(ids, at), session="alice")
        assert cache.diverged_at == at and counts(store) == (1, 1)


def test_tenants_and_models_keep_their_own_conversations(model):
    other = make_model("llama", seed=1)
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        # acme's alice is another session; the same name under another model is no conversation of
        # this model's (its chain hangs under another root).
        assert store.open(model, edited(ids, 4), session="alice", tenant="acme").diverged_at is None
        assert store.open(other, edited(ids, 4), session="alice").diverged_at is None
        assert store.open(model, edited(ids, 4), session="alice").diverged_at == 4


def test_a_forgotten_session_or_a_dropped_block_is_no_difference(model):
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        store.forget(session="alice")
        assert store.open(model, edited(ids, 4), session="alice").diverged_at is None
    # Budgets that keep only part of the conversation (no disk): its last block is gone.
    with TieredStore(None, device="cpu", block_size=B, device_budget=0, host_budget="3KiB") as store:
        ids = plain_next_turn(store, model)
        assert store.stats()["host"]["blocks"] < (ids.shape[1] - 6) // B + 1
        assert store.open(model, edited(ids, 4), session="alice").diverged_at is None
        assert counts(store) == (0, 0)


def test_after_a_restart_a_session_is_compared_from_its_next_commit(model, tmp_path):
    # Which of a session's conversations is its latest is not on disk: no answer rather than a
    # guess, which took an older conversation for it where the latest ended inside it.
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, edited(ids, 10), session="alice")
        assert cache.restored_tokens == 10 and cache.diverged_at is None
        assert counts(store) == (0, 0)
        _, out = turn(store, model, ids)
        assert store.open(model, edited(out, 20), session="alice").diverged_at == 20
        assert store.open(model, out, session="alice").diverged_at is None


def test_after_a_restart_a_conversation_ending_inside_an_older_one_is_no_difference(model, tmp_path):
    # A reply regenerated shorter (a smaller max_new_tokens): the latest conversation ends inside
    # the first one's last full block, and the reopen lets go of its tail, which that block
    # restores. Taken for the latest, the first conversation made the next turn, going on from the
    # shorter reply, reported as diverging where it went on (helper-105).
    prompt = random_ids(27)
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        _, first = turn(store, model, prompt, max_new_tokens=10)
        _, out = turn(store, model, prompt, max_new_tokens=5)
        assert torch.equal(first[:, :out.shape[1]], out) and (out.shape[1] - 1) % B  # a partial tail
        ids = torch.cat([out, random_ids(6, seed=9)], 1)
        assert int(ids[0, out.shape[1]]) != int(first[0, out.shape[1]])
        assert store.open(model, ids, session="alice").diverged_at is None
    with TieredStore(tmp_path / "kv", device="cpu", block_size=B) as store:
        cache = store.open(model, ids, session="alice")
        assert cache.restored_tokens == out.shape[1] and cache.diverged_at is None
        assert counts(store) == (0, 0)
        # Its next commit tells the store again.
        _, out = turn(store, model, ids)
        assert store.open(model, edited(out, 30), session="alice").diverged_at == 30


def test_the_first_difference_is_logged_at_info_then_at_debug(model, caplog):
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        given = edited(ids, 9)
        with caplog.at_level(logging.DEBUG, logger="tierkv"):
            store.open(model, given, session="alice")
            store.open(model, edited(ids, 13), session="alice")
        said = [r for r in caplog.records if "differ from the conversation it committed last" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.INFO, logging.DEBUG]
        first = said[0].getMessage()
        assert f"at token 9 (id {int(given[0, 9])} given, {int(ids[0, 9])} stored)" in first
        assert "chat template" in first and "stats()['diverged_turns']" in first
        # The remedy, not only the causes: what to pass instead.
        assert "keep the ids generate() returned and append the new message's ids to them" in first
        assert "further ones are logged at DEBUG" in first and "further" not in said[1].getMessage()
        assert "alice" not in first  # session names stay out of the logs


def test_commit_after_a_difference_keeps_the_new_conversation_exact(model):
    # The report changes nothing of the restore: the turn is exact against plain generate.
    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = edited(plain_next_turn(store, model), 11)
        cache, out = turn(store, model, ids)
        assert cache.diverged_at == 11
        plain = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, plain)


def test_metrics_export_the_counts(model):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tierkv.metrics import StoreCollector

    with TieredStore(None, device="cpu", block_size=B) as store:
        ids = plain_next_turn(store, model)
        store.open(model, edited(ids, 9), session="alice")
        store.open(model, edited(ids, 2), session="alice")
        registry = CollectorRegistry()
        registry.register(StoreCollector(store))
        found = {s.name: s.value for family in text_string_to_metric_families(generate_latest(registry).decode())
                 for s in family.samples}
        stored = ids.shape[1] - 5 - 1
        assert counts(store) == (2, 2 * stored - 11)
        assert (found["tierkv_diverged_turns_total"], found["tierkv_diverged_tokens_total"]) == (2, 2 * stored - 11)
