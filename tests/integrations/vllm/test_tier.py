"""tiercache as a vLLM secondary tier, driven by vLLM's own factory and manager."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests.integrations.stuck_io import StuckReads
from tests.integrations.vllm.engine import require_vllm

require_vllm()

from tests.integrations.vllm.harness import (  # noqa: E402
    Instance,
    make_keys,
    names,
    offloading_config,
    payloads,
    tier_config,
)
from tests.redis_server import RedisServer, require_redis_server  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tiercache.errors import BackendUnavailableError, ConfigError  # noqa: E402
from tiercache.integrations.vllm import TIER_KEYS, TierCacheTier  # noqa: E402
from tiercache.storage import register_backend, unregister_backend  # noqa: E402
from tiercache.storage.faults import FaultyBackend  # noqa: E402

pytestmark = pytest.mark.vllm

HIT, MISS, RETRY, HIT_PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)
BLOCK = 4096
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in reversed(made):
        inst.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer(require_redis_server()) as server:
        yield server


@pytest.fixture
def faulty_file() -> Iterator[None]:
    register_backend("faulty+file", FaultyBackend)
    yield
    unregister_backend("faulty+file")


def tiercache_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tiercache")]


def test_factory_builds_the_tier_from_the_module_path(tmp_path: Path) -> None:
    spec = TieringOffloadingSpec(offloading_config([tier_config(f"file://{tmp_path}")]))
    view = memoryview(np.zeros((8, BLOCK), dtype=np.int8))
    tier = SecondaryTierFactory.create_secondary_tier(
        tier_config(f"file://{tmp_path}", timeout_s=3.5), view, spec
    )
    try:
        assert isinstance(tier, TierCacheTier)
        assert tier.tier_type == "TierCacheTier"
        assert tier.block_size_bytes == BLOCK
        assert tier._timeout_s == 3.5
    finally:
        tier.shutdown()
    assert tiercache_threads() == []


def test_the_manager_vllm_builds_holds_the_tier(tmp_path: Path, instances: list[Instance]) -> None:
    inst = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(inst)
    assert isinstance(inst.tier, TierCacheTier)
    assert inst.tier.block_size_bytes == inst.row_bytes


@pytest.mark.parametrize(
    "options",
    [
        {"url": ""},
        {"url": "nosuchscheme://x"},
        {"backend_options": {"no_such_option": 1}},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"max_probe_batch": 0},
        {"max_probe_batch": True},
        {"locality": "NEARBY"},
        {"enable_kv_events": "maybe"},
    ],
    ids=[
        "empty-url",
        "unknown-scheme",
        "unknown-backend-option",
        "zero-timeout",
        "nan-timeout",
        "zero-batch",
        "bool-batch",
        "unknown-locality",
        "unreadable-kv-events",
    ],
)
def test_bad_options_are_config_errors(tmp_path: Path, options: dict[str, object]) -> None:
    spec = TieringOffloadingSpec(offloading_config([tier_config(f"file://{tmp_path}")]))
    view = memoryview(np.zeros((8, BLOCK), dtype=np.int8))
    with pytest.raises(ConfigError):
        SecondaryTierFactory.create_secondary_tier(
            {**tier_config(f"file://{tmp_path}"), **options}, view, spec
        )
    assert tiercache_threads() == []


def test_an_unknown_key_is_a_config_error_naming_it(tmp_path: Path) -> None:
    spec = TieringOffloadingSpec(offloading_config([tier_config(f"file://{tmp_path}")]))
    view = memoryview(np.zeros((8, BLOCK), dtype=np.int8))
    entry = {**tier_config(f"file://{tmp_path}"), "timout_s": 3}
    with pytest.raises(ConfigError, match=r"'timout_s'.*'timeout_s'"):
        SecondaryTierFactory.create_secondary_tier(entry, view, spec)
    assert tiercache_threads() == []
    params = inspect.signature(TierCacheTier).parameters.values()
    assert TIER_KEYS == {p.name for p in params if p.kind is p.KEYWORD_ONLY}


def _share(url: str, instances: list[Instance], n: int = 6) -> None:
    a = Instance([tier_config(url)])
    instances.append(a)
    keys, data = make_keys(n), payloads(n, BLOCK)
    a.store(keys, data)

    b = Instance([tier_config(url)])  # a fresh CPU tier, the same storage
    instances.append(b)
    ctx = b.request()
    history = b.lookup_until_settled(keys, ctx)
    steps = names(history)
    assert steps[0] == ["RETRY"] * n, steps  # the existence query runs off the scheduler
    assert ["HIT_PENDING"] * n in steps, steps  # found: vLLM promotes them
    assert steps[-1] == ["HIT"] * n, steps
    assert b.load(keys, ctx, BLOCK) == data


def test_instance_b_loads_what_instance_a_stored_in_files(
    tmp_path: Path, instances: list[Instance]
) -> None:
    _share(f"file://{tmp_path}", instances)


@pytest.mark.redis
def test_instance_b_loads_what_instance_a_stored_in_redis(
    own_redis: RedisServer, instances: list[Instance]
) -> None:
    _share(own_redis.url, instances)


def test_lookup_answers_retry_while_the_query_runs(
    tmp_path: Path, instances: list[Instance], faulty_file: None
) -> None:
    a = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(a)
    keys, data = make_keys(2), payloads(2, BLOCK)
    a.store(keys, data)

    plan = "fault=latency&fault_ops=exists&fault_delay=1.0"
    b = Instance([tier_config(f"faulty+file://{tmp_path}?{plan}")])
    instances.append(b)
    ctx = b.request()
    assert [b.manager.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    b.step()  # the query starts; the backend takes 1 s to answer
    t0 = time.monotonic()
    assert [b.manager.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    assert time.monotonic() - t0 < 0.5  # the scheduler did not wait for it
    history = b.lookup_until_settled(keys, ctx)
    assert names(history)[-1] == ["HIT", "HIT"]
    assert b.load(keys, ctx, BLOCK) == data


def test_a_block_never_stored_is_a_miss(tmp_path: Path, instances: list[Instance]) -> None:
    b = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(b)
    ctx = b.request()
    history = b.lookup_until_settled(make_keys(3), ctx)
    assert names(history) == [["RETRY"] * 3, ["MISS"] * 3]


def test_a_miss_told_to_one_request_is_asked_again_for_the_next(
    tmp_path: Path, instances: list[Instance]
) -> None:
    url = f"file://{tmp_path}"
    a = Instance([tier_config(url)])
    instances.append(a)
    keys, data = make_keys(2), payloads(2, BLOCK)
    early = a.request()  # still running while the blocks get stored
    assert names(a.lookup_until_settled(keys, early))[-1] == ["MISS", "MISS"]
    # The request told MISS keeps its answer: no query per lookup.
    assert [a.tier.lookup(k, early) for k in keys] == [MISS, MISS]

    b = Instance([tier_config(url)])  # another instance sharing the store
    instances.append(b)
    b.store(keys, data)

    late = a.request()
    history = names(a.lookup_until_settled(keys, late))
    assert history[0] == ["RETRY", "RETRY"], history  # a new query, not the old verdict
    assert history[-1] == ["HIT", "HIT"], history
    assert a.load(keys, late, BLOCK) == data


def test_request_finishing_before_its_query_leaves(
    tmp_path: Path, instances: list[Instance]
) -> None:
    a = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(a)
    keys = make_keys(2)
    a.store(keys, payloads(2, BLOCK))
    tier = a.tier
    early = a.request()
    assert [tier.lookup(k, early) for k in keys] == [RETRY, RETRY]  # queued
    tier.on_request_finished(early)  # gone before the end of the step
    late = a.request()
    assert [tier.lookup(k, late) for k in keys] == [RETRY, RETRY]  # queued again
    deadline = time.monotonic() + 10
    while (answers := [tier.lookup(k, late) for k in keys]) != [HIT, HIT]:
        assert RETRY in answers and time.monotonic() < deadline, answers
        tier.on_schedule_end(None)
        time.sleep(0.01)
    tier.on_request_finished(late)
    assert tier._probes == {}  # no verdict outlives its requests


def test_stores_and_loads_use_vllms_region_in_place(
    tmp_path: Path, instances: list[Instance]
) -> None:
    seen: list[tuple[str, list[int]]] = []

    class Recording(FaultyBackend):
        name = "recording"

        async def batch_set(self, keys, pages):  # type: ignore[no-untyped-def]
            seen.append(("set", [_address(p.segments[0]) for p in pages]))
            return await super().batch_set(keys, pages)

        async def batch_get(self, keys, pages):  # type: ignore[no-untyped-def]
            seen.append(("get", [_address(p.segments[0]) for p in pages]))
            return await super().batch_get(keys, pages)

    register_backend("recording+file", Recording)
    try:
        a = Instance([tier_config(f"recording+file://{tmp_path}?fault=latency&fault_delay=0.001")])
        instances.append(a)
        keys, data = make_keys(3), payloads(3, BLOCK)
        ctx = a.request()
        out = a.manager.prepare_store(keys, ctx)
        for chunk, blob in zip(out.store_spec.chunk_ids, data, strict=True):
            a.write_row(int(chunk), blob)
        a.manager.complete_store(keys, ctx, True)
        a.settle()
        base = _address(a.manager.primary_tier.get_kv_memoryview())
        rows = [base + int(c) * a.row_bytes for c in out.store_spec.chunk_ids]
        assert seen == [("set", rows)]  # the backend wrote vLLM's rows, not copies

        b = Instance([tier_config(f"recording+file://{tmp_path}?fault=latency&fault_delay=0.001")])
        instances.append(b)
        seen.clear()
        ctx = b.request()
        b.lookup_until_settled(keys, ctx)
        spec = b.manager.prepare_load(keys, ctx)
        base = _address(b.manager.primary_tier.get_kv_memoryview())
        assert seen == [("get", [base + int(c) * b.row_bytes for c in spec.chunk_ids])]
        b.manager.complete_load(keys, ctx)
    finally:
        unregister_backend("recording+file")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize(
    "other",
    [{"model": "another/model"}, {"dtype": "bfloat16"}, {"block_size": 32}],
    ids=["model", "dtype", "block-size"],
)
def test_other_model_dtype_or_block_size_never_shares_keys(
    tmp_path: Path, instances: list[Instance], other: dict[str, object]
) -> None:
    url = f"file://{tmp_path}"
    a = Instance([tier_config(url)])
    instances.append(a)
    keys = make_keys(2)
    a.store(keys, payloads(2, BLOCK))

    b = Instance([tier_config(url)], **other)
    instances.append(b)
    assert b.tier.namespace_digest != a.tier.namespace_digest
    assert b.tier.page_key(keys[0]) != a.tier.page_key(keys[0])
    history = b.lookup_until_settled(keys, b.request())
    assert names(history)[-1] == ["MISS", "MISS"]

    same = Instance([tier_config(url)])  # the same configuration shares them
    instances.append(same)
    assert same.tier.namespace_digest == a.tier.namespace_digest


def test_keys_are_vllms_block_hash_and_group(tmp_path: Path, instances: list[Instance]) -> None:
    a = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(a)
    (k0,) = make_keys(1, group=0)
    k1 = type(k0)(k0[:-4] + (3).to_bytes(4, "big"))  # the same block hash in group 3
    key0, key1 = a.tier.page_key(k0), a.tier.page_key(k1)
    digest = a.tier.namespace_digest
    assert key0 == f"{digest}.g0-{k0[:-4].hex()}"
    assert key1 == f"{digest}.g3-{k0[:-4].hex()}"


def test_corrupt_page_is_a_miss(tmp_path: Path, instances: list[Instance]) -> None:
    url = f"file://{tmp_path}"
    a = Instance([tier_config(url)])
    instances.append(a)
    keys, data = make_keys(4), payloads(4, BLOCK)
    a.store(keys, data)
    bad = a.tier.page_key(keys[1])
    (path,) = [p for p in tmp_path.rglob("*.page") if p.name.startswith(bad)]
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0xFF  # one flipped byte in the payload
    path.write_bytes(bytes(blob))

    b = Instance([tier_config(url)])
    instances.append(b)
    ctx = b.request()
    history = b.lookup_until_settled(keys, ctx)
    # Found, promoted, then the load finds block 1 fails its checksum: vLLM
    # keeps the blocks that arrived and block 1 becomes a miss.
    assert names(history)[-1] == ["HIT", "MISS", "HIT", "HIT"]
    good = [keys[0], keys[2], keys[3]]
    assert b.load(good, ctx, BLOCK) == [data[0], data[2], data[3]]
    assert not path.exists()  # the backend dropped the corrupt page


@pytest.mark.redis
def test_backend_hanging_mid_load_fails_the_job_and_nothing_hangs(
    own_redis: RedisServer, instances: list[Instance]
) -> None:
    a = Instance([tier_config(own_redis.url)])
    instances.append(a)
    keys, data = make_keys(3), payloads(3, BLOCK)
    a.store(keys, data)

    b = Instance([tier_config(own_redis.url, timeout_s=1.0)])
    instances.append(b)
    ctx = b.request()
    assert [b.manager.lookup(k, ctx) for k in keys] == [RETRY] * 3
    deadline = time.monotonic() + 10
    while b.manager.lookup(keys[0], ctx) is not HIT_PENDING:
        assert time.monotonic() < deadline
        b.step()
        time.sleep(0.01)
    assert [b.manager.lookup(k, ctx) for k in keys] == [HIT_PENDING] * 3
    own_redis.pause()  # the server stops answering: the load is submitted now
    try:
        t0 = time.monotonic()
        b.settle(timeout=10)
        assert time.monotonic() - t0 < 5  # bounded by the tier's timeout
        # vLLM's failure path: the promotion failed, the slots were released.
        assert [b.manager.lookup(k, ctx) for k in keys] == [MISS] * 3
        assert not b.manager.has_pending_work()
    finally:
        own_redis.resume()
    b.manager.on_request_finished(ctx)
    ctx = b.request()  # a later request: the server answers again
    history = b.lookup_until_settled(keys, ctx)
    assert names(history)[-1] == ["HIT"] * 3
    assert b.load(keys, ctx, BLOCK) == data


@pytest.mark.redis
def test_backend_down_means_misses_and_the_tier_recovers(
    own_redis: RedisServer, instances: list[Instance]
) -> None:
    own_redis.stop()
    inst = Instance([tier_config(own_redis.url, timeout_s=1.0, reopen_interval_s=0.2)])
    instances.append(inst)
    keys, data = make_keys(2), payloads(2, BLOCK)
    ctx = inst.request()
    assert names(inst.lookup_until_settled(keys, ctx))[-1] == ["MISS", "MISS"]
    inst.manager.on_request_finished(ctx)
    inst.store(keys, data)  # the cascades fail; vLLM keeps serving from its CPU tier
    ctx = inst.request()
    assert [inst.manager.lookup(k, ctx) for k in keys] == [HIT, HIT]
    assert not inst.manager.has_pending_work()
    inst.manager.on_request_finished(ctx)

    own_redis.start()
    time.sleep(0.3)  # past reopen_interval_s
    fresh = make_keys(2)
    inst.store(fresh, data)
    other = Instance([tier_config(own_redis.url)])
    instances.append(other)
    ctx = other.request()
    assert names(other.lookup_until_settled(fresh, ctx))[-1] == ["HIT", "HIT"]
    assert other.load(fresh, ctx, BLOCK) == data


def test_shutdown_drains_jobs_in_flight(
    tmp_path: Path, instances: list[Instance], faulty_file: None
) -> None:
    plan = "fault=latency&fault_ops=set&fault_delay=0.5"
    url = f"faulty+file://{tmp_path}?{plan}"
    a = Instance([tier_config(url)])
    keys, data = make_keys(4), payloads(4, BLOCK)
    ctx = a.request()
    out = a.manager.prepare_store(keys, ctx)
    for chunk, blob in zip(out.store_spec.chunk_ids, data, strict=True):
        a.write_row(int(chunk), blob)
    a.manager.complete_store(keys, ctx, True)
    assert a.tier.has_pending_work()  # the store is in flight
    tier = a.tier
    a.close()  # vLLM's manager shuts its tiers down
    assert tiercache_threads() == []
    assert [r.success for r in tier.get_finished_jobs()] == [True]  # drained, not dropped
    assert not tier.has_pending_work()

    b = Instance([tier_config(f"file://{tmp_path}")])  # the drained store landed
    instances.append(b)
    ctx = b.request()
    assert names(b.lookup_until_settled(keys, ctx))[-1] == ["HIT"] * 4


def test_shutdown_cancels_jobs_that_hang(
    tmp_path: Path, instances: list[Instance], faulty_file: None
) -> None:
    url = f"faulty+file://{tmp_path}?fault=hang&fault_ops=set"
    a = Instance([tier_config(url, timeout_s=0.5)])
    keys = make_keys(2)
    ctx = a.request()
    a.manager.prepare_store(keys, ctx)
    a.manager.complete_store(keys, ctx, True)
    tier = a.tier
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 5
    assert tiercache_threads() == []
    results = list(tier.get_finished_jobs())
    assert [r.success for r in results] == [False]


def test_tiercache_never_imports_vllm() -> None:
    code = (
        "import sys, tiercache, tiercache.storage, tiercache.integrations;"
        "from tiercache.storage import file, memory;"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _documented_kv_transfer_configs() -> list[tuple[str, str]]:
    """Every ``--kv-transfer-config`` the README and the docs give, with where it is."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for flag in re.findall(r"--kv-transfer-config '([^']+)'", text):
            found.append((str(page.relative_to(ROOT)), flag))
    return found


def test_the_readme_and_the_vllm_guide_give_a_kv_transfer_config() -> None:
    pages = {page for page, _ in _documented_kv_transfer_configs()}
    assert {"README.md", "docs/guides/vllm.md"} <= pages


@pytest.mark.parametrize(
    "page, flag",
    _documented_kv_transfer_configs(),
    ids=lambda v: v if v.endswith(".md") else "",
)
def test_every_documented_kv_transfer_config_builds_the_tier(
    page: str, flag: str, tmp_path: Path
) -> None:
    config = KVTransferConfig(**json.loads(flag))  # vLLM's own validation
    assert config.kv_connector == "OffloadingConnector"
    extra = dict(config.kv_connector_extra_config)
    assert extra.pop("spec_name") == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert tier["url"].split("://")[0] in {"file", "tiercache+unix"}, page
    tier = {**tier, "url": f"file://{tmp_path}"}  # the same entry, on a writable path
    spec = TieringOffloadingSpec(offloading_config([tier]))
    manager = spec.get_manager()
    try:
        assert isinstance(manager.secondary_tiers[0], TierCacheTier)
    finally:
        manager.shutdown()


def test_example_runs() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_tier.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "instance B lookups, step by step: RETRY -> HIT_PENDING -> HIT" in r.stdout
    assert "instance B loaded 8 blocks from tiercache storage; KV bit-identical: True" in r.stdout


def test_reset_cache_drains_jobs_in_flight(
    tmp_path: Path, instances: list[Instance], faulty_file: None
) -> None:
    url = f"faulty+file://{tmp_path}?fault=latency&fault_ops=set&fault_delay=0.5"
    a = Instance([tier_config(url)])
    instances.append(a)
    keys, data = make_keys(3), payloads(3, BLOCK)
    ctx = a.request()
    out = a.manager.prepare_store(keys, ctx)
    for chunk, blob in zip(out.store_spec.chunk_ids, data, strict=True):
        a.write_row(int(chunk), blob)
    a.manager.complete_store(keys, ctx, True)
    assert a.tier.has_pending_work()
    # vLLM's reset (sleep, weight update) calls drain_jobs, then asserts that
    # no job is left before it reuses the CPU tier's slots.
    a.manager.reset_cache()
    assert not a.manager.has_pending_work()

    b = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(b)
    ctx = b.request()
    assert names(b.lookup_until_settled(keys, ctx))[-1] == ["HIT"] * 3
    assert b.load(keys, ctx, BLOCK) == data


@pytest.mark.redis
def test_backend_killed_mid_load_fails_the_job_and_the_tier_recovers(
    own_redis: RedisServer, instances: list[Instance]
) -> None:
    a = Instance([tier_config(own_redis.url)])
    instances.append(a)
    keys, data = make_keys(3), payloads(3, BLOCK)
    a.store(keys, data)

    b = Instance([tier_config(own_redis.url, timeout_s=1.0)])
    instances.append(b)
    ctx = b.request()
    deadline = time.monotonic() + 10
    while [b.manager.lookup(k, ctx) for k in keys] != [HIT_PENDING] * 3:
        assert time.monotonic() < deadline
        b.step()
        time.sleep(0.01)
    own_redis.kill()  # the server dies (connections refused) as the load is submitted
    b.settle(timeout=10)
    assert [b.manager.lookup(k, ctx) for k in keys] == [MISS] * 3  # vLLM recomputes them
    b.manager.on_request_finished(ctx)

    own_redis.start()  # back, empty (no persistence): instance A offloads again
    fresh = make_keys(3)
    a.store(fresh, data)
    ctx = b.request()
    assert names(b.lookup_until_settled(fresh, ctx))[-1] == ["HIT"] * 3
    assert b.load(fresh, ctx, BLOCK) == data


def test_drain_jobs_waits_for_a_load_stuck_in_the_file_system(
    tmp_path: Path, instances: list[Instance], monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's contract: once drain_jobs returns, no tier I/O touches the
    # primary region (reset_cache then reuses its slots). A read stuck in the
    # kernel outlives the tier's deadline; drain_jobs must wait for it.
    a = Instance([tier_config(f"file://{tmp_path}")])
    instances.append(a)
    keys, data = make_keys(2), payloads(2, BLOCK)
    a.store(keys, data)

    stuck = StuckReads(monkeypatch, hold_s=30)
    b = Instance([tier_config(f"file://{tmp_path}", timeout_s=0.5)])
    instances.append(b)
    ctx = b.request()
    deadline = time.monotonic() + 10
    while not stuck.started.is_set():  # lookups, then the promotion's load
        assert time.monotonic() < deadline
        [b.manager.lookup(k, ctx) for k in keys]
        b.step()
        time.sleep(0.01)
    stuck.release_after(7.0)  # past the tier's deadline and drain_jobs' old bound
    b.manager.reset_cache()  # drain_jobs, then vLLM asserts no job is left
    assert stuck.running == 0
    assert not b.manager.has_pending_work()


def test_jobs_waiting_on_a_failed_open_do_not_each_open_again(
    tmp_path: Path, instances: list[Instance]
) -> None:
    # A store that takes long to refuse a connection (a host that drops
    # packets): every job queued behind one failed open used to try its own,
    # one after the other, so the last job (and drain_jobs) waited for all.
    opens: list[float] = []

    async def slow_refusal(url: str, **options: object) -> object:
        opens.append(time.monotonic())
        await asyncio.sleep(0.4)
        raise BackendUnavailableError("connection timed out")

    register_backend("slowrefusal", slow_refusal)
    try:
        a = Instance([tier_config("slowrefusal://host", reopen_interval_s=0.05)])
        instances.append(a)
        opens.clear()
        for i in range(6):
            ctx = a.request(f"store-{i}")
            keys = make_keys(1)
            a.manager.prepare_store(keys, ctx)
            a.manager.complete_store(keys, ctx, True)
        t0 = time.monotonic()
        a.manager.reset_cache()  # drain_jobs: waits for every store to end
        assert time.monotonic() - t0 < 1.5
        assert len(opens) <= 2
    finally:
        unregister_backend("slowrefusal")
