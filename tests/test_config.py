"""TierCacheConfig: keywords, dict, TOML file and TIERCACHE_* environment, validated."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import CapacityError, ConfigError


def test_keywords_and_derived_values() -> None:
    c = TierCacheConfig(
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        dtype="bfloat16",
        page_size=64,
        device_tokens=4096,
        host_ratio=3.0,
    )
    assert c.dtype is torch.bfloat16
    assert c.layout().page_bytes == 64 * 2 * 8 * 4 * 64 * 2
    assert c.resolved_host_tokens() == 3 * 4096
    assert (
        TierCacheConfig(
            page_size=16, host_size_bytes=10 * c.layout().page_bytes
        ).resolved_host_tokens()
        > 0
    )
    # SGLang's timeout policy defaults: 1 s + 0.25 s per 1k tokens, capped.
    assert c.prefetch_timeout(4096) == pytest.approx(2.0)
    assert c.prefetch_timeout(10**9) == c.prefetch_timeout_max


def test_from_dict_rejects_unknown_keys() -> None:
    assert TierCacheConfig.from_dict({"page_size": 32, "device_tokens": 64}).page_size == 32
    with pytest.raises(ConfigError, match="pagesize"):
        TierCacheConfig.from_dict({"pagesize": 32})
    with pytest.raises(ConfigError):
        TierCacheConfig.from_dict([("page_size", 32)])  # type: ignore[arg-type]


def test_replace_and_cache_overrides_reject_unknown_keys() -> None:
    c = TierCacheConfig()
    assert c.replace(page_size=32, device_tokens=64).page_size == 32
    with pytest.raises(ConfigError, match="pagesize"):
        c.replace(pagesize=32)
    with pytest.raises(ConfigError, match="pagesize"):
        TierCache(c, pagesize=32)


def test_from_toml_table_or_whole_file(tmp_path: Path) -> None:
    p = tmp_path / "tc.toml"
    p.write_text(
        '[tiercache]\npage_size = 64\ndevice_tokens = 1024\nstorage_url = "memory://"\n'
        'storage_options = { capacity_bytes = 1000000 }\nprefetch_policy = "timeout"\n'
    )
    c = TierCacheConfig.from_toml(p)
    assert (c.page_size, c.storage_url, c.prefetch_policy) == (64, "memory://", "timeout")
    assert c.storage_options == {"capacity_bytes": 1000000}
    flat = tmp_path / "flat.toml"
    flat.write_text("page_size = 32\ndevice_tokens = 64\n")
    assert TierCacheConfig.from_toml(flat).page_size == 32
    bad = tmp_path / "bad.toml"
    bad.write_text("page_size = [")
    with pytest.raises(ConfigError):
        TierCacheConfig.from_toml(bad)
    with pytest.raises(ConfigError):
        TierCacheConfig.from_toml(tmp_path / "missing.toml")


def test_from_env_parses_by_field_type_and_overrides_win() -> None:
    env = {
        "TIERCACHE_PAGE_SIZE": "64",
        "TIERCACHE_DEVICE_TOKENS": "2048",
        "TIERCACHE_DTYPE": "float16",
        "TIERCACHE_MLA": "false",
        "TIERCACHE_NUM_KV_HEADS": "1",
        "TIERCACHE_HOST_TOKENS": "none",
        "TIERCACHE_PREFETCH_TIMEOUT_BASE": "0.5",
        "TIERCACHE_STORAGE_OPTIONS": "capacity_bytes=100,fsync=1",
        "TIERCACHE_SOMETHING_ELSE": "ignored",
        "UNRELATED": "x",
    }
    c = TierCacheConfig.from_env(env, model="m")
    assert (c.page_size, c.device_tokens, c.dtype, c.mla, c.host_tokens) == (
        64,
        2048,
        torch.float16,
        False,
        None,
    )
    assert c.prefetch_timeout_base == 0.5 and c.model == "m"
    assert c.storage_options == {"capacity_bytes": "100", "fsync": "1"}
    assert TierCacheConfig.from_env(env, page_size=16, device_tokens=16).page_size == 16
    with pytest.raises(ConfigError, match="TIERCACHE_PAGE_SIZE"):
        TierCacheConfig.from_env({"TIERCACHE_PAGE_SIZE": "sixty-four"})
    with pytest.raises(ConfigError):
        TierCacheConfig.from_env({"TIERCACHE_MLA": "maybe"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 0},
        {"page_size": 16, "device_tokens": 100},
        {"write_policy": "write_sometimes"},
        {"prefetch_policy": "eventually"},
        {"host_layout": "token_first"},
        {"dtype": "float64"},
        {"tp_rank": 2, "tp_size": 2},
        {"host_tokens": 64, "host_size_bytes": 1 << 20},
        {"storage_timeout_s": 0},
        {"prefetch_timeout_base": -1},
        {"model": ""},
        {"mla": True, "num_kv_heads": 4},
        {"num_layers": True},
        {"storage_url": ""},
    ],
)
def test_bad_values_raise_config_error_naming_the_field(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TierCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_to_dict_round_trips() -> None:
    c = TierCacheConfig(page_size=32, device_tokens=256, dtype="float16", storage_options={"a": 1})
    assert TierCacheConfig.from_dict(c.to_dict()) == c


FLOAT_FIELDS = [
    "host_ratio",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "storage_timeout_s",
    "storage_reconnect_backoff_s",
    "storage_reconnect_backoff_max_s",
    "alloc_timeout_s",
]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_from_every_source(
    name: str, value: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=name):
        TierCacheConfig(**{name: float(value)})
    with pytest.raises(ConfigError, match=name):
        TierCacheConfig.from_dict({name: float(value)})
    with pytest.raises(ConfigError, match=name):
        TierCacheConfig.from_env({f"TIERCACHE_{name.upper()}": value})
    path = tmp_path / "c.toml"
    path.write_text(f"[tiercache]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=name):
        TierCacheConfig.from_toml(path)


@pytest.mark.parametrize("options", [[("a", 1)], "a=1", 5, None])
def test_storage_options_must_be_a_mapping(options: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage_options"):
        TierCacheConfig(storage_options=options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="storage_options"):
        TierCacheConfig.from_dict({"storage_options": options})
    if isinstance(options, str | int):
        path = tmp_path / "c.toml"
        path.write_text(f"[tiercache]\nstorage_options = {options!r}\n".replace("'", '"'))
        with pytest.raises(ConfigError, match="storage_options"):
            TierCacheConfig.from_toml(path)


@pytest.mark.parametrize("options", [{1: 2}, {"": 1}, {None: "x"}])
def test_storage_options_names_must_be_keyword_names(options: dict[object, object]) -> None:
    """The options become keyword arguments when the backend opens: refuse bad names up front."""
    with pytest.raises(ConfigError, match="storage_options"):
        TierCacheConfig(storage_url="memory://", storage_options=options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="storage_options"):
        TierCacheConfig.from_dict({"storage_options": options})


async def test_a_pool_that_cannot_be_allocated_is_a_capacity_error() -> None:
    # 2**60 bytes of host pool: no machine has it; torch refuses with a RuntimeError.
    cache = TierCache(
        TierCacheConfig(device_tokens=16, page_size=16, host_tokens=(1 << 50) // 16 * 16)
    )
    with pytest.raises(CapacityError):
        await cache.open()
    await cache.aclose()


def test_int_fields_take_numpy_integers_and_store_plain_ints() -> None:
    import numpy as np

    c = TierCacheConfig(page_size=np.int64(16), device_tokens=np.int32(64))  # type: ignore[arg-type]
    assert (c.page_size, c.device_tokens) == (16, 64)
    assert type(c.page_size) is int and type(c.device_tokens) is int
    for name, bad in (("page_size", 16.0), ("tp_rank", -1), ("prefetch_threshold", False)):
        with pytest.raises(ConfigError, match=name):
            TierCacheConfig(**{name: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x", "", "gpu0"])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_on_construction(device: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        TierCacheConfig(device=device)
    with pytest.raises(ConfigError, match="device"):
        TierCacheConfig.from_env({"TIERCACHE_DEVICE": device})


def test_a_cuda_device_is_a_valid_setting_without_cuda() -> None:
    # The configuration may be written for another machine: only opening needs CUDA.
    assert TierCacheConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
async def test_opening_a_cuda_cache_without_cuda_is_a_config_error() -> None:
    cache = TierCache(TierCacheConfig(device="cuda", device_tokens=16, page_size=16))
    with pytest.raises(ConfigError, match="device"):
        await cache.open()
    await cache.aclose()


@pytest.mark.parametrize("raw", ['{"capacity_bytes": 5}', "[1]", "capacity_bytes", "=5", "a=1,b"])
def test_storage_options_from_env_must_be_key_value_pairs(raw: str) -> None:
    with pytest.raises(ConfigError, match="TIERCACHE_STORAGE_OPTIONS"):
        TierCacheConfig.from_env({"TIERCACHE_STORAGE_OPTIONS": raw})


def test_storage_options_from_env_may_be_empty() -> None:
    for raw in ("", " ", ","):
        assert TierCacheConfig.from_env({"TIERCACHE_STORAGE_OPTIONS": raw}).storage_options == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"storage_reconnect_backoff_max_s": 0},
        {"storage_reconnect_backoff_s": 2.0, "storage_reconnect_backoff_max_s": 1.0},
        {"storage_reconnect_backoff_s": 60.0},  # above the default maximum of 30 s
    ],
)
def test_a_reconnect_backoff_maximum_below_its_first_delay_is_refused(
    kwargs: dict[str, object],
) -> None:
    # The probes back off from the first delay up to the maximum: a maximum
    # below it (or 0) would make every probe after the first come sooner.
    with pytest.raises(ConfigError, match="storage_reconnect_backoff_max_s"):
        TierCacheConfig(**kwargs)  # type: ignore[arg-type]
    assert TierCacheConfig(
        storage_reconnect_backoff_s=2.0, storage_reconnect_backoff_max_s=2.0
    ).storage_tier_config()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefetch_timeout_max": 0.5},  # below the default base of 1 s
        {"prefetch_timeout_base": 40.0},  # above the default cap of 30 s
        {"prefetch_timeout_base": 2.0, "prefetch_timeout_max": 1.0},
    ],
)
def test_a_prefetch_timeout_cap_below_its_base_is_refused(kwargs: dict[str, object]) -> None:
    # The cap would silently cut every prefetch's wait below the base.
    with pytest.raises(ConfigError, match="prefetch_timeout_max"):
        TierCacheConfig(**kwargs)  # type: ignore[arg-type]
    c = TierCacheConfig(prefetch_timeout_base=2.0, prefetch_timeout_max=2.0)
    assert c.prefetch_timeout(10**6) == 2.0


def test_a_config_is_hashable_and_its_hash_follows_equality() -> None:
    a = TierCacheConfig(storage_url="memory://", storage_options={"capacity_bytes": 10})
    b = TierCacheConfig.from_dict(a.to_dict())
    assert a == b and hash(a) == hash(b)
    assert hash(TierCacheConfig()) == hash(TierCacheConfig())
    assert len({a, b, TierCacheConfig()}) == 2
    # An option value need not be hashable for the config to be.
    hosts = TierCacheConfig(storage_options={"hosts": ["a", "b"]})
    assert hash(hosts) == hash(TierCacheConfig(storage_options={"hosts": ["a", "b"]}))
    assert hosts != TierCacheConfig(storage_options={"hosts": ["a"]})
    for twin in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert twin == a and hash(twin) == hash(a)


def test_storage_options_cannot_change_under_a_config() -> None:
    given = {"capacity_bytes": 10}
    c = TierCacheConfig(storage_options=given)
    given["capacity_bytes"] = 20  # the caller's dict is copied
    assert c.storage_options == {"capacity_bytes": 10}
    with pytest.raises(TypeError):
        c.storage_options["capacity_bytes"] = 30  # type: ignore[index]
    assert dict(c.storage_options) == {"capacity_bytes": 10} == c.to_dict()["storage_options"]


def test_every_frozen_settings_class_is_hashable() -> None:
    from tiercache.demo import DemoSettings
    from tiercache.integrations._metrics import MetricsOptions
    from tiercache.memory.layout import KVLayout
    from tiercache.models.tiny import TinyConfig
    from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec
    from tiercache.storage_tier import StorageTierConfig

    spec = FaultSpec(FaultKind.ERROR, ops=["get", "set"])
    for value in (
        DemoSettings(),
        MetricsOptions(),
        KVLayout(2, 2, 8),
        TinyConfig(),
        spec,
        FaultPlan.of(spec, seed=1),
        StorageTierConfig(),
    ):
        assert hash(value) == hash(copy.deepcopy(value)), value


@pytest.mark.parametrize("path", [True, 0, 3.5, None, b"tiercache.toml"])
def test_from_toml_refuses_what_is_not_a_path_and_leaves_file_descriptors_alone(
    path: object, tmp_path: Path
) -> None:
    """``open`` takes an int as a file descriptor: from_toml(fd) read that file
    and closed the caller's descriptor, and from_toml(True) closed stdout (fd 1)."""
    spare = tmp_path / "spare"
    spare.write_text("[tiercache]\npage_size = 8\n")
    fd = os.open(spare, os.O_RDONLY)
    try:
        for p in (path, fd):
            with pytest.raises(ConfigError, match="path must be a str or a path"):
                TierCacheConfig.from_toml(p)  # type: ignore[arg-type]
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    with pytest.raises(ConfigError, match="table must be a str or None"):
        TierCacheConfig.from_toml(spare, table=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("environ", [5, ["TIERCACHE_PAGE_SIZE=8"], "TIERCACHE_PAGE_SIZE=8"])
def test_from_env_refuses_an_environ_that_is_not_a_mapping(environ: object) -> None:
    with pytest.raises(ConfigError, match="environ must be a mapping"):
        TierCacheConfig.from_env(environ)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["capacity_bytes", "=1", "a=1,fsync"])
def test_env_storage_options_error_says_what_form_is_expected(raw: str) -> None:
    """The error names the variable and the part that is not ``key=value``, not a type name."""
    with pytest.raises(ConfigError, match="is not key=value,key=value") as e:
        TierCacheConfig.from_env({"TIERCACHE_STORAGE_OPTIONS": raw})
    assert "TIERCACHE_STORAGE_OPTIONS" in str(e.value)
    assert "Mapping" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"host_size_bytes": 1000}, "host_size_bytes"),
        ({"host_ratio": 0}, "host_ratio"),
        ({"host_ratio": 0.001, "device_tokens": 1024}, "host_ratio"),
    ],
)
def test_a_host_pool_smaller_than_a_page_is_refused(kwargs: dict[str, Any], field: str) -> None:
    """A host size that holds no page was rounded up to one page without a word."""
    with pytest.raises(ConfigError, match=field):
        TierCacheConfig(**kwargs)


def test_host_ratio_does_not_matter_when_another_field_sizes_the_host() -> None:
    page_bytes = TierCacheConfig().layout().page_bytes
    assert TierCacheConfig(host_ratio=0, host_tokens=16).resolved_host_tokens() == 16
    c = TierCacheConfig(host_ratio=0, host_size_bytes=page_bytes)
    assert c.resolved_host_tokens() == c.page_size
