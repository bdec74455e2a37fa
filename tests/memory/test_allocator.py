import numpy as np
import pytest
import torch

from tiercache import PageAllocator
from tiercache.errors import DoubleFreeError, InvalidInputError


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_alloc_returns_page_aligned_runs(page_size: int) -> None:
    a = PageAllocator(8 * page_size, page_size)
    x = a.alloc(3 * page_size)
    assert x is not None and x.dtype == torch.int64 and x.numel() == 3 * page_size
    pages = x.view(-1, page_size)
    assert bool((pages[:, 0] % page_size == 0).all())
    assert torch.equal(pages, pages[:, :1] + torch.arange(page_size))
    assert a.available == 5 * page_size


def test_alloc_none_when_full_and_nothing_taken() -> None:
    a = PageAllocator(64, 16)
    assert a.alloc(48) is not None
    assert a.alloc(32) is None
    assert a.available == 16


def test_free_returns_slots_and_reuses_them_sorted() -> None:
    a = PageAllocator(64, 16)
    x, y = a.alloc(16), a.alloc(48)
    assert x is not None and y is not None
    a.free(y)
    a.free(x)
    assert a.available == 64
    z = a.alloc(64)
    assert z is not None and torch.equal(z, torch.arange(64))


def test_double_free_and_foreign_indices_rejected_without_state_change() -> None:
    a = PageAllocator(64, 16)
    x = a.alloc(32)
    assert x is not None
    a.free(x)
    with pytest.raises(DoubleFreeError):
        a.free(x)
    y = a.alloc(16)
    assert y is not None
    with pytest.raises(DoubleFreeError):
        a.free(torch.cat([y, y]))
    assert a.available == 48
    with pytest.raises(InvalidInputError):
        a.free(torch.arange(64, 80))  # out of range
    with pytest.raises(InvalidInputError):
        a.free(torch.arange(1, 17))  # not page-aligned
    with pytest.raises(InvalidInputError):
        a.free(torch.arange(0, 8))  # partial page
    with pytest.raises(InvalidInputError):
        a.free(y.to(torch.int32))
    with pytest.raises(InvalidInputError):
        a.free([0, 1])  # type: ignore[arg-type]
    a.free(y)
    assert a.available == 64


@pytest.mark.parametrize("bad", [-16, 7, 1.5, True, "16"])
def test_alloc_rejects_bad_sizes(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        PageAllocator(64, 16).alloc(bad)  # type: ignore[arg-type]


def test_constructor_validation() -> None:
    with pytest.raises(InvalidInputError):
        PageAllocator(65, 16)
    with pytest.raises(InvalidInputError):
        PageAllocator(64, 0)
    assert PageAllocator(0, 16).alloc(16) is None


def test_sizes_are_ints_numpy_integers_included_bools_and_floats_refused() -> None:
    import numpy as np

    from tiercache import HostKVPool, KVLayout

    a = PageAllocator(np.int64(64), np.int32(16))  # type: ignore[arg-type]
    assert (type(a.num_slots), type(a.page_size)) == (int, int)
    x = a.alloc(np.int64(32))  # type: ignore[arg-type]
    assert x is not None and x.numel() == 32
    for bad in ((64, True), (64.0, 16), (64, 0), (-16, 16)):
        with pytest.raises(InvalidInputError):
            PageAllocator(*bad)  # type: ignore[arg-type]
    for n in (True, 16.0, -16, "16"):
        with pytest.raises(InvalidInputError):
            a.alloc(n)  # type: ignore[arg-type]
    layout = KVLayout(np.int64(1), 1, 8, torch.float32, 4)  # type: ignore[arg-type]
    assert type(layout.num_layers) is int
    with pytest.raises(InvalidInputError, match="mla must be a bool"):
        KVLayout(1, 1, 8, torch.float32, 4, mla=1)  # type: ignore[arg-type]
    pool = HostKVPool(layout, size_bytes=np.int64(layout.page_bytes * 2), pin_memory=False)  # type: ignore[arg-type]
    assert pool.num_slots == 8
    for bad_size in (True, 0, 1.5):
        with pytest.raises(InvalidInputError, match="size_bytes must be a positive int"):
            HostKVPool(layout, size_bytes=bad_size, pin_memory=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("pages", [2, 64, 65, 500])
@pytest.mark.parametrize("released_first", [False, True])
def test_a_page_listed_twice_is_refused_at_any_size_and_nothing_changes(
    pages: int, released_first: bool
) -> None:
    """Few pages and many take different checks; both refuse a repeat and keep the state."""
    ps = 4
    a = PageAllocator(1024 * ps, ps)
    other = a.alloc(100 * ps)
    assert other is not None
    if released_first:  # pages sitting in the release list, not yet merged back
        a.free(other[: 10 * ps])
    x = a.alloc(pages * ps)
    assert x is not None
    before = a.available
    for where in (0, pages // 2, pages - 1):
        dup = torch.cat([x, x[where * ps : (where + 1) * ps]])
        with pytest.raises(DoubleFreeError, match="twice"):
            a.free(dup)
        assert a.available == before
        assert a.is_allocated(x)
    a.free(x)  # the real free still works, exactly once
    assert a.available == before + pages * ps
    with pytest.raises(DoubleFreeError):
        a.free(x)


@pytest.mark.parametrize("n", [1, 2, 64, 65, 300])
def test_has_repeats_finds_a_page_named_twice_at_any_size(n: int) -> None:
    a = PageAllocator(512 * 16, 16)
    pages = np.random.default_rng(n).permutation(512)[:n].astype(np.int64)
    assert not a.has_repeats(pages)
    if n > 1:
        assert a.has_repeats(np.concatenate([pages, pages[n // 2 : n // 2 + 1]]))
