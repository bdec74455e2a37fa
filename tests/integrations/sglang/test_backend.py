"""The backend on SGLang's own host pools: the zero-copy v1 path, the generic path, TP ranks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang

GEOMETRIES = [
    pytest.param(h.Geometry(mla=mla, layout=layout), id=f"{'mla' if mla else 'mha'}-{layout}")
    for mla in (False, True)
    for layout in ("page_first", "layer_first")
]


def _backend(
    url: str, host: Any, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **options: Any
) -> Any:
    config = h.storage_config(
        extra_config=h.extra(url, **options),
        model_name="m",
        tp_rank=tp_rank,
        tp_size=tp_size,
        is_mla_model=mla,
    )
    backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def _pool(g: h.Geometry, seed: int | None) -> Any:
    host = h.host_pool(g, h.device_pool(g))
    if seed is None:
        host.kv_buffer.zero_()
    else:
        h.fill_random(host, seed)
    return host


def _keys(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return h.chain([rnd.randrange(1 << 31) for _ in range(n * 4)], 4)


@pytest.mark.parametrize("g", GEOMETRIES)
def test_v1_reads_and_writes_pages_in_place_in_the_host_pool(
    g: h.Geometry, file_store: str
) -> None:
    src, dst = _pool(g, seed=1), _pool(g, seed=None)
    a, b = _backend(file_store, src, mla=g.mla), _backend(file_store, dst, mla=g.mla)
    try:
        ps = g.page_size
        keys = _keys(6)
        src_idx = torch.arange(3 * ps, 9 * ps)  # pages 3..8 of the source pool
        dst_idx = torch.cat([torch.arange(20 * ps, 23 * ps), torch.arange(10 * ps, 13 * ps)])
        before = dst.kv_buffer.clone()
        assert a.batch_set_v1(keys, src_idx) == [True] * 6
        assert b.batch_exists(keys) == 6
        assert b.batch_get_v1(keys, dst_idx) == [True] * 6
        assert h.pages_bytes(dst, dst_idx, ps) == h.pages_bytes(src, src_idx, ps)
        # Only the six target pages changed.
        touched = torch.zeros(dst.size, dtype=torch.bool)
        touched[dst_idx] = True
        untouched = (~touched).nonzero().flatten()
        assert torch.equal(_slots(dst, g, untouched), _slots_of(before, g, untouched))
    finally:
        a.close()
        b.close()


def _slots_of(buf: torch.Tensor, g: h.Geometry, slots: torch.Tensor) -> torch.Tensor:
    """The token slots ``slots`` of a host pool buffer, in every layer and K/V."""
    if g.mla:
        dim = 1 if g.layout == "layer_first" else 0
    else:
        dim = 2 if g.layout == "layer_first" else 1
    return buf.view(torch.uint8 if buf.element_size() == 1 else torch.int16).index_select(
        dim, slots
    )


def _slots(host: Any, g: h.Geometry, slots: torch.Tensor) -> torch.Tensor:
    return _slots_of(host.kv_buffer, g, slots)


@pytest.mark.parametrize("g", GEOMETRIES)
def test_v1_pages_are_views_of_the_host_pool(g: h.Geometry) -> None:
    """Zero copy: the page buffers handed to the storage backend alias SGLang's host memory."""
    from tiercache.integrations.sglang import _pool_view

    host = _pool(g, seed=2)
    view = _pool_view(host)
    slot = 5 * g.page_size
    page = view.page(slot)
    for seg in page.segments:
        seg[:] = b"\xab" * seg.nbytes
    assert h.page_bytes(host, slot) == b"\xab" * page.nbytes
    assert page.nbytes == len(h.page_bytes(host, 0))


@pytest.mark.parametrize("g", GEOMETRIES)
def test_generic_path_round_trips_sglang_flat_pages(g: h.Geometry, file_store: str) -> None:
    src, dst = _pool(g, seed=3), _pool(g, seed=None)
    a, b = _backend(file_store, src, mla=g.mla), _backend(file_store, dst, mla=g.mla)
    try:
        ps = g.page_size
        keys = _keys(4, seed=1)
        data = [src.get_data_page(i * ps) for i in range(4)]
        assert a.batch_set(keys, data) is True
        assert all(a.exists(k) for k in keys)
        got = b.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        assert all(t is not None for t in got)
        for i, t in enumerate(got):
            dst.set_from_flat_data_page(i * ps, t)
        idx = torch.arange(4 * ps)
        assert h.pages_bytes(dst, idx, ps) == h.pages_bytes(src, idx, ps)
        # The same bytes are what the v1 path reads.
        assert b.batch_get_v1(keys, torch.arange(8 * ps, 12 * ps)) == [True] * 4
        assert h.pages_bytes(dst, torch.arange(8 * ps, 12 * ps), ps) == h.pages_bytes(src, idx, ps)
        # Single-key forms and misses.
        assert b.get(keys[0]) is not None
        assert b.get(_keys(1, seed=9)[0]) is None
        assert b.set(_keys(1, seed=10)[0], src.get_data_page(0)) is True
        assert b.batch_get(_keys(2, seed=11), None) == [None, None]
    finally:
        a.close()
        b.close()


def test_a_page_tensor_of_the_wrong_size_is_a_failed_write_not_an_exception(
    file_store: str,
) -> None:
    g = h.Geometry()
    host = _pool(g, seed=4)
    b = _backend(file_store, host)
    try:
        assert b.batch_set(_keys(1), [torch.zeros(3)]) is False
        assert b.batch_get_v1(_keys(2), torch.arange(3)) == [False, False]  # too few slots
        assert b.batch_get(_keys(2), 5) == [None, None]  # no page tensors at all
        assert b.stats()["errors"] == 3
    finally:
        b.close()


def test_mha_ranks_keep_their_own_pages(file_store: str) -> None:
    g = h.Geometry(mla=False)
    r0, r1 = _pool(g, seed=5), _pool(g, seed=6)
    b0 = _backend(file_store, r0, tp_rank=0, tp_size=2)
    b1 = _backend(file_store, r1, tp_rank=1, tp_size=2)
    try:
        ps, keys = g.page_size, _keys(3, seed=2)
        idx = torch.arange(3 * ps)
        assert b0.namespace.digest != b1.namespace.digest
        assert b0.batch_set_v1(keys, idx) == [True] * 3
        assert b1.batch_exists(keys) == 0  # rank 1 never reads rank 0's heads
        assert b1.batch_set_v1(keys, idx) == [True] * 3
        out = torch.arange(10 * ps, 13 * ps)
        assert b0.batch_get_v1(keys, out) == [True] * 3
        assert b1.batch_get_v1(keys, out) == [True] * 3
        assert h.pages_bytes(r0, out, ps) == h.pages_bytes(r0, idx, ps)
        assert h.pages_bytes(r1, out, ps) == h.pages_bytes(r1, idx, ps)
        assert h.pages_bytes(r0, idx, ps) != h.pages_bytes(r1, idx, ps)
    finally:
        b0.close()
        b1.close()


def test_mla_has_one_writer_and_every_rank_reads_its_pages(file_store: str) -> None:
    g = h.Geometry(mla=True)
    r0, r1 = _pool(g, seed=7), _pool(g, seed=None)
    b0 = _backend(file_store, r0, tp_rank=0, tp_size=2, mla=True)
    b1 = _backend(file_store, r1, tp_rank=1, tp_size=2, mla=True)
    try:
        ps, keys = g.page_size, _keys(3, seed=3)
        idx = torch.arange(3 * ps)
        assert b0.namespace.digest == b1.namespace.digest
        # Rank 1 reports success without writing: the KV is the same on every rank.
        assert b1.batch_set_v1(keys, idx) == [True] * 3
        assert b1.stats()["skipped_not_writer"] == 3
        assert b1.stats()["backend.set_pages"] == 0
        assert b1.batch_exists(keys) == 0
        assert b0.batch_set_v1(keys, idx) == [True] * 3
        assert b1.batch_exists(keys) == 3
        assert b1.batch_get_v1(keys, idx) == [True] * 3
        assert h.pages_bytes(r1, idx, ps) == h.pages_bytes(r0, idx, ps)
    finally:
        b0.close()
        b1.close()


def test_fp8_formats_look_alike_so_the_start_says_so(
    file_store: str, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang keeps fp8 KV as bytes: the host pool of either format is uint8.
    formats = (torch.float8_e4m3fn, torch.float8_e5m2)
    hosts = [_pool(h.Geometry(dtype=dt), seed=None) for dt in formats]
    with caplog.at_level("WARNING", logger="tiercache.integrations.sglang"):
        e4m3, e5m2 = (_backend(file_store, host) for host in hosts)
        named = _backend(file_store, hosts[1], model_name="m-fp8_e5m2")
    try:
        assert e4m3.namespace.dtype == e5m2.namespace.dtype == "uint8"
        assert e4m3.namespace.digest == e5m2.namespace.digest
        assert named.namespace.digest != e4m3.namespace.digest  # model_name keeps them apart
        warned = [r.getMessage() for r in caplog.records if "fp8" in r.getMessage()]
        assert len(warned) == 3 and all("model_name" in m for m in warned), warned
    finally:
        for b in (e4m3, e5m2, named):
            b.close()


def test_a_pool_of_a_named_dtype_does_not_warn(
    file_store: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="tiercache.integrations.sglang"):
        b = _backend(file_store, _pool(h.Geometry(dtype=torch.bfloat16), seed=None))
    try:
        assert b.namespace.dtype == "bfloat16"
        assert not [r for r in caplog.records if "fp8" in r.getMessage()]
    finally:
        b.close()
