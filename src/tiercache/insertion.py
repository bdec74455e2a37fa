"""`Inserter`: finished KV into the index (`TierCache.insert`, `Request.commit`).

An insert checks its slots before anything changes (one per token, whole
pages, none twice; the new ones allocated, not the index's, not another
open request's, no copy in flight), waits for any load still filling the
cached part (nothing may hang under KV that has not landed), then, with no
await left, inserts into the index, frees the slots of the part that was
cached already (never the index's own), hands the new pages to the index
with their producer fence, and lets the write policy write them down.

A long prompt's page hash chain is computed off the loop first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tiercache._checks import check_slot_tensor
from tiercache.cache_values import CacheStats
from tiercache.controller import TierController
from tiercache.errors import InvalidInputError, StateError
from tiercache.index.hashing import INLINE_HASH_PAGES, page_hashes
from tiercache.index.radix import RadixIndex, extra_key_prior
from tiercache.ledger import Owner
from tiercache.loads import LoadBacks
from tiercache.memory.allocator import check_slot_indices
from tiercache.write_policy import WritePolicy

__all__ = ["Inserter"]


class Inserter:
    """Inserts finished KV into the index of one open cache.

    Args:
        index: the cache's prefix index.
        controller: the cache's controller (its ledger owns the pages).
        loads: the loads back in flight.
        writes: the write policy, told of each new node.
        stats: the cache's counters.
        recheck: the facade's check after an await (open, on its loop, no
            background failure pending); raises if not.
    """

    def __init__(
        self,
        index: RadixIndex,
        controller: TierController,
        loads: LoadBacks,
        writes: WritePolicy,
        stats: CacheStats,
        recheck: Callable[[], object],
    ) -> None:
        self.index = index
        self.controller = controller
        self.loads = loads
        self.writes = writes
        self.stats = stats
        self._recheck = recheck
        self.page_size = index.page_size

    async def insert(
        self,
        toks: list[int],
        device_indices: torch.Tensor,
        extra_key: str | None,
        owner: torch.Tensor | None,
        ready: Any,
    ) -> int:
        """`TierCache.insert` of checked tokens and ``extra_key``; ``ready``: the producer's
        fence, recorded; ``owner``: slots of the committing request, which it may pass."""
        ctl = self.controller
        dev = self._slots(toks, device_indices)
        n = int(dev.numel())
        chain = await self._long_chain(toks[:n], extra_key)
        # The cached part may still be landing: wait, then decide on the
        # index as it is after the wait (no await from here on).
        cached = await self._wait_loads_under(toks[:n], extra_key, dev)
        self._recheck()
        same = self._check_new_slots(dev, cached, owner)
        result = self.index.insert(toks[:n], dev, extra_key, checked=True, chain=chain)
        self._free_duplicates(dev[: result.prefix_len], same, ready)
        books = ctl.ledger.device
        new = books.pages(dev[result.prefix_len :])
        if new.size:
            books.give(new, Owner.INDEX)
        # The producer of the new KV travels with its pages: a write of them
        # (write-through now, a write-back at eviction later) waits for it.
        books.set_producer(new, ready)
        self.stats.tokens_inserted += n - result.prefix_len
        self.writes.on_insert(result.node, ready)
        return result.prefix_len

    async def _long_chain(self, toks: list[int], extra_key: str | None) -> list[str] | None:
        """The page hash chain of a long prompt's ``toks``, hashed off the loop; else ``None``.

        ``None`` when few of its pages are new to the index (a commit that
        adds a page to a cached prompt): the index hashes those itself, in
        less time than a thread hop. The chain starts at the namespace's
        root, so it fits whatever the index holds once the hashing is done.
        """
        ps = self.page_size
        if len(toks) // ps <= INLINE_HASH_PAGES:
            return None
        known = self.index.match_prefix(toks, extra_key, touch=False, checked=True)
        if (len(toks) - known.matched_length) // ps <= INLINE_HASH_PAGES:
            return None  # the pages not in the index yet are few: hashed inline
        loop = asyncio.get_running_loop()
        # Cancelling the caller leaves the thread to finish on a list no one changes.
        return await loop.run_in_executor(None, page_hashes, toks, ps, extra_key_prior(extra_key))

    def _slots(self, toks: list[int], device_indices: torch.Tensor) -> torch.Tensor:
        """The whole-page slots of an insert, checked: one per token, page-aligned, no page twice.

        Raises:
            InvalidInputError: anything else.
        """
        ctl, ps = self.controller, self.page_size
        slots = check_slot_tensor(device_indices, "device_indices", ctl.device_pool.num_slots)
        if slots.numel() != len(toks):
            raise InvalidInputError(
                f"device_indices has {slots.numel()} slots for {len(toks)} tokens: one per token"
            )
        n = len(toks) // ps * ps
        dev = check_slot_indices(slots[:n], ps, ctl.device_pool.num_slots, "device_indices")
        if n and ctl.device_allocator.has_repeats(ctl.ledger.device.pages(dev)):
            raise InvalidInputError("device_indices lists a page twice")
        return dev

    def _check_new_slots(
        self, dev: torch.Tensor, cached: torch.Tensor, owner: torch.Tensor | None
    ) -> torch.Tensor:
        """Check the slots of an insert that are not the cached prefix's own.

        Returns:
            Per cached page, whether ``dev`` names the index's own slots for it.

        Raises:
            InvalidInputError: new slots not allocated, held by the index or
                by an open request other than ``owner``, or with a copy in flight.
        """
        ps = self.page_size
        k = int(cached.numel())
        # numpy, not torch, over slots: see `copy_slots`.
        mine = dev[:k].numpy().reshape(-1, ps)
        kept = (mine == cached.numpy().reshape(-1, ps)).all(axis=1)
        same = torch.from_numpy(kept)
        fresh = torch.from_numpy(np.concatenate([mine[~kept].reshape(-1), dev[k:].numpy()]))
        if not fresh.numel():
            return same
        books = self.controller.ledger.device
        pages = books.pages(fresh)
        if not books.allocated(pages):
            raise InvalidInputError(
                "device_indices include slots that are not allocated (use alloc_device)"
            )
        if books.owned(pages, Owner.INDEX):
            raise InvalidInputError(
                "device_indices include slots that hold other cached KV of the index"
            )
        others = pages
        if owner is not None and owner.numel():
            others = pages[~np.isin(pages, books.pages(owner))]
        if books.owned(others, Owner.REQUEST):
            raise InvalidInputError(
                "device_indices include slots an open request owns (commit them through it)"
            )
        if books.leased(pages):
            raise InvalidInputError("device_indices include slots with a copy in flight")
        return same

    def _free_duplicates(self, dup: torch.Tensor, same: torch.Tensor, ready: Any) -> None:
        """Free the slots of an insert's already-cached part, but never the index's own."""
        if not dup.numel():
            return
        ps = self.page_size
        differ = ~same[: dup.numel() // ps]
        if bool(differ.any()):
            # The producer may still be writing them: the next load waits for
            # ``ready``; the ledger's release wakes the room waiters.
            books = self.controller.ledger.device
            pages = books.pages(dup.view(-1, ps)[differ].reshape(-1))
            books.free(pages, fence=self.controller.ready_event(ready, "insert"))

    async def _wait_loads_under(
        self, toks: list[int], extra_key: str | None, dev: torch.Tensor
    ) -> torch.Tensor:
        """Wait until no load in flight fills the cached prefix of ``toks`` or any of ``dev``.

        New pages may only hang under a prefix whose bytes have landed: were
        a load under them to fail, its rollback would leave them on the
        device under a host-only parent. A load into slots of ``dev`` is one
        the caller's KV was computed on, so its failure is the caller's; a
        load of a prefix the caller holds in slots of its own is not (once
        it failed, the index takes the caller's copy instead).

        Returns:
            The device slots of the cached prefix, with no load in flight
            into them (read after the last wait: no await may follow).

        Raises:
            StateError: a load into slots of ``dev`` failed.
        """
        while True:
            cached = self.index.match_prefix(
                toks, extra_key, touch=False, checked=True
            ).device_indices
            pending = self.loads.under(cached, dev)
            if not pending:
                return cached
            for handle, mine in pending:
                try:
                    await handle
                except Exception as e:
                    if mine:
                        raise StateError(
                            f"the load back of this prefix failed ({e!r}): request it again"
                        ) from e
            self._recheck()
