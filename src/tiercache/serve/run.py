"""Running a `NodeServer` as a process (``tiercache serve``) and asking one for its status.

`run_server` serves until SIGTERM or SIGINT, then drains (in-flight
requests finish, the write-behind queue is flushed within the drain
deadline) and returns 0. It prints one line when the socket accepts
connections, so that a supervisor (or a test) can wait for it::

    tiercache serve: ready socket=/run/tc.sock arena=/dev/shm/... arena_bytes=1073741824 pid=1234
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from tiercache.errors import TierCacheError
from tiercache.serve.client import ServeClient
from tiercache.serve.server import NodeServer

__all__ = ["READY_PREFIX", "run_server", "server_status"]

logger = logging.getLogger(__name__)

#: How the line that says the server is ready starts.
READY_PREFIX = "tiercache serve: ready"


async def _serve(server: NodeServer, metrics_port: int | None, metrics_addr: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    collector: Any = None
    httpd: Any = None
    try:
        async with server:
            if metrics_port is not None:
                collector, httpd = _start_metrics(server, metrics_port, metrics_addr)
            port = "" if httpd is None else f" metrics={metrics_addr}:{httpd.server_port}"
            print(
                f"{READY_PREFIX} socket={server.socket_path} arena={server.arena_path} "
                f"arena_bytes={server.arena_bytes} pid={os.getpid()}{port}",
                flush=True,
            )
            await stop.wait()
            print("tiercache serve: draining", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if httpd is not None:
            await asyncio.to_thread(httpd.shutdown)
            httpd.server_close()
        if collector is not None:
            collector.close()
    print("tiercache serve: stopped", flush=True)
    return 0


def _start_metrics(server: NodeServer, port: int, addr: str) -> tuple[Any, Any]:
    """Register the server's collector in a fresh registry and serve it on ``addr:port``."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise TierCacheError("--metrics-port needs prometheus_client (tiercache[metrics])") from e
    import tiercache.metrics

    registry = CollectorRegistry()
    collector = tiercache.metrics.register(server, registry, watch_loop=True)
    try:
        httpd, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        collector.close()
        raise TierCacheError(f"cannot serve metrics on {addr}:{port}: {e}") from e
    return collector, httpd


def run_server(
    server: NodeServer, *, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1"
) -> int:
    """Serve until SIGTERM / SIGINT in a new event loop (uvloop when installed); returns 0.

    Raises:
        TierCacheError: the server could not start (socket in use, bad storage, metrics port).
        OSError: the arena or the socket could not be created.
    """
    try:
        import uvloop

        return uvloop.run(_serve(server, metrics_port, metrics_addr))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve(server, metrics_port, metrics_addr))


async def _status(socket_path: str, timeout_s: float) -> dict[str, Any]:
    client = await ServeClient.connect(socket_path, timeout_s=timeout_s)
    try:
        out: dict[str, Any] = await client.call("status", {}, timeout_s=timeout_s)
        out["arena"] = client.hello.get("arena")
        out["pid"] = client.hello.get("pid")
        return out
    finally:
        await client.aclose()
        client.arena.close()


def server_status(socket_path: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """The counters of the server on ``socket_path`` (blocking; not on an event loop).

    Raises:
        StorageError: no server answers there, or it refused this process.
    """
    return asyncio.run(_status(socket_path, timeout_s))
