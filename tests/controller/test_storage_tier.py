"""The storage half of TierController: prefetch, backup, attach/detach, faults, accounting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.errors import (
    ConfigError,
    InvalidInputError,
    StateError,
    StorageError,
)
from tiercache.index.hashing import page_hashes
from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import PrefetchState, StorageTierConfig

PS = 16


def make(
    threshold: int = 32, io_batch_pages: int = 2, timeout_s: float = 2.0, **cfg: object
) -> TierController:
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    dev = DeviceKVPool(lay, 1024)
    gen = torch.Generator().manual_seed(1)
    for buf in dev.buffers:
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=gen).half())
    host = HostKVPool(lay, 2048)
    conf = StorageTierConfig(
        prefetch_threshold=threshold, io_batch_pages=io_batch_pages, timeout_s=timeout_s, **cfg
    )  # type: ignore[arg-type]
    return TierController(dev, host, storage_config=conf, model="test-model")


@pytest.fixture
async def ctl() -> AsyncIterator[TierController]:
    async with make() as c:
        await c.attach_storage_backend(MemoryBackend())
        yield c


def slow_backend(op: str, delay: float) -> FaultyBackend:
    """A memory backend whose ``op`` calls ("get", "set", ...) each take ``delay`` seconds."""
    return FaultyBackend(
        MemoryBackend(), FaultPlan((FaultSpec(FaultKind.LATENCY, delay=delay, ops=(op,)),))
    )


def host_bytes(c: TierController, host: torch.Tensor) -> list[bytes]:
    return [p.tobytes() for p in c.host_pool.page_buffers(host)]


async def store(c: TierController, tokens: list[int]) -> tuple[torch.Tensor, list[bytes]]:
    """Compute-side: put ``tokens``' KV on host and back it up. Returns host slots and page bytes."""
    dev = c.device_allocator.alloc(len(tokens))
    assert dev is not None
    host = await c.backup(dev)
    assert host is not None
    c.free_device(dev)
    op = c.write_storage(host, tokens)
    assert op is not None
    await op
    assert op.succeeded, op.error
    return host, host_bytes(c, host)


async def fetch(
    c: TierController, tokens: list[int], prior: str | None = None
) -> tuple[int, torch.Tensor]:
    host = c.host_allocator.alloc(len(tokens))
    assert host is not None
    op = c.prefetch("req", host, tokens, prior)
    assert op is not None
    await op
    n, hashes = await c.terminate_prefetch(op)
    assert hashes == op.hash_values[: n // PS]
    return n, host[:n]


async def test_prefetch_fetches_what_backup_stored_bit_identically(ctl: TierController) -> None:
    tokens = list(range(1000, 1000 + 20 * PS))
    host, expect = await store(ctl, tokens)
    ctl.free_host(host)
    start = ctl.host_allocator.available
    n, got = await fetch(ctl, tokens)
    assert n == len(tokens)
    assert host_bytes(ctl, got) == expect
    ctl.free_host(got)
    assert ctl.host_allocator.available == start
    assert ctl.storage is not None and ctl.storage.stats.prefetch_completed == 1


async def test_prefetch_stops_at_the_first_missing_page_and_frees_the_rest(
    ctl: TierController,
) -> None:
    stored = list(range(12 * PS))
    await store(ctl, stored)
    start = ctl.host_allocator.available
    n, got = await fetch(ctl, stored + list(range(5000, 5000 + 8 * PS)))
    assert n == len(stored)
    ctl.free_host(got)
    assert ctl.host_allocator.available == start


async def test_prefetch_under_threshold_is_revoked_and_returns_every_host_slot(
    ctl: TierController,
) -> None:
    await store(ctl, list(range(PS)))  # one page stored; threshold is 2 pages
    start = ctl.host_allocator.available
    host = ctl.host_allocator.alloc(4 * PS)
    assert host is not None
    op = ctl.prefetch("r", host, list(range(4 * PS)))
    assert op is not None
    await op
    assert op.state is PrefetchState.REVOKED and op.storage_hit_tokens == PS
    assert await ctl.terminate_prefetch(op) == (0, [])
    assert ctl.host_allocator.available == start
    assert ctl.storage is not None and ctl.storage.stats.prefetch_revoked == 1


async def test_prefetch_chains_from_a_prior_hash(ctl: TierController) -> None:
    tokens = list(range(8 * PS))
    await store(ctl, tokens)
    prior = page_hashes(tokens[: 2 * PS], PS)[-1]
    n, got = await fetch(ctl, tokens[2 * PS :], prior)
    assert n == 6 * PS
    ctl.free_host(got)
    n, got = await fetch(ctl, tokens[2 * PS :])  # without the prior the keys differ
    assert n == 0


@pytest.mark.parametrize(
    "spec",
    [
        FaultSpec(FaultKind.ERROR, ops={"get"}, after_calls=2),
        FaultSpec(FaultKind.TIMEOUT, ops={"get"}, after_calls=2, delay=0.01),
        FaultSpec(FaultKind.HANG, ops={"get"}, after_calls=2),
        FaultSpec(FaultKind.PARTIAL, ops={"get"}, after_calls=2, keep_pages=1),
        FaultSpec(FaultKind.ERROR, ops={"exists"}),
    ],
    ids=["error", "timeout", "hang", "partial", "query-error"],
)
async def test_storage_faults_mid_prefetch_keep_done_pages_and_free_the_rest(
    spec: FaultSpec,
) -> None:
    async with make(timeout_s=0.2, io_concurrency=1) as c:
        inner = MemoryBackend()
        faulty = FaultyBackend(inner, FaultPlan.of(spec, seed=1))
        faulty.disable()
        await c.attach_storage_backend(faulty)
        tokens = list(range(10 * PS))
        host, expect = await store(c, tokens)
        c.free_host(host)
        start = c.host_allocator.available
        faulty.enable()
        n, got = await fetch(c, tokens)
        faulty.disable()
        if spec.ops == {"exists"}:
            assert n == 0
        elif spec.kind is FaultKind.PARTIAL:
            assert n == 5 * PS  # 2 batches of 2 pages, then 1 of the third
        else:
            assert n == 4 * PS  # the two batches before the fault
        assert host_bytes(c, got) == expect[: n // PS]
        c.free_host(got)
        assert c.host_allocator.available == start
        # The controller keeps serving the next request.
        n, got = await fetch(c, tokens)
        assert n == len(tokens) and host_bytes(c, got) == expect
        c.free_host(got)
        assert c.host_allocator.available == start


async def test_backup_error_midway_keeps_the_done_pages() -> None:
    async with make(backup_batch_pages=2) as c:
        faulty = FaultyBackend(
            MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.ERROR, ops={"set"}, after_calls=2))
        )
        await c.attach_storage_backend(faulty)
        tokens = list(range(10 * PS))
        dev = c.device_allocator.alloc(len(tokens))
        assert dev is not None
        host = await c.backup(dev)
        assert host is not None
        op = c.write_storage(host, tokens, node_id="n1")
        assert op is not None
        with pytest.raises(StateError):
            c.free_host(host)  # the backup reads these slots
        await op
        assert not op.succeeded and isinstance(op.error, StorageError)
        assert op.completed_tokens == 4 * PS
        assert [a.node_id for a in c.drain_backup_acks()] == ["n1"]
        c.free_host(host)
        faulty.disable()
        n, got = await fetch(c, tokens)
        assert n == 4 * PS


async def test_terminate_mid_load_freezes_completed_and_frees_the_rest() -> None:
    async with make(io_concurrency=1) as c:
        faulty = FaultyBackend(
            MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.HANG, ops={"get"}, after_calls=1))
        )
        faulty.disable()
        await c.attach_storage_backend(faulty)
        tokens = list(range(8 * PS))
        host, _ = await store(c, tokens)
        c.free_host(host)
        start = c.host_allocator.available
        faulty.enable()
        h = c.host_allocator.alloc(len(tokens))
        assert h is not None
        op = c.prefetch("r", h, tokens)
        assert op is not None
        while op.completed_tokens < 2 * PS:  # noqa: ASYNC110 - polls a counter, not an event
            await asyncio.sleep(0.001)
        n, _ = await c.terminate_prefetch(op)
        assert n == 2 * PS and op.state is PrefetchState.TERMINATED
        assert c.host_allocator.available == start - n
        c.free_host(h[:n])
        assert c.host_allocator.available == start


async def test_rate_limit_refuses_new_prefetch_while_over_cap() -> None:
    async with make(prefetch_capacity_tokens=8 * PS) as c:
        await c.attach_storage_backend(MemoryBackend())
        h1 = c.host_allocator.alloc(8 * PS)
        h2 = c.host_allocator.alloc(4 * PS)
        assert h1 is not None and h2 is not None
        op = c.prefetch("a", h1, list(range(8 * PS)))
        assert op is not None
        assert c.prefetch_rate_limited()
        assert c.prefetch("b", h2, list(range(4 * PS))) is None  # caller keeps h2
        await c.terminate_prefetch(op)
        assert not c.prefetch_rate_limited()
        op2 = c.prefetch("b", h2, list(range(4 * PS)))
        assert op2 is not None
        await c.terminate_prefetch(op2)
        assert c.host_allocator.available == c.host_allocator.num_slots


async def test_attach_detach_reattach_and_detach_twice(ctl: TierController) -> None:
    tokens = list(range(4 * PS))
    await store(ctl, tokens)
    backend = ctl.storage.backend if ctl.storage else None
    with pytest.raises(StateError):
        await ctl.attach_storage_backend(MemoryBackend())
    assert await ctl.detach_storage_backend() is True
    assert await ctl.detach_storage_backend() is False
    h = ctl.host_allocator.alloc(PS)
    assert h is not None
    assert ctl.prefetch("r", h, list(range(PS))) is None  # no backend: the caller keeps h
    assert ctl.write_storage(h, list(range(PS))) is None
    ctl.free_host(h)
    assert isinstance(backend, MemoryBackend)
    await ctl.attach_storage_backend(backend)  # a backend passed in is not closed on detach
    n, got = await fetch(ctl, tokens)
    assert n == len(tokens)


async def test_attach_of_a_backend_that_fails_to_start_leaves_the_controller_as_it_was(
    tmp_path: object,
) -> None:
    async with make() as c:
        with pytest.raises(ConfigError):
            await c.attach_storage_backend("nosuchscheme://x")
        with pytest.raises(ConfigError):
            await c.attach_storage_backend("memory://", capacity_bytes=-5)
        with pytest.raises(InvalidInputError):
            await c.attach_storage_backend(42)  # type: ignore[arg-type]
        assert c.storage is None
        await c.attach_storage_backend("memory://")
        assert c.storage is not None


async def test_detach_mid_prefetch_and_backup_leaves_no_coroutine_and_no_leak() -> None:
    async with make() as c:
        faulty = FaultyBackend(
            MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.LATENCY, delay=0.05))
        )
        faulty.disable()
        await c.attach_storage_backend(faulty)
        tokens = list(range(8 * PS))
        host, _ = await store(c, tokens)
        start = c.host_allocator.available
        faulty.enable()
        h = c.host_allocator.alloc(len(tokens))
        assert h is not None
        op = c.prefetch("r", h, tokens)
        assert op is not None
        b = c.write_storage(host, list(range(9000, 9000 + 8 * PS)))
        assert b is not None
        await asyncio.sleep(0.01)
        tier = c.storage
        await c.detach_storage_backend()
        assert tier is not None and not tier.busy and len(tier.tasks) == 0
        assert op.done() and b.done()
        n, _ = await c.terminate_prefetch(op)
        c.free_host(h[:n])
        assert c.host_allocator.available == start
        c.free_host(host)  # the cancelled backup released its hold


async def test_closing_the_controller_with_prefetches_in_flight_frees_everything() -> None:
    c = make()
    async with c:
        faulty = FaultyBackend(
            MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.HANG, ops={"exists"}))
        )
        await c.attach_storage_backend(faulty)
        ops = []
        for i in range(3):
            h = c.host_allocator.alloc(4 * PS)
            assert h is not None
            op = c.prefetch(i, h, list(range(i, i + 4 * PS)))
            assert op is not None
            ops.append(op)
    assert all(op.done() and op.completed_tokens == 0 for op in ops)
    assert c.host_allocator.available == c.host_allocator.num_slots


async def test_cancelling_a_task_awaiting_a_prefetch_does_not_stop_or_leak_it(
    ctl: TierController,
) -> None:
    tokens = list(range(6 * PS))
    await store(ctl, tokens)
    h = ctl.host_allocator.alloc(len(tokens))
    assert h is not None
    start = ctl.host_allocator.available
    op = ctl.prefetch("r", h, tokens)
    assert op is not None

    async def waiter() -> None:
        await op

    t = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await op  # the operation ran on, undisturbed
    n, _ = await ctl.terminate_prefetch(op)
    assert n == len(tokens)
    ctl.free_host(h)
    assert ctl.host_allocator.available == start + len(tokens)


async def test_prefetch_bad_input(ctl: TierController) -> None:
    h = ctl.host_allocator.alloc(2 * PS)
    assert h is not None
    with pytest.raises(InvalidInputError):
        ctl.prefetch("r", h, list(range(PS)))  # lengths differ
    with pytest.raises(InvalidInputError):
        ctl.prefetch("r", h, [-1] * (2 * PS))
    with pytest.raises(InvalidInputError):
        ctl.prefetch("r", torch.arange(1500, 1532), list(range(2 * PS)))  # not allocated
    assert ctl.host_allocator.available == ctl.host_allocator.num_slots - 2 * PS


class _Recording(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.set_calls: list[int] = []

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        self.set_calls.append(len(keys))
        return await super().batch_set(keys, pages)


async def test_mla_only_rank_zero_writes() -> None:
    lay = KVLayout(2, 1, 16, torch.float16, PS, mla=True)
    backend = _Recording()
    for rank in (1, 0):
        dev = DeviceKVPool(lay, 256)
        async with TierController(dev, HostKVPool(lay, 256), tp_rank=rank, tp_size=2) as c:
            await c.attach_storage_backend(backend)
            d = c.device_allocator.alloc(4 * PS)
            assert d is not None
            h = await c.backup(d)
            assert h is not None
            op = c.write_storage(h, list(range(4 * PS)))
            assert op is not None
            await op
            assert op.succeeded
            assert backend.set_calls == ([] if rank == 1 else [4])


async def test_backup_skips_pages_already_stored(ctl: TierController) -> None:
    tokens = list(range(6 * PS))
    await store(ctl, tokens)
    await store(ctl, tokens)
    assert ctl.storage is not None
    assert (
        ctl.storage.stats.backup_pages_written == 6 and ctl.storage.stats.backup_pages_skipped == 6
    )


async def test_prefetch_when_not_open_or_detached_errors() -> None:
    c = make()
    with pytest.raises(StateError):
        c.prefetch("r", torch.arange(PS), list(range(PS)))
    async with c:  # no backend attached: nothing starts, the caller keeps its slots
        host = c.host_allocator.alloc(PS)
        assert host is not None and c.storage is None
        assert c.prefetch("r", host, list(range(PS))) is None
        assert c.free_host(host) == PS


async def test_a_detach_in_the_same_loop_turn_ends_every_operation_and_frees_its_slots(
    ctl: TierController,
) -> None:
    """Work cancelled before its first step still ends: nobody waits forever, nothing stays held."""
    free_before = ctl.host_allocator.available
    backup_host = ctl.host_allocator.alloc(2 * PS)
    prefetch_host = ctl.host_allocator.alloc(2 * PS)
    assert backup_host is not None and prefetch_host is not None
    backup = ctl.write_storage(backup_host, list(range(2 * PS)))
    prefetch = ctl.prefetch("r", prefetch_host, list(range(100, 100 + 2 * PS)))
    assert backup is not None and prefetch is not None
    await ctl.detach_storage_backend()  # neither task has run a step yet
    async with asyncio.timeout(2):
        await backup.wait()
        await prefetch.wait()
    assert not backup.succeeded
    assert prefetch.state is PrefetchState.TERMINATED
    assert await ctl.terminate_prefetch(prefetch) == (0, [])
    assert not ctl.ack_busy("host", backup_host)
    ctl.free_host(backup_host)
    assert ctl.host_allocator.available == free_before


async def test_only_tracked_backups_wait_to_be_drained() -> None:
    """A backup its caller awaits (``track=False``, as the cache does) is not kept for `drain_backup_acks`.

    Nothing else drains a cache's backups: kept, they would pile up for the
    life of the process.
    """
    async with make() as c:
        await c.attach_storage_backend(MemoryBackend())
        tokens = list(range(2 * PS))
        dev = c.device_allocator.alloc(len(tokens))
        assert dev is not None
        host = await c.backup(dev)
        assert host is not None
        for i in range(3):
            op = c.write_storage(host, tokens, node_id=f"untracked{i}", track=False)
            assert op is not None
            await op
            assert op.succeeded
        tracked = c.write_storage(host, tokens, node_id="tracked")
        assert tracked is not None
        await tracked
        assert [a.node_id for a in c.drain_backup_acks()] == ["tracked"]
        assert c.drain_backup_acks() == []
        with pytest.raises(InvalidInputError):
            c.write_storage(host, tokens, track=1)  # type: ignore[arg-type]


async def test_a_cache_leaves_no_backup_to_drain(tmp_path: Path) -> None:
    cfg = TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=8 * PS,
        host_tokens=16 * PS,
        model="drain",
    )
    async with TierCache(cfg) as cache:
        await cache.attach_storage(f"file://{tmp_path}")
        for k in range(4):
            toks = [k + 1] * (2 * PS) + [0]
            async with cache.request(toks) as r:
                slots = await r.alloc(len(toks) - r.cached_tokens)
                await r.commit(toks, torch.cat([r.prefix_indices, slots]))
        await cache.wait_idle()
        assert cache.stats().storage_backups == 4
        assert cache.controller.drain_backup_acks() == []


@pytest.mark.parametrize("attached", [True, False])
async def test_storage_verbs_check_every_argument_at_the_call(attached: bool) -> None:
    """A bad hash is refused when given, not raised later as a background failure;
    and the same call gets the same answer with or without a backend attached."""
    async with make() as c:
        if attached:
            await c.attach_storage_backend(MemoryBackend())
        host = c.host_allocator.alloc(2 * PS)
        assert host is not None
        free = c.host_allocator.available
        tokens = list(range(2 * PS))
        bad_calls = [
            lambda: c.prefetch("r", host, tokens, 5),  # type: ignore[arg-type]
            lambda: c.prefetch("r", host, tokens, "not hex"),
            lambda: c.prefetch("r", [0] * PS, tokens),  # type: ignore[arg-type]
            lambda: c.prefetch("r", host, tokens[:PS]),
            lambda: c.write_storage(host, tokens, 123),  # type: ignore[arg-type]
            lambda: c.write_storage(host, tokens, hash_values="ab"),  # type: ignore[arg-type]
            lambda: c.write_storage(host, tokens, hash_values=["ab"]),  # one hash for two pages
            lambda: c.write_storage(host, tokens, hash_values=["ab", "XY"]),
            lambda: c.write_storage(host, [-1] * (2 * PS)),
            # A bad id past the first page, a bool among the ids:
            lambda: c.prefetch("r", host, [*tokens[:-1], -1]),
            lambda: c.prefetch("r", host, [*tokens[:-1], True]),
            lambda: c.write_storage(host, [*tokens[:-1], 2**32]),
            lambda: c.write_storage(host, [*tokens[:-1], "7"], hash_values=["ab", "cd"]),
            lambda: c.write_storage(host, tokens, track="yes"),  # type: ignore[arg-type]
        ]
        for call in bad_calls:
            with pytest.raises(InvalidInputError):
                call()
        await asyncio.sleep(0.05)
        assert c.host_allocator.available == free
        c.free_host(host)  # no background failure surfaces here


async def test_storage_verbs_refuse_host_slots_a_copy_still_fills() -> None:
    """A backup of host slots a device->host copy has not filled yet would store
    whatever they held before under the tokens' keys; a prefetch into slots a
    copy or a backup still uses would overwrite them. Both are refused, and
    the same calls succeed once the copy has settled."""
    c = make()
    c.inline_copy_bytes = 0  # through the copy worker: the copy is in flight below
    async with c:
        await c.attach_storage_backend(MemoryBackend())
        tokens = list(range(2 * PS))
        dev = c.device_allocator.alloc(2 * PS)
        assert dev is not None
        ack = c.submit_write(dev)
        assert ack is not None
        with pytest.raises(StateError):
            c.write_storage(ack.host_indices, tokens)
        with pytest.raises(StateError):
            c.prefetch("r", ack.host_indices, tokens)
        await ack
        backup = c.write_storage(ack.host_indices, tokens, track=False)
        assert backup is not None
        with pytest.raises(StateError):  # the backup reads them
            c.prefetch("r", ack.host_indices, tokens)
        await backup
        assert backup.succeeded
        # What was stored is what the device held.
        host = c.host_allocator.alloc(2 * PS)
        assert host is not None
        op = c.prefetch("r", host, tokens)
        assert op is not None
        await op
        assert op.take_completed()[0] == 2 * PS
        assert host_bytes(c, host) == host_bytes(c, ack.host_indices)
        dev_pages = [
            torch.stack([c.device_pool.buffers[b][layer][dev] for layer in range(2)])
            for b in range(2)
        ]
        loaded = await c.load_back(host)
        assert loaded is not None
        for b in range(2):
            got = torch.stack([c.device_pool.buffers[b][layer][loaded] for layer in range(2)])
            assert torch.equal(got, dev_pages[b])


async def test_reset_waits_for_storage_work_before_it_frees_the_host() -> None:
    """A prefetch or backup in flight still writes or reads its host slots:
    reset ends them before it frees every slot, so no slot is freed under them."""
    c = make(io_batch_pages=1)
    async with c:
        slow = slow_backend("get", 0.2)
        await c.attach_storage_backend(slow)
        tokens = list(range(4 * PS))
        stored, _ = await store(c, tokens)
        host = c.host_allocator.alloc(4 * PS)
        assert host is not None
        op = c.prefetch("r", host, tokens)
        backup = c.write_storage(stored, tokens, track=False)
        assert op is not None and backup is not None
        await asyncio.sleep(0.05)  # the prefetch's reads are in flight
        assert not op.done()
        await c.reset()
        assert op.done() and backup.done()
        assert not c.ack_busy("host", host) and not c.ack_busy("host", stored)
        assert c.host_allocator.available == c.host_allocator.num_slots
        await asyncio.sleep(0.3)  # nothing frees (or fills) a slot after the reset
        assert c.host_allocator.available == c.host_allocator.num_slots
        again = c.host_allocator.alloc(4 * PS)
        assert again is not None
        c.free_host(again)


async def test_backups_a_detach_ends_are_still_drained() -> None:
    """An engine that learns of ended backups from `drain_backup_acks` hears of
    those the detach ended, and of those that ended unread before it."""
    async with make() as c:
        slow = slow_backend("set", 0.5)
        await c.attach_storage_backend(MemoryBackend())
        tokens = list(range(2 * PS))
        host, _ = await store(c, tokens)  # tracked, ended, not drained
        await c.detach_storage_backend()
        await c.attach_storage_backend(slow)
        op = c.write_storage(host, list(range(100, 100 + 2 * PS)), node_id="in flight")
        assert op is not None
        await asyncio.sleep(0.05)
        await c.detach_storage_backend()
        assert op.done() and not op.succeeded
        assert [a.node_id for a in c.drain_backup_acks()] == [None, "in flight"]
        assert c.drain_backup_acks() == []


async def test_storage_verbs_refuse_host_slots_a_prefetch_still_fills() -> None:
    """A backup of host slots a running prefetch fills would store what they
    hold now (not yet, or never, those tokens' KV) under the tokens' keys, and
    a load would put it on the device: both are refused while the prefetch
    runs, from its first step, as is freeing the slots. Once it has ended, its
    completed prefix is backed up and loaded like any host page."""
    c = make(io_batch_pages=1)
    async with c:
        slow = slow_backend("get", 0.2)
        await c.attach_storage_backend(slow)
        tokens = list(range(4 * PS))
        _, want = await store(c, tokens)
        host = c.host_allocator.alloc(4 * PS)
        assert host is not None
        other = list(range(5000, 5000 + 4 * PS))
        op = c.prefetch("r", host, tokens)
        assert op is not None
        for when in ("queued", "reading"):
            with pytest.raises(StateError, match="prefetch"):
                c.write_storage(host, other)
            with pytest.raises(StateError, match="prefetch"):
                c.write_storage(host[PS : 2 * PS], other[:PS])  # one page of it is enough
            with pytest.raises(StateError, match="prefetch"):
                c.submit_load(host)
            with pytest.raises(StateError):
                c.free_host(host)
            if when == "queued":
                await asyncio.sleep(0.05)  # the reads are in flight
        assert not op.done()
        # Nothing was started or allocated by the refused calls.
        assert c.storage_stats().backup_ops == 1 and c.stats.loads == 0
        assert c.device_allocator.available == c.device_allocator.num_slots
        await op
        assert op.take_completed()[0] == len(tokens)
        assert host_bytes(c, host) == want
        backup = c.write_storage(host, tokens, track=False)
        assert backup is not None
        await backup
        assert backup.succeeded
        loaded = await c.load_back(host)
        assert loaded is not None
        c.free_device(loaded)
        c.free_host(host)


async def test_storage_verbs_refuse_host_slots_a_backup_still_reads() -> None:
    """A prefetch into host slots a backup still reads would change the bytes
    being stored under the backup's keys; freeing them would hand them to
    whoever allocates next. Both are refused until the backup has ended; a
    second backup of the same slots (another reader) is not."""
    c = make()
    async with c:
        slow = slow_backend("set", 0.2)
        await c.attach_storage_backend(slow)
        dev = c.device_allocator.alloc(2 * PS)
        assert dev is not None
        host = await c.backup(dev)
        assert host is not None
        tokens = list(range(2 * PS))
        backup = c.write_storage(host, tokens, track=False)
        assert backup is not None
        with pytest.raises(StateError):
            c.prefetch("r", host, list(range(100, 100 + 2 * PS)))
        with pytest.raises(StateError):
            c.free_host(host)
        again = c.write_storage(host, tokens, track=False)
        assert again is not None
        await backup
        await again
        assert backup.succeeded and again.succeeded
        c.free_host(host)
        c.free_device(dev)


async def test_reset_returns_the_prefetch_capacity_of_prefetches_never_collected() -> None:
    """A prefetch that ended before a reset and was never collected counted
    against ``prefetch_capacity_tokens`` for ever: the reset freed its slots
    but not its share of the cap. The reset returns it, and collecting the
    old operation afterwards hands nothing over a second time."""
    async with make(prefetch_capacity_tokens=4 * PS) as c:
        await c.attach_storage_backend(MemoryBackend())
        tokens = list(range(4 * PS))
        await store(c, tokens)
        host = c.host_allocator.alloc(4 * PS)
        assert host is not None
        op = c.prefetch("ended", host, tokens)
        assert op is not None
        await op  # ended, its completed prefix never taken
        assert op.completed_tokens == 4 * PS and c.prefetch_rate_limited()
        await c.reset()
        assert not c.prefetch_rate_limited()
        assert op.take_completed()[0] == 4 * PS  # the same answer, nothing handed over
        assert not c.prefetch_rate_limited()
        first = c.host_allocator.alloc(4 * PS)
        second = c.host_allocator.alloc(4 * PS)
        assert first is not None and second is not None
        again = c.prefetch("again", first, tokens)
        assert again is not None  # the whole cap is free again
        assert c.prefetch("over", second, tokens) is None  # and no more than the cap
        await c.terminate_prefetch(again)
