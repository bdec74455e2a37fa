"""`PrefetchRounds`: the tensor-parallel agreement rounds of one storage tier.

With a TP group, every rank of a storage tier (`tiercache.storage_tier`) makes
two agreements per `StorageTier.prefetch` call, in call order, abstentions
included (`tiercache.tp_agreement`):

* **where the prefix ends** (``hits``): the MIN over the ranks of the pages
  each holds or found in storage, the MIN of the pages each already held, and
  whether every rank keeps the backend (a rank whose fault policy gave it up
  under ``auto_detach`` proposes to detach it, and every rank detaches it at
  that same round);
* **what each loading prefetch completed** (``ends``): once it has ended on
  this rank, the MIN over the ranks of its completed prefix; every rank then
  hands over the same prefix, as SGLang's all-reduce on completion does.

The two sequences run on threads of their own, each over a gloo group of its
own: neither waits for the other, so each is the same on every rank however
the ranks' storage calls are timed. The ``ends`` sequence runs as one task in
the tier's `TaskGroup`.

Everything here runs on the tier's event loop; the collectives run on the
agreements' threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tiercache._aio import finish
from tiercache.tp_agreement import Agreements, Round, tp_ranks

__all__ = ["PrefetchRounds"]

logger = logging.getLogger(__name__)

#: A prefetch's completed prefix end in tokens: known at once (a rank that
#: abstained holds its prefix), or once the prefetch ended on this rank.
EndSource = int | Callable[[], Awaitable[int]]


class PrefetchRounds:
    """The agreement rounds of one storage tier's prefetch calls over a TP group.

    Args:
        tp_group: a ``torch.distributed`` group over the TP ranks.
        timeout_s: how long a round waits for the other ranks before the
            agreements fail (a rank that stopped taking part).
        spawn: starts the ``ends`` task (the tier's `TaskGroup.spawn`).

    Raises:
        ConfigError: ``tp_group`` is not a usable process group.

    Every method runs on the tier's event loop.
    """

    def __init__(
        self,
        tp_group: Any,
        *,
        timeout_s: float,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
    ) -> None:
        self._agreements = Agreements(tp_ranks(tp_group), timeout_s=timeout_s)
        self._seq = 0  # prefetch calls so far (abstentions included)
        self._detach_wanted = False  # proposed at the next ``hits`` round
        self._ends: asyncio.Queue[tuple[int, EndSource, Callable[[int], None] | None] | None]
        self._ends = asyncio.Queue()
        self._ends_task: asyncio.Task[None] | None = spawn(
            self._ends_loop(), "the TP completion agreement"
        )

    def next_seq(self) -> int:
        """The sequence number of the next prefetch call (one per call, abstentions included)."""
        seq = self._seq
        self._seq += 1
        return seq

    def propose_detach(self) -> None:
        """This rank gave its backend up: propose, at the next ``hits`` round, that every rank does."""
        self._detach_wanted = True

    async def hits(self, seq: int, cached: int, hit_pages: int) -> tuple[int, int, bool]:
        """Agree where prefetch call ``seq``'s prefix ends.

        Args:
            seq: the call's `next_seq`.
            cached: pages this rank already holds.
            hit_pages: pages past ``cached`` this rank found in storage.

        Returns:
            The MIN over the ranks of ``cached + hit_pages``; the MIN of
            ``cached``; and whether every rank keeps the backend. A failed
            agreement (a rank gone) answers ``cached`` pages and ``False``:
            a miss, and the backend is detached.
        """
        detach = 0 if self._detach_wanted else 1
        proposal = Round(2 * seq, [cached + hit_pages, detach, cached])
        try:
            job = self._agreements.agree(Agreements.HITS, proposal)
            end, healthy, low = await finish(asyncio.wrap_future(job))
        except Exception as e:
            logger.error("the TP hit-count agreement failed: %r; detaching the backend", e)
            end, healthy, low = cached, 0, cached
        return end, low, bool(healthy)

    def agree_end(
        self, seq: int, end: EndSource, then: Callable[[int], None] | None = None
    ) -> None:
        """Queue call ``seq``'s ``ends`` round, after those of the calls before it.

        ``end``: this rank's prefix end in tokens, or a coroutine function
        that returns it once the prefetch ended here. ``then(agreed)``
        receives the MIN over the ranks (0 when the agreement failed).
        """
        self._ends.put_nowait((seq, end, then))

    async def _ends_loop(self) -> None:
        """The ``ends`` rounds, one at a time in call order, until `aclose`."""
        while (item := await self._ends.get()) is not None:
            seq, end, then = item
            mine = end if isinstance(end, int) else await end()
            try:
                job = self._agreements.agree(Agreements.ENDS, Round(2 * seq + 1, [mine]))
                (agreed,) = await finish(asyncio.wrap_future(job))
            except Exception as e:
                logger.error("the TP completion agreement failed: %r; taking 0 tokens", e)
                agreed = 0
            if then is not None:
                then(agreed)

    async def aclose(self) -> None:
        """Finish the queued ``ends`` rounds (the other ranks make them too), then close.

        The tier calls it once every load has ended. Idempotent.
        """
        task, self._ends_task = self._ends_task, None
        if task is None:
            return
        self._ends.put_nowait(None)
        await asyncio.wait([task])
        await asyncio.to_thread(self._agreements.close)
