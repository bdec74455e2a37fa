"""Set-up of the SGLang suite: SGLang's real modules, a one-process gloo group, stores.

Without SGLang the tests skip with the reason, except under
``TIERCACHE_REQUIRE_ENGINES=1`` (``make test-sglang``, CI), where they fail.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integrations.sglang import sglang_helpers as h
from tests.redis_server import RedisServer, require_redis_server


@pytest.fixture(autouse=True)
def sglang_required() -> None:
    """Skip (or, where SGLang is required, fail) every test of this suite when SGLang is missing."""
    _, why = h.load()
    if why is not None:
        if h.required():
            pytest.fail(f"{h.REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def process_group() -> Iterator[None]:
    """torch.distributed with one gloo rank: SGLang's controller asks its group's size."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch, process_group: None) -> Iterator[None]:
    """SGLang's parallel state patched to a single CPU rank."""
    with h.single_rank(monkeypatch):
        yield


@pytest.fixture
def instances(ranks: None) -> Iterator[list[h.Instance]]:
    """Controllers made by a test; each is detached (backend closed, threads joined) after it."""
    made: list[h.Instance] = []
    yield made
    for inst in made:
        inst.close()


@pytest.fixture
def file_store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = require_redis_server()
    with RedisServer(binary) as server:
        yield server
