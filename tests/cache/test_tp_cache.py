"""Two CPU ranks over gloo, through `TierCache`: a rank whose prefetch returns
early (no host room) still joins the hit-count agreement, so no rank blocks."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("tp_cache_worker.py")


async def _run_ranks(tmp_path: Path, full_rank: int) -> list[dict[str, Any]]:
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            str(rank),
            "2",
            init,
            str(full_rank),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout=60)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await asyncio.gather(*(p.wait() for p in procs))
        pytest.fail("the ranks deadlocked in the hit-count agreement")
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    return [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]


async def test_a_rank_without_host_room_still_joins_the_agreement(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, full_rank=1)
    for r in results:
        # Round 0: one rank had no host room, so the agreed MIN is 0 on both;
        # then both fetch the whole prompt.
        assert r["got"] == [0, 64, 64], results
        assert r["host_free"] == 256, results
