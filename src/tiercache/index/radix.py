"""The radix prefix index: which token prefixes are cached, and where their pages live.

`RadixIndex` is the bookkeeping core of the cache facade (the role of SGLang's
``HiRadixCache`` tree). It is a radix tree over page-aligned token sequences:
every edge (`Node`) holds a whole number of pages, and records, for those
pages, their device slots (L1), their host slots (L2), their hash chain (the
storage keys of L3), lock and pin counts, a hit count and the last access
time. It moves no bytes and owns no slots: the async facade allocates and
frees slots and drives the controller, and tells the index what happened.

Synchronous, loop-free and not thread-safe: call it from one thread (the
event loop's). No method awaits, so no bookkeeping update is ever interrupted
halfway; every method that raises does so before changing any state.

Invariants (checked by `RadixIndex.check_invariants`):

* A node's key is a non-empty whole number of pages; a parent's ``children``
  maps the first page of each child's key to the child.
* ``device_indices`` / ``host_indices`` are either ``None`` or a CPU ``int64``
  tensor with one slot per token of the key; a node is never on neither tier.
* **Device residency is a rooted subtree**: a device-resident node's parent is
  device-resident (or a root). So the device part of a match is always a
  prefix, eviction from the device takes device leaves only, and a node
  becomes device-resident again only together with its evicted ancestors
  (`RadixIndex.insert`, `RadixIndex.attach_device`).
* ``page_hashes`` is the hash chain of the node's pages, continuing from the
  parent's last page hash (`hash_page`); for the default namespace the chain
  starts from ``None`` (SGLang's chain, byte for byte), for an ``extra_key``
  namespace from `extra_key_prior` of the key, so that pages computed under
  different adapters or cache salts never share a storage key.
* ``lock_ref`` and ``host_pin`` count the locks / pins taken on the node or on
  any of its descendants (taking one walks up to the root), so a parent's count
  is at least the sum of its children's.

Namespaces: sequences under different ``extra_key`` values (a LoRA id, a cache
salt) live under different roots and never share a node. The default
namespace's root is `RadixIndex.root`; other roots are created on first insert
and dropped when they become empty.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tiercache._checks import check_count, check_extra_key, check_int, is_int, token_list
from tiercache.errors import InvalidInputError, StateError
from tiercache.index.hashing import page_hashes as _chain_hashes
from tiercache.memory.allocator import cat_slots, copy_slots

__all__ = [
    "InsertResult",
    "MatchResult",
    "Node",
    "RadixIndex",
    "extra_key_prior",
]

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


def extra_key_prior(extra_key: str | None) -> str | None:
    """The hash a namespace's chain starts from.

    ``None`` for the default namespace (so its chain equals SGLang's and
    `page_hashes` of the tokens); for a string, the sha256 hex digest of
    ``b"tiercache-extra-key\\0" + extra_key.encode()``. The same tokens under
    two extra keys therefore hash, and are stored, differently.
    """
    if extra_key is None:
        return None
    return hashlib.sha256(b"tiercache-extra-key\x00" + extra_key.encode()).hexdigest()


@dataclass(slots=True, eq=False, repr=False)
class Node:
    """One edge of the radix tree: a run of whole pages and where they live.

    Nodes are created and changed by `RadixIndex` only; read their fields,
    never assign them. Identity (``is``) is equality; ``id`` is unique within
    one index and survives splits (the lower half keeps it).

    Attributes:
        key: the node's token ids (a whole number of pages; ``()`` for a root).
        parent: the parent node (``None`` for a root, and once detached).
        children: the children, keyed by the first page of their key.
        device_indices: the device slots of the key's tokens (CPU ``int64``),
            or ``None`` when evicted from the device.
        host_indices: the host slots, or ``None`` when not on the host. Set as
            soon as a write is started (see ``write_id``).
        page_hashes: the hash of each page, chained from the parent's last one.
        lock_ref: device locks on this node or a descendant; a locked node is
            never evicted from either tier.
        host_pin: host pins on this node or a descendant; a pinned node is
            never evicted from the host.
        hit_count: how many `RadixIndex.match_prefix` calls reached the node.
        last_access: the index clock at the last match or insert through it.
        backuped_storage: its pages are in storage (set by the facade).
        write_id: the in-flight device->host write covering the node, or ``None``.
        extra_key: the namespace.
        id: unique within the index.
        owner: the index the node belongs to (a node of another index is
            refused by every call, as a removed one is).
    """

    key: tuple[int, ...]
    parent: Node | None
    id: int
    extra_key: str | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    device_indices: torch.Tensor | None = None
    host_indices: torch.Tensor | None = None
    page_hashes: list[str] = field(default_factory=list)
    lock_ref: int = 0
    host_pin: int = 0
    hit_count: int = 0
    last_access: float = 0.0
    backuped_storage: bool = False
    write_id: int | None = None
    owner: object = None

    @property
    def evicted(self) -> bool:
        """Not on the device (``device_indices is None``)."""
        return self.device_indices is None

    @property
    def on_host(self) -> bool:
        """Host slots are assigned (the copy may still be in flight: see `write_in_flight`)."""
        return self.host_indices is not None

    @property
    def write_in_flight(self) -> bool:
        """A device->host write of this node's pages has been started and not finished."""
        return self.write_id is not None

    @property
    def num_tokens(self) -> int:
        """Tokens in this node's key."""
        return len(self.key)

    @property
    def is_root(self) -> bool:
        """A namespace root (empty key)."""
        return not self.key

    def __repr__(self) -> str:
        where = "".join(
            (
                "D" if self.device_indices is not None else "-",
                "H" if self.host_indices is not None else "-",
                "S" if self.backuped_storage else "-",
            )
        )
        return (
            f"Node(id={self.id}, tokens={len(self.key)}, {where}, lock={self.lock_ref}, "
            f"pin={self.host_pin}, children={len(self.children)}"
            + (f", extra_key={self.extra_key!r}" if self.extra_key is not None else "")
            + (f", write={self.write_id}" if self.write_id is not None else "")
            + ")"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What `RadixIndex.match_prefix` found.

    Attributes:
        device_indices: the device slots of the device-resident prefix, in
            token order (CPU ``int64``; empty when nothing is on the device);
            a new tensor, the caller's to keep or overwrite.
        last_device_node: the deepest node of that prefix (a root when empty).
            Lock it to keep the prefix on the device.
        host_hit_length: tokens right after the device prefix that are on the
            host only (load them back with `RadixIndex.attach_device`).
        last_host_node: the deepest matched node on the host or the device.
        last_node: the deepest matched node at all; a storage prefetch of the
            rest of the prompt goes under it (`RadixIndex.insert_host`).
        prior_hash: ``last_node``'s last page hash: the prior of the rest's
            hash chain (the namespace's `extra_key_prior` when nothing matched).
    """

    device_indices: torch.Tensor
    last_device_node: Node
    host_hit_length: int
    last_host_node: Node
    last_node: Node
    prior_hash: str | None

    @property
    def device_length(self) -> int:
        """Tokens of the device-resident prefix."""
        return int(self.device_indices.numel())

    @property
    def matched_length(self) -> int:
        """Tokens on the device or the host (``device_length + host_hit_length``)."""
        return self.device_length + self.host_hit_length


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What `RadixIndex.insert` or `RadixIndex.insert_host` did.

    Attributes:
        prefix_len: leading tokens that were already cached: their slots in the
            call are duplicates, and the caller frees ``indices[:prefix_len]``.
        reattached_len: tokens (right after ``prefix_len``) of host-only nodes
            that took the call's device slots and are device-resident again
            (`RadixIndex.insert` only; always 0 for `RadixIndex.insert_host`).
        node: the new node holding the rest, or ``None`` when nothing was new.
        last_node: the node that ends the inserted sequence (a root when empty).
    """

    prefix_len: int
    reattached_len: int
    node: Node | None
    last_node: Node


@dataclass(slots=True)
class _Seen:
    """What `RadixIndex.check_invariants` counts while walking the tree."""

    nodes: int = 0
    device_tokens: int = 0
    host_tokens: int = 0
    writes: dict[int, list[Node]] = field(default_factory=dict)

    def add(self, n: Node) -> None:
        self.nodes += 1
        if n.device_indices is not None:
            self.device_tokens += len(n.key)
        if n.host_indices is not None:
            self.host_tokens += len(n.key)
        if n.write_id is not None:
            self.writes.setdefault(n.write_id, []).append(n)


def _check_slots(n: Node, name: str, t: torch.Tensor | None) -> None:
    """``t`` (``n.<name>``) is ``None`` or a 1-D CPU ``int64`` tensor, one slot per token."""
    if t is None:
        return
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64, (
        f"{n}.{name} is not an int64 tensor"
    )
    assert t.device.type == "cpu" and t.dim() == 1, f"{n}.{name} is not 1-D on the CPU"
    assert t.numel() == len(n.key), f"{n}.{name} has {t.numel()} slots"


def _check_counts_cover_children(p: Node) -> None:
    """A node's lock and pin counts include those of its children."""
    children = p.children.values()
    assert p.lock_ref >= sum(c.lock_ref for c in children), f"{p} has fewer locks than its children"
    assert p.host_pin >= sum(c.host_pin for c in children), f"{p} has fewer pins than its children"


class RadixIndex:
    """A radix tree over page-aligned token sequences, recording where each page lives.

    Complexity, with ``n`` the tokens of the call, ``d`` the depth of the path
    and ``N`` the nodes of the tree: `match_prefix`, `insert`, `insert_host`
    O(n + d) (plus hashing the new pages in `insert`); `lock`, `unlock`,
    `pin_host`, `unpin_host`, `attach_device` O(d); `split`,
    `mark_device_evicted`, `remove` O(1) (O(children) for the checks); the
    eviction candidate lists O(N + k log N) for k candidates (a heap over
    the current leaves; a parent is pushed when its last child is taken).

    Args:
        page_size: tokens per page (positive).
        clock: the time source for ``last_access`` (LRU order).

    Raises:
        InvalidInputError: ``page_size`` is not a positive int.
    """

    def __init__(self, page_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.page_size = check_int(page_size, "page_size", minimum=1)
        self.clock = clock
        self._ids = itertools.count()
        # Every node this index makes carries it: a node of another index
        # (another cache's match) is never taken for one of this index's.
        self._owner = object()
        self.reset()

    # -- lifecycle and views --------------------------------------------------

    def reset(self) -> None:
        """Forget every node (the caller frees their slots first).

        Nodes from before are detached: every later call given one raises
        `StateError`. In-flight writes are forgotten too.
        """
        old = getattr(self, "_roots", {})
        for root in old.values():
            stack = [root]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                n.children = {}
                n.parent = None
        self.root = Node((), None, next(self._ids), owner=self._owner)
        self._epoch = self.root.id  # every node with a smaller id is from before this reset
        self._roots: dict[str | None, Node] = {None: self.root}
        self._writes: dict[int, list[Node]] = {}
        self._device_tokens = 0
        self._host_tokens = 0
        self._num_nodes = 0

    def nodes(self) -> Iterator[Node]:
        """Every node except the roots, all namespaces, parents before children."""
        for root in list(self._roots.values()):
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                yield n
                stack.extend(n.children.values())

    def roots(self) -> list[Node]:
        """The current namespace roots (the default one first)."""
        return list(self._roots.values())

    def __len__(self) -> int:
        """Nodes in the tree, roots excluded."""
        return self._num_nodes

    def total_device_tokens(self) -> int:
        """Tokens whose KV is on the device (O(1))."""
        return self._device_tokens

    def total_host_tokens(self) -> int:
        """Tokens with host slots, in-flight writes included (O(1))."""
        return self._host_tokens

    def pending_writes(self) -> dict[int, list[Node]]:
        """A copy of the in-flight writes: write id -> the nodes covering it, top to bottom."""
        return {w: list(ns) for w, ns in self._writes.items()}

    def owns(self, node: Node) -> bool:
        """Whether ``node`` was made by this index (attached now or not)."""
        return isinstance(node, Node) and node.owner is self._owner

    def path(self, node: Node) -> list[Node]:
        """The nodes from below the root down to ``node``, in order (``[]`` for a root)."""
        self._check_attached(node)
        out: list[Node] = []
        n: Node | None = node
        while n is not None and n.key:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def prefix_tokens(self, node: Node) -> tuple[int, ...]:
        """Every token from the root down to the end of ``node``."""
        out: list[int] = []
        for n in self.path(node):
            out.extend(n.key)
        return tuple(out)

    # -- matching -------------------------------------------------------------

    def match_prefix(
        self,
        tokens: Sequence[int] | torch.Tensor,
        extra_key: str | None = None,
        *,
        touch: bool = True,
        checked: bool = False,
    ) -> MatchResult:
        """The longest cached prefix of ``tokens``, page by page.

        Only whole pages match: a trailing partial page never does. When the
        match ends inside a node, that node is split there (`split`), so the
        returned nodes end exactly at the match. The device part is the
        leading run of device-resident nodes (a prefix by the residency
        invariant); the host part the host-only nodes after it.

        Args:
            tokens: token ids (a sequence of ints, or a 1-D integer tensor).
            extra_key: the namespace (``None``: the default one).
            touch: update ``last_access`` and ``hit_count`` of the matched
                nodes; pass ``False`` for a pure query that must not change
                the LRU order.
            checked: ``tokens`` is a list or tuple of ids the caller already
                checked with `tiercache._checks.token_list` (a facade holding
                a long prompt): skip that pass.

        Returns:
            A `MatchResult`. O(len(tokens) + depth).

        Raises:
            InvalidInputError: ``tokens`` is not a sequence of ints, or
                ``extra_key`` is not a str or ``None``.
        """
        key = self._as_key(tokens, checked)
        root = self._namespace_root(extra_key)
        path = self._walk(root, key)
        now = self.clock() if touch else 0.0
        dev: list[torch.Tensor] = []
        last_device = root
        last_host = root
        host_len = 0
        on_device = on_host = True
        for n in path:
            if touch:
                n.last_access = now
                n.hit_count += 1
            if on_device and n.device_indices is not None:
                dev.append(n.device_indices)
                last_device = last_host = n
                continue
            on_device = False
            if on_host and n.host_indices is not None:
                host_len += len(n.key)
                last_host = n
            else:
                on_host = False
        last = path[-1] if path else root
        # A new tensor, never a node's own: a caller that writes into it (an
        # engine reusing its index buffer) must not move the index's KV.
        device_indices = copy_slots(dev[0]) if len(dev) == 1 else cat_slots(dev)
        return MatchResult(
            device_indices=device_indices,
            last_device_node=last_device,
            host_hit_length=host_len,
            last_host_node=last_host,
            last_node=last,
            prior_hash=self._prior_of(last),
        )

    # -- structure ------------------------------------------------------------

    def split(self, node: Node, at_tokens: int) -> Node:
        """Split ``node`` after its first ``at_tokens`` tokens; return the new upper half.

        The upper half is a new node (a new ``id``) that takes ``node``'s place
        under its parent; ``node`` keeps its identity and ``id`` and becomes
        the lower half, the only child of the upper one. Device slots, host
        slots and page hashes are cut at the same page. ``lock_ref``,
        ``host_pin``, ``hit_count``, ``last_access``, ``backuped_storage`` and
        ``write_id`` are copied to the upper half, which keeps every count
        consistent (a lock or pin taken through ``node`` also counted on the
        upper half, which is now its ancestor), and an in-flight write now
        covers both halves: `finish_write` marks both. O(1).

        Raises:
            InvalidInputError: ``at_tokens`` not a multiple of the page size
                strictly inside the key.
            StateError: ``node`` is a root or not in this index.
        """
        self._check_attached(node)
        if node.is_root:
            raise StateError("a root cannot be split")
        ps = self.page_size
        if not is_int(at_tokens) or at_tokens % ps or not 0 < at_tokens < len(node.key):
            raise InvalidInputError(
                f"split point must be a multiple of page_size={ps} inside (0, {len(node.key)}), "
                f"got {at_tokens!r}"
            )
        return self._split(node, int(at_tokens))

    def _split(self, node: Node, at: int) -> Node:
        parent = node.parent
        assert parent is not None
        pages = at // self.page_size
        upper = Node(
            node.key[:at],
            parent,
            next(self._ids),
            extra_key=node.extra_key,
            device_indices=None if node.device_indices is None else node.device_indices[:at],
            host_indices=None if node.host_indices is None else node.host_indices[:at],
            page_hashes=node.page_hashes[:pages],
            lock_ref=node.lock_ref,
            host_pin=node.host_pin,
            hit_count=node.hit_count,
            last_access=node.last_access,
            backuped_storage=node.backuped_storage,
            write_id=node.write_id,
            owner=self._owner,
        )
        node.key = node.key[at:]
        if node.device_indices is not None:
            node.device_indices = node.device_indices[at:]
        if node.host_indices is not None:
            node.host_indices = node.host_indices[at:]
        del node.page_hashes[:pages]
        node.parent = upper
        upper.children[node.key[: self.page_size]] = node
        parent.children[upper.key[: self.page_size]] = upper
        if node.write_id is not None:
            covering = self._writes[node.write_id]
            covering.insert(covering.index(node), upper)
        self._num_nodes += 1
        return upper

    # -- insertion ------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        extra_key: str | None = None,
        *,
        checked: bool = False,
        chain: Sequence[str] | None = None,
    ) -> InsertResult:
        """Record freshly computed KV of ``tokens`` held in ``device_indices``.

        The part already cached is not duplicated. Walking the tree along
        ``tokens``: device-resident nodes are duplicates (counted in
        ``prefix_len``: the caller frees ``device_indices[:prefix_len]``);
        host-only nodes (evicted from the device) **take** the call's slots
        for their tokens and are device-resident again (counted in
        ``reattached_len``; the caller keeps those slots in use: SGLang does
        the same when it recomputes an evicted prefix); the rest becomes one
        new device-only node, whose page hashes are computed here. Updates
        ``last_access`` of the path. O(len(tokens) + depth), plus hashing the
        new pages.

        Args:
            tokens: a whole number of pages of token ids.
            device_indices: CPU ``int64``, one slot per token (a tensor on
                another device is copied to the CPU).
            extra_key: the namespace.
            checked: ``tokens`` is a list or tuple of ids the caller already
                checked with `tiercache._checks.token_list` (a facade holding
                a long prompt): skip that pass.
            chain: the hash of every page of ``tokens``, chained from the
                namespace's root (``page_hashes(tokens, page_size,
                extra_key_prior(extra_key))``), hashed by the caller (off
                its event loop, for a long prompt); the new node takes its
                pages' from it. Trusted: only its length is checked here
                (`check_invariants` recomputes them). ``None``: hashed here.

        Raises:
            InvalidInputError: not whole pages, lengths differ, bad indices,
                token ids outside ``[0, 2**32)`` or a bad ``extra_key``.
        """
        key = self._as_key(tokens, checked)
        self._check_pages(len(key), "tokens")
        dev = self._as_indices(device_indices, len(key), "device_indices")
        root = self._namespace_root(extra_key)
        path = self._walk(root, key)
        pos = sum(len(n.key) for n in path)
        hashes = self._given_hashes(chain, len(key) // self.page_size)
        if hashes is not None:
            new_hashes = hashes[pos // self.page_size :]
        elif pos < len(key):
            last = path[-1] if path else root
            new_hashes = _chain_hashes(key[pos:], self.page_size, self._prior_of(last))
        else:
            new_hashes = []
        # Nothing can fail past this point.
        now = self.clock()
        dup = 0
        reattached = 0
        start = 0
        for n in path:
            n.last_access = now
            if n.device_indices is None:
                n.device_indices = dev[start : start + len(n.key)]
                self._device_tokens += len(n.key)
                reattached += len(n.key)
            else:
                assert reattached == 0, "a device-resident node below an evicted one"
                dup += len(n.key)
            start += len(n.key)
        parent = path[-1] if path else root
        if pos == len(key):
            return InsertResult(dup, reattached, None, parent)
        new = self._add_child(parent, key[pos:], new_hashes, now, device_indices=dev[pos:])
        return InsertResult(dup, reattached, new, new)

    def insert_host(
        self,
        tokens: Sequence[int] | torch.Tensor,
        host_indices: torch.Tensor,
        *,
        parent: Node | None = None,
        extra_key: str | None = None,
        page_hashes: Sequence[str] | None = None,
        checked: bool = False,
    ) -> InsertResult:
        """Record pages that arrived in host slots (a storage prefetch) under ``parent``.

        ``tokens`` continue the prefix that ends at ``parent`` (typically
        `MatchResult.last_node` of the match that started the prefetch).
        Existing nodes along the way are duplicates, whatever tier they are
        on: ``prefix_len`` counts them and the caller frees
        ``host_indices[:prefix_len]``. The rest becomes one new host-only node.

        Args:
            tokens: a whole number of pages of token ids.
            host_indices: CPU ``int64``, one host slot per token.
            parent: the node the tokens continue; ``None`` for the root of
                ``extra_key``'s namespace. A root from an earlier match is
                accepted even if its namespace was dropped meanwhile.
            extra_key: the namespace when ``parent`` is ``None``; ignored otherwise.
            page_hashes: the chain of ``tokens``' pages from ``parent``'s last
                hash (what the prefetch fetched by); computed when ``None``.
                They are trusted (only their count is checked here;
                `check_invariants` recomputes them).
            checked: ``tokens`` is a list or tuple of ids the caller already
                checked with `tiercache._checks.token_list` (a facade holding
                a long prompt): skip that pass.

        Raises:
            InvalidInputError: not whole pages, lengths differ, bad indices or
                a wrong number of hashes.
            StateError: ``parent`` is no longer in the index (evicted or reset).
        """
        key = self._as_key(tokens, checked)
        self._check_pages(len(key), "tokens")
        host = self._as_indices(host_indices, len(key), "host_indices")
        start = self._continued_node(parent, extra_key)
        hashes = self._given_hashes(page_hashes, len(key) // self.page_size)
        # Nothing can fail past this point.
        path = self._walk(start, key)
        pos = sum(len(n.key) for n in path)
        last = path[-1] if path else start
        if pos == len(key):
            return InsertResult(pos, 0, None, last)
        if hashes is None:
            new_hashes = _chain_hashes(key[pos:], self.page_size, self._prior_of(last))
        else:
            new_hashes = hashes[pos // self.page_size :]
        new = self._add_child(last, key[pos:], new_hashes, self.clock(), host_indices=host[pos:])
        return InsertResult(pos, 0, new, new)

    def _continued_node(self, parent: Node | None, extra_key: str | None) -> Node:
        """The node `insert_host` continues: ``parent``, or the root of ``extra_key``."""
        if parent is None:
            return self._namespace_root(extra_key)
        self._check_attached(parent)
        return self._namespace_root(parent.extra_key) if parent.is_root else parent

    def _given_hashes(self, page_hashes: Sequence[str] | None, num_pages: int) -> list[str] | None:
        """``page_hashes`` as a list, after checking there is one str per page."""
        if page_hashes is None:
            return None
        hashes = list(page_hashes)
        if len(hashes) != num_pages or not all(isinstance(h, str) for h in hashes):
            raise InvalidInputError(
                f"page_hashes must hold {num_pages} str hashes, got {len(hashes)}"
            )
        return hashes

    def _add_child(
        self,
        parent: Node,
        key: tuple[int, ...],
        page_hashes: list[str],
        now: float,
        *,
        device_indices: torch.Tensor | None = None,
        host_indices: torch.Tensor | None = None,
    ) -> Node:
        """Hang a new node holding ``key`` under ``parent``; count its tokens on its tiers."""
        if parent.is_root:
            self._roots.setdefault(parent.extra_key, parent)
        new = Node(
            key,
            parent,
            next(self._ids),
            extra_key=parent.extra_key,
            device_indices=device_indices,
            host_indices=host_indices,
            page_hashes=page_hashes,
            last_access=now,
            owner=self._owner,
        )
        parent.children[key[: self.page_size]] = new
        if device_indices is not None:
            self._device_tokens += len(key)
        if host_indices is not None:
            self._host_tokens += len(key)
        self._num_nodes += 1
        return new

    def attach_device(self, node: Node, device_indices: torch.Tensor) -> list[Node]:
        """Give device slots to the host-only nodes on the path to ``node`` (a load back).

        The nodes are those of `load_path`: from just below the deepest
        device-resident ancestor down to ``node``. ``device_indices`` covers
        them in order; the caller starts the host->device copy of their
        ``host_indices`` into those slots (and keeps the path locked until it
        lands). O(depth).

        Returns:
            The nodes that became device-resident, top to bottom.

        Raises:
            InvalidInputError: ``device_indices`` is not one slot per token of
                those nodes.
            StateError: ``node`` is not in the index.
        """
        nodes = self.load_path(node)
        total = sum(len(n.key) for n in nodes)
        dev = self._as_indices(device_indices, total, "device_indices")
        start = 0
        for n in nodes:
            n.device_indices = dev[start : start + len(n.key)]
            start += len(n.key)
        self._device_tokens += total
        return nodes

    def load_path(self, node: Node) -> list[Node]:
        """The host-only nodes to load for ``node`` to be device-resident, top to bottom.

        Raises:
            StateError: ``node`` is not in the index.
        """
        out: list[Node] = []
        for n in reversed(self.path(node)):
            if n.device_indices is not None:
                break
            assert n.host_indices is not None, f"{n} is on neither tier"
            out.append(n)
        out.reverse()
        return out

    # -- locks and pins -------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Take a device lock on ``node`` and every ancestor (O(depth)).

        A locked node is never offered for eviction from either tier. A root
        needs no lock: locking one does nothing.

        Raises:
            StateError: ``node`` is not in the index.
        """
        for n in self.path(node):
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        """Release a `lock` (O(depth)).

        Raises:
            StateError: ``node`` or an ancestor is not locked (nothing is
                changed), or ``node`` is not in the index.
        """
        path = self.path(node)
        for n in path:
            if n.lock_ref <= 0:
                raise StateError(f"unlock of {node}: {n} is not locked")
        for n in path:
            n.lock_ref -= 1

    def pin_host(self, node: Node) -> None:
        """Pin ``node`` and its ancestors on the host (O(depth)).

        A pinned node is never offered for host eviction (a prefetch in
        progress under it, a storage backup reading it).

        Raises:
            StateError: ``node`` is not in the index.
        """
        for n in self.path(node):
            n.host_pin += 1

    def unpin_host(self, node: Node) -> None:
        """Release a `pin_host` (O(depth)).

        Raises:
            StateError: ``node`` or an ancestor is not pinned (nothing is
                changed), or ``node`` is not in the index.
        """
        path = self.path(node)
        for n in path:
            if n.host_pin <= 0:
                raise StateError(f"unpin of {node}: {n} is not pinned")
        for n in path:
            n.host_pin -= 1

    # -- device -> host writes ------------------------------------------------

    def begin_write(self, node: Node, host_indices: torch.Tensor) -> int:
        """Record that ``node``'s pages are being written to ``host_indices``.

        Sets ``host_indices`` now (as SGLang does), locks ``node`` so its
        device slots stay put until the copy lands, and returns the write id
        (``node.id``): pass it as the controller's ``node_id`` and hand it to
        `finish_write` when the ack arrives. If ``node`` is split meanwhile,
        the write covers both halves.

        Raises:
            InvalidInputError: not one host slot per token.
            StateError: ``node`` is a root, not in the index, not on the
                device, already on the host, or already being written.
        """
        self._check_attached(node)
        if node.is_root:
            raise StateError("a root has no pages to write")
        if node.device_indices is None:
            raise StateError(f"{node} is not on the device")
        if node.host_indices is not None:
            raise StateError(f"{node} is already on the host")
        assert node.write_id is None
        host = self._as_indices(host_indices, len(node.key), "host_indices")
        wid = node.id
        assert wid not in self._writes
        node.host_indices = host
        node.write_id = wid
        self._host_tokens += len(node.key)
        self._writes[wid] = [node]
        self.lock(node)
        return wid

    def finish_write(self, write_id: int, ok: bool = True) -> list[Node]:
        """Complete the write `begin_write` started and release its lock.

        Args:
            write_id: what `begin_write` returned.
            ok: the copy succeeded. When ``False`` the nodes lose their
                ``host_indices`` again (the caller frees the ack's host slots).

        Returns:
            The nodes the write covered, top to bottom (more than one when it
            was split meanwhile).

        Raises:
            StateError: no such write is in flight (finished already, or reset).
        """
        nodes = self._writes.pop(write_id, None)
        if nodes is None:
            raise StateError(f"no write {write_id!r} is in flight")
        for n in nodes:
            assert n.write_id == write_id
            n.write_id = None
            if not ok:
                n.host_indices = None
                self._host_tokens -= len(n.key)
        self.unlock(nodes[-1])
        return nodes

    # -- eviction -------------------------------------------------------------

    def evictable_device_leaves(self) -> list[Node]:
        """The device leaves `evict_device_candidates` may offer, in no order (O(N))."""
        return [n for n in self.nodes() if self._device_leaf(n, ())]

    def evict_device_candidates(self, num_tokens: int, skip: Collection[int] = ()) -> list[Node]:
        """Nodes to evict from the device to free at least ``num_tokens`` slots, LRU first.

        Leaves first: a node is offered only after every device-resident
        child of it was offered; locked nodes (and nodes with a write in
        flight, which are locked) never are, nor are pinned nodes without a
        host copy (they could only be removed, and a pin keeps a node in the
        tree), nor the nodes whose ids are in ``skip`` (the caller found they
        must stay), nor therefore their ancestors. The tree is not changed: for
        each node, in order, the caller either frees its device slots and
        calls `mark_device_evicted` (it is on the host), or, when it is a
        leaf, frees them and calls `remove`, or writes it back first. Fewer
        tokens than asked are returned when no more is evictable. A heap over
        the leaves: O(N + k log N).
        """
        self._check_count(num_tokens)
        taken: set[int] = set()
        heap = [
            (n.last_access, n.id, n)
            for n in self.nodes()
            if n.id not in skip and self._device_leaf(n, taken)
        ]
        heapq.heapify(heap)
        out: list[Node] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            taken.add(n.id)
            freed += len(n.key)
            p = n.parent
            assert p is not None
            if not p.is_root and p.id not in skip and self._device_leaf(p, taken):
                heapq.heappush(heap, (p.last_access, p.id, p))
        return out

    def evict_host_candidates(self, num_tokens: int) -> list[Node]:
        """Host-only nodes to drop to free at least ``num_tokens`` host slots, LRU first.

        Offered: host-only nodes (evicted from the device) with no child
        (children offered earlier in the list count as gone), not locked, not
        pinned, no write in flight. The tree is not changed: the caller frees
        each node's host slots and calls `remove`, in order. O(N + k log N).
        """
        self._check_count(num_tokens)
        taken: set[int] = set()
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._host_leaf(n, taken)]
        heapq.heapify(heap)
        out: list[Node] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            taken.add(n.id)
            freed += len(n.key)
            p = n.parent
            assert p is not None
            if not p.is_root and self._host_leaf(p, taken):
                heapq.heappush(heap, (p.last_access, p.id, p))
        return out

    def mark_device_evicted(self, node: Node) -> torch.Tensor:
        """Record that ``node``'s device slots were freed; its host copy stays.

        Returns:
            The device slots it held (for the caller to free, if not yet).

        Raises:
            StateError: ``node`` is a root or not in the index, not on the
                device, locked, not on the host (its pages would be nowhere:
                `remove` it instead), or has a device-resident child.
        """
        self._check_attached(node)
        if node.is_root:
            raise StateError("a root holds no pages")
        dev = node.device_indices
        if dev is None:
            raise StateError(f"{node} is not on the device")
        if node.lock_ref:
            raise StateError(f"{node} is locked")
        if node.host_indices is None:
            raise StateError(f"{node} is not on the host; remove it instead")
        if any(c.device_indices is not None for c in node.children.values()):
            raise StateError(f"{node} has a device-resident child; evict the leaves first")
        node.device_indices = None
        self._device_tokens -= len(node.key)
        return dev

    def detach_failed_load(self, node: Node) -> list[torch.Tensor]:
        """Take the device slots from ``node`` and every device-resident node below it.

        The rollback of a failed host->device load: those slots never got
        their bytes (or sit under a prefix that did not), so no node may
        claim them. Unlike `mark_device_evicted`, locked nodes lose their
        slots too (a request holding one finds its load failed). Nodes with a
        host copy stay in the tree as host-only nodes; a device-only
        descendant (whose KV was computed over the failed prefix) is removed
        when it is an unlocked, unpinned leaf, else kept with its slots.
        A node whose host write is in flight keeps its device slots (the
        write reads them). O(subtree).

        Those two exceptions would leave a device node under a host-only
        parent, so the caller must never let new device pages hang under a
        prefix whose load is in flight: the facade's insert waits for every
        load of the prefix it extends, and so never does.

        Returns:
            The device slot tensors taken away, for the caller to free once
            no copy uses them.

        Raises:
            StateError: ``node`` is not in the index.
        """
        self._check_attached(node)
        freed: list[torch.Tensor] = []
        order: list[Node] = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.device_indices is None:
                continue  # nothing below a host-only node is on the device
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            dev = n.device_indices
            if dev is None or n.write_in_flight:
                continue
            if n.host_indices is not None:
                n.device_indices = None
                self._device_tokens -= len(n.key)
                freed.append(dev)
            elif not n.children and not n.lock_ref and not n.host_pin:
                self.remove(n)
                freed.append(dev)
        return freed

    def remove(self, node: Node) -> None:
        """Drop a leaf from the tree (its slots were freed, or are about to be).

        Its ``device_indices`` and ``host_indices`` stay readable on the
        detached node. An ``extra_key`` namespace whose last node goes is
        dropped.

        Raises:
            StateError: ``node`` is a root or not in the index, has children,
                is locked, pinned, or has a write in flight.
        """
        self._check_attached(node)
        if node.is_root:
            raise StateError("a root cannot be removed")
        if node.children:
            raise StateError(f"{node} has children")
        if node.lock_ref:
            raise StateError(f"{node} is locked")
        if node.host_pin:
            raise StateError(f"{node} is pinned on the host")
        assert node.write_id is None
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size]]
        node.parent = None
        if node.device_indices is not None:
            self._device_tokens -= len(node.key)
        if node.host_indices is not None:
            self._host_tokens -= len(node.key)
        self._num_nodes -= 1
        if parent.is_root and parent.extra_key is not None and not parent.children:
            del self._roots[parent.extra_key]

    # -- checking -------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check every invariant of the module docstring (O(total tokens), hashing included).

        Raises:
            AssertionError: with a message naming the broken invariant and node.
        """
        assert self._roots.get(None) is self.root, "the default root is missing"
        seen = _Seen()
        for ns, root in self._roots.items():
            self._check_root(ns, root)
            stack = [root]
            while stack:
                p = stack.pop()
                for first, c in p.children.items():
                    self._check_child(first, c, p, ns)
                    seen.add(c)
                    stack.append(c)
                if not p.is_root:
                    _check_counts_cover_children(p)
        assert seen.nodes == self._num_nodes, f"{seen.nodes} nodes, counted {self._num_nodes}"
        assert seen.device_tokens == self._device_tokens, (
            f"{seen.device_tokens} device tokens, counted {self._device_tokens}"
        )
        assert seen.host_tokens == self._host_tokens, (
            f"{seen.host_tokens} host tokens, counted {self._host_tokens}"
        )
        self._check_writes(seen.writes)

    def _check_root(self, ns: str | None, root: Node) -> None:
        assert root.is_root and root.parent is None, f"root {root} has a key or a parent"
        assert root.extra_key == ns, f"root {root} is filed under {ns!r}"
        assert root.device_indices is None and root.host_indices is None, "a root holds slots"
        assert not root.page_hashes and root.lock_ref == 0 and root.host_pin == 0, (
            f"root {root} has hashes, locks or pins"
        )
        assert ns is None or root.children, f"empty namespace {ns!r} was not dropped"

    def _check_child(self, first: tuple[int, ...], c: Node, p: Node, ns: str | None) -> None:
        """Every invariant of one node ``c`` that its parent ``p`` and namespace decide."""
        ps = self.page_size
        assert c.parent is p, f"{c} has the wrong parent"
        assert c.key and len(c.key) % ps == 0, f"{c} key is not whole pages"
        assert first == c.key[:ps], f"{c} is filed under the wrong first page"
        assert c.extra_key == ns, f"{c} is in namespace {ns!r}"
        _check_slots(c, "device_indices", c.device_indices)
        _check_slots(c, "host_indices", c.host_indices)
        assert c.device_indices is not None or c.host_indices is not None, f"{c} is on neither tier"
        assert c.device_indices is None or p.is_root or p.device_indices is not None, (
            f"{c} is on the device but its parent {p} is not"
        )
        assert c.lock_ref >= 0 and c.host_pin >= 0, f"{c} has a negative count"
        assert c.hit_count >= 0, f"{c} has a negative hit count"
        expect = _chain_hashes(c.key, ps, self._prior_of(p))
        assert c.page_hashes == expect, f"{c} page hashes break the chain"
        assert c.write_id is None or (c.host_indices is not None and c.lock_ref > 0), (
            f"{c} is being written but is unlocked or has no host slots"
        )

    def _check_writes(self, seen: dict[int, list[Node]]) -> None:
        """The in-flight writes recorded agree with the nodes that carry a ``write_id``."""
        assert set(seen) == set(self._writes), "in-flight writes disagree with the nodes"
        for wid, covering in self._writes.items():
            assert {n.id for n in covering} == {n.id for n in seen[wid]}, (
                f"write {wid} covers the wrong nodes"
            )
            for upper, lower in itertools.pairwise(covering):
                assert lower.parent is upper, f"write {wid} covers a broken chain"

    # -- internals ------------------------------------------------------------

    def _walk(self, root: Node, key: tuple[int, ...]) -> list[Node]:
        """The nodes matching ``key``'s whole pages from ``root``, splitting the last one."""
        ps = self.page_size
        n_full = len(key) - len(key) % ps
        path: list[Node] = []
        node = root
        pos = 0
        while pos < n_full:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            ck = child.key
            m = min(len(ck), n_full - pos)
            if key[pos : pos + m] != ck[:m]:
                i = ps  # the first page matched through the dict
                while i < m and key[pos + i] == ck[i]:
                    i += 1
                m = i - i % ps
            if m < len(ck):
                child = self._split(child, m)
            path.append(child)
            pos += m
            if m < len(ck):
                break
            node = child
        return path

    def _device_leaf(self, n: Node, taken: set[int] | tuple[()]) -> bool:
        return (
            n.device_indices is not None
            and n.lock_ref == 0
            and (n.host_pin == 0 or n.host_indices is not None)
            and not any(
                c.device_indices is not None and c.id not in taken for c in n.children.values()
            )
        )

    def _host_leaf(self, n: Node, taken: set[int]) -> bool:
        return (
            n.device_indices is None
            and n.host_indices is not None
            and n.lock_ref == 0
            and n.host_pin == 0
            and n.write_id is None
            and all(c.id in taken for c in n.children.values())
        )

    def _prior_of(self, node: Node) -> str | None:
        if node.page_hashes:
            return node.page_hashes[-1]
        return extra_key_prior(node.extra_key)

    def _namespace_root(self, extra_key: str | None) -> Node:
        check_extra_key(extra_key)
        root = self._roots.get(extra_key)
        if root is None:
            # Unregistered until something is inserted under it.
            root = Node((), None, next(self._ids), extra_key=extra_key, owner=self._owner)
        return root

    def _check_attached(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise InvalidInputError(f"expected a Node, got {type(node).__name__}")
        if not self.owns(node):
            raise StateError(f"{node} is a node of another index")
        if node.is_root:
            # A root holds nothing: one of an emptied (dropped) namespace still names it.
            if node.id < self._epoch:
                raise StateError(f"{node} is a root from before a reset")
            return
        p = node.parent
        if p is None or p.children.get(node.key[: self.page_size]) is not node:
            raise StateError(f"{node} is not in the index (removed, or from before a reset)")

    def _check_pages(self, n: int, what: str) -> None:
        if n % self.page_size:
            raise InvalidInputError(
                f"{what} has {n} tokens, not a whole number of pages of {self.page_size}"
            )

    @staticmethod
    def _check_count(num_tokens: int) -> None:
        check_count(num_tokens, "num_tokens")

    @staticmethod
    def _as_key(tokens: Sequence[int] | torch.Tensor, checked: bool = False) -> tuple[int, ...]:
        """``tokens`` as a tuple of ints, every id checked in C (`token_array`).

        A Python pass over a long prompt's ids would hold the loop for
        milliseconds (about 18 ms at 128k tokens); this costs about one and a
        half. A list or tuple keeps its own id objects (see `token_list`).
        """
        if checked:
            return tuple(tokens)
        return tuple(token_list(tokens, "tokens"))

    @staticmethod
    def _as_indices(indices: torch.Tensor, n: int, what: str) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor):
            raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype != torch.int64 or indices.dim() != 1:
            raise InvalidInputError(
                f"{what} must be a 1-D int64 tensor, got {indices.dtype} {tuple(indices.shape)}"
            )
        if indices.numel() != n:
            raise InvalidInputError(f"{what} has {indices.numel()} slots for {n} tokens")
        # The index keeps its own copy: the caller may reuse its tensor at once.
        return indices.cpu() if indices.device.type != "cpu" else copy_slots(indices)

    def __repr__(self) -> str:
        return (
            f"RadixIndex(page_size={self.page_size}, nodes={self._num_nodes}, "
            f"device_tokens={self._device_tokens}, host_tokens={self._host_tokens}, "
            f"namespaces={len(self._roots)})"
        )

    def mark_backed_up(self, node: Node) -> None:
        """Record that ``node``'s pages are in storage (``node.backuped_storage``).

        Called once a backup of the node succeeded, or for a node inserted
        from pages a prefetch read from storage.

        Raises:
            StateError: ``node`` is a root or not in the index.
        """
        self._check_attached(node)
        if node.is_root:
            raise StateError("a root holds no pages")
        node.backuped_storage = True
