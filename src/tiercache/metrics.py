"""Prometheus metrics for tiercache (the optional extra ``tiercache[metrics]``).

`TierCacheCollector` is a ``prometheus_client`` collector that the host
application registers in its own ``CollectorRegistry``. At each scrape it reads
the ``stats()`` of the object it watches -- a `tiercache.TierCache`, a
`tiercache.storage.StorageBackend`, or a node server (`tiercache.serve.NodeServer`,
whose families are named ``serve_*``: arena bytes used and free, pages,
leases, clients, hits, misses, write-behind backlog) -- and turns the counters into metric
families; it also keeps latency histograms fed through `tiercache.observe`
(copies and storage calls) and samples the event loop's lag::

    from prometheus_client import CollectorRegistry, start_http_server
    import tiercache.metrics

    registry = CollectorRegistry()
    async with TierCache(config) as cache:
        collector = tiercache.metrics.register(cache, registry)  # on the cache's loop
        start_http_server(9400, registry=registry)
        ...
        await collector.aclose()

What is exported (every name starts with ``tiercache_``; ``{}`` are labels):

==========================================  =========  ==========================================
name                                        type       meaning
==========================================  =========  ==========================================
``requests_total``                          counter    prefix lookups (requests) served
``requested_tokens_total``                  counter    prompt tokens looked up
``hit_tokens_total{tier}``                  counter    tokens found on ``device``/``host``/``storage``
``miss_tokens_total{tier}``                 counter    requested tokens found on no tier down to
                                                       ``tier`` (``storage``: the tokens computed,
                                                       a backend attached or not)
``loaded_tokens_total{tier}``               counter    tokens copied out of ``tier`` one tier up
                                                       (``host``: host to device; ``storage``:
                                                       storage to host)
``stored_tokens_total{tier}``               counter    tokens copied into ``tier`` (``host``: from
                                                       the device; ``storage``: from the host)
``transfer_bytes_total{direction}``         counter    bytes moved: ``device_to_host``,
                                                       ``host_to_device``, ``storage_to_host``,
                                                       ``host_to_storage``
``inserted_tokens_total``                   counter    tokens of new KV inserted
``evictions_total{tier}``                   counter    evictions from ``device`` / ``host``
``evicted_tokens_total{tier}``              counter    tokens evicted from ``device`` / ``host``
``prefetches_total``                        counter    storage prefetches started
``prefetch_outcomes_total{outcome}``        counter    ``completed``, ``revoked``, ``terminated``,
                                                       ``failed``
``storage_backups_total``                   counter    node backups to storage that succeeded
``storage_errors_total``                    counter    failed or timed-out storage calls (a
                                                       timed-out call's duration is observed
                                                       with outcome ``cancelled``)
``storage_outages_total``                   counter    times the backend was declared down
``storage_reconnects_total``                counter    times a down backend answered again
``storage_auto_detaches_total``             counter    backends detached by the fault policy
``host_writes_skipped_total``               counter    device->host writes left out for want of
                                                       host room (the node stays device-only)
``storage_attached``                        gauge      1 while a storage backend is attached
``storage_up``                              gauge      1 attached and answering, 0 attached and
                                                       down (probing); absent when none is attached
``cached_tokens{tier}``                     gauge      tokens held on ``device`` / ``host``
``free_slots{tier}``                        gauge      free token slots on ``device`` / ``host``
``copy_duration_seconds{stream}``           histogram  one copy job on a copy stream
``storage_call_duration_seconds{op,         histogram  one storage call (``exists``/``get``/``set``;
outcome}``                                             ``ok``/``error``/``cancelled``)
``event_loop_lag_seconds``                  histogram  how late a sleep on the loop woke up
==========================================  =========  ==========================================

Watching a storage backend instead exports its own counters as
``tiercache_backend_<counter>_total{backend}`` (``exists_calls``,
``get_pages``, ``get_hits``, ``set_pages``, ``set_written``, ``read_bytes``,
``written_bytes``, ``corrupt_pages``, ``evictions``, ``errors``), plus the
histograms.

Threads: a scrape runs on the HTTP server's thread. When the collector knows
the event loop that owns the watched object (``loop``, or the running loop when
`register` is called on it), ``stats()`` runs on that loop and the scrape waits
for it (at most ``scrape_timeout_s``; then the scrape carries only the
histograms). ``stats()`` may be a coroutine function (a storage backend's is);
that needs the loop.

One collector per registry: two collectors in one registry would export the
same names. Give each its own registry, or tell them apart with ``labels`` and
register them in separate registries served on separate ports. A collector
over an open cache records that cache's copies and storage calls only; one
over a storage backend, or over a cache not open yet, records every copy and
storage call in the process (`tiercache.observe`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from tiercache import observe
from tiercache.errors import TierCacheError

try:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tiercache.metrics needs the 'prometheus_client' package: pip install 'tiercache[metrics]'"
    ) from _e

__all__ = ["LATENCY_BUCKETS", "LOOP_LAG_BUCKETS", "TierCacheCollector", "register"]

logger = logging.getLogger(__name__)

#: Buckets (seconds) of the copy and storage-call histograms: 50 us to 10 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Buckets (seconds) of the event loop lag histogram: 100 us to 5 s.
LOOP_LAG_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
)

_TIERS_HIT = ("device", "host", "storage")
# (metric suffix, CacheStats field, help) of the plain counters.
_CACHE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "Prefix lookups (requests) served."),
    ("requested_tokens", "tokens_requested", "Prompt tokens looked up."),
    ("inserted_tokens", "tokens_inserted", "Tokens of new KV inserted."),
    ("prefetches", "prefetches", "Storage prefetches started."),
    ("storage_backups", "storage_backups", "Node backups to storage that succeeded."),
    ("storage_errors", "storage_errors", "Storage calls that failed or timed out."),
    ("storage_outages", "storage_outages", "Times the storage backend was declared down."),
    ("storage_reconnects", "storage_reconnects", "Times a down storage backend answered again."),
    (
        "storage_auto_detaches",
        "storage_auto_detaches",
        "Storage backends detached by the fault policy.",
    ),
    (
        "host_writes_skipped",
        "host_writes_skipped",
        "Device-to-host writes left out for want of host room.",
    ),
)
_BACKEND_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("exists_calls", "exists_calls", "batch_exists calls."),
    ("get_pages", "get_pages", "Pages asked for by batch_get."),
    ("get_hits", "get_hits", "Pages batch_get delivered."),
    ("set_pages", "set_pages", "Pages handed to batch_set."),
    ("set_written", "set_written", "Pages batch_set wrote (new keys)."),
    ("read_bytes", "bytes_read", "Page bytes read."),
    ("written_bytes", "bytes_written", "Page bytes written."),
    ("corrupt_pages", "corrupt_pages", "Pages that failed their checks on read."),
    ("evictions", "evictions", "Pages the backend evicted to make room."),
    ("errors", "errors", "Failed calls and failed commands."),
)


# (direction label, CacheStats byte counter) of ``transfer_bytes_total``.
_TRANSFER_FIELDS: tuple[tuple[str, str], ...] = (
    ("device_to_host", "bytes_device_to_host"),
    ("host_to_device", "bytes_host_to_device"),
    ("storage_to_host", "bytes_storage_read"),
    ("host_to_storage", "bytes_storage_written"),
)
# (tier, direction into it, direction out of it one tier up) for the token counters.
_TIER_DIRECTIONS: tuple[tuple[str, str, str], ...] = (
    ("host", "device_to_host", "host_to_device"),
    ("storage", "host_to_storage", "storage_to_host"),
)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class _FamilyMaker:
    """Makes metric families named ``<namespace>_<name>`` with the constant labels first."""

    def __init__(self, namespace: str, labels: Mapping[str, str]) -> None:
        self.namespace = namespace
        self.names = list(labels)
        self.values = list(labels.values())

    def counter(self, name: str, doc: str, extra: Iterable[str] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(f"{self.namespace}_{name}", doc, labels=[*self.names, *extra])

    def gauge(self, name: str, doc: str, extra: Iterable[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{self.namespace}_{name}", doc, labels=[*self.names, *extra])

    def labels(self, *more: str) -> list[str]:
        """The constant label values followed by ``more``."""
        return [*self.values, *more]


def _lookup_families(make: _FamilyMaker, s: Any) -> Iterator[Metric]:
    """The plain cache counters, and the hit and miss tokens per tier (``s``: CacheStats or None)."""
    for suffix, field, doc in _CACHE_COUNTERS:
        c = make.counter(suffix, doc)
        if s is not None:
            c.add_metric(make.values, _num(getattr(s, field, 0)))
        yield c
    hit = make.counter("hit_tokens", "Prompt tokens found on each tier.", ["tier"])
    miss = make.counter("miss_tokens", "Prompt tokens found on no tier down to this one.", ["tier"])
    if s is not None:
        # A token that misses a tier goes on to the next: what is left after each.
        remaining = _num(s.tokens_requested)
        for tier in _TIERS_HIT:
            h = _num(getattr(s, f"tokens_{tier}_hit", 0))
            hit.add_metric(make.labels(tier), h)
            remaining = max(0.0, remaining - h)
            miss.add_metric(make.labels(tier), remaining)
    yield hit
    yield miss


def _transfer_families(make: _FamilyMaker, s: Any, token_bytes: float) -> Iterator[Metric]:
    """Bytes moved per direction, and the tokens they make (when the token size is known)."""
    moved = {direction: _num(getattr(s, field, 0)) for direction, field in _TRANSFER_FIELDS}
    tb = make.counter("transfer_bytes", "Bytes moved between tiers.", ["direction"])
    if s is not None:
        for direction, n in moved.items():
            tb.add_metric(make.labels(direction), n)
    yield tb
    loaded = make.counter(
        "loaded_tokens", "Tokens copied out of a tier into the tier above it.", ["tier"]
    )
    stored = make.counter("stored_tokens", "Tokens copied into a tier.", ["tier"])
    if s is not None and token_bytes:
        for tier, into, out_of in _TIER_DIRECTIONS:
            loaded.add_metric(make.labels(tier), moved[out_of] // token_bytes)
            stored.add_metric(make.labels(tier), moved[into] // token_bytes)
    yield loaded
    yield stored


def _eviction_families(make: _FamilyMaker, s: Any) -> Iterator[Metric]:
    """Evictions per tier and prefetch outcomes."""
    ev = make.counter("evictions", "Evictions from a tier.", ["tier"])
    evt = make.counter("evicted_tokens", "Tokens evicted from a tier.", ["tier"])
    po = make.counter(
        "prefetch_outcomes", "Storage prefetches that ended, by outcome.", ["outcome"]
    )
    if s is not None:
        for tier in ("device", "host"):
            ev.add_metric(make.labels(tier), _num(getattr(s, f"{tier}_evictions", 0)))
            evt.add_metric(make.labels(tier), _num(getattr(s, f"{tier}_evicted_tokens", 0)))
        for outcome in ("completed", "revoked", "terminated", "failed"):
            po.add_metric(make.labels(outcome), _num(getattr(s, f"prefetch_{outcome}", 0)))
    yield ev
    yield evt
    yield po


def _tier_gauges(make: _FamilyMaker, extra: Mapping[str, Any]) -> Iterator[Metric]:
    """Storage attachment and health, cached tokens and free slots (from ``CacheStats.extra``)."""
    attached = make.gauge("storage_attached", "1 while a storage backend is attached.")
    up = make.gauge(
        "storage_up",
        "1 while the attached storage backend answers, 0 while it is down and probed.",
    )
    if "storage_attached" in extra:
        attached.add_metric(make.values, _num(extra["storage_attached"]))
        if extra["storage_attached"]:
            up.add_metric(make.values, 1.0 - _num(extra.get("storage_down", 0)))
    yield attached
    yield up
    cached = make.gauge("cached_tokens", "Tokens held on a tier.", ["tier"])
    free = make.gauge("free_slots", "Free token slots on a tier.", ["tier"])
    for tier in ("device", "host"):
        if f"{tier}_tokens_cached" in extra:
            cached.add_metric(make.labels(tier), _num(extra[f"{tier}_tokens_cached"]))
        if f"{tier}_free" in extra:
            free.add_metric(make.labels(tier), _num(extra[f"{tier}_free"]))
    yield cached
    yield free


def _backend_families(make: _FamilyMaker, s: Any, backend: str) -> Iterator[Metric]:
    """A storage backend's own counters (``s``: BackendStats or None), labelled by its name."""
    for suffix, field, doc in _BACKEND_COUNTERS:
        c = make.counter(f"backend_{suffix}", doc, ["backend"])
        if s is not None:
            c.add_metric(make.labels(backend), _num(getattr(s, field, 0)))
        yield c


# (metric suffix, ServerStats field, help) of a node server (`tiercache.serve.NodeServer`).
_SERVE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("serve_pages", "pages", "Pages held in the node server's arena."),
    ("serve_leases", "leases", "Read leases held on arena pages."),
    ("serve_reservations", "writing", "Arena pages reserved and being written."),
    ("serve_clients", "clients", "Client connections."),
    (
        "serve_write_behind_backlog",
        "write_behind_backlog",
        "Pages waiting to be written to storage.",
    ),
)
_SERVE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("serve_hits", "hits", "Pages leased to clients (read-through included)."),
    ("serve_misses", "misses", "Pages asked for and not found."),
    ("serve_read_through", "read_through", "Pages read from storage into the arena on a miss."),
    ("serve_evictions", "evictions", "Unleased pages evicted to make room."),
    ("serve_refused_writes", "refused_writes", "Writes refused: every evictable page leased."),
    ("serve_write_behind_done", "write_behind_done", "Pages written behind to storage."),
    ("serve_write_behind_failed", "write_behind_failed", "Write-behind pages that failed."),
    ("serve_refused_peers", "refused_peers", "Connections refused by their credentials."),
    ("serve_bad_frames", "bad_frames", "Malformed, oversized or refused frames."),
)


def _serve_families(make: _FamilyMaker, s: Any) -> Iterator[Metric]:
    """A node server's arena, leases, clients and traffic (``s``: ServerStats or None)."""
    arena = make.gauge("serve_arena_bytes", "Arena bytes used and free.", ["state"])
    if s is not None:
        arena.add_metric(make.labels("used"), _num(s.arena_used_bytes))
        arena.add_metric(make.labels("free"), _num(s.arena_free_bytes))
    yield arena
    for suffix, field, doc in _SERVE_GAUGES:
        g = make.gauge(suffix, doc)
        if s is not None:
            g.add_metric(make.values, _num(getattr(s, field, 0)))
        yield g
    for suffix, field, doc in _SERVE_COUNTERS:
        c = make.counter(suffix, doc)
        if s is not None:
            c.add_metric(make.values, _num(getattr(s, field, 0)))
        yield c


class TierCacheCollector(Collector):
    """A Prometheus collector over one tiercache object's ``stats()``, plus latency histograms.

    Args:
        source: any object with ``stats()`` returning `tiercache.cache.CacheStats`
            (a `TierCache`) or `tiercache.storage.BackendStats` (a storage
            backend, whose ``stats()`` is a coroutine function). For a cache,
            token counts are derived from its byte counters and
            ``source.layout.token_bytes`` (every copy moves whole tokens).
        loop: the event loop that owns ``source``; ``stats()`` is run on it at
            scrape time. ``None``: call ``stats()`` on the scraping thread
            (only for a synchronous ``stats()``).
        namespace: the first word of every metric name.
        labels: constant labels added to every sample (e.g. ``{"engine": "sglang"}``).
        scrape_timeout_s: how long a scrape waits for ``stats()`` on the loop.

    Raises:
        TypeError: ``source`` has no callable ``stats``.
        ValueError: ``scrape_timeout_s`` is not positive.

    The collector adds itself as a `tiercache.observe` sink when created (of
    an open cache's timings only, else of every timing in the process);
    `close` / `aclose` remove it, unregister it and stop the loop sampler.
    """

    def __init__(
        self,
        source: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        namespace: str = "tiercache",
        labels: Mapping[str, str] | None = None,
        scrape_timeout_s: float = 2.0,
    ) -> None:
        if not callable(getattr(source, "stats", None)):
            raise TypeError(f"{type(source).__name__} has no stats() method")
        if not scrape_timeout_s > 0:
            raise ValueError(f"scrape_timeout_s must be > 0, got {scrape_timeout_s!r}")
        self.source = source
        self.loop = loop
        self.namespace = namespace
        self.labels: dict[str, str] = dict(labels or {})
        self.scrape_timeout_s = scrape_timeout_s
        names = tuple(self.labels)
        values = tuple(self.labels.values())
        self._copy = Histogram(
            "copy_duration_seconds",
            "Duration of one copy job on a copy stream.",
            [*names, "stream"],
            namespace=namespace,
            registry=None,
            buckets=LATENCY_BUCKETS,
        )
        self._storage = Histogram(
            "storage_call_duration_seconds",
            "Duration of one storage backend call made by the storage tier.",
            [*names, "op", "outcome"],
            namespace=namespace,
            registry=None,
            buckets=LATENCY_BUCKETS,
        )
        self._lag = Histogram(
            "event_loop_lag_seconds",
            "How much later than asked a sleep on the event loop woke up.",
            list(names),
            namespace=namespace,
            registry=None,
            buckets=LOOP_LAG_BUCKETS,
        )
        self._label_values = values
        self._registries: list[CollectorRegistry] = []
        self._lag_task: asyncio.Task[None] | None = None
        self._lag_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        observe.add_sink(self, source=_observe_source(source))

    # -- the latency sink ------------------------------------------------------

    def observe(self, kind: str, op: str, seconds: float, outcome: str) -> None:
        """`tiercache.observe.LatencySink`: record one copy or storage call (any thread)."""
        if kind == "copy":
            self._copy.labels(*self._label_values, op).observe(seconds)
        elif kind == "storage":
            self._storage.labels(*self._label_values, op, outcome).observe(seconds)

    # -- the event loop lag sampler -----------------------------------------

    def watch_loop(
        self, loop: asyncio.AbstractEventLoop | None = None, *, interval_s: float = 0.05
    ) -> None:
        """Start sampling the lag of ``loop`` (default: ``self.loop``) every ``interval_s``.

        Each sample sleeps ``interval_s`` on the loop and records how much
        later it woke up: the time something else held the loop. Callable
        from any thread; a second call while sampling does nothing.

        Raises:
            ValueError: no loop given or known, or ``interval_s`` not positive.
        """
        loop = loop or self.loop
        if loop is None:
            raise ValueError("watch_loop needs an event loop")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")

        def start() -> None:
            with self._lock:
                if self._closed or self._lag_task is not None:
                    return
                self._lag_loop = loop
                self._lag_task = loop.create_task(self._sample_lag(loop, interval_s))

        if _on_loop(loop):
            start()
        else:
            loop.call_soon_threadsafe(start)

    async def _sample_lag(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        child = self._lag.labels(*self._label_values) if self._label_values else self._lag
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval_s)
            child.observe(max(0.0, loop.time() - t0 - interval_s))

    # -- prometheus_client's Collector ---------------------------------------

    def describe(self) -> Iterable[Metric]:
        """The metric families without samples (lets the registry check names without a scrape)."""
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        """One scrape: ``stats()`` read now, plus the histograms. Never raises for a failed read."""
        stats = self._read_stats()
        return list(self._families(stats))

    def _read_stats(self) -> Any:
        try:
            loop = self.loop
            if loop is not None and loop.is_running() and not _on_loop(loop):
                fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
                    self._stats_on_loop(), loop
                )
                try:
                    return fut.result(self.scrape_timeout_s)
                except concurrent.futures.TimeoutError:
                    fut.cancel()
                    logger.warning(
                        "metrics: stats() did not answer within %g s", self.scrape_timeout_s
                    )
                    return None
            out = self.source.stats()
            if inspect.isawaitable(out):
                with contextlib.suppress(AttributeError):
                    out.close()  # type: ignore[attr-defined]
                logger.warning("metrics: %r needs its event loop to read stats()", self.source)
                return None
            return out
        except Exception as e:  # a scrape must not fail because the source is closing
            logger.warning("metrics: stats() failed: %r", e)
            return None

    async def _stats_on_loop(self) -> Any:
        out = self.source.stats()
        if inspect.isawaitable(out):
            out = await out
        return out

    def _families(self, stats: Any) -> Iterator[Metric]:
        """The metric families of one scrape (``stats`` read now), or of `describe` (``None``).

        A cache's stats give the cache families, a backend's the backend
        families; without stats, the families of what ``source`` is.
        """
        make = _FamilyMaker(self.namespace, self.labels)
        if stats is None:
            serve = hasattr(self.source, "arena_path")
            backend = self._watches_backend()
            cache = not backend and not serve
        else:
            serve = hasattr(stats, "arena_used_bytes")
            backend = hasattr(stats, "get_pages")
            cache = hasattr(stats, "tokens_requested")
        if serve:
            yield from _serve_families(make, stats)
        if cache:
            token_bytes = _num(getattr(getattr(self.source, "layout", None), "token_bytes", 0))
            yield from _lookup_families(make, stats)
            yield from _transfer_families(make, stats, token_bytes)
            yield from _eviction_families(make, stats)
            yield from _tier_gauges(make, getattr(stats, "extra", None) or {})
        if backend:
            name = str(getattr(self.source, "name", "storage"))
            yield from _backend_families(make, stats, name)
        yield from self._copy.collect()
        yield from self._storage.collect()
        yield from self._lag.collect()

    def _watches_backend(self) -> bool:
        from tiercache.storage.base import StorageBackend

        return isinstance(self.source, StorageBackend)

    # -- lifecycle --------------------------------------------------------------

    def register_in(self, registry: CollectorRegistry) -> None:
        """Register in ``registry`` and remember it, so that `close` unregisters from it.

        Callable from any thread.

        Raises:
            ValueError: ``registry`` already holds a collector exporting the
                same names (nothing is remembered then).
        """
        registry.register(self)
        self._registries.append(registry)

    def close(self) -> None:
        """Unregister from every registry `register_in` put it in, stop observing and sampling.

        Idempotent; callable from any thread. The loop sampler is cancelled;
        `aclose` also waits for it to end.
        """
        with self._lock:
            self._closed = True
            task, loop = self._lag_task, self._lag_loop
        observe.remove_sink(self)
        for registry in self._registries:
            with contextlib.suppress(KeyError):
                registry.unregister(self)
        self._registries.clear()
        if task is not None and loop is not None and not task.done():
            if _on_loop(loop):
                task.cancel()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

    async def aclose(self) -> None:
        """`close`, then wait for the loop sampler to end (call on the sampled loop)."""
        self.close()
        task = self._lag_task
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __repr__(self) -> str:
        return f"TierCacheCollector({self.source!r}, labels={self.labels!r})"


def _observe_source(source: Any) -> object | None:
    """The `tiercache.observe` source whose timings belong to ``source``.

    An open `TierCache`'s copy streams and storage tier report with its
    controller's ``observe_source``; anything else (a storage backend, a
    cache not open yet) has none, and its collector records every timing in
    the process.
    """
    from tiercache.cache import TierCache

    if isinstance(source, TierCache):
        with contextlib.suppress(TierCacheError):
            return source.controller.observe_source
    return None


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def register(
    source: Any,
    registry: CollectorRegistry | None = None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    labels: Mapping[str, str] | None = None,
    watch_loop: bool = True,
    loop_lag_interval_s: float = 0.05,
) -> TierCacheCollector:
    """Create a `TierCacheCollector` for ``source`` and register it in ``registry``.

    This is the one call a host application (or an engine adapter) makes.

    Args:
        source: a `TierCache`, a storage backend, or any object whose
            ``stats()`` returns one of their stats types.
        registry: the application's ``CollectorRegistry`` (default:
            ``prometheus_client``'s global ``REGISTRY``).
        loop: the loop that owns ``source``; default: the running loop when
            called on one (the usual case), else ``None``.
        labels: constant labels on every sample.
        watch_loop: also sample the lag of ``loop`` (needs a loop).
        loop_lag_interval_s: the sampler's period.

    Returns:
        The registered collector; ``close()`` or ``await aclose()`` undoes
        everything this call did.

    Raises:
        TypeError: ``source`` has no ``stats()``.
        ValueError: the registry already holds a collector exporting the same
            names (see the module docstring).
    """
    if loop is None:
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
    collector = TierCacheCollector(source, loop=loop, labels=labels)
    registry = registry if registry is not None else REGISTRY
    try:
        collector.register_in(registry)
    except BaseException:
        collector.close()
        raise
    if watch_loop and loop is not None:
        collector.watch_loop(loop, interval_s=loop_lag_interval_s)
    return collector
