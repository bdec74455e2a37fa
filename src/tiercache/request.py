"""`Request`: one request's lease on the cache, from `TierCache.request`.

A request holds, from its start to its end, a `RequestLease`: a lock on
its matched prefix in the index and the device pages its `Request.alloc`
calls took (listed under the lease in the ledger). The lease gives all of
it back in one place, `RequestLease.release`, which `TierCache.request`
calls on every path out of the request.

Both reach the cache through a narrow port (`RequestPort`): the checks of
a public verb, device room, insert, and the release of what a lease holds.
Neither reads the facade's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from tiercache._checks import check_count, check_slot_tensor, token_list
from tiercache.controller import LoadHandle, Ready, TierController
from tiercache.errors import InvalidInputError, StateError
from tiercache.index.radix import Node
from tiercache.memory.allocator import cat_slots

__all__ = ["Request", "RequestLease", "RequestPort"]


class RequestPort(Protocol):
    """What a `Request` may ask of its cache."""

    @property
    def page_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def check(self) -> TierController:
        """The facade's check of a public verb (open, its loop, no failure pending)."""
        ...

    def check_on_loop(self) -> None:
        """Only that the caller runs on the cache's loop thread."""
        ...

    def settle_loads(self) -> None:
        """Settle the loads back whose copy has ended."""
        ...

    async def alloc(self, num_tokens: int, own: int, key: object) -> torch.Tensor:
        """Device slots listed under ``key`` (``own``: the slots it holds already)."""
        ...

    async def insert(
        self,
        toks: list[int],
        slots: torch.Tensor,
        extra_key: str | None,
        owner: torch.Tensor,
        ready: Any,
    ) -> int:
        """`TierCache.insert`, passing ``owner``'s slots (the request's own)."""
        ...

    def held_pages(self, key: object) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The device pages listed under ``key``."""
        ...

    def release(self, key: object, node: Node) -> None:
        """Unlock ``node`` and free the pages listed under ``key`` (no await)."""
        ...


class RequestLease:
    """What one request holds on the cache: its prefix's lock and its device pages.

    The pages its `Request.alloc` calls take are listed under the lease in
    the ledger; `release` gives both back, once.

    Args:
        port: the cache's side.
        node: the locked end of the request's prefix.
    """

    __slots__ = ("_node", "_port", "released")

    def __init__(self, port: RequestPort, node: Node) -> None:
        self._port = port
        self._node = node
        self.released = False

    def held_pages(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The device pages the request holds (from `Request.alloc`, not yet committed)."""
        return self._port.held_pages(self)

    def release(self) -> None:
        """Unlock the prefix and free the pages not committed (no await: cancel-safe; idempotent)."""
        if self.released:
            return
        self.released = True
        self._port.release(self, self._node)


class Request:
    """One request's view of the cache, from `TierCache.request`.

    Attributes:
        tokens: the prompt, as a list of ints.
        cached_tokens: leading tokens whose KV is on the device (or loading):
            whole pages, at most ``len(tokens) - 1`` (one token is always left
            to compute).
        prefix_indices: their device slots.
        load: the `LoadHandle` of the part this request loaded back from host, or ``None``.
        loads: every load the prefix waits on (its own, and loads started by
            concurrent requests for the same pages).
    """

    def __init__(
        self,
        port: RequestPort,
        lease: RequestLease,
        tokens: list[int],
        extra_key: str | None,
        prefix: torch.Tensor,
        loads: list[LoadHandle],
    ) -> None:
        self._port = port
        self._lease = lease
        self.tokens = tokens
        self.extra_key = extra_key
        self.prefix_indices = prefix
        self.cached_tokens = int(prefix.numel())
        self.loads = loads
        self.load = loads[0] if loads else None
        # The slots of the last page `alloc` took that it has not returned yet.
        self._spare = torch.empty(0, dtype=torch.int64)
        self._committed = False
        self._committing = False

    def layer_ready(self, layer: int) -> None:
        """Block a worker thread until ``layer`` of the prefix is on the device (no-op when it is).

        Raises:
            InvalidInputError: ``layer`` is not an int in ``[0, num_layers)``
                (whether or not a load is pending: one answer for one input).
            StateError: called on the event loop's own thread while a load
                is pending (it would deadlock).
            Exception: the load's error, if it failed.
        """
        n = self._port.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidInputError(f"layer must be an int in [0, {n}), got {layer!r}")
        for h in self.loads:
            h.wait_layer(layer)

    async def wait_loaded(self) -> None:
        """Wait until the whole prefix is on the device.

        Raises:
            Exception: the copy's error when a load of the prefix failed. The
                index no longer claims those pages on the device by then; the
                request cannot `commit`, and the next request loads them again.
            StateError: called from another thread or event loop than the
                cache's.
        """
        self._port.check_on_loop()
        for h in self.loads:
            try:
                await h
            except BaseException:
                self._port.settle_loads()
                raise

    async def alloc(self, num_tokens: int) -> torch.Tensor:
        """Device slots for the next ``num_tokens`` new tokens, page by page.

        The request takes whole pages: the slots the previous `alloc` left
        unused in its last page come first, then new pages (waiting for room
        held by other requests or copies, see `TierCache.alloc_device`). So
        successive calls (the prompt's tokens, then generated ones) return
        slots that continue each other, and ``prefix_indices`` followed by
        every `alloc`'s slots, in order, is what `commit` takes for the
        prompt and its generated tokens. Slots the request does not commit
        are freed when it ends.

        Raises:
            InvalidInputError: ``num_tokens`` is not a non-negative int.
            CapacityError: more than the pool can ever give, or no room
                within ``config.alloc_timeout_s``.
            StateError: the request has ended.
        """
        if self._lease.released:
            raise StateError("the request has ended")
        self._port.check()  # the loop's thread, open, no failure pending: spare slots too
        n = check_count(num_tokens)
        ps = self._port.page_size
        spare = self._spare[:n]
        more = n - int(spare.numel())
        if more <= 0:
            self._spare = self._spare[n:]
            return spare
        own = self._lease.held_pages().size * ps
        slots = await self._port.alloc(-(-more // ps) * ps, own, self._lease)
        self._spare = slots[more:]
        return cat_slots([spare, slots[:more]])

    async def commit(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        *,
        ready: Ready = None,
    ) -> int:
        """Insert the KV of ``tokens`` (the prompt, plus generated tokens if any) held in ``device_indices``.

        ``tokens`` must start with the request's own tokens; ``device_indices``
        is one slot per token: the prefix's slots (`prefix_indices`) followed
        by the slots of the request's `alloc` calls, in order (one for the
        prompt, more for generated tokens: they continue each other). Whole pages are inserted; the slots of a
        trailing partial page go back when the request ends. Waits for the
        prefix's load first.

        ``ready`` (CUDA): the producer of the new KV (the forward pass's
        stream or an event after it); by default the caller's current stream,
        recorded when ``commit`` is called, before it awaits anything.

        Every argument is checked before anything changes: a refused commit
        leaves the request uncommitted, and a correct one may follow.

        Returns:
            How many tokens were already cached.

        Raises:
            InvalidInputError: tokens that do not extend the request's,
                ``device_indices`` not a 1-D int64 tensor of one slot per
                token, not starting with `prefix_indices`, or new slots that
                did not come from this request's `alloc`.
            StateError: committed already, the request has ended, or the
                prefix's load back failed (its KV is not on the device).
        """
        if self._lease.released:
            raise StateError("the request has ended")
        port = self._port
        ready_ev = port.check().ready_event(ready, "commit")
        if self._committed or self._committing:
            raise StateError("a request commits once")
        ctl = port.check()
        toks = token_list(tokens)
        if toks[: len(self.tokens)] != self.tokens:
            raise InvalidInputError(
                "commit tokens must be the request's tokens, optionally followed by generated ones"
            )
        slots = check_slot_tensor(device_indices, "device_indices", ctl.device_pool.num_slots)
        if slots.numel() != len(toks):
            raise InvalidInputError(
                f"device_indices has {slots.numel()} slots for {len(toks)} tokens: one per token"
            )
        prefix = slots[: self.cached_tokens].numpy()  # numpy on the loop: see `copy_slots`
        if not np.array_equal(prefix, self.prefix_indices.cpu().numpy()):
            raise InvalidInputError("device_indices must start with the request's prefix_indices")
        ps = port.page_size
        n = len(toks) // ps * ps
        new = slots[self.cached_tokens : n]
        if (
            new.numel()
            and not np.isin(ctl.ledger.device.pages(new), self._lease.held_pages()).all()
        ):
            raise InvalidInputError("new tokens' slots must come from this request's alloc")
        self._committing = True
        try:
            try:
                await self.wait_loaded()
            except Exception as e:
                raise StateError(
                    f"the load back of this request's prefix failed ({e!r}): nothing committed"
                ) from e
            # The prefix is already in the index: insert() frees nothing of it
            # (the same slots), and takes the new pages' slots, which stop
            # being the request's (handed over, or freed as duplicates).
            dup = await port.insert(toks[:n], slots[:n], self.extra_key, new, ready_ev)
        finally:
            self._committing = False
        self._committed = True
        return dup
