"""Two CPU ranks over gloo, through `TierCache`: a rank whose prefetch returns
early (no host room) still joins the hit-count agreement, so no rank blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tp_ranks import run_ranks

WORKER = Path(__file__).with_name("tp_cache_worker.py")


async def _run_ranks(tmp_path: Path, full_rank: int) -> list[dict[str, Any]]:
    return await run_ranks(WORKER, tmp_path, [[str(full_rank)]] * 2)


async def test_a_rank_without_host_room_still_joins_the_agreement(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, full_rank=1)
    for r in results:
        # Round 0: one rank had no host room, so the agreed MIN is 0 on both;
        # then both fetch the whole prompt.
        assert r["got"] == [0, 64, 64], results
        assert r["host_free"] == 256, results
