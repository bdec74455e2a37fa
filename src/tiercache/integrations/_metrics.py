"""Prometheus metrics of an engine adapter: tiercache's collector, optionally served over HTTP.

Both engine adapters take the same options: ``metrics_port`` (serve the
adapter's metrics with ``prometheus_client.start_http_server`` on that port,
plus the tensor-parallel rank where the adapter has one; ``0`` picks a free
port), ``metrics_addr`` (the address it binds, ``0.0.0.0`` by default) and
``metrics_registry`` (a ``CollectorRegistry`` to register the collector in, for
a host application that serves its own). `AdapterMetrics` registers
`tiercache.metrics.TierCacheCollector` for the adapter's storage backend, on
the adapter's event loop, and undoes all of it on `AdapterMetrics.close`.

``prometheus_client`` stays optional: asking for metrics without it is a
`ConfigError` naming the option.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache._checks import is_int
from tiercache.errors import ConfigError
from tiercache.integrations._loop import LoopThread

if TYPE_CHECKING:
    from tiercache.metrics import TierCacheCollector

__all__ = ["AdapterMetrics", "MetricsOptions"]

logger = logging.getLogger(__name__)

#: How long `AdapterMetrics.close` waits for the HTTP server's thread.
_SERVER_JOIN_S = 5.0


def _port(port: object, option: Callable[[str], str]) -> int | None:
    """``metrics_port`` as an int in 0..65535, or None when not given."""
    if port is None:
        return None
    if not is_int(port) or not 0 <= operator.index(port) <= 65535:  # type: ignore[arg-type]
        raise ConfigError(f"{option('metrics_port')} must be a port number, got {port!r}")
    return operator.index(port)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    """The metrics options of an adapter, validated.

    ``enabled`` is false when neither a port nor a registry was given.
    """

    port: int | None = None
    addr: str = "0.0.0.0"
    registry: Any = None

    @property
    def enabled(self) -> bool:
        """A port or a registry was given."""
        return self.port is not None or self.registry is not None

    @classmethod
    def parse(
        cls,
        port: object = None,
        addr: object = None,
        registry: object = None,
        *,
        option: Callable[[str], str],
    ) -> MetricsOptions:
        """Validate the three options.

        Args:
            port: ``metrics_port``: ``None`` or an int in 0..65535.
            addr: ``metrics_addr``: ``None`` (``0.0.0.0``) or a non-empty str.
            registry: ``metrics_registry``: ``None`` or a ``prometheus_client.CollectorRegistry``.
            option: how the adapter names an option in messages
                (``"metrics_port"`` -> ``"extra_config['metrics_port']"``).

        Raises:
            ConfigError: a bad value, or metrics asked for and
                ``prometheus_client`` not installed; the message names the option.
        """
        port = _port(port, option)
        if addr is not None and (not isinstance(addr, str) or not addr):
            raise ConfigError(f"{option('metrics_addr')} must be a host address, got {addr!r}")
        if addr is not None and port is None:
            raise ConfigError(f"{option('metrics_addr')} is set without {option('metrics_port')}")
        if port is None and registry is None:
            return cls()
        asked = "metrics_port" if port is not None else "metrics_registry"
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise ConfigError(
                f"{option(asked)} needs the prometheus_client package: "
                "pip install 'tiercache[metrics]'"
            ) from None
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise ConfigError(
                f"{option('metrics_registry')} must be a prometheus_client CollectorRegistry, "
                f"got {type(registry).__name__}"
            )
        return cls(port=port, addr=addr or "0.0.0.0", registry=registry)


class AdapterMetrics:
    """The collector (and HTTP server) of one adapter.

    Args:
        options: the validated options (`MetricsOptions.enabled` must be true).
        loop: the adapter's loop thread; ``stats()`` of the watched backend
            runs on it at scrape time, and its lag is sampled.
        labels: constant labels of every sample (``engine``, ``tp_rank``, ...).
        rank: added to ``options.port`` (a port per rank on one host); ``None``
            when the adapter has no rank.
        option: how the adapter names an option in messages.

    Raises:
        ConfigError: the port cannot be bound (the message names the option
            and the port).

    The HTTP server starts here (when a port is given); the collector is
    registered by `attach`, once the adapter has a backend. Every method may be
    called from any thread, the loop's included; `close` not from the loop's.
    """

    def __init__(
        self,
        options: MetricsOptions,
        loop: LoopThread,
        *,
        labels: Mapping[str, str],
        rank: int | None = None,
        option: Callable[[str], str],
    ) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.options = options
        self.labels = dict(labels)
        self.registry = options.registry if options.registry is not None else CollectorRegistry()
        self._loop = loop
        self._option = option
        self._lock = threading.Lock()
        self._closed = False
        self.collector: TierCacheCollector | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        #: The port the server listens on (``None``: no server).
        self.port: int | None = None
        if options.port is not None:
            port = options.port + (rank or 0) if options.port else 0
            if port > 65535:
                raise ConfigError(
                    f"{option('metrics_port')} {options.port} + rank {rank} is past port 65535"
                )
            try:
                self._server, self._thread = start_http_server(
                    port, options.addr, registry=self.registry
                )
            except OSError as e:
                raise ConfigError(
                    f"{option('metrics_port')}: cannot serve metrics on {options.addr}:{port}: {e}"
                ) from None
            self.port = int(self._server.server_port)
            logger.info("tiercache metrics on http://%s:%d/metrics", options.addr, self.port)

    @property
    def thread(self) -> threading.Thread | None:
        """The HTTP server's thread (``None``: no server)."""
        return self._thread

    def attach(self, backend: Any) -> None:
        """Register the collector for ``backend`` (a `StorageBackend` on the adapter's loop).

        Does nothing after `close` or when a collector is already registered.

        Raises:
            ConfigError: the registry already exports tiercache's metric names
                (``metrics_registry`` holds another tiercache collector).
        """
        from tiercache.metrics import register

        with self._lock:
            if self._closed or self.collector is not None:
                return
            try:
                self.collector = register(
                    backend, self.registry, loop=self._loop.loop, labels=self.labels
                )
            except ValueError as e:
                raise ConfigError(
                    f"{self._option('metrics_registry')} already holds tiercache's metrics "
                    f"(one collector per registry): {e}"
                ) from None

    def close(self) -> None:
        """Stop the HTTP server, join its thread, unregister the collector. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            collector, self.collector = self.collector, None
        server, thread = self._server, self._thread
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(_SERVER_JOIN_S)
            if thread.is_alive():  # pragma: no cover - a scrape blocking forever
                logger.error("the tiercache metrics server thread did not stop")
        if collector is not None:
            collector.close()
