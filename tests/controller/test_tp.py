"""Two CPU ranks over gloo agree on the MIN prefetch hit count."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("tp_worker.py")


async def test_two_ranks_with_different_hits_agree_on_the_min(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            str(rank),
            "2",
            init,
            str(stored),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for rank, stored in ((0, 6), (1, 3))
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout=90)
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    results = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
    # Rank 0 holds 6 pages, rank 1 holds 3: both load exactly 3 pages (48 tokens).
    for r in results:
        assert r["agreed"] == [[48, 48]] * 3, r
