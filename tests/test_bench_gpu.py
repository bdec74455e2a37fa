"""`benchmarks/bench_gpu.py` (``make bench-gpu``): what runs without a GPU, and a smoke run with one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmarks import bench_gpu
from benchmarks.common import BenchmarkSkipped


def test_it_measures_both_host_layouts_with_contiguous_and_scattered_slots() -> None:
    assert set(bench_gpu.CONFIGS) == {
        (layout, slots)
        for layout in ("layer_first", "page_first")
        for slots in ("contiguous", "scattered")
    }


def test_scattered_pages_never_form_a_run() -> None:
    pages = bench_gpu.scattered_pages(32, seed=1)
    assert sorted(pages) == list(range(0, 64, 2))
    assert all(abs(a - b) != 1 for a, b in zip(pages, pages[1:], strict=False))
    slots = bench_gpu.page_slots([3, 0], 4)
    assert slots.tolist() == [12, 13, 14, 15, 0, 1, 2, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_cuda_it_is_skipped_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkSkipped, match="CUDA"):
        bench_gpu.main(smoke=True, out_dir=tmp_path)


@pytest.mark.gpu
@pytest.mark.allow_blocking
def test_a_smoke_run_reports_every_configuration(tmp_path: Path) -> None:
    result = bench_gpu.main(smoke=True, out_dir=tmp_path)
    assert (tmp_path / "gpu.json").exists()
    rows = result["table"]["rows"]
    assert len(rows) == 2 * len(bench_gpu.CONFIGS)
    assert all(r[3] > 0 and r[4] > 0 and r[6] >= 0 for r in rows)
    assert all(r[7] is not None for r in rows if r[2] == "host -> device")
