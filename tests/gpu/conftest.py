"""Fixtures shared by the CUDA tests (they skip without a GPU: see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    """Spin-kernel cycles per millisecond on this GPU (for ``torch.cuda._sleep``)."""
    torch.cuda.init()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)
