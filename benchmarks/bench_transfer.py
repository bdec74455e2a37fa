"""Device <-> host transfer throughput, as a ratio to the machine's own memcpy.

For page sizes 1, 16 and 64 and host layouts ``layer_first`` and
``page_first``, it times a backup (every layer, device->host,
`CopyEngine.backup_all_layers`) and a load (layer 0 first,
`CopyEngine.load_all_layers`, as the controller loads) of the same pages, both for
contiguous page runs (what a fresh allocator hands out) and for scattered pages
(a random page order on both sides). Each is divided by a plain
``Tensor.copy_`` of the same number of bytes between two preallocated
contiguous tensors, timed interleaved with it in the same run: the order of
the two alternates every round (whatever runs second pays for what the first
left behind: OpenMP workers still spinning, a cold cache), and each figure is
the median of the rounds; each ratio is the median of the rounds' ratios, so a
slow spell of the machine that lands on one round cancels out. The end-to-end controller path (``await
controller.backup(...)``, ``await controller.load_back(...)``) is measured the
same way at page size 64: that is what users get.

"scaling" times transfers of 1, 4, 16, 64 and 256 pages (page size 64) and
fits ``time = intercept + slope * pages``.

Headline: the ratios at page size 64; target >= 0.8 on a CPU.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    headline,
    linear_fit,
    machine_info,
    paired_ratio,
    plot_bars,
    plot_lines,
    set_threads,
    write_result,
)
from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.transfer import CopyEngine

NAME = "transfer"
TARGET_RATIO = 0.8
PAGE_SIZES = (1, 16, 64)
HOST_LAYOUTS = ("layer_first", "page_first")
SCALING_PAGES = (1, 4, 16, 64, 256)

# A realistic shard: 16 layers, 8 KV heads of 128, fp16 -> 64 KiB per token.
FULL_LAYOUT = {"num_layers": 16, "num_kv_heads": 8, "head_dim": 128}
# Quick scaling keeps the page counts but shrinks the pages (4 KiB per token).
QUICK_SCALING_LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 128}


def _layout(spec: dict[str, int], page_size: int) -> KVLayout:
    return KVLayout(
        spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], torch.float16, page_size
    )


def _slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)


def _indices(
    num_tokens: int, page_size: int, pool_slots: int, scattered: bool, seed: int
) -> torch.Tensor:
    """Slot indices of ``num_tokens`` tokens: the first pages in order, or random pages."""
    num_pages = num_tokens // page_size
    if not scattered:
        return torch.arange(num_tokens, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(pool_slots // page_size, generator=gen)[:num_pages]
    return _slots(pages, page_size)


class _Memcpy:
    """The baseline: ``dst.copy_(src)`` of ``nbytes`` between preallocated contiguous tensors."""

    def __init__(self, max_bytes: int) -> None:
        self.src = torch.ones(max_bytes, dtype=torch.uint8)
        self.dst = torch.zeros(max_bytes, dtype=torch.uint8)  # both touched: no page faults

    def fn(self, nbytes: int) -> Callable[[], object]:
        src, dst = self.src[:nbytes], self.dst[:nbytes]
        return lambda: dst.copy_(src)


def _warm(host: HostKVPool) -> HostKVPool:
    """Touch every page of a host pool so that timings exclude first-touch page faults.

    A CPU host pool is allocated lazily (pinned memory is faulted in at
    allocation instead); the cold cost is reported on its own.
    """
    host.buffer.zero_()
    return host


def _interleaved(fns: list[Callable[[], object]], repeat: int) -> list[list[float]]:
    """Seconds of each of ``fns`` in each of ``repeat`` rounds, after one warm-up round.

    The order alternates every round, so each function follows every other
    one equally often; sample ``r`` of every list comes from round ``r``.
    """
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeat):
        order = list(range(len(fns)))
        for i in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return times


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def _engine_rows(
    spec: dict[str, int], num_tokens: int, memcpy: _Memcpy, repeat: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for ps in PAGE_SIZES:
        layout = _layout(spec, ps)
        slots = 2 * num_tokens  # room to scatter
        device = DeviceKVPool(layout, slots)
        for hl in HOST_LAYOUTS:
            host = _warm(HostKVPool(layout, slots, host_layout=hl))
            engine = CopyEngine(device, host)
            # "host_scattered": LRU-scattered host pages loaded into a fresh
            # (contiguous) device allocation, the usual load back.
            for pattern in ("contiguous", "scattered", "host_scattered"):
                h = _indices(num_tokens, ps, slots, pattern != "contiguous", seed=1)
                d = _indices(num_tokens, ps, slots, pattern == "scattered", seed=2)
                plan = engine.plan(h, d)
                nbytes = engine.plan_bytes(plan)

                def backup(plan: Any = plan, engine: CopyEngine = engine) -> None:
                    engine.backup_all_layers(plan)

                def load(plan: Any = plan, engine: CopyEngine = engine) -> None:
                    engine.load_all_layers(plan)

                base = memcpy.fn(nbytes)
                r_base_b, r_backup = _interleaved([base, backup], repeat)
                r_base_l, r_load = _interleaved([base, load], repeat)
                t_base_b, t_backup, t_base_l, t_load = map(
                    statistics.median, (r_base_b, r_backup, r_base_l, r_load)
                )
                rows.append(
                    {
                        "page_size": ps,
                        "host_layout": hl,
                        "pattern": pattern,
                        "pages": num_tokens // ps,
                        "copy_path": (
                            "page gather (load)"
                            if plan.device_runs is not None
                            else "runs, 128 KiB chunks"
                            if plan.chunks is not None
                            else "runs"
                            if plan.runs is not None
                            else "index"
                        ),
                        "runs": len(plan.runs) if plan.runs is not None else None,
                        "bytes": nbytes,
                        "backup_s": t_backup,
                        "load_s": t_load,
                        "memcpy_backup_s": t_base_b,
                        "memcpy_load_s": t_base_l,
                        "backup_gbps": _gbps(nbytes, t_backup),
                        "load_gbps": _gbps(nbytes, t_load),
                        "memcpy_gbps": _gbps(nbytes, min(t_base_b, t_base_l)),
                        "backup_ratio": paired_ratio(r_base_b, r_backup),
                        "load_ratio": paired_ratio(r_base_l, r_load),
                        "backup_ratio_of_medians": t_base_b / t_backup,
                        "load_ratio_of_medians": t_base_l / t_load,
                    }
                )
            engine.close()  # its helper thread, started by the copies above
            del host, engine
        del device
    return rows


async def _timed_async(
    fns: list[Callable[[], Coroutine[Any, Any, float]]], repeat: int
) -> list[list[float]]:
    """Like `_interleaved`, for coroutine functions that return their own timing."""
    for fn in fns:
        await fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeat):
        order = list(range(len(fns)))
        for i in order if r % 2 == 0 else order[::-1]:
            times[i].append(await fns[i]())
    return times


def _sync_timer(fn: Callable[[], object]) -> Callable[[], Coroutine[Any, Any, float]]:
    async def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def _controller_ops(
    c: TierController, dev: torch.Tensor
) -> tuple[Callable[[], Coroutine[Any, Any, float]], Callable[[], Coroutine[Any, Any, float]]]:
    """Timed ``backup`` and ``load_back`` of ``dev``; each frees what it got, untimed."""
    held: dict[str, torch.Tensor] = {}

    async def backup() -> float:
        if "host" in held:
            c.free_host(held.pop("host"))
        t0 = time.perf_counter()
        host = await c.backup(dev)
        dt = time.perf_counter() - t0
        assert host is not None
        held["host"] = host
        return dt

    async def load_back() -> float:
        if "host" not in held:
            await backup()
        t0 = time.perf_counter()
        back = await c.load_back(held["host"])
        dt = time.perf_counter() - t0
        assert back is not None
        c.free_device(back)
        return dt

    return backup, load_back


async def _controller_rows(
    spec: dict[str, int], num_tokens: int, memcpy: _Memcpy, repeat: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ps = 64
    layout = _layout(spec, ps)
    for hl in HOST_LAYOUTS:
        device = DeviceKVPool(layout, 2 * num_tokens)
        host = HostKVPool(layout, num_tokens, host_layout=hl)
        async with TierController(device, host) as c:
            dev = c.device_allocator.alloc(num_tokens)
            assert dev is not None
            nbytes = num_tokens * layout.token_bytes
            # The first backup into a pool nobody has touched yet pays the page faults.
            t0 = time.perf_counter()
            cold = await c.backup(dev)
            t_cold = time.perf_counter() - t0
            assert cold is not None
            c.free_host(cold)
            _warm(host)
            backup, load_back = _controller_ops(c, dev)
            base = _sync_timer(memcpy.fn(nbytes))
            r_base_b, r_backup = await _timed_async([base, backup], repeat)
            r_base_l, r_load = await _timed_async([base, load_back], repeat)
            t_base_b, t_backup, t_base_l, t_load = map(
                statistics.median, (r_base_b, r_backup, r_base_l, r_load)
            )
        rows.append(
            {
                "page_size": ps,
                "host_layout": hl,
                "pages": num_tokens // ps,
                "bytes": nbytes,
                "backup_s": t_backup,
                "load_back_s": t_load,
                "backup_gbps": _gbps(nbytes, t_backup),
                "load_back_gbps": _gbps(nbytes, t_load),
                "memcpy_gbps": _gbps(nbytes, min(t_base_b, t_base_l)),
                "backup_ratio": paired_ratio(r_base_b, r_backup),
                "load_back_ratio": paired_ratio(r_base_l, r_load),
                "backup_ratio_of_medians": t_base_b / t_backup,
                "load_back_ratio_of_medians": t_base_l / t_load,
                "cold_host_pool_backup_gbps": _gbps(nbytes, t_cold),
            }
        )
        del device, host
    return rows


async def _scaling(spec: dict[str, int], memcpy: _Memcpy, repeat: int) -> dict[str, Any]:
    ps = 64
    layout = _layout(spec, ps)
    max_tokens = max(SCALING_PAGES) * ps
    device = DeviceKVPool(layout, 2 * max_tokens)
    host = _warm(HostKVPool(layout, max_tokens))
    points: list[dict[str, Any]] = []
    async with TierController(device, host) as c:
        for pages in SCALING_PAGES:
            n = pages * ps
            h = torch.arange(n, dtype=torch.int64)
            plan = c.engine.plan(h, h)

            def backup(plan: Any = plan) -> None:
                c.engine.backup_all_layers(plan)

            def load(plan: Any = plan) -> None:
                c.engine.load_all_layers(plan)

            dev = c.device_allocator.alloc(n)
            assert dev is not None
            c_backup, c_load = _controller_ops(c, dev)
            t_mem, t_b, t_l = map(
                statistics.median,
                _interleaved([memcpy.fn(n * layout.token_bytes), backup, load], repeat),
            )
            t_cb, t_cl = map(statistics.median, await _timed_async([c_backup, c_load], repeat))
            await c.reset()
            c.engine.close()  # the helper the direct engine copies above started
            points.append(
                {
                    "pages": pages,
                    "bytes": n * layout.token_bytes,
                    "memcpy_s": t_mem,
                    "engine_backup_s": t_b,
                    "engine_load_s": t_l,
                    "controller_backup_s": t_cb,
                    "controller_load_back_s": t_cl,
                }
            )
    xs = [float(p["pages"]) for p in points]
    fits = {}
    for key in (
        "memcpy_s",
        "engine_backup_s",
        "engine_load_s",
        "controller_backup_s",
        "controller_load_back_s",
    ):
        ys = [p[key] for p in points]
        fit = linear_fit(xs, ys)
        fits[key] = {
            "seconds_per_page": fit["slope"],
            "fixed_seconds": fit["intercept"],
            "r2": fit["r2"],
        }
    for p in points:
        for key in (
            "engine_backup_s",
            "engine_load_s",
            "controller_backup_s",
            "controller_load_back_s",
        ):
            p[key.removesuffix("_s") + "_per_page_s"] = p[key] / p["pages"]
    return {
        "layout": layout.describe(),
        "page_bytes": layout.page_bytes,
        "host_layout": "layer_first",
        "points": points,
        "fit": fits,
    }


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the transfer benchmark; write ``transfer.json`` and ``transfer.png``; return the result."""
    threads = set_threads()
    spec = FULL_LAYOUT
    mib = 4 if smoke else 32 if quick else 256
    repeat = 2 if smoke else 3 if quick else 7
    layout64 = _layout(spec, 64)
    num_tokens = mib * 2**20 // layout64.token_bytes  # a multiple of 64 for these sizes
    scaling_spec = QUICK_SCALING_LAYOUT if quick or smoke else FULL_LAYOUT
    max_bytes = max(
        num_tokens * layout64.token_bytes, max(SCALING_PAGES) * _layout(scaling_spec, 64).page_bytes
    )
    memcpy = _Memcpy(max_bytes)

    t0 = time.perf_counter()
    engine_rows = _engine_rows(spec, num_tokens, memcpy, repeat)

    async def async_part() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        ctl = await _controller_rows(spec, num_tokens, memcpy, repeat)
        scaling_repeat = 2 if smoke else 3
        return ctl, await _scaling(scaling_spec, memcpy, scaling_repeat)

    controller_rows, scaling = asyncio.run(async_part())

    heads: list[dict[str, Any]] = []
    for r in engine_rows:
        if r["page_size"] == 64 and r["pattern"] == "scattered":
            for op in ("backup", "load"):
                heads.append(
                    headline(
                        f"engine {op} / memcpy, page 64, scattered, {r['host_layout']}",
                        r[f"{op}_ratio"],
                        TARGET_RATIO,
                    )
                )
        if r["page_size"] == 64 and r["pattern"] == "host_scattered":
            heads.append(
                headline(
                    f"engine load / memcpy, page 64, scattered host -> fresh device run, {r['host_layout']}",
                    r["load_ratio"],
                    TARGET_RATIO,
                )
            )
    for r in controller_rows:
        for op in ("backup", "load_back"):
            heads.append(
                headline(
                    f"controller {op} / memcpy, page 64, {r['host_layout']}",
                    r[f"{op}_ratio"],
                    TARGET_RATIO,
                )
            )

    columns = [
        "path",
        "page",
        "host layout",
        "pattern",
        "copy",
        "backup GB/s",
        "load GB/s",
        "memcpy GB/s",
        "backup ratio",
        "load ratio",
    ]
    rows: list[list[object]] = [
        [
            "engine",
            r["page_size"],
            r["host_layout"],
            r["pattern"],
            r["copy_path"],
            r["backup_gbps"],
            r["load_gbps"],
            r["memcpy_gbps"],
            r["backup_ratio"],
            r["load_ratio"],
        ]
        for r in engine_rows
    ]
    rows += [
        [
            "controller",
            r["page_size"],
            r["host_layout"],
            "contiguous",
            "-",
            r["backup_gbps"],
            r["load_back_gbps"],
            r["memcpy_gbps"],
            r["backup_ratio"],
            r["load_back_ratio"],
        ]
        for r in controller_rows
    ]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": machine_info(),
        "torch_threads": threads,
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "layout": _layout(spec, 64).describe().replace(":P64", ""),
        "bytes_per_measurement": num_tokens * layout64.token_bytes,
        "repeat": repeat,
        "statistic": "median of `repeat` rounds after one warm-up; memcpy baseline interleaved with each measurement, the order alternating every round; a ratio is the median of the rounds' ratios (`*_ratio_of_medians`: the ratio of the two medians)",
        "engine": engine_rows,
        "controller": controller_rows,
        "scaling": scaling,
        "headline": heads,
        "table": {"columns": columns, "rows": rows},
        "elapsed_s": time.perf_counter() - t0,
    }
    write_result(NAME, result, out_dir)
    groups = [f"{r['page_size']}/{r['host_layout'][:5]}/{r['pattern'][:4]}" for r in engine_rows]
    groups += [f"ctl 64/{r['host_layout'][:5]}" for r in controller_rows]
    plot_bars(
        NAME,
        groups,
        {
            "backup / memcpy": [r["backup_ratio"] for r in engine_rows]
            + [r["backup_ratio"] for r in controller_rows],
            "load / memcpy": [r["load_ratio"] for r in engine_rows]
            + [r["load_back_ratio"] for r in controller_rows],
        },
        title=f"device<->host transfer vs memcpy ({result['bytes_per_measurement'] >> 20} MiB, {threads} threads)",
        ylabel="throughput ratio to memcpy",
        out_dir=out_dir,
        hline=TARGET_RATIO,
    )
    pts = scaling["points"]
    plot_lines(
        f"{NAME}_scaling",
        [p["pages"] for p in pts],
        {
            k: [p[k] * 1e3 for p in pts]
            for k in (
                "memcpy_s",
                "engine_backup_s",
                "engine_load_s",
                "controller_backup_s",
                "controller_load_back_s",
            )
        },
        title=f"transfer time vs pages ({scaling['layout']})",
        xlabel="pages",
        ylabel="ms",
        out_dir=out_dir,
        logx=True,
        logy=True,
    )
    return result


if __name__ == "__main__":
    from benchmarks.common import print_table

    res = main()
    print_table(res["table"]["columns"], res["table"]["rows"])
