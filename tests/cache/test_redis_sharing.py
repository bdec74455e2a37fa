"""Two TierCache instances in separate processes share one Redis.

Process A computes and backs up a long prefix; process B, which never saw it,
matches it from storage and loads KV bit-identical to what A computed. The
workers run their caches on the same kind of loop as the test.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tests.redis_server import RedisServer
from tests.storage.redis_fixtures import redis_server, unique_prefix  # noqa: F401

from tiercache.storage.redis import RedisBackend

WORKER = Path(__file__).with_name("redis_worker.py")
PREFIX_TOKENS = 512


async def run_worker(role: str, url: str, key_prefix: str, out: Path) -> dict[str, Any]:
    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else ""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        role,
        url,
        key_prefix,
        str(out),
        loop or "asyncio",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode == 0, err.decode()[-3000:]
    result: dict[str, Any] = await asyncio.to_thread(torch.load, out, weights_only=True)
    return result


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` on floats would let -0.0 pass for 0.0)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


async def test_second_process_loads_bit_identical_kv_from_redis(
    redis_server: RedisServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    key_prefix = unique_prefix("share")
    try:
        a = await run_worker("compute", redis_server.url, key_prefix, tmp_path / "a.pt")
        assert a["storage_backups"] >= 1 and a["written"] > 0
        assert a["k"].shape[1] == PREFIX_TOKENS and bool(a["k"].abs().sum() > 0)

        b = await run_worker("load", redis_server.url, key_prefix, tmp_path / "b.pt")
        # B matched the whole prefix in storage and nothing else.
        assert b["cached_tokens"] == PREFIX_TOKENS
        assert b["storage_hit"] == PREFIX_TOKENS
        assert b["read"] == a["written"]
        assert same_bytes(b["k"], a["k"])
        assert same_bytes(b["v"], a["v"])
    finally:
        async with await RedisBackend.from_url(redis_server.url, prefix=key_prefix) as backend:
            await backend.clear()
