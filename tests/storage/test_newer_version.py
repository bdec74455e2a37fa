"""A page of a newer format version, written by an upgraded process sharing the store
during a rolling upgrade: a miss for this version, but never removed or counted as
damage, so the upgraded processes keep what they stored."""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from tests.redis_server import RedisServer
from tests.storage.redis_fixtures import MakeRedisBackend, make_redis_backend, redis_server
from tests.storage.storage_helpers import FORMAT, keys, random_page

from tiercache.memory import PageBuffer
from tiercache.storage import StorageBackend
from tiercache.storage.file import FileBackend
from tiercache.storage.format import VERSION, pack_page
from tiercache.storage.redis import RedisBackend

__all__ = ["make_redis_backend", "redis_server"]  # fixtures

Store = Callable[[str, bytes], Awaitable[None]]
Load = Callable[[str], Awaitable[bytes | None]]


def newer_blob(key: str, page: PageBuffer, align: int) -> bytes:
    blob = bytearray(b"".join(bytes(p) for p in pack_page(key, page, align)))
    struct.pack_into("<H", blob, 4, VERSION + 1)
    return bytes(blob)


async def check_a_newer_page_is_a_miss_that_stays(
    backend: StorageBackend, put: Store, get: Load, align: int, caplog: pytest.LogCaptureFixture
) -> None:
    (k,) = keys(1)
    blob = newer_blob(k, random_page(), align)
    await put(k, blob)
    dst = PageBuffer.allocate(512, FORMAT)
    with caplog.at_level(logging.WARNING):
        assert await backend.batch_get([k], [dst]) == [False]
    assert dst.tobytes() == bytes(512)
    assert "failed its checks" not in caplog.text
    s = await backend.stats()
    assert (s.corrupt_pages, s.errors) == (0, 0)
    assert await get(k) == blob  # still there for the processes that can read it
    assert await backend.batch_set([k], [random_page()]) == [True]  # first writer wins
    assert await get(k) == blob


async def test_file_keeps_a_page_of_a_newer_format_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with await FileBackend.open(tmp_path / "store") as b:
        await check_a_newer_page_is_a_miss_that_stays(b, b.write_raw, b.read_raw, 4096, caplog)


async def test_redis_keeps_a_page_of_a_newer_format_version(
    make_redis_backend: MakeRedisBackend,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    b: RedisBackend = await make_redis_backend()
    client = aioredis.Redis.from_url(redis_server.url)

    async def put(key: str, data: bytes) -> None:
        await client.set(b.prefix + key, data)

    async def get(key: str) -> bytes | None:
        value: bytes | None = await client.get(b.prefix + key)
        return value

    try:
        await check_a_newer_page_is_a_miss_that_stays(b, put, get, 1, caplog)
    finally:
        await client.aclose()
