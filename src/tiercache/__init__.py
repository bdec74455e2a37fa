"""tiercache: a tiered KV cache for LLM serving, written for asyncio.

Device memory (L1), pinned host memory (L2) and storage backends (L3: local
files, Redis, plugins) behind one asyncio facade, `TierCache`, driven by an
async controller, `TierController`.
"""

from tiercache import errors
from tiercache.cache import CacheMatch, CacheStats, Request, TierCache
from tiercache.config import PREFETCH_POLICIES, WRITE_POLICIES, TierCacheConfig
from tiercache.controller import CopyAck, LoadHandle, TierController
from tiercache.errors import TierCacheError
from tiercache.index.hashing import hash_page, page_hashes
from tiercache.memory import DeviceKVPool, HostKVPool, KVLayout, PageAllocator
from tiercache.storage import PageKey, StorageBackend, open_backend, register_backend
from tiercache.storage.keys import StorageNamespace
from tiercache.storage_tier import BackupOperation, PrefetchOperation, PrefetchState

__version__ = "0.1.0"

__all__ = [
    "PREFETCH_POLICIES",
    "WRITE_POLICIES",
    "BackupOperation",
    "CacheMatch",
    "CacheStats",
    "CopyAck",
    "DeviceKVPool",
    "HostKVPool",
    "KVLayout",
    "LoadHandle",
    "PageAllocator",
    "PageKey",
    "PrefetchOperation",
    "PrefetchState",
    "Request",
    "StorageBackend",
    "StorageNamespace",
    "TierCache",
    "TierCacheConfig",
    "TierCacheError",
    "TierController",
    "__version__",
    "errors",
    "hash_page",
    "open_backend",
    "page_hashes",
    "register_backend",
]
