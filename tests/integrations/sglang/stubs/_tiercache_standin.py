"""Placeholder attributes shared by every stand-in (see README.md).

Loaded once as the module ``_tiercache_standin`` by `sglang_helpers._use_standin`
before any stand-in package, which imports `module_getattr` from it.
"""

from __future__ import annotations

from typing import Any


class Placeholder:
    """Any attribute of the stand-in: usable in module-level code, fails when used for real."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test stand-in, not the real package")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def module_getattr(module: str) -> Any:
    def __getattr__(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return __getattr__
