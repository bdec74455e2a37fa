"""`FaultPolicy`: what a user of a storage backend does once the backend keeps failing.

One object decides it for both users of a backend: the storage tier
(`tiercache.storage_tier.StorageTier`, ``storage_fault_policy``) and the SGLang
adapter (`tiercache.integrations.sglang.TierCacheStorage`, ``fault_policy``).
The user reports every call it makes with `FaultPolicy.succeeded` or
`FaultPolicy.failed`, and asks `FaultPolicy.down` before calling; the policy
counts failures in a row and, at ``threshold``, applies one of
`FAULT_POLICIES`:

- ``none``: nothing; every call is still made (and each failure is a miss).
- ``auto_detach``: the backend is given up for good (`FaultState.DETACHED`,
  one ``auto_detaches``) and ``on_detach`` tells the owner, who detaches it
  (the tier) or simply stops calling it (the adapter).
- ``auto_reconnect``: the backend is down (`FaultState.DOWN`, one
  ``outages``): calls are not made while one probe (``probe()``, under
  ``timeout_s``) retries it with exponential backoff from ``backoff_s`` to
  ``backoff_max_s``; the first answer brings it back up (one ``reconnects``).

The states and their moves::

    UP --threshold, auto_reconnect--> DOWN --probe answers--> UP
    UP --threshold, auto_detach-----> DETACHED (for good)
    UP or DOWN --detach()-----------> DETACHED (the probe is cancelled)
    any --aclose()------------------> closed (no move any more, probe ended)

Close-time failures: once `FaultPolicy.aclose` has begun (or `FaultPolicy.closing`
was called), a failure is not counted. A call cut short by its owner's close
(cancelled, or refused by a backend being closed under it) says nothing of
the backend's health, and an outage declared then would start a probe that
the close would have to end at once.

Everything runs on one event loop: the one the owner calls it from.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from tiercache._aio import bounded

__all__ = ["FAULT_POLICIES", "FaultCounts", "FaultPolicy", "FaultState", "FaultStats"]

logger = logging.getLogger(__name__)

#: What a backend's user does after ``threshold`` failed calls in a row:
#: ``none`` keeps calling (each call a miss); ``auto_detach`` gives the
#: backend up for good (the storage tier detaches it; attach it again by
#: hand); ``auto_reconnect`` stops calling it while a probe retries it with
#: exponential backoff, and resumes when the backend answers again.
FAULT_POLICIES: tuple[str, ...] = ("none", "auto_detach", "auto_reconnect")


class FaultState(enum.Enum):
    """Whether the backend is being called."""

    UP = "up"  # called
    DOWN = "down"  # auto_reconnect: not called; a probe retries it
    DETACHED = "detached"  # auto_detach (or `FaultPolicy.detach`): not called, for good


class FaultCounts(Protocol):
    """Where a `FaultPolicy` counts its moves (`FaultStats`, or an owner's own stats)."""

    outages: int
    reconnects: int
    auto_detaches: int


@dataclass(slots=True)
class FaultStats:
    """The moves of one `FaultPolicy`: outages (``DOWN``), reconnects (back ``UP``), detaches."""

    outages: int = 0
    reconnects: int = 0
    auto_detaches: int = 0


Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


def _create_task(coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro, name=what)


class FaultPolicy:
    """The fault policy of one backend: counts failures in a row and acts on them.

    Args:
        policy: one of `FAULT_POLICIES`.
        threshold: failed calls in a row that trip the policy (≥ 1).
        backoff_s: the first wait of the reconnect probe.
        backoff_max_s: the longest wait of the probe (the wait doubles up to it).
        timeout_s: the deadline of one probe call.
        probe: makes one cheap call to the backend (a ``batch_exists``); any
            exception, or the deadline, is a failed probe.
        name: the backend's name, for the log.
        on_detach: called (on the loop) when ``auto_detach`` gives the backend up.
        spawn: starts the probe task (an owner's `TaskGroup.spawn`); by default
            a plain task of the running loop, referenced by the policy.
        counts: where the moves are counted (default: a new `FaultStats`).

    The arguments are checked by the owner's configuration
    (`StorageTierConfig`, `SGLangOptions`), not here.
    Every method runs on the owner's event loop.
    """

    def __init__(
        self,
        policy: str,
        threshold: int,
        *,
        backoff_s: float,
        backoff_max_s: float,
        timeout_s: float,
        probe: Callable[[], Awaitable[object]],
        name: str,
        on_detach: Callable[[], None] | None = None,
        spawn: Spawn = _create_task,
        counts: FaultCounts | None = None,
    ) -> None:
        assert policy in FAULT_POLICIES, policy
        self.policy = policy
        self.threshold = threshold
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.name = name
        #: The moves so far (the owner's stats when it passed ``counts``).
        self.counts: FaultCounts = counts if counts is not None else FaultStats()
        self._probe_call = probe
        self._on_detach = on_detach
        self._spawn = spawn
        self._state = FaultState.UP
        self._failures = 0  # failed calls in a row
        self._closing = False
        self._probe: asyncio.Task[None] | None = None

    @property
    def state(self) -> FaultState:
        """`FaultState.UP`, ``DOWN`` (a probe runs) or ``DETACHED``."""
        return self._state

    @property
    def down(self) -> bool:
        """The backend is not to be called (``DOWN`` or ``DETACHED``)."""
        return self._state is not FaultState.UP

    @property
    def failures(self) -> int:
        """Failed calls in a row (0 after a success or a reconnect)."""
        return self._failures

    @property
    def probing(self) -> bool:
        """A reconnect probe is running."""
        return self._probe is not None and not self._probe.done()

    def succeeded(self) -> None:
        """A call answered: the failures in a row start again from 0."""
        self._failures = 0

    def failed(self) -> None:
        """A call failed (an error or its deadline): count it; at ``threshold``, act.

        Not counted once the owner is closing (see the module docstring), nor
        while the backend is already down or detached.
        """
        if self._closing or self.down:
            return
        self._failures += 1
        if self._failures < self.threshold or self.policy == "none":
            return
        if self.policy == "auto_detach":
            logger.warning(
                "storage backend %s failed %d times in a row: detaching it (auto_detach)",
                self.name,
                self._failures,
            )
            self.detach()
            if self._on_detach is not None:
                self._on_detach()
            return
        self._state = FaultState.DOWN
        self.counts.outages += 1
        logger.warning(
            "storage backend %s failed %d times in a row: treating it as down and probing it",
            self.name,
            self._failures,
        )
        self._probe = self._spawn(self._reconnect(), "the storage reconnect probe")

    def detach(self) -> None:
        """Give the backend up for good (counted once); a running probe is cancelled.

        The owner calls it when it detaches the backend for a reason of its
        own (under TP: another rank gave up on it). Idempotent; ``on_detach``
        is not called (the owner already knows).
        """
        if self._state is FaultState.DETACHED:
            return
        self._state = FaultState.DETACHED
        self.counts.auto_detaches += 1
        if self._probe is not None:
            self._probe.cancel()

    def closing(self) -> None:
        """The owner has begun to close: from now on no failure is counted, no probe starts.

        Synchronous, for an owner that must mark it before it can reach the
        loop; `aclose` then ends the probe.
        """
        self._closing = True

    async def aclose(self) -> None:
        """Stop acting: no failure counts from now on; cancel the probe and wait for it.

        Idempotent. The state is left as it was (a closed owner calls nothing).
        The owner's callbacks are dropped: ``on_detach`` is often the owner's
        own method, and a closed policy that kept it would keep its owner (and
        the host memory the owner holds) alive until the garbage collector runs.
        """
        self._closing = True
        self._on_detach = None
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            # Wait for it to end without taking its outcome (its own cancellation);
            # a cancellation of the closer itself still reaches the closer.
            await asyncio.wait([probe])

    async def _reconnect(self) -> None:
        """Probe the backend with exponential backoff until it answers, then resume."""
        delay = self.backoff_s
        while not self._closing and self._state is FaultState.DOWN:
            await asyncio.sleep(delay)
            try:
                await bounded(self._probe_call(), self.timeout_s)
            except Exception as e:  # TimeoutError included
                logger.debug("storage probe of %s failed: %r", self.name, e)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            if self._closing or self._state is not FaultState.DOWN:
                return
            self._state = FaultState.UP
            self._failures = 0
            self.counts.reconnects += 1
            logger.warning("storage backend %s answers again: resuming", self.name)
            return
