"""The radix index against a reference model, driven by random operation sequences.

The model is a dict from (extra key, token prefix ending at a page boundary)
to the device and host slots of that page. Every slot handed to the index is
fresh, so a slot names the call that inserted it: after every step, every page
of every node must hold exactly the slots the model says, and every match must
return exactly the model's device slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache.index.radix import Node, RadixIndex

Key = tuple[str | None, tuple[int, ...]]


@dataclass
class Entry:
    dev: tuple[int, ...] | None = None
    host: tuple[int, ...] | None = None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


NAMESPACES = st.sampled_from([None, "a"])
PICK = st.integers(min_value=0, max_value=1 << 16)


class RadixModel(RuleBasedStateMachine):
    PS = 1
    ALPHABET = 3

    def __init__(self) -> None:
        super().__init__()
        self.index = RadixIndex(self.PS, clock=Clock())
        self.pages: dict[Key, Entry] = {}
        self.locks: list[Node] = []
        self.pins: list[Node] = []
        self.writes: dict[int, tuple[list[Key], torch.Tensor]] = {}
        self.next_dev = 0
        self.next_host = 0

    # -- helpers --------------------------------------------------------------

    def fresh_dev(self, n: int) -> torch.Tensor:
        self.next_dev += n
        return torch.arange(self.next_dev - n, self.next_dev, dtype=torch.int64)

    def fresh_host(self, n: int) -> torch.Tensor:
        self.next_host += n
        return torch.arange(self.next_host - n, self.next_host, dtype=torch.int64)

    def page_keys(self, ns: str | None, tokens: tuple[int, ...], start: int = 0) -> list[Key]:
        ps = self.PS
        return [(ns, tokens[: end + ps]) for end in range(start, len(tokens) - ps + 1, ps)]

    def node_keys(self, node: Node) -> list[Key]:
        full = self.index.prefix_tokens(node)
        return self.page_keys(node.extra_key, full, len(full) - node.num_tokens)

    def pick(self, nodes: list[Node], i: int) -> Node | None:
        nodes = sorted(nodes, key=lambda n: n.id)
        return nodes[i % len(nodes)] if nodes else None

    def tokens(self, draw: list[int]) -> tuple[int, ...]:
        return tuple(t % self.ALPHABET for t in draw)

    def expected_match(self, ns: str | None, tokens: tuple[int, ...]) -> tuple[list[int], int]:
        dev: list[int] = []
        host = 0
        on_device = True
        for k in self.page_keys(ns, tokens):
            e = self.pages.get(k)
            if e is None:
                break
            if on_device and e.dev is not None:
                dev.extend(e.dev)
                continue
            on_device = False
            if e.dev is not None or e.host is None:
                break
            host += self.PS
        return dev, host

    # -- rules ----------------------------------------------------------------

    @rule(
        draw=st.lists(st.integers(0, 99), min_size=2, max_size=6),
        ns=NAMESPACES,
        write=st.booleans(),
    )
    def insert(self, draw: list[int], ns: str | None, write: bool) -> None:
        toks = self.tokens(draw)
        toks = toks[: len(toks) - len(toks) % self.PS]
        dev = self.fresh_dev(len(toks))
        dup = reattached = 0
        expected: dict[Key, Entry] = {}
        for i, k in enumerate(self.page_keys(ns, toks)):
            page = tuple(dev[i * self.PS : (i + 1) * self.PS].tolist())
            e = self.pages.get(k)
            if e is not None and e.dev is not None:
                assert reattached == 0
                dup += self.PS
            elif e is not None:
                reattached += self.PS
                expected[k] = Entry(page, e.host)
            else:
                expected[k] = Entry(page, None)
        r = self.index.insert(toks, dev, extra_key=ns)
        assert (r.prefix_len, r.reattached_len) == (dup, reattached)
        self.pages.update(expected)
        if write and r.node is not None:  # write-through: back the new node up
            self.start_write(r.node)

    @rule(draw=st.lists(st.integers(0, 99), max_size=7), ns=NAMESPACES, touch=st.booleans())
    def match(self, draw: list[int], ns: str | None, touch: bool) -> None:
        toks = self.tokens(draw)
        dev, host = self.expected_match(ns, toks)
        m = self.index.match_prefix(toks, extra_key=ns, touch=touch)
        assert m.device_indices.tolist() == dev
        assert m.host_hit_length == host
        assert m.device_length == len(dev)
        if m.last_node.is_root:
            assert m.matched_length == 0
        else:
            assert len(self.index.prefix_tokens(m.last_node)) == m.matched_length

    @rule(draw=st.lists(st.integers(0, 99), min_size=1, max_size=6), ns=NAMESPACES)
    def lock(self, draw: list[int], ns: str | None) -> None:
        m = self.index.match_prefix(self.tokens(draw), extra_key=ns)
        if not m.last_node.is_root:
            self.index.lock(m.last_node)
            self.locks.append(m.last_node)

    @precondition(lambda self: self.locks)
    @rule(i=PICK)
    def unlock(self, i: int) -> None:
        if self.locks:
            self.index.unlock(self.locks.pop(i % len(self.locks)))

    @rule(i=PICK)
    def pin(self, i: int) -> None:
        node = self.pick([n for n in self.index.nodes() if n.on_host], i)
        if node is not None:
            self.index.pin_host(node)
            self.pins.append(node)

    @precondition(lambda self: self.pins)
    @rule(i=PICK)
    def unpin(self, i: int) -> None:
        if self.pins:
            self.index.unpin_host(self.pins.pop(i % len(self.pins)))

    @rule(i=PICK)
    def begin_write(self, i: int) -> None:
        node = self.pick([n for n in self.index.nodes() if not n.evicted and not n.on_host], i)
        if node is not None:
            self.start_write(node)

    def start_write(self, node: Node) -> None:
        host = self.fresh_host(node.num_tokens)
        keys = self.node_keys(node)
        wid = self.index.begin_write(node, host)
        self.writes[wid] = (keys, host)
        for j, k in enumerate(keys):
            self.pages[k].host = tuple(host[j * self.PS : (j + 1) * self.PS].tolist())

    @precondition(lambda self: self.writes)
    @rule(i=PICK, ok=st.booleans())
    def finish_write(self, i: int, ok: bool) -> None:
        if not self.writes:
            return
        wid = sorted(self.writes)[i % len(self.writes)]
        keys, host = self.writes.pop(wid)
        nodes = self.index.finish_write(wid, ok=ok)
        covered = [k for n in nodes for k in self.node_keys(n)]
        assert covered == keys  # a split write still covers exactly its pages
        if not ok:
            for k in keys:
                self.pages[k].host = None

    @rule(i=PICK, at=PICK)
    def split(self, i: int, at: int) -> None:
        # prefer a node with a write in flight: its completion must still cover both halves
        nodes = [n for n in self.index.nodes() if n.num_tokens > self.PS]
        node = self.pick([n for n in nodes if n.write_in_flight] or nodes, i)
        if node is None:
            return
        point = self.PS * (1 + at % (node.num_tokens // self.PS - 1))
        before = self.node_keys(node)
        upper = self.index.split(node, point)
        assert self.node_keys(upper) + self.node_keys(node) == before

    @rule(n=st.integers(0, 4))
    def evict_device(self, n: int) -> None:
        for node in self.index.evict_device_candidates(n):
            assert node.lock_ref == 0 and not node.evicted
            keys = self.node_keys(node)
            if node.on_host:
                self.index.mark_device_evicted(node)
                for k in keys:
                    self.pages[k].dev = None
            elif not node.children:
                self.index.remove(node)
                for k in keys:
                    del self.pages[k]
            else:
                break  # would need a write back first; its ancestors must wait

    @rule(n=st.integers(0, 4))
    def evict_host(self, n: int) -> None:
        for node in self.index.evict_host_candidates(n):
            assert node.evicted and node.on_host and node.lock_ref == 0 and node.host_pin == 0
            keys = self.node_keys(node)
            self.index.remove(node)
            for k in keys:
                del self.pages[k]

    @rule(
        draw=st.lists(st.integers(0, 99), max_size=6),
        extra=st.lists(st.integers(0, 99), max_size=4),
        ns=NAMESPACES,
        from_device=st.booleans(),
    )
    def insert_host(
        self, draw: list[int], extra: list[int], ns: str | None, from_device: bool
    ) -> None:
        toks = self.tokens(draw)
        m = self.index.match_prefix(toks, extra_key=ns)
        parent = m.last_device_node if from_device else m.last_node
        base = () if parent.is_root else self.index.prefix_tokens(parent)
        rest = toks[len(base) :] + self.tokens(extra)
        rest = rest[: len(rest) - len(rest) % self.PS]
        host = self.fresh_host(len(rest))
        full = base + rest
        keys = self.page_keys(ns, full, len(base))
        dup = 0
        while dup < len(keys) and keys[dup] in self.pages:
            dup += 1
        r = self.index.insert_host(rest, host, parent=parent)
        assert r.prefix_len == dup * self.PS
        for j in range(dup, len(keys)):
            self.pages[keys[j]] = Entry(None, tuple(host[j * self.PS : (j + 1) * self.PS].tolist()))

    @rule(draw=st.lists(st.integers(0, 99), max_size=6), ns=NAMESPACES)
    def load_back(self, draw: list[int], ns: str | None) -> None:
        m = self.index.match_prefix(self.tokens(draw), extra_key=ns)
        if m.host_hit_length == 0:
            return
        dev = self.fresh_dev(m.host_hit_length)
        nodes = self.index.attach_device(m.last_host_node, dev)
        keys = [k for n in nodes for k in self.node_keys(n)]
        assert len(keys) * self.PS == m.host_hit_length
        for j, k in enumerate(keys):
            self.pages[k].dev = tuple(dev[j * self.PS : (j + 1) * self.PS].tolist())

    @precondition(lambda self: len(self.index) > 6)
    @rule()
    def reset(self) -> None:
        self.index.reset()
        self.pages.clear()
        self.locks.clear()
        self.pins.clear()
        self.writes.clear()

    # -- invariants -----------------------------------------------------------

    @invariant()
    def tree_matches_model(self) -> None:
        self.index.check_invariants()
        seen = 0
        for node in self.index.nodes():
            for j, k in enumerate(self.node_keys(node)):
                e = self.pages[k]
                sl = slice(j * self.PS, (j + 1) * self.PS)
                dev = (
                    None if node.device_indices is None else tuple(node.device_indices[sl].tolist())
                )
                host = None if node.host_indices is None else tuple(node.host_indices[sl].tolist())
                assert (dev, host) == (e.dev, e.host), (k, node)
                seen += 1
        assert seen == len(self.pages)
        assert self.index.total_device_tokens() == self.PS * sum(
            e.dev is not None for e in self.pages.values()
        )


_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RadixModelPage2(RadixModel):
    PS = 2
    ALPHABET = 2


TestRadixModelPage1 = RadixModel.TestCase
TestRadixModelPage1.settings = _SETTINGS
TestRadixModelPage2 = RadixModelPage2.TestCase
TestRadixModelPage2.settings = _SETTINGS
