"""CopyEngine copies: every path moves the right bytes, and no temporary outgrows the bound.

The paths: contiguous runs, scattered pages (a load copies them as
integer-row chunks of at most 256 KiB, K and V together on a joint CPU pool,
one ``np.copyto`` a chunk, in batches shared with a helper thread when large),
scattered host pages into a fresh device run (page gather), many short runs
(index gather/scatter, through the pinned staging buffers on CUDA); for
backup and load, ``layer_first`` and ``page_first`` host pools, stacked
(joint) and caller-owned device buffers.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.errors import InvalidInputError
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import MAX_TEMP_BYTES, CopyEngine, PinnedStaging, _spans
from tiercache.transfer.streams import CopyStream, copy_helper

PS = 4
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=PS)
SLOTS = 64 * PS


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


PATTERNS = {
    "contiguous": (list(range(0, 16)), list(range(8, 24))),
    "both scattered": (
        [50, 3, 17, 40, 9, 61, 22, 5, 33, 12],
        [7, 44, 2, 19, 58, 30, 11, 36, 25, 1],
    ),
    "host scattered": ([50, 3, 17, 40, 9, 61, 22, 5, 33, 12], list(range(20, 30))),
    "one page": ([13], [42]),
}


def _device(stacked: bool) -> DeviceKVPool:
    if stacked:
        return DeviceKVPool(LAYOUT, SLOTS)
    bufs = [
        [
            torch.zeros(SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=LAYOUT.dtype)
            for _ in range(LAYOUT.num_layers)
        ]
        for _ in range(LAYOUT.num_buffers)
    ]
    return DeviceKVPool(LAYOUT, SLOTS, k_buffers=bufs[0], v_buffers=bufs[1])


def _fill_device(pool: DeviceKVPool) -> None:
    g = torch.Generator().manual_seed(3)
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            buf = pool.buffers[b][layer]
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def _engine(stacked: bool, host_layout: str) -> tuple[DeviceKVPool, HostKVPool, CopyEngine]:
    """A filled device pool, an empty host pool of ``host_layout`` and the engine between them."""
    device = _device(stacked)
    _fill_device(device)
    host = HostKVPool(LAYOUT, SLOTS, host_layout=host_layout)
    return device, host, CopyEngine(device, host)


def _expect(pool: DeviceKVPool, dev: torch.Tensor) -> list[list[torch.Tensor]]:
    return [
        [pool.buffers[b][layer][dev].clone() for layer in range(LAYOUT.num_layers)]
        for b in range(LAYOUT.num_buffers)
    ]


@pytest.fixture(params=[False, True], ids=["unbounded", "tiny-temp-bound"])
def bound(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Either the real bounds, or ones so small that every transfer is cut into pieces.

    The CPU copy chunk then holds 3 tokens (of K and V, on a joint pool; of
    one buffer otherwise) or fewer: chunks end inside pages (page 4) and, in a
    ``page_first`` backup, hold one token of every layer.
    """
    if request.param:
        limit = LAYOUT.page_size * LAYOUT.token_layer_bytes  # one page of one layer
        monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", limit)
        monkeypatch.setattr(engine_module, "_CPU_CHUNK_BYTES", 3 * 2 * LAYOUT.token_layer_bytes)
        return limit
    return MAX_TEMP_BYTES


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "caller-buffers"])
def test_backup_then_load_moves_every_byte(
    pattern: str, host_layout: str, stacked: bool, bound: int
) -> None:
    host_pages, dev_pages = PATTERNS[pattern]
    device, host, engine = _engine(stacked, host_layout)
    h, d = _slots(host_pages), _slots(dev_pages)
    want = _expect(device, d)
    plan = engine.plan(h, d)
    engine.backup_all_layers(plan)
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(host.layer(b, layer)[h], want[b][layer])
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            device.buffers[b][layer].zero_()
    for layer in range(LAYOUT.num_layers):
        engine.load_layer(layer, plan)
    got = _expect(device, d)
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(got[b][layer], want[b][layer])
    # Nothing outside the plan's slots was written.
    outside = torch.ones(SLOTS, dtype=torch.bool)
    outside[d] = False
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            assert not device.buffers[b][layer][outside].any()


class _CopyLog:
    """Wraps ``np.copyto``: what each chunk copy wrote, and on which thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, np.ndarray]] = []
        self.delay = delay
        self.real = np.copyto
        monkeypatch.setattr(np, "copyto", self)

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.calls.append((threading.current_thread().name, dst))
        if self.delay:
            time.sleep(self.delay)  # long enough for the helper to start before the caller is done
        self.real(dst, src)

    @property
    def copies(self) -> list[np.ndarray]:
        return [d for _, d in self.calls]

    @property
    def threads(self) -> set[str]:
        return {name for name, _ in self.calls}


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_scattered_pages_on_a_cpu_pool_copy_as_integer_rows_k_and_v_at_once(
    host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One copy a page of a layer, K and V together (a joint pool), of int64 rows."""
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # one run per page
    device, host, engine = _engine(True, host_layout)
    assert device.joint is not None
    host_pages, dev_pages = PATTERNS["both scattered"]
    plan = engine.plan(_slots(host_pages), _slots(dev_pages))
    assert plan.runs is not None and plan.device_runs is None and plan.chunks is not None
    want = _expect(device, _slots(dev_pages))
    engine.backup_all_layers(plan)
    device.joint.zero_()
    log = _CopyLog(monkeypatch)
    engine.load_layer(1, plan)
    got = _expect(device, _slots(dev_pages))
    assert all(torch.equal(got[b][1], want[b][1]) for b in range(2))
    assert log.threads == {threading.current_thread().name}  # small: no helper
    assert len(log.copies) == len(host_pages)  # one copy a page: K and V at once
    assert {(c.dtype, c.shape) for c in log.copies} == {(np.dtype(np.int64), (PS, 2, 4))}


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_no_gather_temporary_exceeds_the_bound(
    host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backup and a load of many short runs (the index path) gather in bounded pieces."""
    limit = 2 * LAYOUT.page_size * LAYOUT.num_layers * LAYOUT.token_layer_bytes
    monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", limit)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)  # force the index path
    biggest = [0]
    real = torch.Tensor.index_select

    def index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        out = real(self, dim, index)
        biggest[0] = max(biggest[0], out.nbytes)
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    device, host, engine = _engine(True, host_layout)
    pages = list(range(0, 60, 2))  # 30 one-page runs: the whole transfer is 15x the bound
    h, d = _slots(pages), _slots(pages[::-1])
    plan = engine.plan(h, d)
    assert plan.runs is None
    want = _expect(device, d)
    engine.backup_all_layers(plan)
    for layer in range(LAYOUT.num_layers):
        device.buffers[0][layer].zero_()
        device.buffers[1][layer].zero_()
        engine.load_layer(layer, plan)
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    assert 0 < biggest[0] <= limit
    assert engine.plan_bytes(plan) > 10 * limit


def test_spans_cut_whole_units_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", 1000)
    assert _spans(10, 2, 100) == [(0, 10)]  # 10 x 100 bytes fits in one span
    assert _spans(40, 4, 100) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert _spans(3, 1, 5000) == [(0, 1), (1, 2), (2, 3)]  # at least one unit a span
    assert _spans(0, 4, 100) == []


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "caller-buffers"])
def test_the_gpu_backup_branches_move_every_byte(
    pattern: str, host_layout: str, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The branches a CUDA pool takes (layer by layer, chunked runs), run here on CPU tensors."""
    limit = LAYOUT.page_size * LAYOUT.token_layer_bytes
    monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", limit)
    host_pages, dev_pages = PATTERNS[pattern]
    device, host, engine = _engine(stacked, host_layout)
    h, d = _slots(host_pages), _slots(dev_pages)
    plan = engine.plan(h, d)
    engine.device = torch.device("cuda")  # only the branch choice reads it in a backup

    def cpu_only(*args: object) -> None:
        raise AssertionError("the CPU joint-pool backup ran for a CUDA engine")

    monkeypatch.setattr(engine, "_backup_runs_joint", cpu_only)
    want = _expect(device, d)
    engine.backup_all_layers(plan)
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(host.layer(b, layer)[h], want[b][layer])


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["joint", "caller-buffers"])
def test_a_scattered_cpu_load_copies_in_chunks_of_at_most_the_bound(
    host_layout: str, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece holds at most `_CPU_CHUNK_BYTES`, K and V together on a joint pool."""
    buffers = 2 if stacked else 1  # a joint pool copies K and V in one piece
    chunk = 3 * buffers * LAYOUT.token_layer_bytes  # pages of 4 tokens: pieces of 3 and 1
    monkeypatch.setattr(engine_module, "_CPU_CHUNK_BYTES", chunk)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # one run per page
    device, host, engine = _engine(stacked, host_layout)
    host_pages, dev_pages = PATTERNS["both scattered"]
    h, d = _slots(host_pages), _slots(dev_pages)
    want = _expect(device, d)
    plan = engine.plan(h, d)
    assert plan.chunks is not None and plan.device_runs is None
    engine.backup_all_layers(plan)
    for layer in range(LAYOUT.num_layers):
        device.buffers[0][layer].zero_()
        device.buffers[1][layer].zero_()
    log = _CopyLog(monkeypatch)
    for layer in range(LAYOUT.num_layers):
        engine.load_layer(layer, plan)
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    assert max(c.nbytes for c in log.copies) == chunk
    pieces = 2 * len(host_pages)  # 3 + 1 tokens a page
    assert len(log.copies) == pieces * (2 // buffers) * LAYOUT.num_layers


def test_the_staging_ring_is_allocated_once_and_its_slots_are_taken_in_turn() -> None:
    staging = PinnedStaging(pin=False, count=3, slot_bytes=1024)
    assert staging.nbytes == 0
    staging.reserve()
    assert staging.nbytes == 3 * 1024
    arena = staging.buffers[0].data_ptr()
    like = torch.zeros(100, 2, 8, dtype=torch.float16)  # 32 bytes a row
    taken = [staging.take(like, 10) for _ in range(4)]
    assert [i for i, _ in taken] == [0, 1, 2, 0]
    assert taken[0][1].shape == (10, 2, 8) and taken[0][1].dtype == torch.float16
    assert [t.data_ptr() - arena for _, t in taken] == [0, 1024, 2048, 0]
    assert staging.nbytes == 3 * 1024  # never grows
    assert staging.rows(32, 4) == 32
    with pytest.raises(InvalidInputError):
        staging.take(like, 33)  # more than a slot holds


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_staging_is_not_page_locked_without_cuda() -> None:
    staging = PinnedStaging(pin=True)
    assert not staging.pin
    _, buf = staging.take(torch.zeros(4, 2), 4)
    assert not buf.is_pinned()


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_a_load_gathers_short_scattered_runs_through_the_staging_buffers(
    host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA index path, run here on CPU tensors: gathered into staging, span by span."""
    limit = 2 * LAYOUT.page_size * LAYOUT.token_layer_bytes  # two pages of one layer a span
    monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", limit)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)  # force the index path
    device, host, engine = _engine(True, host_layout)
    host_pages, dev_pages = PATTERNS["both scattered"]
    h, d = _slots(host_pages), _slots(dev_pages)
    plan = engine.plan(h, d)
    assert plan.runs is None and plan.device_runs is None
    want = _expect(device, d)
    engine.backup_all_layers(plan)
    staging = PinnedStaging(pin=False, slot_bytes=limit)
    takes: list[int] = []
    real_take = staging.take

    def take(like: torch.Tensor, rows: int) -> tuple[int, torch.Tensor]:
        takes.append(rows)
        return real_take(like, rows)

    monkeypatch.setattr(staging, "take", take)
    engine.staging = staging
    for layer in range(LAYOUT.num_layers):
        device.buffers[0][layer].zero_()
        device.buffers[1][layer].zero_()
        engine.load_layer(layer, plan)
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    spans = len(host_pages) // 2
    assert takes == [2 * PS] * (spans * LAYOUT.num_buffers * LAYOUT.num_layers)
    assert staging.nbytes == staging.count * staging.slot_bytes  # the ring, allocated once


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_a_large_cpu_copy_is_shared_with_the_helper_thread(
    host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From `_PARALLEL_MIN_BYTES` on, the stream's helper takes batches: every chunk copied once."""
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # one run per page
    monkeypatch.setattr(engine_module, "_CPU_CHUNK_BYTES", 2 * LAYOUT.token_layer_bytes)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    device, host, engine = _engine(True, host_layout)
    host_pages, dev_pages = PATTERNS["both scattered"]
    h, d = _slots(host_pages), _slots(dev_pages)
    want = _expect(device, d)
    plan = engine.plan(h, d)
    assert plan.chunks is not None
    engine.backup_all_layers(plan)
    log = _CopyLog(monkeypatch, delay=0.0005)
    threads: set[str] = set()

    def job() -> None:
        threads.add(threading.current_thread().name)
        for layer in range(LAYOUT.num_layers):
            device.buffers[0][layer].zero_()
            device.buffers[1][layer].zero_()
            engine.load_layer(layer, plan)

    stream = CopyStream("chunks", torch.device("cpu"))
    try:
        stream.submit(job).result(timeout=30)
    finally:
        stream.close()
        engine.close()  # the backup above, made outside a stream, shared with its own helper
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    assert threads == {"tiercache-chunks"}
    assert log.threads == {"tiercache-chunks", "tiercache-chunks-helper_0"}
    # Every chunk once: one token of K and V a copy.
    assert len(log.copies) == len(h) * LAYOUT.num_layers


def test_batches_shrink_towards_the_end_and_cover_every_unit() -> None:
    bounds = engine_module._batch_bounds(100)
    assert bounds[0] == (0, engine_module._MAX_BATCH_UNITS)
    assert [lo for lo, _ in bounds[1:]] == [hi for _, hi in bounds[:-1]]  # no gap, no overlap
    assert bounds[-1][1] == 100
    sizes = [hi - lo for lo, hi in bounds]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[-1] <= engine_module._MIN_BATCH_UNITS
    assert engine_module._batch_bounds(0) == []
    assert engine_module._batch_bounds(1) == [(0, 1)]


def test_a_failing_chunk_is_raised_after_the_helper_has_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    dst, src = np.zeros((64, 4)), np.ones((64, 4))
    chunks = tuple((i, i, 1) for i in range(64))
    running = [0]
    real = np.copyto

    def copyto(dst: np.ndarray, src: np.ndarray) -> None:
        running[0] += 1
        try:
            time.sleep(0.001)
            if threading.current_thread().name.startswith("tiercache-fault-helper"):
                raise RuntimeError("copy fault")
            real(dst, src)
        finally:
            running[0] -= 1

    def job() -> None:
        try:
            engine_module._copy_chunks([(dst, src)], chunks, 1 << 30, copy_helper())
        finally:
            left.append(running[0])

    left: list[int] = []
    monkeypatch.setattr(np, "copyto", copyto)
    stream = CopyStream("fault", torch.device("cpu"))
    try:
        with pytest.raises(RuntimeError, match="copy fault"):
            stream.submit(job).result(timeout=30)
    finally:
        stream.close()
    assert left == [0]  # nothing still copying when the error reached the job


def test_outside_a_copy_stream_the_engine_shares_with_its_own_helper_until_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(engine_module, "_CPU_CHUNK_BYTES", 2 * LAYOUT.token_layer_bytes)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # one run per page
    device = _device(True)
    _fill_device(device)
    engine = CopyEngine(device, HostKVPool(LAYOUT, SLOTS))
    host_pages, dev_pages = PATTERNS["both scattered"]
    h, d = _slots(host_pages), _slots(dev_pages)
    want = _expect(device, d)
    plan = engine.plan(h, d)
    assert plan.chunks is not None
    engine.backup_all_layers(plan)
    for layer in range(LAYOUT.num_layers):
        device.buffers[0][layer].zero_()
        device.buffers[1][layer].zero_()
    log = _CopyLog(monkeypatch, delay=0.0005)
    try:
        for layer in range(LAYOUT.num_layers):
            engine.load_layer(layer, plan)
    finally:
        engine.close()
    assert log.threads == {threading.current_thread().name, "tiercache-engine-helper_0"}
    alive = [t.name for t in threading.enumerate() if t.name.startswith("tiercache-engine")]
    assert not alive  # close stopped it
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))


def test_a_small_cpu_copy_never_leaves_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `_PARALLEL_MIN_BYTES` (every copy a controller runs inline) no helper is involved."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    device = _device(True)
    engine = CopyEngine(device, HostKVPool(LAYOUT, SLOTS))
    plan = engine.plan(_slots(list(range(16))), _slots(list(range(16))))
    assert engine.plan_bytes(plan) < engine_module._PARALLEL_MIN_BYTES
    engine.backup_all_layers(plan)
    for layer in range(LAYOUT.num_layers):
        engine.load_layer(layer, plan)
    assert not [t for t in threading.enumerate() if t.name.startswith("tiercache-engine")]


# -- long runs: pieces shared with the helper, the CPU yielded after each ---------------


def _record_pauses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace `_pause` with a recorder of the threads that call it."""
    pauses: list[str] = []
    monkeypatch.setattr(
        engine_module, "_pause", lambda: pauses.append(threading.current_thread().name)
    )
    return pauses


def _contiguous(
    stacked: bool, host_layout: str
) -> tuple[
    DeviceKVPool, HostKVPool, CopyEngine, torch.Tensor, torch.Tensor, list[list[torch.Tensor]]
]:
    """`_engine`, the slots of a contiguous pairing, and the device KV they hold."""
    device, host, engine = _engine(stacked, host_layout)
    h, d = _slots(PATTERNS["contiguous"][0]), _slots(PATTERNS["contiguous"][1])
    return device, host, engine, h, d, _expect(device, d)


def test_pieces_cover_every_run_once_in_order() -> None:
    runs = [(0, 100, 10), (40, 7, 3), (90, 0, 1)]
    pieces = engine_module._pieces(runs, row_bytes=engine_module._PIECE_BYTES // 4)
    assert all(n <= 4 for _, _, n in pieces)
    covered = [(s0 + i, t0 + i) for s0, t0, n in pieces for i in range(n)]
    assert covered == [(s0 + i, t0 + i) for s0, t0, n in runs for i in range(n)]
    assert engine_module._pieces(runs, row_bytes=1) == tuple(runs)  # within a piece: whole
    assert engine_module._pieces([], row_bytes=8) == ()


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["joint", "caller-buffers"])
def test_long_runs_copy_in_pieces_shared_with_the_helper_yielding_after_each(
    host_layout: str, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backup and a load of long runs (a fresh allocation) on a CPU pool, one
    allocated as one tensor or the caller's buffers: cut into pieces of at most
    `_PIECE_BYTES` a row pair, copied by the stream's worker and its helper,
    each yielding the CPU after every piece, every byte in place and every
    layer reported once, in order."""
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    device, host, engine, h, d, want = _contiguous(stacked, host_layout)
    row = LAYOUT.token_layer_bytes  # one buffer of one layer: a backup's row
    monkeypatch.setattr(engine_module, "_PIECE_BYTES", 3 * row)  # pieces end inside pages
    plan = engine.plan(h, d)
    assert plan.runs is not None and len(plan.runs) == 1 and plan.device_runs is None
    pauses = _record_pauses(monkeypatch)
    log = _CopyLog(monkeypatch, delay=0.0005)
    layers: list[int] = []

    def backup() -> None:
        engine.backup_all_layers(plan)

    def load() -> None:
        for bufs in device.buffers:
            for t in bufs:
                t.zero_()
        engine.load_all_layers(plan, layers.append)

    stream = CopyStream("pieces", torch.device("cpu"))
    try:
        stream.submit(backup).result(timeout=30)
        backed_up = list(log.calls)
        for b in range(LAYOUT.num_buffers):
            for x in range(LAYOUT.num_layers):
                assert torch.equal(host.layer(b, x)[h], want[b][x])
        stream.submit(load).result(timeout=30)
    finally:
        stream.close()
        engine.close()
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    assert layers == [0, 1, 2]
    tokens = len(h)
    if stacked and host_layout == "page_first":
        # Written in the host's order: a row is a token of every layer (3 rows
        # of one layer make a piece: one token a piece), a pair a buffer.
        assert len(backed_up) == LAYOUT.num_buffers * tokens
        assert all(dst.shape[:2] == (1, LAYOUT.num_layers) for _, dst in backed_up)
    else:  # a piece per (buffer, layer) and 3 tokens, none longer
        assert len(backed_up) == LAYOUT.num_buffers * LAYOUT.num_layers * -(-tokens // 3)
        assert all(dst.shape[0] <= 3 for _, dst in backed_up)
    loaded = log.calls[len(backed_up) :]
    if stacked:  # a token of K and V is one row of a joint pool: pieces of one token
        assert len(loaded) == LAYOUT.num_layers * tokens
    else:  # a row of one buffer: pieces of 3 tokens, per buffer
        assert len(loaded) == LAYOUT.num_layers * LAYOUT.num_buffers * -(-tokens // 3)
    assert log.threads == {"tiercache-pieces", "tiercache-pieces-helper_0"}
    assert len(pauses) == len(log.calls)  # after every piece, on the thread that copied it
    assert sorted(pauses) == sorted(name for name, _ in log.calls)


def test_a_short_copy_never_yields_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `_PARALLEL_MIN_BYTES` (a copy the event loop may make itself) no pause."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    pauses = _record_pauses(monkeypatch)
    device, host, engine = _engine(True, "layer_first")
    for pattern in PATTERNS.values():
        plan = engine.plan(_slots(pattern[0]), _slots(pattern[1]))
        engine.backup_all_layers(plan)
        engine.load_all_layers(plan)
    assert pauses == []


def test_a_long_copy_torch_keeps_to_one_thread_still_yields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With torch told to use one thread there is no helper, but the copying
    thread still yields after each piece."""
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(engine_module, "_PIECE_BYTES", 2 * LAYOUT.token_layer_bytes)
    pauses = _record_pauses(monkeypatch)
    device, host, engine, h, d, want = _contiguous(True, "page_first")
    log = _CopyLog(monkeypatch)
    plan = engine.plan(h, d)
    stream = CopyStream("alone", torch.device("cpu"))
    try:
        stream.submit(lambda: engine.backup_all_layers(plan)).result(timeout=30)
    finally:
        stream.close()
    assert log.threads == {"tiercache-alone"}
    assert len(pauses) == len(log.calls) > 1
    assert all(torch.equal(host.layer(b, x)[h], want[b][x]) for b in range(2) for x in range(3))


@pytest.mark.parametrize("stacked", [True, False], ids=["joint", "caller-buffers"])
def test_a_long_copy_called_directly_is_torchs_and_never_yields(
    stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a copy stream's job (the caller blocks anyway) a long run is one
    torch ``copy_`` over its threads: no pieces, no helper, no pause."""
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    pauses = _record_pauses(monkeypatch)
    device, host, engine, h, d, want = _contiguous(stacked, "layer_first")
    log = _CopyLog(monkeypatch)
    plan = engine.plan(h, d)
    engine.backup_all_layers(plan)
    for bufs in device.buffers:
        for t in bufs:
            t.zero_()
    engine.load_all_layers(plan)
    got = _expect(device, d)
    assert all(torch.equal(got[b][x], want[b][x]) for b in range(2) for x in range(3))
    assert log.calls == [] and pauses == []
