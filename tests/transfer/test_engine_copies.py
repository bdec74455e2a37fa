"""CopyEngine copies: every path moves the right bytes, and no temporary outgrows the bound.

The paths: contiguous runs, scattered pages on both sides (one integer-row
copy per page and layer), a scattered host into a fresh
device run (page gather), and many short runs (index gather/scatter); for
backup and load, ``layer_first`` and ``page_first`` host pools, stacked and
caller-owned device buffers.
"""

from __future__ import annotations

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import MAX_TEMP_BYTES, CopyEngine, _spans

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


def _expect(pool: DeviceKVPool, dev: torch.Tensor) -> list[list[torch.Tensor]]:
    return [
        [pool.buffers[b][layer][dev].clone() for layer in range(LAYOUT.num_layers)]
        for b in range(LAYOUT.num_buffers)
    ]


@pytest.fixture(params=[False, True], ids=["unbounded", "tiny-temp-bound"])
def bound(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Either the real bound, or one so small that every transfer is cut into pieces."""
    if request.param:
        limit = LAYOUT.page_size * LAYOUT.token_layer_bytes  # one page of one layer
        monkeypatch.setattr(engine_module, "MAX_TEMP_BYTES", limit)
        return limit
    return MAX_TEMP_BYTES


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "caller-buffers"])
def test_backup_then_load_moves_every_byte(
    pattern: str, host_layout: str, stacked: bool, bound: int
) -> None:
    host_pages, dev_pages = PATTERNS[pattern]
    device = _device(stacked)
    _fill_device(device)
    host = HostKVPool(LAYOUT, SLOTS, host_layout=host_layout)
    engine = CopyEngine(device, host)
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


def test_scattered_pages_on_a_cpu_pool_copy_as_integer_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One-page runs are copied as int64 rows: under torch's parallel grain, no fork per page."""
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 0)  # one run per page
    device = _device(True)
    _fill_device(device)
    host = HostKVPool(LAYOUT, SLOTS, host_layout="page_first")
    engine = CopyEngine(device, host)
    host_pages, dev_pages = PATTERNS["both scattered"]
    plan = engine.plan(_slots(host_pages), _slots(dev_pages))
    assert plan.runs is not None and plan.device_runs is None
    want = _expect(device, _slots(dev_pages))
    engine.backup_all_layers(plan)
    dtypes: list[torch.dtype] = []
    real = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        dtypes.append(self.dtype)
        return real(self, src, non_blocking)

    device.buffers[0][1].zero_()
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    engine.load_layer(1, plan)
    monkeypatch.setattr(torch.Tensor, "copy_", real)
    assert torch.equal(device.buffers[0][1][_slots(dev_pages)], want[0][1])
    assert len(dtypes) == 2 * len(host_pages)  # K and V, one copy a page
    assert set(dtypes) == {torch.int64}


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
    device = _device(True)
    _fill_device(device)
    host = HostKVPool(LAYOUT, SLOTS, host_layout=host_layout)
    engine = CopyEngine(device, host)
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
    device = _device(stacked)
    _fill_device(device)
    host = HostKVPool(LAYOUT, SLOTS, host_layout=host_layout)
    engine = CopyEngine(device, host)
    h, d = _slots(host_pages), _slots(dev_pages)
    plan = engine.plan(h, d)
    engine.device = torch.device("cuda")  # only the branch choice reads it in a backup
    want = _expect(device, d)
    engine.backup_all_layers(plan)
    for b in range(LAYOUT.num_buffers):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(host.layer(b, layer)[h], want[b][layer])
