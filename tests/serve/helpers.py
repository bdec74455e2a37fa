"""Helpers of the ``tiercache serve`` tests: a server process, page bytes, socket paths."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from tiercache.memory.pages import PageBuffer
from tiercache.serve.run import READY_PREFIX

FORMAT = "test-format"


def short_dir() -> str:
    """A fresh directory with a short path (a Unix socket path is at most 107 bytes)."""
    return tempfile.mkdtemp(prefix="tcs-", dir="/tmp")


def page_bytes(key: str, nbytes: int) -> bytes:
    """Deterministic bytes of ``key``'s page (any process computes the same)."""
    seed = hashlib.sha256(key.encode()).digest()
    reps = -(-nbytes // len(seed))
    return (seed * reps)[:nbytes]


def page_of(key: str, nbytes: int, fmt: str = FORMAT) -> PageBuffer:
    return PageBuffer.from_bytes(page_bytes(key, nbytes), fmt)


class ServerProcess:
    """``tiercache serve`` as a child process; blocks until its ready line (sync helper).

    ``with ServerProcess(sock, "4MiB") as srv:`` starts it; leaving the block
    sends SIGTERM and waits.
    """

    def __init__(self, socket_path: str, arena_bytes: str = "8MiB", *extra: str) -> None:
        self.socket_path = socket_path
        self.args = [
            sys.executable,
            "-m",
            "tiercache",
            "serve",
            "--socket",
            socket_path,
            "--arena-bytes",
            arena_bytes,
            "--arena-path",
            str(Path(socket_path).with_suffix(".arena")),
            *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""

    def start(self, timeout_s: float = 20.0) -> Self:
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith(READY_PREFIX):
                self.ready_line = line
                return self
        self.kill()
        raise RuntimeError("tiercache serve did not get ready:\n" + "".join(seen))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def terminate(self, timeout_s: float = 20.0) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                self.kill()
