"""Memory tiers: layouts, page allocators, the device (L1) and host (L2) pools.

Everything here is synchronous and loop-free: an ``await`` can never interrupt
a bookkeeping update halfway.
"""

from tiercache.memory.allocator import PageAllocator, check_slot_indices
from tiercache.memory.layout import SUPPORTED_DTYPES, KVLayout, dtype_name
from tiercache.memory.pages import PageBuffer
from tiercache.memory.pools import HOST_LAYOUTS, DeviceKVPool, HostKVPool, available_host_memory

__all__ = [
    "HOST_LAYOUTS",
    "SUPPORTED_DTYPES",
    "DeviceKVPool",
    "HostKVPool",
    "KVLayout",
    "PageAllocator",
    "PageBuffer",
    "available_host_memory",
    "check_slot_indices",
    "dtype_name",
]
