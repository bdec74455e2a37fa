"""float8 KV round-trips byte for byte through every copy path.

torch has no ``index_copy_`` kernel for the float8 dtypes on a CPU (and does
not promise one on CUDA): every gather and scatter of the copy engine goes
through an integer view of the same bytes. Each path (contiguous runs, the
chunked CPU load, the page gather into fresh runs, the index path of short
scattered runs, the CUDA branches run here on CPU tensors) is checked for both
float8 dtypes and both host layouts, bytes compared; then the same round trip
through `TierController` (``write`` of scattered slots, ``load`` of the host
slots it returned), on the CPU and, where there is one, on a GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import CopyEngine

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
PS = 4
SLOTS = 64 * PS

PATTERNS = {
    "contiguous": (list(range(0, 16)), list(range(8, 24))),
    "both scattered": (
        [50, 3, 17, 40, 9, 61, 22, 5, 33, 12],
        [7, 44, 2, 19, 58, 30, 11, 36, 25, 1],
    ),
    "host scattered": ([50, 3, 17, 40, 9, 61, 22, 5, 33, 12], list(range(20, 30))),
    "one page": ([13], [42]),
}


def _slots(pages: list[int], ps: int = PS) -> torch.Tensor:
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (float8 has no ``torch.equal`` on every device)."""
    return t.contiguous().view(torch.uint8).cpu()


def _fill_random(pool: DeviceKVPool, seed: int = 5) -> None:
    """Random bytes in every slot (no NaN patterns matter: only bytes are compared)."""
    g = torch.Generator().manual_seed(seed)
    for bufs in pool.buffers:
        for t in bufs:
            raw = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
            t.view(torch.uint8).copy_(raw.to(t.device))


def _zero(pool: DeviceKVPool) -> None:
    for bufs in pool.buffers:
        for t in bufs:
            t.view(torch.uint8).zero_()


def _snapshot(pool: DeviceKVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    idx = slots.to(pool.device)
    return [_bytes(t.view(torch.uint8)[idx]) for bufs in pool.buffers for t in bufs]


def _pools(
    dtype: torch.dtype, host_layout: str, stacked: bool, device: str = "cpu"
) -> tuple[DeviceKVPool, HostKVPool]:
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=PS)
    if stacked:
        dev = DeviceKVPool(lay, SLOTS, device=device)
    else:
        bufs = [
            [
                torch.zeros(SLOTS, 2, 8, dtype=torch.uint8, device=device).view(dtype)
                for _ in range(3)
            ]
            for _ in range(2)
        ]
        dev = DeviceKVPool(lay, SLOTS, k_buffers=bufs[0], v_buffers=bufs[1])
    return dev, HostKVPool(lay, SLOTS, host_layout=host_layout)


@pytest.mark.parametrize("index_path", [False, True], ids=["planned", "index-path"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "caller-buffers"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_backup_then_load_moves_every_byte(
    dtype: torch.dtype,
    stacked: bool,
    host_layout: str,
    pattern: str,
    index_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if index_path:  # short scattered runs take the index gather/scatter
        monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host = _pools(dtype, host_layout, stacked)
    _fill_random(device)
    engine = CopyEngine(device, host)
    hp, dp = PATTERNS[pattern]
    h, d = _slots(hp), _slots(dp)
    want = _snapshot(device, d)
    plan = engine.plan(h, d)
    engine.backup_all_layers(plan)
    host_bytes = [_bytes(host.layer(b, x).view(torch.uint8)[h]) for b in range(2) for x in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(host_bytes, want, strict=True))
    _zero(device)
    engine.load_all_layers(plan)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(device, d), want, strict=True))
    engine.close()


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_through_the_cuda_branches_and_staging_run_on_cpu(
    dtype: torch.dtype, host_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The branches a CUDA pool takes (layer-by-layer backup, staging gather), on CPU tensors."""
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host = _pools(dtype, host_layout, stacked=True)
    _fill_random(device)
    engine = CopyEngine(device, host)
    engine.staging = engine_module.PinnedStaging(pin=False)
    hp, dp = PATTERNS["both scattered"]
    h, d = _slots(hp), _slots(dp)
    plan = engine.plan(h, d)
    assert plan.runs is None and plan.device_runs is None
    want = _snapshot(device, d)
    engine.backup_all_layers(plan)
    _zero(device)
    for layer in range(3):
        engine.load_layer(layer, plan)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(device, d), want, strict=True))


async def _controller_round_trip(dtype: torch.dtype, host_layout: str, device: str) -> None:
    """The steps a user takes: ``write`` six scattered device slots, ``load`` them back."""
    lay = KVLayout(2, 2, 8, dtype, 1)
    dev = DeviceKVPool(lay, 64, device=device)
    host = HostKVPool(lay, 64, host_layout=host_layout)
    _fill_random(dev)
    async with TierController(dev, host) as ctl:
        every = ctl.device_allocator.alloc(64)
        assert every is not None
        scattered = torch.tensor([3, 9, 17, 22, 40, 51])
        keep = torch.ones(64, dtype=torch.bool)
        keep[scattered] = False
        ctl.device_allocator.free(every[keep])
        want = _snapshot(dev, scattered)
        ack = ctl.submit_write(scattered)
        assert ack is not None
        ctl.start_writing()
        await ack  # a failed copy raises here: it is never only logged
        loaded = ctl.submit_load(ack.host_indices)
        assert loaded is not None
        ctl.start_loading()
        await loaded
        got = _snapshot(dev, loaded.device_indices)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ctl.free_device(loaded.device_indices)
        ctl.free_host(ack.host_indices)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
async def test_fp8_write_then_load_through_the_controller(
    dtype: torch.dtype, host_layout: str
) -> None:
    await _controller_round_trip(dtype, host_layout, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
async def test_fp8_write_then_load_through_the_controller_on_cuda(
    dtype: torch.dtype, host_layout: str
) -> None:
    await _controller_round_trip(dtype, host_layout, "cuda")
    await asyncio.to_thread(torch.cuda.synchronize)


@pytest.mark.gpu
@pytest.mark.parametrize("index_path", [False, True], ids=["planned", "index-path"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_every_cuda_copy_path_moves_every_byte(
    dtype: torch.dtype,
    host_layout: str,
    pattern: str,
    index_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if index_path:
        monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host = _pools(dtype, host_layout, stacked=True, device="cuda")
    _fill_random(device)
    engine = CopyEngine(device, host)
    hp, dp = PATTERNS[pattern]
    h, d = _slots(hp), _slots(dp)
    want = _snapshot(device, d)
    plan = engine.plan(h, d)
    engine.backup_all_layers(plan)
    torch.cuda.synchronize()
    _zero(device)
    engine.load_all_layers(plan)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(device, d), want, strict=True))
