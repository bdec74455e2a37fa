"""The order of fences on CUDA, checked on a CPU through a recording stand-in.

Every rule here is about what a copy waits for before it touches a page:

- a copy out of device pages waits for the producer of their KV, also when
  the cache starts it on its own (a write-back at eviction, selective
  write-through), and the engine can name the stream its forward pass runs on;
- the reader fences of freed device pages stay with those pages until a load
  into them has waited for them, also when a load fails;
- fences do not pile up: finished ones are dropped, and a load waits only for
  the fences of the pages it fills;
- a failed load frees its slots behind a fence (attention over the layers
  that did land may still be queued).

`FenceRecorder` (tests/controller/fence_recorder.py) makes each event remember
the stream it was recorded on, and logs each copy stream's waits and copies.
The same rules on a real GPU: tests/gpu/test_ledger_fences.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.controller.fence_recorder import FenceRecorder

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.errors import InvalidInputError
from tiercache.transfer.engine import CopyEngine

PS = 16


def cache_config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=PS,
        device_tokens=8 * PS,
        host_tokens=32 * PS,
        model="fences",
    )
    return TierCacheConfig(**{**base, **kw})


def controller(device_pages: int = 8) -> TierController:
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    return TierController(
        DeviceKVPool(lay, device_pages * PS), HostKVPool(lay, 64 * PS), inline_copy_bytes=0
    )


# -- class 2: the producer travels with the page ---------------------------------------


async def test_a_write_back_at_eviction_waits_for_the_producer_named_at_insert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with TierCache(cache_config(write_policy="write_back")) as cache:
        rec = FenceRecorder(cache.controller, monkeypatch)
        tokens = list(range(4 * PS))
        slots = await cache.alloc_device(len(tokens))
        await cache.insert(tokens, slots, ready=rec.event("forward"))
        assert rec.copies("write") == []  # write-back: nothing written yet
        rec.current.name = "loop thread"
        assert await cache.evict_device(len(tokens)) == len(tokens)
        (waits,) = rec.copies("write")
        assert "forward" in waits, waits


async def test_selective_write_through_waits_for_the_producer_named_at_insert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = cache_config(write_policy="write_through_selective", write_through_threshold=2)
    async with TierCache(cfg) as cache:
        rec = FenceRecorder(cache.controller, monkeypatch)
        tokens = list(range(4 * PS))
        slots = await cache.alloc_device(len(tokens))
        await cache.insert(tokens, slots, ready=rec.event("forward"))
        rec.current.name = "loop thread"
        for _ in range(3):
            cache.match_prefix(tokens)
        await cache.wait_idle()
        (waits,) = rec.copies("write")
        assert "forward" in waits, waits


async def test_the_engine_names_its_compute_stream_for_the_cache_s_own_copies_and_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with TierCache(cache_config(write_policy="write_back")) as cache:
        rec = FenceRecorder(cache.controller, monkeypatch)
        attention = rec.stream("attention", cache.device_pool.device)
        cache.use_compute_stream(attention)
        tokens = list(range(4 * PS))
        slots = await cache.alloc_device(len(tokens))
        await cache.insert(tokens, slots)  # the KV's producer: the compute stream, now
        rec.current.name = "loop thread"
        assert await cache.evict_device(len(tokens)) == len(tokens)
        (write,) = rec.copies("write")
        assert "attention" in write and "loop thread" not in write, write
        # The evicted slots were freed behind the compute stream: a load into them waits.
        m = cache.match_prefix(tokens)
        _, handle = await cache.load_back(m)
        assert handle is not None
        await handle
        (load,) = rec.copies("load")
        assert "attention" in load and "loop thread" not in load, load
        cache.use_compute_stream(None)
        with pytest.raises(InvalidInputError):
            cache.use_compute_stream("attention")  # type: ignore[arg-type]


async def test_use_compute_stream_is_refused_on_a_cpu_pool() -> None:
    async with TierCache(cache_config()) as cache:
        with pytest.raises(InvalidInputError, match="torch.cuda.Stream"):
            cache.use_compute_stream(torch.cuda.Stream)  # type: ignore[arg-type]


# -- class 3: a failing load keeps the fences of freed slots ------------------------------


async def test_a_load_that_fails_before_its_waits_keeps_the_fences_of_freed_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with controller(device_pages=8) as c:
        rec = FenceRecorder(c, monkeypatch)
        src = c.device_allocator.alloc(2 * PS)  # a write's source, kept
        rest = c.device_allocator.alloc(6 * PS)  # every other page
        assert src is not None and rest is not None
        kv = await c.backup(rest)  # host KV for a later load
        assert kv is not None
        c.free_device(rest, ready=rec.event("attention"))  # attention still reads them

        def fail(engine: CopyEngine, plan: Any) -> None:
            raise RuntimeError("injected write failure")

        monkeypatch.setattr(CopyEngine, "backup_all_layers", fail)
        write = c.submit_write(src)
        assert write is not None
        doomed = c.submit_load(write.host_indices)  # waits for that write, which fails
        assert doomed is not None
        c.start_loading()
        with pytest.raises(Exception, match="failed"):
            await doomed
        c.free_device(doomed.device_indices)
        rec.current.name = "scheduler"
        later = c.submit_load(kv)  # every page freed above, those of the failed load too
        assert later is not None
        c.start_loading()
        await later
        assert sorted(later.device_indices.tolist()) == sorted(rest.tolist())
        first, second = rec.copies("load")
        assert "attention" in first, first  # waited for first, before the failure
        assert "attention" in second, second


# -- class 4: fences do not pile up ---------------------------------------------------------


async def test_fences_of_freed_slots_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async with controller(device_pages=8) as c:
        rec = FenceRecorder(c, monkeypatch)
        src = c.device_allocator.alloc(8 * PS)
        assert src is not None
        kv = await c.backup(src[: 2 * PS])
        assert kv is not None
        c.free_device(src)
        for i in range(50):  # many batches of attention over freed slots, no load between
            slots = c.device_allocator.alloc(8 * PS)
            assert slots is not None
            ev = rec.event(f"attention {i}")
            c.free_device(slots, ready=ev)
            c.fence_device_reads(ready=rec.event(f"engine {i}"))
            if i < 49:
                rec.finish_all()  # those kernels have run by the next batch
        rec.current.name = "scheduler"
        load = c.submit_load(kv)
        assert load is not None
        c.start_loading()
        await load
        (waits,) = rec.copies("load")
        assert sorted(waits) == ["attention 49", "engine 49", "scheduler"], waits
        assert c.ledger.device.fence_count() <= 8  # the load took its pages' fences


# -- class 5: a failed load frees its slots behind a fence -------------------------------


async def test_a_failed_load_back_frees_its_slots_behind_the_compute_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with controller(device_pages=4) as c:
        rec = FenceRecorder(c, monkeypatch)
        src = c.device_allocator.alloc(4 * PS)
        assert src is not None
        kv = await c.backup(src)
        assert kv is not None
        c.free_device(src, ready=rec.event("before"))
        real = CopyEngine.load_layer

        def fail(engine: CopyEngine, i: int, plan: Any) -> None:
            if i == 1:
                raise RuntimeError("injected load failure")
            real(engine, i, plan)

        monkeypatch.setattr(CopyEngine, "load_layer", fail)
        rec.current.name = "attention"  # where the layer that landed is read
        with pytest.raises(RuntimeError, match="injected"):
            await c.load_back(kv)
        monkeypatch.setattr(CopyEngine, "load_layer", real)
        rec.current.name = "scheduler"
        assert c.device_allocator.available == 4 * PS  # freed
        again = await c.load_back(kv)
        assert again is not None
        _, second = rec.copies("load")
        assert "attention" in second, second


@pytest.mark.parametrize("named", [True, False], ids=["compute-stream", "current-stream"])
async def test_a_failed_request_load_frees_its_slots_behind_the_compute_stream(
    monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    async with TierCache(cache_config(device_tokens=4 * PS)) as cache:
        tokens = list(range(3 * PS))
        async with cache.request([*tokens, 0]) as req:
            slots = await req.alloc(len(tokens) + 1)
            await req.commit([*tokens, 0], slots)
        await cache.wait_idle()
        assert await cache.evict_device(3 * PS) == 3 * PS
        rec = FenceRecorder(cache.controller, monkeypatch)
        real = CopyEngine.load_layer

        def fail(engine: CopyEngine, i: int, plan: Any) -> None:
            if i == 1:
                raise RuntimeError("injected load failure")
            real(engine, i, plan)

        monkeypatch.setattr(CopyEngine, "load_layer", fail)
        if named:
            cache.use_compute_stream(rec.stream("attention", cache.device_pool.device))
        else:
            rec.current.name = "attention"
        async with cache.request([*tokens, 1]) as req:
            with pytest.raises(RuntimeError, match="injected"):
                await req.wait_loaded()
        monkeypatch.setattr(CopyEngine, "load_layer", real)
        await cache.wait_idle()
        if named:
            cache.use_compute_stream(None)
        rec.current.name = "scheduler"
        async with cache.request([*tokens, 2]) as req:
            await req.wait_loaded()
        _, second = rec.copies("load")
        assert "attention" in second, second
