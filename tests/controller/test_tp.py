"""Two CPU ranks over gloo agree on the MIN prefetch hit count, whatever one rank's storage does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.tp_ranks import run_ranks

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.errors import ConfigError, InvalidInputError

WORKER = Path(__file__).with_name("tp_worker.py")


async def _run_ranks(tmp_path: Path, ranks: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """Run one worker per ``(stored_pages, mode)``; fail (not hang) if they deadlock."""
    return await run_ranks(WORKER, tmp_path, [[str(stored), mode] for stored, mode in ranks])


async def test_two_ranks_with_different_hits_agree_on_the_min(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(6, "normal"), (3, "normal")])
    # Rank 0 holds 6 pages, rank 1 holds 3: both load exactly 3 pages (48 tokens).
    for r in results:
        assert r["first"] == 48, r
        assert r["agreed"] == [[48, 48]] * 3, r


async def test_a_rank_whose_storage_is_down_still_joins_the_agreement(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(6, "normal"), (6, "down")])
    healthy, down = results
    assert healthy["first"] == down["first"] == 96, results
    # Then rank 1's backend fails: its next query fails (a miss: 0 pages), which
    # marks it down; it skips the next prefetches but still contributes 0.
    assert down["started"] == [True, False, False], down
    assert healthy["started"] == [True, True, True], healthy
    assert healthy["agreed"] == [[0, 0]] * 3, healthy
    assert down["agreed"] == [[0, 0]] * 3, down


async def test_a_rate_limited_rank_still_joins_the_agreement(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(6, "limited"), (4, "normal")])
    limited, normal = results
    # The held prefetch agreed on MIN(6, 4) = 4 pages on both ranks ...
    assert limited["first"] == normal["first"] == 64, results
    # ... then every further prefetch is rate limited on rank 0: the agreed MIN is 0.
    assert limited["started"] == [False, False, False], limited
    assert normal["started"] == [True, True, True], normal
    assert normal["agreed"] == [[0, 0]] * 3, normal


async def test_a_rank_that_abstains_still_joins_the_agreement(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(6, "normal"), (6, "abstain")])
    normal, abstained = results
    assert abstained["started"] == [False, False, False], abstained
    assert normal["agreed"] == [[0, 0]] * 3, normal


async def test_a_rank_that_holds_the_prefix_lets_the_others_fetch_up_to_it(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(8, "normal"), (8, "holding")])
    normal, holding = results
    assert holding["started"] == [False, False, False], holding
    # The ranks agree where the prefix ends (8 pages), not on a hit count.
    assert normal["agreed"] == [[128, 128]] * 3, normal


async def test_ranks_from_different_starts_fetch_up_to_the_same_end(tmp_path: Path) -> None:
    results = await _run_ranks(tmp_path, [(8, "normal"), (8, "half")])
    normal, half = results
    assert normal["agreed"] == [[128, 128]] * 3, normal
    assert half["agreed"] == [[64, 64]] * 3, half  # 64 held + 64 fetched: the same end


async def test_ranks_from_different_starts_agree_the_end_when_one_holds_less(
    tmp_path: Path,
) -> None:
    results = await _run_ranks(tmp_path, [(6, "normal"), (6, "half")])
    normal, half = results
    # Six pages stored: the prefix ends at page 6 on every rank.
    assert normal["agreed"] == [[96, 96]] * 3, normal
    assert half["agreed"] == [[32, 32]] * 3, half


async def test_cached_tokens_that_are_not_whole_pages_are_refused() -> None:
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    async with TierController(DeviceKVPool(lay, 64), HostKVPool(lay, 64)) as ctl:
        await ctl.attach_storage_backend("memory://")
        host = ctl.host_allocator.alloc(16)
        assert host is not None
        for bad in (-16, 8, 1.5, True, "16"):
            with pytest.raises(InvalidInputError, match="cached_tokens"):
                ctl.abstain_prefetch(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError, match="cached_tokens"):
                ctl.prefetch("r", host, list(range(16)), cached_tokens=bad)  # type: ignore[arg-type]
        assert ctl.host_allocator.available == 64 - 16  # nothing taken by a refusal


def test_a_group_of_any_backend_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreements run over gloo groups of their own: an NCCL group (the model's
    own) is accepted with a CPU pool too."""
    import torch.distributed as dist

    lay = KVLayout(2, 2, 8, torch.float16, 16)
    dev, host = DeviceKVPool(lay, 64), HostKVPool(lay, 64)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    TierController(dev, host, tp_rank=0, tp_size=2, tp_group=object())
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [])
    with pytest.raises(ConfigError, match="no ranks"):
        TierController(dev, host, tp_rank=0, tp_size=2, tp_group=object())


def test_a_tp_group_that_is_not_a_process_group_is_refused() -> None:
    lay = KVLayout(2, 2, 8, torch.float16, 16)
    with pytest.raises(ConfigError, match="process group"):
        TierController(
            DeviceKVPool(lay, 64), HostKVPool(lay, 64), tp_rank=0, tp_size=2, tp_group="group"
        )
