"""Host <-> GPU transfers through the controller, against a plain pinned ``copy_``.

Needs CUDA (skipped otherwise). For a realistic shard (16 layers, 8 KV heads
of 128, fp16: 64 KiB a token) and page size 64 it times, for both host
layouts (``layer_first``, ``page_first``) and for contiguous and scattered
slots (every other page, shuffled, on both sides), interleaved with their
baselines in the same run (best of the repeats):

- ``await controller.backup(slots)`` (device -> pinned host, every layer)
  against one ``copy_`` of the same bytes from a contiguous device tensor
  into a pinned host tensor (``non_blocking``, then synchronize);
- ``await controller.load_back(host)`` (pinned host -> device, layer by
  layer) against the same ``copy_`` the other way;
- the peak device memory each copy allocates above what was allocated
  before it (its staging and gathers: bounded by ``MAX_TEMP_BYTES``).

The layer-future overlap: for a ``load`` + ``start_loading`` of the same
pages, how long until ``await handle.layer(0)`` returns (layer 0 usable by
the forward pass) against ``await handle`` (every layer); median over the
rounds. Ideally the first is ``1 / layers`` of the second.

It also reports, per configuration, the host time ``load`` +
``start_loading`` and every ``wait_layer_device`` take while the GPU is busy
(they must not wait for the GPU), and the bytes the host pool page-locks
against its size (cudaHostRegister locks the pool rounded up to a 4 KiB page,
never to a power of two).

Headlines: the worst backup and load GB/s ratio to the plain pinned copy
(target >= 0.8); the worst host time blocked per load (target < 5 ms); pinned
bytes / pool bytes (target < 1.01).
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


#: The (host layout, slots) configurations measured: both host layouts, with
#: contiguous slots and with scattered ones (pages shuffled on both sides).
CONFIGS: tuple[tuple[str, str], ...] = (
    ("layer_first", "contiguous"),
    ("layer_first", "scattered"),
    ("page_first", "contiguous"),
    ("page_first", "scattered"),
)


def scattered_pages(pages: int, seed: int = 0) -> list[int]:
    """Every other page of ``2 * pages`` pages, shuffled: no two neighbours in a run."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.arange(0, 2 * pages, 2)
    return chosen[torch.randperm(pages, generator=g)].tolist()


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """The slots of ``pages``, page by page."""
    base = torch.tensor(pages, dtype=torch.int64).repeat_interleave(page_size) * page_size
    return base + torch.arange(page_size).repeat(len(pages))


async def _peak_extra(coro: Any) -> tuple[float, int, Any]:
    """Await ``coro``: its seconds, the device bytes allocated at its peak above
    what was allocated before, and its result. (The device is synchronized
    around it: nothing else runs in the benchmark.)"""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = await coro
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base, out


async def _measure_config(
    host_layout: str,
    slots: str,
    mib: int,
    repeat: int,
    dev_flat: torch.Tensor,
    host_flat: torch.Tensor,
) -> dict[str, Any]:
    layout = KVLayout(16, 8, 128, torch.float16, 64)
    ps = layout.page_size
    pages = mib * 2**20 // layout.token_bytes // ps
    tokens = pages * ps
    nbytes = tokens * layout.token_bytes
    device = DeviceKVPool(layout, 2 * tokens, device="cuda")
    host = HostKVPool(layout, 2 * tokens, host_layout=host_layout)
    view_d, view_h = dev_flat[:nbytes], host_flat[:nbytes]
    best = {"backup": float("inf"), "load": float("inf"), "d2h": float("inf"), "h2d": float("inf")}
    peak = {"backup": 0, "load": 0}
    blocked_ms = 0.0
    first_layer: list[float] = []
    whole_load: list[float] = []
    async with TierController(device, host) as c:
        every = c.device_allocator.alloc(2 * tokens)
        assert every is not None
        if slots == "contiguous":
            src = every[:tokens]
            c.free_device(every[tokens:])
        else:
            src = page_slots(scattered_pages(pages), ps)
            keep = torch.zeros(2 * tokens, dtype=torch.bool)
            keep[src] = True
            c.free_device(every[~keep])  # the free half is every other page: loads scatter too
        for rnd in range(repeat + 1):  # round 0 warms up
            t_backup, p_backup, h = await _peak_extra(c.backup(src))
            assert h is not None
            if slots == "scattered":  # the host side scattered too: its pages shuffled
                hp = h[::ps] // ps
                h = page_slots(hp[torch.randperm(pages)].tolist(), ps)
            host_slots = h
            t_d2h = _sync_time(lambda: view_h.copy_(view_d, non_blocking=True))
            t_load, p_load, d = await _peak_extra(c.load_back(host_slots))
            assert d is not None
            t_h2d = _sync_time(lambda: view_d.copy_(view_h, non_blocking=True))
            c.free_device(d)
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
                peak["backup"] = max(peak["backup"], p_backup)
                peak["load"] = max(peak["load"], p_load)
                blocked_ms = max(blocked_ms, blocked * 1000)
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    return {
        "host_layout": host_layout,
        "slots": slots,
        "bytes_per_measurement": nbytes,
        "gbps": gbps,
        "backup_ratio": gbps["backup"] / gbps["d2h"],
        "load_ratio": gbps["load"] / gbps["h2d"],
        "blocked_ms": blocked_ms,
        "peak_extra_device_mib": {k: v / 2**20 for k, v in peak.items()},
        "layer0_ready_ms": statistics.median(first_layer) * 1e3,
        "all_layers_ready_ms": statistics.median(whole_load) * 1e3,
        "layer0_fraction": statistics.median(
            [f / w for f, w in zip(first_layer, whole_load, strict=True)]
        ),
        "num_layers": layout.num_layers,
        "pinned_bytes": host.pinned_bytes,
        "pool_bytes": host.nbytes,
    }


async def _measure(mib: int, repeat: int) -> list[dict[str, Any]]:
    nbytes = mib * 2**20
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return [
        await _measure_config(layout, slots, mib, repeat, dev_flat, host_flat)
        for layout, slots in CONFIGS
    ]


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the GPU transfer benchmark; write ``gpu.json``; return the result.

    Raises:
        BenchmarkSkipped: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise BenchmarkSkipped("needs a CUDA device")
    mib = 64 if smoke else 256 if quick else 1024
    repeat = 2 if smoke else 3 if quick else 5
    t0 = time.perf_counter()
    runs = asyncio.run(_measure(mib, repeat))
    worst_backup = min(r["backup_ratio"] for r in runs)
    worst_load = min(r["load_ratio"] for r in runs)
    blocked_ms = max(r["blocked_ms"] for r in runs)
    heads = [
        headline("worst controller backup / pinned copy_ (GB/s ratio)", worst_backup, TARGET_RATIO),
        headline(
            "worst controller load_back / pinned copy_ (GB/s ratio)", worst_load, TARGET_RATIO
        ),
        headline(
            "host ms blocked per load (load+start_loading+wait_layer_device), GPU busy",
            blocked_ms,
            TARGET_BLOCKED_MS,
            higher_is_better=False,
            unit="ms",
        ),
        headline(
            "pinned bytes / host pool bytes",
            max(r["pinned_bytes"] / r["pool_bytes"] for r in runs),
            TARGET_PINNED_RATIO,
            higher_is_better=False,
        ),
    ]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name()},
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "repeat": repeat,
        "statistic": "best of `repeat` rounds after one warm-up; baselines interleaved",
        "configs": runs,
        "headline": heads,
        "table": {
            "columns": [
                "host layout",
                "slots",
                "direction",
                "controller GB/s",
                "pinned copy_ GB/s",
                "ratio",
                "peak extra device MiB",
                "host ms blocked per load",
            ],
            "rows": [
                row
                for r in runs
                for row in (
                    [
                        r["host_layout"],
                        r["slots"],
                        "device -> host",
                        r["gbps"]["backup"],
                        r["gbps"]["d2h"],
                        r["backup_ratio"],
                        r["peak_extra_device_mib"]["backup"],
                        None,
                    ],
                    [
                        r["host_layout"],
                        r["slots"],
                        "host -> device",
                        r["gbps"]["load"],
                        r["gbps"]["h2d"],
                        r["load_ratio"],
                        r["peak_extra_device_mib"]["load"],
                        r["blocked_ms"],
                    ],
                )
            ],
        },
        "overlap_table": {
            "columns": [
                "host layout",
                "slots",
                "layers",
                "layer 0 ready ms",
                "all ready ms",
                "layer 0 / whole",
            ],
            "rows": [
                [
                    r["host_layout"],
                    r["slots"],
                    r["num_layers"],
                    r["layer0_ready_ms"],
                    r["all_layers_ready_ms"],
                    r["layer0_fraction"],
                ]
                for r in runs
            ],
        },
        "elapsed_s": time.perf_counter() - t0,
    }
    write_result(NAME, result, out_dir)
    return result
