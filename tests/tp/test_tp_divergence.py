"""Two ranks whose storage or index diverge still agree: no rank waits forever, and
every rank reports the same ``cached_tokens`` for the same request.

Each rank has its own file store. Before a restart the ranks cache six
128-token prompts (written through to storage); after it they serve them
again (`tests/tp/tp_divergence_worker.py`). The divergences:

- rank 0's storage fails every call, under ``auto_detach``: the detach is
  agreed, so both ranks detach it at the same agreement and serve from
  compute (before, rank 1 waited in an agreement rank 0 never joined);
- rank 1's storage reads take 0.4 s, under ``timeout`` (0.2 s): the ranks
  agree on the MIN of the tokens each completed, as SGLang does on
  completion (before, rank 0 reported 128 where rank 1 reported 0);
- rank 0 has nothing to fetch (it computed the prompts again after the
  restart), so its prefetches return early: it still joins every agreement,
  with the prefix it holds, so rank 1 fetches up to there and both report
  the whole prompt (before, rank 0 reported 128 where rank 1 reported 0);
- rank 0 holds the first half of each prompt: the ranks agree where the
  prefix ends, not how many pages each one hits, and each fetches from its
  own start up to that end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.tp_ranks import run_ranks

WORKER = Path(__file__).with_name("tp_divergence_worker.py")


async def _ranks(tmp_path: Path, scenario: str, backend: str = "gloo") -> list[dict[str, Any]]:
    store = tmp_path / "store"
    return await run_ranks(WORKER, tmp_path, [[scenario, str(store), backend]] * 2)


async def test_ranks_without_divergence_both_serve_from_storage(tmp_path: Path) -> None:
    r0, r1 = await _ranks(tmp_path, "healthy")
    assert r0["cached"] == r1["cached"] == [128] * 6


async def test_storage_failing_on_one_rank_is_detached_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = await _ranks(tmp_path, "fail0")
    assert r0["cached"] == r1["cached"] == [0] * 6
    assert r0["attached"] is r1["attached"] is False
    assert r0["auto_detaches"] == r1["auto_detaches"] == 1


async def test_slow_storage_on_one_rank_gives_both_the_same_cached_tokens(tmp_path: Path) -> None:
    r0, r1 = await _ranks(tmp_path, "slow1")
    assert r0["cached"] == r1["cached"], (r0, r1)
    assert r0["attached"] and r1["attached"]


async def test_a_rank_with_nothing_to_fetch_still_joins_the_agreement(tmp_path: Path) -> None:
    r0, r1 = await _ranks(tmp_path, "warm0")
    # Rank 0 computed the prompts again (a device hit, nothing to fetch): it
    # joins with the prefix it holds, so rank 1 fetches up to it from storage.
    assert r0["cached"] == r1["cached"] == [128] * 6, (r0, r1)


async def test_ranks_that_hold_different_prefixes_fetch_up_to_the_same_end(tmp_path: Path) -> None:
    r0, r1 = await _ranks(tmp_path, "half0")
    assert r0["cached"] == r1["cached"] == [128] * 6, (r0, r1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("scenario", ["healthy", "fail0", "slow1", "warm0", "half0"])
async def test_the_divergences_over_an_nccl_tp_group(tmp_path: Path, scenario: str) -> None:
    """The model's NCCL group passed as ``tp_group``: the agreements run over gloo
    groups of their own, never on a CUDA stream."""
    r0, r1 = await _ranks(tmp_path, scenario, "nccl")
    assert r0["cached"] == r1["cached"], (r0, r1)
    if scenario in ("healthy", "warm0", "half0"):
        assert r0["cached"] == [128] * 6
    if scenario == "fail0":
        assert r0["attached"] is r1["attached"] is False
