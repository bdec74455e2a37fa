"""Each example runs as a script, exits 0 and prints the line that shows its point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CASES = {
    "quickstart.py": "after flush: 64 tokens cached (from storage)",
    "layerwise_overlap.py": "logits match a full recompute: True",
    "shared_storage.py": (
        "process B loaded 512 tokens from storage; logits match a full recompute: True"
    ),
    "runtime_attach.py": "requests across attach/detach; no errors",
    "redis_two_instances.py": "instance B loaded 512 tokens from Redis; KV bit-identical: True",
    "prometheus_metrics.py": "tiercache_hit_tokens_total{instance=demo,tier=storage} 64.0",
}

#: Examples that need a binary on the PATH to run at all.
NEEDS = {"redis_two_instances.py": "redis-server"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name: str) -> None:
    binary = NEEDS.get(name)
    if binary is not None and shutil.which(binary) is None:
        pytest.skip(f"{name} needs {binary}, which is not installed")
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=90
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert CASES[name] in r.stdout


#: Examples that need an engine; their own suites run them (make test-sglang, make test-vllm).
ENGINE_EXAMPLES = {
    "sglang_backend.py": "tests/integrations/sglang/test_example.py",
    "vllm_tier.py": "tests/integrations/vllm/test_tier.py",
}


def test_every_example_is_run_here_or_by_its_engine_suite() -> None:
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert names == set(CASES) | set(ENGINE_EXAMPLES)
    root = EXAMPLES.parent
    for name, suite in ENGINE_EXAMPLES.items():
        assert name in (root / suite).read_text(), f"{suite} does not run {name}"


def test_every_example_compiles_and_type_checks() -> None:
    """mypy over all examples, the engine ones included (an engine's modules are Any here)."""
    files = sorted(str(p) for p in EXAMPLES.glob("*.py"))
    for f in files:
        compile(Path(f).read_text(), f, "exec")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--check-untyped-defs",
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--python-version=3.11",
            "--config-file=",
            "--cache-dir",
            str(EXAMPLES.parent / ".mypy_cache" / "examples"),
            *files,
        ],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
