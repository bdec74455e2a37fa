"""The copy engine: vectorised page moves between the device and host pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache.errors import InvalidInputError
from tiercache.memory.allocator import check_slot_indices
from tiercache.memory.pools import DeviceKVPool, HostKVPool

__all__ = ["CopyEngine", "TransferPlan"]

#: Per-copy-call overhead, expressed in bytes a copy moves in the same time.
#: A page run becomes one ``copy_`` call per buffer; scattered pages instead
#: take one ``index_select`` + ``index_copy_`` pair (two passes over the bytes).
#: Runs win while each run's copy is long compared with a call's overhead.
_RUN_BREAK_EVEN_BYTES = 32 * 1024

#: A load whose device side is at most this many contiguous runs gathers whole
#: host pages into them with one ``index_select(..., out=run)`` per run: one
#: pass over the bytes, in the widest integer type the rows allow.
_MAX_GATHER_RUNS = 8


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its (contiguous) last dim reinterpreted as the widest int type that divides it."""
    row = t.shape[-1] * t.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0 and t.element_size() <= size:
            return t.view(dtype)
    return t.view(torch.uint8)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """What one transfer moves, computed once and reused for every layer.

    ``runs`` is set when the pages form few enough contiguous
    ``(host_start, device_start, length)`` runs that plain slice copies beat
    gather/scatter; otherwise the index tensors are used.
    """

    host_indices: torch.Tensor  # CPU int64
    device_indices: torch.Tensor  # on the device pool's device
    runs: tuple[tuple[int, int, int], ...] | None
    num_tokens: int
    #: Contiguous runs on the device side alone, as ``(first page of the plan,
    #: device start slot, pages)``, and the host page ids in plan order; set
    #: when the device side is a few runs (what a fresh allocation gives): a
    #: load then gathers whole host pages straight into those runs.
    device_runs: tuple[tuple[int, int, int], ...] | None = None
    host_pages: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        return self.num_tokens == 0


class CopyEngine:
    """Moves pages between one device pool and one host pool.

    `backup_all_layers` copies every layer of the given device slots into host
    slots; `load_layer` copies one layer of host slots into device slots. Both
    are synchronous and run on a copy stream's worker thread; on CUDA they only
    enqueue work on the current (copy) stream. Pages are moved as contiguous
    runs with ``copy_`` where both sides are contiguous for long enough, else
    with one vectorised ``index_select``/``index_copy_`` per layer and buffer,
    never a Python loop per token.

    Raises:
        InvalidInputError: the pools have different layouts.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        if device_pool.layout != host_pool.layout:
            raise InvalidInputError(
                f"device and host pools differ: {device_pool.layout} vs {host_pool.layout}"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.layout = device_pool.layout
        self.device = device_pool.device
        self.non_blocking = self.device.type == "cuda" and host_pool.pinned

    def plan(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, checked: bool = False
    ) -> TransferPlan:
        """Validate a pairing of host and device slots and plan its copies.

        ``checked``: both were already validated with `check_slot_indices`
        against their pools (CPU int64): skip that pass.

        Raises:
            InvalidInputError: wrong dtype, shape, alignment, range, or lengths
                that differ.
        """
        ps = self.layout.page_size
        if checked:
            host, dev = host_indices, device_indices
        else:
            host = check_slot_indices(host_indices, ps, self.host_pool.num_slots, "host_indices")
            dev = check_slot_indices(
                device_indices, ps, self.device_pool.num_slots, "device_indices"
            )
        if host.numel() != dev.numel():
            raise InvalidInputError(
                f"host_indices has {host.numel()} slots but device_indices has {dev.numel()}"
            )
        n = host.numel()
        runs = self._runs(host, dev) if n else ()
        dev_on_device = dev.to(self.device, non_blocking=True) if self.device.type != "cpu" else dev
        device_runs, host_pages = None, None
        if (runs is None or len(runs) > 4) and self.device.type == "cpu":
            device_runs = self._device_runs(dev)
            if device_runs is not None:
                host_pages = host[::ps] // ps
        return TransferPlan(host, dev_on_device, runs, n, device_runs, host_pages)

    def _device_runs(self, dev: torch.Tensor) -> tuple[tuple[int, int, int], ...] | None:
        """Contiguous runs of the device side alone, or ``None`` when there are many."""
        ps = self.layout.page_size
        dp = dev[::ps]
        if dp.numel() == 1:
            breaks = torch.zeros(0, dtype=torch.int64)
        else:
            breaks = torch.nonzero((dp[1:] - dp[:-1]) != ps).flatten() + 1
        if breaks.numel() + 1 > _MAX_GATHER_RUNS:
            return None
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), dp.numel()]
        return tuple((a, int(dp[a]), e - a) for a, e in zip(starts, ends, strict=True))

    def _runs(
        self, host: torch.Tensor, dev: torch.Tensor
    ) -> tuple[tuple[int, int, int], ...] | None:
        ps = self.layout.page_size
        if host.numel() == ps:  # one page: one run
            return ((int(host[0]), int(dev[0]), ps),)
        hp, dp = host[::ps], dev[::ps]
        if hp.numel() == 1:
            breaks = torch.zeros(0, dtype=torch.int64)
        else:
            brk = ((hp[1:] - hp[:-1]) != ps) | ((dp[1:] - dp[:-1]) != ps)
            breaks = torch.nonzero(brk).flatten() + 1
        num_runs = breaks.numel() + 1
        # Bytes one run moves per layer and buffer, on average.
        per_run = host.numel() * self.layout.token_layer_bytes / num_runs
        if num_runs > 4 and per_run < _RUN_BREAK_EVEN_BYTES:
            return None
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
        ends = torch.cat([breaks, torch.tensor([hp.numel()])])
        hs = (hp[starts]).tolist()
        ds = (dp[starts]).tolist()
        lens = ((ends - starts) * ps).tolist()
        return tuple(zip(hs, ds, lens, strict=True))

    # -- device -> host -------------------------------------------------------

    def backup_all_layers(self, plan: TransferPlan) -> None:
        """Copy every layer of ``plan``'s device slots into its host slots."""
        if plan.empty:
            return
        host = self.host_pool
        stacked = self.device_pool.stacked
        nb = self.non_blocking
        for b in range(self.layout.num_buffers):
            if stacked is not None:
                src_all = stacked[b]  # (L, S, H, D)
                if plan.runs is not None:
                    for h0, d0, n in plan.runs:
                        src = src_all[:, d0 : d0 + n]
                        dst = host.tokens(b, h0, h0 + n)
                        if host.host_layout == "page_first":
                            src = src.transpose(0, 1)
                        dst.copy_(src, non_blocking=nb)
                else:
                    gathered = src_all.index_select(1, plan.device_indices)
                    if host.host_layout == "layer_first":
                        host.buffer[b].index_copy_(1, plan.host_indices, gathered.to("cpu"))
                    else:
                        host.buffer[b].index_copy_(
                            0, plan.host_indices, gathered.transpose(0, 1).to("cpu")
                        )
            else:
                for layer in range(self.layout.num_layers):
                    self._backup_layer(b, layer, plan)

    def _backup_layer(self, b: int, layer: int, plan: TransferPlan) -> None:
        src = self.device_pool.buffers[b][layer]
        dst = self.host_pool.layer(b, layer)
        if plan.runs is not None:
            for h0, d0, n in plan.runs:
                dst[h0 : h0 + n].copy_(src[d0 : d0 + n], non_blocking=self.non_blocking)
        else:
            dst.index_copy_(
                0, plan.host_indices, src.index_select(0, plan.device_indices).to("cpu")
            )

    # -- host -> device -------------------------------------------------------

    def load_layer(self, layer: int, plan: TransferPlan) -> None:
        """Copy layer ``layer`` of ``plan``'s host slots into its device slots."""
        if plan.empty:
            return
        nb = self.non_blocking
        for b in range(self.layout.num_buffers):
            src = self.host_pool.layer(b, layer)
            dst = self.device_pool.buffers[b][layer]
            if plan.device_runs is not None and plan.host_pages is not None:
                self._gather_pages(src, dst, plan.device_runs, plan.host_pages)
            elif plan.runs is not None:
                for h0, d0, n in plan.runs:
                    dst[d0 : d0 + n].copy_(src[h0 : h0 + n], non_blocking=nb)
            else:
                gathered = src.index_select(0, plan.host_indices)
                dst.index_copy_(0, plan.device_indices, gathered.to(self.device, non_blocking=nb))

    def _gather_pages(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        dst_runs: tuple[tuple[int, int, int], ...],
        src_pages: torch.Tensor,
    ) -> None:
        """Copy whole pages ``src_pages`` of ``src`` into contiguous runs of ``dst`` (CPU only)."""
        ps = self.layout.page_size
        # (pages, ps, H*D): each token's heads are contiguous in every layout.
        row = src.shape[1] * src.shape[2]
        pages = _int_view(src.view(-1, ps, row))
        for first, d0, n in dst_runs:
            out = _int_view(dst[d0 : d0 + n * ps].view(n, ps, row))
            torch.index_select(pages, 0, src_pages[first : first + n], out=out)

    def plan_bytes(self, plan: TransferPlan) -> int:
        """Bytes ``plan`` moves across all layers."""
        return plan.num_tokens * self.layout.token_bytes
