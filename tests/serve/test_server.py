"""`NodeServer` in this process: capacity, leases, bad frames, credentials, storage behind it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from tests.redis_server import RedisServer, require_redis_server
from tests.serve.helpers import FORMAT, page_bytes, page_of

from tiercache.errors import InvalidInputError
from tiercache.memory.pages import PageBuffer
from tiercache.serve import NodeServer, ServeBackend, ServeClient, ServerError
from tiercache.serve import protocol as proto
from tiercache.storage import PageKey, open_backend

BLOCK = 4096
NBYTES = 4000  # one block per page


def _sock() -> str:
    return tempfile.mktemp(prefix="tcs-", suffix=".sock", dir="/tmp")  # short: sun_path limit


@contextlib.asynccontextmanager
async def served(tmp_path: Path, blocks: int = 64, **options: Any) -> AsyncIterator[NodeServer]:
    options.setdefault("arena_path", str(tmp_path / f"arena-{os.urandom(4).hex()}"))
    async with NodeServer(_sock(), blocks * BLOCK, block_bytes=BLOCK, **options) as server:
        yield server


async def settled(server: NodeServer, **want: int) -> None:
    """Wait (up to 5 s) until the server's counters match ``want``: a drop is seen asynchronously."""
    for _ in range(500):
        s = server.stats()
        if all(getattr(s, k) == v for k, v in want.items()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"server counters never reached {want}: {server.stats()}")


def keys(*names: str) -> list[PageKey]:
    return [PageKey(n) for n in names]


async def put(b: ServeBackend, *names: str) -> list[bool]:
    return await b.batch_set(keys(*names), [page_of(n, NBYTES) for n in names])


async def get(b: ServeBackend, *names: str) -> list[bytes | None]:
    outs = [PageBuffer.allocate(NBYTES, FORMAT) for _ in names]
    got = await b.batch_get(keys(*names), outs)
    return [o.tobytes() if g else None for o, g in zip(outs, got, strict=True)]


async def test_lru_under_capacity_pressure(tmp_path: Path) -> None:
    async with served(tmp_path, blocks=4) as server, ServeBackend(server.socket_path) as b:
        assert await put(b, "a", "b", "c", "d") == [True] * 4
        assert await get(b, "a") == [page_bytes("a", NBYTES)]  # a used: b is the oldest
        assert await put(b, "e", "f") == [True, True]
        assert await b.batch_exists(keys("b")) == 0 and await b.batch_exists(keys("c")) == 0
        assert await get(b, "a", "d", "e", "f") == [page_bytes(k, NBYTES) for k in "adef"]
        s = server.stats()
        assert s.evictions == 2 and s.pages == 4 and s.arena_free_bytes == 0


async def test_every_page_leased_refuses_a_write_which_succeeds_after_a_release(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, blocks=4) as server, ServeBackend(server.socket_path) as b:
        assert await put(b, "a", "b", "c", "d") == [True] * 4
        async with await ServeClient.connect(server.socket_path) as reader:
            answer = await reader.call("lease", [[k, NBYTES, FORMAT] for k in "abcd"])
            assert [a[0] for a in answer] == ["hit"] * 4
            assert await put(b, "e") == [False]  # a failed backup, not an exception
            assert server.stats().refused_writes == 1
            assert await get(b, "a", "b", "c", "d") == [page_bytes(k, NBYTES) for k in "abcd"]
            await reader.call("release", [answer[0][1]])
            assert await put(b, "e") == [True]  # a, released, was the only candidate
            assert await b.batch_exists(keys("a")) == 0
            assert await get(b, "b", "e") == [page_bytes(k, NBYTES) for k in "be"]
        await settled(server, leases=0, clients=1)


async def test_pages_of_several_formats_and_sizes_share_the_arena(tmp_path: Path) -> None:
    async with served(tmp_path) as server, ServeBackend(server.socket_path) as b:
        big = PageBuffer.from_bytes(os.urandom(3 * BLOCK + 5), "model-a/page64")
        small = PageBuffer.from_bytes(os.urandom(100), "model-b/page1")
        assert await b.batch_set(keys("big", "small"), [big, small]) == [True, True]
        outs = [PageBuffer.allocate(big.nbytes, big.format), PageBuffer.allocate(100, small.format)]
        assert await b.batch_get(keys("big", "small"), outs) == [True, True]
        assert outs[0].tobytes() == big.tobytes() and outs[1].tobytes() == small.tobytes()
        with pytest.raises(InvalidInputError, match="model-b/page1"):
            await b.batch_get(keys("small"), [PageBuffer.allocate(100, "model-a/page64")])
        assert server.stats().leases == 0  # the refused read left no lease behind


async def test_a_cancelled_read_gives_its_leases_back(tmp_path: Path) -> None:
    nbytes = 2 << 20  # copied in an executor
    async with served(tmp_path, blocks=8 * 513) as server, ServeBackend(server.socket_path) as b:
        names = [f"p{i}" for i in range(8)]
        pages = [PageBuffer.from_bytes(os.urandom(nbytes), FORMAT) for _ in names]
        assert await b.batch_set(keys(*names), pages) == [True] * 8
        for delay in (0, 0.001, 0.005, 0.02):
            outs = [PageBuffer.allocate(nbytes, FORMAT) for _ in names]
            task = asyncio.create_task(b.batch_get(keys(*names), outs))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await settled(server, leases=0)
        outs = [PageBuffer.allocate(nbytes, FORMAT) for _ in names]
        assert await b.batch_get(keys(*names), outs) == [True] * 8
        assert [o.tobytes() for o in outs] == [p.tobytes() for p in pages]


async def test_requests_naming_what_the_client_does_not_hold_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(tmp_path) as server, ServeBackend(server.socket_path) as b:
        assert await put(b, "a") == [True]
        async with (
            await ServeClient.connect(server.socket_path) as c1,
            await ServeClient.connect(server.socket_path) as c2,
        ):
            (lease,) = await c1.call("lease", [["a", NBYTES, FORMAT]])
            (res,) = await c1.call("reserve", [["new", NBYTES, FORMAT]])
            with caplog.at_level(logging.WARNING, "tiercache.serve.server"):
                for op, body in [("release", [lease[1]]), ("commit", [res[1]]), ("abort", [7])]:
                    with pytest.raises(ServerError, match="not held") as e:
                        await c2.call(op, body)
                    assert e.value.code == "invalid"
            assert "not held" in caplog.text
            for op, body, code in [
                ("bogus", {}, "unknown_op"),
                ("exists", "a", "malformed"),
                ("reserve", [["../etc", 1, FORMAT]], "invalid"),
                ("exists", [7], "invalid"),
                ("reserve", [["k", -1, FORMAT]], "malformed"),
                ("lease", [["k", 1, FORMAT]] * (proto.MAX_BATCH + 1), "too_many"),
            ]:
                with pytest.raises(ServerError) as e:
                    await c2.call(op, body)
                assert e.value.code == code, (op, e.value)
            assert await c2.call("exists", ["a"]) == 1  # the connection still serves
            assert server.stats().leases == 1 and server.stats().writing == 1
            await c1.call("commit", [res[1]])
            await c1.call("release", [lease[1]])
        assert server.stats().bad_frames == 9
        assert await get(b, "a") == [page_bytes("a", NBYTES)]


async def _raw(path: str, data: bytes) -> list[Any]:
    """Send ``data`` on a fresh connection, then read replies until the server closes it."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    unpacker = msgpack.Unpacker(raw=False)
    out = []
    while chunk := await asyncio.wait_for(reader.read(65536), 10):
        unpacker.feed(chunk)
        out.extend(unpacker)
    writer.close()
    return out


async def test_bad_frames_close_their_connection_and_no_other(tmp_path: Path) -> None:
    async with served(tmp_path) as server, ServeBackend(server.socket_path) as b:
        assert await put(b, "a") == [True]
        wrong_version = msgpack.packb([99, 1, "exists", ["a"]])
        (reply,) = await _raw(server.socket_path, wrong_version + proto.request(2, "exists", ["a"]))
        assert reply[:2] == [1, "error"] and reply[2]["code"] == "version"
        (reply,) = await _raw(server.socket_path, b"\xc1garbage")
        assert reply[2]["code"] == "malformed"
        (reply,) = await _raw(server.socket_path, msgpack.packb("not a request"))
        assert reply[2]["code"] == "malformed"
        oversized = msgpack.packb([1, 1, "exists", [b"x" * (proto.MAX_FRAME_BYTES + 10)]])
        (reply,) = await _raw(server.socket_path, oversized)
        assert reply[2]["code"] == "oversized"
        assert await _raw(server.socket_path, proto.request(1, "exists", ["a"])[:-3]) == []
        ok = await _raw(server.socket_path, proto.request(5, "exists", ["a"]))
        assert ok == [[5, "ok", 1]]
        assert server.stats().bad_frames == 5
        assert await get(b, "a") == [page_bytes("a", NBYTES)]  # the other client is unaffected


async def test_a_peer_whose_uid_is_not_allowed_is_refused(tmp_path: Path) -> None:
    async with served(tmp_path, allow_uids=frozenset({os.geteuid() + 4242})) as server:
        with pytest.raises(ServerError) as e:
            await ServeClient.connect(server.socket_path)
        assert e.value.code == "refused"
        async with ServeBackend(server.socket_path) as b:
            assert await put(b, "a") == [False]  # a failed backup, not an exception
            assert await b.batch_exists(keys("a")) == 0
        assert server.stats().refused_peers == 2


_PEER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
s.settimeout(10)
data = b""
while chunk := s.recv(65536):
    data += chunk
    if len(data) > 40:
        break
print(data.hex())
"""


async def _as_nobody(path: str) -> Any:
    """Say hello from a child process running as ``nobody``; returns the server's reply."""
    python = shutil.which("python3", path="/usr/bin:/bin")  # one that nobody may run
    if python is None:
        pytest.skip("no system python3 for a child running as nobody")
    run = functools.partial(
        subprocess.run,
        [python, "-I", "-c", _PEER, path, proto.request(1, "hello", {}).hex()],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        timeout=30,
    )
    out = (await asyncio.to_thread(run)).stdout
    return msgpack.unpackb(bytes.fromhex(out.decode().strip()), raw=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
async def test_a_process_of_another_user_is_refused_and_its_group_admitted(tmp_path: Path) -> None:
    async with served(tmp_path) as server:
        await asyncio.to_thread(os.chmod, server.socket_path, 0o666)  # let the kernel pass it
        reply = await _as_nobody(server.socket_path)
        assert reply[1] == "error" and reply[2]["code"] == "refused"
        assert server.stats().refused_peers == 1
    async with served(tmp_path, group=65534) as server:
        st = await asyncio.to_thread(os.stat, server.socket_path)
        assert (st.st_mode & 0o777, st.st_gid) == (0o660, 65534)
        arena = await asyncio.to_thread(os.stat, server.arena_path)
        assert (arena.st_mode & 0o777, arena.st_gid) == (0o660, 65534)
        reply = await _as_nobody(server.socket_path)
        assert reply[1] == "ok" and reply[2]["arena"] == server.arena_path


@pytest.fixture
def redis_url() -> Any:
    with RedisServer(require_redis_server()) as server:
        yield server.url


async def test_write_behind_to_redis_then_a_fresh_server_reads_through(
    tmp_path: Path, redis_url: str
) -> None:
    names = [f"wb{i}" for i in range(20)]
    async with (
        served(tmp_path, storage_url=redis_url) as first,
        ServeBackend(first.socket_path) as b,
    ):
        assert await put(b, *names) == [True] * 20
    # leaving the block drained the write-behind queue into Redis
    assert first.stats().write_behind_done == 20 and first.stats().write_behind_backlog == 0
    async with await open_backend(redis_url) as redis:
        assert await redis.batch_exists(keys(*names)) == 20
    async with (
        served(tmp_path, storage_url=redis_url) as fresh,
        ServeBackend(fresh.socket_path) as b,
    ):
        assert fresh.stats().pages == 0
        assert await b.batch_exists(keys(*names)) == 20  # answered by Redis
        assert await get(b, *names) == [page_bytes(n, NBYTES) for n in names]
        s = fresh.stats()
        assert s.read_through == 20 and s.pages == 20 and s.hits == 20
        assert await get(b, "wb0") == [page_bytes("wb0", NBYTES)]
        assert fresh.stats().read_through == 20  # the second read hit the arena
        assert await get(b, "nowhere") == [None]


async def test_metrics_export_the_arena_and_traffic(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    import tiercache.metrics

    async with served(tmp_path, blocks=4) as server, ServeBackend(server.socket_path) as b:
        registry = CollectorRegistry()
        collector = tiercache.metrics.register(server, registry, watch_loop=False)
        try:
            await put(b, "a", "b")
            await get(b, "a", "zz")
            text = (await asyncio.to_thread(generate_latest, registry)).decode()
        finally:
            collector.close()
    assert f'tiercache_serve_arena_bytes{{state="used"}} {2.0 * BLOCK}' in text
    assert f'tiercache_serve_arena_bytes{{state="free"}} {2.0 * BLOCK}' in text
    assert "tiercache_serve_hits_total 1.0" in text
    assert "tiercache_serve_misses_total 1.0" in text
    assert "tiercache_serve_clients 1.0" in text
    assert "tiercache_serve_write_behind_backlog 0.0" in text
    assert "tiercache_serve_leases 0.0" in text


async def test_url_options_and_refusals() -> None:
    b = await open_backend("tiercache+unix:///tmp/nowhere.sock?timeout_s=0.5&backoff_max_s=1")
    assert isinstance(b, ServeBackend) and b.timeout_s == 0.5 and b.backoff_max_s == 1.0
    async with b:
        assert await b.batch_exists(keys("a")) == 0  # no server: a miss
        assert await b.batch_set(keys("a"), [page_of("a", 10)]) == [False]
    from tiercache.errors import ConfigError

    for bad in [
        "tiercache+unix://host/x.sock",
        "tiercache+unix:rel.sock",
        "tiercache+unix:///x?y=1",
    ]:
        with pytest.raises(ConfigError):
            await open_backend(bad)


async def test_exists_refuses_a_bad_key_beside_keys_it_already_checked(tmp_path: Path) -> None:
    async with served(tmp_path) as server, ServeBackend(server.socket_path) as b:
        await put(b, "a", "b")
        for _ in range(2):  # the second time, "a" and "b" are known to be valid
            assert await b.batch_exists(keys("a", "b")) == 2
        for bad in (["a", "../b"], ["a", ".hidden"], ["a", 7], ["a", "x" * 300]):
            for _ in range(2):  # a refused key is never remembered
                with pytest.raises(InvalidInputError):
                    await b.batch_exists(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="not one str"):
            await b.batch_exists("ab")  # type: ignore[arg-type]
        assert await b.batch_exists(keys("a", "b", "c")) == 2


def test_socket_family_is_unix() -> None:
    assert socket.AF_UNIX  # the server only ever listens on a Unix socket


async def test_a_server_answering_nonsense_costs_misses_not_exceptions(tmp_path: Path) -> None:
    from tiercache.serve.arena import Arena

    arena = await asyncio.to_thread(Arena, str(tmp_path / "arena"), 8192, create=True)
    bad_answers = iter(
        [
            [["hit", 1, [[4096, 8192]]]],  # past the end of the arena
            [["hit", 1, [[0, 10]]]],  # not the page's size
            [["hit", "x", []]],
            "nonsense",
            [["new", 1, [[-5, NBYTES]]]],
        ]
    )

    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        while data := await reader.read(65536):
            unpacker.feed(data)
            for _, rid, op, _ in unpacker:
                if op == "hello":
                    result: Any = {"arena": arena.path, "arena_bytes": 8192, "arena_id": "x"}
                else:
                    result = next(bad_answers, None)
                writer.write(proto.ok_reply(rid, result))
        writer.close()

    path = _sock()
    srv = await asyncio.start_unix_server(fake, path=path)
    try:
        async with ServeBackend(path, backoff_min_s=0) as b:
            for _ in range(4):
                assert await get(b, "a") == [None]
            assert await put(b, "a") == [False]
    finally:
        srv.close()
        await srv.wait_closed()
        arena.close()
        await asyncio.to_thread(os.unlink, path)


async def test_a_restarted_server_serves_the_intact_pages_of_its_kept_arena(tmp_path: Path) -> None:
    from tiercache.serve.persist import index_path

    arena_path = str(tmp_path / "kept.arena")
    names = [f"k{i}" for i in range(10)]
    async with (
        served(tmp_path, arena_path=arena_path, keep_arena=True) as first,
        ServeBackend(first.socket_path) as b,
    ):
        assert await put(b, *names) == [True] * 10
        assert await get(b, "k0") == [page_bytes("k0", NBYTES)]  # k0 is the most recent now
    assert await asyncio.to_thread(os.path.exists, index_path(arena_path))

    def damage(key: str) -> None:
        with open(index_path(arena_path), "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False)
        (blocks,) = [b for h, b in doc["pages"] if key.encode() in h]
        with open(arena_path, "r+b") as f:
            f.seek(blocks[0] * BLOCK + 7)
            byte = f.read(1)
            f.seek(blocks[0] * BLOCK + 7)
            f.write(bytes([byte[0] ^ 0xFF]))

    await asyncio.to_thread(damage, "k3")
    async with (
        served(tmp_path, blocks=64, arena_path=arena_path, keep_arena=True) as second,
        ServeBackend(second.socket_path) as b,
    ):
        assert not await asyncio.to_thread(os.path.exists, index_path(arena_path))
        s = second.stats()
        assert s.restored == 9 and s.pages == 9
        # the LRU order survived: k1 is the oldest page, k0 (read last) the newest
        fill = [f"f{i}" for i in range(64 - 9)]
        assert await put(b, *fill) == [True] * len(fill)  # exactly full
        assert s.evictions == 0 and second.stats().arena_free_bytes == 0
        assert await put(b, "extra") == [True]
        assert await b.batch_exists(keys("k1")) == 0 and await b.batch_exists(keys("k0")) == 1
        kept = [n for n in names if n not in ("k1", "k3")]
        assert await get(b, *kept) == [page_bytes(n, NBYTES) for n in kept]
        assert await get(b, "k3") == [None]  # damaged: dropped, never served
        assert await put(b, "k3") == [True]  # the key is writable again
        assert await get(b, "k3") == [page_bytes("k3", NBYTES)]


async def test_a_kept_arena_without_an_index_or_of_another_size_starts_empty(
    tmp_path: Path,
) -> None:
    arena_path = str(tmp_path / "kept.arena")
    async with (
        served(tmp_path, arena_path=arena_path, keep_arena=True) as first,
        ServeBackend(first.socket_path) as b,
    ):
        assert await put(b, "a") == [True]
    async with served(tmp_path, blocks=32, arena_path=arena_path, keep_arena=True) as other:
        assert other.stats().pages == 0 and other.stats().arena_bytes == 32 * BLOCK
    # the other-size server kept its own (empty) arena; a plain server replaces it all
    async with served(tmp_path, arena_path=arena_path) as plain:
        assert plain.stats().pages == 0
    assert not await asyncio.to_thread(os.path.exists, arena_path)


async def test_a_page_larger_than_the_arena_fails_alone(tmp_path: Path, redis_url: str) -> None:
    async with served(tmp_path, blocks=4, storage_url=redis_url) as server:
        async with await ServeClient.connect(server.socket_path) as c:
            answer = await c.call(
                "reserve",
                [["a", NBYTES, FORMAT], ["huge", 5 * BLOCK, FORMAT], ["b", NBYTES, FORMAT]],
            )
            assert [a[0] for a in answer] == ["new", "full", "new"]
            await c.call("commit", [answer[0][1], answer[2][1]])
            leased = await c.call(
                "lease", [["a", NBYTES, FORMAT], ["huge", 5 * BLOCK, FORMAT], ["b", NBYTES, FORMAT]]
            )
            assert [a[0] for a in leased] == ["hit", "miss", "hit"]
            await c.call("release", [leased[0][1], leased[2][1]])
            await settled(server, leases=0, writing=0, write_behind_backlog=0)


async def test_a_failing_storage_read_through_is_a_miss_and_a_bug_cuts_off_one_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage = await open_backend("faulty+memory://?fault=error&fault_ops=get,exists")
    async with served(tmp_path, storage=storage) as server, ServeBackend(server.socket_path) as b:
        assert await get(b, "a") == [None]  # the store fails: a miss
        assert await b.batch_exists(keys("a")) == 0
        assert await put(b, "a") == [True]

        def broken(*args: Any) -> Any:
            raise KeyError("a bug")

        monkeypatch.setattr(server._table, "exists", broken)
        with caplog.at_level(logging.ERROR, "tiercache.serve.server"):
            async with await ServeClient.connect(server.socket_path) as c:
                with pytest.raises(ServerError) as e:
                    await c.call("exists", ["a"])
                assert e.value.code == "internal"
        assert "internal error answering exists" in caplog.text
        monkeypatch.undo()
        assert await get(b, "a") == [page_bytes("a", NBYTES)]  # everyone else is served
    await storage.aclose()


async def test_a_read_whose_leases_were_lost_during_the_copy_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with served(tmp_path) as server, ServeBackend(server.socket_path) as b:
        assert await put(b, "a", "b") == [True, True]
        copy = b._copy

        async def copy_then_lose_the_server(*args: Any, **kwargs: Any) -> None:
            await copy(*args, **kwargs)
            await server.aclose()  # gone before the release: the leases were not held to the end

        monkeypatch.setattr(b, "_copy", copy_then_lose_the_server)
        assert await get(b, "a", "b") == [None, None]


async def test_a_second_server_on_a_live_servers_arena_is_refused(tmp_path: Path) -> None:
    from tiercache.serve.arena import ArenaInUseError

    arena_path = str(tmp_path / "shared.arena")
    async with (
        served(tmp_path, arena_path=arena_path, keep_arena=True) as first,
        ServeBackend(first.socket_path) as b,
    ):
        assert await put(b, "a") == [True]
        for keep in (False, True):
            with pytest.raises(ArenaInUseError, match="in use by another server"):
                async with served(tmp_path, arena_path=arena_path, keep_arena=keep):
                    pass
        assert await get(b, "a") == [page_bytes("a", NBYTES)]  # untouched
    async with served(tmp_path, arena_path=arena_path, keep_arena=True) as after:
        assert after.stats().restored == 1  # the lock went with the first server
