"""`Prefetcher`: bring pages from storage into host memory under a policy.

A prefetch starts (`Prefetcher.run`): host room for the pages after the
matched prefix, the parent pinned so the fetched pages continue it, the
controller's `TierController.prefetch` told where this rank's prefix ends
(``cached_tokens``: the TP ranks agree on it). It waits as its policy says,
then settles (`Prefetcher.settle`): what arrived is inserted as host-only
nodes, the rest is freed, the pin dropped. A rank that does not prefetch
still joins the TP agreement (`TierController.abstain_prefetch`, with the
length of its prefix), or the ranks that do would wait for it.

A caller cancelled while it waits leaves the settling to a background task:
nothing stays held.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from tiercache.cache_values import CacheMatch, CacheStats
from tiercache.config import TierCacheConfig
from tiercache.controller import TierController
from tiercache.index.radix import Node
from tiercache.room import RoomBroker
from tiercache.storage_tier import PrefetchOperation

__all__ = ["Prefetcher"]


class Prefetcher:
    """The storage prefetches of one open cache.

    Args:
        config: the cache's configuration (policies, threshold, timeouts).
        room: the cache's room broker (host room, index holds).
        stats: the cache's counters.
        tp_group: the TP process group, or ``None``.
    """

    def __init__(
        self, config: TierCacheConfig, room: RoomBroker, stats: CacheStats, tp_group: Any
    ) -> None:
        self.config = config
        self.room = room
        self.stats = stats
        self.tp_group = tp_group
        #: Flushes so far: a prefetch that spans one finds its parent and its
        #: host slots gone (`settle`).
        self.flushes = 0

    async def run(
        self, toks: list[int], match: CacheMatch, request_id: object, policy: str
    ) -> tuple[int, int]:
        """`TierCache.prefetch` once its arguments are checked.

        Returns:
            The tokens fetched, and of those the ones this prefetch added to
            the index (the rest were cached meanwhile by another request):
            its storage hits.
        """
        ctl, room = self.room.controller, self.room
        n = match.storage_candidate_tokens
        start = match.index.matched_length
        if not ctl.storage_attached:
            return 0, 0
        if n <= 0 or n < self.config.prefetch_threshold:
            # Decided from this rank's own index: with a TP group it still
            # joins the agreement (with what it holds), so a rank that does
            # prefetch never waits, and no rank fetches past this one's prefix.
            ctl.abstain_prefetch(start)
            return 0, 0
        parent = match.index.last_node
        loop = asyncio.get_running_loop()
        began = loop.time()
        host = await self._host_slots(ctl, parent, n, self._wait_s(policy, n))
        if host is None:
            # This rank cannot take part; with a TP group it still joins the
            # agreement (with what it holds), or the other ranks would block in it.
            ctl.abstain_prefetch(start)
            return 0, 0
        if not parent.is_root:
            room.pin(parent)
        wanted = toks[start : start + n]
        op = None
        try:
            op = ctl.prefetch(request_id, host, wanted, match.index.prior_hash, cached_tokens=start)
        finally:
            if op is None:  # nothing started (or refused): give back what was taken for it
                ctl.ledger.host.free(ctl.ledger.host.pages(host))
                if not parent.is_root:
                    room.unpin(parent)
        if op is None:
            return 0, 0
        self.stats.prefetches += 1
        settle = self.settle(ctl, op, wanted, parent, match.extra_key, self.flushes)
        try:
            await self._wait_policy(op, policy, n, spent=loop.time() - began)
        except BaseException:
            # Cancelled while waiting: finish on our own so the fetched pages
            # are kept (or freed) and nothing stays held.
            room.operations.spawn(settle, "a prefetch whose caller was cancelled")
            raise
        return await settle

    async def for_request(self, key: list[int], match: CacheMatch, request_id: object) -> int:
        """`TierCache.request`'s prefetch; returns the tokens it added to the index.

        With nothing to fetch, it still joins the TP agreement with the prefix
        this rank holds: every rank joins each request's agreement.
        """
        if not match.storage_candidate_tokens:
            self.room.controller.abstain_prefetch(match.index.matched_length)
            return 0
        # Hold what matched while the prefetch awaits: nothing under it may
        # be evicted meanwhile, so the prefetched pages continue it.
        with self.room.holding(match.index.last_node):
            _, stored = await self.run(key, match, request_id, self.config.prefetch_policy)
        return stored

    def _wait_s(self, policy: str, num_tokens: int) -> float:
        """How long a prefetch under ``policy`` waits for host room that copies in flight hold.

        A best-effort prefetch does not wait (it must not stall the request
        it serves), nor does any under TP (every rank must reach the
        agreement in the same order).
        """
        if policy == "best_effort" or self.tp_group is not None:
            return 0.0
        if policy == "timeout":
            return min(self.config.prefetch_timeout(num_tokens), self.config.alloc_timeout_s)
        return self.config.alloc_timeout_s

    async def _host_slots(
        self, ctl: TierController, parent: Node, num_tokens: int, wait_s: float
    ) -> torch.Tensor | None:
        """Host slots under ``parent``, waiting up to ``wait_s`` for room; ``None`` if none."""
        with self.room.holding(parent):  # nothing may evict it while we wait
            room = await self.room.host_room(num_tokens, wait_s)
        got = ctl.ledger.host.alloc(num_tokens) if room else None
        return None if got is None else got[0]

    async def settle(
        self,
        ctl: TierController,
        op: PrefetchOperation,
        toks: list[int],
        parent: Node,
        extra_key: str | None,
        flushes: int,
    ) -> tuple[int, int]:
        """Terminate ``op``, insert what arrived under ``parent``, free the rest.

        Returns ``(fetched, added)`` as `run` does.

        ``flushes``: `flushes` when ``op`` started. A flush since then has
        dropped ``parent`` and freed every host slot, the fetched ones
        included: nothing is inserted, unpinned or freed, and 0 is returned.
        """
        index, books = self.room.index, ctl.ledger.host
        try:
            done, hashes = await ctl.terminate_prefetch(op)
        finally:
            if self.flushes == flushes and not parent.is_root and parent.host_pin:
                self.room.unpin(parent)
        if done == 0 or self.flushes != flushes:
            return 0, 0
        got = op.host_indices[:done]
        if not self.room.open or (parent.parent is None and not parent.is_root):
            books.free(books.pages(got))  # closing, or the parent was dropped meanwhile
            return 0, 0
        res = index.insert_host(
            toks[:done], got, parent=parent, extra_key=extra_key, page_hashes=hashes, checked=True
        )
        if res.prefix_len:
            books.free(books.pages(got[: res.prefix_len]))
        if res.node is not None:
            index.mark_backed_up(res.node)
        # Pages another request cached meanwhile are hits where that request put them.
        self.stats.tokens_storage_hit += done - res.prefix_len
        return done, done - res.prefix_len

    async def _wait_policy(
        self, op: PrefetchOperation, policy: str, num_tokens: int, spent: float = 0.0
    ) -> None:
        """Wait for ``op`` as ``policy`` says; ``spent``: seconds the timeout already used."""
        if policy == "wait_complete":
            await op.wait()
        elif policy == "timeout":
            # The deadline stops the waiting only: `op.wait` is shielded.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    max(0.0, self.config.prefetch_timeout(num_tokens) - spent)
                ):
                    await op.wait()
        else:  # best_effort: let the query and what IO is ready run, then take it
            await asyncio.sleep(0)
