"""The exceptions tiercache raises.

Every exception raised on purpose by tiercache derives from `TierCacheError`, so
one ``except TierCacheError`` catches them all. The tree::

    TierCacheError
    ├── ConfigError            (also ValueError)   a setting is invalid or unknown
    │   └── BackendNotFoundError                    no backend has that name / URL scheme
    ├── InvalidInputError      (also ValueError)   a call's arguments are wrong: dtype,
    │   │                                           shape, range, page alignment, length
    │   └── DoubleFreeError                         slots freed that were not allocated
    ├── StateError             (also RuntimeError) the object is in the wrong state
    │   └── ClosedError                             used after ``aclose()`` / ``close()``
    ├── CapacityError                               memory cannot be found: a pool sized
    │                                               beyond the machine, or every page locked
    └── StorageError                                a storage backend failed.
        ├── StorageTimeoutError                     ... it did not answer in time
        ├── StorageCorruptionError                  ... it returned bytes that fail checks
        └── BackendUnavailableError                 ... it is down, detached or closed

`StorageError` is the one a caller is expected to handle: **catch it and treat
the operation as a miss**. tiercache itself does so on its prefetch and backup
paths: a failing backend costs recomputation, never wrong KV. Usage errors
(`ConfigError`, `InvalidInputError`, `StateError`) are bugs in the calling code
and are raised before any state changes; nothing already cached is lost.

Invariants that only a bug inside tiercache can break are ``assert`` statements,
not exceptions from this tree.
"""

from __future__ import annotations

__all__ = [
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DoubleFreeError",
    "InvalidInputError",
    "StateError",
    "StorageCorruptionError",
    "StorageError",
    "StorageTimeoutError",
    "TierCacheError",
]


class TierCacheError(Exception):
    """Root of every exception tiercache raises on purpose."""


class ConfigError(TierCacheError, ValueError):
    """A configuration value is invalid, out of range or unknown."""


class BackendNotFoundError(ConfigError):
    """No storage backend is registered under that name or URL scheme."""


class InvalidInputError(TierCacheError, ValueError):
    """A call's arguments are wrong (dtype, shape, range, alignment, length)."""


class DoubleFreeError(InvalidInputError):
    """Slots were freed that are not currently allocated."""


class StateError(TierCacheError, RuntimeError):
    """The object is not in a state that allows this call."""


class ClosedError(StateError):
    """The object was closed; open a new one."""


class CapacityError(TierCacheError):
    """Memory cannot be found: a pool too large for the machine, or all pages locked."""


class StorageError(TierCacheError):
    """A storage backend failed. Catch it and treat the operation as a miss."""


class StorageTimeoutError(StorageError):
    """A storage backend did not answer in time."""


class StorageCorruptionError(StorageError):
    """A storage backend returned bytes that fail the header or checksum checks."""


class BackendUnavailableError(StorageError):
    """The storage backend is down, detached or closed."""
