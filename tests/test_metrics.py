"""Prometheus metrics (``tierkv.metrics``) and the library's logging.

Metrics are checked through the real HTTP endpoint ``serve`` opens, parsed with prometheus_client's
own parser, against ``store.stats()`` after a scenario that reaches every tier: a demotion device ->
host, a restart whose blocks come back from disk, and a corrupt record. Logging: one INFO line per
store open, one WARNING per kind of fault however many follow, and nothing printed by the library.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tierkv
from conftest import damage_in_place, flipped, random_ids
from tierkv import TieredStore
from tierkv.events import DIRECTIONS, CommitEvent, EventLog, MoveEvent, OpenEvent
from tierkv.metrics import BYTES_BUCKETS, SECONDS_BUCKETS, StoreCollector, serve

B = 8
WAIT = 30.0
TIERS = ("device", "host", "disk")
PROGRAMS = {"cli.py", "demo.py", "bench.py"}  # command-line programs may print; the library may not


def generate(model: torch.nn.Module, ids: torch.Tensor, cache=None, new: int = 4) -> torch.Tensor:
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def block_bytes(model: torch.nn.Module, n_tokens: int = B) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * n_tokens * c.head_dim * 4


@pytest.fixture
def model(tiny_model) -> torch.nn.Module:
    return tiny_model("llama")


def turn(store: TieredStore, model: torch.nn.Module, ids: torch.Tensor, session: str | None = None):
    cache = store.open(model, ids, session=session)
    out = generate(model, ids, cache)
    cache.commit(out)
    return cache, out


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}, from a real HTTP scrape."""
    with urllib.request.urlopen(url, timeout=WAIT) as response:
        assert response.status == 200
        return samples(response.read().decode())


def samples(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by(found: dict[str, dict[tuple, float]], name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for labels, value in found[name].items() if "le" not in dict(labels)}


def one(found: dict[str, dict[tuple, float]], name: str) -> float:
    (value,) = found[name].values()
    return value


def corrupt_records(store: TieredStore, keys: list[bytes]) -> None:
    """Flip a payload byte of each record (headers stay readable: found on first read, not by a scan)."""
    for key in keys:
        damage_in_place(store._disk.env, b"blocks", key, lambda record: flipped(record, len(record) // 2, 0xFF))


def verify_scrape_equals_stats(found: dict, stats: dict) -> None:
    for name, field in (("tierkv_tier_bytes", "bytes"), ("tierkv_tier_blocks", "blocks"),
                        ("tierkv_tier_budget_bytes", "budget")):
        assert by(found, name, "tier") == {t: stats[t][field] for t in TIERS}, name
    assert by(found, "tierkv_tier_peak_bytes", "tier") == stats["peak_bytes"]
    assert by(found, "tierkv_hit_tokens_total", "tier") == stats["hits"]
    assert one(found, "tierkv_miss_tokens_total") == stats["misses"]
    assert one(found, "tierkv_evictions_total") == stats["evictions"]
    assert one(found, "tierkv_diverged_turns_total") == stats["diverged_turns"]
    assert one(found, "tierkv_diverged_tokens_total") == stats["diverged_tokens"]
    assert one(found, "tierkv_corrupt_records_total") == stats["corrupt"]
    assert one(found, "tierkv_disk_errors_total") == stats["disk_errors"]
    assert one(found, "tierkv_disk_failed") == float(stats["disk_failed"])
    assert one(found, "tierkv_pending_writes") == stats["pending_writes"]
    assert one(found, "tierkv_sessions") == stats["sessions"]
    assert by(found, "tierkv_moved_bytes_total", "direction") == stats["moved_bytes"]


# -- metrics over HTTP ---------------------------------------------------------------------------
def test_a_scrape_of_the_http_endpoint_equals_stats_after_every_tier_was_used(model, tmp_path) -> None:
    path = tmp_path / "kv"
    kw = dict(device="cpu", device_budget=3 * block_bytes(model), host_budget=4 * block_bytes(model), block_size=B)
    outs = {}
    with TieredStore(path, **kw) as store:
        for i, session in enumerate("abc"):
            before = set(store._index.blocks)
            _, outs[session] = turn(store, model, random_ids(20, 20 + i), session)
        store.flush()
        corrupt_records(store, sorted(set(store._index.blocks) - before))  # session c's blocks

    store = TieredStore(path, **kw)  # restart: everything comes back from disk
    server = serve(store, port=0)
    try:
        assert server.port > 0 and server.collector is not None and server.registry is not None
        url = f"http://127.0.0.1:{server.port}/metrics"
        opens = commits = 0
        for session in "aca":  # a: from disk; c: corrupt, and demotes a to the host; a: from the host
            ids = torch.cat([outs[session], random_ids(3, 30 + opens)], dim=1)
            cache, outs[session] = turn(store, model, ids, session)
            opens, commits = opens + 1, commits + 1
        store.flush()
        stats = store.stats()
        assert stats["hits"]["disk"] > 0 and stats["hits"]["host"] > 0 and stats["corrupt"] == 1
        assert stats["evictions"] > 0 and all(stats["moved_bytes"][d] > 0 for d in DIRECTIONS)

        found = scrape(url)
        verify_scrape_equals_stats(found, stats)
        assert one(found, "tierkv_open_duration_seconds_count") == opens
        assert one(found, "tierkv_commit_duration_seconds_count") == commits
        assert 0 < one(found, "tierkv_open_duration_seconds_sum") < WAIT
        # Histograms counted since serve() subscribed, which was before any traffic: exact.
        assert by(found, "tierkv_move_bytes_sum", "direction") == stats["moved_bytes"]
        assert (by(found, "tierkv_move_bytes_count", "direction")
                == by(found, "tierkv_move_duration_seconds_count", "direction"))
        assert by(found, "tierkv_move_duration_seconds_sum", "direction")["disk_to_host"] > 0  # disk reads are timed
        assert one(found, "tierkv_events_dropped_total") == 0

        again = scrape(url)  # no traffic in between: nothing is counted twice
        assert again == found
        cache, _ = turn(store, model, torch.cat([outs["a"], random_ids(3, 40)], dim=1), "a")
        store.flush()
        after = scrape(url)  # and nothing is lost between scrapes
        assert one(after, "tierkv_open_duration_seconds_count") == opens + 1
        assert by(after, "tierkv_move_bytes_sum", "direction") == store.stats()["moved_bytes"]
        verify_scrape_equals_stats(after, store.stats())
    finally:
        server.close()
    assert not store._events.active  # close() unsubscribed
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
    store.close()


def test_buckets_are_cumulative_and_span_4kib_to_4gib_and_100us_to_30s() -> None:
    store = FakeStore()
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    for nbytes, seconds in ((4096, 0.0001), (5000, 0.2), (3 << 30, 29.0), (5 << 30, 31.0)):
        store.events.emit(MoveEvent("host_to_disk", nbytes, seconds))
    found = samples(generate_latest(registry).decode())
    size = {float(dict(k)["le"]): v for k, v in found["tierkv_move_bytes_bucket"].items()
            if dict(k)["direction"] == "host_to_disk"}
    assert BYTES_BUCKETS[0] == 4096 and BYTES_BUCKETS[-1] == 4 << 30
    assert SECONDS_BUCKETS[0] == 0.0001 and SECONDS_BUCKETS[-1] == 30.0
    assert (size[4096], size[16384], size[1 << 30], size[4 << 30], size[float("inf")]) == (1, 2, 2, 3, 4)
    seconds = {float(dict(k)["le"]): v for k, v in found["tierkv_move_duration_seconds_bucket"].items()
               if dict(k)["direction"] == "host_to_disk"}
    assert seconds[0.0001] == 1 and seconds[0.25] == 2 and seconds[30.0] == 3 and seconds[float("inf")] == 4


class FakeStore:
    """The two methods a collector uses, without a model: for exact event counts under threads."""

    def __init__(self) -> None:
        self.events = EventLog()

    def subscribe(self, maxlen: int = 100_000):
        return self.events.subscribe(maxlen)

    def stats(self) -> dict:
        tier = {"bytes": 0, "budget": 0, "blocks": 0}
        return {"device": tier, "host": tier, "disk": tier, "hits": {t: 0 for t in TIERS}, "misses": 0,
                "evictions": 0, "diverged_turns": 0, "diverged_tokens": 0, "corrupt": 0, "disk_errors": 0,
                "disk_failed": False,
                "moved_bytes": {d: 0 for d in DIRECTIONS}, "peak_bytes": {t: 0 for t in TIERS}, "pending_writes": 0,
                "sessions": 0}


def test_the_disk_failed_gauge_follows_stats() -> None:
    # Every scrape above is of a store whose disk never failed: a gauge stuck at 0 passed.
    store = FakeStore()
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    assert one(samples(generate_latest(registry).decode()), "tierkv_disk_failed") == 0
    healthy = store.stats
    store.stats = lambda: {**healthy(), "disk_failed": True}
    assert one(samples(generate_latest(registry).decode()), "tierkv_disk_failed") == 1


def test_concurrent_scrapes_neither_double_count_nor_lose_events() -> None:
    store = FakeStore()
    collector = StoreCollector(store)
    registry = CollectorRegistry()
    registry.register(collector)
    emitters, per_emitter = 4, 2_000
    done = threading.Event()
    start = threading.Barrier(emitters + 3)

    def emit() -> None:
        start.wait(WAIT)
        for _ in range(per_emitter):
            store.events.emit(OpenEvent(0.001, {t: 0 for t in TIERS}, 1))
            store.events.emit(CommitEvent(0.002, 8))

    def scrape_loop() -> None:
        start.wait(WAIT)
        while not done.is_set():
            samples(generate_latest(registry).decode())

    workers = [threading.Thread(target=emit) for _ in range(emitters)]
    scrapers = [threading.Thread(target=scrape_loop) for _ in range(3)]
    for w in (*workers, *scrapers):
        w.start()
    for w in workers:
        w.join(WAIT)
    done.set()
    for s in scrapers:
        s.join(WAIT)
    found = samples(generate_latest(registry).decode())
    assert one(found, "tierkv_open_duration_seconds_count") == emitters * per_emitter
    assert one(found, "tierkv_commit_duration_seconds_count") == emitters * per_emitter
    assert one(found, "tierkv_commit_duration_seconds_sum") == pytest.approx(0.002 * emitters * per_emitter)
    assert one(found, "tierkv_events_dropped_total") == 0
    collector.close()
    assert not store.events.active


def test_the_collector_plugs_into_an_existing_registry_beside_other_metrics(model) -> None:
    from prometheus_client import Counter

    registry = CollectorRegistry()
    requests = Counter("app_requests", "The application's own metric.", registry=registry)
    requests.inc()
    with TieredStore(None, device="cpu", block_size=B) as store:
        collector = StoreCollector(store)
        registry.register(collector)
        turn(store, model, random_ids(20, 50))
        found = samples(generate_latest(registry).decode())
        assert one(found, "app_requests_total") == 1
        assert one(found, "tierkv_open_duration_seconds_count") == 1
        verify_scrape_equals_stats(found, store.stats())
        refused = StoreCollector(store)
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(refused)  # one store per registry, as prometheus_client enforces
        refused.close()  # as StoreCollector's docstring says: else it stays subscribed
    # A closed store still answers: stats() works after close, and the histograms stay.
    collector.close()
    found = samples(generate_latest(registry).decode())
    assert one(found, "tierkv_open_duration_seconds_count") == 1
    assert by(found, "tierkv_tier_blocks", "tier") == {t: 0 for t in TIERS}


def test_a_server_may_serve_from_a_given_registry_and_leaves_it_clean_on_close() -> None:
    registry = CollectorRegistry()
    store = FakeStore()
    with serve(store, port=0, registry=registry) as server:
        assert server.registry is registry
        store.events.emit(OpenEvent(0.5, {t: 0 for t in TIERS}, 1))
        found = scrape(f"http://127.0.0.1:{server.port}/metrics")
        assert one(found, "tierkv_open_duration_seconds_count") == 1
    assert list(registry.collect()) == []
    assert not store.events.active
    with pytest.raises(ValueError, match="port"):
        serve(store, port=-1)
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        serve(store, port=65536)
    with pytest.raises(TypeError, match="port must be an int"):
        serve(store, port=True)
    assert not store.events.active


def test_an_empty_addr_is_refused_rather_than_bound_to_every_interface() -> None:
    store = FakeStore()
    with pytest.raises(ValueError, match=r"addr='' would serve on every interface; pass addr='0\.0\.0\.0'"):
        serve(store, addr="")  # the socket API reads "" as every interface
    assert not store.events.active  # refused before subscribing


@pytest.mark.parametrize("addr, error, message", [
    (None, TypeError, "addr must be a host name or IP address as a str"),
    (9400, TypeError, "the port goes in port="),
    ("[::1]", ValueError, "without the brackets URLs put around it, like addr='::1'"),
    ("localhost ", ValueError, "has spaces around it; give addr='localhost'"),
    (" ", ValueError, "would serve on every interface"),
    ("no-such-host.invalid", ValueError, "is not an address of this machine"),
    # str.isdigit() is true of '²', which int() refuses: a bare "invalid literal for int()".
    ("localhost:\u00b2", ValueError, "is not an address of this machine"),
    # A port without a host is not told to pass addr='', which is refused.
    (":9100", ValueError, "is not an address of this machine"),
    # Addresses that are not this machine's: a bare "Cannot assign requested address" before.
    ("192.0.2.1", OSError, "cannot serve metrics at addr='192.0.2.1': "),
])
def test_a_bad_addr_is_refused_saying_what_to_give(addr, error, message) -> None:
    # Before: None or a port number raised "argument of type 'NoneType' is not iterable", and an
    # address in brackets or with a space a bare socket.gaierror.
    store = FakeStore()
    with pytest.raises(error, match=re.escape(message)):
        serve(store, addr=addr)
    assert not store.events.active



def test_a_link_local_address_without_its_interface_is_told_to_name_one() -> None:
    """Bound without its ``%interface``, a link-local IPv6 address fails with ``EINVAL``, not the
    ``EADDRNOTAVAIL`` of another machine's address: a bare "Invalid argument" before."""
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 sockets here")
    store = FakeStore()
    with pytest.raises(OSError, match=re.escape("cannot serve metrics at addr='fe80::1': ")) as info:
        serve(store, addr="fe80::1")
    assert "(a link-local one with its interface: 'fe80::1%eth0')" in str(info.value)
    # One given its interface (where that address is not) is not told to add one.
    with pytest.raises(OSError, match=re.escape("cannot serve metrics at addr='fe80::1%lo': ")) as info:
        serve(store, addr="fe80::1%lo")
    assert "link-local" not in str(info.value)
    assert not store.events.active


@pytest.mark.parametrize("addr, kind", [("127.0.0.1:0", "host and port"), ("http://127.0.0.1:0/metrics", "URL"),
                                        ("http://[::1]:0", "URL"), ("http://127.0.0.1", "URL"),
                                        ("http://::1/metrics", "URL"),  # was told addr=':', port=1
                                        # no port ('²' is a digit to str.isdigit, not to int())
                                        ("http://127.0.0.1:²/metrics", "URL"), ("http://[::1]:²", "URL")])
def test_a_url_or_host_and_port_as_addr_is_told_to_split_them_and_the_split_serves(addr, kind) -> None:
    # Before: "is not an address of this machine ([Errno -2] Name or service not known)".
    store = FakeStore()
    with pytest.raises(ValueError, match=re.escape(f"addr={addr!r} is a {kind}; addr takes the host alone")) as info:
        serve(store, addr=addr)
    assert not store.events.active
    advice = re.search(r"pass (addr=.*)$", str(info.value)).group(1)
    call = ast.parse(f"serve(store, {advice})", mode="eval").body  # the advice's own words, pasted
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    try:
        server = serve(store, **arguments)
    except OSError as exc:  # no IPv6 loopback here: bound as far as tierkv goes
        assert arguments["addr"] == "::1", exc
        return
    with server:
        assert server.addr == arguments["addr"] in addr
        scrape(server.url)


def test_a_registry_serving_a_store_already_says_to_leave_registry_out_and_both_ways_serve() -> None:
    # Before: prometheus_client's "Duplicated timeseries in CollectorRegistry: {...}", fifty names
    # and no way out.
    registry = CollectorRegistry()
    first, second = FakeStore(), FakeStore()
    server = serve(first, registry=registry)
    with pytest.raises(ValueError, match=r"already holds a tierkv store's metrics.*Leave registry= out.*close\(\) the "
                                         r"other store's MetricsServer first"):
        serve(second, registry=registry)
    assert not second.events.active
    with serve(second) as own:  # the first way out
        one(scrape(own.url), "tierkv_open_duration_seconds_count")
    server.close()
    with serve(second, registry=registry) as shared:  # the second
        one(scrape(shared.url), "tierkv_open_duration_seconds_count")


def test_a_port_in_use_is_refused_saying_to_pass_another_or_port_0() -> None:
    """It raised the socket's bare ``OSError: [Errno 98] Address already in use``; still an
    ``OSError`` with that errno, for code that catches it."""
    import errno

    store = FakeStore()
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=re.escape(f"cannot serve metrics at 127.0.0.1:{port}: the port is in use")
                           + ".*pass another port=, or port=0 to pick a free one") as raised:
            serve(store, port=port)
        assert raised.value.errno == errno.EADDRINUSE and type(raised.value) is OSError
        assert not store.events.active  # unsubscribed
    finally:
        taken.close()
    with serve(store, port=0) as server:  # port=0, as told
        assert server.port > 0


def test_metric_names_follow_prometheus_conventions(model) -> None:
    with TieredStore(None, device="cpu", block_size=B) as store:
        registry = CollectorRegistry()
        registry.register(StoreCollector(store))
        turn(store, model, random_ids(20, 60))
        text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) == 20
    for family in families:
        assert family.name.startswith("tierkv_"), family.name
        names = {s.name for s in family.samples}
        if family.type == "counter":
            assert names == {family.name + "_total"}, family.name
        else:
            assert not family.name.endswith("_total"), family.name
        if "bytes" in family.name:
            assert family.name.endswith("_bytes"), family.name
        if "seconds" in family.name or "duration" in family.name:
            assert family.name.endswith("_duration_seconds"), family.name
        for s in family.samples:
            labels = set(s.labels) - {"le"}
            assert labels <= {"tier", "direction"}, (s.name, labels)
            assert s.labels.get("tier", "device") in TIERS and s.labels.get("direction", DIRECTIONS[0]) in DIRECTIONS
            if s.name.endswith("_bucket"):
                assert family.type == "histogram"
    types = {f.name: f.type for f in families}
    assert types["tierkv_move_bytes"] == types["tierkv_move_duration_seconds"] == "histogram"
    assert types["tierkv_open_duration_seconds"] == types["tierkv_commit_duration_seconds"] == "histogram"
    assert types["tierkv_tier_bytes"] == "gauge" and types["tierkv_hit_tokens"] == "counter"


def test_an_overflowing_event_queue_warns_once_and_counts_the_drops(caplog) -> None:
    store = FakeStore()
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, maxlen=2))
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        for round_ in range(2):
            for _ in range(5):
                store.events.emit(CommitEvent(0.001, 1))
            found = samples(generate_latest(registry).decode())
            assert one(found, "tierkv_events_dropped_total") == 3 * (round_ + 1)
            assert one(found, "tierkv_commit_duration_seconds_count") == 2 * (round_ + 1)
    warnings = [r for r in caplog.records if r.name == "tierkv" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tierkv_events_dropped_total" in warnings[0].getMessage()


def test_an_overflow_under_serve_says_to_pass_a_larger_maxlen_to_it_and_that_keeps_every_event(caplog) -> None:
    # Before: "pass a larger maxlen to StoreCollector", which serve() made with no maxlen to pass.
    store = FakeStore()
    for maxlen, dropped in ((2, 3), (5, 0)):
        caplog.clear()
        with serve(store, maxlen=maxlen) as server, caplog.at_level(logging.WARNING, logger="tierkv"):
            for _ in range(5):
                store.events.emit(CommitEvent(0.001, 1))
            found = scrape(server.url)
        assert one(found, "tierkv_events_dropped_total") == dropped
        assert one(found, "tierkv_commit_duration_seconds_count") == 5 - dropped
        assert (f"pass a larger maxlen (now {maxlen}) to serve() or StoreCollector" in caplog.text) is bool(dropped)


def test_importing_tierkv_needs_no_prometheus_client_and_the_metrics_module_names_the_extra() -> None:
    script = (
        "import sys, tierkv\n"
        "assert 'prometheus_client' not in sys.modules, 'import tierkv pulled in prometheus_client'\n"
        "sys.modules['prometheus_client'] = None  # as if the metrics extra were not installed\n"
        "try:\n"
        "    import tierkv.metrics\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('tierkv.metrics imported without prometheus_client')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(tierkv.__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert 'pip install "tierkv[metrics]"' in result.stdout


# -- logging -------------------------------------------------------------------------------------------
def tierkv_records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("tierkv") and r.levelno == level]


def test_opening_a_store_logs_one_info_line_with_path_budgets_tiers_and_blocks(model, tmp_path, caplog) -> None:
    path = tmp_path / "kv"
    with TieredStore(path, device="cpu", block_size=B) as store:
        turn(store, model, random_ids(20, 70))
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        store = TieredStore(path, device="cpu", device_budget="3MiB", host_budget="1GiB", disk_budget="2GiB",
                            block_size=B)
        store.close()
    (line,) = [r.getMessage() for r in tierkv_records(caplog, logging.INFO)]
    assert str(path) in line and "tiers=device(cpu),host,disk" in line
    assert "device=3.0 MiB" in line and "host=1.0 GiB" in line and "disk=2.0 GiB" in line
    assert "3 blocks found" in line  # 23 committed tokens: two full blocks and a tail
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        TieredStore(None, device="cpu", block_size=B).close()
    (line,) = [r.getMessage() for r in tierkv_records(caplog, logging.INFO)]
    assert "tiers=device(cpu),host " in line and "disk=none" in line and "0 blocks found" in line


def first_block(store: TieredStore, root: bytes, ids: torch.Tensor) -> bytes:
    return next(m.key for m in store._index.blocks.values() if m.parent == root and m.token_ids[0] == int(ids[0, 0]))


def make_corrupt_store(model, path: Path, n: int) -> tuple[TieredStore, list[torch.Tensor]]:
    """A store whose every block rests on disk only, with the first block of ``n`` conversations damaged."""
    store = TieredStore(path, device="cpu", device_budget=0, host_budget=0, block_size=B)
    firsts, outs = [], []
    for i in range(n):
        ids = random_ids(20, 80 + i)
        cache, out = turn(store, model, ids)
        outs.append(out)
        firsts.append(first_block(store, cache.root, ids))
    store.flush()
    corrupt_records(store, firsts)
    return store, outs


def test_n_corrupt_records_log_one_warning_and_count_n(model, tmp_path, caplog) -> None:
    n = 3
    store, outs = make_corrupt_store(model, tmp_path / "kv", n)
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        for i, out in enumerate(outs):
            ids = torch.cat([out, random_ids(2, 90 + i)], dim=1)
            cache = store.open(model, ids)
            assert cache.restored_tokens == 0
    assert store.stats()["corrupt"] == n
    warnings = tierkv_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "unreadable" in warnings[0].getMessage()
    assert sum("unreadable" in r.getMessage() for r in tierkv_records(caplog, logging.DEBUG)) == n - 1
    store.close()


def test_corrupt_records_found_at_reopen_log_one_warning_for_all(model, tmp_path, caplog) -> None:
    n = 3
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=B)
    firsts = []
    for i in range(n):
        ids = random_ids(20, 100 + i)
        cache, _ = turn(store, model, ids)
        firsts.append(first_block(store, cache.root, ids))
    store.flush()
    for key in firsts:  # the scan itself rejects these: it reads the heads, then the records
        damage_in_place(store._disk.env, b"heads", key, lambda head: b"not a head" + head[10:])
        damage_in_place(store._disk.env, b"blocks", key, lambda record: b"not a record" + record[12:])
    store.close()
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        store = TieredStore(tmp_path / "kv", device="cpu", block_size=B)
    assert store.stats()["corrupt"] == n
    (warning,) = tierkv_records(caplog, logging.WARNING)
    assert f"{n} unreadable records" in warning.getMessage()
    store.close()


def test_disk_write_errors_log_one_warning_and_count(model, tmp_path, caplog) -> None:
    store = TieredStore(tmp_path / "kv", device="cpu", block_size=B)

    def failing(ops):
        raise lmdb.DiskError("No space left on device")

    store._disk.apply = failing
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        for i in range(3):
            turn(store, model, random_ids(20, 110 + i))
            store.flush()
    stats = store.stats()
    assert stats["disk_failed"] and stats["disk_errors"] >= 1
    warnings = tierkv_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "I/O error" in warnings[0].getMessage()
    store.close()


def test_disk_read_errors_log_one_warning_and_count_each(model, tmp_path, caplog) -> None:
    store = TieredStore(tmp_path / "kv", device="cpu", device_budget=0, host_budget=0, block_size=B)
    outs = [turn(store, model, random_ids(20, 120 + i))[1] for i in range(3)]
    store.flush()

    def unreadable(key, into):
        raise OSError(5, "Input/output error")

    store._disk.read_into = unreadable
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        for i, out in enumerate(outs):
            cache = store.open(model, torch.cat([out, random_ids(2, 130 + i)], dim=1))
            assert cache.restored_tokens == 0
    stats = store.stats()
    assert stats["disk_errors"] == 3 and stats["disk_failed"]
    warnings = tierkv_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "I/O error" in warnings[0].getMessage()
    assert sum("I/O error" in r.getMessage() for r in tierkv_records(caplog, logging.DEBUG)) == 2
    store.close()


def test_a_full_turn_and_a_scrape_print_nothing(model, tmp_path, capfd) -> None:
    capfd.readouterr()
    store = TieredStore(tmp_path / "kv", device="cpu", device_budget=0, block_size=B)
    server = serve(store, port=0)
    ids = random_ids(20, 140)
    cache, out = turn(store, model, ids, "s")
    cache, out = turn(store, model, torch.cat([out, random_ids(2, 141)], dim=1), "s")
    store.flush()
    scrape(f"http://127.0.0.1:{server.port}/metrics")  # wsgiref would log each request to stderr
    server.close()
    store.close()
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")


def test_no_library_module_calls_print() -> None:
    package = Path(tierkv.__file__).parent
    offenders = []
    for source in sorted(package.rglob("*.py")):
        if source.relative_to(package).as_posix() in PROGRAMS:
            continue
        for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                offenders.append(f"{source.name}:{node.lineno} print()")
            elif (isinstance(func, ast.Attribute) and func.attr == "write" and isinstance(func.value, ast.Attribute)
                  and func.value.attr in ("stdout", "stderr")):
                offenders.append(f"{source.name}:{node.lineno} {func.value.attr}.write()")
    assert offenders == [], "the library logs through logging.getLogger('tierkv'); it never prints"


def _in_a_forked_child(child: Callable[[], None]) -> int:
    """``child()`` run in a forked child: its exit status, 0 where it returned, -SIGALRM where it hung."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)  # a child stuck on a lock is killed, and its exit status says so
            child()
            code = 0
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_forked_childs_scrape_exports_nothing_even_while_a_parent_scrape_held_the_collectors_lock() -> None:
    # Before: the collector took its own lock before stats() (which a forked child is refused):
    # a scrape of the parent's in progress at the fork left it held for good, and the child's
    # scrape of a registry it inherited hung.
    store = FakeStore()
    collector = StoreCollector(store)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with collector._lock:
            held.set()
            release.wait()

    registry = _registry_of(collector)
    other = Counter("worker_requests", "a metric of the program's own, in the same registry", registry=registry)
    other.inc()

    def scrape_in_child() -> None:
        # A worker forked with the registry: its own metrics still scraped, none of the store's
        # (an exception here failed the whole scrape), and a warning once.
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("tierkv").addHandler(handler)
        text = generate_latest(registry).decode()
        generate_latest(registry)
        assert "worker_requests_total 1.0" in text and "tierkv_" not in text
        assert len([r for r in records if "forked" in r.getMessage()]) == 1
        collector.close()  # nothing of the parent's is let go of, and no wait

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        status = _in_a_forked_child(scrape_in_child)
    finally:
        release.set()
        holder.join()
    assert status == 0  # -SIGALRM: it hung on the lock
    assert one(samples(generate_latest(_registry_of(collector)).decode()), "tierkv_sessions") == 0
    collector.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_forked_childs_close_of_the_parents_metrics_server_returns_and_the_parent_serves_on() -> None:
    # Before: close() in a child (a `with serve(store):` block the child leaves) waited for the
    # serving thread's loop to stop, a thread the child does not have: it hung for good.
    store = FakeStore()
    with serve(store) as server:
        assert _in_a_forked_child(server.close) == 0  # -SIGALRM: it hung
        scrape(server.url)
    assert not store.events.active


def _registry_of(collector: StoreCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
