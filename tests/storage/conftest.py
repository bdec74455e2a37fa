"""Backends under test.

`BACKEND_FACTORIES` is the list of backends the conformance suite runs over:
one async factory per backend, taking the test's ``tmp_path``. Adding a
backend to the suite is one line here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from tests.storage.redis_fixtures import redis_backend_factory

from tiercache.serve import NodeServer, ServeBackend
from tiercache.storage import StorageBackend
from tiercache.storage.file import FileBackend
from tiercache.storage.memory import MemoryBackend

BackendFactory = Callable[[Path], Awaitable[StorageBackend]]


async def _memory(tmp_path: Path) -> StorageBackend:
    return MemoryBackend()


async def _file(tmp_path: Path) -> StorageBackend:
    return await FileBackend.open(tmp_path / "store")


class _ServedBackend(ServeBackend):
    """A client of a server of its own, which it closes with itself."""

    server: NodeServer

    async def aclose(self) -> None:
        await super().aclose()
        await self.server.aclose()


async def _serve(tmp_path: Path) -> StorageBackend:
    import tempfile

    sock = tempfile.mktemp(prefix="tcs-", suffix=".sock", dir="/tmp")  # short: sun_path limit
    server = NodeServer(sock, 8 << 20, block_bytes=4096, arena_path=str(tmp_path / "arena"))
    await server.start()
    backend = _ServedBackend(sock)
    backend.server = server
    return backend


BACKEND_FACTORIES: dict[str, BackendFactory] = {
    "memory": _memory,
    "file": _file,
    "redis": redis_backend_factory,
    "serve": _serve,
}


@pytest.fixture(params=list(BACKEND_FACTORIES))
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageBackend]:
    b = await BACKEND_FACTORIES[request.param](tmp_path)
    try:
        yield b
    finally:
        await b.aclose()
