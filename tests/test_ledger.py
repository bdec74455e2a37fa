"""`Ledger`: owners, leases, spoiled bytes, fences and the release signal, page by page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache import PageAllocator
from tiercache.errors import DoubleFreeError, InvalidInputError, StateError
from tiercache.ledger import Lease, Ledger, Owner, live_fences

PS = 4


class Fence:
    """A stand-in for a CUDA event: ``query()`` says whether it has finished."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.finished = False

    def query(self) -> bool:
        return self.finished

    def __repr__(self) -> str:
        return f"Fence({self.name})"


def make() -> tuple[Ledger, list[None]]:
    ledger = Ledger(PageAllocator(16 * PS, PS), PageAllocator(32 * PS, PS))
    woken: list[None] = []
    ledger.on_release(lambda: woken.append(None))
    return ledger, woken


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_owners_are_counted_and_every_release_wakes_the_listeners() -> None:
    ledger, woken = make()
    dev = ledger.device
    got = dev.alloc(3 * PS)
    assert got is not None
    slots, ids = got
    assert torch.equal(slots, torch.arange(3 * PS))
    assert dev.tokens_owned(Owner.CALLER) == 3 * PS and not woken
    dev.give(ids[:2], Owner.INDEX)  # the index may evict them: a release
    assert dev.tokens_owned(Owner.INDEX) == 2 * PS and len(woken) == 1
    dev.free(ids)
    assert dev.tokens_owned(Owner.INDEX) == dev.tokens_owned(Owner.CALLER) == 0
    assert len(woken) == 2 and dev.available == 16 * PS
    ledger.check_invariants()


def test_a_leased_page_is_not_freed_and_a_refused_free_changes_nothing() -> None:
    ledger, woken = make()
    host = ledger.host
    got = host.alloc(2 * PS)
    assert got is not None
    ids = got[1]
    host.lease(ids[:1], Lease.READ)
    with pytest.raises(StateError, match="still uses"):
        host.free(ids)
    with pytest.raises(DoubleFreeError):
        host.free(pages(int(ids[1]), int(ids[1])))
    assert host.allocated(ids) and not woken
    host.end_lease(ids[:1], Lease.READ)
    assert len(woken) == 1
    host.free(ids)
    with pytest.raises(DoubleFreeError):
        host.free(ids)
    ledger.check_invariants()


def test_give_refuses_pages_that_are_not_allocated() -> None:
    ledger, _ = make()
    with pytest.raises(InvalidInputError):
        ledger.device.give(pages(3), Owner.INDEX)


def test_a_request_holds_only_the_pages_it_still_owns() -> None:
    ledger, _ = make()
    dev = ledger.device
    a, b = object(), object()
    sa = dev.grant(a, 2 * PS)
    assert sa is not None
    pa = dev.pages(sa)
    dev.give(pa[:1], Owner.INDEX)  # committed: the index's now
    assert dev.request_pages(a).tolist() == pa[1:].tolist()
    # The committed page comes back free and goes to another request: not a's.
    dev.free(pa[:1])
    sb = dev.grant(b, 16 * PS - PS)
    assert sb is not None and int(pa[0]) in dev.pages(sb).tolist()
    assert dev.request_pages(a).tolist() == pa[1:].tolist()
    ledger.check_invariants()
    assert dev.free_request(a) == PS
    assert dev.request_pages(a).size == 0 and dev.request_pages(b).size == 15
    assert dev.free_request(b) == 15 * PS and dev.available == 16 * PS
    ledger.check_invariants()


def test_spoiled_bytes_last_until_refilled_or_freed() -> None:
    ledger, _ = make()
    host = ledger.host
    got = host.alloc(2 * PS)
    assert got is not None
    ids = got[1]
    host.spoil(ids[1:])
    assert host.spoiled(ids) and not host.spoiled(ids[:1])
    host.filled(ids)
    assert not host.spoiled(ids)
    host.spoil(ids)
    host.free(ids)
    again = host.alloc(2 * PS)
    assert again is not None and not host.spoiled(again[1])


def test_reader_fences_stay_with_their_pages_until_a_fill_takes_them() -> None:
    ledger, _ = make()
    dev = ledger.device
    got = dev.alloc(4 * PS)
    assert got is not None
    ids = got[1]
    f1, f2, loose = Fence("attention-1"), Fence("attention-2"), Fence("engine")
    dev.free(ids[:2], fence=f1)
    dev.free(ids[2:], fence=f2)
    dev.add_fence(None, loose)  # pages freed by the engine: every fill waits
    assert dev.take_fences(ids[:1]) == [f1, loose]
    # Taken once: the same page's next fill has nothing left to wait for;
    # the other pages keep theirs.
    assert dev.take_fences(ids[:1]) == []
    assert dev.take_fences(ids[1:]) == [f1, f2]


def test_fences_do_not_pile_up_finished_ones_are_dropped() -> None:
    ledger, _ = make()
    dev = ledger.device
    fences = []
    for i in range(100):
        got = dev.alloc(16 * PS)
        assert got is not None
        f = Fence(str(i))
        fences.append(f)
        dev.free(got[1], fence=f)
        f.finished = i % 10 != 9  # one in ten still queued when the next comes
        assert dev.fence_count() <= 16 * 11
    # Only the fences still queued are kept, one slot per page however many frees came.
    assert dev.fence_count() == 16 * sum(1 for f in fences if not f.finished)
    for f in fences:
        f.finished = True
    dev.add_fence(pages(0), Fence("last"))
    assert dev.fence_count() == 1 + 15 * 10  # page 0 dropped its finished ones


def test_producer_fences_travel_until_a_copy_out_lands() -> None:
    ledger, _ = make()
    dev = ledger.device
    got = dev.alloc(2 * PS)
    assert got is not None
    ids = got[1]
    forward = Fence("forward")
    dev.set_producer(ids, forward)
    assert dev.producers(ids) == [forward]
    dev.copied_out(ids[:1])
    assert dev.producers(ids[:1]) == [] and dev.producers(ids) == [forward]
    dev.free(ids)
    assert dev.producers(ids) == []


def test_live_fences_dedupes_and_drops_none_and_finished() -> None:
    a, b = Fence("a"), Fence("b")
    b.finished = True
    assert live_fences([None, a, a, b, (a, Fence("c"))])[:1] == [a]
    assert len(live_fences([None, a, a, b, (a, Fence("c"))])) == 2


def test_check_invariants_catches_a_count_that_is_off() -> None:
    ledger, _ = make()
    got = ledger.device.alloc(PS)
    assert got is not None
    ledger.device.lease(got[1], Lease.FILL)
    ledger.device.end_lease(got[1], Lease.FILL)
    ledger.device.end_lease(got[1], Lease.FILL)
    with pytest.raises(AssertionError, match="negative"):
        ledger.check_invariants()
