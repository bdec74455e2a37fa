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

from tiercache.storage import StorageBackend
from tiercache.storage.file import FileBackend
from tiercache.storage.memory import MemoryBackend

BackendFactory = Callable[[Path], Awaitable[StorageBackend]]


async def _memory(tmp_path: Path) -> StorageBackend:
    return MemoryBackend()


async def _file(tmp_path: Path) -> StorageBackend:
    return await FileBackend.open(tmp_path / "store")


BACKEND_FACTORIES: dict[str, BackendFactory] = {
    "memory": _memory,
    "file": _file,
    "redis": redis_backend_factory,
}


@pytest.fixture(params=list(BACKEND_FACTORIES))
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageBackend]:
    b = await BACKEND_FACTORIES[request.param](tmp_path)
    try:
        yield b
    finally:
        await b.aclose()
