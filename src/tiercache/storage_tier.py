"""The storage (L3) half of the controller: prefetch into host memory and backup
from it, as coroutines.

Where SGLang's ``HiCacheController`` runs a prefetch thread, a prefetch-IO
thread and a backup thread polling queues, `StorageTier` runs:

* one **query coroutine** that takes prefetch operations in arrival order,
  hashes their pages, asks the backend ``batch_exists`` 128 pages at a time,
  stops at the first miss, agrees the hit count across tensor-parallel ranks
  with one all-reduce (MIN) per operation, and revokes operations under the
  threshold;
* bounded-concurrency **IO coroutines** that fill host pages batch by batch,
  growing ``completed_tokens`` only over a contiguous prefix whose bytes are in
  place;
* **backup coroutines** that write host pages to storage batch by batch.

Host slot ownership: `prefetch` takes ownership of the host slots it is given.
When the operation ends (done, revoked, failed, terminated, detached) the
slots past ``completed_tokens`` are freed by the tier, *after* every backend
call that could still write into them has settled; the first
``completed_tokens`` slots belong to the caller once it has called
`terminate_prefetch`. A backend call is never abandoned while it may still be
writing: a timed-out call is cancelled and awaited, and backends guarantee
(see `StorageBackend.batch_get`) that a cancelled call writes nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from tiercache.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidInputError,
    StorageError,
    StorageTimeoutError,
)
from tiercache.index.hashing import pack_tokens, page_hashes
from tiercache.memory.allocator import check_slot_indices
from tiercache.observe import observe
from tiercache.storage.base import PageKey, StorageBackend
from tiercache.storage.keys import StorageNamespace

if TYPE_CHECKING:
    from tiercache._tasks import TaskGroup
    from tiercache.memory.allocator import PageAllocator
    from tiercache.memory.pools import HostKVPool

__all__ = [
    "FAULT_POLICIES",
    "BackupOperation",
    "PrefetchOperation",
    "PrefetchState",
    "StorageTier",
    "StorageTierConfig",
    "StorageTierStats",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Pages hashed inline on the loop; longer prompts are hashed in a worker thread.
_INLINE_HASH_PAGES = 64


def _observe_call(what: str, task: asyncio.Future[Any], seconds: float) -> None:
    """Report one backend call's latency and outcome to `tiercache.observe`."""
    outcome = "cancelled" if task.cancelled() else "error" if task.exception() else "ok"
    observe("storage", what, seconds, outcome)


class _Abstain:
    """A prefetch this rank did not start (storage down, rate limited): the query
    loop still takes part in the hit-count agreement, with 0 hits."""


_ABSTAIN = _Abstain()


def collective_device(tp_group: Any, pool_device: torch.device) -> torch.device:
    """The device of the tensor the TP hit-count agreement reduces over ``tp_group``.

    A gloo (or MPI) group reduces a CPU tensor; an NCCL group needs a tensor on
    this rank's GPU (a CPU tensor makes NCCL fail and would stop the prefetch
    loop). A group with both backends (``"cpu:gloo,cuda:nccl"``) uses gloo.

    Raises:
        ConfigError: ``tp_group`` is not a process group, uses a backend other
            than gloo, MPI or NCCL, or is NCCL with a CPU device pool.
    """
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(tp_group)).lower()
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"tp_group is not a usable torch.distributed process group: {e}") from e
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        if pool_device.type != "cuda":
            raise ConfigError(
                "tp_group is an NCCL group but the device pool is on "
                f"{pool_device}: pass a gloo group (dist.new_group(ranks, backend='gloo'))"
            )
        return pool_device
    raise ConfigError(f"tp_group backend {backend!r} is not supported: use gloo or nccl")


class PrefetchState(enum.Enum):
    QUERYING = "querying"
    LOADING = "loading"
    DONE = "done"  # every hit page is in host memory
    REVOKED = "revoked"  # under the threshold: nothing fetched
    FAILED = "failed"  # a storage error ended it; completed pages kept
    TERMINATED = "terminated"  # stopped by terminate_prefetch / detach / close


_FINAL = (PrefetchState.DONE, PrefetchState.REVOKED, PrefetchState.FAILED, PrefetchState.TERMINATED)


#: What the tier does after ``fault_threshold`` consecutive failed backend calls:
#: ``none`` keeps calling (each call a miss); ``auto_detach`` detaches the
#: backend (attach it again by hand); ``auto_reconnect`` stops calling it —
#: prefetches miss at once, backups are skipped — while a probe retries with
#: exponential backoff, and resumes when the backend answers again.
FAULT_POLICIES: tuple[str, ...] = ("none", "auto_detach", "auto_reconnect")


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
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("timeout_s", "reconnect_backoff_s", "reconnect_backoff_max_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"{name} must be a positive number, got {v!r}")


@dataclass(slots=True)
class StorageTierStats:
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


class PrefetchOperation:
    """One storage prefetch into host memory (SGLang's ``PrefetchOperation``).

    ``completed_tokens`` counts the leading tokens whose bytes are in host
    memory; it only grows, and stops growing once the operation is terminated.
    ``await op`` waits for the operation to end (it never raises for storage
    errors: those end it as `FAILED`, with what was completed kept).
    """

    def __init__(
        self,
        request_id: object,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        prior_hash: str | None,
        done: asyncio.Future[None],
    ) -> None:
        self.request_id = request_id
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.prior_hash = prior_hash
        self.hash_values: list[str] = []
        self.storage_hit_tokens = 0
        self.completed_tokens = 0
        self.state = PrefetchState.QUERYING
        self.error: BaseException | None = None
        self.start_time = time.monotonic()
        self.end_time: float | None = None
        self._done = done
        self._frozen = False  # completed_tokens may no longer grow
        self._io_tasks: set[asyncio.Task[Any]] = set()
        self._released = False

    @property
    def num_tokens(self) -> int:
        return int(self.host_indices.numel())

    def done(self) -> bool:
        return self._done.done()

    def is_terminated(self) -> bool:
        return self._frozen

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._done).__await__()

    def __repr__(self) -> str:
        return (
            f"PrefetchOperation({self.request_id!r}, {self.state.value}, "
            f"completed={self.completed_tokens}/{self.num_tokens})"
        )


class BackupOperation:
    """One backup of host pages to storage. ``await op`` waits for it to end.

    ``completed_tokens`` counts the leading tokens stored (or found already
    stored); a storage error ends the backup early, keeping what was done.
    """

    def __init__(
        self,
        node_id: object,
        host_indices: torch.Tensor,
        hash_values: list[str],
        done: asyncio.Future[None],
    ) -> None:
        self.node_id = node_id
        self.host_indices = host_indices
        self.hash_values = hash_values
        self.completed_tokens = 0
        self.error: BaseException | None = None
        self._done = done

    def done(self) -> bool:
        return self._done.done()

    @property
    def succeeded(self) -> bool:
        return (
            self._done.done()
            and self.error is None
            and self.completed_tokens == self.host_indices.numel()
        )

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._done).__await__()

    def __repr__(self) -> str:
        return f"BackupOperation({self.node_id!r}, completed={self.completed_tokens}/{self.host_indices.numel()})"


class HostSlots(Protocol):
    """What a storage tier may do with its controller's host pool, and nothing more."""

    @property
    def pool(self) -> HostKVPool: ...  # the pinned host pool (read/write page views)
    @property
    def allocator(self) -> PageAllocator: ...  # host slot allocator (free unfilled prefetch slots)
    @property
    def device(self) -> torch.device: ...  # the device pool's device (TP collectives pick theirs)
    def hold(self, host_indices: torch.Tensor) -> None: ...  # slots in use by a storage call
    def release(self, host_indices: torch.Tensor) -> None: ...  # ... no longer
    def storage_failed(self, tier: StorageTier) -> None: ...  # auto_detach: the owner detaches it


class StorageTier:
    """Prefetch and backup between a host pool and one attached storage backend.

    Owned by a `TierController` (``controller.storage``); created by
    `TierController.attach_storage_backend` and stopped by
    `TierController.detach_storage_backend`. Every method runs on the
    controller's loop.
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
    ) -> None:
        self.slots = slots
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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ops: set[PrefetchOperation] = set()
        self._io_slots = asyncio.Semaphore(config.io_concurrency)
        self._held_tokens = 0  # host tokens held by prefetches not yet handed over
        self._finished_backups: deque[BackupOperation] = deque()
        self._collective = None
        self._collective_device = torch.device("cpu")
        if tp_group is not None:
            self._collective_device = collective_device(tp_group, slots.device)
            import concurrent.futures

            # Collectives must be issued in the same order on every rank: one thread.
            self._collective = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tiercache-collective"
            )
        self._closing = False
        self._failures = 0  # consecutive failed backend calls
        self.down = False  # auto_reconnect: the backend is not called until a probe succeeds
        self._probe: asyncio.Task[None] | None = None
        self._query_task = self._spawn(self._query_loop())
        self.error: BaseException | None = None  # a bug that stopped a coroutine

    # -- task ownership -------------------------------------------------------

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.error is None:
            self.error = exc
            logger.error("a storage coroutine stopped on a bug: %r", exc, exc_info=exc)

    # -- helpers --------------------------------------------------------------

    async def _call(self, what: str, coro: Awaitable[T]) -> T:
        """Await a backend call with the tier's timeout; errors become StorageError.

        Counts consecutive failures for the fault policy. While the backend is
        down (``auto_reconnect``) the call is not made: it fails at once with
        `BackendUnavailableError`.
        """
        if self.down:
            if asyncio.iscoroutine(coro):
                coro.close()
            self.stats.skipped_while_down += 1
            raise BackendUnavailableError("the storage backend is down; a probe is retrying it")
        task = asyncio.ensure_future(coro)
        t0 = time.perf_counter()
        task.add_done_callback(lambda t: _observe_call(what, t, time.perf_counter() - t0))
        try:
            async with asyncio.timeout(self.config.timeout_s):
                result = await asyncio.shield(task)
        except TimeoutError:
            self.stats.storage_timeouts += 1
            task.cancel()
            # Wait for the call to settle: it may be writing into host pages.
            with contextlib.suppress(BaseException):
                await task
            self._failed()
            raise StorageTimeoutError(
                f"storage {what} timed out after {self.config.timeout_s} s"
            ) from None
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
            raise
        except StorageError:
            self.stats.storage_errors += 1
            self._failed()
            raise
        except Exception as e:
            # A backend that raises outside the StorageError tree is still a storage failure.
            self.stats.storage_errors += 1
            self._failed()
            raise StorageError(f"storage {what} failed: {e!r}") from e
        self._failures = 0
        return result

    def _failed(self) -> None:
        self._failures += 1
        policy = self.config.fault_policy
        if self._failures < self.config.fault_threshold or policy == "none" or self._closing:
            return
        if policy == "auto_detach":
            if not self.down:
                self.down = True
                self.stats.auto_detaches += 1
                logger.warning(
                    "storage backend %s failed %d times in a row: detaching it",
                    self.backend.name,
                    self._failures,
                )
                self.slots.storage_failed(self)
        elif not self.down:
            self.down = True
            self.stats.outages += 1
            logger.warning(
                "storage backend %s failed %d times in a row: treating it as down and probing it",
                self.backend.name,
                self._failures,
            )
            self._probe = self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        """Probe the backend with exponential backoff until it answers, then resume."""
        delay = self.config.reconnect_backoff_s
        probe = [self.namespace.key("0" * 64)]
        while not self._closing:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self.backend.batch_exists(probe)
            except (TimeoutError, Exception) as e:
                logger.debug("storage probe failed: %r", e)
                delay = min(delay * 2, self.config.reconnect_backoff_max_s)
                continue
            self.down = False
            self._failures = 0
            self.stats.reconnects += 1
            logger.warning("storage backend %s answers again: resuming", self.backend.name)
            return

    async def _hashes(self, token_ids: Sequence[int], prior: str | None) -> list[str]:
        n_pages = len(token_ids) // self.page_size
        if n_pages <= _INLINE_HASH_PAGES:
            return page_hashes(token_ids, self.page_size, prior)
        return await self._loop.run_in_executor(None, page_hashes, token_ids, self.page_size, prior)

    def _check_tokens(
        self, host_indices: torch.Tensor, token_ids: Sequence[int]
    ) -> tuple[torch.Tensor, Sequence[int]]:
        host = check_slot_indices(
            host_indices, self.page_size, self.slots.pool.num_slots, "host_indices"
        )
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        pack_tokens(token_ids[: self.page_size])  # type checks the tokens early
        if len(token_ids) != host.numel():
            raise InvalidInputError(
                f"{len(token_ids)} tokens for {host.numel()} host slots: they must be equal"
            )
        if not self.slots.allocator.is_allocated(host):
            raise InvalidInputError("host_indices include slots that are not allocated")
        return host, token_ids

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
    ) -> PrefetchOperation | None:
        """Start fetching ``token_ids``' pages from storage into ``host_indices``.

        Returns:
            The operation (the tier now owns ``host_indices``), or ``None`` when
            rate-limited or the backend is down (the caller keeps its slots).

        Raises:
            InvalidInputError: slots and tokens that do not match, bad tokens.
        """
        host, tokens = self._check_tokens(host_indices, token_ids)
        if self.down:
            self.stats.skipped_while_down += 1
            self.abstain()
            return None
        cap = self.config.prefetch_capacity_tokens
        if cap is not None and self._held_tokens + host.numel() > cap and self._held_tokens > 0:
            self.stats.prefetch_rate_limited += 1
            self.abstain()
            return None
        op = PrefetchOperation(request_id, host, tokens, prior_hash, self._loop.create_future())
        self._held_tokens += op.num_tokens
        self.slots.hold(host)
        self._ops.add(op)
        self.stats.prefetch_started += 1
        self._query_queue.put_nowait(op)
        return op

    def abstain(self) -> None:
        """With a TP group: this rank skips a prefetch, yet joins its agreement (with 0 hits).

        Every rank makes one collective per `prefetch` call, whether or not it
        started the prefetch, so a rank whose storage is down or rate limited
        neither blocks the others nor desynchronises their collectives; the
        MIN it contributes (0) revokes the prefetch on every rank.
        """
        if self.tp_group is not None:
            self._query_queue.put_nowait(_ABSTAIN)

    async def _query_loop(self) -> None:
        while True:
            op = await self._query_queue.get()
            if op is None:
                return
            if isinstance(op, _Abstain):
                await self._agree_min(0)
                continue
            try:
                await self._query(op)
            except asyncio.CancelledError:
                self._end(op, PrefetchState.TERMINATED)
                raise
            except BaseException as e:  # a bug: end the op, surface the error
                op.error = e
                self._end(op, PrefetchState.FAILED)
                raise

    async def _query(self, op: PrefetchOperation) -> None:
        hit_pages = 0
        if not op._frozen:
            try:
                op.hash_values = await self._hashes(op.token_ids, op.prior_hash)
                keys = self.namespace.keys(op.hash_values)
                step = self.config.query_batch_pages
                for start in range(0, len(keys), step):
                    if op._frozen:
                        break
                    batch = keys[start : start + step]
                    n = await self._call("exists", self.backend.batch_exists(batch))
                    hit_pages += max(0, min(int(n), len(batch)))
                    if n < len(batch):
                        break
            except StorageError as e:
                logger.warning(
                    "storage query for %r failed, treated as a miss: %s", op.request_id, e
                )
                op.error = e
        # Every rank makes exactly one collective per operation, whatever its data.
        hit_pages = await self._agree_min(hit_pages)
        hit_tokens = hit_pages * self.page_size
        op.storage_hit_tokens = hit_tokens
        if op._frozen:
            self._end(op, PrefetchState.TERMINATED)
        elif hit_tokens < max(self.config.prefetch_threshold, 1):
            self.stats.prefetch_revoked += 1
            self._end(op, PrefetchState.REVOKED)
        else:
            self.stats.prefetch_tokens_hit += hit_tokens
            op.state = PrefetchState.LOADING
            self._spawn(self._load(op, hit_pages))

    async def _agree_min(self, value: int) -> int:
        if self.tp_group is None:
            return value
        import torch.distributed as dist

        group = self.tp_group
        device = self._collective_device

        def reduce() -> int:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                t = torch.tensor([value], dtype=torch.int64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
                return int(t.item())

        return await self._loop.run_in_executor(self._collective, reduce)

    async def _load(self, op: PrefetchOperation, hit_pages: int) -> None:
        ps = self.page_size
        keys = self.namespace.keys(op.hash_values[:hit_pages])
        step = self.config.io_batch_pages
        batches = [(s, min(s + step, hit_pages)) for s in range(0, hit_pages, step)]
        arrived = [False] * len(batches)
        next_batch = 0  # first batch not yet counted into completed_tokens
        stop = asyncio.Event()
        pool = self.slots.pool
        host_starts = op.host_indices[::ps].tolist()

        async def one(i: int, lo: int, hi: int) -> None:
            nonlocal next_batch
            async with self._io_slots:
                if stop.is_set() or op._frozen:
                    return
                pages = [pool.page_buffer(s) for s in host_starts[lo:hi]]
                try:
                    got = await self._call("get", self.backend.batch_get(keys[lo:hi], pages))
                except StorageError as e:
                    logger.warning(
                        "prefetch %r: storage read failed, keeping what arrived: %s",
                        op.request_id,
                        e,
                    )
                    op.error = e
                    stop.set()
                    return
                n_ok = 0
                for g in got:
                    if not g:
                        break
                    n_ok += 1
                self.stats.prefetch_pages_fetched += n_ok
                self.stats.bytes_read += n_ok * self.page_bytes
                if n_ok < hi - lo:
                    # A hole: the contiguous prefix ends inside this batch.
                    stop.set()
                    batches[i] = (lo, lo + n_ok)
                arrived[i] = True
                while next_batch < len(batches) and arrived[next_batch] and not op._frozen:
                    b_lo, b_hi = batches[next_batch]
                    op.completed_tokens = b_hi * ps
                    if b_hi < (next_batch + 1) * step and b_hi < hit_pages:
                        next_batch = len(batches)  # the hole ends the prefix
                        break
                    next_batch += 1

        try:
            tasks = [asyncio.ensure_future(one(i, lo, hi)) for i, (lo, hi) in enumerate(batches)]
            op._io_tasks.update(tasks)
            try:
                await asyncio.gather(*tasks)
            except asyncio.CancelledError:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        except asyncio.CancelledError:
            self._end(op, PrefetchState.TERMINATED)
            raise
        if op._frozen:
            state = PrefetchState.TERMINATED
        elif op.error is not None:
            state = PrefetchState.FAILED
        else:
            state = PrefetchState.DONE
        self._end(op, state)

    def _end(self, op: PrefetchOperation, state: PrefetchState) -> None:
        """Final state, then free the host slots past completed_tokens (nothing writes them now)."""
        if op._done.done():
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
        self.slots.release(op.host_indices)
        rest = op.host_indices[op.completed_tokens :]
        if rest.numel():
            self.slots.allocator.free(rest)
        self._held_tokens -= int(rest.numel())
        self._ops.discard(op)
        op._done.set_result(None)

    async def terminate_prefetch(self, op: PrefetchOperation) -> tuple[int, list[str]]:
        """Stop ``op`` and hand its completed prefix to the caller.

        ``completed_tokens`` is frozen at once; the coroutine returns once no
        backend call of ``op`` can write any more and its unfilled host slots
        are freed.

        Returns:
            ``(completed_tokens, hash_values[:completed pages])``. The caller now
            owns ``op.host_indices[:completed_tokens]``.
        """
        first = not op._frozen or not op._released
        if not op._done.done() and not op._frozen:
            self.stats.prefetch_terminated += 1
        op._frozen = True
        for t in list(op._io_tasks):
            t.cancel()
        await op
        if first and not op._released:
            op._released = True
            self._held_tokens -= op.completed_tokens
        return op.completed_tokens, op.hash_values[: op.completed_tokens // self.page_size]

    # -- backup ---------------------------------------------------------------

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        prior_hash: str | None = None,
        *,
        node_id: object = None,
        hash_values: list[str] | None = None,
    ) -> BackupOperation:
        """Back ``host_indices`` (holding ``token_ids``' KV) up to storage, batch by batch.

        The host slots stay the caller's but cannot be evicted until the backup
        ends. With ``write_enabled`` false (MLA on a TP rank other than 0) the
        backup completes at once without IO: rank 0 writes for everyone.

        Raises:
            InvalidInputError: slots and tokens that do not match.
        """
        host, tokens = self._check_tokens(host_indices, token_ids)
        done = self._loop.create_future()
        op = BackupOperation(node_id, host, hash_values or [], done)
        self.stats.backup_ops += 1
        self.slots.hold(host)
        self._spawn(self._backup(op, tokens, prior_hash))
        return op

    async def _backup(self, op: BackupOperation, tokens: Sequence[int], prior: str | None) -> None:
        ps = self.page_size
        try:
            if not op.hash_values:
                op.hash_values = await self._hashes(tokens, prior)
            if not self.write_enabled:
                op.completed_tokens = op.host_indices.numel()
                return
            keys = self.namespace.keys(op.hash_values)
            starts = op.host_indices[::ps].tolist()
            pool = self.slots.pool
            step = self.config.backup_batch_pages
            for lo in range(0, len(keys), step):
                batch_keys = keys[lo : lo + step]
                have = await self._call("exists", self.backend.batch_exists(batch_keys))
                have = max(0, min(int(have), len(batch_keys)))
                self.stats.backup_pages_skipped += have
                todo_keys: list[PageKey] = batch_keys[have:]
                if todo_keys:
                    pages = [pool.page_buffer(s) for s in starts[lo + have : lo + len(batch_keys)]]
                    ok = await self._call("set", self.backend.batch_set(todo_keys, pages))
                    n_ok = 0
                    for g in ok:
                        if not g:
                            break
                        n_ok += 1
                    self.stats.backup_pages_written += n_ok
                    self.stats.bytes_written += n_ok * self.page_bytes
                    if n_ok < len(todo_keys):
                        op.completed_tokens = (lo + have + n_ok) * ps
                        raise StorageError(f"backup of {op.node_id!r}: the backend refused a page")
                op.completed_tokens = (lo + len(batch_keys)) * ps
        except StorageError as e:
            self.stats.backup_failed += 1
            op.error = e
            logger.warning(
                "backup of %r ended early after %d tokens: %s", op.node_id, op.completed_tokens, e
            )
        except asyncio.CancelledError as e:
            op.error = e
            raise
        finally:
            self.slots.release(op.host_indices)
            self._finished_backups.append(op)
            if not op._done.done():
                op._done.set_result(None)

    def drain_backup_acks(self) -> list[BackupOperation]:
        """Backups that ended since the last call, oldest first (non-blocking)."""
        out = list(self._finished_backups)
        self._finished_backups.clear()
        return out

    # -- lifecycle ------------------------------------------------------------

    def _work(self) -> list[asyncio.Task[Any]]:
        """Load and backup tasks: not the query loop, not the reconnect probe."""
        return [t for t in self._tasks if t is not self._query_task and t is not self._probe]

    @property
    def busy(self) -> bool:
        """A prefetch or a backup is running (a reconnect probe does not count)."""
        return bool(self._ops) or bool(self._work())

    async def wait_idle(self) -> None:
        """Return once no prefetch or backup is running (a probe of a down backend may go on)."""
        while True:
            work = self._work()
            if work:
                await asyncio.gather(*work, return_exceptions=True)
            elif self._ops:
                await asyncio.sleep(0.001)  # operations still in the query coroutine
            else:
                return

    async def stop(self) -> None:
        """Terminate every prefetch, cancel every backup, stop the query coroutine.

        Returns once no coroutine of the tier is running and every host slot
        it held is freed. Idempotent. The backend is closed when the tier owns it.
        """
        if self._closing:
            return
        self._closing = True
        for op in list(self._ops):
            op._frozen = True
        self._query_queue.put_nowait(None)
        # Queued, never-queried operations: end them now.
        while True:
            tasks = [t for t in self._tasks if not t.done()]
            for t in tasks:
                if t is not self._query_task:
                    t.cancel()
            if not tasks:
                break
            await asyncio.gather(*tasks, return_exceptions=True)
        for op in list(self._ops):
            self._end(op, PrefetchState.TERMINATED)
        if self._collective is not None:
            collective = self._collective
            await asyncio.to_thread(collective.shutdown, True)
        if self.owns_backend:
            try:
                await self.backend.aclose()
            except Exception as e:
                logger.warning("closing the storage backend failed: %r", e)
