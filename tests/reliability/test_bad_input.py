"""Bad input everywhere public gets the documented error, and costs nothing cached.

One table of ``(name, call, expected error)`` over the public surface: layouts,
allocators, pools, the controller's verbs, prefetch and backup, hashing,
namespaces, keys and `open_backend`. Each case must raise exactly the
documented class from `tiercache.errors`. A controller (with a storage tier)
and a file backend opened before the table still serve a round trip after it,
with what they held before it intact.

Then a full disk: a tiny tmpfs where mounting is allowed, and everywhere a
simulated ``ENOSPC`` in the file backend's write path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, PageAllocator, TierController
from tiercache.errors import (
    BackendNotFoundError,
    CapacityError,
    ConfigError,
    DoubleFreeError,
    InvalidInputError,
    StateError,
    StorageError,
    TierCacheError,
)
from tiercache.index.hashing import hash_page, page_hashes
from tiercache.storage import open_backend
from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.file import FileBackend
from tiercache.storage.keys import StorageNamespace, validate_key
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import PrefetchState, StorageTierConfig

PS = 4
LAYOUT = KVLayout(2, 2, 8, torch.float16, PS)
I64 = torch.int64


@dataclass
class World:
    """What the table runs against: an open controller with storage, a file backend."""

    ctl: TierController
    backend: FileBackend
    tmp: Path
    dev: torch.Tensor  # device slots holding known KV
    host: torch.Tensor  # host slots backed up from ``dev``
    stored_key: PageKey
    stored_bytes: bytes


def _filled_device_pool() -> DeviceKVPool:
    dev = DeviceKVPool(LAYOUT, 32 * PS)
    g = torch.Generator().manual_seed(7)
    for stacked in dev.stacked or []:
        stacked.copy_(torch.randn(stacked.shape, generator=g).half())
    return dev


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    conf = StorageTierConfig(prefetch_threshold=PS, io_batch_pages=2, timeout_s=5.0)
    ctl = TierController(
        _filled_device_pool(), HostKVPool(LAYOUT, 64 * PS), storage_config=conf, model="bad-input"
    )
    async with ctl:
        await ctl.attach_storage_backend(MemoryBackend())
        dev = ctl.device_allocator.alloc(4 * PS)
        assert dev is not None
        host = await ctl.backup(dev)
        assert host is not None
        backend = await FileBackend.open(tmp_path / "store")
        key = PageKey("0123456789abcdef-" + "ab" * 32)
        data = os.urandom(512)
        assert await backend.batch_set([key], [PageBuffer.from_bytes(data, "f")]) == [True]
        try:
            yield World(ctl, backend, tmp_path, dev, host, key, data)
        finally:
            await backend.aclose()


def _slots(*values: int, dtype: torch.dtype = I64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _page(n: int) -> torch.Tensor:
    return torch.arange(n * PS, (n + 1) * PS, dtype=I64)


Case = tuple[str, Callable[[World], Any], type[BaseException]]


async def _attach_to_fresh(backend: object, **options: Any) -> None:
    """Attach ``backend`` to a new, open controller with no storage (closed afterwards)."""
    async with TierController(DeviceKVPool(LAYOUT, 16), HostKVPool(LAYOUT, 16)) as ctl:
        try:
            await ctl.attach_storage_backend(backend, **options)  # type: ignore[arg-type]
        finally:
            assert ctl.storage is None, "a refused attach left a backend attached"
            if isinstance(backend, MemoryBackend):
                await backend.aclose()


_FREE_PAGE = 30  # a device page the world never allocates
_FREE_HOST_PAGE = 60

CASES: list[Case] = [
    # -- KVLayout ---------------------------------------------------------------------------
    ("layout zero layers", lambda w: KVLayout(0, 2, 8), InvalidInputError),
    ("layout float layers", lambda w: KVLayout(2.0, 2, 8), InvalidInputError),  # type: ignore[arg-type]
    ("layout bool heads", lambda w: KVLayout(2, True, 8), InvalidInputError),
    ("layout dtype int32", lambda w: KVLayout(2, 2, 8, torch.int32), InvalidInputError),
    ("layout dtype str", lambda w: KVLayout(2, 2, 8, "float16"), InvalidInputError),  # type: ignore[arg-type]
    ("layout negative page", lambda w: KVLayout(2, 2, 8, page_size=-1), InvalidInputError),
    ("layout mla two heads", lambda w: KVLayout(2, 2, 8, mla=True), InvalidInputError),
    ("layout mla not bool", lambda w: KVLayout(2, 1, 8, mla=1), InvalidInputError),  # type: ignore[arg-type]
    # -- PageAllocator ----------------------------------------------------------------------
    ("allocator unaligned size", lambda w: PageAllocator(10, 4), InvalidInputError),
    ("allocator zero page", lambda w: PageAllocator(8, 0), InvalidInputError),
    ("alloc negative", lambda w: w.ctl.host_allocator.alloc(-PS), InvalidInputError),
    ("alloc unaligned", lambda w: w.ctl.host_allocator.alloc(PS + 1), InvalidInputError),
    ("alloc float", lambda w: w.ctl.host_allocator.alloc(4.0), InvalidInputError),  # type: ignore[arg-type]
    ("alloc bool", lambda w: w.ctl.host_allocator.alloc(True), InvalidInputError),
    ("free int32", lambda w: w.ctl.host_allocator.free(w.host.int()), InvalidInputError),
    ("free float", lambda w: w.ctl.host_allocator.free(w.host.float()), InvalidInputError),
    ("free 2-D", lambda w: w.ctl.host_allocator.free(w.host.view(-1, PS)), InvalidInputError),
    ("free list", lambda w: w.ctl.host_allocator.free([0, 1, 2, 3]), InvalidInputError),  # type: ignore[arg-type]
    (
        "free unaligned run",
        lambda w: w.ctl.host_allocator.free(_slots(1, 2, 3, 4)),
        InvalidInputError,
    ),
    ("free out of range", lambda w: w.ctl.host_allocator.free(_page(10_000)), InvalidInputError),
    ("free negative", lambda w: w.ctl.host_allocator.free(_page(-1)), InvalidInputError),
    (
        "free never allocated",
        lambda w: w.ctl.host_allocator.free(_page(_FREE_HOST_PAGE)),
        DoubleFreeError,
    ),
    (
        "free twice in one call",
        lambda w: w.ctl.host_allocator.free(torch.cat([w.host[:PS], w.host[:PS]])),
        DoubleFreeError,
    ),
    # -- pools --------------------------------------------------------------------------------
    ("device pool bad layout", lambda w: DeviceKVPool("mha", 16), InvalidInputError),  # type: ignore[arg-type]
    ("device pool unaligned", lambda w: DeviceKVPool(LAYOUT, 6), InvalidInputError),
    ("device pool zero slots", lambda w: DeviceKVPool(LAYOUT, 0), InvalidInputError),
    ("device pool bad device", lambda w: DeviceKVPool(LAYOUT, 16, device="tpu"), InvalidInputError),
    (
        "device pool wraps wrong shape",
        lambda w: DeviceKVPool(
            LAYOUT,
            16,
            k_buffers=[torch.zeros(16, 2, 9, dtype=torch.float16)] * 2,
            v_buffers=[torch.zeros(16, 2, 8, dtype=torch.float16)] * 2,
        ),
        InvalidInputError,
    ),
    (
        "device pool wraps wrong dtype",
        lambda w: DeviceKVPool(
            LAYOUT,
            16,
            k_buffers=[torch.zeros(16, 2, 8)] * 2,
            v_buffers=[torch.zeros(16, 2, 8)] * 2,
        ),
        InvalidInputError,
    ),
    (
        "device pool wraps one tensor for two layers",
        lambda w: DeviceKVPool(
            LAYOUT,
            16,
            k_buffers=[torch.zeros(16, 2, 8, dtype=torch.float16)] * 2,
            v_buffers=[torch.zeros(16, 2, 8, dtype=torch.float16) for _ in range(2)],
        ),
        InvalidInputError,
    ),
    ("host pool absurd size", lambda w: HostKVPool(LAYOUT, PS << 40), CapacityError),
    ("host pool absurd bytes", lambda w: HostKVPool(LAYOUT, size_bytes=1 << 60), CapacityError),
    (
        "host pool bad layout",
        lambda w: HostKVPool(LAYOUT, 16, host_layout="bogus"),
        InvalidInputError,
    ),
    (
        "host pool both sizes",
        lambda w: HostKVPool(LAYOUT, 16, size_bytes=1 << 20),
        InvalidInputError,
    ),
    ("host pool under a page", lambda w: HostKVPool(LAYOUT, size_bytes=1), InvalidInputError),
    ("host pool negative", lambda w: HostKVPool(LAYOUT, -PS), InvalidInputError),
    ("host page_buffer unaligned", lambda w: w.ctl.host_pool.page_buffer(1), InvalidInputError),
    # -- TierController -----------------------------------------------------------------------
    (
        "controller inline_copy_bytes bool",
        lambda w: TierController(
            DeviceKVPool(LAYOUT, 16), HostKVPool(LAYOUT, 16), inline_copy_bytes=True
        ),
        ConfigError,
    ),
    (
        "controller foreign allocator",
        lambda w: TierController(
            DeviceKVPool(LAYOUT, 16), HostKVPool(LAYOUT, 16), host_allocator=PageAllocator(32, PS)
        ),
        InvalidInputError,
    ),
    (
        "controller tp rank",
        lambda w: TierController(
            DeviceKVPool(LAYOUT, 16), HostKVPool(LAYOUT, 16), tp_rank=2, tp_size=2
        ),
        InvalidInputError,
    ),
    ("write int32", lambda w: w.ctl.write(w.dev.int()), InvalidInputError),
    ("write float", lambda w: w.ctl.write(w.dev.float()), InvalidInputError),
    ("write 2-D", lambda w: w.ctl.write(w.dev.view(-1, PS)), InvalidInputError),
    ("write list", lambda w: w.ctl.write(w.dev.tolist()), InvalidInputError),
    ("write unaligned length", lambda w: w.ctl.write(w.dev[: PS - 1]), InvalidInputError),
    ("write negative", lambda w: w.ctl.write(_page(-1)), InvalidInputError),
    ("write out of range", lambda w: w.ctl.write(_page(10_000)), InvalidInputError),
    ("write unallocated", lambda w: w.ctl.write(_page(_FREE_PAGE)), InvalidInputError),
    ("write priority str", lambda w: w.ctl.write(w.dev, priority="high"), InvalidInputError),  # type: ignore[arg-type]
    ("load int32", lambda w: w.ctl.load(w.host.int()), InvalidInputError),
    ("load 2-D", lambda w: w.ctl.load(w.host.view(-1, PS)), InvalidInputError),
    ("load unaligned", lambda w: w.ctl.load(w.host[1 : PS + 1]), InvalidInputError),
    ("load out of range", lambda w: w.ctl.load(_page(10_000)), InvalidInputError),
    ("load unallocated", lambda w: w.ctl.load(_page(_FREE_HOST_PAGE)), InvalidInputError),
    (
        "evict device never allocated",
        lambda w: w.ctl.free_device(_page(_FREE_PAGE)),
        DoubleFreeError,
    ),
    ("evict device float", lambda w: w.ctl.free_device(w.dev.float()), InvalidInputError),
    ("evict host out of range", lambda w: w.ctl.free_host(_page(10_000)), InvalidInputError),
    (
        "evict host never allocated",
        lambda w: w.ctl.free_host(_page(_FREE_HOST_PAGE)),
        DoubleFreeError,
    ),
    ("plan lengths differ", lambda w: w.ctl.plan(w.host, w.dev[:PS]), InvalidInputError),
    ("plan float", lambda w: w.ctl.plan(w.host.float(), w.dev), InvalidInputError),
    ("plan out of range", lambda w: w.ctl.plan(w.host[:PS], _page(10_000)), InvalidInputError),
    ("attach not a backend", lambda w: _attach_to_fresh(42), InvalidInputError),
    (
        "attach backend with options",
        lambda w: _attach_to_fresh(MemoryBackend(), capacity_bytes=1),
        InvalidInputError,
    ),
    ("attach unknown url", lambda w: _attach_to_fresh("bogus://x"), BackendNotFoundError),
    ("attach while attached", lambda w: w.ctl.attach_storage_backend(MemoryBackend()), StateError),
    # -- prefetch and backup ------------------------------------------------------------------
    (
        "prefetch fewer tokens than slots",
        lambda w: w.ctl.prefetch("r", w.host, list(range(PS))),
        InvalidInputError,
    ),
    (
        "prefetch more tokens than slots",
        lambda w: w.ctl.prefetch("r", w.host[:PS], list(range(2 * PS))),
        InvalidInputError,
    ),
    (
        "prefetch str tokens",
        lambda w: w.ctl.prefetch("r", w.host[:PS], ["a"] * PS),
        InvalidInputError,
    ),
    (
        "prefetch float tokens",
        lambda w: w.ctl.prefetch("r", w.host[:PS], [0.5] * PS),
        InvalidInputError,
    ),
    (
        "prefetch negative tokens",
        lambda w: w.ctl.prefetch("r", w.host[:PS], [-1] * PS),
        InvalidInputError,
    ),
    (
        "prefetch unallocated slots",
        lambda w: w.ctl.prefetch("r", _page(_FREE_HOST_PAGE), list(range(PS))),
        InvalidInputError,
    ),
    (
        "prefetch int32 slots",
        lambda w: w.ctl.prefetch("r", w.host.int(), list(range(4 * PS))),
        InvalidInputError,
    ),
    ("terminate None", lambda w: w.ctl.terminate_prefetch(None), InvalidInputError),  # type: ignore[arg-type]
    ("terminate not an operation", lambda w: w.ctl.terminate_prefetch("r"), InvalidInputError),  # type: ignore[arg-type]
    (
        "backup token count",
        lambda w: w.ctl.write_storage(w.host, list(range(PS))),
        InvalidInputError,
    ),
    (
        "backup 2**32 token",
        lambda w: w.ctl.write_storage(w.host[:PS], [2**32] * PS),
        InvalidInputError,
    ),
    (
        "backup bad slots",
        lambda w: w.ctl.write_storage(w.host[1 : PS + 1], list(range(PS))),
        InvalidInputError,
    ),
    # -- hashing, namespaces, keys ------------------------------------------------------------
    ("hash negative token", lambda w: hash_page([1, -2, 3]), InvalidInputError),
    ("hash float token", lambda w: hash_page([1.0, 2.0]), InvalidInputError),
    ("hash str tokens", lambda w: hash_page("1234"), InvalidInputError),
    ("hash str in list", lambda w: hash_page([1, "2"]), InvalidInputError),
    ("hash 2**32", lambda w: hash_page([2**32]), InvalidInputError),
    ("hash empty page", lambda w: hash_page([]), InvalidInputError),
    ("hash non-hex prior", lambda w: hash_page([1], "zz"), InvalidInputError),
    ("hash float tensor", lambda w: hash_page(torch.tensor([1.0, 2.0])), InvalidInputError),
    ("hash 2-D array", lambda w: hash_page(np.zeros((2, 2), dtype=np.int64)), InvalidInputError),
    ("hash negative array", lambda w: hash_page(np.array([-1])), InvalidInputError),
    ("page_hashes zero page", lambda w: page_hashes([1, 2], 0), InvalidInputError),
    ("page_hashes float page", lambda w: page_hashes([1, 2], 1.0), InvalidInputError),  # type: ignore[arg-type]
    ("page_hashes 2**32", lambda w: page_hashes([1, 2**32], 1), InvalidInputError),
    ("page_hashes negative", lambda w: page_hashes([-5, 1], 1), InvalidInputError),
    ("page_hashes str", lambda w: page_hashes(["a", "b"], 1), InvalidInputError),
    (
        "namespace empty model",
        lambda w: StorageNamespace("", "float16", "x", "layer_first", 4),
        InvalidInputError,
    ),
    (
        "namespace host layout",
        lambda w: StorageNamespace("m", "float16", "x", "diagonal", 4),
        InvalidInputError,
    ),
    (
        "namespace zero page",
        lambda w: StorageNamespace("m", "float16", "x", "layer_first", 0),
        InvalidInputError,
    ),
    (
        "namespace rank >= size",
        lambda w: StorageNamespace("m", "float16", "x", "layer_first", 4, tp_rank=2, tp_size=2),
        InvalidInputError,
    ),
    (
        "namespace layout type",
        lambda w: StorageNamespace.for_layout("mha", "layer_first", model="m"),
        InvalidInputError,
    ),  # type: ignore[arg-type]
    ("namespace key uppercase", lambda w: w.ctl.namespace.key("ABCD"), InvalidInputError),
    ("namespace key traversal", lambda w: w.ctl.namespace.key("../ab"), InvalidInputError),
    ("namespace keys int", lambda w: w.ctl.namespace.keys([1]), InvalidInputError),  # type: ignore[list-item]
    ("key traversal", lambda w: validate_key("../x"), InvalidInputError),
    ("key dot dot", lambda w: validate_key(".."), InvalidInputError),
    ("key slash", lambda w: validate_key("a/b"), InvalidInputError),
    ("key backslash", lambda w: validate_key("a\\b"), InvalidInputError),
    ("key hidden", lambda w: validate_key(".hidden"), InvalidInputError),
    ("key empty", lambda w: validate_key(""), InvalidInputError),
    ("key 300 chars", lambda w: validate_key("a" * 300), InvalidInputError),
    ("key NUL", lambda w: validate_key("a\x00b"), InvalidInputError),
    ("key space", lambda w: validate_key("a b"), InvalidInputError),
    ("key not str", lambda w: validate_key(b"abc"), InvalidInputError),
    (
        "backend get traversal",
        lambda w: w.backend.batch_get([PageKey("../x")], [PageBuffer.allocate(8, "f")]),
        InvalidInputError,
    ),
    (
        "backend set one str",
        lambda w: w.backend.batch_set(PageKey("abc"), [PageBuffer.allocate(8, "f")]),
        InvalidInputError,
    ),
    (
        "backend set length mismatch",
        lambda w: w.backend.batch_set([PageKey("abc")], []),
        InvalidInputError,
    ),
    (
        "backend set not a page",
        lambda w: w.backend.batch_set([PageKey("abc")], [b"x"]),
        InvalidInputError,
    ),  # type: ignore[list-item]
    # -- open_backend -------------------------------------------------------------------------
    ("open unknown scheme", lambda w: open_backend("bogus://x"), BackendNotFoundError),
    ("open no scheme", lambda w: open_backend("just-a-name"), BackendNotFoundError),
    (
        "open dotted path missing",
        lambda w: open_backend("no_such_pkg.mod:Backend"),
        BackendNotFoundError,
    ),
    ("open empty", lambda w: open_backend(""), ConfigError),
    ("open not str", lambda w: open_backend(42), ConfigError),  # type: ignore[arg-type]
    ("open unknown option", lambda w: open_backend("memory://?nope=1"), ConfigError),
    ("open bad int option", lambda w: open_backend("memory://?capacity_bytes=lots"), ConfigError),
    ("open negative option", lambda w: open_backend("memory://", capacity_bytes=-5), ConfigError),
    (
        "open option twice",
        lambda w: open_backend("memory://?capacity_bytes=1&capacity_bytes=2"),
        ConfigError,
    ),
    ("open file bad bool", lambda w: open_backend(f"file://{w.tmp}/x", fsync="maybe"), ConfigError),
    (
        "open file bad mode",
        lambda w: open_backend(f"file://{w.tmp}/x?dir_mode=0o7777"),
        ConfigError,
    ),
    ("open file remote host", lambda w: open_backend("file://elsewhere/x"), ConfigError),
    ("open file on a file", lambda w: open_backend(f"file://{w.tmp}/plain.txt"), StorageError),
    (
        "open file under a file",
        lambda w: open_backend(f"file://{w.tmp}/plain.txt/sub"),
        StorageError,
    ),
    (
        "open redis bad option",
        lambda w: open_backend("redis://127.0.0.1:1/0?frobnicate=1"),
        ConfigError,
    ),
    (
        "open redis bad timeout",
        lambda w: open_backend("redis://127.0.0.1:1/0", timeout="soon"),
        ConfigError,
    ),
]


async def _call(fn: Callable[[World], Any], w: World) -> Any:
    result = fn(w)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _round_trip(w: World) -> None:
    """The controller and the backend still serve, and kept what they held."""
    ctl = w.ctl
    # Device -> host backup of the same device slots gives the same bytes as before.
    before = [p.tobytes() for p in ctl.host_pool.page_buffers(w.host)]
    again = await ctl.backup(w.dev)
    assert again is not None
    assert [p.tobytes() for p in ctl.host_pool.page_buffers(again)] == before
    # Host -> device -> host.
    dev2 = await ctl.load_back(w.host)
    assert dev2 is not None
    for buf in ctl.device_pool.buffers:
        for layer in buf:
            assert torch.equal(layer[dev2], layer[w.dev])
    # Storage: back up, fetch back into new host slots, bit-identical.
    tokens = list(range(100, 100 + w.host.numel()))
    op = ctl.write_storage(w.host, tokens)
    assert op is not None
    await op
    assert op.succeeded, op.error
    dst = ctl.host_allocator.alloc(w.host.numel())
    assert dst is not None
    pf = ctl.prefetch("after", dst, tokens)
    assert pf is not None
    await pf
    n, _ = await ctl.terminate_prefetch(pf)
    assert pf.state is PrefetchState.DONE and n == len(tokens)
    assert [p.tobytes() for p in ctl.host_pool.page_buffers(dst)] == before
    for slots in (again, dst):
        ctl.free_host(slots)
    ctl.free_device(dev2)
    # The file backend still holds its page and takes a new one.
    page = PageBuffer.allocate(len(w.stored_bytes), "f")
    assert await w.backend.batch_get([w.stored_key], [page]) == [True]
    assert page.tobytes() == w.stored_bytes
    key = PageKey("0123456789abcdef-" + "cd" * 32)
    assert await w.backend.batch_set([key], [PageBuffer.from_bytes(b"n" * 64, "f")]) == [True]


async def _check(
    name: str, fn: Callable[[World], Any], expected: type[BaseException], w: World
) -> str | None:
    """``None`` when ``fn`` raised exactly ``expected``, else what went wrong."""
    try:
        result = await _call(fn, w)
    except TierCacheError as e:
        if type(e) is expected:
            return None
        return f"{name}: raised {type(e).__name__} ({e}), expected {expected.__name__}"
    except Exception as e:
        return f"{name}: raised {type(e).__name__} ({e}) outside the tree, expected {expected.__name__}"
    if isinstance(result, MemoryBackend | FileBackend):
        await result.aclose()
    return f"{name}: returned {result!r}, expected {expected.__name__}"


#: Cases that fail today, with the reason (each is a bug to fix, not an accepted behaviour).
KNOWN_BUGS: dict[str, str] = {}


def _params() -> list[Any]:
    out = []
    for name, fn, expected in CASES:
        marks = (
            [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])] if name in KNOWN_BUGS else []
        )
        out.append(pytest.param(name, fn, expected, id=name.replace(" ", "-"), marks=marks))
    return out


@pytest.fixture
async def plain_file(world: World) -> None:
    await asyncio.to_thread((world.tmp / "plain.txt").write_text, "not a directory")


@pytest.mark.usefixtures("plain_file")
@pytest.mark.parametrize(("name", "fn", "expected"), _params())
async def test_bad_input_raises_its_documented_error(
    name: str, fn: Callable[[World], Any], expected: type[BaseException], world: World
) -> None:
    problem = await _check(name, fn, expected, world)
    assert problem is None, problem


@pytest.mark.usefixtures("plain_file")
async def test_after_the_whole_table_nothing_cached_is_lost(world: World) -> None:
    ctl = world.ctl
    free_dev, free_host = ctl.device_allocator.available, ctl.host_allocator.available
    wrong = [
        problem
        for name, fn, expected in CASES
        if name not in KNOWN_BUGS and (problem := await _check(name, fn, expected, world))
    ]
    assert not wrong, "\n".join(wrong)
    # Nothing was allocated or freed by the refused calls.
    assert (ctl.device_allocator.available, ctl.host_allocator.available) == (free_dev, free_host)
    assert ctl.storage is not None and not ctl.storage.busy
    await _round_trip(world)


def test_the_table_covers_every_public_area() -> None:
    names = " ".join(name for name, _, _ in CASES)
    for area in ("layout", "alloc", "free", "device pool", "host pool", "controller", "write",
                 "load", "evict", "plan", "prefetch", "backup", "hash", "page_hashes",
                 "namespace", "key", "open"):  # fmt: skip
        assert area in names, area


# --- a full disk ------------------------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


class _SimulatedDisk:
    """Patches the file backend's write path to fail with ENOSPC once ``capacity`` bytes are used."""

    def __init__(self, capacity: int) -> None:
        import tiercache.storage.file as file_mod

        self.capacity = capacity
        self.used = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._real = file_mod._writev_all

    def writev_all(self, fd: int, parts: Sequence[bytes | memoryview]) -> None:
        n = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if self.used + n > self.capacity:
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.used += n
        self._real(fd, parts)


@pytest.fixture(params=["tmpfs", "simulated"])
def full_disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """A directory that fills up after about 40 pages of `LAYOUT` (512 bytes each + header)."""
    root = tmp_path / "disk"
    if request.param == "tmpfs":
        with _tmpfs(root, "48k"):
            yield root
    else:
        root.mkdir()
        disk = _SimulatedDisk(48 * 1024)
        monkeypatch.setattr("tiercache.storage.file._writev_all", disk.writev_all)
        yield root


def _temp_files(root: Path) -> list[str]:
    return [n for _, _, files in os.walk(root) for n in files if n.endswith(".tmp")]


async def test_a_full_disk_fails_pages_not_the_store(full_disk: Path) -> None:
    backend = await FileBackend.open(full_disk / "store")
    async with backend:
        keys = [PageKey(f"0123456789abcdef-{i:064x}") for i in range(400)]
        data = [os.urandom(512) for _ in keys]
        results: list[bool] = []
        for lo in range(0, len(keys), 20):
            pages = [PageBuffer.from_bytes(d, "f") for d in data[lo : lo + 20]]
            results += await backend.batch_set(keys[lo : lo + 20], pages)
        assert any(results) and not all(results), "the disk never filled up"
        assert (await backend.stats()).errors > 0
        assert await asyncio.to_thread(_temp_files, full_disk) == []
        stored = [i for i, ok in enumerate(results) if ok]
        pages = [PageBuffer.allocate(512, "f") for _ in stored]
        assert await backend.batch_get([keys[i] for i in stored], pages) == [True] * len(stored)
        assert [p.tobytes() for p in pages] == [data[i] for i in stored]
        failed = [i for i, ok in enumerate(results) if not ok]
        assert await backend.batch_exists([keys[failed[0]]]) == 0


async def test_a_backup_onto_a_full_disk_ends_failed_keeping_what_was_stored(
    full_disk: Path,
) -> None:
    conf = StorageTierConfig(prefetch_threshold=PS, backup_batch_pages=8, timeout_s=5.0)
    ctl = TierController(
        _filled_device_pool(), HostKVPool(LAYOUT, 256 * PS), storage_config=conf, model="full"
    )
    async with ctl:
        await ctl.attach_storage_backend(f"file://{full_disk}/store")
        # 16 device pages backed up 12 times under different tokens: more than the disk holds.
        dev = ctl.device_allocator.alloc(16 * PS)
        assert dev is not None
        host = await ctl.backup(dev)
        assert host is not None
        ops = []
        for r in range(12):
            tokens = list(range(r * 10_000, r * 10_000 + host.numel()))
            op = ctl.write_storage(host, tokens)
            assert op is not None
            await op
            ops.append((op, tokens))
        failed = [(op, t) for op, t in ops if not op.succeeded]
        assert failed, "the disk never filled up"
        op, tokens = failed[0]
        assert isinstance(op.error, StorageError)
        assert op.completed_tokens % PS == 0 and op.completed_tokens < len(tokens)
        assert ctl.storage is not None and ctl.storage.stats.backup_failed >= 1
        assert await asyncio.to_thread(_temp_files, full_disk) == []
        expect = [p.tobytes() for p in ctl.host_pool.page_buffers(host)]
        # Every backup's completed prefix reads back bit-identically.
        for op, tokens in ops:
            n = op.completed_tokens
            if n < conf.prefetch_threshold:
                continue
            dst = ctl.host_allocator.alloc(n)
            assert dst is not None
            pf = ctl.prefetch("check", dst, tokens[:n])
            assert pf is not None
            await pf
            got, _ = await ctl.terminate_prefetch(pf)
            assert got == n, (got, n)
            assert [p.tobytes() for p in ctl.host_pool.page_buffers(dst)] == expect[: n // PS]
            ctl.free_host(dst)
        # And the controller serves the next request.
        dev2 = await ctl.load_back(host)
        assert dev2 is not None
        for buf in ctl.device_pool.buffers:
            for layer in buf:
                assert torch.equal(layer[dev2], layer[dev])
