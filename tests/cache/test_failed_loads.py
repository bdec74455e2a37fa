"""A host->device load that fails leaves no wrong KV behind.

Faults are injected into the copy engine's ``load_layer`` at every layer. After
each failure: the index no longer claims those pages on the device, the
allocators account exactly for what the index holds, nothing stays locked, and
a retry loads the prefix again and serves bit-identical KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import InvalidInputError, StateError
from tiercache.ledger import Owner
from tiercache.transfer.engine import CopyEngine

PS = 16
LAYERS = 3


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=256,
        host_tokens=512,
        model="failed-loads",
    )
    base.update(kw)
    return TierCacheConfig(**base)


def kv_of(tokens: list[int], layer: int, b: int) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    return (t * 0.001 + pos * 0.01 + layer + b * 0.5)[:, None, None].expand(-1, 1, 4)


def assert_kv(cache: TierCache, tokens: list[int], slots: torch.Tensor) -> None:
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            assert torch.equal(buf[slots], kv_of(tokens, layer, b)[: slots.numel()]), (layer, b)


async def commit(cache: TierCache, tokens: list[int]) -> None:
    """Serve ``tokens`` plus one more (the cache always leaves one to compute) and commit."""
    full = [*tokens, 0]
    async with cache.request(full) as req:
        await req.wait_loaded()
        slots = await req.alloc(len(full) - req.cached_tokens)
        for b, bufs in enumerate(cache.device_pool.buffers):
            for layer, buf in enumerate(bufs):
                buf[slots] = kv_of(full, layer, b)[req.cached_tokens :]
        await req.commit(full, torch.cat([req.prefix_indices, slots]))


def check_clean(cache: TierCache) -> None:
    ctl = cache.controller
    cache.index.check_invariants()
    assert ctl.device_allocator.used == cache.index.total_device_tokens()
    assert ctl.host_allocator.used == cache.index.total_host_tokens()
    ctl.ledger.check_invariants()
    assert ctl.ledger.device.tokens_owned(Owner.INDEX) == cache.index.total_device_tokens()
    assert not any(n.lock_ref for n in cache.index.nodes())
    assert not cache._ops.loads


@contextlib.contextmanager
def failing_layer(cache: TierCache, layer: int) -> Iterator[list[int]]:
    """Make the copy engine's ``load_layer`` raise for ``layer``; yields the calls seen."""
    engine = cache.controller.engine
    calls: list[int] = []

    def load_layer(i: int, plan: Any) -> None:
        calls.append(i)
        if i == layer:
            raise RuntimeError(f"injected copy failure at layer {i}")
        CopyEngine.load_layer(engine, i, plan)

    engine.load_layer = load_layer  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del engine.load_layer


@pytest.mark.parametrize("layer", range(LAYERS))
async def test_a_failed_load_leaves_no_wrong_kv_and_a_retry_serves_it(layer: int) -> None:
    P = list(range(100, 164))
    async with TierCache(config()) as c:
        await commit(c, P)
        await c.wait_idle()
        assert await c.evict_device(256) == 64
        for bufs in c.device_pool.buffers:
            for buf in bufs:
                buf.zero_()
        with failing_layer(c, layer) as calls:
            async with c.request(P + [1]) as r1:
                assert r1.cached_tokens == 64
                with pytest.raises(RuntimeError, match="injected"):
                    await r1.wait_loaded()
                # The index gave the pages back to the host tier at once.
                m = c.match_prefix(P)
                assert (m.device_tokens, m.host_tokens) == (0, 64)
                # A commit over a prefix that did not land is refused.
                slots = await r1.alloc(1)
                with pytest.raises(StateError):
                    await r1.commit(P + [1], torch.cat([r1.prefix_indices, slots]))
            assert layer in calls
        await c.wait_idle()
        check_clean(c)
        async with c.request(P + [3]) as r3:
            assert r3.cached_tokens == 64 and r3.loads
            await r3.wait_loaded()
            assert_kv(c, P, r3.prefix_indices)
        await c.wait_idle()
        check_clean(c)


@pytest.mark.parametrize("layer", range(LAYERS))
async def test_concurrent_requests_on_a_failing_load_all_see_it_fail(layer: int) -> None:
    """Requests sharing a failing load, and one loading a deeper prefix on top of it."""
    P = list(range(100, 164))
    Q = P + list(range(700, 732))
    async with TierCache(config()) as c:
        await commit(c, Q)
        await c.wait_idle()
        assert await c.evict_device(256) == 96
        with failing_layer(c, layer):

            async def req(tokens: list[int]) -> tuple[int, bool]:
                async with c.request(tokens) as r:
                    try:
                        await r.wait_loaded()
                    except RuntimeError:
                        return r.cached_tokens, False
                    assert_kv(c, tokens, r.prefix_indices)
                    return r.cached_tokens, True

            results = await asyncio.gather(req(P + [1]), req(P + [2]), req(Q + [3]))
        assert all(not ok for _, ok in results), results
        await c.wait_idle()
        check_clean(c)
        assert c.match_prefix(Q).device_tokens == 0
        got = await asyncio.gather(req(P + [1]), req(Q + [3]))
        assert got == [(64, True), (96, True)]
        await c.wait_idle()
        check_clean(c)


async def test_insert_over_a_failed_load_is_refused() -> None:
    P = list(range(100, 132))
    async with TierCache(config()) as c:
        await commit(c, P)
        await c.wait_idle()
        await c.evict_device(256)
        more = await c.alloc_device(16)
        with failing_layer(c, 0):
            m = c.match_prefix(P)
            prefix, handle = await c.load_back(m)
            assert handle is not None
            # Refused whether the failure is still in flight (StateError) or
            # already rolled back (the prefix slots are no longer allocated).
            with pytest.raises((StateError, InvalidInputError)):
                await c.insert(P + [5] * 16, torch.cat([prefix, more]))
        assert c.match_prefix(P + [5] * 16).device_tokens == 0
        c.free_device(more)
        await c.wait_idle()
        check_clean(c)


@contextlib.contextmanager
def gated_load(cache: TierCache, *, fail: bool) -> Iterator[threading.Event]:
    """Hold every load in the copy worker until the yielded event is set; then fail it or not."""
    engine = cache.controller.engine
    gate = threading.Event()

    def load_layer(i: int, plan: Any) -> None:
        gate.wait(10)
        if fail:
            raise RuntimeError(f"injected copy failure at layer {i}")
        CopyEngine.load_layer(engine, i, plan)

    cache.controller.inline_copy_bytes = 0  # the load runs in the worker, held at the gate
    engine.load_layer = load_layer  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del engine.load_layer


async def write_own(cache: TierCache, tokens: list[int]) -> torch.Tensor:
    """Slots of the caller's own holding ``tokens``' KV, computed without the cache."""
    slots = await cache.alloc_device(len(tokens))
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            buf[slots] = kv_of(tokens, layer, b)
    return slots


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("fail", [True, False], ids=["load-fails", "load-lands"])
@pytest.mark.parametrize("via", ["insert", "request"])
async def test_kv_computed_apart_over_a_loading_prefix(
    write_policy: str, fail: bool, via: str
) -> None:
    """KV computed without the cache, inserted while the same prefix loads back.

    Its caller has the whole prefix in its own slots, so its insert does not
    depend on the load: it waits for it, and then hangs its pages under a
    prefix that landed (or, when the load failed, under its own copy of it,
    which the index takes: the prefix was on the host only by then, so the
    insert reports no device-cached tokens). Nothing ends up on the device
    under a prefix whose bytes never arrived.
    """
    landed = 0 if fail else 64
    P = list(range(100, 164))
    Q = P + list(range(700, 732))
    async with TierCache(config(write_policy=write_policy)) as c:
        await commit(c, P)
        await c.wait_idle()
        if write_policy == "write_back":
            assert await c.evict_device(256) == 64  # written back on the way out
        else:
            await c.evict_device(256)
        own = await write_own(c, Q)
        with gated_load(c, fail=fail) as gate:
            if via == "insert":
                prefix, handle = await c.load_back(c.match_prefix(P))
                assert handle is not None
                inserting = asyncio.create_task(c.insert(Q, own))
                await asyncio.sleep(0.01)
                pass  # it waits for the load of its prefix
                gate.set()
                if fail:
                    with pytest.raises(RuntimeError, match="injected"):
                        await handle
                else:
                    await handle
                assert await inserting == landed
            else:
                async with c.request(P + [1]) as loading:
                    inserting = asyncio.create_task(c.insert(Q, own))
                    await asyncio.sleep(0.01)
                    assert not inserting.done()
                    gate.set()
                    try:
                        await loading.wait_loaded()
                    except RuntimeError:
                        assert fail
                    assert await inserting == landed
        await c.wait_idle()
        check_clean(c)
        m = c.match_prefix(Q)
        assert m.index.matched_length == 96
        if fail:  # the caller's own copy of the prefix replaced the one that did not land
            assert m.device_tokens == 96 and torch.equal(m.device_indices, own)
        async with c.request(Q + [9]) as r:
            await r.wait_loaded()
            assert r.cached_tokens == 96
            assert_kv(c, Q, r.prefix_indices)
        await c.wait_idle()
        check_clean(c)
