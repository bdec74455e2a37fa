"""Prometheus metrics of the backend: served per TP rank, equal to the backend's stats."""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any

import prometheus_client
import pytest
from tests.integrations.scrape import BACKEND_COUNTERS, free_port_pair, port_is_free, scrape
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang


def _backend(host: Any, *, tp_rank: int = 0, tp_size: int = 1, **options: Any) -> Any:
    config = h.storage_config(
        extra_config=h.extra(options.pop("url"), **options),
        model_name="m",
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def _round_trip(backend: Any, host: Any) -> None:
    keys = h.chain(list(range(24)), 4)
    idx = host.alloc(24)
    assert backend.batch_set_v1(keys, idx) == [True] * 6
    assert backend.batch_exists(keys) == 6
    assert backend.batch_get_v1(keys[:4], idx[:16]) == [True] * 4


def test_metrics_port_plus_tp_rank_serves_the_backend_stats_and_close_frees_it(
    file_store: str,
) -> None:
    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    h.fill_random(host, 3)
    port = free_port_pair()
    threads_before = set(threading.enumerate())
    backend = _backend(
        host,
        url=file_store,
        tp_rank=1,
        tp_size=2,
        metrics_port=port,
        metrics_addr="127.0.0.1",
    )
    try:
        assert backend.metrics.port == port + 1
        _round_trip(backend, host)
        scraped = scrape(port + 1)
        stats = backend.stats()
        labels = (("backend", backend.backend.name), ("engine", "sglang"), ("tp_rank", "1"))
        for name, field in BACKEND_COUNTERS.items():
            assert scraped[(name, labels)] == stats[f"backend.{field}"], name
        assert scraped[("tiercache_backend_set_written_total", labels)] == 6
        assert scraped[("tiercache_backend_get_hits_total", labels)] == 4
        server_thread = backend.metrics.thread
        assert server_thread is not None and server_thread.is_alive()
    finally:
        backend.close()
    backend.close()  # idempotent
    assert not server_thread.is_alive()
    assert port_is_free(port + 1)
    assert set(threading.enumerate()) - threads_before == set()


def test_metrics_registry_gets_the_collector_until_close(file_store: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    h.fill_random(host, 4)
    backend = _backend(host, url=file_store, metrics_registry=registry)
    try:
        assert backend.metrics.port is None  # no server without a port
        _round_trip(backend, host)
        stats = backend.stats()
        labels = {"backend": backend.backend.name, "engine": "sglang", "tp_rank": "0"}
        for name, field in BACKEND_COUNTERS.items():
            assert registry.get_sample_value(name, labels) == stats[f"backend.{field}"], name
    finally:
        backend.close()
    assert registry.get_sample_value("tiercache_backend_set_pages_total", labels) is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"metrics_port": -1}, r"extra_config\['metrics_port'\] must be a port"),
        ({"metrics_port": "9400"}, r"extra_config\['metrics_port'\] must be a port"),
        ({"metrics_port": True}, r"extra_config\['metrics_port'\] must be a port"),
        ({"metrics_addr": "127.0.0.1"}, r"extra_config\['metrics_addr'\] is set without"),
        ({"metrics_registry": {}}, r"extra_config\['metrics_registry'\] must be"),
    ],
)
def test_a_bad_metrics_option_is_refused_with_its_name(
    file_store: str, options: dict[str, Any], match: str
) -> None:
    from tiercache.errors import ConfigError

    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    with pytest.raises(ConfigError, match=match):
        _backend(host, url=file_store, **options)


def test_metrics_without_prometheus_client_is_a_config_error_naming_the_option(
    file_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache.errors import ConfigError

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    with pytest.raises(ConfigError, match=r"extra_config\['metrics_port'\].*prometheus_client"):
        _backend(host, url=file_store, metrics_port=0)


def test_a_port_in_use_fails_the_attach_and_leaves_no_thread_or_fd(file_store: str) -> None:
    from tiercache.errors import ConfigError

    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        threads_before = set(threading.enumerate())
        fds_before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(ConfigError, match=rf"metrics_port.*{port}"):
            _backend(host, url=file_store, metrics_port=port, metrics_addr="127.0.0.1")
        assert set(threading.enumerate()) - threads_before == set()
        assert set(os.listdir("/proc/self/fd")) - fds_before == set()


def test_a_rank_port_past_65535_is_refused_and_leaves_no_thread(file_store: str) -> None:
    from tiercache.errors import ConfigError

    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=r"metrics_port'\] 65535 \+ rank 1 is past port 65535"):
        _backend(host, url=file_store, tp_rank=1, tp_size=2, metrics_port=65535)
    assert set(threading.enumerate()) - before == set()


def test_dp_attention_ranks_on_one_host_get_a_port_each(
    file_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --enable-dp-attention SGLang gives the backend the rank within the
    # attention TP group: with --tp 2 --dp 2 both processes pass tp_rank 0
    # (dp_rank 0 and 1). Their processes are ranks 0 and 1 of SGLang's world.
    import torch.distributed as dist

    g = h.Geometry()
    port = free_port_pair()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    made = []
    try:
        for rank in (0, 1):
            monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
            host = h.host_pool(g, h.device_pool(g))
            config = h.storage_config(
                extra_config=h.extra(file_store, metrics_port=port, metrics_addr="127.0.0.1"),
                model_name="m",
                tp_rank=0,
                tp_size=1,
                dp_rank=rank,
            )
            backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
            made.append(backend)
            backend.register_mem_pool_host(host)
        assert [b.metrics.port for b in made] == [port, port + 1]
        assert scrape(port + 1)
    finally:
        for b in made:
            b.close()
