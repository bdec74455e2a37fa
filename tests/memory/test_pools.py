import numpy as np
import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout
from tiercache.errors import CapacityError, InvalidInputError
from tiercache.memory import PageBuffer


def test_layout_sizes() -> None:
    lay = KVLayout(4, 8, 128, torch.float16, 64)
    assert lay.token_layer_bytes == 8 * 128 * 2
    assert lay.token_bytes == 2 * 4 * 8 * 128 * 2
    assert lay.page_bytes == 64 * lay.token_bytes
    mla = KVLayout(4, 1, 576, torch.bfloat16, 64, mla=True)
    assert mla.num_buffers == 1 and mla.token_bytes == 4 * 576 * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_layers=0, num_kv_heads=1, head_dim=8),
        dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=0),
        dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.int64),
        dict(num_layers=1, num_kv_heads=2, head_dim=8, mla=True),
        dict(num_layers=1.0, num_kv_heads=1, head_dim=8),
    ],
)
def test_layout_rejects_bad_fields(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_device_pool_buffers_mha_and_mla() -> None:
    lay = KVLayout(3, 2, 8, torch.float16, 16)
    pool = DeviceKVPool(lay, 64)
    assert len(pool.k_buffer) == 3 and pool.k_buffer[0].shape == (64, 2, 8)
    assert pool.v_buffer[2].dtype == torch.float16
    with pytest.raises(InvalidInputError):
        _ = pool.kv_buffer
    mla = DeviceKVPool(KVLayout(3, 1, 24, torch.float16, 16, mla=True), 64)
    assert mla.kv_buffer[1].shape == (64, 1, 24)
    with pytest.raises(InvalidInputError):
        _ = mla.k_buffer


@pytest.mark.parametrize("mla", [False, True])
def test_a_cpu_device_pool_holds_every_buffer_in_one_joint_tensor(mla: bool) -> None:
    lay = KVLayout(3, 1 if mla else 2, 8, torch.float16, 16, mla=mla)
    pool = DeviceKVPool(lay, 64)
    assert pool.joint is not None and pool.stacked is not None
    assert pool.joint.shape == (lay.num_buffers, 3, 64, lay.num_kv_heads, 8)
    assert pool.joint.is_contiguous() and len(pool.stacked) == lay.num_buffers
    for b in range(lay.num_buffers):
        assert pool.stacked[b].shape == (3, 64, lay.num_kv_heads, 8)
        for x in range(3):
            # The per-layer buffers are views of it: writes to one show in the other.
            assert pool.buffers[b][x].data_ptr() == pool.joint[b, x].data_ptr()
            assert pool.buffers[b][x].is_contiguous()
    pool.buffers[-1][2][5].fill_(3)
    assert torch.equal(pool.joint[-1, 2, 5], torch.full((lay.num_kv_heads, 8), 3.0).half())
    assert int(pool.joint.count_nonzero()) == lay.num_kv_heads * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_pool_has_no_joint_tensor() -> None:
    pool = DeviceKVPool(KVLayout(2, 2, 8, torch.float16, 16), 32, "cuda")
    assert pool.joint is None and pool.stacked is not None


def test_device_pool_wraps_engine_tensors() -> None:
    lay = KVLayout(2, 2, 8, torch.float32, 16)
    ks = [torch.zeros(32, 2, 8) for _ in range(2)]
    vs = [torch.zeros(32, 2, 8) for _ in range(2)]
    pool = DeviceKVPool(lay, 32, k_buffers=ks, v_buffers=vs)
    assert pool.k_buffer[1] is ks[1] and pool.stacked is None and pool.joint is None
    with pytest.raises(InvalidInputError):
        DeviceKVPool(lay, 32, k_buffers=ks, v_buffers=[torch.zeros(32, 2, 4)] * 2)
    with pytest.raises(InvalidInputError):
        DeviceKVPool(lay, 32, k_buffers=ks, v_buffers=[t.half() for t in vs])
    with pytest.raises(InvalidInputError):
        DeviceKVPool(lay, 32, k_buffers=ks)


def test_a_device_pool_beyond_the_device_memory_is_a_capacity_error() -> None:
    lay = KVLayout(2, 2, 8, torch.float32, 16)
    with pytest.raises(CapacityError, match="device pool"):
        DeviceKVPool(lay, 1 << 50)  # 128 PiB: more than any address space


def test_host_pool_layouts_and_sizes() -> None:
    lay = KVLayout(2, 2, 4, torch.bfloat16, 16)
    lf = HostKVPool(lay, 64)
    pf = HostKVPool(lay, 64, host_layout="page_first")
    assert lf.buffer.shape == (2, 2, 64, 2, 4) and pf.buffer.shape == (2, 64, 2, 2, 4)
    by_bytes = HostKVPool(lay, size_bytes=3 * lay.page_bytes + 5)
    assert by_bytes.num_slots == 48
    with pytest.raises(InvalidInputError):
        HostKVPool(lay, 64, host_layout="token_first")
    with pytest.raises(InvalidInputError):
        HostKVPool(lay, 60)
    with pytest.raises(InvalidInputError):
        HostKVPool(lay, 64, size_bytes=100)
    with pytest.raises(CapacityError):
        HostKVPool(lay, size_bytes=1 << 50)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_page_buffer_is_a_zero_copy_view_of_one_page(host_layout: str) -> None:
    lay = KVLayout(3, 2, 4, torch.float16, 16)
    pool = HostKVPool(lay, 64, host_layout=host_layout)
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    page = pool.page_buffer(16)
    assert page.nbytes == lay.page_bytes
    assert len(page.segments) == (2 if host_layout == "page_first" else 6)
    # The page's bytes are exactly the page's K and V of every layer.
    expect = b"".join(
        pool.layer(b, layer)[16:32].contiguous().view(torch.uint8).numpy().tobytes()
        for b in range(2)
        for layer in range(3)
    )
    got = page.tobytes()
    assert sorted(got) == sorted(expect)
    if host_layout == "layer_first":
        assert got == expect
    # Writing through the view changes the pool, and only that page.
    before = pool.buffer.clone()
    page.write(bytes(page.nbytes))
    assert bool((pool.tokens(0, 16, 32) == 0).all()) and bool((pool.tokens(1, 16, 32) == 0).all())
    assert torch.equal(
        pool.tokens(0, 0, 16),
        before[0, :, 0:16] if host_layout == "layer_first" else before[0, 0:16],
    )
    with pytest.raises(InvalidInputError):
        pool.page_buffer(8)
    with pytest.raises(InvalidInputError):
        page.write(b"short")


_NOT_AN_INDEX = [4.0, 0.0, 16.0, True, False, "0", None, np.float64(16.0)]


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_host_pool_views_refuse_what_is_not_an_index_of_the_pool(host_layout: str) -> None:
    """A slot, buffer or layer must be an int inside the pool (numpy ints
    are ints): a float or bool is an `InvalidInputError`, never a TypeError
    or a silent view of another slot, buffer or layer (``False`` is slot 0,
    ``-1`` the last layer, to a tensor)."""
    lay = KVLayout(2, 2, 4, torch.float16, 16)
    pool = HostKVPool(lay, 64, host_layout=host_layout)
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    for bad in [*_NOT_AN_INDEX, -16, 8, 64]:
        with pytest.raises(InvalidInputError):
            pool.page_buffer(bad)  # type: ignore[arg-type]
    for b, layer in [(2, 0), (-1, 0), (0, 2), (0, -1), (True, 0), (0, 1.0), (0.0, 0)]:
        with pytest.raises(InvalidInputError):
            pool.layer(b, layer)  # type: ignore[arg-type]
    for b, start, stop in [
        (2, 0, 16),
        (-1, 0, 16),
        (0, -4, 4),
        (0, 8, 4),
        (0, 0, 65),
        (0, 4.0, 8),
        (0, True, 4),
        (False, 0, 4),
    ]:
        with pytest.raises(InvalidInputError):
            pool.tokens(b, start, stop)  # type: ignore[arg-type]
    # numpy integers are ints, as everywhere else.
    assert pool.page_buffer(np.int64(16)).tobytes() == pool.page_buffer(16).tobytes()
    assert pool.page_buffer(np.int32(0)).tobytes() == pool.page_buffer(0).tobytes()
    assert torch.equal(pool.layer(np.int64(1), np.int32(1)), pool.layer(1, 1))
    assert torch.equal(pool.tokens(np.int64(1), np.int64(16), np.int64(32)), pool.tokens(1, 16, 32))
    assert pool.tokens(0, 64, 64).numel() == 0  # an empty run at the end is a run


def test_standalone_page_buffer() -> None:
    p = PageBuffer.from_bytes(b"abc", "f")
    assert p.tobytes() == b"abc" and p.nbytes == 3
    q = PageBuffer.allocate(3, "f")
    q.write(b"xyz")
    assert q.tobytes() == b"xyz"


def test_wrapped_buffers_may_come_as_one_stacked_tensor_per_kv() -> None:
    lay = KVLayout(2, 2, 4, torch.float16, 4)
    k, v = (
        torch.zeros(2, 16, 2, 4, dtype=torch.float16),
        torch.zeros(2, 16, 2, 4, dtype=torch.float16),
    )
    pool = DeviceKVPool(lay, 16, k_buffers=k, v_buffers=v)  # type: ignore[arg-type]
    pool.k_buffer[1][3] = 1.0
    assert k[1, 3].eq(1.0).all()
    with pytest.raises(InvalidInputError):
        DeviceKVPool(lay, 16, k_buffers=k[:1], v_buffers=v[:1])  # type: ignore[arg-type]


def _mha(n: int = 2) -> KVLayout:
    return KVLayout(n, 2, 4, torch.float16, 4)


def _bufs(n: int = 2, slots: int = 16) -> list[torch.Tensor]:
    return [torch.zeros(slots, 2, 4, dtype=torch.float16) for _ in range(n)]


def test_one_tensor_wrapped_for_two_layers_is_refused_naming_both() -> None:
    ks, vs = _bufs(), _bufs()
    with pytest.raises(InvalidInputError, match=r"k_buffers\[0\] and k_buffers\[1\]"):
        DeviceKVPool(_mha(), 16, k_buffers=[ks[0], ks[0]], v_buffers=vs)


def test_one_tensor_wrapped_for_k_and_v_is_refused_naming_both() -> None:
    ks, vs = _bufs(), _bufs()
    with pytest.raises(InvalidInputError, match=r"k_buffers\[1\] and v_buffers\[0\]"):
        DeviceKVPool(_mha(), 16, k_buffers=ks, v_buffers=[ks[1], vs[1]])


def test_overlapping_views_of_one_storage_are_refused() -> None:
    # Two (16, 2, 4) windows of one flat storage, 8 slots apart: they share 8 slots.
    flat = torch.zeros(24 * 2 * 4, dtype=torch.float16)
    a = flat[: 16 * 8].view(16, 2, 4)
    b = flat[8 * 8 : 24 * 8].view(16, 2, 4)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    with pytest.raises(InvalidInputError, match=r"v_buffers\[0\] and v_buffers\[1\]"):
        DeviceKVPool(_mha(), 16, k_buffers=_bufs(), v_buffers=[a, b])


def test_distinct_storages_over_the_same_memory_are_refused() -> None:
    # Two tensors, two storages, one block of memory (as from_numpy or DLPack give).
    arr = np.zeros((16, 2, 4), dtype=np.float16)
    a, b = torch.from_numpy(arr), torch.from_numpy(arr)
    assert a.untyped_storage() is not b.untyped_storage()
    with pytest.raises(InvalidInputError, match="share memory"):
        DeviceKVPool(_mha(), 16, k_buffers=[a, _bufs(1)[0]], v_buffers=[_bufs(1)[0], b])


def test_mla_layers_over_one_tensor_are_refused() -> None:
    lay = KVLayout(2, 1, 8, torch.float16, 4, mla=True)
    t = torch.zeros(16, 1, 8, dtype=torch.float16)
    with pytest.raises(InvalidInputError, match=r"kv_buffers\[0\] and kv_buffers\[1\]"):
        DeviceKVPool(lay, 16, kv_buffers=[t, t])


def test_disjoint_views_of_one_storage_are_accepted() -> None:
    # One (2, L, slots, H, D) tensor for K and V, as an engine may allocate: every
    # layer of both is a view of it, none overlapping another.
    joint = torch.zeros(2, 2, 16, 2, 4, dtype=torch.float16)
    pool = DeviceKVPool(_mha(), 16, k_buffers=list(joint[0]), v_buffers=list(joint[1]))
    pool.v_buffer[0][5] = 2.0
    assert joint[1, 0, 5].eq(2.0).all() and int(joint.count_nonzero()) == 8
    # Adjacent windows of one flat storage touch but do not overlap.
    flat = torch.zeros(4 * 16 * 8, dtype=torch.float16)
    views = [flat[i * 128 : (i + 1) * 128].view(16, 2, 4) for i in range(4)]
    DeviceKVPool(_mha(), 16, k_buffers=views[:2], v_buffers=views[2:])
