"""Reading an engine adapter's metrics as Prometheus does: over HTTP, in the text format."""

from __future__ import annotations

import socket
import urllib.request

#: The backend counters the collector exports, and the `BackendStats` field of each.
BACKEND_COUNTERS = {
    "tiercache_backend_exists_calls_total": "exists_calls",
    "tiercache_backend_get_pages_total": "get_pages",
    "tiercache_backend_get_hits_total": "get_hits",
    "tiercache_backend_set_pages_total": "set_pages",
    "tiercache_backend_set_written_total": "set_written",
    "tiercache_backend_read_bytes_total": "bytes_read",
    "tiercache_backend_written_bytes_total": "bytes_written",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """GET ``/metrics`` on loopback ``port``; every sample by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def port_is_free(port: int) -> bool:
    """Nothing listens on loopback ``port`` and a new server can bind it.

    The scrape's connection may linger in TIME_WAIT; a server binds past it
    with SO_REUSEADDR, as prometheus_client's does.
    """
    with socket.socket() as c:
        if c.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on loopback (two ranks or replicas)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
        return int(p)
    raise RuntimeError("no two adjacent free ports")
