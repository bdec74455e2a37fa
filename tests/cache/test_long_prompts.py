"""A long prompt's O(tokens) work stays off the loop or in C: hashing its pages
runs in a worker thread, and its ids are checked once per call, never in a
Python pass per index call."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import tiercache.insertion as insertion_module
from tiercache import TierCache, TierCacheConfig
from tiercache.errors import InvalidInputError
from tiercache.index import page_hashes
from tiercache.index.hashing import INLINE_HASH_PAGES
from tiercache.index.radix import RadixIndex, extra_key_prior

PS = 4
LONG = (INLINE_HASH_PAGES + 3) * PS


def config() -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=4 * LONG,
        host_tokens=4 * LONG,
        model="long-prompts",
    )


@pytest.mark.parametrize("extra_key", [None, "tenant-a"])
async def test_a_long_prompt_is_hashed_off_the_loop_into_the_same_chain(
    monkeypatch: pytest.MonkeyPatch, extra_key: str | None
) -> None:
    """The pages of an insert past `INLINE_HASH_PAGES` are hashed in a worker
    thread, and the index holds exactly the chain it would have hashed itself."""
    threads: list[int] = []

    def recording(*args: Any) -> list[str]:
        threads.append(threading.get_ident())
        return page_hashes(*args)

    monkeypatch.setattr(insertion_module, "page_hashes", recording)
    async with TierCache(config()) as c:
        short = list(range(1000, 1000 + 2 * PS))
        await c.insert(short, await c.alloc_device(len(short)), extra_key)
        assert threads == []  # a few pages: the index hashes them inline
        prompt = [*short, *range(5000, 5000 + LONG - len(short))]
        await c.insert(prompt, await c.alloc_device(LONG), extra_key)
        assert threads and threading.get_ident() not in threads
        c.index.check_invariants()  # recomputes every node's chain
        m = c.match_prefix([*prompt, 1], extra_key)
        assert m.device_tokens == LONG
        node = m.index.last_device_node
        chain = [h for n in c.index.path(node) for h in n.page_hashes]
        assert chain == page_hashes(prompt, PS, extra_key_prior(extra_key))
        # One page more on the long cached prompt: the index hashes that page itself.
        hashed = len(threads)
        more = [*prompt, 7, 7, 7, 7]
        await c.insert(more, torch.cat([m.device_indices, await c.alloc_device(PS)]), extra_key)
        assert len(threads) == hashed
        c.index.check_invariants()


def test_an_insert_with_a_chain_of_the_wrong_length_changes_nothing() -> None:
    index = RadixIndex(PS)
    tokens = list(range(3 * PS))
    chain = page_hashes(tokens, PS, None)
    with pytest.raises(InvalidInputError, match="page_hashes"):
        index.insert(tokens, torch.arange(3 * PS), chain=chain[:2])
    assert index.match_prefix(tokens).matched_length == 0
    index.insert(tokens, torch.arange(3 * PS), chain=chain)
    index.check_invariants()


@pytest.mark.parametrize(
    "tokens",
    [list(range(7, 7 + 3 * PS)), tuple(range(7, 7 + 3 * PS)), [np.int64(t) for t in range(3 * PS)]],
    ids=["list", "tuple", "numpy ints"],
)
def test_the_index_takes_a_sequence_as_its_ids_and_still_refuses_bad_ones(tokens: Any) -> None:
    index = RadixIndex(PS)
    index.insert(tokens, torch.arange(3 * PS))
    assert index.match_prefix([int(t) for t in tokens]).matched_length == 3 * PS
    for bad in ([*tokens[:-1], -1], [*tokens[:-1], True], [*tokens[:-1], 1.0]):
        with pytest.raises(InvalidInputError):
            index.insert(bad, torch.arange(3 * PS, 6 * PS))
        with pytest.raises(InvalidInputError):
            index.match_prefix(bad)
    index.check_invariants()
