"""Prometheus metrics for a ``TieredStore`` (the ``metrics`` extra: ``pip install "tierkv[metrics]"``).

Protocol::

    collector = StoreCollector(store)        # subscribes to the store's events (tierkv.events)
    registry.register(collector)             # any CollectorRegistry, or prometheus_client.REGISTRY
    ...                                      # every scrape calls collector.collect()
    collector.close()                        # unsubscribe; collect() still answers from stats()

    server = serve(store, port=0)            # or all of it in one call: HTTP on server.port
    server.close()                           # stop serving, unregister, unsubscribe

The store's hot paths only append events to the subscription's bounded queue; ``collect()`` drains
that queue under the collector's lock into cumulative histograms kept here (so concurrent scrapes
neither double count nor lose an event), then reads ``store.stats()`` for the gauges and counters.
Histograms count from the collector's subscription on; counters read from ``stats()`` count from the
store's open. ``store.stats()`` stays the in-process view; this module only exports it. In a
process forked from the collector's, ``collect()`` exports nothing (``stats()`` is refused there;
an exception would cost the registry's other collectors their metrics), and ``close()`` (the
server's too) lets go of nothing of the parent's, waiting for none of its locks or threads.

Metric names follow Prometheus conventions: a ``tierkv_`` prefix, base units (bytes, seconds),
``_total`` on counters, and a ``tier`` or ``direction`` label rather than one name per tier.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import threading
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

try:
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import Collector
    from prometheus_client.utils import floatToGoString  # bucket bounds written as the client's own histograms
except ImportError as exc:  # the extra is optional: `import tierkv` never needs it
    raise ImportError('tierkv.metrics needs prometheus-client; install it with: pip install "tierkv[metrics]"') from exc

from .events import DIRECTIONS, CommitEvent, MoveEvent, OpenEvent
from .units import whole_number

__all__ = ["StoreCollector", "MetricsServer", "serve", "BYTES_BUCKETS", "SECONDS_BUCKETS"]

logger = logging.getLogger("tierkv")

TIERS = ("device", "host", "disk")
# 4 KiB .. 4 GiB in powers of 4: a block of a tiny model up to a batch of 7B-class blocks.
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**i) for i in range(11))
# 100 us .. 30 s: a CUDA copy of one block up to a cold restore of a long conversation from disk.
SECONDS_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                      0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class _Histogram:
    """Cumulative state of one histogram series; only touched under the collector's lock."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le semantics: value <= bound
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(floatToGoString(b) for b in self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, float(running)))
        return out


# name, help, labels: one place for describe() and collect(), so the two cannot disagree.
_GAUGES = {
    "tierkv_tier_bytes": ("Bytes of KV blocks at rest in a tier.", ["tier"]),
    "tierkv_tier_blocks": ("KV blocks at rest in a tier.", ["tier"]),
    "tierkv_tier_budget_bytes": ("Budget of a tier in bytes (a hard cap on bytes at rest).", ["tier"]),
    "tierkv_tier_peak_bytes": ("The most bytes of KV blocks at rest in a tier at any moment since the store opened.",
                               ["tier"]),
    "tierkv_pending_writes": ("Block writes queued for the disk tier, not yet committed.", []),
    "tierkv_sessions": ("Sessions the store references.", []),
    "tierkv_disk_failed": ("1 once a disk I/O error switched the store to its memory tiers, else 0.", []),
}
_COUNTERS = {  # family names without _total: the exposition appends it
    "tierkv_hit_tokens": ("Tokens restored by open(), by the tier they came from.", ["tier"]),
    "tierkv_miss_tokens": ("Tokens open() could not restore and generate() computes.", []),
    "tierkv_evictions": ("Blocks evicted from a tier to make room.", []),
    "tierkv_diverged_turns": ("Turns whose ids differed from the conversation their session committed last "
                              "(an edit, or a chat template rendering past turns anew).", []),
    "tierkv_diverged_tokens": ("Stored tokens of those sessions past the difference, computed again.", []),
    "tierkv_corrupt_records": ("Disk records dropped as unreadable (checksum, version, fingerprint).", []),
    "tierkv_disk_errors": ("Disk tier operations that failed with an I/O error.", []),
    "tierkv_moved_bytes": ("KV bytes of whole blocks moved between tiers, by direction, since the store opened.",
                           ["direction"]),
    "tierkv_events_dropped": ("Store events lost because scrapes were too rare for the event queue.", []),
}
_HISTOGRAMS = {
    "tierkv_move_bytes": ("Bytes of one move (a copy or a disk transaction), by direction.", ["direction"]),
    "tierkv_move_duration_seconds": ("Duration of one move, by direction; 0 for CPU hand-overs that copy "
                                     "nothing.", ["direction"]),
    "tierkv_open_duration_seconds": ("Wall time of store.open() (copies to the device run on after it).", []),
    "tierkv_commit_duration_seconds": ("Wall time of cache.commit() (copies and disk writes run on after "
                                       "it).", []),
}


class StoreCollector(Collector):
    """A Prometheus collector for one ``TieredStore``; register it in any ``CollectorRegistry``.

    It subscribes to the store's events when made. A registry holds one store's collector: its metric
    names are fixed, so registering a second store's collector in the same registry raises
    (prometheus_client's ``Duplicated timeseries``); give each store a registry of its own (``serve``
    does). ``close()`` a collector whose ``register`` raised, or it stays subscribed and its queue
    keeps filling up to ``maxlen`` events until the store closes.
    """

    def __init__(self, store: Any, maxlen: int = 100_000) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._warned_forked = False
        self._sub = store.subscribe(maxlen)
        self._maxlen = maxlen
        self._dropped = 0  # kept past close(), when the subscription is gone
        self._warned = False
        self._move_bytes = {d: _Histogram(BYTES_BUCKETS) for d in DIRECTIONS}
        self._move_seconds = {d: _Histogram(SECONDS_BUCKETS) for d in DIRECTIONS}
        self._open_seconds = _Histogram(SECONDS_BUCKETS)
        self._commit_seconds = _Histogram(SECONDS_BUCKETS)

    def close(self) -> None:
        """Unsubscribe from the store's events; later scrapes still export ``stats()`` and the
        histograms as they stand. Closing twice is harmless; in a process forked from the
        collector's, it does nothing."""
        if self._forked():
            return
        with self._lock:
            if self._sub is not None:
                self._fold()
                self._sub.close()
                self._sub = None

    def _fold(self) -> None:
        """Drain the store's events into the histograms; the caller holds ``self._lock``."""
        assert self._sub is not None
        for event in self._sub.drain():
            if isinstance(event, MoveEvent):
                self._move_bytes[event.direction].observe(event.nbytes)
                self._move_seconds[event.direction].observe(event.seconds or 0.0)
            elif isinstance(event, OpenEvent):
                self._open_seconds.observe(event.seconds)
            elif isinstance(event, CommitEvent):
                self._commit_seconds.observe(event.seconds)
        if self._sub.dropped > self._dropped and not self._warned:
            self._warned = True  # once: the counter tells how many followed
            # serve() made its collector without a maxlen to pass: "pass a larger maxlen to
            # StoreCollector" could not be done there.
            logger.warning("tierkv: the metrics event queue overflowed and dropped events; scrape more often or "
                           "pass a larger maxlen (now %d) to serve() or StoreCollector. "
                           "tierkv_events_dropped_total counts them", self._maxlen)
        self._dropped = self._sub.dropped

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so registering never drains events or takes the store lock."""
        for name, (doc, labels) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=labels)
        for name, (doc, labels) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, labels=labels)
        for name, (doc, labels) in _HISTOGRAMS.items():
            yield HistogramMetricFamily(name, doc, labels=labels)

    def _forked(self) -> bool:
        # Checked before the lock: a scrape in a thread of the parent that held it at the fork
        # never lets go of it here, and a child's scrape or close waited for it for good.
        return os.getpid() != self._pid

    def collect(self) -> Iterator[Metric]:
        """The store's metrics; in a process forked from the collector's, none (the store's
        ``stats()`` is refused there), with a warning the first time."""
        if self._forked():
            # Nothing rather than an exception: a worker forked with the registry (prometheus'
            # REGISTRY, a server preloaded before its fork) would lose every other collector's
            # metrics to a raise here; this process has no store to export.
            if not self._warned_forked:
                self._warned_forked = True
                logger.warning("tierkv: a StoreCollector scraped in a process forked from the one that made it "
                               "exports nothing (its TieredStore serves only that process); make a TieredStore "
                               "and a StoreCollector of it in this process")
            return
        with self._lock:
            if self._sub is not None:
                self._fold()
            # Snapshot under the lock: a concurrent scrape's fold must not tear this one's view.
            histograms: dict[str, list[tuple[list[str], list[tuple[str, float]], float]]] = {
                "tierkv_move_bytes": [([d], h.buckets(), h.total) for d, h in self._move_bytes.items()],
                "tierkv_move_duration_seconds": [([d], h.buckets(), h.total) for d, h in self._move_seconds.items()],
                "tierkv_open_duration_seconds": [([], self._open_seconds.buckets(), self._open_seconds.total)],
                "tierkv_commit_duration_seconds": [([], self._commit_seconds.buckets(),
                                                    self._commit_seconds.total)],
            }
            dropped = self._dropped
        stats = self._store.stats()  # works on a closed store too
        gauges: dict[str, list[tuple[list[str], float]]] = {
            "tierkv_tier_bytes": [([t], stats[t]["bytes"]) for t in TIERS],
            "tierkv_tier_blocks": [([t], stats[t]["blocks"]) for t in TIERS],
            "tierkv_tier_budget_bytes": [([t], stats[t]["budget"]) for t in TIERS],
            "tierkv_tier_peak_bytes": [([t], stats["peak_bytes"][t]) for t in TIERS],
            "tierkv_pending_writes": [([], stats["pending_writes"])],
            "tierkv_sessions": [([], stats["sessions"])],
            "tierkv_disk_failed": [([], 1.0 if stats["disk_failed"] else 0.0)],
        }
        counters: dict[str, list[tuple[list[str], float]]] = {
            "tierkv_hit_tokens": [([t], stats["hits"][t]) for t in TIERS],
            "tierkv_miss_tokens": [([], stats["misses"])],
            "tierkv_evictions": [([], stats["evictions"])],
            "tierkv_diverged_turns": [([], stats["diverged_turns"])],
            "tierkv_diverged_tokens": [([], stats["diverged_tokens"])],
            "tierkv_corrupt_records": [([], stats["corrupt"])],
            "tierkv_disk_errors": [([], stats["disk_errors"])],
            "tierkv_moved_bytes": [([d], stats["moved_bytes"][d]) for d in DIRECTIONS],
            "tierkv_events_dropped": [([], dropped)],
        }
        for family, specs, samples in ((GaugeMetricFamily, _GAUGES, gauges), (CounterMetricFamily, _COUNTERS, counters)):
            for name, series in samples.items():
                doc, labels = specs[name]
                metric = family(name, doc, labels=labels)
                for values, value in series:
                    metric.add_metric(values, float(value))
                yield metric
        for name, hseries in histograms.items():
            doc, labels = _HISTOGRAMS[name]
            histogram = HistogramMetricFamily(name, doc, labels=labels)
            for values, buckets, total in hseries:
                histogram.add_metric(values, buckets, total)
            yield histogram


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # the library prints nothing: wsgiref would write one stderr line per scrape


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process open


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """An HTTP exposition of one collector's registry on ``port``; ``close()`` stops it."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, registry: CollectorRegistry,
                 collector: StoreCollector, addr: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self.collector = collector
        self.addr = addr
        self.port: int = httpd.server_address[1]
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, unregister the collector and unsubscribe it; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self.collector._forked():
            # A forked child has no serving thread: shutdown() waited for its loop to stop, for
            # good. The child's copy of the socket goes; the parent's server serves on.
            self._httpd.server_close()
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        try:
            self.registry.unregister(self.collector)
        except KeyError:  # the caller unregistered it already
            pass
        self.collector.close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_and_port(netloc: str) -> tuple[str, str]:
    """A URL's host and port (``""`` for none): an IPv6 host is bracketed where a port follows, and
    a bare one ("http://::1") is the host whole, not the host ':' and the port 1."""
    if netloc.startswith("[") and "]" in netloc:
        host, _, rest = netloc[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") and re.fullmatch("[0-9]+", rest[1:]) else ""
    if netloc.count(":") == 1:
        host, _, number = netloc.partition(":")
        return host, number if re.fullmatch("[0-9]+", number) else ""
    return netloc, ""


def serve(store: Any, port: int = 0, addr: str = "127.0.0.1",
          registry: CollectorRegistry | None = None, maxlen: int = 100_000) -> MetricsServer:
    """Serve ``store``'s metrics over HTTP at ``http://addr:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (``server.port`` tells which). ``registry=None`` gives the server a
    registry of its own; pass one (``prometheus_client.REGISTRY`` for the process-wide one) to
    serve the store's metrics beside what is already registered there. ``maxlen``: the events kept
    between scrapes (``StoreCollector``'s). Binds to 127.0.0.1 unless told otherwise: metrics name
    sessions' counts and sizes, not for every network by default.
    ``addr=""`` is refused: the socket API reads it as every interface, which is to be asked for by name.
    A port in use (or one this process may not bind) raises ``OSError`` saying to pass another port
    or ``port=0``, an address not of this machine ``OSError`` saying what to give; a URL or
    ``host:port`` as ``addr`` is told to pass the host and port apart, and a registry that already
    serves a store is refused saying to leave ``registry=`` out (one store per registry).
    """
    if not isinstance(addr, str):
        raise TypeError(f"addr must be a host name or IP address as a str (like '127.0.0.1' or '::1'), got "
                        f"{type(addr).__name__} {addr!r}; the port goes in port=")
    if addr.startswith("[") and addr.endswith("]"):
        raise ValueError(f"addr={addr!r}: give an IPv6 address without the brackets URLs put around it, like "
                         f"addr={addr[1:-1]!r}")
    if addr and addr != addr.strip() and addr.strip():
        raise ValueError(f"addr={addr!r} has spaces around it; give addr={addr.strip()!r}")
    if not addr.strip():
        raise ValueError(f"addr={addr!r} would serve on every interface; pass addr='0.0.0.0' (or '::') to serve "
                         "metrics on every network, or leave the default 127.0.0.1")
    # A URL or host:port was told only that it does not resolve ("Name or service not known").
    url = re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://([^/]*)(?:/.*)?", addr)
    host, colon, number = addr.rpartition(":")
    # ASCII digits: isdigit() is true of '²' too, which int() below refuses.
    if url is not None or (colon and ":" not in host and host and re.fullmatch("[0-9]+", number)):
        if url is not None:
            host, number = _host_and_port(url.group(1))
        given = f"addr={host!r}" + (f", port={int(number)}" if number else "")
        raise ValueError(f"addr={addr!r} is a {'URL' if url is not None else 'host and port'}; addr takes the host "
                         f"alone and port= the port: pass {given}")
    port = whole_number(port, "port", 0, " (0 picks a free port)")
    if port > 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free port), got {port}")
    registry = CollectorRegistry(auto_describe=True) if registry is None else registry
    collector = StoreCollector(store, maxlen)
    try:
        registry.register(collector)
    except BaseException as exc:
        collector.close()
        if isinstance(exc, ValueError) and "Duplicated timeseries" in str(exc):
            # prometheus_client's own message lists fifty metric names and no way out.
            raise ValueError("this registry already holds a tierkv store's metrics, and their names are fixed: a "
                             "registry serves one store. Leave registry= out to serve this store's from a registry "
                             "of its own, or close() the other store's MetricsServer first") from exc
        raise
    try:
        server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
        # Not prometheus_client.start_http_server: it hands its server back (needed for the port
        # that port=0 picked, and to stop it) only in recent releases, and the extra allows >= 0.17.
        httpd = make_server(addr, port, make_wsgi_app(registry), server_class, handler_class=_SilentHandler)
    except BaseException as exc:
        registry.unregister(collector)
        collector.close()
        if isinstance(exc, socket.gaierror):
            raise ValueError(f"addr={addr!r} is not an address of this machine ({exc}); give an IP address or a host "
                             "name that resolves, like '127.0.0.1', '::1' or '0.0.0.0'") from exc
        if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
            # Another machine's address, or a link-local one without its %interface: the bare
            # "Cannot assign requested address" named neither the address nor what to give.
            scope = (f" (a link-local one with its interface: '{addr}%eth0')"
                     if addr.lower().startswith("fe80:") and "%" not in addr else "")
            raise OSError(exc.errno, f"cannot serve metrics at addr={addr!r}: {exc.strerror}; give an address of "
                                     f"this machine{scope}, like '127.0.0.1', '::1' or '0.0.0.0'") from exc
        if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES):
            # An OSError still (PermissionError for EACCES: the constructor picks the subclass by
            # errno), so that code catching the bare error goes on working; the message says what to do.
            why = ("is in use by another program (or another metrics server)" if exc.errno == errno.EADDRINUSE
                   else "needs privileges this process lacks (ports below 1024, usually)")
            where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
            raise OSError(exc.errno, f"cannot serve metrics at {where}: the port {why}; pass another "
                                     "port=, or port=0 to pick a free one (server.port tells which)") from exc
        raise
    thread = threading.Thread(target=httpd.serve_forever, name="tierkv-metrics", daemon=True)
    thread.start()
    server = MetricsServer(httpd, thread, registry, collector, addr)
    logger.info("tierkv metrics served at %s", server.url)
    return server
