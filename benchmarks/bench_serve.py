"""``tiercache serve`` (one KV cache per node) against the file store, Redis and LMCache.

One run starts a ``tiercache serve`` process (``python -m tiercache serve``,
as an operator would), a ``redis-server`` on loopback and a file store, and
measures, all in the same run so that every number is a ratio against a
baseline taken beside it:

1. **Through SGLang's real HiCacheController.** Three SGLang controllers on
   CPU, each with its own host pool (MHA, 24 layers, 1 KV head of 128, fp16,
   64-token pages: 768 KiB per page, ``page_first``) and tiercache's HiCache
   storage backend (``interface_v1``, zero copy) on one of
   ``tiercache+unix://`` (the server), ``file://`` (the page cache hot: each
   prefetch reads files its backup just wrote) and ``redis://127.0.0.1``.
   Each round makes fresh pages (no write is skipped as a duplicate) and
   times ``write_storage`` of 128 pages until the backup thread's ack, then
   ``prefetch`` of the same tokens until the IO thread has filled host
   memory (hit query included). Rounds alternate the sides' order; each store
   is cleared between rounds, outside the timing. Targets: the server ≥ 2×
   the file store and ≥ 5× Redis, backup and prefetch.
2. **exists of 128 keys**: the median round trip of ``batch_exists`` of 128
   held keys from one client (target < 250 µs). Every client here runs on
   uvloop, as the loop of tiercache's engine adapters does.
3. **4 readers at once**: four client processes each read the same 128
   pages (96 MiB) out of the server into their own buffers, round after
   round, started together; the aggregate bytes/s is compared with one
   process's memcpy of the same 128 pages between two of its own buffers
   (target ≥ 0.5).
4. **Server CPU per GiB moved**: the server process's user + system CPU time
   (``/proc/PID/stat``) over phases 1 (the server side) and 3, divided by
   the GiB its clients moved in and out of the arena, against the time one
   memcpy of a GiB takes in this run (target < 5 %: the server hands out
   arena extents; the clients copy the bytes).
5. **LMCache 0.5.6, side by side**: the same 128 pages of 768 KiB stored
   and read back through LMCache's own server, by LMCache's own client
   (``benchmarks/lmcache_side.py``, run in the LMCache environment that
   ``make install-lmcache`` builds; its path is ``TIERCACHE_LMCACHE_PYTHON``),
   against tiercache's client and server moving the same pages (reported,
   no target). Skipped, with the reason, where that environment is missing.

Needs SGLang (``make bench-serve`` runs it in the newest SGLang environment)
and ``redis-server``; skipped with the reason elsewhere.

    python -m benchmarks.run --only serve [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchmarkSkipped,
    headline,
    machine_info,
    plot_bars,
    write_result,
)

_T = TypeVar("_T")

SIDES = ("serve", "file", "redis")
#: 768 KiB pages: 2 (K, V) x 24 layers x 64 tokens x 1 head x 128 x 2 bytes.
LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 24, 1, 128, 64
PAGE_BYTES = 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * 2
PAGES = 128
READERS = 4
#: Where the LMCache environment's Python is named (mk/lmcache.mk sets it).
LMCACHE_ENV = "TIERCACHE_LMCACHE_PYTHON"
LMCACHE_SIDE = _ROOT / "benchmarks" / "lmcache_side.py"
FORMAT = "bench-serve-768k"


# -- the server's CPU time ------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)


# -- one process's memcpy -------------------------------------------------------------------


def _memcpy_s(pages: int, repeat: int) -> float:
    """The median seconds of copying ``pages`` pages between two buffers of this process."""
    src = np.random.default_rng(0).integers(0, 256, (pages, PAGE_BYTES), dtype=np.uint8)
    dst = np.zeros_like(src)
    dst[:] = src  # touch every page of both
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(pages):
            np.copyto(dst[i], src[i])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- SGLang's controller --------------------------------------------------------------------


@contextmanager
def _sglang_process() -> Iterator[Any]:
    """SGLang's modules, a one-rank gloo group and the single-rank parallel state."""
    from tests.integrations.sglang import sglang_helpers as h

    mods, why = h.load()
    if mods is None:
        raise BenchmarkSkipped(why or "SGLang is not importable")
    import socket

    import pytest
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    patch = pytest.MonkeyPatch()
    try:
        with h.single_rank(patch):
            yield h
    finally:
        patch.undo()
        if own_group:
            dist.destroy_process_group()


def _round(h: Any, inst: Any, pages: int, rnd: random.Random) -> tuple[float, float]:
    """One backup and one prefetch of ``pages`` new pages; returns their seconds."""
    ps = inst.geometry.page_size
    tokens = [rnd.randrange(1 << 31) for _ in range(pages * ps)]
    hashes = h.chain(tokens, ps)
    idx = inst.host.alloc(len(tokens))
    t0 = time.perf_counter()
    done = h.backup(inst, idx, tokens, hashes)
    t1 = time.perf_counter()
    got = h.prefetch(inst, tokens)
    t2 = time.perf_counter()
    if done != len(tokens) or got.completed_tokens != len(tokens):
        raise RuntimeError(
            f"{inst.backend.stats().get('url', '?')}: backed up {done}, "
            f"prefetched {got.completed_tokens} of {len(tokens)} tokens"
        )
    # The pages read back are the pages written (checked outside the timing).
    for i in (0, pages - 1):
        a = h.pages_bytes(inst.host, got.host_indices[i * ps : (i + 1) * ps], ps)
        b = h.pages_bytes(inst.host, idx[i * ps : (i + 1) * ps], ps)
        if a != b:
            raise RuntimeError(f"prefetched page {i} differs from the page backed up")
    inst.host.free(idx)
    inst.host.free(got.host_indices)
    inst.backend.clear()
    os.sync()  # write-back of this round's files must not land in the next timing
    return t1 - t0, t2 - t1


def _sglang_rows(urls: dict[str, str], pages: int, rounds: int, server_pid: int) -> dict[str, Any]:
    """Backup and prefetch seconds per side through SGLang's controller, and the server's CPU."""
    import torch

    with _sglang_process() as h:
        g = h.Geometry(
            mla=False,
            layout="page_first",
            layers=LAYERS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            page_size=PAGE_TOKENS,
            device_tokens=16 * PAGE_TOKENS,
            dtype=torch.float16,
        )
        g.host_ratio = (2 * pages + 8) / 16  # the pages backed up and the pages prefetched
        rnd = random.Random(0)
        times: dict[str, dict[str, list[float]]] = {
            s: {"backup": [], "prefetch": []} for s in SIDES
        }
        cpu = 0.0
        insts = {
            s: h.make_instance(g, {**h.EXTRA, "interface_v1": 1, "url": urls[s]}) for s in SIDES
        }
        try:
            for inst in insts.values():
                h.fill_random(inst.host, 1)
                _round(h, inst, 8, rnd)  # warm-up: threads, connections, native hash
            for r in range(rounds):
                order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
                for side in order:
                    c0 = _cpu_s(server_pid)
                    b, p = _round(h, insts[side], pages, rnd)
                    if side == "serve":
                        cpu += _cpu_s(server_pid) - c0
                    times[side]["backup"].append(b)
                    times[side]["prefetch"].append(p)
        finally:
            for inst in insts.values():
                inst.close()
        return {
            "sglang_version": h.sg().version_str,
            "seconds": times,
            "server_cpu_s": cpu,
            "server_bytes": 2 * rounds * pages * PAGE_BYTES,
        }


# -- exists and readers, through tiercache's client -----------------------------------------


def _run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a client coroutine on uvloop (what the engine adapters' loop thread runs)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


def _keys(n: int, tag: str) -> list[Any]:
    from tiercache.storage import PageKey

    return [PageKey(f"bench-serve.{tag}.{i:06d}") for i in range(n)]


async def _fill(url: str, keys: list[Any], nbytes: int) -> None:
    from tiercache.storage import PageBuffer, open_backend

    rng = np.random.default_rng(1)
    pages = [
        PageBuffer.from_bytes(rng.integers(0, 256, nbytes, dtype=np.uint8), FORMAT) for _ in keys
    ]
    async with await open_backend(url) as backend:
        stored = await backend.batch_set(keys, pages)
    if not all(stored):
        raise RuntimeError(f"the server stored {sum(stored)} of {len(keys)} pages")


async def _exists_rtt(url: str, keys: list[Any], repeat: int) -> list[float]:
    """Seconds of each ``batch_exists(keys)`` round trip (all held)."""
    from tiercache.storage import open_backend

    async with await open_backend(url) as backend:
        for _ in range(20):  # warm-up
            await backend.batch_exists(keys)
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = await backend.batch_exists(keys)
            out.append(time.perf_counter() - t0)
            if n != len(keys):
                raise RuntimeError(f"exists found {n} of {len(keys)} held keys")
    return out


async def _read(req: dict[str, Any]) -> dict[str, Any]:
    """One reader process: ``rounds`` reads of every page once the parent says go.

    Prints ``ready`` once connected and warmed up, then waits for a line on stdin.
    """
    from tiercache.storage import PageBuffer, open_backend

    keys = _keys(int(req["pages"]), "read")
    bufs = [PageBuffer.allocate(PAGE_BYTES, FORMAT) for _ in keys]
    async with await open_backend(req["url"]) as backend:
        if not all(await backend.batch_get(keys, bufs)):  # warm-up: maps the arena
            raise RuntimeError("a reader missed a page the server holds")
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the start, for every reader at once
        t0 = time.monotonic()
        for _ in range(int(req["rounds"])):
            if not all(await backend.batch_get(keys, bufs)):
                raise RuntimeError("a reader missed a page the server holds")
        t1 = time.monotonic()
    return {"t0": t0, "t1": t1, "bytes": int(req["rounds"]) * len(keys) * PAGE_BYTES}


def _readers(url: str, pages: int, rounds: int, server_pid: int) -> dict[str, Any]:
    """Aggregate bytes/s of `READERS` processes reading at once, and the server's CPU.

    Every reader connects and warms up first; all are then started together,
    and the aggregate is their bytes over the span from the first start to the
    last end.
    """
    req = {"url": url, "pages": pages, "rounds": rounds}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_serve", "--reader"],
            cwd=_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(READERS)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"a reader process did not get ready: {line!r}")
    c0 = _cpu_s(server_pid)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    outs = []
    for p in procs:
        assert p.stdout is not None
        text = p.stdout.read()
        if p.wait() != 0:
            raise RuntimeError(f"a reader process failed: {text[-2000:]}")
        outs.append(json.loads(text.strip().splitlines()[-1]))
    cpu = _cpu_s(server_pid) - c0
    span = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
    total = sum(o["bytes"] for o in outs)
    return {
        "readers": READERS,
        "bytes": total,
        "span_s": span,
        "aggregate_bytes_per_s": total / span,
        "server_cpu_s": cpu,
        "per_reader_s": [o["t1"] - o["t0"] for o in outs],
    }


# -- LMCache ---------------------------------------------------------------------------------


def _lmcache(pages: int, rounds: int) -> dict[str, Any]:
    """LMCache's side (its own server and client), run in the LMCache environment."""
    py = os.environ.get(LMCACHE_ENV) or str(_ROOT / ".venv-lmcache-0.5.6" / "bin" / "python")
    if not Path(py).exists():
        return {"skipped": f"no LMCache environment at {py} (make install-lmcache)"}
    r = subprocess.run(
        [py, str(LMCACHE_SIDE), "--pages", str(pages), "--page-bytes", str(PAGE_BYTES)]
        + ["--rounds", str(rounds)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"skipped": f"LMCache's side failed (exit {r.returncode}): {r.stderr[-1500:]}"}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


async def _tiercache_put_get(url: str, pages: int, rounds: int) -> dict[str, list[float]]:
    """tiercache's client moving the pages LMCache's side moves: put then get, per round."""
    from tiercache.storage import PageBuffer, open_backend

    rng = np.random.default_rng(2)
    src = [
        PageBuffer.from_bytes(rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8), FORMAT)
        for _ in range(pages)
    ]
    dst = [PageBuffer.allocate(PAGE_BYTES, FORMAT) for _ in range(pages)]
    out: dict[str, list[float]] = {"put": [], "get": []}
    async with await open_backend(url) as backend:
        for r in range(rounds + 1):  # the first round warms up
            keys = _keys(pages, f"lm{r}")
            t0 = time.perf_counter()
            ok = await backend.batch_set(keys, src)
            t1 = time.perf_counter()
            got = await backend.batch_get(keys, dst)
            t2 = time.perf_counter()
            if not (all(ok) and all(got)) or dst[-1].tobytes() != src[-1].tobytes():
                raise RuntimeError("tiercache's client lost a page it stored")
            await backend.delete(keys)
            if r:
                out["put"].append(t1 - t0)
                out["get"].append(t2 - t1)
    return out


# -- the run ---------------------------------------------------------------------------------


def _measure(quick: bool) -> dict[str, Any]:
    from tests.integrations.node_server import NodeServer
    from tests.integrations.sglang import sglang_helpers as h
    from tests.redis_server import RedisServer, redis_server_binary

    mods, why = h.load()  # before anything starts
    if mods is None:
        raise BenchmarkSkipped(why or "SGLang is not importable")
    binary = redis_server_binary()
    if binary is None:
        raise BenchmarkSkipped("redis-server is not installed (apt-get install redis-server)")
    pages = 32 if quick else PAGES
    rounds = 2 if quick else 6
    arena = max(1 << 30, 4 * pages * PAGE_BYTES)
    with (
        tempfile.TemporaryDirectory(prefix="tiercache-bench-serve-") as tmp,
        NodeServer(arena_bytes=arena) as server,
        RedisServer(binary) as redis,
    ):
        urls = {"serve": server.url, "file": f"file://{Path(tmp) / 'store'}", "redis": redis.url}
        sg = _sglang_rows(urls, pages, rounds, server.pid)
        ex_keys = _keys(128, "exists")
        _run(_fill(server.url, ex_keys, 4096))
        rtt = _run(_exists_rtt(server.url, ex_keys, 200 if quick else 2000))
        _run(_fill(server.url, _keys(pages, "read"), PAGE_BYTES))
        readers = _readers(server.url, pages, 5 if quick else 20, server.pid)
        tc = _run(_tiercache_put_get(server.url, pages, rounds))
        server_log = server.output()
    memcpy = _memcpy_s(pages, 9)
    lm = _lmcache(pages, rounds)
    return {
        "pages": pages,
        "rounds": rounds,
        "arena_bytes": arena,
        "sglang": sg,
        "exists_rtt_s": rtt,
        "readers": readers,
        "memcpy_s": memcpy,
        "tiercache_put_get_s": tc,
        "lmcache": lm,
        "server_log_tail": server_log[-2000:],
    }


def _rates(m: dict[str, Any]) -> dict[str, dict[str, float]]:
    pages = m["pages"]
    secs = m["sglang"]["seconds"]
    return {
        s: {d: pages / statistics.median(secs[s][d]) for d in ("backup", "prefetch")} for s in SIDES
    }


def main(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the benchmark, write ``serve.json`` (and ``serve.png``) to ``out_dir``, return the result.

    Raises:
        BenchmarkSkipped: SGLang or ``redis-server`` is missing.
    """
    started = time.perf_counter()
    m = _measure(quick)
    rate = _rates(m)
    mib = PAGE_BYTES / (1 << 20)
    memcpy_bps = m["pages"] * PAGE_BYTES / m["memcpy_s"]
    gib = 1 << 30
    moved = m["sglang"]["server_bytes"] + m["readers"]["bytes"]
    cpu_per_gib = (m["sglang"]["server_cpu_s"] + m["readers"]["server_cpu_s"]) / (moved / gib)
    memcpy_gib_s = gib / memcpy_bps
    rtt_med = statistics.median(m["exists_rtt_s"])
    ratio = {
        f"{d}_vs_{s}": rate["serve"][d] / rate[s][d]
        for d in ("backup", "prefetch")
        for s in ("file", "redis")
    }
    readers_ratio = m["readers"]["aggregate_bytes_per_s"] / memcpy_bps
    tc = {k: m["pages"] / statistics.median(v) for k, v in m["tiercache_put_get_s"].items()}
    lm = m["lmcache"]
    heads = [
        headline(f"SGLang {d} pages/s, serve / {s}", ratio[f"{d}_vs_{s}"], t, unit="x")
        for d in ("backup", "prefetch")
        for s, t in (("file", 2.0), ("redis", 5.0))
    ]
    heads += [
        headline(
            "exists of 128 keys, median round trip",
            rtt_med * 1e6,
            250.0,
            higher_is_better=False,
            unit="us",
        ),
        headline(f"{READERS} readers aggregate / one memcpy", readers_ratio, 0.5, unit="x"),
        headline(
            "server CPU per GiB moved / memcpy of a GiB",
            cpu_per_gib / memcpy_gib_s,
            0.05,
            higher_is_better=False,
            unit="x",
        ),
    ]
    rows = [
        [
            f"SGLang {d}",
            rate["serve"][d],
            rate["file"][d],
            rate["redis"][d],
            ratio[f"{d}_vs_file"],
            ratio[f"{d}_vs_redis"],
        ]
        for d in ("backup", "prefetch")
    ]
    result: dict[str, Any] = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "quick": quick,
        "command": "make bench-serve" + (" (quick)" if quick else ""),
        "config": {
            "sglang_version": m["sglang"]["sglang_version"],
            "page_bytes": PAGE_BYTES,
            "pages_per_op": m["pages"],
            "rounds": m["rounds"],
            "arena_bytes": m["arena_bytes"],
            "geometry": f"MHA L{LAYERS} H{HEADS} D{HEAD_DIM} fp16, {PAGE_TOKENS}-token pages, page_first",
        },
        "pages_per_s": rate,
        "ratios": ratio,
        "exists_rtt_us": {
            "median": rtt_med * 1e6,
            "p90": statistics.quantiles(m["exists_rtt_s"], n=10)[8] * 1e6,
        },
        "readers": {**m["readers"], "memcpy_bytes_per_s": memcpy_bps, "ratio": readers_ratio},
        "server_cpu": {
            "bytes_moved": moved,
            "cpu_s": m["sglang"]["server_cpu_s"] + m["readers"]["server_cpu_s"],
            "cpu_s_per_gib": cpu_per_gib,
            "memcpy_s_per_gib": memcpy_gib_s,
            "clock_tick_s": 1 / os.sysconf("SC_CLK_TCK"),
        },
        "lmcache_side_by_side": {"tiercache_pages_per_s": tc, "lmcache": lm},
        "seconds": m["sglang"]["seconds"],
        "headline": heads,
        "table": {
            "columns": [
                "direction",
                "serve pages/s",
                "file pages/s",
                "redis pages/s",
                "vs file",
                "vs redis",
            ],
            "rows": rows,
        },
        "wall_s": round(time.perf_counter() - started, 2),
    }
    if "pages_per_s" in lm:
        result["lmcache_table"] = {
            "columns": [
                "direction",
                "tiercache serve pages/s",
                f"LMCache ({lm.get('server')}) pages/s",
                "ratio",
            ],
            "rows": [
                [d, tc[d], lm["pages_per_s"][d], tc[d] / lm["pages_per_s"][d]]
                for d in ("put", "get")
            ],
        }
    write_result("serve", result, out_dir)
    plot = plot_bars(
        "serve",
        ["backup", "prefetch"],
        {f"{s}": [rate[s]["backup"], rate[s]["prefetch"]] for s in SIDES},
        title=f"SGLang HiCacheController storage, {mib:.2f} MiB pages, {m['pages']} per op",
        ylabel="pages/s",
        out_dir=out_dir,
    )
    result["plot"] = str(plot) if plot else None
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer pages and rounds")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:  # one of the reader processes: a JSON request on stdin
        print(json.dumps(_run(_read(json.loads(sys.stdin.readline())))))
        sys.exit(0)
    print(json.dumps(main(quick=args.quick, out_dir=args.out_dir), indent=2, default=str))
