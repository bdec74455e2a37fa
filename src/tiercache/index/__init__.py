"""The prefix index and the token hash chain its pages are named by.

Synchronous and loop-free, like everything in the core. Storage identity
(namespaces and keys) lives in `tiercache.storage.keys`.
"""

from tiercache.index.hashing import hash_page, pack_tokens, page_hashes

__all__ = ["hash_page", "pack_tokens", "page_hashes"]
