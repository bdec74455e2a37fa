"""Public completion of copies, `busy`, settle callbacks, an event-driven
`wait_idle`, the controller's task group, and the verbs' names."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Generator
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache._tasks import TaskGroup
from tiercache.controller import CopyAck, LoadHandle
from tiercache.errors import StateError
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import StorageTierConfig

PS = 16


class CopyFault(RuntimeError):
    """The injected copy failure."""


def make(**kw: Any) -> TierController:
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    return TierController(DeviceKVPool(lay, 256), HostKVPool(lay, 512), **kw)


def dev_slots(c: TierController, pages: int = 1) -> torch.Tensor:
    d = c.device_allocator.alloc(pages * PS)
    assert d is not None
    return d


class Steps:
    """Awaits ``aw`` and counts how many times it suspended (each wake-up is one)."""

    def __init__(self, aw: Awaitable[Any]) -> None:
        self.aw = aw
        self.suspensions = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.aw.__await__()
        try:
            yielded = next(it)
            while True:
                self.suspensions += 1
                try:
                    sent = yield yielded
                except BaseException as e:  # a cancellation: hand it on
                    yielded = it.throw(e)
                else:
                    yielded = it.send(sent)
        except StopIteration as stop:
            return stop.value


class Gate:
    """Makes the copies of ``c`` (``what``: an engine method) wait on their worker thread until opened."""

    def __init__(
        self, c: TierController, monkeypatch: pytest.MonkeyPatch, what: str = "backup_all_layers"
    ) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real = getattr(c.engine, what)

        def gated(*args: Any) -> Any:
            self.entered.set()
            self.open.wait(10)
            return real(*args)

        monkeypatch.setattr(c.engine, what, gated)


async def until_set(event: threading.Event) -> None:
    await asyncio.to_thread(event.wait, 10)
    assert event.is_set()


# -- public completion ----------------------------------------------------------------------


@pytest.mark.parametrize("inline_copy_bytes", [0, 256 * 1024])
async def test_ack_callbacks_run_in_order_after_bookkeeping_and_before_awaiters(
    inline_copy_bytes: int,
) -> None:
    async with make(auto_start_writes=False, inline_copy_bytes=inline_copy_bytes) as c:
        ack = c.submit_write(dev_slots(c, 2))
        assert ack is not None and not ack.done()
        order: list[str] = []

        def callback(name: str) -> Any:
            def fn(a: CopyAck) -> None:
                assert a is ack and a.done() and not a.failed()
                # The controller's bookkeeping for the copy is already done.
                assert not c.ack_busy("host", a.host_indices)
                assert not c.ack_busy("device", a.device_indices)
                order.append(name)

            return fn

        async def awaiter(how: str) -> None:
            if how == "await":
                await ack
            else:
                await ack.wait()
            order.append(how)

        ack.add_done_callback(callback("first"))
        tasks = [asyncio.ensure_future(awaiter("await")), asyncio.ensure_future(awaiter("wait"))]
        ack.add_done_callback(callback("second"))  # after the awaiters started waiting
        for _ in range(3):
            await asyncio.sleep(0)
        assert order == []  # nothing started yet
        assert c.start_writing() == 1
        await asyncio.gather(*tasks)
        assert order[:2] == ["first", "second"]
        assert sorted(order[2:]) == ["await", "wait"]
        late: list[CopyAck] = []
        ack.add_done_callback(late.append)  # after it settled: on the next iteration
        assert late == []
        await asyncio.sleep(0)
        assert late == [ack]


@pytest.mark.parametrize("kind", ["backup", "prefetch", "failed backup"])
async def test_storage_operations_order_their_callbacks_as_copies_do(kind: str) -> None:
    """A prefetch's or a backup's done callbacks run in the order added, all of
    them before any awaiter resumes, and one added late runs on the next
    iteration: the same contract as a `CopyAck`'s (one completion for both)."""
    backend = FaultyBackend(MemoryBackend())
    async with make() as c:
        await c.attach_storage_backend(backend)
        tokens = list(range(2 * PS))
        if kind == "prefetch":
            backup = c.write_storage(c.host_allocator.alloc(2 * PS), tokens)
            assert backup is not None
            await backup
            op: Any = c.prefetch("r", c.host_allocator.alloc(2 * PS), tokens)
        else:
            if kind == "failed backup":
                backend.fail_all()  # every call fails: the backup ends with its error
            op = c.write_storage(c.host_allocator.alloc(2 * PS), tokens)
        assert op is not None and not op.done()
        order: list[str] = []

        async def awaiter(how: str) -> None:
            await (op if how == "await" else op.wait())  # a storage error is not raised
            order.append(how)

        op.add_done_callback(lambda o: order.append("first") if o is op and o.done() else None)
        tasks = [asyncio.ensure_future(awaiter("await")), asyncio.ensure_future(awaiter("wait"))]
        op.add_done_callback(lambda o: order.append("second"))  # after the awaiters started
        await asyncio.gather(*tasks)
        assert order[:2] == ["first", "second"]
        assert sorted(order[2:]) == ["await", "wait"]
        assert op.failed() == (kind == "failed backup") == (op.error is not None)
        late: list[object] = []
        op.add_done_callback(late.append)
        assert late == []
        await asyncio.sleep(0)
        assert late == [op]
        if kind == "prefetch":
            await c.terminate_prefetch(op)


async def test_load_handle_callbacks_run_before_awaiters(monkeypatch: pytest.MonkeyPatch) -> None:
    async with make(inline_copy_bytes=0) as c:
        src = dev_slots(c, 2)
        host = await c.backup(src)
        assert host is not None
        gate = Gate(c, monkeypatch, "load_layer")
        assert c.load(host) is not None
        handle = c.start_loading()
        assert handle is not None
        order: list[str] = []

        def on_done(h: LoadHandle) -> None:
            assert h is handle and h.done()
            assert all(a.done() for a in h.acks)  # every ack settled first
            assert not c.ack_busy("device", h.device_indices)
            order.append("callback")

        async def awaiter() -> None:
            await handle.wait()
            order.append("awaiter")

        task = asyncio.ensure_future(awaiter())
        await until_set(gate.entered)
        handle.add_done_callback(on_done)  # after the awaiter started waiting
        gate.open.set()
        await task
        assert order == ["callback", "awaiter"]


async def test_wait_raises_the_copy_failure_and_callbacks_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make(inline_copy_bytes=0) as c:

        def broken(plan: Any) -> None:
            raise CopyFault("no room for a staging buffer")

        monkeypatch.setattr(c.engine, "backup_all_layers", broken)
        ack = c.submit_write(dev_slots(c))
        assert ack is not None
        seen: list[bool] = []
        ack.add_done_callback(lambda a: seen.append(a.failed()))
        with pytest.raises(CopyFault):
            await ack.wait()
        with pytest.raises(CopyFault):
            await ack
        assert seen == [True]
        assert c.stats.copy_errors == 1
        c.free_host(ack.host_indices)  # released although the copy failed


async def test_a_failing_callback_goes_to_the_loop_handler_and_the_rest_still_run() -> None:
    async with make() as c:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        try:
            ack = c.submit_write(dev_slots(c))
            assert ack is not None
            ran: list[int] = []

            def bad(_a: CopyAck) -> None:
                raise ValueError("a caller's bug")

            ack.add_done_callback(bad)
            ack.add_done_callback(lambda _a: ran.append(1))
            await ack
            assert ran == [1]
            assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)
        finally:
            loop.set_exception_handler(None)


# -- busy, settle callbacks, wait_idle -------------------------------------------------------


async def test_busy_covers_queued_scheduled_and_in_flight_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make(inline_copy_bytes=0) as c:
        assert not c.busy
        gate = Gate(c, monkeypatch)
        ack = c.submit_write(dev_slots(c))
        assert ack is not None
        assert c.busy  # queued, starts on the next iteration
        await until_set(gate.entered)
        assert c.busy  # in flight
        gate.open.set()
        await ack
        assert not c.busy
        assert c.load(ack.host_indices) is not None
        assert not c.busy  # queued for an engine's start_loading: nothing will start it
        handle = c.start_loading()
        assert handle is not None
        assert c.busy
        await handle
        assert not c.busy


async def test_settle_callbacks_fire_on_success_failure_and_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make() as c:
        calls: list[bool] = []
        remove = c.add_settle_callback(lambda: calls.append(c.busy))
        ack = c.submit_write(dev_slots(c))
        assert ack is not None
        await ack
        assert calls == [False]  # after the bookkeeping: nothing is in flight any more
        c.free_host(ack.host_indices)
        assert len(calls) == 2
        c.free_device(ack.device_indices)
        assert len(calls) == 3

        def broken(plan: Any) -> None:
            raise CopyFault("copy failed")

        monkeypatch.setattr(c.engine, "backup_all_layers", broken)
        failed = c.submit_write(dev_slots(c))
        assert failed is not None
        with pytest.raises(CopyFault):
            await failed
        assert len(calls) == 4
        remove()
        remove()  # idempotent
        c.free_host(failed.host_indices)
        assert len(calls) == 4


async def test_wait_idle_sleeps_until_the_last_copy_settles_without_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make(inline_copy_bytes=0) as c:
        gate = Gate(c, monkeypatch)
        ack = c.submit_write(dev_slots(c))
        assert ack is not None
        waiting = Steps(c.wait_idle())
        task = asyncio.ensure_future(waiting)  # type: ignore[arg-type]
        await until_set(gate.entered)
        for _ in range(100):  # the loop turns; a polling wait would wake each time
            await asyncio.sleep(0)
        assert not task.done()
        assert waiting.suspensions == 1
        gate.open.set()
        turns = 0
        while not task.done():
            await asyncio.sleep(0.001 if turns > 20 else 0)  # the copy's thread hop
            turns += 1
            assert turns < 5000
        await task
        assert ack.done()
        assert waiting.suspensions == 1  # it slept once, and woke only when the copy settled


async def test_wait_idle_starts_queued_writes_and_returns_at_once_when_idle() -> None:
    async with make(auto_start_writes=False) as c:
        await c.wait_idle()
        ack = c.submit_write(dev_slots(c))
        assert ack is not None
        await c.wait_idle()
        assert ack.done() and not c.busy


# -- the task group ---------------------------------------------------------------------------


def detaching_controller(**kw: Any) -> TierController:
    conf = StorageTierConfig(
        prefetch_threshold=PS, fault_policy="auto_detach", fault_threshold=1, timeout_s=1.0
    )
    return make(storage_config=conf, **kw)


async def failed_detach(c: TierController) -> None:
    """Attach a failing backend whose tier fails to stop; wait for the automatic detach."""
    faulty = FaultyBackend(MemoryBackend())
    await c.attach_storage_backend(faulty)
    tier = c.storage
    assert tier is not None
    real_stop = tier.stop

    async def stop() -> None:
        await real_stop()
        raise RuntimeError("the backend would not close")

    monkeypatch_stop = stop
    tier.stop = monkeypatch_stop  # type: ignore[method-assign]
    faulty.fail_all(True)
    h = c.host_allocator.alloc(2 * PS)
    assert h is not None
    op = c.prefetch("r", h, list(range(2 * PS)))
    assert op is not None
    await op
    await c.terminate_prefetch(op)
    await c.tasks.join()
    assert c.storage is None and c.stats.storage_auto_detaches == 1
    assert c.tasks.failures == 1


async def test_a_failed_background_detach_is_raised_once_at_the_next_call() -> None:
    async with detaching_controller() as c:
        await failed_detach(c)
        with pytest.raises(StateError, match="background task") as info:
            c.submit_write(dev_slots(c))
        assert isinstance(info.value.__cause__, RuntimeError)
        ack = c.submit_write(dev_slots(c))  # raised once, then never again
        assert ack is not None
        await ack


async def test_a_failed_background_detach_not_raised_before_is_raised_at_close() -> None:
    c = detaching_controller()
    await c.open()
    await failed_detach(c)
    with pytest.raises(StateError, match="background task"):
        await c.aclose()
    await c.aclose()  # idempotent, and the failure is not raised twice


async def test_a_task_group_passed_in_is_used_and_left_open() -> None:
    group = TaskGroup("cache")
    c = detaching_controller(tasks=group)
    assert c.tasks is group
    async with c:
        await failed_detach(c)
    assert group.failures == 1
    with pytest.raises(StateError):  # the owner raises it, once
        await group.aclose()


async def test_a_standalone_controller_closes_its_own_group() -> None:
    c = make()
    async with c:
        pass
    with pytest.raises(StateError, match="closed"):
        c.tasks.spawn(asyncio.sleep(0), "late work")


# -- names ------------------------------------------------------------------------------------


def test_verbs_that_free_slots_are_named_free_and_write_policy_is_gone() -> None:
    assert not hasattr(TierController, "evict_device")
    assert not hasattr(TierController, "evict_host")
    assert callable(TierController.free_device) and callable(TierController.free_host)
    assert "write_policy" not in inspect.signature(TierController).parameters
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    with pytest.raises(TypeError):
        TierController(DeviceKVPool(lay, 32), HostKVPool(lay, 32), write_policy="write_back")  # type: ignore[call-arg]
    assert "policy" not in repr(make())


async def test_a_cancelled_backup_keeps_its_slots_until_its_copy_settles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make(inline_copy_bytes=0) as c:
        gate = Gate(c, monkeypatch)
        free_before = c.host_allocator.available
        task = asyncio.ensure_future(c.backup(dev_slots(c)))
        await until_set(gate.entered)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(10):
            await asyncio.sleep(0)
        assert c.busy
        assert c.host_allocator.available == free_before - PS  # still being written
        gate.open.set()
        await c.wait_idle()  # the release ran as the ack's callback, before the ack settled
        assert c.host_allocator.available == free_before


@pytest.mark.parametrize("outcome", ["landed", "failed"])
async def test_a_handle_reads_the_copy_of_a_merged_load_back_whose_caller_was_cancelled(
    outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling `load_back` cancels its private ack's future, not its copy:
    the `LoadHandle` it was merged into still reports the copy's outcome
    through that ack, and awaiting it raises no CancelledError into a task
    that was never cancelled."""
    async with make(inline_copy_bytes=0) as c:
        host = await c.backup(dev_slots(c))
        assert host is not None
        gate = Gate(c, monkeypatch, "load_layer")
        if outcome == "failed":
            real = c.engine.load_layer

            def failing(*args: Any) -> Any:
                real(*args)
                raise CopyFault("injected")

            monkeypatch.setattr(c.engine, "load_layer", failing)
        task = asyncio.ensure_future(c.load_back(host))
        await asyncio.sleep(0)  # queued; the engine's start takes it too
        mine = c.submit_load(host)
        handle = c.start_loading()
        assert mine is not None and handle is not None and len(handle.acks) == 2
        await until_set(gate.entered)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open.set()
        for ack in handle.acks:
            if outcome == "landed":
                await ack
            else:
                with pytest.raises(CopyFault):
                    await ack
            assert ack.done() and ack.failed() == (outcome == "failed")
        assert handle.failed() == (outcome == "failed")
        await c.wait_idle()
        # The cancelled load_back's slots came back; the source's and mine are held.
        assert c.device_allocator.available == 256 - 2 * PS
        c.free_device(mine.device_indices)
