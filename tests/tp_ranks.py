"""Run one worker process per TP rank over gloo, and read what each reports.

A worker is a script called as ``worker RANK WORLD INIT_URL *args`` that prints
one JSON object as its last line of output.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

#: Seconds the ranks get before they count as deadlocked.
RANKS_TIMEOUT_S = 60.0


async def run_ranks(
    worker: Path, tmp_path: Path, rank_args: Sequence[Sequence[str]]
) -> list[dict[str, Any]]:
    """Start ``len(rank_args)`` ranks of ``worker``; return their JSON reports in rank order.

    Fails the test (instead of hanging) when the ranks do not finish within
    `RANKS_TIMEOUT_S` seconds: a rank left behind in a collective blocks the others.
    """
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    world = str(len(rank_args))
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(worker),
            str(rank),
            world,
            init,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for rank, args in enumerate(rank_args)
    ]
    try:
        outs = await asyncio.wait_for(
            asyncio.gather(*(p.communicate() for p in procs)), timeout=RANKS_TIMEOUT_S
        )
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await asyncio.gather(*(p.wait() for p in procs))
        pytest.fail("the ranks deadlocked in the hit-count agreement")
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    return [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
