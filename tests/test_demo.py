"""The demo's claims, checked on tokens (never on time), and the logits of a
prompt whose prefix KV came back from host or storage against a recompute."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.demo import CONFIG_NAMES, build_workload, model_config, settings_for
from tiercache.models.tiny import TinyCausalLM


def test_quick_demo_tokens_and_prefill_reduction(tmp_path: Path) -> None:
    # A relative --dir, run from another folder: what `make run` does.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercache",
            "demo",
            "--quick",
            "--no-progress",
            "--dir",
            "demo-out",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = tmp_path / "demo-out"
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical in every configuration" in r.stdout
    report = json.loads((out / "demo.json").read_text())
    assert report["tokens_identical"] is True
    assert list(report["configs"]) == list(CONFIG_NAMES)
    wl = build_workload(settings_for(quick=True), model_config().vocab_size)
    assert report["requests"] == wl.num_requests
    assert len(report["answers"]) == wl.num_requests
    none = report["configs"]["no_cache"]
    full = report["configs"]["all_tiers"]
    # Without a cache every prompt token is computed.
    assert none["prefill_tokens"] == none["prompt_tokens"]
    shared = wl.shared_prefix_tokens() / none["prompt_tokens"]
    assert shared > 0.5
    assert 1 - full["prefill_tokens"] / none["prefill_tokens"] >= shared
    assert full["hit_rates"]["storage"] > 0


async def _logits_after_reload(
    tmp_path: Path, via: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, int]:
    model = await asyncio.to_thread(TinyCausalLM, dataclasses.replace(model_config(), dtype=dtype))
    mc = model.config
    cfg = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=1024,
        storage_url=f"file://{tmp_path}" if via == "storage" else None,
        prefetch_threshold=16,
        prefetch_policy="wait_complete",
        model="test-demo",
    )
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, mc.vocab_size, (96,), generator=g).tolist()
    prompt = prefix + torch.randint(0, mc.vocab_size, (21,), generator=g).tolist()
    async with TierCache(cfg) as cache:
        pool = cache.device_pool
        async with cache.request(prefix) as req:
            slots = await req.alloc(len(prefix))
            await asyncio.to_thread(model.prefill, pool, prefix, slots)
            await req.commit(prefix, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()
        if via == "host":
            await cache.evict_device(1024)
            assert cache.match_prefix(prefix).host_tokens == len(prefix)
        else:
            await cache.flush()
        async with cache.request(prompt) as req:
            k = req.cached_tokens
            new = await req.alloc(len(prompt) - k)
            logits = await asyncio.to_thread(
                model.prefill, pool, prompt[k:], new, req.prefix_indices, req.layer_ready
            )
        s = cache.stats()
        assert (s.tokens_host_hit if via == "host" else s.tokens_storage_hit) == len(prefix)
    ref = await asyncio.to_thread(model.reference_forward, prompt)
    return logits, ref[k:], k


async def test_logits_after_host_load_match_recompute(tmp_path: Path) -> None:
    logits, ref, k = await _logits_after_reload(tmp_path, "host")
    assert k == 96
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


async def test_logits_after_storage_load_match_recompute(tmp_path: Path) -> None:
    logits, ref, k = await _logits_after_reload(tmp_path, "storage")
    assert k == 96
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("via", ["host", "storage"])
async def test_fp16_logits_after_reload_match_recompute_within_tolerance(
    tmp_path: Path, via: str
) -> None:
    # fp16 KV and activations: within 2e-2 of the model's own full recompute
    # (its reference attention is another kernel), and the same greedy tokens.
    logits, ref, k = await _logits_after_reload(tmp_path, via, torch.float16)
    assert k == 96
    torch.testing.assert_close(logits, ref, rtol=0, atol=2e-2)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("unrelated", ["notes.txt", "sub/data.db"])
def test_demo_does_not_empty_a_store_folder_it_did_not_fill(
    tmp_path: Path, unrelated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dir`` pointed at a folder whose ``store`` holds other files: exit 2, nothing deleted."""
    from tiercache.cli import main

    kept = tmp_path / "store" / unrelated
    kept.parent.mkdir(parents=True)
    kept.write_text("keep me")
    assert main(["demo", "--quick", "--no-progress", "--dir", str(tmp_path)]) == 2
    assert kept.read_text() == "keep me"
    assert unrelated in capsys.readouterr().err
    assert not (tmp_path / "demo.json").exists()


def test_demo_empties_a_store_of_pages_only(tmp_path: Path) -> None:
    """What a file store leaves (pages, pages being written, their folders) is the demo's to empty."""
    from tiercache.demo import _check_only_pages

    _check_only_pages(tmp_path / "store")  # absent
    (tmp_path / "store" / "ab").mkdir(parents=True)
    (tmp_path / "store" / "ab" / "ns-abcdef.page").write_bytes(b"x")
    (tmp_path / "store" / "ab" / ".ns-abcdef.page.1.tmp").write_bytes(b"x")
    _check_only_pages(tmp_path / "store")
