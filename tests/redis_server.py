"""A real ``redis-server`` on loopback for tests and benchmarks.

`RedisServer` starts the binary in a private temporary directory (no RDB, no
AOF), waits until it answers on its socket, and can be stopped (gracefully or
with SIGKILL, to simulate a crash) and started again on the same port and unix
socket within a test. Its methods block: call them from sync fixtures, or from
async tests through ``await asyncio.to_thread(server.kill)``.

`require_redis_server` skips the calling test when the binary is not
installed; nothing else is a reason to skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["RedisServer", "free_port", "redis_server_binary", "require_redis_server"]

_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    """Path of ``redis-server``, or ``None`` when it is not installed."""
    return shutil.which("redis-server")


def require_redis_server() -> str:
    """The ``redis-server`` path; skips the current test when it is missing."""
    import pytest

    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (and a unix socket).

    Args:
        binary: path of ``redis-server``.
        password: if set, the server runs with ``--requirepass``.
        extra_args: more command-line options, e.g. ``["--cluster-enabled", "yes"]``.
    """

    def __init__(
        self, binary: str, *, password: str | None = None, extra_args: list[str] | None = None
    ) -> None:
        self.binary = binary
        self.password = password
        self.extra_args = list(extra_args or [])
        # A short directory name: a unix socket path must fit in 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="tcredis-"))
        self.unix_socket = self.dir / "redis.sock"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix:///.../redis.sock?db=0`` (with ``password=`` when one is set)."""
        pw = f"&password={self.password}" if self.password else ""
        return f"unix://{self.unix_socket}?db=0{pw}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (on a new free port the first time, on the same port after).

        Raises:
            RuntimeError: it did not answer within 10 s (its log is in the message).
        """
        assert not self.running, "already running"
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            if self.port == 0 or attempt > 0:
                self.port = free_port()
            try:
                self._spawn()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise

    def _spawn(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.unix_socket),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if self._answers():
                return
            time.sleep(0.01)
        err = self._stop(kill=True)
        log = self.dir / "redis.log"
        detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server on port {self.port} did not start: {err}{detail}")

    def _answers(self) -> bool:
        """One PING over TCP: any RESP reply (``+PONG`` or ``-NOAUTH``) means it is up."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64)[:1] in (b"+", b"-")
        except OSError:
            return False

    def _stop(self, *, kill: bool) -> str:
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
            if kill:
                proc.kill()
            else:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
        return err

    def stop(self) -> None:
        """Stop gracefully (SIGTERM) and wait for the process. Idempotent."""
        self._stop(kill=False)

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), like a crash, and wait for the process."""
        self._stop(kill=True)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (a hung server)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """``kill`` then ``start`` on the same port and unix socket."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
