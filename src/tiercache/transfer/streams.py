"""Copy streams: ordered queues of copy work that run off the event loop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from tiercache.observe import observe

__all__ = ["CopyStream"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CopyStream:
    """An ordered stream of copy jobs, each run on the stream's own worker thread.

    Jobs run one after another in submission order, as work on one CUDA stream
    does. On a CPU device the worker thread *is* the stream: torch's copy
    kernels release the GIL, so the event loop keeps running while bytes move.
    On CUDA the worker enqueues the job's kernels on a dedicated
    ``torch.cuda.Stream`` (so copies overlap the compute stream) and then waits
    on the events it records, which is what turns GPU completion into host-side
    futures without ever blocking the loop.

    `submit` may be called from any thread; `close` waits for queued jobs.

    Args:
        name: used in the worker thread's name (``tiercache-<name>``).
        device: the device whose memory the stream copies to or from.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.cuda_stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if self.is_cuda else None  # type: ignore[no-untyped-call]
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"tiercache-{name}"
        )
        self._closed = False
        self._pending = 0  # jobs submitted and not finished
        self._lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No job is queued or running."""
        return self._pending == 0

    def run_inline(self, job: Callable[[], T]) -> T:
        """Run ``job`` now on the calling thread (CPU streams only, and only when `idle`).

        For copies so small that handing them to the worker thread costs more
        than the copy: ordering is kept because nothing else is queued.

        Raises:
            RuntimeError: a CUDA stream, a busy stream or a closed one.
        """
        if self.is_cuda or self._closed or self._pending:
            raise RuntimeError(f"copy stream {self.name} cannot run a job inline now")
        with torch.inference_mode():
            return job()

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        if self.cuda_stream is None:
            yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.cuda_stream):
                yield

    def submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``job``; it runs on the worker thread inside the stream context.

        Raises:
            RuntimeError: the stream was closed.
        """
        if self._closed:
            raise RuntimeError(f"copy stream {self.name} is closed")

        def run() -> T:
            t0 = time.perf_counter()
            try:
                with self._context(), torch.inference_mode():
                    return job()
            finally:
                observe("copy", self.name, time.perf_counter() - t0)
                with self._lock:
                    self._pending -= 1

        with self._lock:
            self._pending += 1
        try:
            return self._executor.submit(run)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """On CUDA, make this stream wait for ``event`` (call from inside a job); else nothing."""
        if event is not None and self.cuda_stream is not None:
            self.cuda_stream.wait_event(event)

    def record_event(self) -> torch.cuda.Event | None:
        """On CUDA, record an event on the stream (call from inside a job); else ``None``."""
        if self.cuda_stream is None:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self.cuda_stream)
        return ev

    def close(self) -> None:
        """Wait for queued jobs, then stop the worker. Blocking; idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"CopyStream({self.name!r}, device={self.device})"
