"""The shape of one model's KV cache: layers, heads, head size, dtype, page size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache._checks import check_bool, check_positive
from tiercache.errors import InvalidInputError

__all__ = ["SUPPORTED_DTYPES", "KVLayout", "dtype_name"]

#: dtypes a pool may hold. Pages are moved and stored as raw bytes, so any
#: fixed-size dtype works; these are the ones serving engines use for KV.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: the stable name used in keys and headers."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache shape of one model (one tensor-parallel shard of it).

    Args:
        num_layers: transformer layers.
        num_kv_heads: KV heads held by this shard (MHA/GQA). Must be 1 for MLA.
        head_dim: size of one head; for MLA, ``kv_lora_rank + qk_rope_head_dim``.
        dtype: element type of the cache.
        page_size: token slots per page, the unit of allocation, transfer,
            hashing and storage.
        mla: one latent buffer per layer instead of separate K and V buffers.

    Raises:
        InvalidInputError: a field is not a positive int, the dtype is not a
            supported KV dtype, or ``mla`` with more than one head.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 64
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            object.__setattr__(self, name, check_positive(getattr(self, name), name))
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in SUPPORTED_DTYPES:
            raise InvalidInputError(
                f"dtype must be one of {[dtype_name(d) for d in SUPPORTED_DTYPES]}, got {self.dtype!r}"
            )
        object.__setattr__(self, "mla", check_bool(self.mla, "mla"))
        if self.mla and self.num_kv_heads != 1:
            raise InvalidInputError(
                f"an MLA layout has one latent head, got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def num_buffers(self) -> int:
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        """Bytes of one element of ``dtype``."""
        return self.dtype.itemsize

    @property
    def token_layer_bytes(self) -> int:
        """Bytes of one token in one layer of one buffer (K or V or latent)."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot across every layer and buffer."""
        return self.num_buffers * self.num_layers * self.token_layer_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every layer and buffer: one storage object."""
        return self.page_size * self.token_bytes

    def describe(self) -> str:
        """A stable one-line identity, used in storage headers and keys."""
        kind = "mla" if self.mla else "mha"
        return (
            f"{kind}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":{dtype_name(self.dtype)}:P{self.page_size}"
        )
