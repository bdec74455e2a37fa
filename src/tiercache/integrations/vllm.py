"""tiercache as a secondary tier of vLLM's KV offloading framework.

vLLM (0.33) offloads KV blocks to a CPU tier it manages itself and cascades
them to *secondary tiers* behind it (``vllm/v1/kv_offload/tiering/``).
`TierCacheTier` is such a tier: it keeps blocks in any tiercache storage
backend (``file:///...``, ``redis://...``, a plugin), in tiercache's page format
(header with the key and the byte format, XXH3-64 checksum of the payload, first writer
wins), so a corrupt, truncated or foreign page is a miss, never wrong KV.

vLLM loads it by module path, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{
          "type": "TierCacheTier",
          "module_path": "tiercache.integrations.vllm",
          "url": "file:///var/cache/tiercache/kv"}]}}'

**Threads.** vLLM calls a tier synchronously from its scheduler (under the
tiering manager's lock). The tier owns one asyncio event loop in a daemon
thread (`LoopThread`, named ``tiercache-vllm-<tier type>``); the backend lives
on that loop. No call from vLLM waits for storage:

- `lookup` answers from a verdict cache. A key it has not seen is queued and
  answered `RETRY`; at the end of the scheduler step (`on_schedule_end`) the
  queued keys go to the loop as one existence query, and the scheduler's
  next lookup finds the verdict (``HIT`` or ``MISS``). A ``MISS`` holds for the
  requests that were told it; a later request asks the store again, since the
  block may have been stored since.
- `submit_store` / `submit_load` schedule one batch on the loop and return;
  `get_finished_jobs` collects the batches that completed, as vLLM's
  `JobResult`.
- Only construction (opening the backend), `drain_jobs` and `shutdown` wait,
  each within a timeout, except that `drain_jobs` also waits out a job stuck
  in I/O that cannot be interrupted (vLLM reuses the region's slots next).

**Zero copy.** A block is the row ``chunk_id`` of the primary region's
memoryview that vLLM hands over; a store writes that slice out and a load reads
into it, with no intermediate copy in this module (the file backend verifies a
read in a scratch buffer before it lands, so a failed check never touches the
row).

**Keys and identity.** A block's key is vLLM's block hash and KV-cache group
index, prefixed by a namespace digest of everything that shapes the bytes:
model, KV dtype, tokens per hash, blocks per chunk, the KV-cache groups (block
sizes, layer names, sliding windows), the bytes per block, the parallel layout
(unless vLLM says the bytes are parallelism-agnostic) and the KV-cache layout.
Two models, dtypes or block sizes never share keys. Instances that share
storage must also share vLLM's hash seed and algorithm
(``--prefix-caching-hash-algo``, and ``PYTHONHASHSEED`` for a
non-cryptographic algorithm).

**Faults.** Every storage call runs under ``timeout_s``. An existence query
that fails answers ``MISS``; a store or load that fails (an error, a timeout,
a page that fails its checks) is reported to vLLM as a failed `JobResult`, with
the blocks that did arrive as ``successful_keys``, and the failed keys'
verdicts turn to ``MISS``, so vLLM recomputes them and keeps serving. A backend
that cannot be opened at start-up (server down) is retried at most every
``reopen_interval_s``; until then every lookup is a miss and every job fails.
A Redis backend reconnects by itself once the server is back.

**Metrics.** With ``metrics_port`` (or ``metrics_registry``) the tier registers
`tiercache.metrics`' collector for its backend, labelled ``engine="vllm"`` and
``tier=<tier type>``, once the backend is open; ``stats()`` is read on the
tier's loop at each scrape. `shutdown` stops the server and unregisters it.

This module imports vLLM: only vLLM's tier factory imports it (tiercache
itself never does). It was written against vLLM 0.33.0, whose tiering API is
marked experimental.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiercache._aio import bounded
from tiercache._checks import check_number, check_positive, parse_bool
from tiercache.errors import (
    BackendUnavailableError,
    ConfigError,
    StorageError,
    StorageTimeoutError,
    TierCacheError,
)
from tiercache.integrations._loop import LoopThread
from tiercache.integrations._metrics import AdapterMetrics, MetricsOptions
from tiercache.memory.pages import PageBuffer
from tiercache.storage.base import PageKey, StorageBackend
from tiercache.storage.registry import open_backend, redact_url

__all__ = ["TierCacheTier", "vllm_identity"]

logger = logging.getLogger(__name__)

_IDENTITY_VERSION = "tiercache-vllm/1"

#: The keys of a ``secondary_tiers`` entry that configure the tier (besides vLLM's
#: own ``type``, ``module_path`` and ``backpressure``).
TIER_KEYS = frozenset(
    {
        "url",
        "backend_options",
        "namespace",
        "timeout_s",
        "open_timeout_s",
        "reopen_interval_s",
        "max_probe_batch",
        "locality",
        "enable_kv_events",
        "metrics_port",
        "metrics_addr",
        "metrics_registry",
    }
)


def vllm_identity(offloading_spec: Any, block_bytes: int) -> dict[str, Any]:
    """The fields of vLLM's configuration that shape a stored block's bytes.

    Args:
        offloading_spec: vLLM's ``OffloadingSpec`` (its ``config`` is an
            ``OffloadingConfig``).
        block_bytes: bytes per block in the primary region (its row stride).

    Returns:
        A JSON-serialisable dict; its sorted JSON form names the namespace.

    Raises:
        ConfigError: the spec has no usable ``OffloadingConfig``.
    """
    try:
        config = offloading_spec.config
        parallel = config.parallel
        agnostic = bool(parallel.is_parallelism_agnostic) or bool(config.replicated_layout)
        identity: dict[str, Any] = {
            "version": _IDENTITY_VERSION,
            "model": str(config.model.name),
            "dtype": str(config.model.dtype),
            "tokens_per_hash": int(config.cache.tokens_per_hash),
            "blocks_per_chunk": int(config.cache.blocks_per_chunk),
            "groups": [
                {
                    "group_id": int(g.group_id),
                    "tokens_per_block": int(g.tokens_per_block),
                    "layer_names": [str(n) for n in g.layer_names],
                    "sliding_window_chunks": g.sliding_window_size_in_chunks,
                }
                for g in config.groups
            ],
            "block_bytes": int(block_bytes),
            "kv_bytes_per_block": int(config.worker_kv_bytes_per_block),
            "kv_cache_layout": config.kv_cache_layout,
            "canonical_layout": bool(config.canonical_layout),
            "parallel": "agnostic"
            if agnostic
            else {
                "world_size": int(parallel.world_size),
                "tp": int(parallel.tp_size),
                "pp": int(parallel.pp_size),
                "pcp": int(parallel.pcp_size),
                "dcp": int(parallel.dcp_size),
            },
        }
        json.dumps(identity)
    except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"the offloading spec carries no usable vLLM OffloadingConfig ({e})"
        ) from None
    return identity


def _dp_index(offloading_spec: Any) -> int:
    """The data-parallel replica of this tier's scheduler (0 without data parallelism).

    Each replica runs its own scheduler, so its own tier: the metrics port is
    offset by it, as SGLang's is by the process rank.
    """
    index = getattr(getattr(offloading_spec.config, "parallel", None), "data_parallel_index", 0)
    return int(index or 0)


@dataclass(slots=True)
class _Probe:
    """One key's existence verdict: ``None`` while the query runs."""

    result: bool | None = None
    in_flight: bool = False
    req_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Outcome:
    """What one store or load batch did, per block (computed on the loop)."""

    done: list[bool]
    seconds: float
    error: str | None = None


@dataclass(slots=True)
class _Job:
    job_id: int
    keys: list[OffloadKey]
    is_load: bool
    future: concurrent.futures.Future[_Outcome]


class TierCacheTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier whose blocks live in a tiercache storage backend.

    vLLM's ``SecondaryTierFactory`` constructs it from one entry of
    ``secondary_tiers``; the entry's keys other than ``type`` and
    ``module_path`` are the keyword arguments below.

    Args:
        offloading_spec: vLLM's offloading spec (identity of the bytes).
        primary_kv_view: vLLM's primary CPU region, one row per block.
        tier_type: the tier's type name in vLLM's configuration.
        backpressure_detector: vLLM's optional back-pressure detector.
        url: the tiercache backend URL (``file:///abs/dir``, ``redis://host:6379/0``,
            ``memory://``, a registered plugin), see `tiercache.storage.open_backend`.
        backend_options: extra keyword options for the backend.
        namespace: an extra label mixed into the key namespace (e.g. to keep
            two deployments of one model apart on a shared store).
        timeout_s: the most any storage call (existence query, store or load
            batch) may take once the backend is open (a call made while an
            open is attempted waits for it, up to ``open_timeout_s``); past
            it the call fails as a miss.
        open_timeout_s: the most opening the backend may take.
        reopen_interval_s: after a failed open, the least time before the next
            attempt (from the end of the failed one; calls that waited for a
            failed open fail with it).
        max_probe_batch: keys queued for an existence query that trigger a
            query before the end of the step.
        locality: ``"LOCAL"`` or ``"REMOTE"``: where vLLM should consider the
            storage to be (tier filters, KV events).
        enable_kv_events: emit a stored-block `OffloadingEvent` for each
            successful store (when vLLM has KV events enabled).
        metrics_port: serve Prometheus metrics of the storage backend
            (`tiercache.metrics`, labelled ``engine="vllm"`` and
            ``tier=<tier_type>``) on this port plus vLLM's data-parallel
            index (each data-parallel replica has its own scheduler and
            tier) (``0``: any free port, in ``metrics.port``); needs
            ``tiercache[metrics]``.
        metrics_addr: the address the metrics server binds (default ``0.0.0.0``).
        metrics_registry: a ``prometheus_client.CollectorRegistry`` to register
            the collector in (programmatic use), instead of one of the tier's own.

    Raises:
        ConfigError: an unknown key (the message names it), a bad option,
            URL or primary region.

    Every method runs on the caller's thread (vLLM's scheduler, under the
    tiering manager's lock) and, except `drain_jobs` and `shutdown`, returns
    without waiting for storage.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        url: str,
        backend_options: dict[str, Any] | None = None,
        namespace: str = "",
        timeout_s: float = 10.0,
        open_timeout_s: float = 10.0,
        reopen_interval_s: float = 1.0,
        max_probe_batch: int = 4096,
        locality: str | None = None,
        enable_kv_events: bool = False,
        metrics_port: int | None = None,
        metrics_addr: str | None = None,
        metrics_registry: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"unknown key(s) {sorted(unknown)} in the tiercache tier entry; "
                f"keys: {sorted(TIER_KEYS)}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._set_options(
            url,
            backend_options,
            namespace,
            timeout_s=timeout_s,
            open_timeout_s=open_timeout_s,
            reopen_interval_s=reopen_interval_s,
            max_probe_batch=max_probe_batch,
            locality=locality,
        )
        kv_events = parse_bool(enable_kv_events, "enable_kv_events")
        metrics_options = MetricsOptions.parse(
            metrics_port, metrics_addr, metrics_registry, option=str
        )
        self._set_region(primary_kv_view)
        self._set_identity(offloading_spec, namespace)
        self._events: list[OffloadingEvent] | None = None
        if kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning(
                    "enable_kv_events is set on tier %r but vLLM's KV cache events are "
                    "off; the tier emits none",
                    tier_type,
                )

        # Scheduler-side state (serialised by the tiering manager's lock).
        self._probes: dict[OffloadKey, _Probe] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._probe_batch: list[tuple[OffloadKey, ReqContext]] = []
        self._probe_futures: list[
            tuple[concurrent.futures.Future[list[list[bool]]], list[list[OffloadKey]]]
        ] = []
        self._jobs: dict[int, _Job] = {}
        self._early_results: list[JobResult] = []
        self._shut = False

        # Loop-side state (only touched on the loop).
        self._backend: StorageBackend | None = None
        self._open_lock: asyncio.Lock | None = None
        self._next_open = 0.0
        self._open_attempts = 0
        self._tasks: set[asyncio.Task[Any]] = set()

        #: The Prometheus metrics (``None`` unless ``metrics_port`` or ``metrics_registry``);
        #: the collector is registered once the backend is open.
        self.metrics: AdapterMetrics | None = None
        self._loop = LoopThread(f"tiercache-vllm-{tier_type}")
        try:
            if metrics_options.enabled:
                self.metrics = AdapterMetrics(
                    metrics_options,
                    self._loop,
                    labels={"engine": "vllm", "tier": tier_type},
                    rank=_dp_index(offloading_spec),
                    option=str,
                )
            self._loop.run(self._open_first(), timeout=self._open_timeout_s + 1.0)
        except ConfigError:
            self._close_on_error()
            raise
        except TierCacheError as e:
            # Down at start-up: serve misses and retry the open later.
            logger.warning(
                "tiercache tier %r: backend %s not reachable yet (%s); lookups miss until it is",
                tier_type,
                self._url_display,
                e,
            )
        except BaseException:
            self._close_on_error()
            raise

    def _set_options(
        self,
        url: object,
        backend_options: object,
        namespace: object,
        *,
        timeout_s: object,
        open_timeout_s: object,
        reopen_interval_s: object,
        max_probe_batch: object,
        locality: object,
    ) -> None:
        """Check and keep the tier's options (see the class docstring).

        Raises:
            ConfigError: a bad value; the message names the option.
        """
        if not isinstance(url, str) or not url:
            raise ConfigError(f"the tiercache tier needs a backend url, got {url!r}")
        if backend_options is not None and not isinstance(backend_options, dict):
            raise ConfigError(f"backend_options must be a dict, got {backend_options!r}")
        if not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a str, got {namespace!r}")
        self._timeout_s = check_number(timeout_s, "timeout_s", positive=True, error=ConfigError)
        self._open_timeout_s = check_number(
            open_timeout_s, "open_timeout_s", positive=True, error=ConfigError
        )
        self._reopen_interval_s = check_number(
            reopen_interval_s, "reopen_interval_s", positive=True, error=ConfigError
        )
        self._max_probe_batch = check_positive(
            max_probe_batch, "max_probe_batch", error=ConfigError
        )
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError:
            choices = [m.value for m in Locality]
            raise ConfigError(f"locality must be one of {choices}, got {locality!r}") from None
        self._url = url
        self._url_display = redact_url(url)
        self._backend_options = dict(backend_options or {})

    def _set_region(self, view: memoryview) -> None:
        """Take vLLM's primary region: one row per block.

        Raises:
            ConfigError: not C-contiguous, or rows of no bytes.
        """
        if view.ndim < 1 or view.strides is None or not view.c_contiguous:
            raise ConfigError("the primary region must be a C-contiguous memoryview")
        self._block_bytes = int(view.strides[0])
        self._num_blocks = int(view.shape[0]) if view.shape else 0
        if self._block_bytes <= 0:
            raise ConfigError("the primary region's rows are empty")
        # One flat byte view over vLLM's region: block c is [c*bytes, (c+1)*bytes).
        self._flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def _set_identity(self, offloading_spec: Any, namespace: str) -> None:
        """The identity of the bytes, and the key prefix and page format made from it."""
        identity = vllm_identity(offloading_spec, self._block_bytes)
        if namespace:
            identity["namespace"] = namespace
        self.identity: dict[str, Any] = identity
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        #: 16 hex digits of sha256 over the identity: the prefix of every key.
        self.namespace_digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        self._page_format = f"vllm/{self.namespace_digest}/{self._block_bytes}"

    def _close_on_error(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self._loop.close(self._close_backend(), timeout=self._open_timeout_s)

    # ------------------------------------------------------------------ keys

    def page_key(self, key: OffloadKey) -> PageKey:
        """The storage key of one vLLM block: namespace, group index, block hash."""
        block_hash = get_offload_block_hash(key).hex()
        return PageKey(f"{self.namespace_digest}.g{get_offload_group_idx(key)}-{block_hash}")

    def _pages(self, chunk_ids: Iterable[Any]) -> list[PageBuffer]:
        size = self._block_bytes
        flat = self._flat
        fmt = self._page_format
        pages = []
        for c in (int(c) for c in chunk_ids):
            assert 0 <= c < self._num_blocks, f"chunk {c} outside vLLM's region"
            pages.append(PageBuffer((flat[c * size : (c + 1) * size],), size, fmt))
        return pages

    # --------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether the block is in storage, without waiting for storage.

        Returns:
            ``HIT`` or ``MISS`` once this key's existence query has answered
            (a failed query answers ``MISS``); ``RETRY`` while it is queued or
            running. The query of a new key starts at the end of the step. A
            ``MISS`` is kept for the requests it was told to; a request that
            had not looked the key up before asks again.
        """
        if self._probe_futures:
            self._collect_probes()
        probe = self._probes.get(key)
        if probe is None:
            probe = _Probe()
            self._probes[key] = probe
            self._queue_probe(key, req_context)
        elif probe.result is False and req_context.req_id not in probe.req_ids:
            # A miss told to other requests may be stale (the block may have been
            # stored since, here or by another instance): a new request asks again.
            probe.result = None
            self._queue_probe(key, req_context)
        probe.req_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if probe.result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if probe.result else LookupResult.MISS

    def _queue_probe(self, key: OffloadKey, req_context: ReqContext) -> None:
        self._probe_batch.append((key, req_context))
        if len(self._probe_batch) >= self._max_probe_batch:
            self._flush_probes()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Start the existence query of the keys looked up this step."""
        self._collect_probes()
        self._flush_probes()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """No per-request preference: blocks are offloaded chunk by chunk."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's verdicts (those still running are kept until they land)."""
        for key in self._req_keys.pop(req_context.req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.req_ids.discard(req_context.req_id)
            if not probe.req_ids and not probe.in_flight:
                del self._probes[key]

    def _flush_probes(self) -> None:
        batch, self._probe_batch = self._probe_batch, []
        if not batch or self._shut:
            for key, _ in batch:
                probe = self._probes.get(key)
                if probe is not None and probe.result is None:
                    probe.result = False
            return
        # Group by request and order each group by block position: the
        # backend answers how many keys, from the first, are stored, and a
        # block is only useful after every block before it.
        groups: dict[str, list[tuple[int, int, OffloadKey]]] = {}
        for i, (key, ctx) in enumerate(batch):
            probe = self._probes.get(key)
            if probe is None or probe.in_flight or probe.result is not None:
                continue  # its request finished before the query left, or queued twice
            probe.in_flight = True
            pos = ctx.get_offload_key_position(key)
            groups.setdefault(ctx.req_id, []).append((pos if pos is not None else -1, i, key))
        if not groups:
            return
        key_groups = [[k for _, _, k in sorted(g)] for g in groups.values()]
        page_groups = [[self.page_key(k) for k in g] for g in key_groups]
        try:
            fut = self._loop.submit(self._probe(page_groups))
        except TierCacheError:
            for g in key_groups:
                self._resolve(g, [False] * len(g))
            return
        self._probe_futures.append((fut, key_groups))

    def _collect_probes(self) -> None:
        pending = []
        for fut, key_groups in self._probe_futures:
            if not fut.done():
                pending.append((fut, key_groups))
                continue
            try:
                verdicts = fut.result()
            except BaseException:  # cancelled at shutdown, or a bug: a miss
                verdicts = [[False] * len(g) for g in key_groups]
            for keys, found in zip(key_groups, verdicts, strict=True):
                self._resolve(keys, found)
        self._probe_futures = pending

    def _resolve(self, keys: Sequence[OffloadKey], found: Sequence[bool]) -> None:
        for key, hit in zip(keys, found, strict=True):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.in_flight = False
            if not probe.req_ids:
                del self._probes[key]
            elif probe.result is None:
                probe.result = hit

    def _mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and probe.result is not None:
                probe.result = False

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's blocks from the primary region to storage; returns at once.

        Keys already stored keep their first value (and count as stored).
        """
        keys = list(job_metadata.keys)
        pages = self._pages(job_metadata.chunk_ids)
        self._submit(
            job_metadata.job_id, keys, False, self._store([self.page_key(k) for k in keys], pages)
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's blocks from storage into the primary region; returns at once.

        A block that is missing or fails its checks leaves its row untouched
        and is left out of the job's ``successful_keys``.
        """
        keys = list(job_metadata.keys)
        pages = self._pages(job_metadata.chunk_ids)
        self._submit(
            job_metadata.job_id, keys, True, self._load([self.page_key(k) for k in keys], pages)
        )

    def _submit(self, job_id: int, keys: list[OffloadKey], is_load: bool, coro: Any) -> None:
        try:
            fut = self._loop.submit(coro)
        except TierCacheError:
            self._early_results.append(JobResult(job_id=job_id, success=False))
            if is_load:
                self._mark_miss(keys)
            return
        self._jobs[job_id] = _Job(job_id, keys, is_load, fut)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The stores and loads that ended since the last call, as vLLM's `JobResult`.

        A failed load reports the blocks that did arrive as
        ``successful_keys``; the others turn into misses for later lookups.
        """
        results, self._early_results = self._early_results, []
        finished = [job for job in self._jobs.values() if job.future.done()]
        for job in finished:
            del self._jobs[job.job_id]
            results.append(self._job_result(job))
        return results

    def _job_result(self, job: _Job) -> JobResult:
        try:
            outcome = job.future.result()
        except BaseException as e:  # cancelled at shutdown, or a bug: a failure
            outcome = _Outcome([False] * len(job.keys), 0.0, repr(e))
        ok = [k for k, d in zip(job.keys, outcome.done, strict=True) if d]
        success = len(ok) == len(job.keys)
        nbytes = len(ok) * self._block_bytes
        if success:
            if not job.is_load and self._events is not None and ok:
                self._events.append(
                    OffloadingEvent(
                        keys=ok, medium=self.medium, removed=False, locality=self.locality
                    )
                )
            return JobResult(
                job_id=job.job_id,
                success=True,
                transfer_time=outcome.seconds,
                transfer_bytes=nbytes,
            )
        logger.debug(
            "tiercache tier %r: %s job %d: %d of %d blocks (%s)",
            self.tier_type,
            "load" if job.is_load else "store",
            job.job_id,
            len(ok),
            len(job.keys),
            outcome.error or "missing or corrupt pages",
        )
        if job.is_load:
            done = set(ok)
            self._mark_miss(k for k in job.keys if k not in done)
            return JobResult(
                job_id=job.job_id,
                success=False,
                successful_keys=tuple(ok) if ok else None,
                transfer_time=outcome.seconds,
                transfer_bytes=nbytes or None,
            )
        return JobResult(job_id=job.job_id, success=False, transfer_time=outcome.seconds)

    def has_pending_work(self) -> bool:
        """Jobs or existence queries are still running."""
        return bool(self._jobs or self._probe_futures or self._probe_batch or self._early_results)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored-block events (only with ``enable_kv_events``)."""
        if self._events:
            events, self._events = self._events, []
            yield from events

    def drain_jobs(self) -> None:
        """Wait until every submitted store and load has ended.

        vLLM reuses its region's slots once this returns (``reset_cache``), so
        it returns only when no job touches the region any more. Each job ends
        within ``timeout_s`` (a storage call past it is cancelled), except one
        stuck inside a read or write that cannot be interrupted (a hung file
        system): it is waited for, with an error logged every ``timeout_s`` +
        5 s, as vLLM asks of a stuck tier. Results stay queued for
        `get_finished_jobs`.
        """
        pending = [job.future for job in self._jobs.values()]
        step = self._timeout_s + 5.0
        waited = 0.0
        while pending:
            _, not_done = concurrent.futures.wait(pending, timeout=step)
            pending = list(not_done)
            if not pending:
                return
            waited += step
            if not self._loop.is_alive():  # nothing can end them any more
                logger.error(
                    "tiercache tier %r: %d jobs left with the tier's thread gone",
                    self.tier_type,
                    len(pending),
                )
                return
            logger.error(
                "tiercache tier %r: %d jobs still running after %g s, stuck in storage I/O "
                "into vLLM's region: waiting for them",
                self.tier_type,
                len(pending),
                waited,
            )

    def shutdown(self) -> None:
        """Finish or cancel the jobs in flight, close the backend, stop the thread.

        Jobs get ``timeout_s`` to finish; those still running then are
        cancelled (a cancelled batch returns once no thread touches vLLM's
        region) and reported as failed by `get_finished_jobs`. Idempotent.
        """
        if self._shut:
            return
        self._shut = True
        self._probe_batch = []
        futures: list[concurrent.futures.Future[Any]] = [j.future for j in self._jobs.values()]
        futures += [fut for fut, _ in self._probe_futures]
        if futures:
            concurrent.futures.wait(futures, timeout=self._timeout_s)
        if self.metrics is not None:
            self.metrics.close()
        try:
            self._loop.run(self._close_backend(), timeout=self._timeout_s + 5.0)
        except BaseException as e:
            logger.warning("tiercache tier %r: closing the backend failed: %s", self.tier_type, e)
        if self._loop.close(timeout=self._timeout_s + 5.0):
            # vLLM unmaps its region after the tiers shut down; a view of it
            # kept here would pin the mapping.
            if self._flat is not self._primary_kv_view:
                self._flat.release()
        self._collect_probes()

    # ------------------------------------------------------- on the loop

    def _track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _open_first(self) -> None:
        await self._ensure_backend(force=True)

    async def _ensure_backend(self, force: bool = False) -> StorageBackend:
        if self._backend is not None:
            return self._backend
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        attempts = self._open_attempts
        async with self._open_lock:
            if self._backend is not None:
                return self._backend
            # An open that failed while this call waited for the lock is its
            # answer too: calls queued behind it do not each try again.
            if not force and (
                self._open_attempts != attempts or time.monotonic() < self._next_open
            ):
                raise BackendUnavailableError(f"backend {self._url_display} is down")
            self._open_attempts += 1
            try:
                async with asyncio.timeout(self._open_timeout_s):
                    backend = await open_backend(self._url, **self._backend_options)
            except TimeoutError:
                raise StorageTimeoutError(
                    f"opening {self._url_display} took more than {self._open_timeout_s:g} s"
                ) from None
            finally:
                # The interval runs from the end of an attempt, however long it took.
                self._next_open = time.monotonic() + self._reopen_interval_s
            if self._shut:
                await backend.aclose()
                raise BackendUnavailableError("the tier is shut down")
            self._backend = backend
            logger.info("tiercache tier %r: backend %r open", self.tier_type, backend)
            if self.metrics is not None:
                try:
                    self.metrics.attach(backend)
                except ConfigError:
                    if force:  # at construction: the tier is not made
                        raise
                    logger.exception("tiercache tier %r: metrics not registered", self.tier_type)
            return backend

    async def _guarded(
        self, what: str, n: int, call: Callable[[StorageBackend], Any]
    ) -> tuple[list[Any] | int | None, str | None]:
        """Run one storage call under the timeout; a failure is returned, not raised."""
        try:
            backend = await self._ensure_backend()
            return await bounded(call(backend), self._timeout_s), None
        except TimeoutError:
            err = f"{what} of {n} blocks took more than {self._timeout_s:g} s"
        except StorageError as e:
            err = f"{what} of {n} blocks failed: {e}"
        except TierCacheError as e:
            err = f"{what} of {n} blocks refused: {e}"
        except Exception as e:  # a bug must not reach vLLM's scheduler
            logger.exception("tiercache tier %r: %s failed", self.tier_type, what)
            err = f"{what} of {n} blocks: {e!r}"
        logger.warning("tiercache tier %r: %s", self.tier_type, err)
        return None, err

    async def _probe(self, groups: list[list[PageKey]]) -> list[list[bool]]:
        self._track()
        total = sum(len(g) for g in groups)

        async def exists(backend: StorageBackend) -> list[int]:
            return list(await asyncio.gather(*(backend.batch_exists(g) for g in groups)))

        counts, _ = await self._guarded("existence query", total, exists)
        if not isinstance(counts, list):
            return [[False] * len(g) for g in groups]
        return [[i < n for i in range(len(g))] for g, n in zip(groups, counts, strict=True)]

    async def _store(self, keys: list[PageKey], pages: list[PageBuffer]) -> _Outcome:
        self._track()
        t0 = time.perf_counter()
        done, err = await self._guarded("store", len(keys), lambda b: b.batch_set(keys, pages))
        flags = done if isinstance(done, list) else [False] * len(keys)
        return _Outcome([bool(d) for d in flags], time.perf_counter() - t0, err)

    async def _load(self, keys: list[PageKey], pages: list[PageBuffer]) -> _Outcome:
        self._track()
        t0 = time.perf_counter()
        done, err = await self._guarded("load", len(keys), lambda b: b.batch_get(keys, pages))
        flags = done if isinstance(done, list) else [False] * len(keys)
        return _Outcome([bool(d) for d in flags], time.perf_counter() - t0, err)

    async def _close_backend(self) -> None:
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.aclose()
