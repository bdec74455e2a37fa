"""The tiny transformer: paged attention over the device pool equals plain attention."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, PageAllocator
from tiercache.errors import CapacityError, ConfigError, InvalidInputError, StorageError
from tiercache.models import SequenceInput, TinyCausalLM, TinyConfig


def assert_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within float32 rounding: 1e-5 absolute and relative."""
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


PAGE = 4
SLOTS = 256


def make(
    page_size: int = PAGE, num_slots: int = SLOTS, **config: Any
) -> tuple[TinyCausalLM, DeviceKVPool]:
    cfg = TinyConfig(**config)
    return TinyCausalLM(cfg), DeviceKVPool(cfg.kv_layout(page_size), num_slots)


def tokens(n: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


# ---------------------------------------------------------------- config


def test_config_kv_layout_matches_the_model() -> None:
    cfg = TinyConfig(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    lay = cfg.kv_layout(16)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.page_size, lay.mla) == (
        3,
        2,
        16,
        torch.float16,
        16,
        False,
    )


def test_config_rejects_bad_values() -> None:
    for bad in (
        {"num_heads": 4, "num_kv_heads": 3},
        {"head_dim": 15},
        {"num_layers": 0},
        {"vocab_size": True},
        {"dtype": torch.int8},
        {"rope_base": 0.0},
        {"seed": 1.5},
        {"tie_embeddings": 1},
    ):
        with pytest.raises(ConfigError):
            TinyConfig(**bad)
            pytest.fail(f"{bad}: accepted")


def test_weights_are_deterministic_from_the_seed() -> None:
    toks = tokens(12)
    a = TinyCausalLM(TinyConfig(seed=3)).reference_forward(toks)
    b = TinyCausalLM(TinyConfig(seed=3)).reference_forward(toks)
    c = TinyCausalLM(TinyConfig(seed=4)).reference_forward(toks)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c, atol=1e-2)


def test_tied_embeddings() -> None:
    model, pool = make(tie_embeddings=True)
    assert model.lm_head is model.embed
    assert model.num_parameters == TinyCausalLM(TinyConfig()).num_parameters - 512 * 128
    toks = tokens(15, seed=20)
    assert_fp32(model.prefill(pool, toks, slots(0, 15)), model.reference_forward(toks))


# ------------------------------------------------------- paged attention


def test_paged_prefill_equals_reference_forward() -> None:
    model, pool = make()
    toks = tokens(37)
    logits = model.prefill(pool, toks, slots(8, 37))
    assert logits.dtype == torch.float32 and logits.shape == (37, 512)
    assert_fp32(logits, model.reference_forward(toks))
    # The K/V of every layer landed in the given slots, and nowhere else.
    for layer in range(model.config.num_layers):
        assert bool(pool.k_buffer[layer][8:45].abs().sum(-1).gt(0).all())
        assert not bool(pool.k_buffer[layer][:8].any()) and not bool(
            pool.v_buffer[layer][45:].any()
        )


@pytest.mark.parametrize("split", [1, 4, 13, 36])
def test_prefix_then_suffix_equals_one_full_prefill(split: int) -> None:
    model, pool = make()
    toks = tokens(37, seed=2)
    full = model.prefill(pool, toks, slots(0, 37))
    head = model.prefill(pool, toks[:split], slots(64, split))
    tail = model.prefill(pool, toks[split:], slots(128, 37 - split), prefix_slots=slots(64, split))
    assert_fp32(torch.cat([head, tail]), full)
    for layer in range(model.config.num_layers):
        got_k = torch.cat(
            [pool.k_buffer[layer][64 : 64 + split], pool.k_buffer[layer][128 : 165 - split]]
        )
        assert_fp32(got_k, pool.k_buffer[layer][:37])


def test_prefix_computed_in_another_pool_and_copied_in_gives_the_same_logits() -> None:
    # What a cache does: the prefix KV comes from elsewhere (here a second
    # pool, at different slots), is copied into free slots, and the suffix
    # reads it from there.
    model, pool = make()
    _, other = make()
    toks = tokens(30, seed=3)
    full = model.prefill(pool, toks, slots(0, 30))
    model.prefill(other, toks[:16], slots(200, 16))
    for layer in range(model.config.num_layers):
        pool.k_buffer[layer][100:116] = other.k_buffer[layer][200:216]
        pool.v_buffer[layer][100:116] = other.v_buffer[layer][200:216]
    tail = model.prefill(pool, toks[16:], slots(40, 14), prefix_slots=slots(100, 16))
    assert_fp32(tail, full[16:])


def test_scattered_pages_give_the_same_result() -> None:
    model, pool = make()
    toks = tokens(40, seed=4)
    ref = model.reference_forward(toks)
    page_ids = torch.randperm(SLOTS // PAGE, generator=torch.Generator().manual_seed(0))[:10]
    scattered = (page_ids[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    assert not bool((scattered.diff() == 1).all())
    assert_fp32(model.prefill(pool, toks, scattered), ref)
    # And split across scattered pages: prefix in 6 pages, suffix in the rest.
    _, pool2 = make()
    model.prefill(pool2, toks[:24], scattered[:24])
    tail = model.prefill(pool2, toks[24:], scattered[24:], prefix_slots=scattered[:24])
    assert_fp32(tail, ref[24:])


def test_decode_steps_equal_reference_rows() -> None:
    model, pool = make()
    toks = tokens(12, seed=5)
    ref = model.reference_forward(toks)
    model.prefill(pool, toks[:8], slots(0, 8))
    for i in range(8, 12):
        row = model.decode_step(
            pool, int(toks[i]), 50 + i, torch.cat([slots(0, 8), slots(58, i - 8)])
        )
        assert row.shape == (512,)
        assert_fp32(row, ref[i])


def test_explicit_positions_are_used() -> None:
    model, pool = make()
    toks = tokens(10, seed=6)
    default = model.prefill(pool, toks, slots(0, 10))
    same = model.prefill(pool, toks, slots(20, 10), positions=torch.arange(10))
    shifted = model.prefill(pool, toks, slots(40, 10), positions=torch.arange(1000, 1010))
    spread = model.prefill(pool, toks, slots(60, 10), positions=torch.arange(0, 30, 3))
    assert_fp32(same, default)
    # Rotary attention depends on relative positions only: a uniform shift
    # changes nothing but rounding, a different spacing changes the logits.
    torch.testing.assert_close(shifted, default, atol=1e-3, rtol=0)
    assert not torch.allclose(spread[1:], default[1:], atol=1e-2)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_attention(num_kv_heads: int) -> None:
    model, pool = make(num_heads=4, num_kv_heads=num_kv_heads)
    assert pool.k_buffer[0].shape == (SLOTS, num_kv_heads, 32)
    toks = tokens(21, seed=7)
    ref = model.reference_forward(toks)
    head = model.prefill(pool, toks[:9], slots(0, 9))
    tail = model.prefill(pool, toks[9:], slots(100, 12), prefix_slots=slots(0, 9))
    assert_fp32(torch.cat([head, tail]), ref)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 2e-2), (torch.bfloat16, 1.5e-1)])
def test_half_precision_within_tolerance(dtype: torch.dtype, atol: float) -> None:
    # Stated tolerances on logits of spread ~1: fp16 2e-2, bf16 0.15, against
    # the same model in float32. The split property holds within the same.
    model, pool = make(dtype=dtype)
    ref32 = TinyCausalLM(TinyConfig()).reference_forward(toks := tokens(33, seed=8))
    assert pool.k_buffer[0].dtype == dtype
    full = model.prefill(pool, toks, slots(0, 33))
    torch.testing.assert_close(full, ref32, atol=atol, rtol=0)
    torch.testing.assert_close(full, model.reference_forward(toks), atol=atol, rtol=0)
    tail = model.prefill(pool, toks[20:], slots(64, 13), prefix_slots=slots(0, 20))
    torch.testing.assert_close(tail, full[20:], atol=atol, rtol=0)


def test_batched_forward_equals_one_sequence_at_a_time() -> None:
    model, pool = make()
    shared = tokens(8, seed=9)
    a, b = tokens(5, seed=10), tokens(7, seed=11)
    model.prefill(pool, shared, slots(0, 8))
    out = model.forward(
        pool,
        [
            SequenceInput(a, slots(16, 5), slots(0, 8)),
            SequenceInput(b, slots(32, 7), slots(0, 8)),
            SequenceInput(shared[:3], slots(48, 3)),
        ],
    )
    ref_a = model.reference_forward(torch.cat([shared, a]))[8:]
    ref_b = model.reference_forward(torch.cat([shared, b]))[8:]
    assert_fp32(out[0], ref_a)
    assert_fp32(out[1], ref_b)
    assert_fp32(out[2], model.reference_forward(shared[:3]))


def test_concurrent_calls_from_worker_threads() -> None:
    model, pool = make()
    inputs = [(tokens(20, seed=s), slots(32 * s, 20)) for s in range(4)]
    with ThreadPoolExecutor(2, thread_name_prefix="tiercache-test") as ex:
        outs = list(ex.map(lambda ts: model.prefill(pool, ts[0], ts[1]), inputs))
    for (toks, _), out in zip(inputs, outs, strict=True):
        assert_fp32(out, model.reference_forward(toks))


# ------------------------------------------------------------ layer waits


def test_layer_ready_gates_each_layer_until_its_kv_has_landed() -> None:
    """A filler thread copies the prefix KV in layer by layer, only when asked.

    Layer ``i`` of the target pool holds zeros until ``layer_ready(i)`` was
    called, so a forward pass that read layer ``i`` any earlier would attend
    to zeros and give different logits.
    """
    model, target = make()
    _, source = make()
    num_layers = model.config.num_layers
    toks = tokens(26, seed=12)
    prefix, new = slots(0, 16), slots(64, 10)
    model.prefill(source, toks[:16], prefix)
    expected = model.prefill(source, toks[16:], slots(128, 10), prefix_slots=prefix)

    requested = [threading.Event() for _ in range(num_layers)]
    landed = [threading.Event() for _ in range(num_layers)]
    calls: list[int] = []
    seen: list[tuple[bool, bool, bool]] = []

    def fill() -> None:
        for i in range(num_layers):
            if not requested[i].wait(timeout=10):
                return
            target.k_buffer[i][prefix] = source.k_buffer[i][prefix]
            target.v_buffer[i][prefix] = source.v_buffer[i][prefix]
            landed[i].set()

    def layer_ready(i: int) -> None:
        calls.append(i)
        seen.append(
            (
                # the previous layer already wrote its new K/V ...
                i == 0 or bool(target.k_buffer[i - 1][new].any()),
                # ... this one has not touched the pool yet ...
                not bool(target.k_buffer[i][new].any()),
                # ... and its prefix has not landed yet.
                not bool(target.k_buffer[i][prefix].any()),
            )
        )
        requested[i].set()
        assert landed[i].wait(timeout=10)

    filler = threading.Thread(target=fill, name="tiercache-test-filler")
    filler.start()
    try:
        got = model.prefill(target, toks[16:], new, prefix_slots=prefix, layer_ready=layer_ready)
    finally:
        for ev in requested:
            ev.set()
        filler.join()
    assert calls == list(range(num_layers))
    assert seen == [(True, True, True)] * num_layers
    assert_fp32(got, expected)


def test_layer_ready_with_events_set_by_a_loading_thread() -> None:
    # The shape a controller gives: a loader fills layers in order on its own
    # schedule and sets one event per layer; the forward waits on each.
    model, target = make()
    _, source = make()
    num_layers = model.config.num_layers
    toks = tokens(20, seed=13)
    prefix = slots(0, 12)
    model.prefill(source, toks[:12], prefix)
    expected = model.prefill(source, toks[12:], slots(100, 8), prefix_slots=prefix)
    done = [threading.Event() for _ in range(num_layers)]
    order: list[int] = []

    def load() -> None:
        for i in range(num_layers):
            target.k_buffer[i][prefix] = source.k_buffer[i][prefix]
            target.v_buffer[i][prefix] = source.v_buffer[i][prefix]
            done[i].set()

    def wait_layer(i: int) -> None:
        assert done[i].wait(timeout=10)
        order.append(i)

    loader = threading.Thread(target=load, name="tiercache-test-loader")
    loader.start()
    try:
        got = model.prefill(target, toks[12:], slots(40, 8), prefix, layer_ready=wait_layer)
    finally:
        loader.join()
    assert order == list(range(num_layers))
    assert_fp32(got, expected)


# ---------------------------------------------------------------- generate


def test_generate_is_deterministic_and_equal_with_a_reused_prefix() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)
    prompt = tokens(22, seed=14).tolist()
    first = model.generate(pool, alloc, prompt, 12)
    assert len(first.generated) == 12
    # A fresh model and pool give the same tokens.
    other_model, other_pool = make()
    again = other_model.generate(other_pool, PageAllocator(SLOTS, PAGE), prompt, 12)
    assert again.generated == first.generated

    # Reuse the first 20 prompt tokens' KV (5 whole pages) from the first run.
    prefix = first.slots[:20]
    reused = model.generate(pool, alloc, prompt, 12, prefix_slots=prefix)
    assert reused.generated == first.generated
    assert reused.num_prefix == 20 and torch.equal(reused.slots[:20], prefix)
    assert not bool(torch.isin(reused.allocated, first.allocated).any())
    # The prefix pages were only read.
    assert alloc.is_allocated(first.allocated)


def test_generate_slot_bookkeeping() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)
    prompt = tokens(10, seed=15).tolist()
    res = model.generate(pool, alloc, prompt, 7)
    # prompt + 6 fed-back tokens have KV: 16 tokens, 4 pages, none partial.
    assert res.kv_token_ids == prompt + res.generated[:-1]
    assert res.slots.dtype == torch.int64 and res.slots.numel() == 16
    assert torch.equal(res.slots, res.allocated)
    assert res.num_full_page_tokens == 16 and res.partial_page_slots.numel() == 0
    assert alloc.used == 16
    # The pool really holds that KV: the next token computed over those slots
    # matches plain attention over the whole sequence.
    nxt = model.decode_step(pool, res.generated[-1], 200, res.slots)
    ref = model.reference_forward(res.kv_token_ids + [res.generated[-1]])[-1]
    assert_fp32(nxt, ref)
    # Greedy: each generated token is the argmax after the tokens before it.
    expected = model.reference_forward(res.kv_token_ids)[9:].argmax(-1).tolist()
    assert res.generated == expected

    res2 = model.generate(pool, alloc, prompt, 3, prefix_slots=res.slots[:8])
    # 10 prompt + 2 fed back = 12 KV tokens: 8 reused, 4 computed in one new page.
    assert res2.slots.numel() == 12 and res2.allocated.numel() == 4
    assert res2.num_full_page_tokens == 12
    res3 = model.generate(pool, alloc, prompt, 2)
    # 11 KV tokens in 3 pages; the last page holds 3 of them.
    assert res3.allocated.numel() == 12 and res3.slots.numel() == 11
    assert torch.equal(res3.slots, res3.allocated[:11])
    assert res3.num_full_page_tokens == 8 and torch.equal(
        res3.partial_page_slots, res3.allocated[8:]
    )
    for r in (res, res2, res3):
        alloc.free(r.allocated)
    assert alloc.available == SLOTS


def test_generate_zero_tokens_computes_the_prompt_only() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)
    prompt = tokens(9, seed=16).tolist()
    res = model.generate(pool, alloc, prompt, 0)
    assert res.generated == [] and res.kv_token_ids == prompt and res.slots.numel() == 9
    assert res.allocated.numel() == 12
    logits = model.prefill(pool, [prompt[-1]], slots(200, 1), prefix_slots=res.slots[:8])
    assert_fp32(logits[0], model.reference_forward(prompt)[-1])


def test_generate_stops_at_the_stop_token() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)
    prompt = tokens(6, seed=17).tolist()
    full = model.generate(pool, alloc, prompt, 8)
    stop = full.generated[3]
    cut = model.generate(pool, alloc, prompt, 8, stop_token_id=stop)
    assert cut.generated == full.generated[: full.generated.index(stop) + 1]
    assert cut.slots.numel() == len(prompt) + len(cut.generated) - 1


def test_generate_out_of_pages_frees_what_it_took() -> None:
    model, pool = make(num_slots=32)
    alloc = PageAllocator(32, PAGE)
    held = alloc.alloc(16)
    assert held is not None
    with pytest.raises(CapacityError):
        model.generate(pool, alloc, tokens(10, seed=18).tolist(), 20)
    assert alloc.available == 16


def test_generate_frees_its_pages_when_a_layer_wait_fails() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)

    def failing(i: int) -> None:
        if i == 2:
            raise StorageError("load failed")

    with pytest.raises(StorageError):
        model.generate(pool, alloc, tokens(10, seed=19).tolist(), 4, layer_ready=failing)
    assert alloc.available == SLOTS


# ------------------------------------------------------------- bad inputs


def bad_prefill_cases() -> list[tuple[str, Callable[[TinyCausalLM, DeviceKVPool], object]]]:
    t = tokens(4)
    return [
        ("int32 slots", lambda m, p: m.prefill(p, t, slots(0, 4).int())),
        ("float slots", lambda m, p: m.prefill(p, t, slots(0, 4).float())),
        ("list slots", lambda m, p: m.prefill(p, t, [0, 1, 2, 3])),
        ("2-D slots", lambda m, p: m.prefill(p, t, slots(0, 4).view(2, 2))),
        ("too few slots", lambda m, p: m.prefill(p, t, slots(0, 3))),
        ("too many slots", lambda m, p: m.prefill(p, t, slots(0, 5))),
        ("slot past the end", lambda m, p: m.prefill(p, t, slots(SLOTS - 2, 4))),
        ("negative slot", lambda m, p: m.prefill(p, t, slots(-1, 4))),
        ("repeated slot", lambda m, p: m.prefill(p, t, torch.tensor([0, 1, 1, 2]))),
        ("prefix out of range", lambda m, p: m.prefill(p, t, slots(0, 4), slots(SLOTS, 1))),
        ("prefix int32", lambda m, p: m.prefill(p, t, slots(0, 4), slots(8, 2).int())),
        ("prefix overlaps new", lambda m, p: m.prefill(p, t, slots(0, 4), slots(3, 2))),
        ("token past vocab", lambda m, p: m.prefill(p, [1, 2, 3, 512], slots(0, 4))),
        ("negative token", lambda m, p: m.prefill(p, [1, -2, 3, 4], slots(0, 4))),
        ("float tokens", lambda m, p: m.prefill(p, t.float(), slots(0, 4))),
        ("no tokens", lambda m, p: m.prefill(p, [], slots(0, 0))),
        ("positions length", lambda m, p: m.prefill(p, t, slots(0, 4), positions=torch.arange(3))),
        (
            "positions int32",
            lambda m, p: m.prefill(p, t, slots(0, 4), positions=torch.arange(4).int()),
        ),
        ("bool new_slot", lambda m, p: m.decode_step(p, 1, True, None)),
        (
            "batch writes one slot twice",
            lambda m, p: m.forward(
                p, [SequenceInput(t, slots(0, 4)), SequenceInput(t, slots(3, 4))]
            ),
        ),
        (
            "batch reads what another writes",
            lambda m, p: m.forward(
                p, [SequenceInput(t, slots(0, 4)), SequenceInput(t, slots(8, 4), slots(2, 1))]
            ),
        ),
        ("empty batch", lambda m, p: m.forward(p, [])),
    ]


def test_bad_inputs_raise_before_the_pool_is_touched() -> None:
    # One test over every case (a fresh pool each): the cases are cheap and
    # many, and each names itself on failure.
    for name, call in bad_prefill_cases():
        model, pool = make()
        with pytest.raises(InvalidInputError):
            call(model, pool)
            pytest.fail(f"{name}: no error")
        assert not any(bool(b.any()) for b in pool.k_buffer + pool.v_buffer), name


def test_a_pool_of_another_layout_is_refused() -> None:
    model = TinyCausalLM(TinyConfig())
    for other in (
        {"dtype": torch.float16},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_dim": 16},
    ):
        pool = DeviceKVPool(TinyConfig(**other).kv_layout(PAGE), SLOTS)
        with pytest.raises(InvalidInputError, match="does not match"):
            model.prefill(pool, [1, 2], slots(0, 2))
    with pytest.raises(InvalidInputError, match="DeviceKVPool"):
        model.prefill(object(), [1, 2], slots(0, 2))  # type: ignore[arg-type]


def test_generate_rejects_bad_prefixes_and_allocators() -> None:
    model, pool = make()
    alloc = PageAllocator(SLOTS, PAGE)
    prompt = tokens(10).tolist()
    with pytest.raises(InvalidInputError, match="page"):
        model.generate(pool, alloc, prompt, 2, prefix_slots=slots(0, 6))
    with pytest.raises(InvalidInputError, match="page"):
        model.generate(pool, alloc, prompt, 2, prefix_slots=slots(2, 4))
    with pytest.raises(InvalidInputError, match="at least one"):
        model.generate(pool, alloc, prompt[:8], 2, prefix_slots=slots(0, 8))
    with pytest.raises(InvalidInputError):
        model.generate(pool, PageAllocator(SLOTS, 8), prompt, 2)
    with pytest.raises(InvalidInputError):
        model.generate(pool, alloc, prompt, -1)
    for count in (True, 2.0, "2"):
        with pytest.raises(InvalidInputError, match="max_new_tokens"):
            model.generate(pool, alloc, prompt, count)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="stop_token_id"):
        model.generate(pool, alloc, prompt, 2, stop_token_id=False)  # type: ignore[arg-type]
    assert alloc.available == SLOTS


def test_numpy_integers_are_ints_for_the_config_the_tokens_and_generate() -> None:
    np = pytest.importorskip("numpy")
    cfg = TinyConfig(num_layers=np.int64(2), seed=np.int32(3))
    assert type(cfg.num_layers) is int and type(cfg.seed) is int
    model = TinyCausalLM(cfg)
    pool = DeviceKVPool(cfg.kv_layout(PAGE), SLOTS)
    prompt = tokens(6).tolist()
    as_numpy = [np.int64(t) for t in prompt]
    logits = model.prefill(pool, as_numpy, slots(0, 6))
    assert_fp32(logits, model.reference_forward(prompt))
    alloc = PageAllocator(SLOTS, PAGE)
    first = model.generate(pool, alloc, prompt, np.int64(3), stop_token_id=np.int64(-1))
    assert len(first.generated) == 3


@pytest.mark.gpu
def test_on_cuda_matches_the_cpu_reference() -> None:
    cfg = TinyConfig()
    model = TinyCausalLM(cfg, "cuda")
    pool = DeviceKVPool(cfg.kv_layout(PAGE), SLOTS, device="cuda")
    toks = tokens(30, seed=21)
    # CPU slot tensors are accepted and moved; so are CUDA ones.
    full = model.prefill(pool, toks, slots(0, 30))
    tail = model.prefill(pool, toks[20:], slots(64, 10).cuda(), prefix_slots=slots(0, 20).cuda())
    assert full.device.type == "cuda"
    ref = TinyCausalLM(cfg).reference_forward(toks)
    torch.testing.assert_close(full.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tail, full[20:], atol=1e-4, rtol=1e-4)
    res = model.generate(pool, PageAllocator(SLOTS, PAGE), toks.tolist(), 5)
    cpu_model, cpu_pool = make()
    assert (
        res.generated
        == cpu_model.generate(cpu_pool, PageAllocator(SLOTS, PAGE), toks.tolist(), 5).generated
    )
