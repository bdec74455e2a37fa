"""The token hash chain: one hash per page, each covering every token before it.

A page's hash is SGLang's ``get_hash_str``, byte for byte, so a chain computed
here matches one computed by SGLang (and by another tiercache instance)::

    h = sha256(); if prior: h.update(bytes.fromhex(prior))
    for t in page_tokens: h.update(t.to_bytes(4, "little", signed=False))
    key = h.hexdigest()

Feeding sha256 four bytes at a time costs one Python call per token. Here the
whole token sequence is packed once into little-endian ``uint32`` bytes
(``array('I')`` for Python sequences, numpy for arrays and tensors) and each
page is one ``update`` with the prior digest and one with a slice of the packed
bytes: the same digest, several times faster.

A hash names a token prefix, not a model: `tiercache.storage.keys.StorageNamespace`
adds the identity of the bytes (model, dtype, layout, page size, tensor-parallel
shard) to make a storage key.

Everything here is synchronous and thread-safe (pure functions, frozen
values). Hashing a long prompt takes milliseconds: call it from an executor
when it would otherwise stall the event loop.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

import numpy as np

from tiercache._checks import check_positive, token_array
from tiercache.errors import InvalidInputError

__all__ = ["INLINE_HASH_PAGES", "hash_page", "pack_tokens", "page_hashes"]

_LITTLE = sys.byteorder == "little"

#: Pages a caller on an event loop hashes there; it hashes longer prompts in a
#: worker thread (a thread hop costs about what hashing this many pages does).
INLINE_HASH_PAGES = 64


def pack_tokens(token_ids: object) -> bytes:
    """Token ids as little-endian ``uint32`` bytes, 4 per token.

    Takes what `tiercache._checks.token_array` takes, and refuses the same.

    Args:
        token_ids: a list or tuple of ints, or a 1-D integer numpy array or
            torch tensor (any device; a CUDA tensor is copied to the host).

    Raises:
        InvalidInputError: not a sequence of integers (a ``bool`` is none),
            not 1-D, or a token outside ``[0, 2**32)``.
    """
    ids = token_array(token_ids, "token ids")
    if isinstance(ids, array):
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            ids.byteswap()
        return ids.tobytes()
    return np.ascontiguousarray(ids, dtype="<u4").tobytes()


def _prior_bytes(prior_hash: str | None) -> bytes:
    if prior_hash is None:
        return b""
    if not isinstance(prior_hash, str) or not prior_hash:
        raise InvalidInputError(f"prior_hash must be a hex string or None, got {prior_hash!r}")
    try:
        return bytes.fromhex(prior_hash)
    except ValueError as e:
        raise InvalidInputError(f"prior_hash is not hex: {prior_hash!r}") from e


def hash_page(token_ids: object, prior_hash: str | None = None) -> str:
    """The hash of one page of tokens, chained to the previous page's hash.

    Args:
        token_ids: the page's token ids (see `pack_tokens` for accepted types).
        prior_hash: the previous page's hash (hex), or ``None`` for the first page.

    Returns:
        The 64-character lowercase hex sha256 digest, equal to SGLang's
        ``get_hash_str(token_ids, prior_hash)``.

    Raises:
        InvalidInputError: an empty page, bad token ids or a non-hex prior.
    """
    packed = pack_tokens(token_ids)
    if not packed:
        raise InvalidInputError("a page has at least one token")
    h = hashlib.sha256(_prior_bytes(prior_hash))
    h.update(packed)
    return h.hexdigest()


def page_hashes(token_ids: object, page_size: int, prior_hash: str | None = None) -> list[str]:
    """The hash chain of every full page of ``token_ids``.

    Page ``i`` covers tokens ``[i * page_size, (i + 1) * page_size)`` and is
    chained to page ``i - 1`` (page 0 to ``prior_hash``). A trailing partial
    page is not hashed: its KV is never stored.

    Raises:
        InvalidInputError: ``page_size`` not a positive int, bad token ids or
            a non-hex prior.
    """
    page_size = check_positive(page_size, "page_size")
    packed = pack_tokens(token_ids)
    prior = _prior_bytes(prior_hash)
    step = 4 * page_size
    digests: list[bytes] = []
    append = digests.append
    sha256 = hashlib.sha256
    for start in range(0, len(packed) - step + 1, step):
        # One sha256 call per page over prior + page: equal to update(prior); update(page).
        prior = sha256(prior + packed[start : start + step]).digest()
        append(prior)
    out = [d.hex() for d in digests]
    return out
