"""A one-page `backup` / `load_back` on a GPU (the `gpu` marker: skipped without CUDA).

On a CPU device such a copy is made in the call (tests/controller/
test_copies_in_the_call.py). On CUDA the caller's KV may still be in flight
on its stream: the copy must stay on the copy stream, ordered after the
caller's ``ready``, whatever ``inline_copy_bytes`` says.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController

pytestmark = pytest.mark.gpu

PS = 16


@pytest.fixture(autouse=True)
def _sync() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


def controller() -> TierController:
    lay = KVLayout(2, 2, 64, torch.float16, PS)
    return TierController(
        DeviceKVPool(lay, 8 * PS, device="cuda"),
        HostKVPool(lay, 8 * PS),
        inline_copy_bytes=1 << 30,  # would cover every copy on a CPU device
    )


async def test_a_one_page_backup_waits_for_the_producer_stream(cycles_per_ms: float) -> None:
    async with controller() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        idx = src.to("cuda")
        producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(producer):
            # The forward pass still runs, and writes the KV last.
            torch.cuda._sleep(int(cycles_per_ms * 300))  # type: ignore[no-untyped-call]
            for bufs in c.device_pool.buffers:
                for t in bufs:
                    t[idx] = 7.0
        host = await c.backup(src, ready=producer)
        assert host is not None
        assert c.host_pool.layer(0, 0)[host].eq(7.0).all()


async def test_a_one_page_load_back_lands_before_it_returns() -> None:
    async with controller() as c:
        src = c.device_allocator.alloc(PS)
        assert src is not None
        for bufs in c.device_pool.buffers:
            for t in bufs:
                t[src.to("cuda")] = 3.0
        host = await c.backup(src)
        assert host is not None
        back = await c.load_back(host)
        assert back is not None
        torch.cuda.current_stream().synchronize()
        for bufs in c.device_pool.buffers:
            for t in bufs:
                assert t[back.to("cuda")].eq(3.0).all()
        assert c.stats.write_batches == 1 and c.stats.load_batches == 1
