"""A CPU copy stream's threads yield the CPU to the event loop's thread."""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading

import pytest
import torch

from tiercache.transfer import streams as streams_module
from tiercache.transfer.streams import COPY_NICENESS, CopyStream, copy_helper

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's"
)


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_worker_and_its_helper_run_below_the_calling_thread() -> None:
    """A copy may use every core while the loop sleeps; the loop's thread gets a
    core back at once when it wakes (measured: the loop's lag p99 while 128 MiB
    of 4 MiB pages move fell from 7-10 % to 4-6 % of the transfer on 2 cores)."""
    stream = CopyStream("write", torch.device("cpu"))
    try:
        seen: dict[str, int] = {}

        def job() -> None:
            seen["worker"] = _nice()
            helper = copy_helper()
            assert helper is not None
            seen["helper"] = helper.submit(_nice).result()

        stream.submit(job).result(timeout=30)
    finally:
        stream.close()
    mine = _nice()
    expect = min(19, mine + COPY_NICENESS)
    assert seen == {"worker": expect, "helper": expect}
    assert _nice() == mine  # the caller's own priority is untouched


# -- the stream's own threads -------------------------------------------------------


def _worker(name: str = "tiercache-test") -> streams_module._Worker:
    return streams_module._Worker(name, initializer=lambda: None, initargs=())


def test_a_worker_runs_each_submitters_calls_in_order_and_all_of_them() -> None:
    worker = _worker()
    seen: list[tuple[int, int]] = []

    def submitter(k: int) -> None:
        for i in range(200):
            worker.submit(seen.append, (k, i))

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker.shutdown()  # runs what is queued first
    assert sorted(seen) == [(k, i) for k in range(4) for i in range(200)]
    for k in range(4):
        assert [i for kk, i in seen if kk == k] == list(range(200))
    worker.shutdown()  # idempotent


def test_a_worker_starts_on_its_first_call_with_its_initializer_on_its_thread() -> None:
    ran: list[str] = []
    worker = streams_module._Worker(
        "tiercache-init",
        initializer=lambda tag: ran.append(f"{tag}:{threading.current_thread().name}"),
        initargs=("init",),
    )
    assert not any(t.name == "tiercache-init" for t in threading.enumerate())
    done = threading.Event()
    worker.submit(done.set)
    assert done.wait(10)
    worker.shutdown()
    assert ran == ["init:tiercache-init"]
    assert not any(t.name == "tiercache-init" for t in threading.enumerate())


def test_a_call_that_raises_is_logged_and_the_worker_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = _worker("tiercache-raises")
    after: list[int] = []

    def fails() -> None:
        raise RuntimeError("job fault")

    with caplog.at_level(logging.ERROR, logger="tiercache.transfer.streams"):
        worker.submit(fails)
        worker.submit(after.append, 1)
        worker.shutdown()
    assert after == [1]
    assert any("tiercache-raises" in r.getMessage() for r in caplog.records)


def test_a_worker_dropped_unclosed_ends_its_thread() -> None:
    worker = _worker("tiercache-dropped")
    done = threading.Event()
    worker.submit(done.set)
    assert done.wait(10)
    thread = next(t for t in threading.enumerate() if t.name == "tiercache-dropped")
    del worker
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_closing_a_stream_runs_every_job_it_took_first() -> None:
    stream = CopyStream("closing", torch.device("cpu"))
    ran: list[int] = []
    futures = []
    for i in range(50):
        futures.append(stream.submit(functools.partial(ran.append, i)))
    stream.close()
    assert ran == list(range(50))
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: None)


def _threads_at(nice: int) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[16]) == nice:
            count += 1
    return count


@pytest.mark.skipif(
    not torch.backends.openmp.is_available(), reason="torch runs its threads without OpenMP"
)
def test_a_cpu_copy_thread_starts_an_openmp_team_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libgomp spins idle team threads for milliseconds only while no more threads
    are in teams than cores: with the copy threads' teams counted, a torch op on
    another thread (the loop's) leaves no thread spinning when a copy begins."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    level = min(19, _nice() + COPY_NICENESS)
    before = _threads_at(level)
    stream = CopyStream("team", torch.device("cpu"))
    try:
        stream.submit(lambda: None).result(timeout=30)
        # The worker and its team's other thread, both below the caller.
        assert _threads_at(level) - before >= 2
    finally:
        stream.close()
