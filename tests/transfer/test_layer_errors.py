"""A load that fails at a later layer does not fail the layers that landed before it.

`LayerDoneSet.wait_device` (the compute stream's wait on CUDA) and
`wait_sync` raise the load's error only for a layer that did not land. When
the load fails while queuing its copies, the copy stream is settled first,
so every layer already queued has landed (``mark_failed(settled=True)``).
The CUDA side is driven here with a recording stand-in for the compute
stream; the `gpu` test fails a real load at its second layer.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from tiercache.transfer.layer_done import LayerDoneSet

CUDA0 = torch.device("cuda", 0)


class RecordingStream:
    """Stands in for a CUDA stream: records the events it is told to wait for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def _in_thread(fn: Any, *args: Any) -> BaseException | None:
    """Run ``fn`` on another thread (wait_* refuse the loop's); return what it raised."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:
            out[0] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert not t.is_alive()
    return out[0]


async def test_wait_device_for_a_landed_layer_ignores_a_later_layers_error() -> None:
    done = LayerDoneSet(asyncio.get_running_loop(), 3, cuda=True, device=CUDA0)
    ev0 = object()
    done.mark_recorded(0, ev0)  # type: ignore[arg-type]
    done.mark_done(0)
    done.mark_failed(RuntimeError("layer 1 failed"))
    stream = RecordingStream()
    assert _in_thread(done.wait_device, 0, stream) is None
    assert stream.waited == [ev0]  # ordered on the layer's event, as usual
    err = _in_thread(done.wait_device, 1, stream)
    assert isinstance(err, RuntimeError) and "layer 1" in str(err)
    assert _in_thread(done.wait_sync, 0) is None
    assert isinstance(_in_thread(done.wait_sync, 2), RuntimeError)
    await done.wait(0)
    with pytest.raises(RuntimeError, match="layer 1"):
        await done.wait(1)


async def test_a_failure_after_the_stream_settled_lands_every_queued_layer() -> None:
    done = LayerDoneSet(asyncio.get_running_loop(), 4, cuda=True, device=CUDA0)
    events = [object(), object()]
    for i, ev in enumerate(events):
        done.mark_recorded(i, ev)  # type: ignore[arg-type]
    done.mark_failed(RuntimeError("queuing layer 2 failed"), settled=True)
    stream = RecordingStream()
    for i in range(2):
        assert _in_thread(done.wait_device, i, stream) is None
        assert done.is_done(i)
        await done.wait(i)
    assert stream.waited == events
    for i in (2, 3):
        assert isinstance(_in_thread(done.wait_device, i, stream), RuntimeError)
        with pytest.raises(RuntimeError):
            await done.wait(i)


async def test_without_settling_a_queued_layer_that_did_not_land_fails() -> None:
    """Waiting for layer 0's event failed: its bytes are not known to be there."""
    done = LayerDoneSet(asyncio.get_running_loop(), 2, cuda=True, device=CUDA0)
    done.mark_recorded(0, object())  # type: ignore[arg-type]
    done.mark_failed(RuntimeError("event wait failed"))
    assert isinstance(_in_thread(done.wait_device, 0, RecordingStream()), RuntimeError)
