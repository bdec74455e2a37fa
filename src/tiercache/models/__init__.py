"""Models that run their attention on tiercache's device pool.

`TinyCausalLM` is a small, deterministic decoder-only transformer in plain
torch: it drives the examples, the demo and the end-to-end tests with real
paged attention, so that "load the cached KV" can be checked against
"recompute it" logit for logit.
"""

from tiercache.models.tiny import (
    MODEL_DTYPES,
    GenerateResult,
    LayerReady,
    SequenceInput,
    TinyCausalLM,
    TinyConfig,
)

__all__ = [
    "MODEL_DTYPES",
    "GenerateResult",
    "LayerReady",
    "SequenceInput",
    "TinyCausalLM",
    "TinyConfig",
]
