"""The `TierCache` facade against a reference model, driven by random operation sequences.

KV is a deterministic function of (token, position) (`expected_kv`), so every
slot the cache hands back as a cached prefix can be checked bit for bit. The
model keeps the page-aligned prefixes ever committed, the ones seen backed up
to storage (a flush keeps those), and the requests held open across steps.
Prompts are drawn from a vocabulary of half-page blocks, so they share
prefixes often and diverge inside pages.

After every step (and `TierCache.wait_idle`): the index invariants hold; every
node names only committed prefixes and its device and host slots hold the
expected KV; the allocators account for exactly the index's slots plus the
slots held requests own outside it; no lock is left without a held request,
no pin at all; held prefixes are still on the device, in the same slots.

Misuse is part of the model: refused calls (bad ids with storage attached,
foreign or unallocated slots, bad counts and names) must change nothing;
a commit of tokens that are not the request's is refused and the right one
still goes through; concurrent requests for one host-only prefix (some
cancelled, their prefetches rate limited in one variant) all get its exact
KV; and a load back, or a device->host write, whose copy fails at some layer
(before, part-way through or after queuing) leaves no node claiming KV that
did not land.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
import uvloop
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache import TierCache, TierCacheConfig
from tiercache.cache import Request
from tiercache.errors import CapacityError, InvalidInputError, StateError
from tiercache.ledger import Owner
from tiercache.storage.memory import MemoryBackend
from tiercache.transfer.engine import CopyEngine

T = TypeVar("T")

PS = 4
BLOCKS = ((11, 12), (13, 14), (15, 16))  # half pages: prompts diverge inside pages
MAX_HELD = 2

BAD_IDS = st.sampled_from([[-1] * PS, [2**32] * PS, [2**40] * PS, [1.5] * PS, "abcd"])

SEQS = st.tuples(
    st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=8),
    st.sampled_from([(), (17,)]),
).map(lambda bt: tuple(t for b in bt[0] for t in BLOCKS[b]) + bt[1])


def expected_kv(layout: Any, tokens: tuple[int, ...], layer: int, b: int) -> torch.Tensor:
    """The 'computed' KV of ``tokens``: a function of each token and its position."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.001 + pos * 0.01 + layer + b * 0.5)[:, None, None]
    grid = torch.arange(layout.num_kv_heads * layout.head_dim, dtype=torch.float32).view(
        1, layout.num_kv_heads, layout.head_dim
    )
    return (base + grid * 1e-3).to(layout.dtype)


def page_prefixes(tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tokens[:end] for end in range(PS, len(tokens) + 1, PS)]


@dataclass
class Held:
    ctx: contextlib.AbstractAsyncContextManager[Request]
    req: Request
    tokens: tuple[int, ...]
    new_slots: torch.Tensor  # slots from Request.alloc written with the new tokens' KV
    owned_outside: int  # allocated slots the request owns that are not in the index
    committed: bool


class CacheModel(RuleBasedStateMachine):
    WRITE_POLICY = "write_through"
    #: Host tokens prefetches may hold at once: concurrent ones past it are rate limited.
    PREFETCH_CAPACITY: int | None = None
    LOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] = staticmethod(asyncio.new_event_loop)

    def __init__(self) -> None:
        super().__init__()
        self.loop = self.LOOP_FACTORY()
        self.loop.set_debug(True)
        self.loop.slow_callback_duration = 0.5
        cfg = TierCacheConfig(
            num_layers=2,
            num_kv_heads=1,
            head_dim=4,
            dtype=torch.float16,
            page_size=PS,
            device_tokens=8 * PS,
            host_tokens=16 * PS,
            prefetch_threshold=PS,
            prefetch_policy="wait_complete",
            write_policy=self.WRITE_POLICY,
            write_through_threshold=2,
            model="model-test",
            alloc_timeout_s=0.0,  # the steps run one at a time: a held request never lets go
            prefetch_capacity_tokens=self.PREFETCH_CAPACITY,
        )
        self.cache = TierCache(cfg)
        self.run(self.cache.open())
        self.run(self.cache.attach_storage(MemoryBackend()))
        self.committed: set[tuple[int, ...]] = set()
        self.stored: set[tuple[int, ...]] = set()
        self.held: list[Held] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    async def settle(self) -> None:
        await self.cache.wait_idle()

    def teardown(self) -> None:
        try:
            for h in self.held:
                with contextlib.suppress(Exception):
                    self.run(h.ctx.__aexit__(None, None, None))
            self.held = []
            self.run(self.cache.aclose())
            self.run(self.loop.shutdown_asyncgens())
            self.run(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()

    # -- the model --------------------------------------------------------------

    def longest(self, tokens: tuple[int, ...], known: set[tuple[int, ...]]) -> int:
        """The longest page-aligned prefix of ``tokens`` whose every page prefix is in ``known``."""
        n = 0
        for p in page_prefixes(tokens):
            if p not in known:
                break
            n = len(p)
        return n

    def check_device(self, tokens: tuple[int, ...], slots: torch.Tensor, start: int = 0) -> None:
        """``slots`` hold the KV of ``tokens[start : start + len(slots)]``."""
        pool = self.cache.device_pool
        lay = self.cache.layout
        end = start + int(slots.numel())
        for layer in range(lay.num_layers):
            for b in range(lay.num_buffers):
                got = pool.buffers[b][layer][slots]
                want = expected_kv(lay, tokens[:end], layer, b)[start:end]
                assert torch.equal(got, want), (tokens, start, end, layer, b)

    def check_host(self, tokens: tuple[int, ...], slots: torch.Tensor, start: int) -> None:
        host = self.cache.host_pool
        lay = self.cache.layout
        end = start + int(slots.numel())
        for layer in range(lay.num_layers):
            for b in range(lay.num_buffers):
                got = host.layer(b, layer)[slots]
                want = expected_kv(lay, tokens[:end], layer, b)[start:end]
                assert torch.equal(got, want), ("host", tokens, start, end, layer, b)

    def write_new(self, tokens: tuple[int, ...], start: int, slots: torch.Tensor) -> None:
        pool = self.cache.device_pool
        lay = self.cache.layout
        for layer in range(lay.num_layers):
            for b in range(lay.num_buffers):
                pool.buffers[b][layer][slots] = expected_kv(lay, tokens, layer, b)[start:]

    def stuck(self) -> bool:
        """A device-only node with children whose host write found no room.

        It cannot be dropped (its host-only children need its pages) and
        cannot leave the device until the host has room: only a full host
        pool of pinned or locked nodes makes eviction fall short then.
        """
        host = self.cache.controller.host_allocator
        return host.available < PS and any(
            n.device_indices is not None and not n.on_host and n.children
            for n in self.cache.index.nodes()
        )

    def commit_model(self, tokens: tuple[int, ...]) -> None:
        self.committed.update(page_prefixes(tokens))

    async def _serve(self, tokens: tuple[int, ...], hold: bool, commit: bool) -> Held | None:
        """Open a request, check its prefix, compute and (maybe) commit; keep it open if ``hold``."""
        key = tokens[:-1]  # at least one token is always left to compute
        before = self.longest(key, self.stored)
        storage_before = self.cache.stats().tokens_storage_hit
        room_short = self.held or self.stuck()
        ctx = self.cache.request(list(tokens))
        try:
            req = await ctx.__aenter__()
        except CapacityError:
            assert room_short, "no device room although no request is held"
            event("no device room while requests are held")
            return None
        try:
            await req.wait_loaded()
            cached = req.cached_tokens
            assert cached % PS == 0 and cached < len(tokens)
            assert cached <= self.longest(key, self.committed), (cached, tokens)
            if not self.held:
                # Nothing pins the device or host: every page backed up to
                # storage must come back (prefetch waits for all of it).
                assert cached >= before, (cached, before, tokens)
            self.check_device(tokens, req.prefix_indices)
            if cached:
                event("a request reused a cached prefix")
            if self.cache.stats().tokens_storage_hit > storage_before:
                event("a request fetched pages from storage")
            n_new = len(tokens) - cached
            slots = torch.empty(0, dtype=torch.int64)
            alloc_pages = 0
            if n_new:
                slots = await req.alloc(n_new)
                alloc_pages = -(-n_new // PS) * PS
                self.write_new(tokens, cached, slots)
            if commit:
                await req.commit(list(tokens), torch.cat([req.prefix_indices, slots]))
                self.commit_model(tokens)
        except CapacityError:
            assert room_short, "no device room although no request is held"
            event("no device room while requests are held")
            await ctx.__aexit__(None, None, None)
            return None
        except BaseException as e:
            await ctx.__aexit__(type(e), e, e.__traceback__)
            raise
        if not hold:
            await ctx.__aexit__(None, None, None)
            return None
        committed_new = (len(tokens) // PS * PS - cached) if commit else 0
        return Held(ctx, req, tokens, slots, alloc_pages - committed_new, commit)

    # -- rules ----------------------------------------------------------------

    @rule(tokens=SEQS)
    def request(self, tokens: tuple[int, ...]) -> None:
        self.run(self._serve(tokens, hold=False, commit=True))

    @precondition(lambda self: len(self.held) < MAX_HELD)
    @rule(tokens=SEQS, commit=st.booleans())
    def hold(self, tokens: tuple[int, ...], commit: bool) -> None:
        h = self.run(self._serve(tokens, hold=True, commit=commit))
        if h is not None:
            self.held.append(h)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, MAX_HELD - 1))
    def release(self, i: int) -> None:
        h = self.held.pop(i % len(self.held))
        self.check_device(h.tokens, h.req.prefix_indices)
        if not h.committed and h.new_slots.numel():
            self.check_device(h.tokens, h.new_slots, h.req.cached_tokens)
        self.run(h.ctx.__aexit__(None, None, None))

    @rule(pages=st.integers(1, 10))
    def evict_device(self, pages: int) -> None:
        alloc = self.cache.controller.device_allocator
        cached = self.cache.index.total_device_tokens()
        stuck = self.stuck()
        before = alloc.available
        freed = self.run(self.cache.evict_device(pages * PS))
        assert alloc.available - before == freed
        if freed:
            event("evict_host freed slots")
        if not self.held and not stuck:
            assert freed >= min(pages * PS, cached), (freed, pages * PS, cached)
        if freed:
            event("evict_device freed slots")

    @rule(pages=st.integers(1, 20))
    def evict_host(self, pages: int) -> None:
        alloc = self.cache.controller.host_allocator
        before = alloc.available
        freed = self.run(self.cache.evict_host(pages * PS))
        assert alloc.available - before == freed

    @rule()
    def flush(self) -> None:
        self.run(self.settle())
        if self.held:
            with pytest.raises(StateError):
                self.run(self.cache.flush())
            event("flush refused while a request is open")
            return
        self.run(self.cache.flush())
        assert len(self.cache.index) == 0
        assert self.cache.controller.device_allocator.used == 0
        assert self.cache.controller.host_allocator.used == 0

    @rule()
    def wait_idle(self) -> None:
        self.run(self.settle())

    @rule(tokens=SEQS)
    def prefetch(self, tokens: tuple[int, ...]) -> None:
        self.run(self.settle())
        stored = self.longest(tokens, self.stored)
        self.run(self.cache.prefetch(list(tokens)))
        m = self.cache.match_prefix(list(tokens))
        assert m.device_tokens + m.host_tokens <= self.longest(tokens, self.committed)
        if not self.held:
            assert m.device_tokens + m.host_tokens >= stored, (m, stored, tokens)

    @rule(tokens=SEQS)
    def match(self, tokens: tuple[int, ...]) -> None:
        self.run(self.settle())
        m = self.cache.match_prefix(list(tokens))
        assert m.device_tokens == m.device_indices.numel()
        assert m.device_tokens + m.host_tokens <= self.longest(tokens, self.committed)
        self.check_device(tokens, m.device_indices)

    # -- misuse, concurrency and failed copies ---------------------------------------

    def snapshot(self) -> Any:
        """Every page the index holds and where, both allocators: a refused call changes none."""
        cache = self.cache
        pages = []
        for n in cache.index.nodes():
            full = cache.index.prefix_tokens(n)
            start = len(full) - n.num_tokens
            for i in range(0, n.num_tokens, PS):
                dev = None if n.device_indices is None else int(n.device_indices[i])
                host = None if n.host_indices is None else int(n.host_indices[i])
                pages.append((full[: start + i + PS], dev, host, n.lock_ref > 0))
        ctl = cache.controller
        return (
            sorted(pages, key=repr),
            ctl.device_allocator._allocated.tolist(),
            ctl.host_allocator._allocated.tolist(),
        )

    async def _refused(self, call: Callable[[], Coroutine[Any, Any, Any] | Any]) -> None:
        await self.settle()
        before = self.snapshot()
        with pytest.raises(InvalidInputError):
            result = call()
            if asyncio.iscoroutine(result):
                await result
        await self.settle()
        assert self.snapshot() == before

    @rule(
        bad=BAD_IDS,
        tokens=SEQS,
        which=st.sampled_from(
            ["request", "match", "prefetch", "insert_ids", "insert_foreign", "counts", "policy"]
        ),
    )
    def refused_call(self, bad: Any, tokens: tuple[int, ...], which: str) -> None:
        cache = self.cache

        async def go() -> None:
            if which == "request":

                async def req() -> None:
                    async with cache.request(bad):
                        pass

                await self._refused(req)
            elif which == "match":
                await self._refused(lambda: cache.match_prefix(bad))
            elif which == "prefetch":
                await self._refused(lambda: cache.prefetch(bad))
            elif which == "policy":
                await self._refused(lambda: cache.prefetch(list(tokens), policy="eventually"))
            elif which == "counts":
                await self._refused(lambda: cache.evict_device(-PS))
                await self._refused(lambda: cache.evict_host("x"))
                await self._refused(lambda: cache.alloc_device(PS + 1))
            else:
                n = len(tokens) // PS * PS or PS
                toks = list(tokens[:n]) if len(tokens) >= PS else [11] * PS
                if which == "insert_ids":
                    try:
                        slots = await cache.alloc_device(PS)
                    except CapacityError:
                        return
                    await self._refused(lambda: cache.insert(bad, slots))
                    cache.free_device(slots)
                else:  # slots the caller does not own: free ones, or the index's own
                    cached = cache.index.match_prefix(toks, touch=False).device_indices
                    theirs = [
                        n.device_indices
                        for n in cache.index.nodes()
                        if n.device_indices is not None
                        and not bool(torch.isin(n.device_indices, cached).any())
                    ]
                    if sum(int(t.numel()) for t in theirs) >= n:
                        foreign = torch.cat(theirs)[:n]
                        await self._refused(lambda: cache.insert(toks, foreign))
                        event("insert with the index's own slots refused")
                    alloc = cache.controller.device_allocator
                    free = [p for p in range(alloc.num_pages) if not bool(alloc._allocated[p])]
                    if len(free) * PS >= n:
                        pages = torch.tensor(free[: n // PS], dtype=torch.int64)
                        slots = (pages[:, None] * PS + torch.arange(PS)).reshape(-1)
                        await self._refused(lambda: cache.insert(toks, slots))
                        event("insert with unallocated slots refused")

        self.run(go())

    @precondition(lambda self: len(self.held) < MAX_HELD)
    @rule(tokens=SEQS, other=SEQS)
    def mismatched_commit(self, tokens: tuple[int, ...], other: tuple[int, ...]) -> None:
        """A commit of another prompt's tokens is refused; the request's own then goes through."""

        async def go() -> None:
            ctx = self.cache.request(list(tokens))
            try:
                req = await ctx.__aenter__()
            except CapacityError:
                return
            try:
                await req.wait_loaded()
                try:
                    slots = await req.alloc(len(tokens) - req.cached_tokens)
                except CapacityError:
                    return
                self.write_new(tokens, req.cached_tokens, slots)
                full = torch.cat([req.prefix_indices, slots])
                if other[: len(tokens)] != tokens:
                    await self._refused(lambda: req.commit(list(other), full))
                    event("a commit of other tokens was refused")
                await self._refused(lambda: req.commit(list(tokens), full.tolist()))
                await req.commit(list(tokens), full)
                self.commit_model(tokens)
            finally:
                await ctx.__aexit__(None, None, None)

        self.run(go())

    @rule(
        tokens=SEQS, n=st.integers(2, 3), cancel=st.sets(st.integers(0, 2)), steps=st.integers(0, 6)
    )
    def concurrent_same_prefix(
        self, tokens: tuple[int, ...], n: int, cancel: set[int], steps: int
    ) -> None:
        """``n`` concurrent requests for one prompt, its prefix first made host-only; some cancelled."""
        cache = self.cache

        async def one(i: int) -> int:
            async with cache.request(list(tokens)) as req:
                await req.wait_loaded()
                self.check_device(tokens, req.prefix_indices)
                slots = await req.alloc(len(tokens) - req.cached_tokens)
                self.write_new(tokens, req.cached_tokens, slots)
                await asyncio.sleep(0)
                await req.commit(list(tokens), torch.cat([req.prefix_indices, slots]))
                return req.cached_tokens

        async def go() -> None:
            await self.settle()
            tier = cache.controller.storage
            limited = 0 if tier is None else tier.stats.prefetch_rate_limited
            if not self.held:
                await cache.evict_device(8 * PS)  # whatever is on host leaves the device
            # Concurrent requests wait for each other's room, briefly.
            cache.config = cache.config.replace(alloc_timeout_s=0.2)
            try:
                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                for _ in range(steps):
                    await asyncio.sleep(0)
                for i in cancel:
                    if i < n:
                        tasks[i].cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                cache.config = cache.config.replace(alloc_timeout_s=0.0)
            self.commit_model(tokens)  # a cancelled task may have committed already
            if tier is not None and tier.stats.prefetch_rate_limited > limited:
                event("a concurrent prefetch was rate limited")
            done = [r for r in results if isinstance(r, int)]
            for r in results:
                if isinstance(r, CapacityError):
                    event("a concurrent request found no room")
                elif not isinstance(r, int | asyncio.CancelledError):
                    raise r
            if done:
                event("concurrent same-prefix requests completed")
                if not self.held and len(set(done)) == 1 and done[0]:
                    event("concurrent requests shared a loaded prefix")

        self.run(go())

    @rule(tokens=SEQS, layer=st.integers(0, 1))
    def failed_load(self, tokens: tuple[int, ...], layer: int) -> None:
        """The next load back fails at ``layer``: no wrong KV anywhere, and a retry serves it."""
        cache = self.cache
        engine = cache.controller.engine

        def load_layer(i: int, plan: Any) -> None:
            if i == layer:
                raise RuntimeError("injected copy failure")
            CopyEngine.load_layer(engine, i, plan)

        async def go() -> None:
            await self.settle()
            if not self.held:
                await cache.evict_device(8 * PS)
            engine.load_layer = load_layer  # type: ignore[method-assign]
            try:
                async with cache.request(list(tokens)) as req:
                    try:
                        await req.wait_loaded()
                    except RuntimeError:
                        event("a load back failed")
                        try:
                            slots = await req.alloc(len(tokens) - req.cached_tokens)
                        except CapacityError:
                            return
                        with pytest.raises(StateError):
                            await req.commit(list(tokens), torch.cat([req.prefix_indices, slots]))
                        return
                    self.check_device(tokens, req.prefix_indices)
            except CapacityError:
                assert self.held or self.stuck()
            finally:
                del engine.load_layer

        self.run(go())
        self.run(self.settle())
        self.consistent()
        # The retry loads it again and serves the right KV.
        self.run(self._serve(tokens, hold=False, commit=False))

    @rule(
        tokens=SEQS,
        layer=st.integers(0, 2),
        phase=st.sampled_from(["before", "partial", "after"]),
    )
    def failed_write(self, tokens: tuple[int, ...], layer: int, phase: str) -> None:
        """Device->host copies fail while ``tokens`` is committed and the device evicted.

        ``before``: the job raises before it queues any copy; ``partial``: after
        copying the layers below ``layer`` of each buffer (bytes landed on host
        for part of the KV); ``after``: after every copy was queued. No host
        slot is freed while a copy still counts on it, the index claims no host
        copy that did not land (the invariants check every host page's
        bytes), and a retry serves and writes the right KV.
        """
        cache = self.cache
        ctl = cache.controller
        engine = ctl.engine
        lay = cache.layout
        failures: list[int] = []

        def backup_all_layers(plan: Any) -> None:
            if phase == "partial":
                for b in range(lay.num_buffers):
                    for i in range(min(layer, lay.num_layers)):
                        engine._backup_layer(b, i, plan)
            elif phase == "after":
                CopyEngine.backup_all_layers(engine, plan)
            failures.append(plan.num_tokens)
            raise RuntimeError("injected copy failure")

        host = ctl.host_allocator
        real_free = host.free

        def free(indices: torch.Tensor, *, checked: bool = False) -> None:
            assert not ctl.ack_busy("host", indices), "host slots freed before their copy settled"
            real_free(indices, checked=checked)

        async def go() -> None:
            await self.settle()
            engine.backup_all_layers = backup_all_layers  # type: ignore[method-assign]
            host.free = free  # type: ignore[method-assign]
            try:
                await self._serve(tokens, hold=False, commit=True)
                await self.settle()
                if not self.held:
                    # write_back writes on eviction: those copies fail here.
                    await cache.evict_device(8 * PS)
                await self.settle()
            finally:
                del engine.backup_all_layers
                del host.free
            if failures:
                event("a device->host copy failed")

        self.run(go())
        self.consistent()
        # The retry serves the right KV (checked in _serve); its writes land.
        self.run(self._serve(tokens, hold=False, commit=True))

    # -- invariants -------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        cache = self.cache
        self.run(self.settle())
        index = cache.index
        index.check_invariants()
        ctl = cache.controller
        outside = sum(h.owned_outside for h in self.held)
        assert ctl.device_allocator.used == index.total_device_tokens() + outside, (
            ctl.device_allocator.used,
            index.total_device_tokens(),
            outside,
        )
        assert ctl.host_allocator.used == index.total_host_tokens()
        books = ctl.ledger
        books.check_invariants()
        assert books.device.tokens_owned(Owner.INDEX) == index.total_device_tokens()
        assert not cache._ops.loads
        if not self.held:
            assert books.device.tokens_owned(Owner.REQUEST) == 0
        for node in index.nodes():
            full = index.prefix_tokens(node)
            start = len(full) - node.num_tokens
            for p in page_prefixes(full)[start // PS :]:
                assert p in self.committed, (node, full)
            assert node.host_pin == 0, node
            if not self.held:
                assert node.lock_ref == 0, node
            if node.device_indices is not None:
                self.check_device(full, node.device_indices, start)
            if node.host_indices is not None:
                assert not node.write_in_flight, node
                self.check_host(full, node.host_indices, start)
            if node.backuped_storage:
                self.stored.update(page_prefixes(full)[start // PS :])
        for h in self.held:
            cached = h.req.cached_tokens
            m = index.match_prefix(list(h.tokens[:cached]), touch=False)
            assert torch.equal(m.device_indices, h.req.prefix_indices), (h.tokens, m)
        s = cache.stats()
        hits = s.tokens_device_hit + s.tokens_host_hit + s.tokens_storage_hit
        assert hits <= s.tokens_requested, s


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class CacheModelWriteBack(CacheModel):
    WRITE_POLICY = "write_back"
    LOOP_FACTORY = staticmethod(uvloop.new_event_loop)


class CacheModelSelective(CacheModel):
    WRITE_POLICY = "write_through_selective"
    PREFETCH_CAPACITY = 2 * PS


TestCacheModelWriteThrough = CacheModel.TestCase
TestCacheModelWriteThrough.settings = _SETTINGS
TestCacheModelWriteBack = CacheModelWriteBack.TestCase
TestCacheModelWriteBack.settings = _SETTINGS
TestCacheModelSelective = CacheModelSelective.TestCase
TestCacheModelSelective.settings = _SETTINGS


# -- regressions found by the model ------------------------------------------------


def small_config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        dtype="float16",
        page_size=PS,
        device_tokens=8 * PS,
        host_tokens=16 * PS,
        prefetch_threshold=PS,
        prefetch_policy="wait_complete",
        model="model-test",
    )
    base.update(kw)
    return TierCacheConfig(**base)


async def test_wait_idle_waits_for_the_completion_of_finished_copies() -> None:
    """A copy that finished just before wait_idle still has its node unlocked and backed up after it."""
    toks = [11, 12, 11, 12]
    for yields in range(6):
        async with TierCache(small_config()) as cache:
            await cache.attach_storage(MemoryBackend())
            async with cache.request(toks) as req:
                slots = await req.alloc(PS)
                await req.commit(toks, torch.cat([req.prefix_indices, slots]))
                for _ in range(yields):
                    await asyncio.sleep(0)
            await cache.wait_idle()
            nodes = list(cache.index.nodes())
            assert not any(n.write_in_flight or n.lock_ref for n in nodes), (yields, nodes)
            assert all(n.backuped_storage and not n.host_pin for n in nodes), (yields, nodes)
            await cache.flush()  # no request is open: must not raise StateError


async def test_flush_refuses_while_a_request_with_no_cached_prefix_is_open() -> None:
    async with TierCache(small_config()) as cache:
        ctx = cache.request([1, 2, 3, 4, 5])
        req = await ctx.__aenter__()
        await req.alloc(5)
        try:
            with pytest.raises(StateError):
                await cache.flush()
        finally:
            # Whatever flush did, the open request's release must leave a later
            # request's slots allocated.
            async with cache.request([9] * 8) as other:
                mine = await other.alloc(8)
                await ctx.__aexit__(None, None, None)
                assert cache.controller.device_allocator.is_allocated(mine)


async def test_write_back_evicts_a_device_only_parent_of_host_only_children() -> None:
    async with TierCache(small_config(write_policy="write_back")) as cache:
        toks = [1] * PS + [2] * PS
        async with cache.request(toks) as req:
            slots = await req.alloc(2 * PS)
            await req.commit(toks, slots)
        cache.match_prefix(toks[:PS])  # splits the node: [1]*PS, then its child [2]*PS
        # Nothing is locked: both pages must leave the device (the child is
        # written back first, then the parent).
        assert await cache.evict_device(2 * PS) == 2 * PS


async def test_eviction_looks_past_nodes_whose_write_back_failed_and_must_stay() -> None:
    """Write backs fail; the LRU nodes cannot be dropped (a host-only child needs them).

    The eviction must not stop at them while another device-only node could
    leave: it sets them aside and takes the next least recently used one.
    """
    cfg = small_config(write_policy="write_back", alloc_timeout_s=0.0)
    async with TierCache(cfg) as cache:
        old = [1] * (2 * PS) + [2] * PS
        async with cache.request([*old, 0]) as req:
            slots = await req.alloc(len(old) + 1)
            await req.commit([*old, 0], slots)
        cache.match_prefix(old[: 2 * PS])  # split: [1]*2PS, then its child [2]*PS
        assert await cache.evict_device(PS) == PS  # the child leaves (written back)
        parent = cache.match_prefix(old)
        assert (parent.device_tokens, parent.host_tokens) == (2 * PS, PS)
        recent = [5] * (3 * PS)
        async with cache.request([*recent, 0]) as req:
            slots = await req.alloc(len(recent) + 1)
            await req.commit([*recent, 0], slots)
        await cache.wait_idle()
        filler = await cache.alloc_device(cache.controller.device_allocator.available)
        engine = cache.controller.engine

        def failing(plan: Any) -> None:
            raise RuntimeError("injected copy failure")

        engine.backup_all_layers = failing  # type: ignore[method-assign]
        try:
            got = await cache.alloc_device(2 * PS)  # the LRU candidate is the stuck parent
        finally:
            del engine.backup_all_layers
        assert got.numel() == 2 * PS
        # The recent node was dropped (its write back failed too); the parent stays.
        assert cache.match_prefix(recent).device_tokens == 0
        assert cache.match_prefix(old).device_tokens == 2 * PS
        cache.free_device(got)
        cache.free_device(filler)
        await cache.wait_idle()
        cache.index.check_invariants()
