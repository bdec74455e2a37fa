"""FaultPolicy: every policy and every move between its states, the probe, close;
and GuardedBackend, which reports a backend's calls to it."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import pytest

from tiercache.errors import BackendUnavailableError, StorageError, StorageTimeoutError
from tiercache.storage.base import PageKey
from tiercache.storage.fault_policy import FAULT_POLICIES, FaultPolicy, FaultState, FaultStats
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.guarded import GuardedBackend
from tiercache.storage.memory import MemoryBackend


class Probe:
    """A probe call that fails while ``failing`` and counts its calls."""

    def __init__(self, failing: bool = True, hang: bool = False) -> None:
        self.failing = failing
        self.hang = hang
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.failing:
            raise StorageError("still down")
        return 0


def make(policy: str, threshold: int = 3, probe: Any = None, **kw: Any) -> FaultPolicy:
    return FaultPolicy(
        policy,
        threshold,
        backoff_s=0.001,
        backoff_max_s=0.004,
        timeout_s=kw.pop("timeout_s", 1.0),
        probe=probe or Probe(),
        name="test",
        **kw,
    )


async def wait_for(cond: Any) -> None:
    async with asyncio.timeout(5.0):
        while not cond():  # noqa: ASYNC110 - polls the policy's state, not an event
            await asyncio.sleep(0.001)


def test_the_policies_are_the_three_documented() -> None:
    assert FAULT_POLICIES == ("none", "auto_detach", "auto_reconnect")


@pytest.mark.parametrize("policy", FAULT_POLICIES)
async def test_below_the_threshold_nothing_happens_and_a_success_resets_the_count(
    policy: str,
) -> None:
    f = make(policy, threshold=3)
    f.failed()
    f.failed()
    assert f.failures == 2 and f.state is FaultState.UP and not f.down
    f.succeeded()
    assert f.failures == 0
    f.failed()
    f.failed()
    assert f.state is FaultState.UP  # 2 in a row again, not 4
    assert f.counts == FaultStats()


async def test_none_keeps_calling_however_many_failures() -> None:
    f = make("none", threshold=1)
    for _ in range(10):
        f.failed()
    assert f.state is FaultState.UP and not f.probing
    assert f.failures == 10
    assert f.counts == FaultStats()


async def test_auto_detach_gives_up_for_good_and_tells_the_owner_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told: list[int] = []
    probe = Probe(failing=False)
    f = make("auto_detach", threshold=2, probe=probe, on_detach=lambda: told.append(1))
    f.failed()
    assert told == []
    f.failed()
    assert f.state is FaultState.DETACHED and f.down
    assert told == [1]
    assert f.counts == FaultStats(auto_detaches=1)
    assert "detaching it" in caplog.text
    # Nothing brings it back: no probe, further failures and successes change nothing.
    f.failed()
    f.succeeded()
    f.failed()
    await asyncio.sleep(0.02)
    assert f.state is FaultState.DETACHED and probe.calls == 0 and told == [1]
    assert f.counts == FaultStats(auto_detaches=1)


async def test_auto_reconnect_goes_down_probes_with_backoff_and_comes_back() -> None:
    probe = Probe(failing=True)
    f = make("auto_reconnect", threshold=2, probe=probe)
    f.failed()
    f.failed()
    assert f.state is FaultState.DOWN and f.down and f.probing
    assert f.counts == FaultStats(outages=1)
    await wait_for(lambda: probe.calls >= 4)
    assert f.state is FaultState.DOWN
    f.failed()  # a failure while down is not counted again
    assert f.counts.outages == 1
    probe.failing = False
    await wait_for(lambda: f.state is FaultState.UP)
    assert f.failures == 0 and not f.probing
    assert f.counts == FaultStats(outages=1, reconnects=1)
    # A second outage is a second one, with a new probe.
    probe.failing = True
    f.failed()
    f.failed()
    assert f.state is FaultState.DOWN and f.counts.outages == 2
    probe.failing = False
    await wait_for(lambda: f.state is FaultState.UP)
    assert f.counts == FaultStats(outages=2, reconnects=2)
    await f.aclose()


async def test_the_probe_backoff_doubles_up_to_its_maximum() -> None:
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    probe = Probe(failing=True)
    f = FaultPolicy(
        "auto_reconnect",
        1,
        backoff_s=0.5,
        backoff_max_s=3.0,
        timeout_s=1.0,
        probe=probe,
        name="test",
    )
    mp = pytest.MonkeyPatch()
    mp.setattr(asyncio, "sleep", sleep)
    try:
        f.failed()
        while len(sleeps) < 6:
            await real_sleep(0.001)  # the test's own waits are not recorded
    finally:
        mp.undo()
    await f.aclose()
    assert sleeps[:6] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


async def test_a_hung_probe_is_a_failed_probe_after_its_deadline() -> None:
    probe = Probe(failing=False, hang=True)
    f = make("auto_reconnect", threshold=1, probe=probe, timeout_s=0.01)
    f.failed()
    await wait_for(lambda: probe.calls >= 2)  # the first timed out, the probe went on
    assert f.state is FaultState.DOWN
    probe.hang = False
    await wait_for(lambda: f.state is FaultState.UP)
    await f.aclose()


async def test_detach_from_up_or_down_counts_once_cancels_the_probe_and_skips_the_hook() -> None:
    told: list[int] = []
    probe = Probe(failing=True)
    f = make("auto_reconnect", threshold=1, probe=probe, on_detach=lambda: told.append(1))
    f.failed()
    assert f.probing
    f.detach()
    f.detach()
    assert f.state is FaultState.DETACHED
    await wait_for(lambda: not f.probing)
    assert f.counts == FaultStats(outages=1, auto_detaches=1)
    assert told == []  # the owner called detach: it knows

    g = make("none")
    g.detach()
    assert g.state is FaultState.DETACHED and g.counts == FaultStats(auto_detaches=1)


async def test_a_detach_after_auto_detach_gave_up_is_not_counted_twice() -> None:
    f = make("auto_detach", threshold=1)
    f.failed()
    f.detach()  # under TP: the agreement detaches it on every rank, this one included
    assert f.counts == FaultStats(auto_detaches=1)


@pytest.mark.parametrize("policy", FAULT_POLICIES)
async def test_failures_while_closing_are_not_counted(policy: str) -> None:
    f = make(policy, threshold=1)
    f.closing()
    for _ in range(5):
        f.failed()
    assert f.state is FaultState.UP and f.failures == 0 and not f.probing
    assert f.counts == FaultStats()
    await f.aclose()
    f.failed()
    assert f.state is FaultState.UP


async def test_aclose_ends_the_probe_and_is_idempotent() -> None:
    probe = Probe(failing=True)
    f = make("auto_reconnect", threshold=1, probe=probe)
    f.failed()
    await wait_for(lambda: probe.calls >= 1)
    await f.aclose()
    assert not f.probing
    calls = probe.calls
    await asyncio.sleep(0.02)
    assert probe.calls == calls  # nothing probes after close
    assert f.state is FaultState.DOWN  # left as it was
    await f.aclose()


async def test_aclose_stops_a_probe_stuck_in_its_call() -> None:
    probe = Probe(failing=False, hang=True)
    f = make("auto_reconnect", threshold=1, probe=probe, timeout_s=60.0)
    f.failed()
    await wait_for(lambda: probe.calls == 1)
    async with asyncio.timeout(2):
        await f.aclose()
    assert not f.probing


async def test_a_closer_cancelled_while_the_probe_ends_is_cancelled() -> None:
    """aclose waits for the cancelled probe, but a cancellation of the closer
    itself is the closer's: it is raised, not swallowed with the probe's."""
    stuck, release = asyncio.Event(), asyncio.Event()

    async def probe() -> int:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stuck.set()
            await release.wait()  # a call that takes a while to unwind
            raise
        return 0

    f = make("auto_reconnect", threshold=1, probe=probe, timeout_s=60.0)
    f.failed()
    await asyncio.sleep(0.01)  # the probe is in its call
    closer = asyncio.ensure_future(f.aclose())
    await stuck.wait()
    closer.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await closer
    finally:
        release.set()  # the probe ends either way
    await asyncio.sleep(0.01)
    assert not f.probing


async def test_a_probe_that_answers_after_close_began_does_not_bring_it_back() -> None:
    gate = asyncio.Event()

    async def probe() -> int:
        await gate.wait()
        return 0

    f = make("auto_reconnect", threshold=1, probe=probe)
    f.failed()
    await asyncio.sleep(0.01)
    f.closing()
    gate.set()
    await asyncio.sleep(0.01)
    assert f.state is FaultState.DOWN and f.counts.reconnects == 0
    await f.aclose()


async def test_counts_go_where_the_owner_says_and_the_probe_runs_where_it_spawns() -> None:
    spawned: list[str] = []
    counts = FaultStats()

    def spawn(coro: Any, what: str) -> asyncio.Task[None]:
        spawned.append(what)
        return asyncio.get_running_loop().create_task(coro)

    f = make("auto_reconnect", threshold=1, spawn=spawn, counts=counts)
    f.failed()
    assert counts.outages == 1 and f.counts is counts
    assert spawned == ["the storage reconnect probe"]
    await f.aclose()


# -- GuardedBackend -----------------------------------------------------------------


class Counts:
    def __init__(self) -> None:
        self.storage_errors = 0
        self.storage_timeouts = 0
        self.skipped_while_down = 0


async def test_guarded_calls_report_to_the_policy_and_skip_while_down() -> None:
    inner = MemoryBackend()
    backend = FaultyBackend(inner)
    counts = Counts()
    f = make("auto_detach", threshold=2)
    calls = GuardedBackend(backend, f, timeout_s=1.0, counts=counts)
    keys = [PageKey("a" * 64)]
    assert await calls.exists(keys) == 0
    backend.fail_all(True)
    with pytest.raises(StorageError):
        await calls.exists(keys)
    assert f.failures == 1
    backend.fail_all(False)
    assert await calls.exists(keys) == 0
    assert f.failures == 0  # a success resets the count
    backend.fail_all(True)
    for _ in range(2):
        with pytest.raises(StorageError):
            await calls.exists(keys)
    assert f.state is FaultState.DETACHED and counts.storage_errors == 3
    with pytest.raises(BackendUnavailableError, match="detached"):
        await calls.exists(keys)
    assert counts.skipped_while_down == 1
    await backend.aclose()


async def test_a_guarded_call_past_its_deadline_is_a_timeout_and_a_failure() -> None:
    class Slow(MemoryBackend):
        async def batch_exists(self, keys: Any) -> int:
            await asyncio.sleep(3600)
            return 0

    counts = Counts()
    f = make("none", threshold=1)
    calls = GuardedBackend(Slow(), f, timeout_s=0.01, counts=counts)
    with pytest.raises(StorageTimeoutError):
        await calls.exists([PageKey("a" * 64)])
    assert counts.storage_timeouts == 1 and f.failures == 1


async def test_a_guarded_answer_outside_the_contract_is_a_failed_call() -> None:
    class Wrong(MemoryBackend):
        async def batch_exists(self, keys: Any) -> Any:
            return "three"

    counts = Counts()
    f = make("none", threshold=1)
    calls = GuardedBackend(Wrong(), f, timeout_s=1.0, counts=counts)
    with pytest.raises(StorageError, match="not an int"):
        await calls.exists([PageKey("a" * 64)])
    assert counts.storage_errors == 1 and f.failures == 1


async def test_a_closed_policy_holds_nothing_of_its_owner() -> None:
    class Owner:
        def gave_up(self) -> None:
            pass

    owner = Owner()
    ref = weakref.ref(owner)
    f = make("auto_detach", on_detach=owner.gave_up)
    await f.aclose()
    del owner
    assert ref() is None  # freed without the garbage collector
