"""`TierController.backup` / `load_back` of a few pages on a CPU device copy in the call.

Up to ``inline_copy_bytes`` the copy is made by page ids in the verb itself,
which returns without yielding to the loop. Every layout the copy engine
serves must come out byte for byte; anything that needs ordering (a write
still filling the host slots a load reads), wrapped device buffers, larger
copies and a zero threshold take the queued path; a failing copy frees its
new slots and raises; bad input changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController, observe
from tiercache.errors import InvalidInputError, StateError

PS = 16


def make(
    *,
    layers: int = 3,
    dtype: torch.dtype = torch.float16,
    mla: bool = False,
    host_layout: str = "layer_first",
    device_slots: int = 256,
    host_slots: int = 256,
    wrapped: bool = False,
    **kw: Any,
) -> TierController:
    layout = KVLayout(layers, 1 if mla else 2, 8, dtype, PS, mla=mla)
    if wrapped:
        shape = (device_slots, layout.num_kv_heads, layout.head_dim)
        k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        device = DeviceKVPool(layout, device_slots, k_buffers=k, v_buffers=v)
    else:
        device = DeviceKVPool(layout, device_slots)
    host = HostKVPool(layout, host_slots, host_layout=host_layout)
    return TierController(device, host, **kw)


def fill_random(c: TierController, slots: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(int(slots[0]))
    for bufs in c.device_pool.buffers:
        for t in bufs:
            raw = torch.randint(0, 255, (slots.numel(), *t.shape[1:]), generator=gen)
            t[slots] = raw.to(torch.uint8).view(torch.uint8).to(torch.float32).to(t.dtype)


def device_kv(c: TierController, slots: torch.Tensor) -> list[torch.Tensor]:
    return [t[slots].clone() for bufs in c.device_pool.buffers for t in bufs]


def host_kv(c: TierController, slots: torch.Tensor) -> list[torch.Tensor]:
    L = c.layout.num_layers
    return [
        c.host_pool.layer(b, x)[slots].clone()
        for b in range(len(c.device_pool.buffers))
        for x in range(L)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def run_in_one_step(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive ``coro`` one step: it must finish without awaiting anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the verb yielded to the loop")


async def queued(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` as a task; assert its first step did not finish it; return its result."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # the task's first step
    assert not task.done(), "the copy was made in the call"
    return await task


def scattered(c: TierController) -> torch.Tensor:
    """Four allocated device pages in an order that breaks every run."""
    slots = c.device_allocator.alloc(4 * PS)
    assert slots is not None
    return slots.view(4, PS)[torch.tensor([3, 1, 0, 2])].reshape(-1)


LAYOUTS = [
    pytest.param({}, id="mha-fp16-layer_first"),
    pytest.param({"host_layout": "page_first"}, id="mha-fp16-page_first"),
    pytest.param({"mla": True}, id="mla"),
    pytest.param({"dtype": torch.bfloat16, "host_layout": "page_first"}, id="bf16-page_first"),
    pytest.param({"dtype": torch.float8_e4m3fn}, id="fp8"),
    pytest.param({"layers": 1}, id="one-layer"),
]


@pytest.mark.parametrize("kw", LAYOUTS)
@pytest.mark.parametrize("pages", [1, 3])
async def test_a_small_round_trip_is_made_in_the_call_byte_for_byte(
    kw: dict[str, Any], pages: int
) -> None:
    async with make(**kw) as c:
        src = c.device_allocator.alloc(pages * PS)
        assert src is not None
        fill_random(c, src)
        host = run_in_one_step(c.backup(src))
        assert host is not None
        assert same(host_kv(c, host), device_kv(c, src))
        back = run_in_one_step(c.load_back(host))
        assert back is not None
        assert same(device_kv(c, back), device_kv(c, src))
        assert not c.busy and c.stats.copy_errors == 0


@pytest.mark.parametrize("kw", LAYOUTS)
async def test_scattered_pages_come_back_in_the_order_given(kw: dict[str, Any]) -> None:
    async with make(**kw) as c:
        src = scattered(c)
        fill_random(c, src)
        host = run_in_one_step(c.backup(src))
        assert host is not None and same(host_kv(c, host), device_kv(c, src))
        # The host side scattered too: load its pages back in reverse order.
        rev = host.view(-1, PS).flip(0).reshape(-1)
        back = run_in_one_step(c.load_back(rev))
        assert back is not None
        assert same(device_kv(c, back), host_kv(c, rev))


async def test_it_counts_what_a_queued_copy_counts() -> None:
    async with make() as c:
        src = c.device_allocator.alloc(2 * PS)
        assert src is not None
        token = c.layout.token_bytes
        host = await c.backup(src)
        assert host is not None
        back = await c.load_back(host)
        assert back is not None
        s = c.stats
        assert (s.writes, s.write_batches, s.loads, s.load_batches) == (1, 1, 1, 1)
        assert s.bytes_device_to_host == s.bytes_host_to_device == 2 * PS * token


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"inline_copy_bytes": 0}, id="threshold-0"),
        pytest.param({"wrapped": True}, id="wrapped-device-buffers"),
    ],
)
async def test_what_the_call_does_not_serve_is_queued_and_still_right(kw: dict[str, Any]) -> None:
    async with make(**kw) as c:
        src = c.device_allocator.alloc(2 * PS)
        assert src is not None
        fill_random(c, src)
        host = await queued(c.backup(src))
        assert host is not None and same(host_kv(c, host), device_kv(c, src))
        back = await queued(c.load_back(host))
        assert back is not None and same(device_kv(c, back), device_kv(c, src))


async def test_a_copy_over_the_threshold_is_queued() -> None:
    async with make() as c:
        c.inline_copy_bytes = c.layout.page_bytes  # one page in the call, two queued
        one = c.device_allocator.alloc(PS)
        two = c.device_allocator.alloc(2 * PS)
        assert one is not None and two is not None
        assert run_in_one_step(c.backup(one)) is not None
        host = await queued(c.backup(two))
        assert host is not None and same(host_kv(c, host), device_kv(c, two))


async def test_a_load_of_host_slots_a_write_still_fills_waits_for_that_write() -> None:
    """The in-call load would read host slots whose bytes are not there yet:
    it takes the queued path, ordered after the write."""
    async with make(auto_start_writes=False) as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        fill_random(c, src)
        ack = c.submit_write(src)  # queued, not started
        assert ack is not None
        back = await c.load_back(ack.host_indices)
        assert back is not None and ack.done()
        assert same(device_kv(c, back), device_kv(c, src))


async def test_a_failing_copy_in_the_call_frees_its_slots_and_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        fill_random(c, src)
        good = await c.backup(src)
        assert good is not None
        real = c.engine.copy_pages

        def broken(*args: Any) -> None:
            raise RuntimeError("copy engine fault")

        monkeypatch.setattr(c.engine, "copy_pages", broken)
        dev_free, host_free = c.device_allocator.available, c.host_allocator.available
        with pytest.raises(RuntimeError, match="copy engine fault"):
            await c.backup(src)
        with pytest.raises(RuntimeError, match="copy engine fault"):
            await c.load_back(good)
        assert (c.device_allocator.available, c.host_allocator.available) == (dev_free, host_free)
        assert c.stats.copy_errors == 2
        c.ledger.device.check_invariants()
        c.ledger.host.check_invariants()
        monkeypatch.setattr(c.engine, "copy_pages", real)
        back = await c.load_back(good)  # the controller goes on working
        assert back is not None and same(device_kv(c, back), device_kv(c, src))


async def test_full_pools_return_none_and_take_nothing() -> None:
    async with make(device_slots=2 * PS, host_slots=PS) as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        host = await c.backup(src)
        assert host is not None
        assert await c.backup(src) is None and c.stats.host_full == 1
        assert c.device_allocator.alloc(PS) is not None  # the device is full now
        assert await c.load_back(host) is None and c.stats.device_full == 1


@pytest.mark.parametrize("verb", ["backup", "load_back"])
async def test_bad_input_is_refused_before_anything_is_taken(verb: str) -> None:
    async with make() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        host = await c.backup(src)
        assert host is not None
        fn = c.backup if verb == "backup" else c.load_back
        good = src if verb == "backup" else host
        free = (c.device_allocator.available, c.host_allocator.available)
        unallocated = torch.arange(200, 200 + PS)
        for bad, error in [
            (unallocated, InvalidInputError),
            (good[:-1], InvalidInputError),
            (good.to(torch.int32), InvalidInputError),
            ([0] * PS, InvalidInputError),
        ]:
            with pytest.raises(error):
                await fn(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            await fn(good, priority="high")  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            await fn(good, ready=torch.zeros(1))  # type: ignore[arg-type]
        assert (c.device_allocator.available, c.host_allocator.available) == free
        assert c.stats.copy_errors == 0


async def test_a_load_of_slots_a_failed_copy_spoiled_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queued write that failed leaves its host slots without the KV: the
    in-call load refuses them as the queued one does."""
    async with make() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None

        def broken(plan: object) -> None:
            raise RuntimeError("copy engine fault")

        monkeypatch.setattr(c.engine, "backup_all_layers", broken)
        ack = c.submit_write(src)
        assert ack is not None
        with pytest.raises(RuntimeError):
            await ack
        with pytest.raises(StateError, match="hold no KV"):
            await c.load_back(ack.host_indices)


async def test_many_tasks_each_get_their_own_pages_back() -> None:
    async with make(device_slots=64 * PS, host_slots=64 * PS) as c:
        srcs = []
        for _ in range(16):
            s = c.device_allocator.alloc(PS)
            assert s is not None
            fill_random(c, s)
            srcs.append(s)

        async def round_trip(s: torch.Tensor) -> torch.Tensor:
            h = await c.backup(s)
            assert h is not None
            await asyncio.sleep(0)
            d = await c.load_back(h)
            assert d is not None
            c.free_host(h)
            return d

        outs = await asyncio.gather(*(round_trip(s) for s in srcs))
        for s, d in zip(srcs, outs, strict=True):
            assert same(device_kv(c, d), device_kv(c, s))
        assert c.host_allocator.available == c.host_pool.num_slots


async def test_a_copy_in_the_call_is_timed_for_the_sinks_that_listen() -> None:
    seen: list[tuple[str, str, str]] = []

    class Sink:
        def observe(self, kind: str, op: str, seconds: float, outcome: str) -> None:
            assert seconds >= 0
            seen.append((kind, op, outcome))

    sink = Sink()
    async with make() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        host = await c.backup(src)  # before the sink listens
        assert host is not None
        observe.add_sink(sink, source=c.observe_source)
        try:
            assert observe.active()
            again = await c.backup(src)
            back = await c.load_back(host)
            assert again is not None and back is not None
        finally:
            observe.remove_sink(sink)
    assert seen == [("copy", "write", "ok"), ("copy", "load", "ok")]
