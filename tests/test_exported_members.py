"""The public surface is what we mean it to be (DESIGN.md, "The public surface")."""

from __future__ import annotations

import inspect

import tiercache
import tiercache.storage


def test_top_level_exports_are_exactly_the_public_surface() -> None:
    assert set(tiercache.__all__) == {
        "PREFETCH_POLICIES",
        "WRITE_POLICIES",
        "BackupOperation",
        "CacheMatch",
        "CacheStats",
        "CopyAck",
        "DeviceKVPool",
        "HostKVPool",
        "KVLayout",
        "LoadHandle",
        "PageAllocator",
        "PageKey",
        "PrefetchOperation",
        "PrefetchState",
        "Request",
        "StorageBackend",
        "StorageNamespace",
        "TierCache",
        "TierCacheConfig",
        "TierCacheError",
        "TierController",
        "__version__",
        "errors",
        "hash_page",
        "open_backend",
        "page_hashes",
        "register_backend",
    }
    for name in tiercache.__all__:
        assert hasattr(tiercache, name), name


def test_names_the_design_promises_take_the_arguments_shown() -> None:
    def params(fn: object) -> list[str]:
        return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]

    assert params(tiercache.KVLayout)[:6] == [
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "page_size",
        "mla",
    ]
    assert params(tiercache.PageAllocator)[:2] == ["num_slots", "page_size"]
    assert params(tiercache.DeviceKVPool)[:3] == ["layout", "num_slots", "device"]
    assert params(tiercache.HostKVPool)[:2] == ["layout", "num_slots"]
    assert "host_layout" in params(tiercache.HostKVPool)
    assert params(tiercache.hash_page) == ["token_ids", "prior_hash"]
    assert params(tiercache.page_hashes) == ["token_ids", "page_size", "prior_hash"]
    assert inspect.iscoroutinefunction(tiercache.storage.open_backend)
    for verb in ("batch_exists", "batch_get", "batch_set", "aclose"):
        assert inspect.iscoroutinefunction(getattr(tiercache.StorageBackend, verb)), verb
    for verb in ("alloc", "free"):
        assert callable(getattr(tiercache.PageAllocator, verb))
    assert isinstance(tiercache.PageAllocator.available, property)


def test_the_error_tree() -> None:
    e = tiercache.errors
    assert issubclass(e.ConfigError, ValueError) and issubclass(e.InvalidInputError, ValueError)
    assert issubclass(e.StateError, RuntimeError) and issubclass(e.ClosedError, e.StateError)
    for name in e.__all__:
        assert issubclass(getattr(e, name), e.TierCacheError), name
    for sub in (e.StorageTimeoutError, e.StorageCorruptionError, e.BackendUnavailableError):
        assert issubclass(sub, e.StorageError)
