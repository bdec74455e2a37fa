"""Slots a load back is still filling are never handed out as device-resident.

A load back attaches device slots to the index before their bytes land. While
it is in flight, `match_prefix` reports those tokens as host hits (not on the
device), and `load_back` of the same prefix, by any caller, returns the slots
only together with the handle of the load that fills them: whoever reads them
waits for that handle first, and reads the KV, never what the slots held before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import StateError
from tiercache.transfer.engine import CopyEngine

PS = 16
LAYERS = 2
#: 1.5 MiB of KV in the load: the size the copy worker (not the loop) moves.
HEADS, DIM = 8, 96


def config() -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype="float32",
        page_size=PS,
        device_tokens=2048,
        host_tokens=4096,
        model="in-flight",
    )


def kv_of(tokens: list[int], layer: int, b: int) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    return (t * 0.001 + layer + b * 0.5 + 1.0)[:, None, None].expand(-1, HEADS, DIM)


def kv_is(cache: TierCache, tokens: list[int], slots: torch.Tensor) -> bool:
    return all(
        torch.equal(buf[slots], kv_of(tokens, layer, b))
        for b, bufs in enumerate(cache.device_pool.buffers)
        for layer, buf in enumerate(bufs)
    )


async def cached_on_host_only(cache: TierCache, tokens: list[int]) -> None:
    """Insert ``tokens``' KV, write it to host, evict it from the device, zero the device."""
    slots = await cache.alloc_device(len(tokens))
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            buf[slots] = kv_of(tokens, layer, b)
    await cache.insert(tokens, slots)
    await cache.wait_idle()
    assert await cache.evict_device(len(tokens)) == len(tokens)
    for bufs in cache.device_pool.buffers:
        for buf in bufs:
            buf.zero_()


@contextlib.contextmanager
def slow_load(cache: TierCache) -> Iterator[threading.Event]:
    """Hold every load in the copy worker until the yielded event is set."""
    engine = cache.controller.engine
    gate = threading.Event()

    def load_layer(i: int, plan: Any) -> None:
        gate.wait(10)
        CopyEngine.load_layer(engine, i, plan)

    cache.controller.inline_copy_bytes = 0
    engine.load_layer = load_layer  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del engine.load_layer


async def test_match_prefix_does_not_report_a_loading_prefix_as_on_device() -> None:
    P = list(range(1000, 1000 + 32 * PS))
    async with TierCache(config()) as c:
        await cached_on_host_only(c, P)
        with slow_load(c) as gate:
            before = c.match_prefix(P)
            slots, handle = await c.load_back(before)
            assert handle is not None and not handle.done()
            during = c.match_prefix(P)
            # The slots hold zeros until the load lands: not device-resident.
            assert (during.device_tokens, during.host_tokens) == (0, len(P))
            assert during.device_indices.numel() == 0
            gate.set()
            await handle
        after = c.match_prefix(P)
        assert (after.device_tokens, after.host_tokens) == (len(P), 0)
        assert torch.equal(after.device_indices, slots) and kv_is(c, P, slots)


@pytest.mark.parametrize("which", ["match before the load", "match during the load"])
async def test_a_second_load_back_gets_the_handle_of_the_load_in_flight(which: str) -> None:
    P = list(range(2000, 2000 + 32 * PS))
    async with TierCache(config()) as c:
        await cached_on_host_only(c, P)
        with slow_load(c) as gate:
            first = c.match_prefix(P)
            slots, handle = await c.load_back(first)
            assert handle is not None
            m = first if which == "match before the load" else c.match_prefix(P)
            again, other = await c.load_back(m)
            # The same slots, with the handle whose bytes they wait for: nothing
            # loaded twice, and nothing handed out without a way to wait.
            assert torch.equal(again, slots)
            assert other is handle and not other.done()
            gate.set()
            await other
            assert kv_is(c, P, again)
        await c.wait_idle()
        c.controller.ledger.check_invariants()


async def test_a_load_back_under_two_loads_in_flight_waits_for_the_first() -> None:
    P = list(range(3000, 3000 + 8 * PS))
    Q = [*P, *range(5000, 5000 + 8 * PS)]
    async with TierCache(config()) as c:
        await cached_on_host_only(c, Q)
        with slow_load(c) as gate:
            # Two loads: P's pages, then the rest of Q's under them.
            _, h1 = await c.load_back(c.match_prefix(P))
            # The node of P was split from Q's: the rest loads on its own.
            m = c.match_prefix(Q)
            assert (m.device_tokens, m.host_tokens) == (0, len(Q))
            gate.set()
            slots, h2 = await c.load_back(m)
            assert h1 is not None and h1.done()  # waited for before the slots came back
            if h2 is not None:
                await h2
            assert kv_is(c, Q, slots)


async def test_a_failed_load_in_flight_is_reported_to_the_second_caller() -> None:
    P = list(range(4000, 4000 + 32 * PS))
    async with TierCache(config()) as c:
        await cached_on_host_only(c, P)
        engine = c.controller.engine
        gate = threading.Event()

        def load_all_layers(plan: Any, on_layer: Any = None) -> None:
            gate.wait(10)
            raise RuntimeError("injected copy failure")

        c.controller.inline_copy_bytes = 0
        engine.load_all_layers = load_all_layers  # type: ignore[method-assign]
        try:
            _, handle = await c.load_back(c.match_prefix(P))
            _, other = await c.load_back(c.match_prefix(P))
            assert other is handle is not None
            gate.set()
            with pytest.raises(RuntimeError, match="injected"):
                await other
        finally:
            gate.set()
            del engine.load_all_layers
        await c.wait_idle()
        m = c.match_prefix(P)
        assert (m.device_tokens, m.host_tokens) == (0, len(P))
        slots, h = await c.load_back(m)
        assert h is not None
        await h
        assert kv_is(c, P, slots)
        with pytest.raises(StateError):
            c.unlock(m.index.last_node)
