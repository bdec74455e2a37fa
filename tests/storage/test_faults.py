"""FaultyBackend: every fault kind on every operation it targets, reproducibility,
counters, outage and recovery, cancellation of hanging calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

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
from tiercache.storage.base import BackendState, PageKey, StorageBackend
from tiercache.storage.faults import (
    FaultKind,
    FaultPlan,
    FaultSpec,
    FaultyBackend,
    PartialMode,
    RawPageAccess,
)
from tiercache.storage.format import pack_page, unpack_page

FMT = "test-page-v1"
PAGE = 64


class DictBackend(StorageBackend):
    """A dict of packed pages that verifies what it reads, records what it is asked,
    and offers raw access (a stand-in for a real backend)."""

    name = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}
        self.seen: list[tuple[str, list[str]]] = []

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        self.seen.append(("exists", list(keys)))
        self._stats.exists_calls += 1
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        self._check_open()
        self.seen.append(("get", list(keys)))
        out = []
        for k, p in zip(keys, pages, strict=True):
            blob = self.data.get(k)
            ok = False
            if blob is not None:
                try:
                    unpack_page(k, blob, p)
                    ok = True
                except StorageCorruptionError:
                    self._stats.corrupt_pages += 1
                    del self.data[k]
            out.append(ok)
        return out

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        self._check_open()
        self.seen.append(("set", list(keys)))
        for k, p in zip(keys, pages, strict=True):
            if k not in self.data:
                self.data[k] = b"".join(bytes(s) for s in pack_page(k, p))
        return [True] * len(keys)

    async def delete(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        self.seen.append(("delete", list(keys)))
        return sum(self.data.pop(k, None) is not None for k in keys)

    async def clear(self) -> None:
        self._check_open()
        self.seen.append(("clear", []))
        self.data.clear()

    async def read_raw(self, key: PageKey) -> bytes | None:
        return self.data.get(key)

    async def write_raw(self, key: PageKey, data: bytes) -> None:
        self.data[key] = data


class NoRawBackend(DictBackend):
    """Same, without raw access."""

    read_raw = None  # type: ignore[assignment]
    write_raw = None  # type: ignore[assignment]


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


def key(i: int) -> PageKey:
    return PageKey(f"ns-{i:04d}")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j * 13 + 1) % 251 + 1 for j in range(PAGE))  # never zero


def page(i: int) -> PageBuffer:
    return PageBuffer.from_bytes(payload(i), FMT)


def sentinel() -> PageBuffer:
    return PageBuffer.from_bytes(b"\xaa" * PAGE, FMT)


def make(
    *specs: FaultSpec, seed: int | None = 1, **kw: object
) -> tuple[FaultyBackend, DictBackend]:
    inner = DictBackend()
    return FaultyBackend(inner, FaultPlan(specs, seed=seed), **kw), inner  # type: ignore[arg-type]


async def fill(inner: DictBackend, n: int) -> list[PageKey]:
    keys = [key(i) for i in range(n)]
    await inner.batch_set(keys, [page(i) for i in range(n)])
    inner.seen.clear()
    return keys


async def call(b: StorageBackend, op: str, keys: list[PageKey]) -> object:
    if op == "exists":
        return await b.batch_exists(keys)
    if op == "get":
        return await b.batch_get(keys, [sentinel() for _ in keys])
    if op == "set":
        return await b.batch_set(keys, [page(int(k[3:])) for k in keys])
    if op == "delete":
        return await b.delete(keys)
    assert op == "clear"
    await b.clear()
    return None


ALL_OPS = ["exists", "get", "set", "delete", "clear"]


# -- the plan ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": FaultKind.ERROR, "probability": 1.5},
        {"kind": FaultKind.ERROR, "probability": -0.1},
        {"kind": FaultKind.ERROR, "ops": {"read"}},
        {"kind": FaultKind.ERROR, "ops": "get"},
        {"kind": FaultKind.ERROR, "ops": set()},
        {"kind": FaultKind.PARTIAL, "ops": {"clear"}},
        {"kind": FaultKind.FLIP, "ops": {"set"}},
        {"kind": FaultKind.ERROR, "error": ValueError},
        {"kind": FaultKind.LATENCY, "after": True},
        {"kind": FaultKind.LATENCY, "delay": -1.0},
        {"kind": FaultKind.LATENCY, "delay": (0.2, 0.1)},
        {"kind": FaultKind.ERROR, "after_calls": -1},
        {"kind": FaultKind.ERROR, "max_faults": -1},
        {"kind": FaultKind.FLIP, "flip_bytes": 0},
        {"kind": FaultKind.FLIP, "pages": 0},
        {"kind": "no-such-kind"},
        # Wrong types are refused as configuration errors, not raw TypeErrors.
        {"kind": FaultKind.ERROR, "after_calls": "3"},
        {"kind": FaultKind.ERROR, "max_faults": True},
        {"kind": FaultKind.ERROR, "probability": "1"},
        {"kind": FaultKind.LATENCY, "delay": "0.1"},
        {"kind": FaultKind.LATENCY, "delay": (0.1,)},
        {"kind": FaultKind.TRUNCATE, "keep_bytes": 1.5},
    ],
)
def test_bad_spec_is_a_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        FaultSpec(**kwargs)  # type: ignore[arg-type]


def test_spec_defaults_to_every_supported_operation() -> None:
    assert FaultSpec(FaultKind.ERROR).ops == frozenset(ALL_OPS)
    assert FaultSpec(FaultKind.PARTIAL).ops == frozenset({"exists", "get", "set", "delete"})
    assert FaultSpec(FaultKind.TRUNCATE).ops == frozenset({"get"})
    assert FaultSpec("hang").kind is FaultKind.HANG  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        FaultPlan(("not a spec",))  # type: ignore[arg-type]


def test_wrapping_something_else_is_rejected() -> None:
    with pytest.raises(InvalidInputError):
        FaultyBackend(object())  # type: ignore[arg-type]


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize("op", ALL_OPS)
async def test_error_on_each_operation_raises_before_the_call(op: str) -> None:
    others = [o for o in ALL_OPS if o != op]
    fb, inner = make(FaultSpec(FaultKind.ERROR, ops={op}))
    keys = await fill(inner, 3)
    with pytest.raises(StorageError) as ei:
        await call(fb, op, keys)
    assert type(ei.value) is StorageError
    assert inner.seen == []  # the wrapped backend was never asked
    for o in others:
        if o != "clear":
            await call(fb, o, keys)  # other operations pass
    assert fb.injected["error"] == 1


@pytest.mark.parametrize("op", ALL_OPS)
async def test_error_class_is_configurable(op: str) -> None:
    fb, inner = make(FaultSpec(FaultKind.ERROR, ops={op}, error=BackendUnavailableError))
    keys = await fill(inner, 2)
    with pytest.raises(BackendUnavailableError):
        await call(fb, op, keys)


async def test_error_after_the_call_models_a_lost_reply() -> None:
    fb, inner = make(FaultSpec(FaultKind.ERROR, ops={"set"}, after=True))
    with pytest.raises(StorageError):
        await fb.batch_set([key(1)], [page(1)])
    assert key(1) in inner.data  # the write happened; only the reply was lost


# -- latency and timeouts -------------------------------------------------------


@pytest.mark.parametrize("op", ALL_OPS)
async def test_latency_delays_then_runs_the_call(op: str) -> None:
    sleep = RecordingSleep()
    fb, inner = make(FaultSpec(FaultKind.LATENCY, ops={op}, delay=0.25), sleep=sleep)
    keys = await fill(inner, 2)
    result = await call(fb, op, keys)
    assert sleep.delays == [0.25]
    assert inner.seen and inner.seen[0][0] == op
    if op == "exists":
        assert result == 2
    if op == "get":
        assert result == [True, True]


async def test_latency_range_is_drawn_inside_it() -> None:
    sleep = RecordingSleep()
    fb, inner = make(FaultSpec(FaultKind.LATENCY, delay=(0.01, 0.02)), sleep=sleep)
    for _ in range(20):
        await fb.batch_exists([key(0)])
    assert len(sleep.delays) == 20
    assert all(0.01 <= d <= 0.02 for d in sleep.delays)
    assert len(set(sleep.delays)) > 1


@pytest.mark.parametrize("op", ALL_OPS)
async def test_timeout_sleeps_then_raises(op: str) -> None:
    sleep = RecordingSleep()
    fb, inner = make(FaultSpec(FaultKind.TIMEOUT, ops={op}, delay=0.5), sleep=sleep)
    keys = await fill(inner, 2)
    with pytest.raises(StorageTimeoutError):
        await call(fb, op, keys)
    assert sleep.delays == [0.5]
    assert inner.seen == []


async def test_timeout_after_the_call_keeps_its_effects() -> None:
    fb, inner = make(
        FaultSpec(FaultKind.TIMEOUT, ops={"delete"}, after=True), sleep=RecordingSleep()
    )
    keys = await fill(inner, 2)
    with pytest.raises(StorageTimeoutError):
        await fb.delete(keys)
    assert inner.data == {}


# -- hanging calls -------------------------------------------------------------


async def _until_hung(fb: FaultyBackend) -> None:
    """Let the new task run to its hang (the first point where it suspends)."""
    await asyncio.sleep(0)
    assert fb.injected["hang"] == 1


@pytest.mark.parametrize("op", ALL_OPS)
async def test_hang_ends_only_by_cancellation_and_leaks_nothing(op: str) -> None:
    fb, inner = make(FaultSpec(FaultKind.HANG, ops={op}))
    keys = await fill(inner, 2)
    before = asyncio.all_tasks()
    task = asyncio.create_task(call(fb, op, keys))
    await _until_hung(fb)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == before
    assert fb._hangs == set()
    assert inner.seen == []


async def test_hang_under_a_caller_deadline() -> None:
    fb, inner = make(FaultSpec(FaultKind.HANG, ops={"get"}))
    keys = await fill(inner, 1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await fb.batch_get(keys, [sentinel()])
    assert fb._hangs == set()


async def test_closing_releases_hanging_calls() -> None:
    fb, inner = make(FaultSpec(FaultKind.HANG, ops={"exists"}))
    task = asyncio.create_task(fb.batch_exists([key(0)]))
    await _until_hung(fb)
    await fb.aclose()
    with pytest.raises(BackendUnavailableError):
        await task
    assert inner.state is BackendState.CLOSED


# -- partial batches -------------------------------------------------------------


async def test_partial_get_prefix_leaves_the_rest_untouched() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"get"}, keep_pages=2))
    keys = await fill(inner, 5)
    bufs = [sentinel() for _ in keys]
    assert await fb.batch_get(keys, bufs) == [True, True, False, False, False]
    assert [b.tobytes() for b in bufs[:2]] == [payload(0), payload(1)]
    assert all(b.tobytes() == b"\xaa" * PAGE for b in bufs[2:])
    assert inner.seen == [("get", keys[:2])]  # the dropped pages were never read
    s = await fb.stats()
    assert s.extra["faults.partial"] == 1
    assert s.extra["faults.pages_dropped"] == 3


async def test_partial_get_random_subset_drops_at_least_one() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"get"}, partial=PartialMode.RANDOM), seed=3)
    keys = await fill(inner, 8)
    shapes = set()
    for _ in range(30):
        bufs = [sentinel() for _ in keys]
        got = await fb.batch_get(keys, bufs)
        assert not all(got)
        shapes.add(tuple(got))
        for i, (ok, b) in enumerate(zip(got, bufs, strict=True)):
            assert b.tobytes() == (payload(i) if ok else b"\xaa" * PAGE)
    assert any(g[0] is False and any(g) for g in shapes)  # not only prefixes
    assert fb.injected["partial"] == 30


async def test_partial_keep_is_capped_so_the_batch_is_really_partial() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"get"}, keep_pages=99))
    keys = await fill(inner, 3)
    assert await fb.batch_get(keys, [sentinel() for _ in keys]) == [True, True, False]


async def test_partial_set_writes_only_some() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"set"}, keep_pages=1))
    keys = [key(i) for i in range(4)]
    assert await fb.batch_set(keys, [page(i) for i in range(4)]) == [True, False, False, False]
    assert set(inner.data) == {keys[0]}


async def test_partial_exists_under_reports() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"exists"}), seed=5)
    keys = await fill(inner, 6)
    seen = [await fb.batch_exists(keys) for _ in range(40)]
    assert all(0 <= n < 6 for n in seen)
    assert len(set(seen)) > 1
    # nothing stored: nothing to under-report, and no fault is counted
    assert await fb.batch_exists([key(100)]) == 0
    assert fb.injected["partial"] == 40


async def test_partial_delete_removes_only_some() -> None:
    fb, inner = make(FaultSpec(FaultKind.PARTIAL, ops={"delete"}, keep_pages=2))
    keys = await fill(inner, 4)
    assert await fb.delete(keys) == 2
    assert set(inner.data) == set(keys[2:])


# -- wrong bytes on read ----------------------------------------------------------


async def test_flip_returns_wrong_bytes_as_arrived_and_stored_data_stays_intact() -> None:
    fb, inner = make(FaultSpec(FaultKind.FLIP, flip_bytes=3, max_faults=1))
    keys = await fill(inner, 4)
    bufs = [sentinel() for _ in keys]
    assert await fb.batch_get(keys, bufs) == [True] * 4
    diffs = [
        sum(a != b for a, b in zip(buf.tobytes(), payload(i), strict=True))
        for i, buf in enumerate(bufs)
    ]
    assert sorted(diffs) == [0, 0, 0, 3]  # exactly one page, exactly 3 bytes
    # the stored page is fine: the next (clean) read is right
    again = [sentinel() for _ in keys]
    assert await fb.batch_get(keys, again) == [True] * 4
    assert [b.tobytes() for b in again] == [payload(i) for i in range(4)]
    assert (await fb.stats()).extra["faults.pages_damaged"] == 1


async def test_flip_every_arrived_page_and_keep_misses_untouched() -> None:
    fb, inner = make(FaultSpec(FaultKind.FLIP, pages=None))
    keys = await fill(inner, 3)
    bufs = [sentinel() for _ in range(4)]
    got = await fb.batch_get([*keys, key(50)], bufs)
    assert got == [True, True, True, False]
    assert all(b.tobytes() != payload(i) for i, b in enumerate(bufs[:3]))
    assert bufs[3].tobytes() == b"\xaa" * PAGE


async def test_flip_into_a_multi_segment_page() -> None:
    fb, inner = make(FaultSpec(FaultKind.FLIP, flip_bytes=PAGE))
    keys = await fill(inner, 1)
    a, b = bytearray(b"\xaa" * 40), bytearray(b"\xaa" * (PAGE - 40))
    buf = PageBuffer.from_segments([memoryview(a), memoryview(b)], FMT)
    assert await fb.batch_get(keys, [buf]) == [True]
    assert all(x != y for x, y in zip(bytes(a) + bytes(b), payload(0), strict=True))


async def test_truncate_keeps_a_prefix_and_zeroes_the_tail() -> None:
    fb, inner = make(FaultSpec(FaultKind.TRUNCATE, keep_bytes=10))
    keys = await fill(inner, 1)
    buf = sentinel()
    assert await fb.batch_get(keys, [buf]) == [True]
    assert buf.tobytes() == payload(0)[:10] + bytes(PAGE - 10)


async def test_partial_and_flip_combine() -> None:
    fb, inner = make(
        FaultSpec(FaultKind.PARTIAL, ops={"get"}, keep_pages=2),
        FaultSpec(FaultKind.FLIP, pages=None),
    )
    keys = await fill(inner, 4)
    bufs = [sentinel() for _ in keys]
    assert await fb.batch_get(keys, bufs) == [True, True, False, False]
    assert bufs[0].tobytes() != payload(0) and bufs[1].tobytes() != payload(1)
    assert bufs[2].tobytes() == bufs[3].tobytes() == b"\xaa" * PAGE


# -- damage at rest ---------------------------------------------------------------


async def test_corrupt_stored_is_caught_by_the_backends_checks() -> None:
    fb, inner = make()
    assert isinstance(inner, RawPageAccess)
    keys = await fill(inner, 2)
    assert await fb.corrupt_stored(keys[0], offset=-1)
    assert await fb.truncate_stored(keys[1], 30)
    assert not await fb.corrupt_stored(key(77))
    bufs = [sentinel(), sentinel()]
    assert await fb.batch_get(keys, bufs) == [False, False]
    assert all(b.tobytes() == b"\xaa" * PAGE for b in bufs)
    assert (await fb.stats()).corrupt_pages == 2


async def test_damage_at_rest_needs_raw_access() -> None:
    inner = NoRawBackend()
    fb = FaultyBackend(inner)
    assert not isinstance(inner, RawPageAccess)
    with pytest.raises(StateError):
        await fb.corrupt_stored(key(0))
    with pytest.raises(StateError):
        await fb.truncate_stored(key(0))


async def test_damage_at_rest_rejects_bad_arguments() -> None:
    fb, inner = make()
    keys = await fill(inner, 1)
    size = len(inner.data[keys[0]])
    with pytest.raises(InvalidInputError):
        await fb.corrupt_stored(keys[0], count=0)
    with pytest.raises(InvalidInputError):
        await fb.corrupt_stored(keys[0], offset=size)
    with pytest.raises(InvalidInputError):
        await fb.truncate_stored(keys[0], size)
    for bad in (True, 1.0, "1"):
        with pytest.raises(InvalidInputError):
            await fb.corrupt_stored(keys[0], count=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            await fb.corrupt_stored(keys[0], offset=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            await fb.truncate_stored(keys[0], bad)  # type: ignore[arg-type]
    assert len(inner.data[keys[0]]) == size


# -- rates, schedules and seeds -----------------------------------------------------


async def test_probability_zero_never_faults_and_one_always_does() -> None:
    never, inner = make(FaultSpec(FaultKind.ERROR, probability=0.0))
    keys = await fill(inner, 2)
    for _ in range(200):
        assert await never.batch_exists(keys) == 2
    assert never.total_injected == 0
    always, inner = make(FaultSpec(FaultKind.ERROR, probability=1.0))
    for _ in range(200):
        with pytest.raises(StorageError):
            await always.batch_exists(keys)
    assert always.injected["error"] == 200


async def test_fail_only_the_third_call() -> None:
    fb, inner = make(FaultSpec(FaultKind.ERROR, ops={"get"}, after_calls=2, max_faults=1))
    keys = await fill(inner, 1)
    outcomes = []
    for _ in range(6):
        await fb.batch_exists(keys)  # other operations do not count as matching calls
        try:
            await fb.batch_get(keys, [sentinel()])
            outcomes.append("ok")
        except StorageError:
            outcomes.append("err")
    assert outcomes == ["ok", "ok", "err", "ok", "ok", "ok"]


async def test_fail_the_first_n_calls() -> None:
    fb, inner = make(FaultSpec(FaultKind.ERROR, max_faults=3))
    outcomes = []
    for _ in range(5):
        try:
            await fb.batch_exists([key(0)])
            outcomes.append("ok")
        except StorageError:
            outcomes.append("err")
    assert outcomes == ["err", "err", "err", "ok", "ok"]


MIXED = (
    FaultSpec(FaultKind.LATENCY, delay=(0.0, 0.001), probability=0.3),
    FaultSpec(FaultKind.ERROR, probability=0.2),
    FaultSpec(FaultKind.TIMEOUT, probability=0.1),
    FaultSpec(FaultKind.PARTIAL, probability=0.3, partial=PartialMode.RANDOM),
    FaultSpec(FaultKind.FLIP, probability=0.3),
)


async def _run_script(seed: int) -> tuple[list[object], list[float]]:
    sleep = RecordingSleep()
    fb, inner = make(*MIXED, seed=seed, sleep=sleep)
    keys = await fill(inner, 6)
    outcomes: list[object] = []
    for i in range(120):
        op = ["exists", "get", "set", "delete"][i % 4]
        batch = keys[i % 3 :]
        try:
            if op == "get":
                bufs = [sentinel() for _ in batch]
                outcomes.append((await fb.batch_get(batch, bufs), [b.tobytes() for b in bufs]))
            elif op == "delete":
                outcomes.append(await fb.delete(batch[-1:]))
                await inner.batch_set(batch[-1:], [page(int(batch[-1][3:]))])
            else:
                outcomes.append(await call(fb, op, batch))
        except StorageError as e:
            outcomes.append(type(e).__name__)
    assert fb.total_injected > 0
    return outcomes, sleep.delays


async def test_same_seed_same_faults_other_seed_other_faults() -> None:
    a = await _run_script(11)
    b = await _run_script(11)
    c = await _run_script(12)
    assert a == b
    assert a != c


async def test_concurrent_calls_draw_in_call_order() -> None:
    """Faults are drawn before the first await, so how concurrent calls
    interleave afterwards does not change which call gets which fault."""

    class SkewedSleep:
        def __init__(self, yields: list[int]) -> None:
            self.yields = iter(yields)

        async def __call__(self, delay: float) -> None:
            for _ in range(next(self.yields)):
                await asyncio.sleep(0)

    async def run(yields: list[int]) -> tuple[list[list[bool]], list[str]]:
        fb, inner = make(
            FaultSpec(FaultKind.LATENCY),
            FaultSpec(FaultKind.PARTIAL, partial=PartialMode.RANDOM, probability=0.5),
            seed=4,
            sleep=SkewedSleep(yields),
        )
        keys = await fill(inner, 6)
        results = await asyncio.gather(
            *(fb.batch_get(keys, [sentinel() for _ in keys]) for _ in yields)
        )
        order = [",".join(k[-1] for k in ks) for _, ks in inner.seen]
        return list(results), order

    forward, order_f = await run(list(range(10)))
    backward, order_b = await run(list(range(10, 0, -1)))
    assert order_f != order_b  # the calls really reached the backend in other orders
    assert forward == backward


# -- counters, switches, lifecycle ---------------------------------------------------


async def test_counters_add_up() -> None:
    fb, inner = make(*MIXED, seed=2, sleep=RecordingSleep())
    keys = await fill(inner, 4)
    raised = 0
    for i in range(100):
        try:
            await call(fb, ["exists", "get", "set"][i % 3], keys)
        except StorageError:
            raised += 1
    fb.fail_all(True)
    for _ in range(7):
        with pytest.raises(BackendUnavailableError):
            await fb.batch_exists(keys)
    counts = fb.injected
    s = await fb.stats()
    assert counts["outage"] == 7
    assert counts["error"] + counts["timeout"] == raised
    assert sum(counts.values()) == fb.total_injected == s.extra["faults.total"] == len(fb.events)
    assert all(s.extra[f"faults.{k}"] == v for k, v in counts.items())
    assert s.errors == raised + 7
    assert s.exists_calls == 100 // 3 + 1 - sum(  # calls the inner backend really got
        1 for e in fb.events if e.op == "exists" and e.kind in ("error", "timeout")
    )


async def test_fail_all_is_an_outage_with_recovery() -> None:
    fb, inner = make()
    keys = await fill(inner, 2)
    fb.fail_all(True)
    assert fb.down
    for op in ALL_OPS:
        with pytest.raises(BackendUnavailableError):
            await call(fb, op, keys)
    assert inner.seen == []
    fb.fail_all(False)
    assert await fb.batch_exists(keys) == 2  # recovered, nothing lost
    assert fb.injected["outage"] == 5


async def test_fail_all_does_not_depend_on_enable() -> None:
    fb, _ = make(FaultSpec(FaultKind.ERROR), enabled=False)
    assert not fb.enabled
    assert await fb.batch_exists([key(0)]) == 0
    fb.fail_all()
    with pytest.raises(BackendUnavailableError):
        await fb.batch_exists([key(0)])


async def test_enable_disable_and_set_plan() -> None:
    fb, inner = make(FaultSpec(FaultKind.ERROR, ops={"exists"}))
    keys = await fill(inner, 1)
    with pytest.raises(StorageError):
        await fb.batch_exists(keys)
    fb.disable()
    assert await fb.batch_exists(keys) == 1
    fb.enable()
    with pytest.raises(StorageError):
        await fb.batch_exists(keys)
    fb.set_plan(FaultPlan.of(FaultSpec(FaultKind.ERROR, ops={"exists"}, after_calls=1), seed=0))
    assert await fb.batch_exists(keys) == 1  # spec call counts restart with the plan
    with pytest.raises(StorageError):
        await fb.batch_exists(keys)
    assert fb.injected["error"] == 3  # counters are kept across plans
    with pytest.raises(InvalidInputError):
        fb.set_plan("error")  # type: ignore[arg-type]


async def test_close_closes_inner_unless_told_not_to() -> None:
    fb, inner = make()
    async with fb:
        pass
    assert fb.state is BackendState.CLOSED and inner.state is BackendState.CLOSED
    await fb.aclose()  # idempotent
    with pytest.raises(BackendUnavailableError):
        await fb.batch_exists([key(0)])
    with pytest.raises(BackendUnavailableError):
        await fb.corrupt_stored(key(0))

    keep = DictBackend()
    fb2 = await FaultyBackend.wrap(keep, close_inner=False)
    await fb2.aclose()
    assert keep.state is BackendState.OPEN
    await keep.aclose()
    with pytest.raises(BackendUnavailableError):
        await FaultyBackend.wrap(keep)


async def test_mismatched_batch_lengths_are_rejected() -> None:
    fb, _ = make()
    with pytest.raises(InvalidInputError):
        await fb.batch_get([key(0)], [])
    with pytest.raises(InvalidInputError):
        await fb.batch_set([], [page(0)])


async def test_large_damaged_batches_are_delivered_off_the_loop() -> None:
    big = 600 * 1024  # two pages: over the 1 MiB delivered on the loop
    fb, inner = make(FaultSpec(FaultKind.FLIP, pages=None, flip_bytes=5))
    data = [bytes([i + 1]) * big for i in range(2)]
    keys = [key(0), key(1)]
    await inner.batch_set(keys, [PageBuffer.from_bytes(x, FMT) for x in data])
    bufs = [PageBuffer.allocate(big, FMT) for _ in keys]
    assert await fb.batch_get(keys, bufs) == [True, True]
    for b, x in zip(bufs, data, strict=True):
        assert sum(1 for u, v in zip(b.tobytes(), x, strict=True) if u != v) == 5


# -- with the real in-process backend, and by URL ---------------------------------------


async def test_faults_over_the_memory_backend() -> None:
    from tiercache.storage.memory import MemoryBackend

    inner = MemoryBackend()
    fb = FaultyBackend(
        inner, FaultPlan.of(FaultSpec(FaultKind.PARTIAL, ops={"get"}, keep_pages=1), seed=0)
    )
    keys = [key(i) for i in range(3)]
    assert await fb.batch_set(keys, [page(i) for i in range(3)]) == [True] * 3
    bufs = [sentinel() for _ in keys]
    assert await fb.batch_get(keys, bufs) == [True, False, False]
    assert [b.tobytes() for b in bufs] == [payload(0), b"\xaa" * PAGE, b"\xaa" * PAGE]
    assert (await fb.stats()).get_pages == 1  # the memory backend saw one page only
    fb.fail_all()
    with pytest.raises(BackendUnavailableError):
        await fb.batch_exists(keys)
    fb.fail_all(False)
    assert await fb.batch_exists(keys) == 3
    with pytest.raises(StateError):  # the memory backend offers no raw access
        await fb.corrupt_stored(keys[0])
    await fb.aclose()
    assert inner.state is BackendState.CLOSED


async def test_from_url_builds_the_plan_and_opens_the_inner_backend() -> None:
    from tiercache.storage.memory import MemoryBackend

    fb = await FaultyBackend.from_url(
        "faulty+memory://?capacity_pages=4&fault=error&fault_p=0.5&fault_ops=get,set"
        "&fault_after_calls=1&fault_max=2&fault_error=BackendUnavailableError&fault_seed=9",
    )
    async with fb:
        assert isinstance(fb.inner, MemoryBackend) and fb.inner.capacity_pages == 4
        assert fb.plan == FaultPlan.of(
            FaultSpec(
                FaultKind.ERROR,
                ops={"get", "set"},
                probability=0.5,
                after_calls=1,
                max_faults=2,
                error=BackendUnavailableError,
            ),
            seed=9,
        )
    assert fb.inner.state is BackendState.CLOSED
    fb = await FaultyBackend.from_url(
        "faulty+memory://", fault="latency", fault_delay="0.1,0.2", fault_enabled="0"
    )
    assert fb.plan.specs[0].delay == (0.1, 0.2) and not fb.enabled
    await fb.aclose()
    plan = FaultPlan.of(FaultSpec(FaultKind.HANG), seed=1)
    fb = await FaultyBackend.from_url("faulty+memory://", plan=plan)
    assert fb.plan is plan
    await fb.aclose()


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("memory://", {"fault": "error"}),
        ("faulty+", {"fault": "error"}),
        ("faulty+memory://", {}),
        ("faulty+memory://?fault=explode", {}),
        ("faulty+memory://?fault=error&fault_bogus=1", {}),
        ("faulty+memory://?fault=error&fault_error=KeyError", {}),
        ("faulty+memory://?fault=error&fault_p=2", {}),
        ("faulty+memory://?fault=error", {"plan": FaultPlan()}),
        ("faulty+memory://", {"plan": "error"}),
        ("faulty+memory://?fault=error&bogus=1", {}),  # the inner backend's own check
    ],
)
async def test_from_url_rejects_bad_urls_and_options(url: str, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        await FaultyBackend.from_url(url, **options)


async def test_registered_under_a_faulty_scheme() -> None:
    from tiercache.storage.registry import open_backend, register_backend, unregister_backend

    register_backend("faulty+memory", FaultyBackend)
    try:
        fb = await open_backend("faulty+memory://?fault=error&fault_ops=exists")
        assert isinstance(fb, FaultyBackend)
        with pytest.raises(StorageError):
            await fb.batch_exists([key(0)])
        await fb.aclose()
    finally:
        unregister_backend("faulty+memory")


async def test_max_faults_holds_under_concurrent_calls() -> None:
    fb, inner = make(
        FaultSpec(FaultKind.LATENCY),  # every call suspends between drawing and shaping
        FaultSpec(FaultKind.PARTIAL, ops={"get"}, keep_pages=0, max_faults=2),
        sleep=RecordingSleep(),
    )
    keys = await fill(inner, 2)
    results = await asyncio.gather(
        *(fb.batch_get(keys, [sentinel(), sentinel()]) for _ in range(6))
    )
    assert sorted(results) == [[False, False]] * 2 + [[True, True]] * 4
    assert fb.injected["partial"] == 2


async def test_a_fault_the_inner_failure_preempted_is_not_spent() -> None:
    inner = DictBackend()
    flaky = FaultyBackend(
        inner, FaultPlan.of(FaultSpec(FaultKind.ERROR, ops={"get"}, max_faults=1))
    )
    fb = FaultyBackend(flaky, FaultPlan.of(FaultSpec(FaultKind.FLIP, max_faults=1), seed=0))
    keys = await fill(inner, 1)
    with pytest.raises(StorageError):
        await fb.batch_get(keys, [sentinel()])
    buf = sentinel()
    assert await fb.batch_get(keys, [buf]) == [True]
    assert buf.tobytes() != payload(0)  # the flip was kept for the next call
    assert fb.injected["flip"] == 1 and flaky.injected["error"] == 1
    await fb.aclose()
    assert inner.state is BackendState.CLOSED  # closing closes the whole stack


@pytest.mark.parametrize("op", ["exists", "get", "set", "delete"])
async def test_bad_keys_are_refused_before_any_fault(op: str) -> None:
    """A key every backend refuses is refused here too, and draws no fault."""
    fb, inner = make(FaultSpec(FaultKind.ERROR, probability=1.0))
    for bad in (["../x"], "k1", [b"k1"], [1]):
        with pytest.raises(InvalidInputError):
            if op == "exists":
                await fb.batch_exists(bad)  # type: ignore[arg-type]
            elif op == "get":
                await fb.batch_get(bad, [sentinel()] * len(bad))  # type: ignore[arg-type]
            elif op == "set":
                await fb.batch_set(bad, [page(0)] * len(bad))  # type: ignore[arg-type]
            else:
                await fb.delete(bad)  # type: ignore[arg-type]
    assert fb.total_injected == 0
    assert inner.seen == []


async def test_keys_may_be_an_iterator() -> None:
    fb, inner = make()
    keys = [key(i) for i in range(3)]
    assert await fb.batch_set(iter(keys), [page(i) for i in range(3)]) == [True] * 3
    assert await fb.batch_exists(iter(keys)) == 3
    got = [sentinel() for _ in range(3)]
    assert await fb.batch_get(iter(keys), got) == [True] * 3
    assert await fb.delete(iter(keys)) == 3
