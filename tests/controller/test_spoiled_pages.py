"""Pages a failed copy left without their KV are never loaded or backed up.

A `write` returns its host slots at once; if the device->host copy then fails
(only a warning in the log), those slots hold whatever they held before. A
later `load` of them would bring that back as if it were the KV, and a storage
backup would store it under the tokens' keys with a valid checksum. The ledger
marks such pages spoiled: both are refused with a `StateError` until the pages
are filled again or freed. The same holds for the device slots of a failed load.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.errors import StateError
from tiercache.transfer.engine import CopyEngine

PS = 16


def make() -> TierController:
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    dev = DeviceKVPool(lay, 256)
    for buf in dev.buffers:
        for t in buf:
            t.fill_(7.0)
    return TierController(dev, HostKVPool(lay, 512), inline_copy_bytes=0)


def scattered(c: TierController, pages: int) -> torch.Tensor:
    """Device slots of ``pages`` pages, every other page of a larger allocation."""
    got = c.device_allocator.alloc(2 * pages * PS)
    assert got is not None
    return got.view(-1, PS)[::2].reshape(-1).clone()


@pytest.fixture
def failing_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: CopyEngine, plan: Any) -> None:
        raise RuntimeError("injected write failure")

    monkeypatch.setattr(CopyEngine, "backup_all_layers", fail)


async def test_a_load_of_host_slots_whose_write_failed_is_refused(
    failing_writes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make() as c:
        dev = scattered(c, 4)
        host = c.write(dev)  # the seed's verb: the host slots, at once
        assert host is not None
        await c.wait_idle()
        (ack,) = c.drain_acks()
        assert ack.failed()
        monkeypatch.undo()
        with pytest.raises(StateError, match="hold no KV"):
            c.load(host)
        with pytest.raises(StateError, match="hold no KV"):
            await c.load_back(host)
        assert c.device_allocator.used == 8 * PS  # the refused loads took nothing
        # Freed and written again, the slots hold KV: they load.
        c.free_host(host)
        host = await c.backup(dev)
        assert host is not None
        back = await c.load_back(host)
        assert back is not None
        assert torch.equal(c.device_pool.buffers[0][0][back], c.device_pool.buffers[0][0][dev])
        c.ledger.check_invariants()


async def test_a_backup_to_storage_of_host_slots_whose_write_failed_is_refused(
    failing_writes: None,
) -> None:
    async with make() as c:
        await c.attach_storage_backend("memory://")
        dev = scattered(c, 2)
        ack = c.submit_write(dev)
        assert ack is not None
        with pytest.raises(RuntimeError, match="injected"):
            await ack
        tokens = list(range(2 * PS))
        with pytest.raises(StateError, match="hold no KV"):
            c.write_storage(ack.host_indices, tokens)
        c.free_host(ack.host_indices)


async def test_a_backup_of_device_slots_whose_load_failed_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make() as c:
        src = scattered(c, 2)
        host = await c.backup(src)
        assert host is not None

        def fail(self: CopyEngine, i: int, plan: Any) -> None:
            raise RuntimeError("injected load failure")

        monkeypatch.setattr(CopyEngine, "load_layer", fail)
        ack = c.submit_load(host)
        assert ack is not None
        c.start_loading()
        with pytest.raises(RuntimeError, match="injected"):
            await ack
        monkeypatch.undo()
        with pytest.raises(StateError, match="hold no KV"):
            c.submit_write(ack.device_indices)
        c.free_device(ack.device_indices)
        c.ledger.check_invariants()
