"""The file backend against a plain one-file-per-page store and one big sequential file.

Three stores move the same pages, held in real ``page_first`` `HostKVPool`
buffers (two segments a page, K and V), in the same run and directory:

- ``file backend``: tiercache's `FileBackend` with its default thread count,
  ``batch_set`` then ``batch_get`` in batches of ``batch`` pages with
  ``concurrency`` batch calls in flight. Every page carries its header and
  XXH3-64 checksum, is published atomically (first writer wins), and every
  read is verified.
- ``one file per page``: what SGLang's ``HiCacheFile`` does, written into
  this benchmark as the baseline: a flat directory, one file per page written
  with ``numpy.tofile`` and read with one ``readinto`` per segment straight
  into the destination page; no header, no checksum, no atomic publish. Its
  batches run in the calling thread (``concurrency`` 1), or on
  ``concurrency`` threads.
- ``sequential``: the same bytes as one big file, written with ``write`` and
  read back with ``readinto`` into the destination buffer.

When ``sglang`` is importable, SGLang's real ``HiCacheFile`` runs beside them
(one contiguous tensor a page, as it stores them).

Measurement: destination buffers are allocated and faulted in beforehand (as
a host pool's are); ``sync`` runs between phases, outside the timings, so
that writeback of one phase never lands in another. In each round every
store writes in turn (synced after each), then the stores take turns reading,
``READ_REPEATS`` (3) times, every read checked bit for bit; then all are
cleared and synced. The order of the stores rotates each round. Reads come
from the page cache: this measures each store's own cost, not the disk.
Numbers are medians over all samples; a ratio is the median of ``baseline
seconds / file backend seconds`` over the samples, each paired with the one of
the same round and repeat (above 1: the file backend is faster).

The headline is 768 KiB pages (786,432 bytes: 24 layers, one 128-dim KV head,
64 tokens, fp16), batches of 128 pages, one batch in flight, 512 MiB, 5
rounds. The parameter space, 128 MiB per cell and 3 rounds: pages of 64 KiB,
768 KiB and 2 MiB, batches of 1, 16 and 128, concurrency 1, 4 and 16.
``--quick``: a 128 MiB headline and three points of the space a page size,
16 MiB each; ``--smoke``: tiny sizes, one round, only to show that it runs.

Hashing: `page_hashes` over random token ids, 64-token pages, against the
per-token formulation (one ``sha256.update`` of 4 bytes per token).

Results: ``benchmarks/results/storage.json``, ``storage.png`` (the headline
ratios) and ``storage_grid.png`` (the parameter space).

    python benchmarks/bench_storage.py [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    _pyplot,
    _save,
    headline,
    machine_info,
    paired_ratio,
    plot_bars,
    print_table,
    write_result,
)
from tiercache.index import page_hashes  # noqa: E402
from tiercache.memory import HostKVPool, KVLayout, PageBuffer  # noqa: E402
from tiercache.storage.file import FileBackend, default_concurrency  # noqa: E402
from tiercache.storage.keys import StorageNamespace  # noqa: E402

#: Page sizes of the parameter space, by label.
PAGE_LAYOUTS = {
    "64 KiB": KVLayout(num_layers=8, num_kv_heads=1, head_dim=128, page_size=16),
    "768 KiB": KVLayout(num_layers=24, num_kv_heads=1, head_dim=128, page_size=64),
    "2 MiB": KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, page_size=64),
}
BATCHES = (1, 16, 128)
CONCURRENCY = (1, 4, 16)
HEADLINE_CELL = ("768 KiB", 128, 1)
HASH_LAYOUT = PAGE_LAYOUTS["2 MiB"]
TARGETS = {"vs_plain": 1.2, "seq_write": 0.7, "seq_read": 0.8, "hash": 5.0}


@dataclass(frozen=True)
class Sizes:
    headline_mib: int
    headline_rounds: int
    grid_mib: int
    grid_rounds: int


SIZES = {
    "full": Sizes(512, 5, 128, 3),
    "quick": Sizes(128, 3, 16, 3),
    "smoke": Sizes(4, 1, 2, 1),
}


#: Read phases per store and round. Reads come from the page cache, so they are
#: cheap to repeat; taking turns read by read evens out the load from the rest of
#: the machine, which decides most of the spread on a shared box.
READ_REPEATS = 3


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Store:
    """One store of a cell, as phases the round takes turns on.

    ``name`` and ``tag`` name its timings (``<name>_write<tag>``,
    ``<name>_read<tag>``); ``what`` names it in a failed check; ``start``
    (untimed) opens it, ``clear`` (untimed) removes its pages and closes it.
    """

    name: str
    tag: str
    what: str
    write: Callable[[], Awaitable[None]]
    read: Callable[[], Awaitable[None]]
    check: Callable[[str], None]
    clear: Callable[[], Awaitable[None]]
    start: Callable[[], Awaitable[None]] = _nothing


def _fill(pool: HostKVPool, seed: int) -> None:
    """Random-looking bytes without generating a gigabyte of randomness: tile 8 MiB."""
    flat = pool.buffer.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(flat.numel(), 8 << 20),), dtype=torch.uint8, generator=g)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start : start + n] = block[:n]


def _sync() -> None:
    os.sync()


# --- the one-file-per-page baseline ---------------------------------------------------------


class PlainFileStore:
    """One file per page in a flat directory: ``tofile`` to write, ``readinto`` to read.

    What SGLang's ``HiCacheFile`` does, without its key bookkeeping: no
    header, no checksum, no temporary file (a crash can leave a torn page
    under its real name), no capacity bound. A batch runs in the calling
    thread; ``concurrency`` batches run on that many threads.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key + ".bin")

    def batch_set(self, keys: Sequence[str], pages: Sequence[PageBuffer]) -> list[bool]:
        out = []
        for k, page in zip(keys, pages, strict=True):
            path = self._path(k)
            if os.path.exists(path):
                out.append(True)
                continue
            with open(path, "wb") as f:
                for seg in page.segments:
                    np.frombuffer(seg, dtype=np.uint8).tofile(f)
            out.append(True)
        return out

    def batch_get(self, keys: Sequence[str], pages: Sequence[PageBuffer]) -> list[bool]:
        out = []
        for k, page in zip(keys, pages, strict=True):
            try:
                with open(self._path(k), "rb", buffering=0) as f:
                    ok = all(f.readinto(seg) == seg.nbytes for seg in page.segments)
            except FileNotFoundError:
                ok = False
            out.append(ok)
        return out

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)


def _sglang_store(root: Path) -> tuple[Any | None, str]:
    """SGLang's real ``HiCacheFile`` under ``root``, or ``None`` and why not."""
    try:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
            HiCacheFile,
            HiCacheStorageConfig,
        )
    except Exception as e:  # not installed, or an import error of its own
        return None, f"sglang is not importable: {type(e).__name__}: {e}"
    try:
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, is_mla_model=False, is_page_first_layout=True, model_name=None
        )
        root.mkdir(parents=True, exist_ok=True)
        return HiCacheFile(config, file_path=str(root)), ""
    except Exception as e:
        return None, f"HiCacheFile could not be constructed: {type(e).__name__}: {e}"


# --- one cell ----------------------------------------------------------------------------


def _batches(n: int, batch: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch, n)) for lo in range(0, n, batch)]


def _threaded(fn: Callable[[int, int], None], n: int, batch: int, concurrency: int) -> None:
    """Run ``fn(lo, hi)`` for each batch: inline at concurrency 1, else on that many threads."""
    spans = _batches(n, batch)
    if concurrency == 1:
        for lo, hi in spans:
            fn(lo, hi)
        return
    with ThreadPoolExecutor(concurrency) as ex:
        for _ in ex.map(lambda s: fn(*s), spans):
            pass


async def _in_flight(
    fn: Callable[[int, int], Coroutine[Any, Any, None]], n: int, batch: int, concurrency: int
) -> None:
    """Await ``fn(lo, hi)`` for each batch, ``concurrency`` calls in flight."""
    it = iter(_batches(n, batch))

    async def worker() -> None:
        for lo, hi in it:
            await fn(lo, hi)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


class Cell:
    """One point of the parameter space: pools, keys and the stores, timed round by round."""

    def __init__(self, label: str, mib: int, workdir: Path, with_sglang: bool) -> None:
        self.label = label
        layout = PAGE_LAYOUTS[label]
        self.layout = layout
        self.pages = max(4, mib * 2**20 // layout.page_bytes)
        slots = self.pages * layout.page_size
        self.src = HostKVPool(layout, slots, host_layout="page_first", pin_memory=False)
        self.dst = HostKVPool(layout, slots, host_layout="page_first", pin_memory=False)
        _fill(self.src, 1)
        self.dst.buffer.zero_()  # faulted in before any timing
        idx = torch.arange(slots, dtype=torch.int64)
        self.src_pages = self.src.page_buffers(idx)
        self.dst_pages = self.dst.page_buffers(idx)
        ns = StorageNamespace.for_layout(layout, "page_first", model="bench")
        self.keys = ns.keys(page_hashes(list(range(slots)), layout.page_size))
        self.nbytes = self.pages * layout.page_bytes
        self.src_bytes = memoryview(self.src.buffer.view(-1).view(torch.uint8).numpy())
        self.dst_bytes = memoryview(self.dst.buffer.view(-1).view(torch.uint8).numpy())
        self.workdir = workdir
        self.plain = PlainFileStore(workdir / "plain")
        self.sglang: Any | None = None
        self.sglang_reason = "not requested"
        if with_sglang:
            self.sglang, self.sglang_reason = _sglang_store(workdir / "sglang")
        if self.sglang is not None:
            pb = layout.page_bytes
            self.flat_src = torch.empty((self.pages, pb), dtype=torch.uint8)
            self.flat_dst = torch.zeros((self.pages, pb), dtype=torch.uint8)
            for i, p in enumerate(self.src_pages):
                self.flat_src[i].numpy()[:] = np.frombuffer(p.tobytes(), dtype=np.uint8)
        self.times: dict[str, list[float]] = {}

    def _record(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, baseline: str, measured: str) -> float:
        """``baseline`` seconds / ``measured`` seconds, sample by sample (same round), median."""
        return paired_ratio(self.times[baseline], self.times[measured])

    def _check(self, what: str) -> None:
        if not torch.equal(self.src.buffer.view(torch.uint8), self.dst.buffer.view(torch.uint8)):
            raise AssertionError(f"{what}: the pages read back differ from those written")
        self.dst.buffer.zero_()

    def _sequential(self) -> Store:
        path = self.workdir / "sequential.bin"

        async def clear() -> None:
            await asyncio.to_thread(path.unlink, missing_ok=True)

        return Store(
            "seq",
            "",
            "sequential",
            write=lambda: asyncio.to_thread(_sequential_write, path, self.src_bytes),
            read=lambda: asyncio.to_thread(_sequential_read, path, self.dst_bytes),
            check=self._check,
            clear=clear,
        )

    def _file_backend(
        self, batch: int, concurrency: int, tag: str, workers: int | None = None
    ) -> Store:
        """The file backend, with ``workers`` threads (``None``: its default)."""
        keys, src, dst = self.keys, self.src_pages, self.dst_pages
        opened: list[FileBackend] = []

        async def put(lo: int, hi: int) -> None:
            if not all(await opened[0].batch_set(keys[lo:hi], src[lo:hi])):
                raise AssertionError("file backend: a page was not stored")

        async def get(lo: int, hi: int) -> None:
            if not all(await opened[0].batch_get(keys[lo:hi], dst[lo:hi])):
                raise AssertionError("file backend: a page did not arrive")

        async def start() -> None:
            opened.append(
                await FileBackend.open(self.workdir / f"tiercache{tag}", max_concurrency=workers)
            )

        async def clear() -> None:
            await opened[0].clear()
            await opened.pop().aclose()

        return Store(
            "tier",
            tag,
            "file backend",
            write=lambda: _in_flight(put, self.pages, batch, concurrency),
            read=lambda: _in_flight(get, self.pages, batch, concurrency),
            check=self._check,
            clear=clear,
            start=start,
        )

    def _plain_store(self, batch: int, concurrency: int, tag: str) -> Store:
        keys, src, dst, store = self.keys, self.src_pages, self.dst_pages, self.plain

        def put(lo: int, hi: int) -> None:
            store.batch_set(keys[lo:hi], src[lo:hi])

        def get(lo: int, hi: int) -> None:
            if not all(store.batch_get(keys[lo:hi], dst[lo:hi])):
                raise AssertionError("one file per page: a page did not arrive")

        return Store(
            "plain",
            tag,
            "one file per page",
            write=lambda: _as_async(_threaded, put, self.pages, batch, concurrency),
            read=lambda: _as_async(_threaded, get, self.pages, batch, concurrency),
            check=self._check,
            clear=lambda: _as_async(store.clear),
        )

    def _sglang_store(self, batch: int, concurrency: int, tag: str) -> Store:
        store = self.sglang
        assert store is not None
        keys = [f"bench{tag}-{k}" for k in self.keys]
        src = [self.flat_src[i] for i in range(self.pages)]
        dst = [self.flat_dst[i] for i in range(self.pages)]

        def put(lo: int, hi: int) -> None:
            store.batch_set(keys[lo:hi], values=src[lo:hi])

        def get(lo: int, hi: int) -> None:
            got = store.batch_get(keys[lo:hi], target_locations=dst[lo:hi])
            if got is None or any(g is None for g in got):
                raise AssertionError("HiCacheFile: a page did not arrive")

        def check(what: str) -> None:
            if not torch.equal(self.flat_src, self.flat_dst):
                raise AssertionError(f"{what}: the pages read back differ from those written")
            self.flat_dst.zero_()

        def clear() -> None:
            shutil.rmtree(self.workdir / "sglang", ignore_errors=True)
            (self.workdir / "sglang").mkdir()

        return Store(
            "sglang",
            tag,
            "HiCacheFile",
            write=lambda: _as_async(_threaded, put, self.pages, batch, concurrency),
            read=lambda: _as_async(_threaded, get, self.pages, batch, concurrency),
            check=check,
            clear=lambda: _as_async(clear),
        )

    async def _timed(self, name: str, phase: Callable[[], Awaitable[None]]) -> None:
        t0 = time.perf_counter()
        await phase()
        self._record(name, time.perf_counter() - t0)

    async def round(self, configs: Sequence[tuple[int, int]], turn: int) -> None:
        """One interleaved round over ``configs``; the sequential file joins the first.

        For each config, every store writes in turn (``sync`` after each, outside
        the timings), then every store reads in turn, `READ_REPEATS` times, each
        read checked bit for bit; then all are cleared and synced. The order of
        the stores rotates with ``turn``. Taking turns read by read puts the
        stores under the same load from the rest of the machine.
        """
        for n, (batch, conc) in enumerate(configs):
            tag = f"_b{batch}_c{conc}"
            stores = [self._file_backend(batch, conc, tag), self._plain_store(batch, conc, tag)]
            if self.sglang is not None:
                stores.append(self._sglang_store(batch, conc, tag))
            if n == 0:
                stores.append(self._sequential())
            k = turn % len(stores)
            stores = stores[k:] + stores[:k]
            for st in stores:
                await st.start()
            try:
                for st in stores:
                    await self._timed(f"{st.name}_write{st.tag}", st.write)
                    await asyncio.to_thread(_sync)
                for _ in range(READ_REPEATS):
                    for st in stores:
                        await self._timed(f"{st.name}_read{st.tag}", st.read)
                        st.check(st.what)
            finally:
                for st in stores:
                    await st.clear()
                await asyncio.to_thread(_sync)

    def row(self, batch: int, conc: int) -> dict[str, Any]:
        tag = f"_b{batch}_c{conc}"
        gb = self.nbytes / 1e9
        m, r = self.median, self.ratio
        row: dict[str, Any] = {
            "page": self.label,
            "page_bytes": self.layout.page_bytes,
            "pages": self.pages,
            "batch": batch,
            "concurrency": conc,
            "rounds": len(self.times[f"tier_write{tag}"]),
            "file_write_gbps": gb / m(f"tier_write{tag}"),
            "file_read_gbps": gb / m(f"tier_read{tag}"),
            "plain_write_gbps": gb / m(f"plain_write{tag}"),
            "plain_read_gbps": gb / m(f"plain_read{tag}"),
            "seq_write_gbps": gb / m("seq_write"),
            "seq_read_gbps": gb / m("seq_read"),
            "write_vs_plain": r(f"plain_write{tag}", f"tier_write{tag}"),
            "read_vs_plain": r(f"plain_read{tag}", f"tier_read{tag}"),
            "write_vs_seq": r("seq_write", f"tier_write{tag}"),
            "read_vs_seq": r("seq_read", f"tier_read{tag}"),
        }
        if f"sglang_write{tag}" in self.times:
            row.update(
                sglang_write_gbps=gb / m(f"sglang_write{tag}"),
                sglang_read_gbps=gb / m(f"sglang_read{tag}"),
                write_vs_sglang=r(f"sglang_write{tag}", f"tier_write{tag}"),
                read_vs_sglang=r(f"sglang_read{tag}", f"tier_read{tag}"),
            )
        return row


async def _as_async(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` in the calling (loop) thread, as the baseline stores do."""
    fn(*args)


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


async def _measure(
    label: str, mib: int, rounds: int, configs: Sequence[tuple[int, int]], workdir: Path
) -> list[dict[str, Any]]:
    cell = Cell(label, mib, workdir, with_sglang=True)
    try:
        for turn in range(rounds):
            await cell.round(configs, turn)
        rows = [cell.row(b, c) for b, c in configs]
        for r in rows:
            r["sglang"] = cell.sglang_reason or "ran"
        return rows
    finally:
        del cell


# --- hashing ---------------------------------------------------------------------------------


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
        a = page_hashes(tokens, HASH_LAYOUT.page_size)
        fast = min(fast, time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = _per_token(tokens, HASH_LAYOUT.page_size)
        slow = min(slow, time.perf_counter() - t0)
        assert a == b
    return {
        "tokens": n,
        "page_size": HASH_LAYOUT.page_size,
        "page_hashes_mtok_s": n / fast / 1e6,
        "per_token_mtok_s": n / slow / 1e6,
        "ratio": slow / fast,
    }


# --- report ----------------------------------------------------------------------------------

GRID_COLUMNS = [
    "page",
    "batch",
    "conc",
    "file write GB/s",
    "file read GB/s",
    "1-file/page write GB/s",
    "1-file/page read GB/s",
    "seq write GB/s",
    "seq read GB/s",
    "write x 1-file/page",
    "read x 1-file/page",
    "write x seq",
    "read x seq",
]


def _grid_table(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "columns": GRID_COLUMNS,
        "rows": [
            [
                r["page"],
                r["batch"],
                r["concurrency"],
                r["file_write_gbps"],
                r["file_read_gbps"],
                r["plain_write_gbps"],
                r["plain_read_gbps"],
                r["seq_write_gbps"],
                r["seq_read_gbps"],
                r["write_vs_plain"],
                r["read_vs_plain"],
                r["write_vs_seq"],
                r["read_vs_seq"],
            ]
            for r in rows
        ],
    }


def _plot_grid(rows: Sequence[dict[str, Any]], out_dir: Path) -> Path | None:
    """One panel per page size: file backend / one-file-per-page, write and read, per cell."""
    try:
        plt = _pyplot()
    except ImportError:
        return None
    labels = [lbl for lbl in PAGE_LAYOUTS if any(r["page"] == lbl for r in rows)]
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.2), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        sub = [r for r in rows if r["page"] == label]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["write_vs_plain"] for r in sub], 0.4, label="write")
        ax.bar([x + 0.2 for x in xs], [r["read_vs_plain"] for r in sub], 0.4, label="read")
        ax.axhline(TARGETS["vs_plain"], color="k", linestyle="--", linewidth=1, label="target")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [f"b{r['batch']} c{r['concurrency']}" for r in sub], rotation=45, fontsize=8
        )
        ax.set_title(f"{label} pages")
        ax.set_ylabel("file backend / one file per page")
        ax.legend(fontsize=8)
    fig.suptitle("FileBackend over the parameter space (b = batch pages, c = batches in flight)")
    fig.tight_layout()
    return _save(fig, plt, "storage_grid", out_dir)


def _grid_configs(mode: str) -> list[tuple[int, int]]:
    """The (batch, concurrency) points measured for each page size."""
    if mode == "smoke":  # only that it runs: one point a page size
        return [(16, 4)]
    if mode == "quick":  # a sample of the space: a diagonal of three points
        return [(1, 1), (16, 4), (128, 16)]
    return [(b, c) for b in BATCHES for c in CONCURRENCY]


async def _run_cells(
    mode: str, grid: bool, workdir: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The headline cell, then (with ``grid``) every page size over the grid's points."""
    sizes = SIZES[mode]
    head_label, head_batch, head_conc = HEADLINE_CELL
    (head,) = await _measure(
        head_label,
        sizes.headline_mib,
        sizes.headline_rounds,
        [(head_batch, head_conc)],
        workdir / "headline",
    )
    rows: list[dict[str, Any]] = []
    if grid:
        configs = _grid_configs(mode)
        for label in PAGE_LAYOUTS:
            rows += await _measure(
                label, sizes.grid_mib, sizes.grid_rounds, configs, workdir / label
            )
    return head, rows


def _headlines(head: dict[str, Any], hashing: dict[str, Any]) -> list[dict[str, Any]]:
    cell = "768 KiB pages, batch 128"
    heads = [
        headline(
            f"file write / one-file-per-page write ({cell})",
            head["write_vs_plain"],
            TARGETS["vs_plain"],
            unit="x",
        ),
        headline(
            f"file read / one-file-per-page read ({cell}, verified)",
            head["read_vs_plain"],
            TARGETS["vs_plain"],
            unit="x",
        ),
        headline(
            f"file write / sequential write ({cell})",
            head["write_vs_seq"],
            TARGETS["seq_write"],
            unit="x",
        ),
        headline(
            f"file read / sequential read ({cell})",
            head["read_vs_seq"],
            TARGETS["seq_read"],
            unit="x",
        ),
    ]
    if "write_vs_sglang" in head:
        heads += [
            headline(
                f"file {op} / SGLang HiCacheFile {op} ({cell})",
                head[f"{op}_vs_sglang"],
                TARGETS["vs_plain"],
                unit="x",
            )
            for op in ("write", "read")
        ]
    heads.append(
        headline("page_hashes / per-token hashing", hashing["ratio"], TARGETS["hash"], unit="x")
    )
    return heads


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False, grid: bool = True
) -> dict[str, Any]:
    """Run the storage benchmark; write ``storage.json`` and its plots; return the result."""
    mode = "smoke" if smoke else "quick" if quick else "full"
    sizes = SIZES[mode]
    workdir = Path(tempfile.mkdtemp(prefix="tiercache-bench-storage-"))
    try:
        head, rows = asyncio.run(_run_cells(mode, grid, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    hashing = _hashing(quick or smoke, 1 if smoke else 3)
    heads = _headlines(head, hashing)
    head_table_rows: list[list[object]] = [
        ["sequential file", head["seq_write_gbps"], head["seq_read_gbps"]],
        ["one file per page", head["plain_write_gbps"], head["plain_read_gbps"]],
    ]
    if "sglang_write_gbps" in head:
        head_table_rows.append(
            ["SGLang HiCacheFile", head["sglang_write_gbps"], head["sglang_read_gbps"]]
        )
    head_table_rows.append(["file backend", head["file_write_gbps"], head["file_read_gbps"]])
    result: dict[str, Any] = {
        "benchmark": "storage",
        "quick": quick,
        "mode": mode,
        "machine": machine_info(),
        "threads": default_concurrency(),
        "notes": (
            "page_first HostKVPool pages; medians of interleaved rounds; destination buffers "
            "faulted in beforehand; sync between phases, outside the timings; reads from the "
            "page cache; ratio = median over paired samples (same round) of baseline seconds / file backend seconds. "
            f"SGLang HiCacheFile: {head['sglang']}."
        ),
        "headline_cell": head,
        "grid": rows,
        "sizes": sizes.__dict__,
        "hashing": hashing,
        "targets": TARGETS,
        "headline": heads,
        "table": {
            "columns": ["store (headline cell)", "write GB/s", "read GB/s"],
            "rows": head_table_rows,
        },
    }
    if rows:
        result["grid_table"] = _grid_table(rows)
    write_result("storage", result, out_dir)
    print_table(result["table"]["columns"], result["table"]["rows"])
    if rows:
        print_table(result["grid_table"]["columns"], result["grid_table"]["rows"])
    print(
        f"page_hashes: {hashing['page_hashes_mtok_s']:.1f} Mtok/s, per-token: "
        f"{hashing['per_token_mtok_s']:.2f} Mtok/s, ratio {hashing['ratio']:.1f}x"
    )
    for h in heads:
        print(
            f"{h['name']}: {h['value']:.2f} (target {h['op']} {h['target']:g}) "
            f"{'ok' if h['passed'] else 'MISSED'}"
        )
    plot_bars(
        "storage",
        ["vs one file per page", "vs sequential file"],
        {
            "write": [head["write_vs_plain"], head["write_vs_seq"]],
            "read": [head["read_vs_plain"], head["read_vs_seq"]],
        },
        title=f"FileBackend, 768 KiB pages, batch 128 ({head['pages']} pages, {mode})",
        ylabel="file backend throughput / baseline",
        out_dir=out_dir,
        hline=1.0,
    )
    if rows:
        _plot_grid(rows, out_dir)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smaller volumes, 3 rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny volumes, one round")
    parser.add_argument(
        "--no-grid", action="store_true", help="only the headline cell, not the parameter space"
    )
    args = parser.parse_args()
    main(quick=args.quick, smoke=args.smoke, grid=not args.no_grid)
