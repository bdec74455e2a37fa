"""Two processes share one file store: B reuses a prefix that only A ever computed.

Process A computes the KV of a long prefix with the tiny model, lets the cache
write it through to host and back it up to a file store, and exits. Process B
starts cold on the same directory, requests the prefix followed by new tokens,
finds the prefix in storage, computes only the new tokens (each layer waiting
for its KV to land), and checks its logits against a full recompute.

Run ``python examples/shared_storage.py [--dir DIR]`` (a temporary directory
by default); the script starts both processes itself.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.models.tiny import TinyCausalLM, TinyConfig

PREFIX_TOKENS = 512
NEW_TOKENS = 40


def setup(store: str) -> tuple[TinyCausalLM, TierCacheConfig, list[int], list[int]]:
    """What both processes agree on: the model, the cache shape, the prefix and the new tokens."""
    mc = TinyConfig(dtype=torch.float32, seed=0)
    model = TinyCausalLM(mc)
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=2048,
        model="tiny-seed0",  # part of every storage key: only this model's pages match
        storage_url=f"file://{store}",
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, mc.vocab_size, (PREFIX_TOKENS,), generator=gen).tolist()
    new = torch.randint(0, mc.vocab_size, (NEW_TOKENS,), generator=gen).tolist()
    return model, config, prefix, new


async def process_a(store: str) -> None:
    model, config, prefix, _ = setup(store)
    async with TierCache(config) as cache:
        async with cache.request(prefix) as req:
            slots = await req.alloc(len(prefix) - req.cached_tokens)
            await asyncio.to_thread(model.prefill, cache.device_pool, prefix, slots)
            await req.commit(prefix, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()  # write-through to host, then the backup to the file store
        s = cache.stats()
        print(
            f"process A computed {len(prefix)} tokens and backed them up "
            f"({s.bytes_storage_written} bytes written to {store})"
        )


async def process_b(store: str) -> bool:
    model, config, prefix, new = setup(store)
    prompt = prefix + new
    async with TierCache(config) as cache:
        async with cache.request(prompt) as req:
            loaded = req.cached_tokens
            slots = await req.alloc(len(prompt) - req.cached_tokens)
            logits = await asyncio.to_thread(
                model.prefill,
                cache.device_pool,
                prompt[req.cached_tokens :],
                slots,
                req.prefix_indices,
                req.layer_ready,
            )
        s = cache.stats()
    ref = model.reference_forward(prompt)[loaded:]
    match = loaded == len(prefix) and bool(torch.allclose(logits, ref, rtol=0, atol=1e-5))
    print(f"process B read {s.bytes_storage_read} bytes; computed {len(prompt) - loaded} tokens")
    print(f"process B loaded {loaded} tokens from storage; logits match a full recompute: {match}")
    return match


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="the shared file store (default: a temporary directory)")
    parser.add_argument("--role", choices=["a", "b"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "a":
        asyncio.run(process_a(args.dir))
        return
    if args.role == "b":
        sys.exit(0 if asyncio.run(process_b(args.dir)) else 1)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.abspath(args.dir or tmp)
        for role in ("a", "b"):  # one after the other: B starts after A has exited
            r = subprocess.run([sys.executable, __file__, "--role", role, "--dir", store])
            if r.returncode:
                sys.exit(f"process {role.upper()} failed with exit code {r.returncode}")


if __name__ == "__main__":
    main()
