"""Deadlines and the fault policy of the backend, as SGLang's threads see them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from tests.integrations.sglang import sglang_helpers as h
from tests.integrations.stuck_io import StuckReads

pytestmark = pytest.mark.sglang


def _backend(url: str, host: Any, **options: Any) -> Any:
    config = h.storage_config(extra_config=h.extra(url, **options), model_name="m")
    backend = h.sg().StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def _host() -> Any:
    g = h.Geometry()
    host = h.host_pool(g, h.device_pool(g))
    h.fill_random(host, 0)
    return host


def _wait(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def test_a_hung_store_costs_one_deadline_and_is_a_miss(redis_server: Any) -> None:
    host = _host()
    b = _backend(redis_server.url, host, timeout_s=0.3, fault_policy="none")
    keys = h.chain(list(range(16)), 4)
    idx = torch.arange(16)
    try:
        assert b.batch_set_v1(keys, idx) == [True] * 4
        redis_server.pause()  # the server stops answering; connections stay open
        t0 = time.monotonic()
        assert b.batch_get_v1(keys, torch.arange(32, 48)) == [False] * 4
        assert b.batch_exists(keys) == 0
        elapsed = time.monotonic() - t0
        assert 0.5 <= elapsed < 3.0  # two calls, one deadline each
        assert b.stats()["timeouts"] == 2
        redis_server.resume()
        assert b.batch_exists(keys) == 4
    finally:
        redis_server.resume()
        b.close()


def test_auto_reconnect_stops_calling_a_dead_store_and_resumes_when_it_answers(
    redis_server: Any,
) -> None:
    host = _host()
    b = _backend(
        redis_server.url,
        host,
        timeout_s=1.0,
        fault_threshold=2,
        reconnect_backoff_s=0.05,
        reconnect_backoff_max_s=0.2,
    )
    keys = h.chain(list(range(16)), 4)
    idx = torch.arange(16)
    try:
        redis_server.kill()
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, idx) == [False] * 4
        s = b.stats()
        assert s["outages"] == 1 and s["down"] is True
        # Down: calls return at once without reaching the store.
        t0 = time.monotonic()
        assert b.batch_get_v1(keys, idx) == [False] * 4
        assert time.monotonic() - t0 < 0.5
        assert b.stats()["skipped_while_down"] == 1

        redis_server.start()
        _wait(lambda: not b.stats()["down"])
        assert b.stats()["reconnects"] == 1
        assert b.batch_set_v1(keys, idx) == [True] * 4
        assert b.batch_exists(keys) == 4
    finally:
        b.close()


def test_auto_detach_stops_calling_the_store_for_good(redis_server: Any) -> None:
    host = _host()
    b = _backend(redis_server.url, host, fault_policy="auto_detach", fault_threshold=1)
    keys = h.chain(list(range(8)), 4)
    try:
        redis_server.kill()
        assert b.batch_exists(keys) == 0
        redis_server.start()
        time.sleep(0.3)
        assert b.batch_exists(keys) == 0
        s = b.stats()
        assert s["down"] is True and s["reconnects"] == 0 and s["skipped_while_down"] == 1
    finally:
        b.close()


@pytest.mark.parametrize(
    "faults",
    [
        "fault=hang",  # close ends it: the closed backend raises in it
        "fault=latency&fault_delay=60",  # close cancels it on the loop
    ],
)
def test_a_call_that_close_cuts_short_is_not_an_error(faults: str) -> None:
    host = _host()
    b = _backend(f"faulty+memory://?{faults}&fault_ops=exists", host, timeout_s=60.0)
    keys = h.chain(list(range(8)), 4)
    answers: list[int] = []
    caller = threading.Thread(target=lambda: answers.append(b.batch_exists(keys)))
    try:
        caller.start()
        _wait(lambda: b.backend.total_injected == 1)  # the call is in flight
        b.close()
        caller.join(10)
        assert answers == [0]  # a miss for SGLang, as ever
        s = b.stats()
        assert (s["errors"], s["timeouts"], s["cancelled"]) == (0, 0, 1), s
        assert s["outages"] == 0  # nor a failure for the fault policy
    finally:
        b.close()
        caller.join(10)


def test_a_read_stuck_in_the_file_system_holds_the_call_until_it_lands(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang frees and reuses the host slots of a prefetch that missed. A read
    # stuck in the kernel outlives the deadline; the call must not return
    # while it can still write into those slots.
    host = _host()
    b = _backend(f"file://{tmp_path}", host, timeout_s=0.3, fault_policy="none")
    keys = h.chain(list(range(16)), 4)
    try:
        assert b.batch_set_v1(keys, torch.arange(16)) == [True] * 4
        stuck = StuckReads(monkeypatch, hold_s=30)
        stuck.release_after(7.0)  # past the deadline and the old grace
        target = torch.arange(32, 48)
        assert b.batch_get_v1(keys, target) == [False] * 4  # a miss: past the deadline
        assert stuck.running == 0
        # SGLang reuses the slots for another request's KV.
        host.kv_buffer[:, 32:48].zero_()
        stuck.gate.set()
        _wait(lambda: stuck.running == 0)
        time.sleep(0.1)
        assert not host.kv_buffer[:, 32:48].any()
        assert b.stats()["timeouts"] == 1
    finally:
        b.close()
