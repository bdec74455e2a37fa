"""Two SGLang instances share KV pages through tiercache's HiCache storage backend.

SGLang loads the backend itself when the server starts with::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "tiercache",
        "module_path": "tiercache.integrations.sglang", "class_name": "TierCacheStorage",
        "interface_v1": 1, "url": "file:///var/cache/tiercache"}'

This script makes the same calls SGLang's HiCacheController makes, with
SGLang's own classes, on CPU: SGLang's factory builds the backend from that
extra config, instance A backs up 8 pages of its host pool (``batch_set_v1``),
and instance B, with a host pool of its own, finds them (``batch_exists``) and
reads them into place (``batch_get_v1``). The page keys are SGLang's hash
chain; ``tiercache.page_hashes`` computes the same one.

Run it where SGLang is installed::

    python examples/sglang_backend.py [--url URL]

The environments ``make install-sglang`` builds for the test suite (which runs
this script) hold SGLang without torchvision and, on a machine without a GPU,
without a working ``sgl_kernel``; there, put the suite's stand-ins for those
first on the path::

    PYTHONPATH=tests/integrations/sglang/stubs .venv-sglang-0.5.23/bin/python examples/sglang_backend.py
"""

import argparse
import dataclasses
import random
import tempfile
import warnings
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns that CUDA-only kernels are missing on CPU
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tiercache import page_hashes

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 4, 2, 64, 16, 8


def host_pool() -> Any:
    """SGLang's device KV pool and, over it, its page_first host pool (SGLang's type: Any here)."""
    device = MHATokenToKVPool(
        size=PAGE * 16,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    try:  # SGLang 0.5.20 and later build the host pool from the device pool's buffer info
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        return MHATokenToKVPoolHost(
            buffer_info=device.get_device_pool_infos()[0].buffer_info,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=PAGE,
            layout="page_first",
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=0,
            end_layer=LAYERS,
        )
    except ImportError:
        from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost

        return MHATokenToKVPoolHost(device, 2.0, 0, PAGE, "page_first", pin_memory=False)


def storage_config(url: str) -> HiCacheStorageConfig:
    """What SGLang passes a backend: ranks, model, layout and the extra config."""
    values = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": "example/llama",
        "extra_config": {
            "backend_name": "tiercache",
            "module_path": "tiercache.integrations.sglang",
            "class_name": "TierCacheStorage",
            "interface_v1": 1,
            "url": url,
        },
    }
    fields = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}  # differs by release
    return HiCacheStorageConfig(**{k: v for k, v in values.items() if k in fields})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a tiercache storage URL (default: a temporary file store)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"file://{tmp}"
        rnd = random.Random(0)
        tokens = [rnd.randrange(32000) for _ in range(PAGES * PAGE)]
        keys = page_hashes(tokens, PAGE)  # = SGLang's get_hash_str chain

        pool_a, pool_b = host_pool(), host_pool()
        pool_a.kv_buffer.view(torch.int16).random_()  # "computed" KV
        backends = []
        for pool in (pool_a, pool_b):
            backend = StorageBackendFactory.create_backend("dynamic", storage_config(url), pool)
            backend.register_mem_pool_host(pool)
            backends.append(backend)
        a, b = backends
        try:
            slots_a = pool_a.alloc(len(tokens))
            written = a.batch_set_v1(keys, slots_a)
            print(f"instance A stored {sum(written)} of {PAGES} pages in {url}")

            found = b.batch_exists(keys)
            slots_b = pool_b.alloc(found * PAGE)
            arrived = b.batch_get_v1(keys[:found], slots_b)
            same = all(
                torch.equal(
                    pool_a.get_data_page(int(sa)).view(torch.int16),
                    pool_b.get_data_page(int(sb)).view(torch.int16),
                )
                for sa, sb in zip(slots_a[::PAGE], slots_b[::PAGE], strict=True)
            )
            print(f"instance B found {found} pages, read {sum(arrived)}; KV bit-identical: {same}")
            stats = b.stats()
            print(
                f"instance B stats: {stats['get_hits']} pages read, "
                f"{stats['backend.bytes_read']} bytes, {stats['backend.corrupt_pages']} corrupt"
            )
        finally:
            a.close()
            b.close()


if __name__ == "__main__":
    main()
