"""The tiercache demo: one serving workload under four cache configurations.

An asyncio serving loop drives `TinyCausalLM` (fp32, CPU) through a
`TierCache`. The workload mixes two patterns:

* **multi-turn chat** (modelled on SGLang's ``bench_multiturn.py``): N clients
  share a system prompt; each round a client sends its whole conversation plus
  a new question, greedily decodes an answer, and appends it to the
  conversation. Rounds arrive as a Poisson process per client (seeded).
* **a shared long document** asked several different questions, also with
  Poisson arrivals.

The same workload runs under five configurations:

``no_cache``     recompute every prompt (the cache's prefix is never used);
``device``       device tier only (``write_back`` with a pool that never evicts);
``device_host``  a small device pool whose evictions go to the host tier;
``all_tiers``    device + host + a file store: the workload runs once to fill
                 the store, the cache is flushed, and the second run is measured.
``shared_server`` one cache per node: a ``tiercache serve`` process owns the
                 store, and two engine processes share it through
                 ``tiercache+unix://``. The first process runs the workload and
                 flushes its cache into the server, then exits; the second, a
                 fresh process with empty device and host tiers, is measured:
                 its very first request finds the prefix the first process
                 computed.

For each it reports the time to first token (mean, p50, p90), the prompt
tokens the model computed, and the hit rate of each tier; checks that every
configuration generated exactly the same tokens; writes ``<dir>/demo.json``
and, when matplotlib imports, ``<dir>/demo.png``. The model's forward pass runs
in a worker thread and waits on the load's layer futures, so copies overlap
compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tiercache._checks import check_number, check_positive
from tiercache.cache import TierCache
from tiercache.config import TierCacheConfig
from tiercache.errors import ConfigError, TierCacheError
from tiercache.memory.pools import DeviceKVPool
from tiercache.models.tiny import TinyCausalLM, TinyConfig

__all__ = [
    "CONFIG_NAMES",
    "SHARED_SERVER",
    "ConfigResult",
    "DemoSettings",
    "Workload",
    "build_workload",
    "demo_configs",
    "main",
    "run_demo",
    "settings_for",
    "shared_process_main",
]

logger = logging.getLogger(__name__)

PAGE_SIZE = 16
MODEL_NAME = "tiny-demo"
#: The configurations, in the order they run.
#: The configurations that run in the demo's own process, in the order they run
#: (``report["configs"]``); `SHARED_SERVER` runs last, in processes of its own
#: (``report["shared_server"]``).
CONFIG_NAMES: tuple[str, ...] = ("no_cache", "device", "device_host", "all_tiers")
SHARED_SERVER = "shared_server"
#: The page arena of the ``shared_server`` configuration's server.
SHARED_ARENA_BYTES = 256 << 20
#: How long the ``shared_server`` server may take to say it is ready.
SERVER_START_S = 60.0


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """The workload's shape.

    Attributes:
        clients: chat clients.
        rounds: questions each chat client asks.
        system_tokens: length of the shared system prompt.
        question_tokens: length of each new question.
        answer_tokens: tokens greedily decoded per answer.
        doc_tokens: length of the shared document.
        doc_questions: different questions asked about it.
        mean_gap_s: mean of the exponential gap between a client's requests.
        max_running: requests computed at once (the rest queue, and wait
            counts towards their time to first token).
        seed: seeds the tokens and the arrival times.
    """

    clients: int = 8
    rounds: int = 4
    system_tokens: int = 256
    question_tokens: int = 48
    answer_tokens: int = 8
    doc_tokens: int = 1024
    doc_questions: int = 4
    mean_gap_s: float = 0.02
    max_running: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "clients",
            "rounds",
            "system_tokens",
            "question_tokens",
            "answer_tokens",
            "doc_tokens",
            "doc_questions",
            "max_running",
        ):
            object.__setattr__(self, name, check_positive(getattr(self, name), name))
        check_number(self.mean_gap_s, "mean_gap_s")


def settings_for(quick: bool, clients: int | None = None, seed: int = 0) -> DemoSettings:
    """The full demo's settings, or the small ``--quick`` ones (a few seconds)."""
    if quick:
        s = DemoSettings(
            clients=3,
            rounds=2,
            system_tokens=64,
            question_tokens=16,
            answer_tokens=4,
            doc_tokens=256,
            doc_questions=2,
            mean_gap_s=0.005,
            max_running=1,
            seed=seed,
        )
    else:
        s = DemoSettings(seed=seed)
    if clients is not None:
        s = DemoSettings(**{**asdict(s), "clients": clients})
    return s


@dataclass(frozen=True, slots=True)
class Workload:
    """The static part of the workload: prompts' fixed pieces and arrival gaps.

    The chat prompts also hold the model's answers, so they are only known
    while the workload runs.
    """

    settings: DemoSettings
    vocab_size: int
    system_prompt: list[int]
    questions: list[list[list[int]]]  # [client][round]
    chat_gaps: list[list[float]]  # [client][round]
    document: list[int]
    doc_questions: list[list[int]]
    doc_gaps: list[float]

    @property
    def num_requests(self) -> int:
        s = self.settings
        return s.clients * s.rounds + s.doc_questions

    def shared_prefix_tokens(self, page_size: int = PAGE_SIZE) -> int:
        """Prompt tokens, summed over requests, in whole pages of a shared prefix (system prompt or document)."""
        s = self.settings
        sys_pages = len(self.system_prompt) // page_size * page_size
        doc_pages = len(self.document) // page_size * page_size
        return s.clients * s.rounds * sys_pages + s.doc_questions * doc_pages


def build_workload(settings: DemoSettings, vocab_size: int) -> Workload:
    """Draw the workload's tokens and Poisson arrival gaps from ``settings.seed``."""
    s = settings
    rng = random.Random(s.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def gap() -> float:
        return rng.expovariate(1.0 / s.mean_gap_s) if s.mean_gap_s > 0 else 0.0

    system = toks(s.system_tokens)
    questions = [[toks(s.question_tokens) for _ in range(s.rounds)] for _ in range(s.clients)]
    chat_gaps = [[gap() for _ in range(s.rounds)] for _ in range(s.clients)]
    doc = toks(s.doc_tokens)
    doc_q = [toks(s.question_tokens) for _ in range(s.doc_questions)]
    doc_gaps = [gap() for _ in range(s.doc_questions)]
    return Workload(s, vocab_size, system, questions, chat_gaps, doc, doc_q, doc_gaps)


def model_config() -> TinyConfig:
    return TinyConfig(dtype=torch.float32, seed=0)


def demo_configs(
    store: Path, settings: DemoSettings, server_socket: Path | None = None
) -> dict[str, tuple[TierCacheConfig, bool]]:
    """Each configuration's cache config and whether it uses the cached prefix.

    The small device pool of ``device_host``, ``all_tiers`` and
    ``shared_server`` holds the requests that run at once and little more, so
    the rest of the workload's KV is evicted to the host tier.
    ``server_socket`` is the socket of ``shared_server``'s node server
    (default: ``serve.sock`` beside ``store``).
    """
    mc = model_config()
    s = settings
    biggest = max(
        s.system_tokens + s.rounds * (s.question_tokens + s.answer_tokens),
        s.doc_tokens + s.question_tokens + s.answer_tokens,
    )
    small_device = (s.max_running * (-(-biggest // PAGE_SIZE) + 1) + 1) * PAGE_SIZE
    base = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=PAGE_SIZE,
        model=MODEL_NAME,
        device="cpu",
    )
    small = dict(device_tokens=small_device, host_tokens=65536, write_policy="write_through")
    sock = server_socket if server_socket is not None else store.parent / "serve.sock"
    return {
        "no_cache": (base.replace(device_tokens=4096, host_tokens=PAGE_SIZE), False),
        "device": (
            base.replace(device_tokens=32768, host_tokens=1024, write_policy="write_back"),
            True,
        ),
        "device_host": (base.replace(**small), True),
        "all_tiers": (
            base.replace(
                **small,
                storage_url=store.resolve().as_uri(),
                prefetch_threshold=PAGE_SIZE,
                prefetch_policy="wait_complete",
            ),
            True,
        ),
        SHARED_SERVER: (
            base.replace(
                **small,
                storage_url=f"tiercache+unix://{sock.resolve()}",
                prefetch_threshold=PAGE_SIZE,
                prefetch_policy="wait_complete",
            ),
            True,
        ),
    }


@dataclass(slots=True)
class RunResult:
    """What one pass over the workload measured."""

    ttfts: list[float] = field(default_factory=list)
    #: Per request, in the order their first token came: prompt tokens, cached tokens.
    served: list[tuple[int, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    answers: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ConfigResult:
    """One configuration's numbers, as written to ``demo.json``."""

    name: str
    requests: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    prefill_tokens: int
    prompt_tokens: int
    hit_rates: dict[str, float]
    device_evictions: int
    loads_back: int
    wall_s: float


class _Progress:
    """Progress over every configuration's requests, drawn by tqdm.

    On a terminal it is one live bar on stderr, labelled with the configuration
    that runs. Elsewhere (a pipe, a CI log) tqdm draws nothing and each
    configuration gets one plain line when it starts, so the log stays short.
    Silent when disabled.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = tqdm(
            total=total,
            unit="req",
            file=sys.stderr,
            disable=None if enabled else True,  # None: draw only on a terminal
            dynamic_ncols=True,
            mininterval=0.2,
        )
        self._lines = enabled and bool(self._bar.disable)
        self._total = total
        self._done = 0  # a disabled tqdm bar does not count

    def start(self, label: str) -> None:
        self._bar.set_description_str(label)
        if self._lines:
            print(f"demo: {label} ({self._done}/{self._total} requests done)", file=sys.stderr)

    def step(self) -> None:
        self._done += 1
        self._bar.update()

    def close(self) -> None:
        self._bar.close()


def _p90(values: list[float]) -> float:
    """The 90th percentile, linearly interpolated between samples (numpy's default)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def _decode(
    model: TinyCausalLM,
    pool: DeviceKVPool,
    first: int,
    context: torch.Tensor,
    slots: torch.Tensor,
    n_answer: int,
) -> list[int]:
    """Greedy decode after the prefill: ``slots`` hold the fed-back tokens' K/V (runs in a worker thread)."""
    answer = [first]
    for i in range(n_answer - 1):
        logits = model.decode_step(pool, answer[-1], int(slots[i]), context)
        context = torch.cat([context, slots[i : i + 1]])
        answer.append(int(logits.argmax()))
    return answer


async def _serve(
    cache: TierCache,
    model: TinyCausalLM,
    prompt: list[int],
    n_answer: int,
    use_prefix: bool,
    result: RunResult,
) -> list[int]:
    """Serve one request: reuse the cached prefix (or not), prefill, decode, commit."""
    t0 = time.perf_counter()
    pool = cache.device_pool
    n_kv = len(prompt) + n_answer - 1  # the last answer token is never fed back
    if not use_prefix:
        ps = cache.layout.page_size
        slots = await cache.alloc_device(-(-n_kv // ps) * ps)
        try:
            logits = await asyncio.to_thread(model.prefill, pool, prompt, slots[: len(prompt)])
            result.ttfts.append(time.perf_counter() - t0)
            result.served.append((len(prompt), 0))
            result.prefill_tokens += len(prompt)
            first = int(logits[-1].argmax())
            return await asyncio.to_thread(
                _decode, model, pool, first, slots[: len(prompt)], slots[len(prompt) :], n_answer
            )
        finally:
            cache.free_device(slots)
    # The cache leaves at least one prompt token to compute (its logits give
    # the first answer token) and waits for room other requests hold.
    async with cache.request(prompt) as req:
        k = req.cached_tokens
        new = await req.alloc(n_kv - k)
        prefix = req.prefix_indices
        n_new = len(prompt) - k
        logits = await asyncio.to_thread(
            model.prefill, pool, prompt[k:], new[:n_new], prefix, req.layer_ready
        )
        result.ttfts.append(time.perf_counter() - t0)
        result.served.append((len(prompt), k))
        result.prefill_tokens += n_new
        first = int(logits[-1].argmax())
        context = torch.cat([prefix, new[:n_new]])
        answer = await asyncio.to_thread(
            _decode, model, pool, first, context, new[n_new:], n_answer
        )
        kv_tokens = prompt + answer[:-1]
        await req.commit(kv_tokens, torch.cat([prefix, new]))
    return answer


async def run_workload(
    cache: TierCache,
    model: TinyCausalLM,
    wl: Workload,
    use_prefix: bool,
    on_done: Callable[[], None] = lambda: None,
) -> RunResult:
    """Run every client of ``wl`` concurrently; returns what was measured."""
    s = wl.settings
    result = RunResult()
    sem = asyncio.Semaphore(s.max_running)

    async def serve(key: str, prompt: list[int]) -> list[int]:
        async with sem:
            answer = await _serve(cache, model, prompt, s.answer_tokens, use_prefix, result)
        result.prompt_tokens += len(prompt)
        result.answers[key] = answer
        on_done()
        return answer

    async def chat(c: int) -> None:
        history = list(wl.system_prompt)
        for r in range(s.rounds):
            await asyncio.sleep(wl.chat_gaps[c][r])
            prompt = history + wl.questions[c][r]
            answer = await serve(f"chat{c}.{r}", prompt)
            history = prompt + answer

    async def doc(i: int) -> None:
        await asyncio.sleep(wl.doc_gaps[i])
        await serve(f"doc{i}", wl.document + wl.doc_questions[i])

    t0 = time.perf_counter()
    await asyncio.gather(
        *(chat(c) for c in range(s.clients)), *(doc(i) for i in range(s.doc_questions))
    )
    result.wall_s = time.perf_counter() - t0
    return result


def _hits(before: Any, after: Any) -> dict[str, float]:
    req = after.tokens_requested - before.tokens_requested
    n = req or 1
    dev = (after.tokens_device_hit - before.tokens_device_hit) / n
    host = (after.tokens_host_hit - before.tokens_host_hit) / n
    sto = (after.tokens_storage_hit - before.tokens_storage_hit) / n
    return {"device": dev, "host": host, "storage": sto, "total": dev + host + sto}


async def _run_config(
    name: str,
    config: TierCacheConfig,
    use_prefix: bool,
    model: TinyCausalLM,
    wl: Workload,
    progress: _Progress,
    metrics: _MetricsServer | None = None,
    on_config_done: ConfigHook | None = None,
) -> tuple[ConfigResult, list[RunResult]]:
    runs: list[RunResult] = []
    async with TierCache(config) as cache, contextlib.AsyncExitStack() as stack:
        if metrics is not None:
            stack.push_async_callback(metrics.watch(cache, name).aclose)
        if name == "all_tiers":
            progress.start(f"{name} (fill store)")
            runs.append(await run_workload(cache, model, wl, use_prefix, progress.step))
            await cache.wait_idle()
            await cache.flush()
        progress.start(name)
        before = cache.stats()
        run = await run_workload(cache, model, wl, use_prefix, progress.step)
        after = cache.stats()
        runs.append(run)
        await cache.wait_idle()
        if on_config_done is not None:
            await on_config_done(name, cache)
    t = run.ttfts
    res = ConfigResult(
        name=name,
        requests=len(t),
        ttft_mean_ms=1e3 * statistics.fmean(t),
        ttft_p50_ms=1e3 * statistics.median(t),
        ttft_p90_ms=1e3 * _p90(t),
        prefill_tokens=run.prefill_tokens,
        prompt_tokens=run.prompt_tokens,
        hit_rates=_hits(before, after),
        device_evictions=after.device_evictions - before.device_evictions,
        loads_back=after.loads_back - before.loads_back,
        wall_s=run.wall_s,
    )
    return res, runs


#: ``await hook(name, cache)``: called once per configuration, after its
#: measured run and once the cache is idle, before the cache closes.
ConfigHook = Callable[[str, TierCache], Awaitable[None]]


class _MetricsServer:
    """The demo's Prometheus endpoint: one registry, served over HTTP by prometheus_client.

    Each configuration's cache is watched by its own `TierCacheCollector`
    (labelled ``config=<name>``) while it runs, and unregistered when it closes.
    """

    def __init__(self, port: int, addr: str) -> None:
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise ConfigError(
                "--metrics-port needs prometheus_client: pip install 'tiercache[metrics]'"
            ) from None
        self.port = port
        self.addr = addr
        self.registry = CollectorRegistry()
        self._server: Any = None
        self._thread: Any = None

    async def start(self) -> None:
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = await asyncio.to_thread(
                start_http_server, self.port, self.addr, self.registry
            )
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {self.addr}:{self.port}: {e}") from None
        self.port = self._server.server_port
        print(f"demo: metrics on http://{self.addr}:{self.port}/metrics", file=sys.stderr)

    def watch(self, cache: TierCache, name: str) -> Any:
        from tiercache.metrics import register

        return register(cache, self.registry, labels={"config": name})

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(server.shutdown)
            await asyncio.to_thread(server.server_close)
            await asyncio.to_thread(self._thread.join)


async def _flush(name: str, cache: TierCache) -> None:
    """Write every page of ``cache`` to its storage (the node's server) before it closes."""
    await cache.flush()
    await cache.wait_idle()


async def _shared_process_run(req: dict[str, Any]) -> dict[str, Any]:
    """One engine process of ``shared_server``: the workload through a cache on the node's server."""
    settings = DemoSettings(**req["settings"])
    model = await asyncio.to_thread(TinyCausalLM, model_config())
    wl = build_workload(settings, model.config.vocab_size)
    configs = await asyncio.to_thread(
        demo_configs, Path(req["store"]), settings, Path(req["socket"])
    )
    cfg, use_prefix = configs[SHARED_SERVER]
    hook = _flush if req["role"] == "fill" else None
    res, runs = await _run_config(
        SHARED_SERVER, cfg, use_prefix, model, wl, _Progress(0, False), on_config_done=hook
    )
    run = runs[-1]
    return {"result": asdict(res), "answers": run.answers, "served": run.served, "pid": os.getpid()}


def shared_process_main() -> int:
    """Entry point of a ``shared_server`` engine process (``python -m tiercache.demo``).

    Reads its request as JSON on stdin (``role``: ``fill`` runs the workload
    and flushes the cache into the server, ``measure`` runs it; ``settings``,
    ``store``, ``socket``) and prints its result as one JSON line.
    """
    req = json.load(sys.stdin)
    print(json.dumps(asyncio.run(_shared_process_run(req))), flush=True)
    return 0


class _NodeServerProcess:
    """The ``shared_server`` configuration's ``tiercache serve`` process.

    Started as an operator starts it, with the socket in a short folder of its
    own; ready when it prints its ready line. Its output is drained while it
    runs (the last lines are kept for an error message); `stop` sends SIGTERM,
    so it drains and exits, and kills it if it has not within 30 s.
    """

    def __init__(self, socket: Path, arena_bytes: int) -> None:
        self.socket = socket
        self.arena_bytes = arena_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None
        self.lines: list[str] = []

    async def start(self) -> str:
        """Start the server; returns its ready line.

        Raises:
            TierCacheError: it exited or said nothing within `SERVER_START_S`.
        """
        from tiercache.serve.run import READY_PREFIX

        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tiercache",
            "serve",
            "--socket",
            str(self.socket),
            "--arena-bytes",
            str(self.arena_bytes),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out = self._proc.stdout
        assert out is not None
        try:
            async with asyncio.timeout(SERVER_START_S):
                while True:
                    line = await self._readline(out)
                    if line is None:
                        raise TierCacheError(
                            "tiercache serve exited before it was ready: " + " | ".join(self.lines)
                        )
                    if line.startswith(READY_PREFIX):
                        break
        except TimeoutError:
            raise TierCacheError(
                f"tiercache serve was not ready within {SERVER_START_S:.0f} s"
            ) from None
        self._drain = asyncio.create_task(self._drain_output(out))
        return line

    async def _readline(self, out: asyncio.StreamReader) -> str | None:
        raw = await out.readline()
        if not raw:
            return None
        line = raw.decode(errors="replace").rstrip()
        self.lines = [*self.lines[-19:], line]
        return line

    async def _drain_output(self, out: asyncio.StreamReader) -> None:
        while await self._readline(out) is not None:
            pass

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._drain is not None:
            await self._drain


async def _engine_process(role: str, store: Path, settings: DemoSettings, socket: Path) -> Any:
    """Run one ``shared_server`` engine process to its end; returns its JSON result.

    Raises:
        TierCacheError: the process failed (the message holds the end of its stderr).
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tiercache.demo",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    req = {"role": role, "settings": asdict(settings), "store": str(store), "socket": str(socket)}
    out, err = await proc.communicate(json.dumps(req).encode())
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise TierCacheError(
            f"the demo's {role} engine process exited {proc.returncode}: "
            + err.decode(errors="replace")[-2000:]
        )
    return json.loads(lines[-1])


async def _run_shared_server(
    store: Path, settings: DemoSettings, socket: Path, wl: Workload, progress: _Progress
) -> tuple[ConfigResult, dict[str, dict[str, list[int]]], dict[str, Any]]:
    """``shared_server``: a node server and two engine processes, one after the other.

    Returns the measured (second) process's result, both processes' answers,
    and what the report says of the configuration: the server, each
    process's id and hit rates, and how much of the second process's first
    request came from the cache.
    """
    server = _NodeServerProcess(socket, SHARED_ARENA_BYTES)
    try:
        ready = await server.start()
        done: dict[str, Any] = {}
        for role, label in (("fill", "process 1"), ("measure", "process 2")):
            progress.start(f"shared_server ({label})")
            done[role] = await _engine_process(role, store, settings, socket)
            for _ in range(wl.num_requests):
                progress.step()
    finally:
        await server.stop()
    first, second = done["fill"], done["measure"]
    prompt_tokens, cached_tokens = second["served"][0]
    info = {
        "server": ready,
        "arena_bytes": SHARED_ARENA_BYTES,
        "process_1": {"pid": first["pid"], "hit_rates": first["result"]["hit_rates"]},
        "process_2": {"pid": second["pid"], "hit_rates": second["result"]["hit_rates"]},
        "first_request": {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens},
    }
    answers = {f"{SHARED_SERVER}/process_1": first["answers"], SHARED_SERVER: second["answers"]}
    return ConfigResult(**second["result"]), answers, info


async def run_demo(
    directory: Path,
    settings: DemoSettings,
    *,
    progress: bool = True,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    on_config_done: ConfigHook | None = None,
) -> dict[str, Any]:
    """Run the five configurations; returns the report (also written to ``<directory>/demo.json``).

    The file store lives in ``<directory>/store`` and is emptied first, so the
    ``all_tiers`` numbers always come from this run's own fill; a ``store``
    folder there that holds anything but file store pages is left alone and
    the demo refuses to run. The ``shared_server`` configuration starts
    ``tiercache serve`` (its socket in a fresh folder under the system's
    temporary directory, removed at the end) and two engine processes.

    Args:
        directory: output folder (``demo.json``, ``demo.png``, the file store).
        settings: the workload's shape.
        progress: show progress on stderr.
        metrics_port: serve Prometheus metrics on this port while the demo runs
            (``0``: any free port); each configuration's cache is exported
            with the label ``config=<name>`` while it runs. Needs the
            ``metrics`` extra.
        metrics_addr: the address the metrics server binds.
        on_config_done: ``await on_config_done(name, cache)`` after each
            configuration's measured run, once its cache is idle.

    Raises:
        ConfigError: ``metrics_port`` was given and prometheus_client is
            missing or the port cannot be bound, or ``<directory>/store``
            holds something other than file store pages.
        TierCacheError: the node server or an engine process of
            ``shared_server`` failed.
    """
    store = directory / "store"
    metrics = _MetricsServer(metrics_port, metrics_addr) if metrics_port is not None else None
    if metrics is not None:
        await metrics.start()
    try:
        return await _run_demo(directory, store, settings, progress, metrics, on_config_done)
    finally:
        if metrics is not None:
            await metrics.stop()


def _check_only_pages(store: Path) -> None:
    """Refuse to empty ``store`` unless it holds only what a file store writes there.

    The demo empties ``<directory>/store`` before each run; a folder of that
    name that holds anything else is not the demo's to delete.

    Raises:
        ConfigError: ``store`` is not a directory, or holds a file that is
            not a page (``*.page``) or a page being written (``*.tmp``).
    """
    if not store.exists() and not store.is_symlink():
        return
    if store.is_symlink() or not store.is_dir():
        raise ConfigError(f"{store} is not a folder the demo made: not removing it")
    for path in store.rglob("*"):
        if path.is_symlink() or not (path.is_dir() or path.name.endswith((".page", ".tmp"))):
            raise ConfigError(
                f"{store} holds {path.relative_to(store)}, which is not a file store page: "
                "not emptying it (choose another directory)"
            )


async def _run_demo(
    directory: Path,
    store: Path,
    settings: DemoSettings,
    progress: bool,
    metrics: _MetricsServer | None,
    on_config_done: ConfigHook | None,
) -> dict[str, Any]:

    def prepare() -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        _check_only_pages(store)
        shutil.rmtree(store, ignore_errors=True)
        # A Unix socket's path is limited to ~100 bytes: a short folder of its own.
        return Path(tempfile.mkdtemp(prefix="tiercache-demo-")) / "serve.sock"

    socket = await asyncio.to_thread(prepare)
    try:
        return await _run_all(directory, store, socket, settings, progress, metrics, on_config_done)
    finally:
        await asyncio.to_thread(shutil.rmtree, socket.parent, True)


async def _run_all(
    directory: Path,
    store: Path,
    socket: Path,
    settings: DemoSettings,
    progress: bool,
    metrics: _MetricsServer | None,
    on_config_done: ConfigHook | None,
) -> dict[str, Any]:
    model = await asyncio.to_thread(TinyCausalLM, model_config())
    wl = build_workload(settings, model.config.vocab_size)
    configs = await asyncio.to_thread(demo_configs, store, settings, socket)  # resolves paths
    # all_tiers and shared_server run the workload twice.
    bar = _Progress(wl.num_requests * (len(configs) + 2), progress)
    results: list[ConfigResult] = []
    answers: dict[str, dict[str, list[int]]] = {}
    try:
        for name in CONFIG_NAMES:
            cfg, use_prefix = configs[name]
            res, runs = await _run_config(
                name, cfg, use_prefix, model, wl, bar, metrics, on_config_done
            )
            results.append(res)
            for i, r in enumerate(runs):
                answers[name if i == len(runs) - 1 else f"{name}/fill"] = r.answers
        shared_res, more, shared = await _run_shared_server(store, settings, socket, wl, bar)
        answers.update(more)
    finally:
        bar.close()
    reference = answers["no_cache"]
    mismatched = sorted(k for k, a in answers.items() if a != reference)
    by_name = {r.name: r for r in results}
    none, full = by_name["no_cache"], by_name["all_tiers"]
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "model": {"config": repr(model.config), "parameters": model.num_parameters},
        "page_size": PAGE_SIZE,
        "requests": wl.num_requests,
        "shared_prefix_tokens": wl.shared_prefix_tokens(PAGE_SIZE),
        "prompt_tokens": none.prompt_tokens,
        "configs": {r.name: asdict(r) for r in results},
        "tokens_identical": not mismatched,
        "mismatched": mismatched,
        "ttft_ratio_no_cache_over_all_tiers": none.ttft_mean_ms / full.ttft_mean_ms
        if full.ttft_mean_ms
        else float("inf"),
        "prefill_token_reduction": 1.0 - full.prefill_tokens / none.prefill_tokens
        if none.prefill_tokens
        else 0.0,
        SHARED_SERVER: {"config": asdict(shared_res), **shared},
        "answers": reference,
    }
    await asyncio.to_thread(_write_outputs, directory, report, [*results, shared_res])
    return report


def _write_outputs(directory: Path, report: dict[str, Any], results: list[ConfigResult]) -> None:
    (directory / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report["chart"] = None
        return
    names = [r.name for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r.ttft_mean_ms for r in results], 0.4, label="mean")
    ax1.bar([i + 0.2 for i in x], [r.ttft_p90_ms for r in results], 0.4, label="p90")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("time to first token (ms)")
    ax1.legend()
    ax2.bar(list(x), [r.prefill_tokens for r in results])
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("prompt tokens computed")
    fig.suptitle("tiercache demo: TinyCausalLM on CPU")
    fig.tight_layout()
    fig.savefig(directory / "demo.png", dpi=100)
    plt.close(fig)
    report["chart"] = str(directory / "demo.png")


def format_report(report: dict[str, Any]) -> str:
    """The table and the headline lines printed at the end of the demo."""
    cols = [
        "config",
        "ttft mean",
        "p50",
        "p90",
        "prefill tok",
        "device",
        "host",
        "storage",
        "total",
    ]
    rows = []
    every = {**report["configs"], SHARED_SERVER: report[SHARED_SERVER]["config"]}
    for name, r in every.items():
        h = r["hit_rates"]
        rows.append(
            [
                name,
                f"{r['ttft_mean_ms']:.1f} ms",
                f"{r['ttft_p50_ms']:.1f} ms",
                f"{r['ttft_p90_ms']:.1f} ms",
                str(r["prefill_tokens"]),
                f"{h['device']:.0%}",
                f"{h['host']:.0%}",
                f"{h['storage']:.0%}",
                f"{h['total']:.0%}",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    lines.append("")
    lines.append(
        f"requests: {report['requests']} per configuration; prompt tokens: {report['prompt_tokens']} "
        f"(shared-prefix pages: {report['shared_prefix_tokens']})"
    )
    lines.append(
        f"TTFT no_cache / all_tiers: {report['ttft_ratio_no_cache_over_all_tiers']:.2f}x; "
        f"prefill tokens computed: -{report['prefill_token_reduction']:.1%}"
    )
    first = report[SHARED_SERVER]["first_request"]
    lines.append(
        f"shared_server: process 2's first request found {first['cached_tokens']} of its "
        f"{first['prompt_tokens']} prompt tokens in the node's server, computed by process 1"
    )
    if report["tokens_identical"]:
        lines.append("generated tokens: identical in every configuration")
    else:
        lines.append(f"generated tokens DIFFER in: {', '.join(report['mismatched'])}")
    return "\n".join(lines)


def main(
    directory: str | Path = "tiercache-demo",
    *,
    quick: bool = False,
    clients: int | None = None,
    seed: int = 0,
    progress: bool = True,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
) -> int:
    """Run the demo and print its report; returns the exit status (1 if the tokens differ).

    ``metrics_port`` / ``metrics_addr``: serve Prometheus metrics while it runs
    (see `run_demo`).
    """
    out = Path(directory)
    settings = settings_for(quick, clients, seed)
    t0 = time.perf_counter()
    report = asyncio.run(
        run_demo(
            out, settings, progress=progress, metrics_port=metrics_port, metrics_addr=metrics_addr
        )
    )
    print(format_report(report))
    print(f"results: {out / 'demo.json'}" + (f", {report['chart']}" if report.get("chart") else ""))
    print(f"total: {time.perf_counter() - t0:.1f} s")
    return 0 if report["tokens_identical"] else 1


if __name__ == "__main__":  # a shared_server engine process (see shared_process_main)
    sys.exit(shared_process_main())
