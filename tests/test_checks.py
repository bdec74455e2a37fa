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
    [True, False],
    [],
    # refused
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
    assert all(type(t) is int for t in ids)
    assert pack_tokens(value) == np.array(ids, dtype="<u4").tobytes()


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
