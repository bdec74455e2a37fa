"""A small decoder-only transformer whose attention reads its KV from a `DeviceKVPool`.

The model exists to drive tiercache end to end with real attention: the
examples, the demo and the end-to-end tests compute a prompt's KV into the
device pool, cache it, load it back and check that the next forward pass gives
the same logits as recomputing. It is plain torch (no custom kernels), has
deterministic random weights drawn from a seed, and is quick on a CPU.

**Paged attention.** Every layer writes the K/V of the tokens it computes into
``pool.k_buffer[l]`` / ``pool.v_buffer[l]`` at the slots the caller gives
(``index_copy_``), then gathers the K/V of the prefix slots followed by the new
slots (``index_select``) and lets each new token attend to the whole prefix and
to the new tokens up to itself. The prefix may have been computed by an earlier
call, loaded from the host pool or from storage: the model cannot tell, which is
exactly the property a KV cache relies on.

**Layer waits.** A forward pass takes ``layer_ready``, a callable invoked with
the layer index just before that layer first touches the pool (after its
q/k/v projections). A controller passes its load handle's ``wait_layer`` so
that layer ``i`` computes while layers ``> i`` are still being copied in.

Everything here is synchronous, holds no mutable state besides the pool the
caller passes, and runs under `torch.inference_mode`: any thread may call it,
and several threads may call it at once on disjoint slots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tiercache._checks import check_bool, check_count, check_int, is_int
from tiercache.errors import CapacityError, ConfigError, InvalidInputError
from tiercache.memory import DeviceKVPool, KVLayout, PageAllocator, check_slot_indices
from tiercache.memory.layout import dtype_name

__all__ = [
    "MODEL_DTYPES",
    "GenerateResult",
    "LayerReady",
    "SequenceInput",
    "TinyCausalLM",
    "TinyConfig",
]

logger = logging.getLogger(__name__)

#: dtypes the model computes in (its weights and its KV cache).
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

#: ``layer_ready(i)`` blocks until layer ``i`` of the prefix KV is in the pool.
LayerReady = Callable[[int], None]

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Shape and numerics of a `TinyCausalLM`.

    The defaults give a ~0.7M-parameter model (4 layers, hidden size 128) that
    runs a 256-token prefill in milliseconds on a CPU.

    Args:
        vocab_size: token ids are ``0 <= t < vocab_size``.
        hidden_size: width of the residual stream.
        num_layers: transformer blocks (= KV layers).
        num_heads: query heads.
        num_kv_heads: K/V heads; divides ``num_heads`` (grouped-query attention
            when smaller).
        head_dim: size of one head; even (RoPE rotates pairs).
        intermediate_size: SwiGLU MLP width.
        rope_base: RoPE frequency base.
        rms_eps: RMSNorm epsilon.
        tie_embeddings: the LM head reuses the token embedding matrix.
        dtype: weights, activations and KV cache dtype (attention scores and
            softmax are computed in float32 whatever this is).
        seed: weights are drawn from ``torch.Generator().manual_seed(seed)``;
            the same config gives bit-identical weights on every machine.

    Raises:
        ConfigError: a field is out of range or the dtype is not supported.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            value = check_int(getattr(self, name), name, minimum=1, error=ConfigError)
            object.__setattr__(self, name, value)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary positions, got {self.head_dim}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in MODEL_DTYPES:
            raise ConfigError(
                f"dtype must be one of {[dtype_name(d) for d in MODEL_DTYPES]}, got {self.dtype!r}"
            )
        for name in ("rope_base", "rms_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        object.__setattr__(self, "seed", check_int(self.seed, "seed", error=ConfigError))
        tie = check_bool(self.tie_embeddings, "tie_embeddings", error=ConfigError)
        object.__setattr__(self, "tie_embeddings", tie)

    def kv_layout(self, page_size: int) -> KVLayout:
        """The `KVLayout` (MHA) of this model's KV cache with pages of ``page_size`` tokens.

        Raises:
            InvalidInputError: ``page_size`` is not a positive int.
        """
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
        )


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """One sequence of a batched `TinyCausalLM.forward` call.

    Args:
        token_ids: the tokens to compute (not the cached prefix), at least one.
        new_slots: ``int64`` pool slots where their K/V is written, one per token.
        prefix_slots: ``int64`` pool slots holding the K/V of the tokens before
            them, in order; ``None`` or empty for none.
        positions: ``int64`` rotary positions of ``token_ids``; default
            ``len(prefix_slots) + arange(len(token_ids))``.
    """

    token_ids: TokenIds
    new_slots: torch.Tensor
    prefix_slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What `TinyCausalLM.generate` produced, and where its KV lives.

    Slot bookkeeping: the pool holds the K/V of ``kv_token_ids`` =
    ``prompt_ids + generated[:-1]`` (the last generated token was never fed
    back) at ``slots``, in order. ``slots`` is the caller's ``prefix_slots``
    followed by the first ``len(kv_token_ids) - num_prefix`` slots of
    ``allocated``. Because the prefix is whole pages and ``allocated`` is whole
    pages taken in order, page ``k`` of ``kv_token_ids`` is exactly
    ``slots[k * page_size : (k + 1) * page_size]``, an aligned page of the pool;
    only the last page may be partly used.

    The caller owns ``allocated`` (it came from the allocator passed in): it
    either frees it, or hands the first `num_full_page_tokens` tokens' pages to
    a cache and frees `partial_page_slots`.

    Attributes:
        generated: the new token ids, greedy, in order.
        kv_token_ids: the tokens whose K/V is in the pool.
        slots: ``int64`` slots of ``kv_token_ids``, one per token.
        allocated: ``int64`` page-aligned slots this call took from the
            allocator (whole pages; the tail of the last may be unused).
        num_prefix: tokens whose K/V was given in ``prefix_slots``.
        page_size: the allocator's page size.
    """

    generated: list[int]
    kv_token_ids: list[int]
    slots: torch.Tensor
    allocated: torch.Tensor
    num_prefix: int
    page_size: int

    @property
    def num_full_page_tokens(self) -> int:
        """Leading tokens of ``kv_token_ids`` that fill whole pages (cacheable as pages)."""
        return len(self.kv_token_ids) // self.page_size * self.page_size

    @property
    def partial_page_slots(self) -> torch.Tensor:
        """The allocated page holding the trailing partial page (empty if none); page-aligned."""
        return self.allocated[self.num_full_page_tokens - self.num_prefix :]


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Checked:
    token_ids: torch.Tensor
    new_slots: torch.Tensor
    prefix_slots: torch.Tensor
    positions: torch.Tensor


class _GrowingAllocation:
    """The slots one `TinyCausalLM.generate` call takes, grown a whole page at a time.

    Used from the calling thread only. ``slots(used, more)`` returns slots
    ``[used, used + more)`` of the allocation, taking just enough whole pages
    first, so at most one page is ever partly used.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.pages: list[torch.Tensor] = []
        self.num_slots = 0

    def slots(self, used: int, more: int) -> torch.Tensor:
        """Slots ``[used, used + more)``, allocating whole pages if the allocation is short.

        Raises:
            CapacityError: the allocator has too few free pages.
        """
        short = used + more - self.num_slots
        if short > 0:
            ps = self.allocator.page_size
            want = -(-short // ps) * ps
            got = self.allocator.alloc(want)
            if got is None:
                raise CapacityError(
                    f"the device pool has {self.allocator.available} free slots, "
                    f"generation needs {want} more"
                )
            self.pages.append(got)
            self.num_slots += want
        return torch.cat(self.pages)[used : used + more]

    def slots_taken(self) -> torch.Tensor:
        """Every slot allocated so far, in order (page-aligned)."""
        return torch.cat(self.pages) if self.pages else torch.empty(0, dtype=torch.int64)

    def free(self) -> None:
        """Give every page back to the allocator."""
        for p in self.pages:
            self.allocator.free(p)
        self.pages.clear()
        self.num_slots = 0


class TinyCausalLM:
    """A small causal transformer (RMSNorm, GQA attention with RoPE, SwiGLU MLP).

    Weights are random but deterministic (from ``config.seed``) and never
    change. Any thread may call any method; calls on disjoint slots may run
    concurrently. Nothing here touches an event loop: run it in an executor
    from async code.

    Args:
        config: the model's shape and dtype.
        device: where weights live; the pools passed later must be on it.

    Raises:
        InvalidInputError: ``config`` is not a `TinyConfig` or ``device`` is
            not usable.
    """

    def __init__(self, config: TinyConfig, device: str | torch.device = "cpu") -> None:
        if not isinstance(config, TinyConfig):
            raise InvalidInputError(f"config must be a TinyConfig, got {type(config).__name__}")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidInputError(f"not a torch device: {device!r}") from e
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidInputError("device is cuda but CUDA is not available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = dev
        c = config
        gen = torch.Generator().manual_seed(c.seed)

        def weight(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=dev, dtype=c.dtype)

        def norm() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(c.hidden_size, generator=gen, dtype=torch.float32)
            return w.to(device=dev, dtype=c.dtype)

        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        hid, inter = c.hidden_size, c.intermediate_size
        # A tied head reads logits off the embedding: scale it so they stay of unit spread.
        self.embed = weight(c.vocab_size, hid, std=hid**-0.5 if c.tie_embeddings else 1.0)
        layers = []
        for _ in range(c.num_layers):
            layers.append(
                _Layer(
                    attn_norm=norm(),
                    wq=weight(q_out, hid, std=hid**-0.5),
                    wk=weight(kv_out, hid, std=hid**-0.5),
                    wv=weight(kv_out, hid, std=hid**-0.5),
                    wo=weight(hid, q_out, std=q_out**-0.5),
                    mlp_norm=norm(),
                    w_gate=weight(inter, hid, std=hid**-0.5),
                    w_up=weight(inter, hid, std=hid**-0.5),
                    w_down=weight(hid, inter, std=inter**-0.5),
                )
            )
        self.layers: tuple[_Layer, ...] = tuple(layers)
        self.final_norm = norm()
        self.lm_head = self.embed if c.tie_embeddings else weight(c.vocab_size, hid, std=hid**-0.5)
        self._inv_freq = (
            1.0 / c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        ).to(device=dev, dtype=torch.float32)
        self._scale = 1.0 / math.sqrt(c.head_dim)
        logger.debug("tiny model %s on %s: %d parameters", c, dev, self.num_parameters)

    @property
    def num_parameters(self) -> int:
        """Distinct weight elements."""
        tensors = [self.embed, self.final_norm]
        if not self.config.tie_embeddings:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors.extend(getattr(layer, f) for f in _Layer.__slots__)
        return sum(t.numel() for t in tensors)

    def kv_layout(self, page_size: int) -> KVLayout:
        """Shortcut for ``self.config.kv_layout(page_size)``."""
        return self.config.kv_layout(page_size)

    # ------------------------------------------------------------------ public

    def prefill(
        self,
        pool: DeviceKVPool,
        token_ids: TokenIds,
        new_slots: torch.Tensor,
        prefix_slots: torch.Tensor | None = None,
        layer_ready: LayerReady | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute ``token_ids`` after a cached prefix; write their K/V into ``pool``.

        Args:
            pool: the device pool holding the KV cache (layout `kv_layout`).
            token_ids: the tokens to compute (1-D, at least one).
            new_slots: 1-D ``int64`` slots for their K/V, one per token; they
                are overwritten.
            prefix_slots: 1-D ``int64`` slots holding the K/V of the preceding
                tokens, in order (read only); ``None`` for none.
            layer_ready: called as ``layer_ready(i)`` once per layer, in order,
                before layer ``i`` reads or writes the pool; it blocks until the
                prefix K/V of layer ``i`` is in place.
            positions: rotary positions; default ``len(prefix_slots) + arange(n)``.

        Returns:
            ``float32`` logits of the new tokens, shape ``(len(token_ids), vocab_size)``.

        Raises:
            InvalidInputError: the pool does not match the model; token ids out
                of the vocabulary; slots not 1-D ``int64``, out of range,
                repeated, or a count different from the tokens'. Raised before
                the pool is touched.
        """
        seq = SequenceInput(token_ids, new_slots, prefix_slots, positions)
        return self.forward(pool, [seq], layer_ready=layer_ready)[0]

    def decode_step(
        self,
        pool: DeviceKVPool,
        token_id: int,
        new_slot: int,
        prefix_slots: torch.Tensor | None,
        layer_ready: LayerReady | None = None,
    ) -> torch.Tensor:
        """Compute one token at position ``len(prefix_slots)``; write its K/V at ``new_slot``.

        Returns:
            ``float32`` logits of the next token, shape ``(vocab_size,)``.

        Raises:
            InvalidInputError: as `prefill`.
        """
        slots = torch.tensor([check_int(new_slot, "new_slot")], dtype=torch.int64)
        return self.prefill(pool, [token_id], slots, prefix_slots, layer_ready)[0]

    def forward(
        self,
        pool: DeviceKVPool,
        batch: Sequence[SequenceInput],
        *,
        layer_ready: LayerReady | None = None,
    ) -> list[torch.Tensor]:
        """Compute a batch of sequences, each after its own cached prefix.

        Projections and MLPs run once over all new tokens; attention runs per
        sequence over that sequence's prefix and new slots. ``layer_ready(i)``
        is called once per layer for the whole batch. Sequences may share
        prefix slots; no slot may be written twice or be both written and read.

        Returns:
            One ``float32`` ``(n_new, vocab_size)`` logits tensor per sequence.

        Raises:
            InvalidInputError: as `prefill`, for any sequence, before anything
                is written.
        """
        self._check_pool(pool)
        if isinstance(batch, SequenceInput) or not isinstance(batch, Sequence) or not batch:
            raise InvalidInputError("batch must be a non-empty sequence of SequenceInput")
        checked = [self._check_sequence(pool, s, i) for i, s in enumerate(batch)]
        all_new = torch.cat([c.new_slots for c in checked])
        if len(checked) > 1:
            if torch.unique(all_new).numel() != all_new.numel():
                raise InvalidInputError("two sequences of the batch write the same slot")
            all_prefix = torch.cat([c.prefix_slots for c in checked])
            if all_prefix.numel() and bool(torch.isin(all_prefix, all_new).any()):
                raise InvalidInputError("a slot is written by one sequence and read by another")
        with torch.inference_mode():
            return self._forward(pool, checked, all_new, layer_ready)

    def reference_forward(self, token_ids: TokenIds) -> torch.Tensor:
        """Full-sequence logits with plain causal attention and no KV cache.

        The yardstick for the paged path: same weights, K/V never leave the
        layer, attention by `torch.nn.functional.scaled_dot_product_attention`.

        Returns:
            ``float32`` logits, shape ``(len(token_ids), vocab_size)``.

        Raises:
            InvalidInputError: token ids not 1-D, empty or out of the vocabulary.
        """
        tokens = self._check_tokens(token_ids, "token_ids")
        c = self.config
        group = c.num_heads // c.num_kv_heads
        with torch.inference_mode():
            positions = torch.arange(tokens.numel(), device=self.device)
            x = self.embed[tokens]
            for layer in self.layers:
                q, k, v = self._qkv(layer, x, positions)
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
                out = F.scaled_dot_product_attention(
                    q.float().transpose(0, 1),
                    k.float().transpose(0, 1),
                    v.float().transpose(0, 1),
                    is_causal=True,
                    scale=self._scale,
                )
                attn = out.transpose(0, 1).reshape(tokens.numel(), -1).to(c.dtype)
                x = self._finish_layer(layer, x, attn)
            return self._logits(x)

    def generate(
        self,
        pool: DeviceKVPool,
        allocator: PageAllocator,
        prompt_ids: TokenIds,
        max_new_tokens: int,
        prefix_slots: torch.Tensor | None = None,
        layer_ready: LayerReady | None = None,
        *,
        stop_token_id: int | None = None,
    ) -> GenerateResult:
        """Greedy generation, taking pages from ``allocator`` as the sequence grows.

        The first ``len(prefix_slots)`` prompt tokens are taken as cached (their
        K/V is read from ``prefix_slots``); the rest of the prompt is computed
        in one prefill, then one token per decode step. Pages are allocated
        lazily: whole pages for the computed prompt tokens, then one more page
        each time the last one fills, so at most one page is partly used. See
        `GenerateResult` for where the KV ends up. ``max_new_tokens=0``
        computes the prompt's KV only.

        ``layer_ready`` applies to the prefill only (the prefix is in place
        afterwards).

        The allocator is used from the calling thread: nothing else may use it
        during the call. On any error, every page this call took is freed
        before the error propagates; ``prefix_slots`` are never freed.

        Args:
            pool: the device pool.
            allocator: hands out slots of ``pool`` (same page size).
            prompt_ids: the prompt, including the cached prefix.
            max_new_tokens: tokens to generate, ``>= 0``.
            prefix_slots: page-aligned ``int64`` slots (whole pages) holding
                the K/V of ``prompt_ids[:len(prefix_slots)]``; fewer tokens than
                the prompt, so that at least one is computed.
            layer_ready: as in `prefill`.
            stop_token_id: stop after generating this token.

        Returns:
            The `GenerateResult`.

        Raises:
            InvalidInputError: bad arguments, a prefix that is not whole pages
                or covers the whole prompt, an allocator whose page size or
                size does not match the pool.
            CapacityError: the allocator ran out of pages.
        """
        ps = self._check_allocator(pool, allocator)
        max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
        if stop_token_id is not None:
            stop_token_id = check_int(stop_token_id, "stop_token_id")
        prompt = self._check_tokens(prompt_ids, "prompt_ids")
        prefix = self._check_prefix(pool, prefix_slots, prompt.numel(), ps)
        pages = _GrowingAllocation(allocator)
        try:
            generated, slots = self._generate(
                pool, pages, prompt, prefix, max_new_tokens, layer_ready, stop_token_id
            )
        except BaseException:
            pages.free()
            raise
        # The last generated token is never fed back, so its K/V was never computed.
        kv_tokens = [int(t) for t in prompt.tolist()] + generated[:-1]
        assert slots.numel() == len(kv_tokens)
        return GenerateResult(
            generated=generated,
            kv_token_ids=kv_tokens,
            slots=slots,
            allocated=pages.slots_taken(),
            num_prefix=prefix.numel(),
            page_size=ps,
        )

    def _generate(
        self,
        pool: DeviceKVPool,
        pages: _GrowingAllocation,
        prompt: torch.Tensor,
        prefix: torch.Tensor,
        max_new_tokens: int,
        layer_ready: LayerReady | None,
        stop_token_id: int | None,
    ) -> tuple[list[int], torch.Tensor]:
        """Prefill the uncached part of ``prompt``, then decode greedily one token a step.

        Returns:
            The generated tokens and the slots holding the K/V of every token
            fed to the model (``prefix`` first), in order.
        """
        num_prefix = prefix.numel()
        new = pages.slots(0, prompt.numel() - num_prefix)
        logits = self.prefill(pool, prompt[num_prefix:], new, prefix, layer_ready)
        context = torch.cat([prefix, new])
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            token = int(logits[-1].argmax())
            generated.append(token)
            if len(generated) == max_new_tokens or token == stop_token_id:
                break
            slot = pages.slots(context.numel() - num_prefix, 1)
            logits = self.prefill(pool, [token], slot, context)
            context = torch.cat([context, slot])
        return generated, context

    # ---------------------------------------------------------------- checks

    def _check_pool(self, pool: DeviceKVPool) -> None:
        if not isinstance(pool, DeviceKVPool):
            raise InvalidInputError(f"pool must be a DeviceKVPool, got {type(pool).__name__}")
        lay, c = pool.layout, self.config
        if (
            lay.mla
            or lay.num_layers != c.num_layers
            or lay.num_kv_heads != c.num_kv_heads
            or lay.head_dim != c.head_dim
            or lay.dtype != c.dtype
        ):
            raise InvalidInputError(
                f"pool layout {lay.describe()} does not match the model "
                f"({c.kv_layout(lay.page_size).describe()})"
            )
        if pool.device != self.device:
            raise InvalidInputError(f"pool is on {pool.device}, the model on {self.device}")

    def _check_allocator(self, pool: DeviceKVPool, allocator: object) -> int:
        """Check that ``allocator`` hands out slots of ``pool``; return its page size."""
        self._check_pool(pool)
        if not isinstance(allocator, PageAllocator):
            raise InvalidInputError(
                f"allocator must be a PageAllocator, got {type(allocator).__name__}"
            )
        if allocator.page_size != pool.layout.page_size or allocator.num_slots > pool.num_slots:
            raise InvalidInputError(
                f"{allocator!r} does not hand out slots of {pool!r} (page size or size differs)"
            )
        return allocator.page_size

    def _check_prefix(
        self, pool: DeviceKVPool, prefix_slots: object, num_prompt: int, page_size: int
    ) -> torch.Tensor:
        """Whole-page prefix slots (empty for ``None``) that leave a prompt token to compute."""
        if prefix_slots is None:
            return torch.empty(0, dtype=torch.int64)
        prefix = check_slot_indices(prefix_slots, page_size, pool.num_slots, "prefix_slots")
        if prefix.numel() >= num_prompt:
            raise InvalidInputError(
                f"prefix_slots cover {prefix.numel()} tokens of a {num_prompt}-token prompt: "
                "leave at least one prompt token to compute"
            )
        return prefix

    def _check_tokens(self, token_ids: object, what: str) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            if (
                token_ids.dtype.is_floating_point
                or token_ids.dtype.is_complex
                or token_ids.dtype == torch.bool
            ):
                raise InvalidInputError(f"{what} must be an integer tensor, got {token_ids.dtype}")
            tokens = token_ids.to(device=self.device, dtype=torch.int64)
        elif isinstance(token_ids, Sequence) and not isinstance(token_ids, str | bytes):
            if not all(is_int(t) for t in token_ids):
                raise InvalidInputError(f"{what} must be ints")
            tokens = torch.tensor(
                [int(t) for t in token_ids], dtype=torch.int64, device=self.device
            )
        else:
            raise InvalidInputError(
                f"{what} must be a sequence of ints or a tensor, got {type(token_ids).__name__}"
            )
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise InvalidInputError(
                f"{what} must be 1-D and non-empty, got shape {tuple(tokens.shape)}"
            )
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise InvalidInputError(
                f"{what} out of the vocabulary [0, {self.config.vocab_size}): min {lo}, max {hi}"
            )
        return tokens

    def _check_slots(self, pool: DeviceKVPool, slots: object, what: str) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor):
            raise InvalidInputError(f"{what} must be an int64 tensor, got {type(slots).__name__}")
        if slots.dtype != torch.int64:
            raise InvalidInputError(f"{what} must have dtype int64, got {slots.dtype}")
        if slots.dim() != 1:
            raise InvalidInputError(f"{what} must be 1-D, got shape {tuple(slots.shape)}")
        slots = slots.to(self.device)
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= pool.num_slots:
                raise InvalidInputError(
                    f"{what} out of range [0, {pool.num_slots}): min {lo}, max {hi}"
                )
        return slots

    def _check_sequence(self, pool: DeviceKVPool, seq: object, index: int) -> _Checked:
        if not isinstance(seq, SequenceInput):
            raise InvalidInputError(
                f"batch[{index}] must be a SequenceInput, got {type(seq).__name__}"
            )
        tokens = self._check_tokens(seq.token_ids, "token_ids")
        new = self._check_slots(pool, seq.new_slots, "new_slots")
        if new.numel() != tokens.numel():
            raise InvalidInputError(f"{tokens.numel()} tokens but {new.numel()} new_slots")
        if seq.prefix_slots is None:
            prefix = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            prefix = self._check_slots(pool, seq.prefix_slots, "prefix_slots")
        both = torch.cat([prefix, new])
        if torch.unique(both).numel() != both.numel():
            raise InvalidInputError("new_slots and prefix_slots must all be distinct slots")
        if seq.positions is None:
            positions = torch.arange(
                prefix.numel(), prefix.numel() + tokens.numel(), device=self.device
            )
        else:
            if not isinstance(seq.positions, torch.Tensor) or seq.positions.dtype != torch.int64:
                raise InvalidInputError("positions must be an int64 tensor")
            positions = seq.positions.to(self.device)
            if positions.shape != tokens.shape:
                raise InvalidInputError(
                    f"positions has shape {tuple(positions.shape)}, the tokens {tuple(tokens.shape)}"
                )
            if int(positions.min()) < 0:
                raise InvalidInputError("positions must be non-negative")
        return _Checked(tokens, new, prefix, positions)

    # ----------------------------------------------------------------- maths

    def _forward(
        self,
        pool: DeviceKVPool,
        batch: list[_Checked],
        all_new: torch.Tensor,
        layer_ready: LayerReady | None,
    ) -> list[torch.Tensor]:
        tokens = torch.cat([s.token_ids for s in batch])
        positions = torch.cat([s.positions for s in batch])
        # Per sequence: where its rows start among the new tokens, and the
        # slots its queries attend to (prefix, then its own new tokens).
        offsets = [0]
        for s in batch:
            offsets.append(offsets[-1] + s.token_ids.numel())
        contexts = [torch.cat([s.prefix_slots, s.new_slots]) for s in batch]
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            if layer_ready is not None:
                layer_ready(i)
            k_pool, v_pool = pool.k_buffer[i], pool.v_buffer[i]
            k_pool.index_copy_(0, all_new, k)
            v_pool.index_copy_(0, all_new, v)
            parts = []
            for s, start, stop, ctx in zip(batch, offsets, offsets[1:], contexts, strict=False):
                k_ctx = k_pool.index_select(0, ctx)
                v_ctx = v_pool.index_select(0, ctx)
                parts.append(self._attend(q[start:stop], k_ctx, v_ctx, s.prefix_slots.numel()))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = self._finish_layer(layer, x, attn)
        logits = self._logits(x)
        return [logits[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return xf.to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (n, heads, D); rotate-half convention (as Llama), computed in float32.
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        n = x.shape[0]
        h = self._rms_norm(x, layer.attn_norm)
        q = F.linear(h, layer.wq).view(n, c.num_heads, c.head_dim)
        k = F.linear(h, layer.wk).view(n, c.num_kv_heads, c.head_dim)
        v = F.linear(h, layer.wv).view(n, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_prefix: int
    ) -> torch.Tensor:
        """Queries ``(n, H, D)`` over keys/values ``(num_prefix + n, Hkv, D)``.

        New token ``j`` sees every prefix key and the new keys ``0..j``.
        Returns ``(n, H * D)`` in the model dtype.
        """
        c = self.config
        n, m = q.shape[0], k.shape[0]
        group = c.num_heads // c.num_kv_heads
        qf = q.float().transpose(0, 1)  # (H, n, D)
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, m, D)
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qf, kf.transpose(1, 2)) * self._scale  # (H, n, m)
        visible = (
            torch.arange(m, device=q.device)[None, :]
            <= (num_prefix + torch.arange(n, device=q.device))[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # (H, n, D)
        return out.transpose(0, 1).reshape(n, c.num_heads * c.head_dim).to(c.dtype)

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(attn, layer.wo)
        h = self._rms_norm(x, layer.mlp_norm)
        return x + F.linear(
            F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up), layer.w_down
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()

    def __repr__(self) -> str:
        return f"TinyCausalLM({self.config}, device={self.device})"
