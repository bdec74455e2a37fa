"""FileBackend on-disk format version, damaged entries that heal, and the write paths.

A page of an older format version is a plain miss that the next write
replaces; a directory, a fifo or a symbolic link standing where a page file
should be is a miss on every call and is replaced by the next write; both
publishing paths (unnamed ``O_TMPFILE`` files and named temporary files) keep
first-writer-wins and read back verified.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.storage.storage_helpers import FORMAT, keys, random_page

from tiercache.errors import StorageCorruptionError
from tiercache.memory import PageBuffer
from tiercache.storage import file as file_module
from tiercache.storage.file import FileBackend, default_concurrency, shard_dir
from tiercache.storage.format import (
    VERSION,
    decode_header,
    header_size,
    is_older_version,
    pack_page,
    unpack_page,
)

LOGGER = "tiercache.storage.file"


def page_path(root: Path, key: str) -> Path:
    return root / shard_dir(key) / f"{key}.page"


def version1_blob(key: str, page: PageBuffer) -> bytes:
    """A page as format version 1 wrote it: CRC-32 checksums, 28-byte fixed header."""
    fmt_b, key_b = page.format.encode(), key.encode()
    payload = page.tobytes()
    fixed = struct.pack(
        "<4sHHHHQI", b"TCKV", 1, len(fmt_b), len(key_b), 0, len(payload), zlib.crc32(payload)
    )
    hcrc = zlib.crc32(key_b, zlib.crc32(fmt_b, zlib.crc32(fixed)))
    return fixed + struct.pack("<I", hcrc) + fmt_b + key_b + payload


def version2_blob(key: str, page: PageBuffer) -> bytes:
    """A page as format version 2 wrote it: XXH3-64, no padding between the key and payload."""
    blob = bytearray(b"".join(bytes(p) for p in pack_page(key, page)))
    struct.pack_into("<H", blob, 4, 2)
    return bytes(blob)


def test_the_format_version_is_3_and_older_pages_are_told_apart() -> None:
    (k,) = keys(1)
    page = random_page()
    assert VERSION == 3
    current = b"".join(bytes(p) for p in pack_page(k, page))
    assert decode_header(current).key == k
    assert not is_older_version(current)
    assert is_older_version(version1_blob(k, page))
    assert is_older_version(version2_blob(k, page))
    assert not is_older_version(b"junk" + bytes(40))


def test_a_flipped_bit_anywhere_in_a_header_is_caught() -> None:
    # The header checksum is taken in place over the two runs around the stored sum
    # (fixed fields; format, key and padding): every byte of the header is covered.
    (k,) = keys(1)
    page = random_page()
    header = bytes(pack_page(k, page, 64)[0])
    assert decode_header(header).key == k
    for at in range(len(header)):
        damaged = bytearray(header)
        damaged[at] ^= 0x10
        with pytest.raises(StorageCorruptionError):
            decode_header(damaged)


@pytest.mark.parametrize("align", [1, 64, 4096])
def test_a_padded_header_puts_the_payload_at_a_multiple_of_align(align: int) -> None:
    (k,) = keys(1)
    page = random_page()
    header, *segments = pack_page(k, page, align)
    assert len(header) == header_size(k, page.format, align)
    assert len(header) % align == 0
    h = decode_header(header)
    assert h.header_len == len(header)
    blob = bytes(header) + b"".join(bytes(s) for s in segments)
    dst = PageBuffer.allocate(page.nbytes, page.format)
    unpack_page(k, blob, dst)
    assert dst.tobytes() == page.tobytes()


async def test_page_files_keep_their_payload_on_a_4_kib_boundary(tmp_path: Path) -> None:
    ks = keys(2)
    pages = [random_page() for _ in ks]
    async with await FileBackend.open(tmp_path / "store") as b:
        assert await b.batch_set(ks, pages) == [True, True]
        for k, p in zip(ks, pages, strict=True):
            raw = await b.read_raw(k)
            assert raw is not None
            h = decode_header(raw)
            assert h.header_len == 4096
            assert raw[h.header_len :] == p.tobytes()


async def test_version_2_pages_are_quiet_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    ks = keys(2)
    old = [random_page() for _ in ks]
    for k, p in zip(ks, old, strict=True):
        path = page_path(root, k)
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(path.write_bytes, version2_blob(k, p))
    async with await FileBackend.open(root) as b:
        dst = [PageBuffer.allocate(p.nbytes, p.format) for p in old]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await b.batch_get(ks, dst) == [False, False]
        assert "failed its checks" not in caplog.text
        assert (await b.stats()).corrupt_pages == 0
        assert [d.tobytes() for d in dst] == [bytes(p.nbytes) for p in old]
        assert await b.batch_set(ks, old) == [True, True]
        assert await b.batch_get(ks, dst) == [True, True]
        assert [d.tobytes() for d in dst] == [p.tobytes() for p in old]


def old_tree_path(root: Path, key: str) -> Path:
    """Where format version 1 kept a page: two shard levels."""
    tail = key.rpartition("-")[2]
    return root / tail[:2] / tail[2:4] / f"{key}.page"


async def test_version_1_pages_are_quiet_misses_and_the_next_write_replaces_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    ks = keys(3)
    old = [random_page() for _ in ks]
    # Two in the version 1 tree, one (copied by hand) where version 2 looks.
    places = [old_tree_path(root, ks[0]), old_tree_path(root, ks[1]), page_path(root, ks[2])]
    for k, p, path in zip(ks, old, places, strict=True):
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(path.write_bytes, version1_blob(k, p))
    async with await FileBackend.open(root) as b:
        # The scan removed the old tree's files and its emptied directories.
        assert not await asyncio.to_thread(places[0].exists)
        assert not await asyncio.to_thread(places[0].parent.exists)
        assert await b.batch_exists(ks[:2]) == 0
        dst = [PageBuffer.allocate(512, FORMAT) for _ in ks]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await b.batch_get(ks, dst) == [False] * 3
        assert [d.tobytes() for d in dst] == [bytes(512)] * 3  # never read into the page
        assert "failed its checks" not in caplog.text  # stale, not damaged
        assert (await b.stats()).corrupt_pages == 0
        assert not await asyncio.to_thread(places[2].exists)
        assert await b.batch_exists(ks) == 0
        new = [random_page() for _ in ks]
        assert await b.batch_set(ks, new) == [True] * 3
        assert await b.batch_get(ks, dst) == [True] * 3
        assert [d.tobytes() for d in dst] == [p.tobytes() for p in new]
        raw = await b.read_raw(ks[0])
        assert raw is not None and decode_header(raw).key == ks[0]


async def test_the_backend_makes_its_256_shards_once_and_clear_keeps_them(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with await FileBackend.open(root) as b:
        shards = sorted(p.name for p in await asyncio.to_thread(lambda: list(root.iterdir())))
        assert shards == [f"{i:02x}" for i in range(256)]
        ks = keys(4)
        assert await b.batch_set(ks, [random_page() for _ in ks]) == [True] * 4
        await b.clear()
        left = await asyncio.to_thread(lambda: sorted(root.rglob("*")))
        assert len(left) == 256 and all(p.is_dir() for p in left)


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")  # not empty: removed as a tree


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_to_a_valid_page(path: Path) -> None:
    # Points at a real, valid page file of the same key: still never followed.
    target = path.parent.parent / "elsewhere.page"
    os.replace(path, target)
    os.symlink(target, path)


def _dangling_symlink(path: Path) -> None:
    os.symlink(path.parent / "nowhere", path)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "directory": _directory,
    "fifo": _fifo,
    "symlink": _symlink_to_a_valid_page,
    "dangling symlink": _dangling_symlink,
}


async def _damage(root: Path, key: str, kind: str, backend: FileBackend) -> None:
    path = page_path(root, key)
    if kind == "symlink":
        assert await backend.batch_set([key], [random_page()]) == [True]
    else:
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(DAMAGE[kind], path)


@pytest.mark.parametrize("kind", list(DAMAGE))
async def test_a_damaged_entry_is_a_miss_and_the_next_write_heals_it(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "store"
    (k,) = keys(1)
    async with await FileBackend.open(root) as b:
        await _damage(root, k, kind, b)
    # A fresh backend: whatever the scan made of the entry, it is never a page.
    async with await FileBackend.open(root) as b:
        assert await b.batch_exists([k]) == 0
        page = random_page()
        assert await b.batch_set([k], [page]) == [True]  # not "already stored"
        path = page_path(root, k)
        assert await asyncio.to_thread(path.is_file) and not await asyncio.to_thread(
            path.is_symlink
        )
        dst = PageBuffer.allocate(512, FORMAT)
        assert await b.batch_get([k], [dst]) == [True]
        assert dst.tobytes() == page.tobytes()
        assert await b.batch_exists([k]) == 1


@pytest.mark.parametrize("kind", list(DAMAGE))
async def test_deleting_or_clearing_a_damaged_entry_removes_it(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    (k,) = keys(1)
    async with await FileBackend.open(root) as b:
        await _damage(root, k, kind, b)
        assert await b.delete([k]) == 0  # no page was there
        assert not await asyncio.to_thread(os.path.lexists, page_path(root, k))
        await _damage(root, k, kind, b)
        await b.clear()
        assert not await asyncio.to_thread(os.path.lexists, page_path(root, k))


@pytest.mark.parametrize("kind", list(DAMAGE))
async def test_reading_a_damaged_entry_is_a_logged_miss_that_removes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    root = tmp_path / "store"
    (k,) = keys(1)
    async with await FileBackend.open(root) as b:
        await _damage(root, k, kind, b)
        dst = PageBuffer.allocate(512, FORMAT)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            # A fifo would block a plain open() forever: the timeout catches a hang.
            got = await asyncio.wait_for(b.batch_get([k], [dst]), 10)
        assert got == [False]
        assert dst.tobytes() == bytes(512)
        assert "failed its checks" in caplog.text
        assert not await asyncio.to_thread(os.path.lexists, page_path(root, k))
        assert (await b.stats()).corrupt_pages == 1
        page = random_page()
        assert await b.batch_set([k], [page]) == [True]
        assert await b.batch_get([k], [dst]) == [True] and dst.tobytes() == page.tobytes()


@pytest.mark.parametrize("unnamed", [True, False], ids=["o_tmpfile", "named-tmp"])
async def test_both_publish_paths_are_first_writer_wins_and_leave_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unnamed: bool
) -> None:
    if not unnamed:
        monkeypatch.setattr(FileBackend, "_probe_tmpfile", lambda self: False)
    root = tmp_path / "store"
    async with await FileBackend.open(root, max_concurrency=4) as b:
        if unnamed and not b.publishes_unnamed:
            pytest.skip("O_TMPFILE is not supported here")
        assert b.publishes_unnamed is unnamed
        ks = keys(8)
        first = [random_page() for _ in ks]
        # Two backends' worth of racing writers of the same keys.
        a, c = await asyncio.gather(
            b.batch_set(ks, first), b.batch_set(ks, [random_page() for _ in ks])
        )
        assert a == c == [True] * 8
        dst = [PageBuffer.allocate(512, FORMAT) for _ in ks]
        assert await b.batch_get(ks, dst) == [True] * 8
    names = [n for _, _, files in os.walk(root) for n in files]
    assert len(names) == 8 and all(n.endswith(".page") for n in names)
    # Reopened, the pages are the ones first stored, verified.
    async with await FileBackend.open(root) as b:
        again = [PageBuffer.allocate(512, FORMAT) for _ in ks]
        assert await b.batch_get(ks, again) == [True] * 8
        assert [d.tobytes() for d in again] == [d.tobytes() for d in dst]
        assert (await b.stats()).set_written == 0


async def test_a_page_file_that_appears_meanwhile_wins_over_this_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    (k,) = keys(1)
    theirs, ours = random_page(), random_page()
    real = file_module._writev_all

    def racing_writev_all(fd: int, parts: object) -> None:
        # Another process publishes the key while this write is in progress.
        path = page_path(root, k)
        path.write_bytes(b"".join(bytes(p) for p in pack_page(k, theirs)))
        real(fd, parts)  # type: ignore[arg-type]

    async with await FileBackend.open(root) as b:
        monkeypatch.setattr(file_module, "_writev_all", racing_writev_all)
        assert await b.batch_set([k], [ours]) == [True]
        monkeypatch.setattr(file_module, "_writev_all", real)
        assert (await b.stats()).set_written == 0
        dst = PageBuffer.allocate(512, FORMAT)
        assert await b.batch_get([k], [dst]) == [True]
        assert dst.tobytes() == theirs.tobytes()


def test_the_default_thread_count_fits_the_cpus() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert default_concurrency() == max(2, min(16, cpus))
    assert FileBackend("/nonexistent-tiercache-root").max_concurrency == default_concurrency()
    assert FileBackend("/nonexistent-tiercache-root", max_concurrency=3).max_concurrency == 3


async def test_a_flipped_byte_in_the_header_padding_is_caught(tmp_path: Path) -> None:
    (k,) = keys(1)
    page = random_page()
    async with await FileBackend.open(tmp_path / "store") as b:
        assert await b.batch_set([k], [page]) == [True]
        raw = await b.read_raw(k)
        assert raw is not None and decode_header(raw).header_len == 4096
        damaged = bytearray(raw)
        damaged[4000] ^= 0xFF  # in the zero padding between the key and the payload
        await b.write_raw(k, bytes(damaged))
        dst = PageBuffer.allocate(page.nbytes, page.format)
        assert await b.batch_get([k], [dst]) == [False]
        assert (await b.stats()).corrupt_pages == 1
        assert dst.tobytes() == bytes(page.nbytes)  # a bad header never touches the page
