"""Copy streams: ordered queues of copy work that run off the event loop.

A job runs in two halves. The *enqueue* half runs on the stream's worker
thread: on CUDA it only queues kernels on the stream and records events (a
few microseconds a layer), then returns the `Completion` it wants reported.
The *settle* half waits for those events on a separate completer thread and
runs each step's callback once its bytes are in place. So the next job's
kernels are queued while the previous job's bytes still move, and a consumer
waiting device-side for the next job's first layer is not held behind the
previous job's host-side wait.

A job that raises while enqueueing is settled before its failure is
reported: an event is recorded after what it already queued and the worker
waits for it, so no caller frees memory a DMA still reads or writes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tiercache.observe import observe

__all__ = ["Completion", "CopyStream", "copy_helper", "new_event"]

logger = logging.getLogger(__name__)

_running = threading.local()


def copy_helper() -> concurrent.futures.ThreadPoolExecutor | None:
    """The helper thread of the CPU copy stream whose job runs on the calling thread.

    ``None`` outside a job (and on CUDA streams, whose jobs only queue work).
    A job may hand part of a large copy to it; the stream stops it on `close`.
    """
    helper: concurrent.futures.ThreadPoolExecutor | None = getattr(_running, "helper", None)
    return helper


def _bind_device(device: torch.device) -> None:
    """A CUDA stream's thread: make ``device`` the thread's current device (thread start)."""
    torch.cuda.set_device(device)


#: How much less CPU priority a CPU copy thread takes than the event loop's
#: (Linux ``nice``): a copy may use every core while the loop sleeps, and
#: the loop's thread gets a core back as soon as it wakes.
COPY_NICENESS = 10


def _thread_nice() -> int | None:
    """The calling thread's nice value (Linux), or ``None`` where a thread has none of its own."""
    if not sys.platform.startswith("linux"):  # elsewhere a thread id is not a ``who``
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def _start_cpu_copy_thread(base: int | None) -> None:
    """A CPU copy thread's start: `_yield_to_the_loop`, then `_join_openmp`."""
    _yield_to_the_loop(base)
    _join_openmp()


def _join_openmp() -> None:
    """Give the calling thread an OpenMP team of its own (one small parallel op),
    where torch runs its threads with OpenMP and may use two or more.

    The copies of a CPU copy thread are numpy's: they never start a team. But
    libgomp spins a team's idle threads for a long while (about 10 ms here)
    only while no more threads are in teams than there are cores; with the
    copy threads' teams counted, it spins briefly and sleeps. Without them, a
    torch op on any other thread (the event loop's, the engine's) left one
    of its threads spinning at that thread's priority just as a copy began,
    taking a core from it (measured on 2 cores: a 256 MiB controller backup
    right after a torch copy on the loop's thread ran at 0.4-0.6 of memcpy,
    0.74-0.84 with the teams). The team's threads then sleep, unused.
    """
    if torch.get_num_threads() > 1 and torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        with torch.inference_mode():
            torch.ones(1 << 16).add_(1)  # above torch's grain: run by a team


def _yield_to_the_loop(base: int | None) -> None:
    """A CPU copy thread's start: run `COPY_NICENESS` below ``base``, the nice
    value of the thread that made the stream (the event loop's).

    The copy's OpenMP threads, started from this thread, inherit it. On
    Linux a thread has its own nice value (``setpriority`` of its id); where
    that is not so, or not allowed, nothing changes.
    """
    if base is None:
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base + COPY_NICENESS)


def new_event() -> torch.cuda.Event:
    """A CUDA event that the host waits on by sleeping, not spinning.

    ``blocking=True`` makes ``synchronize`` yield the CPU (the driver's
    blocking-sync flag): a default event spin-waits and burns a core per
    waiting thread for the whole copy.
    """
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class Completion:
    """What a job's settle half waits for, and what it reports.

    ``steps``: ``(event, callback)`` pairs in stream order. On CUDA the
    completer waits for each event, then runs its callback (on the completer
    thread). With ``event`` ``None`` (a CPU stream, where the bytes moved while
    the job ran) the callback runs at once. ``on_error`` runs, after the stream
    has settled, if waiting for an event fails. ``keep`` holds objects (index
    tensors, plans) that queued kernels still read: they are dropped only
    once every step has settled.
    """

    steps: list[tuple[torch.cuda.Event | None, Callable[[], None] | None]] = field(
        default_factory=list
    )
    on_error: Callable[[BaseException], None] | None = None
    keep: Any = None


class CopyStream:
    """An ordered stream of copy jobs, enqueued on the stream's own worker thread.

    Jobs run one after another in submission order, as work on one CUDA stream
    does. On a CPU device the worker thread *is* the stream: torch's copy
    kernels release the GIL, so the event loop keeps running while bytes move.
    On CUDA the worker enqueues the job's kernels on a dedicated
    ``torch.cuda.Stream`` of the stream's device (so copies overlap the
    compute stream) and hands the events it records to a completer thread,
    which waits for them with blocking (non-spinning) events and resolves the
    job's future: GPU completion becomes a host-side future without ever
    blocking the loop, and without holding the next job's enqueue.

    A job's future resolves only after everything the job queued has finished
    on the device, whether it succeeded or failed: callers may free the job's
    slots from the future's callbacks.

    `submit` may be called from any thread; `close` waits for queued jobs.

    Args:
        name: used in the worker threads' names (``tiercache-<name>``).
        device: the device whose memory the stream copies to or from; a CUDA
            device must carry its index.
    """

    def __init__(self, name: str, device: torch.device, *, source: object | None = None) -> None:
        self.name = name
        self.device = device
        #: Who the stream's timings belong to (`tiercache.observe`): its controller.
        self.source = source
        self.is_cuda = device.type == "cuda"
        self.cuda_stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if self.is_cuda else None  # type: ignore[no-untyped-call]
        )
        # On CUDA both threads make the stream's device their current device
        # before anything else: a CUDA call (an event's synchronize) on a
        # thread that never chose one runs in device 0's context, creating it.
        bind: dict[str, Any] = (
            {"initializer": _bind_device, "initargs": (device,)}
            if self.is_cuda
            else {"initializer": _start_cpu_copy_thread, "initargs": (_thread_nice(),)}
        )
        self._executor = _Worker(f"tiercache-{name}", **bind)
        self._completer = _Worker(f"tiercache-{name}-settle", **bind) if self.is_cuda else None
        #: A CPU stream's second thread for large copies (see `copy_helper`).
        self._helper = (
            None
            if self.is_cuda
            else concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"tiercache-{name}-helper",
                **bind,
            )
        )
        self._closed = False
        self._pending = 0  # jobs submitted and not settled
        self._lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No job is queued, running or settling."""
        return self._pending == 0

    def run_inline(self, job: Callable[[], Completion | None]) -> None:
        """Run ``job`` now on the calling thread (CPU streams only, and only when `idle`).

        For copies so small that handing them to the worker thread costs more
        than the copy: ordering is kept because nothing else is queued. The
        completion's callbacks run before this returns. It is timed like a
        queued job (`tiercache.observe`), failed or not.

        Raises:
            RuntimeError: a CUDA stream, a busy stream or a closed one.
            Exception: whatever the job raised.
        """
        if self.is_cuda or self._closed or self._pending:
            raise RuntimeError(f"copy stream {self.name} cannot run a job inline now")
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                done = job()
            if done is not None:
                self._settle_steps(done)
        finally:
            observe("copy", self.name, time.perf_counter() - started, source=self.source)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        if self.cuda_stream is None:
            yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.cuda_stream):
                yield

    def submit(self, job: Callable[[], Completion | None]) -> concurrent.futures.Future[None]:
        """Queue ``job``; it runs on the worker thread inside the stream context.

        The returned future resolves once the job's `Completion` has settled
        (every event waited for, every callback run), or fails with the job's
        error once the stream has settled after it.

        Raises:
            RuntimeError: the stream was closed.
        """
        if self._closed:
            raise RuntimeError(f"copy stream {self.name} is closed")
        queued = _QueuedJob(self, job)
        with self._lock:
            self._pending += 1
        try:
            self._executor.submit(queued.run)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        return queued.result

    def _enqueue(self, job: Callable[[], Completion | None]) -> Completion:
        """Run ``job``'s enqueue half in the stream context (worker thread).

        If it raises, the stream is settled first: nothing the job queued is
        still running when the failure is reported.
        """
        _running.helper = self._helper
        try:
            with self._context(), torch.inference_mode():
                try:
                    done = job()
                except BaseException:
                    self.settle()
                    raise
        finally:
            _running.helper = None
        return Completion() if done is None else done

    def _job_finished(self, started: float) -> None:
        observe("copy", self.name, time.perf_counter() - started, source=self.source)
        with self._lock:
            self._pending -= 1

    def _settle_steps(self, done: Completion) -> None:
        try:
            for ev, callback in done.steps:
                if ev is not None:
                    ev.synchronize()
                if callback is not None:
                    callback()
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.settle()
            if done.on_error is not None:
                done.on_error(e)
            raise
        finally:
            done.keep = None

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """On CUDA, make this stream wait for ``event`` (call from inside a job); else nothing."""
        if event is not None and self.cuda_stream is not None:
            self.cuda_stream.wait_event(event)

    def record_event(self) -> torch.cuda.Event | None:
        """On CUDA, record a blocking event on the stream (call from inside a job); else ``None``."""
        if self.cuda_stream is None:
            return None
        ev = new_event()
        ev.record(self.cuda_stream)
        return ev

    def settle(self) -> None:
        """Block until everything queued on the stream so far has finished (CPU: nothing to do).

        Called by a job that fails part-way, before it reports the failure:
        copies it already queued may still be reading or writing its slots.
        """
        ev = self.record_event()
        if ev is not None:
            ev.synchronize()

    def close(self) -> None:
        """Wait for queued jobs and their settling, then stop the threads. Blocking; idempotent."""
        self._closed = True
        self._executor.shutdown()
        if self._completer is not None:
            self._completer.shutdown()
        if self._helper is not None:
            self._helper.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"CopyStream({self.name!r}, device={self.device})"


class _Worker:
    """One thread that runs the calls handed to it, in order.

    Not a `concurrent.futures.ThreadPoolExecutor`: its ``submit`` takes a
    lock that its worker also takes after every item (the idle semaphore's),
    so the event loop's ``submit`` could wait milliseconds for the worker to
    win the GIL back and let go of it (measured: a 16 KiB-page round trip's
    ``submit`` took 2.7-3.4 ms, of which 0.3 ms on the CPU). Here the caller
    only puts the call on a `queue.SimpleQueue`, which takes no Python lock.
    The calls handle their own errors (`_QueuedJob`): one that raises is
    logged, and the thread goes on.

    The thread starts on the first call. `shutdown` runs what is queued, then
    stops it; so does dropping the worker unclosed (as an executor's thread
    ends once the executor is collected). A daemon thread: copies move bytes
    between memories the process owns, nothing of theirs outlives it.
    """

    def __init__(
        self, name: str, *, initializer: Callable[..., None], initargs: tuple[Any, ...]
    ) -> None:
        self._name = name
        self._init = (initializer, initargs)
        self._calls: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread, after every call handed over before."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    calls = self._calls
                    thread = threading.Thread(
                        target=_work,
                        args=(self._name, calls, *self._init),
                        name=self._name,
                        daemon=True,
                    )
                    thread.start()
                    weakref.finalize(self, calls.put, None)  # ends it once dropped
                    self._thread = thread
        self._calls.put((fn, args))

    def shutdown(self) -> None:
        """Run every call queued so far, then stop the thread (blocking; idempotent)."""
        with self._start_lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._calls.put(None)
            if thread is not threading.current_thread():
                thread.join()


def _work(
    name: str,
    calls: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None],
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
) -> None:
    """A `_Worker`'s thread: the calls of ``calls`` in order, until a ``None``."""
    initializer(*initargs)
    while (item := calls.get()) is not None:
        fn, args = item
        try:
            fn(*args)
        except BaseException:
            logger.exception("a call on %s failed", name)
        del item, fn, args  # drop the call's references before waiting for the next


class _QueuedJob:
    """One job submitted to a `CopyStream`: its two halves and the future they resolve."""

    __slots__ = ("job", "result", "started", "stream")

    def __init__(self, stream: CopyStream, job: Callable[[], Completion | None]) -> None:
        self.stream = stream
        self.job = job
        self.started = time.perf_counter()
        self.result: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.result.set_running_or_notify_cancel()

    def run(self) -> None:
        """The enqueue half (worker thread); hands the settle half on, or settles here."""
        stream = self.stream
        self.started = time.perf_counter()
        try:
            done = stream._enqueue(self.job)
        except BaseException as e:
            stream._job_finished(self.started)
            self.result.set_exception(e)
            return
        completer = stream._completer
        if completer is None or not any(ev is not None for ev, _ in done.steps):
            self.settle(done)
        else:
            completer.submit(self.settle, done)

    def settle(self, done: Completion) -> None:
        """The settle half: wait for the events, run the callbacks, resolve the future."""
        try:
            self.stream._settle_steps(done)
        except BaseException as e:
            self.stream._job_finished(self.started)
            self.result.set_exception(e)
        else:
            self.stream._job_finished(self.started)
            self.result.set_result(None)
