"""Two vLLM engine processes share one ``tiercache serve``: A stores blocks, B loads the same bytes.

Each process runs vLLM 0.33's real ``TieringOffloadingManager`` (built by
vLLM's own spec and ``SecondaryTierFactory``) with tiercache as its secondary
tier on ``tiercache+unix://`` (engine_process.py). A offloads blocks and its
tier commits them to the node's server; B, a separate process with its own
CPU region, finds them through vLLM's lookups, promotes them into its region
and reads them back. B's bytes are compared with the bytes A stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integrations.node_server import NodeServer, run_engine_process
from tests.integrations.vllm.engine import require_vllm

require_vllm()

from tests.integrations.vllm.engine_process import block_data  # noqa: E402

pytestmark = pytest.mark.vllm

ENGINE = "tests.integrations.vllm.engine_process"
BLOCKS = 6
BLOCK = 4096


@pytest.fixture
def server() -> Iterator[NodeServer]:
    with NodeServer() as s:
        yield s


def _engine(url: str, role: str, seed: int, out: Path, **fields: Any) -> Any:
    req = {"role": role, "url": url, "blocks": BLOCKS, "block_bytes": BLOCK, "seed": seed}
    return run_engine_process(ENGINE, {**req, "out": str(out), **fields})


@pytest.mark.timeout(600)  # two processes, each importing vLLM
def test_b_loads_the_blocks_a_stored_through_one_server(server: NodeServer, tmp_path: Path) -> None:
    assert _engine(server.url, "store", 1, tmp_path / "a.bin") == {"stored": BLOCKS}

    b = _engine(server.url, "load", 1, tmp_path / "b.bin", miss_seed=2)
    # Blocks no process stored are misses...
    assert b["miss_steps"][-1] == ["MISS"] * BLOCKS, b["miss_steps"]
    # ...and A's blocks are found, promoted and read back with A's bytes.
    steps = b["steps"]
    assert steps[0] == ["RETRY"] * BLOCKS, steps  # the existence query runs off the scheduler
    assert steps[-1] == ["HIT"] * BLOCKS, steps
    got = (tmp_path / "b.bin").read_bytes()
    want = block_data(BLOCKS, BLOCK, 1)
    assert [got[i * BLOCK : (i + 1) * BLOCK] for i in range(BLOCKS)] == want
