"""Latency observations: the seam between the code that times work and whoever records it.

Two places in tiercache time their work and report it here: every copy job a
`tiercache.transfer.streams.CopyStream` runs (``kind="copy"``, ``op`` = the
stream's name) and every storage call the storage tier makes
(``kind="storage"``, ``op`` = ``"exists"``, ``"get"`` or ``"set"``, with the
outcome ``"ok"``, ``"error"``, or ``"cancelled"`` when the call timed out or
its caller was cancelled).

A sink is any object with an ``observe`` method (`LatencySink`);
`tiercache.metrics.TierCacheCollector` is one. With no sink added, `observe`
costs one tuple check. Sinks are process-wide: they see the observations of
every cache in the process.

`observe` is called from the event loop (storage calls) and from copy stream
worker threads (copies), so a sink must be thread-safe and must not block.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["LatencySink", "add_sink", "observe", "remove_sink", "sinks"]


class LatencySink(Protocol):
    """Receives one timing per finished piece of work."""

    def observe(self, kind: str, op: str, seconds: float, outcome: str) -> None:
        """Record that ``op`` of ``kind`` took ``seconds`` and ended with ``outcome``.

        Called from the event loop or a worker thread; must not block or raise.
        """


_sinks: tuple[LatencySink, ...] = ()
_lock = threading.Lock()


def add_sink(sink: LatencySink) -> None:
    """Send every later observation to ``sink`` too (adding one twice adds it once)."""
    global _sinks
    with _lock:
        if sink not in _sinks:
            _sinks = (*_sinks, sink)


def remove_sink(sink: LatencySink) -> None:
    """Stop sending observations to ``sink`` (no error when it was not added)."""
    global _sinks
    with _lock:
        _sinks = tuple(s for s in _sinks if s is not sink)


def sinks() -> tuple[LatencySink, ...]:
    """The sinks observations go to now."""
    return _sinks


def observe(kind: str, op: str, seconds: float, outcome: str = "ok") -> None:
    """Hand one timing to every sink. Any thread; a sink that raises is ignored."""
    for sink in _sinks:
        try:
            sink.observe(kind, op, seconds, outcome)
        except Exception:  # a broken sink must never break a copy or a storage call
            pass
