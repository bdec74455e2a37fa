"""The radix prefix index: matching, splitting, namespaces, locks, eviction, writes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tiercache.errors import InvalidInputError, StateError
from tiercache.index import page_hashes
from tiercache.index.radix import Node, RadixIndex, extra_key_prior


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def make(page_size: int = 2) -> tuple[RadixIndex, FakeClock]:
    clock = FakeClock()
    return RadixIndex(page_size, clock=clock), clock


def path_hashes(index: RadixIndex, node: Node) -> list[str]:
    return [h for n in index.path(node) for h in n.page_hashes]


def back_up(index: RadixIndex, node: Node, host_start: int) -> None:
    """Give ``node`` host slots through a completed write."""
    wid = index.begin_write(node, slots(host_start, node.num_tokens))
    index.finish_write(wid)


# -- insert and match -----------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_insert_then_match(ps: int) -> None:
    index, _ = make(ps)
    tokens = list(range(100, 100 + 4 * ps))
    dev = slots(1000, 4 * ps)
    r = index.insert(tokens, dev)
    assert r.prefix_len == 0 and r.reattached_len == 0 and r.node is not None
    m = index.match_prefix(tokens)
    assert torch.equal(m.device_indices, dev)
    assert m.last_device_node is r.node and m.last_node is r.node
    assert m.host_hit_length == 0 and m.matched_length == 4 * ps
    assert m.prior_hash == page_hashes(tokens, ps)[-1]
    # a longer prompt matches the cached part; a diverging one up to its last common page
    longer = index.match_prefix([*tokens, 7, 7])
    assert torch.equal(longer.device_indices, dev)
    diverge = [*tokens[: 2 * ps], *[9] * (2 * ps)]
    m2 = index.match_prefix(diverge)
    assert torch.equal(m2.device_indices, dev[: 2 * ps])
    assert m2.last_node.num_tokens == 2 * ps  # the node was split at the match
    assert index.match_prefix([5] * ps).device_length == 0
    index.check_invariants()


def test_partial_trailing_page_never_matches() -> None:
    index, _ = make(4)
    index.insert(list(range(8)), slots(0, 8))
    assert index.match_prefix(list(range(7))).device_length == 4
    assert index.match_prefix(list(range(3))).device_length == 0
    assert index.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).device_length == 4
    assert index.match_prefix([0, 1, 2, 99, 4, 5, 6, 7]).device_length == 0
    index.check_invariants()


def test_insert_rejects_bad_input() -> None:
    index, _ = make(4)
    with pytest.raises(InvalidInputError, match="whole number of pages"):
        index.insert(list(range(6)), slots(0, 6))
    with pytest.raises(InvalidInputError, match="slots for"):
        index.insert(list(range(8)), slots(0, 4))
    with pytest.raises(InvalidInputError, match="int64"):
        index.insert(list(range(4)), torch.arange(4, dtype=torch.int32))
    with pytest.raises(InvalidInputError):
        index.insert([0, 1, 2, -1], slots(0, 4))
    with pytest.raises(InvalidInputError, match="ints"):
        index.insert([0, 1, 2, 3.0], slots(0, 4))  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="extra_key"):
        index.insert(list(range(4)), slots(0, 4), extra_key=3)  # type: ignore[arg-type]
    assert len(index) == 0 and index.total_device_tokens() == 0
    with pytest.raises(InvalidInputError, match="page_size"):
        RadixIndex(0)


def test_tokens_as_tensor_or_array() -> None:
    index, _ = make(2)
    index.insert(torch.tensor([1, 2, 3, 4]), slots(0, 4))
    assert index.match_prefix(np.array([1, 2, 3, 4])).device_length == 4
    assert index.match_prefix((1, 2, 3, 4)).device_length == 4
    assert index.match_prefix(torch.tensor([1, 2, 9, 9])).device_length == 2


def test_insert_reports_duplicates() -> None:
    index, _ = make(2)
    index.insert([1, 2, 3, 4], slots(0, 4))
    r = index.insert([1, 2, 3, 4, 5, 6], slots(10, 6))
    assert r.prefix_len == 4 and r.node is not None and r.node.key == (5, 6)
    assert torch.equal(r.node.device_indices, slots(14, 2))  # type: ignore[arg-type]
    again = index.insert([1, 2, 3, 4, 5, 6], slots(20, 6))
    assert again.prefix_len == 6 and again.node is None and again.last_node is r.node
    # ending inside a node splits it; nothing new
    inner = index.insert([1, 2], slots(30, 2))
    assert inner.prefix_len == 2 and inner.node is None and inner.last_node.key == (1, 2)
    # the original slots survive
    assert torch.equal(
        index.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, torch.tensor([0, 1, 2, 3, 14, 15])
    )
    assert index.total_device_tokens() == 6
    index.check_invariants()


def test_hash_chain_continues_across_nodes() -> None:
    ps = 4
    index, _ = make(ps)
    tokens = list(range(40))
    for end in (8, 20, 40):
        index.insert(tokens[:end], slots(0, end))
    # split points the inserts did not make
    index.match_prefix(tokens[:12])
    index.match_prefix(tokens[:28])
    last = index.match_prefix(tokens).last_node
    assert len(index.path(last)) == 5
    assert path_hashes(index, last) == page_hashes(tokens, ps)
    for n in index.path(last):
        assert index.prefix_tokens(n)[-n.num_tokens :] == n.key
    index.check_invariants()


# -- split -----------------------------------------------------------------------


def test_split_keeps_slots_and_hashes_consistent() -> None:
    ps = 2
    index, _ = make(ps)
    tokens = list(range(10, 22))  # 6 pages
    node = index.insert(tokens, slots(100, 12)).node
    assert node is not None
    back_up(index, node, 500)
    node.hit_count = 3
    node.backuped_storage = True
    index.lock(node)
    index.pin_host(node)
    upper = index.split(node, 4)
    assert upper.key == tuple(tokens[:4]) and node.key == tuple(tokens[4:])
    assert upper.parent is index.root and node.parent is upper and upper.id != node.id
    assert torch.equal(upper.device_indices, slots(100, 4))  # type: ignore[arg-type]
    assert torch.equal(node.device_indices, slots(104, 8))  # type: ignore[arg-type]
    assert torch.equal(upper.host_indices, slots(500, 4))  # type: ignore[arg-type]
    assert torch.equal(node.host_indices, slots(504, 8))  # type: ignore[arg-type]
    full = page_hashes(tokens, ps)
    assert upper.page_hashes == full[:2] and node.page_hashes == full[2:]
    for field in ("lock_ref", "host_pin", "hit_count", "last_access", "backuped_storage"):
        assert getattr(upper, field) == getattr(node, field), field
    index.check_invariants()
    # a lock and a pin taken before the split are released through both halves
    index.unlock(node)
    index.unpin_host(node)
    assert upper.lock_ref == node.lock_ref == 0 and upper.host_pin == node.host_pin == 0
    index.check_invariants()


def test_split_rejects_bad_points() -> None:
    index, _ = make(2)
    node = index.insert([1, 2, 3, 4], slots(0, 4)).node
    assert node is not None
    for at in (0, 1, 4, 6, -2):
        with pytest.raises(InvalidInputError):
            index.split(node, at)
    with pytest.raises(StateError):
        index.split(index.root, 2)
    assert len(index) == 1


def test_split_during_write_marks_both_halves() -> None:
    index, _ = make(2)
    node = index.insert([1, 2, 3, 4, 5, 6], slots(0, 6)).node
    assert node is not None
    wid = index.begin_write(node, slots(100, 6))
    assert node.write_in_flight and node.on_host and node.lock_ref == 1
    # an insert that diverges inside the node splits it twice
    index.insert([1, 2, 9, 9], slots(10, 4))
    index.insert([1, 2, 3, 4, 8, 8], slots(20, 6))
    covering = index.pending_writes()[wid]
    assert [n.key for n in covering] == [(1, 2), (3, 4), (5, 6)]
    assert covering[-1] is node
    assert all(n.write_in_flight and n.lock_ref >= 1 for n in covering)
    index.check_invariants()
    done = index.finish_write(wid)
    assert done == covering
    assert all(not n.write_in_flight and n.on_host for n in done)
    assert torch.equal(torch.cat([n.host_indices for n in done]), slots(100, 6))  # type: ignore[misc]
    assert all(n.lock_ref == 0 for n in done)
    index.check_invariants()
    with pytest.raises(StateError, match="no write"):
        index.finish_write(wid)


def test_failed_write_clears_host_slots_of_both_halves() -> None:
    index, _ = make(2)
    node = index.insert([1, 2, 3, 4], slots(0, 4)).node
    assert node is not None
    wid = index.begin_write(node, slots(100, 4))
    upper = index.split(node, 2)
    assert index.total_host_tokens() == 4
    index.finish_write(wid, ok=False)
    assert not upper.on_host and not node.on_host and node.lock_ref == upper.lock_ref == 0
    assert index.total_host_tokens() == 0
    index.check_invariants()


def test_begin_write_rejects_wrong_states() -> None:
    index, _ = make(2)
    node = index.insert([1, 2], slots(0, 2)).node
    assert node is not None
    with pytest.raises(InvalidInputError):
        index.begin_write(node, slots(0, 4))
    with pytest.raises(StateError):
        index.begin_write(index.root, slots(0, 0))
    index.begin_write(node, slots(0, 2))
    with pytest.raises(StateError, match="already on the host"):
        index.begin_write(node, slots(2, 2))
    # a node being written is locked: it is never offered for eviction
    assert index.evict_device_candidates(100) == []
    with pytest.raises(StateError, match="locked"):
        index.remove(node)


# -- namespaces ------------------------------------------------------------------


def test_extra_keys_never_share_nodes() -> None:
    ps = 2
    index, _ = make(ps)
    tokens = [1, 2, 3, 4]
    a = index.insert(tokens, slots(0, 4), extra_key="lora-a").node
    assert a is not None
    assert index.match_prefix(tokens).device_length == 0
    assert index.match_prefix(tokens, extra_key="lora-b").device_length == 0
    assert torch.equal(index.match_prefix(tokens, extra_key="lora-a").device_indices, slots(0, 4))
    plain = index.insert(tokens, slots(10, 4)).node
    assert plain is not None and plain is not a and plain.parent is index.root
    assert index.insert(tokens, slots(20, 4), extra_key="").prefix_len == 0
    # the chain of a namespace starts from its prior: different storage keys
    assert plain.page_hashes == page_hashes(tokens, ps)
    assert a.page_hashes == page_hashes(tokens, ps, extra_key_prior("lora-a"))
    assert a.page_hashes != plain.page_hashes
    assert extra_key_prior(None) is None and extra_key_prior("") != extra_key_prior("x")
    assert index.match_prefix([], extra_key="lora-a").prior_hash == extra_key_prior("lora-a")
    assert len(index.roots()) == 3
    index.check_invariants()
    # an emptied namespace is dropped; a match under it still works
    index.remove(a)
    assert len(index.roots()) == 2
    assert index.match_prefix(tokens, extra_key="lora-a").device_length == 0
    index.check_invariants()


def test_pure_query_namespace_is_not_registered() -> None:
    index, _ = make(2)
    m = index.match_prefix([1, 2], extra_key="salt")
    assert m.last_node.is_root and m.last_node.extra_key == "salt"
    assert len(index.roots()) == 1
    # host pages prefetched under that root land in its namespace
    r = index.insert_host([1, 2], slots(0, 2), parent=m.last_node)
    assert r.node is not None and r.node.extra_key == "salt"
    assert r.node.page_hashes == page_hashes([1, 2], 2, extra_key_prior("salt"))
    assert index.match_prefix([1, 2], extra_key="salt").host_hit_length == 2
    index.check_invariants()


# -- locks and pins --------------------------------------------------------------


def test_lock_protects_ancestors() -> None:
    index, _ = make(2)
    index.insert([1, 2], slots(0, 2))
    index.insert([1, 2, 3, 4], slots(0, 4))
    leaf = index.insert([1, 2, 3, 4, 5, 6], slots(0, 6)).node
    assert leaf is not None
    path = index.path(leaf)
    assert len(path) == 3
    index.lock(leaf)
    assert [n.lock_ref for n in path] == [1, 1, 1]
    assert index.evict_device_candidates(100) == []
    assert index.evictable_device_leaves() == []
    with pytest.raises(StateError, match="locked"):
        index.mark_device_evicted(leaf)
    index.lock(index.root)  # a root needs no lock
    index.unlock(leaf)
    assert [n.lock_ref for n in path] == [0, 0, 0]
    with pytest.raises(StateError, match="not locked"):
        index.unlock(leaf)
    # an unlock that would go below zero anywhere changes nothing
    index.lock(path[0])
    with pytest.raises(StateError):
        index.unlock(leaf)
    assert [n.lock_ref for n in path] == [1, 0, 0]
    # with the top locked, the two lower nodes are evictable, leaf first
    assert index.evict_device_candidates(100) == [leaf, path[1]]
    index.check_invariants()


def test_pins_protect_host_nodes() -> None:
    index, _ = make(2)
    leaf = index.insert([1, 2, 3, 4], slots(0, 4)).node
    assert leaf is not None
    back_up(index, leaf, 0)
    index.mark_device_evicted(leaf)
    index.pin_host(leaf)
    assert index.evict_host_candidates(100) == []
    with pytest.raises(StateError, match="pinned"):
        index.remove(leaf)
    index.unpin_host(leaf)
    with pytest.raises(StateError, match="not pinned"):
        index.unpin_host(leaf)
    assert index.evict_host_candidates(100) == [leaf]


def test_pinned_node_without_host_copy_is_not_offered_for_device_eviction() -> None:
    index, _ = make(2)
    node = index.insert([1, 2], slots(0, 2)).node
    assert node is not None
    wid = index.begin_write(node, slots(0, 2))
    index.pin_host(node)
    index.finish_write(wid, ok=False)  # the pin outlives the failed copy
    assert index.evict_device_candidates(10) == []
    index.unpin_host(node)
    assert index.evict_device_candidates(10) == [node]


# -- eviction --------------------------------------------------------------------


def test_device_eviction_is_lru_leaves_first() -> None:
    index, _ = make(1)
    index.insert([1, 2], slots(0, 2))  # a: (1, 2)
    b = index.insert([1, 2, 3], slots(0, 3)).node  # a's child
    c = index.insert([1, 2, 4, 5], slots(10, 4)).node  # a's child
    d = index.insert([7], slots(20, 1)).node
    assert b is not None and c is not None and d is not None
    a = b.parent
    assert a is not None and a.key == (1, 2)
    # access order: d oldest, then c, then b (a is touched with both)
    index.match_prefix([1, 2, 4, 5])
    index.match_prefix([1, 2, 3])
    assert index.evict_device_candidates(1) == [d]
    assert index.evict_device_candidates(2) == [d, c]
    assert index.evict_device_candidates(4) == [d, c, b]
    # a becomes a leaf only once b and c are taken
    assert index.evict_device_candidates(100) == [d, c, b, a]
    assert index.evict_device_candidates(0) == []
    # Skipped nodes are not offered, nor is a parent of one (it cannot become a leaf).
    assert index.evict_device_candidates(1, skip={d.id}) == [c]
    assert index.evict_device_candidates(100, skip={c.id}) == [d, b]
    assert index.evict_device_candidates(100, skip={d.id, b.id, c.id}) == []
    assert set(index.evictable_device_leaves()) == {b, c, d}
    index.lock(c)
    assert index.evict_device_candidates(100) == [d, b]
    with pytest.raises(InvalidInputError):
        index.evict_device_candidates(-1)
    # the candidate list does not change the tree
    assert index.total_device_tokens() == 6
    index.check_invariants()


def test_mark_device_evicted_and_host_hits() -> None:
    index, _ = make(2)
    top = index.insert([1, 2], slots(0, 2)).node
    leaf = index.insert([1, 2, 3, 4, 5, 6], slots(0, 6)).node
    assert top is not None and leaf is not None
    with pytest.raises(StateError, match="not on the host"):
        index.mark_device_evicted(leaf)
    back_up(index, leaf, 50)
    back_up(index, top, 60)
    with pytest.raises(StateError, match="device-resident child"):
        index.mark_device_evicted(top)
    assert torch.equal(index.mark_device_evicted(leaf), slots(2, 4))
    with pytest.raises(StateError, match="not on the device"):
        index.mark_device_evicted(leaf)
    assert leaf.evicted and leaf.on_host
    m = index.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert torch.equal(m.device_indices, slots(0, 2))
    assert m.last_device_node is top and m.last_host_node is leaf and m.last_node is leaf
    assert m.host_hit_length == 4 and m.matched_length == 6
    index.mark_device_evicted(top)
    m = index.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_length == 0 and m.host_hit_length == 6 and m.last_device_node is index.root
    assert index.total_device_tokens() == 0 and index.total_host_tokens() == 6
    index.check_invariants()


def test_attach_device_loads_the_host_path() -> None:
    index, _ = make(2)
    index.insert([1, 2], slots(0, 2))
    mid = index.insert([1, 2, 3, 4], slots(0, 4)).node
    leaf = index.insert([1, 2, 3, 4, 5, 6], slots(0, 6)).node
    assert mid is not None and leaf is not None
    back_up(index, leaf, 10)
    back_up(index, mid, 20)
    index.mark_device_evicted(leaf)
    index.mark_device_evicted(mid)
    assert index.load_path(leaf) == [mid, leaf]
    with pytest.raises(InvalidInputError):
        index.attach_device(leaf, slots(30, 2))
    assert index.attach_device(leaf, slots(30, 4)) == [mid, leaf]
    assert torch.equal(
        index.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, torch.tensor([0, 1, 30, 31, 32, 33])
    )
    assert index.load_path(leaf) == []
    index.check_invariants()


def test_insert_reattaches_evicted_nodes() -> None:
    index, _ = make(2)
    top = index.insert([1, 2], slots(0, 2)).node
    leaf = index.insert([1, 2, 3, 4, 5, 6], slots(0, 6)).node
    assert top is not None and leaf is not None
    back_up(index, leaf, 10)
    index.mark_device_evicted(leaf)
    # recomputed KV: the device prefix is a duplicate, the evicted part takes the new slots
    r = index.insert([1, 2, 3, 4, 5, 6, 7, 8], slots(40, 8))
    assert r.prefix_len == 2 and r.reattached_len == 4
    assert r.node is not None and r.node.key == (7, 8)
    assert torch.equal(leaf.device_indices, slots(42, 4))  # type: ignore[arg-type]
    assert torch.equal(leaf.host_indices, slots(10, 4))  # type: ignore[arg-type]
    assert index.total_device_tokens() == 8
    index.check_invariants()


def test_host_eviction_lru_and_remove() -> None:
    index, _ = make(1)
    a = index.insert([1], slots(0, 1)).node
    b = index.insert([1, 2], slots(0, 2)).node
    c = index.insert([3], slots(5, 1)).node
    assert a is not None and b is not None and c is not None
    for i, n in enumerate((a, b, c)):
        back_up(index, n, 10 * i)
    # device-resident nodes are never host candidates
    assert index.evict_host_candidates(10) == []
    for n in (b, a, c):
        index.mark_device_evicted(n)
    index.match_prefix([3])
    assert index.evict_host_candidates(1) == [b]
    assert index.evict_host_candidates(10) == [b, a, c]
    with pytest.raises(StateError, match="has children"):
        index.remove(a)
    for n in index.evict_host_candidates(10):
        index.remove(n)
    assert len(index) == 0 and index.total_host_tokens() == 0
    assert b.parent is None and b.host_indices is not None  # detached, still readable
    with pytest.raises(StateError, match="not in the index"):
        index.remove(b)
    with pytest.raises(StateError, match="not in the index"):
        index.lock(b)
    with pytest.raises(StateError):
        index.remove(index.root)
    index.check_invariants()


def test_insert_host_under_a_match() -> None:
    ps = 2
    index, _ = make(ps)
    tokens = list(range(1, 11))  # 5 pages
    index.insert(tokens[:4], slots(0, 4))
    m = index.match_prefix(tokens)
    assert m.device_length == 4
    rest = tokens[4:]
    hashes = page_hashes(rest, ps, m.prior_hash)
    assert hashes == page_hashes(tokens, ps)[2:]
    r = index.insert_host(rest, slots(100, 6), parent=m.last_node, page_hashes=hashes)
    assert r.prefix_len == 0 and r.node is not None
    assert r.node.evicted and torch.equal(r.node.host_indices, slots(100, 6))  # type: ignore[arg-type]
    m2 = index.match_prefix(tokens)
    assert m2.device_length == 4 and m2.host_hit_length == 6 and m2.last_host_node is r.node
    # a second prefetch of the same pages is all duplicates
    dup = index.insert_host(rest[:4], slots(200, 4), parent=m.last_node)
    assert dup.prefix_len == 4 and dup.node is None
    # partly duplicate: only the rest is new, with a computed chain
    more = [*rest, 11, 12]
    part = index.insert_host(more, slots(300, 8), parent=m.last_node)
    assert part.prefix_len == 6 and part.node is not None and part.node.key == (11, 12)
    assert path_hashes(index, part.node) == page_hashes([*tokens, 11, 12], ps)
    with pytest.raises(InvalidInputError, match="page_hashes"):
        index.insert_host([50, 51], slots(0, 2), page_hashes=["ab", "cd"])
    index.check_invariants()
    # a parent that went away is refused
    index.remove(part.node)
    with pytest.raises(StateError):
        index.insert_host([13, 14], slots(0, 2), parent=part.node)


def test_touch_false_leaves_lru_alone() -> None:
    index, _ = make(2)
    node = index.insert([1, 2], slots(0, 2)).node
    assert node is not None
    before = (node.last_access, node.hit_count)
    index.match_prefix([1, 2], touch=False)
    assert (node.last_access, node.hit_count) == before
    index.match_prefix([1, 2])
    assert node.last_access > before[0] and node.hit_count == before[1] + 1


def test_reset_detaches_everything() -> None:
    index, _ = make(2)
    node = index.insert([1, 2], slots(0, 2)).node
    assert node is not None
    old_root = index.root
    wid = index.begin_write(node, slots(0, 2))
    index.reset()
    assert len(index) == 0 and index.total_device_tokens() == index.total_host_tokens() == 0
    assert index.match_prefix([1, 2]).device_length == 0
    with pytest.raises(StateError):
        index.lock(node)
    with pytest.raises(StateError):
        index.insert_host([1, 2], slots(0, 2), parent=old_root)
    with pytest.raises(StateError):
        index.finish_write(wid)
    index.check_invariants()


def test_node_ids_are_unique_and_repr_is_short() -> None:
    index, _ = make(1)
    for t in itertools.permutations([1, 2, 3]):
        index.insert(list(t), slots(0, 3))
    ids = [n.id for n in index.nodes()]
    assert len(ids) == len(set(ids)) == len(index)
    node = next(index.nodes())
    assert repr(node).startswith("Node(id=") and len(repr(node)) < 120
    assert "RadixIndex(page_size=1" in repr(index)


def test_check_invariants_catches_corruption() -> None:
    index, _ = make(2)
    node = index.insert([1, 2, 3, 4], slots(0, 4)).node
    assert node is not None
    node.page_hashes[1] = "00"
    with pytest.raises(AssertionError, match="hash"):
        index.check_invariants()
    node.page_hashes[1] = page_hashes([1, 2, 3, 4], 2)[1]
    node.device_indices = slots(0, 2)
    with pytest.raises(AssertionError, match="slots"):
        index.check_invariants()


# -- the invariant checker -------------------------------------------------------


def _evict_upper_only(upper: Node, lower: Node) -> None:
    upper.host_indices = slots(20, 4)
    upper.device_indices = None


def _break_lower_lock(upper: Node, lower: Node) -> None:
    upper.lock_ref = 0
    lower.lock_ref = 1


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda upper, lower: setattr(lower, "parent", None), "wrong parent"),
        (lambda upper, lower: setattr(lower, "lock_ref", -1), "negative count"),
        (lambda upper, lower: setattr(lower, "hit_count", -1), "negative hit count"),
        (lambda upper, lower: lower.page_hashes.__setitem__(0, "0" * 64), "break the chain"),
        (lambda upper, lower: setattr(lower, "device_indices", slots(0, 2)), "has 2 slots"),
        (
            lambda upper, lower: setattr(lower, "host_indices", [0, 1, 2, 3]),
            "not an int64 tensor",
        ),
        (lambda upper, lower: setattr(lower, "device_indices", None), "neither tier"),
        (_evict_upper_only, "its parent"),
        (lambda upper, lower: setattr(lower, "write_id", 123), "being written"),
        (_break_lower_lock, "fewer locks"),
        (lambda upper, lower: setattr(upper, "host_pin", -1), "negative count"),
        (lambda upper, lower: setattr(lower, "extra_key", "other"), "namespace"),
    ],
)
def test_check_invariants_names_each_broken_invariant(damage: object, message: str) -> None:
    index, _ = make(2)
    index.insert(list(range(8)), slots(0, 8))
    index.match_prefix(list(range(4)))  # split: upper [0..3], lower [4..7]
    upper = index.match_prefix(list(range(4))).last_node
    lower = next(iter(upper.children.values()))
    index.check_invariants()
    damage(upper, lower)  # type: ignore[operator]
    with pytest.raises(AssertionError, match=message):
        index.check_invariants()


def test_check_invariants_catches_a_wrong_token_count_and_a_lost_write() -> None:
    index, _ = make(2)
    r = index.insert(list(range(4)), slots(0, 4))
    assert r.node is not None
    r.node.host_indices = slots(10, 4)  # host slots that no write or count knows of
    with pytest.raises(AssertionError, match="host tokens"):
        index.check_invariants()
    r.node.host_indices = None
    index.begin_write(r.node, slots(10, 4))
    index.check_invariants()
    r.node.write_id = None  # the write is still recorded as in flight
    with pytest.raises(AssertionError, match="in-flight writes"):
        index.check_invariants()


def test_numpy_integers_are_ints_and_bools_are_not() -> None:
    index = RadixIndex(np.int64(2))
    assert type(index.page_size) is int
    r = index.insert([np.int64(t) for t in range(6)], slots(0, 6))
    assert r.node is not None and r.node.key == (0, 1, 2, 3, 4, 5)
    upper = index.split(r.node, np.int32(2))
    assert upper.key == (0, 1)
    assert len(index.evict_device_candidates(np.int64(2))) == 1
    for bad in (True, 2.0):
        with pytest.raises(InvalidInputError):
            RadixIndex(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            index.split(r.node, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            index.evict_device_candidates(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        index.insert([True, False], slots(6, 2))
    index.check_invariants()
