"""Prometheus metrics of the tier's backend: served over HTTP, equal to the backend's stats."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.integrations.vllm.engine import require_vllm

require_vllm()
import prometheus_client  # noqa: E402
from tests.integrations.scrape import (  # noqa: E402
    BACKEND_COUNTERS,
    free_port_pair,
    port_is_free,
    scrape,
)
from tests.integrations.vllm.harness import (  # noqa: E402
    Instance,
    make_keys,
    names,
    offloading_config,
    payloads,
    tier_config,
)
from tests.redis_server import RedisServer, require_redis_server  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tiercache.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 4096


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in reversed(made):
        inst.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend_stats(tier: Any) -> Any:
    return tier._loop.run(tier._backend.stats(), timeout=5)


def test_metrics_port_serves_the_backend_stats_and_shutdown_frees_it(
    tmp_path: Path, instances: list[Instance]
) -> None:
    url = f"file://{tmp_path}"
    registry = prometheus_client.CollectorRegistry()
    a = Instance([tier_config(url, metrics_registry=registry)])
    instances.append(a)
    keys, data = make_keys(5), payloads(5, BLOCK)
    a.store(keys, data)
    stored = _backend_stats(a.tier)
    labels = {"backend": "file", "engine": "vllm", "tier": "TierCacheTier"}
    for name, field in BACKEND_COUNTERS.items():
        assert registry.get_sample_value(name, labels) == getattr(stored, field), name
    assert registry.get_sample_value("tiercache_backend_set_written_total", labels) == 5

    port = _free_port()
    threads_before = set(threading.enumerate())
    b = Instance([tier_config(url, metrics_port=port, metrics_addr="127.0.0.1")])
    instances.append(b)
    assert b.tier.metrics.port == port  # data-parallel index 0: the port as given
    ctx = b.request()
    assert names(b.lookup_until_settled(keys, ctx))[-1] == ["HIT"] * 5
    assert b.load(keys, ctx, BLOCK) == data
    b.settle()
    scraped = scrape(port)
    loaded = _backend_stats(b.tier)
    key = tuple(sorted(labels.items()))
    for name, field in BACKEND_COUNTERS.items():
        assert scraped[(name, key)] == getattr(loaded, field), name
    assert scraped[("tiercache_backend_get_hits_total", key)] == 5
    server_thread = b.tier.metrics.thread
    assert server_thread is not None and server_thread.is_alive()

    b.close()
    assert not server_thread.is_alive()
    assert port_is_free(port)
    assert set(threading.enumerate()) - threads_before == set()
    a.close()
    assert registry.get_sample_value("tiercache_backend_set_pages_total", labels) is None


def test_data_parallel_replicas_on_one_host_get_a_port_each(
    tmp_path: Path, instances: list[Instance]
) -> None:
    # Each vLLM data-parallel replica runs its own scheduler, so its own tier.
    port = free_port_pair()
    for dp in (0, 1):
        tier = tier_config(f"file://{tmp_path}", metrics_port=port, metrics_addr="127.0.0.1")
        instances.append(Instance([tier], dp_index=dp, dp_size=2))
    assert [i.tier.metrics.port for i in instances] == [port, port + 1]
    assert scrape(port + 1)


def _create(tmp_path: Path, **options: Any) -> Any:
    spec = TieringOffloadingSpec(offloading_config([tier_config(f"file://{tmp_path}")]))
    view = memoryview(np.zeros((8, BLOCK), dtype=np.int8))
    return SecondaryTierFactory.create_secondary_tier(
        {**tier_config(f"file://{tmp_path}"), **options}, view, spec
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"metrics_port": 70000}, "metrics_port must be a port"),
        ({"metrics_port": "9400"}, "metrics_port must be a port"),
        ({"metrics_addr": "127.0.0.1"}, "metrics_addr is set without metrics_port"),
        ({"metrics_registry": object()}, "metrics_registry must be"),
    ],
)
def test_a_bad_metrics_option_is_a_config_error_naming_it(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=match):
        _create(tmp_path, **options)
    assert set(threading.enumerate()) - before == set()


def test_metrics_without_prometheus_client_is_a_config_error_naming_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ConfigError, match="metrics_port needs the prometheus_client package"):
        _create(tmp_path, metrics_port=0)


def test_a_port_in_use_fails_the_tier_and_leaves_no_thread(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = set(threading.enumerate())
        with pytest.raises(ConfigError, match=rf"metrics_port: cannot serve .*:{port}"):
            _create(tmp_path, metrics_port=port, metrics_addr="127.0.0.1")
        assert set(threading.enumerate()) - before == set()


def test_a_second_collector_in_one_registry_is_a_config_error(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    first = _create(tmp_path, metrics_registry=registry)
    try:
        before = set(threading.enumerate())
        with pytest.raises(ConfigError, match="already holds tiercache's metrics"):
            _create(tmp_path, metrics_registry=registry)
        assert set(threading.enumerate()) - before == set()
    finally:
        first.shutdown()


@pytest.mark.redis
def test_a_store_down_at_start_is_exported_once_it_opens() -> None:
    registry = prometheus_client.CollectorRegistry()
    labels = {"backend": "redis", "engine": "vllm", "tier": "TierCacheTier"}
    with RedisServer(require_redis_server()) as server:
        server.stop()
        inst = Instance(
            [
                tier_config(
                    server.url, timeout_s=1.0, reopen_interval_s=0.2, metrics_registry=registry
                )
            ]
        )
        try:
            assert inst.tier.metrics.collector is None  # nothing to watch yet
            assert registry.get_sample_value("tiercache_backend_set_pages_total", labels) is None
            server.start()
            time.sleep(0.3)  # past reopen_interval_s
            keys, data = make_keys(2), payloads(2, BLOCK)
            inst.store(keys, data)
            assert inst.tier.metrics.collector is not None
            stats = _backend_stats(inst.tier)
            for name, field in BACKEND_COUNTERS.items():
                assert registry.get_sample_value(name, labels) == getattr(stats, field), name
            assert registry.get_sample_value("tiercache_backend_set_written_total", labels) == 2
        finally:
            inst.close()
