"""L3 storage tiers: the `StorageBackend` interface, backends and their registry.

``await open_backend(url, **options)`` opens a backend by URL (``memory://``,
``file:///path``, ``redis://...``, or a registered plugin). The backend classes
load on first use, so importing this package stays cheap and free of optional
dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiercache.storage.base import BackendState, BackendStats, PageBuffer, PageKey, StorageBackend
from tiercache.storage.keys import MAX_KEY_LENGTH, StorageNamespace, validate_key
from tiercache.storage.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    open_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)

if TYPE_CHECKING:
    from tiercache.storage.file import FileBackend
    from tiercache.storage.memory import MemoryBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendState",
    "BackendStats",
    "MAX_KEY_LENGTH",
    "FileBackend",
    "MemoryBackend",
    "PageBuffer",
    "PageKey",
    "StorageBackend",
    "StorageNamespace",
    "available_backends",
    "open_backend",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
    "validate_key",
]

_LAZY = {
    "MemoryBackend": "tiercache.storage.memory",
    "FileBackend": "tiercache.storage.file",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
