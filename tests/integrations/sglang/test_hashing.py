"""tiercache's page hash chain is SGLang's, byte for byte, namespaced chains included."""

from __future__ import annotations

import random

import pytest
from tests.integrations.sglang import sglang_helpers as h

from tiercache import hash_page, page_hashes

pytestmark = pytest.mark.sglang


def _tokens(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(0, 1 << 31) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_page_hashes_equal_sglang_get_hash_str(page_size: int) -> None:
    tokens = _tokens(page_size * 9 + page_size // 2, seed=page_size)
    assert page_hashes(tokens, page_size) == h.chain(tokens, page_size)


def test_a_chain_continued_from_a_prior_hash_is_sglang_chain() -> None:
    prior = h.sg().get_hash_str([7, 8, 9, 10], None)
    assert hash_page([7, 8, 9, 10]) == prior
    tokens = _tokens(64, seed=1)
    assert page_hashes(tokens, 16, prior_hash=prior) == h.chain(tokens, 16, prior)


def test_the_documented_example_is_sglang_hash() -> None:
    want = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert h.sg().get_hash_str([1, 2, 3, 4], None) == want == hash_page([1, 2, 3, 4])


@pytest.mark.parametrize(
    ("extra_key", "cache_salt"),
    [("lora-a", None), (None, "tenant-7"), ("lora-b", "tenant-7"), ("", None)],
)
def test_namespaced_chains_start_from_sglang_namespace_seed(
    extra_key: str | None, cache_salt: str | None
) -> None:
    s = h.sg()
    if s.storage_namespace_seed is None:
        pytest.skip(f"SGLang {s.version_str} has no storage namespace seed (added in 0.5.20)")
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tokens = _tokens(48, seed=2)
    key = RadixKey(tokens, extra_key=extra_key, cache_salt=cache_salt)
    sglang_chain = s.get_storage_hash_str(key, None, page_size=16)
    seed = s.storage_namespace_seed(extra_key, cache_salt)
    assert seed is not None
    assert page_hashes(tokens, 16, prior_hash=seed) == sglang_chain
    # A namespace changes every key of the chain.
    assert set(sglang_chain).isdisjoint(page_hashes(tokens, 16))
