"""RedisBackend throughput as a ratio to raw redis-py SET/GET of the same bytes.

Starts its own ``redis-server`` on loopback (no persistence) and moves 64-token
pages of one tensor-parallel shard of a Llama-3-8B-like model: 32 layers, one
KV head of 128 dims per rank (TP=8), fp16, K and V -> 64 x 2 x 32 x 128 x 2 B
= 1 MiB a page, held as two segments (K, V) as a ``page_first`` host pool
hands them out. Quick mode uses 8 layers (256 KiB pages) and fewer batches.

For each direction it times, in the same run and with the same client class,
batch size and pipelining (one non-transactional pipeline per batch):

- ``backend``: ``RedisBackend.batch_set`` / ``batch_get`` (header + CRC-32,
  one join per page on write; verify + copy into the page buffers on read);
- ``raw``: ``SET key value NX`` / ``GET`` of ready-made ``bytes`` values of
  the same size (no header, no checksum, no copy into a page).

The result is ``backend / raw`` throughput per direction (1.0 = no overhead),
best of ``repeats`` interleaved runs.

The cluster rows do the same against a Redis Cluster of 3 masters on loopback
(made with ``redis-cli --cluster create``; no replicas, so the numbers measure
the client side and not replication): ``RedisBackend`` on a
``redis+cluster://`` URL, which splits each batch by owning master into one
pipeline per master sent at once, against redis-py's own ``RedisCluster``
pipeline of the same ``SET NX`` / ``GET`` commands. Batches are 3x larger so
every master gets pages of each batch. Skipped (with a note) where
``redis-cli`` is missing. Written to ``benchmarks/results/redis.json``
(and ``redis.png`` when matplotlib imports).

    python benchmarks/bench_redis.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.redis_server import (  # noqa: E402
    LocalRedisCluster,
    RedisServer,
    redis_server_binary,
)

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchmarkSkipped,
    headline,
    machine_info,
    plot_bars,
    write_result,
)
from tiercache.storage import PageBuffer, PageKey  # noqa: E402
from tiercache.storage.redis import OFFLOAD_BYTES, RedisBackend  # noqa: E402

MiB = 1 << 20


def _page_bytes(
    layers: int, tokens: int = 64, heads: int = 1, head_dim: int = 128, itemsize: int = 2
) -> int:
    return 2 * layers * tokens * heads * head_dim * itemsize


def _versions() -> dict[str, Any]:
    binary = redis_server_binary() or ""
    try:
        server = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        server = "unknown"
    return {
        "platform": platform.platform(),
        "redis_py": redis.__version__,
        "redis_server": server,
    }


async def _run(
    server: RedisServer | LocalRedisCluster,
    *,
    page_bytes: int,
    batch: int,
    batches: int,
    repeats: int,
) -> dict[str, Any]:
    half = page_bytes // 2
    fmt = f"bench:mha:P64:{page_bytes}B:page_first"
    pages = [
        PageBuffer.from_segments(
            [
                memoryview(bytearray(os.urandom(half))),
                memoryview(bytearray(os.urandom(page_bytes - half))),
            ],
            fmt,
        )
        for _ in range(batch)
    ]
    targets = [PageBuffer.allocate(page_bytes, fmt) for _ in range(batch)]
    values = [p.tobytes() for p in pages]
    total = page_bytes * batch * batches

    backend = await RedisBackend.from_url(
        server.url, prefix="bench:tc:", timeout=30, max_connections=4
    )
    raw: Any
    if isinstance(server, LocalRedisCluster):
        raw = RedisCluster.from_url(server.url.replace("redis+cluster", "redis"), socket_timeout=30)

        async def flush() -> None:
            await raw.flushdb(target_nodes=RedisCluster.PRIMARIES)
    else:
        raw = aioredis.Redis.from_url(server.url, socket_timeout=30)

        async def flush() -> None:
            await raw.flushdb()

    best: dict[str, float] = {}

    def keys(run: str, b: int) -> list[str]:
        return [f"{run}-{b:05d}-{i:03d}" for i in range(batch)]

    async def timed(name: str, coro_factory: Any) -> None:
        t0 = time.perf_counter()
        for b in range(batches):
            await coro_factory(b)
        rate = total / (time.perf_counter() - t0)
        best[name] = max(best.get(name, 0.0), rate)

    async def raw_set(b: int) -> None:
        async with raw.pipeline(transaction=False) as pipe:
            for k, v in zip(keys("raw", b), values, strict=True):
                pipe.set("bench:raw:" + k, v, nx=True)
            await pipe.execute()

    async def raw_get(b: int) -> None:
        async with raw.pipeline(transaction=False) as pipe:
            for k in keys("raw", b):
                pipe.get("bench:raw:" + k)
            out = await pipe.execute()
        assert all(len(v) == page_bytes for v in out)

    async def tc_set(b: int) -> None:
        ok = await backend.batch_set([PageKey(k) for k in keys("tc", b)], pages)
        assert all(ok)

    async def tc_get(b: int) -> None:
        ok = await backend.batch_get([PageKey(k) for k in keys("tc", b)], targets)
        assert all(ok)

    try:
        await raw.ping()
        for _ in range(repeats):
            await flush()  # the benchmark's own server
            await timed("raw_write", raw_set)
            await timed("backend_write", tc_set)
            await timed("raw_read", raw_get)
            await timed("backend_read", tc_get)
        assert targets[-1].tobytes() == pages[-1].tobytes()
        await flush()
    finally:
        await backend.aclose()
        await raw.aclose()
    return {
        "throughput_MiB_s": {k: round(v / MiB, 1) for k, v in best.items()},
        "write_ratio": round(best["backend_write"] / best["raw_write"], 3),
        "read_ratio": round(best["backend_read"] / best["raw_read"], 3),
    }


def main(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the benchmark, write ``redis.json`` (and ``redis.png``) to ``out_dir``, return the result.

    Raises:
        BenchmarkSkipped: ``redis-server`` is not installed.
    """
    binary = redis_server_binary()
    if binary is None:
        raise BenchmarkSkipped("redis-server is not installed (apt-get install redis-server)")
    if quick:
        config = {"page_bytes": _page_bytes(layers=8), "batch": 8, "batches": 32, "repeats": 5}
    else:
        config = {"page_bytes": _page_bytes(layers=32), "batch": 8, "batches": 16, "repeats": 5}
    started = time.perf_counter()
    with RedisServer(binary) as server:
        measured = asyncio.run(_run(server, **config))
    tp = measured["throughput_MiB_s"]
    cli = shutil.which("redis-cli")
    cluster_config = {**config, "batch": 3 * config["batch"], "batches": config["batches"] // 2}
    cluster: dict[str, Any] | None = None
    if cli is not None:
        with LocalRedisCluster(binary, cli, masters=3, replicas=0) as nodes:
            cluster = asyncio.run(_run(nodes, **cluster_config))
    result: dict[str, Any] = {
        "benchmark": "redis",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {**machine_info(), **_versions()},
        "quick": quick,
        "config": {
            **config,
            "tokens_per_page": 64,
            "layout": "Llama-3-8B TP=8 shard: L32 (quick: L8) x 1 KV head x 128 dims, fp16, K+V, page_first",
            "offload_bytes": OFFLOAD_BYTES,
        },
        **measured,
        "headline": [
            headline("redis write throughput / raw SET", measured["write_ratio"], 0.5, unit="x"),
            headline("redis read throughput / raw GET", measured["read_ratio"], 0.5, unit="x"),
        ],
        "table": {
            "columns": ["direction", "raw MiB/s", "RedisBackend MiB/s", "ratio"],
            "rows": [
                ["write", tp["raw_write"], tp["backend_write"], measured["write_ratio"]],
                ["read", tp["raw_read"], tp["backend_read"], measured["read_ratio"]],
            ],
        },
    }
    if cluster is not None:
        ctp = cluster["throughput_MiB_s"]
        result["cluster"] = {
            "config": {**cluster_config, "masters": 3, "replicas": 0},
            **cluster,
        }
        result["headline"] += [
            headline(
                "redis cluster write throughput / raw cluster pipeline",
                cluster["write_ratio"],
                0.5,
                unit="x",
            ),
            headline(
                "redis cluster read throughput / raw cluster pipeline",
                cluster["read_ratio"],
                0.5,
                unit="x",
            ),
        ]
        result["table"]["rows"] += [
            ["cluster write", ctp["raw_write"], ctp["backend_write"], cluster["write_ratio"]],
            ["cluster read", ctp["raw_read"], ctp["backend_read"], cluster["read_ratio"]],
        ]
    else:
        result["cluster"] = {"skipped": "redis-cli is not installed (apt-get install redis-tools)"}
    result["wall_s"] = round(time.perf_counter() - started, 2)
    write_result("redis", result, out_dir)
    plot = plot_bars(
        "redis",
        ["write", "read"],
        {
            "raw redis-py SET/GET": [tp["raw_write"], tp["raw_read"]],
            "RedisBackend": [tp["backend_write"], tp["backend_read"]],
        },
        title=f"Redis tier, {config['page_bytes'] // 1024} KiB pages, {config['batch']} per batch",
        ylabel="MiB/s",
        out_dir=out_dir,
    )
    result["plot"] = str(plot) if plot else None
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small pages and few batches (< 15 s)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    print(json.dumps(main(quick=args.quick, out_dir=args.out_dir), indent=2))
