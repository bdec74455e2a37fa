"""Validation of engine adapter options, shared by the SGLang and vLLM adapters."""

from __future__ import annotations

import math

from tiercache.errors import ConfigError

__all__ = ["positive"]


def positive(option: str, value: object, *, integer: bool = False) -> float:
    """Check that ``value`` is a finite positive number (an int with ``integer``).

    Args:
        option: the option as the adapter's user writes it (``"timeout_s"``,
            ``"extra_config['timeout_s']"``), for the message.
        value: the value given.
        integer: only an int is accepted.

    Returns:
        ``value`` as a float.

    Raises:
        ConfigError: a bool, a non-number, NaN, an infinity, zero or a negative
            number; the message names ``option``.
    """
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        kind = "an int" if integer else "a number"
        raise ConfigError(f"{option} must be {kind}, got {value!r}")
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{option} must be positive, got {value!r}")
    return v
