"""L3 storage tiers: the `StorageBackend` interface, backends and their registry."""

from tiercache.storage.base import BackendState, BackendStats, PageBuffer, PageKey, StorageBackend

__all__ = ["BackendState", "BackendStats", "PageBuffer", "PageKey", "StorageBackend"]
