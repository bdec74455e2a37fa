"""Security of the storage tier: paths, permissions and credentials.

* Keys are validated before any path is built: a key with ``/``, ``..``, NUL or
  a leading dot raises `InvalidInputError` and creates nothing, inside or
  outside the store.
* Files are private by default (0o600 files, 0o700 directories), even under
  ``umask 0``.
* A Redis password never reaches a log record, a repr or str, or any raised
  exception (message, args, cause or context), whether the calls succeed, the
  password is wrong, or the server dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.redis_server import RedisServer, require_redis_server
from tests.storage.redis_fixtures import unique_prefix

from tiercache.errors import ConfigError, InvalidInputError, StorageError, TierCacheError
from tiercache.storage import open_backend
from tiercache.storage.base import PageBuffer, PageKey, StorageBackend
from tiercache.storage.file import FileBackend
from tiercache.storage.registry import redact_url

# Built at run time so that no source line shown in a traceback contains it.
PASSWORD = "".join(["s3cr", "et-", "pw", "-", "7f1c"])
WRONG_PASSWORD = "".join(["wr0ng", "-pw-", "c0de"])

BAD_KEYS = [
    "../x",
    "../../etc/passwd",
    "a/b",
    "/abs",
    "..",
    ".",
    ".hidden",
    "a\x00b",
    "a\\b",
    "x" * 300,
    "",
]


def _tree(path: Path) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, n), path)
        for d, dirs, files in os.walk(path)
        for n in [*dirs, *files]
    }


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
async def test_bad_keys_are_refused_before_any_path_is_built(key: str, tmp_path: Path) -> None:
    root = tmp_path / "area" / "store"
    async with await FileBackend.open(root) as backend:
        ok = PageKey("0123456789abcdef-" + "ab" * 32)
        await backend.batch_set([ok], [PageBuffer.from_bytes(b"x" * 64, "f")])
        before = await asyncio.to_thread(_tree, tmp_path)
        page = PageBuffer.from_bytes(b"y" * 64, "f")
        calls = [
            backend.batch_set([PageKey(key)], [page]),
            backend.batch_set([ok, PageKey(key)], [page, page]),  # one bad key fails the batch
            backend.batch_get([PageKey(key)], [page]),
            backend.batch_exists([PageKey(key)]),
            backend.delete([PageKey(key)]),
        ]
        for call in calls:
            with pytest.raises(InvalidInputError):
                await call
        assert await asyncio.to_thread(_tree, tmp_path) == before
        assert page.tobytes() == b"y" * 64
        assert await backend.batch_exists([ok]) == 1


async def test_files_and_directories_are_private_even_with_umask_0(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = tmp_path / "store"
        async with await FileBackend.open(root) as backend:
            keys = [PageKey(f"0123456789abcdef-{i:02x}{'0' * 62}") for i in range(8)]
            pages = [PageBuffer.from_bytes(os.urandom(64), "f") for _ in keys]
            assert await backend.batch_set(keys, pages) == [True] * len(keys)
    finally:
        os.umask(old)

    def modes() -> dict[str, int]:
        out = {".": stat.S_IMODE(os.stat(root).st_mode)}
        for rel in _tree(root):
            out[rel] = stat.S_IMODE(os.lstat(root / rel).st_mode)
        return out

    found = await asyncio.to_thread(modes)
    files = {p: m for p, m in found.items() if p.endswith(".page")}
    dirs = {p: m for p, m in found.items() if not p.endswith(".page")}
    assert len(files) == 8 and len(dirs) >= 3
    assert {p: oct(m) for p, m in files.items() if m != 0o600} == {}
    assert {p: oct(m) for p, m in dirs.items() if m != 0o700} == {}


# --- credentials --------------------------------------------------------------------------------


def _texts_of(exc: BaseException) -> str:
    """Everything an exception could show: formatted chain, and each link's repr, str and args."""
    parts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        parts += [repr(e), str(e), *(repr(a) for a in e.args)]
        todo += [e.__cause__, e.__context__]
    return "\n".join(parts)


def _assert_secret_free(text: str, what: str) -> None:
    for secret in (PASSWORD, WRONG_PASSWORD):
        assert secret not in text, f"a password appears in {what}:\n{text[:2000]}"


@pytest.fixture
def secure_redis() -> Iterator[RedisServer]:
    with RedisServer(require_redis_server(), password=PASSWORD) as server:
        yield server


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)  # the root logger: every library, every level
    return caplog


def test_redact_url_masks_any_scheme() -> None:
    assert redact_url(f"redis://:{PASSWORD}@h:1/0") == "redis://:***@h:1/0"
    assert redact_url(f"rediss://user:{PASSWORD}@h/0?x=1") == "rediss://user:***@h/0?x=1"
    assert redact_url(f"myplugin://u:{PASSWORD}@h") == "myplugin://u:***@h"
    assert redact_url("redis://:pa?ss#w@h/0") == "redis://:***@h/0"
    got = redact_url(f"unix:///tmp/r.sock?db=1&password={PASSWORD}")
    assert got == "unix:///tmp/r.sock?db=1&password=***"
    for plain in ("memory://", "file:///x?fsync=1", "file:rel/p", "redis://h:1/0?x=a@b"):
        assert redact_url(plain) == plain


async def test_registry_never_logs_or_raises_the_url_password(
    all_logs: pytest.LogCaptureFixture,
) -> None:
    from tiercache.storage.registry import register_backend, unregister_backend

    async def factory(url: str, **options: object) -> StorageBackend:
        from tiercache.storage.memory import MemoryBackend

        return MemoryBackend()

    register_backend("secretive", factory)
    try:
        backend = await open_backend(f"secretive://user:{PASSWORD}@host/x")
        await backend.aclose()
        with pytest.raises(ConfigError) as twice:
            await open_backend(f"memory://?password={PASSWORD}&password={PASSWORD}")
        _assert_secret_free(_texts_of(twice.value), "the duplicate-option error")
    finally:
        unregister_backend("secretive")
    assert "opened memory backend for secretive://user:***@host/x" in all_logs.text
    _assert_secret_free(all_logs.text, "the logs")


async def test_redis_password_never_leaks(
    secure_redis: RedisServer, all_logs: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{secure_redis.port}/0"
    seen: list[str] = []
    backend = await open_backend(url, prefix=unique_prefix("sec"), timeout=2)
    try:
        # Calls that work.
        key = PageKey("0123456789abcdef-" + "ab" * 32)
        data = os.urandom(256)
        assert await backend.batch_set([key], [PageBuffer.from_bytes(data, "f")]) == [True]
        page = PageBuffer.allocate(256, "f")
        assert await backend.batch_get([key], [page]) == [True] and page.tobytes() == data
        assert await backend.batch_exists([key]) == 1
        seen += [repr(backend), str(backend), repr(await backend.stats())]
        # A wrong password, by URL and by the password= query.
        for bad in (
            f"redis://:{WRONG_PASSWORD}@127.0.0.1:{secure_redis.port}/0",
            f"unix://{secure_redis.unix_socket}?db=0&password={WRONG_PASSWORD}",
        ):
            with pytest.raises(TierCacheError) as wrong:
                b = await open_backend(bad, timeout=2)
                try:
                    await b.batch_exists([key])
                finally:
                    await b.aclose()
            assert isinstance(wrong.value, StorageError)
            seen.append(_texts_of(wrong.value))
        # A bad option in a URL that carries the password.
        with pytest.raises(ConfigError) as bad_option:
            await open_backend(url + "?frobnicate=1")
        seen.append(_texts_of(bad_option.value))
        # The server dies under an open backend.
        await asyncio.to_thread(secure_redis.kill)
        with pytest.raises(StorageError) as down:
            await backend.batch_get([key], [page])
        seen.append(_texts_of(down.value))
        with pytest.raises(StorageError) as down_set:
            await backend.batch_set([key], [page])
        seen.append(_texts_of(down_set.value))
        seen += [repr(backend), str(backend)]
    finally:
        await backend.aclose()
    assert len(seen) >= 8
    for i, text in enumerate(seen):
        _assert_secret_free(text, f"repr/exception #{i}")
    _assert_secret_free(all_logs.text, "the logs")
    assert any(r.name.startswith("tiercache") for r in all_logs.records), "nothing was logged"
