"""The ``tiercache serve`` / ``tiercache status`` command-line contract."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys

import pytest
from tests.serve.helpers import ServerProcess, short_dir

from tiercache.cli import parse_size


def _status(sock: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiercache", "status", "--socket", sock, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_serve_prints_ready_answers_status_and_stops_on_sigterm() -> None:
    d = short_dir()
    sock = os.path.join(d, "node.sock")
    try:
        srv = ServerProcess(sock, "1MiB").start()
        assert "arena_bytes=1048576" in srv.ready_line
        st = os.stat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        arena = os.path.join(d, "node.arena")
        assert stat.S_IMODE(os.stat(arena).st_mode) == 0o600
        out = _status(sock)
        assert out.returncode == 0, out.stderr
        assert "status: up" in out.stdout and "arena_free_bytes: 1048576" in out.stdout
        rc, log = srv.terminate()
        assert rc == 0, log
        assert "stopped" in log
        assert not os.path.exists(sock) and not os.path.exists(arena)
        down = _status(sock)
        assert down.returncode == 1 and "down" in down.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_second_server_on_a_live_socket_is_refused() -> None:
    d = short_dir()
    sock = os.path.join(d, "node.sock")
    try:
        with ServerProcess(sock, "1MiB"):
            second = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tiercache",
                    "serve",
                    "--socket",
                    sock,
                    "--arena-bytes",
                    "1MiB",
                    "--arena-path",
                    os.path.join(d, "other.arena"),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert second.returncode == 2
            assert "already listening" in second.stderr
            assert _status(sock).returncode == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_stale_socket_left_by_a_killed_server_is_replaced() -> None:
    d = short_dir()
    sock = os.path.join(d, "node.sock")
    try:
        first = ServerProcess(sock, "1MiB").start()
        first.kill()
        assert os.path.exists(sock)
        with ServerProcess(sock, "1MiB"):
            assert _status(sock).returncode == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("1GiB", 1 << 30),
        ("512MiB", 512 << 20),
        ("64KiB", 65536),
        ("2G", 2 * 10**9),
        ("1_000", 1000),
        ("1.5KiB", 1536),
    ],
)
def test_sizes_parse(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1", "1XB", "GiB", "0.3"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_sigterm_flushes_write_behind_to_storage_and_serves_metrics() -> None:
    import asyncio
    import re
    import urllib.request

    from tests.serve.helpers import page_of

    from tiercache.serve import ServeBackend
    from tiercache.storage import PageKey, open_backend

    d = short_dir()
    sock = os.path.join(d, "node.sock")
    store = os.path.join(d, "store")
    keys = [PageKey(f"p{i}") for i in range(50)]
    try:
        srv = ServerProcess(
            sock,
            "4MiB",
            "--storage-url",  # a slow store: SIGTERM comes while the write-behind is busy
            f"faulty+file://{store}?fault=latency&fault_delay=0.5&fault_ops=set",
            "--metrics-port",
            "0",
        ).start()
        m = re.search(r"metrics=([\d.]+):(\d+)", srv.ready_line)
        assert m, srv.ready_line

        async def write() -> None:
            async with ServeBackend(sock) as b:
                assert await b.batch_set(keys, [page_of(k, 20_000) for k in keys]) == [True] * 50

        asyncio.run(write())
        url = f"http://{m.group(1)}:{m.group(2)}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "tiercache_serve_arena_bytes{state=" in text
        assert "tiercache_serve_write_behind_backlog" in text
        rc, log = srv.terminate()  # while the write-behind is still writing
        assert rc == 0, log
        assert "draining" in log and "not written" not in log

        async def check() -> int:
            async with await open_backend(f"file://{store}") as fb:
                return await fb.batch_exists(keys)

        assert asyncio.run(check()) == 50
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_sigterm_gives_up_on_write_behind_at_the_drain_deadline() -> None:
    import asyncio
    import time

    from tests.serve.helpers import page_of

    from tiercache.serve import ServeBackend
    from tiercache.storage import PageKey

    d = short_dir()
    sock = os.path.join(d, "node.sock")
    keys = [PageKey(f"p{i}") for i in range(8)]
    try:
        srv = ServerProcess(
            sock,
            "1MiB",
            "--storage-url",
            f"faulty+file://{d}/store?fault=latency&fault_delay=60&fault_ops=set",
            "--drain-seconds",
            "0.5",
        ).start()

        async def write() -> None:
            async with ServeBackend(sock) as b:
                assert await b.batch_set(keys, [page_of(k, 1000) for k in keys]) == [True] * 8

        asyncio.run(write())
        t0 = time.monotonic()
        rc, log = srv.terminate()
        assert rc == 0, log
        assert time.monotonic() - t0 < 30  # the deadline, not the 60 s store
        assert "drain deadline passed" in log
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_keep_arena_survives_a_restart_of_the_command() -> None:
    import asyncio

    from tests.serve.helpers import page_bytes, page_of

    from tiercache.memory.pages import PageBuffer
    from tiercache.serve import ServeBackend
    from tiercache.storage import PageKey

    d = short_dir()
    sock = os.path.join(d, "node.sock")
    keys = [PageKey(f"p{i}") for i in range(6)]

    async def write() -> None:
        async with ServeBackend(sock) as b:
            assert await b.batch_set(keys, [page_of(k, 3000) for k in keys]) == [True] * 6

    async def read() -> list[bytes | None]:
        async with ServeBackend(sock) as b:
            outs = [PageBuffer.allocate(3000, "test-format") for _ in keys]
            got = await b.batch_get(keys, outs)
            return [o.tobytes() if g else None for o, g in zip(outs, got, strict=True)]

    try:
        with ServerProcess(sock, "1MiB", "--keep-arena"):
            asyncio.run(write())
        with ServerProcess(sock, "1MiB", "--keep-arena"):
            assert asyncio.run(read()) == [page_bytes(k, 3000) for k in keys]
            assert "restored: 6" in _status(sock).stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)
