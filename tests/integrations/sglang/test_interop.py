"""Pages SGLang stores through the backend are read by a TierCache, and the reverse.

Both sides key pages with the same hash chain and the same namespace (model,
dtype, KV shape, host layout, page size, TP shard), and store the same bytes:
SGLang's host layouts are tiercache's.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from tests.integrations.sglang import sglang_helpers as h

from tiercache import TierCache, TierCacheConfig

pytestmark = pytest.mark.sglang

PAGES = 6
MODEL = "test-model"

GEOMETRIES = [
    pytest.param(h.Geometry(mla=False, layout="page_first"), id="mha-page_first"),
    pytest.param(h.Geometry(mla=False, layout="layer_first"), id="mha-layer_first"),
    pytest.param(h.Geometry(mla=True, layout="page_first"), id="mla-page_first"),
    pytest.param(h.Geometry(mla=True, layout="layer_first"), id="mla-layer_first"),
]


def _config(g: h.Geometry, url: str) -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=g.layers,
        num_kv_heads=1 if g.mla else g.heads,
        head_dim=g.kv_lora_rank + g.rope_dim if g.mla else g.head_dim,
        dtype=g.dtype,
        page_size=g.page_size,
        mla=g.mla,
        model=MODEL,
        device_tokens=256,
        host_layout=g.layout,
        storage_url=url,
        prefetch_policy="wait_complete",
        prefetch_threshold=g.page_size,
    )


def _sglang_page(device_pool: Any, slots: torch.Tensor, g: h.Geometry) -> bytes:
    """The page of tiercache device slots ``slots``, flattened as SGLang's host layout orders it."""
    L = g.layers
    if g.mla:
        t = torch.stack([device_pool.kv_buffer[layer][slots] for layer in range(L)])  # L, ps, 1, D
        t = t if g.layout == "layer_first" else t.permute(1, 0, 2, 3)
    else:
        t = torch.stack(
            [
                torch.stack([device_pool.buffers[b][layer][slots] for layer in range(L)])
                for b in (0, 1)
            ]
        )  # 2, L, ps, H, D
        t = t if g.layout == "layer_first" else t.permute(0, 2, 1, 3, 4)
    return bytes(t.contiguous().view(torch.uint8).numpy())


def _tokens(seed: int, g: h.Geometry) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(0, 32000) for _ in range(PAGES * g.page_size)]


@pytest.mark.parametrize("g", GEOMETRIES)
def test_a_tiercache_reads_pages_sglang_stored(
    instances: list[h.Instance], file_store: str, g: h.Geometry
) -> None:
    a = h.make_instance(g, h.extra(file_store), model_name=MODEL)
    instances.append(a)
    tokens = _tokens(1, g)
    h.fill_random(a.host, 2)
    a_idx = a.host.alloc(len(tokens))
    assert h.backup(a, a_idx, tokens, h.chain(tokens, g.page_size)) == len(tokens)
    want = h.pages_bytes(a.host, a_idx, g.page_size)

    async def read() -> list[bytes]:
        async with TierCache(_config(g, file_store)) as cache:
            # A request always leaves its last token to compute: ask for a
            # continuation, so that every stored page is a prefix page.
            async with cache.request([*tokens, 0]) as req:
                assert req.cached_tokens == len(tokens)
                slots = req.prefix_indices
                await req.wait_loaded()
                ps = g.page_size
                return [
                    _sglang_page(cache.device_pool, slots[i : i + ps], g)
                    for i in range(0, len(tokens), ps)
                ]

    assert asyncio.run(read()) == want


@pytest.mark.parametrize("g", GEOMETRIES)
def test_sglang_reads_pages_a_tiercache_stored(
    instances: list[h.Instance], file_store: str, g: h.Geometry
) -> None:
    tokens = _tokens(3, g)
    gen = torch.Generator().manual_seed(4)

    async def write() -> list[bytes]:
        async with TierCache(_config(g, file_store)) as cache:
            async with cache.request(tokens) as req:
                slots = await req.alloc(len(tokens))
                for bufs in cache.device_pool.buffers:
                    for layer in bufs:
                        raw = layer.view(torch.uint8)
                        raw[slots] = torch.randint(
                            0, 256, raw[slots].shape, dtype=torch.uint8, generator=gen
                        )
                await req.commit(tokens, slots)
            await cache.wait_idle()
            ps = g.page_size
            return [
                _sglang_page(cache.device_pool, slots[i : i + ps], g)
                for i in range(0, len(tokens), ps)
            ]

    want = asyncio.run(write())
    b = h.make_instance(g, h.extra(file_store), model_name=MODEL)
    instances.append(b)
    got = h.prefetch(b, tokens)
    assert got.completed_tokens == len(tokens)
    assert h.pages_bytes(b.host, got.host_indices, g.page_size) == want
