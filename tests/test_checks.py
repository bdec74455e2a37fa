"""The shared argument checks agree with the hash chain: one answer for one input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tiercache._checks import check_choice, check_count, check_slot_tensor, token_list
from tiercache.errors import InvalidInputError
from tiercache.index.hashing import pack_tokens

IDS = [0, 1, 2**31, 2**32 - 1]

INPUTS: list[Any] = [
    IDS,
    tuple(IDS),
    np.array(IDS, dtype=np.int64),
    np.array(IDS, dtype=np.uint32),
    torch.tensor(IDS, dtype=torch.int64),
    torch.tensor([0, 1, 2], dtype=torch.int32),
    torch.tensor([0, 1, 2], dtype=torch.uint8),
    torch.tensor([0, 1, 2]).to(torch.uint32),
    [np.int64(3), np.int32(4)],
    [],
    # refused
    [True, False],
    (False,),
    [5, 0, True],
    [np.True_],
    [-1],
    [2**32],
    torch.tensor([-1]),
    torch.tensor([2**32]),
    np.array([-1]),
    [1.0],
    [1.5],
    ["1"],
    [None],
    torch.zeros(3),
    torch.zeros(3, dtype=torch.bool),
    torch.zeros(2, 2, dtype=torch.int64),
    np.zeros((2, 2), dtype=np.int64),
    np.zeros(3),
    "abc",
    b"abc",
    {1, 2},
    None,
    7,
]


@pytest.mark.parametrize("value", INPUTS, ids=lambda v: repr(v)[:40])
def test_token_list_and_the_hash_chain_give_one_answer(value: Any) -> None:
    try:
        ids = token_list(value)
    except InvalidInputError:
        with pytest.raises(InvalidInputError):
            pack_tokens(value)
        return
    if isinstance(value, list | tuple):
        # A sequence's own id objects are kept (no new int per id of a long prompt).
        assert all(a is b for a, b in zip(ids, value, strict=True))
    else:
        assert all(type(t) is int for t in ids)
    assert pack_tokens(value) == np.array(ids, dtype="<u4").tobytes()


@pytest.mark.parametrize(
    "tokens",
    [[True], (False, 1), [0, 1, 2, True], [1] * 300 + [False], [np.bool_(True)]],
    ids=lambda v: repr(v)[:30],
)
def test_a_bool_is_not_a_token_id(tokens: list[Any]) -> None:
    """``True == 1`` in Python, but a bool among token ids is a caller's bug, as a bool tensor is."""
    from tiercache.index.hashing import hash_page, page_hashes

    for check in (token_list, pack_tokens, hash_page, lambda t: page_hashes(t, 1)):
        with pytest.raises(InvalidInputError, match="bool"):
            check(tokens)


def test_ints_equal_to_bools_stay_token_ids() -> None:
    assert token_list([0, 1, 1, 0]) == [0, 1, 1, 0]
    assert token_list((np.int64(1), np.uint8(0))) == [1, 0]


def test_counts_names_and_slot_tensors() -> None:
    assert check_count(0) == 0 and check_count(np.int64(32), multiple_of=16) == 32
    for bad in (-1, 1.0, "1", None, True, 17):
        with pytest.raises(InvalidInputError):
            check_count(bad, multiple_of=16)
    assert check_choice("a", ("a", "b"), "policy") == "a"
    for name in ("c", None, 1):
        with pytest.raises(InvalidInputError):
            check_choice(name, ("a", "b"), "policy")
    assert torch.equal(check_slot_tensor(torch.arange(4), "s", 8), torch.arange(4))
    for bad in ([0, 1], torch.arange(4).int(), torch.arange(4).view(2, 2), torch.tensor([8])):
        with pytest.raises(InvalidInputError):
            check_slot_tensor(bad, "s", 8)


def test_is_int_takes_ints_and_numpy_integers_only() -> None:
    from tiercache._checks import is_int

    assert is_int(3) and is_int(np.int64(3)) and is_int(np.uint8(1))
    assert not is_int(True) and not is_int(np.bool_(True))
    assert not is_int(3.0) and not is_int("3") and not is_int(None)


def test_check_int_and_check_bool_refuse_lookalikes() -> None:
    from tiercache._checks import check_bool, check_int
    from tiercache.errors import ConfigError

    assert check_int(np.int32(4), "n", minimum=0) == 4
    for bad in (True, 1.0, "1", None):
        with pytest.raises(InvalidInputError, match="n must be an int"):
            check_int(bad, "n")
    with pytest.raises(ConfigError, match=">= 1"):
        check_int(0, "n", minimum=1, error=ConfigError)
    assert check_bool(np.bool_(False), "b") is False
    for bad in (1, 0, "true", None):
        with pytest.raises(InvalidInputError, match="b must be a bool"):
            check_bool(bad, "b")


def test_check_positive_takes_ints_of_at_least_one() -> None:
    from tiercache._checks import check_positive
    from tiercache.errors import ConfigError

    assert check_positive(1, "n") == 1 and type(check_positive(np.int64(7), "n")) is int
    for bad in (0, -3, True, 2.0, "2", None):
        with pytest.raises(InvalidInputError, match="n must be a positive int"):
            check_positive(bad, "n")
    with pytest.raises(ConfigError, match="size must be a positive int"):
        check_positive(0, "size", error=ConfigError)


def test_check_number_takes_finite_reals_only() -> None:
    from tiercache._checks import check_number
    from tiercache.errors import ConfigError

    assert check_number(0, "t") == 0.0 and check_number(np.float32(0.5), "t") == 0.5
    assert check_number(2, "t", positive=True) == 2.0
    for bad in (-1, float("nan"), float("inf"), -float("inf"), True, "1", None):
        with pytest.raises(InvalidInputError, match="t must be a finite non-negative number"):
            check_number(bad, "t")
    with pytest.raises(ConfigError, match="t must be a finite positive number"):
        check_number(0.0, "t", positive=True, error=ConfigError)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (np.bool_(True), True),
        (1, True),
        (0, False),
        ("1", True),
        ("0", False),
        ("true", True),
        (" TRUE ", True),
        ("False", False),
        ("yes", True),
        ("no", False),
        ("on", True),
        ("Off", False),
    ],
)
def test_parse_bool_reads_one_set_of_words(value: object, expected: bool) -> None:
    from tiercache._checks import parse_bool

    assert parse_bool(value, "flag") is expected


@pytest.mark.parametrize("value", ["maybe", "", "2", "y", "t", 2, -1, 1.0, None, [True]])
def test_parse_bool_refuses_the_rest_naming_the_option(value: object) -> None:
    from tiercache._checks import parse_bool
    from tiercache.errors import ConfigError

    with pytest.raises(ConfigError, match="TIERCACHE_MLA must be a bool"):
        parse_bool(value, "TIERCACHE_MLA")


def test_every_on_off_option_reads_the_same_words() -> None:
    """A URL option, a keyword option and a TIERCACHE_ variable agree on each word."""
    from tiercache._checks import FALSE_WORDS, TRUE_WORDS
    from tiercache.config import TierCacheConfig
    from tiercache.errors import ConfigError
    from tiercache.storage.registry import option_bool

    for word in sorted(TRUE_WORDS | FALSE_WORDS):
        for spelled in (word, word.upper(), f" {word} "):
            expected = word in TRUE_WORDS
            assert option_bool("fsync", spelled) is expected
            env = {"TIERCACHE_MLA": spelled, "TIERCACHE_NUM_KV_HEADS": "1"}
            assert TierCacheConfig.from_env(env).mla is expected
    with pytest.raises(ConfigError, match="option fsync"):
        option_bool("fsync", "maybe")
    with pytest.raises(ConfigError, match="TIERCACHE_MLA"):
        TierCacheConfig.from_env({"TIERCACHE_MLA": "maybe"})


def test_token_array_packs_without_a_python_list() -> None:
    from array import array

    from tiercache._checks import token_array

    assert isinstance(token_array([1, 2]), array)
    arr = np.array([3, 4], dtype=np.uint32)
    assert token_array(arr) is arr  # checked in place, not copied
    assert token_array(torch.tensor([5, 6])).tolist() == [5, 6]
    assert token_array(range(3)).tolist() == [0, 1, 2]
