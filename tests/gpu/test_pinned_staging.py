"""A CUDA load of scattered rows goes through page-locked staging (the `gpu` marker).

Gathered into pageable memory, the upload would be synchronous: the copy
worker would wait for the whole stream ahead of it. A calibrated spin kernel
(``torch.cuda._sleep``) queued on the stream first makes that wait certain to
show.
"""

from __future__ import annotations

import time

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import CopyEngine

pytestmark = pytest.mark.gpu

PS = 4
SPIN_MS = 300.0


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


def test_a_scattered_load_queues_its_upload_from_pinned_staging(
    cycles_per_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)  # the index path
    layout = KVLayout(2, 4, 64, torch.float16, PS)
    device = DeviceKVPool(layout, 256, device="cuda")
    host = HostKVPool(layout, 256)
    g = torch.Generator().manual_seed(5)
    for b in range(layout.num_buffers):
        host.layer(b, 0).copy_(torch.randn(host.layer(b, 0).shape, generator=g).half())
    engine = CopyEngine(device, host)
    h, d = _slots([40, 3, 17, 29, 9]), _slots([7, 44, 2, 19, 58])
    plan = engine.plan(h, d)
    assert plan.runs is None
    torch.cuda._sleep(int(cycles_per_ms * SPIN_MS))  # the stream is busy for SPIN_MS
    t0 = time.perf_counter()
    engine.load_layer(0, plan)  # K and V: one span each, one staging slot each
    queued_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert queued_s < SPIN_MS / 1000 / 2  # queued, not waited for
    assert engine.staging is not None and engine.staging.pin
    assert len(engine.staging.buffers) == 1  # the ring, allocated when the engine was made
    assert all(buf.is_pinned() for buf in engine.staging.buffers)
    for b in range(layout.num_buffers):
        assert torch.equal(device.buffers[b][0][d.cuda()].cpu(), host.layer(b, 0)[h])
