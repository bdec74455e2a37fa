"""Fixtures and factories for tests that need a real Redis.

Import the fixtures into a test module or a conftest
(``from tests.storage.redis_fixtures import redis_server, ...``). They skip
only when ``redis-server`` is missing.

- `shared_redis_server`: one server for the whole test process, started on
  first use and stopped at exit; tests keep apart by key prefix
  (`unique_prefix`). Never stop it in a test.
- ``redis_server``: that shared server, as a fixture.
- ``own_redis_server``: a fresh server for one test, which may kill, pause
  and restart it.
- ``make_redis_backend``: an async factory ``await make(url=None, **options)``
  opening a `RedisBackend` on the shared server under a unique prefix; every
  backend it made is cleared and closed at teardown.
- `redis_backend_factory`: the ``BACKEND_FACTORIES`` entry of the
  conformance suite (``async (tmp_path) -> StorageBackend``).
- ``redis_cluster``: a 3-master, 3-replica `LocalRedisCluster` shared by the
  tests of one module (keep apart by prefix; never kill its nodes).
- ``own_redis_cluster``: a fresh cluster for one test, which may kill nodes
  and promote replicas.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.redis_server import (
    LocalRedisCluster,
    RedisServer,
    require_redis_cluster,
    require_redis_server,
)

from tiercache.errors import StorageError
from tiercache.storage import StorageBackend
from tiercache.storage.redis import RedisBackend

__all__ = [
    "MakeRedisBackend",
    "make_redis_backend",
    "own_redis_cluster",
    "own_redis_server",
    "redis_backend_factory",
    "redis_cluster",
    "redis_server",
    "shared_redis_server",
    "unique_prefix",
]

MakeRedisBackend = Callable[..., Awaitable[RedisBackend]]

_shared: RedisServer | None = None
_shared_lock = threading.Lock()


def unique_prefix(tag: str = "t") -> str:
    """A key prefix no other test uses: ``"tctest:<tag>:<hex>:"``."""
    return f"tctest:{tag}:{uuid.uuid4().hex[:12]}:"


def shared_redis_server() -> RedisServer:
    """The process-wide test server, started on first call (blocks: not on the loop)."""
    global _shared
    binary = require_redis_server()
    with _shared_lock:
        if _shared is None or not _shared.running:
            server = RedisServer(binary)
            server.start()
            atexit.register(server.close)
            _shared = server
        return _shared


async def redis_backend_factory(tmp_path: Path) -> StorageBackend:
    """A `RedisBackend` on the shared server under a fresh prefix (conformance suite entry)."""
    server = await asyncio.to_thread(shared_redis_server)
    return await RedisBackend.from_url(server.url, prefix=unique_prefix("conf"), timeout=5)


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    """The shared redis-server (loopback TCP and a unix socket)."""
    return shared_redis_server()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server for this test alone; it may be killed, paused and restarted."""
    with RedisServer(require_redis_server()) as server:
        yield server


@pytest.fixture
async def make_redis_backend(redis_server: RedisServer) -> AsyncIterator[MakeRedisBackend]:
    """``await make(url=None, **options)``: a backend on the shared server under a fresh prefix."""
    made: list[RedisBackend] = []

    async def make(url: str | None = None, **options: Any) -> RedisBackend:
        options.setdefault("prefix", unique_prefix())
        backend = await RedisBackend.from_url(url or redis_server.url, **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        if backend.state.value == "open":
            with contextlib.suppress(StorageError):
                await backend.clear()
        await backend.aclose()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """3 masters + 3 replicas on loopback, shared by one test module; stopped after it."""
    with LocalRedisCluster(*require_redis_cluster()) as cluster:
        yield cluster


@pytest.fixture
def own_redis_cluster() -> Iterator[LocalRedisCluster]:
    """3 masters + 3 replicas for this test alone: it may kill masters and promote replicas."""
    with LocalRedisCluster(*require_redis_cluster()) as cluster:
        yield cluster
