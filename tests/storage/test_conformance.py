"""The contract every `StorageBackend` keeps, run over each backend of `BACKEND_FACTORIES`."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tests.storage.storage_helpers import FORMAT, host_pool, keys, random_page, slots

from tiercache.errors import BackendUnavailableError, InvalidInputError
from tiercache.memory import PageBuffer
from tiercache.storage import BackendState, StorageBackend


async def test_exists_counts_from_the_first_key_up_to_the_first_hole(
    backend: StorageBackend,
) -> None:
    ks = keys(5)
    assert await backend.batch_exists(ks) == 0
    assert await backend.batch_exists([]) == 0
    assert await backend.batch_set(ks[:3], [random_page() for _ in range(3)]) == [True] * 3
    assert await backend.batch_set([ks[4]], [random_page()]) == [True]
    assert await backend.batch_exists(ks) == 3  # first hole at index 3
    assert await backend.batch_exists(ks[:3]) == 3  # all N
    assert await backend.batch_exists([ks[3], *ks[:3]]) == 0  # hole first


async def test_standalone_pages_round_trip(backend: StorageBackend) -> None:
    ks = keys(4)
    src = [random_page(512 + 64 * i) for i in range(4)]
    assert await backend.batch_set(ks, src) == [True] * 4
    dst = [PageBuffer.allocate(p.nbytes, FORMAT) for p in src]
    assert await backend.batch_get(ks, dst) == [True] * 4
    assert [d.tobytes() for d in dst] == [s.tobytes() for s in src]


async def test_multi_segment_page_round_trips(backend: StorageBackend) -> None:
    raw = random_page(300).tobytes()
    src = PageBuffer.from_segments(
        [memoryview(bytearray(raw[:100])), memoryview(bytearray(raw[100:]))], FORMAT
    )
    dst_back = [bytearray(50), bytearray(250)]
    dst = PageBuffer.from_segments([memoryview(b) for b in dst_back], FORMAT)
    (k,) = keys(1)
    assert await backend.batch_set([k], [src]) == [True]
    assert await backend.batch_get([k], [dst]) == [True]
    assert bytes(dst_back[0]) + bytes(dst_back[1]) == raw


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
async def test_host_pool_pages_round_trip(backend: StorageBackend, host_layout: str) -> None:
    src_pool = await asyncio.to_thread(host_pool, host_layout, 32, 1)
    dst_pool = await asyncio.to_thread(host_pool, host_layout, 32, 2)
    src = src_pool.page_buffers(slots(1, 2, 5))
    dst = dst_pool.page_buffers(slots(7, 0, 3))
    ks = keys(3)
    assert await backend.batch_set(ks, src) == [True] * 3
    assert await backend.batch_get(ks, dst) == [True] * 3
    for s, d in zip((1, 2, 5), (7, 0, 3), strict=True):
        for b in range(2):
            assert torch.equal(
                src_pool.tokens(b, s * 4, s * 4 + 4).view(torch.int16),
                dst_pool.tokens(b, d * 4, d * 4 + 4).view(torch.int16),
            )
    assert [p.tobytes() for p in dst] == [p.tobytes() for p in src]


async def test_missing_page_leaves_the_target_untouched(backend: StorageBackend) -> None:
    ks = keys(3)
    src = [random_page() for _ in range(3)]
    await backend.batch_set([ks[0], ks[2]], [src[0], src[2]])
    dst = [random_page() for _ in range(3)]
    before = dst[1].tobytes()
    assert await backend.batch_get(ks, dst) == [True, False, True]
    assert dst[1].tobytes() == before
    assert dst[0].tobytes() == src[0].tobytes() and dst[2].tobytes() == src[2].tobytes()


async def test_first_writer_wins(backend: StorageBackend) -> None:
    (k,) = keys(1)
    first, second = random_page(), random_page()
    assert await backend.batch_set([k], [first]) == [True]
    assert await backend.batch_set([k], [second]) == [True]
    dst = PageBuffer.allocate(512, FORMAT)
    assert await backend.batch_get([k], [dst]) == [True]
    assert dst.tobytes() == first.tobytes()


async def test_concurrent_writers_of_one_key_store_one_of_the_values(
    backend: StorageBackend,
) -> None:
    (k,) = keys(1)
    pages = [random_page() for _ in range(4)]
    results = await asyncio.gather(*(backend.batch_set([k], [p]) for p in pages))
    assert results == [[True]] * 4
    dst = PageBuffer.allocate(512, FORMAT)
    assert await backend.batch_get([k], [dst]) == [True]
    assert dst.tobytes() in {p.tobytes() for p in pages}


async def test_delete_and_clear(backend: StorageBackend) -> None:
    ks = keys(4)
    await backend.batch_set(ks, [random_page() for _ in ks])
    assert await backend.delete([ks[0], keys(1)[0]]) == 1
    assert await backend.batch_exists(ks) == 0
    assert await backend.batch_exists(ks[1:]) == 3
    # Evictions are what the backend dropped for room, never what it was told to delete.
    assert (await backend.stats()).evictions == 0
    await backend.clear()
    assert await backend.batch_exists(ks[1:]) == 0
    dst = random_page()
    before = dst.tobytes()
    assert await backend.batch_get(ks[1:2], [dst]) == [False]
    assert dst.tobytes() == before


@pytest.mark.parametrize(
    ("nbytes", "fmt"), [(512, "fmt:b"), (256, "fmt:a"), (1024, "fmt:a")], ids=str
)
async def test_a_target_of_another_format_or_size_is_refused_and_the_page_kept(
    backend: StorageBackend, nbytes: int, fmt: str
) -> None:
    """A target that does not fit the stored page (another dtype, layout or
    size) is the caller's mistake, not damage to the store: the read is an
    `InvalidInputError`, the page is not copied into it, and the page stays
    stored, whole, for a reader with the right buffer."""
    ks = keys(2)
    src = [random_page(512, "fmt:a"), random_page(512, "fmt:a")]
    assert await backend.batch_set(ks, src) == [True, True]
    wrong = random_page(nbytes, fmt)
    before = wrong.tobytes()
    for batch, targets in (
        ([ks[0]], [wrong]),
        (ks, [PageBuffer.allocate(512, "fmt:a"), wrong]),  # one wrong target refuses the batch
    ):
        with pytest.raises(InvalidInputError, match="fmt:a"):
            await backend.batch_get(batch, targets)
        assert wrong.tobytes() == before
    assert await backend.batch_exists(ks) == 2
    right = [PageBuffer.allocate(512, "fmt:a") for _ in ks]
    assert await backend.batch_get(ks, right) == [True, True]
    assert [r.tobytes() for r in right] == [s.tobytes() for s in src]
    assert (await backend.stats()).corrupt_pages == 0


@pytest.mark.parametrize("flaw", ["read-only", "size-not-its-segments"])
async def test_a_target_that_cannot_take_a_page_is_refused_before_any_io(
    backend: StorageBackend, flaw: str
) -> None:
    """A target that no page could be read into is refused whether or not
    its key is stored, and nothing stored is touched."""
    ks = keys(2)
    src = random_page()
    assert await backend.batch_set(ks[:1], [src]) == [True]
    if flaw == "read-only":
        bad = PageBuffer.from_segments([memoryview(bytes(512))], FORMAT)
    else:
        bad = PageBuffer((memoryview(bytearray(512)),), 256, FORMAT)
    for k in ks:
        with pytest.raises(InvalidInputError, match="target"):
            await backend.batch_get([k], [bad])
    dst = PageBuffer.allocate(512, FORMAT)
    assert await backend.batch_get(ks[:1], [dst]) == [True]
    assert dst.tobytes() == src.tobytes()


async def test_mismatched_batch_is_rejected(backend: StorageBackend) -> None:
    ks = keys(2)
    with pytest.raises(InvalidInputError):
        await backend.batch_set(ks, [random_page()])
    with pytest.raises(InvalidInputError):
        await backend.batch_get(ks, [random_page()])


async def test_keys_may_be_any_iterable_of_keys(backend: StorageBackend) -> None:
    """Every backend reads ``keys`` once: an iterator gets the answer its list gets."""
    ks = keys(3)
    src = [random_page() for _ in range(3)]
    assert await backend.batch_set(iter(ks), src) == [True] * 3
    assert await backend.batch_exists(iter(ks)) == 3
    dst = [random_page() for _ in range(3)]
    assert await backend.batch_get(iter(ks), dst) == [True] * 3
    assert [d.tobytes() for d in dst] == [s.tobytes() for s in src]
    assert await backend.delete(iter(ks[:2])) == 2
    assert await backend.batch_exists(tuple(ks[2:])) == 1


async def test_closed_backend_raises_and_aclose_is_idempotent(backend: StorageBackend) -> None:
    (k,) = keys(1)
    await backend.aclose()
    await backend.aclose()
    assert backend.state is BackendState.CLOSED
    with pytest.raises(BackendUnavailableError):
        await backend.batch_exists([k])
    with pytest.raises(BackendUnavailableError):
        await backend.batch_get([k], [random_page()])
    with pytest.raises(BackendUnavailableError):
        await backend.batch_set([k], [random_page()])
    with pytest.raises(BackendUnavailableError):
        await backend.delete([k])
    with pytest.raises(BackendUnavailableError):
        await backend.clear()
    with pytest.raises(BackendUnavailableError):
        async with backend:
            pass


async def test_async_with_closes(backend: StorageBackend) -> None:
    (k,) = keys(1)
    async with backend as b:
        assert b is backend
        assert await b.batch_set([k], [random_page()]) == [True]
    assert backend.state is BackendState.CLOSED
    with pytest.raises(BackendUnavailableError):
        await backend.batch_exists([k])


async def test_stats_count_operations(backend: StorageBackend) -> None:
    ks = keys(3)
    await backend.batch_set(ks[:2], [random_page(), random_page()])
    await backend.batch_set(ks[:1], [random_page()])  # exists: not written again
    await backend.batch_exists(ks)
    await backend.batch_get(ks, [PageBuffer.allocate(512, FORMAT) for _ in ks])
    s = await backend.stats()
    assert s.exists_calls == 1
    assert s.set_pages == 3
    assert s.set_written == 2
    assert s.bytes_written == 1024  # page bytes, whatever the backend adds to store them
    assert s.get_pages == 3
    assert s.get_hits == 2
    assert s.bytes_read == 1024
    assert s.corrupt_pages == 0
    s.get_hits = 99  # a snapshot, not the live counters
    assert (await backend.stats()).get_hits == 2
