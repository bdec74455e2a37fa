"""The cache's background tasks share one `TaskGroup` and its one failure policy.

A deferred write-through that fails (here: the controller refuses the copy
with an unexpected error once the host room it waited for appears) is a bug
in the background: it is logged once when it happens, raised once as
`StateError` by the next call of the cache, or by `aclose` if no call came
first, and never again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from tests.cache.gated_backend import GatedBackend

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import StateError

PS = 16


def config() -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=256,
        host_tokens=64,
        model="background",
        write_policy="write_through",
        alloc_timeout_s=5.0,
    )


class Boom(RuntimeError):
    pass


async def a_failing_deferred_write(cache: TierCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defer a write-through behind a backup's pin, then make its copy fail once it may go."""
    backend = GatedBackend()
    await cache.attach_storage(backend)
    a = list(range(1000, 1064))
    await cache.insert(a, await cache.alloc_device(64))
    await cache.controller.wait_idle()
    await asyncio.sleep(0)  # A's backup starts and waits at the gate
    assert await cache.evict_device(256) == 64
    b = list(range(2000, 2064))
    await cache.insert(b, await cache.alloc_device(64))  # deferred: the host is pinned full

    def refuse(*_a: Any, **_k: Any) -> None:
        raise Boom("the copy could not start")

    monkeypatch.setattr(cache.controller, "submit_write", refuse)
    backend.gate.set()
    await cache.wait_idle()  # it raised nothing: the failure came after its first check
    assert cache.tasks.failures == 1


async def test_a_failed_deferred_write_is_raised_once_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with TierCache(config()) as cache:
        with caplog.at_level(logging.ERROR, logger="tiercache"):
            await a_failing_deferred_write(cache, monkeypatch)
        logged = [r for r in caplog.records if "deferred write-through failed" in r.getMessage()]
        assert len(logged) == 1
        with pytest.raises(StateError, match="background task of the cache failed") as e:
            cache.match_prefix(list(range(32)))
        assert isinstance(e.value.__cause__, Boom)
        cache.match_prefix(list(range(32)))  # raised once: the next call goes through
        assert cache.tasks.failures == 1
    # ... and not again at close.


async def test_a_failed_deferred_write_not_raised_before_is_raised_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = TierCache(config())
    await cache.open()
    try:
        await a_failing_deferred_write(cache, monkeypatch)
    finally:
        with pytest.raises(StateError) as e:
            await cache.aclose()
    assert isinstance(e.value.__cause__, Boom)
    await cache.aclose()  # closed: idempotent, raises nothing more
