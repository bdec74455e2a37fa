"""Client processes of the ``tiercache serve`` tests: ``python -m tests.serve.client_proc MODE ...``.

Modes:

``share SOCK INDEX CLIENTS PAGES NBYTES``
    store this client's pages, wait until every client's are there, read
    them all and compare their bytes; print ``OK n`` (exit 0) or exit 1.
``hold-write SOCK KEY NBYTES``
    reserve KEY, write half its bytes into the arena, print ``RESERVED`` and wait to be killed.
``hold-read SOCK KEY NBYTES``
    lease KEY, read half of it, print ``LEASED`` and wait to be killed.
``engine-a SOCK`` / ``engine-b SOCK``
    a `TierCache` "engine" computing a prefix and backing it up through the
    server / a restarted one finding the prefix there; B prints
    ``LOADED n MATCH b``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch
from tests.serve.helpers import FORMAT, page_bytes, page_of

from tiercache import TierCache, TierCacheConfig
from tiercache.memory.pages import PageBuffer
from tiercache.models.tiny import TinyCausalLM, TinyConfig
from tiercache.serve import ServeClient
from tiercache.serve.arena import copy_into, copy_out_of
from tiercache.storage import PageKey, open_backend


async def share(sock: str, index: int, clients: int, pages: int, nbytes: int) -> int:
    backend = await open_backend(f"tiercache+unix://{sock}")
    async with backend:
        mine = [PageKey(f"c{index}-p{j}") for j in range(pages)]
        assert await backend.batch_set(mine, [page_of(k, nbytes) for k in mine]) == [True] * pages
        every = [PageKey(f"c{i}-p{j}") for i in range(clients) for j in range(pages)]
        deadline = time.monotonic() + 60
        while await backend.batch_exists(every) < len(every):
            if time.monotonic() > deadline:
                print("TIMEOUT waiting for the other clients", flush=True)
                return 1
            await asyncio.sleep(0.05)
        for _ in range(3):  # read everything a few times, all clients at once
            outs = [PageBuffer.allocate(nbytes, FORMAT) for _ in every]
            got = await backend.batch_get(every, outs)
            if got != [True] * len(every):
                print(f"MISSING {got.count(False)}", flush=True)
                return 1
            for k, out in zip(every, outs, strict=True):
                if out.tobytes() != page_bytes(k, nbytes):
                    print(f"TORN {k}", flush=True)
                    return 1
    print(f"OK {len(every)}", flush=True)
    return 0


async def hold(sock: str, op: str, key: str, nbytes: int) -> int:
    client = await ServeClient.connect(sock)
    (answer,) = await client.call(op, [[key, nbytes, FORMAT]])
    extents = [(o, n) for o, n in answer[2]]
    half = PageBuffer.from_bytes(page_bytes(key, nbytes)[: nbytes // 2], FORMAT)
    first = []
    left = nbytes // 2
    for o, n in extents:  # only the first half of the page
        if left <= 0:
            break
        first.append((o, min(n, left)))
        left -= min(n, left)
    if op == "reserve":
        copy_into(client.arena, first, half)
        print("RESERVED", flush=True)
    else:
        copy_out_of(client.arena, first, half)
        print("LEASED", flush=True)
    await asyncio.sleep(3600)
    return 0


def _engine(sock: str) -> tuple[TinyCausalLM, TierCacheConfig, list[int]]:
    mc = TinyConfig(dtype=torch.float32, seed=0)
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=1024,
        model="tiny-seed0",
        storage_url=f"tiercache+unix://{sock}",
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, mc.vocab_size, (256,), generator=gen).tolist()
    return TinyCausalLM(mc), config, prompt


async def engine_a(sock: str) -> int:
    model, config, prompt = _engine(sock)
    async with TierCache(config) as cache:
        async with cache.request(prompt) as req:
            slots = await req.alloc(len(prompt) - req.cached_tokens)
            await asyncio.to_thread(model.prefill, cache.device_pool, prompt, slots)
            await req.commit(prompt, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()
        print(f"STORED {cache.stats().bytes_storage_written}", flush=True)
    return 0


async def engine_b(sock: str) -> int:
    model, config, prompt = _engine(sock)
    async with TierCache(config) as cache:
        async with cache.request(prompt) as req:
            loaded = req.cached_tokens
            slots = await req.alloc(len(prompt) - loaded)
            logits = await asyncio.to_thread(
                model.prefill,
                cache.device_pool,
                prompt[loaded:],
                slots,
                req.prefix_indices,
                req.layer_ready,
            )
    ref = model.reference_forward(prompt)[loaded:]
    match = bool(torch.allclose(logits, ref, rtol=0, atol=1e-5))
    print(f"LOADED {loaded} MATCH {match}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    mode, sock, *rest = argv
    if mode == "share":
        index, clients, pages, nbytes = map(int, rest)
        return asyncio.run(share(sock, index, clients, pages, nbytes))
    if mode in ("hold-write", "hold-read"):
        key, nbytes = rest[0], int(rest[1])
        return asyncio.run(hold(sock, "reserve" if mode == "hold-write" else "lease", key, nbytes))
    if mode == "engine-a":
        return asyncio.run(engine_a(sock))
    if mode == "engine-b":
        return asyncio.run(engine_b(sock))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
