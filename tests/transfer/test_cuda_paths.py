"""The CUDA copy paths, run on CPU tensors: every host<->device copy is one the GPU can
queue without the host waiting, and the staging ring never makes loads move in lockstep.

On CUDA, an asynchronous copy between the device and *pageable* host memory
is synchronous: the copying thread waits until the stream reaches it (behind
the caller's ``ready`` and earlier loads). torch makes such a pageable
temporary whenever the host side of a copy is strided (a ``page_first``
layer) or when a result is moved with ``.to("cpu")``. The engine's CUDA
branches are run here with ``engine.device`` set to CUDA on CPU tensors, a
recorder wrapping ``Tensor.copy_`` and ``Tensor.to``: every copy with one side
in host memory (the host pool or the staging ring) must have that side
contiguous, inside that memory, and be non-blocking; nothing is moved to the
CPU with ``.to``. A recording stand-in for events checks that the staging
ring records each upload on the pool's copy stream and that one load, or two
in a row, never wait for their own uploads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.transfer import engine as engine_module
from tiercache.transfer.engine import CopyEngine, PinnedStaging

PS = 4
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=PS)
SLOTS = 64 * PS

PATTERNS = {
    "contiguous": (list(range(0, 16)), list(range(8, 24))),
    "both scattered": (
        [50, 3, 17, 40, 9, 61, 22, 5, 33, 12],
        [7, 44, 2, 19, 58, 30, 11, 36, 25, 1],
    ),
    "host scattered": ([50, 3, 17, 40, 9, 61, 22, 5, 33, 12], list(range(20, 30))),
    "device scattered": (list(range(20, 30)), [50, 3, 17, 40, 9, 61, 22, 5, 33, 12]),
}


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


class FakeEvent:
    """Stands in for a CUDA event: pending until `finish`; records what waited on it."""

    log: list[tuple[str, Any]] = []

    def __init__(self) -> None:
        self.done = False
        self.stream: Any = None

    def record(self, stream: Any = None) -> None:
        self.stream = stream
        FakeEvent.log.append(("record", stream))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the host blocks here
        FakeEvent.log.append(("synchronize", self.stream))
        self.done = True


class CopyRecorder:
    """Records every ``copy_`` and ``.to`` with its host side, for the checks above."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, host_memory: list[torch.Tensor]) -> None:
        self.ranges = [
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in host_memory
        ]
        self.bad: list[str] = []
        self.crossings = 0
        real_copy, real_to = torch.Tensor.copy_, torch.Tensor.to
        recorder = self

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            recorder.check(dst, src, non_blocking)
            return real_copy(dst, src, non_blocking=non_blocking)

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            target = args[0] if args else kwargs.get("device")
            if isinstance(target, str | torch.device):
                if recorder.in_host(t):  # an upload out of host memory
                    recorder.check(None, t, bool(kwargs.get("non_blocking", False)))
                elif torch.device(target).type == "cpu":  # a download into a new tensor
                    recorder.bad.append(f".to('cpu') of {tuple(t.shape)}: pageable and blocking")
            return real_to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch.Tensor, "to", to)

    def in_host(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(lo <= p < hi for lo, hi in self.ranges)

    def check(self, dst: torch.Tensor | None, src: torch.Tensor, non_blocking: bool) -> None:
        src_host = self.in_host(src)
        dst_host = dst is not None and self.in_host(dst)
        if src_host == dst_host:
            return  # host to host (a gather into staging) or device to device
        self.crossings += 1
        host_side = src if src_host else dst
        assert host_side is not None
        if not host_side.is_contiguous():
            self.bad.append(f"strided host side {tuple(host_side.stride())}: a pageable temporary")
        if not non_blocking:
            self.bad.append("a blocking host<->device copy")


def _engine(host_layout: str, stacked: bool) -> tuple[DeviceKVPool, HostKVPool, CopyEngine]:
    if stacked:
        device = DeviceKVPool(LAYOUT, SLOTS)
    else:
        bufs = [[torch.zeros(SLOTS, 2, 8, dtype=torch.float16) for _ in range(3)] for _ in range(2)]
        device = DeviceKVPool(LAYOUT, SLOTS, k_buffers=bufs[0], v_buffers=bufs[1])
    g = torch.Generator().manual_seed(3)
    for bufs in device.buffers:
        for t in bufs:
            t.copy_(torch.randn(t.shape, generator=g).half())
    host = HostKVPool(LAYOUT, SLOTS, host_layout=host_layout)
    return device, host, CopyEngine(device, host)


def _as_cuda(engine: CopyEngine, monkeypatch: pytest.MonkeyPatch) -> PinnedStaging:
    """Make ``engine`` take its CUDA branches on CPU tensors, with a tracked staging ring."""
    engine.device = torch.device("cuda", 0)
    engine.non_blocking = True  # a pinned pool
    staging = PinnedStaging(pin=False, track=True, new_event=FakeEvent)
    staging.reserve()  # up front, as a CUDA engine does
    staging.pin = True  # queue uploads non-blocking, release on the copy stream
    engine.staging = staging
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("copy-stream", device))
    monkeypatch.setattr(
        engine_module.torch.cuda, "current_stream", lambda device=None: ("copy-stream", device)
    )
    FakeEvent.log = []
    return staging


@pytest.mark.parametrize("index_path", [False, True], ids=["runs", "index-path"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "caller-buffers"])
def test_cuda_loads_and_backups_never_copy_through_pageable_memory(
    stacked: bool, host_layout: str, pattern: str, index_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if index_path:
        monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host, engine = _engine(host_layout, stacked)
    hp, dp = PATTERNS[pattern]
    h, d = _slots(hp), _slots(dp)
    plan = engine.plan(h, d)  # planned on the CPU: the index tensors stay here
    staging = _as_cuda(engine, monkeypatch)
    want = [t[d].clone() for bufs in device.buffers for t in bufs]
    rec = CopyRecorder(monkeypatch, [host.buffer, *staging.buffers])
    engine.backup_all_layers(plan)
    for b in range(2):
        for x in range(3):
            assert torch.equal(host.layer(b, x)[h], want[b * 3 + x])
    for bufs in device.buffers:
        for t in bufs:
            t.zero_()
    landed: list[int] = []
    engine.load_all_layers(plan, landed.append)
    monkeypatch.undo()
    assert landed == [0, 1, 2]
    got = [t[d] for bufs in device.buffers for t in bufs]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert rec.crossings > 0
    assert rec.bad == []
    # Nothing waited on the host: one load's uploads never wait for each other.
    assert ("synchronize", ("copy-stream", torch.device("cuda", 0))) not in FakeEvent.log
    assert all(
        s == ("copy-stream", torch.device("cuda", 0)) for op, s in FakeEvent.log if op == "record"
    )


def test_scattered_loads_take_staging_slots_in_turn_and_never_wait_for_each_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer i's K no longer waits for layer i-1's upload, nor a load for the one before."""
    monkeypatch.setattr(engine_module, "_RUN_BREAK_EVEN_BYTES", 1 << 30)
    device, host, engine = _engine("layer_first", stacked=True)
    hp, dp = PATTERNS["both scattered"]
    plan = engine.plan(_slots(hp), _slots(dp))
    assert plan.runs is None
    staging = _as_cuda(engine, monkeypatch)
    for _ in range(2):  # two loads in a row, every upload still queued (events pending)
        engine.load_all_layers(plan)
    assert staging.waits == 0
    ops = [op for op, _ in FakeEvent.log]
    assert ops.count("record") == 2 * 3 * 2  # loads x layers x K/V: one slot each
    assert "synchronize" not in ops
    # Only when the ring comes round to a slot whose upload is still queued
    # does the host wait, for that one upload.
    for _ in range(staging.count):
        staging.take(torch.zeros(1, 8, dtype=torch.int64), 1)
    assert staging.waits > 0


def test_a_cuda_engine_allocates_its_staging_ring_when_it_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Up front, so cudaHostAlloc never runs while the GPU is busy (CPU memory here)."""
    device = DeviceKVPool(LAYOUT, SLOTS)
    monkeypatch.setattr(device, "device", torch.device("cuda", 0))
    engine = CopyEngine(device, HostKVPool(LAYOUT, SLOTS))
    staging = engine.staging
    assert staging is not None
    assert staging.nbytes == staging.count * staging.slot_bytes > 0
    ring = [b.data_ptr() for b in staging.buffers]
    staging.take(torch.zeros(1, 8, dtype=torch.int64), 4)
    assert [b.data_ptr() for b in staging.buffers] == ring  # taking a slot allocates nothing
