"""The ``serve`` coroutine of the README and of the asyncio server guide, as written, serves every prompt.

The ``serve`` coroutine is taken verbatim from each page and run against a
small cache and `TinyCausalLM` (the snippet's ``model``), for prompts of every
length around the page size and for exact repeats of them, concurrently. Its
cached KV must give the same logits as a computation from scratch. (Each
snippet also runs whole as a script: `tests/test_docs_snippets.py`.)
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.memory.pools import DeviceKVPool
from tiercache.models import TinyCausalLM, TinyConfig

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    ROOT / "docs" / "guides" / "asyncio-server.md",
]
PS = 16


def page_serve(page: Path) -> str:
    """The source of ``serve`` in the first python block of ``page`` that defines it."""
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        m = re.search(r"^async def serve\(.*?(?=^\S)", block, re.S | re.M)
        if m is not None:
            return m.group(0)
    raise AssertionError(f"{page} has no python block that defines serve()")


class RecordingModel:
    """The snippet's ``model``: a TinyCausalLM whose prefill logits are kept."""

    def __init__(self, model: TinyCausalLM) -> None:
        self.model = model
        self.logits: list[torch.Tensor] = []

    def prefill(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model.prefill(*args, **kwargs)
        self.logits.append(out[-1])
        return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("length", [1, PS - 1, PS, PS + 1, 2 * PS, 3 * PS + 5])
async def test_the_serve_snippet_serves_every_prompt_and_its_repeat(
    length: int, page: Path
) -> None:
    tiny = TinyCausalLM(TinyConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1))
    model = RecordingModel(tiny)
    lay = tiny.kv_layout(PS)
    namespace: dict[str, Any] = {"asyncio": asyncio, "torch": torch, "model": model}
    exec(compile(page_serve(page), str(page), "exec"), namespace)
    serve = namespace["serve"]
    config = TierCacheConfig(
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        dtype=lay.dtype,
        page_size=PS,
        device_tokens=256,
        model="readme",
    )
    prompt = [(7 * i + 3) % 200 for i in range(length)]
    scratch = DeviceKVPool(lay, 64)
    expect = tiny.prefill(scratch, prompt, torch.arange(length))[-1]
    async with TierCache(config) as cache:
        await serve(cache, prompt)  # computed from scratch
        await serve(cache, prompt)  # an exact repeat: served from the cache
        await asyncio.gather(serve(cache, prompt), serve(cache, prompt))
        await cache.wait_idle()
        assert cache.stats().tokens_device_hit >= (length - 1) // PS * PS * 3
    assert len(model.logits) == 4
    for got in model.logits:
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
