"""Drive vLLM's real scheduler-side offloading manager on CPU, as its connector does.

`Instance` is one vLLM instance's ``TieringOffloadingManager``, built by vLLM's
own ``TieringOffloadingSpec.get_manager`` from an ``OffloadingConfig`` (so the
secondary tier goes through vLLM's ``SecondaryTierFactory``), with its primary
CPU region in ``/dev/shm`` as in a real server. The GPU side is played by the
test: it writes a block's bytes into the primary row vLLM hands out, and reads
a promoted block back from the primary row.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TIER = {"type": "TierCacheTier", "module_path": "tiercache.integrations.vllm"}


def tier_config(url: str, **options: Any) -> dict[str, Any]:
    """One ``secondary_tiers`` entry for tiercache (short timeouts for tests)."""
    return {**TIER, "url": url, "timeout_s": 2.0, **options}


def offloading_config(
    tiers: Sequence[dict[str, Any]],
    *,
    model: str = "tiercache-test/tiny",
    dtype: str = "float16",
    block_size: int = 16,
    kv_bytes_per_block: int = 4096,
    num_chunks: int = 64,
    dp_index: int = 0,
    dp_size: int = 1,
) -> OffloadingConfig:
    """vLLM's normalised offloading configuration for a one-worker CPU instance."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=block_size, layer_names=("layers.0", "layers.1"), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": num_chunks * kv_bytes_per_block,
            "secondary_tiers": [dict(t) for t in tiers],
        },
        engine_id=f"tctest-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=block_size, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp_index,
            data_parallel_size=dp_size,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def make_keys(n: int, group: int = 0) -> list[OffloadKey]:
    """``n`` distinct vLLM block keys (random 32-byte block hashes)."""
    return [make_offload_key(os.urandom(32), group) for _ in range(n)]


def payloads(n: int, nbytes: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(n)]


class Instance:
    """One vLLM instance's scheduler-side offloading manager (real vLLM classes)."""

    def __init__(self, tiers: Sequence[dict[str, Any]], **config: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tiers, **config))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self._requests = 0
        self._closed = False

    # The primary region, as the GPU worker sees it. Arrays are made per call
    # so that no view outlives the region (vLLM unmaps it at shutdown).
    @property
    def row_bytes(self) -> int:
        stride: int = self.manager.primary_tier.get_kv_memoryview().strides[0]
        return stride

    def write_row(self, chunk: int, data: bytes) -> None:
        rows = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)
        rows.reshape(-1, self.row_bytes)[chunk, : len(data)] = np.frombuffer(data, np.uint8)

    def read_row(self, chunk: int, n: int) -> bytes:
        rows = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)
        return rows.reshape(-1, self.row_bytes)[chunk, :n].tobytes()

    def request(self, name: str | None = None) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=name or f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        """The end of one scheduler step."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def settle(self, timeout: float = 10.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "jobs still pending"
            time.sleep(0.01)
            self.step()

    def store(self, keys: Sequence[OffloadKey], data: Sequence[bytes]) -> None:
        """Offload blocks as vLLM does: GPU -> primary, then cascade to the tier."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for chunk, blob in zip(out.store_spec.chunk_ids, data, strict=True):
            self.write_row(int(chunk), blob)
        self.manager.complete_store(keys, ctx, True)
        self.settle()
        self.manager.on_request_finished(ctx)
        self.step()

    def lookup_until_settled(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, timeout: float = 15.0
    ) -> list[list[LookupResult]]:
        """Look the keys up once per step until none answers RETRY or HIT_PENDING.

        Returns the answers of every step.
        """
        history: list[list[LookupResult]] = []
        deadline = time.monotonic() + timeout
        while True:
            answers = [self.manager.lookup(k, ctx) for k in keys]
            history.append(answers)
            if not any(a in (LookupResult.RETRY, LookupResult.HIT_PENDING) for a in answers):
                return history
            assert time.monotonic() < deadline, f"lookups never settled: {history[-3:]}"
            self.step()
            time.sleep(0.01)

    def load(self, keys: Sequence[OffloadKey], ctx: ReqContext, n: int) -> list[bytes]:
        """Read promoted blocks from the primary tier, as the GPU worker would."""
        spec = self.manager.prepare_load(keys, ctx)
        out = [self.read_row(int(c), n) for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.shutdown()


def names(history: list[list[LookupResult]]) -> list[list[str]]:
    return [[a.name for a in step] for step in history]
