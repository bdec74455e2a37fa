"""Prometheus metrics: the collector reads stats() at scrape time, the histograms
fill from real copies and storage calls, and the demo serves it all over HTTP."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.redis_server import free_port

import tiercache.metrics
from tiercache import TierCache, TierCacheConfig, observe
from tiercache.demo import CONFIG_NAMES, run_demo, settings_for
from tiercache.storage.base import PageKey
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.memory import MemoryBackend

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return _parse(r.read().decode())


def _check_cache_samples(samples: Samples, stats: Any, token_bytes: int, **labels: str) -> None:
    """Every counter of the cache's stats() appears with the same value."""
    g = lambda name, **kw: _get(samples, name, **labels, **kw)  # noqa: E731
    assert g("tiercache_requests_total") == stats.requests
    assert g("tiercache_requested_tokens_total") == stats.tokens_requested
    remaining = stats.tokens_requested
    for tier in ("device", "host", "storage"):
        hit = getattr(stats, f"tokens_{tier}_hit")
        remaining -= hit
        assert g("tiercache_hit_tokens_total", tier=tier) == hit
        assert g("tiercache_miss_tokens_total", tier=tier) == remaining
    moved = {
        "device_to_host": stats.bytes_device_to_host,
        "host_to_device": stats.bytes_host_to_device,
        "storage_to_host": stats.bytes_storage_read,
        "host_to_storage": stats.bytes_storage_written,
    }
    for direction, n in moved.items():
        assert g("tiercache_transfer_bytes_total", direction=direction) == n
    assert g("tiercache_loaded_tokens_total", tier="host") == moved["host_to_device"] // token_bytes
    assert g("tiercache_loaded_tokens_total", tier="storage") == (
        moved["storage_to_host"] // token_bytes
    )
    assert g("tiercache_stored_tokens_total", tier="host") == moved["device_to_host"] // token_bytes
    assert g("tiercache_stored_tokens_total", tier="storage") == (
        moved["host_to_storage"] // token_bytes
    )
    for outcome in ("completed", "revoked", "terminated", "failed"):
        assert g("tiercache_prefetch_outcomes_total", outcome=outcome) == getattr(
            stats, f"prefetch_{outcome}"
        )
    for tier in ("device", "host"):
        assert g("tiercache_evictions_total", tier=tier) == getattr(stats, f"{tier}_evictions")
        assert g("tiercache_evicted_tokens_total", tier=tier) == getattr(
            stats, f"{tier}_evicted_tokens"
        )
        assert g("tiercache_cached_tokens", tier=tier) == stats.extra[f"{tier}_tokens_cached"]
        assert g("tiercache_free_slots", tier=tier) == stats.extra[f"{tier}_free"]
    assert g("tiercache_inserted_tokens_total") == stats.tokens_inserted
    assert g("tiercache_prefetches_total") == stats.prefetches
    assert g("tiercache_storage_backups_total") == stats.storage_backups
    assert g("tiercache_storage_auto_detaches_total") == stats.storage_auto_detaches
    assert g("tiercache_host_writes_skipped_total") == stats.host_writes_skipped
    assert g("tiercache_storage_outages_total") == stats.storage_outages
    assert g("tiercache_storage_reconnects_total") == stats.storage_reconnects
    assert g("tiercache_storage_errors_total") == stats.storage_errors
    assert g("tiercache_storage_attached") == stats.extra["storage_attached"]


async def test_demo_metrics_endpoint_agrees_with_stats(tmp_path: Path) -> None:
    port = free_port()
    seen: dict[str, Samples] = {}

    async def check(name: str, cache: TierCache) -> None:
        # A real HTTP scrape from another thread, while the loop that owns the cache runs.
        samples = await asyncio.to_thread(_scrape, port)
        _check_cache_samples(samples, cache.stats(), cache.layout.token_bytes, config=name)
        seen[name] = samples

    report = await run_demo(
        tmp_path, settings_for(quick=True), progress=False, metrics_port=port, on_config_done=check
    )
    assert report["tokens_identical"]
    assert list(seen) == list(CONFIG_NAMES)
    full = seen["all_tiers"]
    labels = {"config": "all_tiers"}
    assert _get(full, "tiercache_hit_tokens_total", tier="storage", **labels) > 0
    assert _get(full, "tiercache_transfer_bytes_total", direction="storage_to_host", **labels) > 0
    assert _get(full, "tiercache_prefetch_outcomes_total", outcome="completed", **labels) > 0
    assert _get(full, "tiercache_storage_up", **labels) == 1.0
    # The histograms were fed by the real copies, storage calls and the loop sampler.
    copies = sum(v for (n, _), v in full.items() if n == "tiercache_copy_duration_seconds_count")
    assert copies > 0
    assert (
        _get(
            full, "tiercache_storage_call_duration_seconds_count", op="get", outcome="ok", **labels
        )
        > 0
    )
    assert _get(full, "tiercache_event_loop_lag_seconds_count", **labels) > 0
    # Without storage there is no storage_up sample.
    assert not any(n == "tiercache_storage_up" for (n, _) in seen["device_host"])
    # The server is gone once the demo returns.
    with pytest.raises(OSError):
        await asyncio.to_thread(_scrape, port)


def test_cli_demo_serves_metrics_while_it_runs(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiercache", "demo", "--quick", "--no-progress"]
        + ["--dir", str(tmp_path / "out"), "--metrics-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    requests = 0.0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and requests == 0:
            try:
                samples = _scrape(port)
            except OSError:
                time.sleep(0.05)
                continue
            requests = sum(v for (n, _), v in samples.items() if n == "tiercache_requests_total")
            time.sleep(0.02)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert requests > 0
    assert f"http://127.0.0.1:{port}/metrics" in err


def _config(**kw: Any) -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        device="cpu",
        **kw,
    )


async def _insert(cache: TierCache, tokens: list[int]) -> None:
    """Compute and commit ``tokens`` as one new request, then wait for its copies."""
    async with cache.request(tokens) as req:
        await req.commit(tokens, await req.alloc(len(tokens)))
    await cache.wait_idle()


async def test_collector_reads_stats_on_the_cache_loop_at_scrape_time() -> None:
    registry = CollectorRegistry()
    async with TierCache(_config(storage_url="memory://")) as cache:
        collector = tiercache.metrics.register(cache, registry, labels={"engine": "test"})
        try:
            tokens = list(range(16))
            await _insert(cache, tokens)
            async with cache.request(tokens) as req:
                assert req.cached_tokens > 0
            # Scrape from another thread: stats() runs on this loop meanwhile.
            text = await asyncio.to_thread(generate_latest, registry)
            _check_cache_samples(
                _parse(text.decode()), cache.stats(), cache.layout.token_bytes, engine="test"
            )
        finally:
            await collector.aclose()
    # Closing unregistered it and removed its latency sink.
    assert not [m for m in registry.collect() if m.name.startswith("tiercache")]
    assert collector not in observe.sinks()


async def test_small_copies_run_inline_are_timed_too() -> None:
    """A CPU copy small enough to run inline is still a copy job the histogram counts."""
    registry = CollectorRegistry()
    async with TierCache(_config()) as cache:
        assert cache.layout.page_bytes * 4 < cache.controller.inline_copy_bytes
        collector = tiercache.metrics.register(cache, registry, watch_loop=False)
        try:
            tokens = list(range(16))
            async with cache.request(tokens) as req:
                await req.commit(tokens, await req.alloc(len(tokens)))
            await cache.wait_idle()
            await cache.evict_device(16)
            async with cache.request(tokens) as req:
                assert req.cached_tokens == 12
                await req.wait_loaded()
            samples = _parse((await asyncio.to_thread(generate_latest, registry)).decode())
        finally:
            await collector.aclose()
    counts = {
        dict(labels)["stream"]: v
        for (n, labels), v in samples.items()
        if n == "tiercache_copy_duration_seconds_count"
    }
    assert counts.get("write", 0) >= 1
    assert counts.get("load", 0) >= 1


async def test_storage_backend_collector_and_call_outcomes() -> None:
    registry = CollectorRegistry()
    backend = MemoryBackend()
    collector = tiercache.metrics.register(backend, registry, watch_loop=False)
    try:
        key = PageKey("k1")
        observe.observe("storage", "get", 0.002, "error")
        await backend.batch_exists([key])
        text = await asyncio.to_thread(generate_latest, registry)
        samples = _parse(text.decode())
        stats = await backend.stats()
        assert _get(samples, "tiercache_backend_exists_calls_total", backend="memory") == (
            stats.exists_calls
        )
        assert (
            _get(
                samples, "tiercache_storage_call_duration_seconds_count", op="get", outcome="error"
            )
            == 1
        )
        # The 2 ms call sits in the 2.5 ms bucket and above, not below.
        bucket = "tiercache_storage_call_duration_seconds_bucket"
        assert _get(samples, bucket, op="get", outcome="error", le="0.001") == 0
        assert _get(samples, bucket, op="get", outcome="error", le="0.0025") == 1
    finally:
        await collector.aclose()
        await backend.aclose()


async def test_two_collectors_in_one_registry_are_refused() -> None:
    registry = CollectorRegistry()
    backend = MemoryBackend()
    first = tiercache.metrics.register(backend, registry, watch_loop=False)
    try:
        with pytest.raises(ValueError, match="Duplicated"):
            tiercache.metrics.register(backend, registry, watch_loop=False)
        # The refused one did not stay a latency sink.
        assert (
            len([s for s in observe.sinks() if isinstance(s, tiercache.metrics.TierCacheCollector)])
            == 1
        )
    finally:
        await first.aclose()
        await backend.aclose()


async def test_register_in_two_registries_and_close_leaves_both() -> None:
    backend = MemoryBackend()
    first, second = CollectorRegistry(), CollectorRegistry()
    collector = tiercache.metrics.TierCacheCollector(backend)
    try:
        collector.register_in(first)
        collector.register_in(second)
        for registry in (first, second):
            assert b"tiercache_backend_get_pages_total" in generate_latest(registry)
        with pytest.raises(ValueError, match="Duplicated"):
            collector.register_in(first)
    finally:
        await collector.aclose()
        await backend.aclose()
    for registry in (first, second):
        assert b"tiercache_backend_get_pages_total" not in generate_latest(registry)


def test_source_without_stats_is_refused() -> None:
    with pytest.raises(TypeError, match="stats"):
        tiercache.metrics.TierCacheCollector(object())


async def test_storage_outage_and_reconnect_show_in_fault_state_metrics() -> None:
    registry = CollectorRegistry()
    config = _config(
        prefetch_threshold=4,
        storage_fault_threshold=1,
        storage_reconnect_backoff_s=0.01,
        storage_reconnect_backoff_max_s=0.02,
    )
    async with TierCache(config) as cache:
        faulty = FaultyBackend(MemoryBackend())
        await cache.attach_storage(faulty)
        collector = tiercache.metrics.register(cache, registry, watch_loop=False)
        try:
            scrape = lambda: asyncio.to_thread(generate_latest, registry)  # noqa: E731
            assert _get(_parse((await scrape()).decode()), "tiercache_storage_up") == 1.0
            faulty.fail_all(True)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while cache.stats().storage_outages == 0:
                assert loop.time() < deadline, "the storage tier never declared an outage"
                async with cache.request(list(range(32))):
                    pass
                await asyncio.sleep(0.01)
            samples = _parse((await scrape()).decode())
            assert _get(samples, "tiercache_storage_up") == 0.0
            assert _get(samples, "tiercache_storage_outages_total") == 1
            assert (
                _get(
                    samples,
                    "tiercache_storage_call_duration_seconds_count",
                    op="exists",
                    outcome="error",
                )
                >= 1
            )
            faulty.fail_all(False)
            while cache.stats().storage_reconnects == 0:
                assert loop.time() < deadline, "the storage tier never reconnected"
                await asyncio.sleep(0.01)
            samples = _parse((await scrape()).decode())
            assert _get(samples, "tiercache_storage_up") == 1.0
            assert _get(samples, "tiercache_storage_reconnects_total") == 1
        finally:
            await collector.aclose()


async def test_storage_counters_do_not_go_down_when_the_backend_is_detached() -> None:
    """Prometheus counters only grow: the counts of a detached backend stay in the totals."""
    registry = CollectorRegistry()
    config = _config(
        prefetch_threshold=4,
        prefetch_policy="wait_complete",
        storage_fault_policy="auto_detach",
        storage_fault_threshold=2,
    )
    async with TierCache(config) as cache:
        collector = tiercache.metrics.register(cache, registry, watch_loop=False)
        try:
            await cache.attach_storage(MemoryBackend())
            prompt = list(range(17))
            async with cache.request(prompt) as req:
                slots = await req.alloc(len(prompt))
                await req.commit(prompt, slots)
            await cache.wait_idle()
            written = cache.stats().bytes_storage_written
            assert written > 0
            await cache.detach_storage()  # by hand
            assert cache.stats().bytes_storage_written == written
            faulty = FaultyBackend(MemoryBackend())
            await cache.attach_storage(faulty)
            faulty.fail_all(True)
            for i in range(2):  # two failed queries: the fault policy detaches it
                await cache.prefetch(list(range(100 + i, 117 + i)))
            await cache.wait_idle()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while cache.controller.storage is not None:  # the detach runs in the background
                assert loop.time() < deadline, "the fault policy never detached the backend"
                await asyncio.sleep(0.01)
            s = cache.stats()
            assert s.storage_auto_detaches == 1
            assert s.storage_errors == 2 and s.bytes_storage_written == written
            samples = _parse((await asyncio.to_thread(generate_latest, registry)).decode())
            assert _get(samples, "tiercache_storage_errors_total") == 2
            assert _get(samples, "tiercache_transfer_bytes_total", direction="host_to_storage") == (
                written
            )
            assert _get(samples, "tiercache_storage_attached") == 0
        finally:
            await collector.aclose()


def test_register_from_an_engine_thread_with_the_adapter_loop() -> None:
    """How an engine adapter registers: from the engine's thread, naming the loop it owns."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="adapter-loop", daemon=True)
    thread.start()
    try:
        backend = MemoryBackend()
        on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(5)  # noqa: E731
        on_loop(backend.batch_exists([PageKey("k1")]))
        registry = CollectorRegistry()
        collector = tiercache.metrics.register(
            backend, registry, loop=loop, labels={"engine": "x"}, loop_lag_interval_s=0.005
        )
        deadline = time.monotonic() + 10
        while True:
            samples = _parse(generate_latest(registry).decode())
            lag = samples.get(("tiercache_event_loop_lag_seconds_count", (("engine", "x"),)), 0)
            if lag >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert lag >= 2  # the sampler runs on the adapter's loop
        assert (
            _get(samples, "tiercache_backend_exists_calls_total", backend="memory", engine="x") == 1
        )
        collector.close()
        on_loop(asyncio.sleep(0.05))
        assert not [m for m in registry.collect() if m.name.startswith("tiercache")]
        on_loop(backend.aclose())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_cli_demo_with_a_taken_metrics_port_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercache.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["demo", "--quick", "--dir", str(tmp_path), "--metrics-port", str(port)])
    assert rc == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err


def _histogram_counts(registry: CollectorRegistry) -> dict[str, float]:
    """Observation counts of the copy and storage-call histograms, summed over labels."""
    samples = _parse(generate_latest(registry).decode())
    out = {"copy": 0.0, "storage": 0.0}
    for (name, _), value in samples.items():
        if name == "tiercache_copy_duration_seconds_count":
            out["copy"] += value
        elif name == "tiercache_storage_call_duration_seconds_count":
            out["storage"] += value
    return out


async def test_two_caches_in_one_process_each_time_only_their_own_work() -> None:
    """A collector's copy and storage histograms hold its cache's timings, not the other's."""
    ra, rb = CollectorRegistry(), CollectorRegistry()
    async with (
        TierCache(_config(storage_url="memory://", prefetch_threshold=4)) as a,
        TierCache(_config(storage_url="memory://", prefetch_threshold=4)) as b,
    ):
        ca = tiercache.metrics.register(a, ra, labels={"instance": "a"}, watch_loop=False)
        cb = tiercache.metrics.register(b, rb, labels={"instance": "b"}, watch_loop=False)
        try:
            tokens = list(range(32))
            await _insert(a, tokens)
            await a.flush()
            async with a.request(tokens) as req:
                await req.wait_loaded()
            await a.wait_idle()
            assert a.stats().bytes_device_to_host > 0 and a.stats().bytes_storage_read > 0
            assert b.stats().requests == 0
            counts_a, counts_b = _histogram_counts(ra), _histogram_counts(rb)
            assert counts_a["copy"] > 0 and counts_a["storage"] > 0
            assert counts_b == {"copy": 0.0, "storage": 0.0}
        finally:
            await ca.aclose()
            await cb.aclose()
