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
import re
import sys
from array import array

import numpy as np

from tiercache.errors import InvalidInputError

__all__ = ["hash_page", "pack_tokens", "page_hashes"]

_HASH_RE = re.compile(r"[0-9a-f]{1,128}")
_TOKEN_LIMIT = 1 << 32
_LITTLE = sys.byteorder == "little"


def pack_tokens(token_ids: object) -> bytes:
    """Token ids as little-endian ``uint32`` bytes, 4 per token.

    Args:
        token_ids: a list or tuple of ints, or a 1-D integer numpy array or
            torch tensor (any device; a CUDA tensor is copied to the host).

    Raises:
        InvalidInputError: not a sequence of integers, not 1-D, or a token
            outside ``[0, 2**32)``.
    """
    if isinstance(token_ids, (list, tuple)):
        try:
            packed = array("I", token_ids)
        except OverflowError as e:
            raise InvalidInputError(f"token ids must lie in [0, 2**32): {e}") from e
        except TypeError as e:
            raise InvalidInputError(f"token ids must be integers: {e}") from e
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            packed.byteswap()
        return packed.tobytes()
    arr: np.ndarray
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif type(token_ids).__module__.startswith("torch") and hasattr(token_ids, "detach"):
        import torch

        assert isinstance(token_ids, torch.Tensor)
        if (
            token_ids.dtype.is_floating_point
            or token_ids.dtype.is_complex
            or token_ids.dtype == torch.bool
        ):
            raise InvalidInputError(
                f"token ids must be an integer tensor, got dtype {token_ids.dtype}"
            )
        t = token_ids.detach().cpu()
        arr = (
            t
            if t.dtype in (torch.int32, torch.int64, torch.uint8, torch.int16, torch.int8)
            else t.long()
        ).numpy()
    else:
        raise InvalidInputError(
            f"token ids must be a list, tuple, numpy array or torch tensor, got {type(token_ids).__name__}"
        )
    if arr.ndim != 1:
        raise InvalidInputError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must have an integer dtype, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT):
        raise InvalidInputError(
            f"token ids must lie in [0, 2**32): min {int(arr.min())}, max {int(arr.max())}"
        )
    return np.ascontiguousarray(arr, dtype="<u4").tobytes()


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
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise InvalidInputError(f"page_size must be a positive int, got {page_size!r}")
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
