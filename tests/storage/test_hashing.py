"""Page hashes (SGLang's chain, byte for byte), storage namespaces and key validation."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from tiercache.errors import InvalidInputError
from tiercache.index import hash_page, page_hashes
from tiercache.memory import KVLayout
from tiercache.storage.keys import StorageNamespace, validate_key

KNOWN = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"


def reference_hash(tokens: list[int], prior: str | None = None) -> str:
    """SGLang's get_hash_str, one update per token."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(t.to_bytes(4, byteorder="little", signed=False))
    return h.hexdigest()


def test_known_vector() -> None:
    assert hash_page([1, 2, 3, 4]) == KNOWN
    assert reference_hash([1, 2, 3, 4]) == KNOWN


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
)
def test_input_types_hash_alike(convert: object) -> None:
    assert callable(convert)
    assert hash_page(convert([1, 2, 3, 4])) == KNOWN
    assert page_hashes(convert([1, 2, 3, 4, 5]), 2) == page_hashes([1, 2, 3, 4, 5], 2)


def test_chain_equals_the_per_token_reference_on_random_inputs() -> None:
    rng = random.Random(1234)
    for _ in range(30):
        page_size = rng.choice([1, 2, 3, 16, 64])
        n = rng.randrange(0, 5 * page_size + page_size)
        tokens = [rng.randrange(0, 2**32) for _ in range(n)]
        prior = rng.choice([None, reference_hash([rng.randrange(1000)])])
        expected: list[str] = []
        h = prior
        for start in range(0, n - page_size + 1, page_size):
            h = reference_hash(tokens[start : start + page_size], h)
            expected.append(h)
        assert page_hashes(tokens, page_size, prior) == expected
        assert page_hashes(np.array(tokens, dtype=np.uint32), page_size, prior) == expected
        for i, e in enumerate(expected):
            assert (
                hash_page(
                    tokens[i * page_size : (i + 1) * page_size], expected[i - 1] if i else prior
                )
                == e
            )


def test_extreme_token_values() -> None:
    tokens = [0, 2**32 - 1, 2**31, 255]
    assert hash_page(tokens) == reference_hash(tokens)
    assert hash_page(torch.tensor(tokens, dtype=torch.int64)) == reference_hash(tokens)


def test_partial_page_is_not_hashed() -> None:
    assert page_hashes([1, 2, 3], 4) == []
    assert page_hashes([1, 2, 3, 4, 5, 6, 7], 4) == [KNOWN]
    assert page_hashes([], 4) == []


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1],
        [2**32],
        [1.0, 2.0],
        ["a"],
        np.array([1.5]),
        np.array([-3], dtype=np.int64),
        np.array([[1, 2]]),
        torch.tensor([1.0]),
        torch.tensor([True]),
        torch.tensor([-1]),
        torch.tensor([2**32]),
        "1234",
        b"\x01\x02",
        None,
    ],
)
def test_bad_tokens_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        page_hashes(bad, 1)
    with pytest.raises(InvalidInputError):
        hash_page(bad)


def test_bad_page_size_prior_and_empty_page() -> None:
    for ps in (0, -1, 1.5, True):
        with pytest.raises(InvalidInputError):
            page_hashes([1, 2], ps)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        hash_page([1], "not hex")
    with pytest.raises(InvalidInputError):
        hash_page([])


LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=16)
MLA = KVLayout(
    num_layers=4, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, page_size=16, mla=True
)


def test_namespace_keys_are_namespaced_and_safe() -> None:
    ns = StorageNamespace.for_layout(LAYOUT, "page_first", model="llama-8b", tp_rank=1, tp_size=2)
    key = ns.key(KNOWN)
    assert key == f"{ns.digest}-{KNOWN}"
    assert len(ns.digest) == 16
    assert set(key) <= set("0123456789abcdef-")
    assert validate_key(key) == key
    assert ns.keys([KNOWN, KNOWN]) == [key, key]
    assert (
        StorageNamespace.for_layout(
            LAYOUT, "page_first", model="llama-8b", tp_rank=1, tp_size=2
        ).key(KNOWN)
        == key
    )


def test_namespace_separates_models_dtypes_layouts_and_ranks() -> None:
    base = dict(model="m", tp_rank=0, tp_size=2)
    digests = {
        StorageNamespace.for_layout(LAYOUT, "page_first", **base).digest,  # type: ignore[arg-type]
        StorageNamespace.for_layout(
            LAYOUT, "page_first", model="other", tp_rank=0, tp_size=2
        ).digest,
        StorageNamespace.for_layout(
            KVLayout(4, 2, 16, dtype=torch.bfloat16, page_size=16),
            "page_first",
            **base,  # type: ignore[arg-type]
        ).digest,
        StorageNamespace.for_layout(LAYOUT, "layer_first", **base).digest,  # type: ignore[arg-type]
        StorageNamespace.for_layout(KVLayout(4, 2, 16, page_size=32), "page_first", **base).digest,  # type: ignore[arg-type]
        StorageNamespace.for_layout(LAYOUT, "page_first", model="m", tp_rank=1, tp_size=2).digest,
        StorageNamespace.for_layout(LAYOUT, "page_first", model="m", tp_rank=0, tp_size=4).digest,
    }
    assert len(digests) == 7


def test_a_separator_in_a_field_cannot_pose_as_the_next_field() -> None:
    def ns(model: str, dtype: str, layout: str = "x") -> StorageNamespace:
        return StorageNamespace(model, dtype, layout, "page_first", 16)

    assert ns("m|dtype=a", "b").digest != ns("m", "a|dtype=b").digest
    assert ns("m", "a|layout=b", "c").digest != ns("m", "a", "b|layout=c").digest
    assert ns("m\\|dtype=a", "b").digest != ns("m\\", "a|dtype=b").digest
    # Ordinary values keep their identity (and the keys already stored under it).
    assert ns("llama-8b", "float16", "mha:L4").identity == (
        "tiercache/1|model=llama-8b|dtype=float16|layout=mha:L4|host=page_first|page=16|tp=0/1|mla=0"
    )
    with pytest.raises(InvalidInputError):
        StorageNamespace("m", 16, "x", "page_first", 16)  # type: ignore[arg-type]


def test_mla_drops_the_tp_rank() -> None:
    r0 = StorageNamespace.for_layout(MLA, "page_first", model="dsv3", tp_rank=0, tp_size=8)
    r5 = StorageNamespace.for_layout(MLA, "page_first", model="dsv3", tp_rank=5, tp_size=8)
    assert r0.mla and r0.key(KNOWN) == r5.key(KNOWN)
    assert "tp=*" in r0.identity


def test_namespace_rejects_bad_fields() -> None:
    with pytest.raises(InvalidInputError):
        StorageNamespace.for_layout(LAYOUT, "page_first", model="m", tp_rank=2, tp_size=2)
    with pytest.raises(InvalidInputError):
        StorageNamespace.for_layout(LAYOUT, "weird", model="m")
    with pytest.raises(InvalidInputError):
        StorageNamespace.for_layout(LAYOUT, "page_first", model="")
    ns = StorageNamespace.for_layout(LAYOUT, "page_first", model="m")
    for bad in ("", "ABC", "../x", "a-b", "g" * 10):
        with pytest.raises(InvalidInputError):
            ns.key(bad)


@pytest.mark.parametrize(
    "bad", ["", "../x", "a/b", "a\\b", ".hidden", "..", "a b", "x" * 201, "é", None, 5]
)
def test_validate_key_rejects_unsafe_keys(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        validate_key(bad)


def test_validate_key_accepts_safe_keys() -> None:
    for good in ("a", "A-b_c.d", "x" * 200, "0123456789abcdef-" + KNOWN):
        assert validate_key(good) == good
