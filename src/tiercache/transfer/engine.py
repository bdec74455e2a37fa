"""The copy engine: vectorised page moves between the device and host pools.

**Bounded temporaries.** No copy builds a temporary as large as the
transfer. A gather (``index_select``) and the contiguous copy that torch makes
of a strided source before a host<->device DMA are made in chunks of at most
`MAX_TEMP_BYTES` (64 MiB): backing up 128k tokens of a 32-layer model costs
64 MiB of extra device memory, not gigabytes. With a ``layer_first`` host
pool a backup to the host goes layer by layer, where both sides are
contiguous and no temporary is needed at all.

**Runs on a CPU device pool** are copied as the widest integer rows they
allow, K and V together where the pool is `DeviceKVPool.joint` (what a CPU
pool allocates): one copy moves a slice of tokens of both, one
``np.copyto`` between numpy views of the pools (cheap views, the GIL let go
while the bytes move, no OpenMP team). The many one-page runs of a load
scattered on both sides are cut into chunks of at most `_CPU_CHUNK_BYTES`
(256 KiB) a layer; the runs of a copy of 4 MiB or more
(`_PARALLEL_MIN_BYTES`: a fresh allocation, a contiguous backup) into
pieces of at most `_PIECE_BYTES` (1 MiB) a row pair. When torch may use two
threads, the copying thread and one helper thread take batches of them in
turn (the copy stream's helper inside a stream's job, else the engine's
own, until `CopyEngine.close`), and each yields the CPU after every chunk
(`_pause`): an event loop that wakes gets a core within a chunk, where
torch's own ``copy_`` held both cores to the end of its time slice. A
load of scattered host pages into a few device runs (what a fresh
allocation gives) gathers whole pages into each run with one
``index_select`` instead.

**Scattered rows on CUDA** (runs too short to copy one by one) are gathered
on the host into a reused page-locked `PinnedStaging` buffer, so the upload
that follows is queued asynchronously instead of blocking the copy worker.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache._checks import check_instance
from tiercache.errors import InvalidInputError
from tiercache.memory.allocator import check_slot_indices
from tiercache.memory.pools import DeviceKVPool, HostKVPool
from tiercache.transfer.streams import copy_helper, new_event

__all__ = ["MAX_TEMP_BYTES", "CopyEngine", "PinnedStaging", "TransferPlan"]

#: The most bytes one temporary of a copy holds (see the module docstring).
MAX_TEMP_BYTES = 64 << 20

#: Per-copy-call overhead, expressed in bytes a copy moves in the same time.
#: A page run becomes one ``copy_`` call per buffer; scattered pages instead
#: take one ``index_select`` + ``index_copy_`` pair (two passes over the bytes).
#: Runs win while each run's copy is long compared with a call's overhead.
_RUN_BREAK_EVEN_BYTES = 32 * 1024

#: On a CPU device pool, the most bytes one copy of a scattered load moves (a
#: page of K and V at once where the pool is `DeviceKVPool.joint`): the unit
#: the copying thread and its helper share.
_CPU_CHUNK_BYTES = 256 * 1024

#: A CPU copy of at least this many bytes is shared with a helper thread (when
#: torch may use two threads or more): batches of chunks are handed out one
#: at a time to whichever thread is free, as OpenMP would split one large
#: copy. Below it, the copy stays on the calling thread: no handoff, and
#: nothing to wait for on an event loop that runs a small copy inline.
_PARALLEL_MIN_BYTES = 4 << 20


Chunk = tuple[int, int, int]


#: The numpy view of one side of a CPU copy (token rows of integers).
Rows = np.ndarray[Any, np.dtype[Any]]


#: A long run of a CPU copy is cut into pieces of at most this many bytes a
#: pair of rows (`_pieces`): the unit the copying thread and its helper share,
#: and after each of which they yield the CPU (`_pause`).
_PIECE_BYTES = 1 << 20

#: Let another runnable thread on this core go first (``sched_yield``), where
#: the platform has it. A shared copy calls it after every chunk: the copy
#: keeps every core while nothing else wants one, and an event loop that wakes
#: up gets its core within a chunk (~0.1 ms), not at the end of the copy
#: thread's time slice (measured on 2 cores: the loop's lag p99 while 64 MiB
#: moved fell from 2.5 ms with torch's copy to 0.2 ms, at the same bandwidth).
_pause: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def _pieces(runs: Sequence[Chunk], row_bytes: int) -> tuple[Chunk, ...]:
    """``runs`` (``(src start, dst start, n)`` each) cut into pieces of at most
    `_PIECE_BYTES` for rows of ``row_bytes``, in order."""
    step = max(1, _PIECE_BYTES // max(1, row_bytes))
    return tuple(
        (s0 + a, t0 + a, min(step, n - a)) for s0, t0, n in runs for a in range(0, n, step)
    )


def _copy_chunks(
    pairs: list[tuple[Rows, Rows]],
    chunks: tuple[Chunk, ...],
    nbytes: int,
    pool: concurrent.futures.ThreadPoolExecutor | None = None,
) -> None:
    """``dst[d0:d0+n] <- src[h0:h0+n]`` for every ``(dst, src)`` of ``pairs`` and ``(h0, d0, n)`` of ``chunks``.

    Each chunk is one ``np.copyto`` between numpy views: a numpy view costs a
    fraction of a torch one, the copy lets go of the GIL, and numpy never
    forks OpenMP threads (which, started from two copy streams' threads at
    once, wake up slowly). From `_PARALLEL_MIN_BYTES` on (``nbytes``), the
    helper thread of ``pool`` takes batches of chunks too, one batch at a
    time. Returns once every chunk is copied, the helper's included; if a
    copy fails, raises its error once the helper has let go of the copy.
    """
    units = len(pairs) * len(chunks)
    if pool is None or nbytes < _PARALLEL_MIN_BYTES or torch.get_num_threads() < 2:
        # Alone: a short copy (which may run on the event loop itself), or one
        # torch is told to keep to one thread (yielding after each chunk).
        pause = _pause if nbytes >= _PARALLEL_MIN_BYTES else None
        _copy_batches(pairs, chunks, iter(((0, units),)), pause)
        return
    batches = iter(_batch_bounds(units))  # next() is atomic: both threads share it
    job = pool.submit(_copy_batches, pairs, chunks, batches, _pause)
    try:
        _copy_batches(pairs, chunks, batches, _pause)
    finally:
        if not job.cancel():  # it started: the batch it holds lands first
            job.result()


#: Chunks a thread takes at once when a copy is shared: at most 8 (2 MiB of
#: 256 KiB chunks), fewer towards the end so that neither thread waits long
#: for the other's last batch.
_MAX_BATCH_UNITS = 8
_MIN_BATCH_UNITS = 2


def _batch_bounds(units: int) -> list[tuple[int, int]]:
    """``[0, units)`` in ``(lo, hi)`` batches, each at most a quarter of what is left."""
    bounds: list[tuple[int, int]] = []
    lo = 0
    while lo < units:
        size = min(_MAX_BATCH_UNITS, max(_MIN_BATCH_UNITS, (units - lo) // 4))
        bounds.append((lo, min(units, lo + size)))
        lo += size
    return bounds


def _copy_batches(
    pairs: list[tuple[Rows, Rows]],
    chunks: tuple[Chunk, ...],
    batches: Iterator[tuple[int, int]],
    pause: Callable[[], None] | None = None,
) -> None:
    """Copy the chunks of each ``(lo, hi)`` batch (numbered pair-major) that ``batches``
    yields; ``pause()`` after each chunk (`_pause`, off the event loop)."""
    per_pair = len(chunks)
    for lo, hi in batches:
        for u in range(lo, hi):
            dst, src = pairs[u // per_pair]
            h0, d0, n = chunks[u % per_pair]
            np.copyto(dst[d0 : d0 + n], src[h0 : h0 + n])
            if pause is not None:
                pause()


def _copy_layer_chunks(
    layer_pairs: list[list[tuple[Rows, Rows]]],
    chunks: tuple[Chunk, ...],
    pool: concurrent.futures.ThreadPoolExecutor,
    on_layer: Callable[[int], None] | None,
) -> None:
    """`_copy_chunks` for every layer of a load at once, shared with ``pool``'s helper.

    The chunks of all layers are numbered layer after layer and handed out in
    batches to the calling thread and the helper, as `_copy_chunks` does for
    one layer: the helper is woken once a load, not once a layer (a wake-up
    costs as much as a few chunks). The calling thread calls
    ``on_layer(i)`` once layers ``0..i`` are all copied, in order, after
    each of its own batches and once the helper is done; a layer the helper
    finishes is reported after the caller's batch in hand.
    """
    per_layer = len(layer_pairs[0]) * len(chunks)
    left = [per_layer] * len(layer_pairs)  # chunks not copied yet, per layer
    lock = threading.Lock()
    batches = iter(_batch_bounds(per_layer * len(layer_pairs)))  # next() is atomic

    def copy(lo: int, hi: int) -> None:
        while lo < hi:
            x, first = divmod(lo, per_layer)
            end = min(hi, (x + 1) * per_layer)
            _copy_batches(layer_pairs[x], chunks, iter(((first, end - x * per_layer),)), _pause)
            with lock:
                left[x] -= end - lo
            lo = end

    def helper() -> None:
        for lo, hi in batches:
            copy(lo, hi)

    reported = 0

    def report() -> None:
        nonlocal reported
        while reported < len(left) and left[reported] == 0:
            if on_layer is not None:
                on_layer(reported)
            reported += 1

    job = pool.submit(helper)
    try:
        for lo, hi in batches:
            copy(lo, hi)
            report()
    finally:
        if not job.cancel():  # it started: the batch it holds lands first
            job.result()
    report()


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


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """``(..., H, D)`` -> ``(..., H*D)`` widest-int rows: a view of the same bytes.

    Every gather and scatter of KV goes through such a view: torch has no
    ``index_copy_`` kernel for the float8 dtypes on a CPU (and none is
    promised on CUDA), and an integer copy moves the same bytes whatever the
    KV dtype. Only the last two dims need be contiguous.
    """
    return _int_view(t.view(*t.shape[:-2], -1))


def _spans(n: int, unit: int, unit_bytes: int) -> list[tuple[int, int]]:
    """``[0, n)`` in spans of whole ``unit`` items whose bytes stay within `MAX_TEMP_BYTES`.

    ``unit_bytes`` is the size of one item; a span holds at least one unit.
    """
    step = max(1, MAX_TEMP_BYTES // max(1, unit * unit_bytes)) * unit
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _chunk_runs(
    runs: tuple[tuple[int, int, int], ...], tokens: int
) -> tuple[tuple[int, int, int], ...]:
    """``runs`` (``(a, b, n)`` triples) cut into pieces of at most ``tokens`` tokens."""
    return tuple(
        (a + lo, b + lo, min(tokens, n - lo)) for a, b, n in runs for lo in range(0, n, tokens)
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``(n, H, D)`` -> ``(n, H*D)`` widest-int rows (a view; the token dim may be strided)."""
    return _int_view(t.view(t.shape[0], -1))


#: The page-locked staging ring of a CUDA engine: `STAGING_SLOTS` slots of
#: `STAGING_SLOT_BYTES` (64 MiB in all), allocated when the engine is made.
STAGING_SLOTS = 16
STAGING_SLOT_BYTES = 4 << 20


class PinnedStaging:
    """A ring of page-locked slots that scattered host rows are gathered into before an upload.

    A gather into pageable memory would make the host->device copy that
    follows synchronous: the copy worker would wait for the DMA before it
    could queue the next layer. Gathered into page-locked memory, the upload
    is queued asynchronously on the copy stream.

    The slots are used in turn, every layer and K/V of every load taking the
    next one, so a load never waits for its own uploads, nor a load for the
    one before it while the ring holds both (`STAGING_SLOTS` x
    `STAGING_SLOT_BYTES`: 64 MiB by default). Only a slot whose last upload
    has not finished when the ring comes round to it again is waited for
    (a blocking, non-spinning event). The memory is allocated once, by
    `reserve` (the engine calls it when it is made, before any copy runs:
    ``cudaHostAlloc`` never runs while the GPU is busy).

    Used from one thread at a time (the load stream's worker).

    Args:
        pin: page-lock the slots; only where CUDA is available. Without it
            (a CPU-only machine) the slots are ordinary memory.
        count: slots in the ring.
        slot_bytes: bytes of one slot: the most one gather may hold.
        track: record an event after each upload and wait for it before the
            slot is refilled (default: ``pin``; there is no asynchronous copy
            to wait for otherwise).
        new_event: makes the events (`new_event`; a stand-in in tests).
    """

    def __init__(
        self,
        pin: bool,
        count: int = STAGING_SLOTS,
        slot_bytes: int = STAGING_SLOT_BYTES,
        *,
        track: bool | None = None,
        new_event: Callable[[], Any] = new_event,
    ) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.count = count
        self.slot_bytes = slot_bytes
        self.track = self.pin if track is None else track
        self._new_event = new_event
        self._arena: torch.Tensor | None = None
        self._events: list[Any] = [None] * count
        self._next = 0
        #: Slots whose previous upload was still running when taken (the host waited).
        self.waits = 0

    def reserve(self) -> None:
        """Allocate the ring now (once): ``count * slot_bytes`` bytes, page-locked when `pin`."""
        if self._arena is None:
            self._arena = torch.empty(
                self.count * self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin
            )

    def rows(self, row_bytes: int, unit: int) -> int:
        """The most rows of ``row_bytes`` one slot holds, in whole ``unit`` rows (at least one unit).

        Raises:
            InvalidInputError: one unit does not fit in a slot.
        """
        n = self.slot_bytes // max(1, row_bytes) // unit * unit
        if n == 0:
            raise InvalidInputError(
                f"a staging slot of {self.slot_bytes} bytes cannot hold {unit} rows of {row_bytes} bytes"
            )
        return n

    def take(self, like: torch.Tensor, rows: int) -> tuple[int, torch.Tensor]:
        """The next slot as a ``(rows, *like.shape[1:])`` tensor of ``like``'s dtype, and its number.

        Waits (host) only for a slot whose last upload has not finished.

        Raises:
            InvalidInputError: ``rows`` rows do not fit in a slot.
        """
        self.reserve()
        assert self._arena is not None
        nbytes = rows * like[0].numel() * like.element_size()
        if nbytes > self.slot_bytes:
            raise InvalidInputError(
                f"{rows} rows of {nbytes // max(1, rows)} bytes do not fit a {self.slot_bytes}-byte slot"
            )
        i = self._next
        self._next = (i + 1) % self.count
        ev = self._events[i]
        if ev is not None:
            if not ev.query():
                self.waits += 1
                ev.synchronize()
            self._events[i] = None
        base = i * self.slot_bytes
        buf = self._arena[base : base + nbytes]
        return i, buf.view(like.dtype).view((rows, *like.shape[1:]))

    def release(self, i: int, stream: Any = None) -> None:
        """Slot ``i`` was handed to an upload queued on ``stream`` (the copy stream of
        the pool's device): record when that upload ends."""
        if self.track:
            ev = self._new_event()
            ev.record(stream)
            self._events[i] = ev

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The memory allocated so far (flat ``uint8``): the ring, once reserved."""
        return () if self._arena is None else (self._arena,)

    @property
    def nbytes(self) -> int:
        """Bytes the ring holds now."""
        return sum(b.numel() for b in self.buffers)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """What one transfer moves, computed once and reused for every layer.

    ``runs`` is set when the pages form few enough contiguous
    ``(host_start, device_start, length)`` runs that plain slice copies beat
    gather/scatter (a CPU load of many of them copies ``chunks``);
    otherwise the index tensors are used. A CPU load into a device side of a
    few contiguous runs uses ``device_runs`` before either.
    """

    host_indices: torch.Tensor  # CPU int64
    device_indices: torch.Tensor  # on the device pool's device
    runs: tuple[tuple[int, int, int], ...] | None
    num_tokens: int
    #: Contiguous runs on the device side alone, as ``(first page of the plan,
    #: device start slot, pages)``, and the host page ids in plan order; set
    #: on a CPU device pool when the host side is scattered (``runs`` is
    #: ``None`` or many) and the device side is a few runs (what a fresh
    #: allocation gives): a load then gathers whole host pages straight into
    #: those runs, one ``index_select`` a run.
    device_runs: tuple[tuple[int, int, int], ...] | None = None
    host_pages: torch.Tensor | None = None
    #: On a CPU device pool, when there are more than `_MAX_GATHER_RUNS`
    #: runs: ``runs`` cut into ``(host_start, device_start, length)`` pieces
    #: of at most `_CPU_CHUNK_BYTES` a layer (K and V together on a joint
    #: pool), each copied by a load with one ``np.copyto``.
    chunks: tuple[tuple[int, int, int], ...] | None = None

    @property
    def empty(self) -> bool:
        return self.num_tokens == 0


class CopyEngine:
    """Moves pages between one device pool and one host pool.

    `backup_all_layers` copies every layer of the given device slots into host
    slots; `load_layer` copies one layer of host slots into device slots. Both
    are synchronous and run on a copy stream's worker thread; on CUDA they only
    enqueue work on the current (copy) stream. On a CPU device pool a
    scattered load of 4 MiB or more a layer is shared with a helper thread
    (the copy stream's inside a stream's job, else the engine's own: see
    `close`); the call returns once both are done. Pages are moved as contiguous
    runs with ``copy_`` where both sides are contiguous for long enough, else
    with one vectorised ``index_select``/``index_copy_`` per layer and buffer,
    never a Python loop per token.

    Raises:
        InvalidInputError: not a `DeviceKVPool` and a `HostKVPool`, or pools
            with different layouts.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        check_instance(device_pool, DeviceKVPool, "device_pool")
        check_instance(host_pool, HostKVPool, "host_pool")
        if device_pool.layout != host_pool.layout:
            raise InvalidInputError(
                f"device and host pools differ: {device_pool.layout} vs {host_pool.layout}"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.layout = device_pool.layout
        self.device = device_pool.device
        self.non_blocking = self.device.type == "cuda" and host_pool.pinned
        #: Where a CUDA load gathers scattered host rows (`load_layer`'s index
        #: path); ``None`` on a CPU device pool, which gathers straight into a
        #: temporary it scatters from at once.
        self.staging: PinnedStaging | None = None
        if self.device.type == "cuda":
            row = self.layout.page_size * self.layout.token_layer_bytes
            self.staging = PinnedStaging(pin=True, slot_bytes=max(STAGING_SLOT_BYTES, row))
            # Now, before any copy: cudaHostAlloc never waits for a busy GPU.
            self.staging.reserve()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()
        self._rows_cache: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._arrays_cache: list[list[tuple[Rows, Rows]]] | None = None
        self._pages_cache: tuple[Rows, Rows] | None = None
        self._backup_pairs_cache: list[tuple[Rows, Rows]] | None = None

    def _helper_pool(self, nbytes: int) -> concurrent.futures.ThreadPoolExecutor | None:
        """The thread that shares a CPU copy of ``nbytes``, or ``None`` to copy alone.

        Inside a copy stream's job, the stream's helper (`copy_helper`);
        otherwise the engine's own, started on first use and stopped by `close`.
        """
        if nbytes < _PARALLEL_MIN_BYTES or torch.get_num_threads() < 2:
            return None
        pool = copy_helper()
        if pool is not None:
            return pool
        with self._helper_lock:
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="tiercache-engine-helper"
                )
            return self._helper

    def _layer_rows(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, the ``(device, host)`` integer-row views a CPU load copies between.

        With a joint device pool, one pair of ``(slots, B, row)`` views: a
        slice of tokens holds their K and V. Otherwise one pair of ``(slots,
        row)`` views a buffer. Made once, under inference mode, and used only
        under it (or as numpy arrays: `_layer_arrays`).
        """
        rows = self._rows_cache
        if rows is None:
            joint, host = self.device_pool.joint, self.host_pool
            B, S = self.layout.num_buffers, host.num_slots
            with torch.inference_mode():
                if joint is not None:
                    dev_slots = joint.shape[2]
                    rows = [
                        [
                            (
                                _int_view(joint[:, x].view(B, dev_slots, -1)).transpose(0, 1),
                                _int_view(
                                    (
                                        host.buffer[:, x]
                                        if host.host_layout == "layer_first"
                                        else host.buffer[:, :, x]
                                    ).view(B, S, -1)
                                ).transpose(0, 1),
                            )
                        ]
                        for x in range(self.layout.num_layers)
                    ]
                else:
                    rows = [
                        [
                            (_rows(self.device_pool.buffers[b][x]), _rows(host.layer(b, x)))
                            for b in range(B)
                        ]
                        for x in range(self.layout.num_layers)
                    ]
            self._rows_cache = rows
        return rows

    def _layer_arrays(self) -> list[list[tuple[Rows, Rows]]]:
        """`_layer_rows` as numpy arrays (sharing the pools' memory), for `_copy_chunks`."""
        arrays = self._arrays_cache
        if arrays is None:
            arrays = [[(d.numpy(), s.numpy()) for d, s in pairs] for pairs in self._layer_rows()]
            self._arrays_cache = arrays
        return arrays

    @property
    def copies_pages(self) -> bool:
        """Whether `copy_pages` serves these pools: a CPU device pool allocated as one tensor."""
        return self.device.type == "cpu" and self.device_pool.joint is not None

    def _page_arrays(self) -> tuple[Rows, Rows]:
        """The device and host pools as ``(B, L, slots, row)`` integer numpy views.

        A ``page_first`` host pool is ``(B, slots, L, row)`` in memory: its
        view swaps the two middle axes (a strided view, no copy).
        """
        arrays = self._pages_cache
        if arrays is None:
            joint, host = self.device_pool.joint, self.host_pool
            assert joint is not None
            B, L = self.layout.num_buffers, self.layout.num_layers
            dev = _int_view(joint.view(B, L, joint.shape[2], -1)).numpy()
            buf = _int_view(host.buffer.view(*host.buffer.shape[:3], -1)).numpy()
            if host.host_layout != "layer_first":
                buf = buf.swapaxes(1, 2)
            arrays = self._pages_cache = (dev, buf)
        return arrays

    def copy_pages(
        self, to_host: bool, host_pages: Sequence[int], device_pages: Sequence[int]
    ) -> None:
        """Copy whole pages between the pools by page id, every layer and buffer at once.

        The small-copy path of a CPU device pool (`copies_pages`): no slot
        tensors and no plan, one `_copy_run` per run of pages that follow
        each other on both sides. The caller checked the page ids; the two
        sequences have the same length. ``to_host``: device -> host, else
        host -> device.
        """
        ps = self.layout.page_size
        n = len(host_pages)
        i = 0
        while i < n:
            h0, d0 = host_pages[i], device_pages[i]
            j = i + 1
            while j < n and host_pages[j] == h0 + j - i and device_pages[j] == d0 + j - i:
                j += 1
            self._copy_run(to_host, h0 * ps, d0 * ps, (j - i) * ps)
            i = j

    def _copy_run(self, to_host: bool, h0: int, d0: int, n: int) -> None:
        """Slots ``h0..h0+n`` of the host pool and ``d0..d0+n`` of the (CPU, joint)
        device pool, every layer and buffer: one ``np.copyto`` (``to_host``:
        device -> host). numpy lets go of the GIL and never starts OpenMP
        threads, whose team on a copy stream's thread costs more than a short
        copy (torch's ``copy_`` took 2-7x as long for a 768 KiB page there)."""
        dev, host = self._page_arrays()
        if to_host:
            np.copyto(host[:, :, h0 : h0 + n], dev[:, :, d0 : d0 + n])
        else:
            np.copyto(dev[:, :, d0 : d0 + n], host[:, :, h0 : h0 + n])

    def close(self) -> None:
        """Stop the engine's own helper thread, if it started one. Idempotent.

        Only copies made outside a copy stream start it; the engine stays
        usable (a later large copy starts a new one).
        """
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

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
        device_runs, host_pages, chunks = None, None, None
        if self.device.type == "cpu" and (runs is None or len(runs) > 4):
            # Scattered host pages: gathered whole into the device side's runs
            # when it has few (a fresh allocation), one index_select a run.
            device_runs = self._device_runs(dev)
            if device_runs is not None:
                host_pages = host[::ps] // ps
        if self.device.type == "cpu" and runs is not None and len(runs) > _MAX_GATHER_RUNS:
            chunks = _chunk_runs(runs, self._chunk_tokens())
        return TransferPlan(host, dev_on_device, runs, n, device_runs, host_pages, chunks)

    def _host_runs(self, host: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
        """The contiguous runs of ``host``, as ``(first slot of the plan, host start, tokens)``.

        A ``page_first`` host page is contiguous across layers: each run is
        one copy of every layer between the pool and a device tensor.
        """
        ps = self.layout.page_size
        hp = host[::ps]
        if hp.numel() == 1:
            breaks: list[int] = []
        else:
            breaks = (torch.nonzero((hp[1:] - hp[:-1]) != ps).flatten() + 1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, hp.numel()]
        first = hp[starts].tolist()
        return tuple((a * ps, f, (e - a) * ps) for a, e, f in zip(starts, ends, first, strict=True))

    def _chunk_tokens(self) -> int:
        """Tokens one copy of a scattered CPU load moves (a chunk of `TransferPlan.chunks`).

        At most `_CPU_CHUNK_BYTES`, counting every buffer where the device
        pool is joint.
        """
        buffers = self.layout.num_buffers if self.device_pool.joint is not None else 1
        return max(1, _CPU_CHUNK_BYTES // (buffers * self.layout.token_layer_bytes))

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
        """Copy every layer of ``plan``'s device slots into its host slots.

        On CUDA every device->host copy lands straight in the (page-locked)
        host pool, from a contiguous source: it is queued, never waited for.
        Contiguous runs of a ``layer_first`` pool copy layer by layer; anything
        else is gathered on the device (in chunks of at most `MAX_TEMP_BYTES`)
        into the host pool's own order, then copied one host run at a time.
        """
        if plan.empty:
            return
        if self.device.type != "cpu":
            if self.host_pool.host_layout == "page_first" or plan.runs is None:
                self._backup_staged(plan)
                return
        joint = self.device_pool.joint
        if joint is not None and self.device.type == "cpu" and plan.runs is not None:
            self._backup_runs_joint(joint, plan.runs)
            return
        stacked = self.device_pool.stacked
        for b in range(self.layout.num_buffers):
            if stacked is None:
                for layer in range(self.layout.num_layers):
                    self._backup_layer(b, layer, plan)
            elif plan.runs is not None:
                self._backup_runs(b, stacked[b], plan.runs)
            else:
                self._backup_gather(b, stacked[b], plan)

    def _backup_runs(
        self, b: int, src_all: torch.Tensor, runs: tuple[tuple[int, int, int], ...]
    ) -> None:
        """CUDA, ``layer_first`` host: runs of a stacked ``(L, S, H, D)`` device buffer.

        Layer by layer, where both sides are contiguous: each copy is queued
        straight into the page-locked pool, no temporary on either side.
        """
        host = self.host_pool
        nb = self.non_blocking
        for layer in range(self.layout.num_layers):
            src, dst = src_all[layer], host.buffer[b, layer]
            for h0, d0, n in runs:
                dst[h0 : h0 + n].copy_(src[d0 : d0 + n], non_blocking=nb)

    def _backup_staged(self, plan: TransferPlan) -> None:
        """CUDA: gather the device slots on the device, then one DMA per host run (and layer).

        ``page_first``: the gather is laid out ``(tokens, L, row)``, as a host
        page is, so a host run of every layer is one copy. ``layer_first``:
        ``(L, tokens, row)``, one copy per layer and host run.
        """
        host = self.host_pool
        L = self.layout.num_layers
        nb = self.non_blocking
        token_bytes = L * self.layout.token_layer_bytes
        page_first = host.host_layout == "page_first"
        host_runs = self._host_runs(plan.host_indices)
        for b in range(self.layout.num_buffers):
            dst = _token_rows(host.buffer[b])  # (S, L, row) or (L, S, row)
            stacked = self.device_pool.stacked
            for lo, hi in _spans(plan.num_tokens, self.layout.page_size, token_bytes):
                idx = plan.device_indices[lo:hi]
                if stacked is not None:
                    gathered = _token_rows(stacked[b]).index_select(1, idx)  # (L, n, row)
                else:
                    gathered = torch.stack(
                        [_token_rows(t).index_select(0, idx) for t in self.device_pool.buffers[b]]
                    )
                if page_first:
                    staged = gathered.transpose(0, 1).contiguous()  # (n, L, row)
                for off, h0, m in host_runs:
                    a, z = max(off, lo), min(off + m, hi)
                    if a >= z:
                        continue
                    h = h0 + (a - off)
                    if page_first:
                        dst[h : h + z - a].copy_(staged[a - lo : z - lo], non_blocking=nb)
                    else:
                        for x in range(L):
                            dst[x, h : h + z - a].copy_(
                                gathered[x, a - lo : z - lo], non_blocking=nb
                            )

    def _backup_runs_joint(
        self, joint: torch.Tensor, runs: tuple[tuple[int, int, int], ...]
    ) -> None:
        """Runs of every layer and buffer at once from a (CPU) joint ``(B, L, S, H, D)`` pool.

        One copy a run of integer rows (K and V together, every layer), no
        temporary. A run under `_PARALLEL_MIN_BYTES` is a `_copy_run`. Inside
        a copy stream's job the longer ones are cut into pieces of every
        buffer and layer (`_pieces`), shared with the stream's helper thread
        (`_copy_chunks`), which yield the CPU after each; called directly (the
        caller blocks anyway), each is torch's ``copy_`` over its threads.
        """
        token_bytes = self.layout.token_bytes
        long: list[Chunk] = []
        for h0, d0, n in runs:
            if n * token_bytes < _PARALLEL_MIN_BYTES:
                self._copy_run(True, h0, d0, n)
            elif copy_helper() is None:
                self._copy_run_torch(joint, h0, d0, n)
            else:
                long.append((d0, h0, n))
        if long:
            nbytes = sum(n for *_, n in long) * token_bytes
            pairs = self._backup_pairs()
            chunks = _pieces(long, pairs[0][1][0].nbytes)
            _copy_chunks(pairs, chunks, nbytes, self._helper_pool(nbytes))

    def _copy_run_torch(self, joint: torch.Tensor, h0: int, d0: int, n: int) -> None:
        """A backup of one long run from a joint pool: torch's ``copy_`` over its threads."""
        host = self.host_pool
        B, L = self.layout.num_buffers, self.layout.num_layers
        with torch.inference_mode():
            src = _int_view(joint.view(B, L, joint.shape[2], -1))[:, :, d0 : d0 + n]
            dst_all = _int_view(host.buffer.view(*host.buffer.shape[:3], -1))
            if host.host_layout == "layer_first":
                dst_all[:, :, h0 : h0 + n].copy_(src)
            else:
                dst_all[:, h0 : h0 + n].copy_(src.transpose(1, 2))

    def _backup_pairs(self) -> list[tuple[Rows, Rows]]:
        """``(host rows, device rows)`` of a joint pool (numpy views), for the long runs
        of a backup, in the host's order: a ``layer_first`` host holds a buffer's
        layer contiguously (a pair a buffer and layer), a ``page_first`` one a
        token's layers together (a pair a buffer, a row a token of every layer:
        the host is written in order, as torch's copy did; a pair a layer wrote
        2 KiB every 32 KiB and ran at 0.65 of memcpy)."""
        pairs = self._backup_pairs_cache
        if pairs is None:
            dev, host = self._page_arrays()
            B, L = self.layout.num_buffers, self.layout.num_layers
            if self.host_pool.host_layout == "layer_first":
                pairs = [(host[b, x], dev[b, x]) for b in range(B) for x in range(L)]
            else:
                pairs = [(host[b].swapaxes(0, 1), dev[b].swapaxes(0, 1)) for b in range(B)]
            self._backup_pairs_cache = pairs
        return pairs

    def _backup_gather(self, b: int, src_all: torch.Tensor, plan: TransferPlan) -> None:
        """Scattered slots of every layer, gathered on the device in bounded chunks."""
        host = self.host_pool
        token_bytes = self.layout.num_layers * self.layout.token_layer_bytes
        for lo, hi in _spans(plan.num_tokens, self.layout.page_size, token_bytes):
            gathered = _token_rows(src_all).index_select(1, plan.device_indices[lo:hi])
            idx = plan.host_indices[lo:hi]
            dst = _token_rows(host.buffer[b])
            if host.host_layout == "layer_first":
                dst.index_copy_(1, idx, gathered.to("cpu"))
            else:
                dst.index_copy_(0, idx, gathered.transpose(0, 1).to("cpu"))

    def _backup_layer(self, b: int, layer: int, plan: TransferPlan) -> None:
        src = self.device_pool.buffers[b][layer]
        dst = self.host_pool.layer(b, layer)
        if plan.runs is not None:
            self._copy_runs(dst, src, [(d0, h0, n) for h0, d0, n in plan.runs])
            return
        for lo, hi in _spans(plan.num_tokens, self.layout.page_size, self.layout.token_layer_bytes):
            gathered = _token_rows(src).index_select(0, plan.device_indices[lo:hi])
            _token_rows(dst).index_copy_(0, plan.host_indices[lo:hi], gathered.to("cpu"))

    # -- host -> device -------------------------------------------------------

    def load_all_layers(
        self, plan: TransferPlan, on_layer: Callable[[int], None] | None = None
    ) -> None:
        """Copy every layer of ``plan``'s host slots into its device slots, layer 0 first.

        ``on_layer(i)`` is called on the calling thread once layers ``0..i``
        are all in place (on CUDA: queued on the current stream, as
        `load_layer` leaves them), for every layer in order.

        The same bytes as `load_layer` for each layer in turn. A large
        scattered CPU load shares its chunks with the engine's helper thread
        across all layers, instead of handing it each layer's in turn.
        """
        num_layers = self.layout.num_layers
        if self.device.type != "cpu" and self.host_pool.host_layout == "page_first":
            if not plan.empty:
                self._load_staged(plan, range(num_layers), on_layer)
            return
        if self.device.type == "cpu" and plan.device_runs is None:
            # Scattered chunks, or (in a stream's job) long runs cut in pieces:
            # one helper for the load.
            chunks = plan.chunks
            if chunks is None and plan.runs is not None and copy_helper() is not None:
                pairs = self._layer_arrays()[0]
                chunks = _pieces(plan.runs, pairs[0][1][0].nbytes)
            pool = self._helper_pool(self.plan_bytes(plan)) if chunks is not None else None
            if pool is not None and chunks is not None:
                _copy_layer_chunks(self._layer_arrays(), chunks, pool, on_layer)
                return
        for i in range(num_layers):
            self.load_layer(i, plan)
            if on_layer is not None:
                on_layer(i)

    def load_layer(self, layer: int, plan: TransferPlan) -> None:
        """Copy layer ``layer`` of ``plan``'s host slots into its device slots."""
        if plan.empty:
            return
        if self.device.type != "cpu" and self.host_pool.host_layout == "page_first":
            self._load_staged(plan, (layer,), None)
            return
        if self.device.type == "cpu" and plan.device_runs is None and plan.runs is not None:
            if plan.chunks is not None:
                nbytes = plan.num_tokens * self.layout.num_buffers * self.layout.token_layer_bytes
                arrays = self._layer_arrays()[layer]
                _copy_chunks(arrays, plan.chunks, nbytes, self._helper_pool(nbytes))
                return
            self._load_layer_runs(layer, plan.runs, plan.num_tokens)
            return
        for b in range(self.layout.num_buffers):
            src = self.host_pool.layer(b, layer)
            dst = self.device_pool.buffers[b][layer]
            if plan.device_runs is not None and plan.host_pages is not None:
                self._gather_pages(src, dst, plan.device_runs, plan.host_pages)
            elif plan.runs is not None:
                self._copy_runs(dst, src, plan.runs)
            else:
                self._load_gathered(src, dst, plan)

    def _load_layer_runs(
        self, layer: int, runs: tuple[tuple[int, int, int], ...], num_tokens: int
    ) -> None:
        """A few runs of one layer (CPU): each one ``np.copyto`` when the load is
        short (see `_copy_run`); else, in a copy stream's job, in pieces shared
        with its helper thread, and called directly, torch's ``copy_``."""
        pairs = self._layer_arrays()[layer]
        if num_tokens * self.layout.token_bytes < _PARALLEL_MIN_BYTES:
            for dst_a, src_a in pairs:
                for s0, t0, n in runs:
                    np.copyto(dst_a[t0 : t0 + n], src_a[s0 : s0 + n])
            return
        if copy_helper() is None:
            with torch.inference_mode():
                for dst, src in self._layer_rows()[layer]:
                    for s0, t0, n in runs:
                        dst[t0 : t0 + n].copy_(src[s0 : s0 + n])
            return
        nbytes = num_tokens * self.layout.num_buffers * self.layout.token_layer_bytes
        chunks = _pieces(runs, pairs[0][1][0].nbytes)
        _copy_chunks(pairs, chunks, nbytes, self._helper_pool(nbytes))

    def _load_staged(
        self,
        plan: TransferPlan,
        layers: range | tuple[int, ...],
        on_layer: Callable[[int], None] | None,
    ) -> None:
        """CUDA, ``page_first`` host: one DMA per host run of every layer, then device copies.

        A ``page_first`` host layer is strided: torch would stage it through a
        pageable temporary and wait for the stream. A host run of whole pages
        is contiguous across layers instead: it goes up in one asynchronous
        copy into a device tensor (chunks of at most `MAX_TEMP_BYTES` a
        buffer), from which each layer is scattered on the device.
        ``on_layer(i)`` is called once layer ``i`` is queued in every chunk.
        """
        host = self.host_pool
        L = self.layout.num_layers
        nb = self.non_blocking
        token_bytes = L * self.layout.token_layer_bytes
        spans = _spans(plan.num_tokens, self.layout.page_size, token_bytes)
        where = self.device_pool.buffers[0][0].device
        host_runs = self._host_runs(plan.host_indices)
        for si, (lo, hi) in enumerate(spans):
            staged: list[torch.Tensor] = []
            for b in range(self.layout.num_buffers):
                src = _token_rows(host.buffer[b])  # (S, L, row)
                up = torch.empty((hi - lo, *src.shape[1:]), dtype=src.dtype, device=where)
                for off, h0, m in host_runs:
                    a, z = max(off, lo), min(off + m, hi)
                    if a < z:
                        h = h0 + (a - off)
                        up[a - lo : z - lo].copy_(src[h : h + z - a], non_blocking=nb)
                staged.append(up)
            idx = plan.device_indices[lo:hi]
            for layer in layers:
                for b, up in enumerate(staged):
                    dst = _token_rows(self.device_pool.buffers[b][layer])
                    dst.index_copy_(0, idx, up[:, layer])
                if on_layer is not None and si == len(spans) - 1:
                    on_layer(layer)

    def _load_gathered(self, src: torch.Tensor, dst: torch.Tensor, plan: TransferPlan) -> None:
        """Scattered host rows into scattered device rows of one layer, span by span.

        Without `staging` (a CPU device pool) the gather is a temporary of at
        most `MAX_TEMP_BYTES`; with it (CUDA) the rows are gathered into a
        page-locked staging buffer, uploaded asynchronously on the current
        (copy) stream, then scattered on the device.
        """
        staging = self.staging
        per_token = self.layout.token_layer_bytes
        src, dst = _token_rows(src), _token_rows(dst)
        if staging is None:
            for lo, hi in _spans(plan.num_tokens, self.layout.page_size, per_token):
                host_idx, dev_idx = plan.host_indices[lo:hi], plan.device_indices[lo:hi]
                dst.index_copy_(0, dev_idx, src.index_select(0, host_idx))
            return
        step = staging.rows(per_token, self.layout.page_size)
        stream = torch.cuda.current_stream(self.device) if staging.pin else None
        for lo in range(0, plan.num_tokens, step):
            hi = min(lo + step, plan.num_tokens)
            host_idx, dev_idx = plan.host_indices[lo:hi], plan.device_indices[lo:hi]
            i, buf = staging.take(src, hi - lo)
            torch.index_select(src, 0, host_idx, out=buf)
            gathered = buf.to(dst.device, non_blocking=staging.pin)
            staging.release(i, stream)  # on the copy stream that queued the upload
            dst.index_copy_(0, dev_idx, gathered)

    def _copy_runs(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        runs: tuple[tuple[int, int, int], ...] | list[tuple[int, int, int]],
    ) -> None:
        """Copy ``src[s0:s0+n]`` to ``dst[t0:t0+n]`` for each ``(s0, t0, n)`` of one layer.

        Note the order: ``runs`` holds ``(src start, dst start, length)``.
        On a CPU device pool each run is one copy of integer rows; otherwise
        runs are copied in chunks of at most `MAX_TEMP_BYTES` where the source
        is strided (a ``page_first`` host layer, which torch stages
        contiguously before a DMA).
        """
        nb = self.non_blocking
        if self.device.type == "cpu":
            # Integer rows: a one-page run stays under torch's parallel grain (no
            # OpenMP fork and join for 128 KiB); in a copy stream's job, 4 MiB
            # or more go in pieces shared with its helper, as a joint pool's do.
            s, d = _rows(src), _rows(dst)
            row_bytes = s.shape[1] * s.element_size()
            nbytes = sum(n for *_, n in runs) * row_bytes
            if nbytes >= _PARALLEL_MIN_BYTES and copy_helper() is not None:
                pairs = [(d.numpy(), s.numpy())]
                _copy_chunks(pairs, _pieces(runs, row_bytes), nbytes, self._helper_pool(nbytes))
                return
            for s0, t0, n in runs:
                d[t0 : t0 + n].copy_(s[s0 : s0 + n])
            return
        for s0, t0, n in runs:
            for lo, hi in _spans(n, 1, self.layout.token_layer_bytes):
                dst[t0 + lo : t0 + hi].copy_(src[s0 + lo : s0 + hi], non_blocking=nb)

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
