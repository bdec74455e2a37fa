"""Controller overhead: small-operation rate against a thread-and-queue controller, and loop lag.

Part 1 — operations per second of one-page writes (device->host backups) and
loads (host->device) on a tiny layout, through the async `TierController`
(``await c.backup(page)`` / ``await c.load_back(page)``), one at a time and
with N operations in flight (N tasks), on asyncio's default loop and on
uvloop. The baseline is `ThreadedController`, written here the way SGLang's
seed ``HiCacheController`` does it: one ``threading.Thread`` per queue (write,
load) polling ``queue.Queue.get(timeout=...)``, the same `CopyEngine` copy
(plan, then ``backup_all_layers`` / ``load_layer`` per layer), and an ack per
operation: a ``threading.Event`` the caller waits on (one at a time) or an ack
queue the caller polls (N in flight). Each rate is the best of a few repeats
after a warm-up, both designs measured in the same run.

Part 2 — event-loop lag: a coroutine ticking every 1 ms records how late each
tick wakes while 1 GiB (quick: 128 MiB) moves device->host->device through the
controller. p50, p99 and max lag are reported, and p99 as a fraction of the
transfer's duration (target < 5%).

Headlines: async / threaded ops-per-second ratio (target >= 1.0: the async
design adds no per-operation overhead), and the p99 lag fraction.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvloop

from benchmarks.common import (
    RESULTS_DIR,
    headline,
    machine_info,
    percentile,
    plot_bars,
    set_threads,
    write_result,
)
from tiercache import DeviceKVPool, HostKVPool, KVLayout, PageAllocator, TierController
from tiercache.transfer import CopyEngine

NAME = "controller"
TARGET_OPS_RATIO = 1.0
TARGET_LAG_FRACTION = 0.05
CONCURRENCY = 8
PAGE_SIZE = 16
TICK_S = 0.001

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def _tiny_layout() -> KVLayout:
    # 2 layers, 2 KV heads of 64, fp16: 1 KiB per token, 16 KiB per page.
    return KVLayout(2, 2, 64, torch.float16, PAGE_SIZE)


def _pools(layout: KVLayout, slots: int) -> tuple[DeviceKVPool, HostKVPool]:
    device = DeviceKVPool(layout, slots)
    host = HostKVPool(layout, slots)
    host.buffer.zero_()  # fault the host pages in now, not during the timing
    return device, host


# -- the baseline: the seed's thread-and-queue design ---------------------------


@dataclass(slots=True)
class _ThreadedOp:
    host: torch.Tensor
    device: torch.Tensor
    done: threading.Event | None
    layers_done: int = 0
    error: BaseException | None = field(default=None)


class ThreadedController:
    """A minimal thread-and-queue controller, as SGLang's seed builds it.

    The caller (the scheduler thread) allocates slots and puts an operation on
    the write or load queue; the queue's thread polls it with
    ``get(timeout=...)``, plans and runs the same `CopyEngine` copy, then acks:
    it sets the operation's ``threading.Event``, or puts the operation on the
    ack queue the caller polls. Operations are copied one at a time, in order.
    """

    POLL_TIMEOUT_S = 0.5

    def __init__(
        self,
        device: DeviceKVPool,
        host: HostKVPool,
        device_alloc: PageAllocator,
        host_alloc: PageAllocator,
    ) -> None:
        self.engine = CopyEngine(device, host)
        self.num_layers = device.layout.num_layers
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self.write_queue: queue.Queue[_ThreadedOp] = queue.Queue()
        self.load_queue: queue.Queue[_ThreadedOp] = queue.Queue()
        self.ack_write_queue: queue.Queue[_ThreadedOp] = queue.Queue()
        self.ack_load_queue: queue.Queue[_ThreadedOp] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._write_thread, name="bench-threaded-write", daemon=True),
            threading.Thread(target=self._load_thread, name="bench-threaded-load", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def write(
        self, device_indices: torch.Tensor, done: threading.Event | None = None
    ) -> _ThreadedOp | None:
        host = self.host_alloc.alloc(device_indices.numel())
        if host is None:
            return None
        op = _ThreadedOp(host, device_indices, done)
        self.write_queue.put(op)
        return op

    def load(
        self, host_indices: torch.Tensor, done: threading.Event | None = None
    ) -> _ThreadedOp | None:
        dev = self.device_alloc.alloc(host_indices.numel())
        if dev is None:
            return None
        op = _ThreadedOp(host_indices, dev, done)
        self.load_queue.put(op)
        return op

    def _poll(self, q: queue.Queue[_ThreadedOp]) -> _ThreadedOp | None:
        try:
            return q.get(timeout=self.POLL_TIMEOUT_S)
        except queue.Empty:
            return None

    def _ack(self, op: _ThreadedOp, acks: queue.Queue[_ThreadedOp]) -> None:
        if op.done is not None:
            op.done.set()
        else:
            acks.put(op)

    def _write_thread(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                op = self._poll(self.write_queue)
                if op is None:
                    continue
                try:
                    self.engine.backup_all_layers(self.engine.plan(op.host, op.device))
                except BaseException as e:  # reported to the caller through the ack
                    op.error = e
                self._ack(op, self.ack_write_queue)

    def _load_thread(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                op = self._poll(self.load_queue)
                if op is None:
                    continue
                try:
                    plan = self.engine.plan(op.host, op.device)
                    for layer in range(self.num_layers):
                        self.engine.load_layer(layer, plan)
                        op.layers_done = layer + 1
                except BaseException as e:
                    op.error = e
                self._ack(op, self.ack_load_queue)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _threaded_rate(kind: str, n_ops: int, concurrency: int, repeat: int) -> float:
    """Best ops/s of the threaded design: one op at a time (Event) or N in flight (ack queue)."""
    layout = _tiny_layout()
    slots = 4 * concurrency * PAGE_SIZE
    device, host = _pools(layout, slots)
    dalloc, halloc = PageAllocator(slots, PAGE_SIZE), PageAllocator(slots, PAGE_SIZE)
    tc = ThreadedController(device, host, dalloc, halloc)
    try:
        if kind == "write":
            sources = [dalloc.alloc(PAGE_SIZE) for _ in range(concurrency)]
        else:
            sources = [halloc.alloc(PAGE_SIZE) for _ in range(concurrency)]
        srcs = [s for s in sources if s is not None]
        submit = tc.write if kind == "write" else tc.load
        acks = tc.ack_write_queue if kind == "write" else tc.ack_load_queue
        free = halloc.free if kind == "write" else dalloc.free

        def result_slots(op: _ThreadedOp) -> torch.Tensor:
            return op.host if kind == "write" else op.device

        def one_at_a_time(n: int) -> None:
            ev = threading.Event()
            for _ in range(n):
                ev.clear()
                op = submit(srcs[0], ev)
                assert op is not None
                ev.wait()
                assert op.error is None, op.error
                free(result_slots(op))

        def in_flight(n: int) -> None:
            submitted = done = 0
            for s in srcs[: min(concurrency, n)]:
                submit(s)
                submitted += 1
            while done < n:
                op = acks.get()
                assert op.error is None, op.error
                free(result_slots(op))
                done += 1
                if submitted < n:
                    submit(op.device if kind == "write" else op.host)
                    submitted += 1

        run = one_at_a_time if concurrency == 1 else in_flight
        run(max(20, n_ops // 10))  # warm-up
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            run(n_ops)
            best = min(best, time.perf_counter() - t0)
        return n_ops / best
    finally:
        tc.close()


# -- the async controller -------------------------------------------------------


async def _async_rate(kind: str, n_ops: int, concurrency: int, repeat: int) -> float:
    """Best ops/s through `TierController`: ``concurrency`` tasks, each one op at a time."""
    layout = _tiny_layout()
    slots = 4 * concurrency * PAGE_SIZE
    device, host = _pools(layout, slots)
    async with TierController(device, host, track_acks=False) as c:
        dev_pages = [c.device_allocator.alloc(PAGE_SIZE) for _ in range(concurrency)]
        srcs: list[torch.Tensor] = []
        for d in dev_pages:
            assert d is not None
            if kind == "write":
                srcs.append(d)
            else:
                h = await c.backup(d)
                assert h is not None
                srcs.append(h)

        async def worker(src: torch.Tensor, n: int) -> None:
            if kind == "write":
                for _ in range(n):
                    h = await c.backup(src)
                    assert h is not None
                    c.evict_host(h)
            else:
                for _ in range(n):
                    d = await c.load_back(src)
                    assert d is not None
                    c.evict_device(d)

        async def run(n: int) -> None:
            per = n // concurrency
            await asyncio.gather(*(worker(s, per) for s in srcs))

        await run(max(20, n_ops // 10))  # warm-up
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            await run(n_ops)
            best = min(best, time.perf_counter() - t0)
        return (n_ops // concurrency * concurrency) / best


def _run_on(loop_name: str, coro_fn: Callable[[], Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(coro_fn())


# -- event-loop lag ---------------------------------------------------------------


async def _lag(total_bytes: int, rounds: int) -> dict[str, Any]:
    """Tick every 1 ms while ``total_bytes`` go device->host->device ``rounds`` times."""
    spec = KVLayout(16, 8, 128, torch.float16, 64)  # 64 KiB per token
    n = total_bytes // spec.token_bytes
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
        c.evict_host(h)
        c.evict_device(back)

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
            c.evict_host(h)
            c.evict_device(back)
        stop.set()
        await tick
    duration = sum(durations) / len(durations)
    p50, p99, mx = percentile(lags, 50), percentile(lags, 99), max(lags, default=0.0)
    return {
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


# -- main ---------------------------------------------------------------------------


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the controller benchmark; write ``controller.json`` and ``controller.png``; return it."""
    threads = set_threads()
    n_ops = 160 if smoke else 800 if quick else 4000
    repeat = 2 if smoke else 3
    lag_bytes = (32 if smoke else 128 if quick else 1024) * 2**20
    lag_rounds = 2 if smoke else 3
    t_start = time.perf_counter()

    rates: list[dict[str, Any]] = []
    for kind in ("write", "load"):
        for conc in (1, CONCURRENCY):
            threaded = _threaded_rate(kind, n_ops, conc, repeat)
            for loop_name in LOOPS:
                rate = _run_on(loop_name, functools.partial(_async_rate, kind, n_ops, conc, repeat))
                rates.append(
                    {
                        "op": kind,
                        "in_flight": conc,
                        "loop": loop_name,
                        "async_ops_per_s": rate,
                        "threaded_ops_per_s": threaded,
                        "ratio": rate / threaded,
                        "async_us_per_op": 1e6 / rate,
                        "threaded_us_per_op": 1e6 / threaded,
                    }
                )

    lag = {name: _run_on(name, functools.partial(_lag, lag_bytes, lag_rounds)) for name in LOOPS}

    heads = [
        headline(
            f"async/threaded ops/s, {r['op']}, {r['in_flight']} in flight, {r['loop']}",
            r["ratio"],
            TARGET_OPS_RATIO,
        )
        for r in rates
    ]
    heads += [
        headline(
            f"loop lag p99 / transfer time, {lag_bytes >> 20} MiB round trip, {name}",
            v["p99_fraction_of_transfer"],
            TARGET_LAG_FRACTION,
            higher_is_better=False,
        )
        for name, v in lag.items()
    ]
    columns = [
        "op",
        "in flight",
        "loop",
        "async ops/s",
        "threaded ops/s",
        "ratio",
        "async us/op",
        "threaded us/op",
    ]
    rows: list[list[object]] = [
        [
            r["op"],
            r["in_flight"],
            r["loop"],
            r["async_ops_per_s"],
            r["threaded_ops_per_s"],
            r["ratio"],
            r["async_us_per_op"],
            r["threaded_us_per_op"],
        ]
        for r in rates
    ]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": machine_info(),
        "torch_threads": threads,
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "layout": _tiny_layout().describe(),
        "ops_per_measurement": n_ops,
        "repeat": repeat,
        "statistic": "best of `repeat` timed batches after a warm-up batch",
        "threaded_design": "a thread per queue polling Queue.get(timeout); one copy per op; Event ack (1 in flight) or ack queue (N in flight)",
        "rates": rates,
        "lag": lag,
        "headline": heads,
        "table": {"columns": columns, "rows": rows},
        "lag_table": {
            "columns": [
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
                    name,
                    v["round_trip_s"] * 1e3,
                    v["ticks"],
                    v["lag_p50_ms"],
                    v["lag_p99_ms"],
                    v["lag_max_ms"],
                    v["idle_lag_p99_ms"],
                    v["p99_fraction_of_transfer"],
                ]
                for name, v in lag.items()
            ],
        },
        "elapsed_s": 0.0,
    }
    result["elapsed_s"] = time.perf_counter() - t_start
    write_result(NAME, result, out_dir)
    groups = [f"{r['op']} x{r['in_flight']}" for r in rates if r["loop"] == "asyncio"]
    series: dict[str, Sequence[float]] = {
        "threaded": [r["threaded_ops_per_s"] for r in rates if r["loop"] == "asyncio"],
        **{
            f"async ({name})": [r["async_ops_per_s"] for r in rates if r["loop"] == name]
            for name in LOOPS
        },
    }
    plot_bars(
        NAME,
        groups,
        series,
        title=f"one-page ops per second ({result['layout']})",
        ylabel="ops/s",
        out_dir=out_dir,
    )
    return result


if __name__ == "__main__":
    from benchmarks.common import print_table

    res = main()
    print_table(res["table"]["columns"], res["table"]["rows"])
    print_table(res["lag_table"]["columns"], res["lag_table"]["rows"])
