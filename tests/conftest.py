"""Shared test set-up: every async test runs on asyncio and on uvloop, in debug
mode, with blocking calls on the event loop turned into failures."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
import uvloop
from blockbuster import BlockBuster, blockbuster_ctx

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _debug(factory: LoopFactory) -> LoopFactory:
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_debug(True)
        # Debug mode logs callbacks slower than this; copies are offloaded, so
        # only a genuinely blocking callback would get near it.
        loop.slow_callback_duration = 0.5
        return loop

    return make


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    return {"asyncio": _debug(asyncio.new_event_loop), "uvloop": _debug(uvloop.new_event_loop)}


@pytest.fixture(autouse=True)
def blockbuster(request: pytest.FixtureRequest) -> Iterator[BlockBuster | None]:
    """Fail any test whose tiercache code blocks the event loop thread."""
    if request.node.get_closest_marker("allow_blocking") is not None:
        yield None
        return
    with blockbuster_ctx(["tiercache"]) as bb:
        # Sizing a host pool reads /proc/meminfo and the cgroup limit: virtual
        # files served from kernel memory, which never wait on a device.
        for fn in ("io.TextIOWrapper.read", "io.BufferedReader.read"):
            if fn in bb.functions:
                bb.functions[fn].can_block_in("tiercache/memory/pools.py", "available_host_memory")
        yield bb


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """No test may leave a tiercache worker thread running."""
    yield
    leaked = [t for t in threading.enumerate() if t.name.startswith("tiercache") and t.is_alive()]
    if leaked:
        gc.collect()  # an executor dropped without shutdown exits once collected
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_blocking: the test may block the loop on purpose")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
