"""The ledger's fences on a real GPU (the `gpu` marker: skipped without CUDA).

The same rules as tests/controller/test_fences.py checks on a CPU with a
recorder. Each race is made deterministic with a calibrated spin kernel
(``torch.cuda._sleep``) on the stream that ought to be waited for: a copy that
did not wait for it would certainly run first, and the test would see wrong bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.transfer.engine import CopyEngine, TransferPlan

pytestmark = pytest.mark.gpu

LAYERS = 2
PS = 16
SPIN_MS = 300.0


@pytest.fixture(autouse=True)
def _sync() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


def spin(cycles_per_ms: float, ms: float = SPIN_MS) -> None:
    torch.cuda._sleep(int(cycles_per_ms * ms))


def controller(device_pages: int) -> TierController:
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    return TierController(
        DeviceKVPool(lay, device_pages * PS, device="cuda"), HostKVPool(lay, 64 * PS)
    )


def cache_config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=LAYERS,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        page_size=PS,
        device="cuda",
        device_tokens=8 * PS,
        host_tokens=32 * PS,
    )
    return TierCacheConfig(**{**base, **kw})


def fill(pool: DeviceKVPool, slots: torch.Tensor, value: float, layer: int | None = None) -> None:
    idx = slots.to(pool.device)
    for buf in pool.buffers:
        for i, t in enumerate(buf):
            if layer is None or i == layer:
                t.index_fill_(0, idx, value)


def values(pool: DeviceKVPool, slots: torch.Tensor) -> set[float]:
    idx = slots.to(pool.device)
    return {float(v) for buf in pool.buffers for t in buf for v in t[idx].unique().tolist()}


def host_values(pool: HostKVPool, slots: torch.Tensor) -> set[float]:
    return {
        float(v)
        for b in range(pool.layout.num_buffers)
        for layer in range(LAYERS)
        for v in pool.layer(b, layer)[slots].unique().tolist()
    }


# -- class 2: writes the cache starts itself wait for the producer ----------------------


@pytest.mark.parametrize("how", ["write_back", "write_through_selective", "compute_stream"])
async def test_a_write_the_cache_starts_itself_waits_for_the_forward_stream(
    cycles_per_ms: float, how: str
) -> None:
    policy = "write_back" if how == "compute_stream" else how
    cfg = cache_config(write_policy=policy, write_through_threshold=1)
    tokens = list(range(100, 100 + 4 * PS))
    async with TierCache(cfg) as cache:
        forward = torch.cuda.Stream()
        if how == "compute_stream":
            cache.use_compute_stream(forward)
        slots = await cache.alloc_device(len(tokens))
        fill(cache.device_pool, slots, 1.0)
        forward.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(forward):
            spin(cycles_per_ms)  # the forward pass still runs ...
            fill(cache.device_pool, slots, 5.0)  # ... and writes the KV last
        await cache.insert(tokens, slots, ready=None if how == "compute_stream" else forward)
        if how == "write_through_selective":
            cache.match_prefix(tokens)  # reaches the threshold: written now
        else:
            assert await cache.evict_device(len(tokens)) == len(tokens)  # written back first
        await cache.wait_idle()
        node = cache.index.match_prefix(tokens, None, touch=False).last_node
        assert node.host_indices is not None
        assert host_values(cache.host_pool, node.host_indices) == {5.0}


# -- class 3: a failing load keeps the fences of freed slots ------------------------------


async def test_a_failing_load_keeps_the_fences_of_slots_freed_before_it(
    cycles_per_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with controller(device_pages=8) as c:
        pool = c.device_pool
        src = c.device_allocator.alloc(2 * PS)
        rest = c.device_allocator.alloc(6 * PS)
        assert src is not None and rest is not None
        fill(pool, rest, 1.0)
        kv = await c.backup(rest)  # what the later load brings back: 1.0
        assert kv is not None
        fill(pool, rest, 2.0)  # what a queued reader reads
        reader = torch.cuda.Stream()
        reader.wait_stream(torch.cuda.current_stream())
        idx = rest.cuda()
        with torch.cuda.stream(reader):
            spin(cycles_per_ms)
            seen = [t[idx].clone() for buf in pool.buffers for t in buf]
        c.free_device(rest, ready=reader)

        def fail(engine: CopyEngine, plan: TransferPlan) -> None:
            raise RuntimeError("injected write failure")

        monkeypatch.setattr(CopyEngine, "backup_all_layers", fail)
        write = c.submit_write(src)
        assert write is not None
        doomed = c.submit_load(write.host_indices)  # fails on that write, before its waits
        assert doomed is not None
        c.start_loading()
        with pytest.raises(Exception, match="failed"):
            await doomed
        c.free_device(doomed.device_indices)
        later = await c.load_back(kv)
        assert later is not None
        reader.synchronize()
        for s in seen:
            assert bool((s == 2.0).all()), "a load overwrote slots a queued reader still read"
        assert values(pool, later) == {1.0}


# -- class 4: fences do not pile up ---------------------------------------------------------


async def test_many_frees_keep_few_fences_and_the_last_reader_is_still_waited_for(
    cycles_per_ms: float,
) -> None:
    async with controller(device_pages=4) as c:
        pool = c.device_pool
        src = c.device_allocator.alloc(4 * PS)
        assert src is not None
        fill(pool, src, 1.0)
        kv = await c.backup(src)
        assert kv is not None
        c.free_device(src)
        for _ in range(200):  # batches of attention over freed slots, no load between
            slots = c.device_allocator.alloc(4 * PS)
            assert slots is not None
            c.free_device(slots)
        torch.cuda.synchronize()
        slots = c.device_allocator.alloc(4 * PS)
        assert slots is not None
        fill(pool, slots, 2.0)
        reader = torch.cuda.Stream()
        reader.wait_stream(torch.cuda.current_stream())
        idx = slots.cuda()
        with torch.cuda.stream(reader):
            spin(cycles_per_ms)
            seen = [t[idx].clone() for buf in pool.buffers for t in buf]
        c.free_device(slots, ready=reader)
        assert c.ledger.device.fence_count() <= 2 * 4  # finished fences were dropped
        back = await c.load_back(kv)
        assert back is not None
        reader.synchronize()
        for s in seen:
            assert bool((s == 2.0).all())
        assert values(pool, back) == {1.0}


# -- class 5: a failed load frees its slots behind a fence -------------------------------


async def test_a_failed_load_frees_its_slots_behind_attention_still_reading_them(
    cycles_per_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    P = list(range(100, 100 + 4 * PS))
    Q = list(range(900, 900 + 4 * PS))
    async with TierCache(cache_config(device_tokens=4 * PS, host_tokens=16 * PS)) as cache:
        pool = cache.device_pool
        for tokens, value in ((P, 1.0), (Q, 9.0)):
            slots = await cache.alloc_device(len(tokens))
            fill(pool, slots, value)
            await cache.insert(tokens, slots)
            await cache.wait_idle()
            assert await cache.evict_device(len(tokens)) == len(tokens)
        attention = torch.cuda.Stream()
        cache.use_compute_stream(attention)
        real = CopyEngine.load_layer

        def fail_late(engine: CopyEngine, i: int, plan: TransferPlan) -> None:
            if i == 1:
                raise RuntimeError("injected load failure")
            real(engine, i, plan)

        monkeypatch.setattr(CopyEngine, "load_layer", fail_late)
        async with cache.request([*P, 0]) as req:
            assert req.load is not None
            idx = req.prefix_indices.cuda()
            req.load.wait_layer_device(0, attention)  # layer 0 lands; attention reads it
            with torch.cuda.stream(attention):
                spin(cycles_per_ms)
                seen = [buf[0][idx].clone() for buf in pool.buffers]
            with pytest.raises(RuntimeError, match="injected"):
                await req.wait_loaded()
        monkeypatch.setattr(CopyEngine, "load_layer", real)
        await cache.wait_idle()
        async with cache.request([*Q, 0]) as other:  # loads into the slots just freed
            await other.wait_loaded()
            assert values(pool, other.prefix_indices) == {9.0}
        attention.synchronize()
        for s in seen:
            assert bool((s == 1.0).all()), "a load overwrote slots attention still read"
