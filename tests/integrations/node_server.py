"""`tiercache serve` in a child process, as an operator runs it, for the engine suites.

`NodeServer` starts ``python -m tiercache serve --socket PATH --arena-bytes N``
and waits for its socket to appear; its `url` is what an engine is given
(``tiercache+unix:///PATH``). `run_engine_process` runs one engine process (a
module of the suite, with ``python -m``) and returns what it printed, so that
a test can drive two engine processes against one server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: How long the server may take to show its socket (it imports torch first).
START_S = 60.0


class NodeServer:
    """One ``tiercache serve`` process with its socket in a fresh short folder.

    A Unix socket's path is limited to about 100 bytes, so the folder is made
    under the system's temporary directory, not under pytest's (long) one.
    """

    def __init__(self, arena_bytes: int = 64 << 20, storage_url: str | None = None) -> None:
        self.arena_bytes = arena_bytes
        self.storage_url = storage_url
        self._dir = Path(tempfile.mkdtemp(prefix="tcs-"))
        self.socket = self._dir / "cache.sock"
        self._log = self._dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The storage URL engines are given."""
        return f"tiercache+unix://{self.socket}"

    @property
    def pid(self) -> int:
        """The server's process id (it must be running)."""
        assert self._proc is not None, "the server is not running"
        return self._proc.pid

    def start(self) -> NodeServer:
        """Start the server and wait until its socket exists.

        Raises:
            RuntimeError: it exited, or showed no socket within `START_S`
                (the message holds its output).
        """
        cmd = [sys.executable, "-m", "tiercache", "serve", "--socket", str(self.socket)]
        cmd += ["--arena-bytes", str(self.arena_bytes)]
        if self.storage_url is not None:
            cmd += ["--storage-url", self.storage_url]
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while not self.socket.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tiercache serve did not start: {self.output()}")
            time.sleep(0.05)
        return self

    def output(self) -> str:
        """What the server printed so far."""
        try:
            return self._log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (the server drains and exits), SIGKILL if it does not within 30 s."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> NodeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def run_engine_process(module: str, args: dict[str, Any], timeout: float = 280.0) -> Any:
    """Run ``python -m module`` with ``args`` as JSON on its stdin; returns its JSON answer.

    The process prints one JSON line last; anything else it prints (engine
    logs) is kept for the failure message.

    Raises:
        AssertionError: it failed or printed no answer (with its output).
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, (
        f"{module} exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    )
    return json.loads(lines[-1])
