"""Pinned host pools lock their own size: pageable memory registered in place.

The CUDA runtime is replaced by a recorder, so this runs on a CPU: it checks
what the pool asks the driver for (address, length, flags) and that it gives
the pages back when the pool goes away.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from tiercache import HostKVPool, KVLayout
from tiercache.errors import CapacityError, InvalidInputError


class FakeCudart:
    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, Any]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", (ptr, size, flags)))
        if self.fail:
            return self.fail
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_pinned_pool_registers_exactly_its_pages_and_unregisters_them(cudart: FakeCudart) -> None:
    lay = KVLayout(2, 8, 128, torch.float16, 64)  # 8 KiB a token
    slots = 5 * 64 * 41  # 41 * 5 pages: 13.1 MiB, far from a power of two
    pool = HostKVPool(lay, slots, pin_memory=True)
    assert pool.pinned
    ((kind, (ptr, size, flags)),) = cudart.calls
    assert kind == "register" and flags == 1  # cudaHostRegisterPortable
    assert ptr == pool.buffer.data_ptr() and ptr % 4096 == 0
    assert size == pool.pinned_bytes == -(-pool.nbytes // 4096) * 4096
    assert pool.pinned_bytes < pool.nbytes + 4096
    assert pool.buffer.numel() * pool.buffer.element_size() == pool.nbytes
    pool.buffer.fill_(1.0)  # the whole buffer is usable memory
    del pool
    gc.collect()
    assert cudart.calls[-1] == ("unregister", ptr)
    assert cudart.registered == {}


def test_a_refused_registration_is_a_capacity_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(fail=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    with pytest.raises(CapacityError, match="cudaHostRegister"):
        HostKVPool(lay, 256, pin_memory=True)


def test_pinning_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    with pytest.raises(InvalidInputError, match="CUDA"):
        HostKVPool(lay, 256, pin_memory=True)
