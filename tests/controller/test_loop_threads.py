"""The cache's own work on large slot lists runs no torch kernel on the event loop.

torch spreads an elementwise op, a reduction or a copy of 32k elements or
more over an OpenMP team started from the calling thread, whose threads then
spin for milliseconds at that thread's priority. On the event loop that took
a core from the copy streams for every large verb (measured on 2 cores: 7 ms
of CPU per 64 MiB round trip of 16 KiB pages, copies 1.5-2x slower, until
the copy threads' own teams made libgomp spin briefly). So slot tensors are
checked, copied, joined and compared with numpy on the loop (`copy_slots`,
`cat_slots`): a copy of them costs less that way at any size, too.

A torch function mode, active on the loop thread only (modes are per
thread), records every torch call made there on 32k elements or more that
is not a view or a read of metadata, while the large verbs of the controller,
the facade and the storage tier run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController

#: torch calls that read metadata or make views: no kernel runs.
FREE = frozenset(
    {
        "__get__",
        "__getitem__",
        "__len__",
        "cpu",
        "data_ptr",
        "detach",
        "dim",
        "element_size",
        "is_contiguous",
        "is_pinned",
        "numel",
        "numpy",
        "reshape",
        "size",
        "stride",
        "view",
    }
)

N = 1 << 16  # slots: above torch's grain of 32k elements


class Kernels(TorchFunctionMode):
    """Records the torch calls on large tensors that run a kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                tensors += [t for t in a if isinstance(t, torch.Tensor)]
        if name not in FREE and sum(t.numel() for t in tensors) >= 1 << 15:
            self.seen.append(name)
        return func(*args, **kwargs)


async def test_the_controllers_large_verbs_run_no_kernel_on_the_loop() -> None:
    layout = KVLayout(2, 2, 8, torch.float16, 16)
    device, host = DeviceKVPool(layout, 2 * N), HostKVPool(layout, N)
    async with TierController(device, host, inline_copy_bytes=0) as c:
        dev = c.device_allocator.alloc(N)
        assert dev is not None
        with Kernels() as spy:
            h = await c.backup(dev)
            assert h is not None
            back = await c.load_back(h)
            assert back is not None
            c.free_host(h)
            c.free_device(back)
            halves = [c.submit_write(dev[: N // 2]), c.submit_write(dev[N // 2 :])]
            c.start_writing()  # two writes merged into one copy
            for ack in halves:
                assert ack is not None
                await ack
                c.free_host(ack.host_indices)
        assert spy.seen == []


async def test_the_facades_large_verbs_run_no_kernel_on_the_loop(tmp_path: Path) -> None:
    config = TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float16,
        page_size=16,
        device_tokens=2 * N,
        host_tokens=2 * N,
        storage_url=f"file:{tmp_path}",
    )
    prompt = list(range(N))
    longer = prompt + [7] * 16
    async with TierCache(config) as cache:
        slots = await cache.alloc_device(N)
        with Kernels() as spy:
            await cache.insert(prompt, slots)
            match = cache.match_prefix(prompt)
            assert match.device_tokens == N
            async with cache.request(longer) as req:
                more = await req.alloc(16)
                whole = np.concatenate([req.prefix_indices.numpy(), more.numpy()])
                await req.commit(longer, torch.from_numpy(whole))
            await cache.backup_to_storage()  # what write-through left to back up
            await cache.wait_idle()
            await cache.evict_device(2 * N)
            await cache.evict_host(2 * N)
            async with cache.request(prompt) as req:  # prefetched from storage, loaded back
                assert req.cached_tokens >= N - 16
        assert spy.seen == []
