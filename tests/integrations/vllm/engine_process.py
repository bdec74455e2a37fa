"""One vLLM engine process: vLLM's real offloading manager with tiercache as its secondary tier.

Run by the suite as ``python -m tests.integrations.vllm.engine_process`` with a
JSON request on stdin::

    {"role": "store" | "load", "url": URL, "blocks": N, "block_bytes": B,
     "seed": S, "out": PATH}

The blocks' keys and bytes are drawn from ``seed``, so two processes given
the same seed name the same blocks. ``store`` offloads the blocks as vLLM
does (GPU rows into the primary CPU region, then the cascade to the
secondary tier) and waits until the tier holds them; ``load`` looks them up
step by step until vLLM settles, promotes them and reads them back from the
primary region, writing their bytes back to back to ``out`` (after looking
up, when ``miss_seed`` is given, blocks of that seed that no process stored). The last line
printed is a JSON answer (for ``load``, the lookup answers of every step).
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's import-time deprecation warnings
    from tests.integrations.vllm.harness import Instance, names, payloads, tier_config
    from vllm.v1.kv_offload.base import OffloadKey, make_offload_key


def block_keys(n: int, seed: int) -> list[OffloadKey]:
    """``n`` vLLM block keys drawn from ``seed`` (the same in every process)."""
    return [make_offload_key(hashlib.sha256(f"{seed}:{i}".encode()).digest(), 0) for i in range(n)]


def block_data(n: int, nbytes: int, seed: int) -> list[bytes]:
    """The bytes of ``n`` blocks drawn from ``seed``."""
    return payloads(n, nbytes, seed)


def _serve(req: dict[str, Any]) -> dict[str, Any]:
    n, nbytes, seed = int(req["blocks"]), int(req["block_bytes"]), int(req["seed"])
    keys = block_keys(n, seed)
    inst = Instance([tier_config(str(req["url"]))], kv_bytes_per_block=nbytes)
    try:
        if req["role"] == "store":
            inst.store(keys, block_data(n, nbytes, seed))
            return {"stored": n}
        answer: dict[str, Any] = {}
        if req.get("miss_seed") is not None:
            ctx = inst.request()
            missing = block_keys(n, int(req["miss_seed"]))
            answer["miss_steps"] = names(inst.lookup_until_settled(missing, ctx))
            inst.manager.on_request_finished(ctx)
        ctx = inst.request()
        steps = names(inst.lookup_until_settled(keys, ctx))
        got: list[bytes] = []
        if steps[-1] == ["HIT"] * n:
            got = inst.load(keys, ctx, nbytes)
        Path(req["out"]).write_bytes(b"".join(got))
        return {**answer, "steps": steps, "loaded": len(got)}
    finally:
        inst.close()


def main() -> int:
    answer = _serve(json.load(sys.stdin))
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
