"""Two SGLang engine processes share one ``tiercache serve``: A backs up, B prefetches the same bytes.

Each engine process runs SGLang's real ``HiCacheController`` with tiercache's
HiCache storage backend on ``tiercache+unix://`` (engine_process.py). A's
backup thread commits its pages to the node's server; B, a separate process
with its own host pool, finds them with the prefetch thread's hit query and
copies them in with its IO thread. The bytes B ends up with are compared with
the bytes A backed up, page by page.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integrations.node_server import NodeServer, run_engine_process

pytestmark = pytest.mark.sglang

ENGINE = "tests.integrations.sglang.engine_process"
PAGES = 8
PAGE_SIZE = 4  # sglang_helpers.Geometry's


@pytest.fixture
def server() -> Iterator[NodeServer]:
    with NodeServer() as s:
        yield s


def _tokens(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1 << 31) for _ in range(PAGES * PAGE_SIZE)]


def _engine(url: str, role: str, tokens: list[int], out: Path, **fields: Any) -> Any:
    req = {"role": role, "url": url, "tokens": tokens, "seed": 7, "out": str(out), **fields}
    return run_engine_process(ENGINE, req)


def _pages(blob: bytes, n: int) -> list[bytes]:
    size = len(blob) // n
    assert size * n == len(blob)
    return [blob[i * size : (i + 1) * size] for i in range(n)]


@pytest.mark.timeout(600)  # two processes, each importing SGLang
@pytest.mark.parametrize(
    "geometry",
    [
        pytest.param({"mla": False, "layout": "page_first"}, id="mha-page_first"),
        pytest.param({"mla": True, "layout": "layer_first"}, id="mla-layer_first"),
    ],
)
def test_b_prefetches_the_bytes_a_backed_up_through_one_server(
    server: NodeServer, tmp_path: Path, geometry: dict[str, Any]
) -> None:
    tokens = _tokens(1)
    a = _engine(server.url, "backup", tokens, tmp_path / "a.bin", **geometry)
    assert a["backed_up"] == len(tokens)
    assert a["stats"]["set_stored"] == PAGES

    b = _engine(
        server.url, "prefetch", tokens, tmp_path / "b.bin", miss_tokens=_tokens(2), **geometry
    )
    # A prefix no process backed up is a miss...
    assert b["miss_hit_tokens"] == b["miss_completed_tokens"] == 0
    # ...and A's prefix arrives whole, with A's bytes.
    assert b["hit_tokens"] == b["completed_tokens"] == len(tokens)
    assert b["stats"]["exists_hits"] == PAGES and b["stats"]["get_hits"] == PAGES
    want = _pages((tmp_path / "a.bin").read_bytes(), PAGES)
    got = _pages((tmp_path / "b.bin").read_bytes(), PAGES)
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert x == y, f"page {i} differs"
