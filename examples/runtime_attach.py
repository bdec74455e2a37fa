"""Attach and detach a storage backend while requests keep being served.

Four tasks serve requests without pause (request, alloc, prefill with the tiny
model, commit) over a few shared documents followed by per-request questions.
Meanwhile the main task:

1. serves with the device and host tiers only;
2. attaches a file store at runtime: new KV is backed up to it;
3. detaches it: requests go on, nothing fails;
4. attaches it again, caches one more document and waits for its backup;
5. stops the workers, flushes the device and host tiers, and requests that
   document again: it comes back from storage;
6. flushes again and checks that every device and host slot is free.
"""

import asyncio
import random
import tempfile
from collections.abc import Callable

import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.models.tiny import TinyCausalLM, TinyConfig

WORKERS = 4


async def serve(cache: TierCache, model: TinyCausalLM, prompt: list[int]) -> int:
    """One request: reuse the cached prefix, compute the rest, commit. Returns the cached tokens."""
    async with cache.request(prompt) as req:
        slots = await req.alloc(len(prompt) - req.cached_tokens)
        await asyncio.to_thread(
            model.prefill,
            cache.device_pool,
            prompt[req.cached_tokens :],
            slots,
            req.prefix_indices,
            req.layer_ready,
        )
        await req.commit(prompt, torch.cat([req.prefix_indices, slots]))
        return req.cached_tokens


async def main() -> None:
    mc = TinyConfig(num_layers=2)
    model = TinyCausalLM(mc)
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=1024,  # small: documents are evicted and reloaded all the time
        host_tokens=16384,  # room for everything this run inserts: nothing leaves the host
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )
    rng = random.Random(0)
    documents = [[rng.randrange(mc.vocab_size) for _ in range(128)] for _ in range(6)]
    served = 0
    errors: list[BaseException] = []
    stop = asyncio.Event()
    progress = asyncio.Event()

    async def worker(seed: int) -> None:
        nonlocal served
        r = random.Random(seed)
        while not stop.is_set():
            question = [r.randrange(mc.vocab_size) for _ in range(r.randrange(8, 40))]
            try:
                await serve(cache, model, r.choice(documents) + question)
                served += 1
            except Exception as e:  # an example reports failures rather than hiding them
                errors.append(e)
                print(f"  request failed: {e!r}")
            progress.set()

    async def wait_for(cond: Callable[[], bool]) -> None:
        while not cond() and not errors:
            progress.clear()
            await progress.wait()  # set after every request

    async def serve_more(n: int) -> None:
        target = served + n
        await wait_for(lambda: served >= target)

    with tempfile.TemporaryDirectory() as store:
        async with TierCache(config) as cache:
            tasks = [asyncio.create_task(worker(i)) for i in range(WORKERS)]
            await serve_more(20)
            print(f"1. no storage:       {served} requests served")

            await cache.attach_storage(f"file://{store}")
            await wait_for(lambda: cache.stats().storage_backups >= 5)
            s = cache.stats()
            print(
                f"2. attached {store}: {served} served, "
                f"{s.storage_backups} nodes backed up ({s.bytes_storage_written} bytes)"
            )

            await cache.detach_storage()
            await serve_more(20)
            print(f"3. detached:         {served} served, still no errors: {not errors}")

            await cache.attach_storage(f"file://{store}")
            before = cache.stats().storage_backups
            await serve_more(20)
            report = rng.sample(range(mc.vocab_size), 16) * 16  # 256 tokens, a new document
            await serve(cache, model, report)
            print(
                f"4. re-attached:      {served} served, "
                f"{cache.stats().storage_backups - before} more nodes backed up"
            )

            stop.set()
            await asyncio.gather(*tasks)
            await cache.wait_idle()  # the last backups land
            # wait_idle can return before the done-callback of a host write that
            # just finished has run (it unlocks the node and starts its backup):
            # let it run, and let flush's own wait_idle wait for that backup.
            await asyncio.sleep(0)
            await cache.flush()  # only storage keeps the KV now
            async with cache.request(report + [1, 2, 3]) as req:
                await req.wait_loaded()
                print(
                    f"5. after a flush:    {req.cached_tokens} tokens of the document from storage"
                )
                from_storage = req.cached_tokens == len(report)

            await cache.flush()
            s = cache.stats()
            ctl = cache.controller
            no_leak = (
                ctl.device_allocator.available == config.device_tokens
                and ctl.host_allocator.available == config.resolved_host_tokens()
            )
            print(
                f"6. after a flush:    device {ctl.device_allocator.available}/"
                f"{config.device_tokens} slots free, host {ctl.host_allocator.available}/"
                f"{config.resolved_host_tokens()} free, storage errors {s.storage_errors}"
            )
    if errors or not from_storage or not no_leak or s.storage_errors:
        raise SystemExit(
            f"failed: {len(errors)} errors, from storage {from_storage}, leak-free {no_leak}"
        )
    print(f"served {served} requests across attach/detach; no errors")


if __name__ == "__main__":
    asyncio.run(main())
