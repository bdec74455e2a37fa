"""tiercache as a storage tier of vLLM's KV offloading, shared by two vLLM instances.

On a GPU server the whole setup is one flag of ``vllm serve`` (printed first).
This script runs the same configuration through vLLM's own scheduler-side
classes on a CPU: vLLM's ``TieringOffloadingSpec`` builds the offloading
manager and, through its ``SecondaryTierFactory``, tiercache's tier. Instance A
offloads 8 KV blocks (vLLM cascades them from its CPU tier into tiercache's
file store); instance B, with an empty CPU tier and the same store, finds them,
promotes them into its CPU tier and reads back the same bytes.

Needs vLLM installed (``make install-vllm`` builds ``.venv-vllm-0.33.0``)::

    .venv-vllm-0.33.0/bin/python examples/vllm_tier.py
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

BLOCK_BYTES = 64 * 1024  # one KV block of every layer, as vLLM lays it out on the CPU
BLOCKS = 8


def extra_config(store_url: str) -> dict[str, object]:
    """``kv_connector_extra_config`` of the OffloadingConnector with tiercache behind it."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * BLOCK_BYTES,
        "secondary_tiers": [
            {
                "type": "TierCacheTier",
                "module_path": "tiercache.integrations.vllm",
                "url": store_url,
                "timeout_s": 5,
            }
        ],
    }


def vllm_instance(store_url: str) -> TieringOffloadingSpec:
    """vLLM's offloading spec, as its connector builds it for one GPU worker."""
    return TieringOffloadingSpec(
        OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("model.layers.0.attn",), group_id=0),),
            worker_kv_bytes_per_block=BLOCK_BYTES,
            enable_kv_cache_events=False,
            extra_config=extra_config(store_url),
            engine_id=uuid.uuid4().hex[:12],
            model=OffloadingModelConfig(name="Qwen/Qwen3-0.6B", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=False,
            ),
        )
    )


def rows(manager: Any) -> np.ndarray:
    """vLLM's primary CPU region, one row per block (what its GPU worker copies to/from)."""
    view = manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)


def end_step(manager: Any) -> None:
    ctx = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    manager.on_schedule_end(ctx)


def main() -> None:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config("file:///var/cache/tiercache/vllm"),
    }
    print("on a GPU server:")
    print(f"  vllm serve Qwen/Qwen3-0.6B --kv-transfer-config '{json.dumps(config)}'")
    store = tempfile.mkdtemp(prefix="tiercache-vllm-")
    try:
        run(f"file://{store}")
    finally:
        shutil.rmtree(store, ignore_errors=True)


def run(url: str) -> None:
    """Instance A offloads blocks into the store at ``url``; instance B loads them."""

    keys = [make_offload_key(os.urandom(32), 0) for _ in range(BLOCKS)]
    rng = np.random.default_rng(0)
    kv = [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8) for _ in range(BLOCKS)]

    # Instance A computes the blocks and offloads them.
    a = vllm_instance(url).get_manager()
    ctx = ReqContext(req_id="a-1")
    a.on_new_request(ctx)
    out = a.prepare_store(keys, ctx)
    region = rows(a)
    for chunk, block in zip(out.store_spec.chunk_ids, kv, strict=True):
        region[chunk, :BLOCK_BYTES] = block  # the GPU -> CPU copy
    del region
    a.complete_store(keys, ctx, True)  # vLLM cascades them to tiercache
    while a.has_pending_work():
        end_step(a)
        time.sleep(0.01)
    a.on_request_finished(ctx)
    a.shutdown()
    print(f"instance A stored {BLOCKS} blocks in {url}")

    # Instance B starts cold and shares the store.
    b = vllm_instance(url).get_manager()
    ctx = ReqContext(req_id="b-1")
    b.on_new_request(ctx)
    steps = []
    while True:
        answers = [b.lookup(k, ctx) for k in keys]
        steps.append(answers[0].name)
        if all(r is LookupResult.HIT for r in answers):
            break
        end_step(b)
        time.sleep(0.01)
    print("instance B lookups, step by step: " + " -> ".join(dict.fromkeys(steps)))
    spec = b.prepare_load(keys, ctx)
    region = rows(b)
    same = all(
        np.array_equal(region[c, :BLOCK_BYTES], block)
        for c, block in zip(spec.chunk_ids, kv, strict=True)
    )
    del region
    b.complete_load(keys, ctx)
    b.on_request_finished(ctx)
    b.shutdown()
    print(f"instance B loaded {BLOCKS} blocks from tiercache storage; KV bit-identical: {same}")


if __name__ == "__main__":
    main()
