"""Page and key helpers shared by the storage tests."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from tiercache.memory import HostKVPool, KVLayout, PageBuffer
from tiercache.storage import PageKey

#: A small layout: 4-token pages of 2 layers x 2 heads x 8 dims fp16 (512 bytes a page).
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
FORMAT = "test:page"


def keys(n: int) -> list[PageKey]:
    """``n`` distinct valid keys shaped like real ones (namespace digest, page hash)."""
    return [PageKey(f"0123456789abcdef-{os.urandom(32).hex()}") for _ in range(n)]


def random_page(nbytes: int = 512, fmt: str = FORMAT) -> PageBuffer:
    return PageBuffer.from_bytes(os.urandom(nbytes), fmt)


def host_pool(host_layout: str, num_slots: int = 32, seed: int = 0) -> HostKVPool:
    """A host pool filled with random values (build it outside the event loop)."""
    pool = HostKVPool(LAYOUT, num_slots, host_layout=host_layout, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(pool.buffer.dtype))
    return pool


def slots(*pages: int) -> torch.Tensor:
    """Slot indices of the given page numbers of the test layout."""
    ps = LAYOUT.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


async def page_file_size(root: Path) -> int:
    """Bytes of a file store's page file of a `random_page` (header included); leaves none."""
    from tiercache.storage.file import FileBackend, shard_dir

    (k,) = keys(1)
    async with await FileBackend.open(root) as probe:
        await probe.batch_set([k], [random_page()])
        path = root / shard_dir(k) / f"{k}.page"
        size = (await asyncio.to_thread(os.stat, path)).st_size
        await probe.clear()
    return size
