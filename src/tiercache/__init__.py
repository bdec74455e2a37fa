"""tiercache: a tiered KV cache for LLM serving, written for asyncio."""

from tiercache import errors
from tiercache.errors import TierCacheError
from tiercache.controller import CopyAck, LoadHandle, TierController
from tiercache.memory import DeviceKVPool, HostKVPool, KVLayout, PageAllocator

__version__ = "0.1.0"

__all__ = [
    "CopyAck",
    "LoadHandle",
    "TierController",
    "DeviceKVPool",
    "HostKVPool",
    "KVLayout",
    "PageAllocator",
    "TierCacheError",
    "__version__",
    "errors",
]
