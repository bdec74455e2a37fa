"""`AsyncResource`: the ``async with`` shape shared by the cache, the controller and backends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


class AsyncResource(ABC):
    """An object used with ``async with`` and closed by `aclose`.

    ``async with x:`` calls `_aenter` on entry (acquire, or check the object
    is usable) and ``await x.aclose()`` on exit, whatever the exit (an
    exception, a cancellation). `aclose` must be idempotent.
    """

    @abstractmethod
    async def _aenter(self) -> None:
        """Entering ``async with``: acquire what is needed, or refuse a closed object."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release everything. Idempotent."""

    async def __aenter__(self) -> Self:
        await self._aenter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
