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

import concurrent.futures
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "LocalRedisCluster",
    "RedisServer",
    "free_port",
    "redis_server_binary",
    "require_redis_cluster",
    "require_redis_server",
]

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


def free_port(*, cluster: bool = False) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    ``cluster``: a port for a cluster node, whose cluster bus listens on
    ``port + 10000``: both must be free, so the port is at most 55535.
    """
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 55535)
        try:
            with (
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a,
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b,
            ):
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


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
                self.port = free_port(cluster="--cluster-enabled" in self.extra_args)
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


def require_redis_cluster() -> tuple[str, str]:
    """``(redis-server, redis-cli)`` paths; skips the current test when either is missing.

    Debian's ``redis-server`` package depends on ``redis-tools``, which holds
    ``redis-cli``: where one is installed, so is the other.
    """
    import pytest

    server = require_redis_server()
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
    return server, cli


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on loopback.

    Every node is a `RedisServer` with cluster mode on and
    ``cluster-require-full-coverage no`` (a failed master costs only its own
    slots; the others keep serving). The cluster is created with
    ``redis-cli --cluster create ... --cluster-replicas N --cluster-yes``.
    Replicas never fail over by themselves (``cluster-replica-no-failover
    yes``): a test promotes one with `promote`, so it controls when the
    topology changes. Methods block; call them off the event loop.
    """

    def __init__(
        self,
        server: str,
        cli: str,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
    ):
        self.cli = cli
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--cluster-replica-no-failover", "yes",
        ]  # fmt: skip
        self.nodes = [RedisServer(server, extra_args=args) for _ in range((1 + replicas) * masters)]
        self.num_masters = masters

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<port of a master>`` (any node would do)."""
        return f"redis+cluster://127.0.0.1:{self.masters()[0].port}"

    def command(self, node: RedisServer, *args: str, timeout: float = 10) -> str:
        """Run ``redis-cli -p PORT ARGS...`` against ``node``; its stdout."""
        r = subprocess.run(
            [self.cli, "-h", "127.0.0.1", "-p", str(node.port), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} on {node.port}: {r.stderr}{r.stdout}")
        return r.stdout

    def start(self) -> None:
        """Start the nodes, create the cluster, wait until every node agrees it is ok."""
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(RedisServer.start, self.nodes))
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        r = subprocess.run(
            [self.cli, "--cluster", "create", *addrs]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout}{r.stderr}")
        self.wait_until(lambda: all(self._ok(n) for n in self.nodes), "the cluster to be ok")
        self.wait_until(
            lambda: (
                len(self.masters()) == self.num_masters
                and all(self.replica_of(m) is not None or not self.replicas for m in self.masters())
            ),
            "every master to have a replica",
        )

    def _ok(self, node: RedisServer) -> bool:
        info = self.command(node, "CLUSTER", "INFO")
        return "cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}" in info

    def _nodes_table(self) -> list[list[str]]:
        live = next(n for n in self.nodes if n.running)
        return [line.split() for line in self.command(live, "CLUSTER", "NODES").splitlines()]

    def _by_port(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters owning slots, as a live node sees it."""
        out = []
        for f in self._nodes_table():
            flags = f[2].split(",")
            if "master" in flags and "fail" not in flags and len(f) > 8:
                node = self._by_port(int(f[1].split("@")[0].rsplit(":", 1)[1]))
                if node.running:
                    out.append(node)
        return out

    def replica_of(self, master: RedisServer) -> RedisServer | None:
        """The running replica of ``master``, or ``None``."""
        table = self._nodes_table()
        ids = {int(f[1].split("@")[0].rsplit(":", 1)[1]): f[0] for f in table}
        for f in table:
            if "slave" in f[2].split(",") and f[3] == ids.get(master.port):
                node = self._by_port(int(f[1].split("@")[0].rsplit(":", 1)[1]))
                if node.running:
                    return node
        return None

    def keyslot(self, key: str) -> int:
        """The hash slot of ``key``, as the server computes it."""
        return int(self.command(self.masters()[0], "CLUSTER", "KEYSLOT", key))

    def slots_of(self, master: RedisServer) -> set[int]:
        """The slots ``master`` owns."""
        for f in self._nodes_table():
            if int(f[1].split("@")[0].rsplit(":", 1)[1]) == master.port:
                out: set[int] = set()
                for r in f[8:]:
                    if r.startswith("["):
                        continue  # a slot being migrated
                    lo, _, hi = r.partition("-")
                    out.update(range(int(lo), int(hi or lo) + 1))
                return out
        return set()

    def wait_replicated(self) -> None:
        """Wait until every replica has every write its master accepted."""

        def offsets_equal() -> bool:
            for m in self.masters():
                replica = self.replica_of(m)
                if replica is None:
                    continue
                mo = _info_field(self.command(m, "INFO", "replication"), "master_repl_offset")
                ro = _info_field(self.command(replica, "INFO", "replication"), "slave_repl_offset")
                if mo != ro:
                    return False
            return True

        self.wait_until(offsets_equal, "the replicas to catch up")

    def promote(self, replica: RedisServer) -> None:
        """``CLUSTER FAILOVER TAKEOVER`` on ``replica``; wait until it serves as a master."""
        self.command(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
        self.wait_until(
            lambda: (
                "role:master" in self.command(replica, "INFO", "replication")
                and all(replica in self._masters_seen_by(n) for n in self.nodes if n.running)
            ),
            f"node {replica.port} to be a master for every node",
        )

    def _masters_seen_by(self, node: RedisServer) -> list[RedisServer]:
        out = []
        for line in self.command(node, "CLUSTER", "NODES").splitlines():
            f = line.split()
            if "master" in f[2].split(",") and len(f) > 8:
                out.append(self._by_port(int(f[1].split("@")[0].rsplit(":", 1)[1])))
        return out

    @staticmethod
    def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
        """Poll ``check`` every 50 ms. Raises: RuntimeError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if check():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}")

    def close(self) -> None:
        """Stop every node and remove their directories."""
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(RedisServer.close, self.nodes))

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _info_field(info: str, name: str) -> str | None:
    for line in info.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None
