"""Two cache instances in two processes share one Redis: B loads the KV that A computed.

Instance A computes the KV of a long prefix with the tiny model and backs it up
to Redis. Instance B, in another process that never saw the prefix, requests
the prefix followed by new tokens: the prefix is found in Redis and loaded into
B's device pool. B then checks that

- the loaded KV is bit-identical to the KV of the prefix recomputed in B, and
- its logits for the new tokens match a full recompute within 1e-5.

Run ``python examples/redis_two_instances.py [--redis-url redis://host:port/0]``.
Without ``--redis-url`` a private ``redis-server`` is started on a free loopback
port (the binary must be installed) and stopped at the end. The pages are
stored under a fresh key prefix, which B deletes when it is done.
"""

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.memory import DeviceKVPool
from tiercache.models.tiny import TinyCausalLM, TinyConfig
from tiercache.storage.redis import RedisBackend

PREFIX_TOKENS = 512
NEW_TOKENS = 40


@contextmanager
def private_redis() -> Iterator[str]:
    """Start ``redis-server`` on a free 127.0.0.1 port (no persistence); yield its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed: install it or pass --redis-url")
    with tempfile.TemporaryDirectory(prefix="tcredis-") as workdir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                        c.sendall(b"PING\r\n")
                        if c.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def setup(url: str, prefix: str) -> tuple[TinyCausalLM, TierCacheConfig, list[int], list[int]]:
    """What both instances agree on: the model, the cache shape, the prefix and the new tokens."""
    mc = TinyConfig(dtype=torch.float32, seed=0)
    model = TinyCausalLM(mc)
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=2048,
        model="tiny-seed0",
        storage_url=url,
        storage_options={"prefix": prefix},
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, mc.vocab_size, (PREFIX_TOKENS,), generator=gen).tolist()
    new = torch.randint(0, mc.vocab_size, (NEW_TOKENS,), generator=gen).tolist()
    return model, config, tokens, new


async def instance_a(url: str, key_prefix: str) -> None:
    model, config, prefix, _ = setup(url, key_prefix)
    async with TierCache(config) as cache:
        async with cache.request(prefix) as req:
            slots = await req.alloc(len(prefix) - req.cached_tokens)
            await asyncio.to_thread(model.prefill, cache.device_pool, prefix, slots)
            await req.commit(prefix, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()  # host write-through, then the backup to Redis
        written = cache.stats().bytes_storage_written
    print(f"instance A computed {len(prefix)} tokens and wrote {written} bytes to Redis")


async def instance_b(url: str, key_prefix: str) -> bool:
    model, config, prefix, new = setup(url, key_prefix)
    prompt = prefix + new
    n = len(prefix)
    async with TierCache(config) as cache:
        pool = cache.device_pool
        async with cache.request(prompt) as req:
            loaded = req.cached_tokens
            slots = await req.alloc(len(prompt) - loaded)
            logits = await asyncio.to_thread(
                model.prefill,
                pool,
                prompt[loaded:],
                slots,
                req.prefix_indices,
                req.layer_ready,
            )
            got = [(pool.k_buffer[i][req.prefix_indices], pool.v_buffer[i][req.prefix_indices])
                   for i in range(config.num_layers)]  # fmt: skip
        read = cache.stats().bytes_storage_read
    # The prefix recomputed here, in a pool of our own.
    ref_pool = DeviceKVPool(config.layout(), n)
    await asyncio.to_thread(model.prefill, ref_pool, prefix, torch.arange(n))
    bit_identical = loaded == n and all(
        torch.equal(k, ref_pool.k_buffer[i]) and torch.equal(v, ref_pool.v_buffer[i])
        for i, (k, v) in enumerate(got)
    )
    ref_logits = model.reference_forward(prompt)[loaded:]
    close = bool(torch.allclose(logits, ref_logits, rtol=0, atol=1e-5))
    async with await RedisBackend.from_url(url, prefix=key_prefix) as backend:
        await backend.clear()  # leave the server as we found it
    print(f"instance B read {read} bytes; logits match a full recompute: {close}")
    print(f"instance B loaded {loaded} tokens from Redis; KV bit-identical: {bit_identical}")
    return bit_identical and close


def run_both(url: str) -> None:
    key_prefix = f"tcexample:{uuid.uuid4().hex[:12]}:"
    for role in ("a", "b"):  # B starts after A has exited
        cmd = [sys.executable, __file__, "--role", role, "--redis-url", url, "--key-prefix"]
        r = subprocess.run([*cmd, key_prefix])
        if r.returncode:
            sys.exit(f"instance {role.upper()} failed with exit code {r.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a Redis to use (default: start a private one)")
    parser.add_argument("--role", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--key-prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "a":
        asyncio.run(instance_a(args.redis_url, args.key_prefix))
    elif args.role == "b":
        sys.exit(0 if asyncio.run(instance_b(args.redis_url, args.key_prefix)) else 1)
    elif args.redis_url:
        run_both(args.redis_url)
    else:
        with private_redis() as url:
            run_both(url)


if __name__ == "__main__":
    main()
