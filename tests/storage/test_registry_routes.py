"""URL routes that lead to other modules: the fault injector and Redis cluster aliases."""

from __future__ import annotations

import pytest

from tiercache.errors import ConfigError
from tiercache.storage import open_backend
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.storage.registry import resolve_backend


async def test_any_faulty_plus_scheme_opens_the_fault_injector_around_its_inner_backend() -> None:
    b = await open_backend("faulty+memory://?fault=error&fault_p=1&fault_ops=get&fault_seed=3")
    try:
        assert isinstance(b, FaultyBackend)
        assert isinstance(b.inner, MemoryBackend)
    finally:
        await b.aclose()


async def test_faulty_url_errors_never_show_the_password() -> None:
    with pytest.raises(ConfigError) as e:
        await open_backend("faulty+memory://user:topsecret@x/")
    assert "topsecret" not in str(e.value)


def test_redis_cluster_schemes_resolve_to_the_redis_backend() -> None:
    from tiercache.storage.redis import RedisBackend

    assert resolve_backend("redis+cluster") is RedisBackend
    assert resolve_backend("rediss+cluster") is RedisBackend
