"""`FaultyBackend`: a wrapper that makes any `StorageBackend` misbehave on purpose.

It exists to show what tiercache does when storage fails: errors, slow or
hanging calls, partial batches, wrong bytes, outages and recoveries. A
`FaultPlan` says which faults to inject, on which operations, how often, and
from which seed; the same plan and the same sequence of calls give the same
faults, so a failing run can be replayed.

What each fault kind models (`FaultKind`):

- ``ERROR``: the call raises a `StorageError` subclass (``StorageError`` by
  default; `BackendUnavailableError` for a refused connection). With
  ``after=True`` the wrapped call runs first and its effects stand: the reply
  was lost, not the request.
- ``LATENCY``: the call is delayed by a fixed or uniformly drawn time, then
  runs normally.
- ``TIMEOUT``: the call sleeps ``delay`` seconds, then raises
  `StorageTimeoutError` (a backend whose own deadline expired).
- ``HANG``: the call never answers; it ends only when the caller cancels it
  (cancellation propagates as `asyncio.CancelledError`) or when the wrapper is
  closed (`BackendUnavailableError`). No task is created, so nothing leaks.
- ``PARTIAL``: the batch is served in part. ``batch_get`` reads only some of
  the pages (a prefix, or a random subset) and reports the others as not
  arrived; the wrapped backend never sees those, so their buffers are really
  untouched. ``batch_set`` writes only some pages and reports the others as
  not stored; ``delete`` removes only some keys; ``batch_exists`` reports fewer
  pages than are stored.
- ``FLIP`` / ``TRUNCATE``: ``batch_get`` returns wrong bytes for a page and
  still reports it as arrived: bytes flipped, or only a prefix of the payload
  copied and the rest zero-filled. The page is read into a scratch buffer by
  the wrapped backend, damaged, then copied into the caller's buffer. This
  models a *broken backend*, one that does not verify what it returns (or a
  fault between its check and the caller); nothing above the backend can
  detect it, which is exactly why backends verify stored pages with
  `tiercache.storage.format`. To test that a backend's own checks catch damage
  *at rest*, use `FaultyBackend.corrupt_stored` / `FaultyBackend.truncate_stored`,
  which damage the stored bytes themselves through the wrapped backend's
  optional `RawPageAccess` methods.

Outside the plan, ``fail_all(True)`` makes every call raise
`BackendUnavailableError` until ``fail_all(False)``: an outage and its
recovery.

By URL: `FaultyBackend.from_url` opens ``faulty+<inner URL>``, e.g.
``faulty+memory://?fault=error&fault_p=0.1&fault_ops=get,set&fault_seed=7``:
the ``fault*`` options (and a ``plan=FaultPlan(...)`` keyword) build the plan,
every other option goes to the inner backend; the registry routes every
``faulty+`` scheme here, no registration needed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from tiercache._aio import finish
from tiercache._checks import check_int
from tiercache.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidInputError,
    StateError,
    StorageCorruptionError,
    StorageError,
    StorageTimeoutError,
)
from tiercache.memory.pages import PageBuffer
from tiercache.storage.base import BackendState, BackendStats, PageKey, StorageBackend
from tiercache.storage.keys import check_batch
from tiercache.storage.registry import (
    open_backend,
    option_bool,
    option_float,
    option_int,
    redact_url,
    url_options,
)

__all__ = [
    "OPERATIONS",
    "FaultEvent",
    "FaultKind",
    "FaultPlan",
    "FaultSpec",
    "FaultyBackend",
    "PartialMode",
    "RawPageAccess",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The operations a fault can target, by name.
OPERATIONS: frozenset[str] = frozenset({"exists", "get", "set", "delete", "clear"})


class FaultKind(enum.Enum):
    """What an injected fault does (see the module docstring)."""

    ERROR = "error"
    LATENCY = "latency"
    TIMEOUT = "timeout"
    HANG = "hang"
    PARTIAL = "partial"
    FLIP = "flip"
    TRUNCATE = "truncate"


class PartialMode(enum.Enum):
    """Which pages a ``PARTIAL`` fault keeps."""

    #: The first k pages, the rest dropped.
    PREFIX = "prefix"
    #: A random subset (at least one page dropped).
    RANDOM = "random"


_SUPPORTED: dict[FaultKind, frozenset[str]] = {
    FaultKind.ERROR: OPERATIONS,
    FaultKind.LATENCY: OPERATIONS,
    FaultKind.TIMEOUT: OPERATIONS,
    FaultKind.HANG: OPERATIONS,
    FaultKind.PARTIAL: frozenset({"exists", "get", "set", "delete"}),
    FaultKind.FLIP: frozenset({"get"}),
    FaultKind.TRUNCATE: frozenset({"get"}),
}

#: Deliveries of damaged pages larger than this copy in an executor, not on the loop.
_OFFLOAD_BYTES = 1 << 20

#: Kinds that end the call with an exception (or never end it).
_RAISING = frozenset({FaultKind.ERROR, FaultKind.TIMEOUT, FaultKind.HANG})
#: Kinds that change a call's result rather than end it.
_SHAPING = frozenset({FaultKind.PARTIAL, FaultKind.FLIP, FaultKind.TRUNCATE})

#: The int fields of a `FaultSpec`: (name, smallest value, whether ``None`` is allowed).
_COUNT_FIELDS: tuple[tuple[str, int, bool], ...] = (
    ("after_calls", 0, False),
    ("max_faults", 0, True),
    ("keep_pages", 0, True),
    ("pages", 1, True),
    ("flip_bytes", 1, False),
    ("keep_bytes", 0, True),
)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _targeted_ops(kind: FaultKind, ops: Collection[str] | None) -> frozenset[str]:
    """The operations a spec of ``kind`` targets: ``ops`` checked, or all it supports."""
    supported = _SUPPORTED[kind]
    if ops is None:
        return supported
    if isinstance(ops, str):
        raise ConfigError(f"ops must be a collection of operation names, not the string {ops!r}")
    chosen = frozenset(ops)
    if not chosen:
        raise ConfigError("a fault spec must target at least one operation")
    unknown = chosen - OPERATIONS
    if unknown:
        raise ConfigError(f"unknown operations {sorted(unknown)}; choose from {sorted(OPERATIONS)}")
    unsupported = chosen - supported
    if unsupported:
        raise ConfigError(f"a {kind.value} fault cannot apply to {sorted(unsupported)}")
    return chosen


def _check_delay(delay: object) -> None:
    """A delay is a number >= 0 or a ``(low, high)`` range with ``0 <= low <= high``."""
    if isinstance(delay, tuple):
        if len(delay) != 2 or not all(_is_number(x) for x in delay):
            raise ConfigError(f"a delay range is a (low, high) pair of numbers, got {delay!r}")
        lo, hi = delay
        if not 0.0 <= lo <= hi:
            raise ConfigError(f"delay range must satisfy 0 <= low <= high, got {delay}")
    elif not (_is_number(delay) and delay >= 0):  # type: ignore[operator]
        raise ConfigError(f"delay must be >= 0, got {delay!r}")


@dataclass(frozen=True)
class FaultSpec:
    """One rule of a `FaultPlan`: which fault, on which operations, how often.

    A call to an operation the spec targets is a *matching call*. The first
    ``after_calls`` matching calls are left alone; each later one faults with
    ``probability`` until ``max_faults`` faults were injected by this spec.
    "Fail the 3rd call only" is ``after_calls=2, max_faults=1``; "fail the
    first N" is ``max_faults=N``.

    Attributes:
        kind: what the fault does.
        ops: the operations targeted (names from `OPERATIONS`); ``None`` means
            every operation the kind supports. ``PARTIAL`` supports ``exists``,
            ``get``, ``set``, ``delete``; ``FLIP`` and ``TRUNCATE`` only ``get``.
        probability: chance, in [0, 1], that a matching call faults.
        after_calls: matching calls to let through before any fault.
        max_faults: most faults this spec injects (``None``: no limit).
        error: the exception class an ``ERROR`` fault raises (a `StorageError`
            subclass).
        after: for ``ERROR`` and ``TIMEOUT``, run the wrapped call first and
            raise after it (its effects stand: a lost reply).
        delay: seconds for ``LATENCY`` and ``TIMEOUT``: a number, or a
            ``(low, high)`` range drawn uniformly.
        partial: which pages a ``PARTIAL`` fault keeps.
        keep_pages: for a ``PREFIX`` partial fault, how many pages to keep
            (capped so that at least one page is dropped); ``None`` draws it.
        pages: how many of the arrived pages a ``FLIP``/``TRUNCATE`` fault
            damages (``None``: all of them).
        flip_bytes: how many distinct bytes a ``FLIP`` fault changes per page.
        keep_bytes: how many payload bytes a ``TRUNCATE`` fault keeps (capped
            below the page size); ``None`` draws it.

    Raises:
        ConfigError: a value out of range, or an operation the kind does not
            support.
    """

    kind: FaultKind
    ops: Collection[str] | None = None
    probability: float = 1.0
    after_calls: int = 0
    max_faults: int | None = None
    error: type[StorageError] = StorageError
    after: bool = False
    delay: float | tuple[float, float] = 0.0
    partial: PartialMode = PartialMode.PREFIX
    keep_pages: int | None = None
    pages: int | None = 1
    flip_bytes: int = 1
    keep_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = FaultKind(self.kind)
            partial = PartialMode(self.partial)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "partial", partial)
        object.__setattr__(self, "ops", _targeted_ops(kind, self.ops))
        if not (_is_number(self.probability) and 0.0 <= self.probability <= 1.0):
            raise ConfigError(f"probability must be in [0, 1], got {self.probability!r}")
        for name, minimum, optional in _COUNT_FIELDS:
            value = getattr(self, name)
            if not (optional and value is None):
                check_int(value, name, minimum=minimum, error=ConfigError)
        if not (isinstance(self.error, type) and issubclass(self.error, StorageError)):
            raise ConfigError(f"error must be a StorageError subclass, got {self.error!r}")
        if self.after and kind not in (FaultKind.ERROR, FaultKind.TIMEOUT):
            raise ConfigError("after=True applies only to error and timeout faults")
        _check_delay(self.delay)

    def targets(self, op: str) -> bool:
        """Whether this spec applies to operation ``op``."""
        assert isinstance(self.ops, frozenset)
        return op in self.ops


@dataclass(frozen=True)
class FaultPlan:
    """The faults to inject, in order, and the seed that makes them reproducible.

    On each call the specs targeting the operation are consulted in order: a
    ``LATENCY`` fault sleeps and the next spec is consulted; an ``ERROR``,
    ``TIMEOUT`` or ``HANG`` fault ends the consultation (later specs are not
    consulted for this call); ``PARTIAL``, ``FLIP`` and ``TRUNCATE`` faults
    shape the result, in plan order.

    Attributes:
        specs: the rules.
        seed: seed of the wrapper's private random generator (``None``: drawn
            from the OS, not reproducible).
    """

    specs: Sequence[FaultSpec] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        specs = tuple(self.specs)
        for s in specs:
            if not isinstance(s, FaultSpec):
                raise ConfigError(f"a fault plan holds FaultSpec values, got {s!r}")
        object.__setattr__(self, "specs", specs)

    @classmethod
    def of(cls, *specs: FaultSpec, seed: int | None = None) -> FaultPlan:
        """``FaultPlan.of(spec1, spec2, seed=7)``."""
        return cls(specs, seed)


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One injected fault, as recorded in `FaultyBackend.events`.

    Attributes:
        call: the wrapper's call number (0-based, over all operations).
        op: the operation.
        kind: the fault kind, or ``"outage"`` for a ``fail_all`` refusal.
        detail: what was done (pages kept, bytes flipped, delay, ...).
    """

    call: int
    op: str
    kind: str
    detail: str = ""


@runtime_checkable
class RawPageAccess(Protocol):
    """Optional raw access a backend may offer, so stored bytes can be damaged.

    ``read_raw`` returns exactly what the backend keeps for ``key`` (for the
    file and redis backends: header and payload), or ``None`` when the key is
    not stored; ``write_raw`` replaces it verbatim, with no checks.
    """

    async def read_raw(self, key: PageKey) -> bytes | None: ...

    async def write_raw(self, key: PageKey, data: bytes) -> None: ...


@dataclass(slots=True)
class _SpecState:
    spec: FaultSpec
    calls: int = 0
    faults: int = 0


@dataclass(slots=True)
class _Decision:
    """The faults drawn for one call, before the wrapped backend is called."""

    call: int
    op: str
    delays: list[tuple[_SpecState, float]] = field(default_factory=list)
    raising: _SpecState | None = None
    raise_delay: float = 0.0
    shaping: list[_SpecState] = field(default_factory=list)
    # A generator private to this call, so results shaped after an await do not
    # depend on how concurrent calls interleave.
    rng: random.Random | None = None


#: The exceptions a ``fault_error`` URL option may name.
_URL_ERRORS: dict[str, type[StorageError]] = {
    c.__name__: c
    for c in (StorageError, BackendUnavailableError, StorageTimeoutError, StorageCorruptionError)
}


def _url_as_is(name: str, value: Any) -> Any:
    return value


def _url_probability(name: str, value: Any) -> float:
    return option_float(name, value, minimum=0.0)


def _url_ops(name: str, value: Any) -> Any:
    """``"get,set"`` -> ``["get", "set"]``; a collection passes as is."""
    return [o.strip() for o in value.split(",")] if isinstance(value, str) else value


def _url_delay(name: str, value: Any) -> float | tuple[float, float]:
    """``"0.1"`` -> ``0.1``; ``"0.1,0.2"`` -> ``(0.1, 0.2)``; a tuple passes as is."""
    if isinstance(value, str) and "," in value:
        lo, _, hi = value.partition(",")
        return option_float(name, lo), option_float(name, hi)
    if isinstance(value, tuple):
        return value
    return option_float(name, value)


def _url_error(name: str, value: Any) -> Any:
    """An exception class by name (from `_URL_ERRORS`); a class passes as is."""
    if not isinstance(value, str):
        return value
    if value not in _URL_ERRORS:
        raise ConfigError(f"{name} must be one of {sorted(_URL_ERRORS)}, got {value!r}")
    return _URL_ERRORS[value]


#: URL option -> (the `FaultSpec` field it sets, its parser(option name, value)).
_URL_SPEC_OPTIONS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "fault": ("kind", _url_as_is),
    "fault_p": ("probability", _url_probability),
    "fault_ops": ("ops", _url_ops),
    "fault_after_calls": ("after_calls", option_int),
    "fault_max": ("max_faults", option_int),
    "fault_delay": ("delay", _url_delay),
    "fault_error": ("error", _url_error),
    "fault_partial": ("partial", _url_as_is),
}
#: Every option `FaultyBackend.from_url` keeps for itself.
_URL_FAULT_OPTIONS = frozenset({"plan", "fault_seed", "fault_enabled", *_URL_SPEC_OPTIONS})


def _take_fault_options(options: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the ``plan`` and ``fault*`` options; the rest is the inner backend's.

    Raises:
        ConfigError: a ``fault*`` option this wrapper does not know.
    """
    taken = {k: options.pop(k) for k in list(options) if k == "plan" or k.startswith("fault")}
    unknown = sorted(set(taken) - _URL_FAULT_OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown fault option(s) {unknown} (known: {sorted(_URL_FAULT_OPTIONS)})"
        )
    return taken


def _plan_from_options(options: dict[str, Any], url: str) -> FaultPlan:
    """The plan a URL's fault options describe: ``plan=`` alone, or one spec from ``fault*``.

    Raises:
        ConfigError: both or neither given, a ``plan`` that is not a `FaultPlan`,
            or a bad option value.
    """
    plan = options.pop("plan", None)
    if plan is not None:
        if options:
            raise ConfigError(f"give either plan= or fault options, not both: {sorted(options)}")
        if not isinstance(plan, FaultPlan):
            raise ConfigError(f"plan must be a FaultPlan, got {type(plan).__name__}")
        return plan
    if "fault" not in options:
        raise ConfigError(
            f"{redact_url(url)!r}: say which fault to inject (fault=error, latency, ...)"
        )
    spec_args = {
        field_name: parse(name, options[name])
        for name, (field_name, parse) in _URL_SPEC_OPTIONS.items()
        if name in options
    }
    seed = options.get("fault_seed")
    return FaultPlan(
        (FaultSpec(**spec_args),),
        seed=None if seed in (None, "") else option_int("fault_seed", seed),
    )


class FaultyBackend(StorageBackend):
    """A `StorageBackend` that forwards to another and injects faults on the way.

    Counters of injected faults, by kind (and ``"outage"``), are in
    `injected` and in ``stats().extra`` under ``"faults.<kind>"``. The most
    recent events are in `events`.

    All methods run on the event loop that owns the wrapped backend; the
    control methods (`enable`, `disable`, `set_plan`, `fail_all`) are plain
    synchronous calls and take effect on the next call.

    Args:
        inner: the backend to wrap.
        plan: the faults to inject (default: none).
        close_inner: whether `aclose` also closes ``inner``.
        enabled: whether the plan is active from the start.
        history: how many `FaultEvent` values to keep.
        sleep: the coroutine function that waits for ``LATENCY`` and
            ``TIMEOUT`` faults (default `asyncio.sleep`; tests pass a
            recording one).
    """

    name = "faulty"

    def __init__(
        self,
        inner: StorageBackend,
        plan: FaultPlan | None = None,
        *,
        close_inner: bool = True,
        enabled: bool = True,
        history: int = 1024,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__()
        if not isinstance(inner, StorageBackend):
            raise InvalidInputError(
                f"FaultyBackend wraps a StorageBackend, got {type(inner).__name__}"
            )
        self.inner = inner
        self.close_inner = close_inner
        self._enabled = enabled
        self._down = False
        self._calls = 0
        self._counts: dict[str, int] = {k.value: 0 for k in FaultKind}
        self._counts["outage"] = 0
        self._pages_dropped = 0
        self._pages_damaged = 0
        self._raised = 0
        self._hangs: set[asyncio.Future[None]] = set()
        self._sleep = sleep
        self.events: deque[FaultEvent] = deque(maxlen=history)
        self.set_plan(plan if plan is not None else FaultPlan())

    @classmethod
    async def wrap(
        cls,
        inner: StorageBackend,
        plan: FaultPlan | None = None,
        *,
        close_inner: bool = True,
        enabled: bool = True,
    ) -> FaultyBackend:
        """Wrap an open backend (the form a registry entry calls).

        Raises:
            BackendUnavailableError: ``inner`` is closed.
        """
        if inner.state is BackendState.CLOSED:
            raise BackendUnavailableError(f"cannot wrap the {inner.name} backend: it is closed")
        return cls(inner, plan, close_inner=close_inner, enabled=enabled)

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> FaultyBackend:
        """Open ``faulty+<inner URL>``: the inner backend, wrapped.

        Plan options (query parameters or keywords): ``fault`` (a `FaultKind`
        value; required unless ``plan`` is given), ``fault_p`` (probability),
        ``fault_ops`` (comma-separated operations), ``fault_after_calls``,
        ``fault_max`` (max faults), ``fault_delay`` (seconds, or ``"low,high"``),
        ``fault_error`` (``StorageError``, ``BackendUnavailableError``,
        ``StorageTimeoutError`` or ``StorageCorruptionError``), ``fault_partial``
        (``prefix`` / ``random``), ``fault_seed``, ``fault_enabled``; or
        ``plan=FaultPlan(...)`` as a keyword, alone. The other options go to
        the inner backend's URL factory. The wrapper closes the inner backend.

        Raises:
            ConfigError: not a ``faulty+`` URL, unknown or bad fault options.
            BackendNotFoundError: the inner URL names no backend.
        """
        head, plus, inner_url = url.partition("+")
        if head.lower() != cls.name or not plus or not inner_url:
            raise ConfigError(
                f"a faulty backend URL is 'faulty+<inner URL>', got {redact_url(url)!r}"
            )
        inner_base, merged = url_options(inner_url, options)
        fault_options = _take_fault_options(merged)
        enabled = option_bool("fault_enabled", fault_options.pop("fault_enabled", True))
        plan = _plan_from_options(fault_options, url)
        inner = await open_backend(inner_base, **merged)
        return cls(inner, plan, close_inner=True, enabled=enabled)

    # -- control ---------------------------------------------------------

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        """Start injecting the plan's faults."""
        self._enabled = True

    def disable(self) -> None:
        """Stop injecting the plan's faults (an outage set by `fail_all` stays)."""
        self._enabled = False

    def set_plan(self, plan: FaultPlan) -> None:
        """Replace the plan; restarts the spec call counts and the random generator from ``plan.seed``.

        The injected-fault counters are kept.
        """
        if not isinstance(plan, FaultPlan):
            raise InvalidInputError(f"expected a FaultPlan, got {type(plan).__name__}")
        self._plan = plan
        self._states = [_SpecState(s) for s in plan.specs]
        self._rng = random.Random(plan.seed)

    def fail_all(self, down: bool = True) -> None:
        """Simulate an outage: while ``down``, every call raises `BackendUnavailableError`.

        Independent of `enable` / `disable`. Calls hanging at the time keep
        hanging.
        """
        if down != self._down:
            logger.info("%s backend outage %s", self.inner.name, "begins" if down else "ends")
        self._down = down

    @property
    def down(self) -> bool:
        return self._down

    @property
    def injected(self) -> dict[str, int]:
        """Faults injected so far, by kind value and ``"outage"`` (a copy)."""
        return dict(self._counts)

    @property
    def total_injected(self) -> int:
        return sum(self._counts.values())

    # -- the StorageBackend interface -----------------------------------------

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        keys = check_batch(keys)  # as every backend, before anything else (a fault included)
        d = await self._before("exists")
        n = await self._forward(d, d.shaping, self.inner.batch_exists(keys))
        for st in d.shaping:
            assert d.rng is not None
            if n == 0:
                st.faults -= 1
                continue
            kept = self._prefix_len(st.spec, n, d.rng)
            self._record(st, d, f"reported {kept} of {n}")
            self._pages_dropped += n - kept
            n = kept
        await self._after(d)
        return n

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        keys = check_batch(keys, pages, targets=True)
        d = await self._before("get")
        partial = [st for st in d.shaping if st.spec.kind is FaultKind.PARTIAL]
        damage = [st for st in d.shaping if st.spec.kind is not FaultKind.PARTIAL]
        idx = self._thin(d, partial, list(range(len(keys))), "kept", "pages")
        sub_keys = [keys[i] for i in idx]
        if damage:
            # Read into scratch buffers so damaged bytes reach the caller only
            # through an ordinary copy, as a broken backend would deliver them.
            targets = [PageBuffer.allocate(pages[i].nbytes, pages[i].format) for i in idx]
        else:
            targets = [pages[i] for i in idx]
        got = await self._forward(d, damage, self.inner.batch_get(sub_keys, targets)) if idx else []
        if damage:
            assert d.rng is not None
            self._damage(d, damage, targets, got, idx)
            copies = [(t, pages[i]) for i, t, ok in zip(idx, targets, got, strict=True) if ok]
            if sum(t.nbytes for t, _ in copies) > _OFFLOAD_BYTES:
                await finish(asyncio.get_running_loop().run_in_executor(None, _deliver, copies))
            else:
                _deliver(copies)
        out = [False] * len(keys)
        for i, ok in zip(idx, got, strict=True):
            out[i] = ok
        await self._after(d)
        return out

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        keys = check_batch(keys, pages)
        d = await self._before("set")
        idx = self._thin(d, d.shaping, list(range(len(keys))), "wrote", "pages")
        if len(idx) == len(keys):
            out = await self._forward(d, [], self.inner.batch_set(keys, pages))
        else:
            out = [False] * len(keys)
            if idx:
                got = await self._forward(
                    d, [], self.inner.batch_set([keys[i] for i in idx], [pages[i] for i in idx])
                )
                for i, ok in zip(idx, got, strict=True):
                    out[i] = ok
        await self._after(d)
        return out

    async def delete(self, keys: Sequence[PageKey]) -> int:
        keys = check_batch(keys)
        d = await self._before("delete")
        sub = self._thin(d, d.shaping, keys, "deleted", "keys")
        n = await self._forward(d, [], self.inner.delete(sub)) if sub else 0
        await self._after(d)
        return n

    def _thin(
        self, d: _Decision, specs: list[_SpecState], items: list[_T], verb: str, unit: str
    ) -> list[_T]:
        """Apply each ``PARTIAL`` spec of ``specs`` in turn: keep a subset of ``items``.

        A spec that finds nothing left to drop gives its fault back.
        """
        for st in specs:
            assert d.rng is not None
            if not items:
                st.faults -= 1
                continue
            kept = self._subset(st.spec, len(items), d.rng)
            self._record(st, d, f"{verb} {len(kept)} of {len(items)} {unit}")
            self._pages_dropped += len(items) - len(kept)
            items = [items[i] for i in kept]
        return items

    async def clear(self) -> None:
        d = await self._before("clear")
        await self._forward(d, [], self.inner.clear())
        await self._after(d)

    async def stats(self) -> BackendStats:
        """The wrapped backend's counters, plus the injected faults.

        ``errors`` adds the calls this wrapper failed on purpose; ``extra``
        gains ``faults.<kind>``, ``faults.outage``, ``faults.total``,
        ``faults.pages_dropped`` (pages left out by partial faults) and
        ``faults.pages_damaged`` (pages returned flipped or truncated).
        """
        s = await self.inner.stats()
        s.errors += self._raised
        for k, v in self._counts.items():
            s.extra[f"faults.{k}"] = v
        s.extra["faults.total"] = self.total_injected
        s.extra["faults.pages_dropped"] = self._pages_dropped
        s.extra["faults.pages_damaged"] = self._pages_damaged
        return s

    async def aclose(self) -> None:
        """Close the wrapper (and ``inner`` when ``close_inner``); hanging calls
        end with `BackendUnavailableError`. Idempotent."""
        if self.state is BackendState.CLOSED:
            return
        self.state = BackendState.CLOSED
        for fut in list(self._hangs):
            if not fut.done():
                fut.set_exception(BackendUnavailableError(f"the {self.name} backend was closed"))
        self._hangs.clear()
        if self.close_inner:
            await self.inner.aclose()

    # -- damage at rest --------------------------------------------------------

    async def corrupt_stored(
        self, key: PageKey, *, offset: int | None = None, count: int = 1
    ) -> bool:
        """Flip ``count`` bytes of what the wrapped backend stores for ``key``.

        The damage is at rest: the backend's own checks (header, checksums)
        must catch it on the next read. Needs the wrapped backend to offer
        `RawPageAccess`. ``offset`` is the first byte to flip (negative counts
        from the end; default: drawn from the plan's generator); bytes flipped
        are consecutive and wrap around.

        Returns:
            Whether the key was stored (and is now damaged).

        Raises:
            StateError: the wrapped backend has no raw access.
            InvalidInputError: ``count`` < 1 or ``offset`` out of range.
        """
        raw_io = self._raw_io()
        count = check_int(count, "count", minimum=1)
        if offset is not None:
            offset = check_int(offset, "offset")
        raw = await raw_io.read_raw(key)
        if raw is None:
            return False
        data = bytearray(raw)
        if not data:
            raise InvalidInputError(f"the stored value of {key} is empty; nothing to flip")
        if offset is None:
            offset = self._rng.randrange(len(data))
        if not -len(data) <= offset < len(data):
            raise InvalidInputError(f"offset {offset} outside the {len(data)} stored bytes")
        for j in range(count):
            data[(offset + j) % len(data)] ^= 0xFF
        await raw_io.write_raw(key, bytes(data))
        logger.debug("flipped %d stored bytes of %s at %d", count, key, offset)
        return True

    async def truncate_stored(self, key: PageKey, length: int | None = None) -> bool:
        """Cut what the wrapped backend stores for ``key`` to ``length`` bytes.

        Models a torn write at rest. ``length`` defaults to a draw below the
        stored size. Needs `RawPageAccess` on the wrapped backend.

        Returns:
            Whether the key was stored (and is now truncated).

        Raises:
            StateError: the wrapped backend has no raw access.
            InvalidInputError: ``length`` negative or not below the stored size.
        """
        raw_io = self._raw_io()
        if length is not None:
            length = check_int(length, "length")
        raw = await raw_io.read_raw(key)
        if raw is None:
            return False
        if length is None:
            length = self._rng.randrange(len(raw)) if raw else 0
        if not 0 <= length < max(len(raw), 1):
            raise InvalidInputError(f"length {length} must be in [0, {len(raw)})")
        await raw_io.write_raw(key, raw[:length])
        logger.debug("truncated stored %s to %d of %d bytes", key, length, len(raw))
        return True

    # -- internals -------------------------------------------------------

    def _raw_io(self) -> RawPageAccess:
        self._check_open()
        if not isinstance(self.inner, RawPageAccess):
            raise StateError(
                f"the {self.inner.name} backend offers no raw access (read_raw / write_raw); "
                "damage at rest needs it"
            )
        return self.inner

    async def _before(self, op: str) -> _Decision:
        """Draw this call's faults; sleep, raise or hang as they say."""
        d = self._start_call(op)
        if self._enabled:
            self._draw(d)
        # Every draw for this call is made above, before the first await, so
        # concurrent calls cannot change one another's faults.
        for st, delay in d.delays:
            self._record(st, d, f"delayed {delay:.3f}s")
            await self._sleep(delay)
        if d.raising is not None and not d.raising.spec.after:
            await self._raise(d.raising, d)
        return d

    def _start_call(self, op: str) -> _Decision:
        """Number the call; refuse it during an outage (`fail_all`)."""
        self._check_open()
        call = self._calls
        self._calls += 1
        if self._down:
            self._counts["outage"] += 1
            self._raised += 1
            self.events.append(FaultEvent(call, op, "outage"))
            raise BackendUnavailableError(
                f"the {self.inner.name} backend is down (simulated outage)"
            )
        return _Decision(call, op)

    def _draw(self, d: _Decision) -> None:
        """Consult the specs in plan order and file each fault that fires into ``d``.

        A raising fault (``ERROR``, ``TIMEOUT``, ``HANG``) ends the consultation.
        """
        for st in self._states:
            if not self._fires(st, d.op):
                continue
            # Reserve the fault now, so concurrent calls cannot overrun max_faults;
            # a result-shaping fault that finds nothing to shape gives it back.
            st.faults += 1
            kind = st.spec.kind
            if kind is FaultKind.LATENCY:
                d.delays.append((st, self._draw_delay(st.spec)))
            elif kind in _RAISING:
                d.raising = st
                if kind is FaultKind.TIMEOUT:
                    d.raise_delay = self._draw_delay(st.spec)
                return
            else:
                assert kind in _SHAPING
                if d.rng is None:
                    d.rng = random.Random(self._rng.getrandbits(64))
                d.shaping.append(st)

    def _fires(self, st: _SpecState, op: str) -> bool:
        """Count a matching call against ``st`` and draw whether it faults."""
        spec = st.spec
        if not spec.targets(op):
            return False
        st.calls += 1
        if st.calls <= spec.after_calls:
            return False
        if spec.max_faults is not None and st.faults >= spec.max_faults:
            return False
        # Draw even at probability 1 or 0 so that a plan's other specs see
        # the same sequence whatever the probabilities.
        return self._rng.random() < spec.probability

    async def _forward(self, d: _Decision, pending: list[_SpecState], call: Awaitable[_T]) -> _T:
        """Await the wrapped backend; if it fails, give back the faults reserved
        for this call that will now never be injected."""
        try:
            return await call
        except BaseException:
            for st in pending:
                st.faults -= 1
            if d.raising is not None:
                d.raising.faults -= 1
            raise

    async def _after(self, d: _Decision) -> None:
        st = d.raising
        if st is not None:
            assert st.spec.after
            await self._raise(st, d)

    async def _raise(self, st: _SpecState, d: _Decision) -> None:
        spec = st.spec
        where = "after" if spec.after else "before"
        if spec.kind is FaultKind.ERROR:
            self._record(st, d, f"{spec.error.__name__} {where} the call")
            self._raised += 1
            raise spec.error(f"injected fault: {d.op} on the {self.inner.name} backend failed")
        if spec.kind is FaultKind.TIMEOUT:
            delay = d.raise_delay
            self._record(st, d, f"timed out after {delay:.3f}s {where} the call")
            self._raised += 1
            await self._sleep(delay)
            raise StorageTimeoutError(
                f"injected fault: {d.op} on the {self.inner.name} backend timed out"
            )
        assert spec.kind is FaultKind.HANG
        self._record(st, d, "hung")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hangs.add(fut)
        try:
            await fut
        finally:
            self._hangs.discard(fut)
        # Only closing the wrapper resolves a hang, and it does so with an exception.
        raise AssertionError("unreachable: a hang ended without an exception")

    def _draw_delay(self, spec: FaultSpec) -> float:
        if isinstance(spec.delay, tuple):
            return self._rng.uniform(*spec.delay)
        return float(spec.delay)

    def _record(self, st: _SpecState, d: _Decision, detail: str) -> None:
        kind = st.spec.kind.value
        self._counts[kind] += 1
        self.events.append(FaultEvent(d.call, d.op, kind, detail))
        logger.debug("injected %s fault on %s (call %d): %s", kind, d.op, d.call, detail)

    @staticmethod
    def _prefix_len(spec: FaultSpec, n: int, rng: random.Random) -> int:
        """A prefix length in [0, n) (n > 0)."""
        if spec.keep_pages is not None:
            return min(spec.keep_pages, n - 1)
        return rng.randrange(n)

    def _subset(self, spec: FaultSpec, n: int, rng: random.Random) -> list[int]:
        """Positions kept by a partial fault over ``n`` > 0 items: never all of them."""
        if spec.partial is PartialMode.PREFIX:
            return list(range(self._prefix_len(spec, n, rng)))
        kept = [i for i in range(n) if rng.random() < 0.5]
        if len(kept) == n:
            kept.pop(rng.randrange(n))
        return kept

    def _damage(
        self,
        d: _Decision,
        damage: list[_SpecState],
        targets: list[PageBuffer],
        got: list[bool],
        labels: list[int],
    ) -> None:
        """Flip or truncate bytes of arrived scratch pages, as the specs say."""
        rng = d.rng
        assert rng is not None
        arrived = [i for i, ok in enumerate(got) if ok and targets[i].nbytes > 0]
        for st in damage:
            if not arrived:
                st.faults -= 1
                continue
            spec = st.spec
            n = len(arrived) if spec.pages is None else min(spec.pages, len(arrived))
            chosen = sorted(rng.sample(arrived, n))
            details = []
            for i in chosen:
                buf = targets[i].segments[0]
                size = buf.nbytes
                if spec.kind is FaultKind.FLIP:
                    positions = rng.sample(range(size), min(spec.flip_bytes, size))
                    for p in positions:
                        buf[p] ^= rng.randrange(1, 256)
                    details.append(f"page {labels[i]}: {len(positions)} bytes flipped")
                else:
                    keep = (
                        min(spec.keep_bytes, size - 1)
                        if spec.keep_bytes is not None
                        else rng.randrange(size)
                    )
                    buf[keep:] = bytes(size - keep)
                    details.append(f"page {labels[i]}: cut to {keep} of {size} bytes")
            self._pages_damaged += n
            self._record(st, d, "; ".join(details))


def _deliver(copies: list[tuple[PageBuffer, PageBuffer]]) -> None:
    """Copy scratch pages into the caller's pages (any thread)."""
    for src, dst in copies:
        dst.write(src.segments[0])
