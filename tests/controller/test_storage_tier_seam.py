"""`StorageTier` through its narrow seam: a `HostSlots` that is not a controller.

The tier is built here over a plain host pool and allocator (`FakeSlots`
below), with its own `TaskGroup`: no `TierController` exists in this file.
What it may do to the host pool is exactly the `HostSlots` protocol, and the
fake records every hold and release so the tests see the slot books balance.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import torch

from tiercache import HostKVPool, KVLayout, PageAllocator
from tiercache._tasks import TaskGroup
from tiercache.errors import StateError
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.keys import StorageNamespace
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import (
    HostSlots,
    PrefetchOperation,
    PrefetchState,
    StorageTier,
    StorageTierConfig,
)

PS = 16


class FakeSlots:
    """A `HostSlots` over a bare pool: counts holds (and fills) per slot and every fault call."""

    def __init__(self) -> None:
        layout = KVLayout(2, 2, 8, torch.float16, PS)
        self.pool = HostKVPool(layout, 1024)
        self.allocator = PageAllocator(1024, PS)
        self.device = torch.device("cpu")
        self.held = torch.zeros(1024, dtype=torch.int64)
        self.filled = torch.zeros(1024, dtype=torch.int64)
        self.failed: list[StorageTier] = []

    def hold(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        self.held[host_indices] += 1
        if fill:
            self.filled[host_indices] += 1

    def release(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        self.held[host_indices] -= 1
        if fill:
            self.filled[host_indices] -= 1
        assert int(self.held.min()) >= 0, "released more than held"
        assert int(self.filled.min()) >= 0, "released more fills than held"

    def allocated(self, host_indices: torch.Tensor) -> bool:
        return self.allocator.is_allocated(host_indices)

    def free(self, host_indices: torch.Tensor) -> None:
        self.allocator.free(host_indices)

    def spoiled(self, host_indices: torch.Tensor) -> bool:
        return False

    def in_use(self, host_indices: torch.Tensor) -> bool:
        return bool(self.held[host_indices].any())

    def filling(self, host_indices: torch.Tensor) -> bool:
        return bool(self.filled[host_indices].any())

    def storage_failed(self, tier: StorageTier) -> None:
        self.failed.append(tier)


def _tier(slots: FakeSlots, tasks: TaskGroup, backend: object, **cfg: object) -> StorageTier:
    namespace = StorageNamespace.for_layout(slots.pool.layout, "layer_first", model="seam")
    conf = StorageTierConfig(prefetch_threshold=PS, io_batch_pages=2, timeout_s=2.0, **cfg)  # type: ignore[arg-type]
    return StorageTier(slots, tasks, backend, namespace, conf, owns_backend=False)  # type: ignore[arg-type]


@pytest.fixture
async def seam() -> AsyncIterator[tuple[FakeSlots, TaskGroup, StorageTier]]:
    slots, tasks = FakeSlots(), TaskGroup("seam test")
    tier = _tier(slots, tasks, MemoryBackend())
    yield slots, tasks, tier
    await tier.stop()
    await tasks.aclose()


def _fill(slots: FakeSlots, host: torch.Tensor, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    pages = slots.pool.page_buffers(host)
    for p in pages:
        for seg in p.segments:
            raw = seg.cast("B")
            raw[:] = rng.randbytes(raw.nbytes)
    return [p.tobytes() for p in pages]


def test_the_fake_is_a_host_slots() -> None:
    slots: HostSlots = FakeSlots()  # mypy checks the protocol here
    assert slots.pool.layout.page_size == PS


async def test_backup_then_prefetch_through_a_host_slots_that_is_no_controller(
    seam: tuple[FakeSlots, TaskGroup, StorageTier],
) -> None:
    slots, tasks, tier = seam
    tokens = list(range(6 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    expect = _fill(slots, src, 1)
    backup = tier.write_storage(src, tokens)
    assert int(slots.held[src].min()) == 1  # held while the backend reads them
    await backup.wait()
    assert backup.succeeded and int(slots.held.sum()) == 0
    start = slots.allocator.available
    dst = slots.allocator.alloc(8 * PS)
    assert dst is not None
    op = tier.prefetch("r", dst, tokens + list(range(9000, 9000 + 2 * PS)))
    assert op is not None
    await op.wait()
    assert op.state is PrefetchState.DONE
    n, hashes = op.take_completed()
    assert n == len(tokens) and len(hashes) == 6
    assert [p.tobytes() for p in slots.pool.page_buffers(dst[:n])] == expect
    # The two unfilled pages went back to the fake's allocator; nothing is held.
    assert slots.allocator.available == start - n
    assert int(slots.held.sum()) == 0
    assert tasks.failures == 0


async def test_auto_detach_asks_the_owner_through_storage_failed() -> None:
    slots, tasks = FakeSlots(), TaskGroup("seam test")
    bad = FaultyBackend(MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.ERROR)))
    tier = _tier(slots, tasks, bad, fault_policy="auto_detach", fault_threshold=2)
    for i in range(2):
        host = slots.allocator.alloc(2 * PS)
        assert host is not None
        op = tier.prefetch(i, host, list(range(2 * PS)))
        assert op is not None
        await op
    assert slots.failed == [tier] and tier.down
    await tier.stop()
    await tasks.aclose()
    assert int(slots.held.sum()) == 0


async def test_prefetch_and_backup_operations_complete_publicly(
    seam: tuple[FakeSlots, TaskGroup, StorageTier],
) -> None:
    slots, _, tier = seam
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    order: list[str] = []
    backup = tier.write_storage(src, tokens)
    assert not backup.done()
    backup.add_done_callback(lambda b: order.append(f"first {b is backup}"))
    backup.add_done_callback(lambda b: order.append("second"))

    async def awaiter() -> None:
        await backup
        order.append("awaiter")

    waiting = asyncio.ensure_future(awaiter())
    await backup.wait()
    await waiting
    assert backup.done() and order == ["first True", "second", "awaiter"]

    dst = slots.allocator.alloc(len(tokens))
    assert dst is not None
    op = tier.prefetch("r", dst, tokens)
    assert op is not None
    seen: list[PrefetchOperation] = []
    op.add_done_callback(seen.append)
    with pytest.raises(StateError):
        op.take_completed()  # not ended yet: nothing to hand over
    await op.wait()
    assert op.done() and seen == [op]
    late: list[PrefetchOperation] = []
    op.add_done_callback(late.append)  # after the end: still called, soon
    await asyncio.sleep(0)
    assert late == [op]


async def test_cancelling_a_wait_does_not_stop_the_operation(
    seam: tuple[FakeSlots, TaskGroup, StorageTier],
) -> None:
    slots, _, tier = seam
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    backup = tier.write_storage(src, tokens)
    waiter = asyncio.ensure_future(backup.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await backup.wait()
    assert backup.succeeded


async def test_take_completed_is_idempotent_and_hands_over_once() -> None:
    slots, tasks = FakeSlots(), TaskGroup("seam test")
    tier = _tier(slots, tasks, MemoryBackend(), prefetch_capacity_tokens=4 * PS)
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    await tier.write_storage(src, tokens)
    dst = slots.allocator.alloc(len(tokens))
    assert dst is not None
    op = tier.prefetch("r", dst, tokens)
    assert op is not None
    await op
    assert tier.rate_limited()  # the completed pages still count against the cap
    first = op.take_completed()
    assert first == (len(tokens), op.hash_values)
    assert not tier.rate_limited()  # handed over: no longer the tier's
    # Again, and through terminate_prefetch: the same answer, nothing handed over twice.
    assert op.take_completed() == first
    assert await tier.terminate_prefetch(op) == first
    extra = slots.allocator.alloc(len(tokens))
    assert extra is not None
    op2 = tier.prefetch("r2", extra, tokens)
    assert op2 is not None  # under the cap again, by exactly one handover
    assert tier.rate_limited()
    await tier.stop()
    await tasks.aclose()


async def test_wait_idle_wakes_on_the_last_end_without_polling(
    seam: tuple[FakeSlots, TaskGroup, StorageTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, _, tier = seam
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    backup = tier.write_storage(src, tokens)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def counting_sleep(delay: float, *args: object) -> object:
        sleeps.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counting_sleep)
    assert tier.busy
    await tier.wait_idle()
    assert backup.done() and not tier.busy
    assert [d for d in sleeps if d > 0] == []


async def test_a_bug_in_a_storage_coroutine_surfaces_once_through_the_group(
    seam: tuple[FakeSlots, TaskGroup, StorageTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, tasks, tier = seam
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    assert src is not None
    await tier.write_storage(src, tokens)

    async def broken(*_args: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(tier, "_read_batch", broken)
    dst = slots.allocator.alloc(len(tokens))
    assert dst is not None
    op = tier.prefetch("r", dst, tokens)
    assert op is not None
    await op.wait()
    await asyncio.sleep(0)  # the group's done callback
    assert op.state is PrefetchState.FAILED and isinstance(op.error, ZeroDivisionError)
    assert int(slots.held.sum()) == 0 and slots.allocator.available == 1024 - len(tokens)
    assert tasks.failures == 1
    with pytest.raises(StateError) as e:
        tasks.raise_failure()
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    tasks.raise_failure()  # raised once only
    assert not hasattr(tier, "error")


async def test_a_closed_group_refuses_a_backup_and_nothing_stays_held() -> None:
    slots, tasks = FakeSlots(), TaskGroup("seam test")
    tier = _tier(slots, tasks, MemoryBackend())
    await tier.stop()
    await tasks.aclose()
    src = slots.allocator.alloc(2 * PS)
    assert src is not None
    with pytest.raises(StateError, match="closed"):
        tier.write_storage(src, list(range(2 * PS)))
    assert int(slots.held.sum()) == 0 and not tier.busy


async def test_the_tier_refuses_slots_another_of_its_operations_fills_or_reads(
    seam: tuple[FakeSlots, TaskGroup, StorageTier],
) -> None:
    """The tier's own verbs keep the rule its owner's verbs keep: no backup of
    slots a prefetch fills, no prefetch into slots a backup reads."""
    slots, _, tier = seam
    tokens = list(range(4 * PS))
    src = slots.allocator.alloc(len(tokens))
    dst = slots.allocator.alloc(len(tokens))
    assert src is not None and dst is not None
    _fill(slots, src, 2)
    backup = tier.write_storage(src, tokens)
    op = tier.prefetch("r", dst, list(range(100, 100 + len(tokens))))
    assert op is not None
    with pytest.raises(StateError, match="prefetch"):
        tier.write_storage(dst, tokens)
    with pytest.raises(StateError):
        tier.prefetch("again", src, tokens)
    with pytest.raises(StateError):
        tier.prefetch("twice", dst, tokens)
    assert slots.filling(dst) and not slots.filling(src)
    await backup.wait()
    await op.wait()
    op.take_completed()
    assert int(slots.held.sum()) == 0 and int(slots.filled.sum()) == 0


async def test_forgetting_uncollected_prefixes_keeps_counting_running_prefetches() -> None:
    slots, tasks = FakeSlots(), TaskGroup("seam test")
    tier = _tier(slots, tasks, MemoryBackend(), prefetch_capacity_tokens=8 * PS)
    tokens = list(range(4 * PS))

    def alloc(n: int) -> torch.Tensor:
        host = slots.allocator.alloc(n)
        assert host is not None
        return host

    await tier.write_storage(alloc(len(tokens)), tokens)
    ended = tier.prefetch("ended", alloc(len(tokens)), tokens)
    assert ended is not None
    await ended
    running = tier.prefetch("running", alloc(len(tokens)), tokens)
    assert running is not None and tier.rate_limited()
    tier.forget_uncollected()  # the ended one stops counting; the running one does not
    assert not tier.rate_limited()
    await running
    assert running.take_completed()[0] == len(tokens)
    assert ended.take_completed()[0] == len(tokens)  # nothing handed over twice
    full = tier.prefetch("full", alloc(8 * PS), list(range(8 * PS)))
    assert full is not None and tier.rate_limited()  # exactly the cap is free
    await tier.stop()
    await tasks.aclose()
