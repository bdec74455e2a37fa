"""The demo's ``shared_server`` configuration: two engine processes share one ``tiercache serve``.

The first process computes the workload and leaves its KV in the node's
server; the second, a fresh process, finds it on its very first request and
generates exactly the tokens a cache-less run generates. Checked on tokens
and counts, never on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.demo import (
    CONFIG_NAMES,
    PAGE_SIZE,
    SHARED_SERVER,
    build_workload,
    model_config,
    settings_for,
)


def test_the_second_process_hits_what_the_first_computed(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tiercache", "demo", "--quick", "--no-progress", "--dir", "out"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert list(report["configs"]) == list(CONFIG_NAMES)  # the in-process ones, unchanged
    shared = report[SHARED_SERVER]
    assert "tiercache serve: ready" in shared["server"]

    # Two engine processes, neither of them the demo's own.
    pids = {shared["process_1"]["pid"], shared["process_2"]["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids

    # Process 1 started with an empty server: nothing came from storage.
    assert shared["process_1"]["hit_rates"]["storage"] == 0
    # Process 2's first request: its whole shared prefix came from the server.
    wl = build_workload(settings_for(quick=True), model_config().vocab_size)
    prefix = min(len(wl.system_prompt), len(wl.document)) // PAGE_SIZE * PAGE_SIZE
    first = shared["first_request"]
    assert first["cached_tokens"] >= prefix > 0
    assert first["cached_tokens"] < first["prompt_tokens"]
    assert shared["process_2"]["hit_rates"]["storage"] > 0
    assert shared["config"]["prefill_tokens"] < report["configs"]["no_cache"]["prefill_tokens"]

    # The tokens of both processes are the tokens of a run without any cache.
    assert report["tokens_identical"] is True
    assert report["mismatched"] == []
    assert "shared_server: process 2's first request found" in r.stdout


async def test_a_node_server_that_cannot_start_is_an_error_naming_why(tmp_path: Path) -> None:
    from tiercache.demo import _NodeServerProcess
    from tiercache.errors import TierCacheError

    server = _NodeServerProcess(tmp_path / "serve.sock", 0)  # no arena of 0 bytes
    with pytest.raises(TierCacheError, match="exited before it was ready.*arena-bytes"):
        await server.start()
    await server.stop()
    await server.stop()  # idempotent
    assert not (tmp_path / "serve.sock").exists()
