"""One tensor-parallel rank for test_tp.py: stores `stored_pages` pages locally,
prefetches 8, and prints the hit count the ranks agreed on."""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import torch.distributed as dist

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import StorageTierConfig

PS = 16


async def main(rank: int, world: int, init: str, stored_pages: int) -> dict[str, object]:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    conf = StorageTierConfig(prefetch_threshold=PS)
    ctl = TierController(
        DeviceKVPool(lay, 256),
        HostKVPool(lay, 512),
        tp_rank=rank,
        tp_size=world,
        tp_group=group,
        storage_config=conf,
    )
    results: dict[str, object] = {"rank": rank}
    async with ctl:
        await ctl.attach_storage_backend(MemoryBackend())
        tokens = list(range(8 * PS))
        dev = ctl.device_allocator.alloc(stored_pages * PS)
        assert dev is not None
        host = await ctl.backup(dev)
        assert host is not None
        op = ctl.write_storage(host, tokens[: stored_pages * PS])
        assert op is not None
        await op
        agreed = []
        # Several prefetches in a row: every rank must make the same collective calls.
        for _ in range(3):
            h = ctl.host_allocator.alloc(8 * PS)
            assert h is not None
            pf = ctl.prefetch("r", h, tokens)
            assert pf is not None
            await pf
            n, _ = await ctl.terminate_prefetch(pf)
            agreed.append((pf.storage_hit_tokens, n))
            ctl.evict_host(h[:n])
        results["agreed"] = agreed
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    rank, world, init, stored = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    print(json.dumps(asyncio.run(main(rank, world, init, stored))))
