"""`FrozenMapping`: the read-only mapping that frozen configuration dataclasses hold.

A frozen dataclass is hashable and equal to itself for good; a ``dict`` field
breaks both: ``hash()`` raises ``TypeError``, and the dict can be changed in
place after the object was hashed, compared or handed to another thread.
Configuration that takes a mapping of options (`TierCacheConfig.storage_options`,
the SGLang adapter's ``backend_options``) stores a `FrozenMapping` copy instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["FrozenMapping"]


class FrozenMapping(Mapping[str, Any]):
    """A read-only copy of a mapping of named options; hashable.

    It compares equal to any mapping with the same items (a ``dict``
    included) and hashes over its keys alone: option values may be
    unhashable (a list of hosts, an SSL context), and equal mappings have
    equal keys, so equal objects always hash alike. ``dict(m)`` or ``**m``
    gives the options back as a dict.

    Args:
        data: the options; copied (later changes to it do not reach this one).
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMapping):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._data))

    def __reduce__(self) -> tuple[type[FrozenMapping], tuple[dict[str, Any]]]:
        return FrozenMapping, (self._data,)

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"
