"""The values the facade hands out: its state, its counters, a match.

`CacheState` is the facade's lifecycle; `CacheStats` what it did (merged
with the controller's and the storage tier's counters by `merged_stats`);
`CacheMatch` what `TierCache.match_prefix` found, with the checks a verb
that takes one back makes on it (`check_match`, `check_match_of`,
`check_device_match`). All are re-exported from `tiercache.cache`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tiercache._checks import check_instance
from tiercache.errors import InvalidInputError, StateError
from tiercache.index.radix import MatchResult, RadixIndex

if TYPE_CHECKING:
    from tiercache.controller import TierController

__all__ = [
    "CacheMatch",
    "CacheState",
    "CacheStats",
    "check_device_match",
    "count_request",
    "check_match",
    "check_match_of",
    "merged_stats",
]


class CacheState(enum.Enum):
    """Where a `TierCache` is in its life: created, open, or closed (for good)."""

    CREATED = "created"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class CacheStats:
    """What the cache did. Token counts are per matched request.

    Every count only grows: the storage ones add up every backend attached so
    far (a detached backend keeps its counts here).
    """

    requests: int = 0
    tokens_requested: int = 0
    tokens_device_hit: int = 0
    tokens_host_hit: int = 0
    tokens_storage_hit: int = 0
    tokens_inserted: int = 0
    device_evictions: int = 0
    device_evicted_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0
    write_backs: int = 0
    #: Device->host writes the write policy left out for want of host room
    #: (the node stays device-only): refused by the controller, or given up
    #: on because nothing in flight would free the room.
    host_writes_skipped: int = 0
    loads_back: int = 0
    prefetches: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_storage_read: int = 0
    bytes_storage_written: int = 0
    prefetch_revoked: int = 0
    prefetch_terminated: int = 0
    prefetch_completed: int = 0
    prefetch_failed: int = 0
    storage_backups: int = 0
    storage_errors: int = 0
    storage_outages: int = 0
    storage_reconnects: int = 0
    storage_auto_detaches: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        hit = self.tokens_device_hit + self.tokens_host_hit + self.tokens_storage_hit
        return hit / self.tokens_requested if self.tokens_requested else 0.0

    def hit_rates(self) -> dict[str, float]:
        n = self.tokens_requested or 1
        return {
            "device": self.tokens_device_hit / n,
            "host": self.tokens_host_hit / n,
            "storage": self.tokens_storage_hit / n,
            "total": self.hit_rate,
        }


def count_request(
    stats: CacheStats, tokens: int, device_then: int, prefix: int, stored: int
) -> None:
    """Count in ``stats`` a request of ``tokens`` whose cached prefix is ``prefix`` tokens long.

    The prefix is what was on the device when it matched (``device_then``),
    what its own prefetch stored, and the rest from host (there then, or
    put there meanwhile by a concurrent request's prefetch or commit).
    """
    stats.requests += 1
    stats.tokens_requested += tokens
    device_hit = min(device_then, prefix)
    stats.tokens_device_hit += device_hit
    stats.tokens_host_hit += max(0, prefix - device_hit - stored)


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """What `TierCache.match_prefix` found for a prompt.

    Attributes:
        device_indices: device slots of the device-resident prefix whose bytes have landed.
        device_tokens: its length.
        host_tokens: tokens after it that are on the host only, or whose load
            back is still in flight (`load_back` them: it returns the slots
            with the handle of the load that fills them).
        storage_candidate_tokens: whole-page tokens after the device and host
            parts that a storage prefetch may still find.
        index: the index's raw result (nodes to lock, the prior hash).
    """

    device_indices: torch.Tensor
    device_tokens: int
    host_tokens: int
    storage_candidate_tokens: int
    index: MatchResult
    extra_key: str | None


def merged_stats(own: CacheStats, ctl: TierController | None, index: RadixIndex) -> CacheStats:
    """A snapshot of ``own`` counters with the controller's and the storage tier's."""
    s = CacheStats(**{k: getattr(own, k) for k in CacheStats.__slots__ if k != "extra"})
    if ctl is None:
        return s
    s.bytes_device_to_host = ctl.stats.bytes_device_to_host
    s.bytes_host_to_device = ctl.stats.bytes_host_to_device
    st = ctl.storage_stats()  # every backend attached so far: never goes down
    s.bytes_storage_read = st.bytes_read
    s.bytes_storage_written = st.bytes_written
    s.prefetch_revoked = st.prefetch_revoked
    s.prefetch_terminated = st.prefetch_terminated
    s.prefetch_completed = st.prefetch_completed
    s.prefetch_failed = st.prefetch_failed
    s.storage_errors = st.storage_errors + st.storage_timeouts
    s.storage_outages = st.outages
    s.storage_reconnects = st.reconnects
    s.storage_auto_detaches = ctl.stats.storage_auto_detaches
    s.extra = {
        "device_tokens_cached": float(index.total_device_tokens()),
        "host_tokens_cached": float(index.total_host_tokens()),
        "device_free": float(ctl.device_allocator.available),
        "host_free": float(ctl.host_allocator.available),
        "storage_attached": float(ctl.storage is not None),
        "storage_down": float(ctl.storage is not None and ctl.storage.down),
    }
    return s


def check_match(index: RadixIndex, match: CacheMatch) -> None:
    """Check that ``match`` is a `CacheMatch` of ``index``'s cache.

    Raises:
        InvalidInputError: not a `CacheMatch`.
        StateError: a match of another cache (its nodes and slots are
            that cache's).
    """
    check_instance(match, CacheMatch, "match")
    if not index.owns(match.index.last_node):
        raise StateError("match comes from another TierCache: match on this one")


def check_match_of(index: RadixIndex, match: CacheMatch, toks: list[int]) -> None:
    """Check that ``match`` was taken on ``toks`` (or on a prompt they start with).

    Raises:
        InvalidInputError: its matched prefix is not that of ``toks``, or
            its storage part reaches past their end.
        StateError: its nodes are no longer in the index (match again).
    """
    m = match.index
    prefix = index.prefix_tokens(m.last_node)
    if (
        len(prefix) != m.matched_length
        or tuple(toks[: m.matched_length]) != prefix
        or m.matched_length + match.storage_candidate_tokens > len(toks)
    ):
        raise InvalidInputError("match is not a match of these tokens: match them again")


def check_device_match(index: RadixIndex, match: CacheMatch) -> None:
    """Check that ``index`` still holds ``match``'s device prefix in the same slots.

    Its slots are only the prefix's while the index still holds them
    there: a match from before an eviction or a flush names slots that
    may be free or another prefix's by now.

    Raises:
        StateError: it does not.
    """
    node = match.index.last_device_node
    try:
        now = index.match_prefix(
            index.prefix_tokens(node), match.extra_key, touch=False, checked=True
        ).device_indices
    except StateError as e:
        raise StateError("the index changed since this match: match again") from e
    if not torch.equal(now, match.device_indices):
        raise StateError("the index changed since this match: match again")
