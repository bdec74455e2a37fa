"""Page identity: the token hash chain, storage keys and (later) the prefix index.

Synchronous and loop-free, like everything in the core.
"""

from tiercache.index.hashing import (
    MAX_KEY_LENGTH,
    StorageNamespace,
    hash_page,
    pack_tokens,
    page_hashes,
    validate_key,
)

__all__ = [
    "MAX_KEY_LENGTH",
    "StorageNamespace",
    "hash_page",
    "pack_tokens",
    "page_hashes",
    "validate_key",
]
