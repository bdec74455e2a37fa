"""Building SGLang's real objects on CPU, across the SGLang releases the suite supports.

`load()` imports SGLang (with the torchvision stand-in when the real package is
missing) and reports why it cannot. The builders make SGLang's own device and
host KV pools, its `HiCacheController` with a storage backend attached, and
drive the controller the way SGLang's scheduler does: `backup` waits for the
backup thread's ack, `prefetch` runs the hit query, allocates host memory for
the hits (0.5.20+ leave that to the scheduler) and waits for the IO thread.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import torch

STUBS = Path(__file__).resolve().parent / "stubs"
#: The module name the stand-ins' shared placeholders (``stubs/_tiercache_standin.py``; a
#: process with ``stubs`` on its path imports it by that name too) load under.
STANDIN = "_tiercache_standin"
#: Set by `make test-sglang` and CI: a missing SGLang fails the run instead of skipping it.
REQUIRE_ENV = "TIERCACHE_REQUIRE_ENGINES"
#: How long a test waits for one of SGLang's threads to answer.
WAIT_S = 30.0

EXTRA = {
    "backend_name": "tiercache",
    "module_path": "tiercache.integrations.sglang",
    "class_name": "TierCacheStorage",
}


def extra(url: str, **options: Any) -> dict[str, Any]:
    """The extra config that loads tiercache's backend (zero-copy path) with ``options``."""
    return {**EXTRA, "interface_v1": 1, "url": url, **options}


def _use_standin(name: str) -> None:
    """Import the stand-in package ``stubs/<name>`` as ``name`` unless the real one imports."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(name)
        return
    except ImportError:
        pass
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    if STANDIN not in sys.modules:  # the placeholders every stand-in imports
        _load(STANDIN, STUBS / f"{STANDIN}.py")
    path = STUBS / name
    _load(name, path / "__init__.py", [str(path)])


def _load(name: str, file: Path, search: list[str] | None = None) -> None:
    """Import ``file`` as the module ``name`` (a package when ``search`` is given)."""
    spec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=search)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _import_sglang() -> types.SimpleNamespace:
    importlib.import_module("sglang")  # not installed: the reason to skip, before any stand-in
    for name in ("torchvision", "sgl_kernel"):
        _use_standin(name)
    with warnings.catch_warnings():
        # SGLang warns at import that CUDA-only kernels are unavailable on CPU.
        warnings.simplefilter("ignore")
        import sglang
        import sglang.srt.managers.cache_controller as cc_mod
        from sglang.srt.mem_cache import hicache_storage, memory_pool
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        try:
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            new_host_pools = True
        except ImportError:
            from sglang.srt.mem_cache.memory_pool_host import (
                MHATokenToKVPoolHost,
                MLATokenToKVPoolHost,
            )

            new_host_pools = False
        try:
            from sglang.srt.mem_cache.utils import get_hash_str
        except ImportError:
            from sglang.srt.mem_cache.hicache_storage import get_hash_str
        try:
            from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed
        except ImportError:
            get_storage_hash_str = storage_namespace_seed = None
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    version = tuple(int(p) for p in sglang.__version__.split(".")[:3] if p.isdigit())
    return types.SimpleNamespace(
        version=version,
        version_str=sglang.__version__,
        cc_mod=cc_mod,
        HiCacheController=cc_mod.HiCacheController,
        HiCacheStorage=hicache_storage.HiCacheStorage,
        HiCacheStorageConfig=hicache_storage.HiCacheStorageConfig,
        HiCacheFile=hicache_storage.HiCacheFile,
        FailureInjector=getattr(hicache_storage, "HiCacheStorageFailureInjector", None),
        StorageBackendFactory=StorageBackendFactory,
        MHATokenToKVPool=memory_pool.MHATokenToKVPool,
        MLATokenToKVPool=memory_pool.MLATokenToKVPool,
        MHATokenToKVPoolHost=MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=MLATokenToKVPoolHost,
        new_host_pools=new_host_pools,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        get_hash_str=get_hash_str,
        get_storage_hash_str=get_storage_hash_str,
        storage_namespace_seed=storage_namespace_seed,
    )


_SG: types.SimpleNamespace | None = None
_WHY: str | None = None


def load() -> tuple[types.SimpleNamespace | None, str | None]:
    """SGLang's modules, or ``None`` and the reason they cannot be imported."""
    global _SG, _WHY
    if _SG is None and _WHY is None:
        try:
            _SG = _import_sglang()
        except Exception as e:  # ImportError, or an import-time failure inside SGLang
            _WHY = (
                f"SGLang is not importable here ({type(e).__name__}: {e}); run `make test-sglang`"
            )
    return _SG, _WHY


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def sg() -> types.SimpleNamespace:
    mods, why = load()
    assert mods is not None, why
    return mods


# -- parallel state ------------------------------------------------------------------------


@contextmanager
def single_rank(monkeypatch: Any, tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """Patch the controller module's view of the parallel state: one CPU process."""
    cc_mod = sg().cc_mod
    par = types.SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_tp_rank=tp_rank,
        attn_tp_size=tp_size,
        attn_dp_rank=0,
        attn_dcp_size=1,
        attn_dcp_rank=0,
        attn_cp_rank=0,
        attn_cp_size=1,
    )
    monkeypatch.setattr(cc_mod, "is_dp_attention_enabled", lambda: False)
    if hasattr(cc_mod, "get_parallel"):
        monkeypatch.setattr(cc_mod, "get_parallel", lambda: par)
    else:
        monkeypatch.setattr(cc_mod, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(cc_mod, "get_tensor_model_parallel_world_size", lambda: tp_size)
    yield


def storage_config(**fields: Any) -> Any:
    """A ``HiCacheStorageConfig`` with the fields this SGLang release has (defaults filled)."""
    cls = sg().HiCacheStorageConfig
    defaults = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "test-model",
        "extra_config": None,
    }
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in {**defaults, **fields}.items() if k in names}
    return cls(**kw)


# -- pools ---------------------------------------------------------------------------------


@dataclass
class Geometry:
    mla: bool = False
    layout: str = "page_first"
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    kv_lora_rank: int = 12
    rope_dim: int = 4
    page_size: int = 4
    device_tokens: int = 64
    host_ratio: float = 4.0
    dtype: torch.dtype = torch.float16


def device_pool(g: Geometry) -> Any:
    s = sg()
    if g.mla:
        return s.MLATokenToKVPool(
            size=g.device_tokens,
            page_size=g.page_size,
            dtype=g.dtype,
            kv_lora_rank=g.kv_lora_rank,
            qk_rope_head_dim=g.rope_dim,
            layer_num=g.layers,
            device="cpu",
            enable_memory_saver=False,
        )
    return s.MHATokenToKVPool(
        size=g.device_tokens,
        page_size=g.page_size,
        dtype=g.dtype,
        head_num=g.heads,
        head_dim=g.head_dim,
        layer_num=g.layers,
        device="cpu",
        enable_memory_saver=False,
    )


def host_pool(g: Geometry, dev: Any) -> Any:
    s = sg()
    cls = s.MLATokenToKVPoolHost if g.mla else s.MHATokenToKVPoolHost
    if not s.new_host_pools:
        return cls(dev, g.host_ratio, 0, g.page_size, g.layout, pin_memory=False, device="cpu")
    kw: dict[str, Any] = {
        "buffer_info": dev.get_device_pool_infos()[0].buffer_info,
        "host_to_device_ratio": g.host_ratio,
        "host_size": 0,
        "page_size": g.page_size,
        "layout": g.layout,
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": dev.size,
        "start_layer": 0,
        "end_layer": g.layers,
    }
    if g.mla:
        kw["target_layer_num"] = g.layers
    return cls(**kw)


def fill_random(host: Any, seed: int) -> None:
    """Random bytes in the whole host pool (as integers: no NaN to break comparisons)."""
    gen = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(host: Any, slot: int) -> bytes:
    """One page of SGLang's host pool, as SGLang flattens it for storage."""
    page = host.get_data_page(int(slot), flat=True)
    return bytes(page.contiguous().view(torch.uint8).numpy())


def pages_bytes(host: Any, indices: torch.Tensor, page_size: int) -> list[bytes]:
    return [page_bytes(host, int(i)) for i in indices[::page_size].tolist()]


# -- hashes --------------------------------------------------------------------------------


def chain(tokens: Sequence[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's page hash chain, one ``get_hash_str`` call per full page."""
    get_hash_str = sg().get_hash_str
    out: list[str] = []
    for i in range(0, len(tokens) - page_size + 1, page_size):
        prior = get_hash_str(list(tokens[i : i + page_size]), prior)
        out.append(prior)
    return out


# -- the controller ------------------------------------------------------------------------


@dataclass
class Instance:
    """One SGLang HiCache instance: device pool, host pool, controller with storage."""

    geometry: Geometry
    device: Any
    host: Any
    controller: Any

    @property
    def backend(self) -> Any:
        return self.controller.storage_backend

    def close(self) -> None:
        if self.controller.enable_storage or self.controller.storage_backend is not None:
            self.controller.detach_storage_backend()
        stop = getattr(self.controller, "stop_event", None)
        if stop is not None:
            stop.set()


def make_instance(
    g: Geometry, extra: dict[str, Any], *, model_name: str = "test-model", storage: str = "dynamic"
) -> Instance:
    """An SGLang `HiCacheController` with the storage backend attached (patch the ranks first)."""
    s = sg()
    dev = device_pool(g)
    host = host_pool(g, dev)
    alloc = s.TokenToKVPoolAllocator(dev.size, g.dtype, "cpu", dev, False)
    import torch.distributed as dist

    controller = s.HiCacheController(
        alloc,
        host,
        g.page_size,
        dist.group.WORLD,
        threading.Event(),
        storage_backend=storage,
        prefetch_threshold=g.page_size,
        model_name=model_name,
        storage_backend_extra_config=dict(extra),
    )
    return Instance(g, dev, host, controller)


def backup(inst: Instance, host_indices: torch.Tensor, tokens: list[int], hashes: list[str]) -> int:
    """``write_storage`` and wait for the backup thread's ack; returns the tokens it backed up."""
    cc = inst.controller
    op_id = cc.write_storage(host_indices, tokens, hash_value=hashes)
    while True:
        op = cc.ack_backup_queue.get(timeout=WAIT_S)
        if op.id == op_id:
            return int(op.completed_tokens)


@dataclass
class Prefetched:
    hit_tokens: int
    completed_tokens: int
    host_indices: torch.Tensor | None


def prefetch(inst: Instance, tokens: list[int], last_hash: str | None = None) -> Prefetched:
    """``prefetch`` through the controller's threads, as SGLang's scheduler drives it.

    Returns the tokens the hit query found, the tokens that arrived in host
    memory, and the host slots they arrived in (the caller frees them).
    """
    cc = inst.controller
    host = inst.host
    if sg().version >= (0, 5, 20) or not _takes_host_indices(cc):
        op = cc.prefetch("req", tokens, last_hash)
        op = cc.prefetch_hit_queue.get(timeout=WAIT_S)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return Prefetched(0, 0, None)
        indices = host.alloc(hit)
        assert indices is not None, "host pool full"
        op.host_indices = indices
        cc.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
            if ack.completed_req:
                return Prefetched(hit, completed, indices)
    # 0.5.9 .. 0.5.19: host memory is reserved up front; the prefetch thread
    # frees what missed and the IO thread counts completed tokens.
    indices = host.alloc(len(tokens))
    assert indices is not None, "host pool full"
    op = cc.prefetch("req", indices, tokens, last_hash)
    deadline = WAIT_S
    step = 0.01
    waited = 0.0
    import time

    while waited < deadline:
        hashes = op.hash_value
        if op.is_terminated() or (
            hashes and op.completed_tokens >= len(hashes) * inst.geometry.page_size
        ):
            break
        if _revoked(cc, op):
            return Prefetched(0, 0, None)
        time.sleep(step)
        waited += step
    time.sleep(0.05)
    hit = len(op.hash_value) * inst.geometry.page_size
    return Prefetched(hit, int(op.completed_tokens), indices[:hit])


def _takes_host_indices(cc: Any) -> bool:
    import inspect

    return "host_indices" in inspect.signature(cc.prefetch).parameters


def _revoked(cc: Any, op: Any) -> bool:
    q = getattr(cc, "prefetch_revoke_queue", None)
    if q is None:
        return False
    try:
        rid = q.get_nowait()
    except Empty:
        return False
    return bool(rid == op.request_id)
