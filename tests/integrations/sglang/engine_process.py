"""One SGLang engine process: a real `HiCacheController` that backs pages up or prefetches them.

Run by the suite as ``python -m tests.integrations.sglang.engine_process`` with
a JSON request on stdin::

    {"role": "backup" | "prefetch", "url": URL, "tokens": [...], "seed": N,
     "mla": bool, "layout": "page_first" | "layer_first", "out": PATH}

``backup`` fills the host pool with random bytes (``seed``) and backs the
pages of ``tokens`` up through the controller's backup thread; ``prefetch``
runs the hit query and the IO thread for ``tokens`` (after the same for
``miss_tokens``, when given: a prefix no process stored). Either way the pages'
bytes, as SGLang flattens them for storage, are written back to back to
``out``, and the last line printed is a JSON answer: the tokens backed up or
the tokens hit and prefetched, and the backend's counters.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.integrations.sglang import sglang_helpers as h


def _serve(req: dict[str, Any]) -> dict[str, Any]:
    g = h.Geometry(mla=bool(req["mla"]), layout=str(req["layout"]))
    ps = g.page_size
    tokens = [int(t) for t in req["tokens"]]
    inst = h.make_instance(g, h.extra(str(req["url"])))
    try:
        answer: dict[str, Any] = {"sglang": h.sg().version_str}
        if req["role"] == "backup":
            h.fill_random(inst.host, int(req["seed"]))
            idx = inst.host.alloc(len(tokens))
            assert idx is not None, "host pool full"
            answer["backed_up"] = h.backup(inst, idx, tokens, h.chain(tokens, ps))
            pages = h.pages_bytes(inst.host, idx, ps)
        else:
            if req.get("miss_tokens"):
                miss = h.prefetch(inst, [int(t) for t in req["miss_tokens"]])
                answer["miss_hit_tokens"] = miss.hit_tokens
                answer["miss_completed_tokens"] = miss.completed_tokens
            got = h.prefetch(inst, tokens)
            answer["hit_tokens"] = got.hit_tokens
            answer["completed_tokens"] = got.completed_tokens
            done = (
                got.host_indices[: got.completed_tokens] if got.host_indices is not None else None
            )
            pages = [] if done is None else h.pages_bytes(inst.host, done, ps)
        Path(req["out"]).write_bytes(b"".join(pages))
        answer["stats"] = {k: v for k, v in inst.backend.stats().items() if isinstance(v, int)}
        return answer
    finally:
        inst.close()


def main() -> int:
    req = json.load(sys.stdin)
    mods, why = h.load()
    if mods is None:
        print(why, file=sys.stderr)
        return 1
    import torch.distributed as dist

    with socket.socket() as s:  # a one-rank gloo group of this process's own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    patch = pytest.MonkeyPatch()
    try:
        with h.single_rank(patch):
            answer = _serve(req)
    finally:
        patch.undo()
        dist.destroy_process_group()
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
