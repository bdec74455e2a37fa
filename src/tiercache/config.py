"""`TierCacheConfig`: every knob of a `TierCache`, validated in one place."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from tiercache._checks import (
    check_backoff,
    check_bool,
    check_choice,
    check_int,
    check_number,
    parse_bool,
)
from tiercache._frozen import FrozenMapping
from tiercache.errors import ConfigError, TierCacheError
from tiercache.memory.layout import SUPPORTED_DTYPES, KVLayout, dtype_name
from tiercache.memory.pools import HOST_LAYOUTS
from tiercache.storage_tier import FAULT_POLICIES, StorageTierConfig

__all__ = ["PREFETCH_POLICIES", "WRITE_POLICIES", "TierCacheConfig"]

PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
_DTYPES = {dtype_name(d): d for d in SUPPORTED_DTYPES}
_ENV_PREFIX = "TIERCACHE_"

#: Int fields and the least value each may take.
_INT_FIELDS: dict[str, int] = {
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 1,
    "page_size": 1,
    "tp_rank": 0,
    "tp_size": 1,
    "device_tokens": 1,
    "host_tokens": 1,
    "host_size_bytes": 1,
    "write_through_threshold": 1,
    "prefetch_threshold": 0,
    "prefetch_capacity_tokens": 1,
    "storage_io_concurrency": 1,
    "storage_io_batch_pages": 1,
    "storage_query_batch_pages": 1,
    "storage_backup_batch_pages": 1,
    "storage_fault_threshold": 1,
}
#: Int fields where ``None`` means "not set".
_OPTIONAL_FIELDS = frozenset({"host_tokens", "host_size_bytes", "prefetch_capacity_tokens"})
#: Ratios and durations: finite numbers, at least 0.
_NUMBER_FIELDS = (
    "host_ratio",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "storage_timeout_s",
    "storage_reconnect_backoff_s",
    "storage_reconnect_backoff_max_s",
    "alloc_timeout_s",
)
#: Of those, the ones that must be above 0.
_POSITIVE_FIELDS = frozenset(
    {"storage_timeout_s", "storage_reconnect_backoff_s", "storage_reconnect_backoff_max_s"}
)
#: Fields that name one of a fixed set of policies.
_CHOICE_FIELDS: dict[str, tuple[str, ...]] = {
    "write_policy": WRITE_POLICIES,
    "prefetch_policy": PREFETCH_POLICIES,
    "host_layout": HOST_LAYOUTS,
    "storage_fault_policy": FAULT_POLICIES,
}


def _parse_dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {value!r}")


@dataclass(frozen=True)
class TierCacheConfig:
    """The configuration of one `TierCache` (one model shard).

    Build it from keyword arguments, `from_dict`, `from_toml` or `from_env`
    (``TIERCACHE_<FIELD>`` variables). Every field is validated on
    construction; a bad value raises `ConfigError` naming the field.

    Model shape:
        num_layers, num_kv_heads, head_dim, dtype, page_size, mla: the KV layout
        (see `KVLayout`).
        model: a name for the weights, folded into storage keys so pages of
        different models never mix.
        tp_rank, tp_size: this tensor-parallel shard.

    Memory tiers:
        device: ``"cpu"`` or a CUDA device for L1.
        device_tokens: token slots in the device pool.
        host_tokens: token slots in the host pool; or ``host_size_bytes``; or
        ``host_ratio`` times ``device_tokens`` (default 2.0, as SGLang). Whole
        pages, rounded down; the one that sizes the pool must give at least
        one page.
        host_layout: ``"layer_first"`` or ``"page_first"``.

    Policies:
        write_policy: ``write_through`` (back up to host on insert),
        ``write_through_selective`` (once a node's hit count reaches
        ``write_through_threshold``), ``write_back`` (when evicted from device).
        storage_url: an L3 backend to attach on open (``None``: none), with
        ``storage_options`` (a mapping, kept as a read-only copy so that the
        config stays a hashable value).
        prefetch_policy: ``timeout`` (the default: wait up to
        ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens /
        1024`` seconds, capped at ``prefetch_timeout_max``, so a request after
        a restart gets what storage holds unless storage is slower than
        that), ``wait_complete`` (wait for the whole prefetch),
        ``best_effort`` (take only what arrived by the time the request
        proceeds: one loop iteration, so in practice pages of a very fast
        backend only).
        prefetch_threshold: fewer storage-hit tokens than this are not fetched.
        prefetch_capacity_tokens: host tokens prefetches may hold at once
        (``None``: no cap).
        storage_timeout_s: deadline of every backend call.
        storage_io_concurrency, storage_io_batch_pages, storage_query_batch_pages,
        storage_backup_batch_pages: storage IO shape.
        alloc_timeout_s: how long `TierCache.alloc_device`, `Request.alloc` and
        a load back wait for device room that other requests or copies hold
        (first come, first served) before raising `CapacityError`; ``0``
        fails at once. A call that can never fit fails at once. Also how
        long a host write (write-through, write-back eviction) or a
        ``wait_complete`` prefetch waits for host room that copies,
        backups, prefetches or loads in flight hold.
        storage_fault_policy: after ``storage_fault_threshold`` consecutive
        failed backend calls, ``auto_reconnect`` (default) stops calling the
        backend — prefetches miss at once, backups are skipped — and probes it
        with exponential backoff from ``storage_reconnect_backoff_s`` up to
        ``storage_reconnect_backoff_max_s`` (not below the first; both
        above 0), resuming when it answers;
        ``auto_detach`` detaches it; ``none`` keeps calling it.
    """

    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    page_size: int = 16
    mla: bool = False
    model: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    device: str = "cpu"
    device_tokens: int = 4096
    host_tokens: int | None = None
    host_size_bytes: int | None = None
    host_ratio: float = 2.0
    host_layout: str = "layer_first"
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    storage_url: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_timeout_max: float = 30.0
    prefetch_capacity_tokens: int | None = None
    storage_timeout_s: float = 5.0
    storage_io_concurrency: int = 4
    storage_io_batch_pages: int = 8
    storage_query_batch_pages: int = 128
    storage_backup_batch_pages: int = 32
    storage_fault_policy: str = "auto_reconnect"
    storage_fault_threshold: int = 5
    storage_reconnect_backoff_s: float = 0.5
    storage_reconnect_backoff_max_s: float = 30.0
    alloc_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _parse_dtype(self.dtype))
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(
                f"storage_options must be a mapping, got {type(self.storage_options).__name__}"
            )
        bad_names = [k for k in self.storage_options if not isinstance(k, str) or not k]
        if bad_names:
            # They are passed as keyword arguments when the backend opens.
            raise ConfigError(f"storage_options names must be non-empty str, got {bad_names!r}")
        # Read-only and hashable: the config is a frozen value, options included.
        object.__setattr__(self, "storage_options", FrozenMapping(self.storage_options))
        self._check_numbers()
        self._check_names()
        self._check_sizes()
        try:
            layout = self.layout()
        except TierCacheError as e:
            raise ConfigError(str(e)) from e
        self._check_host_size(layout.page_bytes)

    def _check_numbers(self) -> None:
        """Each field of `_INT_FIELDS` and `_NUMBER_FIELDS` by its rule (ints stored as ``int``)."""
        for name, minimum in _INT_FIELDS.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL_FIELDS:
                checked = check_int(value, name, minimum=minimum, error=ConfigError)
                object.__setattr__(self, name, checked)
        for name in _NUMBER_FIELDS:
            check_number(
                getattr(self, name), name, positive=name in _POSITIVE_FIELDS, error=ConfigError
            )
        check_bool(self.mla, "mla", error=ConfigError)

    def _check_names(self) -> None:
        """The string fields: policies from their tuples, non-empty names."""
        for name, allowed in _CHOICE_FIELDS.items():
            check_choice(getattr(self, name), allowed, name, error=ConfigError)
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty str, got {self.model!r}")
        if self.storage_url is not None and (
            not isinstance(self.storage_url, str) or not self.storage_url
        ):
            raise ConfigError(
                f"storage_url must be a non-empty str or None, got {self.storage_url!r}"
            )
        if not isinstance(self.device, str):
            raise ConfigError(
                f"device must be a str such as 'cpu' or 'cuda:0', got {self.device!r}"
            )
        # The form only: whether CUDA is there is a question for the machine that opens the cache.
        try:
            device_type = torch.device(self.device).type
        except (RuntimeError, TypeError):
            device_type = None
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def _check_sizes(self) -> None:
        """How the int fields fit together: the shard, whole pages, one way to size the host."""
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} must be below tp_size={self.tp_size}")
        for name in ("device_tokens", "host_tokens"):
            tokens = getattr(self, name)
            if tokens is not None and tokens % self.page_size:
                raise ConfigError(
                    f"{name}={tokens} is not a multiple of page_size={self.page_size}"
                )
        if self.host_tokens is not None and self.host_size_bytes is not None:
            raise ConfigError("give host_tokens or host_size_bytes, not both")
        if self.prefetch_timeout_max < self.prefetch_timeout_base:
            raise ConfigError(
                f"prefetch_timeout_max={self.prefetch_timeout_max:g} must be at least "
                f"prefetch_timeout_base={self.prefetch_timeout_base:g}: the cap would cut "
                "every prefetch's wait below its base"
            )
        check_backoff(
            self.storage_reconnect_backoff_s,
            self.storage_reconnect_backoff_max_s,
            "storage_reconnect_backoff_s",
            "storage_reconnect_backoff_max_s",
        )

    def _check_host_size(self, page_bytes: int) -> None:
        """The field that sizes the host pool gives it at least one page (never rounded up)."""
        if self.host_tokens is not None:
            return  # a positive multiple of page_size
        if self.host_size_bytes is not None:
            if self.host_size_bytes < page_bytes:
                raise ConfigError(
                    f"host_size_bytes={self.host_size_bytes} is less than one page "
                    f"({page_bytes} bytes)"
                )
        elif int(self.device_tokens * self.host_ratio) < self.page_size:
            raise ConfigError(
                f"host_ratio={self.host_ratio} gives the host pool less than one page: "
                f"device_tokens={self.device_tokens} x {self.host_ratio} < page_size={self.page_size}"
            )

    # -- derived --------------------------------------------------------------

    def layout(self) -> KVLayout:
        """The `KVLayout` these fields describe."""
        return KVLayout(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.page_size,
            mla=self.mla,
        )

    def resolved_host_tokens(self) -> int:
        """Host pool slots: ``host_tokens``, else from ``host_size_bytes``, else the ratio."""
        ps = self.page_size
        if self.host_tokens is not None:
            return self.host_tokens
        if self.host_size_bytes is not None:
            return max(ps, self.host_size_bytes // self.layout().page_bytes * ps)
        return max(ps, int(self.device_tokens * self.host_ratio) // ps * ps)  # checked: >= ps

    def storage_tier_config(self) -> StorageTierConfig:
        """The controller's storage knobs (`StorageTierConfig`) these fields describe."""
        return StorageTierConfig(
            prefetch_threshold=self.prefetch_threshold,
            query_batch_pages=self.storage_query_batch_pages,
            io_batch_pages=self.storage_io_batch_pages,
            io_concurrency=self.storage_io_concurrency,
            backup_batch_pages=self.storage_backup_batch_pages,
            prefetch_capacity_tokens=self.prefetch_capacity_tokens,
            timeout_s=self.storage_timeout_s,
            fault_policy=self.storage_fault_policy,
            fault_threshold=self.storage_fault_threshold,
            reconnect_backoff_s=self.storage_reconnect_backoff_s,
            reconnect_backoff_max_s=self.storage_reconnect_backoff_max_s,
        )

    def prefetch_timeout(self, num_tokens: int) -> float:
        """The ``timeout`` policy's deadline for a prefetch of ``num_tokens`` tokens."""
        t = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * num_tokens / 1024
        return min(t, self.prefetch_timeout_max)

    def replace(self, **changes: Any) -> TierCacheConfig:
        """A copy with ``changes`` applied, validated as a new configuration.

        Raises:
            ConfigError: an unknown field name (a typo never passes silently)
                or a bad value.
        """
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown configuration keys: {unknown}")
        return dataclasses.replace(self, **changes)

    # -- constructors -----------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TierCacheConfig:
        """Build from a mapping; unknown keys raise `ConfigError` (typos never pass silently)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown configuration keys: {unknown}")
        try:
            return cls(**dict(data))
        except TypeError as e:
            raise ConfigError(str(e)) from e

    @classmethod
    def from_toml(cls, path: str | Path, table: str | None = "tiercache") -> TierCacheConfig:
        """Build from a TOML file: the ``[tiercache]`` table, or the whole file when absent.

        Raises:
            ConfigError: ``path`` is not a str or path (an int would be read
                as an open file descriptor, and closed), ``table`` is not a
                str or None, an unreadable or invalid file, or bad values.
        """
        if isinstance(path, bool) or not isinstance(path, str | os.PathLike):
            raise ConfigError(f"path must be a str or a path, got {type(path).__name__} {path!r}")
        if table is not None and not isinstance(table, str):
            raise ConfigError(f"table must be a str or None, got {table!r}")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read configuration {path}: {e}") from e
        if table and isinstance(data.get(table), dict):
            data = data[table]
        return cls.from_dict(data)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> TierCacheConfig:
        """Build from ``TIERCACHE_<FIELD>`` variables (e.g. ``TIERCACHE_PAGE_SIZE=64``).

        Values are parsed by the field's type; ``TIERCACHE_STORAGE_OPTIONS``
        is ``key=value,key=value`` (anything else raises). Keyword ``overrides`` win over the
        environment. Unknown ``TIERCACHE_`` variables are ignored (other tools
        share the prefix), except that a bad value for a known one raises.

        Raises:
            ConfigError: ``environ`` is not a mapping, a bad value, or an
                unknown override.
        """
        env = os.environ if environ is None else environ
        if not isinstance(env, Mapping):
            raise ConfigError(f"environ must be a mapping, got {type(env).__name__}")
        types = {f.name: f.type for f in fields(cls)}
        data: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(_ENV_PREFIX):
                continue
            name = key[len(_ENV_PREFIX) :].lower()
            if name not in types:
                continue
            data[name] = _parse_env(name, str(types[name]), raw)
        data.update(overrides)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dtype"] = dtype_name(self.dtype)
        out["storage_options"] = dict(self.storage_options)
        return out


def _parse_env(name: str, type_name: str, raw: str) -> Any:
    text = raw.strip()
    try:
        if name == "storage_options":
            opts: dict[str, str] = {}
            for part in filter(None, (p.strip() for p in text.split(","))):
                k, eq, v = part.partition("=")
                if not eq or not k.strip():
                    raise ConfigError(
                        f"TIERCACHE_STORAGE_OPTIONS={raw!r} is not key=value,key=value: {part!r}"
                    )
                opts[k.strip()] = v.strip()
            return opts
        if "None" in type_name and text.lower() in ("", "none"):
            return None
        if type_name.startswith("bool"):
            return parse_bool(text, f"{_ENV_PREFIX}{name.upper()}")
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
        return text
    except ConfigError:
        raise  # already says what is wrong (a ConfigError is a ValueError too)
    except ValueError as e:
        raise ConfigError(f"TIERCACHE_{name.upper()}={raw!r} is not a valid {type_name}") from e
