"""Copy lifetimes on the CPU: failed copies settle before anything is freed, and
loads are ordered after the backups they read.

On a GPU a copy job only *queues* its copies; they keep running after the job
raises. `FakeDMA` models that on the CPU: a copy the faulty engine "queues"
lands a little later on its own thread, and only `CopyStream.settle` (what a
CUDA job does by recording an event and synchronizing it) waits for it. A slot
freed, or a failure reported, while such a copy is still running is exactly
the use-after-free a GPU would hit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.errors import InvalidInputError, StateError
from tiercache.transfer.engine import TransferPlan
from tiercache.transfer.streams import CopyStream

LAYERS = 3
PS = 16


class CopyFault(RuntimeError):
    """The injected copy failure (a device temporary's OOM looks like this)."""


class FakeDMA:
    """Copies that land ``delay`` seconds after they are queued, each on its own thread."""

    def __init__(self, delay: float = 0.2) -> None:
        self.delay = delay
        self.threads: list[threading.Thread] = []

    def queue(self, copy: Callable[[], None]) -> None:
        def land() -> None:
            time.sleep(self.delay)
            with torch.inference_mode():
                copy()

        t = threading.Thread(target=land, name="fake-dma")
        t.start()
        self.threads.append(t)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def settle(self) -> None:
        for t in self.threads:
            t.join()


@pytest.fixture
def dma(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDMA]:
    fake = FakeDMA()
    original = getattr(CopyStream, "settle", None)

    def settle(self: CopyStream) -> None:
        fake.settle()
        if original is not None:
            original(self)

    monkeypatch.setattr(CopyStream, "settle", settle, raising=False)
    yield fake
    fake.settle()


def make(**kw: Any) -> TierController:
    lay = KVLayout(LAYERS, 2, 8, torch.float32, PS)
    dev = DeviceKVPool(lay, 256)
    gen = torch.Generator().manual_seed(1)
    for buf in dev.buffers:
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=gen))
    host = HostKVPool(lay, 512)
    host.buffer.fill_(-1.0)
    kw.setdefault("inline_copy_bytes", 0)  # through the copy worker, as on a GPU
    return TierController(dev, host, **kw)


def kv(c: TierController, slots: torch.Tensor) -> list[torch.Tensor]:
    return [
        c.device_pool.buffers[b][layer][slots].clone()
        for b in range(c.layout.num_buffers)
        for layer in range(LAYERS)
    ]


def host_kv(c: TierController, slots: torch.Tensor) -> list[torch.Tensor]:
    return [
        c.host_pool.layer(b, layer)[slots].clone()
        for b in range(c.layout.num_buffers)
        for layer in range(LAYERS)
    ]


def watch_frees(c: TierController, dma: FakeDMA) -> list[str]:
    """Record every free made while a queued copy is still running."""
    early: list[str] = []
    for name in ("device_allocator", "host_allocator"):
        alloc = getattr(c, name)
        free = alloc.free

        def checked(
            indices: torch.Tensor, *a: Any, _f: Any = free, _n: str = name, **k: Any
        ) -> Any:
            if dma.running():
                early.append(f"{_n}.free while a copy was still running")
            return _f(indices, *a, **k)

        alloc.free = checked
    return early


LOAD_FAULTS = [(layer, phase) for layer in range(LAYERS) for phase in ("before", "after")]


@pytest.mark.parametrize(("fault_layer", "phase"), LOAD_FAULTS)
async def test_a_failed_load_settles_before_its_slots_are_freed_and_a_retry_is_correct(
    dma: FakeDMA, fault_layer: int, phase: str
) -> None:
    """A load that fails before / after queuing layer ``fault_layer``'s copy."""
    async with make() as c:
        src = c.device_allocator.alloc(64)
        assert src is not None
        expect = kv(c, src)
        host = await c.backup(src)
        assert host is not None
        c.free_device(src)
        dev_free = c.device_allocator.available
        early = watch_frees(c, dma)
        original = c.engine.load_layer

        def faulty(layer: int, plan: TransferPlan) -> None:
            if layer == fault_layer and phase == "before":
                raise CopyFault(f"layer {layer}")
            dma.queue(lambda: original(layer, plan))
            if layer == fault_layer and phase == "after":
                raise CopyFault(f"layer {layer}")

        c.engine.load_layer = faulty  # type: ignore[method-assign]
        ack = c.submit_load(host)
        assert ack is not None
        handle = c.start_loading()
        assert handle is not None
        reported: list[bool] = []

        def consumer() -> None:
            # A forward pass blocked on the last layer: it learns of the
            # failure only once nothing the load queued is still running.
            with pytest.raises(CopyFault):
                handle.wait_layer(LAYERS - 1, timeout=10)
            reported.append(dma.running())

        waiter = asyncio.create_task(asyncio.to_thread(consumer))
        with pytest.raises(CopyFault):
            await handle
        assert not dma.running(), "the load reported failure while its copies still ran"
        with pytest.raises(CopyFault):
            await ack
        await waiter
        assert reported == [False]
        assert not c.ack_busy("device", ack.device_indices)
        c.free_device(ack.device_indices)  # the caller frees a failed load's slots
        assert early == []
        assert c.device_allocator.available == dev_free
        assert c.stats.copy_errors == 1

        # The copy engine works again: a retry serves the right KV.
        c.engine.load_layer = original  # type: ignore[method-assign]
        again = await c.load_back(host)
        assert again is not None
        for got, want in zip(kv(c, again), expect, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("fault_layer", range(LAYERS))
async def test_load_back_frees_a_failed_loads_slots_only_after_it_settled(
    dma: FakeDMA, fault_layer: int
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(32)
        assert src is not None
        expect = kv(c, src)
        host = await c.backup(src)
        assert host is not None
        c.free_device(src)
        dev_free = c.device_allocator.available
        early = watch_frees(c, dma)
        original = c.engine.load_layer

        def faulty(layer: int, plan: TransferPlan) -> None:
            dma.queue(lambda: original(layer, plan))
            if layer == fault_layer:
                raise CopyFault(f"layer {layer}")

        c.engine.load_layer = faulty  # type: ignore[method-assign]
        with pytest.raises(CopyFault):
            await c.load_back(host)
        assert early == []
        assert c.device_allocator.available == dev_free
        c.engine.load_layer = original  # type: ignore[method-assign]
        again = await c.load_back(host)
        assert again is not None
        for got, want in zip(kv(c, again), expect, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("phase", ["before", "after"])
async def test_a_failed_backup_settles_before_its_host_slots_are_freed(
    dma: FakeDMA, phase: str
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(48)
        assert src is not None
        expect = kv(c, src)
        host_free = c.host_allocator.available
        early = watch_frees(c, dma)
        original = c.engine.backup_all_layers

        def faulty(plan: TransferPlan) -> None:
            if phase == "after":
                dma.queue(lambda: original(plan))
            raise CopyFault("backup")

        c.engine.backup_all_layers = faulty  # type: ignore[method-assign]
        with pytest.raises(CopyFault):
            await c.backup(src)  # frees its host slots on failure
        assert early == []
        assert c.host_allocator.available == host_free
        assert not c.ack_busy("device", src)
        c.engine.backup_all_layers = original  # type: ignore[method-assign]
        host = await c.backup(src)
        assert host is not None
        for got, want in zip(host_kv(c, host), expect, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("inline", [True, False])
async def test_a_load_of_host_slots_still_being_written_waits_for_the_write(
    inline: bool,
) -> None:
    """``write`` then ``load`` of its host slots before the write started or finished."""
    async with make(auto_start_writes=False, inline_copy_bytes=1 << 30 if inline else 0) as c:
        src = c.device_allocator.alloc(64)
        assert src is not None
        expect = kv(c, src)
        ack = c.submit_write(src)
        assert ack is not None
        dst = c.load(ack.host_indices)  # the write is still queued
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None
        async with asyncio.timeout(10):  # the write must have been started for the load
            await handle
            await ack
        for got, want in zip(kv(c, dst), expect, strict=True):
            assert torch.equal(got, want)


async def test_a_load_waits_for_a_slow_backup_into_its_host_slots() -> None:
    async with make() as c:
        src = c.device_allocator.alloc(64)
        assert src is not None
        expect = kv(c, src)
        original = c.engine.backup_all_layers

        def slow(plan: TransferPlan) -> None:
            time.sleep(0.2)  # on the write stream's worker, not the loop
            original(plan)

        c.engine.backup_all_layers = slow  # type: ignore[method-assign]
        ack = c.submit_write(src)
        assert ack is not None
        c.start_writing()
        dst = c.load(ack.host_indices)
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None
        await handle
        assert ack.done()
        for got, want in zip(kv(c, dst), expect, strict=True):
            assert torch.equal(got, want)


async def test_a_load_of_host_slots_whose_backup_failed_fails_too() -> None:
    async with make() as c:
        src = c.device_allocator.alloc(32)
        assert src is not None

        def broken(plan: TransferPlan) -> None:
            time.sleep(0.05)
            raise CopyFault("backup")

        c.engine.backup_all_layers = broken  # type: ignore[method-assign]
        ack = c.submit_write(src)
        assert ack is not None
        c.start_writing()
        dst = c.load(ack.host_indices)
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None
        with pytest.raises(StateError, match="backup"):
            await handle
        with pytest.raises(CopyFault):
            await ack


async def test_ready_is_refused_on_a_cpu_pool() -> None:
    async with make() as c:
        src = c.device_allocator.alloc(16)
        assert src is not None
        with pytest.raises(InvalidInputError, match="ready"):
            c.submit_write(src, ready=object())  # type: ignore[arg-type]
        assert c.host_allocator.available == c.host_allocator.num_slots
        with pytest.raises(InvalidInputError, match="ready"):
            c.free_device(src, ready=object())  # type: ignore[arg-type]
        assert c.device_allocator.is_allocated(src)


async def test_a_small_load_waiting_for_a_backup_does_not_run_on_the_loop() -> None:
    """A load small enough to run inline, of host slots a slow backup still fills."""
    token_bytes = 2 * LAYERS * 2 * 8 * 4
    async with make(inline_copy_bytes=32 * token_bytes) as c:
        src = c.device_allocator.alloc(64)  # the backup goes to the worker
        assert src is not None
        expect = kv(c, src[:16])
        original = c.engine.backup_all_layers

        def slow(plan: TransferPlan) -> None:
            time.sleep(0.3)
            original(plan)

        c.engine.backup_all_layers = slow  # type: ignore[method-assign]
        ack = c.submit_write(src)
        assert ack is not None
        c.start_writing()
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.perf_counter()
            while not ack.done():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.02)
        dst = c.load(ack.host_indices[:16])  # 16 tokens: under the inline size
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None
        await handle
        await beat
        assert max(gaps) < 0.2, f"the loop stalled {max(gaps):.3f} s"
        for got, want in zip(kv(c, dst), expect, strict=True):
            assert torch.equal(got, want)


async def test_a_queued_copy_uses_the_slots_given_not_a_reused_index_tensor() -> None:
    """submit_write and submit_load kept the caller's index tensor in the queued
    copy (and its ack), and read it when the copy ran: a caller that reused its
    tensor for the next batch before then backed up, or loaded, other slots."""
    async with make() as c:
        dev = c.device_allocator.alloc(2 * PS)
        assert dev is not None
        want = kv(c, dev[:PS])
        given = dev[:PS].clone()
        ack = c.submit_write(given)
        assert ack is not None
        given.copy_(dev[PS:])  # reused before the queued write starts
        await ack
        assert torch.equal(ack.device_indices, dev[:PS])
        assert all(map(torch.equal, host_kv(c, ack.host_indices), want))
        host = ack.host_indices.clone()
        other = await c.backup(dev[PS:])
        assert other is not None
        load = c.submit_load(host)
        assert load is not None
        host.copy_(other)  # reused before the load starts
        handle = c.start_loading()
        assert handle is not None
        await handle
        assert torch.equal(load.host_indices, ack.host_indices)
        assert all(map(torch.equal, kv(c, load.device_indices), want))


async def test_storage_verbs_use_the_slots_given_not_a_reused_index_tensor() -> None:
    """write_storage read the caller's host index tensor batch by batch, later:
    reused at once, it stored another page's KV under these tokens' key, for
    every instance sharing the store. A prefetch fills its slots later too."""
    from tiercache.index.hashing import page_hashes
    from tiercache.storage.memory import MemoryBackend
    from tiercache.storage_tier import StorageTierConfig

    async with make(storage_config=StorageTierConfig(prefetch_threshold=PS)) as c:
        await c.attach_storage_backend(MemoryBackend())
        dev = c.device_allocator.alloc(2 * PS)
        assert dev is not None
        host = await c.backup(dev)
        assert host is not None
        want = host_kv(c, host[:PS])
        given = host[:PS].clone()
        hashes = page_hashes(list(range(PS)), PS)
        op = c.write_storage(given, list(range(PS)), hash_values=hashes)
        assert op is not None
        given.copy_(host[PS:])  # reused before the backup reads it
        hashes[0] = "cd" * 32
        await op.wait()
        assert op.succeeded
        into = c.host_allocator.alloc(2 * PS)
        assert into is not None
        target = into[:PS].clone()
        fetch = c.prefetch("r", target, list(range(PS)))
        assert fetch is not None
        target.copy_(into[PS:])  # reused before the pages land
        await fetch.wait()
        done, _ = await c.terminate_prefetch(fetch)
        assert done == PS
        assert all(map(torch.equal, host_kv(c, into[:PS]), want))
