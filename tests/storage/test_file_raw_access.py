"""Raw access to the file backend: damage at rest is caught by the backend's own checks."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

import pytest

from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.file import FileBackend

FMT = "test-format"


def key(i: int) -> PageKey:
    return PageKey(f"0123456789abcdef-{i:064x}")


async def stored(root: Path, n: int) -> tuple[FaultyBackend, list[bytes]]:
    inner = await FileBackend.open(root)
    wrapper = FaultyBackend(inner, close_inner=True)
    pages = [bytes((i * 7 + j) % 251 for j in range(4096)) for i in range(n)]
    ok = await wrapper.batch_set(
        [key(i) for i in range(n)], [PageBuffer.from_bytes(p, FMT) for p in pages]
    )
    assert all(ok)
    return wrapper, pages


async def test_corrupted_or_truncated_at_rest_is_a_miss_never_wrong_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend, pages = await stored(tmp_path, 3)
    async with backend:
        assert await backend.corrupt_stored(key(0))
        assert await backend.truncate_stored(key(1), 100)
        targets = [PageBuffer.allocate(4096, FMT) for _ in range(3)]
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            got = await backend.batch_get([key(i) for i in range(3)], targets)
        assert got == [False, False, True]
        # Both are misses. A truncated file never touches its page; a corrupt payload
        # was read into its page before the checksum failed, and that page is not
        # reported as arrived, so it is never used.
        assert targets[1].tobytes() == bytes(4096)
        assert targets[2].tobytes() == pages[2]
        assert caplog.text
        # The damaged files were removed: they are misses from now on.
        assert await backend.batch_exists([key(0)]) == 0
        assert await backend.inner.read_raw(key(0)) is None  # type: ignore[attr-defined]


async def test_raw_read_returns_the_stored_file_and_raw_write_keeps_files_private(
    tmp_path: Path,
) -> None:
    inner = await FileBackend.open(tmp_path)
    async with inner:
        await inner.batch_set([key(5)], [PageBuffer.from_bytes(b"x" * 512, FMT)])
        raw = await inner.read_raw(key(5))
        assert raw is not None and raw.endswith(b"x" * 512) and raw.startswith(b"TCKV")
        old = os.umask(0)
        try:
            await inner.write_raw(key(6), b"junk")
        finally:
            os.umask(old)
        mode = await asyncio.to_thread(
            lambda: stat.S_IMODE(next(tmp_path.rglob(f"{key(6)}.page")).stat().st_mode)
        )
        assert mode == 0o600
        assert await inner.read_raw(key(7)) is None
