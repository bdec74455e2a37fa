"""End to end: time to first token with the cache, and where loading a prefix beats recomputing it.

**(a) The demo workload** (`tiercache.demo`: multi-turn chat clients sharing a
system prompt, plus a long document asked several questions; Poisson
arrivals) under its four configurations: ``no_cache``, ``device``,
``device_host`` and ``all_tiers`` (a file store filled by a first pass, the
device and host tiers flushed, the second pass measured). For each: time to
first token (mean, p50, p90 over the requests), prompt tokens computed, hit
rate per tier, and whether every configuration generated the same tokens.
This is `tiercache.demo.run_demo` itself, run in a temporary folder.

**(b) Prefix sweep.** One request of a shared prefix of ``L`` tokens plus a
new suffix of `SUFFIX_TOKENS` tokens, with `TinyCausalLM` (fp32, a larger
config than the demo's so that compute is not trivially cheap) on this
machine. Its time to first token (from ``cache.request`` to the prefill's
logits, the serving path of the demo) when the prefix is served

* from the device tier (a hit: only the suffix is computed),
* from the host tier (evicted from the device: load back layer by layer,
  overlapped with the suffix's prefill),
* from storage (a file store in a temporary folder, device and host tiers
  flushed: prefetch into host, then load back; the page files are in the OS
  page cache, as on any re-read),

against recomputing the whole prompt (``L + SUFFIX_TOKENS`` tokens, same model,
same slots path). ``ratio = recompute_ttft / tier_ttft``: above 1 loading wins.
Each round runs the four in turn (so a slow spell of the machine hits all of
them) after one warm-up round; the reported time is the **median** of the
rounds (the minimum is kept too). The last-token logits of each tier are
compared with recompute's (max abs difference, fp32 noise only).

Headlines: the demo's TTFT ratio no-cache / all-tiers (target >= 1: the
cache must not make the first token later). For (b) the smallest prefix
length at which each tier beats recompute is reported in ``crossover_table``
(no target).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    headline,
    machine_info,
    plot_lines,
    set_threads,
    write_result,
)
from tiercache import demo
from tiercache.cache import TierCache
from tiercache.config import TierCacheConfig
from tiercache.models.tiny import TinyCausalLM, TinyConfig

NAME = "e2e"
#: The demo's TTFT ratio no-cache / all-tiers must be at least this.
TARGET_DEMO_RATIO = 1.0
PAGE_SIZE = 64
SUFFIX_TOKENS = 64
TIERS: tuple[str, ...] = ("device", "host", "storage")
FULL_PREFIXES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
QUICK_PREFIXES: tuple[int, ...] = (128, 512, 1024)
SMOKE_PREFIXES: tuple[int, ...] = (64, 128)

#: The sweep's model: 6 layers, hidden 256, GQA 4/2 heads of 64, fp32 (~3.7M
#: parameters, 6 KiB of KV per token): a prefill costs milliseconds per
#: hundred tokens on a CPU, growing quadratically with attention.
SWEEP_MODEL = TinyConfig(
    vocab_size=1024,
    hidden_size=256,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    dtype=torch.float32,
    seed=0,
)
#: The smoke run only checks that everything runs.
SMOKE_MODEL = TinyConfig(dtype=torch.float32, seed=0)


# -- (a) the demo workload --------------------------------------------------------


def _demo_part(quick: bool, smoke: bool) -> dict[str, Any]:
    settings = demo.settings_for(quick or smoke)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-e2e-") as d:
        report = asyncio.run(demo.run_demo(Path(d), settings, progress=False))
    report.pop("answers", None)
    report.pop("chart", None)
    report["elapsed_s"] = time.perf_counter() - t0
    return report


# -- (b) the prefix sweep ---------------------------------------------------------


@dataclass(slots=True)
class _Timed:
    seconds: float
    cached_tokens: int
    last_logits: torch.Tensor


async def _recompute(cache: TierCache, model: TinyCausalLM, prompt: list[int]) -> _Timed:
    """The whole prompt computed from scratch: the no-cache path of the demo."""
    ps = cache.layout.page_size
    t0 = time.perf_counter()
    slots = await cache.alloc_device(-(-len(prompt) // ps) * ps)
    try:
        logits = await asyncio.to_thread(
            model.prefill, cache.device_pool, prompt, slots[: len(prompt)]
        )
        dt = time.perf_counter() - t0
    finally:
        cache.free_device(slots)
    return _Timed(dt, 0, logits[-1])


async def _served(cache: TierCache, model: TinyCausalLM, prompt: list[int]) -> _Timed:
    """Through ``cache.request``: match, prefetch, load back, prefill of the rest (not committed)."""
    t0 = time.perf_counter()
    async with cache.request(prompt) as req:
        k = min(req.cached_tokens, len(prompt) - 1)
        new = await req.alloc(len(prompt) - k)
        logits = await asyncio.to_thread(
            model.prefill,
            cache.device_pool,
            prompt[k:],
            new,
            req.prefix_indices[:k],
            req.layer_ready,
        )
        dt = time.perf_counter() - t0
    return _Timed(dt, k, logits[-1])


async def _sweep_length(
    model: TinyCausalLM, prefix_len: int, rounds: int, store: Path
) -> dict[str, Any]:
    """Time recompute and the three tiers for one prefix length; ``rounds`` after one warm-up."""
    mc = model.config
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(mc.vocab_size) for _ in range(prefix_len)]
    suffix = [rng.randrange(mc.vocab_size) for _ in range(SUFFIX_TOKENS)]
    prompt = prefix + suffix
    room = -(-(prefix_len + SUFFIX_TOKENS) // PAGE_SIZE) * PAGE_SIZE
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=PAGE_SIZE,
        model=f"bench-e2e-{prefix_len}",
        device="cpu",
        device_tokens=2 * room + 2 * PAGE_SIZE,
        host_tokens=2 * room,
        write_policy="write_through",
        storage_url=f"file://{store}",
        prefetch_threshold=PAGE_SIZE,
        prefetch_policy="wait_complete",
    )
    times: dict[str, list[float]] = {k: [] for k in ("recompute", *TIERS)}
    diffs: dict[str, float] = {}
    async with TierCache(config) as cache:
        # Compute the prefix once and cache it on every tier (write-through to host, then storage).
        slots = await cache.alloc_device(prefix_len)
        await asyncio.to_thread(model.prefill, cache.device_pool, prefix, slots)
        await cache.insert(prefix, slots)
        await cache.wait_idle()
        for r in range(rounds + 1):
            runs: dict[str, _Timed] = {}
            # storage: a restart (device and host empty), the store keeps the pages
            await cache.flush()
            runs["storage"] = await _served(cache, model, prompt)
            await cache.wait_idle()
            runs["device"] = await _served(cache, model, prompt)  # the prefix is back on device
            freed = await cache.evict_device(prefix_len)
            if freed < prefix_len:
                raise RuntimeError(f"evicted {freed} of {prefix_len} prefix tokens from device")
            runs["host"] = await _served(cache, model, prompt)
            runs["recompute"] = await _recompute(cache, model, prompt)
            for tier in TIERS:
                if runs[tier].cached_tokens != prefix_len:
                    raise RuntimeError(
                        f"{tier}: {runs[tier].cached_tokens} of {prefix_len} prefix tokens cached"
                    )
            if r == 0:
                continue  # warm-up
            for k, t in runs.items():
                times[k].append(t.seconds)
            ref = runs["recompute"].last_logits
            for tier in TIERS:
                d = float((runs[tier].last_logits - ref).abs().max())
                diffs[tier] = max(diffs.get(tier, 0.0), d)
        stats = cache.stats()
    row: dict[str, Any] = {
        "prefix_tokens": prefix_len,
        "suffix_tokens": SUFFIX_TOKENS,
        "kv_bytes": prefix_len * config.layout().token_bytes,
        "rounds": rounds,
    }
    for k, ts in times.items():
        row[f"{k}_ttft_s"] = statistics.median(ts)
        row[f"{k}_ttft_min_s"] = min(ts)
    for tier in TIERS:
        row[f"{tier}_ratio"] = row["recompute_ttft_s"] / row[f"{tier}_ttft_s"]
    # What the prefix itself costs beyond a device hit: computing it, or bringing it up.
    for k in ("recompute", "host", "storage"):
        row[f"{k}_extra_over_device_s"] = row[f"{k}_ttft_s"] - row["device_ttft_s"]
    for tier in TIERS:
        row[f"{tier}_logits_max_abs_diff"] = diffs[tier]
    row["storage_bytes_read"] = stats.bytes_storage_read
    return row


def _crossover(rows: list[dict[str, Any]], tier: str) -> int | None:
    """The smallest tested prefix length from which on ``tier`` beats recompute at every longer one."""
    best: int | None = None
    for row in sorted(rows, key=lambda r: -r["prefix_tokens"]):
        if row[f"{tier}_ratio"] > 1.0:
            best = row["prefix_tokens"]
        else:
            break
    return best


async def _sweep(lengths: tuple[int, ...], rounds: int, smoke: bool) -> dict[str, Any]:
    model = await asyncio.to_thread(TinyCausalLM, SMOKE_MODEL if smoke else SWEEP_MODEL)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-e2e-store-") as d:
        for n in lengths:
            rows.append(await _sweep_length(model, n, rounds, Path(d)))
    return {
        "model": repr(model.config),
        "parameters": model.num_parameters,
        "kv_bytes_per_token": model.config.kv_layout(PAGE_SIZE).token_bytes,
        "page_size": PAGE_SIZE,
        "rows": rows,
        "crossover": {t: _crossover(rows, t) for t in TIERS},
    }


# -- main -------------------------------------------------------------------------


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the end-to-end benchmark; write ``e2e.json`` and ``e2e.png``; return the result."""
    threads = set_threads()
    t0 = time.perf_counter()
    demo_report = _demo_part(quick, smoke)
    lengths = SMOKE_PREFIXES if smoke else QUICK_PREFIXES if quick else FULL_PREFIXES
    rounds = 1 if smoke else 3 if quick else 5
    sweep = asyncio.run(_sweep(lengths, rounds, smoke))

    configs = demo_report["configs"]
    ratio = demo_report["ttft_ratio_no_cache_over_all_tiers"]
    heads = [
        headline("demo TTFT no-cache / all-tiers (mean)", ratio, TARGET_DEMO_RATIO, unit="x"),
    ]
    demo_table = {
        "columns": [
            "config",
            "ttft mean ms",
            "p50 ms",
            "p90 ms",
            "prefill tok",
            "prompt tok",
            "hit device",
            "hit host",
            "hit storage",
        ],
        "rows": [
            [
                name,
                c["ttft_mean_ms"],
                c["ttft_p50_ms"],
                c["ttft_p90_ms"],
                c["prefill_tokens"],
                c["prompt_tokens"],
                c["hit_rates"]["device"],
                c["hit_rates"]["host"],
                c["hit_rates"]["storage"],
            ]
            for name, c in configs.items()
        ],
    }
    rows = sweep["rows"]
    sweep_table = {
        "columns": [
            "prefix",
            "recompute ms",
            "device ms",
            "host ms",
            "storage ms",
            "device ratio",
            "host ratio",
            "storage ratio",
        ],
        "rows": [
            [
                r["prefix_tokens"],
                1e3 * r["recompute_ttft_s"],
                1e3 * r["device_ttft_s"],
                1e3 * r["host_ttft_s"],
                1e3 * r["storage_ttft_s"],
                r["device_ratio"],
                r["host_ratio"],
                r["storage_ratio"],
            ]
            for r in rows
        ],
    }
    crossover_table = {
        "columns": ["tier", "beats recompute from prefix length"],
        "rows": [
            [
                t,
                "not within the sweep" if sweep["crossover"][t] is None else sweep["crossover"][t],
            ]
            for t in TIERS
        ],
    }
    result: dict[str, Any] = {
        "name": NAME,
        "machine": machine_info(),
        "torch_threads": threads,
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "demo": demo_report,
        "sweep": sweep,
        "statistic": (
            "demo: mean/p50/p90 over the requests of one run per configuration; "
            f"sweep: median (and min) of {rounds} rounds after one warm-up round, "
            "recompute and the tiers run in turn within each round"
        ),
        "headline": heads,
        "table": demo_table,
        "sweep_table": sweep_table,
        "crossover_table": crossover_table,
    }
    result["elapsed_s"] = time.perf_counter() - t0
    write_result(NAME, result, out_dir)
    xs = [r["prefix_tokens"] for r in rows]
    plot_lines(
        NAME,
        xs,
        {f"{t} (recompute / load)": [r[f"{t}_ratio"] for r in rows] for t in TIERS},
        title=f"TTFT ratio recompute / cached prefix (+{SUFFIX_TOKENS} new tokens, {threads} threads)",
        xlabel="shared prefix tokens",
        ylabel="recompute TTFT / tier TTFT (>1: loading wins)",
        out_dir=out_dir,
        logx=True,
        logy=True,
    )
    return result


if __name__ == "__main__":
    from benchmarks.run import main as run_main

    raise SystemExit(run_main(["--only", NAME]))
