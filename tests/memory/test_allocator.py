import numpy as np
import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, PageAllocator, TierController
from tiercache.errors import DoubleFreeError, InvalidInputError
from tiercache.memory.allocator import check_slot_indices, check_slot_pages, one_page


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


@pytest.mark.parametrize(
    "make_slots",
    [lambda: torch.arange(16).to_sparse(), lambda: torch.arange(16, device="meta")],
    ids=["sparse", "meta"],
)
async def test_slots_without_readable_values_are_invalid_input_at_every_verb(
    make_slots: object,
) -> None:
    """A sparse or meta tensor of int64 slots is an `InvalidInputError`, not
    torch's own TypeError or NotImplementedError, and takes or frees nothing."""
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    async with TierController(DeviceKVPool(lay, 64), HostKVPool(lay, 64)) as c:
        held = c.device_allocator.alloc(16)
        assert held is not None
        bad = make_slots()  # type: ignore[operator]
        verbs = {
            "submit_write": lambda: c.submit_write(bad),
            "submit_load": lambda: c.submit_load(bad),
            "free_device": lambda: c.free_device(bad),
            "free_host": lambda: c.free_host(bad),
            "ack_busy": lambda: c.ack_busy("device", bad),
            "allocator.free": lambda: c.device_allocator.free(bad),
            "check_slot_indices": lambda: check_slot_indices(bad, 16, 64),
        }
        for name, call in verbs.items():
            with pytest.raises(InvalidInputError, match="dense tensor"):
                call()
            assert (c.device_allocator.available, c.host_allocator.available) == (48, 64), name
        for coro in (c.backup, c.load_back):
            with pytest.raises(InvalidInputError, match="dense tensor"):
                await coro(bad)
        assert c.device_allocator.is_allocated(held)


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


def _reference_verdict(slots: list[int], page_size: int, num_slots: int) -> str:
    """What a plain reading of the contract says of ``slots``: ok, range or aligned."""
    if min(slots) < 0 or max(slots) >= num_slots:
        return "range"
    for start in range(0, len(slots), page_size):
        first = slots[start]
        if first % page_size or slots[start : start + page_size] != list(
            range(first, first + page_size)
        ):
            return "aligned"
    return "ok"


def _verdict(slots: list[int], page_size: int, num_slots: int) -> str:
    try:
        check_slot_indices(torch.tensor(slots, dtype=torch.int64), page_size, num_slots)
    except InvalidInputError as e:
        return "range" if "out of range" in str(e) else "aligned"
    return "ok"


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("num_pages", [4, 70, 1500])
def test_slot_checks_agree_with_the_contract_for_every_kind_of_defect(
    page_size: int, num_pages: int
) -> None:
    """Few slots are checked as ints, many vectorised: both give the contract's verdict.

    Each case takes valid slots of scattered pages and plants one defect: a
    slot moved inside its page, a page shifted off its boundary, two slots
    swapped, a page past the end or below zero, a slot past the end in the
    middle of a page. The verdict, and the error's kind, must match a plain
    reading of the contract, wherever in the list the defect sits.
    """
    rng = np.random.default_rng(page_size * 10_000 + num_pages)
    pool_pages = 4 * num_pages
    num_slots = pool_pages * page_size
    for case in range(60):
        pages = rng.permutation(pool_pages)[:num_pages]
        slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).tolist()
        where = int(rng.integers(len(slots)))
        page_at = where - where % page_size
        kind = case % 6
        if kind == 0:
            slots[where] += int(rng.choice([-1, 1, page_size, -page_size]))
        elif kind == 1:
            shift = int(rng.integers(1, page_size)) if page_size > 1 else 0
            slots[page_at : page_at + page_size] = [
                s + shift for s in slots[page_at : page_at + page_size]
            ]
        elif kind == 2 and page_size > 1:
            j = page_at + (where - page_at + 1) % page_size
            slots[where], slots[j] = slots[j], slots[where]
        elif kind == 3:
            slots[page_at : page_at + page_size] = range(num_slots, num_slots + page_size)
        elif kind == 4:
            slots[page_at : page_at + page_size] = range(-page_size, 0)
        elif kind == 5:
            slots[where] = num_slots + where
        assert _verdict(slots, page_size, num_slots) == _reference_verdict(
            slots, page_size, num_slots
        ), (case, kind, where)


@pytest.mark.parametrize("page_size", [1, 16])
def test_many_scattered_pages_come_back_as_runs_after_a_merge(page_size: int) -> None:
    """Large allocations (past the tile of steps) and merges of freed pages stay exact."""
    num_pages = 10_000
    a = PageAllocator(num_pages * page_size, page_size)
    everything = a.alloc(num_pages * page_size)
    assert everything is not None
    odd = everything.view(num_pages, page_size)[1::2].reshape(-1)
    a.free(odd)
    got = a.alloc(len(odd))  # merges the released pages back, sorted
    assert got is not None
    assert torch.equal(got, odd)
    assert a.alloc(page_size) is None
    check_slot_indices(got, page_size, num_pages * page_size)


def test_pages_to_slots_keeps_any_order_of_pages() -> None:
    """Page ids in any order (not the free list's) map to their slots in that order."""
    a = PageAllocator(1024 * 4, 4)
    rng = np.random.default_rng(7)
    for n in (3, 65, 200):
        start = int(rng.integers(0, 1024 - n))
        pages = torch.from_numpy(start + rng.permutation(n))  # spans n ids, not sorted
        slots = a.pages_to_slots(pages)
        assert torch.equal(slots.view(-1, 4), pages[:, None] * 4 + torch.arange(4))


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_slot_checks_find_a_defect_on_either_side_of_a_chunk_boundary(page_size: int) -> None:
    """Long slot lists are checked in chunks of whole pages: a defect right at a
    chunk's edge, or in the last partial chunk, is found like any other."""
    from tiercache.memory import allocator

    chunk = allocator._RUN_CHUNK - allocator._RUN_CHUNK % page_size
    num_pages = (2 * chunk) // page_size + 7  # two whole chunks and a partial one
    num_slots = 2 * num_pages * page_size
    pages = np.random.default_rng(page_size).permutation(2 * num_pages)[:num_pages]
    good = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    check_slot_indices(torch.from_numpy(good.copy()), page_size, num_slots)
    for where in (chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, good.size - 1):
        for delta in (1, -1):
            bad = good.copy()
            bad[where] += delta
            verdict = _reference_verdict(bad.tolist(), page_size, num_slots)
            assert verdict != "ok" or page_size == 1
            assert _verdict(bad.tolist(), page_size, num_slots) == verdict, (where, delta)


def test_one_page_comes_back_from_the_pages_freed_last() -> None:
    """A one-page allocation takes the page freed last (its bytes are likely in
    cache); longer ones still come off the free list in order, as runs."""
    a = PageAllocator(16 * 16, 16)
    x = a.alloc(4 * 16)
    assert x is not None
    a.free(x[16:32])  # page 1
    a.free(x[48:64])  # page 3
    one = a.alloc(16)
    assert one is not None and torch.equal(one, torch.arange(48, 64))
    run = a.alloc(2 * 16)  # off the free list: pages 4 and 5
    assert run is not None and torch.equal(run, torch.arange(64, 96))
    again = a.alloc(16)
    assert again is not None and torch.equal(again, torch.arange(16, 32))
    assert a.available == 16 * 16 - 6 * 16


@pytest.mark.parametrize("seed", range(5))
def test_no_page_is_handed_out_twice_whatever_the_order_of_allocs_and_frees(seed: int) -> None:
    """A model of the pool against the allocator: one-page and longer
    allocations (`alloc_one` among them), frees of one or many pages
    (`free_one` among them), merges of the free list."""
    rng = np.random.default_rng(seed)
    ps, pages = 4, 64
    a = PageAllocator(pages * ps, ps)
    held: list[torch.Tensor] = []
    owned: set[int] = set()
    for _ in range(2000):
        if held and rng.random() < 0.45:
            k = int(rng.integers(1, min(len(held), 12) + 1))
            batch = [held.pop(int(rng.integers(len(held)))) for _ in range(k)]
            slots = torch.cat(batch)
            if k == 1 and rng.random() < 0.5:
                a.free_one(int(slots[0]) // ps)
            else:
                a.free(slots)
            for p in (slots[::ps] // ps).tolist():
                owned.remove(p)
        else:
            need = 1 if rng.random() < 0.6 else int(rng.integers(2, 9))
            if need == 1 and rng.random() < 0.5:
                page = a.alloc_one()
                got = None if page is None else a.page_slots(page)
            else:
                got = a.alloc(need * ps)
            if got is None:
                assert a.available < need * ps
                continue
            new = (got[::ps] // ps).tolist()
            assert not owned & set(new) and len(set(new)) == len(new)
            owned |= set(new)
            held.extend(got.view(-1, ps))
        assert a.available == (pages - len(owned)) * ps
        assert all(a.is_allocated(torch.arange(p * ps, (p + 1) * ps)) for p in owned)


def test_the_one_page_verbs_refuse_a_double_free_and_a_full_pool() -> None:
    a = PageAllocator(2 * 4, 4)
    first, second = a.alloc_one(), a.alloc_one()
    assert (first, second) == (0, 1) and a.alloc_one() is None and a.available == 0
    assert torch.equal(a.page_slots(1), torch.arange(4, 8))
    a.free_one(1)
    with pytest.raises(DoubleFreeError):
        a.free_one(1)
    assert a.available == 4 and a.holds(0) and not a.holds(1)
    assert a.alloc_one() == 1  # the page freed last
    a.free_one(0)
    a.free_one(1)
    assert a.alloc(8) is not None  # both free again, as one run after the merge


def _one_page_cases(ps: int, num_slots: int) -> list[object]:
    """Inputs of every kind: one good page, each defect of one page, more or
    fewer slots, other types, dtypes, devices, layouts and shapes."""
    good = torch.arange(ps, 2 * ps)
    cases: list[object] = [
        good,
        torch.arange(0, ps),
        torch.arange(num_slots - ps, num_slots),
        torch.arange(num_slots, num_slots + ps),  # past the end
        torch.arange(-ps, 0),  # below zero
        torch.arange(2 * ps, 4 * ps),  # two pages
        good[:-1] if ps > 1 else torch.zeros(0, dtype=torch.int64),  # short
        torch.arange(ps + 1, 2 * ps + 1),  # off its boundary
        good.flip(0),
        good.to(torch.int32),
        good.float(),
        good.view(1, -1),
        good.tolist(),
        good.numpy(),
        torch.arange(0, 2 * ps)[::2],  # a strided view
        torch.empty(ps, dtype=torch.int64, device="meta"),
        good.to_sparse(),
        good.as_subclass(_Slots),
    ]
    if ps > 1:
        swapped = good.clone()
        swapped[[0, 1]] = swapped[[1, 0]]
        bumped = good.clone()
        bumped[-1] += 1
        cases += [swapped, bumped]
    return cases


class _Slots(torch.Tensor):
    """A tensor subclass (its methods may do anything): the full check only."""


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_one_page_takes_exactly_the_single_pages_the_full_check_takes(ps: int) -> None:
    """`one_page` is the one-page verbs' test: it never accepts what
    `check_slot_pages` refuses, and when it accepts, the page id is the one the
    full check finds; a plain CPU tensor of one page is always taken."""
    num_slots = 8 * ps
    for i, x in enumerate(_one_page_cases(ps, num_slots)):
        got = one_page(x, ps, num_slots)
        try:
            pages = check_slot_pages(x, ps, num_slots)[1].tolist()
        except InvalidInputError:
            pages = None
        if got is not None:
            assert pages == [got], i
        else:  # refused by both, or a subclass (CUDA tensors too: not on this machine)
            assert pages is None or len(pages) != 1 or type(x) is not torch.Tensor, i
