"""open_backend: URL forms, query options, plugins by registration, entry point and dotted path."""

from __future__ import annotations

import asyncio
import importlib.metadata
import sys
from pathlib import Path
from typing import Any, Self

import pytest
from tests.storage.storage_helpers import keys, random_page

from tiercache.errors import BackendNotFoundError, ConfigError
from tiercache.storage import (
    FileBackend,
    MemoryBackend,
    StorageBackend,
    available_backends,
    open_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from tiercache.storage import registry as registry_module


class PluginBackend(MemoryBackend):
    """A third-party backend: remembers how it was opened."""

    name = "plugin"

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.url = url
        self.options = options

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        _, opts = registry_module.url_options(url, options)
        return cls(url, opts)


async def test_memory_urls() -> None:
    b = await open_backend("memory://")
    assert isinstance(b, MemoryBackend) and b.capacity_bytes is None
    await b.aclose()
    b = await open_backend("memory://?capacity_bytes=4096&capacity_pages=2")
    assert isinstance(b, MemoryBackend) and (b.capacity_bytes, b.capacity_pages) == (4096, 2)
    await b.aclose()


async def test_file_url_absolute_with_options(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store?capacity_bytes=1000000&fsync=1&max_concurrency=3"
    async with await open_backend(url) as b:
        assert isinstance(b, FileBackend)
        assert (b.root, b.capacity_bytes, b.fsync, b.max_concurrency) == (
            tmp_path / "store",
            1000000,
            True,
            3,
        )
        (k,) = keys(1)
        assert await b.batch_set([k], [random_page()]) == [True]
    async with await open_backend(f"file://{tmp_path}/store?fsync=1", fsync=False) as b:
        assert isinstance(b, FileBackend) and b.fsync is False  # keywords win over the query
        assert await b.batch_exists([k]) == 1


async def test_file_url_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with await open_backend("file:rel/store") as b:
        assert isinstance(b, FileBackend) and b.root == Path("rel/store")
        await b.batch_set(keys(1), [random_page()])
    assert (tmp_path / "rel" / "store").is_dir()


@pytest.mark.parametrize(
    "url",
    [
        "file://somehost/x",
        "file://",
        "file:///tmp/x?colour=red",
        "file:///tmp/x?capacity_bytes=lots",
        "file:///tmp/x?fsync=maybe",
        "file:///tmp/x?fsync=1&fsync=0",
        "memory://?capacity_pages=-2",
        "memory://somewhere",
    ],
)
async def test_bad_urls_and_options_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        await open_backend(url)


@pytest.mark.parametrize(
    "url", ["nope://x", "relative/path", "", "tests.storage.missing_module:Backend"]
)
async def test_unknown_backends(url: str) -> None:
    with pytest.raises(ConfigError):  # BackendNotFoundError for all but the empty URL
        await open_backend(url)
    if url:
        with pytest.raises(BackendNotFoundError):
            await open_backend(url)


@pytest.mark.parametrize("name", [5, None, b"memory"])
def test_resolve_backend_refuses_a_name_that_is_not_a_str(name: object) -> None:
    with pytest.raises(BackendNotFoundError, match="is a str"):
        resolve_backend(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", ["redis", "rediss", "unix"])
def test_redis_schemes_resolve_to_the_redis_backend(scheme: str) -> None:
    factory = resolve_backend(scheme)
    assert getattr(factory, "__name__", "") == "RedisBackend"
    assert getattr(factory, "__module__", "") == "tiercache.storage.redis"


async def test_missing_redis_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiercache.storage.redis", None)
    with pytest.raises(BackendNotFoundError, match="redis"):
        await open_backend("redis://localhost:6379/0")


@pytest.mark.parametrize(
    "url",
    [
        "tests.storage.test_registry:PluginBackend?colour=red",
        "tests.storage.test_registry.PluginBackend?colour=red",
    ],
)
async def test_dotted_path_plugin(url: str) -> None:
    b = await open_backend(url, size=3)
    assert type(b).__name__ == "PluginBackend"
    assert b.url == url and b.options == {"colour": "red", "size": 3}  # type: ignore[attr-defined]
    await b.aclose()


async def test_register_backend_with_sync_and_async_factories() -> None:
    opened: list[tuple[str, dict[str, Any]]] = []

    def sync_factory(url: str, **options: Any) -> StorageBackend:
        opened.append((url, options))
        return MemoryBackend()

    async def async_factory(url: str, **options: Any) -> StorageBackend:
        opened.append((url, options))
        return MemoryBackend()

    register_backend("mine", sync_factory)
    try:
        with pytest.raises(ConfigError):
            register_backend("mine", async_factory)
        assert "mine" in await asyncio.to_thread(available_backends)
        async with await open_backend("mine://a?x=1", y=2) as b:
            assert isinstance(b, MemoryBackend)
        register_backend("mine", async_factory, replace=True)
        async with await open_backend("mine://b") as b:
            assert isinstance(b, MemoryBackend)
        register_backend("mine", PluginBackend, replace=True)
        async with await open_backend("mine://c?q=1") as b:
            assert isinstance(b, PluginBackend) and b.options == {"q": "1"}
    finally:
        unregister_backend("mine")
    assert opened == [("mine://a?x=1", {"y": 2}), ("mine://b", {})]
    with pytest.raises(BackendNotFoundError):
        await open_backend("mine://a")


def test_register_backend_rejects_bad_names_and_factories() -> None:
    for name in ("", "Upper", "has space", "1x"):
        with pytest.raises(ConfigError):
            register_backend(name, MemoryBackend)
    with pytest.raises(ConfigError):
        register_backend("fine", "not callable")  # type: ignore[arg-type]


async def test_a_built_in_scheme_is_replaced_only_on_purpose_and_never_removed() -> None:
    for name in ("memory", "file", "redis", "rediss", "unix"):
        with pytest.raises(ConfigError, match="built-in"):
            register_backend(name, PluginBackend)
        with pytest.raises(ConfigError, match="built-in"):
            unregister_backend(name)
    async with await open_backend("memory://") as b:
        assert type(b) is MemoryBackend  # the refused registration changed nothing
    register_backend("memory", PluginBackend, replace=True)
    try:
        async with await open_backend("memory://") as b:
            assert isinstance(b, PluginBackend)
    finally:
        unregister_backend("memory")  # the replacement goes; the built-in is back
    async with await open_backend("memory://") as b:
        assert type(b) is MemoryBackend
    unregister_backend("never-registered")  # absent: no error


async def test_factory_returning_something_else_is_a_config_error() -> None:
    register_backend("wrong", lambda url, **o: object())
    try:
        with pytest.raises(ConfigError, match="not a StorageBackend"):
            await open_backend("wrong://")
    finally:
        unregister_backend("wrong")


async def test_entry_point_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [
        importlib.metadata.EntryPoint(
            "viaep", "tests.storage.test_registry:PluginBackend", "tiercache.backends"
        ),
        importlib.metadata.EntryPoint(
            "broken", "tests.storage.no_such_module:X", "tiercache.backends"
        ),
    ]
    monkeypatch.setattr(registry_module, "_entry_points", lambda: eps)
    assert {"viaep", "broken"} <= set(available_backends())
    b = await open_backend("viaep://host?k=v")
    assert type(b).__name__ == "PluginBackend" and b.options == {"k": "v"}  # type: ignore[attr-defined]
    await b.aclose()
    with pytest.raises(BackendNotFoundError, match="failed to load"):
        await open_backend("broken://")
