"""A file store whose reads block in the kernel, as on a hung network file system.

`StuckReads` replaces the file backend's per-page read with one that waits
on a gate before reading, on the backend's own worker thread, so that the
read cannot be interrupted: cancelling the batch does not stop it, and once
the gate opens it writes the page into the caller's memory, as a ``preadv``
stuck on NFS does when the server comes back.
"""

from __future__ import annotations

import threading
from typing import Any

from tiercache.storage.file import FileBackend


class StuckReads:
    """Patch `FileBackend` reads to wait for `release` (at most ``hold_s`` seconds)."""

    def __init__(self, monkeypatch: Any, hold_s: float) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._running = 0
        real = FileBackend._read_fd

        def read_fd(fd: int, key: str, page: Any) -> Any:
            with self._lock:
                self._running += 1
            self.started.set()
            try:
                self.gate.wait(self.hold_s)
                return real(fd, key, page)
            finally:
                with self._lock:
                    self._running -= 1

        monkeypatch.setattr(FileBackend, "_read_fd", staticmethod(read_fd))

    @property
    def running(self) -> int:
        """Reads that have started and not ended."""
        with self._lock:
            return self._running

    def release_after(self, seconds: float) -> threading.Timer:
        """Open the gate ``seconds`` from now (on a timer thread)."""
        timer = threading.Timer(seconds, self.gate.set)
        timer.daemon = True
        timer.start()
        return timer
