"""`ReadyFences`: where a controller's copies are ordered against the caller's CUDA work.

A copy stream waits for one event per operation before it touches the
slots: the event named by the caller's ``ready`` (its producer for a
write, the last readers of the slots a load fills), resolved here in the
submitting call, on the caller's thread. On a CPU device the caller's work
is done when it calls, and nothing is recorded.
"""

from __future__ import annotations

import torch

from tiercache.errors import InvalidInputError
from tiercache.transfer.streams import new_event

__all__ = ["Ready", "ReadyFences"]

#: What a caller may name as the producer (writes) or the last reader (loads)
#: of the slots it hands over: an event recorded after that work, or the
#: stream it was queued on (an event is recorded on it at submission).
Ready = torch.cuda.Event | torch.cuda.Stream | None


class ReadyFences:
    """Resolves ``ready`` into the event a copy stream waits for (`TierController.ready_event`).

    Args:
        device: the device pool's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        #: No fence to resolve: a CPU device (``ready`` must then be ``None``).
        self.cpu = not self._cuda
        #: The stream the engine's forward pass runs on (`use_compute_stream`).
        self.compute_stream: torch.cuda.Stream | None = None
        #: CUDA: the side stream where a caller's event is pinned; made on first use.
        self._ready_stream: torch.cuda.Stream | None = None

    def resolve(self, ready: Ready, what: str) -> torch.cuda.Event | None:
        """`TierController.ready_event`."""
        device = self.device
        if not self._cuda:
            if ready is not None:
                raise InvalidInputError(
                    f"{what}: ready names a CUDA stream or event, but the device pool is on {device}"
                )
            return None
        if ready is None:
            ev = new_event()
            ev.record(self.compute_stream or torch.cuda.current_stream(device))
            return ev
        if isinstance(ready, torch.cuda.Event):
            side = self._ready_stream
            if side is None:
                side = self._ready_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_event(ready)  # the event as recorded now
            ev = new_event()
            ev.record(side)
            return ev
        if isinstance(ready, torch.cuda.Stream):
            if ready.device != device:
                raise InvalidInputError(
                    f"{what}: ready is a stream of {ready.device}, the pool is on {device}"
                )
            ev = new_event()
            ev.record(ready)
            return ev
        raise InvalidInputError(
            f"{what}: ready must be a torch.cuda.Event, a torch.cuda.Stream or None, "
            f"got {type(ready).__name__}"
        )

    def use_compute_stream(self, stream: torch.cuda.Stream | None) -> None:
        """`TierController.use_compute_stream`."""
        if stream is not None:
            device = self.device
            if not self._cuda or not isinstance(stream, torch.cuda.Stream):
                raise InvalidInputError(
                    f"use_compute_stream: needs a torch.cuda.Stream of the pool's device ({device})"
                )
            if stream.device != device:
                raise InvalidInputError(
                    f"use_compute_stream: a stream of {stream.device}, the pool is on {device}"
                )
        self.compute_stream = stream
