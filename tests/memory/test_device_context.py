"""CUDA calls made on tiercache's own threads run in the pool's device context.

A CUDA call on a thread that never chose a device runs in device 0's context
and creates it (about 0.5 GiB on every TP rank that is not on GPU 0). Here
recording stand-ins for the CUDA runtime note which device was current on
the calling thread when the host pool was page-locked (a `TierCache` builds
it on an ``asyncio.to_thread`` worker) and when a copy stream's threads ran
and waited for their events.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tiercache import HostKVPool, KVLayout
from tiercache.transfer import streams as streams_module
from tiercache.transfer.streams import Completion, CopyStream

_current = threading.local()


def _device_now() -> torch.device | None:
    return getattr(_current, "device", None)


@contextlib.contextmanager
def _fake_device(device: Any) -> Iterator[None]:
    before = _device_now()
    _current.device = torch.device(device)
    try:
        yield
    finally:
        _current.device = before


class _FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.device | None]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", _device_now()))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", _device_now()))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "device", _fake_device)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: setattr(_current, "device", torch.device(d))
    )
    return rt


def test_the_host_pool_is_page_locked_in_its_devices_context(fake_cuda: _FakeCudart) -> None:
    lay = KVLayout(2, 2, 8, torch.float16, 4)
    seen: list[Any] = []

    def build() -> None:  # a fresh thread: no current device, as under asyncio.to_thread
        pool = HostKVPool(lay, 64, pin_memory=True, device="cuda:1")
        seen.append(pool.device)
        del pool

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert seen == [torch.device("cuda", 1)]
    assert ("register", torch.device("cuda", 1)) in fake_cuda.calls
    assert all(dev == torch.device("cuda", 1) for _, dev in fake_cuda.calls)


class _FakeEvent:
    def __init__(self) -> None:
        self.synchronized_on: list[tuple[str, torch.device | None]] = []

    def synchronize(self) -> None:
        self.synchronized_on.append((threading.current_thread().name, _device_now()))

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def test_a_cuda_copy_streams_threads_run_on_its_device(
    fake_cuda: _FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(streams_module, "new_event", _FakeEvent)
    stream = CopyStream("ctx", torch.device("cuda", 1))
    ev = _FakeEvent()
    ran_on: list[torch.device | None] = []

    def job() -> Completion:
        ran_on.append(_device_now())
        return Completion([(ev, None)])  # type: ignore[list-item]

    try:
        stream.submit(job).result(timeout=5)
    finally:
        stream.close()
    assert ran_on == [torch.device("cuda", 1)]
    # The settle thread waited for the event with the stream's device current.
    assert [d for _, d in ev.synchronized_on] == [torch.device("cuda", 1)]
    assert all(name.startswith("tiercache-ctx-settle") for name, _ in ev.synchronized_on)
