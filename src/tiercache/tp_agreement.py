"""Agreements between the tensor-parallel ranks of one cache: gloo groups of their own.

Every TP rank must reach the same decision about a storage prefetch (how many
pages to fetch, how many tokens it completed, whether the backend is
detached), or ranks compute different prefill lengths. The ranks agree with
all-reduces (MIN) over **gloo groups that tiercache creates for itself** over
the ranks of the group the caller passes, one per sequence of decisions, each
used by one thread of its own:

* the model's collectives never interleave with these, whatever group the
  caller passed (even the model's own NCCL communicator): no two threads ever
  issue collectives on one group;
* nothing runs on a CUDA stream: the tensors are CPU tensors, so no compute
  stream (the legacy default stream included) ever waits on an agreement.

The groups are made (``new_group(..., use_local_synchronization=True)``: only
the member ranks take part) by the agreement's first round, on its thread, so
the event loop never waits for the other ranks to arrive.

Each round carries a tag that names its decision (the sequence number of the
prefetch call it is about, and what is decided). Ranks that call the verbs in
different orders would pair rounds about different decisions: every rank sees
the mismatch in the reduced tags and takes 0 (a miss) for that round, the
same on every rank, instead of a wrong agreement.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tiercache.errors import ConfigError

__all__ = ["Agreements", "Round", "tp_ranks"]

logger = logging.getLogger(__name__)


def tp_ranks(tp_group: Any) -> list[int]:
    """The global ranks of ``tp_group``, checking that it is a process group.

    Any backend is accepted: the agreements run over gloo groups of their own
    over these ranks.

    Raises:
        ConfigError: ``tp_group`` is not a usable ``torch.distributed`` process group.
    """
    import torch.distributed as dist

    try:
        dist.get_backend(tp_group)
        ranks = list(dist.get_process_group_ranks(tp_group))
    except (RuntimeError, ValueError, TypeError, AttributeError, KeyError) as e:
        raise ConfigError(f"tp_group is not a usable torch.distributed process group: {e}") from e
    if not ranks:
        raise ConfigError("tp_group has no ranks")
    return ranks


class Round:
    """What one agreement round decides: a tag that names it and the values, all by MIN.

    ``tag``: the same number on every rank for the same decision (a
    non-negative integer). ``values``: the rank's proposals; the answer holds
    their minimum over the ranks, or 0 for each when the ranks' tags differ.
    """

    __slots__ = ("tag", "values")

    def __init__(self, tag: int, values: Sequence[int]) -> None:
        self.tag = tag
        self.values = list(values)


class _Groups:
    """The two gloo groups of one set of agreements (hit counts, completions), made once."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[Any] | None = None


#: Group pairs that no live `Agreements` uses, per tuple of TP ranks. A pair
#: is reused by the next `Agreements` over the same ranks (a storage backend
#: attached again): ``new_group`` is not called again, and a destroyed
#: group's name is never reused while another rank may still hold it.
_free: dict[tuple[int, ...], list[_Groups]] = {}
_free_lock = threading.Lock()


class Agreements:
    """Two sequences of MIN agreements, each over a gloo group of its own, on a thread of its own.

    Sequence ``0`` (`HITS`) and sequence ``1`` (`ENDS`) never wait for each
    other. Within a sequence, rounds run in the order `agree` is called. The
    groups are made by the first round (on the thread), or taken over from
    an earlier `Agreements` over the same ranks that was closed: every rank
    must make and close its `Agreements` in the same order.

    Used from one event loop; `agree` returns a future of the thread pool.

    Args:
        ranks: the global ranks of the TP group (`tp_ranks`).
        timeout_s: how long a round waits for the other ranks before it
            fails (every later round then fails at once: a rank that left
            the sequence cannot be re-paired).
    """

    HITS = 0
    ENDS = 1

    def __init__(self, ranks: list[int], *, timeout_s: float) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self._key = tuple(ranks)
        with _free_lock:
            free = _free.get(self._key)
            self._groups = free.pop() if free else _Groups()
        self._broken: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._running = 0  # rounds inside an all-reduce now
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tiercache-agree-{n}")
            for n in ("hits", "ends")
        ]
        self._made = self._threads[self.HITS].submit(self._make)

    def _make(self) -> None:
        import torch.distributed as dist

        if self._groups.groups is not None:
            return
        try:
            self._groups.groups = [
                dist.new_group(
                    self.ranks,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    use_local_synchronization=True,
                )
                for _ in range(2)
            ]
        except BaseException as e:
            self._broken = e
            logger.error("the TP agreement groups could not be made: %r", e)
            raise

    def agree(self, sequence: int, round_: Round) -> concurrent.futures.Future[list[int]]:
        """Queue ``round_`` on ``sequence``; the future resolves to the agreed values (see `Round`).

        Raises (through the future):
            RuntimeError: the groups could not be made, or an earlier round failed.
            Exception: the all-reduce failed (the other ranks did not answer in
                time): every later round fails too.
        """
        return self._threads[sequence].submit(self._reduce, sequence, round_)

    def _reduce(self, sequence: int, round_: Round) -> list[int]:
        import torch.distributed as dist

        self._made.result()
        if self._broken is not None:
            raise RuntimeError(f"the TP agreements are broken: {self._broken!r}")
        groups = self._groups.groups
        assert groups is not None
        t = torch.tensor([round_.tag, -round_.tag, *round_.values], dtype=torch.int64)
        with self._lock:
            if self._closed:
                raise RuntimeError("the TP agreements are closed")
            self._running += 1
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups[sequence])
        except BaseException as e:
            self._broken = e
            raise
        finally:
            with self._lock:
                self._running -= 1
        low, high = int(t[0]), -int(t[1])
        if low != high:
            logger.warning(
                "TP ranks paired agreements %d and %d: they call the prefetch verbs in "
                "different orders; taking 0 on every rank",
                low,
                high,
            )
            return [0] * len(round_.values)
        return [int(v) for v in t[2:].tolist()]

    def close(self) -> None:
        """Stop the threads; keep the groups for the next `Agreements` over these ranks.

        Rounds still queued are cancelled (every rank closes after the same
        rounds when they stop together). A round inside an all-reduce now
        (another rank never joined it) is not waited for: the call returns,
        the round ends when the group's timeout expires, and its groups are
        dropped, never handed to the next user. Blocking only for the
        threads to finish a round they already left; idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = self._running > 0
        for thread in self._threads:
            thread.shutdown(wait=not stuck, cancel_futures=True)
        if not stuck and self._broken is None and self._groups.groups is not None:
            with _free_lock:
                _free.setdefault(self._key, []).append(self._groups)
