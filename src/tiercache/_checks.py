"""Argument checks shared by every public verb, so that they all agree.

One input has one answer wherever it is passed: a list, a tuple, a 1-D
integer numpy array and a 1-D integer tensor of the same token ids are the
same prompt; an id outside ``[0, 2**32)`` (what a storage key can encode), or a
``bool`` (in a list as in a tensor), is an `InvalidInputError` at
`TierCache.request`, `TierCache.insert`, `TierCache.match_prefix`,
`TierCache.prefetch`, `Request.commit` and `tiercache.index.hash_page` alike.
Counts are non-negative ints, never ``bool`` or ``float``; names of policies
come from a fixed tuple; slot arguments are 1-D ``int64`` tensors, never lists.

Configuration reads the same way: sizes are positive ints (`check_positive`),
durations finite numbers (`check_number`), and every on/off option, from a
URL query, a keyword, a ``TIERCACHE_*`` variable or an engine's config, is
read by `parse_bool` with one set of words. Each check takes the exception
class its caller raises (``error=ConfigError`` for configuration).

The checks only read their arguments: a refused call has changed nothing.
"""

from __future__ import annotations

import math
import numbers
import operator
from array import array
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from tiercache.errors import ConfigError, InvalidInputError

__all__ = [
    "check_backoff",
    "check_extra_key",
    "check_index",
    "check_instance",
    "FALSE_WORDS",
    "TOKEN_LIMIT",
    "TRUE_WORDS",
    "check_bool",
    "check_choice",
    "check_count",
    "check_int",
    "check_number",
    "check_positive",
    "check_slot_tensor",
    "is_int",
    "parse_bool",
    "token_array",
    "token_list",
]

_T = TypeVar("_T")

#: Token ids lie in ``[0, TOKEN_LIMIT)``: storage keys pack each id into 4 bytes.
TOKEN_LIMIT = 1 << 32

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def token_array(tokens: object, what: str = "tokens") -> array[int] | npt.NDArray[np.integer[Any]]:
    """``tokens`` checked, as an ``array('I')`` or a 1-D integer numpy array.

    The form `tiercache.index.hash_page` packs into bytes without a Python
    loop; `token_list` turns it into Python ints.

    Args:
        tokens: a list or tuple (any sequence but ``str`` and ``bytes``) of
            ints, or a 1-D integer numpy array or torch tensor (any device; a
            CUDA tensor is copied to the host).
        what: the argument's name, for the message.

    Returns:
        An ``array('I')`` for a sequence (a new one), else a 1-D numpy array
        of an integer dtype (possibly a view of ``tokens``: read it, never write it).

    Raises:
        InvalidInputError: not one of those types, a non-integer element or
            dtype (``bool`` included: ``[True]`` is not ``[1]``), not 1-D, or
            an id outside ``[0, 2**32)``.
    """
    if isinstance(tokens, list | tuple):  # the common case first: prompts are lists
        return _sequence_ids(tokens, what)
    if isinstance(tokens, torch.Tensor):
        return _checked_ids(_tensor_numpy(tokens, what), what)
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} must have an integer dtype, got {tokens.dtype}")
        return _checked_ids(tokens, what)
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Sequence):
        raise InvalidInputError(
            f"{what} must be a list or tuple of ints, or a 1-D integer tensor or array, "
            f"got {type(tokens).__name__}"
        )
    return _sequence_ids(tokens, what)


def token_list(tokens: object, what: str = "tokens") -> list[int]:
    """``tokens`` as a list of ids, after checking every one.

    Args:
        tokens: as for `token_array`.
        what: the argument's name, for the message.

    Returns:
        A new list (the caller may keep it; later changes to ``tokens`` do
        not reach it). A list or tuple's own id objects are kept (ints, or
        numpy integers, which compare and hash as the ints they equal):
        making a new int for each of a long prompt's ids costs more than
        checking them (about 5 ms at 128k tokens, where the check in C
        costs about one).

    Raises:
        InvalidInputError: as `token_array`.
    """
    ids = token_array(tokens, what)
    if isinstance(tokens, list | tuple):
        return list(tokens)
    out: list[int] = ids.tolist()
    return out


def _tensor_numpy(tokens: torch.Tensor, what: str) -> npt.NDArray[np.integer[Any]]:
    """An integer tensor's values as a numpy array on the host (its dtype checked here)."""
    dt = tokens.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise InvalidInputError(f"{what} must be an integer tensor, got dtype {dt}")
    t = tokens.detach()
    t = t.cpu() if t.device.type != "cpu" else t
    if dt not in _INT_DTYPES:  # unsigned 16/32/64-bit: numpy cannot view them
        t = t.long()
    out: npt.NDArray[np.integer[Any]] = t.numpy()
    return out


def _checked_ids(arr: npt.NDArray[np.integer[Any]], what: str) -> npt.NDArray[np.integer[Any]]:
    """``arr`` once it is 1-D with every id in ``[0, TOKEN_LIMIT)``."""
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
        raise InvalidInputError(
            f"{what} must lie in [0, 2**32): min {int(arr.min())}, max {int(arr.max())}"
        )
    return arr


def _sequence_ids(tokens: Sequence[Any], what: str) -> array[int]:
    """A sequence of ids as ``array('I')``.

    ``array('I')`` checks the type and range of every element in C (numpy
    integers are taken). It takes a ``bool`` too, as the int it equals;
    `_refuse_bools` then refuses it, as a bool tensor or array is refused.
    """
    try:
        ids = array("I", tokens)
    except OverflowError as e:
        bad = next((t for t in tokens if not 0 <= operator.index(t) < TOKEN_LIMIT), None)
        raise InvalidInputError(f"{what} must lie in [0, 2**32), got {bad!r}") from e
    except TypeError as e:
        bad = next((t for t in tokens if not is_int(t)), None)
        raise InvalidInputError(f"{what} must be ints, got {type(bad).__name__} {bad!r}") from e
    _refuse_bools(tokens, ids, what)
    return ids


def _refuse_bools(tokens: Sequence[Any], ids: array[int], what: str) -> None:
    """Refuse ``True`` / ``False`` among ``tokens`` (``ids`` is their ``array('I')``).

    Only an element whose id is 0 or 1 can be a bool: numpy finds those in
    ``ids`` without a Python loop, and only they are looked at (a prompt has
    few), so a long prompt pays microseconds, not a pass in Python.

    Raises:
        InvalidInputError: an element is a ``bool``.
    """
    if not ids:
        return
    for i in np.flatnonzero(np.frombuffer(ids, dtype=np.uint32) <= 1).tolist():
        if isinstance(tokens[i], bool):
            raise InvalidInputError(f"{what} must be ints, got bool {tokens[i]!r} at position {i}")


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


def check_index(value: object, what: str, size: int) -> int:
    """An index into ``size`` things: an ``int`` in ``[0, size)`` (numpy integers
    accepted, ``bool`` and ``float`` not; no negative index from the end).

    Cheap for a plain in-range ``int`` (pool views call it on the copy path).

    Raises:
        InvalidInputError: anything else.
    """
    if value.__class__ is int and 0 <= value < size:
        return value
    n = check_int(value, what)
    if not 0 <= n < size:
        raise InvalidInputError(f"{what} must be in [0, {size}), got {n}")
    return n


def check_bool(value: object, what: str, *, error: type[Exception] = InvalidInputError) -> bool:
    """A real ``bool`` (``np.bool_`` accepted); ints, strings and None are refused.

    Raises:
        InvalidInputError: (or ``error``) anything else.
    """
    if not isinstance(value, bool | np.bool_):
        raise error(f"{what} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_positive(value: object, what: str, *, error: type[Exception] = InvalidInputError) -> int:
    """An ``int`` of at least 1 (numpy integers accepted, ``bool`` and ``float`` not).

    Args:
        value: the argument.
        what: its name, for the message.
        error: the exception to raise (``ConfigError`` for configuration fields).

    Raises:
        InvalidInputError: (or ``error``) anything else; the message reads
            "``what`` must be a positive int".
    """
    if not is_int(value) or operator.index(value) < 1:  # type: ignore[arg-type]
        raise error(f"{what} must be a positive int, got {value!r}")
    return operator.index(value)  # type: ignore[arg-type]


def check_number(
    value: object, what: str, *, positive: bool = False, error: type[Exception] = InvalidInputError
) -> float:
    """A finite real number at least 0 (above 0 with ``positive``), as a float.

    Ints, floats and numpy reals are accepted; ``bool``, strings, NaN and the
    infinities are not.

    Raises:
        InvalidInputError: (or ``error``) anything else.
    """
    ok = not isinstance(value, bool | np.bool_) and isinstance(value, numbers.Real)
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        kind = "positive" if positive else "non-negative"
        raise error(f"{what} must be a finite {kind} number, got {value!r}")
    return number


#: The spellings `parse_bool` reads as true and as false (compared lower-cased, stripped).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(value: object, what: str, *, error: type[Exception] = ConfigError) -> bool:
    """An on/off option, from a bool, ``0``/``1``, or a word of `TRUE_WORDS` / `FALSE_WORDS`.

    The one reader of such options, for URL query parameters, keyword
    options, ``TIERCACHE_*`` variables and engine configs alike. Words are
    compared after ``strip().lower()``.

    Args:
        value: the option's value.
        what: the option's name as its user writes it, for the message.
        error: the exception to raise.

    Raises:
        ConfigError: (or ``error``) anything else, e.g. ``"maybe"``, ``2``
            or ``None``; the message names ``what``.
    """
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if is_int(value) and operator.index(value) in (0, 1):  # type: ignore[arg-type]
        return bool(operator.index(value))  # type: ignore[arg-type]
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    raise error(f"{what} must be a bool (1/0, true/false, yes/no, on/off), got {value!r}")


def check_instance(
    value: object, cls: type[_T], what: str, *, error: type[Exception] = InvalidInputError
) -> _T:
    """``value`` once it is an instance of ``cls``.

    Raises:
        InvalidInputError: (or ``error``) anything else, named in the message,
            rather than an ``AttributeError`` wherever it is first used.
    """
    if not isinstance(value, cls):
        raise error(f"{what} must be a {cls.__name__}, got {type(value).__name__}")
    return value


def check_choice(
    value: object,
    allowed: Sequence[str],
    what: str,
    *,
    error: type[Exception] = InvalidInputError,
) -> str:
    """One of the names in ``allowed``.

    Raises:
        InvalidInputError: (or ``error``) anything else (an unknown name is
            never taken for a default).
    """
    if not isinstance(value, str) or value not in allowed:
        raise error(f"{what} must be one of {tuple(allowed)}, got {value!r}")
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
    if cpu.numel():
        # numpy's reductions: torch's start an OpenMP team on the calling thread
        # for 32k slots or more (see `tiercache.memory.allocator.copy_slots`).
        values = cpu.numpy()
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= num_slots:
            raise InvalidInputError(f"{what} out of range [0, {num_slots}): min {lo}, max {hi}")
    return cpu


def check_extra_key(extra_key: object) -> str | None:
    """``extra_key`` once it is ``None`` or a str that UTF-8 can encode.

    The key's bytes start its namespace's hash chain: a lone surrogate
    (``"\\ud800"``) has none, and is refused here rather than failing to
    encode deep inside hashing.

    Raises:
        InvalidInputError: anything else.
    """
    if extra_key is None:
        return None
    if not isinstance(extra_key, str):
        raise InvalidInputError(f"extra_key must be a str or None, got {extra_key!r}")
    try:
        extra_key.encode()
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"extra_key must be encodable as UTF-8: {e}") from None
    return extra_key


def check_backoff(first: float, most: float, first_name: str, most_name: str) -> None:
    """A reconnect backoff that grows from ``first`` seconds up to ``most``.

    Raises:
        ConfigError: ``most`` below ``first`` (every probe after the first
            would come sooner); the message names both options.
    """
    if most < first:
        raise ConfigError(
            f"{most_name}={most:g} must be at least {first_name}={first:g}: "
            "the probes back off from one up to the other"
        )
