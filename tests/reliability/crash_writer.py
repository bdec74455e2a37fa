"""A writer to be killed: backs pages up into a file store until SIGKILL arrives.

Run as ``python crash_writer.py``, it is a small fork server: it imports
tiercache once, then reads commands on stdin, one a line:

    fork <mode> <root> <start>   fork a writer; prints ``pid <pid>``
    reap <pid>                   wait for a writer; prints ``reaped <pid> <signal or -exit code>``
    exit                         stop

A forked writer opens ``root`` and writes pages forever, starting at
batch ``start`` of ``mode`` (see `batch_keys`); it prints ``started <pid>``
once its backend is open. Forking from a process that has already imported
torch makes a fresh writer cost a millisecond instead of a second of imports,
so a test can afford many kills.

Modes:

* ``backend``: `FileBackend.batch_set` directly, batches of `BATCH_PAGES`
  single-segment pages.
* ``controller``: `TierController.write_storage` from a real `HostKVPool`
  (``layer_first``, so each page is several segments), one operation of
  `BATCH_PAGES` pages at a time.

Every page's bytes are `expected_bytes` of its storage key, so a reader can
check any stored page on its own. The module is also imported by the test for
the key plan and the expected bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import traceback

import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.index.hashing import page_hashes
from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.file import FileBackend
from tiercache.storage.keys import StorageNamespace
from tiercache.storage_tier import StorageTierConfig

#: Tokens per page and the layout of controller mode: 2 layers x 2 heads x 32 dims fp16,
#: 16-token pages = 8 KiB a page, 4 segments a page in layer_first.
PAGE_SIZE = 16
LAYOUT = KVLayout(2, 2, 32, torch.float16, PAGE_SIZE)
PAGE_BYTES = LAYOUT.page_bytes
HOST_LAYOUT = "layer_first"
MODEL = "crash-test"
NAMESPACE = StorageNamespace.for_layout(LAYOUT, HOST_LAYOUT, model=MODEL)
#: The page format of controller mode (what `HostKVPool.format` is for this layout).
CONTROLLER_FORMAT = f"{LAYOUT.describe()}:{HOST_LAYOUT}"
#: The page format of backend mode.
BACKEND_FORMAT = "crash-test:raw"
BATCH_PAGES = 8
#: A pause between batches: keeps the store small enough that re-reading all
#: of it after every kill stays fast, while each kill still lands among writes.
PACE_S = 0.01
MODES = ("backend", "controller")


def expected_bytes(key: str, nbytes: int = PAGE_BYTES) -> bytes:
    """The only bytes a page stored under ``key`` may hold."""
    return hashlib.shake_256(key.encode()).digest(nbytes)


def page_format(mode: str) -> str:
    return CONTROLLER_FORMAT if mode == "controller" else BACKEND_FORMAT


def batch_tokens(b: int) -> list[int]:
    """The tokens of controller-mode batch ``b`` (distinct for every batch)."""
    n = BATCH_PAGES * PAGE_SIZE
    return [(b * n + t) * 7 + 3 for t in range(n)]


def batch_keys(mode: str, b: int) -> list[PageKey]:
    """The keys of batch ``b`` of ``mode``, in the order the writer writes them."""
    if mode == "backend":
        return [
            NAMESPACE.key(hashlib.sha256(f"page:{i}".encode()).hexdigest())
            for i in range(b * BATCH_PAGES, (b + 1) * BATCH_PAGES)
        ]
    return NAMESPACE.keys(page_hashes(batch_tokens(b), PAGE_SIZE))


async def _write_backend(root: str, start: int) -> None:
    backend = await FileBackend.open(root, max_concurrency=4)
    print(f"started {os.getpid()}", flush=True)
    b = start
    while True:
        keys = batch_keys("backend", b)
        pages = [PageBuffer.from_bytes(expected_bytes(k), BACKEND_FORMAT) for k in keys]
        ok = await backend.batch_set(keys, pages)
        assert all(ok), ok
        b += 1
        await asyncio.sleep(PACE_S)


async def _write_controller(root: str, start: int) -> None:
    dev = DeviceKVPool(LAYOUT, 4 * PAGE_SIZE)
    host = HostKVPool(LAYOUT, 4 * BATCH_PAGES * PAGE_SIZE, host_layout=HOST_LAYOUT)
    config = StorageTierConfig(backup_batch_pages=BATCH_PAGES, timeout_s=30.0)
    async with TierController(dev, host, model=MODEL, storage_config=config) as ctl:
        await ctl.attach_storage_backend(f"file://{root}?max_concurrency=4")
        print(f"started {os.getpid()}", flush=True)
        b = start
        while True:
            tokens = batch_tokens(b)
            slots = ctl.host_allocator.alloc(len(tokens))
            assert slots is not None
            keys = batch_keys("controller", b)
            for key, page in zip(keys, host.page_buffers(slots), strict=True):
                page.write(expected_bytes(key))
            op = ctl.write_storage(slots, tokens)
            assert op is not None
            await op
            assert op.succeeded, op.error
            ctl.free_host(slots)
            b += 1
            await asyncio.sleep(PACE_S)


def _writer(mode: str, root: str, start: int) -> None:
    try:
        fn = _write_backend if mode == "backend" else _write_controller
        asyncio.run(fn(root, start))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def main() -> None:
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fork":
            mode, root, start = cmd[1], cmd[2], int(cmd[3])
            assert mode in MODES, mode
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _writer(mode, root, start)
            print(f"pid {pid}", flush=True)
        elif cmd[0] == "reap":
            pid = int(cmd[1])
            _, status = os.waitpid(pid, 0)
            code = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
            print(f"reaped {pid} {code}", flush=True)
        elif cmd[0] == "exit":
            return


if __name__ == "__main__":
    main()
