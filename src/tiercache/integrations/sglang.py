"""tiercache as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

`TierCacheStorage` is a ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage``
that keeps SGLang's pages in any tiercache storage backend URL (``file://``,
``redis://``, ``redis+cluster://``, ``memory://``, a registered plugin), in
tiercache's checksummed page format, behind a fault policy, with stats. SGLang
loads it at run time::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{
            "backend_name": "tiercache",
            "module_path": "tiercache.integrations.sglang",
            "class_name": "TierCacheStorage",
            "interface_v1": 1,
            "url": "file:///var/cache/tiercache"}'

**Options** (keys of the extra config besides SGLang's own ``backend_name``,
``module_path``, ``class_name``, ``interface_v1`` and ``tp_lcm_size``); an
unknown key or a bad value raises `ConfigError` naming the key:

- ``url`` (required): the tiercache storage backend URL.
- ``backend_options`` (dict): keyword options for ``open_backend``.
- ``capacity_bytes`` (int): shorthand for ``backend_options["capacity_bytes"]``
  (the file and memory backends evict past it).
- ``timeout_s`` (default 5.0): deadline of every storage call (a read or
  write of SGLang's pages stuck in I/O is waited for: see **Threads**).
- ``open_timeout_s`` (default 30.0): deadline of opening and closing the backend.
- ``fault_policy`` (``auto_reconnect`` default, ``auto_detach``, ``none``) and
  ``fault_threshold`` (default 5): after that many failed calls in a row,
  ``auto_reconnect`` stops calling the backend (every call is a miss at once)
  and probes it with exponential backoff from ``reconnect_backoff_s`` (0.5) up
  to ``reconnect_backoff_max_s`` (30), resuming when it answers (one
  ``outages``, then one ``reconnects``, in `TierCacheStorage.stats`);
  ``auto_detach`` stops calling it for good (one ``auto_detaches``); ``none``
  keeps calling it. The policy is the storage tier's own
  (`tiercache.storage.fault_policy`); a call that `close` cuts short is not a
  failure for it.
- ``model_name``: the model identity in storage keys, instead of the name
  SGLang passes (set it to share pages with a `TierCache` under another name).
- ``metrics_port`` (int): serve Prometheus metrics of the storage backend
  (`tiercache.metrics`, labelled ``engine="sglang"`` and ``tp_rank``) on
  ``metrics_port + rank``, the process's rank in SGLang's ``torch.distributed``
  world (the TP rank with one pipeline stage and no DP attention, where
  ``tp_rank`` repeats across processes) (``0``: any free port, in ``metrics.port``);
  ``metrics_addr`` is the address it binds (``0.0.0.0``). In Python,
  ``metrics_registry`` (a ``prometheus_client.CollectorRegistry``) registers
  the collector there instead of in a registry of the backend's own. Both
  need ``tiercache[metrics]``; `close` stops the server and unregisters.

**Keys.** SGLang's page keys are the ``get_hash_str`` chain, the same chain as
tiercache's ``page_hashes``. Each is stored under
``StorageNamespace.for_layout(...).key(hash)``: the model name, KV dtype and
shape, host layout, page size and tensor-parallel shard (the rank is left out
for MLA, whose KV every rank holds; only rank 0 writes it). The KV dtype is
the host pool's: SGLang keeps fp8 KV as bytes, so ``fp8_e4m3`` and
``fp8_e5m2`` pages of one model name share keys (a warning says so at start;
give instances of different fp8 formats different ``model_name`` values). Pipeline and
context-parallel shards are added to the model identity. So a `TierCache` of
the same model, layout, host layout and shard reads the pages SGLang stored,
and the reverse.

**Threads.** SGLang calls the backend synchronously from its prefetch,
prefetch-IO and backup threads. The tiercache backend lives on an event loop
(uvloop) in a daemon thread owned by this object; every call is submitted with
``run_coroutine_threadsafe`` and bounded by ``timeout_s``, except that a read
or write of SGLang's host pages stuck where it cannot be interrupted (a hung
file system) holds its call until it ends: SGLang frees and reuses the pages
of a call that missed, so none returns while storage may still write into
them (an error is logged meanwhile). Any failure inside
tiercache (an error, a timeout, a corrupt page, a closed backend) is a miss or a
failed write for SGLang, never an exception in its threads. `close` drains the
loop and stops the thread; SGLang calls it when the backend is detached.

**Paths.** With ``interface_v1: 1`` the controller calls `batch_get_v1` /
`batch_set_v1`: the pages are read and written in place, as views of SGLang's
host pool (``layer_first`` or ``page_first``, MHA or MLA). Without it the
generic `batch_get` / `batch_set` move flat page tensors; both paths store the
same bytes, so pages written by one are read by the other.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from tiercache._aio import bounded
from tiercache._checks import check_backoff, check_choice, check_number, check_positive
from tiercache._frozen import FrozenMapping
from tiercache.errors import (
    ClosedError,
    ConfigError,
    InvalidInputError,
    StorageError,
    StorageTimeoutError,
)
from tiercache.integrations._loop import LoopThread
from tiercache.integrations._metrics import AdapterMetrics, MetricsOptions
from tiercache.memory.layout import KVLayout
from tiercache.memory.pages import PageBuffer
from tiercache.memory.pools import host_page_buffer
from tiercache.storage import StorageBackend, open_backend
from tiercache.storage.base import PageKey
from tiercache.storage.fault_policy import FAULT_POLICIES, FaultPolicy
from tiercache.storage.keys import StorageNamespace
from tiercache.storage.registry import redact_url

__all__ = ["AdapterStats", "SGLangOptions", "TierCacheStorage"]

logger = logging.getLogger(__name__)

#: Keys of the extra config that configure metrics (`MetricsOptions`).
METRICS_KEYS = frozenset({"metrics_port", "metrics_addr", "metrics_registry"})
#: Keys of the extra config that belong to SGLang, not to this backend.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)
#: Extra wait on SGLang's side beyond ``timeout_s`` (the loop cancels at ``timeout_s``).
_GRACE_S = 5.0

T = TypeVar("T")


class _Skipped(StorageError):
    """The backend is down under the fault policy: the call was not made."""


#: The host pool layouts whose byte order is tiercache's.
SUPPORTED_LAYOUTS = ("layer_first", "page_first")


def _option(name: str) -> str:
    return f"extra_config[{name!r}]"


def _process_rank(tp_rank: int) -> int:
    """This process's rank in SGLang's ``torch.distributed`` world (``tp_rank`` in a world of one).

    SGLang's ``tp_rank`` is not unique on a host: with DP attention it is the
    rank within the attention TP group, and pipeline stages repeat it. Each
    of SGLang's processes holds its own rank of the default process group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return tp_rank


@dataclass(frozen=True, slots=True)
class SGLangOptions:
    """This backend's options, read from SGLang's extra config (see the module docstring)."""

    url: str
    backend_options: Mapping[str, Any]
    timeout_s: float = 5.0
    open_timeout_s: float = 30.0
    fault_policy: str = "auto_reconnect"
    fault_threshold: int = 5
    reconnect_backoff_s: float = 0.5
    reconnect_backoff_max_s: float = 30.0
    model_name: str | None = None
    metrics: MetricsOptions = MetricsOptions()

    def __post_init__(self) -> None:
        # Read-only and hashable, as the options of a frozen value must be.
        object.__setattr__(self, "backend_options", FrozenMapping(self.backend_options))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangOptions:
        """Validate ``extra`` and build the options.

        Raises:
            ConfigError: a missing ``url``, an unknown key, or a bad value; the
                message names the key.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"the extra config must be a dict, got {type(extra).__name__}")
        known = (
            SGLANG_KEYS
            | {f for f in cls.__dataclass_fields__ if f != "metrics"}
            | {"capacity_bytes"}
            | METRICS_KEYS
        )
        for key in extra:
            if key not in known:
                raise ConfigError(
                    f"extra_config[{key!r}] is not an option of the tiercache backend; "
                    f"options: {sorted(known - SGLANG_KEYS)}"
                )
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError(
                "extra_config['url'] must name a tiercache storage backend, "
                f"e.g. 'file:///var/cache/tiercache'; got {url!r}"
            )
        if "interface_v1" in extra and extra["interface_v1"] not in (0, 1, True, False):
            raise ConfigError(
                f"extra_config['interface_v1'] must be 0 or 1, got {extra['interface_v1']!r}"
            )
        kw = _timing_options(extra)
        if "model_name" in extra:
            if not isinstance(extra["model_name"], str) or not extra["model_name"]:
                raise ConfigError(
                    f"extra_config['model_name'] must be a non-empty str, got {extra['model_name']!r}"
                )
            kw["model_name"] = extra["model_name"]
        kw["metrics"] = MetricsOptions.parse(
            extra.get("metrics_port"),
            extra.get("metrics_addr"),
            extra.get("metrics_registry"),
            option=_option,
        )
        return cls(url=url, backend_options=_backend_options(extra), **kw)


def _backend_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``backend_options``, with ``capacity_bytes`` folded in.

    Raises:
        ConfigError: not a dict of str keys, or a bad ``capacity_bytes``.
    """
    options = extra.get("backend_options", {})
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(
            f"extra_config['backend_options'] must be a dict of options, got {options!r}"
        )
    options = dict(options)
    if "capacity_bytes" in extra:
        options["capacity_bytes"] = check_positive(
            extra["capacity_bytes"], _option("capacity_bytes"), error=ConfigError
        )
    return options


def _timing_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The deadlines and the fault policy given in ``extra`` (those absent keep their defaults).

    Raises:
        ConfigError: a bad value, or ``reconnect_backoff_max_s`` below
            ``reconnect_backoff_s``; the message names its key.
    """
    kw: dict[str, Any] = {}
    for name in ("timeout_s", "open_timeout_s", "reconnect_backoff_s", "reconnect_backoff_max_s"):
        if name in extra:
            kw[name] = check_number(extra[name], _option(name), positive=True, error=ConfigError)
    if "fault_threshold" in extra:
        kw["fault_threshold"] = check_positive(
            extra["fault_threshold"], _option("fault_threshold"), error=ConfigError
        )
    if "fault_policy" in extra:
        kw["fault_policy"] = check_choice(
            extra["fault_policy"], FAULT_POLICIES, _option("fault_policy"), error=ConfigError
        )
    defaults = SGLangOptions.__dataclass_fields__
    first = kw.get("reconnect_backoff_s", defaults["reconnect_backoff_s"].default)
    most = kw.get("reconnect_backoff_max_s", defaults["reconnect_backoff_max_s"].default)
    check_backoff(first, most, _option("reconnect_backoff_s"), _option("reconnect_backoff_max_s"))
    return kw


@dataclass(slots=True)
class AdapterStats:
    """What the adapter did for SGLang (`TierCacheStorage.stats`).

    Counted on SGLang's threads, under a lock: ``get_*`` / ``set_*`` are pages
    asked for and pages served or stored, ``exists_*`` hit queries and the
    pages they found; ``errors`` and ``timeouts`` are failed calls (each a miss
    for SGLang); ``cancelled`` calls that `TierCacheStorage.close` cut short
    (in flight when it began: misses too, but no failure of the store);
    ``skipped_while_down`` calls not made under the fault policy or after
    close; ``skipped_not_writer`` MLA pages not written on ranks other than 0.
    """

    get_pages: int = 0
    get_hits: int = 0
    set_pages: int = 0
    set_stored: int = 0
    exists_calls: int = 0
    exists_hits: int = 0
    errors: int = 0
    timeouts: int = 0
    cancelled: int = 0
    skipped_while_down: int = 0
    skipped_not_writer: int = 0
    down: bool = False


@dataclass(frozen=True, slots=True)
class _PoolView:
    """Byte geometry of SGLang's host pool, and the tiercache identity of its pages."""

    layout: KVLayout
    host_layout: str
    num_slots: int
    view: memoryview
    format: str

    def page(self, slot: int) -> PageBuffer:
        """A zero-copy `PageBuffer` over the page at ``slot`` (tiercache's segment order)."""
        return host_page_buffer(
            self.view, self.layout, self.host_layout, self.num_slots, slot, self.format
        )


def _pool_view(pool: Any) -> _PoolView:
    """Read the geometry of an SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``).

    Raises:
        ConfigError: a layout or pool kind whose bytes are not tiercache's.
    """
    host_layout = getattr(pool, "layout", None)
    if host_layout not in SUPPORTED_LAYOUTS:
        raise ConfigError(
            f"the tiercache backend supports --hicache-mem-layout {' or '.join(SUPPORTED_LAYOUTS)}, "
            f"got {host_layout!r}"
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise ConfigError("the tiercache backend does not support decode context parallelism")
    buf = getattr(pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor):
        raise ConfigError(f"{type(pool).__name__} has no kv_buffer tensor to store pages from")
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ConfigError("the host pool's kv_buffer must be one contiguous host tensor")
    mla = hasattr(pool, "kv_lora_rank")
    want: tuple[int, ...]
    num_layers, size, page_size = int(pool.layer_num), int(pool.size), int(pool.page_size)
    if mla:
        heads, head_dim = 1, int(buf.shape[-1])
        want = (
            (num_layers, size, 1, head_dim)
            if host_layout == "layer_first"
            else (size, num_layers, 1, head_dim)
        )
    else:
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
        v_head_dim = int(getattr(pool, "v_head_dim", head_dim) or head_dim)
        if v_head_dim != head_dim:
            raise ConfigError(
                f"K and V head sizes differ ({head_dim} and {v_head_dim}): "
                "tiercache pages hold K and V of one size"
            )
        want = (
            (2, num_layers, size, heads, head_dim)
            if host_layout == "layer_first"
            else (2, size, num_layers, heads, head_dim)
        )
    if tuple(buf.shape) != want:
        raise ConfigError(
            f"{type(pool).__name__}.kv_buffer has shape {tuple(buf.shape)}, "
            f"expected {want} for {host_layout}"
        )
    try:
        layout = KVLayout(num_layers, heads, head_dim, buf.dtype, page_size, mla=mla)
    except InvalidInputError as e:
        raise ConfigError(f"the host pool's KV cannot be stored by tiercache: {e}") from e
    view = memoryview(buf.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return _PoolView(layout, host_layout, size, view, f"{layout.describe()}:{host_layout}")


class TierCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """An SGLang HiCache storage backend backed by a tiercache `StorageBackend`.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (read by attribute,
            tolerant of the fields each SGLang release has); its
            ``extra_config`` carries this backend's options.
        kwargs: what SGLang's factory passes besides (unused).

    Raises:
        ConfigError: bad options (the message names the key), or no model name.
        StorageError: the backend could not be opened.

    Every method may be called from any SGLang thread; none raises into SGLang
    for a storage failure (see the module docstring).
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = getattr(storage_config, "extra_config", None)
        self.options = SGLangOptions.from_extra_config(extra)
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        self.is_mla_config = bool(getattr(storage_config, "is_mla_model", False))
        model = self.options.model_name or getattr(storage_config, "model_name", None)
        if not model:
            raise ConfigError("no model name: SGLang passed none; set extra_config['model_name']")
        shard = ""
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        if pp_size > 1:
            shard += f"@pp{getattr(storage_config, 'pp_rank', 0)}of{pp_size}"
        cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            shard += f"@cp{getattr(storage_config, 'attn_cp_rank', 0)}of{cp_size}"
        self.model = str(model) + shard
        self.stats_ = AdapterStats()
        self._pool: _PoolView | None = None
        self._namespace: StorageNamespace | None = None
        #: `close` has begun: a call that ends badly from now on was cut short by it.
        self._closing = False
        self._stats_lock = threading.Lock()
        self._close_lock = threading.Lock()
        #: The Prometheus metrics (``None`` unless ``metrics_port`` or ``metrics_registry``).
        self.metrics: AdapterMetrics | None = None
        self._loop = LoopThread(name=f"tiercache-sglang-tp{self.tp_rank}")
        try:
            self.backend: StorageBackend = self._loop.run(
                open_backend(self.options.url, **self.options.backend_options),
                self.options.open_timeout_s,
            )
        except BaseException:
            self._loop.close()
            raise
        #: The fault policy (`tiercache.storage.fault_policy`): told of every
        #: call on the loop thread; its ``down`` is read on SGLang's threads too.
        self.faults = FaultPolicy(
            self.options.fault_policy,
            self.options.fault_threshold,
            backoff_s=self.options.reconnect_backoff_s,
            backoff_max_s=self.options.reconnect_backoff_max_s,
            timeout_s=self.options.timeout_s,
            probe=functools.partial(self.backend.batch_exists, [PageKey("tiercache-sglang-probe")]),
            name=self.backend.name,
        )
        try:
            if self.options.metrics.enabled:
                self.metrics = AdapterMetrics(
                    self.options.metrics,
                    self._loop,
                    labels={"engine": "sglang", "tp_rank": str(self.tp_rank)},
                    rank=_process_rank(self.tp_rank),
                    option=_option,
                )
                self.metrics.attach(self.backend)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            self._loop.close(self.backend.aclose(), timeout=self.options.open_timeout_s)
            raise
        logger.info(
            "tiercache storage for SGLang: %s, model %s, tp %d/%d",
            redact_url(self.options.url),
            self.model,
            self.tp_rank,
            self.tp_size,
        )

    # -- set-up -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: the pages of every call are views of it.

        A pool of bytes (SGLang's fp8 KV) is logged as a warning: the KV
        dtype in the keys is then ``uint8``, whatever the fp8 format.

        Raises:
            ConfigError: the pool's layout or kind is not one tiercache stores.
        """
        super().register_mem_pool_host(mem_pool_host)
        pool = _pool_view(mem_pool_host)
        self._namespace = StorageNamespace.for_layout(
            pool.layout,
            pool.host_layout,
            model=self.model,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        self._pool = pool
        if pool.layout.dtype == torch.uint8:
            logger.warning(
                "SGLang's host pool holds the KV as bytes, as it keeps fp8 KV: the page keys "
                "of model %s cannot tell fp8_e4m3 from fp8_e5m2; instances that share this "
                "store with another fp8 format need another model_name",
                self.model,
            )

    @property
    def namespace(self) -> StorageNamespace:
        """The identity of the stored pages (known once the host pool is registered)."""
        if self._namespace is None:
            raise InvalidInputError("no host pool registered yet")
        return self._namespace

    @property
    def is_writer(self) -> bool:
        """MLA KV is the same on every rank: only rank 0 writes it."""
        mla = self._pool.layout.mla if self._pool is not None else self.is_mla_config
        return not mla or self.tp_rank == 0

    # -- the bridge ---------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        # Only SGLang's threads count (never the loop thread, which must not wait on a lock).
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats_, k, getattr(self.stats_, k) + v)

    def _call(
        self, what: str, coro: Coroutine[Any, Any, T], default: T, *, in_place: bool = False
    ) -> T:
        """Run ``coro`` on the loop under the deadline; any failure logs and returns ``default``.

        Called from SGLang's threads. With ``in_place`` (``coro`` reads or
        writes SGLang's pages) the call returns only once ``coro`` has
        settled: past the deadline it is cancelled, and a read or write stuck
        where it cannot be interrupted (a hung file system) is waited for,
        since SGLang frees and reuses the pages of a call that missed.
        """
        if self._closing or self.faults.down:
            coro.close()
            self._count(skipped_while_down=1)
            return default
        try:
            if not in_place:
                return self._loop.run(self._guarded(what, coro), self.options.timeout_s + _GRACE_S)
            return self._settled(what, self._loop.submit(self._guarded(what, coro)))
        except (_Skipped, ClosedError):
            self._count(skipped_while_down=1)
        except Exception as e:
            if self._closing:
                # Cancelled by close, or failed as close shut the store under
                # it: what close does to calls in flight, not a failure.
                self._count(cancelled=1)
                logger.debug("tiercache %s cut short by close, treated as a miss: %r", what, e)
            elif isinstance(e, StorageTimeoutError):
                self._count(timeouts=1)
                logger.warning("tiercache %s timed out, treated as a miss: %s", what, e)
            else:
                self._count(errors=1)
                logger.warning("tiercache %s failed, treated as a miss: %r", what, e)
        return default

    def _settled(self, what: str, fut: concurrent.futures.Future[T]) -> T:
        """``fut``'s result, waited for until it settles (or the loop thread is gone)."""
        step = self.options.timeout_s + _GRACE_S
        waited = 0.0
        while True:
            try:
                return fut.result(step)
            except concurrent.futures.TimeoutError:
                waited += step
                if not self._loop.is_alive():
                    fut.cancel()
                    raise StorageTimeoutError(f"{what}: the loop thread is gone") from None
                logger.error(
                    "tiercache %s still running after %g s, stuck in storage I/O on SGLang's "
                    "host pages: waiting for it",
                    what,
                    waited,
                )

    async def _guarded(self, what: str, coro: Coroutine[Any, Any, T]) -> T:
        """On the loop: the call under ``timeout_s``, counted for the fault policy."""
        if self.faults.down:
            coro.close()
            raise _Skipped
        try:
            # bounded: a timed-out call has settled before this raises, for it
            # may be copying into SGLang's host pages.
            result = await bounded(coro, self.options.timeout_s)
        except TimeoutError:
            self.faults.failed()
            raise StorageTimeoutError(
                f"{what} timed out after {self.options.timeout_s} s"
            ) from None
        except Exception:
            # Not counted once close has begun: a store closed under the call has not failed.
            self.faults.failed()
            raise
        self.faults.succeeded()
        return result

    def _prepare(self, what: str, build: Any) -> Any:
        """Build keys and page views on the calling thread; a bad argument is a miss, not a fault."""
        try:
            return build()
        except (InvalidInputError, ValueError, TypeError, RuntimeError) as e:
            self._count(errors=1)
            logger.warning("tiercache %s refused its arguments, treated as a miss: %s", what, e)
            return None

    def _pages_at(self, host_indices: torch.Tensor, n: int) -> list[PageBuffer]:
        pool = self._pool
        if pool is None:
            raise InvalidInputError("no host pool registered yet")
        ps = pool.layout.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() < n * ps:
            raise InvalidInputError(f"host_indices must hold {n} pages of {ps} slots")
        firsts = host_indices[: n * ps : ps].tolist()
        return [pool.page(int(s)) for s in firsts]

    def _flat_page(self, tensor: torch.Tensor) -> PageBuffer:
        pool = self._pool
        if pool is None:
            raise InvalidInputError("no host pool registered yet")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise InvalidInputError("a page must be a host tensor")
        if not tensor.is_contiguous():
            raise InvalidInputError("a page tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != pool.layout.page_bytes:
            raise InvalidInputError(
                f"a page tensor holds {nbytes} bytes, expected {pool.layout.page_bytes}"
            )
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        return PageBuffer((view,), pool.layout.page_bytes, pool.format)

    # -- the v1 (zero-copy) interface -----------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (0 on any failure)."""
        if not keys:
            return 0
        skeys = self._prepare("batch_exists", lambda: self.namespace.keys(keys))
        n = 0 if skeys is None else self._call("batch_exists", self.backend.batch_exists(skeys), 0)
        self._count(exists_calls=1, exists_hits=n)
        return n

    def _read(self, keys: list[str], build: Any) -> list[bool]:
        args = self._prepare("batch_get", lambda: (self.namespace.keys(keys), build()))
        miss = [False] * len(keys)
        got = (
            miss
            if args is None
            else self._call("batch_get", self.backend.batch_get(*args), miss, in_place=True)
        )
        self._count(get_pages=len(keys), get_hits=sum(got))
        return got

    def _write(self, keys: list[str], build: Any) -> list[bool]:
        if not self.is_writer:
            self._count(skipped_not_writer=len(keys))
            return [True] * len(keys)
        args = self._prepare("batch_set", lambda: (self.namespace.keys(keys), build()))
        fail = [False] * len(keys)
        done = (
            fail
            if args is None
            else self._call("batch_set", self.backend.batch_set(*args), fail, in_place=True)
        )
        self._count(set_pages=len(keys), set_stored=sum(done))
        return done

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read each key's page into SGLang's host pool in place.

        Args:
            keys: page hashes (SGLang's chain).
            host_indices: host pool slots, ``page_size`` per key, page-aligned.

        Returns:
            Per page, whether it arrived; a missing, corrupt or unreadable page
            is ``False`` and leaves its host slots untouched.
        """
        if not keys:
            return []
        return self._read(keys, lambda: self._pages_at(host_indices, len(keys)))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``.

        Returns:
            Per page, whether it is stored (``True`` too when it already was,
            and on MLA ranks other than 0, which do not write).
        """
        if not keys:
            return []
        return self._write(keys, lambda: self._pages_at(host_indices, len(keys)))

    # -- the generic interface ------------------------------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Read each key's page into the matching flat page tensor.

        Args:
            keys: page hashes.
            target_locations: one contiguous flat page tensor per key (SGLang
                passes ``get_dummy_flat_data_page()`` buffers); ``None``
                allocates them from the host pool.

        Returns:
            Per key, the filled tensor, or ``None`` for a miss.
        """
        if not keys:
            return []
        targets: list[Any] = []

        def build() -> list[PageBuffer]:
            if target_locations is None:
                if self._pool is None:
                    raise InvalidInputError("no host pool registered yet")
                targets.extend(self.mem_pool_host.get_dummy_flat_data_page() for _ in keys)
            else:
                targets.extend(target_locations)
            if len(targets) != len(keys):
                raise InvalidInputError(f"{len(targets)} target pages for {len(keys)} keys")
            return [self._flat_page(t) for t in targets]

        got = self._read(keys, build)
        if len(targets) != len(keys):  # refused: no page tensors to hand back
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(targets, got, strict=True)]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors (SGLang's ``get_data_page`` pages) under ``keys``.

        Returns:
            Whether every page is stored.
        """
        if not keys:
            return True

        def build() -> list[PageBuffer]:
            if values is None or len(values) != len(keys):
                raise InvalidInputError(f"batch_set needs one page tensor per key ({len(keys)})")
            return [self._flat_page(v) for v in values]

        return all(self._write(keys, build))

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """One page, as `batch_get` of one key."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """One page, as `batch_set` of one key."""
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (``False`` on any failure)."""
        return self.batch_exists([key]) == 1

    # -- the rest ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every page the backend holds (in its namespace or prefix)."""

        self._call("clear", self.backend.clear(), None)

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters, as one dict.

        Returns:
            The `AdapterStats` fields (pages asked for and served, errors,
            timeouts, calls cut short by `close`, calls skipped while the
            backend was down, MLA writes
            skipped on ranks other than 0); ``outages``, ``reconnects`` and
            ``auto_detaches`` of the fault policy and ``down`` (the backend is
            not being called);
            and the storage backend's own `BackendStats` under ``backend.*``
            (absent once closed or when the backend does not answer in
            ``timeout_s``).

        Called from any thread but the loop's.
        """
        with self._stats_lock:
            out: dict[str, Any] = asdict(self.stats_)
        counts = self.faults.counts
        out.update(
            outages=counts.outages,
            reconnects=counts.reconnects,
            auto_detaches=counts.auto_detaches,
            down=self.faults.down,
        )

        if not self._loop.closed:
            try:
                s = self._loop.run(self.backend.stats(), self.options.timeout_s)
            except Exception as e:
                logger.debug("backend stats unavailable: %r", e)
            else:
                out.update({f"backend.{f}": getattr(s, f) for f in s.__dataclass_fields__})
        return out

    def get_stats(self) -> None:
        """SGLang's hook for storage metrics: ``None`` (SGLang then reports its own); see `stats`."""
        return None

    def close(self) -> None:
        """Stop the metrics server, close the backend, stop the loop and join its thread.

        Idempotent.

        Pending calls are cancelled (counted as ``cancelled``, not as errors);
        afterwards every call is a miss.
        """
        with self._close_lock:
            if self._loop.closed:
                return
            self.faults.closing()
            self._closing = True
            if self.metrics is not None:
                self.metrics.close()

            async def drain() -> None:
                await self.faults.aclose()
                await self.backend.aclose()

            self._loop.close(drain(), timeout=self.options.open_timeout_s)

    def __repr__(self) -> str:
        return (
            f"TierCacheStorage({redact_url(self.options.url)}, model={self.model!r}, "
            f"tp={self.tp_rank}/{self.tp_size})"
        )
