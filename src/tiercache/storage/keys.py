"""Storage identity: which bytes a key names, and which keys every backend accepts.

A page's chain hash (`tiercache.index.hashing`) names a token prefix, not a
model. `StorageNamespace` adds the identity of the bytes (model, dtype,
layout, page size, tensor-parallel shard), so pages of different models,
dtypes or shards never share a storage key. `validate_key` is the one rule
for keys, applied by every backend alike: a key that one backend stores,
every backend stores.

Everything here is synchronous, thread-safe and free of I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache._checks import check_bool, check_positive, is_int
from tiercache.errors import InvalidInputError
from tiercache.memory.layout import KVLayout, dtype_name
from tiercache.memory.pools import HOST_LAYOUTS
from tiercache.storage.base import PageBuffer, PageKey

__all__ = ["MAX_KEY_LENGTH", "StorageNamespace", "check_batch", "validate_key"]

#: The longest storage key a backend accepts.
MAX_KEY_LENGTH = 200

_KEY_RE = re.compile(r"[0-9A-Za-z_.-]+")
_HASH_RE = re.compile(r"[0-9a-f]{1,128}")


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


def check_batch(
    keys: Sequence[PageKey],
    pages: Sequence[PageBuffer] | None = None,
    *,
    targets: bool = False,
) -> list[PageKey]:
    """Check a batch's keys with `validate_key`, and that there is one page per key.

    Every backend checks its batches here, before any I/O.

    Args:
        keys: the batch's keys (a sequence; one ``str`` is refused, not split).
        pages: the batch's pages, or None for a call without pages.
        targets: the pages are read into (``batch_get``): each must be
            writable and exactly as long as it says (``nbytes``).

    Returns:
        The keys, as a new list.

    Raises:
        InvalidInputError: a bad key, ``keys`` and ``pages`` of different
            lengths, a page that is not a `PageBuffer`, or (``targets``) a
            page with a read-only segment or whose segments do not add up
            to its ``nbytes``.
    """
    if isinstance(keys, str):
        raise InvalidInputError("keys must be a sequence of keys, not one str")
    out = [validate_key(k) for k in keys]
    if pages is not None:
        if len(pages) != len(out):
            raise InvalidInputError(f"{len(out)} keys but {len(pages)} pages")
        for p in pages:
            if not isinstance(p, PageBuffer):
                raise InvalidInputError(f"pages must be PageBuffer objects, got {type(p).__name__}")
            if targets:
                _check_target(p)
    return out


def _check_target(page: PageBuffer) -> None:
    """Refuse a page buffer that no stored page can be read into."""
    total = 0
    for seg in page.segments:
        if seg.readonly:
            raise InvalidInputError("a target page has a read-only segment: it cannot be read into")
        total += seg.nbytes
    if total != page.nbytes:
        raise InvalidInputError(
            f"a target page says it holds {page.nbytes} bytes but its segments hold {total}"
        )


def _field(value: str) -> str:
    """A free-text identity field with ``\\`` and ``|`` escaped.

    Unescaped, a ``|`` in one field could pose as the next field: the model
    ``"m|dtype=a"`` with dtype ``"b"`` and the model ``"m"`` with dtype
    ``"a|dtype=b"`` would share one identity, and so one key prefix. A value
    without either character is unchanged, and so are the keys it names.
    """
    return value.replace("\\", "\\\\").replace("|", "\\|")


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
        for name in ("dtype", "layout"):
            if not isinstance(getattr(self, name), str):
                raise InvalidInputError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.host_layout not in HOST_LAYOUTS:
            raise InvalidInputError(
                f"host_layout must be one of {HOST_LAYOUTS}, got {self.host_layout!r}"
            )
        for name in ("page_size", "tp_size"):
            object.__setattr__(self, name, check_positive(getattr(self, name), name))
        if not is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidInputError(
                f"tp_rank must be an int in [0, {self.tp_size}), got {self.tp_rank!r}"
            )
        object.__setattr__(self, "tp_rank", int(self.tp_rank))
        object.__setattr__(self, "mla", check_bool(self.mla, "mla"))
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
        model, dtype, layout = (_field(v) for v in (self.model, self.dtype, self.layout))
        return (
            f"tiercache/1|model={model}|dtype={dtype}|layout={layout}"
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
