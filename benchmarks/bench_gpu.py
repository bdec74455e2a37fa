"""Host <-> GPU transfers through the controller, against a plain pinned ``copy_``.

Needs CUDA (skipped otherwise). For a realistic shard (16 layers, 8 KV heads
of 128, fp16: 64 KiB a token) and page size 64 it times, interleaved with
their baselines in the same run (best of the repeats):

- ``await controller.backup(slots)`` (device -> pinned host, every layer)
  against one ``copy_`` of the same bytes from a contiguous device tensor
  into a pinned host tensor (``non_blocking``, then synchronize);
- ``await controller.load_back(host)`` (pinned host -> device, layer by
  layer) against the same ``copy_`` the other way.

The layer-future overlap: for a ``load`` + ``start_loading`` of the same
pages, how long until ``await handle.layer(0)`` returns (layer 0 usable by
the forward pass) against ``await handle`` (every layer); median over the
rounds. Ideally the first is ``1 / layers`` of the second.

It also reports the host time ``load`` + ``start_loading`` and every
``wait_layer_device`` take while the GPU is busy (they must not wait for the
GPU), and the bytes the host pool page-locks against its size (cudaHostRegister
locks the pool rounded up to a 4 KiB page, never to a power of two).

Headlines: backup and load GB/s as a ratio of the plain pinned copy (target
>= 0.8); host time blocked (target < 5 ms); pinned bytes / pool bytes
(target < 1.01).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    BenchmarkSkipped,
    headline,
    machine_info,
    write_result,
)
from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController

NAME = "gpu"
TARGET_RATIO = 0.8
TARGET_BLOCKED_MS = 5.0
TARGET_PINNED_RATIO = 1.01


def _sync_time(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


async def _overlap(c: TierController, h: torch.Tensor) -> tuple[float, float]:
    """The layer-future overlap: seconds until layer 0 of a load of ``h`` is usable, and all."""
    t0 = time.perf_counter()
    d = c.load(h)
    handle = c.start_loading()
    assert d is not None and handle is not None
    await handle.layer(0)
    t_first = time.perf_counter() - t0
    await handle
    t_all = time.perf_counter() - t0
    c.free_device(d)
    return t_first, t_all


async def _blocked_s(c: TierController, h: torch.Tensor) -> float:
    """Host seconds ``load`` + ``start_loading`` + every ``wait_layer_device`` take, GPU busy.

    Tens of milliseconds of spin are queued on the compute stream first: a
    call that waited for the GPU would show them.
    """
    torch.cuda._sleep(50_000_000)
    t0 = time.perf_counter()
    d = c.load(h)
    handle = c.start_loading()
    assert d is not None and handle is not None
    for layer in range(handle.num_layers):
        handle.wait_layer_device(layer)
    blocked = time.perf_counter() - t0
    await handle
    c.free_device(d)
    return blocked


async def _measure(mib: int, repeat: int) -> dict[str, Any]:
    layout = KVLayout(16, 8, 128, torch.float16, 64)
    tokens = mib * 2**20 // layout.token_bytes // 64 * 64
    nbytes = tokens * layout.token_bytes
    device = DeviceKVPool(layout, 2 * tokens, device="cuda")
    host = HostKVPool(layout, 2 * tokens)
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = {"backup": float("inf"), "load": float("inf"), "d2h": float("inf"), "h2d": float("inf")}
    blocked_ms = 0.0
    first_layer: list[float] = []
    whole_load: list[float] = []
    async with TierController(device, host) as c:
        src = c.device_allocator.alloc(tokens)
        assert src is not None
        for rnd in range(repeat + 1):  # round 0 warms up
            t0 = time.perf_counter()
            h = await c.backup(src)
            t_backup = time.perf_counter() - t0
            assert h is not None
            t_d2h = _sync_time(lambda: host_flat.copy_(dev_flat, non_blocking=True))
            t0 = time.perf_counter()
            d = await c.load_back(h)
            t_load = time.perf_counter() - t0
            assert d is not None
            t_h2d = _sync_time(lambda: dev_flat.copy_(host_flat, non_blocking=True))
            c.free_device(d)  # the pool holds two loads' worth: ``src`` and one more
            t_first, t_all = await _overlap(c, h)
            blocked = await _blocked_s(c, h)
            c.free_host(h)
            if rnd:
                first_layer.append(t_first)
                whole_load.append(t_all)
                best["backup"] = min(best["backup"], t_backup)
                best["load"] = min(best["load"], t_load)
                best["d2h"] = min(best["d2h"], t_d2h)
                best["h2d"] = min(best["h2d"], t_h2d)
                blocked_ms = max(blocked_ms, blocked * 1000)
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    return {
        "bytes_per_measurement": nbytes,
        "gbps": gbps,
        "backup_ratio": gbps["backup"] / gbps["d2h"],
        "load_ratio": gbps["load"] / gbps["h2d"],
        "blocked_ms": blocked_ms,
        "layer0_ready_ms": statistics.median(first_layer) * 1e3,
        "all_layers_ready_ms": statistics.median(whole_load) * 1e3,
        "layer0_fraction": statistics.median(
            [f / w for f, w in zip(first_layer, whole_load, strict=True)]
        ),
        "num_layers": layout.num_layers,
        "pinned_bytes": host.pinned_bytes,
        "pool_bytes": host.nbytes,
    }


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the GPU transfer benchmark; write ``gpu.json``; return the result.

    Raises:
        BenchmarkSkipped: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise BenchmarkSkipped("needs a CUDA device")
    mib = 64 if smoke else 512 if quick else 2048
    repeat = 2 if smoke else 3 if quick else 5
    t0 = time.perf_counter()
    r = asyncio.run(_measure(mib, repeat))
    heads = [
        headline("controller backup / pinned copy_ (GB/s ratio)", r["backup_ratio"], TARGET_RATIO),
        headline("controller load_back / pinned copy_ (GB/s ratio)", r["load_ratio"], TARGET_RATIO),
        headline(
            "host ms blocked in load+start_loading+wait_layer_device, GPU busy",
            r["blocked_ms"],
            TARGET_BLOCKED_MS,
            higher_is_better=False,
            unit="ms",
        ),
        headline(
            "pinned bytes / host pool bytes",
            r["pinned_bytes"] / r["pool_bytes"],
            TARGET_PINNED_RATIO,
            higher_is_better=False,
        ),
    ]
    g = r["gbps"]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name()},
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "repeat": repeat,
        "statistic": "best of `repeat` rounds after one warm-up; baselines interleaved",
        **r,
        "headline": heads,
        "table": {
            "columns": ["direction", "controller GB/s", "pinned copy_ GB/s", "ratio"],
            "rows": [
                ["device -> host", g["backup"], g["d2h"], r["backup_ratio"]],
                ["host -> device", g["load"], g["h2d"], r["load_ratio"]],
            ],
        },
        "overlap_table": {
            "columns": ["layers", "layer 0 ready ms", "all layers ready ms", "layer 0 / whole"],
            "rows": [
                [
                    r["num_layers"],
                    r["layer0_ready_ms"],
                    r["all_layers_ready_ms"],
                    r["layer0_fraction"],
                ]
            ],
        },
        "elapsed_s": time.perf_counter() - t0,
    }
    write_result(NAME, result, out_dir)
    return result
