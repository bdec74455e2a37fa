"""Stream order and copy lifetimes on a real GPU (the `gpu` marker: skipped without CUDA).

Each race is made deterministic by queuing a calibrated spin kernel
(``torch.cuda._sleep``) on the stream that ought to be waited for: if the copy
did not wait for it, it would certainly run first and the test would see the
wrong bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.transfer.engine import TransferPlan

pytestmark = pytest.mark.gpu

LAYERS = 2
PS = 16
SPIN_MS = 300.0


class CopyFault(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _sync() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


def spin(cycles_per_ms: float, ms: float = SPIN_MS) -> None:
    """Queue ``ms`` of GPU busy-wait on the current stream."""
    torch.cuda._sleep(int(cycles_per_ms * ms))


def make(device_slots: int = 512, host_slots: int = 2048, **kw: Any) -> TierController:
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    return TierController(
        DeviceKVPool(lay, device_slots, device="cuda"), HostKVPool(lay, host_slots), **kw
    )


def fill(c: TierController, slots: torch.Tensor, value: float) -> None:
    """Write ``value`` into every layer of ``slots`` on the current stream."""
    idx = slots.to(c.device_pool.device)
    for buf in c.device_pool.buffers:
        for t in buf:
            t.index_fill_(0, idx, value)


def device_values(c: TierController, slots: torch.Tensor) -> set[float]:
    idx = slots.to(c.device_pool.device)
    return {
        float(v) for buf in c.device_pool.buffers for t in buf for v in t[idx].unique().tolist()
    }


def host_values(c: TierController, slots: torch.Tensor) -> set[float]:
    return {
        float(v)
        for b in range(c.layout.num_buffers)
        for layer in range(LAYERS)
        for v in c.host_pool.layer(b, layer)[slots].unique().tolist()
    }


# -- a slow producer on another stream, then a backup --------------------------------


@pytest.mark.parametrize("how", ["ready_stream", "ready_event", "stream_context"])
async def test_a_backup_waits_for_a_slow_producer_on_a_side_stream(
    cycles_per_ms: float, how: str
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(256)
        assert src is not None
        fill(c, src, 1.0)
        producer = torch.cuda.Stream()
        producer.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(producer):
            spin(cycles_per_ms)  # the forward pass is still running ...
            fill(c, src, 7.0)  # ... and writes the KV last
        if how == "ready_stream":
            ack = c.submit_write(src, ready=producer)
        elif how == "ready_event":
            ev = torch.cuda.Event()
            ev.record(producer)
            ack = c.submit_write(src, ready=ev)
        else:
            with torch.cuda.stream(producer):
                ack = c.submit_write(src)  # default: the caller's current stream
        assert ack is not None
        await ack
        assert host_values(c, ack.host_indices) == {7.0}


async def test_commit_orders_the_backup_after_the_forward_stream(cycles_per_ms: float) -> None:
    cfg = TierCacheConfig(
        num_layers=LAYERS,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        page_size=PS,
        device="cuda",
        device_tokens=1024,
        write_policy="write_through",
    )
    prompt = list(range(100, 100 + 8 * PS))
    async with TierCache(cfg) as cache:
        ctl = cache.controller
        forward = torch.cuda.Stream()
        async with cache.request(prompt) as req:
            slots = await req.alloc(len(prompt))
            forward.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(forward):
                spin(cycles_per_ms)
                fill(ctl, slots, 5.0)
            await req.commit(prompt, slots, ready=forward)
        await cache.wait_idle()
        node = cache.index.match_prefix(prompt, None, touch=False)
        host = node.last_node.host_indices
        assert host is not None
        assert host_values(ctl, host) == {5.0}


# -- a reader still queued on freed slots, then a load into them -----------------------


@pytest.mark.parametrize("how", ["free_ready", "load_ready"])
async def test_a_load_into_freed_slots_waits_for_their_queued_reader(
    cycles_per_ms: float, how: str
) -> None:
    async with make(device_slots=256) as c:
        src = c.device_allocator.alloc(256)  # every device slot
        assert src is not None
        fill(c, src, 1.0)
        host = await c.backup(src)  # the KV the load brings back: 1.0
        assert host is not None
        fill(c, src, 2.0)  # what the slots hold now, for a reader
        reader = torch.cuda.Stream()
        reader.wait_stream(torch.cuda.current_stream())
        idx = src.cuda()
        with torch.cuda.stream(reader):
            spin(cycles_per_ms)  # attention of the previous batch, still queued
            seen = [t[idx].clone() for buf in c.device_pool.buffers for t in buf]
        if how == "free_ready":
            c.free_device(src, ready=reader)
            dst = c.load(host)
        else:
            c.free_device(src)
            dst = c.load(host, ready=reader)
        assert dst is not None
        assert sorted(dst.tolist()) == sorted(src.tolist())  # the very slots just freed
        handle = c.start_loading()
        assert handle is not None
        await handle
        reader.synchronize()
        for s in seen:
            assert bool((s == 2.0).all()), "the load overwrote slots a queued reader still read"
        assert device_values(c, dst) == {1.0}


# -- wait_layer_device from a thread whose current device is another ---------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_wait_layer_device_waits_on_the_pools_device_from_a_thread_on_another(
    cycles_per_ms: float,
) -> None:
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    dev1 = torch.device("cuda", 1)
    c = TierController(DeviceKVPool(lay, 512, device=dev1), HostKVPool(lay, 1024))
    async with c:
        src = c.device_allocator.alloc(128)
        assert src is not None
        with torch.cuda.device(dev1):
            fill(c, src, 3.0)
            host = await c.backup(src)
            assert host is not None
            fill(c, src, 0.0)
            load_stream = c._copies.load_stream.cuda_stream if c._copies.load_stream else None
            assert load_stream is not None
            with torch.cuda.stream(load_stream):
                spin(cycles_per_ms)  # the load's copies run late
            dst = c.load(host)
            assert dst is not None
            handle = c.start_loading()
            assert handle is not None
        idx = dst.to(dev1)

        def forward() -> list[torch.Tensor]:
            torch.cuda.set_device(0)  # this thread's current device is not the pool's
            out = []
            for layer in range(LAYERS):
                handle.wait_layer_device(layer)
                with torch.cuda.device(dev1):
                    out.append(c.device_pool.buffers[0][layer][idx].clone())
            torch.cuda.synchronize(dev1)
            return out

        got = await asyncio.to_thread(forward)
        await handle
        for t in got:
            assert bool((t == 3.0).all()), "the layer was read before its copy landed"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_a_cache_on_cuda_takes_the_calling_threads_current_device() -> None:
    cfg = TierCacheConfig(
        num_layers=LAYERS, num_kv_heads=4, head_dim=64, dtype="float16", page_size=PS,
        device="cuda", device_tokens=256,
    )  # fmt: skip
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        async with TierCache(cfg) as cache:
            assert cache.device_pool.device == torch.device("cuda", 1)
    finally:
        torch.cuda.set_device(previous)


# -- a copy that fails in the middle of a job -------------------------------------


async def test_a_load_that_fails_mid_job_settles_before_it_reports(cycles_per_ms: float) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(256)
        assert src is not None
        fill(c, src, 4.0)
        host = await c.backup(src)
        assert host is not None
        c.free_device(src)
        free_before = c.device_allocator.available
        original = c.engine.load_layer
        stream = c._copies.load_stream.cuda_stream if c._copies.load_stream else None
        assert stream is not None

        def faulty(layer: int, plan: TransferPlan) -> None:
            if layer == 0:
                spin(cycles_per_ms)  # on the copy stream: layer 0's copy lands late
                original(layer, plan)
                return
            raise CopyFault("a device temporary ran out of memory")

        c.engine.load_layer = faulty  # type: ignore[method-assign]
        ack = c.submit_load(host)
        assert ack is not None
        handle = c.start_loading()
        assert handle is not None
        with pytest.raises(CopyFault):
            await handle
        assert stream.query(), "the failure was reported while its copy still ran"
        with pytest.raises(CopyFault):
            await ack
        c.free_device(ack.device_indices)
        assert c.device_allocator.available == free_before
        c.engine.load_layer = original  # type: ignore[method-assign]
        again = await c.load_back(host)
        assert again is not None
        assert device_values(c, again) == {4.0}


async def test_a_backup_that_fails_after_queuing_settles_before_its_host_slots_go(
    cycles_per_ms: float,
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(256)
        assert src is not None
        fill(c, src, 6.0)
        host_free = c.host_allocator.available
        original = c.engine.backup_all_layers
        stream = c._copies.write_stream.cuda_stream if c._copies.write_stream else None
        assert stream is not None
        freed_while_running: list[bool] = []
        free = c.host_allocator.free_pages  # what the ledger frees through

        def watched_free(pages: Any, *a: Any, **k: Any) -> Any:
            freed_while_running.append(not stream.query())
            return free(pages, *a, **k)

        c.host_allocator.free_pages = watched_free  # type: ignore[method-assign]

        def faulty(plan: TransferPlan) -> None:
            spin(cycles_per_ms)
            original(plan)
            raise CopyFault("after queuing")

        c.engine.backup_all_layers = faulty  # type: ignore[method-assign]
        with pytest.raises(CopyFault):
            await c.backup(src)
        assert freed_while_running == [False]
        assert c.host_allocator.available == host_free
        c.engine.backup_all_layers = original  # type: ignore[method-assign]
        h = await c.backup(src)
        assert h is not None
        assert host_values(c, h) == {6.0}


# -- the host is not blocked while the GPU is busy -------------------------------------


async def test_start_loading_and_wait_layer_device_do_not_block_the_host(
    cycles_per_ms: float,
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(256)
        assert src is not None
        fill(c, src, 8.0)
        host = await c.backup(src)
        assert host is not None
        c.free_device(src)
        spin(cycles_per_ms, 2 * SPIN_MS)  # the compute stream is busy
        t0 = time.perf_counter()
        first = c.load(host)
        h1 = c.start_loading()
        submit_s = time.perf_counter() - t0
        assert first is not None and h1 is not None
        # A second load while the first still waits on the device.
        second = c.load(host)
        h2 = c.start_loading()
        assert second is not None and h2 is not None

        def forward() -> float:
            t = time.perf_counter()
            for layer in range(LAYERS):
                h1.wait_layer_device(layer)
                h2.wait_layer_device(layer)
            return time.perf_counter() - t

        wait_s = await asyncio.to_thread(forward)
        limit = SPIN_MS / 1000 / 2
        assert submit_s < limit, f"load + start_loading blocked the host {submit_s:.3f} s"
        assert wait_s < limit, f"wait_layer_device blocked the host {wait_s:.3f} s"
        await h1
        await h2
        assert device_values(c, first) == {8.0}
        assert device_values(c, second) == {8.0}


# -- pinned host memory ---------------------------------------------------------------


def test_the_host_pool_pins_its_own_size_not_a_power_of_two(cycles_per_ms: float) -> None:
    lay = KVLayout(2, 8, 128, torch.float16, 64)  # 8 KiB a token
    slots = (40 * 2**20 + 5 * 64 * 8192) // lay.token_bytes  # 40 MiB and 5 pages
    slots -= slots % 64
    pool = HostKVPool(lay, slots)
    assert pool.pinned and pool.buffer.is_pinned()
    assert pool.nbytes <= pool.pinned_bytes < pool.nbytes + 4096
    # Pinned for real: an asynchronous copy out of it returns before the GPU gets to it.
    dst = torch.empty(pool.buffer.numel(), dtype=pool.buffer.dtype, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        spin(cycles_per_ms)
        t0 = time.perf_counter()
        dst.copy_(pool.buffer.view(-1), non_blocking=True)
        queued_s = time.perf_counter() - t0
    s.synchronize()
    assert queued_s < SPIN_MS / 1000 / 2, f"the copy blocked the host {queued_s:.3f} s: pageable"
    del pool
