"""FileBackend throughput against one large sequential file, and page-key hashing speed.

Pages are 64-token pages of a 16-layer model with 8 KV heads of 64 dims in
fp16: 64 x 2 (K, V) x 16 x 8 x 64 x 2 B = 2 MiB a page, held in a real
``page_first`` `HostKVPool` (two segments a page, written and read in place).
The full run moves 1 GiB (512 pages), ``--quick`` 64 MiB (32 pages).

In the same run and the same directory it times:

- ``sequential``: the same bytes written as one file (``write`` of the pool's
  whole buffer) and read back with ``readinto`` into a preallocated buffer;
- ``file backend``: ``batch_set`` of every page (batches of 32 pages, header
  + CRC-32 + temporary file + link per page), then ``batch_get`` of every page
  into a second pool (CRC check, one copy per page), at ``max_concurrency``
  1, 4 and 16.

Reads come from the page cache in both cases (the files were just written and
the machine has the memory): this measures the backend's overhead, not the
disk. Neither side fsyncs. Ratios are ``sequential seconds / backend seconds``
(1.0 = as fast as one big file), best of ``repeats`` interleaved runs.

Hashing: `page_hashes` over random token ids, 64-token pages, against the
per-token formulation (one ``sha256.update`` of 4 bytes per token).

Results: ``benchmarks/results/storage.json`` and ``storage.png``.

    python benchmarks/bench_storage.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    headline,
    machine_info,
    plot_bars,
    print_table,
    write_result,
)
from tiercache.index import StorageNamespace, page_hashes  # noqa: E402
from tiercache.memory import HostKVPool, KVLayout  # noqa: E402
from tiercache.storage.file import FileBackend  # noqa: E402

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.float16, page_size=64)
CONCURRENCY = (1, 4, 16)
BATCH_PAGES = 32
TARGETS = {"write": 0.7, "read": 0.8, "hash": 5.0}


def _fill(pool: HostKVPool, seed: int) -> None:
    """Random-looking bytes without generating a gigabyte of randomness: tile 8 MiB."""
    flat = pool.buffer.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(flat.numel(), 8 << 20),), dtype=torch.uint8, generator=g)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start : start + n] = block[:n]


def _sequential_write(path: Path, data: memoryview) -> None:
    with open(path, "wb", buffering=0) as f:
        view = data
        while view:
            view = view[f.write(view) :]


def _sequential_read(path: Path, into: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        n = 0
        while n < into.nbytes:
            got = f.readinto(into[n:])
            if not got:
                raise RuntimeError("short read")
            n += got


async def _storage(quick: bool, repeats: int, workdir: Path) -> dict[str, Any]:
    pages = 32 if quick else 512
    src = HostKVPool(LAYOUT, pages * LAYOUT.page_size, host_layout="page_first", pin_memory=False)
    dst = HostKVPool(LAYOUT, pages * LAYOUT.page_size, host_layout="page_first", pin_memory=False)
    _fill(src, 1)
    idx = torch.arange(pages * LAYOUT.page_size, dtype=torch.int64)
    src_pages, dst_pages = src.page_buffers(idx), dst.page_buffers(idx)
    ns = StorageNamespace.for_layout(LAYOUT, "page_first", model="bench")
    keys = ns.keys(page_hashes(list(range(pages * LAYOUT.page_size)), LAYOUT.page_size))
    total = pages * LAYOUT.page_bytes
    src_bytes = memoryview(src.buffer.view(-1).view(torch.uint8).numpy())
    dst_bytes = memoryview(dst.buffer.view(-1).view(torch.uint8).numpy())
    loop = asyncio.get_running_loop()

    best: dict[str, float] = {}

    def record(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    seq_path = workdir / "sequential.bin"
    for _ in range(repeats):
        # Baseline: one big file, written then read back, in the same directory.
        t0 = time.perf_counter()
        await loop.run_in_executor(None, _sequential_write, seq_path, src_bytes)
        record("seq_write", time.perf_counter() - t0)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, _sequential_read, seq_path, dst_bytes)
        record("seq_read", time.perf_counter() - t0)
        await loop.run_in_executor(None, os.unlink, seq_path)
        for c in CONCURRENCY:
            root = workdir / f"store-c{c}"
            async with await FileBackend.open(root, max_concurrency=c) as backend:
                t0 = time.perf_counter()
                for i in range(0, pages, BATCH_PAGES):
                    ok = await backend.batch_set(
                        keys[i : i + BATCH_PAGES], src_pages[i : i + BATCH_PAGES]
                    )
                    assert all(ok)
                record(f"write_c{c}", time.perf_counter() - t0)
                dst.buffer.zero_()
                t0 = time.perf_counter()
                for i in range(0, pages, BATCH_PAGES):
                    ok = await backend.batch_get(
                        keys[i : i + BATCH_PAGES], dst_pages[i : i + BATCH_PAGES]
                    )
                    assert all(ok)
                record(f"read_c{c}", time.perf_counter() - t0)
                assert torch.equal(src.buffer.view(torch.int16), dst.buffer.view(torch.int16))
                await backend.clear()
    gib = total / 2**30
    rows = []
    for c in CONCURRENCY:
        rows.append(
            {
                "concurrency": c,
                "write_gib_s": gib / best[f"write_c{c}"],
                "read_gib_s": gib / best[f"read_c{c}"],
                "write_ratio": best["seq_write"] / best[f"write_c{c}"],
                "read_ratio": best["seq_read"] / best[f"read_c{c}"],
            }
        )
    return {
        "pages": pages,
        "page_bytes": LAYOUT.page_bytes,
        "total_bytes": total,
        "batch_pages": BATCH_PAGES,
        "sequential": {
            "write_gib_s": gib / best["seq_write"],
            "read_gib_s": gib / best["seq_read"],
        },
        "file_backend": rows,
        "seconds": best,
    }


def _per_token(tokens: list[int], page_size: int) -> list[str]:
    out: list[str] = []
    prior: str | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start : start + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def _hashing(quick: bool, repeats: int) -> dict[str, Any]:
    n = (1 << 16) if quick else (1 << 19)
    rng = random.Random(0)
    tokens = [rng.randrange(0, 128_000) for _ in range(n)]
    fast = slow = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = page_hashes(tokens, LAYOUT.page_size)
        fast = min(fast, time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = _per_token(tokens, LAYOUT.page_size)
        slow = min(slow, time.perf_counter() - t0)
        assert a == b
    return {
        "tokens": n,
        "page_size": LAYOUT.page_size,
        "page_hashes_mtok_s": n / fast / 1e6,
        "per_token_mtok_s": n / slow / 1e6,
        "ratio": slow / fast,
    }


def main(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the storage benchmark; write ``<out_dir>/storage.json`` (and ``.png``); return the result."""
    repeats = 2 if quick else 3
    workdir = Path(tempfile.mkdtemp(prefix="tiercache-bench-storage-"))
    try:
        storage = asyncio.run(_storage(quick, repeats, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    hashing = _hashing(quick, repeats)
    rows = storage["file_backend"]
    best_write = max(r["write_ratio"] for r in rows)
    best_read = max(r["read_ratio"] for r in rows)
    table_rows: list[list[object]] = [
        [
            "sequential file",
            "-",
            storage["sequential"]["write_gib_s"],
            storage["sequential"]["read_gib_s"],
            1.0,
            1.0,
        ]
    ]
    table_rows += [
        [
            "file backend",
            r["concurrency"],
            r["write_gib_s"],
            r["read_gib_s"],
            r["write_ratio"],
            r["read_ratio"],
        ]
        for r in rows
    ]
    table = {
        "columns": [
            "what",
            "concurrency",
            "write GiB/s",
            "read GiB/s",
            "write ratio",
            "read ratio",
        ],
        "rows": table_rows,
    }
    result: dict[str, Any] = {
        "benchmark": "storage",
        "quick": quick,
        "machine": machine_info(),
        "layout": LAYOUT.describe() + ":page_first",
        "notes": (
            "2 MiB pages (64 tokens x 16 layers x 8 heads x 64 dims fp16, K and V) from a page_first "
            "HostKVPool; no fsync on either side; reads served from the page cache; ratio = sequential "
            "one-file seconds / backend seconds, best of interleaved repeats; hash ratio = per-token "
            "sha256 updates seconds / page_hashes seconds."
        ),
        "storage": storage,
        "hashing": hashing,
        "targets": {
            "write_ratio": TARGETS["write"],
            "read_ratio": TARGETS["read"],
            "hash_ratio": TARGETS["hash"],
        },
        "headline": [
            headline(
                "file write / sequential write (best concurrency)",
                best_write,
                TARGETS["write"],
                unit="x",
            ),
            headline(
                "file read / sequential read (best concurrency)",
                best_read,
                TARGETS["read"],
                unit="x",
            ),
            headline(
                "page_hashes / per-token hashing", hashing["ratio"], TARGETS["hash"], unit="x"
            ),
        ],
        "table": table,
    }
    write_result("storage", result, out_dir)
    print_table(table["columns"], table["rows"])
    print(
        f"page_hashes: {hashing['page_hashes_mtok_s']:.1f} Mtok/s, per-token: {hashing['per_token_mtok_s']:.2f} "
        f"Mtok/s, ratio {hashing['ratio']:.1f}x (target >= {TARGETS['hash']:g})"
    )
    for h in result["headline"]:
        print(
            f"{h['name']}: {h['value']:.2f} (target {h['op']} {h['target']:g}) {'ok' if h['passed'] else 'MISSED'}"
        )
    plot_bars(
        "storage",
        [f"c={r['concurrency']}" for r in rows],
        {
            "write ratio": [r["write_ratio"] for r in rows],
            "read ratio": [r["read_ratio"] for r in rows],
        },
        title=f"FileBackend vs one sequential file ({storage['total_bytes'] >> 20} MiB of 2 MiB pages)",
        ylabel="backend throughput / sequential throughput",
        out_dir=out_dir,
        hline=1.0,
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB instead of 1 GiB, fewer repeats"
    )
    args = parser.parse_args()
    main(quick=args.quick)
