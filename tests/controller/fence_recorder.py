"""A recording stand-in for CUDA streams and events, for the ordering rules on a CPU.

`FenceRecorder` makes a CPU controller take its CUDA path for ``ready``
(events recorded on streams, waited for by the copy streams) with stand-ins
that record instead of queuing GPU work: every event remembers the stream it
was recorded on (its ``label``), and every copy stream's ``wait_for`` and
copy is appended to ``log`` in order, so a test reads which fences each copy
waited for before it moved a byte. An event is unfinished until the test
marks it ``finished`` (as `torch.cuda.Event.query` would say).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tiercache.ready_fences as ready_fences_module
from tiercache import TierController
from tiercache.transfer.engine import CopyEngine
from tiercache.transfer.streams import CopyStream


class FakeStream(torch.cuda.Stream):
    """A named stream of the pool's device."""

    def __new__(cls, name: str, device: torch.device) -> FakeStream:  # noqa: ARG004
        return object.__new__(cls)

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self._device = device
        self.waited: str | None = None

    def wait_event(self, event: Any) -> None:
        """A side stream that waits for ``event``: what it records next marks what ``event`` marked."""
        self.waited = getattr(event, "label", repr(event))

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent(torch.cuda.Event):
    """An event: ``label`` names what it marks (the stream it was recorded on)."""

    def __new__(cls, label: str = "") -> FakeEvent:  # noqa: ARG004
        return object.__new__(cls)

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.finished = False

    def record(self, stream: Any = None) -> None:
        waited = getattr(stream, "waited", None)
        self.label = waited if waited is not None else getattr(stream, "name", repr(stream))

    def query(self) -> bool:
        return self.finished

    def __repr__(self) -> str:
        return f"FakeEvent({self.label})"


class FenceRecorder:
    """Install the stand-ins on ``controller`` (a CPU one) for the rest of the test.

    Attributes:
        log: ``(stream name, "job", "")`` when a copy job starts, then its
            ``(stream name, "wait", event label)`` and ``(stream name, "copy", "")``
            entries, in the order the copy streams saw them.
        current: the stream `torch.cuda.current_stream` returns (the calling thread's).
    """

    def __init__(self, controller: TierController, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events: list[FakeEvent] = []
        device = controller.device_pool.device
        self.current = FakeStream("current", device)
        monkeypatch.setattr(controller._fences, "_cuda", True)
        # The side stream that pins a caller's event at submission (`ready_event`).
        monkeypatch.setattr(controller._fences, "_ready_stream", FakeStream("pin", device))
        monkeypatch.setattr(controller._copies, "_pinned_indices", lambda indices: indices)
        monkeypatch.setattr(ready_fences_module, "new_event", self._new_event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        log = self.log

        def wait_for(stream: CopyStream, event: Any) -> None:
            if event is not None:
                log.append((stream.name, "wait", getattr(event, "label", repr(event))))

        def backup_all_layers(engine: CopyEngine, plan: Any) -> None:
            log.append(("write", "copy", ""))
            real_backup(engine, plan)

        def load_all_layers(engine: CopyEngine, plan: Any, *args: Any, **kw: Any) -> None:
            log.append(("load", "copy", ""))
            real_load(engine, plan, *args, **kw)

        real_backup, real_load = CopyEngine.backup_all_layers, CopyEngine.load_all_layers
        real_submit, real_inline = CopyStream.submit, CopyStream.run_inline

        def marked(stream: CopyStream, job: Any) -> Any:
            def run() -> Any:
                log.append((stream.name, "job", ""))
                return job()

            return run

        monkeypatch.setattr(CopyStream, "submit", lambda s, job: real_submit(s, marked(s, job)))
        monkeypatch.setattr(CopyStream, "run_inline", lambda s, job: real_inline(s, marked(s, job)))
        monkeypatch.setattr(CopyStream, "wait_for", wait_for)
        monkeypatch.setattr(CopyEngine, "backup_all_layers", backup_all_layers)
        monkeypatch.setattr(CopyEngine, "load_all_layers", load_all_layers)

    def _new_event(self) -> FakeEvent:
        ev = FakeEvent()
        self.events.append(ev)
        return ev

    def stream(self, name: str, device: torch.device) -> FakeStream:
        return FakeStream(name, device)

    def event(self, label: str) -> FakeEvent:
        ev = FakeEvent(label)
        self.events.append(ev)
        return ev

    def copies(self, stream: str) -> list[list[str]]:
        """For each copy job on ``stream``, in order, the labels it waited for before its copy
        (all of them, for a job that failed before it copied)."""
        out: list[list[str]] = []
        copied = True
        for name, what, label in self.log:
            if name != stream:
                continue
            if what == "job":
                out.append([])
                copied = False
            elif what == "wait" and not copied:
                out[-1].append(label)
            elif what == "copy":
                copied = True
        return out

    def finish_all(self) -> None:
        for ev in self.events:
            ev.finished = True
