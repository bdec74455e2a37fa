"""Argument checks shared by every public verb, so that they all agree.

One input has one answer wherever it is passed: a list, a tuple, a 1-D
integer numpy array and a 1-D integer tensor of the same token ids are the
same prompt; an id outside ``[0, 2**32)`` (what a storage key can encode) is an
`InvalidInputError` at `TierCache.request`, `TierCache.insert`,
`TierCache.match_prefix`, `TierCache.prefetch`, `Request.commit` and
`tiercache.index.hash_page` alike. Counts are non-negative ints, never
``bool`` or ``float``; names of policies come from a fixed tuple; slot
arguments are 1-D ``int64`` tensors, never lists.

The checks only read their arguments: a refused call has changed nothing.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.errors import InvalidInputError

__all__ = [
    "TOKEN_LIMIT",
    "check_bool",
    "check_choice",
    "check_count",
    "check_int",
    "check_slot_tensor",
    "is_int",
    "token_list",
]

#: Token ids lie in ``[0, TOKEN_LIMIT)``: storage keys pack each id into 4 bytes.
TOKEN_LIMIT = 1 << 32

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def token_list(tokens: object, what: str = "tokens") -> list[int]:
    """``tokens`` as a list of Python ints, after checking every id.

    Args:
        tokens: a list or tuple of ints, or a 1-D integer numpy array or
            torch tensor (any device).
        what: the argument's name, for the message.

    Returns:
        A new list (the caller may keep it; later changes to ``tokens`` do
        not reach it).

    Raises:
        InvalidInputError: not one of those types, a non-integer element or
            dtype, not 1-D, or an id outside ``[0, 2**32)``.
    """
    if isinstance(tokens, torch.Tensor):
        dt = tokens.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise InvalidInputError(f"{what} must be an integer tensor, got dtype {dt}")
        if tokens.dim() != 1:
            raise InvalidInputError(f"{what} must be 1-D, got shape {tuple(tokens.shape)}")
        t = tokens.detach()
        t = t.cpu() if t.device.type != "cpu" else t
        if dt not in _INT_DTYPES:  # unsigned 16/32/64-bit: as `hash_page` reads them
            t = t.long()
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= TOKEN_LIMIT):
            raise InvalidInputError(
                f"{what} must lie in [0, 2**32): min {int(t.min())}, max {int(t.max())}"
            )
        out: list[int] = t.tolist()
        return out
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} must have an integer dtype, got {tokens.dtype}")
        if tokens.ndim != 1:
            raise InvalidInputError(f"{what} must be 1-D, got shape {tokens.shape}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= TOKEN_LIMIT):
            raise InvalidInputError(
                f"{what} must lie in [0, 2**32): min {int(tokens.min())}, max {int(tokens.max())}"
            )
        return [int(t) for t in tokens.tolist()]
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Sequence):
        raise InvalidInputError(
            f"{what} must be a list or tuple of ints, or a 1-D integer tensor or array, "
            f"got {type(tokens).__name__}"
        )
    # array('I') checks type and range of every element in C, and tolist()
    # hands back plain ints (numpy integers normalised; a bool is the int it
    # equals, as everywhere in Python and in `hash_page`).
    try:
        packed = array("I", tokens)
    except OverflowError as e:
        bad = next((t for t in tokens if not 0 <= operator.index(t) < TOKEN_LIMIT), None)
        raise InvalidInputError(f"{what} must lie in [0, 2**32), got {bad!r}") from e
    except TypeError as e:
        bad = next((t for t in tokens if not is_int(t)), None)
        raise InvalidInputError(f"{what} must be ints, got {type(bad).__name__} {bad!r}") from e
    return packed.tolist()


def is_int(value: object) -> bool:
    """True for ``int`` and numpy integers; False for ``bool``, ``float`` and the rest."""
    if isinstance(value, bool | np.bool_):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_count(value: object, what: str = "num_tokens", *, multiple_of: int = 1) -> int:
    """A non-negative int (numpy integers accepted, ``bool`` and ``float`` not).

    Raises:
        InvalidInputError: anything else, or not a multiple of ``multiple_of``.
    """
    if not is_int(value):
        raise InvalidInputError(f"{what} must be a non-negative int, got {value!r}")
    n = operator.index(value)  # type: ignore[arg-type]
    if n < 0:
        raise InvalidInputError(f"{what} must be a non-negative int, got {n}")
    if n % multiple_of:
        raise InvalidInputError(f"{what}={n} is not a multiple of the page size {multiple_of}")
    return n


def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    error: type[Exception] = InvalidInputError,
) -> int:
    """An ``int`` (numpy integers accepted, ``bool`` and ``float`` not), at least ``minimum``.

    Args:
        value: the argument.
        what: its name, for the message.
        minimum: the smallest value allowed, or None for no bound.
        error: the exception to raise (``ConfigError`` for configuration fields).

    Raises:
        InvalidInputError: (or ``error``) anything else.
    """
    if not is_int(value):
        raise error(f"{what} must be an int, got {type(value).__name__} {value!r}")
    n = operator.index(value)  # type: ignore[arg-type]
    if minimum is not None and n < minimum:
        raise error(f"{what} must be >= {minimum}, got {n}")
    return n


def check_bool(value: object, what: str, *, error: type[Exception] = InvalidInputError) -> bool:
    """A real ``bool`` (``np.bool_`` accepted); ints, strings and None are refused.

    Raises:
        InvalidInputError: (or ``error``) anything else.
    """
    if not isinstance(value, bool | np.bool_):
        raise error(f"{what} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_choice(value: object, allowed: Sequence[str], what: str) -> str:
    """One of the names in ``allowed``.

    Raises:
        InvalidInputError: anything else (an unknown name is never taken for a default).
    """
    if not isinstance(value, str) or value not in allowed:
        raise InvalidInputError(f"{what} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_slot_tensor(indices: Any, what: str, num_slots: int) -> torch.Tensor:
    """A 1-D ``int64`` tensor of slot ids in ``[0, num_slots)``, returned on the CPU.

    Raises:
        InvalidInputError: a list or other non-tensor, another dtype or shape,
            or an id out of range.
    """
    if not isinstance(indices, torch.Tensor):
        raise InvalidInputError(
            f"{what} must be a 1-D int64 torch.Tensor, got {type(indices).__name__}"
        )
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise InvalidInputError(
            f"{what} must be a 1-D int64 tensor, got {indices.dtype} {tuple(indices.shape)}"
        )
    cpu = indices.detach()
    cpu = cpu.cpu() if cpu.device.type != "cpu" else cpu
    if cpu.numel() and (int(cpu.min()) < 0 or int(cpu.max()) >= num_slots):
        raise InvalidInputError(
            f"{what} out of range [0, {num_slots}): min {int(cpu.min())}, max {int(cpu.max())}"
        )
    return cpu
