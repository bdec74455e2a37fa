"""The CUDA copy paths never hold the host for the GPU (the `gpu` marker: skipped without CUDA).

With the copy stream held busy for 300 ms by ``torch.cuda._sleep``, queuing a
load or a backup, for both host layouts and for contiguous and scattered
slots, blocks the host for less than 50 ms: every copy between the device
and the host pool is queued from page-locked memory. Then: a load that fails
at a later layer, the device context of the copy threads, the staging ring's
events and a caller's ready event re-recorded after submission.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import CopyEngine
from tiercache.transfer.streams import Completion, CopyStream

pytestmark = pytest.mark.gpu

PS = 16
LAYERS = 4
SPIN_MS = 300.0
BLOCK_LIMIT_S = 0.050

PATTERNS = {
    "contiguous": (list(range(0, 24)), list(range(8, 32))),
    "scattered": (
        [50, 3, 17, 40, 9, 61, 22, 5, 33, 12, 44, 1],
        [7, 44, 2, 19, 58, 30, 11, 36, 25, 1, 60, 13],
    ),
}


@pytest.fixture(autouse=True)
def _sync() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


def _engine(host_layout: str) -> tuple[DeviceKVPool, HostKVPool, CopyEngine]:
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    device = DeviceKVPool(lay, 64 * PS, device="cuda")
    host = HostKVPool(lay, 64 * PS, host_layout=host_layout)
    for bufs in device.buffers:
        for t in bufs:
            t.copy_(torch.randn(t.shape, device="cuda").half())
    return device, host, CopyEngine(device, host)


@pytest.mark.parametrize("index_path", [False, True], ids=["planned", "index-path"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_loads_and_backups_do_not_block_the_host_while_the_copy_stream_is_busy(
    host_layout: str,
    pattern: str,
    index_path: bool,
    cycles_per_ms: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if index_path:
        monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host, engine = _engine(host_layout)
    hp, dp = PATTERNS[pattern]
    h, d = _slots(hp), _slots(dp)
    want = [t[d.cuda()].cpu() for bufs in device.buffers for t in bufs]
    copy = torch.cuda.Stream()
    with torch.cuda.stream(copy):
        plan = engine.plan(h, d.pin_memory())
        torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))
        t0 = time.perf_counter()
        engine.backup_all_layers(plan)
        backup_s = time.perf_counter() - t0
        for bufs in device.buffers:
            for t in bufs:
                t.zero_()
        torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))
        t0 = time.perf_counter()
        engine.load_all_layers(plan)
        load_s = time.perf_counter() - t0
    copy.synchronize()
    assert backup_s < BLOCK_LIMIT_S, f"the backup blocked the host {backup_s:.3f} s"
    assert load_s < BLOCK_LIMIT_S, f"the load blocked the host {load_s:.3f} s"
    got = [t[d.cuda()].cpu() for bufs in device.buffers for t in bufs]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
async def test_wait_layer_device_does_not_block_the_host_for_either_layout(
    host_layout: str, pattern: str, cycles_per_ms: float
) -> None:
    """Through the controller: two loads behind a busy compute stream, waited layer by layer."""
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    async with TierController(
        DeviceKVPool(lay, 64 * PS, device="cuda"), HostKVPool(lay, 64 * PS, host_layout=host_layout)
    ) as c:
        hp, _ = PATTERNS[pattern]
        src = c.device_allocator.alloc(64 * PS)
        assert src is not None
        host = await c.backup(src[: len(hp) * PS])
        assert host is not None
        c.free_device(src)
        torch.cuda._sleep(int(cycles_per_ms * 2 * SPIN_MS))  # the compute stream is busy
        first = c.load(host)
        h1 = c.start_loading()
        second = c.load(host)
        h2 = c.start_loading()
        assert first is not None and second is not None and h1 is not None and h2 is not None

        def forward() -> float:
            t = time.perf_counter()
            for layer in range(LAYERS):
                h1.wait_layer_device(layer)
                h2.wait_layer_device(layer)
            return time.perf_counter() - t

        wait_s = await asyncio.to_thread(forward)
        assert wait_s < BLOCK_LIMIT_S, f"wait_layer_device blocked the host {wait_s:.3f} s"
        await h1
        await h2


async def test_a_load_failing_at_its_second_layer_keeps_the_first(cycles_per_ms: float) -> None:
    lay = KVLayout(LAYERS, 4, 64, torch.float16, PS)
    async with TierController(DeviceKVPool(lay, 1024, device="cuda"), HostKVPool(lay, 1024)) as c:
        src = c.device_allocator.alloc(4 * PS)
        assert src is not None
        host = await c.backup(src)
        assert host is not None
        real = c.engine.load_layer

        def load_layer(layer: int, plan: engine_module.TransferPlan) -> None:
            if layer == 1:
                raise RuntimeError("layer 1 failed")
            real(layer, plan)

        c.engine.load_layer = load_layer  # type: ignore[method-assign]
        torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))
        dev = c.load(host)
        handle = c.start_loading()
        assert dev is not None and handle is not None

        def forward() -> list[str]:
            out = []
            for layer in range(2):
                try:
                    handle.wait_layer_device(layer)
                    out.append("ok")
                except RuntimeError:
                    out.append("failed")
            return out

        assert await asyncio.to_thread(forward) == ["ok", "failed"]
        with pytest.raises(RuntimeError):
            await handle


def test_a_copy_streams_threads_run_on_its_device() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    stream = CopyStream("ctx", device)
    seen: dict[str, int] = {}

    def job() -> Completion:
        seen["enqueue"] = torch.cuda.current_device()
        ev = stream.record_event()
        return Completion([(ev, lambda: seen.__setitem__("settle", torch.cuda.current_device()))])

    try:
        stream.submit(job).result(timeout=10)
    finally:
        stream.close()
    assert seen == {"enqueue": device.index, "settle": device.index}


def test_a_host_pool_built_on_a_fresh_thread_is_pinned_for_its_device() -> None:
    lay = KVLayout(2, 4, 64, torch.float16, PS)
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    pools: list[HostKVPool] = []
    t = threading.Thread(target=lambda: pools.append(HostKVPool(lay, 256, device=device)))
    t.start()
    t.join()
    assert pools[0].device == device and pools[0].buffer.is_pinned()


def test_staging_events_are_recorded_on_the_copy_stream(
    cycles_per_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host, engine = _engine("layer_first")
    hp, dp = PATTERNS["scattered"]
    copy = torch.cuda.Stream()
    with torch.cuda.stream(copy):
        plan = engine.plan(_slots(hp), _slots(dp).pin_memory())
        torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))
        engine.load_all_layers(plan)
    staging = engine.staging
    assert staging is not None
    pending = [ev for ev in staging._events if ev is not None]
    assert pending and not any(ev.query() for ev in pending)  # behind the busy copy stream
    assert staging.waits == 0
    copy.synchronize()
    assert all(ev.query() for ev in pending)


async def test_a_ready_event_recorded_again_after_submission_keeps_its_first_point(
    cycles_per_ms: float,
) -> None:
    lay = KVLayout(2, 4, 64, torch.float16, PS)
    async with TierController(DeviceKVPool(lay, 1024, device="cuda"), HostKVPool(lay, 1024)) as c:
        src = c.device_allocator.alloc(4 * PS)
        assert src is not None
        producer = torch.cuda.Stream()
        ready = torch.cuda.Event()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))
            for bufs in c.device_pool.buffers:
                for t in bufs:
                    t.index_fill_(0, src.cuda(), 7.0)
            ready.record()
        ack = c.submit_write(src, ready=ready)
        assert ack is not None
        ready.record(torch.cuda.Stream())  # recorded again, on an idle stream
        c.start_writing()
        await ack
        host = c.host_pool
        assert all(
            bool((host.layer(b, x)[ack.host_indices] == 7.0).all())
            for b in range(2)
            for x in range(2)
        )


def test_a_cuda_index_tensor_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Reading it waits for the GPU on the calling thread: said once, loudly."""
    from tiercache.memory import allocator

    allocator._warned_device_indices = False
    slots = torch.arange(2 * PS, dtype=torch.int64, device="cuda")
    with caplog.at_level("WARNING", logger="tiercache.memory.allocator"):
        got = allocator.check_slot_indices(slots, PS, 64 * PS, "device_indices")
        allocator.check_slot_indices(slots, PS, 64 * PS, "device_indices")
    assert got.device.type == "cpu" and torch.equal(got, slots.cpu())
    assert sum("waits for the GPU" in r.getMessage() for r in caplog.records) == 1
