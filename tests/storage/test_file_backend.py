"""FileBackend specifics: restart and second process, damaged files, crash leftovers,
capacity, permissions, key safety, write failures and cancellation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.storage.storage_helpers import (
    FORMAT,
    host_pool,
    keys,
    page_file_size,
    random_page,
    slots,
)

from tiercache.errors import ConfigError, InvalidInputError
from tiercache.memory import PageBuffer
from tiercache.storage import file as file_module
from tiercache.storage.file import FileBackend, shard_dir
from tiercache.storage.format import pack_page

LOGGER = "tiercache.storage.file"


def page_path(root: Path, key: str) -> Path:
    return root / shard_dir(key) / f"{key}.page"


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


CHILD = """
import asyncio, hashlib, sys
from tiercache.memory import PageBuffer
from tiercache.storage import file as file_module
from tiercache.storage.file import FileBackend

async def main():
    root, fmt, nbytes, *ks = sys.argv[1:]
    async with await FileBackend.open(root) as b:
        print(await b.batch_exists(ks))
        pages = [PageBuffer.allocate(int(nbytes), fmt) for _ in ks]
        print(await b.batch_get(ks, pages))
        for p in pages:
            print(hashlib.sha256(p.tobytes()).hexdigest())

asyncio.run(main())
"""


async def test_a_second_process_reads_the_pages_bit_identically(tmp_path: Path) -> None:
    root = tmp_path / "store"
    pool = await asyncio.to_thread(host_pool, "page_first", 32, 7)
    pages = pool.page_buffers(slots(0, 3, 6))
    ks = keys(3)
    async with await FileBackend.open(root) as b:
        assert await b.batch_set(ks, pages) == [True] * 3
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(root), pool.format, str(pages[0].nbytes), *ks,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().split()
    assert lines[0] == "3"
    assert "".join(lines[1:4]) == "[True,True,True]"
    assert lines[4:] == [hashlib.sha256(p.tobytes()).hexdigest() for p in pages]


async def test_pages_and_lru_order_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ks = keys(3)
    src = [random_page() for _ in ks]
    async with await FileBackend.open(root) as b:
        await b.batch_set(ks, src)
    now = time.time()
    for age, k in zip((300, 200, 100), ks, strict=True):  # ks[0] oldest
        await asyncio.to_thread(os.utime, page_path(root, k), (now - age, now - age))
    size = (await asyncio.to_thread(os.stat, page_path(root, ks[0]))).st_size
    async with await FileBackend.open(root, capacity_bytes=2 * size) as b:
        s = await b.stats()
        assert s.extra["pages"] == 2 and s.evictions == 1
        assert await b.batch_exists(ks) == 0  # the oldest went
        dst = [PageBuffer.allocate(512, FORMAT) for _ in ks[1:]]
        assert await b.batch_get(ks[1:], dst) == [True, True]
        assert [d.tobytes() for d in dst] == [p.tobytes() for p in src[1:]]
    assert not await asyncio.to_thread(page_path(root, ks[0]).exists)


async def test_a_read_counts_as_a_use_after_a_restart(tmp_path: Path) -> None:
    """LRU, not FIFO, across a restart: a page read recently outlives one written later."""
    root = tmp_path / "store"
    ks = keys(3)
    async with await FileBackend.open(root) as b:
        await b.batch_set(ks, [random_page() for _ in ks])
    size = (await asyncio.to_thread(os.stat, page_path(root, ks[0]))).st_size
    now = time.time()
    for age, k in zip((300, 200, 100), ks, strict=True):  # written ks[0] first
        await asyncio.to_thread(os.utime, page_path(root, k), (now - age, now - age))
    async with await FileBackend.open(root, capacity_bytes=3 * size) as b:
        assert await b.batch_get(ks[:1], [PageBuffer.allocate(512, FORMAT)]) == [True]
    async with await FileBackend.open(root, capacity_bytes=2 * size) as b:
        assert (await b.stats()).evictions == 1
    # ks[1] is the least recently used: written early and never read.
    exists = [await asyncio.to_thread(page_path(root, k).exists) for k in ks]
    assert exists == [True, False, True]


async def test_pages_written_by_another_instance_are_found(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with await FileBackend.open(root) as reader, await FileBackend.open(root) as writer:
        ks = keys(2)
        assert await reader.batch_exists(ks) == 0
        await writer.batch_set(ks, [random_page(), random_page()])
        assert await reader.batch_exists(ks) == 2


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(700))


def _header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[30] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip, _truncate, _extend, _garbage, _header])
async def test_damaged_file_is_a_logged_miss_and_is_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    assert callable(damage)
    root = tmp_path / "store"
    async with await FileBackend.open(root) as b:
        ks = keys(2)
        src = [random_page(), random_page()]
        await b.batch_set(ks, src)
        await asyncio.to_thread(damage, page_path(root, ks[0]))
        dst = [random_page(), PageBuffer.allocate(512, FORMAT)]
        before = dst[0].tobytes()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await b.batch_get(ks, dst) == [False, True]
        if damage is not _flip:
            assert dst[0].tobytes() == before  # a bad header never touches the page
        # A flipped payload byte is found after the read into the page (one copy): the
        # page is reported as not arrived, so its slot is never published.
        assert dst[1].tobytes() == src[1].tobytes()
        assert "failed its checks" in caplog.text
        assert not await asyncio.to_thread(page_path(root, ks[0]).exists)
        assert (await b.stats()).corrupt_pages == 1
        assert await b.batch_exists(ks[:1]) == 0


async def test_swapped_files_are_misses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    async with await FileBackend.open(root) as b:
        ks = keys(2)
        await b.batch_set(ks, [random_page(), random_page()])
        p0, p1 = page_path(root, ks[0]), page_path(root, ks[1])
        tmp = tmp_path / "swap"
        await asyncio.to_thread(os.replace, p0, tmp)
        await asyncio.to_thread(os.replace, p1, p0)
        await asyncio.to_thread(os.replace, tmp, p1)
        dst = [random_page(), random_page()]
        before = [d.tobytes() for d in dst]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await b.batch_get(ks, dst) == [False, False]
        assert [d.tobytes() for d in dst] == before
        assert "file swapped" in caplog.text
        assert await asyncio.to_thread(all_files, root) == []


async def test_page_read_into_another_format_is_refused_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bfloat16 target for a float16 page is the caller's mistake: refused,
    the target untouched, the file kept for readers of its format."""
    root = tmp_path / "store"
    fp16 = "mha:L2:H2:D8:float16:P4:page_first"
    async with await FileBackend.open(root) as b:
        (k,) = keys(1)
        src = random_page(512, fp16)
        await b.batch_set([k], [src])
        dst = random_page(512, "mha:L2:H2:D8:bfloat16:P4:page_first")
        before = dst.tobytes()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(InvalidInputError, match="bfloat16"):
                await b.batch_get([k], [dst])
        assert dst.tobytes() == before
        assert "failed its checks" not in caplog.text
        assert await asyncio.to_thread(page_path(root, k).exists)
        assert await b.batch_exists([k]) == 1 and (await b.stats()).corrupt_pages == 0
        right = PageBuffer.allocate(512, fp16)
        assert await b.batch_get([k], [right]) == [True]
        assert right.tobytes() == src.tobytes()


async def test_leftover_temporary_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (k,) = keys(1)
    shard = page_path(root, k).parent
    await asyncio.to_thread(shard.mkdir, parents=True)
    blob = b"".join(bytes(p) for p in pack_page(k, random_page()))
    stale, fresh = shard / f".{k}.1.aaaaaaaa.tmp", shard / f".{k}.2.bbbbbbbb.tmp"
    for p in (stale, fresh):
        await asyncio.to_thread(p.write_bytes, blob)
    old = time.time() - 3600
    await asyncio.to_thread(os.utime, stale, (old, old))
    async with await FileBackend.open(root) as b:
        assert await b.batch_exists([k]) == 0  # a temp file is never a page
        assert await b.batch_get([k], [PageBuffer.allocate(512, FORMAT)]) == [False]
        assert not await asyncio.to_thread(stale.exists)
        assert await asyncio.to_thread(fresh.exists)  # may belong to a live writer
        assert await b.batch_set([k], [random_page()]) == [True]
        assert await b.batch_exists([k]) == 1


async def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ks = keys(4)
    size = await page_file_size(root)
    async with await FileBackend.open(root, capacity_bytes=3 * size) as b:
        await b.batch_set(ks[:3], [random_page() for _ in range(3)])
        assert await b.batch_get([ks[0]], [PageBuffer.allocate(512, FORMAT)]) == [True]
        assert await b.batch_set([ks[3]], [random_page()]) == [True]
        assert await b.batch_exists([ks[1]]) == 0
        assert not await asyncio.to_thread(page_path(root, ks[1]).exists)
        assert await b.batch_exists([ks[0], ks[2], ks[3]]) == 3
        s = await b.stats()
        assert s.evictions == 1 and s.extra["bytes"] == 3 * size
        assert await b.batch_set(keys(1), [random_page(3 * size)]) == [
            False
        ]  # larger than the store
        assert len(await asyncio.to_thread(all_files, root)) == 3


async def test_a_batch_larger_than_the_capacity_stays_under_it(tmp_path: Path) -> None:
    """The batch's own pages in flight cannot be evicted: the leading pages that fit are stored."""
    root = tmp_path / "store"
    ks = keys(3)
    size = await page_file_size(root)
    async with await FileBackend.open(root, capacity_bytes=2 * size) as b:
        assert await b.batch_set(ks, [random_page() for _ in ks]) == [True, True, False]
        assert (await b.stats()).extra["bytes"] == 2 * size
        assert len(await asyncio.to_thread(all_files, root)) == 2
        assert await b.batch_set(ks[2:], [random_page()]) == [True]  # evicts ks[0]
        assert len(await asyncio.to_thread(all_files, root)) == 2


async def test_capacity_is_per_backend_when_two_share_a_root(tmp_path: Path) -> None:
    """As documented: each bounds what it knows, so the tree holds up to both capacities."""
    root = tmp_path / "store"
    ka, kb = keys(3), keys(3)
    size = await page_file_size(root)
    a = await FileBackend.open(root, capacity_bytes=2 * size)
    b = await FileBackend.open(root, capacity_bytes=2 * size)
    async with a, b:
        for k in ka:
            await a.batch_set([k], [random_page()])
        for k in kb:
            await b.batch_set([k], [random_page()])
        assert (await a.stats()).extra["bytes"] == (await b.stats()).extra["bytes"] == 2 * size
        assert len(await asyncio.to_thread(all_files, root)) == 4
    async with await FileBackend.open(root, capacity_bytes=2 * size) as c:
        assert (await c.stats()).extra["bytes"] == 2 * size  # a restart bounds them all
    assert len(await asyncio.to_thread(all_files, root)) == 2


async def test_files_and_directories_are_private(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with await FileBackend.open(root) as b:
        (k,) = keys(1)
        await b.batch_set([k], [random_page()])
    path = page_path(root, k)
    for d in (root, path.parent):
        assert stat.S_IMODE((await asyncio.to_thread(os.stat, d)).st_mode) == 0o700
    assert stat.S_IMODE((await asyncio.to_thread(os.stat, path)).st_mode) == 0o600


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "..", "/etc/passwd", ".hidden"])
async def test_unsafe_keys_never_reach_a_path(tmp_path: Path, bad: str) -> None:
    async with await FileBackend.open(tmp_path / "store") as b:
        with pytest.raises(InvalidInputError):
            await b.batch_set([bad], [random_page()])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError):
            await b.batch_get([bad], [random_page()])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError):
            await b.delete([bad])  # type: ignore[list-item]
    assert await asyncio.to_thread(all_files, tmp_path) == []


async def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    async with await FileBackend.open(tmp_path / "store", fsync=True, max_concurrency=2) as b:
        ks = keys(3)
        src = [random_page() for _ in ks]
        assert await b.batch_set(ks, src) == [True] * 3
        dst = [PageBuffer.allocate(512, FORMAT) for _ in ks]
        assert await b.batch_get(ks, dst) == [True] * 3
        assert [d.tobytes() for d in dst] == [p.tobytes() for p in src]


async def test_a_failed_write_is_false_counted_and_leaves_no_temp_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    async with await FileBackend.open(root) as b:
        ks = keys(2)
        while shard_dir(ks[1]) == shard_dir(ks[0]):
            ks[1] = keys(1)[0]
        blocked = page_path(root, ks[0]).parent
        await asyncio.to_thread(blocked.rmdir)  # the backend made every shard when it started
        await asyncio.to_thread(blocked.write_bytes, b"not a directory")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            result = await b.batch_set(ks, [random_page(), random_page()])
        assert result == [False, True]
        assert "cannot write 1 of 2 pages" in caplog.text
        assert (await b.stats()).errors == 1
        files = await asyncio.to_thread(all_files, root)
        assert not [f for f in files if f.name.endswith(".tmp")]


async def test_cancelled_batch_set_cancels_pending_pages_and_finishes_running_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    release = threading.Event()
    two_running = asyncio.Event()
    entered: list[int] = []
    real_writev_all = file_module._writev_all

    def slow_writev_all(fd: int, parts: object) -> None:
        entered.append(fd)
        if len(entered) == 2:
            loop.call_soon_threadsafe(two_running.set)
        release.wait(10)
        real_writev_all(fd, parts)  # type: ignore[arg-type]

    root = tmp_path / "store"
    size = await page_file_size(root)
    monkeypatch.setattr(file_module, "_writev_all", slow_writev_all)
    async with await FileBackend.open(root, max_concurrency=2, capacity_bytes=20 * size) as b:
        ks = keys(10)
        task = asyncio.create_task(b.batch_set(ks, [random_page() for _ in ks]))
        await two_running.wait()
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done()  # waits for the two pages being written
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(entered) == 2  # the other eight never started
        files = await asyncio.to_thread(all_files, root)
        assert len(files) == 2 and not [f for f in files if f.name.endswith(".tmp")]
        # The two written are indexed and counted: a capacity bounds them too.
        s = await b.stats()
        assert (s.extra["pages"], s.extra["bytes"], s.set_written) == (2, 2 * size, 2)
        monkeypatch.setattr(file_module, "_writev_all", real_writev_all)
        assert await b.batch_set(ks, [random_page() for _ in ks]) == [True] * len(ks)
        assert await b.batch_exists(ks) == len(ks)


async def test_options_are_checked() -> None:
    for opts in (
        {"capacity_bytes": 0},
        {"max_concurrency": 0},
        {"fsync": "maybe"},
        {"capacity_bytes": 10, "scan": False},
    ):
        with pytest.raises(ConfigError):
            FileBackend("/nonexistent-tiercache-root", **opts)  # type: ignore[arg-type]


async def test_a_read_that_ends_after_its_page_was_removed_does_not_bring_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit read before a delete or an eviction removed the file must not re-index it:
    the index would claim the page, and the next write of it would be skipped."""
    root = tmp_path / "store"
    ks = keys(4)
    size = await page_file_size(root)
    # Threads to spare beside the two reads held midway.
    async with await FileBackend.open(root, capacity_bytes=2 * size, max_concurrency=4) as b:
        assert await b.batch_set(ks[:2], [random_page(), random_page()]) == [True, True]
        real = FileBackend._read_job
        read, release = threading.Barrier(3), threading.Event()

        def slow_read(self: FileBackend, key: str, page: PageBuffer) -> object:
            result = real(self, key, page)
            read.wait(10)
            release.wait(10)
            return result

        monkeypatch.setattr(FileBackend, "_read_job", slow_read)
        dst = [PageBuffer.allocate(512, FORMAT) for _ in range(2)]
        reading = asyncio.create_task(b.batch_get(ks[:2], dst))
        await asyncio.to_thread(read.wait, 10)
        assert await b.delete(ks[:1]) == 1
        monkeypatch.undo()
        assert await b.batch_set(ks[2:], [random_page(), random_page()]) == [True, True]
        assert not await asyncio.to_thread(page_path(root, ks[1]).exists)
        release.set()
        assert await reading == [True, True]  # both were read whole before their removal
        assert await b.batch_exists(ks[:1]) == 0
        assert await b.batch_exists(ks[1:2]) == 0
        assert (await b.stats()).extra["bytes"] == 2 * size
        assert await b.batch_set(ks[:1], [random_page()]) == [True]
        assert await asyncio.to_thread(page_path(root, ks[0]).exists)  # written, not skipped


async def test_a_read_while_its_page_is_being_removed_does_not_bring_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that begins after a delete was asked for, and ends before the file is gone."""
    root = tmp_path / "store"
    ks = keys(1)
    async with await FileBackend.open(root, max_concurrency=4) as b:
        assert await b.batch_set(ks, [random_page()]) == [True]
        real, unlinking, release = file_module._unlink, threading.Event(), threading.Event()

        def slow_unlink(path: str | Path) -> bool:
            unlinking.set()
            release.wait(10)
            return real(path)

        monkeypatch.setattr(file_module, "_unlink", slow_unlink)
        deleting = asyncio.create_task(b.delete(ks))
        await asyncio.to_thread(unlinking.wait, 10)
        assert await b.batch_get(ks, [PageBuffer.allocate(512, FORMAT)]) == [True]
        release.set()
        assert await deleting == 1
        assert await b.batch_exists(ks) == 0
        assert (await b.stats()).extra["pages"] == 0


async def test_indexing_a_large_store_at_start_keeps_the_event_loop_turning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attaching a store of a million pages under a live loop must not stall it for the
    time the index takes to fill."""
    n = 500_000
    found = [(f"0123456789abcdef-{i:064x}", 4608) for i in range(n)]
    real_scan = FileBackend._scan_job

    def scan(self: FileBackend) -> object:
        real_scan(self)  # make the shards
        return file_module._index_of(found), 0

    monkeypatch.setattr(FileBackend, "_scan_job", scan)
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    b = await FileBackend.open(tmp_path / "store")
    await asyncio.sleep(0.01)  # the ticker records the gap that open left
    ticker.cancel()
    try:
        s = await b.stats()
        assert (s.extra["pages"], s.extra["bytes"]) == (n, n * 4608)
        assert max(gaps) < 0.15, max(gaps)  # all at once: 0.3 s and more
    finally:
        await b.aclose()
