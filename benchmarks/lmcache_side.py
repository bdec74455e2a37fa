"""LMCache's side of ``bench_serve``: pages stored in and read back from LMCache's own server.

Run in the LMCache environment (``make install-lmcache``), not imported by the
package or the other benchmarks::

    .venv-lmcache-0.5.6/bin/python benchmarks/lmcache_side.py --pages 128 --page-bytes 786432

It starts LMCache's multiprocess server (``lmcache server``: one KV cache
server per node, engines connect over ZeroMQ) on loopback with its chunk
size set to one page (64 tokens), and drives it with LMCache's own client for
that server (``ServerBenchClient``, what ``lmcache bench server --mode cpu``
uses) holding a CPU KV cache of the same geometry as ``bench_serve``'s pages
(MHA, 24 layers, 1 KV head of 128, fp16, 64-token blocks: 768 KiB a block).
Each round stores ``pages`` blocks of a fresh request (cold: lookup, then
STORE) and reads them back (warm: lookup, zero the destination, RETRIEVE),
and checks the bytes read back against the bytes stored (LMCache's own
per-chunk checksums). Both of LMCache's CPU transfer modes are measured:
``engine_driven`` (the worker gathers and scatters through the server's
staging buffers) and ``lmcache_driven`` (the server copies through POSIX
shared memory the worker registered).

The last line printed is JSON: which server ran, pages/s per direction and
mode, and the seconds of every round. If ``lmcache server`` does not start,
the answer says why and nothing is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 24, 1, 128, 64
START_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _mp_server(l1_gb: float, log: Path) -> Iterator[tuple[str, str]]:
    """``lmcache server`` on loopback; yields its ZeroMQ and HTTP URLs once it serves."""
    port, http = _free_port(), _free_port()
    lmcache = Path(sys.executable).with_name("lmcache")
    cmd = [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--chunk-size", str(PAGE_TOKENS), "--l1-size-gb", str(l1_gb)]
    cmd += ["--eviction-policy", "LRU", "--http-host", "127.0.0.1", "--http-port", str(http)]
    cmd += ["--disable-observability", "--disable-metrics", "--supported-transfer-mode", "auto"]
    cmd += ["--shm-name", f"tiercache-bench-lmcache-{os.getpid()}"]  # engine_driven over SHM
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_S
        while b"cache server is running" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"lmcache server did not start: {log.read_text(errors='replace')[-1500:]}"
                )
            time.sleep(0.1)
        yield f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(rpc: str, http: str, pages: int, mode: str) -> Any:
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    blocks = 2 * pages + 8
    config = BenchConfig(
        rpc_url=rpc,
        http_url=http,
        mode="cpu",
        transfer_mode=mode,
        tp_size=1,
        use_mla=False,
        num_tokens=pages * PAGE_TOKENS,  # one sequence token is put in front
        kvcache_shape_spec=f"(2,{blocks},{PAGE_TOKENS},{HEADS},{HEAD_DIM}):float16:{LAYERS}",
        num_blocks=blocks,
        block_size=PAGE_TOKENS,
    )
    client = ServerBenchClient(config, log=lambda _msg: None)
    client.start()
    return client


def _round(client: Any, seq: int, pages: int) -> tuple[float, float, float]:
    """Store ``pages`` blocks of request ``seq``, read them back; their seconds and the lookup's."""
    cold = client.create_request(seq, f"bench-{seq}-cold", "cold")
    assert cold is not None and cold.total_chunks == pages, cold
    if client.lookup(cold).hit_chunks != 0:
        raise RuntimeError("a fresh request hit")
    want = client.compute_checksums(cold, 0, cold.num_full_tokens)
    t0 = time.perf_counter()
    stored = client.store(cold, 0, cold.num_full_tokens)
    t1 = time.perf_counter()
    client.end_session(cold)
    if stored is None or not stored.succeeded:
        raise RuntimeError("LMCache's STORE failed")

    warm = client.create_request(seq, f"bench-{seq}-warm", "warm")
    t2 = time.perf_counter()
    hit = client.lookup(warm).hit_chunks
    t3 = time.perf_counter()
    deadline = t3 + 10.0
    while hit != pages and time.perf_counter() < deadline:  # a STORE that lands after its reply
        time.sleep(0.01)
        hit = client.lookup(warm).hit_chunks
    if hit != pages:
        raise RuntimeError(f"LMCache's lookup found {hit} of {pages} chunks it stored")
    client.zero_destination(warm, 0, warm.num_full_tokens)
    t4 = time.perf_counter()
    got = client.retrieve(warm, 0, warm.num_full_tokens)
    t5 = time.perf_counter()
    if got is None or not got.succeeded:
        raise RuntimeError("LMCache's RETRIEVE failed")
    if client.compute_checksums(warm, 0, warm.num_full_tokens) != want:
        raise RuntimeError("LMCache read back other bytes than it stored")
    client.end_session(warm)
    return t1 - t0, t5 - t4, t3 - t2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--page-bytes", type=int, default=786432)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--log", type=Path, default=Path("/tmp/tiercache-bench-lmcache-server.log"))
    args = parser.parse_args()
    page_bytes = 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    if args.page_bytes != page_bytes:
        parser.error(f"this side's geometry makes {page_bytes}-byte pages, not {args.page_bytes}")
    import lmcache

    answer: dict[str, Any] = {"lmcache_version": getattr(lmcache, "__version__", "?")}
    # Room for every round of both modes (and half again): no stored page is evicted.
    stored = 2 * (args.rounds + 1) * args.pages * page_bytes
    l1_gb = round(max(1.0, 1.5 * stored / (1 << 30)), 2)
    try:
        with _mp_server(l1_gb, args.log) as (rpc, http):
            answer["server"] = "lmcache server (multiprocess)"
            modes: dict[str, Any] = {}
            for base, mode in ((0, "engine_driven"), (1000, "lmcache_driven")):
                client = None
                try:
                    client = _client(rpc, http, args.pages, mode)
                    _round(client, base, args.pages)  # warm-up
                    secs: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
                    for r in range(1, args.rounds + 1):
                        put, get, lookup = _round(client, base + r, args.pages)
                        secs["put"].append(put)
                        secs["get"].append(get)
                        secs["lookup"].append(lookup)
                    modes[mode] = {
                        "seconds": secs,
                        "pages_per_s": {
                            d: args.pages / statistics.median(secs[d]) for d in ("put", "get")
                        },
                        "lookup_median_s": statistics.median(secs["lookup"]),
                    }
                except Exception as e:  # one mode failing leaves the other's numbers
                    modes[mode] = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    if client is not None:
                        client.close()
            answer["modes"] = modes
            best = {
                d: max(
                    (m["pages_per_s"][d] for m in modes.values() if "pages_per_s" in m),
                    default=None,
                )
                for d in ("put", "get")
            }
            if None not in best.values():
                answer["pages_per_s"] = best
    except RuntimeError as e:
        answer["server_error"] = str(e)
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
