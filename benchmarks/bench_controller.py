"""Controller overhead: one-page operations against the floor, and loop lag.

Part 1 — operations per second of one-page writes (device->host backups) and
loads (host->device) through the async `TierController`
(``await c.backup(page)`` / ``await c.load_back(page)``), for three page
shapes (2 layers, page 16: 16 KiB pages; 24 layers, page 64: 768 KiB pages;
both at most ``inline_copy_bytes``, so the controller copies them in the
call; 16 layers, 8 heads, page 64: 4 MiB pages, which it copies on its
stream's thread), on asyncio's default loop and on uvloop, 1 and 8
operations in flight (that many tasks, each one operation at a time).

The baseline is the floor: the same copies done directly by the caller with
the same `CopyEngine` (plan, then ``backup_all_layers``, or ``load_layer`` for
every layer), no slot allocation, no bookkeeping.

- 1 in flight: one copy at a time, plus one executor round trip
  (``await loop.run_in_executor``) when the controller's copy leaves the loop
  (pages above its ``inline_copy_bytes``). Target: the controller costs at
  most 1.25x the floor per operation (floor ops/s / controller ops/s).
- 8 in flight: the caller doing the same copies itself, one by one, with no
  thread hop at all. Target: the controller's ops/s at least 1.0x that.

Both run in the same process and loop, in interleaved rounds (the order
alternating every round); the figures are medians over the rounds, and a ratio
is the median of the rounds' ratios.

Part 2 — event-loop lag: a coroutine ticking every 1 ms records how late each
tick wakes while 1 GiB (quick: 128 MiB) of 4 MiB pages moves
device->host->device through the controller, and again 256 MiB (quick: 64 MiB)
of 16 KiB pages, 10 round trips each (quick: 3). p50, p99 and max lag are
reported, and p99 as a fraction of the transfer's duration (target < 5%).

Part 3 — the longest call: every synchronous controller verb of a 256 MiB
(quick: 64 MiB) round trip (``submit_write``, ``start_writing``,
``submit_load``, ``start_loading``, ``free_device``, ``free_host``) is timed on
its own, for both page shapes; the headline is the slowest verb's median
(target < 1 ms: no call may stall the loop longer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import uvloop

from benchmarks.common import (
    RESULTS_DIR,
    headline,
    machine_info,
    paired_ratio,
    percentile,
    plot_bars,
    set_threads,
    write_result,
)
from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.transfer import CopyEngine

NAME = "controller"
#: Controller seconds per op / floor seconds per op, at 1 in flight: at most this.
TARGET_COST_RATIO = 1.25
#: Controller ops/s / caller-does-the-copies ops/s, at 8 in flight: at least this.
TARGET_OPS_RATIO = 1.0
TARGET_LAG_FRACTION = 0.05
#: The slowest synchronous verb of a 256 MiB round trip, in ms: below this.
TARGET_CALL_MS = 1.0
CONCURRENCY = 8
TICK_S = 0.001

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}

#: The two page shapes measured, by label.
SHAPES: dict[str, KVLayout] = {
    # 2 layers, 2 KV heads of 64, fp16, page 16: 1 KiB a token, 16 KiB a page.
    "16 KiB": KVLayout(2, 2, 64, torch.float16, 16),
    # 24 layers, 1 KV head of 128, fp16, page 64: 12 KiB a token, 768 KiB a page.
    "768 KiB": KVLayout(24, 1, 128, torch.float16, 64),
    # 16 layers, 8 KV heads of 128, fp16, page 64: 4 MiB a page, above
    # inline_copy_bytes: the copy goes to the stream's thread and back.
    "4 MiB": KVLayout(16, 8, 128, torch.float16, 64),
}


def _pools(layout: KVLayout, slots: int) -> tuple[DeviceKVPool, HostKVPool]:
    device = DeviceKVPool(layout, slots)
    host = HostKVPool(layout, slots)
    host.buffer.zero_()  # fault the host pages in now, not during the timing
    return device, host


# -- one shape on one loop: the floor and the controller, round by round ----------


class _Shape:
    """Pools, a controller and the floor's engine for one page shape, on the running loop."""

    def __init__(self, layout: KVLayout, controller: TierController) -> None:
        self.layout = layout
        self.c = controller
        self.engine = CopyEngine(controller.device_pool, controller.host_pool)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "bench-floor")
        self.off_loop = layout.page_bytes > controller.inline_copy_bytes
        self.dev: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.times: dict[tuple[str, str, int], list[float]] = {}

    async def setup(self) -> None:
        ps = self.layout.page_size
        for _ in range(CONCURRENCY):
            d = self.c.device_allocator.alloc(ps)
            assert d is not None
            h = await self.c.backup(d)  # the host copy the loads read
            assert h is not None
            self.dev.append(d)
            self.host.append(h)
        # The floor copies between slots of its own, after the controller's.
        self.floor_dev = [self.c.device_allocator.alloc(ps) for _ in range(CONCURRENCY)]
        self.floor_host = [self.c.host_allocator.alloc(ps) for _ in range(CONCURRENCY)]

    def _copy(self, kind: str, i: int) -> None:
        h, d = self.floor_host[i], self.floor_dev[i]
        assert h is not None and d is not None
        plan = self.engine.plan(h, d)
        if kind == "write":
            self.engine.backup_all_layers(plan)
        else:
            for layer in range(self.layout.num_layers):
                self.engine.load_layer(layer, plan)

    async def floor(self, kind: str, conc: int, n: int) -> float:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if conc == 1 and self.off_loop:
            copy = functools.partial(self._copy, kind, 0)
            for _ in range(n):
                await loop.run_in_executor(self.executor, copy)
        else:
            with torch.inference_mode():
                for k in range(n):
                    self._copy(kind, k % conc)
        return time.perf_counter() - t0

    async def controller(self, kind: str, conc: int, n: int) -> float:
        c = self.c

        async def worker(i: int, ops: int) -> None:
            if kind == "write":
                for _ in range(ops):
                    h = await c.backup(self.dev[i])
                    assert h is not None
                    c.free_host(h)
            else:
                for _ in range(ops):
                    d = await c.load_back(self.host[i])
                    assert d is not None
                    c.free_device(d)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, n // conc) for i in range(conc)))
        return time.perf_counter() - t0

    async def round(self, n: dict[int, int], turn: int) -> None:
        for kind in ("write", "load"):
            for conc in (1, CONCURRENCY):
                ops = n[conc]
                pair = [("floor", self.floor), ("controller", self.controller)]
                for who, fn in pair if turn % 2 == 0 else pair[::-1]:
                    seconds = await fn(kind, conc, ops)
                    self.times.setdefault((who, kind, conc), []).append(seconds / ops)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


async def _measure_shape(label: str, n: dict[int, int], rounds: int) -> list[dict[str, Any]]:
    layout = SHAPES[label]
    slots = 4 * CONCURRENCY * layout.page_size
    device, host = _pools(layout, slots)
    async with TierController(device, host, track_acks=False) as c:
        shape = _Shape(layout, c)
        try:
            await shape.setup()
            await shape.round({k: max(4, v // 10) for k, v in n.items()}, 0)  # warm-up
            shape.times.clear()
            for turn in range(rounds):
                await shape.round(n, turn)
        finally:
            shape.close()
    rows = []
    for kind in ("write", "load"):
        for conc in (1, CONCURRENCY):
            floors = shape.times[("floor", kind, conc)]
            ctls = shape.times[("controller", kind, conc)]
            floor, ctl = statistics.median(floors), statistics.median(ctls)
            rows.append(
                {
                    "page": label,
                    "page_bytes": layout.page_bytes,
                    "op": kind,
                    "in_flight": conc,
                    "copies_off_loop": shape.off_loop,
                    "async_ops_per_s": 1 / ctl,
                    "floor_ops_per_s": 1 / floor,
                    "async_us_per_op": ctl * 1e6,
                    "floor_us_per_op": floor * 1e6,
                    # 1 in flight: cost per op / the floor's (<= 1.25);
                    # 8 in flight: ops/s / the floor's (>= 1.0).
                    "ratio": paired_ratio(ctls, floors)
                    if conc == 1
                    else paired_ratio(floors, ctls),
                    "ratio_of_medians": ctl / floor if conc == 1 else floor / ctl,
                    "rounds": rounds,
                }
            )
    return rows


def _run_on(loop_name: str, coro_fn: Callable[[], Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(coro_fn())


# -- event-loop lag ---------------------------------------------------------------


#: The lag's large pages: 16 layers, 8 KV heads of 128, fp16, page 64 (4 MiB a page).
LAG_LAYOUT = KVLayout(16, 8, 128, torch.float16, 64)


async def _lag(total_bytes: int, rounds: int, spec: KVLayout = LAG_LAYOUT) -> dict[str, Any]:
    """Tick every 1 ms while ``total_bytes`` go device->host->device ``rounds`` times."""
    n = total_bytes // spec.page_bytes * spec.page_size
    device = DeviceKVPool(spec, 2 * n)
    host = HostKVPool(spec, n)
    host.buffer.zero_()
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(max(0.0, time.perf_counter() - t0 - TICK_S))

    async with TierController(device, host) as c:
        dev = c.device_allocator.alloc(n)
        assert dev is not None
        h = await c.backup(dev)  # warm-up round trip, not ticked
        assert h is not None
        back = await c.load_back(h)
        assert back is not None
        c.free_host(h)
        c.free_device(back)

        # Idle lag: the loop's own timer granularity, with nothing moving.
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.1)
        stop.set()
        await tick
        idle = list(lags)
        lags.clear()
        stop.clear()

        tick = asyncio.create_task(ticker())
        durations = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            h = await c.backup(dev)
            assert h is not None
            back = await c.load_back(h)
            assert back is not None
            durations.append(time.perf_counter() - t0)
            c.free_host(h)
            c.free_device(back)
        stop.set()
        await tick
    duration = sum(durations) / len(durations)
    p50, p99, mx = percentile(lags, 50), percentile(lags, 99), max(lags, default=0.0)
    return {
        "page_bytes": spec.page_bytes,
        "bytes_each_way": n * spec.token_bytes,
        "rounds": rounds,
        "round_trip_s": duration,
        "round_trip_gbps": 2 * n * spec.token_bytes / duration / 1e9,
        "ticks": len(lags),
        "lag_p50_ms": p50 * 1e3,
        "lag_p99_ms": p99 * 1e3,
        "lag_max_ms": mx * 1e3,
        "idle_lag_p50_ms": percentile(idle, 50) * 1e3,
        "idle_lag_p99_ms": percentile(idle, 99) * 1e3,
        "p99_fraction_of_transfer": p99 / duration,
        "max_fraction_of_transfer": mx / duration,
    }


# -- the longest call ----------------------------------------------------------------

CALL_VERBS = (
    "submit_write",
    "start_writing",
    "free_device",
    "submit_load",
    "start_loading",
    "free_host",
)


async def _calls(label: str, total_bytes: int, rounds: int) -> dict[str, float]:
    """Median ms of each synchronous verb of a ``total_bytes`` round trip of ``label`` pages."""
    layout = SHAPES[label]
    n = total_bytes // layout.page_bytes * layout.page_size
    device, host = _pools(layout, n)
    times: dict[str, list[float]] = {}

    def timed(verb: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        times.setdefault(verb, []).append(time.perf_counter() - t0)
        return out

    async with TierController(device, host, track_acks=False, auto_start_writes=False) as c:
        for r in range(rounds + 1):  # the first round warms the pools up, untimed
            if r == 1:
                times.clear()
            dev = c.device_allocator.alloc(n)
            assert dev is not None
            write = timed("submit_write", c.submit_write, dev)
            assert write is not None
            timed("start_writing", c.start_writing)
            await write
            timed("free_device", c.free_device, dev)
            load = timed("submit_load", c.submit_load, write.host_indices)
            assert load is not None
            handle = timed("start_loading", c.start_loading)
            await handle
            timed("free_device", c.free_device, load.device_indices)
            timed("free_host", c.free_host, write.host_indices)
    return {verb: statistics.median(ts) * 1e3 for verb, ts in times.items()}


# -- main ---------------------------------------------------------------------------


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the controller benchmark; write ``controller.json`` and ``controller.png``; return it."""
    threads = set_threads()
    rounds = 1 if smoke else 3 if quick else 7
    scale = 1 if smoke else 4 if quick else 10
    lag_bytes = (32 if smoke else 128 if quick else 1024) * 2**20
    # p99 wants samples: 10 round trips give 200-700 ticks (3 gave 60, where p99 is the max).
    lag_rounds = 2 if smoke else 3 if quick else 10
    t_start = time.perf_counter()

    rates: list[dict[str, Any]] = []
    for label, layout in SHAPES.items():
        # About 0.05-0.2 s a measurement: fewer ops for the larger pages.
        per = max(8, (8 if layout.page_bytes > 256 * 1024 else 40) * scale)
        n = {1: per, CONCURRENCY: per * 2 // CONCURRENCY * CONCURRENCY}
        for loop_name in LOOPS:
            for row in _run_on(loop_name, functools.partial(_measure_shape, label, n, rounds)):
                rates.append({**row, "loop": loop_name})

    lag = {name: _run_on(name, functools.partial(_lag, lag_bytes, lag_rounds)) for name in LOOPS}
    small_bytes = (16 if smoke else 64 if quick else 256) * 2**20
    small = SHAPES["16 KiB"]
    lag_small = {
        name: _run_on(name, functools.partial(_lag, small_bytes, lag_rounds, small))
        for name in LOOPS
    }
    calls = {
        label: _run_on("asyncio", functools.partial(_calls, label, small_bytes, rounds))
        for label in ("16 KiB", "768 KiB")
    }

    heads = [
        headline(
            f"controller us/op / floor us/op, {r['op']}, {r['page']} pages, 1 in flight, "
            f"{r['loop']}",
            r["ratio"],
            TARGET_COST_RATIO,
            higher_is_better=False,
        )
        if r["in_flight"] == 1
        else headline(
            f"controller ops/s / caller-copies ops/s, {r['op']}, {r['page']} pages, "
            f"{r['in_flight']} in flight, {r['loop']}",
            r["ratio"],
            TARGET_OPS_RATIO,
        )
        for r in rates
    ]
    # The large-page rows keep the names they have always had.
    lag_rows = [(f"{lag_bytes >> 20} MiB round trip", lag)]
    lag_rows.append((f"{small_bytes >> 20} MiB round trip, 16 KiB pages", lag_small))
    heads += [
        headline(
            f"loop lag p99 / transfer time, {what}, {name}",
            v["p99_fraction_of_transfer"],
            TARGET_LAG_FRACTION,
            higher_is_better=False,
        )
        for what, lags in lag_rows
        for name, v in lags.items()
    ]
    heads += [
        headline(
            f"longest controller call (ms), {small_bytes >> 20} MiB round trip, {label} pages",
            max(verbs.values()),
            TARGET_CALL_MS,
            higher_is_better=False,
        )
        for label, verbs in calls.items()
    ]
    columns = [
        "page",
        "op",
        "in flight",
        "loop",
        "controller ops/s",
        "floor ops/s",
        "controller us/op",
        "floor us/op",
        "ratio",
        "target",
    ]
    rows: list[list[object]] = [
        [
            r["page"],
            r["op"],
            r["in_flight"],
            r["loop"],
            r["async_ops_per_s"],
            r["floor_ops_per_s"],
            r["async_us_per_op"],
            r["floor_us_per_op"],
            r["ratio"],
            f"<= {TARGET_COST_RATIO}" if r["in_flight"] == 1 else f">= {TARGET_OPS_RATIO}",
        ]
        for r in rates
    ]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": machine_info(),
        "torch_threads": threads,
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "shapes": {label: layout.describe() for label, layout in SHAPES.items()},
        "rounds": rounds,
        "statistic": "median over interleaved rounds (floor and controller alternate first); a ratio is the median of the rounds' ratios (`ratio_of_medians`: the ratio of the two medians)",
        "floor": (
            "the same CopyEngine copies done by the caller; at 1 in flight plus one executor "
            "round trip when the controller's copy leaves the loop; at 8 in flight one by one "
            "with no thread hop. ratio: controller/floor us per op at 1 in flight (<= 1.25), "
            "controller/floor ops/s at 8 in flight (>= 1.0)"
        ),
        "rates": rates,
        "lag": lag,
        "lag_small_pages": lag_small,
        "calls_ms": {"bytes": small_bytes, "rounds": rounds, "median_ms": calls},
        "headline": heads,
        "table": {"columns": columns, "rows": rows},
        "lag_table": {
            "columns": [
                "pages",
                "loop",
                "round trip ms",
                "ticks",
                "p50 ms",
                "p99 ms",
                "max ms",
                "idle p99 ms",
                "p99/transfer",
            ],
            "rows": [
                [
                    f"{v['page_bytes'] >> 10} KiB",
                    name,
                    v["round_trip_s"] * 1e3,
                    v["ticks"],
                    v["lag_p50_ms"],
                    v["lag_p99_ms"],
                    v["lag_max_ms"],
                    v["idle_lag_p99_ms"],
                    v["p99_fraction_of_transfer"],
                ]
                for lags in (lag, lag_small)
                for name, v in lags.items()
            ],
        },
        "calls_table": {
            "columns": ["pages", *CALL_VERBS],
            "rows": [[label, *(verbs[v] for v in CALL_VERBS)] for label, verbs in calls.items()],
        },
        "elapsed_s": 0.0,
    }
    result["elapsed_s"] = time.perf_counter() - t_start
    write_result(NAME, result, out_dir)
    groups = [f"{r['page']} {r['op']} x{r['in_flight']}" for r in rates if r["loop"] == "asyncio"]
    series: dict[str, Sequence[float]] = {
        f"controller / floor ops/s ({name})": [
            r["async_ops_per_s"] / r["floor_ops_per_s"] for r in rates if r["loop"] == name
        ]
        for name in LOOPS
    }
    plot_bars(
        NAME,
        groups,
        series,
        title="one-page ops/s, controller / floor (1.0 = the floor's rate)",
        ylabel="controller ops/s / floor ops/s",
        out_dir=out_dir,
        hline=1.0,
    )
    return result


if __name__ == "__main__":
    from benchmarks.common import print_table

    res = main()
    print_table(res["table"]["columns"], res["table"]["rows"])
    print_table(res["lag_table"]["columns"], res["lag_table"]["rows"])
    print_table(res["calls_table"]["columns"], res["calls_table"]["rows"])
