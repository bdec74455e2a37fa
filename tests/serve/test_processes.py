"""Several processes on one ``tiercache serve``: sharing, clients and the server killed mid-work.

The server runs as ``tiercache serve`` (the real command); clients are
processes of `tests.serve.client_proc`. These tests are synchronous and drive
their own event loop where they need one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.serve.helpers import FORMAT, ServerProcess, page_bytes, page_of, short_dir

from tiercache.memory.pages import PageBuffer
from tiercache.serve import ServeBackend, ServeClient
from tiercache.storage import PageKey

ROOT = str(Path(__file__).resolve().parents[2])
NBYTES = 10_000


@pytest.fixture
def sock() -> Iterator[str]:
    d = short_dir()
    yield os.path.join(d, "node.sock")
    shutil.rmtree(d, ignore_errors=True)


def spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.serve.client_proc", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def wait_line(proc: subprocess.Popen[str], expected: str, timeout_s: float = 60) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.strip() == expected:
            return
    raise AssertionError(f"no {expected!r} from the client:\n{''.join(seen)}")


def kill9(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def status(sock: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        client = await ServeClient.connect(sock)
        try:
            out: dict[str, Any] = await client.call("status", {})
            return out
        finally:
            await client.aclose()
            client.arena.close()

    return asyncio.run(go())


def wait_status(sock: str, **want: int) -> dict[str, Any]:
    """Poll the server until its counters match ``want`` (the status connection counts as 1 client)."""
    deadline = time.monotonic() + 10
    while True:
        st = status(sock)
        if all(st[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def store(sock: str, keys: list[str]) -> list[bool]:
    async def go() -> list[bool]:
        async with ServeBackend(sock) as b:
            return await b.batch_set([PageKey(k) for k in keys], [page_of(k, NBYTES) for k in keys])

    return asyncio.run(go())


def read(sock: str, keys: list[str]) -> list[bytes | None]:
    async def go() -> list[bytes | None]:
        async with ServeBackend(sock) as b:
            outs = [PageBuffer.allocate(NBYTES, FORMAT) for _ in keys]
            got = await b.batch_get([PageKey(k) for k in keys], outs)
            return [o.tobytes() if g else None for o, g in zip(outs, got, strict=True)]

    return asyncio.run(go())


def test_four_client_processes_share_pages_byte_for_byte(sock: str) -> None:
    with ServerProcess(sock, "16MiB", "--block-bytes", "4KiB"):
        procs = [spawn("share", sock, i, 4, 8, NBYTES) for i in range(4)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outs
        assert all("OK 32" in o for o in outs), outs
        st = wait_status(sock, clients=1)
        assert st["pages"] == 32 and st["leases"] == 0 and st["writing"] == 0
        assert st["hits"] == 4 * 3 * 32  # every client read every page three times


def test_client_killed_mid_write_leaves_no_page_and_gives_its_room_back(sock: str) -> None:
    with ServerProcess(sock, "4MiB", "--block-bytes", "4KiB"):
        assert store(sock, ["other"]) == [True]
        before = wait_status(sock, clients=1)
        writer = spawn("hold-write", sock, "victim", NBYTES)
        wait_line(writer, "RESERVED")
        during = status(sock)
        assert during["writing"] == 1 and during["arena_used_bytes"] > before["arena_used_bytes"]
        assert read(sock, ["victim"]) == [None]  # half written: invisible
        kill9(writer)
        after = wait_status(sock, clients=1, writing=0)
        assert after["writing"] == 0
        assert after["arena_used_bytes"] == before["arena_used_bytes"]
        assert after["pages"] == before["pages"] == 1
        assert read(sock, ["victim", "other"]) == [None, page_bytes("other", NBYTES)]
        # the key is free again: a whole write lands and reads back whole
        assert store(sock, ["victim"]) == [True]
        assert read(sock, ["victim"]) == [page_bytes("victim", NBYTES)]


def test_client_killed_mid_read_releases_its_lease(sock: str) -> None:
    # An arena of exactly two pages: while the lease is held, a third page
    # must evict the unleased one; once the reader is killed the leased page
    # is evictable again.
    with ServerProcess(sock, "24KiB", "--block-bytes", "4KiB"):
        assert store(sock, ["leased", "spare"]) == [True, True]
        before = wait_status(sock, clients=1)
        reader = spawn("hold-read", sock, "leased", NBYTES)
        wait_line(reader, "LEASED")
        assert status(sock)["leases"] == 1
        assert store(sock, ["third"]) == [True]  # evicts "spare", never the leased page
        assert read(sock, ["leased", "spare"]) == [page_bytes("leased", NBYTES), None]
        kill9(reader)
        after = wait_status(sock, clients=1, leases=0)
        assert after["leases"] == 0
        assert after["arena_used_bytes"] == before["arena_used_bytes"]
        assert read(sock, ["leased"]) == [page_bytes("leased", NBYTES)]  # nothing torn
        assert store(sock, ["fourth", "fifth"]) == [True, True]  # both old pages evictable now
        assert read(sock, ["leased", "third"]) == [None, None]


def test_server_killed_mid_traffic_means_misses_then_recovery(sock: str) -> None:
    srv = ServerProcess(sock, "8MiB", "--block-bytes", "4KiB").start()

    async def go() -> None:
        b = ServeBackend(sock, timeout_s=2, backoff_min_s=0.01, backoff_max_s=0.2)
        async with b:
            keys = [PageKey(f"k{i}") for i in range(16)]
            pages = [page_of(k, NBYTES) for k in keys]
            outs = [PageBuffer.allocate(NBYTES, FORMAT) for _ in keys]
            stop = asyncio.Event()
            results: list[tuple[list[bool], list[bool]]] = []
            progress = asyncio.Condition()

            async def rounds(n: int, want: tuple[list[bool], list[bool]] | None = None) -> None:
                """Wait for ``n`` more rounds of traffic, or for a round that answers ``want``."""
                start = len(results)
                async with progress:
                    await asyncio.wait_for(
                        progress.wait_for(
                            lambda: (
                                len(results) >= start + n and (want is None or results[-1] == want)
                            )
                        ),
                        30,
                    )

            async def traffic() -> None:
                while not stop.is_set():
                    wrote = await b.batch_set(keys, pages)
                    got = await b.batch_get(keys, outs)
                    results.append((wrote, got))
                    async with progress:
                        progress.notify_all()
                    for o, k, g in zip(outs, keys, got, strict=True):
                        if g:
                            assert o.tobytes() == page_bytes(k, NBYTES)
                    await asyncio.sleep(0)

            task = asyncio.create_task(traffic())
            await rounds(5)
            assert results[-1] == ([True] * 16, [True] * 16)
            await asyncio.to_thread(srv.kill)  # mid-traffic
            await rounds(5)
            assert results[-1] == ([False] * 16, [False] * 16)  # misses, no exception
            assert await b.batch_exists(keys) == 0
            await asyncio.to_thread(srv.start)
            await rounds(1, want=([True] * 16, [True] * 16))  # back, within the backoff
            stop.set()
            await task
            assert (await b.stats()).extra["reconnects"] >= 2

    try:
        asyncio.run(go())
    finally:
        srv.__exit__(None, None, None)


def test_a_restarted_engine_process_still_hits_its_pages(sock: str) -> None:
    with ServerProcess(sock, "64MiB"):
        a = spawn("engine-a", sock)
        out_a = a.communicate(timeout=120)[0]
        assert a.returncode == 0 and "STORED" in out_a, out_a
        b = spawn("engine-b", sock)  # the same engine, restarted: a fresh process
        out_b = b.communicate(timeout=120)[0]
        assert b.returncode == 0, out_b
        assert "LOADED 240 MATCH True" in out_b, out_b
