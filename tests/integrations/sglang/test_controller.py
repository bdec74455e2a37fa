"""Round trips through SGLang's real HiCacheController: A backs pages up, B prefetches them.

Controller A's backup thread calls ``batch_set_v1`` (``write_storage``);
controller B's prefetch thread calls ``batch_exists`` and its IO thread
``batch_get_v1`` (``prefetch``). Two controllers share one store, as two
SGLang instances would.
"""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang

PAGES = 8

GEOMETRIES = [
    pytest.param(h.Geometry(mla=False, layout="page_first"), id="mha-page_first"),
    pytest.param(h.Geometry(mla=False, layout="layer_first"), id="mha-layer_first"),
    pytest.param(h.Geometry(mla=True, layout="page_first"), id="mla-page_first"),
    pytest.param(h.Geometry(mla=True, layout="layer_first"), id="mla-layer_first"),
]


def _tokens(n_pages: int, page_size: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(0, 1 << 31) for _ in range(n_pages * page_size)]


def _written(inst: h.Instance, tokens: list[int], seed: int = 1) -> tuple[Any, list[str]]:
    """Random KV for ``tokens`` in A's host pool, backed up by A's backup thread."""
    g = inst.geometry
    h.fill_random(inst.host, seed)
    idx = inst.host.alloc(len(tokens))
    hashes = h.chain(tokens, g.page_size)
    assert h.backup(inst, idx, tokens, hashes) == len(tokens)
    return idx, hashes


def _same_pages(a: h.Instance, a_idx: Any, b: h.Instance, b_idx: Any, n_pages: int) -> None:
    ps = a.geometry.page_size
    want = h.pages_bytes(a.host, a_idx[: n_pages * ps], ps)
    got = h.pages_bytes(b.host, b_idx[: n_pages * ps], ps)
    assert len(got) == n_pages
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert x == y, f"page {i} differs"


def _pair(
    instances: list[h.Instance], g: h.Geometry, cfg: dict[str, Any]
) -> tuple[h.Instance, h.Instance]:
    a = h.make_instance(g, cfg)
    instances.append(a)
    b = h.make_instance(g, cfg)
    instances.append(b)
    return a, b


@pytest.mark.parametrize("g", GEOMETRIES)
def test_round_trip_two_controllers_sharing_a_file_store(
    instances: list[h.Instance], file_store: str, g: h.Geometry
) -> None:
    a, b = _pair(instances, g, h.extra(file_store))
    tokens = _tokens(PAGES, g.page_size)
    a_idx, _ = _written(a, tokens)
    assert a.backend.stats()["set_stored"] == PAGES

    got = h.prefetch(b, tokens)
    assert got.hit_tokens == len(tokens)
    assert got.completed_tokens == len(tokens)
    _same_pages(a, a_idx, b, got.host_indices, PAGES)
    s = b.backend.stats()
    assert s["exists_hits"] == PAGES and s["get_hits"] == PAGES


@pytest.mark.parametrize(
    "g",
    [
        pytest.param(h.Geometry(mla=False, layout="page_first"), id="mha-page_first"),
        pytest.param(h.Geometry(mla=True, layout="layer_first"), id="mla-layer_first"),
    ],
)
def test_round_trip_two_controllers_sharing_redis(
    instances: list[h.Instance], redis_server: Any, g: h.Geometry
) -> None:
    a, b = _pair(instances, g, h.extra(redis_server.url))
    tokens = _tokens(PAGES, g.page_size, seed=3)
    a_idx, _ = _written(a, tokens, seed=4)

    got = h.prefetch(b, tokens)
    assert got.hit_tokens == got.completed_tokens == len(tokens)
    _same_pages(a, a_idx, b, got.host_indices, PAGES)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_round_trip_through_the_generic_path(
    instances: list[h.Instance], file_store: str, layout: str
) -> None:
    """Without ``interface_v1`` the controller moves flat page tensors (batch_get/batch_set)."""
    g = h.Geometry(layout=layout)
    a, b = _pair(instances, g, h.extra(file_store, interface_v1=0))
    tokens = _tokens(PAGES, g.page_size, seed=5)
    a_idx, _ = _written(a, tokens, seed=6)

    got = h.prefetch(b, tokens)
    assert got.completed_tokens == len(tokens)
    _same_pages(a, a_idx, b, got.host_indices, PAGES)


def test_pages_written_by_the_generic_path_are_read_by_the_zero_copy_path(
    instances: list[h.Instance], file_store: str
) -> None:
    g = h.Geometry(layout="layer_first")
    a = h.make_instance(g, h.extra(file_store, interface_v1=0))
    instances.append(a)
    b = h.make_instance(g, h.extra(file_store, interface_v1=1))
    instances.append(b)
    tokens = _tokens(PAGES, g.page_size, seed=7)
    a_idx, _ = _written(a, tokens, seed=8)

    got = h.prefetch(b, tokens)
    assert got.completed_tokens == len(tokens)
    _same_pages(a, a_idx, b, got.host_indices, PAGES)


def test_partial_existence_prefetches_the_leading_run(
    instances: list[h.Instance], file_store: str
) -> None:
    g = h.Geometry()
    a, b = _pair(instances, g, h.extra(file_store))
    ps = g.page_size
    tokens = _tokens(PAGES, ps, seed=9)
    hashes = h.chain(tokens, ps)
    h.fill_random(a.host, 10)
    a_idx = a.host.alloc(len(tokens))
    # Pages 0-4 and 6-7 are stored; page 5 is not.
    assert h.backup(a, a_idx[: 5 * ps], tokens[: 5 * ps], hashes[:5]) == 5 * ps
    assert h.backup(a, a_idx[6 * ps :], tokens[6 * ps :], hashes[6:]) == 2 * ps

    got = h.prefetch(b, tokens)
    assert got.hit_tokens == got.completed_tokens == 5 * ps
    _same_pages(a, a_idx, b, got.host_indices, 5)


def test_a_prefix_never_stored_is_a_miss(instances: list[h.Instance], file_store: str) -> None:
    g = h.Geometry()
    a, b = _pair(instances, g, h.extra(file_store))
    _written(a, _tokens(PAGES, g.page_size, seed=11))

    got = h.prefetch(b, _tokens(PAGES, g.page_size, seed=12))
    assert got.hit_tokens == got.completed_tokens == 0
    assert b.backend.stats()["get_pages"] == 0


def test_a_corrupt_page_is_a_miss_and_is_removed(
    instances: list[h.Instance], tmp_path: Path, file_store: str
) -> None:
    g = h.Geometry()
    a, b = _pair(instances, g, h.extra(file_store))
    ps = g.page_size
    tokens = _tokens(PAGES, ps, seed=13)
    a_idx, hashes = _written(a, tokens, seed=14)
    (victim,) = (tmp_path / "store").rglob(f"*{hashes[3]}*")
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit in the payload
    victim.write_bytes(bytes(data))

    got = h.prefetch(b, tokens)
    assert got.hit_tokens == PAGES * ps  # the file is there...
    assert got.completed_tokens == 3 * ps  # ...but its bytes are refused
    _same_pages(a, a_idx, b, got.host_indices, 3)
    assert b.backend.stats()["backend.corrupt_pages"] == 1
    assert b.backend.batch_exists(hashes[3:]) == 0


def test_backend_down_mid_prefetch_is_a_miss_and_sglang_keeps_serving(
    instances: list[h.Instance],
    redis_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = h.Geometry()
    cfg = h.extra(redis_server.url, timeout_s=2.0)
    a, b = _pair(instances, g, cfg)
    ps = g.page_size
    tokens = _tokens(PAGES, ps, seed=15)
    _written(a, tokens, seed=16)
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))

    # The hit query answers, then the server dies before the IO thread reads.
    real_exists = b.backend.batch_exists

    def exists_then_die(keys: list[str], extra_info: Any = None) -> int:
        n = real_exists(keys, extra_info)
        redis_server.kill()
        return n

    monkeypatch.setattr(b.backend, "batch_exists", exists_then_die)
    with caplog.at_level(logging.WARNING):
        got = h.prefetch(b, tokens)
    assert got.hit_tokens == PAGES * ps
    assert got.completed_tokens == 0
    assert b.backend.stats()["errors"] + b.backend.stats()["timeouts"] >= 1
    monkeypatch.setattr(b.backend, "batch_exists", real_exists)

    # While the server is down: misses, no exception.
    assert h.prefetch(b, tokens).completed_tokens == 0

    # The server comes back (empty: it keeps nothing on disk): both instances serve again.
    redis_server.start()
    a_idx, _ = _written(a, tokens, seed=17)
    got = h.prefetch(b, tokens)
    assert got.completed_tokens == PAGES * ps
    _same_pages(a, a_idx, b, got.host_indices, PAGES)

    assert escaped == []
    sglang_errors = [
        r for r in caplog.records if r.name.startswith("sglang") and r.levelno >= logging.ERROR
    ]
    assert sglang_errors == [], [r.getMessage() for r in sglang_errors]
    threads = [b.controller.prefetch_thread, b.controller.backup_thread]
    assert all(t.is_alive() for t in threads)
