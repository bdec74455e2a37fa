"""One tensor-parallel rank for test_tp_cache.py, through the `TierCache` facade.

Both ranks store the same prompt, flush, and prefetch it three times with the
``wait_complete`` policy. On the rank named ``full`` the host pool is taken
for the first round (its `TierCache.prefetch` returns early for want of host
room); it must still join the hit-count agreement, or the other rank blocks in
it. Prints what each prefetch returned."""

from __future__ import annotations

import asyncio
import json
import sys

import torch.distributed as dist

from tiercache import TierCache, TierCacheConfig
from tiercache.storage.memory import MemoryBackend

PS = 16


async def main(rank: int, world: int, init: str, full_rank: int) -> dict[str, object]:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    cfg = TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=256,
        host_tokens=256,
        model="tp-cache",
        write_policy="write_through",
        prefetch_threshold=PS,
        tp_rank=rank,
        tp_size=world,
    )
    results: dict[str, object] = {"rank": rank}
    async with TierCache(cfg, tp_group=group) as cache:
        await cache.attach_storage(MemoryBackend())
        prompt = list(range(100, 100 + 4 * PS))
        slots = await cache.alloc_device(len(prompt))
        await cache.insert(prompt, slots)
        await cache.wait_idle()
        await cache.flush()  # the prompt is in storage only
        got: list[int] = []
        for i in range(3):
            held = None
            if i == 0 and rank == full_rank:
                held = cache.controller.host_allocator.alloc(256)
                assert held is not None
            got.append(await cache.prefetch(prompt, policy="wait_complete"))
            if held is not None:
                cache.controller.free_host(held)
            await cache.flush()
        results["got"] = got
        await cache.wait_idle()
        results["host_free"] = cache.stats().extra["host_free"]
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    rank, world, init, full = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    print(json.dumps(asyncio.run(main(rank, world, init, full))))
