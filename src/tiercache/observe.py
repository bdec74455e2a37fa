"""Latency observations: the seam between the code that times work and whoever records it.

Two places in tiercache time their work and report it here: every copy job a
`tiercache.transfer.streams.CopyStream` runs (``kind="copy"``, ``op`` = the
stream's name) and every storage call the storage tier makes
(``kind="storage"``, ``op`` = ``"exists"``, ``"get"`` or ``"set"``, with the
outcome ``"ok"``, ``"error"``, or ``"cancelled"`` when the call timed out or
its caller was cancelled).

A sink is any object with an ``observe`` method (`LatencySink`);
`tiercache.metrics.TierCacheCollector` is one. With no sink added, `observe`
costs one tuple check. A sink added without a ``source`` sees the
observations of every cache in the process; one added with
``source=cache.controller.observe_source`` sees only that cache's (its copy
streams and its storage tier report with that token as the source).

`observe` is called from the event loop (storage calls) and from copy stream
worker threads (copies), so a sink must be thread-safe and must not block.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["LatencySink", "active", "add_sink", "observe", "remove_sink", "sinks"]


class LatencySink(Protocol):
    """Receives one timing per finished piece of work."""

    def observe(self, kind: str, op: str, seconds: float, outcome: str) -> None:
        """Record that ``op`` of ``kind`` took ``seconds`` and ended with ``outcome``.

        Called from the event loop or a worker thread; must not block or raise.
        """


# (sink, the source it listens to or None for every source)
_sinks: tuple[tuple[LatencySink, object | None], ...] = ()
_lock = threading.Lock()


def add_sink(sink: LatencySink, *, source: object | None = None) -> None:
    """Send every later observation of ``source`` (``None``: of any source) to ``sink`` too.

    Adding a sink that is already added changes nothing.
    """
    global _sinks
    with _lock:
        if all(s is not sink for s, _ in _sinks):
            _sinks = (*_sinks, (sink, source))


def remove_sink(sink: LatencySink) -> None:
    """Stop sending observations to ``sink`` (no error when it was not added)."""
    global _sinks
    with _lock:
        _sinks = tuple((s, src) for s, src in _sinks if s is not sink)


def active() -> bool:
    """Whether any sink listens (a caller may skip timing what nobody reads)."""
    return bool(_sinks)


def sinks() -> tuple[LatencySink, ...]:
    """The sinks observations go to now."""
    return tuple(s for s, _ in _sinks)


def observe(
    kind: str, op: str, seconds: float, outcome: str = "ok", *, source: object | None = None
) -> None:
    """Hand one timing of ``source`` to the sinks that listen to it. Any thread.

    A sink that raises is ignored.
    """
    for sink, wanted in _sinks:
        if wanted is not None and wanted is not source:
            continue
        try:
            sink.observe(kind, op, seconds, outcome)
        except Exception:  # a broken sink must never break a copy or a storage call
            pass
