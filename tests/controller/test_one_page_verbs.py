"""The one-page verbs take a path of their own: it must do what the checked path does.

`TierController.backup`, `load_back`, `free_host` and `free_device` of one
whole page on a CPU device work by the page's id (`one_page`,
`PoolLedger.readable`, `alloc_one`, `free_one`), without the page-id arrays
of the checked path. Anything else (bad input, a page in flight, spoiled
bytes, a full pool, a ``ready``) falls through to the checked path.

Each case below runs twice on a fresh controller, with the one-page path and
with it turned off (`one_page` answering ``None``), and must end the same
way: the same slots and bytes, or the same error and message, and the same
books after (free slots, counters, owners, leases, the ledger's invariants).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

import tiercache.copy_scheduler as copy_scheduler_module
import tiercache.ledger as ledger_module
from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.ledger import Lease, Owner

PS = 16

#: A case: given the controller, run one verb and return what it returned.
Case = Callable[[TierController], Awaitable[Any]]


def make(device_pages: int = 8, host_pages: int = 8, **kw: Any) -> TierController:
    layout = KVLayout(2, 2, 8, torch.float16, PS)
    device = DeviceKVPool(layout, device_pages * PS)
    gen = torch.Generator().manual_seed(7)
    for bufs in device.buffers:
        for t in bufs:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return TierController(device, HostKVPool(layout, host_pages * PS), **kw)


def page(c: TierController) -> torch.Tensor:
    slots = c.device_allocator.alloc(PS)
    assert slots is not None
    return slots


async def backed_up(c: TierController) -> torch.Tensor:
    host = await c.backup(page(c))
    assert host is not None
    return host


def device_kv(c: TierController, slots: torch.Tensor) -> list[list[float]]:
    return [t[slots].float().tolist() for bufs in c.device_pool.buffers for t in bufs]


def host_kv(c: TierController, slots: torch.Tensor) -> list[list[float]]:
    return [
        c.host_pool.layer(b, layer)[slots].float().tolist()
        for b in range(2)
        for layer in range(c.layout.num_layers)
    ]


def books(c: TierController) -> dict[str, Any]:
    """Everything a verb may change, other than the bytes."""
    c.ledger.check_invariants()
    out: dict[str, Any] = {
        "free": (c.device_allocator.available, c.host_allocator.available),
        "stats": dataclasses.asdict(c.stats),
    }
    for name, pool in (("device", c.ledger.device), ("host", c.ledger.host)):
        out[name] = [pool.tokens_owned(o) for o in Owner]
        pages = np.arange(pool.num_pages)
        out[name + " leased"] = [bool(pool.leased(pages, lease)) for lease in Lease]
        out[name + " spoiled"] = pool.spoiled(pages)
    return out


# -- the cases ----------------------------------------------------------------------


async def backup_ok(c: TierController) -> Any:
    return await backup_ok_of(c, page(c))


async def backup_unallocated(c: TierController) -> Any:
    return await c.backup(torch.arange(5 * PS, 6 * PS))


async def backup_of_a_page_a_load_fills(c: TierController) -> Any:
    ack = c.submit_load(await backed_up(c))  # queued, not started: it fills its device page
    assert ack is not None
    return await c.backup(ack.device_indices)


async def backup_of_a_spoiled_page(c: TierController) -> Any:
    src = page(c)
    c.ledger.device.spoil(c.ledger.device.pages(src))
    return await c.backup(src)


async def backup_into_a_full_host(c: TierController) -> Any:
    src = page(c)
    assert c.host_allocator.alloc(c.host_allocator.available) is not None
    return await c.backup(src)


async def backup_with_a_bad_priority(c: TierController) -> Any:
    return await c.backup(page(c), priority=True)


async def backup_with_ready_on_a_cpu(c: TierController) -> Any:
    return await c.backup(page(c), ready=torch.zeros(1))  # type: ignore[arg-type]


async def backup_of_an_engine_page(c: TierController) -> Any:
    # Pages the engine takes from the shared allocator are free to the ledger.
    src = c.ledger.device.allocator.alloc(PS)
    assert src is not None
    return await backup_ok_of(c, src)


async def backup_ok_of(c: TierController, src: torch.Tensor) -> Any:
    out = await c.backup(src)
    assert out is not None
    return out.tolist(), host_kv(c, out) == device_kv(c, src)


async def load_ok(c: TierController) -> Any:
    host = await backed_up(c)
    out = await c.load_back(host)
    assert out is not None
    return out.tolist(), device_kv(c, out) == host_kv(c, host)


async def load_unallocated(c: TierController) -> Any:
    return await c.load_back(torch.arange(6 * PS, 7 * PS))


async def load_of_a_page_a_write_fills(c: TierController) -> Any:
    ack = c.submit_write(page(c))  # queued: it fills its host page; the load waits for it
    assert ack is not None
    out = await c.load_back(ack.host_indices)
    assert out is not None
    return out.tolist(), device_kv(c, out) == host_kv(c, ack.host_indices)


async def load_of_a_page_a_prefetch_fills(c: TierController) -> Any:
    host = await backed_up(c)
    c.ledger.host.lease(c.ledger.host.pages(host), Lease.FETCH)
    return await c.load_back(host)


async def load_of_a_spoiled_page(c: TierController) -> Any:
    host = await backed_up(c)
    c.ledger.host.spoil(c.ledger.host.pages(host))
    return await c.load_back(host)


async def load_into_a_full_device(c: TierController) -> Any:
    host = await backed_up(c)
    assert c.device_allocator.alloc(c.device_allocator.available) is not None
    return await c.load_back(host)


async def load_with_a_float_priority(c: TierController) -> Any:
    return await c.load_back(await backed_up(c), priority=1.0)  # type: ignore[arg-type]


async def load_of_two_pages_one_bad(c: TierController) -> Any:
    host = await backed_up(c)
    return await c.load_back(torch.cat([host, torch.arange(7 * PS, 8 * PS)]))


async def free_host_ok(c: TierController) -> Any:
    return c.free_host(await backed_up(c))


async def free_host_twice(c: TierController) -> Any:
    host = await backed_up(c)
    c.free_host(host)
    return c.free_host(host)


async def free_host_a_write_fills(c: TierController) -> Any:
    ack = c.submit_write(page(c))
    assert ack is not None
    return c.free_host(ack.host_indices)


async def free_host_a_backup_reads(c: TierController) -> Any:
    host = await backed_up(c)
    c.ledger.host.lease(c.ledger.host.pages(host), Lease.READ)  # a storage backup, say
    return c.free_host(host)


async def free_host_misaligned(c: TierController) -> Any:
    host = await backed_up(c)
    return c.free_host(host + 1)


async def free_device_ok(c: TierController) -> Any:
    return c.free_device(page(c))


async def free_device_twice(c: TierController) -> Any:
    src = page(c)
    c.free_device(src)
    return c.free_device(src)


async def free_device_a_write_reads(c: TierController) -> Any:
    src = page(c)
    assert c.submit_write(src) is not None
    return c.free_device(src)


async def free_device_with_ready_on_a_cpu(c: TierController) -> Any:
    return c.free_device(page(c), ready=torch.zeros(1))  # type: ignore[arg-type]


async def free_device_of_a_load(c: TierController) -> Any:
    out = await c.load_back(await backed_up(c))
    assert out is not None
    return c.free_device(out), c.device_allocator.available


async def free_device_as_int32(c: TierController) -> Any:
    return c.free_device(page(c).to(torch.int32))


CASES: list[Case] = [
    backup_ok,
    backup_unallocated,
    backup_of_a_page_a_load_fills,
    backup_of_a_spoiled_page,
    backup_into_a_full_host,
    backup_with_a_bad_priority,
    backup_with_ready_on_a_cpu,
    backup_of_an_engine_page,
    load_ok,
    load_unallocated,
    load_of_a_page_a_write_fills,
    load_of_a_page_a_prefetch_fills,
    load_of_a_spoiled_page,
    load_into_a_full_device,
    load_with_a_float_priority,
    load_of_two_pages_one_bad,
    free_host_ok,
    free_host_twice,
    free_host_a_write_fills,
    free_host_a_backup_reads,
    free_host_misaligned,
    free_device_ok,
    free_device_twice,
    free_device_a_write_reads,
    free_device_with_ready_on_a_cpu,
    free_device_of_a_load,
    free_device_as_int32,
]


async def outcome(case: Case, inline_copy_bytes: int) -> tuple[Any, dict[str, Any]]:
    """What ``case`` returned or raised, and the books after it."""
    async with make(auto_start_writes=False, inline_copy_bytes=inline_copy_bytes) as c:
        try:
            result: Any = ("returned", await case(c))
        except Exception as e:
            result = ("raised", type(e).__name__, str(e))
        return result, books(c)


@pytest.mark.parametrize("inline_copy_bytes", [1 << 20, 0])
@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
async def test_the_one_page_path_ends_as_the_checked_path_does(
    case: Case, inline_copy_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same result or error, same books: with copies in the call, and with
    every copy queued (``inline_copy_bytes=0``: only the frees take the one-page path)."""
    fast = await outcome(case, inline_copy_bytes)
    for module in (copy_scheduler_module, ledger_module):
        monkeypatch.setattr(module, "one_page", lambda *a: None)
    checked = await outcome(case, inline_copy_bytes)
    assert fast == checked


async def test_the_cases_reach_both_ends() -> None:
    """The cases are not all refusals: the one-page path returns slots and bytes."""
    results = [(await outcome(case, 1 << 20))[0] for case in CASES]
    assert sum(r[0] == "returned" for r in results) >= 8
    assert sum(r[0] == "raised" for r in results) >= 15
    assert all(r[1][1] for r in results if r[0] == "returned" and isinstance(r[1], tuple))


async def test_the_one_page_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The four verbs of one good page never build a page-id array (the checked path's)."""

    def refused(*a: object, **kw: object) -> object:
        raise AssertionError("the checked path ran")

    async with make() as c:
        host = await backed_up(c)
        src = page(c)
        for module in ("tiercache.controller", "tiercache.ledger"):
            for name in ("check_slot_pages", "page_ids"):
                if hasattr(__import__(module, fromlist=["x"]), name):
                    monkeypatch.setattr(f"{module}.{name}", refused)
        out = await c.backup(src)
        back = await c.load_back(host)
        assert out is not None and back is not None
        assert c.free_host(out) == PS and c.free_device(back) == PS
        assert c.free_device(src) == PS and c.free_host(host) == PS
        assert c.device_allocator.available == c.device_pool.num_slots - PS  # backed_up's source
        c.ledger.check_invariants()
