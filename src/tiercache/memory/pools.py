"""The device (L1) and host (L2) KV pools."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

from tiercache._checks import check_index, check_positive
from tiercache.errors import CapacityError, InvalidInputError
from tiercache.memory.allocator import check_slot_indices
from tiercache.memory.layout import KVLayout
from tiercache.memory.pages import PageBuffer

__all__ = [
    "HOST_LAYOUTS",
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "available_host_memory",
    "resolve_device",
]

#: cudaHostRegister works on whole host pages: the pool's buffer is aligned to
#: (and its registered length rounded up to) this many bytes.
_HOST_PAGE = 4096

logger = logging.getLogger(__name__)

HostLayout = Literal["layer_first", "page_first"]
HOST_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first")


def available_host_memory() -> int:
    """Bytes of host memory this process can still take (MemAvailable, capped by cgroup)."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for path, used_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(path) as f:
                raw = f.read().strip()
            if raw == "max":
                continue
            with open(used_path) as f:
                used = int(f.read().strip())
            avail = min(avail, max(0, int(raw) - used))
        except (OSError, ValueError):
            continue
    return avail


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a `torch.device`; a bare ``"cuda"`` becomes the calling thread's current device.

    Call it on the thread whose current device is meant (a TP rank's own
    thread), never inside a worker thread, whose current device is 0.

    Raises:
        InvalidInputError: not a device, not cpu/cuda, or cuda without CUDA.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError(f"not a torch device: {device!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError("device is cuda but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise InvalidInputError(f"device must be cpu or cuda, got {dev}")
    return dev


def _on_device(device: torch.device | None) -> Any:
    """``torch.cuda.device(device)``, or nothing when ``device`` is ``None``.

    A CUDA call made on a thread that never chose a device runs in device 0's
    context, creating it if needed (about 0.5 GiB on every rank not on GPU 0).
    """
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _registered_buffer(
    shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """A pageable buffer of ``shape`` page-locked in place with ``cudaHostRegister``.

    ``torch.empty(pin_memory=True)`` goes through torch's caching host
    allocator, which rounds every block up to a power of two: a 40 GiB pool
    would lock 64 GiB. Registering plain memory locks exactly the pages the
    buffer spans. Returns the tensor and the bytes locked. The call runs in
    ``device``'s context (the calling thread's current device if ``None``).

    Raises:
        RuntimeError: the driver refused to register the memory.
    """
    locked = -(-nbytes // _HOST_PAGE) * _HOST_PAGE
    raw = torch.empty(locked + _HOST_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HOST_PAGE
    region = raw[skip : skip + locked]
    # cudaHostRegisterPortable (1): pinned for every CUDA context of the process.
    with _on_device(device):
        err = int(
            torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                region.data_ptr(), locked, 1
            )
        )
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {locked} bytes failed with CUDA error {err}")
    buf = region[:nbytes].view(dtype).view(shape)
    return buf, locked


def _unregister(buffer: torch.Tensor, device: torch.device | None = None) -> None:
    """Unlock a `_registered_buffer` (its pool is gone; views of it stay valid, pageable).

    Runs in ``device``'s context: the collector may call it on any thread.
    """
    try:
        with _on_device(device):
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                buffer.data_ptr()
            )
    except Exception:  # interpreter shutdown: the process unmaps it anyway
        pass


class DeviceKVPool:
    """The L1 pool: per-layer KV buffers in device memory.

    MHA: ``k_buffer[l]`` and ``v_buffer[l]`` of shape ``(num_slots, num_kv_heads,
    head_dim)``. MLA: ``kv_buffer[l]`` of shape ``(num_slots, 1, head_dim)``.
    ``buffers[b][l]`` addresses both uniformly (``b`` = 0 for K / latent, 1 for V).
    A pool it allocates itself also exposes ``stacked[b]``, the ``(L, slots, H, D)``
    tensor the per-layer buffers are views of (``None`` for wrapped buffers).
    On the CPU, ``stacked`` are in turn views of ``joint``, one ``(B, L, slots,
    H, D)`` tensor, so that a copy can take a page of K and V at once
    (``None`` on CUDA and for wrapped buffers).

    Args:
        layout: the model's KV layout.
        num_slots: token slots; a multiple of the page size.
        device: ``"cpu"`` or a CUDA device.
        k_buffers: MHA K tensors an engine already owns, to wrap instead of
            allocating (one per layer, right shape, dtype, device, contiguous;
            no two may share memory, though they may be disjoint views of
            one larger tensor).
        v_buffers: the V tensors, as ``k_buffers``.
        kv_buffers: the same for MLA.

    Raises:
        InvalidInputError: sizes, shapes, dtypes or devices that do not match,
            or wrapped buffers that overlap in memory (the message names two).
        CapacityError: the pool does not fit in the device's memory.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        device: str | torch.device = "cpu",
        *,
        k_buffers: Sequence[torch.Tensor] | None = None,
        v_buffers: Sequence[torch.Tensor] | None = None,
        kv_buffers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        num_slots = _whole_pages(num_slots, layout)
        self.layout = layout
        self.num_slots = num_slots
        self.device = resolve_device(device)
        shape = (num_slots, layout.num_kv_heads, layout.head_dim)
        wrapped = [b for b in (k_buffers, v_buffers, kv_buffers) if b is not None]
        if wrapped:
            given = [k_buffers, v_buffers] if not layout.mla else [kv_buffers]
            if layout.mla and (k_buffers is not None or v_buffers is not None):
                raise InvalidInputError("an MLA pool wraps kv_buffers, not k_buffers/v_buffers")
            if not layout.mla and kv_buffers is not None:
                raise InvalidInputError("an MHA pool wraps k_buffers and v_buffers, not kv_buffers")
            if any(g is None for g in given):
                raise InvalidInputError("wrap both k_buffers and v_buffers")
            names = ("kv_buffers",) if layout.mla else ("k_buffers", "v_buffers")
            self.buffers = [
                self._check_wrapped(list(g), shape, name)
                for g, name in zip(given, names, strict=True)
                if g is not None
            ]
            _check_disjoint(
                [
                    (f"{name}[{i}]", t)
                    for name, g in zip(names, self.buffers, strict=True)
                    for i, t in enumerate(g)
                ]
            )
            self.stacked: list[torch.Tensor] | None = None
            self.joint: torch.Tensor | None = None
        else:
            # One (L, slots, H, D) tensor per K/V: every layer is a view of it, so
            # a backup of all layers is one strided copy per page run, not L copies.
            stacked = (layout.num_layers, *shape)
            try:
                if self.device.type == "cpu":
                    # K and V in one tensor too: the CPU copy engine moves a page of
                    # both with one copy (half the copies, half the views to make).
                    self.joint = torch.zeros(
                        (layout.num_buffers, *stacked), dtype=layout.dtype, device=self.device
                    )
                    self.stacked = list(self.joint.unbind(0))
                else:
                    self.joint = None
                    self.stacked = [
                        torch.zeros(stacked, dtype=layout.dtype, device=self.device)
                        for _ in range(layout.num_buffers)
                    ]
            except (RuntimeError, MemoryError) as e:  # torch's out-of-memory is a RuntimeError
                raise CapacityError(
                    f"cannot allocate a device pool of {num_slots * layout.token_bytes / 2**30:.2f} GiB "
                    f"on {self.device}: {e}"
                ) from e
            self.buffers = [list(t.unbind(0)) for t in self.stacked]

    def _check_wrapped(
        self, bufs: list[torch.Tensor], shape: tuple[int, ...], name: str
    ) -> list[torch.Tensor]:
        """``bufs`` (the ``name`` argument) once each is one layer's contiguous buffer of ``shape``."""
        if len(bufs) != self.layout.num_layers:
            raise InvalidInputError(
                f"{name}: expected {self.layout.num_layers} layer buffers, got {len(bufs)}"
            )
        for i, t in enumerate(bufs):
            what = f"{name}[{i}]"
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(f"{what} is not a tensor")
            if tuple(t.shape) != shape:
                raise InvalidInputError(f"{what} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != self.layout.dtype:
                raise InvalidInputError(f"{what} has dtype {t.dtype}, expected {self.layout.dtype}")
            if t.device != self.device:
                raise InvalidInputError(f"{what} is on {t.device}, expected {self.device}")
            if not t.is_contiguous():
                raise InvalidInputError(f"{what} is not contiguous")
        return bufs

    @property
    def k_buffer(self) -> list[torch.Tensor]:
        if self.layout.mla:
            raise InvalidInputError("an MLA pool has kv_buffer, not k_buffer")
        return self.buffers[0]

    @property
    def v_buffer(self) -> list[torch.Tensor]:
        if self.layout.mla:
            raise InvalidInputError("an MLA pool has kv_buffer, not v_buffer")
        return self.buffers[1]

    @property
    def kv_buffer(self) -> list[torch.Tensor]:
        if not self.layout.mla:
            raise InvalidInputError("an MHA pool has k_buffer and v_buffer, not kv_buffer")
        return self.buffers[0]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.token_bytes

    def __repr__(self) -> str:
        return f"DeviceKVPool({self.layout.describe()}, num_slots={self.num_slots}, device={self.device})"


def _check_disjoint(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse buffers that share memory: a write to one layer (or to K) would land in another.

    The same tensor passed twice, overlapping views of one storage, or two
    storages over one block of memory (``from_numpy`` or DLPack of the same
    array) all alias. Every buffer is contiguous (checked before), so it
    spans exactly ``[data_ptr, data_ptr + nbytes)`` of the device's address
    space: ``data_ptr`` is its storage's address plus its storage offset. So
    the check compares byte ranges, not tensor identity, and views of one
    stacked tensor that do not overlap (an engine's ``(L, slots, H, D)``
    tensor, one view per layer) pass. Sorted by start, one pass: O(n log n).

    Args:
        named: each buffer with the name the caller gave it (``"k_buffers[1]"``).

    Raises:
        InvalidInputError: two buffers overlap; the message names both.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, (_, t) in enumerate(named)
    )
    reach, holder = -1, -1  # the furthest end so far, and whose it is
    for start, end, i in spans:
        if start < reach:
            first, second = sorted((holder, i))
            raise InvalidInputError(
                f"{named[first][0]} and {named[second][0]} share memory: each layer's K and V "
                "need a buffer of their own, or writing one overwrites the other"
            )
        if end > reach:
            reach, holder = end, i


def host_page_buffer(
    view: memoryview,
    layout: KVLayout,
    host_layout: str,
    num_slots: int,
    slot: int,
    fmt: str,
) -> PageBuffer:
    """A zero-copy `PageBuffer` over one page of a flat host pool's bytes.

    ``view`` holds the pool as ``(B, L, num_slots, ...)`` (``layer_first``) or
    ``(B, num_slots, L, ...)`` (``page_first``) in C order, as `HostKVPool` and
    SGLang's host pools lay it out. The segments come in tiercache's page
    order: buffer by buffer, then (``layer_first``) layer by layer.

    Raises:
        InvalidInputError: ``slot`` is not an int (numpy integers are), or
            not the first slot of a page of the pool.
    """
    ps = layout.page_size
    slot = check_index(slot, "slot", num_slots)
    if slot % ps:
        raise InvalidInputError(f"slot {slot} is not the first slot of a page of this pool")
    tok = layout.token_layer_bytes
    L, B, n = layout.num_layers, layout.num_buffers, num_slots
    segs: list[memoryview] = []
    if host_layout == "page_first":
        run = ps * L * tok
        for b in range(B):
            off = (b * n + slot) * L * tok
            segs.append(view[off : off + run])
    else:
        run = ps * tok
        for b in range(B):
            for layer in range(L):
                off = ((b * L + layer) * n + slot) * tok
                segs.append(view[off : off + run])
    return PageBuffer(tuple(segs), layout.page_bytes, fmt)


def _whole_pages(num_slots: object, layout: KVLayout) -> int:
    """``num_slots`` once it is a positive int of whole pages of ``layout``."""
    n = check_positive(num_slots, "num_slots")
    if n % layout.page_size:
        raise InvalidInputError(f"num_slots={n} is not a multiple of page_size={layout.page_size}")
    return n


def _host_slots(layout: KVLayout, num_slots: object, size_bytes: object) -> object:
    """The slots a host pool asks for: ``num_slots``, or the whole pages in ``size_bytes``."""
    if (num_slots is None) == (size_bytes is None):
        raise InvalidInputError("give exactly one of num_slots and size_bytes")
    if size_bytes is None:
        return num_slots
    size = check_positive(size_bytes, "size_bytes")
    slots = size // layout.page_bytes * layout.page_size
    if slots == 0:
        raise InvalidInputError(
            f"size_bytes={size} is smaller than one page ({layout.page_bytes} bytes)"
        )
    return slots


class HostKVPool:
    """The L2 pool: one big host buffer, pinned when CUDA is present.

    ``layer_first`` holds ``(B, L, slots, H, D)``: one layer of many tokens is
    contiguous, which makes layer-by-layer loads one run per layer.
    ``page_first`` holds ``(B, slots, L, H, D)``: one page is one contiguous run
    per K/V buffer, so storage IO reads and writes pages in place (2 segments a
    page instead of ``2 * L``). ``B`` is 2 (K, V) for MHA and 1 for MLA.

    Args:
        layout: the model's KV layout.
        num_slots: token slots (a multiple of the page size); or give
        size_bytes: the memory to use instead, rounded down to whole pages.
        host_layout: ``"layer_first"`` or ``"page_first"``.
        pin_memory: page-lock the buffer (default: when CUDA is available).
            A pinned pool is allocated pageable and registered in place with
            ``cudaHostRegister``: it locks `pinned_bytes`, its size rounded up
            to a 4 KiB page (torch's caching host allocator would round it up
            to a power of two). Unlocked when the pool is garbage collected.
        device: the CUDA device the pool serves (its device pool's): the
            memory is registered, and later unregistered, in that device's
            context. Pass it when building the pool on a thread that never
            chose a device (``asyncio.to_thread``): otherwise the driver uses
            device 0 and creates a context there. ``None``: the calling
            thread's current device.

    Raises:
        InvalidInputError: bad sizes or layout name; ``pin_memory=True``
            without CUDA; a ``device`` that is not an indexed CUDA device.
        CapacityError: the pool does not fit in the host memory available.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int | None = None,
        *,
        size_bytes: int | None = None,
        host_layout: str = "layer_first",
        pin_memory: bool | None = None,
        device: torch.device | str | int | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if host_layout not in HOST_LAYOUTS:
            raise InvalidInputError(
                f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}"
            )
        num_slots = _whole_pages(_host_slots(layout, num_slots, size_bytes), layout)
        self.layout = layout
        self.num_slots = num_slots
        self.host_layout = host_layout
        need = num_slots * layout.token_bytes
        avail = available_host_memory()
        if need > avail * 0.9:
            raise CapacityError(
                f"a host pool of {need / 2**30:.2f} GiB does not fit: "
                f"{avail / 2**30:.2f} GiB of host memory is available"
            )
        self.pinned = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if self.pinned and not torch.cuda.is_available():
            raise InvalidInputError("pin_memory=True needs CUDA, which is not available")
        #: The CUDA device whose context page-locks the pool (``None``: the
        #: creating thread's current device).
        self.device: torch.device | None = None
        if device is not None:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if dev.type != "cuda" or dev.index is None:
                raise InvalidInputError(f"device must be an indexed CUDA device, got {device!r}")
            self.device = dev
        B, L, H, D = layout.num_buffers, layout.num_layers, layout.num_kv_heads, layout.head_dim
        shape = (B, L, num_slots, H, D) if host_layout == "layer_first" else (B, num_slots, L, H, D)
        #: Bytes page-locked for this pool (0 when not pinned): the buffer
        #: rounded up to whole host pages, never to a power of two.
        self.pinned_bytes = 0
        try:
            if self.pinned:
                self.buffer, self.pinned_bytes = _registered_buffer(
                    shape, layout.dtype, need, self.device
                )
                weakref.finalize(self, _unregister, self.buffer, self.device)
            else:
                self.buffer = torch.empty(shape, dtype=layout.dtype)
        except (RuntimeError, MemoryError) as e:  # out of memory, pinning refused
            raise CapacityError(
                f"cannot allocate a host pool of {need / 2**30:.2f} GiB: {e}"
            ) from e
        self._bytes = self.buffer.view(-1).view(torch.uint8)
        self._view: memoryview = memoryview(self._bytes.numpy())  # type: ignore[arg-type]
        self.format = f"{layout.describe()}:{host_layout}"
        logger.debug(
            "host pool %s: %d slots, %.2f GiB, pinned=%s",
            self.format,
            num_slots,
            need / 2**30,
            self.pinned,
        )

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.token_bytes

    def layer(self, b: int, layer: int) -> torch.Tensor:
        """The ``(num_slots, H, D)`` view of buffer ``b`` (0 = K/latent, 1 = V), one layer.

        Contiguous in ``layer_first``; strided (one token every ``L*H*D``
        elements) in ``page_first``.

        Raises:
            InvalidInputError: ``b`` or ``layer`` is not an int (numpy
                integers are) of the pool: no negative index from the end.
        """
        b = check_index(b, "b", self.layout.num_buffers)
        layer = check_index(layer, "layer", self.layout.num_layers)
        if self.host_layout == "layer_first":
            return self.buffer[b, layer]
        return self.buffer[b, :, layer]

    def tokens(self, b: int, start: int, stop: int) -> torch.Tensor:
        """All layers of slots ``[start, stop)`` of buffer ``b``: ``(L, n, H, D)`` or ``(n, L, H, D)``.

        Raises:
            InvalidInputError: ``b`` is not a buffer of the pool, or ``start``
                and ``stop`` are not ints with ``0 <= start <= stop <=
                num_slots`` (numpy integers are ints).
        """
        b = check_index(b, "b", self.layout.num_buffers)
        start = check_index(start, "start", self.num_slots + 1)
        stop = check_index(stop, "stop", self.num_slots + 1)
        if start > stop:
            raise InvalidInputError(f"start={start} is after stop={stop}")
        if self.host_layout == "layer_first":
            return self.buffer[b, :, start:stop]
        return self.buffer[b, start:stop]

    def page_buffer(self, slot: int) -> PageBuffer:
        """A zero-copy `PageBuffer` over the page that starts at slot ``slot``.

        Raises:
            InvalidInputError: ``slot`` is not an int (numpy integers are), or
                not the first slot of a page of the pool.
        """
        return host_page_buffer(
            self._view, self.layout, self.host_layout, self.num_slots, slot, self.format
        )

    def page_buffers(self, host_indices: torch.Tensor) -> list[PageBuffer]:
        """One `PageBuffer` per page of ``host_indices`` (page-aligned slots of this pool)."""
        cpu = check_slot_indices(
            host_indices, self.layout.page_size, self.num_slots, "host_indices"
        )
        return [self.page_buffer(s) for s in cpu[:: self.layout.page_size].tolist()]

    def __repr__(self) -> str:
        return f"HostKVPool({self.format}, num_slots={self.num_slots}, pinned={self.pinned})"
