"""FileBackend on a store where files cannot be removed (a read-only mount, another
user's files, a shard replaced by a file): what is cached stays served, damage is
reported as damage, and every failure is a `StorageError`."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.storage.storage_helpers import FORMAT, keys, page_file_size, random_page

from tiercache.errors import StorageError
from tiercache.memory import PageBuffer
from tiercache.storage.file import FileBackend, shard_dir

LOGGER = "tiercache.storage.file"


def page_path(root: Path, key: str) -> Path:
    return root / shard_dir(key) / f"{key}.page"


def shards(ks: list[str]) -> set[str]:
    return {shard_dir(k) for k in ks}


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Removing or making anything under the roots appended to the list fails with EROFS."""
    roots: list[Path] = []
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def refuse(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
            if any(os.fspath(path).startswith(os.fspath(r)) for r in roots):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "unlink", refuse(real_unlink))
    monkeypatch.setattr(os, "rmdir", refuse(real_rmdir))
    monkeypatch.setattr(os, "mkdir", refuse(os.mkdir))
    yield roots


async def test_a_store_whose_leftovers_cannot_be_removed_still_opens_and_serves(
    tmp_path: Path, read_only: list[Path]
) -> None:
    root = tmp_path / "store"
    ks, src = keys(2), [random_page(), random_page()]
    async with await FileBackend.open(root) as b:
        assert await b.batch_set(ks, src) == [True, True]
    shard = page_path(root, ks[0]).parent
    stale = shard / f".{ks[0]}.1.aaaaaaaa.tmp"
    old_layout = shard / "9a" / f"{ks[0]}.page"  # format version 1's two-level tree
    await asyncio.to_thread(old_layout.parent.mkdir)
    for p in (stale, old_layout):
        await asyncio.to_thread(p.write_bytes, b"leftover")
    old = time.time() - 3600
    await asyncio.to_thread(os.utime, stale, (old, old))
    empty = next(root / f"{i:02x}" for i in range(256) if f"{i:02x}" not in shards(ks))
    await asyncio.to_thread(empty.rmdir)  # no shard there, and none can be made
    read_only.append(root)
    async with await FileBackend.open(root) as b:
        dst = [PageBuffer.allocate(512, FORMAT) for _ in ks]
        assert await b.batch_get(ks, dst) == [True, True]
        assert [d.tobytes() for d in dst] == [p.tobytes() for p in src]


async def test_a_damaged_page_that_cannot_be_removed_is_still_a_corrupt_miss(
    tmp_path: Path, read_only: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    ks = keys(2)
    async with await FileBackend.open(root) as b:
        assert await b.batch_set(ks, [random_page(), random_page()]) == [True, True]
        await asyncio.to_thread(page_path(root, ks[0]).write_bytes, b"")  # truncated
        await asyncio.to_thread(page_path(root, ks[1]).unlink)
        await asyncio.to_thread(page_path(root, ks[1]).mkdir)  # a directory in its place
        read_only.append(root)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for _ in range(2):  # still there: the second read finds it again
                dst = [PageBuffer.allocate(512, FORMAT) for _ in ks]
                assert await b.batch_get(ks, dst) == [False, False]
        s = await b.stats()
        assert (s.corrupt_pages, s.errors) == (4, 0)
        assert "could not be removed" in caplog.text
        assert "cannot read" not in caplog.text


async def test_eviction_and_delete_of_files_that_cannot_be_removed(
    tmp_path: Path, read_only: list[Path]
) -> None:
    root = tmp_path / "store"
    ks = keys(3)
    while shard_dir(ks[2]) in (shard_dir(ks[0]), shard_dir(ks[1])):
        ks[2] = keys(1)[0]
    size = await page_file_size(root)
    async with await FileBackend.open(root, capacity_bytes=2 * size) as b:
        assert await b.batch_set(ks[:2], [random_page(), random_page()]) == [True, True]
        read_only.append(page_path(root, ks[0]))
        # The eviction of ks[0] fails: the new page is stored all the same.
        assert await b.batch_set(ks[2:], [random_page()]) == [True]
        assert await b.batch_exists(ks[2:]) == 1
        read_only.append(page_path(root, ks[1]))
        with pytest.raises(StorageError, match="cannot delete"):
            await b.delete(ks[1:2])
        read_only.clear()
        # A page under a shard that became a file is gone: nothing to delete.
        shard = page_path(root, ks[2]).parent
        await asyncio.to_thread(page_path(root, ks[2]).unlink)
        await asyncio.to_thread(shard.rmdir)
        await asyncio.to_thread(shard.write_bytes, b"not a directory")
        assert await b.delete(ks[2:]) == 0


async def test_a_full_disk_fails_each_page_and_logs_one_warning_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    ks = keys(20)
    async with await FileBackend.open(root) as b:

        def full(fd: int, buffers: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "writev", full)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await b.batch_set(ks, [random_page() for _ in ks]) == [False] * 20
        monkeypatch.undo()
        failures = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(failures) == 1 and "20 of 20 pages" in failures[0].getMessage()
        assert (await b.stats()).errors == 20
        files = await asyncio.to_thread(lambda: [p for p in root.rglob("*") if p.is_file()])
        assert files == []  # no temporary file left behind
        assert await b.batch_set(ks, [random_page() for _ in ks]) == [True] * 20
