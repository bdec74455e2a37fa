"""Export a cache's counters and latencies to Prometheus (needs ``tiercache[metrics]``).

The application owns the registry and the HTTP endpoint; tiercache gives the
collector. This script serves ``/metrics`` on a free port, runs a few requests
through a cache with a file store, scrapes its own endpoint once and prints
some of what Prometheus would see.
"""

import asyncio
import tempfile
import urllib.request

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import tiercache.metrics
from tiercache import TierCache, TierCacheConfig


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def main() -> None:
    registry = CollectorRegistry()
    server, thread = await asyncio.to_thread(start_http_server, 0, "127.0.0.1", registry)
    port = server.server_port
    with tempfile.TemporaryDirectory() as store:
        config = TierCacheConfig(
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            page_size=16,
            device_tokens=1024,
            storage_url=f"file://{store}",
            prefetch_threshold=16,
            prefetch_policy="wait_complete",
        )
        prompt = list(range(100, 164))
        async with TierCache(config) as cache:
            collector = tiercache.metrics.register(cache, registry, labels={"instance": "demo"})
            async with cache.request(prompt) as req:
                slots = await req.alloc(len(prompt) - req.cached_tokens)
                await req.commit(prompt, torch.cat([req.prefix_indices, slots]))
            await cache.wait_idle()
            await cache.flush()
            async with cache.request(prompt + [7, 8, 9]) as req:
                await req.wait_loaded()
            samples = await asyncio.to_thread(scrape, port)
            await collector.aclose()
    await asyncio.to_thread(server.shutdown)
    await asyncio.to_thread(thread.join)
    server.server_close()
    for name in (
        "tiercache_requests_total{instance=demo}",
        "tiercache_hit_tokens_total{instance=demo,tier=storage}",
        "tiercache_transfer_bytes_total{direction=storage_to_host,instance=demo}",
        "tiercache_storage_up{instance=demo}",
        "tiercache_storage_call_duration_seconds_count{instance=demo,op=get,outcome=ok}",
    ):
        print(f"{name} {samples.get(name)}")
    print(f"scraped http://127.0.0.1:{port}/metrics: {len(samples)} samples")


if __name__ == "__main__":
    asyncio.run(main())
