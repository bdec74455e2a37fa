"""tiercache's SGLang backend against SGLang's own HiCacheFile, both driven by SGLang's controller.

Two SGLang ``HiCacheController`` instances on CPU, each with its own host pool
(the same geometry) and one storage backend on local disk:

- ``hicache_file``: SGLang's built-in ``--hicache-storage-backend file``
  (one raw file per page, no checksum; the controller's generic path copies
  each page out of and back into the host pool);
- ``tiercache``: ``--hicache-storage-backend dynamic`` with
  ``tiercache.integrations.sglang.TierCacheStorage`` over ``file://`` and
  ``interface_v1`` (zero copy: pages are read and written as views of the host
  pool; every page carries a header and CRC-32, checked on every read).

Each round, for each backend in turn (the order alternates), new pages are
made (fresh tokens, so no write is skipped as a duplicate) and timed through
the controller's own threads, the way SGLang's scheduler uses them:

- backup: ``write_storage`` of ``pages`` pages, until the backup thread's ack;
- prefetch: ``prefetch`` of the same tokens, until the IO thread has put every
  page into host memory (hit query included).

Both read files their backup just wrote (in the page cache). The store is
cleared and ``sync`` runs between rounds, outside the timed region. Reported: the median
pages/s of each side over the rounds and the ratio tiercache / HiCacheFile
(target >= 1.0 on both). Needs SGLang (``make bench-sglang`` runs it in the
SGLang environment); skipped with the reason elsewhere.

    python benchmarks/bench_sglang.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

SIDES = ("hicache_file", "tiercache")


@contextmanager
def _sglang_process() -> Iterator[Any]:
    """SGLang's modules, a one-rank gloo group and the single-rank parallel state."""
    from tests.integrations.sglang import sglang_helpers as h

    mods, why = h.load()
    if mods is None:
        raise BenchmarkSkipped(why or "SGLang is not importable")
    import socket

    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    class _Patch:
        def __init__(self) -> None:
            self.saved: list[tuple[Any, str, Any]] = []

        def setattr(self, obj: Any, name: str, value: Any) -> None:
            self.saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    patch = _Patch()
    try:
        with h.single_rank(patch):
            yield h
    finally:
        for obj, name, value in reversed(patch.saved):
            setattr(obj, name, value)
        if own_group:
            dist.destroy_process_group()


def _instance(h: Any, g: Any, side: str, root: Path) -> Any:
    if side == "hicache_file":
        return h.make_instance(g, {"file_storage_path": str(root / side)}, storage="file")
    cfg = {**h.EXTRA, "interface_v1": 1, "url": f"file://{root / side}"}
    return h.make_instance(g, cfg)


def _round(h: Any, inst: Any, pages: int, rnd: random.Random) -> tuple[float, float]:
    """One backup and one prefetch of ``pages`` new pages; returns their seconds."""
    g = inst.geometry
    ps = g.page_size
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
            f"{inst.controller.storage_backend_type}: backed up {done}, "
            f"prefetched {got.completed_tokens} of {len(tokens)} tokens"
        )
    # The pages read back are the pages written (checked outside the timing).
    if h.pages_bytes(inst.host, got.host_indices[:ps], ps) != h.pages_bytes(
        inst.host, idx[:ps], ps
    ):
        raise RuntimeError("a prefetched page differs from the page backed up")
    inst.host.free(idx)
    inst.host.free(got.host_indices)
    inst.controller.storage_backend.clear()
    os.sync()  # write-back of this round's files must not land in the next timing
    return t1 - t0, t2 - t1


def _measure(quick: bool) -> dict[str, Any]:
    import torch

    with _sglang_process() as h:
        g = h.Geometry(
            mla=False,
            layout="page_first",
            layers=8 if quick else 32,
            heads=1,
            head_dim=128,
            page_size=64,
            device_tokens=16 * 64,
            dtype=torch.float16,
        )
        pages = 64 if quick else 128
        rounds = 3 if quick else 9
        # Host pool: room for the pages backed up and the pages prefetched.
        g.host_ratio = (2 * pages + 8) / 16
        rnd = random.Random(0)
        times: dict[str, dict[str, list[float]]] = {
            s: {"backup": [], "prefetch": []} for s in SIDES
        }
        with tempfile.TemporaryDirectory(prefix="tiercache-bench-sglang-") as tmp:
            insts = {s: _instance(h, g, s, Path(tmp)) for s in SIDES}
            try:
                for inst in insts.values():
                    h.fill_random(inst.host, 1)
                    _round(h, inst, 8, rnd)  # warm-up: threads, files, native hash
                for r in range(rounds):
                    order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
                    for side in order:
                        b, p = _round(h, insts[side], pages, rnd)
                        times[side]["backup"].append(b)
                        times[side]["prefetch"].append(p)
            finally:
                for inst in insts.values():
                    inst.close()
        page_bytes = 2 * g.layers * g.page_size * g.heads * g.head_dim * 2
        rate = {s: {k: pages / statistics.median(v) for k, v in times[s].items()} for s in SIDES}
        return {
            "sglang_version": h.sg().version_str,
            "page_bytes": page_bytes,
            "pages_per_op": pages,
            "rounds": rounds,
            "geometry": f"MHA L{g.layers} H{g.heads} D{g.head_dim} fp16, {g.page_size}-token pages, page_first",
            "seconds": times,
            "pages_per_s": rate,
            "backup_ratio": rate["tiercache"]["backup"] / rate["hicache_file"]["backup"],
            "prefetch_ratio": rate["tiercache"]["prefetch"] / rate["hicache_file"]["prefetch"],
        }


def main(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the benchmark, write ``sglang.json`` (and ``sglang.png``) to ``out_dir``, return the result.

    Raises:
        BenchmarkSkipped: SGLang is not importable here.
    """
    started = time.perf_counter()
    m = _measure(quick)
    rate = m["pages_per_s"]
    mib = m["page_bytes"] / (1 << 20)
    result: dict[str, Any] = {
        "benchmark": "sglang",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "quick": quick,
        "config": {
            k: m[k] for k in ("sglang_version", "page_bytes", "pages_per_op", "rounds", "geometry")
        },
        **{k: m[k] for k in ("seconds", "pages_per_s", "backup_ratio", "prefetch_ratio")},
        "headline": [
            headline(
                "SGLang backup pages/s, tiercache / HiCacheFile", m["backup_ratio"], 1.0, unit="x"
            ),
            headline(
                "SGLang prefetch pages/s, tiercache / HiCacheFile",
                m["prefetch_ratio"],
                1.0,
                unit="x",
            ),
        ],
        "table": {
            "columns": [
                "direction",
                "HiCacheFile pages/s",
                "tiercache pages/s",
                "ratio",
                "tiercache MiB/s",
            ],
            "rows": [
                [
                    d,
                    rate["hicache_file"][d],
                    rate["tiercache"][d],
                    m[f"{d}_ratio"],
                    rate["tiercache"][d] * mib,
                ]
                for d in ("backup", "prefetch")
            ],
        },
        "wall_s": round(time.perf_counter() - started, 2),
    }
    write_result("sglang", result, out_dir)
    plot = plot_bars(
        "sglang",
        ["backup", "prefetch"],
        {
            "SGLang HiCacheFile": [
                rate["hicache_file"]["backup"],
                rate["hicache_file"]["prefetch"],
            ],
            "tiercache backend": [rate["tiercache"]["backup"], rate["tiercache"]["prefetch"]],
        },
        title=f"SGLang {m['sglang_version']} storage, {mib:.2f} MiB pages, {m['pages_per_op']} per op",
        ylabel="pages/s",
        out_dir=out_dir,
    )
    result["plot"] = str(plot) if plot else None
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller pages and fewer rounds")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    print(json.dumps(main(quick=args.quick, out_dir=args.out_dir), indent=2, default=str))
