"""A memory backend whose writes wait at a gate the test opens and closes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.memory import MemoryBackend


class GatedBackend(MemoryBackend):
    """A memory backend whose writes wait until the test opens the gate.

    Args:
        open_gate: start with the gate open (writes pass until the test clears it).
    """

    def __init__(self, *, open_gate: bool = False) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        if open_gate:
            self.gate.set()

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        await self.gate.wait()
        return await super().batch_set(keys, pages)
