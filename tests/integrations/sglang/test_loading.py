"""Loading through SGLang's own factory; options; the loop thread's lifecycle."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang


def _create(config_extra: dict[str, Any], g: h.Geometry | None = None) -> Any:
    """SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)``, then the pool registration."""
    g = g or h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    config = h.storage_config(extra_config=dict(config_extra), model_name="m")
    backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def _tiercache_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tiercache")]


def test_factory_loads_the_backend_by_module_and_class(file_store: str) -> None:
    from tiercache.integrations.sglang import TierCacheStorage

    backend = _create(h.extra(file_store))
    try:
        assert type(backend) is TierCacheStorage
        assert isinstance(backend, h.sg().HiCacheStorage)
        assert backend.model == "m"
        assert backend.namespace.model == "m"
        assert backend.batch_exists(h.chain(list(range(8)), 4)) == 0
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"url": None}, "'url'"),
        ({"timeout_s": 0}, "'timeout_s'"),
        ({"timeout_s": "fast"}, "'timeout_s'"),
        ({"fault_policy": "retry"}, "'fault_policy'"),
        ({"fault_threshold": 1.5}, "'fault_threshold'"),
        ({"fault_threshold": True}, "'fault_threshold'"),
        ({"reconnect_backoff_s": float("inf")}, "'reconnect_backoff_s'"),
        (
            {"reconnect_backoff_s": 10, "reconnect_backoff_max_s": 1},
            "'reconnect_backoff_max_s'",
        ),
        ({"reconnect_backoff_s": 60}, "'reconnect_backoff_max_s'"),
        ({"capacity_bytes": -1}, "'capacity_bytes'"),
        ({"capacity_bytes": 1.0}, "'capacity_bytes'"),
        ({"backend_options": [1]}, "'backend_options'"),
        ({"model_name": ""}, "'model_name'"),
        ({"compression": "zstd"}, "'compression'"),
    ],
)
def test_a_bad_option_is_refused_with_its_name(
    file_store: str, options: dict[str, Any], named: str
) -> None:
    from tiercache.errors import ConfigError

    before = _tiercache_threads()
    with pytest.raises(ConfigError, match=named):
        _create({**h.extra(file_store), **options})
    assert _tiercache_threads() == before


def test_an_unopenable_url_fails_the_attach_and_leaves_no_thread() -> None:
    from tiercache.errors import TierCacheError

    before = _tiercache_threads()
    with pytest.raises(TierCacheError):
        _create(h.extra("nosuchscheme://x"))
    assert _tiercache_threads() == before


def test_options_reach_the_tiercache_backend(file_store: str) -> None:
    backend = _create(
        h.extra(
            file_store,
            timeout_s=2.5,
            fault_policy="none",
            fault_threshold=3,
            capacity_bytes=1 << 20,
            model_name="shared-name",
        )
    )
    try:
        assert backend.options.timeout_s == 2.5
        assert backend.options.fault_policy == "none"
        assert backend.options.fault_threshold == 3
        assert backend.options.backend_options == {"capacity_bytes": 1 << 20}
        assert backend.namespace.model == "shared-name"
    finally:
        backend.close()


def test_the_options_are_a_hashable_frozen_value() -> None:
    from tiercache.integrations.sglang import SGLangOptions

    given = {"capacity_bytes": 10, "hosts": ["a"]}
    a = SGLangOptions.from_extra_config({"url": "memory://", "backend_options": given})
    b = SGLangOptions(url="memory://", backend_options=dict(given))
    assert a == b and hash(a) == hash(b)
    given["capacity_bytes"] = 20  # the caller's dict is copied
    assert a.backend_options["capacity_bytes"] == 10
    with pytest.raises(TypeError):
        a.backend_options["capacity_bytes"] = 30  # type: ignore[index]


def test_an_unsupported_host_layout_is_refused_by_name(file_store: str) -> None:
    from tiercache.errors import ConfigError

    g = h.Geometry(layout="page_first_direct")
    host = h.host_pool(g, h.device_pool(g))
    config = h.storage_config(extra_config=h.extra(file_store), model_name="m")
    backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
    try:
        with pytest.raises(ConfigError, match="page_first_direct"):
            backend.register_mem_pool_host(host)
    finally:
        backend.close()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_leaves_no_thread_and_no_file_descriptor(redis_server: Any) -> None:
    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    h.fill_random(host, 0)
    threads_before, fds_before = _tiercache_threads(), _fds()
    backend = _create(h.extra(redis_server.url), g)
    backend.register_mem_pool_host(host)
    keys = h.chain(list(range(16)), 4)
    idx = host.alloc(16)
    assert backend.batch_set_v1(keys, idx) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert len(_tiercache_threads()) == len(threads_before) + 1
    backend.close()
    backend.close()  # idempotent
    assert _tiercache_threads() == threads_before
    assert _fds() - fds_before == set()
    # After close every call is a miss, never an exception.
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, idx) == [False] * 4
    assert backend.batch_set_v1(keys, idx) == [False] * 4
