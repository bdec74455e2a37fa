"""The device<->host half of TierController: round trips, layer futures,
cancellation, loop responsiveness and bad input."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import tiercache.controller as controller_module
from tiercache import DeviceKVPool, HostKVPool, KVLayout, PageAllocator, TierController
from tiercache.errors import (
    ClosedError,
    ConfigError,
    DoubleFreeError,
    InvalidInputError,
    StateError,
)
from tiercache.transfer import LayerDoneCounter


def make(
    *,
    layers: int = 3,
    heads: int = 2,
    dim: int = 8,
    dtype: torch.dtype = torch.float16,
    page_size: int = 16,
    mla: bool = False,
    device_slots: int = 256,
    host_slots: int = 512,
    host_layout: str = "layer_first",
    **kw: object,
) -> TierController:
    lay = KVLayout(layers, 1 if mla else heads, dim, dtype, page_size, mla=mla)
    dev = DeviceKVPool(lay, device_slots)
    gen = torch.Generator().manual_seed(0)
    for buf in dev.buffers:
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    host = HostKVPool(lay, host_slots, host_layout=host_layout)
    return TierController(dev, host, **kw)  # type: ignore[arg-type]


async def backed_up(c: TierController, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` device slots and the host copy the controller backed them up to."""
    src = c.device_allocator.alloc(tokens)
    assert src is not None
    host = await c.backup(src)
    assert host is not None
    return src, host


def kv_at(c: TierController, slots: torch.Tensor) -> list[torch.Tensor]:
    return [
        c.device_pool.buffers[b][layer][slots].clone()
        for b in range(c.layout.num_buffers)
        for layer in range(c.layout.num_layers)
    ]


def scattered(alloc: PageAllocator, pages: int) -> torch.Tensor:
    """Allocate ``pages`` pages and return them in a shuffled page order."""
    ps = alloc.page_size
    x = alloc.alloc(pages * ps)
    assert x is not None
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(pages))
    return x.view(-1, ps)[order].reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mla", [False, True])
async def test_round_trip_is_bit_identical(
    dtype: torch.dtype, page_size: int, host_layout: str, mla: bool
) -> None:
    async with make(dtype=dtype, page_size=page_size, host_layout=host_layout, mla=mla) as c:
        for shuffle in (False, True):
            pages = 128 // page_size if page_size > 1 else 40
            src = (
                scattered(c.device_allocator, pages)
                if shuffle
                else c.device_allocator.alloc(pages * page_size)
            )
            assert src is not None
            expect = kv_at(c, src)
            host = await c.backup(src)
            assert host is not None
            c.free_device(src)
            # Overwrite the freed device slots so a stale read cannot pass.
            for buf in c.device_pool.buffers:
                for t in buf:
                    t[src] = 0
            dst = await c.load_back(host)
            assert dst is not None
            assert not torch.equal(dst, src) or shuffle  # usually other slots
            got = kv_at(c, dst)
            for e, g in zip(expect, got, strict=True):
                assert torch.equal(e.view(torch.uint8), g.view(torch.uint8))
            c.free_device(dst)
            c.free_host(host)
        assert c.host_allocator.available == c.host_allocator.num_slots
        assert c.device_allocator.available == c.device_allocator.num_slots


async def test_wrapped_engine_buffers_round_trip() -> None:
    lay = KVLayout(2, 2, 8, torch.float32, 16)
    ks = [torch.randn(64, 2, 8) for _ in range(2)]
    vs = [torch.randn(64, 2, 8) for _ in range(2)]
    dev = DeviceKVPool(lay, 64, k_buffers=ks, v_buffers=vs)
    async with TierController(dev, HostKVPool(lay, 64, host_layout="page_first")) as c:
        src = c.device_allocator.alloc(32)
        assert src is not None
        expect = [ks[1][src].clone(), vs[0][src].clone()]
        host = await c.backup(src)
        assert host is not None
        dst = await c.load_back(host)
        assert dst is not None
        assert torch.equal(ks[1][dst], expect[0]) and torch.equal(vs[0][dst], expect[1])


async def test_layer_futures_resolve_in_order_before_completion_with_data_in_place() -> None:
    async with make(layers=6, device_slots=2048, host_slots=2048, dim=64) as c:
        src = c.device_allocator.alloc(1024)
        assert src is not None
        expect = kv_at(c, src)
        host = await c.backup(src)
        assert host is not None
        dst = c.load(host)
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None and handle.num_layers == 6
        events: list[object] = []
        seen_ok: list[bool] = []

        def on_layer(i: int) -> None:
            events.append(i)
            # When layer i is reported loaded, its bytes are already in place.
            ok = all(
                torch.equal(c.device_pool.buffers[b][i][dst], expect[b * 6 + i]) for b in range(2)
            )
            seen_ok.append(ok)

        for i in range(6):
            handle.layers.futures[i].add_done_callback(lambda _f, i=i: on_layer(i))
        handle._future.add_done_callback(lambda _f: events.append("all"))
        for i in range(6):
            await handle.layer(i)
            assert all(
                torch.equal(c.device_pool.buffers[b][i][dst], expect[b * 6 + i]) for b in range(2)
            )
        await handle
        await asyncio.sleep(0)  # done-callbacks are scheduled, not run inline
        assert events == [0, 1, 2, 3, 4, 5, "all"]
        assert all(seen_ok)
        assert all(a.done() for a in handle.acks)


async def test_sync_wait_from_a_worker_thread_and_not_on_the_loop() -> None:
    async with make() as c:
        src, host = await backed_up(c, 64)
        c.load(host)
        handle = c.start_loading()
        assert handle is not None

        def forward() -> list[int]:
            order = []
            for i in range(c.layout.num_layers):
                handle.wait_layer(i, timeout=10)
                handle.wait_layer_device(i)
                order.append(i)
            return order

        assert await asyncio.to_thread(forward) == [0, 1, 2]
        with pytest.raises(StateError):
            handle.wait_layer(0)
        with pytest.raises(InvalidInputError):
            await handle.layer(3)


async def test_layer_done_counter_rotates_three_sets() -> None:
    loop = asyncio.get_running_loop()
    counter = LayerDoneCounter(2)
    ids = [counter.update_producer(loop)[0] for _ in range(4)]
    assert ids == [0, 1, 2, 0]
    counter.set_consumer(0)
    done = counter.current()
    assert done is not None
    done.mark_done(0)
    await counter.wait_until(0)
    with pytest.raises(InvalidInputError):
        counter.set_consumer(3)


@pytest.mark.parametrize("index", ["1", 1.0, None, True])
async def test_a_consumer_index_that_is_not_an_int_is_refused(index: object) -> None:
    counter = LayerDoneCounter(2)
    with pytest.raises(InvalidInputError):
        counter.set_consumer(index)  # type: ignore[arg-type]
    assert counter.consumer_index == -1


async def test_layer_waits_take_a_layer_as_the_consumer_index_is_taken() -> None:
    """A numpy integer names a layer at every layer wait, as it names a set at
    `set_consumer`; a bool, a float or an index outside the layers is refused."""
    async with make(layers=3) as c:
        src, host = await backed_up(c, 16)
        assert c.submit_load(host) is not None
        handle = c.start_loading()
        assert handle is not None
        c.layer_done_counter.set_consumer(np.int64(handle.producer_id))
        for i in (np.int64(2), np.int32(0)):
            await handle.layer(i)  # type: ignore[arg-type]
            await asyncio.to_thread(handle.wait_layer, i)  # type: ignore[arg-type]
            await asyncio.to_thread(handle.wait_layer_device, i)  # type: ignore[arg-type]
            assert handle.layers.is_done(i)  # type: ignore[arg-type]
            await c.layer_done_counter.wait_until(i)  # type: ignore[arg-type]
        for bad in (True, 1.0, "1", -1, 3, np.int64(3)):
            with pytest.raises(InvalidInputError, match="layer"):
                await handle.layer(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError, match="layer"):
                await asyncio.to_thread(handle.wait_layer, bad)  # type: ignore[arg-type]
        await handle


@pytest.mark.parametrize("bad", ["1", -1.0, float("nan"), True])
async def test_wait_layer_refuses_a_bad_timeout(bad: object) -> None:
    done = LayerDoneCounter(2).update_producer(asyncio.get_running_loop())[1]
    done.mark_done(0)

    def wait() -> None:
        done.wait_sync(0, bad)  # type: ignore[arg-type]

    with pytest.raises(InvalidInputError):
        await asyncio.to_thread(wait)


async def test_merged_writes_priorities_and_drained_acks() -> None:
    async with make(auto_start_writes=False) as c:
        slots = [c.device_allocator.alloc(16) for _ in range(3)]
        acks = [
            c.submit_write(s, priority=p, node_id=10 + p)
            for s, p in zip(slots, [2, 0, 1], strict=True)
        ]  # type: ignore[arg-type]
        assert all(a is not None for a in acks)
        assert c.drain_acks() == []
        assert c.start_writing() == 3
        for a in acks:
            assert a is not None
            await a
        assert c.stats.write_batches == 1
        assert sorted(a.node_id for a in c.drain_acks()) == [10, 11, 12]
        assert c.drain_acks() == []
        assert c.start_writing() == 0


async def test_full_host_and_device_return_none_and_keep_accounting() -> None:
    async with make(device_slots=64, host_slots=32) as c:
        src = c.device_allocator.alloc(64)
        assert src is not None
        assert c.write(src) is None
        assert c.stats.host_full == 1
        host = await c.backup(src[:32])
        assert host is not None
        assert c.load(host) is None  # device is full
        assert c.stats.device_full == 1
        assert c.host_allocator.available == 0 and c.device_allocator.available == 0


@pytest.mark.parametrize("verb", ["backup", "load_back"])
async def test_a_cancel_as_the_copy_settles_frees_at_once_not_after_a_reset(verb: str) -> None:
    """A `backup` / `load_back` cancelled after its copy settled, but before it
    resumed, frees its slots then: not a loop iteration later, when a `reset`
    and the next owner of those slots may have come in between.

    inline_copy_bytes=0: the copy is queued (a small one is made in the call,
    which never yields and so cannot be cancelled part-way)."""
    async with make(inline_copy_bytes=0) as c:
        handler_calls: list[object] = []
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: handler_calls.append(ctx))
        src, host = await backed_up(c, 32)
        pool = c.device_allocator if verb == "load_back" else c.host_allocator
        call = c.load_back(host) if verb == "load_back" else c.backup(src)
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # queued; cancelled once its copy has settled
        remove = c.add_settle_callback(task.cancel)

        async def reset_then_take_all() -> torch.Tensor:
            await c.reset()
            mine = pool.alloc(pool.num_slots)  # on, in the same step
            assert mine is not None
            return mine

        taker = asyncio.ensure_future(reset_then_take_all())
        with pytest.raises(asyncio.CancelledError):
            await task
        mine = await taker
        remove()
        for _ in range(3):
            await asyncio.sleep(0)
        assert pool.available == 0 and pool.is_allocated(mine)
        assert handler_calls == []


@pytest.mark.parametrize("point", ["before_start", "during_copy"])
async def test_cancelling_a_backup_or_load_leaks_nothing(
    point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inline_copy_bytes=0: every copy runs on its stream's worker thread,
    # where it can still be running when its awaiting task is cancelled.
    async with make(layers=4, inline_copy_bytes=0) as c:
        start_host, start_dev = c.host_allocator.available, c.device_allocator.available
        gate = threading.Event()
        real_backup, real_load = c.engine.backup_all_layers, c.engine.load_layer

        def held_backup(plan: object) -> None:
            gate.wait(10)
            real_backup(plan)  # type: ignore[arg-type]

        def held_load(layer: int, plan: object) -> None:
            gate.wait(10)
            real_load(layer, plan)  # type: ignore[arg-type]

        monkeypatch.setattr(c.engine, "backup_all_layers", held_backup)
        monkeypatch.setattr(c.engine, "load_layer", held_load)
        src = c.device_allocator.alloc(64)
        assert src is not None
        gate.set()
        host = await c.backup(src)
        assert host is not None
        gate.clear()
        held_host, held_dev = c.host_allocator.available, c.device_allocator.available
        tasks = [asyncio.create_task(c.backup(src)) for _ in range(3)]
        tasks += [asyncio.create_task(c.load_back(host)) for _ in range(3)]
        if point == "during_copy":
            for _ in range(3):
                await asyncio.sleep(0)
            # The copies are running (held at the gate): their slots are taken.
            assert c.host_allocator.available == held_host - 3 * 64
            assert c.device_allocator.available == held_dev - 3 * 64
        for t in tasks:
            t.cancel()
        for t in tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        gate.set()
        await c.wait_idle()
        await asyncio.sleep(0)  # the release callbacks run after the acks resolve
        assert c.host_allocator.available == held_host
        assert c.device_allocator.available == held_dev
        c.free_host(host)
        c.free_device(src)
        assert c.host_allocator.available == start_host
        assert c.device_allocator.available == start_dev


async def test_a_failing_copy_fails_its_layers_frees_and_leaves_the_controller_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # inline_copy_bytes=0: every copy is queued, layer by layer (the copies made
    # in the call: test_a_failing_copy_in_the_call_frees_its_slots_and_raises).
    async with make(layers=4, inline_copy_bytes=0) as c:
        src, host = await backed_up(c, 32)
        real = c.engine.load_layer

        def broken(layer: int, plan: object) -> None:
            if layer == 2:
                raise RuntimeError("copy engine fault")
            real(layer, plan)  # type: ignore[arg-type]

        monkeypatch.setattr(c.engine, "load_layer", broken)
        before = c.device_allocator.available
        c.load(host)
        handle = c.start_loading()
        assert handle is not None
        await handle.layer(1)
        with pytest.raises(RuntimeError, match="copy engine fault"):
            await handle.layer(2)
        with pytest.raises(RuntimeError):
            await handle
        with pytest.raises(RuntimeError):
            await c.load_back(host)
        assert c.stats.copy_errors == 2
        monkeypatch.setattr(c.engine, "load_layer", real)
        dst = await c.load_back(host)
        assert dst is not None
        assert (
            c.device_allocator.available == before - 32 - 32
        )  # the first handle's slots stay the caller's


async def test_event_loop_stays_responsive_while_a_gigabyte_moves() -> None:
    # 8 layers x 2 (K,V) x 32768 tokens x 8 heads x 128 dim x fp16 = 1 GiB.
    c = make(layers=8, heads=8, dim=128, page_size=64, device_slots=32768, host_slots=32768)
    assert c.device_pool.nbytes >= 1 << 30
    async with c:
        src = c.device_allocator.alloc(32768)
        assert src is not None
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t0 - 0.001)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        host = await c.backup(src)
        c.free_device(src)
        dst = await c.load_back(host)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - t0
        stop.set()
        await tick
        assert dst is not None
        assert c.stats.bytes_device_to_host + c.stats.bytes_host_to_device >= 2 << 30
        # A blocked loop would show one lag as long as the whole transfer.
        assert max(lags) < 0.25 * elapsed, (max(lags), elapsed)
        assert len(lags) > 10


async def test_bad_input_raises_documented_errors() -> None:
    c = make()
    with pytest.raises(StateError):
        c.write(torch.arange(16))
    async with c:
        ok = c.device_allocator.alloc(32)
        assert ok is not None
        with pytest.raises(InvalidInputError):
            c.write(ok.to(torch.int32))
        with pytest.raises(InvalidInputError):
            c.write(ok[:8])  # not a whole page
        with pytest.raises(InvalidInputError):
            c.write(ok + 1)  # not page-aligned
        with pytest.raises(InvalidInputError):
            c.write(torch.arange(256, 272))  # out of range
        with pytest.raises(InvalidInputError):
            c.write(torch.arange(64, 80))  # not allocated on the device
        with pytest.raises(InvalidInputError):
            c.write(ok.view(2, 16))
        with pytest.raises(InvalidInputError):
            c.load(torch.arange(0, 16))  # host slots not allocated
        with pytest.raises(InvalidInputError):
            c.plan(torch.arange(16), torch.arange(32))  # lengths differ
        with pytest.raises(InvalidInputError):
            c.write(ok, priority="high")  # type: ignore[arg-type]
        assert c.host_allocator.available == 512  # nothing was reserved by the failures
        host = c.write(ok)
        assert host is not None
        with pytest.raises(StateError):
            c.free_host(host)  # its copy is in flight
        await c.wait_idle()
        c.free_host(host)
        with pytest.raises(DoubleFreeError):
            c.free_host(host)
    with pytest.raises(ClosedError):
        c.write(ok)
    with pytest.raises(ClosedError):
        await c.open()
    await c.aclose()  # idempotent


async def test_a_refused_free_device_records_no_fence_and_wakes_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A double free is refused before the load fence (CUDA) is recorded or waiters woken."""
    async with make() as c:
        woken: list[None] = []
        c.add_settle_callback(lambda: woken.append(None))
        # A CPU pool has no events: stand one in, as a CUDA pool would resolve ``ready``.
        monkeypatch.setattr(c, "ready_event", lambda ready, what="ready": "fence")
        slots = c.device_allocator.alloc(32)
        assert slots is not None
        c.free_device(slots)
        assert c.ledger.device.fence_count() == 2 and len(woken) == 1  # one per freed page
        again = c.device_allocator.alloc(16)
        assert again is not None
        for bad in (slots, torch.cat([again, again])):  # freed already; one page twice
            with pytest.raises(DoubleFreeError):
                c.free_device(bad)
        assert c.ledger.device.fence_count() == 2 and len(woken) == 1
        assert c.device_allocator.is_allocated(again)


async def test_a_backup_of_device_slots_a_load_still_fills_is_refused() -> None:
    """Writing device slots before the load into them has landed would back up
    whatever was there before: a `StateError` that takes no host slot, until the
    load (queued, running, or dropped by `reset`) has settled."""
    async with make() as c:
        src, host = await backed_up(c, 32)
        for phase in ("queued", "started"):
            ack = c.submit_load(host)
            assert ack is not None
            if phase == "started":
                c.start_loading()
            free_host = c.host_allocator.available
            with pytest.raises(StateError, match="load still fills"):
                c.submit_write(ack.device_indices)
            with pytest.raises(StateError, match="load still fills"):
                await c.backup(ack.device_indices[16:])
            assert c.host_allocator.available == free_host
            if phase == "queued":
                c.start_loading()
            await ack
            again = await c.backup(ack.device_indices)  # landed: its KV is src's
            assert again is not None
            back = await c.load_back(again)
            assert back is not None
            assert all(
                torch.equal(a, b) for a, b in zip(kv_at(c, src), kv_at(c, back), strict=True)
            )
        dropped = c.submit_load(host)
        assert dropped is not None
        await c.reset()
        slots = c.device_allocator.alloc(32)
        assert slots is not None
        assert await c.backup(slots) is not None  # nothing of the dropped load stays


@pytest.mark.parametrize(
    "kw", [{"node_id": "n1"}, {"node_id": 1.5}, {"node_id": True}, {"track": "no"}, {"track": None}]
)
async def test_a_node_id_or_track_of_the_wrong_type_is_refused_and_takes_no_slot(
    kw: dict[str, object],
) -> None:
    async with make() as c:
        src, host = await backed_up(c, 16)
        free = (c.device_allocator.available, c.host_allocator.available)
        with pytest.raises(InvalidInputError, match=next(iter(kw))):
            c.submit_write(src, **kw)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match=next(iter(kw))):
            c.submit_load(host, **kw)  # type: ignore[arg-type]
        assert (c.device_allocator.available, c.host_allocator.available) == free
        assert not c.busy and c.drain_acks() == []
        ack = c.submit_write(src, node_id=np.int64(7), track=np.bool_(True))  # type: ignore[arg-type]
        assert ack is not None and ack.node_id == 7
        await ack
        assert c.drain_acks() == [ack]


async def test_a_refused_priority_takes_no_slot() -> None:
    """The priority is checked before a write or load allocates its slots, not after."""
    async with make() as c:
        dev = c.device_allocator.alloc(16)
        assert dev is not None
        with pytest.raises(InvalidInputError, match="priority"):
            c.submit_write(dev, priority="high")  # type: ignore[arg-type]
        ack = c.submit_write(dev)
        assert ack is not None
        assert torch.equal(ack.host_indices, torch.arange(16))  # the first free host page
        await ack
        with pytest.raises(InvalidInputError, match="priority"):
            c.submit_load(ack.host_indices, priority=1.5)  # type: ignore[arg-type]
        load = c.submit_load(ack.host_indices)
        assert load is not None
        assert torch.equal(load.device_indices, torch.arange(16, 32))  # the next free device page
        c.start_loading()
        await load


def test_constructor_validation() -> None:
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    for bad in ({"inline_copy_bytes": -1}, {"inline_copy_bytes": 1.5}, {"track_acks": 1}):
        with pytest.raises(ConfigError):
            TierController(DeviceKVPool(lay, 32), HostKVPool(lay, 32), **bad)  # type: ignore[arg-type]
    other = KVLayout(2, 2, 8, torch.float32, 16)
    with pytest.raises(InvalidInputError):
        TierController(DeviceKVPool(lay, 32), HostKVPool(other, 32))
    with pytest.raises(InvalidInputError):
        TierController(
            DeviceKVPool(lay, 32), HostKVPool(lay, 32), host_allocator=PageAllocator(64, 16)
        )


async def test_reset_frees_everything_and_close_drains_queued_writes() -> None:
    c = make(auto_start_writes=False)
    async with c:
        src = c.device_allocator.alloc(64)
        assert src is not None
        ack = c.submit_write(src)
        assert ack is not None
        await c.reset()
        assert ack.done()
        assert c.host_allocator.available == 512 and c.device_allocator.available == 256
        src = c.device_allocator.alloc(64)
        assert src is not None
        ack = c.submit_write(src)
        assert ack is not None and not ack.done()
    assert ack.done() and not ack.failed()


async def test_backup_starts_its_own_write_when_writes_do_not_start_themselves() -> None:
    """With ``auto_start_writes`` off nobody else may call `start_writing`:
    `backup` starts its write (merged with what is queued), as `load_back` its load.

    inline_copy_bytes=0: copies are queued (a small one is made in the call)."""
    async with make(auto_start_writes=False, inline_copy_bytes=0) as c:
        queued_src = c.device_allocator.alloc(16)
        src = c.device_allocator.alloc(32)
        assert queued_src is not None and src is not None
        queued = c.submit_write(queued_src)
        assert queued is not None
        host = await c.backup(src)
        assert host is not None and queued.done()
        back = await c.load_back(host)
        assert back is not None
        assert all(torch.equal(a, b) for a, b in zip(kv_at(c, back), kv_at(c, src), strict=True))
        free = c.host_allocator.available
        task = asyncio.ensure_future(c.backup(src))
        await asyncio.sleep(0)  # the write is queued; cancel before it has settled
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.wait_idle()
        assert c.host_allocator.available == free and not c.busy


async def test_tiny_copies_run_inline_on_an_idle_cpu_stream_and_stay_correct() -> None:
    async with make(layers=2) as c:
        src = c.device_allocator.alloc(16)
        assert src is not None
        expect = kv_at(c, src)
        calls: list[str] = []
        for stream in (c._copies.write_stream, c._copies.load_stream):
            assert stream is not None
            real = stream.submit
            stream.submit = lambda job, real=real: (calls.append("thread"), real(job))[1]  # type: ignore[method-assign]
        host = await c.backup(src)
        assert host is not None
        dst = await c.load_back(host)
        assert dst is not None
        assert calls == []  # both copies ran on the loop thread: no hand-off
        assert all(torch.equal(e, g) for e, g in zip(expect, kv_at(c, dst), strict=True))
    async with make(layers=2, inline_copy_bytes=0) as c:
        src = c.device_allocator.alloc(16)
        assert src is not None
        seen: list[str] = []
        real_backup = c.engine.backup_all_layers

        def record(plan: object) -> None:
            seen.append(threading.current_thread().name)
            real_backup(plan)  # type: ignore[arg-type]

        c.engine.backup_all_layers = record  # type: ignore[method-assign]
        await c.backup(src)
        assert seen and seen[0].startswith("tiercache-write")


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn])
async def test_scattered_host_pages_load_by_page_gather_into_contiguous_device_runs(
    host_layout: str, dtype: torch.dtype
) -> None:
    async with make(host_layout=host_layout, dtype=dtype) as c:
        pages = 12
        src = c.device_allocator.alloc(pages * 16)
        assert src is not None
        expect = kv_at(c, src)
        host = await c.backup(src)
        assert host is not None
        shuffled = scattered_view(host, 16)
        c.free_device(src)
        dst = c.device_allocator.alloc(pages * 16)
        assert dst is not None
        plan = c.engine.plan(shuffled, dst)
        assert plan.device_runs is not None and len(plan.device_runs) == 1  # the gather path
        for layer in range(c.layout.num_layers):
            c.engine.load_layer(layer, plan)
        order = torch.argsort(shuffled.view(-1, 16)[:, 0])
        # dst page k received shuffled host page k; map back to src order
        got = kv_at(c, dst.view(-1, 16)[order].reshape(-1))
        for e, g in zip(expect, got, strict=True):
            assert torch.equal(e.view(torch.uint8), g.view(torch.uint8))


def scattered_view(slots: torch.Tensor, ps: int) -> torch.Tensor:
    order = torch.randperm(slots.numel() // ps, generator=torch.Generator().manual_seed(7))
    return slots.view(-1, ps)[order].reshape(-1)


async def test_concurrent_load_backs_merge_into_one_copy() -> None:
    # Queued copies merge; inline_copy_bytes=0 queues these small ones too.
    async with make(inline_copy_bytes=0) as c:
        hosts = []
        for _ in range(4):
            src = c.device_allocator.alloc(16)
            assert src is not None
            h = await c.backup(src)
            assert h is not None
            hosts.append((h, kv_at(c, src)))
        before = c.stats.load_batches
        dsts = await asyncio.gather(*(c.load_back(h) for h, _ in hosts))
        assert c.stats.load_batches == before + 1
        for d, (_, expect) in zip(dsts, hosts, strict=True):
            assert d is not None
            assert all(torch.equal(e, g) for e, g in zip(expect, kv_at(c, d), strict=True))


class _CountingWakes:
    """Counts ``call_soon_threadsafe`` on ``loop``: each one is a wake-up from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = loop.call_soon_threadsafe

        def counted(*args: object, **kw: object) -> object:
            self.count += 1
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)


async def test_a_load_nobody_watches_layer_by_layer_wakes_the_loop_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy thread wakes the loop per layer only while someone may watch the layers."""
    async with make(layers=12, inline_copy_bytes=0) as c:
        src, host = await backed_up(c, 64)
        loop = asyncio.get_running_loop()
        wakes = _CountingWakes(loop, monkeypatch)
        made = 0
        create_future = loop.create_future

        def counted_future() -> asyncio.Future[object]:
            nonlocal made
            made += 1
            return create_future()

        monkeypatch.setattr(loop, "create_future", counted_future)
        dst = await c.load_back(host)  # awaits the whole load, no layer
        assert dst is not None
        assert wakes.count == 1  # the job's settle; none of the 12 layers woke it
        assert made < 12  # and no future a layer was made: nobody asked for one
        assert all(torch.equal(a, b) for a, b in zip(kv_at(c, dst), kv_at(c, src), strict=True))
        # Watched: each layer resolves its future as it lands (several may
        # share one wake-up, but the count grows).
        c.load(host)
        handle = c.start_loading()
        assert handle is not None
        wakes.count = 0
        for i in range(12):
            await handle.layer(i)
        await handle
        assert wakes.count > 1


@pytest.mark.parametrize("watch", ["before", "after", "never"])
async def test_layer_futures_say_the_same_whenever_they_are_first_watched(watch: str) -> None:
    """Futures first read after the load tell what happened, as if watched throughout."""
    gate = threading.Event()
    async with make(layers=4, inline_copy_bytes=0) as c:
        src, host = await backed_up(c, 32)
        real = c.engine.load_layer

        def held(layer: int, plan: object) -> None:
            gate.wait(10)
            if layer == 2:
                raise RuntimeError("copy engine fault")
            real(layer, plan)  # type: ignore[arg-type]

        c.engine.load_layer = held  # type: ignore[method-assign]
        c.load(host)
        handle = c.start_loading()
        assert handle is not None
        if watch == "before":
            futures = handle.layers.futures
        gate.set()
        with pytest.raises(RuntimeError, match="copy engine fault"):
            await handle
        if watch == "after":
            futures = handle.layers.futures
        if watch == "never":  # only the waiters, and the thread-side answers
            await handle.layer(0)
            await handle.layer(1)
            for i in (2, 3):
                with pytest.raises(RuntimeError, match="copy engine fault"):
                    await handle.layer(i)
            await asyncio.to_thread(handle.wait_layer, 1, 5)
            with pytest.raises(RuntimeError, match="copy engine fault"):
                await asyncio.to_thread(handle.wait_layer, 3, 5)
            return
        await asyncio.sleep(0)
        assert [f.done() for f in futures] == [True] * 4
        assert [f.exception() is None for f in futures] == [True, True, False, False]
        await handle.layer(1)
        with pytest.raises(RuntimeError):
            await handle.layer(3)


@pytest.mark.parametrize("verb", ["backup", "load_back"])
@pytest.mark.parametrize("pages", [1, 4096])
async def test_a_large_transfer_yields_before_its_checks_and_a_small_one_does_not(
    verb: str, pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backup / load_back of 64k slots or more let the loop run once before the
    O(slots) checks, so they never share a loop step with the caller's work;
    a one-page operation keeps its single step and the bytes are right either way."""
    ps = 16
    n = pages * ps
    async with make(layers=1, heads=1, dim=4, page_size=ps, device_slots=2 * n, host_slots=n) as c:
        src, host = await backed_up(c, n) if verb == "load_back" else (None, None)
        dev = c.device_allocator.alloc(n) if verb == "backup" else None
        ran: list[bool] = []
        check = controller_module._copy_source
        checked_after: list[bool] = []

        def spy(*args: object, **kw: object) -> object:
            checked_after.append(bool(ran))
            return check(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(controller_module, "_copy_source", spy)
        asyncio.get_running_loop().call_soon(ran.append, True)
        if verb == "backup":
            assert dev is not None
            out = await c.backup(dev)
            assert out is not None
            assert torch.equal(c.host_pool.layer(0, 0)[out], c.device_pool.buffers[0][0][dev])
        else:
            assert host is not None and src is not None
            out = await c.load_back(host)
            assert out is not None
            assert all(torch.equal(a, b) for a, b in zip(kv_at(c, out), kv_at(c, src), strict=True))
        if pages * ps >= 1 << 16:
            assert checked_after == [True]
        else:  # checked by its page id (no `_copy_source`), and no loop step at all
            assert checked_after == [] and ran == []


async def test_calls_from_another_thread_or_loop_are_refused_and_change_nothing() -> None:
    """The controller's bookkeeping is not locked: a verb off its loop is a `StateError`."""
    async with make() as c:
        src, host = await backed_up(c, 32)
        free = (c.device_allocator.available, c.host_allocator.available)

        def elsewhere() -> list[str]:
            out = []
            calls = [
                lambda: c.submit_write(src),
                lambda: c.submit_load(host),
                lambda: c.start_writing(),
                lambda: c.start_loading(),
                lambda: c.free_host(host),
                lambda: c.free_device(src),
                lambda: asyncio.run(c.backup(src)),
                lambda: asyncio.run(c.load_back(host)),
                lambda: asyncio.run(c.reset()),
                lambda: asyncio.run(c.wait_idle()),
                lambda: asyncio.run(c.aclose()),
                lambda: asyncio.run(c.detach_storage_backend()),
                lambda: c.drain_acks(),
                lambda: c.drain_backup_acks(),
                lambda: c.fence_device_reads(),
                lambda: c.ack_busy("host", host),
                lambda: c.add_settle_callback(lambda: None),
            ]
            for call in calls:
                try:
                    call()
                except StateError as e:
                    out.append(str(e))
            return out

        queued = c.submit_write(src)  # for `drain_acks` to take, or `wait_idle` to start
        assert queued is not None
        await queued
        errors = await asyncio.to_thread(elsewhere)
        assert len(errors) == 17
        assert all("event loop that opened it" in e for e in errors)
        assert c.state.value == "open" and c.drain_acks() == [queued]
        c.free_host(queued.host_indices)
        assert (c.device_allocator.available, c.host_allocator.available) == free
        assert not c.busy
        back = await c.load_back(host)  # on its own loop, all still works
        assert back is not None
        assert all(torch.equal(a, b) for a, b in zip(kv_at(c, back), kv_at(c, src), strict=True))
        c.free_device(back)
        c.free_host(host)
        c.free_device(src)
    assert c.device_allocator.available == c.device_allocator.num_slots


def test_between_loop_runs_the_opening_thread_may_call_synchronous_verbs() -> None:
    loop = asyncio.new_event_loop()
    try:
        c = make()
        loop.run_until_complete(c.open())
        src = c.device_allocator.alloc(16)
        assert src is not None
        ack = c.submit_write(src)  # the loop is not running: same thread, allowed
        assert ack is not None
        loop.run_until_complete(ack)
        assert c.free_host(ack.host_indices) == 16
        loop.run_until_complete(c.aclose())
    finally:
        loop.close()


@pytest.mark.parametrize("verb", ["backup", "load_back"])
async def test_a_large_transfer_checks_its_slots_and_queues_in_two_loop_steps(
    verb: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backup / load_back of 64k slots or more read the caller's slots once, in a
    loop step of their own, and decide (state checks, allocation, queueing) in a
    later one, from the page ids: the caller's tensor changed between the two
    changes nothing."""
    ps = 16
    n = 1 << 16
    async with make(
        layers=1,
        heads=1,
        dim=4,
        page_size=ps,
        device_slots=2 * n,
        host_slots=n,
        inline_copy_bytes=0,
    ) as c:
        src, host = await backed_up(c, n) if verb == "load_back" else (None, None)
        dev = c.device_allocator.alloc(n) if verb == "backup" else None
        given = dev if verb == "backup" else host
        assert given is not None
        original = given.clone()
        loop = asyncio.get_running_loop()
        step = [0]

        def tick() -> None:
            step[0] += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        seen: dict[str, list[int]] = {"check": [], "queue": []}
        real_check = controller_module.check_slot_pages

        def check(indices: object, *args: object, **kw: object) -> object:
            if indices is given:
                seen["check"].append(step[0])
                # The caller reuses its tensor once the check's step is over:
                # nothing may read it again.
                loop.call_soon(given.fill_, 0)
                return real_check(indices, *args, **kw)  # type: ignore[arg-type]
            return real_check(indices, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(controller_module, "check_slot_pages", check)
        queue = "queue_write" if verb == "backup" else "queue_load"
        real_queue = getattr(c._copies, queue)

        def queued(*args: object) -> object:
            seen["queue"].append(step[0])
            return real_queue(*args)

        monkeypatch.setattr(c._copies, queue, queued)
        out = await (c.backup(given) if verb == "backup" else c.load_back(given))
        assert out is not None
        assert len(seen["check"]) == 1 and len(seen["queue"]) == 1
        assert seen["queue"][0] > seen["check"][0] > 0
        if verb == "backup":
            assert torch.equal(c.host_pool.layer(0, 0)[out], c.device_pool.buffers[0][0][original])
        else:
            assert src is not None
            assert all(torch.equal(a, b) for a, b in zip(kv_at(c, out), kv_at(c, src), strict=True))
        c.ledger.check_invariants()
