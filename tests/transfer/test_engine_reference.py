"""CopyEngine against a reference copy: every byte of both pools, for every CPU path.

Both pools are filled with random bytes (any bit pattern: NaNs included), a
backup and a load run (layer by layer, then all layers at once, each layer
checked when it is reported), and the whole of both pools is compared, as
bytes, with what plain indexing gives: the slots of the plan hold the other side's
bytes, and no other byte changed. For page sizes 1, 16 and 64, odd page
counts, both host layouts, joint and caller-owned device buffers, row sizes
that copy as int64, int16 (6-byte rows) and a one-buffer (MLA) layout; with
the real bounds, and with tiny ones under which chunks end inside pages and
cross page boundaries inside runs, and the helper thread takes batches of
three chunks.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import CopyEngine

LAYOUTS = {
    "mha-int64-rows": dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16),
    "mha-int16-rows": dict(num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float16),
    "mla-fp32": dict(num_layers=2, num_kv_heads=1, head_dim=6, dtype=torch.float32, mla=True),
}

PATTERNS = ("contiguous", "both scattered", "host scattered", "device scattered", "two-page runs")


def _pages(pattern: str, count: int, pool_pages: int, seed: int) -> tuple[list[int], list[int]]:
    """Host and device page ids of ``count`` pages in pools of ``pool_pages``."""
    rng = random.Random(seed)
    every = list(range(pool_pages))
    scattered = [rng.sample(every, count) for _ in range(2)]
    if pattern == "contiguous":
        return list(range(2, 2 + count)), list(range(count + 1, 2 * count + 1))
    if pattern == "both scattered":
        return scattered[0], scattered[1]
    if pattern == "host scattered":
        return scattered[0], list(range(1, 1 + count))
    if pattern == "device scattered":
        return list(range(1, 1 + count)), scattered[1]
    # Runs of two pages on both sides, the runs in a random order.
    pairs = count // 2 + 1
    host_runs = rng.sample(range(pool_pages // 2), pairs)
    dev_runs = rng.sample(range(pool_pages // 2), pairs)
    host = [2 * r + i for r in host_runs for i in range(2)][:count]
    dev = [2 * r + i for r in dev_runs for i in range(2)][:count]
    return host, dev


def _slots(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


def _randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    flat = t.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``(slots, H, D)`` (any strides, contiguous rows) as ``(slots, row bytes)`` uint8."""
    return t.view(t.shape[0], -1).view(torch.uint8)


def _device(layout: KVLayout, slots: int, joint: bool) -> DeviceKVPool:
    if joint:
        pool = DeviceKVPool(layout, slots)
        assert pool.joint is not None
        return pool
    bufs = [
        [
            torch.empty(slots, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype)
            for _ in range(layout.num_layers)
        ]
        for _ in range(layout.num_buffers)
    ]
    if layout.mla:
        return DeviceKVPool(layout, slots, kv_buffers=bufs[0])
    return DeviceKVPool(layout, slots, k_buffers=bufs[0], v_buffers=bufs[1])


def _check_round_trip(
    layout: KVLayout, host_layout: str, joint: bool, host_pages: list[int], dev_pages: list[int]
) -> CopyEngine:
    ps = layout.page_size
    pool_pages = max(max(host_pages), max(dev_pages)) + 2
    slots = pool_pages * ps
    gen = torch.Generator().manual_seed(7)
    device = _device(layout, slots, joint)
    host = HostKVPool(layout, slots, host_layout=host_layout)
    for b in range(layout.num_buffers):
        for x in range(layout.num_layers):
            _randomize(device.buffers[b][x], gen)
    _randomize(host.buffer, gen)
    engine = CopyEngine(device, host)
    try:
        _round_trip(engine, host_pages, dev_pages)
    finally:
        engine.close()
    return engine


def _round_trip(engine: CopyEngine, host_pages: list[int], dev_pages: list[int]) -> None:
    layout, device, host = engine.layout, engine.device_pool, engine.host_pool
    gen = torch.Generator().manual_seed(11)
    ps = layout.page_size
    h, d = _slots(host_pages, ps), _slots(dev_pages, ps)
    plan = engine.plan(h, d)
    B, L = layout.num_buffers, layout.num_layers

    # Backup: the host slots take the device slots' bytes; nothing else changes.
    want = [[_bytes(host.layer(b, x)).clone() for x in range(L)] for b in range(B)]
    for b in range(B):
        for x in range(L):
            want[b][x][h] = _bytes(device.buffers[b][x])[d]
    engine.backup_all_layers(plan)
    for b in range(B):
        for x in range(L):
            assert torch.equal(_bytes(host.layer(b, x)), want[b][x]), (b, x)

    # Load, into a device pool with fresh bytes: the device slots take the host slots' bytes.
    for b in range(B):
        for x in range(L):
            _randomize(device.buffers[b][x], gen)
    _randomize(host.buffer, gen)
    before = [[_bytes(device.buffers[b][x]).clone() for x in range(L)] for b in range(B)]
    want = [[t.clone() for t in per_buffer] for per_buffer in before]
    for b in range(B):
        for x in range(L):
            want[b][x][d] = _bytes(host.layer(b, x))[h]
    for x in range(L):
        engine.load_layer(x, plan)
        for b in range(B):  # exactly this layer: the ones after it are still untouched
            for y in range(L):
                expect = want[b][y] if y <= x else before[b][y]
                assert torch.equal(_bytes(device.buffers[b][y]), expect), (x, b, y)

    # Every layer at once, into fresh bytes again: each layer reported in order, once
    # it and every layer before it are in place; all of them in place at the end.
    for b in range(B):
        for x in range(L):
            _randomize(device.buffers[b][x], gen)
    before = [[_bytes(device.buffers[b][x]).clone() for x in range(L)] for b in range(B)]
    want = [[t.clone() for t in per_buffer] for per_buffer in before]
    for b in range(B):
        for x in range(L):
            want[b][x][d] = _bytes(host.layer(b, x))[h]
    reported: list[int] = []

    def on_layer(x: int) -> None:
        for b in range(B):
            for y in range(x + 1):
                assert torch.equal(_bytes(device.buffers[b][y]), want[b][y]), (x, b, y)
        reported.append(x)

    engine.load_all_layers(plan, on_layer)
    assert reported == list(range(L))
    for b in range(B):
        for y in range(L):
            assert torch.equal(_bytes(device.buffers[b][y]), want[b][y]), (b, y)


@pytest.fixture(params=["real-bounds", "tiny-bounds-shared"])
def bounds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The real constants, or tiny ones: every scattered load is cut into chunks of
    about 3 tokens, shared with the helper thread in batches of at most 3 chunks."""
    if request.param == "tiny-bounds-shared":
        monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # runs, not the index path
        monkeypatch.setattr(engine_module, "_CPU_CHUNK_BYTES", 3 * 2 * 32)  # 3 tokens of K and V
        monkeypatch.setattr(engine_module, "_MAX_BATCH_UNITS", 3)
        monkeypatch.setattr(engine_module, "_MIN_BATCH_UNITS", 1)
        monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    return str(request.param)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("count", [7, 13])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("joint", [True, False], ids=["joint", "caller-buffers"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_byte_matches_a_reference_copy(
    layout_name: str,
    joint: bool,
    host_layout: str,
    page_size: int,
    count: int,
    pattern: str,
    bounds: str,
) -> None:
    layout = KVLayout(**LAYOUTS[layout_name], page_size=page_size)  # type: ignore[arg-type]
    host_pages, dev_pages = _pages(pattern, count, 4 * count, seed=count)
    _check_round_trip(layout, host_layout, joint, host_pages, dev_pages)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pattern", ["both scattered", "two-page runs"])
def test_real_chunks_end_inside_pages_of_4_kib_rows(
    host_layout: str, pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 heads of 128 halves: 4 KiB rows, so a 256 KiB chunk of K and V holds 32
    tokens, half a page of 64; 9 pages make 4.5 MiB a layer, which the helper shares.
    Five runs of two pages are chunked too (instead of one copy a run)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(engine_module, "_MAX_GATHER_RUNS", 2)
    layout = KVLayout(num_layers=2, num_kv_heads=16, head_dim=128, page_size=64)
    host_pages, dev_pages = _pages(pattern, 9, 20, seed=3)
    engine = _check_round_trip(layout, host_layout, True, host_pages, dev_pages)
    plan = engine.plan(_slots(host_pages, 64), _slots(dev_pages, 64))
    assert plan.chunks is not None and plan.device_runs is None
    assert {n for _, _, n in plan.chunks} == {32}
    assert engine_module._PARALLEL_MIN_BYTES <= 9 * 64 * 2 * layout.token_layer_bytes


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_a_load_of_all_layers_waits_for_a_slow_helper(
    host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper thread copies its batches slowly: every layer is still reported,
    in order, only once in place, and all are in place when the call returns."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(engine_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(engine_module, "_MAX_GATHER_RUNS", 0)
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # runs, not the index path
    monkeypatch.setattr(engine_module, "_MAX_BATCH_UNITS", 2)
    monkeypatch.setattr(engine_module, "_MIN_BATCH_UNITS", 1)
    caller = threading.get_ident()
    copy_batches = engine_module._copy_batches

    def slow_on_the_helper(*args: Any) -> None:
        if threading.get_ident() != caller:
            time.sleep(0.005)
        copy_batches(*args)

    monkeypatch.setattr(engine_module, "_copy_batches", slow_on_the_helper)
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, page_size=4)
    host_pages, dev_pages = _pages("both scattered", 40, 100, seed=5)
    engine = _check_round_trip(layout, host_layout, True, host_pages, dev_pages)
    plan = engine.plan(_slots(host_pages, 4), _slots(dev_pages, 4))
    assert plan.chunks is not None and plan.device_runs is None
