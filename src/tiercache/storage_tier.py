"""The storage (L3) half of the controller: prefetch into host memory and backup
from it, as coroutines.

Where SGLang's ``HiCacheController`` runs a prefetch thread, a prefetch-IO
thread and a backup thread polling queues, `StorageTier` runs:

* one **query coroutine** that takes prefetch operations in arrival order,
  hashes their pages, asks the backend ``batch_exists`` 128 pages at a time,
  stops at the first miss, agrees the hit count across tensor-parallel ranks
  with one all-reduce (MIN) per operation, and revokes operations under the
  threshold (with a TP group, the ranks also agree an ``auto_detach``, and the
  tokens each operation completed: `tiercache.prefetch_rounds`);
* bounded-concurrency **IO coroutines** that fill host pages batch by batch,
  growing ``completed_tokens`` only over a contiguous prefix whose bytes are in
  place;
* **backup coroutines** that write host pages to storage batch by batch.

Every backend call goes through a `tiercache.storage.guarded.GuardedBackend`
(deadline, answer checks, timings) that reports to the tier's
`tiercache.storage.fault_policy.FaultPolicy` (``fault_policy``), the same
policy object the SGLang adapter uses.

Host slot ownership: `prefetch` takes ownership of the host slots it is given.
When the operation ends (done, revoked, failed, terminated, detached) the
slots past ``completed_tokens`` are freed by the tier, *after* every backend
call that could still write into them has settled; the first
``completed_tokens`` slots belong to the caller once it has called
`terminate_prefetch` (or `PrefetchOperation.take_completed`). A backend call
is never abandoned while it may still be writing: a timed-out call is
cancelled and awaited (`tiercache._aio.bounded`), and backends guarantee (see
`StorageBackend.batch_get`) that a cancelled call writes nothing more.

The tier sees its owner's host pool through `HostSlots` only: the pool, its
allocator, and "hold"/"release" marks on the slots a storage call uses (the
owner refuses to free a held slot). Its coroutines run in the owner's
`TaskGroup`, whose one failure policy applies: a bug is logged once and
raised once, at the owner's next call or at its close.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch

from tiercache._aio import finish
from tiercache._checks import check_backoff, check_bool, check_int, token_array
from tiercache._tasks import TaskGroup
from tiercache.acks import Completion, settle
from tiercache.errors import (
    ConfigError,
    InvalidInputError,
    StateError,
    StorageError,
)
from tiercache.index.hashing import INLINE_HASH_PAGES, page_hashes
from tiercache.memory.allocator import check_slot_indices
from tiercache.memory.pools import HostKVPool
from tiercache.prefetch_rounds import PrefetchRounds
from tiercache.storage.base import PageKey, StorageBackend
from tiercache.storage.fault_policy import FAULT_POLICIES, FaultPolicy
from tiercache.storage.guarded import GuardedBackend
from tiercache.storage.keys import StorageNamespace
from tiercache.tp_agreement import tp_ranks

__all__ = [
    "FAULT_POLICIES",
    "BackupOperation",
    "HostSlots",
    "PrefetchOperation",
    "PrefetchState",
    "StorageTier",
    "StorageTierConfig",
    "StorageTierStats",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Abstain:
    """A prefetch this rank did not start (storage down, rate limited, nothing to
    fetch): the query loop still takes part in the hit-count agreement, with no
    hits past the ``cached_tokens`` this rank already holds, and, when another
    rank loads, in the agreement on the completed prefix."""

    __slots__ = ("seq", "cached_tokens")

    def __init__(self, seq: int, cached_tokens: int) -> None:
        self.seq = seq
        self.cached_tokens = cached_tokens


def collective_device(tp_group: Any, pool_device: torch.device) -> torch.device:
    """Check ``tp_group`` and return the device the TP agreements reduce on: the CPU.

    Whatever the group's backend (gloo, NCCL, both), the agreements run over
    gloo groups of their own over its ranks (`tiercache.tp_agreement`): never
    on a CUDA stream, never interleaved with the model's collectives.

    Raises:
        ConfigError: ``tp_group`` is not a usable process group.
    """
    tp_ranks(tp_group)
    return torch.device("cpu")


class PrefetchState(enum.Enum):
    QUERYING = "querying"
    LOADING = "loading"
    DONE = "done"  # every hit page is in host memory
    REVOKED = "revoked"  # under the threshold: nothing fetched
    FAILED = "failed"  # a storage error ended it; completed pages kept
    TERMINATED = "terminated"  # stopped by terminate_prefetch / detach / close


_FINAL = (PrefetchState.DONE, PrefetchState.REVOKED, PrefetchState.FAILED, PrefetchState.TERMINATED)


@dataclass(frozen=True, slots=True)
class StorageTierConfig:
    """Knobs of the storage tier (see `TierCacheConfig` for their documentation)."""

    prefetch_threshold: int = 256
    query_batch_pages: int = 128
    io_batch_pages: int = 8
    io_concurrency: int = 4
    backup_batch_pages: int = 32
    prefetch_capacity_tokens: int | None = None
    timeout_s: float = 5.0
    fault_policy: str = "auto_reconnect"
    fault_threshold: int = 5
    reconnect_backoff_s: float = 0.5
    reconnect_backoff_max_s: float = 30.0
    #: With a TP group: how long an agreement round waits for the other ranks
    #: before the agreements fail (a rank that stopped taking part).
    tp_agreement_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.fault_policy not in FAULT_POLICIES:
            raise ConfigError(
                f"fault_policy must be one of {FAULT_POLICIES}, got {self.fault_policy!r}"
            )
        for name in (
            "query_batch_pages",
            "io_batch_pages",
            "io_concurrency",
            "backup_batch_pages",
            "fault_threshold",
        ):
            check_int(getattr(self, name), name, minimum=1, error=ConfigError)
        for name in (
            "timeout_s",
            "reconnect_backoff_s",
            "reconnect_backoff_max_s",
            "tp_agreement_timeout_s",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        check_backoff(
            self.reconnect_backoff_s,
            self.reconnect_backoff_max_s,
            "reconnect_backoff_s",
            "reconnect_backoff_max_s",
        )


@dataclass(slots=True)
class StorageTierStats:
    """Counters of one storage tier (`TierController.storage_stats` sums them over tiers)."""

    prefetch_started: int = 0
    prefetch_rate_limited: int = 0
    prefetch_revoked: int = 0
    prefetch_completed: int = 0
    prefetch_failed: int = 0
    prefetch_terminated: int = 0
    prefetch_pages_fetched: int = 0
    prefetch_tokens_hit: int = 0
    backup_ops: int = 0
    backup_pages_written: int = 0
    backup_pages_skipped: int = 0
    backup_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    storage_errors: int = 0
    storage_timeouts: int = 0
    outages: int = 0
    reconnects: int = 0
    auto_detaches: int = 0
    skipped_while_down: int = 0

    def add(self, other: StorageTierStats) -> None:
        """Add ``other``'s counts to these (totals over several tiers)."""
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class HostSlots(Protocol):
    """What a storage tier may do with its owner's host pool, and nothing more.

    The owner (a `TierController`) keeps the books of which host slots are in
    use by copies; the tier marks the slots its backend calls read or write
    with `hold` while they run and `release` after, so the owner never frees
    or reuses them meanwhile. A prefetch holds its slots with ``fill=True``:
    until it ends they do not hold the tokens' KV, so nothing may read them
    (`filling`). Every member is used on the loop thread.
    """

    @property
    def pool(self) -> HostKVPool:
        """The pinned host pool (the tier reads and writes page views of it)."""
        ...

    def allocated(self, host_indices: torch.Tensor) -> bool:
        """Whether every page of ``host_indices`` (CPU, page-aligned) is allocated."""
        ...

    def free(self, host_indices: torch.Tensor) -> None:
        """Free host slots the tier took over (those a prefetch did not fill)."""
        ...

    def spoiled(self, host_indices: torch.Tensor) -> bool:
        """Whether a failed copy left some of ``host_indices`` without their KV."""
        ...

    @property
    def device(self) -> torch.device:
        """The device pool's device (an NCCL TP group reduces on it)."""
        ...

    def hold(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        """Mark ``host_indices`` in use by a storage call: the owner may not free them.

        ``fill``: the call writes them (a prefetch): nothing may read them
        until the matching `release`.
        """
        ...

    def release(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        """Undo one `hold` of ``host_indices`` (with the same ``fill``)."""
        ...

    def in_use(self, host_indices: torch.Tensor) -> bool:
        """Whether a copy or a storage call uses any of ``host_indices`` (CPU, page-aligned)."""
        ...

    def filling(self, host_indices: torch.Tensor) -> bool:
        """Whether a device->host copy or a prefetch still fills any of ``host_indices``.

        Such slots do not hold their tokens' KV yet (a prefetch that ends
        short never fills some of them): reading them reads other bytes.
        """
        ...

    def storage_failed(self, tier: StorageTier) -> None:
        """The ``auto_detach`` fault policy gave up on ``tier``'s backend: the owner detaches it."""
        ...


def _leading_ok(flags: Sequence[object]) -> int:
    """How many leading entries of a backend's per-page answer are true."""
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n


class _StorageCompletion(Completion):
    """The completion of a storage operation: it ends once, and its errors end it.

    ``await op`` and ``await op.wait()`` wait for the end and raise nothing (a
    storage error ends the operation early and is kept in ``error``);
    cancelling the waiting task does not stop the operation. Done callbacks
    run in the order added, before any awaiter resumes, as a copy's do.
    """

    error: BaseException | None

    def failed(self) -> bool:
        """Whether it has ended with a storage error (see ``error``)."""
        return self.done() and self.error is not None


class PrefetchOperation(_StorageCompletion):
    """One storage prefetch into host memory (SGLang's ``PrefetchOperation``).

    ``completed_tokens`` counts the leading tokens whose bytes are in host
    memory; it only grows, and stops growing once the operation is terminated.
    ``await op`` (or ``await op.wait()``) waits for the operation to end (it
    never raises for storage errors: those end it as `FAILED`, with what was
    completed kept). Once it has ended, `take_completed` hands the completed
    prefix to the caller.
    """

    def __init__(
        self,
        request_id: object,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        prior_hash: str | None,
        done: asyncio.Future[None],
        *,
        page_size: int,
        on_handover: Callable[[int], None] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        super().__init__(done)
        self.request_id = request_id
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.prior_hash = prior_hash
        self.hash_values: list[str] = []
        self.storage_hit_tokens = 0
        self.completed_tokens = 0
        self.state = PrefetchState.QUERYING
        self.error = None
        self.start_time = time.monotonic()
        self.end_time: float | None = None
        self.page_size = page_size
        #: The tokens the caller already holds before ``token_ids`` (its matched
        #: prefix): with a TP group the ranks agree where the prefix ends.
        self.cached_tokens = cached_tokens
        self._frozen = False  # completed_tokens may no longer grow
        self._io_tasks: set[asyncio.Task[Any]] = set()
        self._released = False  # the completed prefix was handed over
        self._on_handover = on_handover
        #: With a TP group: the number of the `StorageTier.prefetch` call that
        #: made it (the same on every rank), and, once it has ended on this
        #: rank while its completed tokens are still to be agreed, how it ended.
        self._seq = -1
        self._local_end: PrefetchState | None = None
        self._agreeing = False  # its hits were agreed > 0: its completion is agreed too
        self._ended_locally = asyncio.Event()

    @property
    def num_tokens(self) -> int:
        return int(self.host_indices.numel())

    def is_terminated(self) -> bool:
        return self._frozen

    def take_completed(self) -> tuple[int, list[str]]:
        """Hand the completed prefix to the caller, once the operation has ended.

        Idempotent: later calls return the same answer and hand nothing over again.

        Returns:
            ``(completed_tokens, hash_values[:completed pages])``. The caller
            owns ``host_indices[:completed_tokens]`` from now on.

        Raises:
            StateError: the operation has not ended (await it, or terminate it, first).
        """
        if not self.done():
            raise StateError("the prefetch has not ended: await it or terminate it first")
        if not self._released:
            self._released = True
            if self._on_handover is not None:
                self._on_handover(self.completed_tokens)
        return self.completed_tokens, self.hash_values[: self.completed_tokens // self.page_size]

    def __repr__(self) -> str:
        return (
            f"PrefetchOperation({self.request_id!r}, {self.state.value}, "
            f"completed={self.completed_tokens}/{self.num_tokens})"
        )


def _untraced(error: BaseException) -> BaseException:
    """``error``, and the errors it was raised from, without their tracebacks.

    For an error an operation keeps (a storage failure, a miss, already
    logged): its traceback holds this tier's frames, which hold the operation
    and the tier, and through the tier the host pool, in a cycle only the
    garbage collector would free.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


class BackupOperation(_StorageCompletion):
    """One backup of host pages to storage. ``await op`` (or ``op.wait()``) waits for it to end.

    ``completed_tokens`` counts the leading tokens stored (or found already
    stored); a storage error ends the backup early, keeping what was done.
    """

    def __init__(
        self,
        node_id: object,
        host_indices: torch.Tensor,
        hash_values: list[str],
        done: asyncio.Future[None],
        *,
        track: bool = True,
    ) -> None:
        super().__init__(done)
        self.node_id = node_id
        self.host_indices = host_indices
        self.hash_values = hash_values
        self.completed_tokens = 0
        self.error = None
        #: Reported by `StorageTier.drain_backup_acks` once it ends.
        self._track = track

    @property
    def succeeded(self) -> bool:
        return (
            self.done()
            and self.error is None
            and self.completed_tokens == self.host_indices.numel()
        )

    def __repr__(self) -> str:
        return f"BackupOperation({self.node_id!r}, completed={self.completed_tokens}/{self.host_indices.numel()})"


class _ArrivedPrefix:
    """The pages of one prefetch that have landed, and the contiguous prefix they make.

    The hit pages are read in batches of ``step`` pages, several at once, in
    any order. Batch ``i`` covers pages ``[i * step, min((i + 1) * step,
    total))``. A batch that lands short (a missing page, a failed read) ends
    the prefix inside it: batches after it no longer count, and those not
    started yet are not worth reading (`stopped`).
    """

    def __init__(self, total_pages: int, step: int) -> None:
        self.total_pages = total_pages
        self.step = step
        self.pages = 0  # the contiguous prefix of landed pages
        self.stopped = False
        self._landed: dict[int, int] = {}  # batch -> pages of it that landed
        self._next = 0  # the first batch not yet counted into the prefix
        self._ended = False

    @property
    def batches(self) -> int:
        return -(-self.total_pages // self.step)

    def bounds(self, batch: int) -> tuple[int, int]:
        lo = batch * self.step
        return lo, min(lo + self.step, self.total_pages)

    def land(self, batch: int, pages: int) -> None:
        """Batch ``batch`` has ``pages`` leading pages in place; grow the prefix over it."""
        lo, hi = self.bounds(batch)
        if pages < hi - lo:
            self.stopped = True
        self._landed[batch] = pages
        while not self._ended and self._next in self._landed:
            got = self._landed.pop(self._next)
            lo, hi = self.bounds(self._next)
            self.pages = lo + got
            self._ended = got < hi - lo
            self._next += 1


def check_cached_tokens(cached_tokens: object, page_size: int) -> int:
    """``cached_tokens`` of `StorageTier.prefetch` / `StorageTier.abstain`, checked.

    Raises:
        InvalidInputError: not a non-negative int multiple of ``page_size``.
    """
    if (
        isinstance(cached_tokens, bool)
        or not isinstance(cached_tokens, int)
        or cached_tokens < 0
        or cached_tokens % page_size
    ):
        raise InvalidInputError(
            f"cached_tokens must be a non-negative multiple of the page size ({page_size}), "
            f"got {cached_tokens!r}"
        )
    return cached_tokens


def check_storage_args(
    slots: HostSlots,
    namespace: StorageNamespace,
    host_indices: torch.Tensor,
    token_ids: Sequence[int],
    prior_hash: str | None = None,
    hash_values: list[str] | None = None,
    *,
    fill: bool,
) -> tuple[torch.Tensor, Sequence[int]]:
    """The arguments of a prefetch or a backup, checked before anything starts.

    ``fill``: the call writes the host slots (a prefetch), else it reads them
    (a backup). The slots' state is checked last, once the arguments are good.

    Returns:
        The CPU int64 host slots and the token ids, every one checked (an
        ``array("I")``, or a numpy array when given an array or a tensor).

    Raises:
        InvalidInputError: slots that are not allocated page-aligned host
            slots, tokens that are not ids or not one per slot, a
            ``prior_hash`` that is not hex, or ``hash_values`` that are not
            one page hash per page.
        StateError: a prefetch into slots that a copy or a storage call
            still uses (it would overwrite the bytes they move), or a backup
            of slots that a device->host copy or a prefetch still fills (it
            would store bytes that are not the tokens' KV under their keys).
    """
    page_size = slots.pool.layout.page_size
    host = check_slot_indices(host_indices, page_size, slots.pool.num_slots, "host_indices")
    # Every id, checked once here (in C); the array is what gets hashed later
    # (a numpy one is sliced and hashed as a sequence is).
    token_ids = cast("Sequence[int]", token_array(token_ids, "token_ids"))
    if len(token_ids) != host.numel():
        raise InvalidInputError(
            f"{len(token_ids)} tokens for {host.numel()} host slots: they must be equal"
        )
    page_hashes((), page_size, prior_hash)  # checks the prior (no page to hash)
    if hash_values is not None:
        if not isinstance(hash_values, list):
            raise InvalidInputError(
                f"hash_values must be a list of page hashes, got {type(hash_values).__name__}"
            )
        pages = host.numel() // page_size
        if hash_values and len(hash_values) != pages:
            raise InvalidInputError(
                f"{len(hash_values)} hash_values for {pages} pages: give one per page"
            )
        namespace.keys(hash_values)  # each a page hash
    if not slots.allocated(host):
        raise InvalidInputError("host_indices include slots that are not allocated")
    if fill and slots.in_use(host):
        raise StateError(
            "host_indices are in use by a copy or a storage call; prefetch into free slots"
        )
    if not fill and slots.filling(host):
        raise StateError(
            "a device->host copy or a storage prefetch still fills some of host_indices: "
            "back them up once it has ended (await its ack or the prefetch)"
        )
    if not fill and slots.spoiled(host):
        raise StateError(
            "some of host_indices hold no KV (the copy into them failed): nothing to back up"
        )
    return host, token_ids


class StorageTier:
    """Prefetch and backup between a host pool and one attached storage backend.

    Created by `TierController.attach_storage_backend` and stopped by
    `TierController.detach_storage_backend` (``controller.storage``). Every
    method runs on the loop that created it.

    Args:
        slots: the owner's host pool and its slot books (`HostSlots`).
        tasks: the owner's `TaskGroup`: the tier's coroutines run in it.
        backend: the open storage backend.
        namespace: the identity folded into every page key.
        config: the tier's knobs.
        owns_backend: close ``backend`` at `stop`.
        tp_group: a ``torch.distributed`` group over the TP ranks (hit counts agree by MIN).
        write_enabled: false on the TP ranks that do not write (MLA: rank 0 writes).
        source: the source of the tier's call timings in `tiercache.observe`
            (the controller, so that one cache's collector sees only its calls).

    Raises:
        ConfigError: an unusable ``tp_group``.
    """

    def __init__(
        self,
        slots: HostSlots,
        tasks: TaskGroup,
        backend: StorageBackend,
        namespace: StorageNamespace,
        config: StorageTierConfig,
        *,
        owns_backend: bool,
        tp_group: Any = None,
        write_enabled: bool = True,
        source: object | None = None,
    ) -> None:
        self.slots = slots
        #: Who the tier's call timings belong to (`tiercache.observe`): its controller.
        self.source = source
        self.tasks = tasks
        self.backend = backend
        self.namespace = namespace
        self.config = config
        self.owns_backend = owns_backend
        self.tp_group = tp_group
        self.write_enabled = write_enabled
        self.stats = StorageTierStats()
        self.page_size = slots.pool.layout.page_size
        self.page_bytes = slots.pool.layout.page_bytes
        self._loop = asyncio.get_running_loop()
        self._query_queue: asyncio.Queue[PrefetchOperation | _Abstain | None] = asyncio.Queue()
        # Work in flight, each with the task that runs it (none while queued for the query).
        self._ops: set[PrefetchOperation] = set()
        self._loads: dict[PrefetchOperation, asyncio.Task[None]] = {}
        self._backups: dict[BackupOperation, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._io_slots = asyncio.Semaphore(config.io_concurrency)
        self._held_tokens = 0  # host tokens held by prefetches not yet handed over
        # Bumped by `forget_uncollected`: the prefixes of prefetches that ended
        # before it are no longer counted in _held_tokens.
        self._held_generation = 0
        self._finished_backups: deque[BackupOperation] = deque()
        # With a TP group: the agreements on each prefetch call's prefix end
        # and on what each loading prefetch completed, in call order.
        self._rounds: PrefetchRounds | None = None
        if tp_group is not None:
            self._rounds = PrefetchRounds(
                tp_group, timeout_s=config.tp_agreement_timeout_s, spawn=tasks.spawn
            )
        self._closing = False
        #: The fault policy: counts failed calls in a row and acts on them.
        self.faults = FaultPolicy(
            config.fault_policy,
            config.fault_threshold,
            backoff_s=config.reconnect_backoff_s,
            backoff_max_s=config.reconnect_backoff_max_s,
            timeout_s=config.timeout_s,
            probe=functools.partial(backend.batch_exists, [namespace.key("0" * 64)]),
            name=backend.name,
            on_detach=self._gave_up,
            spawn=tasks.spawn,
            counts=self.stats,
        )
        self._calls = GuardedBackend(
            backend, self.faults, timeout_s=config.timeout_s, counts=self.stats, source=source
        )
        self._query_task = tasks.spawn(self._query_loop(), "the storage query loop")

    # -- work in flight ---------------------------------------------------------

    def _work_changed(self) -> None:
        """Keep the idle event true to whether any prefetch or backup is running."""
        if self._ops or self._backups:
            self._idle.clear()
        else:
            self._idle.set()

    def _add_op(self, op: PrefetchOperation) -> None:
        self._ops.add(op)
        self._work_changed()

    @property
    def down(self) -> bool:
        """The fault policy stopped calling the backend (a probe may be retrying it)."""
        return self.faults.down

    def _gave_up(self) -> None:
        """``auto_detach`` gave the backend up: detach it (under TP: on every rank at once)."""
        if self._rounds is not None:
            # Under TP every rank detaches at the same agreement, or the ranks
            # that keep the backend wait in agreements this rank never joins.
            logger.warning("proposing to detach %s on every TP rank", self.backend.name)
            self._rounds.propose_detach()
            return
        self.slots.storage_failed(self)

    async def _hashes(self, token_ids: Sequence[int], prior: str | None) -> list[str]:
        n_pages = len(token_ids) // self.page_size
        if n_pages <= INLINE_HASH_PAGES:
            return page_hashes(token_ids, self.page_size, prior)
        job = self._loop.run_in_executor(None, page_hashes, token_ids, self.page_size, prior)
        return await finish(job)

    # -- prefetch ---------------------------------------------------------------

    def rate_limited(self) -> bool:
        """Whether prefetch-held host memory is at its cap (no new prefetch starts)."""
        cap = self.config.prefetch_capacity_tokens
        return cap is not None and self._held_tokens >= cap

    def prefetch(
        self,
        request_id: object,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        prior_hash: str | None = None,
        *,
        cached_tokens: int = 0,
        checked: bool = False,
    ) -> PrefetchOperation | None:
        """Start fetching ``token_ids``' pages from storage into ``host_indices``.

        ``cached_tokens``: the tokens this rank already holds before
        ``token_ids`` (a multiple of the page size). With a TP group the
        ranks agree on where the prefix ends (the MIN over the ranks of
        ``cached_tokens`` + storage hits), not on a hit count, so ranks whose
        own caches hold different prefixes still end with the same one.
        ``checked``: the caller already passed the arguments through
        `check_storage_args` and hands over what it returned (CPU slots, a
        list of tokens): skip that pass.

        Returns:
            The operation (the tier now owns ``host_indices``), or ``None`` when
            rate-limited or the backend is down (the caller keeps its slots).

        Raises:
            InvalidInputError: slots and tokens that do not match, bad tokens.
            StateError: a copy or a storage call still uses some of
                ``host_indices`` (see `check_storage_args`).
        """
        host, tokens = (
            (host_indices, token_ids)
            if checked
            else check_storage_args(
                self.slots, self.namespace, host_indices, token_ids, prior_hash, fill=True
            )
        )
        cached_tokens = check_cached_tokens(cached_tokens, self.page_size)
        if self.down:
            self.stats.skipped_while_down += 1
            self.abstain(cached_tokens)
            return None
        cap = self.config.prefetch_capacity_tokens
        if cap is not None and self._held_tokens + host.numel() > cap and self._held_tokens > 0:
            self.stats.prefetch_rate_limited += 1
            self.abstain(cached_tokens)
            return None
        op = PrefetchOperation(
            request_id,
            host,
            tokens,
            prior_hash,
            self._loop.create_future(),
            page_size=self.page_size,
            cached_tokens=cached_tokens,
        )
        op._seq = self._rounds.next_seq() if self._rounds is not None else -1
        self._held_tokens += op.num_tokens
        self.slots.hold(host, fill=True)
        self._add_op(op)
        self.stats.prefetch_started += 1
        self._query_queue.put_nowait(op)
        return op

    def _handed_over(self, generation: int, tokens: int) -> None:
        """A prefetch's completed prefix became its caller's: the tier no longer holds it.

        ``generation``: `_held_generation` when the prefetch ended. A prefix that
        `forget_uncollected` already stopped counting is not subtracted again.
        """
        if generation == self._held_generation:
            self._held_tokens -= tokens

    def forget_uncollected(self) -> None:
        """Stop counting the prefixes of ended prefetches that nobody collected.

        For an owner that freed every host slot (`TierController.reset`):
        those prefixes are gone, so they no longer count against
        ``prefetch_capacity_tokens``. Collecting such an operation later
        (`PrefetchOperation.take_completed`, `terminate_prefetch`) returns its
        answer and hands nothing over. Prefetches still running keep counting.
        """
        self._held_tokens = sum(op.num_tokens for op in self._ops)
        self._held_generation += 1

    def abstain(self, cached_tokens: int = 0) -> None:
        """With a TP group: this rank skips a prefetch, yet joins its agreements.

        Every rank makes one collective per `prefetch` call, whether or not it
        started the prefetch, so a rank whose storage is down or rate limited
        neither blocks the others nor desynchronises their collectives. It
        proposes that the prefix end at its ``cached_tokens`` (no hits past
        what it holds): with the default 0 no rank loads; a rank that already
        holds the prefix lets the others fetch up to it, and then joins the
        agreement on the completed prefix too.

        Raises:
            InvalidInputError: ``cached_tokens`` is not a non-negative multiple
                of the page size.
        """
        cached_tokens = check_cached_tokens(cached_tokens, self.page_size)
        if self._rounds is not None:
            self._query_queue.put_nowait(_Abstain(self._rounds.next_seq(), cached_tokens))

    async def _query_loop(self) -> None:
        while True:
            op = await self._query_queue.get()
            if op is None:
                return
            if isinstance(op, _Abstain):
                cached = op.cached_tokens // self.page_size
                end, low, healthy = await self._agree_hits(op.seq, cached, 0)
                if not healthy:
                    return  # every rank stops here: the backend is detached on all
                if self._rounds is not None and self._group_loads(end, low):
                    # Another rank loads: agree its end too (this rank holds its prefix).
                    self._rounds.agree_end(op.seq, op.cached_tokens)
                continue
            try:
                if not await self._query(op):
                    return
            except asyncio.CancelledError:
                self._end(op, PrefetchState.TERMINATED)
                raise
            except BaseException as e:  # a bug: end the op, surface the error
                op.error = e
                self._end(op, PrefetchState.FAILED)
                raise

    async def _count_hits(self, op: PrefetchOperation) -> int:
        """Pages of ``op`` in storage, up to the first missing one (0 on a storage error)."""
        hit_pages = 0
        try:
            op.hash_values = await self._hashes(op.token_ids, op.prior_hash)
            keys = self.namespace.keys(op.hash_values)
            step = self.config.query_batch_pages
            for start in range(0, len(keys), step):
                if op._frozen:
                    break
                batch = keys[start : start + step]
                n = await self._calls.exists(batch)
                hit_pages += n
                if n < len(batch):
                    break
        except StorageError as e:
            logger.warning("storage query for %r failed, treated as a miss: %s", op.request_id, e)
            op.error = _untraced(e)
        return hit_pages

    async def _query(self, op: PrefetchOperation) -> bool:
        """Count ``op``'s hits, agree them, then load or end it; whether the loop goes on.

        ``False``: the ranks agreed to detach the backend (``auto_detach``):
        the query loop stops on every rank at this same agreement.
        """
        hit_pages = 0 if op._frozen else await self._count_hits(op)
        # Every rank makes exactly one agreement per prefetch call, whatever its data.
        cached = op.cached_tokens // self.page_size
        end, low, healthy = await self._agree_hits(op._seq, cached, hit_pages)
        hit_pages = max(0, end - cached) if healthy else 0
        hit_tokens = hit_pages * self.page_size
        op.storage_hit_tokens = hit_tokens
        if not healthy:
            self._end(op, PrefetchState.REVOKED)
            return False
        if not self._group_loads(end, low):
            # Agreed on every rank: no rank loads, no completion to agree.
            if op._frozen:
                self._end(op, PrefetchState.TERMINATED)
            else:
                self.stats.prefetch_revoked += 1
                self._end(op, PrefetchState.REVOKED)
            return True
        if self._rounds is not None:
            # Every rank loads it (or, terminated here, contributes 0): its
            # completed tokens are agreed once it has ended on every rank.
            op._agreeing = True
            self._rounds.agree_end(
                op._seq,
                functools.partial(self._local_end, op),
                functools.partial(self._agreed_end, op),
            )
        if op._frozen:
            self._end(op, PrefetchState.TERMINATED)
        elif not hit_pages:
            # Another rank holds less: this one already has the agreed prefix.
            self.stats.prefetch_revoked += 1
            self._end(op, PrefetchState.REVOKED)
        else:
            self.stats.prefetch_tokens_hit += hit_tokens
            op.state = PrefetchState.LOADING
            self._loads[op] = self.tasks.spawn(self._load(op, hit_pages), "a storage prefetch")
        return True

    def _group_loads(self, end: int, low: int) -> bool:
        """Whether, by the agreed prefix end and the lowest rank's cached pages (both
        the same on every rank), the rank furthest behind loads: then every rank
        agrees the completed prefix too."""
        return (end - low) * self.page_size >= max(self.config.prefetch_threshold, 1)

    async def _agree_hits(self, seq: int, cached: int, hit_pages: int) -> tuple[int, int, bool]:
        """Where the prefix of prefetch call ``seq`` ends, in pages, the lowest rank's
        ``cached`` pages, and whether the backend is kept (`PrefetchRounds.hits`;
        without a TP group, this rank's own answer). Not kept: detach it now."""
        if self._rounds is None:
            return cached + hit_pages, cached, True
        end, low, healthy = await self._rounds.hits(seq, cached, hit_pages)
        if not healthy and not self._closing:
            self.faults.detach()
            logger.warning(
                "a TP rank gave up on its storage backend: detaching %s on this rank too",
                self.backend.name,
            )
            self.slots.storage_failed(self)
        return end, low, healthy

    @staticmethod
    async def _local_end(op: PrefetchOperation) -> int:
        """``op``'s prefix end in tokens, once it has ended on this rank."""
        await op._ended_locally.wait()
        return op.cached_tokens + op.completed_tokens

    def _agreed_end(self, op: PrefetchOperation, agreed: int) -> None:
        """Every rank ended ``op``; ``agreed`` is the MIN prefix end: end it for its caller.

        Every rank then hands over the same prefix, as SGLang's all-reduce on
        completion does.
        """
        state = op._local_end
        assert state is not None
        op.completed_tokens = max(0, min(op.completed_tokens, agreed - op.cached_tokens))
        self._finish(op, state)

    async def _load(self, op: PrefetchOperation, hit_pages: int) -> None:
        """Read ``op``'s first ``hit_pages`` pages into its host slots, then end it.

        The pages are read ``io_batch_pages`` at a time, up to
        ``io_concurrency`` batches at once across the tier. ``completed_tokens``
        grows over the contiguous prefix of what landed (`_ArrivedPrefix`).
        """
        prefix = _ArrivedPrefix(hit_pages, self.config.io_batch_pages)
        keys = self.namespace.keys(op.hash_values[:hit_pages])
        reads = [
            asyncio.ensure_future(self._read_batch(op, prefix, i, keys))
            for i in range(prefix.batches)
        ]
        op._io_tasks.update(reads)
        try:
            # A read that `terminate_prefetch` cancelled ends cancelled: not an error.
            results = await asyncio.gather(*reads, return_exceptions=True)
        except asyncio.CancelledError:  # the tier stops: gather waited for every read
            self._end(op, PrefetchState.TERMINATED)
            raise
        bug = next((r for r in results if isinstance(r, Exception)), None)
        if bug is not None:  # the op ends, then the group reports the bug
            op.error = bug
            self._end(op, PrefetchState.FAILED)
            raise bug
        if op._frozen:
            self._end(op, PrefetchState.TERMINATED)
        else:
            self._end(op, PrefetchState.FAILED if op.error is not None else PrefetchState.DONE)

    async def _read_batch(
        self, op: PrefetchOperation, prefix: _ArrivedPrefix, batch: int, keys: list[PageKey]
    ) -> None:
        """Read one batch of ``op``'s pages into its host slots and count what landed."""
        async with self._io_slots:
            if prefix.stopped or op._frozen:
                return
            lo, hi = prefix.bounds(batch)
            ps = self.page_size
            pool = self.slots.pool
            pages = [pool.page_buffer(s) for s in op.host_indices[lo * ps : hi * ps : ps].tolist()]
            try:
                got = await self._calls.get(keys[lo:hi], pages)
            except StorageError as e:
                logger.warning(
                    "prefetch %r: storage read failed, keeping what arrived: %s", op.request_id, e
                )
                op.error = _untraced(e)
                prefix.land(batch, 0)
                return
            n_ok = _leading_ok(got)
            self.stats.prefetch_pages_fetched += n_ok
            self.stats.bytes_read += n_ok * self.page_bytes
            prefix.land(batch, n_ok)
            if not op._frozen:
                op.completed_tokens = prefix.pages * ps

    def _end(self, op: PrefetchOperation, state: PrefetchState) -> None:
        """``op`` ended on this rank: finish it, or (TP, loading) let the ranks agree first.

        Nothing writes into its slots any more when this is called.
        """
        if op.done() or op._local_end is not None:
            return
        op._frozen = True
        if op._agreeing:
            op._local_end = state
            op._ended_locally.set()
            return
        self._finish(op, state)

    def _finish(self, op: PrefetchOperation, state: PrefetchState) -> None:
        """Final state, then free the host slots past completed_tokens (nothing writes them now)."""
        if op.done():
            return
        op._frozen = True
        op.state = state
        op.end_time = time.monotonic()
        if state is PrefetchState.REVOKED:
            op.completed_tokens = 0
        if state is PrefetchState.DONE:
            self.stats.prefetch_completed += 1
        elif state is PrefetchState.FAILED:
            self.stats.prefetch_failed += 1
        self.slots.release(op.host_indices, fill=True)
        rest = op.host_indices[op.completed_tokens :]
        if rest.numel():
            self.slots.free(rest)
        self._held_tokens -= int(rest.numel())
        # The completed prefix counts until the caller takes it (or a reset frees it).
        op._on_handover = functools.partial(self._handed_over, self._held_generation)
        self._ops.discard(op)
        self._loads.pop(op, None)
        self._work_changed()
        settle(op, None)

    async def terminate_prefetch(self, op: PrefetchOperation) -> tuple[int, list[str]]:
        """Stop ``op`` and hand its completed prefix to the caller.

        ``completed_tokens`` is frozen at once; the coroutine returns once no
        backend call of ``op`` can write any more and its unfilled host slots
        are freed.

        Returns:
            ``(completed_tokens, hash_values[:completed pages])`` (see
            `PrefetchOperation.take_completed`). The caller now owns
            ``op.host_indices[:completed_tokens]``.
        """
        if not op.done() and not op._frozen:
            self.stats.prefetch_terminated += 1
        op._frozen = True
        for t in list(op._io_tasks):
            t.cancel()
        await op.wait()
        return op.take_completed()

    async def terminate_all(self) -> None:
        """Terminate every prefetch and wait for every backup; the tier stays attached.

        Returns once no prefetch or backup is running (a reconnect probe may
        go on). The prefetches' completed prefixes are handed over (to be
        freed by the caller, as `TierController.reset` does).
        """
        while self._ops or self._backups:
            await asyncio.gather(*(self.terminate_prefetch(op) for op in list(self._ops)))
            await self.wait_idle()

    # -- backup ---------------------------------------------------------------

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        prior_hash: str | None = None,
        *,
        node_id: object = None,
        hash_values: list[str] | None = None,
        track: bool = True,
        checked: bool = False,
    ) -> BackupOperation:
        """Back ``host_indices`` (holding ``token_ids``' KV) up to storage, batch by batch.

        The host slots stay the caller's but cannot be evicted until the backup
        ends. With ``write_enabled`` false (MLA on a TP rank other than 0) the
        backup completes at once without IO: rank 0 writes for everyone.
        ``track``: report the ended operation through `drain_backup_acks` (an
        engine's scheduler polls it); a caller that awaits the operation or
        registers a done callback passes ``False``, or the ended operations
        pile up until it drains them. ``checked``: as in `prefetch` (``track``
        included).

        Raises:
            InvalidInputError: bad arguments (see `check_storage_args`).
            StateError: a device->host copy or a prefetch still fills some
                of ``host_indices`` (see `check_storage_args`).
        """
        if checked:
            host, tokens = host_indices, token_ids
        else:
            host, tokens = check_storage_args(
                self.slots,
                self.namespace,
                host_indices,
                token_ids,
                prior_hash,
                hash_values,
                fill=False,
            )
            check_bool(track, "track")
        op = BackupOperation(
            node_id, host, hash_values or [], self._loop.create_future(), track=track
        )
        # Spawned first (it runs later): a closed group refuses it before anything is held.
        task = self.tasks.spawn(self._backup(op, tokens, prior_hash), "a backup")
        # A task cancelled before its first step never runs `_backup`'s cleanup: end it here.
        task.add_done_callback(lambda _t: self._end_backup(op))
        self._backups[op] = task
        self.slots.hold(host)
        self.stats.backup_ops += 1
        self._work_changed()
        return op

    async def _backup(self, op: BackupOperation, tokens: Sequence[int], prior: str | None) -> None:
        """Hash the pages if needed, write them (`_write_pages`), then end ``op``."""
        try:
            if not op.hash_values:
                op.hash_values = await self._hashes(tokens, prior)
            if self.write_enabled:
                await self._write_pages(op)
            else:
                op.completed_tokens = op.host_indices.numel()
        except StorageError as e:
            self.stats.backup_failed += 1
            op.error = _untraced(e)
            # While the backend is down, the outage was logged once (and so
            # will its end be): a warning for every backup it skips would flood
            # the log of a busy server.
            logger.log(
                logging.DEBUG if self.down else logging.WARNING,
                "backup of %r ended early after %d tokens: %s",
                op.node_id,
                op.completed_tokens,
                e,
            )
        except asyncio.CancelledError:
            # A new one: the one raised carries this frame, which holds ``op``.
            op.error = asyncio.CancelledError()
            raise
        finally:
            self._end_backup(op)

    async def _write_pages(self, op: BackupOperation) -> None:
        """Write ``op``'s pages ``backup_batch_pages`` at a time, skipping those already stored.

        Raises:
            StorageError: a call failed or the backend refused a page
                (``completed_tokens`` counts what was stored before it).
        """
        keys = self.namespace.keys(op.hash_values)
        step = self.config.backup_batch_pages
        for lo in range(0, len(keys), step):
            stored = await self._write_batch(op, lo, keys[lo : lo + step])
            op.completed_tokens = (lo + stored) * self.page_size
            if stored < len(keys[lo : lo + step]):
                raise StorageError(f"backup of {op.node_id!r}: the backend refused a page")

    async def _write_batch(self, op: BackupOperation, lo: int, keys: list[PageKey]) -> int:
        """Store pages ``lo ..`` of ``op`` under ``keys``; return how many leading ones are stored."""
        have = await self._calls.exists(keys)
        self.stats.backup_pages_skipped += have
        todo = keys[have:]
        if not todo:
            return have
        ps = self.page_size
        starts = op.host_indices[(lo + have) * ps : (lo + len(keys)) * ps : ps].tolist()
        pages = [self.slots.pool.page_buffer(s) for s in starts]
        n_ok = _leading_ok(await self._calls.set(todo, pages))
        self.stats.backup_pages_written += n_ok
        self.stats.bytes_written += n_ok * self.page_bytes
        return have + n_ok

    def _end_backup(self, op: BackupOperation) -> None:
        """Release ``op``'s slots and end it; idempotent."""
        if op.done():
            return
        self.slots.release(op.host_indices)
        if op._track:
            self._finished_backups.append(op)
        self._backups.pop(op, None)
        self._work_changed()
        if not op.done():
            settle(op, None)

    def drain_backup_acks(self) -> list[BackupOperation]:
        """Backups that ended since the last call, oldest first (non-blocking)."""
        out = list(self._finished_backups)
        self._finished_backups.clear()
        return out

    # -- lifecycle ------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A prefetch or a backup is running (a reconnect probe does not count)."""
        return not self._idle.is_set()

    async def wait_idle(self) -> None:
        """Return once no prefetch or backup is running (a probe of a down backend may go on).

        Event-driven: it wakes when the last running operation ends.
        """
        await self._idle.wait()

    async def stop(self) -> None:
        """Terminate every prefetch, cancel every backup, stop the query coroutine.

        Returns once no coroutine of the tier is running and every host slot
        it held is freed. Idempotent. The backend is closed when the tier owns it.
        Tracked backups it ended are still reported by `drain_backup_acks`.
        """
        if self._closing:
            return
        self._closing = True
        self.faults.closing()
        for op in self._ops:
            op._frozen = True
        self._query_queue.put_nowait(None)
        await self._end_tasks()
        # A task that ended with an exception (the cancelled probe) holds its
        # traceback, whose frames hold this tier, and the tier holds host
        # pool memory: drop them, or only the garbage collector frees the pool.
        await self.faults.aclose()
        self._loads.clear()
        self._backups.clear()
        # Operations still queued for the query loop never started: end them now.
        for op in list(self._ops):
            self._end(op, PrefetchState.TERMINATED)
        if self._rounds is not None:
            # The loads ended: agree what each completed (the other ranks stop too).
            await self._rounds.aclose()
        if self.owns_backend:
            try:
                await self.backend.aclose()
            except Exception as e:
                logger.warning("closing the storage backend failed: %r", e)

    def _running(self) -> list[asyncio.Task[Any]]:
        tasks = [self._query_task, *self._loads.values(), *self._backups.values()]
        return [t for t in tasks if t is not None and not t.done()]

    async def _end_tasks(self) -> None:
        """Cancel the tier's loads and backups; let the query loop finish; wait for all."""
        while tasks := self._running():
            for t in tasks:
                if t is not self._query_task:
                    t.cancel()
            await asyncio.wait(tasks)
