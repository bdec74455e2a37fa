"""Page keys: the token hash chain and the storage namespace around it.

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

A hash names a token prefix, not a model. `StorageNamespace` adds the identity
of the bytes (model, dtype, layout, page size, tensor-parallel shard), so pages
of different models, dtypes or shards never share a storage key.

Everything here is synchronous and thread-safe (pure functions, frozen
values). Hashing a long prompt takes milliseconds: call it from an executor
when it would otherwise stall the event loop.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiercache.errors import InvalidInputError
from tiercache.memory.layout import KVLayout, dtype_name
from tiercache.memory.pools import HOST_LAYOUTS
from tiercache.storage.base import PageKey

__all__ = [
    "MAX_KEY_LENGTH",
    "StorageNamespace",
    "hash_page",
    "pack_tokens",
    "page_hashes",
    "validate_key",
]

#: The longest storage key a backend accepts.
MAX_KEY_LENGTH = 200

_KEY_RE = re.compile(r"[0-9A-Za-z_.-]+")
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


def validate_key(key: object) -> PageKey:
    """Check that ``key`` is safe to use as a file name, a redis key, or a URL part.

    Accepted: 1 to `MAX_KEY_LENGTH` characters of ``[0-9A-Za-z_.-]``, not
    starting with ``"."``. So a key never contains a path separator, never is
    ``"."`` or ``".."``, and never names a hidden (temporary) file.

    Raises:
        InvalidInputError: the key breaks one of these rules.
    """
    if not isinstance(key, str):
        raise InvalidInputError(f"a page key must be a str, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidInputError(
            f"a page key must have 1 to {MAX_KEY_LENGTH} characters, got {len(key)}"
        )
    if key[0] == "." or _KEY_RE.fullmatch(key) is None:
        raise InvalidInputError(
            f"a page key may only use [0-9A-Za-z_.-] and not start with '.': {key!r}"
        )
    return PageKey(key)


@dataclass(frozen=True, slots=True)
class StorageNamespace:
    """The identity of one pool's page bytes, prefixed to every storage key.

    Two pools share stored pages only when every field that shapes the bytes
    matches. For MLA the latent cache is replicated across tensor-parallel
    ranks, so ``tp_rank`` is left out of the identity: one rank writes, every
    rank reads the same keys.

    Attributes:
        model: model name (anything identifying the weights).
        dtype: KV dtype name, e.g. ``"float16"``.
        layout: `KVLayout.describe` of the shard.
        host_layout: ``"layer_first"`` or ``"page_first"`` (the byte order of
            a stored page).
        page_size: tokens per page.
        tp_rank, tp_size: this shard and the tensor-parallel width.
        mla: the layout is MLA.

    Raises:
        InvalidInputError: empty model, bad ranks, or an unknown host layout.
    """

    model: str
    dtype: str
    layout: str
    host_layout: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    mla: bool = False
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidInputError(f"model must be a non-empty str, got {self.model!r}")
        if self.host_layout not in HOST_LAYOUTS:
            raise InvalidInputError(
                f"host_layout must be one of {HOST_LAYOUTS}, got {self.host_layout!r}"
            )
        for name in ("page_size", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {v!r}")
        if (
            isinstance(self.tp_rank, bool)
            or not isinstance(self.tp_rank, int)
            or not 0 <= self.tp_rank < self.tp_size
        ):
            raise InvalidInputError(
                f"tp_rank must be an int in [0, {self.tp_size}), got {self.tp_rank!r}"
            )
        if not isinstance(self.mla, bool):
            raise InvalidInputError(f"mla must be a bool, got {self.mla!r}")
        object.__setattr__(self, "_digest", hashlib.sha256(self.identity.encode()).hexdigest()[:16])

    @classmethod
    def for_layout(
        cls,
        layout: KVLayout,
        host_layout: str,
        *,
        model: str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> StorageNamespace:
        """The namespace of a host pool of ``layout`` in ``host_layout``."""
        if not isinstance(layout, KVLayout):
            raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        return cls(
            model=model,
            dtype=dtype_name(layout.dtype),
            layout=layout.describe(),
            host_layout=host_layout,
            page_size=layout.page_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            mla=layout.mla,
        )

    @property
    def identity(self) -> str:
        """The fields that name the bytes, as one line (``tp_rank`` omitted for MLA)."""
        rank = "*" if self.mla else str(self.tp_rank)
        return (
            f"tiercache/1|model={self.model}|dtype={self.dtype}|layout={self.layout}"
            f"|host={self.host_layout}|page={self.page_size}|tp={rank}/{self.tp_size}|mla={int(self.mla)}"
        )

    @property
    def digest(self) -> str:
        """16 hex characters of sha256 over `identity`: the key prefix."""
        return self._digest

    def key(self, page_hash: str) -> PageKey:
        """The storage key of the page whose chain hash is ``page_hash``.

        Raises:
            InvalidInputError: ``page_hash`` is not 1 to 128 lowercase hex characters.
        """
        if not isinstance(page_hash, str) or _HASH_RE.fullmatch(page_hash) is None:
            raise InvalidInputError(f"a page hash is lowercase hex, got {page_hash!r}")
        return PageKey(f"{self._digest}-{page_hash}")

    def keys(self, page_hashes: Sequence[str]) -> list[PageKey]:
        """`key` of each hash, in order."""
        prefix = self._digest
        out: list[PageKey] = []
        for h in page_hashes:
            if not isinstance(h, str) or _HASH_RE.fullmatch(h) is None:
                raise InvalidInputError(f"a page hash is lowercase hex, got {h!r}")
            out.append(PageKey(f"{prefix}-{h}"))
        return out
