"""tiercache's vLLM tier against vLLM's own ``fs`` tier, through vLLM's real manager.

Both tiers are built by vLLM 0.33's ``TieringOffloadingSpec`` (so through its
``SecondaryTierFactory``) and driven by its ``TieringOffloadingManager`` exactly
as the offloading connector drives them, with the same jobs:

- **store**: ``N`` blocks already in vLLM's primary CPU region are cascaded to
  the tier in jobs of ``job_blocks`` blocks (``complete_store``), and the
  scheduler steps until every job has reported back. Blocks/s.
- **load**: a second instance (fresh CPU tier, same storage directory) looks the
  ``N`` blocks up once per scheduler step until all are ``HIT``: the existence
  queries, the promotion jobs and their completions. Blocks/s. Every loaded
  block is then compared (CRC-32) with what was stored.

tiercache's tier runs the ``file`` backend, whose pages carry a CRC-32 that is
verified on every read (checksums are always on); vLLM's ``fs`` tier stores raw
bytes with no check, with O_DIRECT where the filesystem allows it (reported).
Each tier uses its shipped defaults (16 IO threads each). The two are
measured in interleaved rounds (order alternating), each round in fresh
directories under ``--dir``; the result is the median blocks/s of each and the
ratio tiercache / fs (target: at least 1.0 for both directions).

Needs vLLM (``make bench-vllm`` builds the environment). Written to
``benchmarks/results/vllm.json``.

    python benchmarks/bench_vllm.py [--quick] [--blocks N] [--block-kib K] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RESULTS_DIR,
    BenchmarkSkipped,
    headline,
    machine_info,
    print_table,
    write_result,
)

#: ``vllm-fs`` is vLLM's fs tier as shipped (O_DIRECT where the filesystem
#: allows it); ``vllm-fs-buffered`` the same tier through the page cache, as
#: tiercache's file backend runs: the like-for-like baseline.
TIERS = ("tiercache", "vllm-fs", "vllm-fs-buffered")


def _import_vllm() -> dict[str, Any]:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import numpy as np
        from vllm.v1.kv_offload import base, config
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError as e:
        raise BenchmarkSkipped(f"vllm is not importable ({e}); run `make bench-vllm`") from None
    return {
        "np": np,
        "base": base,
        "config": config,
        "spec": TieringOffloadingSpec,
        "io": fs_io,
        "fs_manager": fs_manager,
    }


class _Buffered:
    """Within it, vLLM's fs tier finds O_DIRECT unsupported and uses the page cache."""

    def __init__(self, v: dict[str, Any], on: bool) -> None:
        self.module, self.on = v["fs_manager"], on
        self.saved = self.module.probe_o_direct

    def __enter__(self) -> None:
        if self.on:
            self.module.probe_o_direct = lambda directory: False

    def __exit__(self, *exc: object) -> None:
        self.module.probe_o_direct = self.saved


def _tier(kind: str, root: Path) -> dict[str, Any]:
    if kind == "tiercache":
        return {
            "type": "TierCacheTier",
            "module_path": "tiercache.integrations.vllm",
            "url": f"file://{root}",
        }
    return {"type": "fs", "root_dir": str(root)}


class _Instance:
    """One vLLM instance's scheduler-side manager with one secondary tier."""

    def __init__(self, v: dict[str, Any], tier: dict[str, Any], blocks: int, nbytes: int) -> None:
        c = v["config"]
        cfg = c.OffloadingConfig(
            groups=(
                c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),
            ),
            worker_kv_bytes_per_block=nbytes,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": blocks * nbytes, "secondary_tiers": [tier]},
            engine_id=f"tcbench-{uuid.uuid4().hex[:12]}",
            model=c.OffloadingModelConfig(name="bench/model", dtype="float16"),
            cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=c.OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=False,
            ),
        )
        self.v = v
        self.manager = v["spec"](cfg).get_manager()
        self.nbytes = nbytes

    def rows(self) -> Any:
        view = self.manager.primary_tier.get_kv_memoryview()
        return self.v["np"].frombuffer(view, dtype=self.v["np"].uint8).reshape(view.shape[0], -1)

    def step(self) -> None:
        ctx = self.v["base"].ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        self.manager.on_schedule_end(ctx)

    def close(self) -> None:
        self.manager.shutdown()


def _round(
    v: dict[str, Any], kind: str, base_dir: Path, data: list[bytes], job_blocks: int
) -> tuple[float, float]:
    """One store and one load of ``data`` through ``kind``; returns blocks/s of each."""
    np, b = v["np"], v["base"]
    n, nbytes = len(data), len(data[0])
    root = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=base_dir))
    keys = [b.make_offload_key(os.urandom(32), 0) for _ in range(n)]
    jobs = [keys[i : i + job_blocks] for i in range(0, n, job_blocks)]
    try:
        with _Buffered(v, kind == "vllm-fs-buffered"):
            a = _Instance(v, _tier(kind, root), n, nbytes)
        try:
            ctx = b.ReqContext(req_id="store")
            a.manager.on_new_request(ctx)
            rows = a.rows()
            for job in jobs:
                out = a.manager.prepare_store(job, ctx)
                for key, chunk in zip(job, out.store_spec.chunk_ids, strict=True):
                    rows[int(chunk), :nbytes] = np.frombuffer(data[keys.index(key)], np.uint8)
            del rows
            t0 = time.perf_counter()
            for job in jobs:
                a.manager.complete_store(job, ctx, True)
            while True:
                a.step()
                if not a.manager.has_pending_work():
                    break
                time.sleep(0.0002)
            store_s = time.perf_counter() - t0
            a.manager.on_request_finished(ctx)
            a.step()
        finally:
            a.close()

        with _Buffered(v, kind == "vllm-fs-buffered"):
            bi = _Instance(v, _tier(kind, root), n, nbytes)
        try:
            ctx = b.ReqContext(req_id="load")
            bi.manager.on_new_request(ctx)
            t0 = time.perf_counter()
            while True:
                answers = [bi.manager.lookup(k, ctx) for k in keys]
                if all(r is b.LookupResult.HIT for r in answers):
                    break
                if b.LookupResult.MISS in answers:
                    raise RuntimeError(f"{kind}: a stored block was a miss")
                bi.step()
                time.sleep(0.0002)
            load_s = time.perf_counter() - t0
            spec = bi.manager.prepare_load(keys, ctx)
            rows = bi.rows()
            for i, chunk in enumerate(spec.chunk_ids):
                if zlib.crc32(rows[int(chunk), :nbytes]) != zlib.crc32(data[i]):
                    raise RuntimeError(f"{kind}: block {i} came back different")
            del rows
            bi.manager.complete_load(keys, ctx)
            bi.manager.on_request_finished(ctx)
            bi.step()
        finally:
            bi.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return n / store_s, n / load_s


def main(
    quick: bool = False,
    out_dir: Path = RESULTS_DIR,
    smoke: bool = False,
    *,
    blocks: int | None = None,
    block_kib: int | None = None,
    rounds: int | None = None,
    job_blocks: int = 16,
    base_dir: str | None = None,
) -> dict[str, Any]:
    v = _import_vllm()
    if smoke:
        blocks, block_kib, rounds = blocks or 16, block_kib or 64, rounds or 1
    elif quick:
        blocks, block_kib, rounds = blocks or 128, block_kib or 256, rounds or 3
    else:
        blocks, block_kib, rounds = blocks or 512, block_kib or 256, rounds or 7
    nbytes = block_kib * 1024
    rng = v["np"].random.default_rng(0)
    data = [rng.integers(0, 256, nbytes, dtype=v["np"].uint8).tobytes() for _ in range(blocks)]
    base = Path(tempfile.mkdtemp(prefix="tcbench-vllm-", dir=base_dir))
    o_direct = bool(v["io"].probe_o_direct(str(base)))
    samples: dict[str, dict[str, list[float]]] = {k: {"store": [], "load": []} for k in TIERS}
    try:
        for kind in TIERS:  # warm-up
            _round(v, kind, base, data[: min(16, blocks)], job_blocks)
        for r in range(rounds):
            for kind in TIERS if r % 2 == 0 else TIERS[::-1]:
                store, load = _round(v, kind, base, data, job_blocks)
                samples[kind]["store"].append(store)
                samples[kind]["load"].append(load)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: {d: statistics.median(samples[k][d]) for d in ("store", "load")} for k in TIERS}
    ratio = {d: med["tiercache"][d] / med["vllm-fs"][d] for d in ("store", "load")}
    ratio_buffered = {
        d: med["tiercache"][d] / med["vllm-fs-buffered"][d] for d in ("store", "load")
    }
    rows = [
        [
            d,
            round(med["tiercache"][d]),
            round(med["vllm-fs"][d]),
            round(med["vllm-fs-buffered"][d]),
            round(ratio[d], 2),
            round(ratio_buffered[d], 2),
            round(med["tiercache"][d] * nbytes / 2**20),
        ]
        for d in ("store", "load")
    ]
    result: dict[str, Any] = {
        "benchmark": "vllm",
        "machine": machine_info(),
        "vllm": _vllm_version(),
        "blocks": blocks,
        "block_bytes": nbytes,
        "job_blocks": job_blocks,
        "rounds": rounds,
        "fs_o_direct": o_direct,
        "samples_blocks_per_s": samples,
        "median_blocks_per_s": med,
        "ratio": ratio,
        "ratio_buffered": ratio_buffered,
        "table": {
            "columns": [
                "direction",
                "tiercache blk/s",
                "fs blk/s",
                "fs buffered blk/s",
                "ratio vs fs",
                "ratio vs fs buffered",
                "tiercache MiB/s",
            ],
            "rows": rows,
        },
        "headline": [
            headline("vllm tier store vs vllm fs", ratio["store"], 1.0, unit="x"),
            headline("vllm tier load vs vllm fs", ratio["load"], 1.0, unit="x"),
            headline("vllm tier store vs vllm fs buffered", ratio_buffered["store"], 1.0, unit="x"),
            headline("vllm tier load vs vllm fs buffered", ratio_buffered["load"], 1.0, unit="x"),
        ],
    }
    write_result("vllm", result, out_dir)
    return result


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--blocks", type=int)
    parser.add_argument("--block-kib", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--dir", help="where the stores live (default: the temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    res = main(
        args.quick,
        args.out,
        blocks=args.blocks,
        block_kib=args.block_kib,
        rounds=args.rounds,
        job_blocks=args.job_blocks,
        base_dir=args.dir,
    )
    print(
        f"{res['blocks']} blocks of {res['block_bytes'] // 1024} KiB, jobs of "
        f"{res['job_blocks']}, {res['rounds']} rounds, fs O_DIRECT={res['fs_o_direct']}"
    )
    print_table(res["table"]["columns"], res["table"]["rows"])
