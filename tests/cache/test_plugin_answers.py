"""A storage plugin that breaks the answer contract costs misses, never wrong KV or a failure.

The plugin here stores and reads pages correctly, then answers in a shape the
`StorageBackend` docs do not allow: a count that is not an int, a flag list
of the wrong length, no list at all. The cache must treat such an answer as a
failed call (a miss, a skipped backup) and keep serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.memory import MemoryBackend


class OddAnswers(MemoryBackend):
    """A memory backend whose answers are replaced by ``odd`` once ``on`` is set."""

    def __init__(self, op: str, odd: Any) -> None:
        super().__init__()
        self.op, self.odd, self.on = op, odd, False

    def _answer(self, op: str, real: Any, n: int) -> Any:
        if not self.on or op != self.op:
            return real
        return self.odd(n) if callable(self.odd) else self.odd

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        return self._answer("exists", await super().batch_exists(keys), len(keys))  # type: ignore[no-any-return]

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._answer("get", await super().batch_get(keys, pages), len(keys))  # type: ignore[no-any-return]

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        return self._answer("set", await super().batch_set(keys, pages), len(keys))  # type: ignore[no-any-return]


CONFIG = dict(
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    page_size=16,
    device_tokens=1024,
    host_ratio=2.0,
    prefetch_policy="wait_complete",
    prefetch_threshold=16,
    storage_io_batch_pages=2,
)
PROMPT = [(13 * i + 5) % 30000 for i in range(129)]


def fill(cache: TierCache, slots: torch.Tensor) -> None:
    for b, bufs in enumerate(cache.device_pool.buffers):
        for layer, buf in enumerate(bufs):
            buf[slots] = torch.arange(slots.numel(), dtype=buf.dtype)[:, None, None] + 100 * (
                2 * layer + b
            )


def expected(cache: TierCache, n: int) -> list[torch.Tensor]:
    return [
        torch.arange(n, dtype=buf.dtype)[:, None, None].expand(n, *buf.shape[1:])
        + 100 * (2 * layer + b)
        for b, bufs in enumerate(cache.device_pool.buffers)
        for layer, buf in enumerate(bufs)
    ]


async def served(cache: TierCache) -> int:
    """Serve PROMPT; check the KV of its cached prefix is what was stored. Returns its length."""
    async with cache.request(PROMPT) as req:
        await req.wait_loaded()
        got = req.cached_tokens
        for buf, want in zip(
            (buf for bufs in cache.device_pool.buffers for buf in bufs),
            expected(cache, got),
            strict=True,
        ):
            assert torch.equal(buf[req.prefix_indices], want)
    return got


async def store(backend: OddAnswers) -> None:
    async with TierCache(TierCacheConfig(**CONFIG)) as cache:  # type: ignore[arg-type]
        await cache.attach_storage(backend)
        async with cache.request(PROMPT) as req:
            slots = await req.alloc(len(PROMPT))
            fill(cache, slots)
            await req.commit(PROMPT, slots)
        await cache.wait_idle()
        await cache.detach_storage()


@pytest.mark.parametrize(
    ("op", "odd"),
    [
        ("exists", [True] * 8),
        ("exists", None),
        ("exists", 2.0),
        ("get", None),
        ("get", 3),
        ("get", lambda n: [True] * (n + 3)),
        ("get", lambda n: [True] * (n - 1)),
        ("get", lambda n: (True for _ in range(n))),
    ],
)
async def test_an_ill_formed_read_answer_is_a_miss(op: str, odd: Any) -> None:
    backend = OddAnswers(op, odd)
    await store(backend)
    backend.on = True
    async with TierCache(TierCacheConfig(**CONFIG)) as cache:  # type: ignore[arg-type]
        await cache.attach_storage(backend)
        got = await served(cache)
        assert got == 0
        assert cache.stats().storage_errors > 0
        await cache.detach_storage()
    await backend.aclose()


@pytest.mark.parametrize("odd", [None, lambda n: [True] * (n + 3), lambda n: [True] * (n - 1)])
async def test_an_ill_formed_write_answer_is_a_failed_backup(odd: Any) -> None:
    backend = OddAnswers("set", odd)
    backend.on = True
    await store(backend)  # no StateError at wait_idle or close
    backend.on = False
    async with TierCache(TierCacheConfig(**CONFIG)) as cache:  # type: ignore[arg-type]
        await cache.attach_storage(backend)
        await served(cache)  # whatever part was stored is the right KV
        await cache.detach_storage()
    await backend.aclose()
