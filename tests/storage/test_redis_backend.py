"""RedisBackend against a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from tests.redis_server import RedisServer, require_redis_server
from tests.storage.redis_fixtures import (
    MakeRedisBackend,
    make_redis_backend,
    own_redis_server,
    redis_server,
    unique_prefix,
)

from tiercache.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidInputError,
    StorageError,
    StorageTimeoutError,
)
from tiercache.storage import PageBuffer, PageKey
from tiercache.storage import redis as redis_module
from tiercache.storage.format import pack_page
from tiercache.storage.redis import OFFLOAD_BYTES, RedisBackend, mask_url

__all__ = ["make_redis_backend", "own_redis_server", "redis_server"]  # fixtures used here

FMT = "test:mha:L2:H2:D8:float16:P4"


def key(i: int) -> PageKey:
    return PageKey(f"{i:064x}")


def page(seed: int, nbytes: int = 4096, segments: int = 2) -> PageBuffer:
    """A page of ``nbytes`` pseudo-random bytes in ``segments`` separate buffers."""
    data = bytes((seed * 131 + i * 7 + (i >> 8)) & 0xFF for i in range(nbytes))
    step = nbytes // segments
    cuts = [
        data[i * step : (i + 1) * step if i < segments - 1 else nbytes] for i in range(segments)
    ]
    return PageBuffer.from_segments([memoryview(bytearray(c)) for c in cuts], FMT)


def blank(nbytes: int = 4096, fill: int = 0xEE) -> PageBuffer:
    return PageBuffer.from_bytes(bytes([fill]) * nbytes, FMT)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain redis-py client on the session server, to inspect and tamper."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_round_trip(make_redis_backend: MakeRedisBackend) -> None:
    backend = await make_redis_backend()
    pages = [page(i, segments=1 + i % 3) for i in range(5)]
    keys = [key(i) for i in range(5)]
    assert await backend.batch_set(keys, pages) == [True] * 5
    targets = [blank() for _ in range(6)]
    got = await backend.batch_get([*keys, key(99)], targets)
    assert got == [True] * 5 + [False]
    for src, dst in zip(pages, targets[:5], strict=True):
        assert dst.tobytes() == src.tobytes()
    assert targets[5].tobytes() == blank().tobytes()  # a miss leaves its buffer alone
    s = await backend.stats()
    assert (s.set_pages, s.set_written, s.get_pages, s.get_hits) == (5, 5, 6, 5)
    assert s.bytes_written == s.bytes_read == 5 * 4096
    assert await backend.delete([key(0), key(1), key(99)]) == 2
    assert await backend.batch_exists(keys) == 0
    assert await backend.batch_get([], []) == [] and await backend.batch_set([], []) == []


@pytest.mark.parametrize("stored", [0, 3, 8])
async def test_batch_exists_counts_from_the_first(
    make_redis_backend: MakeRedisBackend, stored: int
) -> None:
    backend = await make_redis_backend()
    keys = [key(i) for i in range(8)]
    await backend.batch_set(keys[:stored], [page(i) for i in range(stored)])
    assert await backend.batch_exists(keys) == stored
    if stored < 8:
        # a page stored after a gap does not count
        await backend.batch_set([keys[stored + 1 if stored < 7 else stored]], [page(50)])
        assert await backend.batch_exists(keys) == (stored if stored < 7 else 8)
    assert await backend.batch_exists([]) == 0


async def test_first_writer_wins(make_redis_backend: MakeRedisBackend) -> None:
    first, second = await make_redis_backend(), None
    second = await make_redis_backend(prefix=first.prefix)  # another instance, same namespace
    a, b = page(1), page(2)
    assert a.tobytes() != b.tobytes()
    assert await first.batch_set([key(1)], [a]) == [True]
    assert await second.batch_set([key(1)], [b]) == [True]  # the key holds a page ...
    target = blank()
    assert await second.batch_get([key(1)], [target]) == [True]
    assert target.tobytes() == a.tobytes()  # ... and it is the first one
    assert (await second.stats()).set_written == 0
    assert (await first.stats()).set_written == 1


async def test_ttl_expires_pages(make_redis_backend: MakeRedisBackend, raw: aioredis.Redis) -> None:
    backend = await make_redis_backend(ttl_seconds=0.3)
    await backend.batch_set([key(1)], [page(1)])
    pttl = await raw.pttl(backend.prefix + key(1))
    assert 0 < pttl <= 300
    for _ in range(100):  # bounded poll: expiry, not its timing, is the point
        if await backend.batch_exists([key(1)]) == 0:
            break
        await asyncio.sleep(0.05)
    assert await backend.batch_exists([key(1)]) == 0
    # without a TTL, a page stays
    keeper = await make_redis_backend()
    await keeper.batch_set([key(1)], [page(1)])
    assert await raw.pttl(keeper.prefix + key(1)) == -1


async def test_prefixes_are_isolated_and_clear_keeps_others(
    make_redis_backend: MakeRedisBackend, raw: aioredis.Redis
) -> None:
    a = await make_redis_backend(prefix=unique_prefix("a"))
    b = await make_redis_backend(prefix=unique_prefix("b"))
    # glob characters in a prefix are matched literally by clear()
    star = await make_redis_backend(prefix=unique_prefix("x") + "*[")
    await a.batch_set([key(i) for i in range(3)], [page(i) for i in range(3)])
    assert await b.batch_exists([key(0)]) == 0
    await b.batch_set([key(0)], [page(9)])
    await star.batch_set([key(0)], [page(8)])
    await raw.set("unrelated:" + key(0), b"x")
    try:
        await star.clear()
        assert await a.batch_exists([key(0), key(1), key(2)]) == 3
        await a.clear()
        assert await a.batch_exists([key(0), key(1), key(2)]) == 0
        assert await star.batch_exists([key(0)]) == 0
        assert await b.batch_exists([key(0)]) == 1
        assert await raw.exists("unrelated:" + key(0)) == 1
    finally:
        await raw.delete("unrelated:" + key(0))


async def test_clear_scans_many_keys(
    make_redis_backend: MakeRedisBackend, raw: aioredis.Redis
) -> None:
    backend = await make_redis_backend()
    n = 2500  # more than one SCAN step
    keys = [key(i) for i in range(n)]
    await backend.batch_set(keys, [page(0, nbytes=16, segments=1)] * n)
    assert await backend.batch_exists(keys) == n
    await backend.clear()
    assert [k async for k in raw.scan_iter(match=backend.prefix + "*")] == []


async def test_an_intact_page_of_another_format_is_refused_and_kept(
    make_redis_backend: MakeRedisBackend, raw: aioredis.Redis
) -> None:
    """A value whose intact header names the key but another format is a good
    page for a reader of that format: reading it into this target is an
    `InvalidInputError`, and neither target is written nor any key deleted."""
    backend = await make_redis_backend()
    good = page(3)
    await backend.batch_set([key(2)], [page(4)])
    foreign = b"".join(pack_page(key(1), PageBuffer.from_bytes(good.tobytes(), "other")))
    await raw.set(backend.prefix + key(1), foreign)
    targets = [blank(), blank()]
    with pytest.raises(InvalidInputError, match="'other'"):
        await backend.batch_get([key(1), key(2)], targets)
    assert [t.tobytes() for t in targets] == [blank().tobytes()] * 2
    assert await raw.get(backend.prefix + key(1)) == foreign
    assert await backend.batch_exists([key(1), key(2)]) == 2
    assert (await backend.stats()).corrupt_pages == 0


def _flip_payload(blob: bytes) -> bytes:
    b = bytearray(blob)
    b[-10] ^= 0x40
    return bytes(b)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other_key", "garbage"])
async def test_corrupt_value_is_a_miss_and_deleted(
    make_redis_backend: MakeRedisBackend,
    raw: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    backend = await make_redis_backend()
    good = page(3)
    await backend.batch_set([key(1), key(2)], [good, page(4)])
    blob = await raw.get(backend.prefix + key(1))
    assert blob == b"".join(pack_page(key(1), good))
    bad = {
        "flipped": lambda: _flip_payload(blob),
        "truncated": lambda: blob[:-100],
        "other_key": lambda: b"".join(pack_page(key(7), good)),
        "garbage": lambda: b"not a page",
    }[damage]()
    await raw.set(backend.prefix + key(1), bad)
    targets = [blank(), blank()]
    with caplog.at_level(logging.WARNING, logger="tiercache.storage.redis"):
        assert await backend.batch_get([key(1), key(2)], targets) == [False, True]
    assert targets[0].tobytes() == blank().tobytes()  # never copied into the target
    assert targets[1].tobytes() == page(4).tobytes()
    assert (await backend.stats()).corrupt_pages == 1
    assert await raw.exists(backend.prefix + key(1)) == 0  # removed, so a good copy can be written
    assert key(1) in caplog.text
    assert await backend.batch_set([key(1)], [good]) == [True]
    assert await backend.batch_get([key(1)], [targets[0]]) == [True]


async def test_a_page_of_an_older_format_version_is_a_quiet_miss_and_dropped(
    make_redis_backend: MakeRedisBackend,
    raw: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As in the file backend: after an upgrade, older pages are stale, not damage."""
    backend = await make_redis_backend()
    old = bytearray(b"".join(pack_page(key(1), page(1))))
    struct.pack_into("<H", old, 4, 2)  # format version 2
    await raw.set(backend.prefix + key(1), bytes(old))
    with caplog.at_level(logging.DEBUG, logger="tiercache.storage.redis"):
        assert await backend.batch_get([key(1)], [blank()]) == [False]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    s = await backend.stats()
    assert (s.corrupt_pages, s.errors) == (0, 0)
    assert await raw.exists(backend.prefix + key(1)) == 0  # dropped: the next write replaces it
    assert await backend.batch_set([key(1)], [page(1)]) == [True]
    assert await backend.batch_get([key(1)], [blank()]) == [True]


async def test_large_pages_are_checked_off_the_loop(
    make_redis_backend: MakeRedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    for name in ("_pack_values", "_unpack_values"):
        real = getattr(redis_module, name)

        def spy(*args: object, _real: object = real) -> object:
            threads.append(threading.current_thread().name)
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(redis_module, name, spy)
    backend = await make_redis_backend()
    small, big = page(1), page(2, nbytes=OFFLOAD_BYTES + 4096, segments=4)
    await backend.batch_set([key(1)], [small])
    await backend.batch_set([key(2)], [big])
    target = blank(big.nbytes)
    assert await backend.batch_get([key(2)], [target]) == [True]
    assert target.tobytes() == big.tobytes()
    main = threading.main_thread().name
    assert threads[0] == main  # a small page is packed on the loop
    assert threads[1] != main and threads[2] != main  # a big one in the executor


async def test_one_round_trip_per_batch(
    make_redis_backend: MakeRedisBackend, raw: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await make_redis_backend()
    await backend.ping()  # the pooled connection exists; the handshake is not counted
    sends: list[int] = []
    real_send = Connection.send_packed_command

    async def counting_send(self: Connection, command: object, check_health: bool = True) -> None:
        sends.append(1)
        await real_send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counting_send)
    await raw.config_resetstat()
    n = 16
    keys = [key(i) for i in range(n)]

    for name, call in [
        ("set", lambda: backend.batch_set(keys, [page(i) for i in range(n)])),
        ("exists", lambda: backend.batch_exists(keys)),
        ("get", lambda: backend.batch_get(keys, [blank() for _ in range(n)])),
        ("unlink", lambda: backend.delete(keys)),
    ]:
        sends.clear()
        await call()
        assert len(sends) == 1, f"{name}: {len(sends)} writes to the socket for one batch"
    monkeypatch.undo()
    stats = await raw.info("commandstats")
    for cmd in ("set", "exists", "get", "unlink"):
        assert stats[f"cmdstat_{cmd}"]["calls"] == n  # every command of the batch ran


async def test_server_errors_fail_single_pages(
    make_redis_backend: MakeRedisBackend,
    raw: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = await make_redis_backend()
    await raw.config_set("maxmemory", 1)  # every write is refused with OOM
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.storage.redis"):
            got = await backend.batch_set([key(i) for i in range(50)], [page(1)] * 50)
        assert got == [False] * 50
    finally:
        await raw.config_set("maxmemory", 0)
    assert (await backend.stats()).errors == 50
    # One warning for the batch, not one per page: a full server must not flood the log.
    assert len(caplog.records) == 1
    assert "SET failed for 50 of 50 pages" in caplog.records[0].getMessage()
    assert key(0) in caplog.records[0].getMessage()
    assert await backend.batch_set([key(1)], [page(1)]) == [True]


@pytest.mark.parametrize("command", ["EXISTS", "UNLINK"])
async def test_a_refused_lookup_or_delete_is_counted_and_logged_not_silent(
    make_redis_backend: MakeRedisBackend,
    redis_server: RedisServer,
    raw: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    command: str,
) -> None:
    """A server that refuses a command (here an ACL without it) answers each page with an
    error: read silently as 'not stored' or 'not there', a store that never hits, or
    damaged pages that are never dropped, would go unnoticed."""
    user = f"no{command.lower()}{os.getpid()}"
    deny = f"-{command.lower()}"
    await raw.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", deny)
    url = redis_server.url.replace("redis://", f"redis://{user}:pw@", 1)
    backend = await make_redis_backend(url)
    try:
        ks = [key(i) for i in range(3)]
        assert await backend.batch_set(ks, [page(i) for i in range(3)]) == [True] * 3
        with caplog.at_level(logging.WARNING, logger="tiercache.storage.redis"):
            if command == "EXISTS":
                assert await backend.batch_exists(ks) == 0
            else:
                assert await backend.delete(ks) == 0
        assert (await backend.stats()).errors == 3
        assert f"{command} failed for 3 of 3 pages" in caplog.text
    finally:
        await raw.execute_command("ACL", "SETUSER", user, "+@all")
        await backend.clear()
        await backend.aclose()
        await raw.execute_command("ACL", "DELUSER", user)


async def test_unix_socket_url(redis_server: RedisServer) -> None:
    async with await RedisBackend.from_url(
        redis_server.unix_url, prefix=unique_prefix("unix")
    ) as backend:
        assert "unix://" in repr(backend)
        await backend.batch_set([key(1)], [page(1)])
        target = blank()
        assert await backend.batch_get([key(1)], [target]) == [True]
        assert target.tobytes() == page(1).tobytes()
        await backend.clear()


async def _expect_unavailable(backend: RedisBackend) -> None:
    """Every verb fails with a StorageError subclass (never a redis exception)."""
    calls = [
        lambda: backend.batch_exists([key(1)]),
        lambda: backend.batch_get([key(1)], [blank()]),
        lambda: backend.batch_set([key(2)], [page(2)]),
        lambda: backend.delete([key(1)]),
        lambda: backend.clear(),
        lambda: backend.ping(),
    ]
    for call in calls:
        async with asyncio.timeout(10):  # a hang would be the bug; "prompt" is the 0.5 s option
            with pytest.raises((BackendUnavailableError, StorageTimeoutError)):
                await call()


async def test_killed_server_fails_fast_and_backend_recovers(own_redis_server: RedisServer) -> None:
    backend = await RedisBackend.from_url(own_redis_server.url, timeout=0.5, max_connections=2)
    try:
        await backend.batch_set([key(1)], [page(1)])
        await asyncio.to_thread(own_redis_server.kill)
        await _expect_unavailable(backend)
        assert (await backend.stats()).errors >= 6
        await asyncio.to_thread(own_redis_server.start)  # same port
        # the same backend object: the pool replaces its dead connections
        assert await backend.batch_exists([key(1)]) == 0  # no persistence: the page is gone
        assert await backend.batch_set([key(1)], [page(1)]) == [True]
        target = blank()
        assert await backend.batch_get([key(1)], [target]) == [True]
        assert target.tobytes() == page(1).tobytes()
    finally:
        await backend.aclose()


async def test_hung_server_times_out_and_backend_recovers(own_redis_server: RedisServer) -> None:
    backend = await RedisBackend.from_url(own_redis_server.url, timeout=0.3, max_connections=2)
    try:
        await backend.batch_set([key(1)], [page(1)])
        await asyncio.to_thread(own_redis_server.pause)
        try:
            for call in (
                lambda: backend.batch_exists([key(1)]),
                lambda: backend.batch_get([key(1)], [blank()]),
            ):
                async with asyncio.timeout(10):
                    with pytest.raises(StorageTimeoutError):
                        await call()
        finally:
            await asyncio.to_thread(own_redis_server.resume)
        target = blank()
        assert await backend.batch_get([key(1)], [target]) == [True]
        assert target.tobytes() == page(1).tobytes()
    finally:
        await backend.aclose()


async def test_unreachable_server_fails_at_open(own_redis_server: RedisServer) -> None:
    url = own_redis_server.url
    await asyncio.to_thread(own_redis_server.kill)
    with pytest.raises(BackendUnavailableError):
        await RedisBackend.from_url(url, timeout=0.5)
    lazy = await RedisBackend.from_url(url, timeout=0.5, ping_on_open=False)
    with pytest.raises(BackendUnavailableError):
        await lazy.batch_exists([key(1)])
    await lazy.aclose()


PASSWORD = "pw-Zq8-secret"


async def test_credentials_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(require_redis_server(), password=PASSWORD)
    await asyncio.to_thread(server.start)
    try:
        caplog.set_level(logging.DEBUG)
        messages: list[str] = []
        with pytest.raises(BackendUnavailableError) as bad_auth:
            await RedisBackend.from_url(
                server.url.replace(PASSWORD, "wrong-" + PASSWORD[::-1]), timeout=1
            )
        messages.append(str(bad_auth.value))
        for url in (server.url, server.unix_url):
            backend = await RedisBackend.from_url(url, timeout=0.5)
            await backend.batch_set([key(1)], [page(1)])
            assert await backend.batch_get([key(1)], [blank()]) == [True]
            messages += [repr(backend), str(backend)]
            assert "***" in repr(backend)
            await backend.aclose()
        backend = await RedisBackend.from_url(server.url, timeout=0.5)
        await asyncio.to_thread(server.kill)
        for call in (
            lambda: backend.batch_exists([key(1)]),
            lambda: backend.batch_set([key(1)], [page(1)]),
        ):
            with pytest.raises(StorageError) as failure:
                await call()
            messages.append(str(failure.value))
            # redis-py's exception is not chained for display (its text could carry secrets)
            assert failure.value.__cause__ is None and failure.value.__suppress_context__
        await backend.aclose()
        with pytest.raises(ConfigError) as bad_option:
            RedisBackend(server.url + "?bogus=1")
        messages.append(str(bad_option.value))
    finally:
        await asyncio.to_thread(server.close)
    assert caplog.text  # the failures above were logged ...
    for text in [caplog.text, *messages]:
        assert PASSWORD not in text  # ... and nothing shows the password
        assert PASSWORD[::-1] not in text


def test_mask_url() -> None:
    assert mask_url("redis://u:p%40ss@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("redis://:pass@h:1/0") == "redis://:***@h:1/0"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"
    assert mask_url("unix:///tmp/r.sock?db=1&password=pw") == "unix:///tmp/r.sock?db=1&password=***"


async def test_lifecycle(make_redis_backend: MakeRedisBackend) -> None:
    backend = await make_redis_backend()
    async with backend as entered:
        assert entered is backend
        await entered.batch_set([key(1)], [page(1)])
    assert backend.state.value == "closed" and "closed" in repr(backend)
    await backend.aclose()  # idempotent
    for call in (
        lambda: backend.batch_exists([key(1)]),
        lambda: backend.batch_get([key(1)], [blank()]),
        lambda: backend.batch_set([key(1)], [page(1)]),
        lambda: backend.delete([key(1)]),
        lambda: backend.clear(),
    ):
        with pytest.raises(BackendUnavailableError):
            await call()


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("http://localhost:6379", {}),
        ("redis://localhost:6379?bogus=1", {}),
        ("redis://localhost:6379", {"bogus": 1}),
        ("redis://localhost:6379", {"prefix": ""}),
        ("redis://localhost:6379", {"timeout": 0}),
        ("redis://localhost:6379", {"timeout": "soon"}),
        ("redis://localhost:6379", {"ttl_seconds": -1}),
        ("redis://localhost:6379", {"max_connections": 0}),
        ("redis://localhost:6379", {"cluster": "maybe"}),
        ("redis://localhost:6379?max_connections=x", {}),
        ("unix:///tmp/x.sock?cluster=1", {}),
        ("redis://localhost:notaport/0", {}),
        ("redis://localhost:6379/abc", {}),
        ("redis://localhost:6379/0/1", {}),
        ("redis://localhost:6379/1?db=2", {}),
        # Values redis-py takes and the server (or the connection) refuses
        # only at the first call: refused here, where the URL is read.
        ("redis://localhost:6379?protocol=9", {}),
        ("redis://localhost:6379?protocol=1", {}),
        ("redis://localhost:6379?protocol=three", {}),
        ("redis+cluster://localhost:6379?protocol=9", {}),
        ("redis://localhost:6379?db=-1", {}),
        ("unix:///tmp/x.sock?db=-1", {}),
        ("redis+cluster://localhost:6379/1", {}),
        ("redis+cluster://localhost:6379?db=2", {}),
        ("redis://localhost:6379?client_name=two%20words", {}),
        ("redis://localhost:6379?client_name=line%0Abreak", {}),
        ("rediss://localhost:6379?ssl_cert_reqs=sometimes", {}),
        ("rediss://localhost:6379?ssl_check_hostname=maybe", {}),
        # TLS settings on a connection without TLS would be a TypeError at connect.
        ("redis://localhost:6379?ssl_cert_reqs=required", {}),
        ("unix:///tmp/x.sock?ssl_ca_certs=/etc/ca.pem", {}),
        # Given twice: redis-py would silently take one of them.
        ("redis://localhost:6379?db=1&db=2", {}),
        ("redis://localhost:6379?protocol=2&protocol=3", {}),
        ("redis://localhost:6379?prefix=a:&prefix=b:", {}),
    ],
)
async def test_bad_configuration(url: str, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        await RedisBackend.from_url(url, ping_on_open=False, **options)


@pytest.mark.parametrize(
    "query",
    [
        "protocol=2",
        "protocol=3",
        "db=0",
        "db=15",
        "client_name=worker-1",
        "protocol=",
        "db=",
    ],
)
async def test_good_redis_py_parameters_are_accepted(redis_server: RedisServer, query: str) -> None:
    server = redis_server.url.rpartition("/")[0]  # no database in the path
    async with await RedisBackend.from_url(f"{server}?{query}") as backend:
        await backend.ping()


@pytest.mark.parametrize(
    "url",
    [
        "rediss://localhost:6379?ssl_cert_reqs=required&ssl_check_hostname=yes",
        "rediss://localhost:6379?ssl_cert_reqs=none&ssl_check_hostname=off",
        "rediss+cluster://localhost:6379?ssl_cert_reqs=optional&ssl_ca_certs=/etc/ca.pem",
    ],
)
async def test_good_tls_parameters_are_accepted(url: str) -> None:
    backend = await RedisBackend.from_url(url, ping_on_open=False)
    await backend.aclose()


async def test_options_from_url(redis_server: RedisServer) -> None:
    prefix = unique_prefix("q")
    url = f"{redis_server.url}?prefix={prefix}&ttl_seconds=30&timeout=2&max_connections=3"
    async with await RedisBackend.from_url(url) as backend:
        assert (backend.prefix, backend.ttl_seconds, backend.timeout, backend.max_connections) == (
            prefix,
            30,
            2,
            3,
        )
        assert not backend.cluster
    async with await RedisBackend.from_url(url, timeout=1.5, prefix="kw:") as backend:
        assert (backend.timeout, backend.prefix) == (1.5, "kw:")  # a keyword wins over the URL


async def test_bad_input(make_redis_backend: MakeRedisBackend) -> None:
    backend = await make_redis_backend()
    with pytest.raises(InvalidInputError):
        await backend.batch_set([key(1), key(2)], [page(1)])
    with pytest.raises(InvalidInputError):
        await backend.batch_get([key(1)], [])
    for bad in ("", "a b", "x*", "k\n"):
        with pytest.raises(InvalidInputError):
            await backend.batch_exists([PageKey(bad)])
    with pytest.raises(InvalidInputError):
        await backend.batch_set([key(1)], [b"bytes"])  # type: ignore[list-item]


@pytest.mark.skipif(os.environ.get("TIERCACHE_NO_CLUSTER") == "1", reason="cluster test disabled")
async def test_cluster_mode() -> None:
    server = RedisServer(
        require_redis_server(),
        extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
    )
    await asyncio.to_thread(server.start)
    try:
        setup = aioredis.Redis.from_url(server.url)
        await setup.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        for _ in range(200):
            info = await setup.execute_command("CLUSTER", "INFO")
            if b"cluster_state:ok" in info:
                break
            await asyncio.sleep(0.02)
        await setup.aclose()
        url = server.url.replace("redis://", "redis+cluster://").removesuffix("/0")
        async with await RedisBackend.from_url(
            url, prefix=unique_prefix("c"), timeout=2
        ) as backend:
            assert backend.cluster
            keys = [key(i) for i in range(20)]  # spread over many slots
            assert await backend.batch_set(keys, [page(i) for i in range(20)]) == [True] * 20
            assert await backend.batch_exists(keys) == 20
            targets = [blank() for _ in keys]
            assert await backend.batch_get(keys, targets) == [True] * 20
            assert all(t.tobytes() == page(i).tobytes() for i, t in enumerate(targets))
            assert await backend.delete(keys[:5]) == 5
            assert await backend.batch_exists(keys) == 0
            await backend.clear()
            assert await backend.batch_exists(keys[5:]) == 0
    finally:
        await asyncio.to_thread(server.close)


async def test_open_backend_opens_redis_urls(redis_server: RedisServer) -> None:
    from tiercache.storage.registry import open_backend

    prefix = unique_prefix("reg")
    for url in (redis_server.url, f"{redis_server.unix_url}&ttl_seconds=30"):
        backend = await open_backend(url, prefix=prefix, timeout=2)
        async with backend:
            assert isinstance(backend, RedisBackend) and backend.prefix == prefix
            await backend.batch_set([key(1)], [page(1)])
            assert await backend.batch_exists([key(1)]) == 1
            await backend.clear()
    with pytest.raises(ConfigError):
        await open_backend(redis_server.url, bogus=1)


async def test_cancelled_get_waits_for_the_copy_into_its_pages(
    make_redis_backend: MakeRedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await make_redis_backend()
    big = page(5, nbytes=OFFLOAD_BYTES + 4096, segments=2)
    await backend.batch_set([key(1)], [big])
    loop = asyncio.get_running_loop()
    started, finished = asyncio.Event(), threading.Event()
    real = redis_module._unpack_values

    def slow_unpack(*args: object) -> object:
        loop.call_soon_threadsafe(started.set)
        finished.wait(0.3)  # a copy still running when the caller is cancelled
        out = real(*args)  # type: ignore[arg-type]
        finished.set()
        return out

    monkeypatch.setattr(redis_module, "_unpack_values", slow_unpack)
    target = blank(big.nbytes)
    task = asyncio.create_task(backend.batch_get([key(1)], [target]))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()  # the buffer is no longer being written when the caller gets it back
    monkeypatch.undo()
    assert await backend.batch_exists([key(1)]) == 1  # the backend is still usable


async def test_key_of_another_type_is_a_corrupt_miss_and_deleted(
    make_redis_backend: MakeRedisBackend, raw: aioredis.Redis
) -> None:
    """Another writer's list under our key: a miss that is dropped, so the page can be stored."""
    backend = await make_redis_backend()
    await raw.rpush(backend.prefix + key(1), b"not a page")
    target = blank()
    assert await backend.batch_get([key(1)], [target]) == [False]
    assert target.tobytes() == blank().tobytes()
    stats = await backend.stats()
    assert (stats.corrupt_pages, stats.errors) == (1, 0)
    assert await raw.exists(backend.prefix + key(1)) == 0
    assert await backend.batch_set([key(1)], [page(1)]) == [True]
    assert await backend.batch_get([key(1)], [target]) == [True]
    assert target.tobytes() == page(1).tobytes()
