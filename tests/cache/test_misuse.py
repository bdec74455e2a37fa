"""Misuse of the public verbs: refused before anything changes, one answer per input, no raw errors.

Every refused call is checked to leave the index, both allocators and the
request as they were, and to be retryable with correct arguments. The first
five tests are the regressions this module was written for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

from tiercache import (
    DeviceKVPool,
    HostKVPool,
    KVLayout,
    PageAllocator,
    TierCache,
    TierCacheConfig,
    TierController,
)
from tiercache.cache import Request
from tiercache.errors import BackendUnavailableError, CapacityError, InvalidInputError, StateError
from tiercache.index.hashing import hash_page
from tiercache.ledger import Owner
from tiercache.storage.memory import MemoryBackend

PS = 16


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=256,
        host_tokens=512,
        prefetch_threshold=PS,
        prefetch_policy="wait_complete",
        model="misuse",
    )
    base.update(kw)
    return TierCacheConfig(**base)


def kv_of(tokens: list[int], layer: int, b: int) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    return (t * 0.001 + pos * 0.01 + layer + b * 0.5)[:, None, None].expand(-1, 1, 4)


def write_kv(cache: TierCache, tokens: list[int], start: int, slots: torch.Tensor) -> None:
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            buf[slots] = kv_of(tokens, layer, b)[start : start + slots.numel()]


def assert_kv(cache: TierCache, tokens: list[int], slots: torch.Tensor) -> None:
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            assert torch.equal(buf[slots], kv_of(tokens, layer, b)[: slots.numel()]), (layer, b)


def snapshot(cache: TierCache, req: Request | None = None) -> Any:
    """What the cache holds, page by page (a node split is not a change), and the allocators."""
    ctl = cache.controller
    pages = []
    for n in cache.index.nodes():
        full = cache.index.prefix_tokens(n)
        start = len(full) - n.num_tokens
        for i in range(0, n.num_tokens, PS):
            dev = None if n.device_indices is None else int(n.device_indices[i])
            host = None if n.host_indices is None else int(n.host_indices[i])
            pages.append((full[: start + i + PS], dev, host, n.lock_ref > 0, n.host_pin > 0))
    nodes = sorted(pages, key=repr)
    out: tuple[Any, ...] = (
        nodes,
        ctl.device_allocator._allocated.tolist(),
        ctl.host_allocator._allocated.tolist(),
    )
    if req is not None:
        held = ctl.ledger.device.request_pages(req._lease).tolist()
        out += (req._committed, held, req.cached_tokens)
    return out


async def refused(
    cache: TierCache,
    call: Callable[[], Awaitable[Any] | Any],
    error: type[BaseException] = InvalidInputError,
    req: Request | None = None,
) -> None:
    """``call`` raises ``error`` and changes nothing."""
    await cache.wait_idle()
    before = snapshot(cache, req)
    with pytest.raises(error):
        result = call()
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            await result
    await cache.wait_idle()
    assert snapshot(cache, req) == before


async def serve(cache: TierCache, tokens: list[int]) -> int:
    async with cache.request(tokens) as req:
        await req.wait_loaded()
        assert_kv(cache, tokens, req.prefix_indices)
        slots = await req.alloc(len(tokens) - req.cached_tokens)
        write_kv(cache, tokens, req.cached_tokens, slots)
        await req.commit(tokens, torch.cat([req.prefix_indices, slots]))
        return req.cached_tokens


def check_accounting(cache: TierCache) -> None:
    ctl = cache.controller
    cache.index.check_invariants()
    assert ctl.device_allocator.used == cache.index.total_device_tokens()
    assert ctl.host_allocator.used == cache.index.total_host_tokens()
    ctl.ledger.check_invariants()
    assert ctl.ledger.device.tokens_owned(Owner.INDEX) == cache.index.total_device_tokens()


# -- the five regressions ---------------------------------------------------------------


async def test_refused_insert_leaves_index_unchanged() -> None:
    P = list(range(100, 132))
    async with TierCache(config()) as c:
        good = await c.alloc_device(32)
        write_kv(c, P, 0, good)
        await refused(c, lambda: c.insert(P, torch.arange(128, 160)))
        # The retry with the right slots inserts them; nothing was cached before.
        assert await c.insert(P, good) == 0
        await c.wait_idle()
        check_accounting(c)
        assert c.stats().extra["device_free"] == 256 - 32
        assert await serve(c, P + [1]) == 32


async def test_commit_with_tokens_that_are_not_the_requests_is_refused() -> None:
    A = list(range(1000, 1016)) + [5] * 16
    B = list(range(2000, 2048))
    async with TierCache(config()) as c:
        await serve(c, A + [9])
        async with c.request(A + [7] * 16) as req:
            assert req.cached_tokens == 32
            slots = await req.alloc(16)
            write_kv(c, A + [7] * 16, 32, slots)
            full = torch.cat([req.prefix_indices, slots])
            await refused(c, lambda: req.commit(B, full), req=req)
            # The refused commit left the request uncommitted: the right one goes through.
            assert await req.commit(A + [7] * 16, full) == 32
        await c.wait_idle()
        check_accounting(c)
        assert c.match_prefix(B + [1]).device_tokens == 0
        assert await c.evict_device(256) == 48
        check_accounting(c)


async def test_concurrent_requests_for_one_host_only_prefix_both_get_it() -> None:
    P = list(range(100, 132))
    Q = list(range(500, 564))
    async with TierCache(config(device_tokens=64, host_tokens=256)) as c:
        s = await c.alloc_device(32)
        write_kv(c, P, 0, s)
        await c.insert(P, s)
        await c.wait_idle()
        await c.evict_device(64)
        s = await c.alloc_device(64)
        write_kv(c, Q, 0, s)
        await c.insert(Q, s)  # fills the device; its host write is in flight

        async def req() -> int:
            async with c.request(P + [1]) as r:
                await r.wait_loaded()
                assert_kv(c, P, r.prefix_indices)
                return r.cached_tokens

        assert await asyncio.gather(req(), req()) == [32, 32]
        await c.wait_idle()
        check_accounting(c)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
async def test_out_of_range_ids_leak_no_host_slots(bad: int) -> None:
    async with TierCache(config()) as c:
        await c.attach_storage(MemoryBackend())
        for _ in range(3):
            with pytest.raises(InvalidInputError):
                async with c.request([bad] * 32):
                    pass
        assert c.stats().extra["host_free"] == 512
        check_accounting(c)
    async with TierCache(config()) as c:  # no storage: the same answer
        with pytest.raises(InvalidInputError):
            async with c.request([bad] * 32):
                pass


async def test_alloc_waits_for_room_other_requests_hold() -> None:
    """Slots held by concurrent requests come back: alloc waits instead of failing."""
    async with TierCache(config(device_tokens=128)) as c:
        order: list[str] = []
        held = asyncio.Event()

        async def holder() -> None:
            async with c.request([1] * 97) as r:
                await r.alloc(97)  # 112 of 128 slots
                order.append("held")
                held.set()
                await asyncio.sleep(0.05)
                order.append("release")

        async def waiter() -> None:
            await held.wait()
            async with c.request([2] * 64) as r:
                await r.alloc(64)
                order.append("got")

        await asyncio.gather(holder(), waiter())
        assert order == ["held", "release", "got"]
        check_accounting(c)


async def test_requests_that_all_hold_and_wait_for_room_do_not_wait_for_the_timeout() -> None:
    """Each request holds half the pool and wants more: only one giving up frees room.

    Waiting would end only at ``alloc_timeout_s``; the first in line is refused at
    once instead, and its end lets the others through.
    """
    async with TierCache(config(device_tokens=96, alloc_timeout_s=60.0)) as c:
        holding = 0
        all_hold = asyncio.Event()

        async def one(tok: int) -> str:
            nonlocal holding
            tokens = [tok] * 33
            async with c.request(tokens) as r:
                first = await r.alloc(32)
                holding += 1
                if holding == 3:
                    all_hold.set()
                await all_hold.wait()
                try:
                    second = await r.alloc(1)
                except CapacityError:
                    return "refused"
                write_kv(c, tokens, 0, torch.cat([first, second]))
                await r.commit(tokens, torch.cat([first, second]))
                return "served"

        async with asyncio.timeout(10):
            results = await asyncio.gather(one(1), one(2), one(3))
        assert sorted(results) == ["refused", "served", "served"]
        await c.wait_idle()
        check_accounting(c)
        assert not c._parts.device.blocked and c._parts.room.open_requests == 0


# -- waiting for room: fair, cancellable, bounded --------------------------------------


async def test_alloc_that_can_never_fit_fails_at_once() -> None:
    async with TierCache(config(device_tokens=64)) as c:
        with pytest.raises(CapacityError):
            await c.alloc_device(128)
        async with c.request([1] * 40) as r:
            await r.alloc(40)  # 48 slots held by the only request: nobody else can free
            with pytest.raises(CapacityError):
                await asyncio.wait_for(r.alloc(32), 2.0)
        check_accounting(c)


async def test_alloc_gives_up_after_the_timeout() -> None:
    async with TierCache(config(device_tokens=64, alloc_timeout_s=0.1)) as c:
        async with c.request([1] * 40) as r1:
            await r1.alloc(40)
            async with c.request([2] * 40) as r2:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(CapacityError, match="alloc_timeout_s"):
                    await r2.alloc(32)
                assert loop.time() - t0 >= 0.09  # the loop clock is coarse on uvloop
        check_accounting(c)


async def test_waiters_are_served_first_come_first_served_and_cancel_cleanly() -> None:
    async with TierCache(config(device_tokens=64, alloc_timeout_s=5.0)) as c:
        got: list[int] = []
        hold = await c.alloc_device(64)

        async def want(i: int) -> None:
            slots = await c.alloc_device(32)
            got.append(i)
            await asyncio.sleep(0.01)
            c.free_device(slots)

        tasks = [asyncio.create_task(want(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # a waiter leaving the queue takes nothing
        await asyncio.sleep(0.01)
        c.free_device(hold)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert got == [0, 2, 3], got
        assert tasks[1].cancelled()
        assert c.controller.device_allocator.used == 0
        assert not c._parts.room.device


# -- one answer for one input ------------------------------------------------------------


async def test_lists_tuples_and_tensors_are_the_same_prompt() -> None:
    P = list(range(300, 340))
    forms: list[Any] = [
        P,
        tuple(P),
        torch.tensor(P),
        torch.tensor(P, dtype=torch.int32),
        np.array(P),
    ]
    async with TierCache(config()) as c:
        await serve(c, P)
        for form in forms:
            assert c.match_prefix(form).device_tokens == 32
            async with c.request(form) as r:
                assert r.cached_tokens == 32
                assert r.tokens == P


BAD_IDS: list[Any] = [
    [-1] * 32,
    [2**32] * 32,
    torch.full((32,), -1),
    torch.full((32,), 2**32),
    torch.zeros(32),  # float tensor
    torch.zeros(2, 16, dtype=torch.int64),  # 2-D
    [1.0] * 32,
    [True] * 32,  # True == 1, but a bool is no token id
    [7] * 31 + [False],
    ["a"] * 32,
    "abc",
    b"abc",
    {1, 2, 3},
    None,
    42,
]


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda b: repr(b)[:30])
async def test_bad_ids_are_refused_everywhere(bad: Any) -> None:
    async with TierCache(config()) as c:
        await c.attach_storage(MemoryBackend())
        await serve(c, list(range(40)))
        await c.wait_idle()
        slots = await c.alloc_device(32)

        async def in_request() -> None:
            async with c.request(bad):
                pass

        await refused(c, in_request)
        await refused(c, lambda: c.match_prefix(bad))
        await refused(c, lambda: c.prefetch(bad))
        await refused(c, lambda: c.insert(bad, slots))
        with pytest.raises(InvalidInputError):
            hash_page(bad)
        async with c.request(list(range(48))) as r:
            new = await r.alloc(48 - r.cached_tokens)
            await refused(c, lambda: r.commit(bad, torch.cat([r.prefix_indices, new])), req=r)
        c.free_device(slots)
        check_accounting(c)


async def test_bad_counts_policies_and_argument_types_are_refused() -> None:
    P = list(range(64))
    async with TierCache(config()) as c:
        await c.attach_storage(MemoryBackend())
        await serve(c, P)
        await c.wait_idle()
        for n in (-1, -PS, 1.5, "x", None, True, 17):
            await refused(c, lambda n=n: c.alloc_device(n))
        for n in (-1, 1.5, "x", None, True):
            await refused(c, lambda n=n: c.evict_device(n))
            await refused(c, lambda n=n: c.evict_host(n))
        await refused(c, lambda: c.prefetch(P, policy="eventually"))
        await refused(c, lambda: c.load_back("match"))  # type: ignore[arg-type]
        await refused(c, lambda: c.lock("node"))  # type: ignore[arg-type]
        await refused(c, lambda: c.match_prefix(P, extra_key=5))  # type: ignore[arg-type]
        # A str with no UTF-8 bytes (a lone surrogate) cannot start a hash chain.
        await refused(c, lambda: c.match_prefix(P, extra_key="\ud800"))
        await refused(c, lambda: c.insert(P[:32], c.match_prefix(P).device_indices[:32], "\ud800"))
        slots = await c.alloc_device(32)
        await refused(c, lambda: c.free_device(slots.tolist()))  # type: ignore[arg-type]
        await refused(c, lambda: c.insert(P[:32], slots.tolist()))  # type: ignore[arg-type]
        await refused(c, lambda: c.insert(P[:32], slots.int()))
        await refused(c, lambda: c.insert(P[:32], slots[:16]))
        await refused(c, lambda: c.insert(P[:32], torch.cat([slots[:16], slots[:16]])))
        index_slots = c.match_prefix(P).device_indices
        other = list(range(900, 932))
        await refused(c, lambda: c.insert(other, index_slots[:32]))  # the index's own slots
        await refused(c, lambda: c.free_device(index_slots[:32]))
        c.free_device(slots)
        async with c.request(P + [1] * 16) as r:
            new = await r.alloc(r_new := 80 - r.cached_tokens)
            assert new.numel() == r_new
            for n in (-1, 1.5, "x", None):
                await refused(c, lambda n=n: r.alloc(n), req=r)
            full = torch.cat([r.prefix_indices, new])
            await refused(c, lambda: r.commit(P + [1] * 16, full.tolist()), req=r)
            await refused(c, lambda: r.commit(P + [1] * 16, full[:-1]), req=r)
            await refused(c, lambda: r.commit(P + [1] * 16, full.flip(0)), req=r)
            foreign = await c.alloc_device(16)
            await refused(
                c, lambda: r.commit(P + [1] * 16, torch.cat([full[:-16], foreign])), req=r
            )
            c.free_device(foreign)
            write_kv(c, P + [1] * 16, r.cached_tokens, new)
            await r.commit(P + [1] * 16, full)
            await refused(c, lambda: r.commit(P + [1] * 16, full), StateError, req=r)
        await c.wait_idle()
        check_accounting(c)


# -- the README's flow for every prompt -----------------------------------------------------


@pytest.mark.parametrize("length", [1, PS - 1, PS, PS + 1, 2 * PS, 4 * PS])
async def test_an_exact_repeat_always_leaves_a_token_to_compute(length: int) -> None:
    P = list(range(7, 7 + length))
    async with TierCache(config()) as c:
        for _ in range(2):
            async with c.request(P) as req:
                assert req.cached_tokens <= len(P) - 1
                assert req.cached_tokens == (len(P) - 1) // PS * PS or req.cached_tokens == 0
                slots = await req.alloc(len(P) - req.cached_tokens)
                assert slots.numel() >= 1
                write_kv(c, P, req.cached_tokens, slots)
                await req.commit(P, torch.cat([req.prefix_indices, slots]))
        await c.wait_idle()
        check_accounting(c)


# -- cancellation at every await ---------------------------------------------------------


async def test_cancelling_a_request_at_any_await_leaves_exact_accounting() -> None:
    """Two requests over one prefix on every tier; one is cancelled after k loop iterations."""
    P = list(range(100, 164))  # four pages
    for k in range(40):
        async with TierCache(config(device_tokens=128, alloc_timeout_s=2.0)) as c:
            await c.attach_storage(MemoryBackend())
            await serve(c, P[:32] + [1])
            await c.wait_idle()
            await serve(c, P + [1])  # pages 3-4 on device, 1-2 too; all on host and in storage
            await c.wait_idle()
            await c.evict_device(128)  # host and storage only
            await c.evict_host(16)  # the last page from storage only
            victim = asyncio.create_task(serve(c, P + [2]))
            other = asyncio.create_task(serve(c, P + [3]))
            for _ in range(k):
                await asyncio.sleep(0)
            victim.cancel()
            results = await asyncio.gather(victim, other, return_exceptions=True)
            assert isinstance(results[1], int), (k, results)
            assert isinstance(results[0], int | asyncio.CancelledError), (k, results)
            await c.wait_idle()
            check_accounting(c)
            assert not any(n.lock_ref or n.host_pin for n in c.index.nodes())
            assert await serve(c, P + [4]) == 64


async def test_slots_an_open_request_owns_are_only_its_own_to_commit_or_free() -> None:
    P = list(range(500, 532))
    async with TierCache(config()) as c:
        async with c.request([*P, 1]) as req:
            slots = await req.alloc(33)
            write_kv(c, [*P, 1], 0, slots)
            await refused(c, lambda: c.free_device(slots[:32]), req=req)
            await refused(c, lambda: c.insert(P, slots[:32]), req=req)
            async with c.request([9] * 33) as other:
                await refused(c, lambda: other.commit([9] * 33, slots), req=req)
            assert await req.commit([*P, 1], slots) == 0
        await c.wait_idle()
        check_accounting(c)
        assert c.controller.ledger.device.tokens_owned(Owner.REQUEST) == 0
        assert await serve(c, [*P, 2]) == 32


# -- the loop that opened the cache ------------------------------------------------------


async def test_calls_from_another_thread_or_loop_are_refused() -> None:
    """The bookkeeping is not thread-safe: a call off the cache's loop is a `StateError`."""
    P = list(range(700, 732))
    async with TierCache(config()) as c:
        await serve(c, [*P, 1])
        await c.wait_idle()
        node = c.match_prefix(P).index.last_node
        async with c.request([*P, 2]) as req:
            slots = await req.alloc(1)
            tokens, indices = [*P, 2], torch.cat([req.prefix_indices, slots])
            before = snapshot(c, req)

            def elsewhere() -> list[str]:
                out = []
                calls: list[Callable[[], Any]] = [
                    lambda: c.match_prefix(P),
                    lambda: c.lock(node),
                    lambda: c.free_device(slots),
                    lambda: asyncio.run(c.alloc_device(PS)),
                    lambda: asyncio.run(c.insert(P, indices[:32])),
                    lambda: asyncio.run(serve(c, [*P, 3])),
                    lambda: asyncio.run(req.alloc(PS)),
                    lambda: asyncio.run(req.commit(tokens, indices)),
                    lambda: asyncio.run(req.wait_loaded()),
                ]
                for call in calls:
                    try:
                        call()
                    except StateError as e:
                        out.append(str(e))
                return out

            errors = await asyncio.to_thread(elsewhere)
            assert len(errors) == 9
            assert all("event loop that opened it" in e for e in errors)
            assert snapshot(c, req) == before
            req.layer_ready(0)  # meant for worker threads: no load is pending here
            await asyncio.to_thread(req.layer_ready, 1)
            assert await req.commit(tokens, indices) == 32
        await c.wait_idle()
        check_accounting(c)


async def test_unlock_releases_only_locks_taken_with_lock() -> None:
    """A stray `unlock` must not drop a request's lock: its prefix would be evicted under it."""
    P = list(range(800, 864))
    async with TierCache(config()) as c:
        await serve(c, [*P, 1])
        await c.wait_idle()
        async with c.request([*P, 2]) as req:
            assert req.cached_tokens == 64
            node = c.match_prefix(P).index.last_device_node
            await refused(c, lambda: c.unlock(node), StateError, req=req)
            c.lock(node)
            c.lock(node)
            c.unlock(node)
            c.unlock(node)
            await refused(c, lambda: c.unlock(node), StateError, req=req)
            await c.evict_device(256)  # the request's prefix is locked: it stays
            assert_kv(c, [*P, 2], req.prefix_indices)
            slots = await req.alloc(1)
            write_kv(c, [*P, 2], 64, slots)
            assert await req.commit([*P, 2], torch.cat([req.prefix_indices, slots])) == 64
        await c.wait_idle()
        check_accounting(c)
        assert not any(n.lock_ref for n in c.index.nodes())


async def test_a_match_or_node_of_another_cache_is_refused() -> None:
    """Two caches of one shape number their slots and nodes alike: a match taken on one
    and passed to the other named the first one's host slots, and its load attached
    the second one's device slots to the first one's nodes (wrong KV on the first)."""
    P = list(range(900, 948))
    Q = list(range(300, 348))
    async with TierCache(config()) as a, TierCache(config()) as b:
        await b.attach_storage(MemoryBackend())
        await serve(a, [*P, 1])
        await serve(b, [*Q, 1])
        await a.wait_idle()
        await a.evict_device(256)  # P is on a's host only
        host_match = a.match_prefix(P)
        assert host_match.host_tokens == 48
        await serve(a, [*Q, 2])  # a's device holds other KV now
        device_match = a.match_prefix(Q)
        root_match = a.match_prefix([7] * 48)  # nothing cached: a's root
        node = device_match.index.last_device_node
        for m in (host_match, device_match, root_match):
            await refused(b, lambda m=m: b.load_back(m), StateError)
            await refused(b, lambda m=m: b.prefetch(P, m), StateError)
        await refused(b, lambda: b.lock(node), StateError)
        await refused(b, lambda: b.unlock(node), StateError)
        assert node.lock_ref == 0
        assert await serve(a, [*P, 3]) == 48  # a's KV, from a's host
        assert await serve(b, [*Q, 3]) == 48
        for c in (a, b):
            await c.wait_idle()
            check_accounting(c)


@pytest.mark.parametrize("bad", [None, 3, [1], "node"])
async def test_unlock_of_what_is_not_a_node_is_invalid_input(bad: Any) -> None:
    """`unlock` documents InvalidInputError for a non-Node (as `lock` raises); it said
    StateError ("holds no lock"), and a list was a raw TypeError (unhashable)."""
    async with TierCache(config()) as c:
        await serve(c, [*range(64), 1])
        await refused(c, lambda: c.lock(bad), InvalidInputError)
        await refused(c, lambda: c.unlock(bad), InvalidInputError)


async def test_an_engines_own_pool_and_allocator_are_checked_then_shared() -> None:
    """`TierCache(device_pool=..., device_allocator=...)`: anything but a pool and an
    allocator was a raw AttributeError at open, and a pool of another shape was
    reported as "device and host pools differ"."""
    lay = config().layout()
    other = KVLayout(2, 2, 4, torch.float32, PS)
    for kwargs, message in [
        ({"device_pool": "pool"}, "device_pool must be a DeviceKVPool"),
        ({"device_pool": DeviceKVPool(other, 256)}, "the config describes"),
        ({"device_allocator": [0, 16]}, "device_allocator must be a PageAllocator"),
        (
            {"device_pool": DeviceKVPool(lay, 256), "device_allocator": object()},
            "device_allocator must be a PageAllocator",
        ),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            TierCache(config(), **kwargs)
    host = HostKVPool(lay, 64)
    with pytest.raises(InvalidInputError, match="device_pool must be a DeviceKVPool"):
        TierController("pool", host)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="host_pool must be a HostKVPool"):
        TierController(DeviceKVPool(lay, 256), None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="host_allocator must be a PageAllocator"):
        TierController(DeviceKVPool(lay, 256), host, host_allocator=1)  # type: ignore[arg-type]
    # The right ones are used as they are: the engine's allocator is the cache's.
    pool, alloc = DeviceKVPool(lay, 256), PageAllocator(256, PS)
    async with TierCache(config(), device_pool=pool, device_allocator=alloc) as c:
        assert c.device_pool is pool and c.controller.device_allocator is alloc
        await serve(c, [*range(40), 1])
        assert await serve(c, [*range(40), 2]) == 32
        assert alloc.used == c.index.total_device_tokens() == 32


async def test_flush_refuses_while_alloc_device_slots_are_not_inserted_or_freed() -> None:
    """flush reset the device allocator under slots a caller had from `alloc_device`:
    the next `alloc_device` handed the same slots out again, and two callers wrote
    their KV into one place."""
    P = list(range(600, 632))
    async with TierCache(config()) as c:
        await serve(c, [*P, 1])
        await c.wait_idle()
        mine = await c.alloc_device(32)
        await refused(c, c.flush, StateError)
        write_kv(c, [*range(32)], 0, mine)
        assert await c.insert([*range(32)], mine) == 0
        await c.flush()  # everything it held is the index's: it may go
        assert c.controller.device_allocator.used == 0
        mine = await c.alloc_device(16)
        c.free_device(mine)
        await c.flush()
        check_accounting(c)


@pytest.mark.parametrize("steps", [[1, 9], [3, 3, 3, 3], [16, 4], [0, 2, 0, 30]])
async def test_prompt_and_generated_tokens_commit_from_successive_allocs(steps: list[int]) -> None:
    """`commit` takes the prompt plus generated tokens, with the slots of the
    request's allocs in order; but each `alloc` began a new page, so a prompt
    that left a page part-filled made every such commit a refused
    "not page-aligned" one, and the generated tokens' KV was never cached."""
    P = list(range(700, 707 + PS))  # not a whole number of pages
    async with TierCache(config()) as c:
        async with c.request(P) as req:
            tokens = list(P)
            slots = [req.prefix_indices, await req.alloc(len(P) - req.cached_tokens)]
            for i, n in enumerate(steps):  # decode steps
                new = await req.alloc(n)
                assert new.numel() == n
                slots.append(new)
                tokens += [5 + i] * n
            full = torch.cat(slots)
            write_kv(c, tokens, 0, full)
            assert await req.commit(tokens, full) == 0
        await c.wait_idle()
        check_accounting(c)  # the uncommitted tail went back at the end
        async with c.request([*tokens, 2]) as other:
            await other.alloc(1)  # the rest of its page is spare now
            with pytest.raises(StateError, match="another thread"):
                await asyncio.to_thread(asyncio.run, other.alloc(1))
        whole = len(tokens) // PS * PS
        async with c.request([*tokens, 1]) as again:
            assert again.cached_tokens == whole
            assert_kv(c, tokens, again.prefix_indices)


async def test_attaching_a_closed_backend_is_refused() -> None:
    """A closed backend was attached as if open: every call then failed, the fault
    policy took that for an outage and probed it for ever, and nothing said why."""
    closed = MemoryBackend()
    await closed.aclose()
    async with TierCache(config()) as c:
        with pytest.raises(BackendUnavailableError, match="closed"):
            await c.attach_storage(closed)
        assert not c.controller.storage_attached
        await c.attach_storage(MemoryBackend())  # an open one attaches
        assert c.controller.storage_attached


async def test_the_index_never_shares_a_slot_tensor_with_its_caller() -> None:
    """insert and commit kept the caller's slot tensor as the node's, and
    match_prefix / prefix_indices handed the node's own tensor out: an engine
    that reused its index buffer (as one does with a per-request slot table)
    moved the index onto other slots, and served their KV as this prompt's."""
    P = list(range(400, 432))
    Q = list(range(500, 532))
    async with TierCache(config(write_policy="write_back")) as c:
        slots = await c.alloc_device(32)
        write_kv(c, P, 0, slots)
        await c.insert(P, slots)
        slots.fill_(0)  # the caller's buffer, reused
        async with c.request([*Q, 1]) as req:
            new = await req.alloc(33)
            write_kv(c, [*Q, 1], 0, new)
            full = torch.cat([req.prefix_indices, new])
            await req.commit([*Q, 1], full)
            full.fill_(0)
            new.fill_(0)
        for tokens in (P, Q):
            m = c.match_prefix(tokens)
            assert m.device_tokens == 32
            assert_kv(c, tokens, m.device_indices)
            m.device_indices.fill_(0)  # what a match returns is the caller's too
            async with c.request([*tokens, 2]) as again:
                assert_kv(c, tokens, again.prefix_indices)
                again.prefix_indices.fill_(0)
        await c.wait_idle()
        check_accounting(c)
        for tokens in (P, Q):
            assert await serve(c, [*tokens, 3]) == 32
