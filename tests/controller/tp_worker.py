"""One tensor-parallel rank for test_tp.py: stores `stored_pages` pages locally,
prefetches 8, and prints the hit count the ranks agreed on.

``mode`` (optional fifth argument) changes what this rank's storage does:
``normal``; ``down``: its backend fails, so the tier marks it down and skips
the next prefetches; ``limited``: it holds one prefetch, so the next one is
rate limited; ``abstain``: it skips the prefetches and calls `abstain_prefetch`;
``holding``: it holds the 8 pages already, so it calls `abstain_prefetch` with
them; ``half``: it holds the first 4 pages and prefetches the other 4."""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import torch.distributed as dist

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.index.hashing import page_hashes
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import StorageTierConfig

PS = 16


async def main(rank: int, world: int, init: str, stored_pages: int, mode: str) -> dict[str, object]:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    conf = StorageTierConfig(
        prefetch_threshold=PS,
        fault_threshold=1,
        reconnect_backoff_s=60.0,  # once down, it stays down for the test
        reconnect_backoff_max_s=60.0,
        prefetch_capacity_tokens=8 * PS if mode == "limited" else None,
    )
    ctl = TierController(
        DeviceKVPool(lay, 256),
        HostKVPool(lay, 1024),
        tp_rank=rank,
        tp_size=world,
        tp_group=group,
        storage_config=conf,
    )
    results: dict[str, object] = {"rank": rank}
    async with ctl:
        backend = FaultyBackend(MemoryBackend())
        await ctl.attach_storage_backend(backend)
        tokens = list(range(8 * PS))
        dev = ctl.device_allocator.alloc(stored_pages * PS)
        assert dev is not None
        host = await ctl.backup(dev)
        assert host is not None
        op = ctl.write_storage(host, tokens[: stored_pages * PS])
        assert op is not None
        await op
        # A first prefetch on every rank. A ``limited`` rank holds it (its
        # agreement is done): the cap is reached, and its next prefetches are
        # rate limited. The others finish it at once.
        h = ctl.host_allocator.alloc(8 * PS)
        assert h is not None
        first = ctl.prefetch("first", h, tokens)
        assert first is not None
        await first
        held = None
        if mode == "limited":
            held = first
        else:
            n, _ = await ctl.terminate_prefetch(first)
            ctl.free_host(h[:n])
            results["first"] = n
        if mode == "down":
            backend.fail_all()
        agreed: list[tuple[int, int]] = []
        started: list[bool] = []
        # Several prefetches in a row: every rank must make the same collective calls.
        for _ in range(3):
            h = ctl.host_allocator.alloc(8 * PS)
            assert h is not None
            if mode == "abstain":  # this rank decides on its own not to prefetch
                ctl.abstain_prefetch()
                pf = None
            elif mode == "holding":  # nothing to fetch: it holds the whole prefix
                ctl.abstain_prefetch(8 * PS)
                pf = None
            elif mode == "half":  # it holds the first half: it fetches the rest
                ctl.free_host(h[4 * PS :])
                h = h[: 4 * PS]
                prior = page_hashes(tokens[: 4 * PS], PS)[-1]
                pf = ctl.prefetch("r", h, tokens[4 * PS :], prior, cached_tokens=4 * PS)
            else:
                pf = ctl.prefetch("r", h, tokens)
            started.append(pf is not None)
            if pf is None:  # skipped on this rank: it keeps its slots
                ctl.free_host(h)
                agreed.append((0, 0))
                continue
            await pf
            n, _ = await ctl.terminate_prefetch(pf)
            agreed.append((pf.storage_hit_tokens, n))
            ctl.free_host(h[:n])
        if held is not None:
            n, _ = await ctl.terminate_prefetch(held)
            results["first"] = n
        results["agreed"] = agreed
        results["started"] = started
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    rank, world, init, stored = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "normal"
    print(json.dumps(asyncio.run(main(rank, world, init, stored, mode))))
