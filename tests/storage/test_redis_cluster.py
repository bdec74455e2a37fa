"""RedisBackend on a real Redis Cluster: 3 masters and 3 replicas on loopback.

The cluster is made by ``redis-cli --cluster create ... --cluster-replicas 1``
(`tests.redis_server.LocalRedisCluster`). These tests check what the backend
promises a team that runs one: a batch is split by owning master with one
round trip per master; a dead master costs only its own pages; after its
replica takes over, the backend finds the new topology by itself.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import tests.cache.test_redis_sharing as sharing
from tests.redis_server import LocalRedisCluster, RedisServer
from tests.storage.redis_fixtures import own_redis_cluster, redis_cluster, unique_prefix

from tiercache.errors import BackendUnavailableError
from tiercache.storage import PageBuffer, PageKey
from tiercache.storage.redis import RedisBackend

__all__ = ["own_redis_cluster", "redis_cluster"]  # fixtures used here

FMT = "test:cluster:P4"
N = 60


def key(i: int) -> PageKey:
    return PageKey(f"{i:064x}")


def page(seed: int, nbytes: int = 2048) -> PageBuffer:
    data = bytes((seed * 131 + i * 7 + (i >> 8)) & 0xFF for i in range(nbytes))
    return PageBuffer.from_bytes(data, FMT)


def blank(nbytes: int = 2048) -> PageBuffer:
    return PageBuffer.from_bytes(b"\xee" * nbytes, FMT)


def owners(
    cluster: LocalRedisCluster,
    prefix: str,
    keys: list[PageKey],
    slots: dict[int, set[int]] | None = None,
) -> dict[int, set[int]]:
    """Master port -> indices of ``keys`` whose slot it owns, as the servers compute it.

    ``slots``: master port -> its slots (default: the masters' now).
    """
    if slots is None:
        slots = {m.port: cluster.slots_of(m) for m in cluster.masters()}
    out: dict[int, set[int]] = {port: set() for port in slots}
    for i, k in enumerate(keys):
        slot = cluster.keyslot(prefix + k)
        [port] = [p for p, s in slots.items() if slot in s]
        out[port].add(i)
    return out


def slot_map(cluster: LocalRedisCluster) -> dict[int, set[int]]:
    return {m.port: cluster.slots_of(m) for m in cluster.masters()}


def command_calls(cluster: LocalRedisCluster, node: RedisServer, command: str) -> int:
    """How many times ``node`` has executed ``command`` (``INFO commandstats``)."""
    m = re.search(rf"cmdstat_{command}:calls=(\d+)", cluster.command(node, "INFO", "commandstats"))
    return int(m.group(1)) if m else 0


async def test_cluster_batch_spreads_over_all_masters_one_round_trip_per_node(
    redis_cluster: LocalRedisCluster,
) -> None:
    c = redis_cluster
    prefix = unique_prefix("spread")
    keys = [key(i) for i in range(N)]
    owned = await asyncio.to_thread(owners, c, prefix, keys)
    masters = await asyncio.to_thread(c.masters)
    assert len(masters) == 3 and all(owned[m.port] for m in masters)  # every master owns some
    async with await RedisBackend.from_url(c.url, prefix=prefix, timeout=5) as backend:
        for verb, command in (("set", "set"), ("exists", "exists"), ("get", "get")):
            before = {
                m.port: await asyncio.to_thread(command_calls, c, m, command) for m in masters
            }
            trips = dict((await backend.stats()).extra)
            if verb == "set":
                assert await backend.batch_set(keys, [page(i) for i in range(N)]) == [True] * N
            elif verb == "exists":
                assert await backend.batch_exists(keys) == N
            else:
                targets = [blank() for _ in keys]
                assert await backend.batch_get(keys, targets) == [True] * N
                assert all(t.tobytes() == page(i).tobytes() for i, t in enumerate(targets))
            after = (await backend.stats()).extra
            for m in masters:
                # Each master ran exactly the commands of the keys it owns ...
                calls = await asyncio.to_thread(command_calls, c, m, command)
                assert calls - before[m.port] == len(owned[m.port]), (verb, m.port)
                # ... and got them in one round trip (one pipeline).
                name = f"round_trips@127.0.0.1:{m.port}"
                assert int(after[name]) - int(trips.get(name, 0)) == 1, (verb, m.port)
            assert int(after["round_trips"]) - int(trips.get("round_trips", 0)) == 3
        await backend.clear()


async def test_cluster_master_killed_mid_workload_its_pages_miss_others_hit(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    c = own_redis_cluster
    prefix = unique_prefix("kill")
    keys = [key(i) for i in range(N)]
    slots = await asyncio.to_thread(slot_map, c)
    owned = await asyncio.to_thread(owners, c, prefix, keys, slots)
    victim = (await asyncio.to_thread(c.masters))[1]
    dead = owned[victim.port]
    async with await RedisBackend.from_url(c.url, prefix=prefix, timeout=2) as backend:
        assert await backend.batch_set(keys, [page(i) for i in range(N)]) == [True] * N
        killed = asyncio.Event()
        after_kill: list[list[bool]] = []

        async def workload() -> None:
            rounds = 0
            while len(after_kill) < 5:
                was_killed = killed.is_set()
                targets = [blank() for _ in keys]
                got = await backend.batch_get(keys, targets)  # never raises here
                for i, (ok, t) in enumerate(zip(got, targets, strict=True)):
                    # Never wrong bytes: a page either arrived whole or stayed untouched.
                    assert t.tobytes() == (page(i) if ok else blank()).tobytes()
                if was_killed:
                    after_kill.append(got)
                elif not killed.is_set():
                    assert got == [True] * N
                rounds += 1
                await asyncio.sleep(0.005)

        async def kill_midway() -> None:
            await asyncio.sleep(0.1)
            await asyncio.to_thread(victim.kill)
            killed.set()

        await asyncio.wait_for(asyncio.gather(workload(), kill_midway()), timeout=60)
        expected = [i not in dead for i in range(N)]
        assert all(got == expected for got in after_kill)
        # Writes: the live masters take theirs, the dead one's pages are refused, nothing raises.
        new = [key(1000 + i) for i in range(N)]
        new_owned = await asyncio.to_thread(owners, c, prefix, new, slots)
        stored = await backend.batch_set(new, [page(1000 + i) for i in range(N)])
        assert stored == [i not in new_owned[victim.port] for i in range(N)]
        live = [k for i, k in enumerate(keys) if i not in dead]
        assert await backend.batch_exists(live) == len(live)
        assert (await backend.stats()).errors > 0
        # A batch that only the dead master owns is misses too, not an error: one
        # master down must not look like the whole store down to the fault policy.
        only_dead = [keys[i] for i in sorted(dead)[:3]]
        assert await backend.batch_get(only_dead, [blank() for _ in only_dead]) == [False] * 3
        assert await backend.batch_exists(only_dead) == 0
        # Every master down is an outage of the store: the call raises.
        for m in await asyncio.to_thread(c.masters):
            await asyncio.to_thread(m.kill)
        with pytest.raises(BackendUnavailableError):
            await backend.batch_get(keys, [blank() for _ in keys])


async def test_cluster_failover_backend_follows_promoted_replica_hits_and_backups_resume(
    own_redis_cluster: LocalRedisCluster,
) -> None:
    c = own_redis_cluster
    prefix = unique_prefix("failover")
    keys = [key(i) for i in range(N)]
    owned = await asyncio.to_thread(owners, c, prefix, keys)
    victim = (await asyncio.to_thread(c.masters))[2]
    replica = await asyncio.to_thread(c.replica_of, victim)
    assert replica is not None
    dead = owned[victim.port]
    async with await RedisBackend.from_url(c.url, prefix=prefix, timeout=2) as backend:
        assert await backend.batch_set(keys, [page(i) for i in range(N)]) == [True] * N
        await asyncio.to_thread(c.wait_replicated)
        await asyncio.to_thread(victim.kill)
        got = await backend.batch_get(keys, [blank() for _ in keys])
        assert got == [i not in dead for i in range(N)]

        await asyncio.to_thread(c.promote, replica)
        # The same backend object, never reopened, finds the new master by itself.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:
            targets = [blank() for _ in keys]
            got = await backend.batch_get(keys, targets)
            if got == [True] * N or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert got == [True] * N
        assert all(t.tobytes() == page(i).tobytes() for i, t in enumerate(targets))
        assert int((await backend.stats()).extra[f"round_trips@127.0.0.1:{replica.port}"]) > 0
        # Backups resume, into the promoted master's slots too.
        new = [key(2000 + i) for i in range(N)]
        new_owned = await asyncio.to_thread(owners, c, prefix, new)
        assert new_owned[replica.port]
        assert await backend.batch_set(new, [page(2000 + i) for i in range(N)]) == [True] * N
        targets = [blank() for _ in new]
        assert await backend.batch_get(new, targets) == [True] * N
        assert all(t.tobytes() == page(2000 + i).tobytes() for i, t in enumerate(targets))


async def test_two_processes_share_kv_through_the_cluster(
    redis_cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    c = redis_cluster
    key_prefix = unique_prefix("share")
    try:
        a = await sharing.run_worker("compute", c.url, key_prefix, tmp_path / "a.pt")
        assert a["storage_backups"] >= 1 and a["written"] > 0
        b = await sharing.run_worker("load", c.url, key_prefix, tmp_path / "b.pt")
        assert b["cached_tokens"] == sharing.PREFIX_TOKENS
        assert b["storage_hit"] == sharing.PREFIX_TOKENS
        assert b["read"] == a["written"]
        assert sharing.same_bytes(b["k"], a["k"]) and sharing.same_bytes(b["v"], a["v"])
        # The shared pages really are spread over the masters.
        masters = await asyncio.to_thread(c.masters)
        counts = [int(await asyncio.to_thread(c.command, m, "DBSIZE")) for m in masters]
        assert all(n > 0 for n in counts), counts
    finally:
        async with await RedisBackend.from_url(c.url, prefix=key_prefix) as backend:
            await backend.clear()
