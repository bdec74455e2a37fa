"""`PageBuffer`: one page's bytes as the storage tier sees them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.errors import InvalidInputError

__all__ = ["PageBuffer"]


@dataclass(frozen=True, slots=True)
class PageBuffer:
    """One page's bytes, as a few contiguous segments in a fixed order.

    A host pool hands out page buffers whose segments are views of its own
    memory (zero-copy): a backend writes the segments out one after the other,
    or reads into them in place. In the ``page_first`` host layout a page is one
    segment per K/V buffer; in ``layer_first`` it is one segment per buffer and
    layer. Segments are writable ``memoryview`` objects of format ``"B"``.

    Attributes:
        segments: the page's bytes, in order.
        nbytes: total length of the segments.
        format: identity of the byte layout (model shape, dtype, host layout,
            page size). A backend stores it, and reading a stored page into a
            buffer of another format (or length) is an `InvalidInputError`
            that leaves the stored page in place.
    """

    segments: tuple[memoryview, ...]
    nbytes: int
    format: str

    @classmethod
    def from_segments(cls, segments: Sequence[memoryview], format: str) -> PageBuffer:
        views = tuple(s if s.format == "B" and s.ndim == 1 else s.cast("B") for s in segments)
        return cls(views, sum(v.nbytes for v in views), format)

    @classmethod
    def allocate(cls, nbytes: int, format: str) -> PageBuffer:
        """A standalone buffer of ``nbytes`` zero bytes (tests, tools)."""
        return cls((memoryview(bytearray(nbytes)),), nbytes, format)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, format: str) -> PageBuffer:
        """A standalone, writable copy of ``data``."""
        buf = bytearray(data)
        return cls((memoryview(buf),), len(buf), format)

    def tobytes(self) -> bytes:
        """A copy of the page's bytes."""
        if len(self.segments) == 1:
            return self.segments[0].tobytes()
        return b"".join(s.tobytes() for s in self.segments)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (exactly ``nbytes`` long) into the segments.

        Raises:
            InvalidInputError: ``data`` has the wrong length.
        """
        src = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        if src.nbytes != self.nbytes:
            raise InvalidInputError(f"page data is {src.nbytes} bytes, expected {self.nbytes}")
        pos = 0
        for seg in self.segments:
            seg[:] = src[pos : pos + seg.nbytes]
            pos += seg.nbytes
