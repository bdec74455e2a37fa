"""Malformed frames from hypothesis: the server answers or closes, stays up, and loses nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.serve.helpers import FORMAT, ServerProcess, page_bytes, page_of, short_dir

from tiercache.memory.pages import PageBuffer
from tiercache.serve import ServeBackend
from tiercache.serve import protocol as proto
from tiercache.storage import PageKey

NBYTES = 5000
KEEP = [f"keep{i}" for i in range(4)]


class RawClient:
    """A blocking protocol client on a plain socket (the fuzzer's well-behaved neighbour)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.ids = 0

    def call(self, op: str, body: Any) -> Any:
        self.ids += 1
        self.sock.sendall(proto.request(self.ids, op, body))
        while True:
            for reply in self.unpacker:
                assert reply[0] == self.ids and reply[1] == "ok", reply
                return reply[2]
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed a well-behaved connection"
            self.unpacker.feed(chunk)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, RawClient]]:
    d = short_dir()
    sock = os.path.join(d, "node.sock")
    try:
        with ServerProcess(sock, "2MiB", "--block-bytes", "4KiB", "--log-level", "error"):

            async def seed() -> None:
                async with ServeBackend(sock) as b:
                    keys = [PageKey(k) for k in KEEP]
                    assert await b.batch_set(keys, [page_of(k, NBYTES) for k in KEEP]) == [True] * 4

            asyncio.run(seed())
            neighbour = RawClient(sock)
            # leased by the neighbour: no fuzzed clear, delete or eviction may take them
            assert [a[0] for a in neighbour.call("lease", [[k, NBYTES, FORMAT] for k in KEEP])] == [
                "hit"
            ] * 4
            yield sock, neighbour
            neighbour.sock.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _send(path: str, data: bytes) -> None:
    """Send ``data`` on a fresh connection, half-close, read until the server closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed on a fatal frame before reading it all


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
_ops = st.sampled_from(sorted(proto.OPS)) | st.text(max_size=8)
_items = st.lists(
    st.tuples(
        st.text(max_size=12) | st.sampled_from(KEEP), st.integers(-5, 1 << 40), st.text(max_size=10)
    ).map(list),
    max_size=6,
)
_requests = st.builds(
    lambda v, rid, op, body: msgpack.packb([v, rid, op, body]),
    st.sampled_from([proto.VERSION]) | st.integers(-2, 5) | _scalars,
    st.integers(-(1 << 63), (1 << 64) - 1) | _scalars,
    _ops,
    _values | _items | st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=5),
)
_frames = st.lists(
    st.binary(max_size=300) | _values.map(msgpack.packb) | _requests,
    min_size=1,
    max_size=4,
).map(b"".join)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=_frames, cut=st.integers(0, 400) | st.none())
def test_malformed_frames_leave_the_server_and_its_neighbours_unharmed(
    server: tuple[str, RawClient], data: bytes, cut: int | None
) -> None:
    path, neighbour = server
    _send(path, data if cut is None else data[:cut])
    assert neighbour.call("exists", KEEP) == 4  # up, answering, nothing lost


def test_after_the_fuzzing_the_pages_are_intact(server: tuple[str, RawClient]) -> None:
    path, neighbour = server
    status = neighbour.call("status", {})
    assert status["bad_frames"] > 0

    async def read() -> list[bytes]:
        async with ServeBackend(path) as b:
            outs = [PageBuffer.allocate(NBYTES, FORMAT) for _ in KEEP]
            assert await b.batch_get([PageKey(k) for k in KEEP], outs) == [True] * 4
            return [o.tobytes() for o in outs]

    assert asyncio.run(read()) == [page_bytes(k, NBYTES) for k in KEEP]
