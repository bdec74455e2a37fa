"""Edge inputs to the request verbs get one answer whatever state the request is in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import InvalidInputError, StateError

PS = 16


def config() -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=128,
        host_tokens=256,
        model="edge-inputs",
    )


@pytest.mark.parametrize("layer", [-1, 2, 99, "0", 1.0, True, None])
async def test_layer_ready_refuses_a_bad_layer_with_or_without_a_pending_load(layer: Any) -> None:
    """A bad layer was accepted silently when nothing was loading, and refused
    when a load was: now it is refused either way."""
    async with TierCache(config()) as cache:
        prompt = list(range(100, 132))
        slots = await cache.alloc_device(32)
        await cache.insert(prompt, slots)
        async with cache.request([*prompt, 1]) as req:
            assert not req.loads
            with pytest.raises(InvalidInputError, match="layer"):
                req.layer_ready(layer)
        await cache.wait_idle()
        await cache.evict_device(128)  # the prefix is host-only: the next request loads it
        async with cache.request([*prompt, 2]) as req:
            assert req.loads
            with pytest.raises(InvalidInputError, match="layer"):
                req.layer_ready(layer)
            await req.wait_loaded()
            assert req.cached_tokens == 32


async def test_layer_ready_accepts_every_layer() -> None:
    async with TierCache(config()) as cache:
        async with cache.request([1, 2, 3]) as req:
            for layer in range(cache.layout.num_layers):
                req.layer_ready(layer)
            slots = await req.alloc(3)
            assert slots.dtype == torch.int64


async def test_load_back_of_a_stale_match_is_refused_not_served_from_freed_slots() -> None:
    """A match taken before an eviction or a flush named slots that were freed
    meanwhile; `load_back` returned them as the prefix (KV that is not there)."""
    async with TierCache(config()) as cache:
        prompt = list(range(100, 132))
        slots = await cache.alloc_device(32)
        await cache.insert(prompt, slots)
        fresh = cache.match_prefix(prompt)
        assert fresh.device_tokens == 32 and fresh.host_tokens == 0
        got, handle = await cache.load_back(fresh)
        assert torch.equal(got, slots) and handle is None
        await cache.wait_idle()
        await cache.flush()
        with pytest.raises(StateError, match="match again"):
            await cache.load_back(fresh)
        # Reinserted in other slots: the old match still names the old ones.
        other = await cache.alloc_device(64)
        await cache.insert(prompt, other[32:])
        with pytest.raises(StateError, match="match again"):
            await cache.load_back(fresh)
        got, _ = await cache.load_back(cache.match_prefix(prompt))
        assert torch.equal(got, other[32:])
        cache.free_device(other[:32])
        assert cache.stats().extra["device_free"] == 128 - 32


@pytest.mark.parametrize("ready", ["stream", 1, object()])
async def test_free_device_checks_ready_before_it_frees(ready: Any) -> None:
    """``ready`` names the slots' last readers (CUDA); on a CPU pool anything but
    ``None`` is refused, and the refused call frees nothing."""
    async with TierCache(config()) as cache:
        slots = await cache.alloc_device(32)
        with pytest.raises(InvalidInputError, match="ready"):
            cache.free_device(slots, ready=ready)
        assert cache.controller.device_allocator.is_allocated(slots)
        cache.free_device(slots, ready=None)
        assert cache.stats().extra["device_free"] == 128
