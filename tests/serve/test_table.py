"""`PageTable`: the arena's index, LRU and lease table, without a server."""

from __future__ import annotations

import pytest

from tiercache.errors import InvalidInputError
from tiercache.serve.table import Outcome, PageTable


def _write(t: PageTable, holder: int, key: str, nbytes: int = 100, fmt: str = "f") -> None:
    h = t.reserve(holder, key, nbytes, fmt)
    assert h.outcome is Outcome.NEW
    t.commit(holder, [h.ident])


def test_lru_evicts_the_least_recently_used_unleased_page() -> None:
    t = PageTable(blocks=3, block_bytes=100)
    w = t.add_holder()
    for k in "abc":
        _write(t, w, k)
    r = t.add_holder()
    lease = t.lease(r, "a", 100, "f")  # a is used: b is now the oldest
    t.release(r, [lease.ident])
    _write(t, w, "d")
    assert t.exists(["a"]) == 1 and t.exists(["b"]) == 0 and t.exists(["c", "d"]) == 2
    assert t.stats().evictions == 1


def test_exists_is_not_a_use() -> None:
    t = PageTable(blocks=2, block_bytes=100)
    w = t.add_holder()
    _write(t, w, "a")
    _write(t, w, "b")
    assert t.exists(["a"]) == 1
    _write(t, w, "c")
    assert t.exists(["a"]) == 0 and t.exists(["b", "c"]) == 2


def test_every_page_leased_refuses_a_write_until_a_release() -> None:
    t = PageTable(blocks=2, block_bytes=100)
    w, r = t.add_holder(), t.add_holder()
    _write(t, w, "a")
    _write(t, w, "b")
    leases = [t.lease(r, k, 100, "f").ident for k in "ab"]
    assert t.reserve(w, "c", 100, "f").outcome is Outcome.FULL
    assert t.stats().pages == 2 and t.stats().free_blocks == 0
    t.release(r, leases[:1])
    assert t.reserve(w, "c", 100, "f").outcome is Outcome.NEW
    assert t.exists(["a"]) == 0 and t.exists(["b"]) == 1


def test_pages_of_different_sizes_share_the_arena() -> None:
    t = PageTable(blocks=10, block_bytes=100)
    w = t.add_holder()
    big = t.reserve(w, "big", 650, "model-a")
    small = t.reserve(w, "small", 30, "model-b")
    assert len(big.blocks) == 7 and len(small.blocks) == 1
    t.commit(w, [big.ident, small.ident])
    assert t.lease(w, "big", 650, "model-a").outcome is Outcome.HIT
    mismatch = t.lease(w, "small", 30, "model-a")
    assert mismatch.outcome is Outcome.MISMATCH and mismatch.format == "model-b"
    with pytest.raises(InvalidInputError, match="larger than the arena"):
        t.reserve(w, "huge", 1001, "f")


def test_first_writer_wins_and_a_key_being_written_is_busy() -> None:
    t = PageTable(blocks=4, block_bytes=100)
    a, b = t.add_holder(), t.add_holder()
    h = t.reserve(a, "k", 100, "f")
    assert t.reserve(b, "k", 100, "f").outcome is Outcome.BUSY
    assert t.lease(b, "k", 100, "f").outcome is Outcome.MISS  # invisible until committed
    t.commit(a, [h.ident])
    assert t.reserve(b, "k", 100, "f").outcome is Outcome.HAVE


def test_dropping_a_holder_gives_everything_back() -> None:
    t = PageTable(blocks=4, block_bytes=100)
    w, r = t.add_holder(), t.add_holder()
    _write(t, w, "a")
    t.lease(r, "a", 100, "f")
    t.lease(r, "a", 100, "f")
    t.reserve(r, "half", 200, "f")
    assert t.stats().free_blocks == 1
    assert t.drop_holder(r) == (1, 2)
    s = t.stats()
    assert (s.free_blocks, s.leases, s.writing, s.pages) == (3, 0, 0, 1)
    assert t.exists(["half"]) == 0
    assert t.reserve(w, "half", 200, "f").outcome is Outcome.NEW  # the key is free again


def test_ids_another_holder_holds_are_refused_and_nothing_changes() -> None:
    t = PageTable(blocks=4, block_bytes=100)
    a, b = t.add_holder(), t.add_holder()
    ra = t.reserve(a, "x", 100, "f")
    rb = t.reserve(b, "y", 100, "f")
    with pytest.raises(InvalidInputError, match="not held"):
        t.commit(a, [ra.ident, rb.ident])
    with pytest.raises(InvalidInputError, match="twice"):
        t.commit(a, [ra.ident, ra.ident])
    assert t.stats().writing == 2 and t.exists(["x"]) == 0
    _write(t, a, "z")
    lz = t.lease(a, "z", 100, "f")
    with pytest.raises(InvalidInputError, match="not held"):
        t.release(b, [lz.ident])
    assert t.stats().leases == 1
    t.commit(a, [ra.ident])
    assert t.exists(["x"]) == 1


def test_delete_and_clear_spare_leased_pages() -> None:
    t = PageTable(blocks=4, block_bytes=100)
    w = t.add_holder()
    for k in "abc":
        _write(t, w, k)
    t.lease(w, "a", 100, "f")
    assert t.delete(["a", "b", "nope"]) == 1
    assert t.clear() == 1
    assert t.exists(["a"]) == 1 and t.stats().pages == 1


def test_restore_adopts_pages_in_lru_order_or_nothing() -> None:
    from tiercache.errors import StateError

    t = PageTable(blocks=4, block_bytes=100)
    with pytest.raises(InvalidInputError, match="taken"):
        t.restore([("a", (0,), 100, "f"), ("b", (0,), 100, "f")])
    with pytest.raises(InvalidInputError, match="block count"):
        t.restore([("a", (0, 1), 100, "f")])
    with pytest.raises(InvalidInputError, match="out of range"):
        t.restore([("a", (4,), 100, "f")])
    assert t.stats().pages == 0 and t.stats().free_blocks == 4  # nothing adopted
    t.restore([("old", (2,), 100, "f"), ("new", (0,), 50, "f")])
    assert t.stats().pages == 2 and t.stats().free_blocks == 2
    w = t.add_holder()
    _write(t, w, "c")
    _write(t, w, "d")
    _write(t, w, "e")  # evicts the oldest restored page
    assert t.exists(["old"]) == 0 and t.exists(["new"]) == 1
    assert [p[0] for p in t.ready_pages()] == ["new", "c", "d", "e"]
    with pytest.raises(StateError):
        t.restore([])
