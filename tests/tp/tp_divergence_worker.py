"""One tensor-parallel rank for test_tp_divergence.py, through the `TierCache` facade.

Called as ``worker RANK WORLD INIT_URL SCENARIO STORE_DIR [BACKEND]``. Each rank
has its own file store under ``STORE_DIR``. Before a restart it caches six
128-token prompts (written through to storage); after it, a new cache on the
same store serves the six prompts again, and the rank reports the
``cached_tokens`` of each request. ``SCENARIO`` makes the ranks diverge:

- ``fail0``: rank 0's storage fails every call (``auto_detach`` policy);
- ``slow1``: rank 1's storage reads take 0.4 s (``timeout`` policy);
- ``warm0``: after the restart rank 0 computes the prompts again (so it has
  nothing to prefetch: its prefetches return early), rank 1 does not;
- ``half0``: after the restart rank 0 computes the first half of each prompt
  again; both ranks then fetch up to the same end, from different starts;
- ``healthy``: no divergence.

``BACKEND`` is ``gloo`` (the default, CPU pools) or ``nccl`` (one GPU per
rank, device pools on it, the TP group an NCCL group).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiercache import TierCache, TierCacheConfig
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend

PS = 16
PROMPTS = [[1000 * (i + 1) + t for t in range(128 + 1)] for i in range(6)]


def config(rank: int, world: int, scenario: str, device: str) -> TierCacheConfig:
    policy = "timeout" if scenario == "slow1" else "wait_complete"
    return TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        page_size=PS,
        device=device,
        device_tokens=2048,
        host_tokens=2048,
        model="tp-divergence",
        write_policy="write_through",
        prefetch_policy=policy,
        prefetch_threshold=PS,
        prefetch_timeout_base=0.2,
        prefetch_timeout_per_ki_token=0.0,
        storage_timeout_s=5.0,
        storage_fault_policy="auto_detach" if scenario == "fail0" else "auto_reconnect",
        storage_fault_threshold=1,
        tp_rank=rank,
        tp_size=world,
    )


async def fill(cache: TierCache, prefetch: bool = True, tokens: int | None = None) -> None:
    for whole in PROMPTS:
        prompt = whole if tokens is None else whole[:tokens]
        async with cache.request(prompt, prefetch=prefetch) as req:
            new = await req.alloc(len(prompt) - req.cached_tokens)
            await req.commit(prompt, torch.cat([req.prefix_indices, new]))
    await cache.wait_idle()


async def main(
    rank: int, world: int, init: str, scenario: str, store: Path, backend: str
) -> dict[str, Any]:
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend=backend)
    cfg = config(rank, world, scenario, device)
    root = store / f"rank{rank}"
    report: dict[str, Any] = {"rank": rank}
    async with TierCache(cfg, tp_group=group) as cache:
        await cache.attach_storage(f"file://{root}")
        await fill(cache)
    # A restart: a new cache on the same store, on every rank.
    async with TierCache(cfg, tp_group=group) as cache:
        faulty = await cache.attach_storage(f"faulty+file://{root}", plan=FaultPlan())
        assert isinstance(faulty, FaultyBackend)
        if scenario == "fail0" and rank == 0:
            faulty.fail_all()
        if scenario == "slow1" and rank == 1:
            faulty.set_plan(FaultPlan.of(FaultSpec(FaultKind.LATENCY, ops=["get"], delay=0.4)))
        if scenario == "warm0" and rank == 0:
            # This rank computes the prompts again (no prefetch, no agreement):
            # it then has nothing to fetch, and its prefetches return early.
            await fill(cache, prefetch=False)
        if scenario == "half0" and rank == 0:
            # This rank computes the first half of each prompt again: it then
            # fetches the second half from storage, rank 1 the whole prompt.
            await fill(cache, prefetch=False, tokens=64 + 1)
        await serve(cache, report)
    dist.destroy_process_group()
    return report


async def serve(cache: TierCache, report: dict[str, Any]) -> None:
    cached = []
    for prompt in PROMPTS:
        async with cache.request(prompt) as req:
            cached.append(req.cached_tokens)
    await cache.wait_idle()
    report["cached"] = cached
    report["attached"] = cache.controller.storage_attached
    report["auto_detaches"] = cache.controller.storage_stats().auto_detaches


if __name__ == "__main__":
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    scenario, store = sys.argv[4], Path(sys.argv[5])
    backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    print(json.dumps(asyncio.run(main(rank, world, init, scenario, store, backend))))
