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
