"""A file store survives writers killed with SIGKILL at random points.

A writer process (`crash_writer.py`) backs pages up into a directory, directly
through `FileBackend.batch_set` or through `TierController.write_storage` from a
real host pool, and is killed with SIGKILL after a random 20-300 ms. After every
kill a new in-process reader opens the same directory and checks:

* every published page file reads back bit-identical to the bytes its key
  determines (`crash_writer.expected_bytes`); a planned key that was never
  published reads as a miss; no read ever returns other bytes;
* temporary files left by the killed writer are not pages (not indexed, not
  found by ``batch_exists``, a miss on read), and once stale they are removed;
* the store keeps working: new pages written after the crash read back.

``TIERCACHE_CRASH_KILLS`` sets the kills per test (default 6) for a longer run;
``TIERCACHE_CRASH_SEED`` the seed of the kill points.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.reliability import crash_writer as cw

from tiercache.storage.base import PageBuffer, PageKey
from tiercache.storage.file import FileBackend

KILLS = int(os.environ.get("TIERCACHE_CRASH_KILLS", "6"))
SEED = int(os.environ.get("TIERCACHE_CRASH_SEED", "20240611"))
WRITER = Path(cw.__file__)
_LINE_TIMEOUT_S = 60.0
#: Stale temporary files are removed when a backend opens (see file.py).
_STALE_S = 11 * 60


@dataclass
class StoreCheck:
    """What one reader found in a store."""

    pages: int = 0  # published page files
    temps: int = 0  # temporary files on disk
    verified: int = 0  # reads that returned the expected bytes
    misses: int = 0  # planned keys with no page
    wrong: list[str] = field(default_factory=list)  # reads that returned other bytes
    lost: list[str] = field(default_factory=list)  # published files that did not read back
    unknown: list[str] = field(default_factory=list)  # page files no writer planned
    visible_temps: list[str] = field(default_factory=list)  # temp files seen as pages
    last_batch: int = -1  # highest batch with a published page


class Plan:
    """The writer's planned keys, batch by batch, with the reverse lookup."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.keys: list[list[PageKey]] = []
        self.batch_of: dict[str, int] = {}

    def extend_to(self, n_batches: int) -> None:
        while len(self.keys) < n_batches:
            b = len(self.keys)
            ks = cw.batch_keys(self.mode, b)
            self.keys.append(ks)
            for k in ks:
                self.batch_of[k] = b

    def find(self, key: str) -> int | None:
        while key not in self.batch_of and len(self.keys) < 20_000:
            self.extend_to(len(self.keys) + 256)
        return self.batch_of.get(key)


def _list_store(root: Path) -> tuple[list[str], list[str]]:
    """Keys of ``*.page`` files and names of temporary files, anywhere under ``root``."""
    pages: list[str] = []
    temps: list[str] = []
    for _dir, _subdirs, files in os.walk(root):
        for name in files:
            if name.endswith(".tmp"):
                temps.append(name)
            elif name.endswith(".page"):
                pages.append(name.removesuffix(".page"))
    return pages, temps


def _tmp_key(name: str) -> str:
    """``.<key>.<pid>.<random>.tmp`` -> ``<key>``."""
    return name[1:].rsplit(".", 3)[0]


async def check_store(root: Path, plan: Plan, extra: dict[str, str] | None = None) -> StoreCheck:
    """Open ``root`` in a fresh backend and read every key that could be there.

    ``extra`` maps more keys (written by the reader itself) to their page format.
    """
    extra = extra or {}
    fmt = cw.page_format(plan.mode)
    out = StoreCheck()
    page_keys, temp_names = await asyncio.to_thread(_list_store, root)
    out.pages, out.temps = len(page_keys), len(temp_names)
    for k in page_keys:
        b = plan.find(k)
        if b is None and k not in extra:
            out.unknown.append(k)
        elif b is not None:
            out.last_batch = max(out.last_batch, b)
    plan.extend_to(out.last_batch + 3)
    published = set(page_keys)
    # Every planned key up to two batches past the last published one, the
    # keys of leftover temporary files, and the reader's own pages.
    probe: dict[str, str] = {k: fmt for ks in plan.keys[: out.last_batch + 3] for k in ks}
    probe.update({_tmp_key(n): fmt for n in temp_names})
    probe.update(extra)
    async with await FileBackend.open(root) as backend:
        stats = await backend.stats()
        if stats.extra["pages"] != len(page_keys):
            out.visible_temps.append(f"index has {stats.extra['pages']} pages, disk {out.pages}")
        for name in temp_names:
            k = _tmp_key(name)
            if k not in published and await backend.batch_exists([PageKey(k)]):
                out.visible_temps.append(name)
        items = list(probe.items())
        for lo in range(0, len(items), 64):
            chunk = items[lo : lo + 64]
            keys = [PageKey(k) for k, _ in chunk]
            pages = [PageBuffer.allocate(cw.PAGE_BYTES, f) for _, f in chunk]
            got = await backend.batch_get(keys, pages)
            for k, page, hit in zip(keys, pages, got, strict=True):
                if hit:
                    if page.tobytes() == cw.expected_bytes(k):
                        out.verified += 1
                    else:
                        out.wrong.append(k)
                elif k in published:
                    out.lost.append(k)
                else:
                    out.misses += 1
    return out


class Zygote:
    """The `crash_writer` fork server, driven over its stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pending: list[str] = []
        self.worker: int | None = None  # the writer forked last, until reaped

    @classmethod
    async def start(cls) -> Zygote:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WRITER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def expect(self, prefix: str) -> list[str]:
        """The next line starting with ``prefix`` (other lines are kept for later)."""
        for i, line in enumerate(self.pending):
            if line.startswith(prefix):
                return self.pending.pop(i).split()
        assert self.proc.stdout is not None
        while True:
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), _LINE_TIMEOUT_S)
            except TimeoutError:
                raw = b""
            if not raw:
                await self.fail(f"no {prefix!r} line from the writer")
            line = raw.decode().strip()
            if line.startswith(prefix):
                return line.split()
            self.pending.append(line)

    def kill_worker(self) -> None:
        if self.worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker, signal.SIGKILL)

    async def fail(self, why: str) -> None:
        # The writer holds the pipes too: kill it first, or reading them never ends.
        self.kill_worker()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        assert self.proc.stderr is not None
        try:
            err = await asyncio.wait_for(self.proc.stderr.read(), 10)
        except TimeoutError:
            err = b"<stderr not readable>"
        pytest.fail(f"{why}; writer stderr:\n{err.decode(errors='replace')[-4000:]}")

    async def close(self) -> None:
        self.kill_worker()
        if self.proc.returncode is None:
            try:
                await self.send("exit")
                await asyncio.wait_for(self.proc.wait(), 10)
            except (TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()


async def kill_one(zygote: Zygote, mode: str, root: Path, start: int, delay_s: float) -> None:
    """Fork a writer, let it write for ``delay_s``, SIGKILL it and check it died of the kill."""
    await zygote.send(f"fork {mode} {root} {start}")
    pid = zygote.worker = int((await zygote.expect("pid "))[1])
    await zygote.expect(f"started {pid}")
    await asyncio.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    await zygote.send(f"reap {pid}")
    code = int((await zygote.expect(f"reaped {pid}"))[2])
    zygote.worker = None
    if code != signal.SIGKILL:
        await zygote.fail(f"writer {pid} ended with {code} before it was killed")


def _age(paths: list[Path]) -> None:
    old = time.time() - _STALE_S
    for p in paths:
        os.utime(p, (old, old))


def _temp_paths(root: Path) -> list[Path]:
    return [Path(d, n) for d, _, files in os.walk(root) for n in files if n.endswith(".tmp")]


@pytest.mark.parametrize("mode", cw.MODES)
async def test_killed_writers_never_leave_wrong_or_visible_partial_pages(
    mode: str, tmp_path: Path
) -> None:
    assert KILLS > 0
    rng = random.Random(f"{SEED}:{mode}")
    root = tmp_path / "store"
    plan = Plan(mode)
    fmt = cw.page_format(mode)
    extra: dict[str, str] = {}
    kills = verified = misses = temps_seen = 0
    start = 0
    zygote = await Zygote.start()
    try:
        for n in range(KILLS):
            await kill_one(zygote, mode, root, start, rng.uniform(0.02, 0.3))
            kills += 1
            check = await check_store(root, plan, extra)
            assert not check.wrong, f"wrong bytes after kill {n}: {check.wrong[:4]}"
            assert not check.lost, f"published pages lost after kill {n}: {check.lost[:4]}"
            assert not check.unknown, f"unplanned page files: {check.unknown[:4]}"
            assert not check.visible_temps, f"temporary files seen as pages: {check.visible_temps}"
            verified += check.verified
            misses += check.misses
            temps_seen = max(temps_seen, check.temps)
            # The store keeps working after the crash: a new page writes and reads back.
            key = cw.NAMESPACE.key(f"{n + 1:04x}" + "e" * 60)
            async with await FileBackend.open(root) as backend:
                page = PageBuffer.from_bytes(cw.expected_bytes(key), fmt)
                assert await backend.batch_set([key], [page]) == [True]
                back = PageBuffer.allocate(cw.PAGE_BYTES, fmt)
                assert await backend.batch_get([key], [back]) == [True]
                assert back.tobytes() == cw.expected_bytes(key)
            extra[key] = fmt
            # Resume a little before the end: rewrites existing and half-written keys.
            start = max(0, check.last_batch - 1)
    finally:
        await zygote.close()

    # Leftover temporary files are removed once stale, and removing them loses no page.
    leftovers = await asyncio.to_thread(_temp_paths, root)
    await asyncio.to_thread(_age, leftovers)
    final = await check_store(root, plan, extra)
    remaining = await asyncio.to_thread(_temp_paths, root)
    assert not remaining, f"stale temporary files survived a reopen: {remaining}"
    assert not final.wrong and not final.lost and not final.visible_temps
    verified += final.verified
    misses += final.misses

    print(
        f"\ncrash consistency [{mode}]: kills={kills} pages_verified={verified} "
        f"misses={misses} max_leftover_temps={temps_seen} stale_temps_removed={len(leftovers)} "
        f"pages_on_disk={final.pages}"
    )
    assert kills == KILLS
    assert verified > 0
    assert misses > 0


async def test_the_check_catches_wrong_torn_and_unplanned_pages(tmp_path: Path) -> None:
    """The checker above can fail: plant each kind of damage and see it reported."""
    root = tmp_path / "store"
    plan = Plan("backend")
    good, wrong, torn = cw.batch_keys("backend", 0)[:3]
    fmt = cw.BACKEND_FORMAT
    async with await FileBackend.open(root) as backend:
        pages = [
            PageBuffer.from_bytes(cw.expected_bytes(good), fmt),
            PageBuffer.from_bytes(cw.expected_bytes(good), fmt),  # the bytes of another key
            PageBuffer.from_bytes(cw.expected_bytes(torn), fmt),
        ]
        assert await backend.batch_set([good, wrong, torn], pages) == [True] * 3
    clean = await check_store(root, plan)
    assert clean.wrong == [wrong] and clean.verified == 2 and not clean.lost

    def damage() -> None:
        (path,) = [Path(d, f"{torn}.page") for d, _, fs in os.walk(root) if f"{torn}.page" in fs]
        path.write_bytes(path.read_bytes()[:-10])  # a torn page under its real name
        path.with_name("0000-not-planned.page").write_bytes(b"x")

    await asyncio.to_thread(damage)
    damaged = await check_store(root, plan)
    assert damaged.lost == [torn]
    assert damaged.unknown == ["0000-not-planned"]
