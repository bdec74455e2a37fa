"""MemoryBackend specifics: LRU bounds, key validation, large batches, dropped mismatches."""

from __future__ import annotations

import pytest
from tests.storage.storage_helpers import FORMAT, keys, random_page

from tiercache.errors import ConfigError, InvalidInputError
from tiercache.memory import PageBuffer
from tiercache.storage.memory import MemoryBackend


async def test_capacity_bytes_evicts_least_recently_used() -> None:
    async with MemoryBackend(capacity_bytes=3 * 512) as b:
        ks = keys(4)
        await b.batch_set(ks[:3], [random_page() for _ in range(3)])
        assert await b.batch_get([ks[0]], [PageBuffer.allocate(512, FORMAT)]) == [
            True
        ]  # ks[0] is now fresh
        await b.batch_set([ks[3]], [random_page()])
        assert await b.batch_exists([ks[1]]) == 0  # the LRU page went
        assert await b.batch_exists([ks[0], ks[2], ks[3]]) == 3
        assert b.used_bytes == 3 * 512 and len(b) == 3
        s = await b.stats()
        assert s.evictions == 1 and s.extra["pages"] == 3


async def test_capacity_pages_and_oversized_page() -> None:
    async with MemoryBackend(capacity_pages=2, capacity_bytes=1024) as b:
        ks = keys(4)
        assert await b.batch_set(ks[:3], [random_page() for _ in range(3)]) == [True] * 3
        assert len(b) == 2 and await b.batch_exists(ks[1:3]) == 2
        assert await b.batch_set([ks[3]], [random_page(2048)]) == [False]
        assert await b.batch_exists([ks[3]]) == 0


async def test_large_batches_copy_off_the_loop_and_round_trip() -> None:
    async with MemoryBackend() as b:
        ks = keys(3)
        src = [random_page(1 << 20) for _ in ks]  # 3 MiB: over the inline threshold
        assert await b.batch_set(ks, src) == [True] * 3
        dst = [PageBuffer.allocate(1 << 20, FORMAT) for _ in ks]
        assert await b.batch_get(ks, dst) == [True] * 3
        assert [d.tobytes() for d in dst] == [s.tobytes() for s in src]


async def test_stored_copy_is_independent_of_the_source() -> None:
    async with MemoryBackend() as b:
        (k,) = keys(1)
        src = random_page()
        want = src.tobytes()
        await b.batch_set([k], [src])
        src.write(bytes(512))
        dst = PageBuffer.allocate(512, FORMAT)
        await b.batch_get([k], [dst])
        assert dst.tobytes() == want


async def test_a_page_read_into_another_format_is_refused_and_kept() -> None:
    async with MemoryBackend() as b:
        ks = keys(2)
        await b.batch_set(ks, [random_page(512, "fmt:a"), random_page(512, "fmt:a")])
        targets = [PageBuffer.allocate(512, "fmt:a"), random_page(512, "fmt:b")]
        before = [t.tobytes() for t in targets]
        with pytest.raises(InvalidInputError, match="fmt:b"):
            await b.batch_get(ks, targets)
        assert [t.tobytes() for t in targets] == before  # no target of the batch written
        assert await b.batch_exists(ks) == 2
        assert (await b.stats()).corrupt_pages == 0


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".x"])
async def test_unsafe_keys_are_rejected(bad: str) -> None:
    async with MemoryBackend() as b:
        with pytest.raises(InvalidInputError):
            await b.batch_set([bad], [random_page()])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError):
            await b.batch_exists([bad])  # type: ignore[list-item]


async def test_from_url_options() -> None:
    b = await MemoryBackend.from_url("memory://?capacity_bytes=1000&capacity_pages=3")
    assert (b.capacity_bytes, b.capacity_pages) == (1000, 3)
    await b.aclose()
    b = await MemoryBackend.from_url("memory://", capacity_bytes=5)
    assert b.capacity_bytes == 5
    await b.aclose()
    for url, opts in [
        ("memory://?capacity_bytes=abc", {}),
        ("memory://?capacity_bytes=0", {}),
        ("memory://?colour=red", {}),
        ("memory://host", {}),
        ("memory://", {"capacity_pages": -1}),
    ]:
        with pytest.raises(ConfigError):
            await MemoryBackend.from_url(url, **opts)
